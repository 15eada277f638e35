"""A real autoscaling Ray cluster on this machine for tests: `ray start --head` with Ray's own
autoscaler (v1, the monitor process) and its fake multi-node provider, which "launches" a node
by starting, from the monitor process, a raylet with the node type's resources, and ends it by
killing those processes. Everything the cluster runs is found, and killed at the end, by a
marker in its environment (which every process Ray starts inherits) and by its own temp dir;
the test asserts that nothing is left.

Not `ray.cluster_utils.AutoscalingCluster`: it reads a config template that Ray's wheel lacks,
and it runs `ray stop --force`, which kills every Ray process of the user on the host, other
tests' clusters included. Never run `ray stop` here."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import ray._private.services
from ray._private.state import GlobalState
from ray._raylet import GcsClientOptions
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_TYPE

from tests.harness import free_port

MARKER_ENV = "BRIGADE_TEST_RAY_CLUSTER"  # its value is one cluster's token
START_TIMEOUT_S = 120.0
KILL_TIMEOUT_S = 30.0
OBJECT_STORE_BYTES = 150 * 1024 * 1024  # per node; Ray's floor is 75 MiB


@dataclass
class AutoscalingRay:
    """A started cluster: its GCS address, its temp dir and the token that marks its processes."""

    address: str
    temp_dir: Path
    token: str
    state: GlobalState

    def worker_nodes(self) -> dict[str, dict[str, float]]:
        """The alive nodes the autoscaler launched: node id -> resources (asked of the GCS, so
        that the test process never joins the cluster as a driver)."""
        return {
            node["NodeID"]: node["Resources"]
            for node in self.state.node_table()
            if node["Alive"] and "node:__internal_head__" not in node["Resources"]
        }

    def wait_for_worker_nodes(self, count: int, timeout: float) -> dict[str, dict[str, float]]:
        deadline = time.monotonic() + timeout
        while len(nodes := self.worker_nodes()) != count and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(nodes) == count, f"expected {count} autoscaled node(s) within {timeout:.0f}s: {nodes}"
        return nodes

    def processes(self) -> list[int]:
        return cluster_processes(self.token, self.temp_dir)


def cluster_processes(token: str, temp_dir: Path) -> list[int]:
    """Pids of this user's processes that belong to the cluster: the marker in their environment,
    or the cluster's temp dir on their command line."""
    marker = f"{MARKER_ENV}={token}".encode()
    uid, found = os.getuid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marker in environ or str(temp_dir).encode() in cmdline:
            found.append(int(entry))
    return found


def _die_with_the_test() -> None:
    """The head's `ray start --block` is SIGTERMed when the test process dies without teardown;
    the processes it started die with it (Ray's own fate sharing on Linux)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def autoscaling_config(
    gcs_address: str, head_cpus: int, worker_types: dict[str, dict], idle_timeout_s: float
) -> dict:
    """The autoscaler's cluster config for the fake multi-node provider, complete: the monitor
    reads it as it is, without filling in defaults. `use_node_id_as_ip`: every fake node has this
    host's address, so the autoscaler tells them apart by node id (RAY_FAKE_CLUSTER gives the head
    the provider's fixed head id)."""
    return {
        "cluster_name": "brigade-test",
        "max_workers": sum(t["max_workers"] for t in worker_types.values()),
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,  # the provider's nodes join this head, not one on port 6379
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": {
            # What `ray start` gives the head; the autoscaler never launches another.
            FAKE_HEAD_NODE_TYPE: {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
            **{name: _node_type(spec) for name, spec in worker_types.items()},
        },
        "head_node_type": FAKE_HEAD_NODE_TYPE,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "upscaling_speed": 1.0,
        "auth": {},
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


def _node_type(spec: dict) -> dict:
    """A worker node type as the autoscaler wants it: min_workers 0 unless given, and an object
    store of OBJECT_STORE_BYTES (Ray's default, 30% of this host's memory, on every fake node)."""
    resources = {"object_store_memory": OBJECT_STORE_BYTES, **spec["resources"]}
    return {"node_config": {}, "min_workers": 0, **spec, "resources": resources}


@contextmanager
def autoscaling_ray(
    worker_types: dict[str, dict], logs_to: Path, head_cpus: int = 1, idle_timeout_s: float = 6.0
) -> Iterator[AutoscalingRay]:
    """A head node of `head_cpus` CPUs whose autoscaler launches nodes of `worker_types`
    (autoscaler node types: `resources`, `max_workers`, optionally `min_workers`), on free ports
    in a temp dir of its own; at the end every process of it is killed, its logs are kept in
    `logs_to` (the autoscaler's: monitor.log), and the test fails if a process is left or its GCS
    port still answers."""
    # Short: Ray's Unix sockets live under it, and their paths must stay under 108 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="brigade-ray-", dir="/tmp"))
    token = secrets.token_hex(8)
    port = free_port()
    address = f"{ray._private.services.get_node_ip_address()}:{port}"
    config_path = temp_dir / "autoscaling.json"
    config_path.write_text(json.dumps(autoscaling_config(address, head_cpus, worker_types, idle_timeout_s)))
    argv = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
        f"--temp-dir={temp_dir}", f"--autoscaling-config={config_path}", f"--num-cpus={head_cpus}",
        f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats", "--include-dashboard=false",
        # Free ports for what would otherwise take fixed ones, which another cluster may hold.
        f"--dashboard-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        "--min-worker-port=0", "--max-worker-port=0",
    ]  # fmt: skip
    env = {
        **os.environ,
        MARKER_ENV: token,
        "RAY_FAKE_CLUSTER": "1",  # the provider refuses to run without it
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",  # the autoscaler's round, 5 s by default
    }
    log_path = temp_dir / "ray-start.log"
    with open(log_path, "wb") as log:
        head = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=_die_with_the_test,
        )  # fmt: skip
    state = GlobalState()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"Ray runtime started" not in log_path.read_bytes():
            assert head.poll() is None, f"ray start failed:\n{log_path.read_text(errors='replace')}"
            assert time.monotonic() < deadline, f"ray start hung:\n{log_path.read_text(errors='replace')}"
            time.sleep(0.2)
        state._initialize_global_state(
            GcsClientOptions.create(address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False)
        )
        yield AutoscalingRay(address, temp_dir, token, state)
    finally:
        state.disconnect()
        _kill_cluster(token, temp_dir, head, logs_to)
        left = cluster_processes(token, temp_dir)
        assert not left, f"processes of the Ray cluster left: {left}"
        # A killed process leaves /proc's view (its environment) before it closes its sockets.
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while _answers(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _answers(port), f"the cluster's GCS port {port} still answers"


def _answers(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _kill_cluster(token: str, temp_dir: Path, head: subprocess.Popen, logs_to: Path) -> None:
    """SIGKILL every process of the cluster until none is left: the head's, the fake nodes' (the
    monitor's children, which no fate sharing ends) and the workers of each; then its temp dir
    goes, but for its logs."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while (pids := cluster_processes(token, temp_dir)) and time.monotonic() < deadline:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            head.wait(0.5)  # the one process of the cluster that is this test's child: reaped
    with suppress(subprocess.TimeoutExpired):
        head.wait(5)
    for logs in temp_dir.glob("session_*/logs"):
        with suppress(OSError):  # shutil.Error too: the logs help, but the cluster must go anyway
            shutil.copytree(logs, logs_to, dirs_exist_ok=True)
    shutil.rmtree(temp_dir, ignore_errors=True)
