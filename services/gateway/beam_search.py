"""vLLM's beam search (`use_beam_search`), run by the gateway over one-token requests.

As vLLM's OpenAI server runs it (in its frontend, not its engine): each step sends every live beam
as a request of `max_tokens` 1 asking for the top 2 x width logprobs, its prompt the prompt's token
ids and the beam's output so far, so that the prefix cache spares all but the last tokens. A
beam's candidates are the beam and one of those tokens; a candidate ending in eos (unless
`ignore_eos`) is complete, the others compete by cumulative logprob for the `width` places of the
next step. The search ends at `max_tokens`, at max_model_len, or when no beam is left; then the
complete and the live beams are ranked by `cumulative_logprob / seq_len ** length_penalty`
(seq_len: prompt and output tokens, less one for a last eos) and the best `width` are the choices.

Beam search samples nothing: every step runs greedily whatever the request's temperature, top_p,
top_k, min_p or seed. The first step of each prompt sends it as the request gave it (text,
token ids or a chat) and takes back its token ids; every later step sends token ids, so nothing
is rendered or tokenized again, and goes as a continuation of a call the run admitted
(m.Generate.continues), so that a run stopping meanwhile finishes the search. Each step's
requests wait at most STEP_TIMEOUT_S; an error of any of them fails the whole search, and the
others are aborted, as they are when the client goes away (cancelling the feed cancels every
step in flight, and the SDK aborts a cancelled request).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from client.async_sdk import AsyncClient
from client.errors import BrigadeError
from client.sdk import StreamDelta
from ipc import messages as m
from ipc.validation import MAX_LOGPROBS, MAX_MAX_TOKENS
from services.common.text import Tokenizer
from services.gateway.errors import invalid
from services.gateway.protocol import SamplingFields

T = TypeVar("T")


class Job(Protocol):
    """What a search reads of a choice's job (jobs.Job, which plans the search: jobs.py imports
    this module, so it is not imported here)."""

    prompt_index: int
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    sampling: dict[str, Any]


# Each step asks the engine for 2 x width logprobs, and it gives at most MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
# seq_len ** length_penalty stays a finite float for any context length up to 2**60 tokens.
MAX_ABS_LENGTH_PENALTY = 10.0
# One step's requests, queueing and prefill included (the first step prefills the whole prompt).
STEP_TIMEOUT_S = 300.0
# What a step's requests take from the request's own: where and for whom they run.
STEP_FIELDS = ("adapter", "priority", "cache_salt")
# Only the first step's request carries the prompt as the client gave it; these shape it.
FIRST_STEP_FIELDS = ("truncate_prompt_tokens", "chat_template_kwargs", "continue_final_message",
                     "add_generation_prompt")  # fmt: skip


@dataclass(frozen=True)
class BeamSearch:
    """A request's beam search: `width` beams (its `n`), ranked with `length_penalty`."""

    width: int
    length_penalty: float
    ignore_eos: bool
    max_tokens: int | None  # None: the tokenizer's default_max_tokens (a chat's), as for a sampled reply
    num_logprobs: int  # asked of each step: the 2 x width candidates, or the reply's top-N if more
    skip_special_tokens: bool
    top_n: int = 0  # the reply's top logprobs a token: all a beam keeps of each step's


def beam_search_of(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    max_tokens_field: str,
    top_n: int,
    constrained_by: str,
) -> BeamSearch | None:
    """The request's beam search (None: it asks for none), checked: a field that beams cannot
    honour is refused by name rather than ignored. `top_n`: the logprobs the reply wants."""
    penalty = 1.0 if req.length_penalty is None else req.length_penalty
    if not req.use_beam_search:
        if penalty != 1.0:
            raise invalid(
                "length_penalty applies only to beam search (use_beam_search: true)", "length_penalty"
            )
        return None
    if not math.isfinite(penalty) or abs(penalty) > MAX_ABS_LENGTH_PENALTY:
        raise invalid(
            f"length_penalty must be in [-{MAX_ABS_LENGTH_PENALTY:g}, {MAX_ABS_LENGTH_PENALTY:g}], got {penalty}",
            "length_penalty",
        )
    if not 1 <= req.n <= MAX_BEAM_WIDTH:
        raise invalid(
            f"n is the beam width with use_beam_search; each step scores 2 x n candidates a beam from "
            f"the engine's top logprobs, of which it gives at most {MAX_LOGPROBS}: n must be in "
            f"[1, {MAX_BEAM_WIDTH}], got {req.n}",
            "n",
        )
    if max_tokens is not None and not 1 <= max_tokens <= MAX_MAX_TOKENS:
        raise invalid(
            f"{max_tokens_field} must be in [1, {MAX_MAX_TOKENS}], got {max_tokens}", max_tokens_field
        )
    for name in _unservable(req, constrained_by):
        raise invalid(f"{name} is not supported with use_beam_search", name)
    return BeamSearch(
        req.n, penalty, req.ignore_eos, max_tokens, max(2 * req.n, top_n), req.skip_special_tokens, top_n
    )


