"""Packaging, checked offline (no Docker engine, no cluster here): the Kubernetes manifests against
the Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields fail), their wiring to
each other and to the config, and the Dockerfiles' instructions and the files they copy."""

from __future__ import annotations

import fnmatch
import json
import shlex
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from ipc.config import load_config
from tests.conftest import REPO_ROOT

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
DOCKERFILES = sorted((REPO_ROOT / "deploy" / "docker").glob("Dockerfile.*"))
KUBERNETES_VERSION = "1.30.0"  # the oldest release still in wide use that these must run on


def manifests() -> list[dict]:
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def one(kind: str) -> dict:
    (doc,) = [d for d in manifests() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, kubernetes_validate.latest_version()])
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    docs = manifests()
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_check_can_fail() -> None:
    bad = one("Deployment")
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def configmap_config(tmp_path: Path):
    """The ConfigMap's config.yaml, loaded as the supervisor loads it."""
    path = tmp_path / "config.yaml"
    path.write_text(one("ConfigMap")["data"]["config.yaml"])
    return load_config(path)


def test_configmap_holds_a_valid_config(tmp_path: Path) -> None:
    assert configmap_config(tmp_path).gateway.host == "0.0.0.0"


def test_deployment_probes_mounts_and_resources(tmp_path: Path) -> None:
    config = configmap_config(tmp_path)
    deployment = one("Deployment")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.gateway.port, "metrics": config.supervisor.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    # The config is the ConfigMap as a whole directory: a subPath mount would never be updated.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    config_mount = mounts["config"]
    assert "subPath" not in config_mount
    assert volumes["config"]["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    assert container["args"][:2] == ["serve", "--config"]
    assert Path(container["args"][2]).parent == Path(config_mount["mountPath"])
    assert Path(container["args"][2]).name in one("ConfigMap")["data"]
    assert mounts["shm"]["mountPath"] == "/dev/shm" and volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])


def test_service_routes_to_the_pods_ports() -> None:
    service, deployment = one("Service"), one("Deployment")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == names


def test_hpa_scales_the_deployment_on_a_metric_brigade_exports(tmp_path: Path) -> None:
    """The HPA's per-pod metric is a Brigade metric as the Prometheus Adapter rule in
    docs/operations.md names it, and it waits longer than the supervisor's own autoscaler."""
    hpa, deployment = one("HorizontalPodAutoscaler"), one("Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"], "Deployment", deployment["metadata"]["name"],
    )  # fmt: skip
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    exported = name.replace("brigade_", "brigade:", 1)
    assert f"`{exported}`" in (REPO_ROOT / "docs" / "metrics.md").read_text()
    operations = (REPO_ROOT / "docs" / "operations.md").read_text()
    assert f'seriesQuery: "{exported}' in operations and f'as: "{name}"' in operations
    autoscale = configmap_config(tmp_path).autoscale
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > autoscale.scale_down_window_s
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] > autoscale.scale_up_cooldown_s


def dockerignored(path: str) -> bool:
    patterns = [p.strip() for p in (REPO_ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    return any(fnmatch.fnmatch(path, p) or path.split("/")[0] == p for p in patterns)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile(dockerfile: Path) -> None:
    parser = DockerfileParser(fileobj=dockerfile.open("rb"))
    instructions = [i for i in parser.structure if i["instruction"] != "COMMENT"]
    assert instructions[0]["instruction"] == "FROM"
    known = {"FROM", "RUN", "ENV", "WORKDIR", "COPY", "USER", "EXPOSE", "ENTRYPOINT", "CMD"}
    assert {i["instruction"] for i in instructions} <= known
    for i in instructions:
        if i["instruction"] == "RUN":  # the shell form: must at least parse as shell
            check = subprocess.run(
                ["bash", "-n", "-c", i["value"]], capture_output=True, text=True, timeout=30
            )
            assert check.returncode == 0, f"{dockerfile.name}: RUN {i['value']!r}: {check.stderr}"
        if i["instruction"] == "COPY":
            *sources, _ = shlex.split(i["value"])
            for source in sources:
                assert (REPO_ROOT / source).exists(), (
                    f"{dockerfile.name} copies {source}, which is not in the repo"
                )
                assert not dockerignored(source), (
                    f"{dockerfile.name} copies {source}, which .dockerignore excludes"
                )
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entrypoint,) = json.loads(next(i["value"] for i in instructions if i["instruction"] == "ENTRYPOINT"))
    assert entrypoint in scripts
    command = json.loads(parser.cmd)
    assert command[:2] == ["serve", "--config"]
    overrides = [command[k + 1] for k, arg in enumerate(command) if arg == "--set"]
    config = load_config(REPO_ROOT / command[2], overrides)
    exposed = {int(p) for i in instructions if i["instruction"] == "EXPOSE" for p in i["value"].split()}
    assert {config.gateway.port, config.supervisor.metrics_port} <= exposed
    assert config.gateway.host == "0.0.0.0"  # reachable from outside the container
    assert ("cuda" in dockerfile.name) == (config.engine.device == "cuda")
