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
  straight into the array given (a step-slot view in shared memory: no copy).

eos: the model's eos tokens (given to `load_grammar_tokenizer`) are allowed exactly where the grammar
may end, and are the only tokens allowed once it must end (`is_terminated`). A request's own
stop_token_ids are ordinary tokens to the grammar: allowed only where the grammar allows their text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import llguidance
import numpy as np

from services.scheduler.grammar_compiler import CompiledGrammar


class GrammarViolation(RuntimeError):
    """A token the request's grammar does not allow reached its matcher."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return np.zeros((rows, bitmask_words(vocab_size)), dtype=np.int32)


class GrammarMatcher:
    __slots__ = ("_matcher", "key", "num_tokens")

    def __init__(self, compiled: CompiledGrammar, history: Iterable[int] = ()) -> None:
        self.key = compiled.key
        self._matcher = compiled.new_matcher()
        self.num_tokens = 0
        self.advance(history)

    def advance(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            if not self._matcher.consume_token(int(token)):
                raise GrammarViolation(
                    f"token {int(token)} at output position {self.num_tokens} refused by the grammar: "
                    f"{self._matcher.get_error()}"
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


class BitmaskFiller:
    """Fills many rows at once on the engine's own threads (the GIL is released while it works)."""

    def __init__(self, threads: int | None = None) -> None:
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def fill(self, bitmask: np.ndarray, matchers: Sequence[GrammarMatcher]) -> None:
        """bitmask[i] <- the allowed tokens of matchers[i]; rows past len(matchers) are untouched."""
        _check_bitmask(bitmask)
        if len(matchers) > bitmask.shape[0]:
            raise ValueError(f"{len(matchers)} matchers for a bitmask of {bitmask.shape[0]} rows")
        if not matchers:
            return
        pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )


def _check_bitmask(bitmask: np.ndarray) -> None:
    # The engine writes through a raw pointer: the layout must be exactly what it assumes.
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags.c_contiguous:
        raise ValueError(
            f"bitmask must be a C-contiguous 2-D int32 array, got {bitmask.dtype} {bitmask.shape}"
        )
    if not bitmask.flags.writeable:
        raise ValueError("bitmask must be writeable")
