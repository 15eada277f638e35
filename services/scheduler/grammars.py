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
    """The grammar arrays of one step: `rows` are plan indices of constrained sampled rows."""

    rows: np.ndarray  # [C] int32
    matchers: list[GrammarMatcher]
    grammars: Grammars

    def write(self, slot: SlotSink) -> None:
        """Into the slot in place: the rows, then each matcher's bitmask row (no copy)."""
        slot.alloc("grammar_rows", np.dtype(np.int32), self.rows.shape)[:] = self.rows
        bitmask = slot.alloc("grammar_bitmask", np.dtype(np.int32), (len(self.rows), self.grammars.words))
        self.grammars.filler.fill(bitmask, self.matchers)

    def arrays(self) -> dict[str, np.ndarray]:
        """The same arrays in memory of their own (tests and benchmarks)."""
        bitmask = np.zeros((len(self.rows), self.grammars.words), np.int32)
        self.grammars.filler.fill(bitmask, self.matchers)
        return {"grammar_rows": self.rows.copy(), "grammar_bitmask": bitmask}


def plan_grammar(
    grammars: Grammars | None, seqs: list[Request], constrained: np.ndarray, is_sampled: np.ndarray
) -> GrammarPlan | None:
    """The grammar arrays of a step whose sequences `seqs` have these per-row flags; None when no
    sampled row is constrained. Each matcher must stand at the token its row samples: one planned
    ahead of its previous sample would get the mask of the wrong position."""
    picked = np.flatnonzero(constrained & is_sampled)
    if not len(picked) or grammars is None:
        return None
    matchers = []
    for i in picked.tolist():
        req = seqs[i]
        matcher = req.grammar
        if matcher is None or matcher.num_tokens != req.num_output_tokens:
            raise RuntimeError(f"request {req.request_id!r}: its grammar is not at its next token")
        matchers.append(matcher)
    return GrammarPlan(picked.astype(np.int32), matchers, grammars)
