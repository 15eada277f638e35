"""Proposers for speculative decoding (docs/speculative.md): tokens a running sequence is likely
to generate next, which the worker verifies in one forward pass (services/gpu_worker/speculation.py).

`NgramProposer` is prompt lookup: text that restates or edits its input (summaries, code edits,
extraction) repeats runs of the prompt, so the tokens that followed the latest earlier occurrence
of the sequence's last n tokens are a cheap guess at what follows now. It costs no model call.

`DraftModelProposer` leaves the tokens to the worker's draft model: the scheduler only decides how
many each row drafts (the adaptive rule's depth, cut as any proposal is) and gives them KV slots;
the plan carries DRAFT_TOKEN in their places, which the worker fills in before it verifies
(services/gpu_worker/draft.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ipc.config import MAX_SPECULATIVE_TOKENS
from ipc.messages import DRAFT_TOKEN


class Proposer(Protocol):
    """What proposes tokens from a sequence's own tokens. Proposers that condition on the target's
    hidden states (EAGLE heads, MTP layers) need the worker to run them: like the draft model,
    they would propose DRAFT_TOKEN places for the worker to fill (docs/speculative.md, "What plugs
    in where")."""

    num_tokens: int  # the most it proposes at once (speculative.num_speculative_tokens)
    # Whether its proposals are DRAFT_TOKEN places, their tokens known only in the worker; a
    # constrained request cannot verify those (the scheduler makes a span's grammar masks).
    drafts_in_worker: bool

    def propose(self, token_ids: np.ndarray, limit: int) -> np.ndarray:
        """Up to `limit` tokens (int32) likely to follow `token_ids` (prompt, then outputs)."""
        ...


def _check_num_tokens(num_tokens: int) -> None:
    if not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {num_tokens}")


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Proposes up to `num_tokens` tokens by matching the sequence's last n tokens, for n from
    `max_n` down to `min_n` (the longest match wins), against its earlier tokens."""

    num_tokens: int
    min_n: int
    max_n: int
    drafts_in_worker = False

    def __post_init__(self) -> None:
        _check_num_tokens(self.num_tokens)
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"n-gram bounds must satisfy 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}"
            )

    def propose(self, token_ids: np.ndarray, limit: int) -> np.ndarray:
        """The proposal for a sequence whose tokens (prompt, then outputs) are `token_ids` [L]:
        the tokens after the latest earlier occurrence of its longest matching suffix of n tokens,
        at most `limit` of them (what the request may still generate) and at most `num_tokens`.
        Empty when no suffix of `min_n` tokens or more occurs earlier."""
        tokens = np.asarray(token_ids)
        length = len(tokens)
        count = min(self.num_tokens, limit)
        if count <= 0:
            return tokens[:0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1: every occurrence except the suffix itself,
            # each followed by at least one token.
            windows = sliding_window_view(tokens[: length - 1], n)
            matches = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start : start + count]
        return tokens[:0]


@dataclass(frozen=True, slots=True)
class DraftModelProposer:
    """Asks the worker's draft model for up to `num_tokens` tokens after every sequence: the
    proposal is DRAFT_TOKEN places, which the worker drafts greedily in the step that verifies
    them."""

    num_tokens: int
    drafts_in_worker = True

    def __post_init__(self) -> None:
        _check_num_tokens(self.num_tokens)

    def propose(self, token_ids: np.ndarray, limit: int) -> np.ndarray:
        """`min(num_tokens, limit)` DRAFT_TOKEN places (none when `limit` <= 0)."""
        return np.full(max(min(self.num_tokens, limit), 0), DRAFT_TOKEN, np.int32)
