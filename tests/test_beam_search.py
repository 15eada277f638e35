"""The gateway's beam search (services/gateway/beam_search.py) against a scripted client: an error
of one beam's step fails the whole search at once, and neither that nor a cancelled search (its
client gone) leaves any step request running. Its results against HF transformers' are
tests/test_gateway.py's (test_beam_search_*), on a served model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from client.errors import BrigadeError, InvalidRequest
from client.sdk import StreamDelta
from ipc import messages as m
from services.gateway.beam_search import STEP_TIMEOUT_S, Beam, BeamSearch, advance, beam_search_feed
from services.gateway.jobs import Job

PROMPT = [10, 11, 12]
EOS = 2


class FakeTokenizer:
    eos_token_ids = (EOS,)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == EOS))


class ScriptedClient:
    """Answers each step with the same top logprobs (token 100 + k at -k - 1). At `fail_at`
    tokens of output, the beam that ends in 101 raises `error` and the others never answer; at
    `hang_at`, none answers. Counts the streams open."""

    def __init__(
        self, fail_at: int | None = None, hang_at: int | None = None, error: Exception | None = None
    ):
        self.fail_at, self.hang_at = fail_at, hang_at
        self.error = error or InvalidRequest("prompt: refused")
        self.num_open = 0
        self.num_started = 0
        self.timeouts: list[float | None] = []
        self.continues: list[bool] = []  # each step's m.Generate.continues, as sent
        self.all_hanging = asyncio.Event()
        self.num_hanging = 0

    async def stream(self, prompt: Any, *, messages: Any = None, timeout: float | None = None,
                     **sampling: Any) -> AsyncIterator[StreamDelta]:  # fmt: skip
        self.num_open += 1
        self.num_started += 1
        self.timeouts.append(timeout)
        self.continues.append(sampling.get("continues", False))
        try:
            ids = list(prompt)
            output = len(ids) - len(PROMPT)
            if output == self.fail_at and ids[-1] == 101:
                await asyncio.sleep(0.01)
                raise self.error
            if output in (self.fail_at, self.hang_at):
                self.num_hanging += 1
                await asyncio.Event().wait()
            top = {100 + k: -float(k + 1) for k in range(sampling["logprobs"])}
            yield StreamDelta(
                "x", [100], [-1.0], "length", m.Usage(len(ids), 1), [top],
                prompt_token_ids=ids if sampling.get("return_prompt_ids") else None,
            )  # fmt: skip
        finally:
            self.num_open -= 1


def search(width: int = 3, max_tokens: int | None = 5) -> BeamSearch:
    return BeamSearch(width, 1.0, False, max_tokens, 2 * width, True)


async def run(
    client: ScriptedClient, width: int = 3, max_tokens: int | None = 5
) -> list[tuple[int, StreamDelta]]:
    jobs = [Job(j, 0, list(PROMPT), None, {"return_prompt_ids": False}) for j in range(width)]
    feed = beam_search_feed(client, jobs, search(width, max_tokens), FakeTokenizer(), 1024, 3)  # type: ignore[arg-type]
    async with contextlib.aclosing(feed):
        return [item async for item in feed]


def test_every_step_has_a_deadline_and_the_beams_come_best_first() -> None:
    client = ScriptedClient()
    out = asyncio.run(run(client))
    assert [index for index, _ in out] == [0, 1, 2]
    cumulative = [sum(delta.logprobs or []) for _, delta in out]
    assert cumulative == sorted(cumulative, reverse=True) and cumulative[0] == -5.0  # token 100 five times
    assert all(delta.finish_reason == "length" and len(delta.token_ids) == 5 for _, delta in out)
    assert client.num_started == 1 + 4 * 3 and client.timeouts == [STEP_TIMEOUT_S] * client.num_started
    assert client.num_open == 0


def test_every_step_after_the_first_continues_the_admitted_search() -> None:
    """The first step is the call's first request, which a stopping run refuses; the later ones
    continue it (m.Generate.continues), which a stopping run takes: a search under way finishes."""
    client = ScriptedClient()
    asyncio.run(run(client))
    assert client.continues == [False] + [True] * 4 * 3


def test_without_max_tokens_it_searches_as_far_as_the_tokenizers_default() -> None:
    out = asyncio.run(run(ScriptedClient(), width=2, max_tokens=None))  # the default given is 3
    assert [len(delta.token_ids) for _, delta in out] == [3, 3]


@pytest.mark.parametrize("error", [InvalidRequest("prompt: refused"), BrigadeError("engine gone")])
def test_an_error_of_one_beam_fails_the_search_and_aborts_the_other_beams(error: Exception) -> None:
    """One beam's step fails while the others' wait: the error ends the search at once, as it
    is (the gateway answers it with its status), and the other steps are closed, none sent after."""
    client = ScriptedClient(fail_at=2, error=error)
    with pytest.raises(type(error), match=str(error)):
        asyncio.run(failed(client))
    assert client.num_started == 1 + 3 + 3  # the first step, then 3 beams' twice


async def failed(client: ScriptedClient) -> None:
    """Run a search that fails; raise its error once sure that no step is left open (asked here,
    in the loop: asyncio.run would cancel what is left itself)."""
    try:
        await asyncio.wait_for(run(client), 10)
    finally:
        await asyncio.sleep(0.05)  # what was not cancelled would still be waiting
        assert client.num_open == 0


def test_a_bug_in_a_step_fails_the_search_without_orphans() -> None:
    client = ScriptedClient(fail_at=1, error=RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(failed(client))


def test_a_cancelled_search_closes_every_step_in_flight() -> None:
    """The client went away while every beam's step waits: cancelling the feed's consumer (as the
    gateway's disconnect watch does) closes each step's stream (the SDK aborts its request)."""
    client = ScriptedClient(hang_at=1)

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(run(client))
        while client.num_hanging < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert client.num_open == 0 and client.num_started == 4

    asyncio.run(asyncio.wait_for(cancel_midway(), 10))


def test_live_beams_are_ranked_by_score_as_vllm_ranks_them() -> None:
    """With ignore_eos an eos stays live, and its eos does not count in its length (vLLM's
    sort key): of eos at -5.0 and token 7 at -5.4 after 9 prompt tokens, 7 scores -5.4 / 10 and
    eos -5.0 / 9, so 7 is kept though its cumulative logprob is lower."""
    search = BeamSearch(1, 1.0, True, 4, 2, True)
    live, completed = advance([Beam()], [{EOS: -5.0, 7: -5.4}], [], search, frozenset({EOS}), 9)
    assert [beam.tokens for beam in live] == [[7]] and completed == []
    search = BeamSearch(1, 0.0, True, 4, 2, True)  # no length penalty: by cumulative logprob
    live, _ = advance([Beam()], [{EOS: -5.0, 7: -5.4}], [], search, frozenset({EOS}), 9)
    assert [beam.tokens for beam in live] == [[EOS]]
