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
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

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


@dataclass(slots=True)
class GrammarPlan:
    """The grammar arrays of one step: `rows` are plan indices of constrained sampled rows, a row
    that verifies proposals once per verified position (`proposed[i]`: matchers[i]'s proposals,
    empty for a row that samples one token)."""

    rows: np.ndarray  # [C] int32
    matchers: list[GrammarMatcher]
    proposed: list[np.ndarray]
    grammars: Grammars

    def write(self, slot: SlotSink) -> None:
        """Into the slot in place: the rows, then each matcher's bitmask rows (no copy)."""
        slot.alloc("grammar_rows", np.dtype(np.int32), self.rows.shape)[:] = self.rows
        self._fill(slot.alloc("grammar_bitmask", np.dtype(np.int32), (len(self.rows), self.grammars.words)))

    def arrays(self) -> dict[str, np.ndarray]:
        """The same arrays in memory of their own (tests and benchmarks)."""
        bitmask = np.zeros((len(self.rows), self.grammars.words), np.int32)
        self._fill(bitmask)
        return {"grammar_rows": self.rows.copy(), "grammar_bitmask": bitmask}

    def _fill(self, bitmask: np.ndarray) -> None:
        """One mask per plain row, all of them at once on the engine's threads; then each verifying
        row's span of masks, one after another (each position's matcher state follows the last)."""
        filler = self.grammars.filler
        counts = [len(p) + 1 for p in self.proposed]
        firsts = np.cumsum([0, *counts[:-1]]).tolist()
        plain = [i for i, n in enumerate(counts) if n == 1]
        filler.fill(bitmask, [self.matchers[i] for i in plain], [firsts[i] for i in plain])
        for i, n in enumerate(counts):
            if n > 1:
                filler.fill_span(bitmask, firsts[i], self.matchers[i], self.proposed[i])


NO_PROPOSALS = np.zeros(0, np.int32)


def plan_grammar(
    grammars: Grammars | None,
    seqs: list[Request],
    constrained: np.ndarray,
    is_sampled: np.ndarray,
    num_decodes: int = 0,
    proposals: Sequence[np.ndarray] = (),
) -> GrammarPlan | None:
    """The grammar arrays of a step whose sequences `seqs` have these per-row flags (the entries
    from `num_decodes` on verifying `proposals`); None when no sampled row is constrained. Each
    matcher must stand at the token its row samples: one planned ahead of its previous sample
    would get the mask of the wrong position."""
    picked = np.flatnonzero(constrained & is_sampled)
    if not len(picked) or grammars is None:
        return None
    matchers, proposed = [], []
    for i in picked.tolist():
        req = seqs[i]
        matcher = req.grammar
        if matcher is None or matcher.num_tokens != req.num_output_tokens:
            raise RuntimeError(f"request {req.request_id!r}: its grammar is not at its next token")
        matchers.append(matcher)
        verifies = num_decodes <= i < num_decodes + len(proposals)
        proposed.append(proposals[i - num_decodes] if verifies else NO_PROPOSALS)
    rows = np.repeat(picked, [len(p) + 1 for p in proposed]).astype(np.int32)
    return GrammarPlan(rows, matchers, proposed, grammars)
