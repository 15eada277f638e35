"""Speculative decoding in the scheduler (docs/speculative.md): which decodes of a step verify
proposals (services/scheduler/proposers.py), with the KV blocks and token budget for them, and the
counts of what the workers accepted."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.proposers import Proposer
from services.scheduler.request import Request
from services.scheduler.state import SchedulerState


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

    A decode speculates when verification samples its request exactly as plain decoding does
    (PlanTable.may_speculate: greedy or sampled, without penalties, min_tokens, top logprobs,
    grammar or adapter) and its last token is known: a decode planned ahead on a
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
