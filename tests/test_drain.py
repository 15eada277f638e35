"""What a stopping run lets finish (supervisor.py `Supervisor.drain`): every call admitted before
the drain, including the later requests of a call made of several (a beam search's steps, the
choices sent after a prompt's first, an embedding call's later windows: m.Generate.continues),
while new calls are refused. The drain's own logic against stage handles fed scripted loads,
and a gateway's later choices against a recording client."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

from client.sdk import StreamDelta
from ipc import messages as m
from ipc.config import load_config
from services.gateway.jobs import Job
from services.gateway.runner import run_jobs
from supervision.stages import StageHandle
from supervisor import Supervisor

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


def beat(handle: StageHandle, num_in_flight: int) -> None:
    load = m.StageLoad(num_in_flight=num_in_flight)
    handle.on_heartbeat(m.Heartbeat(handle.name, 1, 0, False, load), time.monotonic())


class Stages:
    def __init__(self, *handles: StageHandle) -> None:
        self.handles = handles

    def of_kind(self, kind: str) -> list[StageHandle]:
        return [h for h in self.handles if h.kind == kind]


def drain(
    handles: list[StageHandle],
    rounds: list[Callable[[], None]],
    timeout_s: float = 5.0,
    queued: Callable[[], None] = lambda: None,
) -> tuple[int, list[str]]:
    """Run `Supervisor.drain` over `handles`. `queued`: the heartbeats sent before the drain
    began and still in the control socket, which its first read takes; each later read (the
    drain's rounds) runs the next of `rounds`, the heartbeats that came meanwhile (none once they
    are used up). Returns how many rounds it made and the commands it sent, by stage."""
    config = load_config(None, [f"supervisor.drain_timeout_s={timeout_s}"])
    script = iter(rounds)
    reads = 0
    sent: list[str] = []

    def read_control(timeout: float) -> None:
        nonlocal reads, queued
        queued, first = (lambda: None), queued
        first()
        if timeout:
            reads += 1
            next(script, lambda: time.sleep(0.01))()

    supervisor = SimpleNamespace(
        config=config,
        stages=Stages(*handles),
        signals=[signal.SIGTERM],
        read_control=read_control,
        command=lambda handle, message: sent.append(f"{handle.name}: {type(message).__name__}"),
    )
    Supervisor.drain(supervisor)  # type: ignore[arg-type]
    return reads, sent


def test_the_drain_waits_for_a_gateways_call_between_two_of_its_requests() -> None:
    """Between two steps of a beam search no tokenizer holds any of it: only the gateway knows
    that the call goes on, and the drain ends once the gateway has nothing in flight either."""
    tokenizer, gateway = stage("tokenizer-0", "tokenizer"), stage("gateway-0", "gateway")
    rounds = [lambda: (beat(tokenizer, 0), beat(gateway, 1))] * 3 + [lambda: beat(gateway, 0)]
    reads, sent = drain([tokenizer, gateway], rounds)
    assert reads == 4
    assert sent == ["tokenizer-0: Shutdown"]  # the gateways take no Shutdown: they go on serving


def test_the_drain_believes_no_load_sent_before_it_began() -> None:
    """Both stages said 0 a moment before the drain (their heartbeats still in the socket as it
    begins): a call admitted since would not show in it. The drain ends once each has said 0
    again."""
    tokenizer, gateway = stage("tokenizer-0", "tokenizer"), stage("gateway-0", "gateway")
    rounds = [lambda: None, lambda: beat(tokenizer, 0), lambda: None, lambda: beat(gateway, 0)]
    reads, _ = drain([tokenizer, gateway], rounds, queued=lambda: (beat(tokenizer, 0), beat(gateway, 0)))
    assert reads == 4


def test_a_stage_that_is_down_is_not_waited_for() -> None:
    tokenizer, gateway = stage("tokenizer-0", "tokenizer"), stage("gateway-0", "gateway")
    gateway.is_ready = False  # exited and waiting to restart: it will not report
    reads, _ = drain([tokenizer, gateway], [lambda: beat(tokenizer, 0)])
    assert reads == 1


def test_the_deadline_and_a_second_signal_still_end_the_drain() -> None:
    tokenizer, gateway = stage("tokenizer-0", "tokenizer"), stage("gateway-0", "gateway")
    started = time.monotonic()
    drain([tokenizer, gateway], [lambda: (beat(tokenizer, 0), beat(gateway, 1))] * 1000, timeout_s=0.3)
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
