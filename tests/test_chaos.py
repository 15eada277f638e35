"""Exactly-once delivery under faults, with real processes on the tiny model: requests that the
scheduler finished while their text sat in a detokenizer that then died, requests the engine
forgot, resumes that claim text they never had, and a seeded chaos run that SIGKILLs every stage
kind (and SIGSTOPs the worker and the scheduler) at random moments while streamed and
non-streamed requests are in flight, and SIGKILLs each kind again with busy loops taking the CPU
from the stages. Every request must end with exactly the text of a calm run (under the busy
loops: or with an error the server sent, never silence).

`--chaos-seed N` replays a fault plan; a failing chaos test prints its seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq

from client import BrigadeError, Client, RequestTimeout, ServerUnavailable
from client.sdk import make_generate
from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST, SCHEDULER_INPUT
from ipc.sockets import PushQueue
from services.stage import read_run_info, run_endpoints
from services.tokenizer.core import engine_id
from tests.harness import Run, assert_clean, brigade_run, free_port, spec_decode_counters, tokenizer_dealer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 240
STALL_TIMEOUT_S = 1.0
HANG_TIMEOUT_S = 5.0
STEP_TIMEOUT_S = 3.0  # below hang_timeout_s: a stuck worker is the scheduler's to give up on first
REQUEST_TIMEOUT_S = 120.0  # every client wait: a lost request fails the test instead of hanging it
RECOVER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Spec:
    """One request of the workload: greedy or seeded sampling, streamed or not; with an image
    URL, a chat of the image and the prompt (the vision-language run's)."""

    prompt: str
    stream: bool
    temperature: float
    seed: int | None
    image_url: str | None = None

    def generate(self) -> m.Generate:
        sampling = dict(max_tokens=MAX_TOKENS, temperature=self.temperature, ignore_eos=True)
        if self.seed is not None:
            sampling["seed"] = self.seed
        if self.image_url is None:
            request = make_generate(None, self.prompt, None, sampling)
        else:
            image = {"type": "image_url", "image_url": {"url": self.image_url}}
            chat = [{"role": "user", "content": [image, {"type": "text", "text": self.prompt}]}]
            request = make_generate(None, None, chat, sampling)
        return msgspec.structs.replace(request, stream=self.stream)


SPECS = [
    Spec(f"Bucket {i} passes down the line and", stream=i % 2 == 0, temperature=0.0 if i < 4 else 0.8, seed=i)
    for i in range(8)
]

Output = tuple[str, list[int]]


def run_one(run_dir: Path, spec: Spec) -> Output:
    """The request through the SDK's session (failover and resubmission included). The SDK
    streams everything; a non-streamed request is the protocol's `stream=False`, answered with
    one whole delta at the end."""
    with Client(run_dir, failover_after=2.0, unavailable_after=REQUEST_TIMEOUT_S) as client:
        return collect(client, spec)


def collect(client: Client, spec: Spec) -> Output:
    """`spec` through `client`: its whole text and tokens, checked to end at the length limit."""
    deltas = list(client._stream(spec.generate(), REQUEST_TIMEOUT_S))
    assert deltas and deltas[-1].finish_reason == "length", deltas[-1:]
    if not spec.stream:
        assert len(deltas) == 1, f"a non-streamed request got {len(deltas)} replies"
    return "".join(d.text for d in deltas), [i for d in deltas for i in d.token_ids]


def run_each(
    run_dir: Path, during: Callable[[], None] | None = None, specs: list[Spec] = SPECS
) -> list[Output | BaseException]:
    """Every spec at once, each one's output or what it raised; `during()` runs while they are
    in flight."""
    results: list[Output | BaseException | None] = [None] * len(specs)

    def one(i: int) -> None:
        try:
            results[i] = run_one(run_dir, specs[i])
        except BaseException as exc:  # reported below, with the others
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(specs))]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 30)
    return [TimeoutError("the request's thread did not end") if r is None else r for r in results]


