"""The scheduler and a real worker as OS processes, on the tiny model, without a supervisor: the
test writes run.json and creates the rings as the supervisor does, and plays the tokenizer and the
detokenizer on the scheduler's sockets. The overlapped step loop gives the greedy tokens of plain
synchronous generation, and a worker SIGKILLed mid-generation is replaced without a request
being lost, changed, repeated or cut."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from ipc import messages as m
from ipc.codec import DETOKENIZER_INPUT, SCHEDULER_INPUT, TOKENIZER_INPUT
from ipc.config import load_config
from ipc.endpoints import Endpoints
from ipc.sampling_defaults import fill_defaults
from ipc.shm import ShmRing, new_run_id
from ipc.sockets import PullQueue, PushQueue
from services.stage import RunInfo, write_run_info
from supervision.run import RING_SLOTS, result_slot_bytes, step_slot_bytes
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_REQUESTS = 6
MAX_TOKENS = 160  # long enough that every request is still running when the worker is killed
KILL_AFTER_TOKENS = 6
WAIT_S = 300.0
OVERRIDES = (
    "model.dtype=float32",
    "model.max_model_len=512",
    "engine.kv_cache_mib=16",
    "engine.threads=1",
    "engine.max_num_seqs=16",
    # Both runs compute every prompt from scratch, as the reference does.
    "engine.enable_prefix_caching=false",
)


class Group:
    """One engine group started by hand: run.json and the rings as the supervisor makes them, the
    scheduler and worker processes, and the test's ends of the scheduler's sockets."""

    def __init__(self, run_dir: Path, model_dir: Path, overrides: tuple[str, ...] = ()) -> None:
        self.run_dir = run_dir
        config = load_config(None, OVERRIDES + overrides)
        self.endpoints = Endpoints(run_dir, new_run_id())
        write_run_info(
            run_dir, RunInfo(self.endpoints.run_id, os.getpid(), str(model_dir), "tiny", [], config)
        )
        self.rings: list[ShmRing] = []
        self.processes: list[subprocess.Popen] = []
        self.ctx = zmq.Context()
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        step_bytes = step_slot_bytes(config, vocab_size)
        self.rings.append(ShmRing.create(self.endpoints.step_ring(0), RING_SLOTS, step_bytes, 1))
        self.rings.append(
            ShmRing.create(self.endpoints.result_ring(0), RING_SLOTS, result_slot_bytes(config), 1)
        )
        self.detokenizer = PullQueue(self.ctx, self.endpoints.detokenizer_in(0), DETOKENIZER_INPUT)
        self.tokenizer = PullQueue(self.ctx, self.endpoints.tokenizer_in(0), TOKENIZER_INPUT)
        self.scheduler_in = PushQueue(self.ctx, self.endpoints.scheduler_in(0), SCHEDULER_INPUT)
        self.scheduler = self.start("scheduler")
        self.worker = self.start("gpu_worker")

    def start(self, kind: str) -> subprocess.Popen:
        with open(self.run_dir / f"{kind}-{len(self.processes)}.log", "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", f"services.{kind}", "--run-dir", str(self.run_dir)],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def log(self, process: subprocess.Popen) -> str:
        kind = "scheduler" if process is self.scheduler else "gpu_worker"
        return (self.run_dir / f"{kind}-{self.processes.index(process)}.log").read_text()

    def submit(self, request_id: str, prompt: list[int]) -> None:
        params = fill_defaults(
            m.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, seed=1)
        )
        assert self.scheduler_in.put(m.SubmitRequest(request_id, 0, m.pack_ids(prompt), params))

    def collect(self, got: dict[str, list[int]], until: Callable[[dict[str, list[int]]], bool]) -> None:
        """Receive token updates into `got` until `until(got)`; every update must continue its
        request exactly where it stands (no duplicate, no gap) and none may follow the last."""
        deadline = time.monotonic() + WAIT_S
        while not until(got):
            failure = self.tokenizer.get(0)
            assert failure is None, f"the scheduler failed a request: {failure}"
            assert self.scheduler.poll() is None, f"the scheduler exited:\n{self.log(self.scheduler)}"
            assert time.monotonic() < deadline, (
                f"no progress in {WAIT_S:.0f}s: {[len(t) for t in got.values()]}"
            )
            batch = self.detokenizer.get(0.5)
            if batch is None:
                continue
            assert isinstance(batch, m.TokenBatch | m.StepTokens), batch
            for update in batch.to_updates():
                tokens = got[update.request_id]
                assert len(tokens) < MAX_TOKENS, f"{update.request_id}: output after its end"
                assert update.start_index == len(tokens), f"{update.request_id}: a gap or a duplicate"
                tokens.extend(m.unpack_ids(update.token_ids).tolist())
                assert (update.finish_reason == "length") == (len(tokens) == MAX_TOKENS)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(30)
        self.ctx.destroy(linger=0)
        for ring in self.rings:
            ring.close()
            ring.unlink()


@pytest.fixture
def group(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Group]:
    """A group with the OVERRIDES, plus those of `@pytest.mark.overrides(...)`."""
    marker = request.node.get_closest_marker("overrides")
    # A short path: ipc:// socket paths are limited to about 100 bytes.
    run_dir = Path(tempfile.mkdtemp(prefix="brigade-test-"))
    group = None
    try:
        group = Group(run_dir, tiny_model_dir, marker.args if marker else ())
        yield group
    finally:
        if group is not None:
            group.close()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 40_000, int(rng.integers(5, 40))).tolist() for _ in range(NUM_REQUESTS)]


@pytest.fixture
def reference(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Plain synchronous greedy generation in this process, every id explicit."""
    from services.gpu_worker.model_runner import ModelRunner
    from tests.test_model import generate

    runner = ModelRunner(tiny_model_dir, dtype="float32", kv_cache_bytes=16 << 20, threads=1)
    return generate(runner, prompts, MAX_TOKENS)[0]


