"""A constrained request's place in its grammar, and the bitmask rows that carry it to the worker.

The bitmask is packed int32 `[rows, ceil(vocab_size / 32)]`: bit `t % 32` of word `t // 32` is 1
when token `t` is allowed. Only constrained sequences have a row (the plan says which sequence each
row is for), so unconstrained ones cost nothing, and a step without any has no bitmask at all.

- `GrammarMatcher(compiled, history)`: a fresh matcher advanced through `history`, the output
  tokens so far. After any fault (a dead worker, scheduler, tokenizer, gateway) the scheduler
  rebuilds every matcher this way from the token history it resumes with, and the state, and so
  every later bitmask, is exactly the one the lost matcher had.
- `advance(tokens)`: the tokens a step appended. A token the grammar refuses can only come from a
  bug (the worker samples under the mask), so it raises `GrammarViolation` rather than drifting on.
- `BitmaskFiller.fill(bitmask, matchers)`: row i <- matchers[i], on the engine's thread pool and
  straight into the array given (a step-slot view in shared memory: no copy). A matcher whose mask
  takes longer than the filler's budget gets a `failure`: its request is failed after this step
  (services/scheduler/results.py), so one pathological constraint cannot slow every other
  request's steps for the rest of its output.

eos: the model's eos tokens (given to `load_grammar_tokenizer`) are allowed exactly where the grammar
may end, and are the only tokens allowed once it must end (`is_terminated`). A request's own
stop_token_ids are ordinary tokens to the grammar: allowed only where the grammar allows their text.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import llguidance
import numpy as np

from services.common.grammar_compiler import CompiledGrammar, short_error


class GrammarViolation(RuntimeError):
    """A token the request's grammar does not allow reached its matcher. `over_limits`: the engine
    refused it because the grammar went past the engine's limits (the constraint's fault, not a
    bug: the token was allowed by the mask)."""

    def __init__(self, message: str, *, over_limits: bool = False) -> None:
        super().__init__(message)
        self.over_limits = over_limits


class GrammarMatcher:
    __slots__ = ("_matcher", "failure", "key", "num_tokens")

    def __init__(self, compiled: CompiledGrammar, history: Iterable[int] = ()) -> None:
        self.key = compiled.key
        self._matcher = compiled.new_matcher()
        self.num_tokens = 0
        self.failure: str | None = None  # why the request must fail (set by BitmaskFiller)
        self.advance(history)

    def advance(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            if not self._matcher.consume_token(int(token)):
                error = short_error(self._matcher.get_error())
                raise GrammarViolation(
                    f"token {int(token)} at output position {self.num_tokens} refused by the grammar: {error}",
                    # The engine names its limits so ("lexer error: too many expressions
                    # constructed", "... too complex", "parser error: Too many items" for a
                    # grammar with no finite match); a plain refusal is "... doesn't satisfy".
                    over_limits="lexer error" in error
                    or any(limit in error.lower() for limit in ("too complex", "too many items")),
                )
            self.num_tokens += 1

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (an eos now would end it validly)."""
        return self._matcher.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """Nothing but eos can follow: the output is complete and cannot be extended."""
        return self._matcher.is_stopped()

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write this matcher's allowed tokens into bitmask[row] (one thread; see BitmaskFiller)."""
        _check_bitmask(bitmask)
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def num_valid(self, tokens: np.ndarray) -> int:
        """How many of `tokens`, from the first, the grammar allows next (nothing is consumed)."""
        return self._matcher.validate_tokens(tokens.tolist()) if len(tokens) else 0

    def fill_span(self, bitmask: np.ndarray, first_row: int, proposed: np.ndarray) -> None:
        """The masks of a verified span (speculative decoding): bitmask[first_row + i] <- the
        allowed tokens after proposed[:i], for i from 0 to len(proposed). The matcher ends where
        it began. Positions after a proposal the grammar refuses are never emitted (verification
        stops at it): they get that position's mask."""
        _check_bitmask(bitmask)
        consumed = 0
        try:
            for i in range(len(proposed) + 1):
                self.fill(bitmask, first_row + i)
                if i == len(proposed) or not self._matcher.consume_token(int(proposed[i])):
                    bitmask[first_row + i + 1 : first_row + len(proposed) + 1] = bitmask[first_row + i]
                    break
                consumed += 1
        finally:
            self._matcher.rollback(consumed)


class BitmaskFiller:
    """Fills many rows at once on the engine's own threads (the GIL is released while it works).

    `budget_s` bounds one matcher's mask in one step. A fill whose whole batch stays within it (the
    common case by far: a row takes tens of microseconds) costs nothing more. A slower one fills
    each row again alone, timed, to find the matchers over the budget (their masks are the same);
    those get a `failure`. That second fill costs at most one more mask per row, once: a matcher
    that failed is gone after this step."""

    def __init__(self, threads: int | None = None, budget_s: float = 0.2) -> None:
        if budget_s <= 0:
            raise ValueError(f"budget_s must be positive, got {budget_s}")
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self.budget_s = budget_s

    def fill(
        self, bitmask: np.ndarray, matchers: Sequence[GrammarMatcher], rows: Sequence[int] | None = None
    ) -> None:
        """bitmask[rows[i]] (row i by default) <- the allowed tokens of matchers[i]; other rows
        are untouched."""
        _check_bitmask(bitmask)
        rows = range(len(matchers)) if rows is None else rows
        if len(rows) != len(matchers) or (len(rows) and not 0 <= min(rows) <= max(rows) < bitmask.shape[0]):
            raise ValueError(
                f"{len(matchers)} matchers for rows {list(rows)} of a bitmask of {bitmask.shape[0]}"
            )
        if not matchers:
            return
        pairs = [(m._matcher, row) for m, row in zip(matchers, rows, strict=True)]
        started = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )
        if time.perf_counter() - started <= self.budget_s:
            return
        for matcher, row in zip(matchers, rows, strict=True):
            started = time.perf_counter()
            matcher.fill(bitmask, row)
            self._judge(matcher, time.perf_counter() - started, 1)

    def fill_span(
        self, bitmask: np.ndarray, first_row: int, matcher: GrammarMatcher, proposed: np.ndarray
    ) -> None:
        """A verifying row's masks (`GrammarMatcher.fill_span`), on this thread, timed as one
        mask per position."""
        started = time.perf_counter()
        matcher.fill_span(bitmask, first_row, proposed)
        self._judge(matcher, time.perf_counter() - started, len(proposed) + 1)

    def _judge(self, matcher: GrammarMatcher, elapsed: float, num_masks: int) -> None:
        if elapsed / num_masks > self.budget_s:
            matcher.failure = (
                f"too complex: its grammar's mask took {elapsed / num_masks * 1000:.0f} ms in one step, "
                f"over the budget of {self.budget_s * 1000:.0f} ms (structured.mask_timeout_ms)"
            )


def _check_bitmask(bitmask: np.ndarray) -> None:
    # The engine writes through a raw pointer: the layout must be exactly what it assumes.
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags.c_contiguous:
        raise ValueError(
            f"bitmask must be a C-contiguous 2-D int32 array, got {bitmask.dtype} {bitmask.shape}"
        )
    if not bitmask.flags.writeable:
        raise ValueError("bitmask must be writeable")