def run_all(
    run_dir: Path, during: Callable[[], None] | None = None, specs: list[Spec] = SPECS
) -> list[Output]:
    """Every spec at once, each of which must complete; `during()` runs while they are in flight."""
    results = run_each(run_dir, during, specs)
    failures = {i: r for i, r in enumerate(results) if not isinstance(r, tuple)}
    assert not failures, f"requests did not complete: {failures}"
    return results  # type: ignore[return-value]


def assert_same(got: list[Output], want: list[Output], what: str, specs: list[Spec] = SPECS) -> None:
    for i, ((text, ids), (want_text, want_ids)) in enumerate(zip(got, want, strict=True)):
        assert len(ids) == MAX_TOKENS, f"{what}: request {i} has {len(ids)} tokens"
        assert ids == want_ids, f"{what}: request {i} ({specs[i]}) changed its tokens"
        assert text == want_text, f"{what}: request {i} ({specs[i]}) changed its text"


def wait_for(what: str, condition: Callable[[], bool], timeout: float = RECOVER_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.05)


def running_pid(run: Run, kind: str) -> int:
    """The pid of the (single) stage of this kind, once it is up and running."""
    pids: list[int] = []

    def found() -> bool:
        pids[:] = [r["pid"] for r in run.read_status() if r["kind"] == kind and r["state"] == "running"]
        return len(pids) == 1

    wait_for(f"{kind} running", found)
    return pids[0]


def all_running(run: Run) -> bool:
    rows = run.read_status()
    return bool(rows) and all(r["state"] == "running" for r in rows)


def wait_for_restarts(run: Run, minimum: dict[str, int]) -> None:
    """Every stage running, and each kind restarted at least `minimum[kind]` times over its
    stages. Waited for, not read once: a kill that lands after the requests ended (a late delay
    of a seeded run) is in status.json only once the supervisor has seen the death."""
    counts: dict[str, int] = {}

    def reached() -> bool:
        counts.clear()
        for row in run.read_status():
            counts[row["kind"]] = counts.get(row["kind"], 0) + row["restarts"]
        return all_running(run) and all(counts.get(kind, 0) >= n for kind, n in minimum.items())

    with contextlib.suppress(AssertionError):
        wait_for(f"restarts {minimum}", reached)
    assert all(counts.get(kind, 0) >= n for kind, n in minimum.items()), counts


def chaos_settings(model_dir: Path) -> tuple[str, ...]:
    """The config overrides of a chaos run: quick restarts and short timeouts."""
    return (
        f"model.path={model_dir}",
        "model.dtype=float32",
        "model.max_model_len=1024",
        "engine.kv_cache_mib=64",
        "engine.threads=1",
        "engine.max_num_seqs=16",
        f"engine.step_timeout_s={STEP_TIMEOUT_S}",
        f"supervisor.hang_timeout_s={HANG_TIMEOUT_S}",
        "supervisor.restart_intensity=100",
        "supervisor.backoff_initial_s=0.1",
        "supervisor.backoff_max_s=0.5",
        f"tokenizer.stall_timeout_s={STALL_TIMEOUT_S}",
    )


@pytest.fixture(scope="module", params=["ipc", "tcp"])
def run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Run]:
    """The same run with its links over ipc://, and over tcp:// with CURVE on loopback."""
    run_dir = tmp_path_factory.mktemp(f"chaos-{request.param}")
    with brigade_run(run_dir, *chaos_settings(tiny_model_dir), f"network.transport={request.param}") as live:
        run_id = read_run_info(run_dir).run_id
        yield live
    assert_clean(run_dir, run_id)


@pytest.fixture(scope="module")
def calm(run: Run) -> list[Output]:
    """The fault-free outputs, from the same run."""
    first = run_all(run.run_dir)
    assert_same(run_all(run.run_dir), first, "a second calm run")
    return first


