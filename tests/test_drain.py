"""What a stopping run lets finish (supervisor.py `Supervisor.drain`): every call admitted before
the drain, including the later requests of a call made of several (a beam search's steps, the
choices sent after a prompt's first, an embedding call's later windows: m.Generate.continues),
while new calls are refused. The drain's own logic against stage handles fed scripted loads, a
gateway's later choices against a recording client, and a beam search under way when a real run
gets SIGTERM."""

from __future__ import annotations

import asyncio
import http.client
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from client.errors import ServerUnavailable
from client.sdk import StreamDelta
from ipc import messages as m
from ipc.config import load_config
from services.gateway.jobs import Job
from services.gateway.runner import run_jobs
from supervision.stages import StageHandle
from supervisor import Supervisor
from tests.harness import brigade_run, free_port
from tests.test_embeddings import post as post_json

# -- the drain's logic, no process --------------------------------------------------------------


class LiveProcess:
    """What a StageHandle asks of its process: it runs."""

    pid = 1

    def poll(self) -> None:
        return None


def stage(name: str, kind: str) -> StageHandle:
    handle = StageHandle(name, kind, [], {}, process=LiveProcess(), is_ready=True)  # type: ignore[arg-type]
    handle.on_heartbeat(m.Heartbeat(name, 1, 0, False, m.StageLoad()), time.monotonic() - 1.0)
    return handle


def beat(handle: StageHandle, num_in_flight: int, draining: bool = False) -> None:
    """A heartbeat from `handle` now; `draining`: a tokenizer's, sent once it took the Shutdown."""
    load = m.StageLoad(num_in_flight=num_in_flight, is_draining=draining)
    handle.on_heartbeat(m.Heartbeat(handle.name, 1, 0, False, load), time.monotonic())


class Stages:
    def __init__(self, *handles: StageHandle) -> None:
        self.handles = handles

    def of_kind(self, kind: str) -> list[StageHandle]:
        return [h for h in self.handles if h.kind == kind]


def drain(
    handles: list[StageHandle], rounds: list[Callable[[], None]], timeout_s: float = 5.0
) -> tuple[int, list[str]]:
    """Run `Supervisor.drain` over `handles`; each of its reads of the control socket runs the
    next of `rounds`, the heartbeats that came meanwhile (none once they are used up). Returns
    how many reads it made and the commands it sent: "after N reads: stage: command"."""
    config = load_config(None, [f"supervisor.drain_timeout_s={timeout_s}"])
    script = iter(rounds)
    reads = 0
    sent: list[str] = []

    def read_control(timeout: float) -> None:
        nonlocal reads
        reads += 1
        next(script, lambda: time.sleep(0.01))()

    supervisor = SimpleNamespace(
        config=config,
        stages=Stages(*handles),
        signals=[signal.SIGTERM],
        read_control=read_control,
        command=lambda handle, message: sent.append(
            f"after {reads} reads: {handle.name}: {type(message).__name__}"
        ),
    )
    Supervisor.drain(supervisor)  # type: ignore[arg-type]
    return reads, sent


def test_the_drain_waits_for_a_gateways_call_between_two_of_its_requests() -> None:
    """The gateways drain first: once each says so (one call in flight), the tokenizers. Between
    two steps of a beam search no tokenizer holds any of it: only the gateway knows that the
    call goes on, and the drain ends once the gateway has nothing in flight either."""
    tokenizer, gateway = stage("tokenizer-0", "tokenizer"), stage("gateway-0", "gateway")
    rounds = [
        lambda: beat(gateway, 1, draining=True),
        *[lambda: (beat(tokenizer, 0, draining=True), beat(gateway, 1, draining=True))] * 2,
        lambda: beat(gateway, 0, draining=True),
    ]
    reads, sent = drain([tokenizer, gateway], rounds)
    assert reads == 4
    assert sent == ["after 0 reads: gateway-0: Shutdown", "after 1 reads: tokenizer-0: Shutdown"]


