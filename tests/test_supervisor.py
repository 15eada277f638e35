"""The supervisor with real processes: chaos (SIGKILL every stage kind under load, nothing lost),
crash loops, shutdown under load, and the status command."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from client import Client
from ipc.shm import sweep_stale_runs
from tests.conftest import brigade_shm_objects
from tests.harness import assert_clean, brigade_run, stage_processes, start_supervisor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_REQUESTS = 32
NEW_TOKENS = 40


def run_streams(run_dir: Path, started: threading.Event | None = None) -> list[tuple[str, list[int]]]:
    """32 greedy streaming requests at once; each result is (text, ids) assembled from its stream,
    and a stream must never repeat or skip (the client checks positions; we check the text)."""
    results: list[tuple[str, list[int]] | None] = [None] * NUM_REQUESTS
    first_delta = threading.Barrier(NUM_REQUESTS + 1) if started else None

    def one(i: int) -> None:
        with Client(run_dir, failover_after=3.0, unavailable_after=120.0) as client:
            text, ids, is_first = [], [], True
            for delta in client.stream(
                f"Story number {i}: once upon a time",
                max_tokens=NEW_TOKENS,
                temperature=0.0,
                ignore_eos=True,
                timeout=600,
            ):
                text.append(delta.text)
                ids += delta.token_ids
                if is_first and first_delta is not None:
                    is_first = False
                    first_delta.wait(120)
            results[i] = ("".join(text), ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    if first_delta is not None and started is not None:
        first_delta.wait(120)
        started.set()
    for t in threads:
        t.join(600)
    assert all(r is not None for r in results), "a request did not complete"
    return results  # type: ignore[return-value]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    run_dir = tmp_path_factory.mktemp("chaos")
    port = free_port()
    with brigade_run(
        run_dir,
        "model.dtype=float32",
        "engine.max_num_seqs=32",
        "model.max_model_len=512",
        "supervisor.backoff_initial_s=0.1",
        f"supervisor.metrics_port={port}",
    ) as run:
        run.metrics_port = port
        yield run
    assert_clean(run_dir)


@pytest.fixture(scope="module")
def fault_free(chaos_run) -> list[tuple[str, list[int]]]:
    return run_streams(chaos_run.run_dir)


@pytest.mark.parametrize("kind", ["tokenizer", "scheduler", "gpu_worker", "detokenizer"])
def test_sigkill_loses_nothing(chaos_run, fault_free, kind: str) -> None:
    started = threading.Event()
    outcome: list = []
    runner = threading.Thread(target=lambda: outcome.append(run_streams(chaos_run.run_dir, started)))
    runner.start()
    assert started.wait(300), "streams never started"
    (pid,) = chaos_run.stage_pids(kind)
    os.kill(pid, signal.SIGKILL)
    runner.join(600)
    assert outcome, "streams did not finish"
    for i, ((text, ids), (want_text, want_ids)) in enumerate(zip(outcome[0], fault_free, strict=True)):
        assert ids == want_ids, f"request {i} after killing {kind}"
        assert text == want_text, f"request {i} after killing {kind}"
    chaos_run.wait_until_running(120)
    restarts = {r["name"]: r["restarts"] for r in chaos_run.status()}
    assert any(n.startswith(kind) and c >= 1 for n, c in restarts.items()), restarts


def test_metrics_endpoint(chaos_run, fault_free) -> None:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{chaos_run.metrics_port}/metrics", timeout=10)
        .read()
        .decode()
    )
    for name in (  # docs/metrics.md
        "brigade:request_success_total",
        "brigade:time_to_first_token_seconds_bucket",
        "brigade:inter_token_latency_seconds_bucket",
        "brigade:e2e_request_latency_seconds_bucket",
        "brigade:num_requests_running",
        "brigade:num_requests_waiting",
        "brigade:kv_cache_usage_perc",
        "brigade:prefix_cache_queries_total",
        "brigade:shm_slots_in_use",
        "brigade:stage_restarts_total",
        "brigade:malformed_messages_total",
    ):
        assert name in text, name
    finished = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("brigade:request_success_total{") and 'finished_reason="length"' in line
    ]
    assert finished and finished[0] >= NUM_REQUESTS  # at least the fault-free round


def test_status_json_lists_every_stage(chaos_run) -> None:
    rows = chaos_run.status()
    # configs/default.yaml runs one of each kind, the HTTP gateway included (gateway.replicas=1)
    assert {r["kind"] for r in rows} == {"gateway", "tokenizer", "scheduler", "gpu_worker", "detokenizer"}
    for row in rows:
        assert {"name", "kind", "pid", "state", "restarts"} <= row.keys()
        os.kill(row["pid"], 0)  # a live process


def test_crash_loop_gives_up_cleanly(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A stage that keeps failing after it was up is restarted `restart_intensity` times, then
    the run ends with an error and leaves nothing behind. (A stage that fails its very first
    start ends the run at once: tests/test_supervision_faults.py.)"""
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={tiny_model_dir}",
        "supervisor.restart_intensity=1",
        "supervisor.backoff_initial_s=0.1",
    )
    with brigade_run(run_dir, *overrides) as run:
        run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
        (pid,) = run.stage_pids("detokenizer")
        os.kill(pid, signal.SIGKILL)
        run.wait_for_line("detokenizer-0 up", 120)
        (pid,) = run.stage_pids("detokenizer")
        os.kill(pid, signal.SIGKILL)
        line = run.wait_for_line("giving up", 120)
        assert "detokenizer-0 failed 2 times within 60s" in line
        assert run.process.wait(120) == 1
    assert_clean(run_dir, run_id)
    assert not (run_dir / "run.json").exists()