def test_detokenizer_death_after_the_scheduler_finished_loses_nothing(run: Run, calm: list[Output]) -> None:
    """Issue 14 item 1. The detokenizer is stopped, so the scheduler finishes every request
    while all their text waits in the detokenizer's queue; then it is killed. The scheduler has
    forgotten these requests, so only the tokenizer's journal can re-drive them."""
    detokenizer = running_pid(run, "detokenizer")
    os.kill(detokenizer, signal.SIGSTOP)
    try:

        def kill_once_finished_upstream() -> None:
            def scheduler(key: str) -> int:
                return sum(r[key] for r in run.read_status() if r["kind"] == "scheduler")

            wait_for("the scheduler running the requests", lambda: scheduler("running") > 0)
            wait_for(
                "the scheduler finishing them", lambda: scheduler("running") + scheduler("queue_depth") == 0
            )
            with contextlib.suppress(ProcessLookupError):  # or the supervisor found it hung first
                os.kill(detokenizer, signal.SIGKILL)

        outputs = run_all(run.run_dir, during=kill_once_finished_upstream)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(detokenizer, signal.SIGKILL)
    assert_same(outputs, calm, "after the detokenizer died holding every request's text")
    wait_for("every stage running", lambda: all_running(run))


def raw_request(run: Run, request: m.Generate, timeout: float) -> list[m.ClientReply]:
    """Send one request on a bare DEALER; the replies until its end (or the timeout)."""
    ctx = zmq.Context()
    try:
        sock = tokenizer_dealer(ctx, run.run_dir)
        sock.send(CLIENT_REQUEST.encode(request))
        replies: list[m.ClientReply] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not sock.poll(100):
                continue
            reply = CLIENT_REPLY.decode(sock.recv())
            replies.append(reply)
            if isinstance(reply, m.ErrorReply) or getattr(reply, "finish_reason", None) is not None:
                break
        return replies
    finally:
        ctx.destroy(linger=0)


def test_resume_past_the_resumed_text_is_refused_at_once(run: Run, calm: list[Output]) -> None:
    """Issue 14 item 2: a raw resume claiming 10**12 characters of 3 tokens used to wait behind a
    gap forever (and held the drain at shutdown); it is an invalid_request now."""
    request = m.Generate(
        "resume-past-its-text",
        prompt=SPECS[0].prompt,
        params=m.SamplingParams(max_tokens=8, temperature=0.0),
        resume_output_ids=m.pack_ids([300, 301, 302]),
        resume_num_chars=10**12,
    )
    replies = raw_request(run, request, timeout=30)
    assert replies, "no answer in 30 s"
    (reply,) = replies
    assert isinstance(reply, m.ErrorReply), reply
    assert (reply.request_id, reply.code) == ("resume-past-its-text", "invalid_request")
    assert "resume_num_chars" in reply.message
    wait_for(
        "the tokenizer holding nothing in flight",
        lambda: all(r["queue_depth"] == 0 for r in run.read_status() if r["kind"] == "tokenizer"),
        timeout=30,
    )


def test_a_request_the_engine_forgot_is_redriven(run: Run, calm: list[Output]) -> None:
    """Issue 14 item 2: the scheduler loses a request the tokenizer still journals (an abort that
    did not come from its client, here sent straight to the scheduler under the engine's id of
    the request). The tokenizer's watchdog sees no progress, learns from the scheduler that it no
    longer runs the request, and resubmits it from what the client has: the client gets exactly
    the calm text."""
    generate = SPECS[0].generate()
    assert SPECS[0].stream
    identity = b"forgetful-client"  # a connection of known identity: the engine id is derivable
    endpoints = run_endpoints(run.run_dir, read_run_info(run.run_dir))
    ctx = zmq.Context()
    try:
        scheduler = PushQueue(ctx, endpoints.scheduler_in(0), SCHEDULER_INPUT)  # with the stage key over tcp
        sock = tokenizer_dealer(ctx, run.run_dir, identity=identity)
        sock.send(CLIENT_REQUEST.encode(generate))
        text, ids = "", []
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while True:
            assert time.monotonic() < deadline, "the request did not finish"
            if not sock.poll(100):
                continue
            reply = CLIENT_REPLY.decode(sock.recv())
            if isinstance(reply, m.HealthReply):
                continue  # the tokenizer's keepalive
            assert isinstance(reply, m.Delta), reply
            assert (reply.token_index, reply.char_offset) == (len(ids), len(text))
            if not ids:
                assert scheduler.put(m.AbortRequest(engine_id(0, identity, generate.request_id)))
            text += reply.text
            ids += m.unpack_ids(reply.token_ids).tolist()
            if reply.finish_reason is not None:
                break
    finally:
        ctx.destroy(linger=0)
    assert (text, ids) == calm[0]