def test_a_load_counts_once_its_stage_says_it_took_the_shutdown() -> None:
    """A heartbeat sent before its stage handled the Shutdown may come after, and miss a call
    admitted meanwhile: only loads that say the stage is draining count."""
    tokenizer, gateway = stage("tokenizer-0", "tokenizer"), stage("gateway-0", "gateway")
    rounds = [
        lambda: (beat(tokenizer, 0), beat(gateway, 0)),
        lambda: beat(gateway, 0, draining=True),
        lambda: beat(tokenizer, 0),
        lambda: beat(tokenizer, 0, draining=True),
    ]
    reads, sent = drain([tokenizer, gateway], rounds)
    assert reads == 4 and sent[-1] == "after 2 reads: tokenizer-0: Shutdown"


def test_a_stage_that_is_down_is_not_waited_for() -> None:
    tokenizer, gateway = stage("tokenizer-0", "tokenizer"), stage("gateway-0", "gateway")
    gateway.is_ready = False  # exited and waiting to restart: it will not report
    reads, sent = drain([tokenizer, gateway], [lambda: beat(tokenizer, 0, draining=True)])
    assert reads == 1 and sent[-1] == "after 0 reads: tokenizer-0: Shutdown"


def test_the_deadline_and_a_second_signal_still_end_the_drain() -> None:
    tokenizer, gateway = stage("tokenizer-0", "tokenizer"), stage("gateway-0", "gateway")
    started = time.monotonic()
    drain(
        [tokenizer, gateway],
        [lambda: (beat(tokenizer, 0, draining=True), beat(gateway, 1, draining=True))] * 1000,
        timeout_s=0.3,
    )
    assert 0.3 <= time.monotonic() - started < 3.0
    supervisor_signals: list[int] = []

    def second_signal() -> None:
        supervisor_signals.append(signal.SIGTERM)

    # A second signal lands while the drain waits: it returns at once.
    config = load_config(None, ["supervisor.drain_timeout_s=60"])
    supervisor = SimpleNamespace(
        config=config,
        stages=Stages(tokenizer, gateway),
        signals=supervisor_signals,
        read_control=lambda timeout: second_signal() if timeout else None,
        command=lambda handle, message: None,
    )
    supervisor_signals.append(signal.SIGTERM)
    started = time.monotonic()
    Supervisor.drain(supervisor)  # type: ignore[arg-type]
    assert time.monotonic() - started < 3.0 and len(supervisor_signals) == 2


# -- the gateway's later choices ----------------------------------------------------------------


class RecordingClient:
    """Answers each request with one final delta; records each request's `continues`."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bool]] = []

    async def stream(
        self, prompt: Any, *, messages: Any = None, **sampling: Any
    ) -> AsyncIterator[StreamDelta]:
        self.sent.append((prompt, sampling.get("continues", False)))
        await asyncio.sleep(0)
        yield StreamDelta("x", [5], None, "length", m.Usage(3, 1))


def test_choices_after_a_prompts_first_continue_the_admitted_call() -> None:
    """n = 2 over two prompts: each prompt's first choice goes as a new call (refused by a
    stopping run), its second once the first was admitted, as a continuation (taken)."""
    client = RecordingClient()
    jobs = [Job(j, j // 2, f"prompt {j // 2}", None, {}) for j in range(4)]

    async def run() -> list[tuple[int, StreamDelta]]:
        return [item async for item in run_jobs(client, jobs)]  # type: ignore[arg-type]

    assert len(asyncio.run(run())) == 4
    assert sorted(client.sent) == [
        ("prompt 0", False),
        ("prompt 0", True),
        ("prompt 1", False),
        ("prompt 1", True),
    ]
    assert [c for _, c in client.sent[:2]] == [False, False]  # the first choices go together, first


class RefusingClient(RecordingClient):
    """Refuses every prompt's first request, as a stopping run refuses a new call."""

    async def stream(
        self, prompt: Any, *, messages: Any = None, **sampling: Any
    ) -> AsyncIterator[StreamDelta]:
        self.sent.append((prompt, sampling.get("continues", False)))
        await asyncio.sleep(0)
        raise ServerUnavailable("server is shutting down")
        yield  # an async generator, as the SDK's stream


