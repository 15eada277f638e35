"""Proposers for speculative decoding (docs/speculative.md): tokens a running sequence is likely
to generate next, which the worker verifies in one forward pass (services/gpu_worker/speculation.py).

`NgramProposer` is prompt lookup: text that restates or edits its input (summaries, code edits,
extraction) repeats runs of the prompt, so the tokens that followed the latest earlier occurrence
of the sequence's last n tokens are a cheap guess at what follows now. It costs no model call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ipc.config import MAX_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from services.scheduler.request import Request
    from services.scheduler.state import SchedulerState


class Proposer(Protocol):
    """What proposes tokens from a sequence's own tokens. Proposers that condition on the target's
    hidden states (EAGLE heads, MTP layers) need the worker to run them and are not of this kind
    (docs/speculative.md, "What plugs in where")."""

    def propose(self, token_ids: np.ndarray, limit: int) -> np.ndarray:
        """Up to `limit` tokens (int32) likely to follow `token_ids` (prompt, then outputs)."""
        ...


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Proposes up to `num_tokens` tokens by matching the sequence's last n tokens, for n from
    `max_n` down to `min_n` (the longest match wins), against its earlier tokens."""

    num_tokens: int
    min_n: int
    max_n: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_tokens}"
            )
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


@dataclass(slots=True)
class Verifications:
    """The decodes of a step that verify proposals: indices into the step's decodes, and each one's
    proposed tokens."""

    decodes: list[int]
    proposals: list[np.ndarray]

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.proposals)


class Speculation:
    """Chooses which decodes of a step verify proposals, and gives them the KV blocks and the
    token budget for them (services/scheduler/core.py `Scheduler.schedule`); counts what the
    workers accepted (the spec_decode_* metrics).

    A decode speculates when its request decodes plain greedy (PlanTable.may_speculate: what
    verification reproduces exactly) and its last token is known: a decode planned ahead on a
    placeholder has nothing to look up. A verification never preempts anyone: proposals are cut
    to the free blocks, the token budget and what the request may still generate."""

    def __init__(self, state: SchedulerState, proposer: Proposer) -> None:
        self.state = state
        self.proposer = proposer
        self.num_drafts = 0  # verifications applied
        self.num_draft_tokens = 0  # tokens they proposed
        self.num_accepted_tokens = 0  # of which the target agreed with

    def plan(
        self,
        seqs: list[Request],
        rows: np.ndarray,
        starts: np.ndarray,
        is_placeholder: np.ndarray,
        budget: int,
    ) -> Verifications:
        """Proposals for the decodes `seqs` (their plan-table rows, computed tokens before the step
        and placeholders), within `budget` extra tokens; their blocks are allocated and their
        NUM_COMPUTED advanced past the proposals."""
        state = self.state
        table = state.table
        bs = state.block_size
        blocks = state.blocks
        out = Verifications([], [])
        candidates = np.flatnonzero(table.may_speculate.take(rows) & ~is_placeholder).tolist()
        for j in candidates:
            if budget <= 0:
                break
            req = seqs[j]
            row = int(rows[j])
            start = int(starts[j])  # the last known token's position
            # Every emitted token must fit the request's length limit: proposals, then one more.
            limit = min(budget, int(table.length_limit[row]) - req.num_tokens - 1)
            proposal = self.proposer.propose(req.all_token_ids, limit)
            if not len(proposal):
                continue
            # Cut to the blocks it holds and the free ones: speculation never preempts.
            room = (len(req.block_ids) + blocks.num_available) * bs - start - 1
            proposal = proposal[:room]
            if not len(proposal):
                continue
            state.grow(req, start + 1 + len(proposal))
            table.num_computed[row] = start + 1 + len(proposal)
            out.decodes.append(j)
            out.proposals.append(proposal)
            budget -= len(proposal)
        return out

    def applied(self, num_proposed: int, num_emitted: int) -> None:
        """Count one verification's result."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_emitted - 1