def test_worker_sigkill_mid_generation_loses_and_changes_nothing(
    group: Group, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # A run without the fault: the scheduler's overlapped loop against synchronous generation.
    clean: dict[str, list[int]] = {f"clean-{i}": [] for i in range(NUM_REQUESTS)}
    for i, prompt in enumerate(prompts):
        group.submit(f"clean-{i}", prompt)
    group.collect(clean, lambda got: all(len(t) == MAX_TOKENS for t in got.values()))
    assert list(clean.values()) == reference

    # The same requests again; the worker dies once each has a few tokens, and a new one starts.
    faulty: dict[str, list[int]] = {f"faulty-{i}": [] for i in range(NUM_REQUESTS)}
    for i, prompt in enumerate(prompts):
        group.submit(f"faulty-{i}", prompt)
    group.collect(faulty, lambda got: all(len(t) >= KILL_AFTER_TOKENS for t in got.values()))
    group.worker.kill()
    group.worker.wait(30)  # reaped: the scheduler sees the pid gone, not a zombie
    assert all(len(t) < MAX_TOKENS for t in faulty.values()), "a request finished before the fault"
    group.worker = group.start("gpu_worker")
    group.collect(faulty, lambda got: all(len(t) == MAX_TOKENS for t in got.values()))
    assert list(faulty.values()) == reference

    group.scheduler.send_signal(signal.SIGTERM)
    group.scheduler.wait(30)
    log = group.log(group.scheduler)
    assert "worker lost" in log
    match = re.search(r"stopping after (\d+) steps, (\d+) planned ahead", log)
    assert match is not None, log
    num_steps, num_planned_ahead = int(match[1]), int(match[2])
    # Nearly every decode step went out before the result of the step before it.
    assert num_planned_ahead > 0.8 * num_steps, log


STALL_TIMEOUT_S = 5


@pytest.mark.overrides(f"engine.step_timeout_s={STALL_TIMEOUT_S}")
def test_stalled_worker_is_killed_and_replaced_without_changing_a_token(
    group: Group, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """A worker alive but stuck past step_timeout_s (SIGSTOP here) is given up on and killed by
    the scheduler; left alive it would never say hello again and the group would wait forever."""
    got: dict[str, list[int]] = {f"stall-{i}": [] for i in range(NUM_REQUESTS)}
    for i, prompt in enumerate(prompts):
        group.submit(f"stall-{i}", prompt)
    group.collect(got, lambda got: all(len(t) >= KILL_AFTER_TOKENS for t in got.values()))
    group.worker.send_signal(signal.SIGSTOP)
    try:
        returncode = group.worker.wait(STALL_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        returncode = None
    assert returncode == -signal.SIGKILL, f"the stalled worker was not killed (exit {returncode})"
    assert all(len(t) < MAX_TOKENS for t in got.values()), "a request finished before the stall"
    group.worker = group.start("gpu_worker")
    group.collect(got, lambda got: all(len(t) == MAX_TOKENS for t in got.values()))
    assert list(got.values()) == reference


BURST = 40
BURST_WAITING = 4


@pytest.mark.overrides(f"engine.max_num_waiting={BURST_WAITING}")
def test_burst_fills_every_free_slot_before_refusing(group: Group) -> None:
    """Issue 14 item 12: a burst into an idle group is admitted up to its free sequence slots
    plus max_num_waiting (16 + 4 here), whether it lands before the worker is up or after; the
    rest get a clear `overloaded`, and every admitted request completes."""
    params = fill_defaults(m.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, seed=1))
    for i in range(BURST):
        assert group.scheduler_in.put(m.SubmitRequest(f"burst-{i}", 0, m.pack_ids([5, 6, 7 + i]), params))
    finished: set[str] = set()
    refused: list[m.RequestFailed] = []
    deadline = time.monotonic() + WAIT_S
    while len(finished) + len(refused) < BURST:
        assert time.monotonic() < deadline, f"{len(finished)} done, {len(refused)} refused in {WAIT_S:.0f}s"
        assert group.scheduler.poll() is None, f"the scheduler exited:\n{group.log(group.scheduler)}"
        failure = group.tokenizer.get(0)
        if failure is not None:
            refused.append(failure)
        batch = group.detokenizer.get(0.2)
        if batch is not None:
            finished |= {u.request_id for u in batch.to_updates() if u.finish_reason is not None}
    max_num_seqs = load_config(None, OVERRIDES).engine.max_num_seqs
    assert len(finished) >= max_num_seqs + BURST_WAITING, f"only {len(finished)} of {BURST} admitted"
    assert all(isinstance(f, m.RequestFailed) and f.code == "overloaded" for f in refused), refused
    assert not finished & {f.request_id for f in refused}


def test_progress_query_reports_outputs_held_and_unknown_ids(group: Group, prompts: list[list[int]]) -> None:
    """The tokenizer's watchdog asks how far its quiet requests are: the scheduler answers with
    the output tokens it holds for each (at least what it has already sent on), -1 for one it
    does not run."""
    got: dict[str, list[int]] = {"asked": []}
    group.submit("asked", prompts[0])
    group.collect(got, lambda got: len(got["asked"]) >= KILL_AFTER_TOKENS)
    assert group.scheduler_in.put(m.QueryRequests(0, ["asked", "never-submitted"]))
    deadline = time.monotonic() + WAIT_S
    reply = None
    while reply is None:
        assert time.monotonic() < deadline, "no answer to QueryRequests"
        reply = group.tokenizer.get(0.5)
    assert isinstance(reply, m.RequestProgress), reply
    assert reply.request_ids == ["asked", "never-submitted"]
    held, unknown = reply.num_output_tokens
    assert KILL_AFTER_TOKENS <= held <= MAX_TOKENS and unknown == -1
