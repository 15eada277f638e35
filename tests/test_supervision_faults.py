"""Supervision faults with real processes: a reload that cannot be read, configs that can only
fail at run time (refused before any stage starts, or fatal at the first failure instead of a
crash loop), a stuck worker blamed on its scheduler, and `status` piped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from client import Client, Overloaded
from ipc import messages as m
from ipc.codec import CONTROL_DOWN, CONTROL_UP
from ipc.sockets import RouterSocket
from tests.conftest import REPO_ROOT, brigade_shm_objects
from tests.harness import assert_clean, brigade_run, stage_processes
from tests.test_scheduler_process import KILL_AFTER_TOKENS, NUM_REQUESTS, Group

pytestmark = pytest.mark.timeout(600)


class Ended:
    """A supervisor run that ended by itself: its pid (part of its shared-memory names), exit
    code and stderr."""

    def __init__(self, run_dir: Path, *overrides: str, timeout: float = 300) -> None:
        argv = [
            sys.executable,
            "supervisor.py",
            "--config",
            "configs/default.yaml",
            "--run-dir",
            str(run_dir),
        ]
        for override in overrides:
            argv += ["--set", override]
        process = subprocess.Popen(
            argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            _, self.stderr = process.communicate(timeout=timeout)
        finally:
            process.kill()
            process.wait()
        self.pid, self.returncode, self.run_dir = process.pid, process.returncode, run_dir

    def assert_nothing_left(self) -> None:
        """No stage process, socket file or shared-memory object of this run (other runs on the
        machine may own some meanwhile)."""
        assert not stage_processes(self.run_dir)
        assert not list(self.run_dir.glob("*.sock"))
        ours = [n for n in brigade_shm_objects() if n.removeprefix("sem.").startswith(f"brigade-{self.pid}x")]
        assert not ours, f"shared memory left: {ours}"


# -- item 9: a reload that cannot be read is refused, at start a clean config error ----------


@pytest.mark.slow
def test_reload_of_a_non_utf8_config_is_refused_and_the_run_goes_on(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config_path = tmp_path / "brigade.yaml"
    config = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    config["model"].update(path=str(tiny_model_dir), dtype="float32", max_model_len=512)
    config_path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, config=str(config_path)) as run:
        pids = {r["name"]: r["pid"] for r in run.status()}
        with Client(run_dir) as client:
            before = client.generate("Hello", max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120)
        config_path.write_bytes(config_path.read_bytes() + b"# caf\xe9\n")
        run.process.send_signal(signal.SIGHUP)
        line = run.wait_for_line("reload refused, config unchanged", 60)
        assert "is not UTF-8 text: byte 0xe9" in line
        time.sleep(1.0)  # the watch loop would have ended by now if the reload had crashed it
        assert run.process.poll() is None, "the supervisor died on a bad reload"
        assert {r["name"]: r["pid"] for r in run.status()} == pids  # nothing restarted
        with Client(run_dir) as client:
            after = client.generate("Hello", max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120)
        assert after.token_ids == before.token_ids
    assert run.process.returncode == 0
    assert_clean(run_dir)


def test_non_utf8_config_at_start_is_a_clean_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"engine:\n  max_num_seqs: 8  # caf\xe9\n")
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", str(path), "--run-dir", str(tmp_path / "run")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith(f"config error: {path} is not UTF-8 text: byte 0xe9"), done.stderr
    assert "Traceback" not in done.stderr


# -- item 11: run-time config errors are refused before spawning, or fatal at once ------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["engine.kv_cache_mib=1"],
            "engine.kv_cache_mib=1 holds 1 KV block(s) of 16 tokens",
        ),
        (
            ["engine.tensor_parallel=4"],  # SmolLM2-135M has 3 KV heads
            "engine.tensor_parallel=4 cannot split",
        ),
        (
            # Rings sized past the address space: mapping them fails after the segment is made.
            ["engine.max_num_seqs=1099511627776"],
            "shared-memory rings could not be made ([Errno 12] Cannot allocate memory): each step slot",
        ),
    ],
)
def test_config_the_model_cannot_run_is_refused_before_any_stage_starts(
    tmp_path: Path, smollm2_dir: Path, overrides: list[str], message: str
) -> None:
    done = Ended(tmp_path / "run", *overrides, "supervisor.backoff_initial_s=0.1")
    assert done.returncode == 1, done.stderr
    assert message in done.stderr
    assert " started " not in done.stderr, "a stage was spawned for a config that cannot run"
    assert "Traceback" not in done.stderr
    done.assert_nothing_left()


def test_kv_check_uses_the_models_shape(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The check reads the prepared model's config.json: the tiny model's K and V take 2 layers x
    2 KV heads x 16 dims x 4 bytes x 2 = 512 bytes a token, so 1 MiB holds 2048 tokens, enough for
    its 2048 positions but not for 4096."""
    from ipc.config import load_config
    from supervision.preflight import Refused, check_model

    check_model(load_config(None, ["engine.kv_cache_mib=1", "model.dtype=float32"]), tiny_model_dir)
    longer = tmp_path / "tiny-4k"
    shutil.copytree(tiny_model_dir, longer)
    raw = json.loads((longer / "config.json").read_text())
    (longer / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 4096}))
    with pytest.raises(Refused, match=r"engine.kv_cache_mib=1 holds 128 KV block\(s\) .* max_model_len=4096"):
        check_model(load_config(None, ["engine.kv_cache_mib=1", "model.max_model_len=4096"]), longer)
    # A CUDA worker checks its budget at start; preflight still gives the run's sampling defaults.
    assert isinstance(check_model(load_config(None, ["engine.device=cuda"]), tiny_model_dir), dict)
    # A bfloat16 cache (engine.kv_cache_dtype) takes half the bytes a token: 4096 tokens fit.
    check_model(
        load_config(
            None, ["engine.kv_cache_mib=1", "model.max_model_len=4096", "engine.kv_cache_dtype=bfloat16"]
        ),
        longer,
    )
    with pytest.raises(
        Refused, match=r"engine.tensor_parallel=3 cannot split .*: it must be <= or a multiple"
    ):
        check_model(load_config(None, ["engine.tensor_parallel=3"]), tiny_model_dir)