def test_a_refused_first_choice_sends_no_other() -> None:
    """The call fails with its first choice's refusal; its other choices are not sent at all
    (as continuations, a stopping run would take them for nothing)."""
    client = RefusingClient()
    jobs = [Job(j, 0, "prompt", None, {}) for j in range(4)]

    async def run() -> list[tuple[int, StreamDelta]]:
        return [item async for item in run_jobs(client, jobs)]  # type: ignore[arg-type]

    with pytest.raises(ServerUnavailable, match="shutting down"):
        asyncio.run(run())
    assert client.sent == [("prompt", False)]


# -- a real run -----------------------------------------------------------------------------------

# Long enough (about 15 s on 2 cores) that the search goes on well past the gateway's own
# graceful stop (STOP_GRACE_S, then SIGKILL), had the drain ended between two of its steps.
BEAM_TOKENS = 1500


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    return post_json(f"http://127.0.0.1:{port}", path, body, timeout_s=300)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_beam_search_under_way_at_sigterm_finishes_and_new_calls_are_refused(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    port = free_port()
    overrides = (f"model.path={tiny_model_dir}", f"gateway.port={port}", "supervisor.drain_timeout_s=120")
    with brigade_run(tmp_path / "run", *overrides) as run:
        body = {
            "model": str(tiny_model_dir),
            "prompt": "Once upon a time",
            "n": 3,
            "max_tokens": BEAM_TOKENS,
            "ignore_eos": True,  # every beam runs its whole length: the search takes its time
            "use_beam_search": True,
            "return_token_ids": True,
        }
        status, calm = post(port, "/v1/completions", body)
        assert status == 200, calm
        outcome: list[tuple[int, dict, float]] = []

        def search() -> None:
            try:
                status, reply = post(port, "/v1/completions", body)
            except (OSError, http.client.HTTPException) as exc:  # the gateway stopped under it
                status, reply = 0, {"error": repr(exc)}
            outcome.append((status, reply, time.time()))

        thread = threading.Thread(target=search)
        thread.start()
        # Once the gateway counts it (its heartbeat, every half second), with most of its steps to go.
        deadline = time.monotonic() + 60
        while not any(row["kind"] == "gateway" and row["queue_depth"] for row in run.read_status()):
            assert time.monotonic() < deadline, "the gateway never counted the search"
            time.sleep(0.05)
        sigterm_at = time.time()
        run.process.send_signal(signal.SIGTERM)
        run.wait_for_line("signal received: draining", 30)
        # A new call is refused while the search goes on (once the gateway has the Shutdown).
        deadline = time.monotonic() + 10
        while True:
            status, refused = post(
                port, "/v1/completions", {**body, "use_beam_search": False, "max_tokens": 1}
            )
            if status != 200 or time.monotonic() > deadline:
                break
        assert status == 503 and "shutting down" in refused["error"]["message"], refused
        status, refused = post(port, "/v1/completions", {**body, "max_tokens": 2})  # a new search
        assert status == 503 and "shutting down" in refused["error"]["message"], refused
        thread.join(300)
        assert outcome, "the search did not end"
        status, reply, replied_at = outcome[0]
        assert status == 200, reply
        assert replied_at > sigterm_at + 1.0, "the search ended too soon to say that the drain kept it"
        assert [c["token_ids"] for c in reply["choices"]] == [c["token_ids"] for c in calm["choices"]]
        assert [c["text"] for c in reply["choices"]] == [c["text"] for c in calm["choices"]]
        run.wait_for_line("drained: nothing in flight", 60)
        assert run.process.wait(120) == 0
