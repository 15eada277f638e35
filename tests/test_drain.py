"""What a stopping run lets finish (supervisor.py `Supervisor.drain`): every call admitted before
the drain, including the later requests of a call made of several (a beam search's steps, the
choices sent after a prompt's first, an embedding call's later windows: m.Generate.continues),
while new calls are refused. A gateway's later choices against a recording client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from client.sdk import StreamDelta
from ipc import messages as m
from services.gateway.jobs import Job
from services.gateway.runner import run_jobs

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