@pytest.mark.slow
def test_stage_failing_its_first_start_ends_the_run_with_its_error(tmp_path: Path, smollm2_dir: Path) -> None:
    """A model whose weights cannot load: the worker's error ends the run at once, instead of
    restarting a worker that can only fail again until the restart intensity runs out."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, broken / name)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    done = Ended(tmp_path / "run", f"model.path={broken}", "supervisor.backoff_initial_s=0.1")
    assert done.returncode == 1
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert error.startswith("error: gpu_worker-0-0 failed to start (exit code 1): "), error
    assert "safetensor" in error.lower(), error  # the worker's own last words
    assert "restarting gpu_worker" not in done.stderr
    done.assert_nothing_left()


# -- item 10: a stuck worker is not blamed on its scheduler ------------------------------------


@pytest.mark.slow
def test_scheduler_heartbeats_while_it_waits_on_a_stuck_worker(tiny_model_dir: Path) -> None:
    """The scheduler waits up to step_timeout_s on a step; meanwhile it must keep telling the
    supervisor it is alive, or the supervisor kills it for the worker's hang."""
    step_timeout_s = 20.0
    run_dir = Path(tempfile.mkdtemp(prefix="brigade-test-"))
    group = None
    try:
        group = Group(run_dir, tiny_model_dir, (f"engine.step_timeout_s={step_timeout_s}",))
        control = RouterSocket(group.ctx, group.endpoints.supervisor(), CONTROL_UP, CONTROL_DOWN)
        prompts = [[5 + i, 17, 23, 99] for i in range(NUM_REQUESTS)]
        got: dict[str, list[int]] = {f"beat-{i}": [] for i in range(NUM_REQUESTS)}
        for i, prompt in enumerate(prompts):
            group.submit(f"beat-{i}", prompt)
        group.collect(got, lambda got: all(len(t) >= KILL_AFTER_TOKENS for t in got.values()))
        group.worker.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        beats: list[float] = []
        while time.monotonic() - stopped_at < step_timeout_s / 2:
            received = control.recv(0.5)
            if (
                received is not None
                and isinstance(received[1], m.Heartbeat)
                and received[1].name == "scheduler-0"
            ):
                beats.append(time.monotonic() - stopped_at)
        assert group.scheduler.poll() is None
        gaps = [b - a for a, b in zip([0.0, *beats], [*beats, step_timeout_s / 2], strict=True)]
        assert max(gaps) < 3.0, f"the scheduler went {max(gaps):.1f}s without a heartbeat (beats at {beats})"
    finally:
        if group is not None:
            group.close()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.slow