def test_shutdown_under_load_leaves_nothing(tmp_path: Path, smollm2_dir: Path) -> None:
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, "model.dtype=float32", "supervisor.drain_timeout_s=2") as run:
        run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
        client = Client(run_dir)
        streams = [
            client.stream(f"Tell me about {i}", max_tokens=200, temperature=0.0, timeout=60) for i in range(8)
        ]
        for stream in streams:
            next(stream)
        run.process.send_signal(signal.SIGTERM)
        assert run.process.wait(120) == 0
        client.close()
    assert_clean(run_dir, run_id)
    assert not (run_dir / "run.json").exists()


def is_alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_all_gone(pids: dict[int, str], timeout: float) -> list[str]:
    """Names of the processes still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pids[p] for p in pids if is_alive(p)]


def test_supervisor_sigkill_leaves_no_orphans_and_next_start_sweeps(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, "model.dtype=float32") as run:
        run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
        stages = {r["pid"]: r["name"] for r in run.status()}
        run.process.kill()
        run.process.wait(30)
        alive = wait_all_gone(stages, 90)
    # Nobody was left to unlink the run's shared memory; the next start sweeps it first.
    left = any(run_id in n for n in brigade_shm_objects())
    swept = sweep_stale_runs()
    assert not alive, f"stages outlived a SIGKILLed supervisor: {alive}"
    assert left and any(run_id in n for n in swept)
    assert not any(run_id in n for n in brigade_shm_objects())


def test_supervisor_sigkill_while_stages_start_leaves_no_orphans(tmp_path: Path, smollm2_dir: Path) -> None:
    """Killed while its stages are still importing, before they could ask for PDEATHSIG: they must
    notice at startup that the supervisor is gone (this once left a worker running forever)."""
    run_dir = tmp_path / "run"
    process = start_supervisor(run_dir)
    try:
        started: dict[int, str] = {}
        for line in process.stdout:  # "started gpu_worker-0-0 (pid 123)", one per stage
            if " started " in line:
                name, pid = line.split(" started ")[1].split(" (pid ")
                started[int(pid.rstrip(")\n"))] = name
            if len(started) == 4:
                break
        assert len(started) == 4, f"the supervisor did not start 4 stages: {started}"
        process.kill()
        process.wait(30)
        alive = wait_all_gone(started, 90)
    finally:
        process.kill()
        process.wait()
        for pid in stage_processes(run_dir):
            os.kill(pid, signal.SIGKILL)
        sweep_stale_runs()
    assert not alive, f"stages outlived a supervisor SIGKILLed while they started: {alive}"