def test_a_request_sent_to_a_tokenizer_that_dies_before_reading_it_is_resubmitted(
    run: Run, calm: list[Output]
) -> None:
    """The client is connected, the tokenizer is stopped, the request goes into the connection
    and the tokenizer is killed before it reads it: the request never reached any process. The
    client's probes name its requests; the restarted tokenizer answers that it holds none of
    them, and the client resubmits. (Found by --chaos-seed 278338493 over tcp: a client that had
    not heard from the first process took the restarted one for the one holding its request,
    and waited for it until its timeout.)"""
    wait_for("every stage running", lambda: all_running(run))
    tokenizer = running_pid(run, "tokenizer")
    results: list[Output | BaseException] = []
    with Client(run.run_dir, failover_after=2.0, unavailable_after=REQUEST_TIMEOUT_S) as client:
        # IMMEDIATE: the DEALER can send once its connection (and CURVE handshake) is complete.
        assert client._sockets[0].poll(10_000, zmq.POLLOUT), "the client did not connect"
        os.kill(tokenizer, signal.SIGSTOP)

        def first_spec() -> None:
            try:
                results.append(collect(client, SPECS[0]))
            except BaseException as exc:  # reported below
                results.append(exc)

        thread = threading.Thread(target=first_spec, daemon=True)
        thread.start()
        time.sleep(0.5)  # the request (and any probe) is written into the stopped peer's socket
        os.kill(tokenizer, signal.SIGKILL)
        thread.join(REQUEST_TIMEOUT_S + 30)
        assert results and isinstance(results[0], tuple), results
        assert client.session.num_failovers >= 1, "the request was not resubmitted"
    assert results[0] == calm[0]
    wait_for("every stage running", lambda: all_running(run))


# The stages a request passes through on the SDK's path (the HTTP gateway has its own kill test).
FAULTED_KINDS = ("tokenizer", "scheduler", "gpu_worker", "detokenizer")


def fault_plan(seed: int) -> list[list[tuple[str, signal.Signals, float]]]:
    """Waves of (stage kind, signal, delay after the wave starts): each kind SIGKILLed twice, the
    worker and the scheduler SIGSTOPped (hung) once each, two faults of two kinds per wave, in
    random order and at random moments."""
    rng = random.Random(seed)
    faults = [(kind, signal.SIGKILL) for kind in FAULTED_KINDS] * 2
    faults += [("gpu_worker", signal.SIGSTOP), ("scheduler", signal.SIGSTOP)]
    # A wave never faults one kind twice: the second fault would read the pid the first just
    # killed (status has not caught up) and hit nothing, so that kind would miss a restart.
    rng.shuffle(faults)
    while any(faults[i][0] == faults[i + 1][0] for i in range(0, len(faults), 2)):
        rng.shuffle(faults)
    timed = [(kind, sig, rng.uniform(0.0, 1.5)) for kind, sig in faults]
    return [timed[i : i + 2] for i in range(0, len(timed), 2)]


