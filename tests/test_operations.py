"""Operations on a real run of the tiny model, started by the `brigade` console script installed
from a freshly built wheel: `brigade chat|generate|status`, every metric the Grafana dashboard
queries in the live /metrics, and the audit log of a stage restart and of config reloads seen
through a Kubernetes-style ConfigMap symlink swap."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import Client
from client.errors import PromptTooLong
from services.metrics import CUDA_ONLY
from tests.conftest import REPO_ROOT
from tests.harness import Run, assert_clean, brigade_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "brigade.json"
TINY = ("model.dtype=float32", "model.max_model_len=256", "engine.kv_cache_mib=16", "engine.threads=1",
        "engine.max_num_seqs=8", "supervisor.backoff_initial_s=0.1")  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ConfigMapDir:
    """The layout the kubelet gives a mounted ConfigMap: `config.yaml -> ..data/config.yaml`,
    `..data -> ..<timestamp>/`; an update writes a new timestamped dir and renames a new
    `..data` link over the old one."""

    def __init__(self, root: Path, text: str) -> None:
        self.root = root
        self.version = 0
        root.mkdir()
        self._write(text)
        (root / "config.yaml").symlink_to("..data/config.yaml")

    @property
    def path(self) -> Path:
        return self.root / "config.yaml"

    def _write(self, text: str) -> Path:
        self.version += 1
        data = self.root / f"..2026_12_01_{self.version:02d}"
        data.mkdir()
        (data / "config.yaml").write_text(text)
        link = self.root / "..data_tmp"
        link.symlink_to(data.name)
        link.rename(self.root / "..data")
        return data / "config.yaml"

    def update(self, text: str) -> None:
        old = os.stat(self.path)
        new = self._write(text)
        # The nasty case: the new file carries the old one's mtime, as a fast update within the
        # filesystem's timestamp granularity would. Only its inode tells it apart.
        os.utime(new, ns=(old.st_atime_ns, old.st_mtime_ns))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, installed) -> Run:
    script, env = installed
    root = tmp_path_factory.mktemp("ops")
    config = ConfigMapDir(root / "etc", "tokenizer:\n  replicas: 1\n")
    port = free_port()
    run_dir = root / "run"
    mlflow = []
    if importlib.util.find_spec("mlflow") is not None:
        from mlflow import MlflowClient

        uri = f"sqlite:///{root / 'mlflow.db'}"  # its tables made here, so the run's sink starts fast
        MlflowClient(tracking_uri=uri).create_experiment(
            "ops", artifact_location=(root / "artifacts").as_uri()
        )
        mlflow = [f"observability.mlflow.tracking_uri={uri}", "observability.mlflow.experiment=ops",
                  "observability.mlflow.interval_s=1", "observability.mlflow.sample_requests=2"]  # fmt: skip
    with brigade_run(
        run_dir,
        f"model.path={tiny_model_dir}",
        *TINY,
        *mlflow,
        f"supervisor.metrics_port={port}",
        config=str(config.path),
        command=[str(script), "serve"],
        env=env,
    ) as run:
        run.metrics_port = port
        run.configmap = config  # type: ignore[attr-defined]
        run.env = env  # type: ignore[attr-defined]
        run.script = script  # type: ignore[attr-defined]
        run.mlflow_uri = mlflow[0].split("=", 1)[1] if mlflow else None  # type: ignore[attr-defined]
        yield run
    assert_clean(run_dir)


def brigade(run: Run, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(run.script), *args],  # type: ignore[attr-defined]
        env={**os.environ, **run.env},  # type: ignore[attr-defined]
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_brigade_chat_and_generate(live: Run) -> None:
    done = brigade(live, "chat", "--run", str(live.run_dir), "Hello there", "--max-tokens", "8",
                   "--temperature", "0", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    with Client(live.run_dir) as client:
        want = client.chat(
            [{"role": "user", "content": "Hello there"}], max_tokens=8, temperature=0, timeout=120
        )
        want_generate = client.generate("Once upon a time", max_tokens=5, temperature=0, timeout=120)
    assert reply["token_ids"] == want.token_ids and reply["text"] == want.text
    done = brigade(live, "generate", "Once upon a time", "--max-tokens", "5", "--temperature", "0", "--json",
                   "--run", str(live.run_dir))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == want_generate.token_ids


def test_brigade_status(live: Run) -> None:
    done = brigade(live, "status", "--run", str(live.run_dir), "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {r["kind"] for r in rows} == {"tokenizer", "scheduler", "gpu_worker", "detokenizer", "gateway"}
    table = brigade(live, "status", "--run", str(live.run_dir), "--once", timeout=30)
    assert table.returncode == 0 and "scheduler-0" in table.stdout
    missing = brigade(live, "status", "--run", str(live.run_dir / "nope"), timeout=30)
    assert missing.returncode == 1 and "no live Brigade run" in missing.stderr
    unknown = brigade(live, "bogus", timeout=30)
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr


# Prometheus 2's default scrape header: the page must keep its `brigade:` names for it too.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def scrape(run: Run) -> dict[str, list]:
    """The run's metrics port, scraped as Prometheus scrapes it."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{run.metrics_port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}
    )
    text = urllib.request.urlopen(request, timeout=30).read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def test_the_metrics_port_filters_by_name_and_gzips(live: Run) -> None:
    """As prometheus_client's own server did: `name[]` picks samples by name, gzip when accepted."""
    wanted = ["brigade:http_e2e_request_latency_seconds_count", "brigade:num_requests_running"]
    query = "&".join(f"name[]={name}" for name in wanted)
    request = urllib.request.Request(
        f"http://127.0.0.1:{live.metrics_port}/metrics?{query}",
        headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"},
    )
    deadline = time.monotonic() + 60
    while True:  # stage gauges land with the next heartbeat interval
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.headers["Content-Encoding"] == "gzip"
            text = gzip.decompress(reply.read()).decode()
        names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
        if names == set(wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert names == set(wanted)


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return {name for expr in exprs for name in re.findall(r"brigade:[a-zA-Z_:][a-zA-Z0-9_:]*", expr)}


def test_every_dashboard_metric_is_in_the_live_metrics(live: Run, tiny_model_dir: Path) -> None:
    num_requests = 4
    with Client(live.run_dir) as client:
        for i in range(num_requests):
            client.generate(f"Request {i}: the same long shared prefix of words", max_tokens=6,
                            temperature=0, ignore_eos=True, timeout=120)  # fmt: skip
        with pytest.raises(PromptTooLong):
            client.generate("word " * 400, max_tokens=4, timeout=60)  # over max_model_len: refused
    deadline = time.monotonic() + 60
    while True:  # stage gauges land with the next heartbeat interval
        samples = scrape(live)
        if "brigade:num_requests_running" in samples or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    queried = dashboard_metrics()
    assert len(queried) >= 15
    missing = sorted(name for name in queried if name not in samples and name not in CUDA_ONLY)
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"

    def total(name: str, **labels: str) -> float:
        return sum(s.value for s in samples[name] if labels.items() <= s.labels.items())

    assert {s.labels["model_name"] for s in samples["brigade:num_requests_running"]} == {str(tiny_model_dir)}
    assert total("brigade:request_success_total", finished_reason="length") >= num_requests + 2
    assert total("brigade:request_failure_total", code="prompt_too_long") == 1
    assert total("brigade:generation_tokens_total") >= 6 * num_requests
    assert total("brigade:prompt_tokens_total") > 0
    assert total("brigade:time_to_first_token_seconds_count") >= num_requests
    assert total("brigade:request_queue_time_seconds_count") >= num_requests
    assert total("brigade:prefix_cache_queries_total") >= total("brigade:prefix_cache_hits_total") > 0
    assert {s.labels["stage"] for s in samples["brigade:stage_cpu_seconds_total"]} >= {
        "supervisor", "tokenizer-0", "scheduler-0", "gpu_worker-0-0", "detokenizer-0"}  # fmt: skip
    assert all(s.value > 1e6 for s in samples["brigade:stage_resident_memory_bytes"])


def test_mlflow_sink_logs_the_live_run(live: Run) -> None:
    uri = live.mlflow_uri  # type: ignore[attr-defined]
    if uri is None:
        pytest.skip("mlflow is not installed (pip install '.[mlflow]')")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    with Client(live.run_dir) as brigade_client:
        brigade_client.generate(
            "A sampled request", max_tokens=6, temperature=0, ignore_eos=True, timeout=120
        )
    deadline = time.monotonic() + 120
    while True:
        (experiment,) = [e for e in client.search_experiments() if e.name == "ops"]
        runs = client.search_runs([experiment.experiment_id])
        history = client.get_metric_history(runs[0].info.run_id, "generation_tok_per_s") if runs else []
        samples = client.list_artifacts(runs[0].info.run_id, "samples") if runs else []
        if (any(h.value > 0 for h in history) and samples) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(runs) == 1 and runs[0].info.run_name.startswith("brigade-")
    assert runs[0].data.params["engine.max_num_seqs"] == "8"
    assert any(h.value > 0 for h in history), "no throughput point reached MLflow"
    assert samples, "no request sample reached MLflow"
    for artifact in samples:
        local = client.download_artifacts(runs[0].info.run_id, artifact.path, str(live.run_dir / "dl"))
        for sample in json.loads(Path(local).read_text()):
            assert {"request_id", "prompt", "output", "finish_reason"} <= sample.keys()


def audit_lines(run: Run) -> list[dict]:
    path = run.run_dir / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_audit(run: Run, predicate, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in audit_lines(run):
            if predicate(line):
                return line
        time.sleep(0.2)
    raise AssertionError(f"no such audit event within {timeout:.0f}s; audit log: {audit_lines(run)}")


def test_stage_restart_is_audited(live: Run) -> None:
    (pid,) = live.stage_pids("detokenizer")
    os.kill(pid, signal.SIGKILL)
    line = wait_for_audit(live, lambda e: e["event"] == "stage_restart" and e["stage"] == "detokenizer-0")
    assert line["source"] == "supervisor" and line["restart"] == 1
    assert "-9" in line["reason"]
    live.wait_until_running(120)
    restarts = scrape(live)["brigade:stage_restarts_total"]
    assert [s.value for s in restarts if s.labels["stage"] == "detokenizer-0"] == [1.0]


def test_configmap_swap_reloads_and_is_audited(live: Run) -> None:
    configmap: ConfigMapDir = live.configmap  # type: ignore[attr-defined]
    configmap.update("tokenizer:\n  replicas: 2\n")
    applied = wait_for_audit(live, lambda e: e["event"] == "reload" and e["outcome"] == "applied")
    assert applied["applied"] == {"tokenizer.replicas": [1, 2]} and applied["refused"] == {}
    rescale = wait_for_audit(live, lambda e: e["event"] == "rescale")
    assert rescale["changes"] == {"tokenizer.replicas": [1, 2]}
    live.wait_until_running(180)
    assert len(live.stage_pids("tokenizer")) == 2
    configmap.update("tokenizer:\n  replicas: 2\nengine:\n  block_size: 32\n")
    refused = wait_for_audit(
        live, lambda e: e["event"] == "reload" and e["outcome"] == "refused" and e["refused"]
    )
    assert refused["refused"] == {"engine.block_size": [16, 32]} and refused["applied"] == {}
    configmap.update("tokenizer:\n  replicas: -1\n")
    error = wait_for_audit(live, lambda e: e["event"] == "reload" and e["error"])
    assert "tokenizer.replicas" in error["error"]
    assert live.process.poll() is None  # a bad config never ends the run