def test_stopped_worker_restarts_the_worker_not_the_scheduler(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={tiny_model_dir}", "model.dtype=float32", "model.max_model_len=512", "engine.threads=1",
        "engine.step_timeout_s=4", "supervisor.hang_timeout_s=8", "supervisor.backoff_initial_s=0.1",
    )  # fmt: skip
    with brigade_run(run_dir, *overrides) as run:
        before = {r["name"]: (r["pid"], r["restarts"]) for r in run.status()}
        with Client(run_dir) as client:
            reference = client.generate("Once", max_tokens=64, temperature=0.0, ignore_eos=True, timeout=120)
        results: list = []

        def generate() -> None:
            with Client(run_dir, failover_after=3.0, unavailable_after=120.0) as client:
                results.append(
                    client.generate("Once", max_tokens=64, temperature=0.0, ignore_eos=True, timeout=300)
                )

        os.kill(before["gpu_worker-0-0"][0], signal.SIGSTOP)  # stuck before the request's first step
        thread = threading.Thread(target=generate)
        thread.start()
        thread.join(300)
        assert results and results[0].token_ids == reference.token_ids
        run.wait_until_running(120)
        after = {r["name"]: (r["pid"], r["restarts"]) for r in run.status()}
        assert after["scheduler-0"] == before["scheduler-0"], (
            "the scheduler was restarted for its worker's hang"
        )
        assert after["gpu_worker-0-0"][1] == 1 and after["gpu_worker-0-0"][0] != before["gpu_worker-0-0"][0]
    assert_clean(run_dir)


# -- issue 21: status ends when its output is not a terminal ---------------------------------


def test_status_prints_the_table_once_when_piped(tmp_path: Path) -> None:
    row = {
        "name": "scheduler-0", "kind": "scheduler", "pid": 4242, "state": "running", "restarts": 2,
        "uptime_s": 12.0, "queue_depth": 3, "running": 5, "kv_usage": 0.25, "tokens_per_s": 99.5, "malformed": 0,
    }  # fmt: skip
    (tmp_path / "status.json").write_text(json.dumps([row]))
    done = subprocess.run(
        [sys.executable, "supervisor.py", "status", "--run", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "\033" not in done.stdout  # no screen clearing when not a terminal
    assert len(lines) == 3 and lines[0].split()[:3] == ["stage", "pid", "state"]
    assert lines[2].split() == ["scheduler-0", "4242", "running", "2", "12s", "3", "5", "25.0%", "99.5"]


def test_status_watch_refreshes_until_stopped(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text("[]")
    process = subprocess.Popen(
        [sys.executable, "supervisor.py", "status", "--run", str(tmp_path), "--watch"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(5)  # it refreshes every second and never ends by itself
        (tmp_path / "status.json").unlink()
        assert process.wait(30) == 1  # the run is gone
        assert process.stdout is not None
        assert process.stdout.read().count("\033[2J") >= 2
    finally:
        process.kill()
        process.wait()


def test_status_without_a_run(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "supervisor.py", "status", "--run", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 1
    assert "no live Brigade run" in done.stderr


def test_steps_that_never_finish_in_time_fail_their_requests_instead_of_restarting_forever(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    """Every replacement worker recomputes all sequences, a bigger step than the late one: on a
    host too slow for engine.step_timeout_s that could loop forever in silence. After
    MAX_LATE_STEPS late workers in a row the group's requests fail, naming the setting, and the
    run lives on. A 400-token prefill of SmolLM2 on one thread takes far longer than the 0.1 s
    allowed (and than the 0.2 s between the scheduler's looks at the ring)."""
    run_dir = tmp_path / "run"
    overrides = (
        "model.max_model_len=1024", "engine.threads=1", "engine.step_timeout_s=0.1",
        "supervisor.backoff_initial_s=0.1", "supervisor.restart_intensity=50", "gateway.replicas=0",
    )  # fmt: skip
    with brigade_run(run_dir, *overrides) as run:
        prompt = " ".join(["bucket"] * 400)
        with Client(run_dir, unavailable_after=240.0) as client, pytest.raises(Overloaded) as failed:
            client.generate(prompt, max_tokens=4, temperature=0.0, timeout=240)
        assert "engine.step_timeout_s" in str(failed.value)
        assert run.process.poll() is None  # the run goes on
        # The third late worker is killed as its requests fail: its restart may be counted a
        # moment after the client hears of the failure.
        deadline = time.monotonic() + 30
        while (rows := {r["name"]: r for r in run.status()})["gpu_worker-0-0"]["restarts"] < 3:
            assert time.monotonic() < deadline, f"fewer than 3 worker restarts: {rows}"
            time.sleep(0.2)
        assert rows["scheduler-0"]["restarts"] == 0, "the scheduler itself was restarted"
    assert_clean(run_dir)