def test_chaos_every_stage_killed_or_hung_loses_and_changes_nothing(
    run: Run, calm: list[Output], chaos_seed: int
) -> None:
    for wave, faults in enumerate(fault_plan(chaos_seed)):
        wait_for("every stage running", lambda: all_running(run))
        injected: list[str] = []

        def inject(
            faults: list[tuple[str, signal.Signals, float]] = faults, injected: list[str] = injected
        ) -> None:
            started = time.monotonic()
            for kind, sig, delay in faults:
                pid = running_pid(run, kind)
                time.sleep(max(0.0, started + delay - time.monotonic()))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                injected.append(f"{sig.name} {kind} at {time.monotonic() - started:.2f}s")

        outputs = run_all(run.run_dir, during=inject)
        assert_same(outputs, calm, f"seed {chaos_seed}, wave {wave}: {injected}")
    wait_for_restarts(run, dict.fromkeys(FAULTED_KINDS, 2))


# Long enough that the dead tokenizer's copies would still be computing long after the kills.
ORPHAN_MAX_TOKENS = 1000
ORPHAN_CHECK_BEFORE = 800  # the copies must be stopped before the served requests get this far


def test_copies_of_a_dead_tokenizer_stop_though_the_detokenizer_died_with_it(
    run: Run, calm: list[Output]
) -> None:
    """Issue 29 item 11 (found while reproducing it under CPU contention). A dead tokenizer's
    requests keep running in the scheduler under their old engine ids while their clients
    resubmit them to its replacement; they used to be stopped only when their text reached
    that replacement, which aborts ids it never journaled. When the detokenizer died too, no
    text of theirs reached anyone (the restarted detokenizer had no history to continue), and
    they computed to max_tokens for nobody, beside the requests being served: 8 copies ran for
    30 s after every client had gone, taking steps and KV blocks from the next requests. The
    worker dies with them here, so that the copies are not ahead of the served requests."""
    wait_for("every stage running", lambda: all_running(run))
    received = [0] * len(SPECS)
    stopping = threading.Event()

    def serve(i: int) -> None:
        with (
            Client(run.run_dir, failover_after=2.0, unavailable_after=REQUEST_TIMEOUT_S) as client,
            contextlib.closing(  # closing the stream aborts the request
                client.stream(
                    SPECS[i].prompt,
                    max_tokens=ORPHAN_MAX_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                    timeout=REQUEST_TIMEOUT_S,
                )
            ) as stream,
        ):
            for delta in stream:
                received[i] += len(delta.token_ids)
                if stopping.is_set():
                    return

    threads = [threading.Thread(target=serve, args=(i,), daemon=True) for i in range(len(SPECS))]
    for t in threads:
        t.start()
    try:
        wait_for("every request generating", lambda: min(received) > 0)
        for kind in ("gpu_worker", "tokenizer", "detokenizer"):
            os.kill(running_pid(run, kind), signal.SIGKILL)
        at_kill = list(received)
        wait_for(
            "every request served again", lambda: all(r > k for r, k in zip(received, at_kill, strict=True))
        )

        def only_the_served_run() -> bool:
            assert max(received) < ORPHAN_CHECK_BEFORE, "the dead tokenizer's copies are still running"
            rows = [r for r in run.read_status() if r["kind"] == "scheduler"]
            return [r["running"] + r["queue_depth"] for r in rows] == [len(SPECS)]

        wait_for("the scheduler running only the served requests", only_the_served_run)
    finally:
        stopping.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S)
    wait_for(
        "the scheduler idle",
        lambda: all(r["running"] == 0 for r in run.read_status() if r["kind"] == "scheduler"),
    )