def _unservable(req: SamplingFields, constrained_by: str) -> list[str]:
    """The fields set that beam search cannot honour: each step reads the raw distribution's top
    tokens, before any penalty, bias or mask, and no text exists until the search ends."""
    given = {
        "stream": req.stream,  # no beam is final before the last step (vLLM refuses it too)
        "echo": getattr(req, "echo", False),
        "prompt_logprobs": req.prompt_logprobs is not None,
        "stop": req.stop not in (None, []),
        "stop_token_ids": bool(req.stop_token_ids),
        "min_tokens": bool(req.min_tokens),
        "presence_penalty": bool(req.presence_penalty),
        "frequency_penalty": bool(req.frequency_penalty),
        "repetition_penalty": req.repetition_penalty not in (None, 1.0),
        "logit_bias": bool(req.logit_bias),
        "allowed_token_ids": req.allowed_token_ids is not None,
        "bad_words": bool(req.bad_words),
        constrained_by: bool(constrained_by),
        "tools": getattr(req, "tools", None) is not None,
        # every beam comes at the search's end: an output's time and rate would mean nothing
        "timings_per_token": req.timings_per_token,
    }
    return [name for name, is_set in given.items() if is_set]


@dataclass
class Beam:
    """One hypothesis: its output so far, each token's logprob and that step's top logprobs."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative: float = 0.0
    finish_reason: str | None = None  # "stop": it ended in eos; None while live


def score(beam: Beam, num_prompt: int, eos_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's (and HF's) length-normalized score: a last eos does not count in the length."""
    seq_len = num_prompt + len(beam.tokens)
    if beam.tokens and beam.tokens[-1] in eos_ids:
        seq_len -= 1
    return beam.cumulative / seq_len**length_penalty


def advance(
    live: list[Beam], tops: Sequence[dict[int, float]], completed: list[Beam], search: BeamSearch,
    eos_ids: frozenset[int], num_prompt: int,
) -> tuple[list[Beam], list[Beam]]:  # fmt: skip
    """One step: the next live beams (the best `width` by score, as vLLM ranks them: all of one
    length, so by cumulative logprob, but for an eos kept live by ignore_eos, which does not count
    in the length) and the completed ones, from each live beam's top logprobs (`tops`, in the
    same order)."""
    candidates: list[tuple[float, int, int, float, dict[int, float]]] = []
    completed = list(completed)
    for i, (beam, top) in enumerate(zip(live, tops, strict=True)):
        ranked = sorted(top.items(), key=lambda x: -x[1])
        kept = dict(ranked[: search.top_n])  # not the whole of every step: a beam may run long
        # The top 2 x width only, as vLLM: more (for the reply's top-N) would admit other eos candidates.
        for token, logprob in ranked[: 2 * search.width]:
            if token in eos_ids and not search.ignore_eos:
                completed.append(_child(beam, kept, token, logprob, "stop"))
            else:
                seq_len = num_prompt + len(beam.tokens) + (token not in eos_ids)
                score_of = (beam.cumulative + logprob) / seq_len**search.length_penalty
                candidates.append((score_of, i, token, logprob, kept))
    candidates.sort(key=lambda x: -x[0])  # stable: ties keep the beams' and the tokens' order
    next_live = [
        _child(live[i], kept, token, logprob) for _, i, token, logprob, kept in candidates[: search.width]
    ]
    # A complete beam's score never changes: only the best `width` can ever be returned.
    completed.sort(key=lambda b: -score(b, num_prompt, eos_ids, search.length_penalty))
    return next_live, completed[: search.width]


def _child(beam: Beam, top: dict[int, float], token: int, logprob: float, reason: str | None = None) -> Beam:
    return Beam(
        [*beam.tokens, token], [*beam.logprobs, logprob], [*beam.top_logprobs, top],
        beam.cumulative + logprob, reason,
    )  # fmt: skip


@dataclass
class _StepOutput:
    top: dict[int, float]
    prompt_ids: list[int] | None
    usage: m.Usage | None


