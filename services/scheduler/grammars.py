"""Structured output in the scheduler: each constrained request's grammar, compiled off the hot path,
and the bitmask rows of its matcher in the step plans (docs/structured_output.md).

- A constrained request waits for its compile in `SchedulerState.compiling`, outside the waiting
  queue, so it holds up no other request; a cached grammar (the same constraint text, or a request
  resubmitted after a fault) is ready at once and queues like any other.
- Its `GrammarMatcher` is built from its output tokens so far, so a resubmission after any fault
  (worker, scheduler, tokenizer) continues in exactly the state the lost one had, and advances with
  each token the request appends (`Results.update`).
- A step's plan carries a bitmask row only for the constrained rows that sample in it
  (`GrammarPlan`), filled by the engine's threads straight into the step-ring slot.

A constrained row's mask needs the token its previous step samples, so such a row is never planned
ahead of that sample (services/scheduler/decode.py): while one runs, the pipeline plans each step
after the previous one's result, as it does for penalty rows.

allowed_token_ids (vLLM's) take the same path: a request's ids become one packed row at admission
(`allowed_mask`, Request.allowed_mask), which is its row in every step it samples in, AND-ed into
its grammar's where it has one. That row does not depend on the last token, so a request with
allowed_token_ids alone is planned ahead like any other. The worker masks, samples and reports
logprobs exactly as for a grammar's rows (services/gpu_worker/sampler.py): logprobs stay those of
the raw logits. A row that the grammar, allowed_token_ids, bad words and min_tokens together leave
with no token fails its request, saying so (`GrammarPlan.empty`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ipc.messages import StructuredOutput
from ipc.step_plan import SlotSink, vocab_words
from services.common.grammar_compiler import CompiledGrammar, GrammarCompiler, GrammarError
from services.scheduler.grammar_matcher import BitmaskFiller, GrammarMatcher, GrammarViolation
from services.scheduler.request import Request


class Grammars:
    """The compiler (cache included) and the bitmask filler of one scheduler."""

    def __init__(
        self, compiler: GrammarCompiler, vocab_size: int, filler: BitmaskFiller | None = None
    ) -> None:
        self.compiler = compiler
        self.words = vocab_words(vocab_size)
        self.filler = filler if filler is not None else BitmaskFiller()

    def submit(self, spec: StructuredOutput) -> Future[CompiledGrammar]:
        return self.compiler.submit(spec)

    def close(self) -> None:
        self.compiler.close()


def matcher_for(req: Request, future: Future[CompiledGrammar]) -> GrammarMatcher:
    """The request's matcher from its finished compile, advanced through its outputs so far.
    Raises GrammarError: the constraint does not compile, or the outputs do not follow it."""
    try:
        compiled = future.result()
    except Exception as exc:  # GrammarError, or whatever else the engine raised while compiling
        raise GrammarError(f"structured.{exc}") from None
    try:
        return GrammarMatcher(compiled, req.output_ids)
    except GrammarViolation as exc:
        raise GrammarError(f"structured: the output_ids do not follow the constraint: {exc}") from None


def allowed_mask(token_ids: Sequence[int], words: int) -> np.ndarray:
    """A bitmask row (the grammar matcher's layout) allowing exactly `token_ids`."""
    allowed = np.zeros(32 * words, np.bool_)
    allowed[np.asarray(token_ids, np.int64)] = True
    return np.packbits(allowed, bitorder="little").view(np.int32)


def is_allowed(mask: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Whether each of `tokens` is allowed by the bitmask row `mask`."""
    ids = tokens.astype(np.int64)
    return ((mask.view(np.uint32)[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(np.bool_)


def _clear(row: np.ndarray, token_ids: Sequence[int]) -> None:
    """Disallow `token_ids` in a bitmask row, in place."""
    ids = np.asarray(token_ids, np.int64)
    bits = np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
    np.bitwise_and.at(row.view(np.uint32), ids >> 5, ~bits)


def _no_token_message(req: Request, position: int, bans: Sequence[int], eos_token_ids: Sequence[int]) -> str:
    """Why a row had nothing to sample, naming what together allowed nothing (the first named
    leads, so that the gateway names it as the request's field)."""
    p = req.params
    held = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    causes = []
    if p.allowed_token_ids is not None:
        causes.append("allowed_token_ids")
    if req.grammar is not None:
        causes.append(f"structured.{p.structured.kind}" if p.structured is not None else "the grammar")
    if req.bad_words is not None:
        causes.append("bad_words")
    if p.min_tokens > position and held & set(bans):
        causes.append("min_tokens")
    listed = causes[0] if len(causes) == 1 else f"{', '.join(causes[:-1])} and {causes[-1]}"
    return (
        f"{causes[0]}: no token is left to sample at output position {position}: {listed} together allow none"
    )


@dataclass(slots=True)
class GrammarPlan:
    """The bitmask arrays of one step: `rows` are plan indices of masked sampled rows (a row
    that verifies proposals once per verified position; `proposed[i]`: entry i's proposals, empty
    for a row that samples one token). A row is masked by its grammar (`matchers[i]`), by its
    allowed_token_ids (`statics[i]`, the same at every position), or both: the AND of the two.
    `bans[i]` are the tokens its logit bias sets to -inf at its sample position (bad words, eos
    and stop ids under min_tokens); they are cleared from its rows too, so that a row left with no
    token at all is seen here: it is given every token instead (its draw goes nowhere, and
    sampling stays well defined) and the request fails with `empty[plan index] = (position in
    the span, message)` (services/scheduler/results.py)."""

    rows: np.ndarray  # [C] int32
    seqs: list[Request]
    plan_indices: list[int]
    matchers: list[GrammarMatcher | None]
    statics: list[np.ndarray | None]
    bans: list[list[int]]
    proposed: list[np.ndarray]
    positions: list[int]  # each entry's output position (its span's first)
    words: int
    filler: BitmaskFiller | None
    eos_token_ids: tuple[int, ...]
    empty: dict[int, tuple[int, str]] = field(default_factory=dict)

    def write(self, slot: SlotSink) -> None:
        """Into the slot in place: the rows, then each entry's bitmask rows (no copy)."""
        slot.alloc("grammar_rows", np.dtype(np.int32), self.rows.shape)[:] = self.rows
        self._fill(slot.alloc("grammar_bitmask", np.dtype(np.int32), (len(self.rows), self.words)))

    def arrays(self) -> dict[str, np.ndarray]:
        """The same arrays in memory of their own (tests and benchmarks)."""
        bitmask = np.zeros((len(self.rows), self.words), np.int32)
        self._fill(bitmask)
        return {"grammar_rows": self.rows.copy(), "grammar_bitmask": bitmask}

    def _fill(self, bitmask: np.ndarray) -> None:
        """One grammar mask per plain row, all of them at once on the engine's threads; then each
        verifying row's span of grammar masks, one after another (each position's matcher state
        follows the last); then each entry's static mask and bans over its rows."""
        self.empty = {}
        counts = [len(p) + 1 for p in self.proposed]
        firsts = np.cumsum([0, *counts[:-1]]).tolist()
        plain = [i for i, n in enumerate(counts) if n == 1 and self.matchers[i] is not None]
        if plain:
            assert self.filler is not None  # a matcher comes with the engine's grammars
            self.filler.fill(bitmask, [self.matchers[i] for i in plain], [firsts[i] for i in plain])
        for i, (n, first) in enumerate(zip(counts, firsts, strict=True)):
            matcher, static, bans = self.matchers[i], self.statics[i], self.bans[i]
            span = bitmask[first : first + n]
            if matcher is None:
                span[:] = static
            else:
                if n > 1:
                    assert self.filler is not None
                    self.filler.fill_span(bitmask, first, matcher, self.proposed[i])
                if static is not None:
                    span &= static
            if bans:
                for row in span:
                    _clear(row, bans)
            if bans or (matcher is not None and static is not None):
                self._check_empty(i, span)

    def _check_empty(self, i: int, span: np.ndarray) -> None:
        for m, row in enumerate(span):
            if not row.any():
                position = self.positions[i] + m
                self.empty[self.plan_indices[i]] = (
                    m,
                    _no_token_message(self.seqs[i], position, self.bans[i], self.eos_token_ids),
                )
                span[m:] = -1  # every token: the draw goes nowhere, and stays well defined
                return


NO_PROPOSALS = np.zeros(0, np.int32)


def plan_grammar(
    grammars: Grammars | None,
    words: int,
    seqs: list[Request],
    masked: np.ndarray,
    is_sampled: np.ndarray,
    sample_positions: np.ndarray,
    eos_token_ids: tuple[int, ...],
    num_decodes: int = 0,
    proposals: Sequence[np.ndarray] = (),
) -> GrammarPlan | None:
    """The bitmask arrays of a step whose sequences `seqs` have these per-row flags (`masked`: a
    grammar or allowed_token_ids; the entries from `num_decodes` on verifying `proposals`) and
    sample positions (context lengths); None when no sampled row is masked. Each matcher must
    stand at the token its row samples: one planned ahead of its previous sample would get the
    mask of the wrong position. A static mask holds at any position."""
    picked = np.flatnonzero(masked & is_sampled)
    if not len(picked) or not words:
        return None
    matchers, statics, bans, proposed, positions = [], [], [], [], []
    for i in picked.tolist():
        req = seqs[i]
        matcher = req.grammar
        if matcher is None and req.allowed_mask is None:
            raise RuntimeError(
                f"request {req.request_id!r}: a masked row without a grammar or allowed tokens"
            )
        if matcher is not None and matcher.num_tokens != req.num_output_tokens:
            raise RuntimeError(f"request {req.request_id!r}: its grammar is not at its next token")
        matchers.append(matcher)
        statics.append(req.allowed_mask)
        always = req.bad_words.always if req.bad_words is not None else []
        bans.append([*always, *req.bans(int(sample_positions[i]), eos_token_ids)])
        verifies = num_decodes <= i < num_decodes + len(proposals)
        proposed.append(proposals[i - num_decodes] if verifies else NO_PROPOSALS)
        # A verifying row's sample position is its span's last (plan.py `_build`).
        positions.append(int(sample_positions[i]) - len(proposed[-1]) - req.num_prompt_tokens)
    rows = np.repeat(picked, [len(p) + 1 for p in proposed]).astype(np.int32)
    return GrammarPlan(
        rows,
        [seqs[i] for i in picked.tolist()],
        picked.tolist(),
        matchers,
        statics,
        bans,
        proposed,
        positions,
        words,
        grammars.filler if grammars is not None else None,
        eos_token_ids,
    )