def test_requests_abandoned_while_their_scheduler_is_down_leave_the_detokenizer(run: Run) -> None:
    """A hostile run: streams whose clients left while their scheduler was dead stayed in the
    detokenizer for good (its queue grew by them at every such crash): the scheduler tells a shard
    to forget an aborted request only if it runs it, and the restarted one never had them. The
    tokenizer that aborts a request now tells the shard itself. A bare client, so that it aborts
    the moment the scheduler is killed (the SDK's stream only leaves at its next delta)."""
    wait_for("every stage running", lambda: all_running(run))
    ids = [f"abandoned-{i}" for i in range(4)]
    ctx = zmq.Context()
    try:
        sock = tokenizer_dealer(ctx, run.run_dir)
        for i, request_id in enumerate(ids):
            request = msgspec.structs.replace(SPECS[2 * i].generate(), request_id=request_id, stream=True)
            request.params.max_tokens = ORPHAN_MAX_TOKENS
            sock.send(CLIENT_REQUEST.encode(request))
        generating: set[str] = set()
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while generating != set(ids):
            assert time.monotonic() < deadline, f"only {sorted(generating)} generating"
            if sock.poll(100):
                reply = CLIENT_REPLY.decode(sock.recv())
                if isinstance(reply, m.HealthReply):
                    continue  # the tokenizer's keepalive
                assert isinstance(reply, m.Delta), reply
                generating.add(reply.request_id)

        def detokenizer_holds() -> int:
            return sum(r["queue_depth"] for r in run.read_status() if r["kind"] == "detokenizer")

        wait_for("the detokenizer's load naming the requests", lambda: detokenizer_holds() == len(ids))
        restarts = sum(r["restarts"] for r in run.read_status() if r["kind"] == "scheduler")
        os.kill(running_pid(run, "scheduler"), signal.SIGKILL)
        for request_id in ids:
            sock.send(CLIENT_REQUEST.encode(m.Abort(request_id)))
        wait_for_restarts(run, {"scheduler": restarts + 1})
        wait_for(
            "the detokenizer holding no request",
            lambda: detokenizer_holds() == 0,
            timeout=30,
        )
    finally:
        ctx.destroy(linger=0)


# Busy loops beside the stages, at their priority: the CPU contention of a host shared with other
# jobs (issue 29 item 11). Each loop ends by itself after HOG_LIMIT_S, so that none outlives a
# test process killed before its teardown.
HOG_PROCESSES = 6
HOG_LIMIT_S = 300.0
HOG_CODE = """
import os, sys, time
for _ in range(int(sys.argv[1]) - 1):
    if os.fork() == 0:
        break
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    pass
"""


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """HOG_PROCESSES busy loops in a process group of their own, killed whole at teardown."""
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG_CODE, str(HOG_PROCESSES), str(HOG_LIMIT_S)], start_new_session=True
    )
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()


def test_every_stage_killed_under_cpu_contention_answers_every_request(
    run: Run, calm: list[Output], cpu_hog: None, chaos_seed: int
) -> None:
    """Issue 29 item 11: with busy loops taking most of the CPU from the stages, each stage kind
    is SIGKILLed in turn while the requests are generating. Every request ends with exactly the
    calm text, or with an error the server sent; never silence (the client's own timeout, or no
    tokenizer answering)."""
    rng = random.Random(chaos_seed)
    for kind in rng.sample(FAULTED_KINDS, len(FAULTED_KINDS)):
        wait_for("every stage running", lambda: all_running(run))
        delay = rng.uniform(0.0, 1.0)

        def kill(kind: str = kind, delay: float = delay) -> None:
            pid = running_pid(run, kind)
            time.sleep(delay)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

        outcomes = run_each(run.run_dir, during=kill)
        for i, outcome in enumerate(outcomes):
            what = f"seed {chaos_seed}: request {i} ({SPECS[i]}), {kind} SIGKILLed at {delay:.2f}s"
            is_silence = isinstance(outcome, RequestTimeout | ServerUnavailable)
            if isinstance(outcome, BrigadeError) and not is_silence and str(outcome):
                continue  # failed with the server's error, which says why
            assert isinstance(outcome, tuple), f"{what}: {outcome!r}"
            assert outcome == calm[i], f"{what}: changed its output"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_worker_and_scheduler_killed_mid_stream_with_speculation_change_nothing(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, method: str
) -> None:
    """With n-gram or draft-model speculation on (docs/speculative.md; the draft: the tiny
    model's first layer), a SIGKILL of the worker, then of the scheduler, while the requests
    stream leaves every request with the text of a calm run: the recompute (worker) and the
    resubmission (scheduler) start from accepted tokens only, and a restarted worker's draft
    cache is rebuilt with the target's, from the sequences' whole histories."""
    from tests.test_speculation_draft import truncated_copy

    run_dir = tmp_path_factory.mktemp("chaos-speculative")
    metrics_port = free_port()
    method_settings = [f"speculative.method={method}"]
    if method == "draft_model":
        draft = truncated_copy(tiny_model_dir, tmp_path_factory.mktemp("chaos-draft") / "draft", 1)
        method_settings.append(f"speculative.model={draft}")
    with brigade_run(
        run_dir,
        *chaos_settings(tiny_model_dir),
        *method_settings,
        f"supervisor.metrics_port={metrics_port}",
    ) as run:
        calm = run_all(run.run_dir)
        assert spec_decode_counters(metrics_port).get("brigade:spec_decode_num_drafts_total"), (
            "nothing verified"
        )
        for kind in ("gpu_worker", "scheduler"):
            wait_for("every stage running", lambda: all_running(run))

            def kill(kind: str = kind) -> None:
                pid = running_pid(run, kind)
                time.sleep(0.5)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

            assert_same(run_all(run.run_dir, during=kill), calm, f"{kind} SIGKILLed with speculation on")
        wait_for_restarts(run, {"gpu_worker": 1, "scheduler": 1})
        run_id = read_run_info(run_dir).run_id
    assert_clean(run_dir, run_id)