async def _step(
    client: AsyncClient, prompt: Any, messages: list[dict[str, Any]] | None, sampling: dict[str, Any]
) -> _StepOutput:
    """One beam's next-token distribution (its top logprobs), from a request of one token."""
    top: dict[int, float] | None = None
    prompt_ids, usage = None, None
    stream = client.stream(prompt, messages=messages, timeout=STEP_TIMEOUT_S, **sampling)
    async with contextlib.aclosing(stream):
        async for delta in stream:
            if delta.top_logprobs:
                top = delta.top_logprobs[0]
            prompt_ids = delta.prompt_token_ids or prompt_ids
            usage = delta.usage or usage
    if not top:  # every generating request with logprobs > 0 brings them: a broken reply
        raise BrigadeError("internal error: a beam search step came back without its top logprobs")
    return _StepOutput(top, prompt_ids, usage)


async def _all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result, or the first error; either way none is left running (a cancelled step
    aborts its request)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Found:
    prompt_ids: list[int]
    beams: list[Beam]  # best first
    cached_tokens: int


async def _search(
    client: AsyncClient,
    job: Job,
    search: BeamSearch,
    eos_ids: frozenset[int],
    max_model_len: int,
    max_tokens: int,
) -> _Found:
    """The best `width` beams of one prompt."""
    step = {name: job.sampling[name] for name in STEP_FIELDS if name in job.sampling}
    # Greedy (the logprobs are the raw distribution's either way), and no draft model for one token.
    step.update(max_tokens=1, temperature=0.0, logprobs=search.num_logprobs, speculate=False)
    first_step = {name: job.sampling[name] for name in FIRST_STEP_FIELDS if name in job.sampling}
    first = await _step(client, job.prompt, job.messages, {**step, **first_step, "return_prompt_ids": True})
    if first.prompt_ids is None:
        raise BrigadeError("internal error: a beam search's first step came back without its prompt's ids")
    prompt_ids = np.asarray(first.prompt_ids, dtype=np.int32)
    num_prompt = len(prompt_ids)
    # The engine takes prompts of at most max_model_len - 1 tokens: a beam that long ends there.
    num_steps = min(max_model_len - num_prompt, max_tokens)
    live, completed = advance([Beam()], [first.top], [], search, eos_ids, num_prompt)
    # The run admitted the search with its first step: a stopping run takes the next ones
    # (m.Generate.continues), so that the search ends as it would have, not with a 503 midway.
    later = {**step, "continues": True}
    for _ in range(num_steps - 1):
        if not live:
            break
        outputs = await _all(
            _step(client, np.concatenate((prompt_ids, np.asarray(beam.tokens, np.int32))), None, later)
            for beam in live
        )
        live, completed = advance(live, [o.top for o in outputs], completed, search, eos_ids, num_prompt)
    for beam in live:
        beam.finish_reason = "length"
    ranked = sorted(completed + live, key=lambda b: -score(b, num_prompt, eos_ids, search.length_penalty))
    cached = first.usage.cached_tokens if first.usage is not None else 0
    return _Found(first.prompt_ids, ranked[: search.width], cached)


async def beam_search_feed(
    client: AsyncClient, jobs: list[Job], search: BeamSearch, tokenizer: Tokenizer, max_model_len: int,
    default_max_tokens: int,
) -> AsyncIterator[tuple[int, StreamDelta]]:  # fmt: skip
    """Each prompt's beams as (choice index, its whole output in one delta), best first, as
    run_jobs feeds a request's choices: the prompts are searched side by side, and the choices
    come once every search has ended."""
    leaders: dict[int, Job] = {}
    for job in jobs:
        leaders.setdefault(job.prompt_index, job)
    eos_ids = frozenset(tokenizer.eos_token_ids)
    max_tokens = search.max_tokens if search.max_tokens is not None else default_max_tokens
    found = await _all(
        _search(client, job, search, eos_ids, max_model_len, max_tokens) for job in leaders.values()
    )
    # The texts decoded off the event loop: width x prompts outputs of up to max_model_len tokens.
    texts = await asyncio.to_thread(
        lambda: [[tokenizer.decode(b.tokens, search.skip_special_tokens) for b in f.beams] for f in found]
    )
    for (prompt_index, job), result, beam_texts in zip(leaders.items(), found, texts, strict=True):
        if len(result.beams) != search.width:  # each step admits at least 2 x width candidates
            raise BrigadeError(
                f"internal error: beam search found {len(result.beams)} of {search.width} beams"
            )
        asked_prompt_ids = bool(job.sampling.get("return_prompt_ids"))
        for rank, (beam, text) in enumerate(zip(result.beams, beam_texts, strict=True)):
            usage = m.Usage(len(result.prompt_ids), len(beam.tokens), result.cached_tokens)
            delta = StreamDelta(
                text, beam.tokens, beam.logprobs, beam.finish_reason or "length", usage, beam.top_logprobs,
                prompt_token_ids=result.prompt_ids if asked_prompt_ids else None,
            )  # fmt: skip
            yield prompt_index * search.width + rank, delta