@pytest.mark.parametrize("model_fixture", ["tiny_gemma3_vlm_dir", "tiny_qwen25vl_dir"])
def test_a_vision_language_run_with_each_stage_killed_changes_nothing(
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
    model_fixture: str,
    chaos_seed: int,
) -> None:
    """The encoder among the faults (issue 36): chats with an image each, half as data URLs and
    half fetched from a local HTTP server, while each stage kind of a vision-language run is
    SIGKILLed in turn. The encoder is stopped first, so that the requests are in its socket when
    it dies: the tokenizer asks again, and the restarted encoder (its cache kept) answers. Every
    request ends with exactly the text of a calm run: Gemma 3's, whose image tokens are fixed,
    and Qwen2.5-VL's, whose chats with http images are tokenized only once those are fetched
    (their size gives their tokens) and whose resubmissions keep that prompt."""
    from tests.test_image_chat import data_url, png
    from tests.test_image_fetch import ImageServer

    model_dir: Path = request.getfixturevalue(model_fixture)
    rng = random.Random(chaos_seed)
    run_dir = tmp_path_factory.mktemp("chaos-vlm")
    with ImageServer({f"/{i}.png": png(24 + i, 40 - i, seed=i) for i in range(len(SPECS))}) as images:
        specs = [
            dataclasses.replace(
                spec, image_url=f"{images.url}/{i}.png" if i % 2 else data_url(images.files[f"/{i}.png"])
            )
            for i, spec in enumerate(SPECS)
        ]
        with brigade_run(run_dir, *chaos_settings(model_dir), "encoder.replicas=1") as run:
            calm = run_all(run.run_dir, specs=specs)
            for kind in ("encoder", *rng.sample(FAULTED_KINDS, len(FAULTED_KINDS))):
                wait_for("every stage running", lambda: all_running(run))
                pid = running_pid(run, kind)
                delay = rng.uniform(0.0, 1.5)
                if kind == "encoder":
                    os.kill(pid, signal.SIGSTOP)
                    delay = 0.5  # the requests (and their resends) are in its socket

                def kill(pid: int = pid, delay: float = delay) -> None:
                    time.sleep(delay)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

                outputs = run_all(run.run_dir, during=kill, specs=specs)
                assert_same(outputs, calm, f"seed {chaos_seed}: {kind} SIGKILLed at {delay:.2f}s", specs)
            wait_for_restarts(run, dict.fromkeys(("encoder", *FAULTED_KINDS), 1))
            run_id = read_run_info(run_dir).run_id
    assert_clean(run_dir, run_id)
