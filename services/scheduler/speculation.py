"""Speculative decoding in the scheduler (docs/speculative.md): which decodes of a step verify
proposals (services/scheduler/proposers.py) and how many tokens each may propose (the adaptive
rule: `speculative_depth` bounds it by the batch and the acceptance rate, `paying_depth` keeps to
what the measured step times pay for), with the KV blocks and token budget for them, and the
counts of what the workers accepted."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ipc.step_plan import MAX_CONSTRAINED_PROPOSALS
from services.scheduler.grammars import is_allowed
from services.scheduler.proposers import Proposer
from services.scheduler.request import Request
from services.scheduler.state import SchedulerState

# The adaptive rule (`speculative_depth`, then `paying_depth`). Where a decode step is bound by
# reading the weights, proposals ride along nearly free; where it is bound by compute (a large
# batch, or a CPU whose few-row kernels are), every proposal costs about as much as a token.
FULL_DEPTH_DECODES = 4  # up to this many decodes in a step, each may propose the configured number
MAX_SPECULATIVE_DECODES = 16  # above this many, a step verifies nothing
MIN_KEPT_PROBABILITY = 0.3  # a proposal is verified only when it is at least this likely to be kept
# Each request's per-token acceptance rate is a decaying count over its own verifications (about
# its last 50) plus, as a prior worth REQUEST_PRIOR of them, the scheduler's rate over every
# request's verifications (decaying alike, from a prior of 0.8 worth five, so that speculation
# starts on): a request starts where the recent ones left off, and then follows its own text, so
# that a request restating a text and an open chat, in one batch or one after the other, each
# get their own depth.
ACCEPTANCE_DECAY = 0.98
PRIOR_KEPT, PRIOR_TRIED = 4.0, 5.0
REQUEST_PRIOR = 2.0
# While the acceptance rate keeps speculation off, one step in this many proposes one token per
# decode, so that the rate can recover when the text turns repetitive; while the step times keep
# it below what the batch and the rate allow, one step in this many proposes that much, so that
# its time is measured again.
PROBE_INTERVAL = 32
# The time of an all-decode step, by the tokens it carries, is a decaying average of what such
# steps cost the pipeline: each new one moves it this far (about the last 3 weigh).
STEP_TIME_WEIGHT = 0.3


def speculative_depth(max_depth: int, num_decodes: int, acceptance_rate: float) -> int:
    """How many tokens each decode of a step may propose, at most `max_depth` (the configured
    number): fewer as the step's `num_decodes` grow (a step verifies at most
    FULL_DEPTH_DECODES * max_depth proposals, and none above MAX_SPECULATIVE_DECODES decodes),
    and fewer as the per-token `acceptance_rate` falls: the k-th proposal is kept only when the
    k - 1 before it were, with probability rate**k, so a decode proposes while that is at least
    MIN_KEPT_PROBABILITY, and nothing when the rate is below it."""
    if not 0 < num_decodes <= MAX_SPECULATIVE_DECODES or acceptance_rate < MIN_KEPT_PROBABILITY:
        return 0
    by_batch = min(max_depth, FULL_DEPTH_DECODES * max_depth // num_decodes)
    if acceptance_rate >= 1.0:
        return by_batch
    # The largest k with rate**k >= MIN_KEPT_PROBABILITY (>= 1 here; the epsilon absorbs the
    # rounding of a rate exactly at a power's boundary).
    by_acceptance = int(math.log(MIN_KEPT_PROBABILITY) / math.log(acceptance_rate) + 1e-9)
    return min(by_batch, by_acceptance)


def paying_depth(
    bound: int, num_decodes: int, acceptance_rate: float, step_times: Mapping[int, float]
) -> int:
    """The depth k, 0 to `bound`, at which a step of `num_decodes` decodes emits the most tokens
    per second: a decode verifying k proposals emits 1 + rate + ... + rate**k tokens expected,
    in a step of num_decodes * (1 + k) tokens whose time `step_times` holds (seconds, by the
    step's tokens). A step size not measured yet is taken to cost what a plain step does, so that
    it is tried (and measured) once it may pay; the plain step is measured first (0), unless
    nothing is (workers that report no times: `bound`, the rule of the batch and the rate)."""
    plain = step_times.get(num_decodes)
    if plain is None:
        return 0 if step_times else bound
    best, best_speed = 0, 1.0  # a plain step: one token per decode in `plain` seconds
    expected = 1.0
    for k in range(1, bound + 1):
        expected += acceptance_rate**k
        speed = expected * plain / step_times.get(num_decodes * (1 + k), plain)
        if speed > best_speed:
            best, best_speed = k, speed
    return best


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
    (PlanTable.may_speculate: greedy or sampled, penalties, logit bias and min_tokens included,
    top logprobs, adapters and grammars too) and its last token is known: a decode planned
    ahead on a placeholder has nothing to look up. A verification never preempts anyone:
    proposals are cut to the free blocks, the token budget and what the request may still
    generate; a constrained request's, to what its grammar allows (each verified position gets
    its own mask row, MAX_CONSTRAINED_PROPOSALS of them in a step at most)."""

    def __init__(self, state: SchedulerState, proposer: Proposer) -> None:
        self.state = state
        self.proposer = proposer
        self.num_drafts = 0  # verifications applied
        self.num_draft_tokens = 0  # tokens they proposed
        self.num_accepted_tokens = 0  # of which the target agreed with
        # Tokens each verification emitted (accepted + 1), for the acceptance length histogram;
        # the metrics take them out.
        self.acceptance_lengths: deque[int] = deque()
        # The scheduler's rate's decaying counts of proposals kept and judged, over all requests.
        self.kept = PRIOR_KEPT
        self.tried = PRIOR_TRIED
        # Consecutive planned steps the step times held below the bound of the batch and the rate.
        self.steps_below_bound = 0
        # Seconds an all-decode step takes, by its tokens (decodes plus proposals), decaying.
        self.step_times: dict[int, float] = {}
        self.last_step_verified = False  # whether the step planned last verifies proposals

    def acceptance_rate(self, req: Request) -> float:
        """The request's per-token acceptance rate: its proposals kept over those judged (the
        kept ones and the first rejected one of each verification), decaying, with the
        scheduler's rate as its prior."""
        prior = REQUEST_PRIOR * self.kept / self.tried
        return (req.speculation_kept + prior) / (req.speculation_tried + REQUEST_PRIOR)

    def depth(self, num_decodes: int, req: Request) -> int:
        """How many tokens `req`, a decode in a step of `num_decodes` decodes, may propose: what
        the step times pay for (`paying_depth`) within the bound of the batch and its acceptance
        rate (`speculative_depth`); in a probe, 1 while its rate keeps it off (one of its steps
        in PROBE_INTERVAL), the bound while the step times keep the depth below it."""
        max_depth = self.proposer.num_tokens
        acceptance_rate = self.acceptance_rate(req)
        bound = speculative_depth(max_depth, num_decodes, acceptance_rate)
        if bound == 0:
            is_probe = (
                speculative_depth(max_depth, num_decodes, 1.0) > 0  # the batch would allow it
                and req.speculation_steps_off + 1 >= PROBE_INTERVAL
            )
            return 1 if is_probe else 0
        if self.steps_below_bound + 1 >= PROBE_INTERVAL:
            return bound
        return paying_depth(bound, num_decodes, acceptance_rate, self.step_times)

    def step_executed(self, num_decodes: int, num_tokens: int, seconds: float) -> None:
        """Take the `seconds` an all-decode step of `num_decodes` decodes and `num_tokens` tokens
        cost (StepPipeline: from the last result to its own) into the step times (a step with a
        prompt chunk would not tell what verification costs). Only sizes a speculating step may
        have are kept; a time of 0 is none."""
        if seconds <= 0 or num_decodes > MAX_SPECULATIVE_DECODES:
            return
        if num_tokens > num_decodes * (1 + self.proposer.num_tokens):
            return
        known = self.step_times.get(num_tokens)
        self.step_times[num_tokens] = (
            seconds if known is None else known + STEP_TIME_WEIGHT * (seconds - known)
        )

    def wants_step_results(self, decodes: list[Request]) -> bool:
        """Whether the next step, of these `decodes`, must be planned after the last one's
        result: one of them that may speculate may propose (a decode planned ahead has no known
        last token to look up), or the step in flight verifies (the positions after it are
        unknown until it is applied)."""
        if self.last_step_verified:
            return True
        if not 0 < len(decodes) <= MAX_SPECULATIVE_DECODES:
            return False
        may_speculate = self.state.table.may_speculate
        return any(may_speculate[req.row] and self.depth(len(decodes), req) > 0 for req in decodes)

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
        self.last_step_verified = False
        # Every decode that may speculate counts toward the probes, a placeholder too (a step
        # planned ahead proposes nothing): each request's own, and the step's time probe (its
        # deepest decode against the highest bound).
        speculating = np.flatnonzero(table.may_speculate.take(rows)).tolist()
        depths = {j: self.depth(len(seqs), seqs[j]) for j in speculating}
        max_depth = self.proposer.num_tokens
        bound = max(
            (speculative_depth(max_depth, len(seqs), self.acceptance_rate(seqs[j])) for j in speculating),
            default=0,
        )
        self.steps_below_bound = self.steps_below_bound + 1 if max(depths.values(), default=0) < bound else 0
        for j, depth in depths.items():
            seqs[j].speculation_steps_off = 0 if depth > 0 else seqs[j].speculation_steps_off + 1
        constrained_room = MAX_CONSTRAINED_PROPOSALS
        for j in speculating:
            depth = depths[j]
            if budget <= 0:
                break
            if depth == 0 or is_placeholder[j]:
                continue
            req = seqs[j]
            row = int(rows[j])
            start = int(starts[j])  # the last known token's position
            # Every emitted token must fit the request's length limit: proposals, then one more.
            limit = min(depth, budget, int(table.length_limit[row]) - req.num_tokens - 1)
            # min_tokens bans eos and the stop ids while the sampled position is below its end
            # (plan.py `_logit_bias`); a span must not cross it, so that the bias the plan gives
            # the span's first position holds at each of its positions.
            ban_end = req.num_prompt_tokens + req.params.min_tokens
            if start + 1 < ban_end:
                limit = min(limit, ban_end - start - 2)
            depends_on_tokens = req.grammar is not None or (
                req.bad_words is not None and bool(req.bad_words.prefixes)
            )
            if depends_on_tokens and self.proposer.drafts_in_worker:
                continue  # its span's masks or bans would need tokens only the worker will know
            is_masked = req.grammar is not None or req.allowed_mask is not None
            if is_masked:
                limit = min(limit, constrained_room)
            proposal = self.proposer.propose(req.all_token_ids, limit)
            if req.allowed_mask is not None and not self.proposer.drafts_in_worker:
                # A proposal outside allowed_token_ids could never be emitted: nor could those after it.
                outside = np.flatnonzero(~is_allowed(req.allowed_mask, proposal))
                proposal = proposal[: outside[0]] if len(outside) else proposal
            if req.grammar is not None:
                # A proposal the grammar refuses could never be emitted: nor could those after it.
                proposal = proposal[: req.grammar.num_valid(proposal)]
            if req.bad_words is not None and req.bad_words.prefixes:
                # The plan gives the span's every position the bias of its first (plan.py
                # `_logit_bias`): it must not reach a position where bad words ban other tokens.
                proposal = proposal[: _same_bans(req, proposal)]
            if is_masked:
                constrained_room -= len(proposal)
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
        self.last_step_verified = bool(out.decodes)
        return out

    def applied(self, req: Request, num_proposed: int, num_emitted: int) -> None:
        """Count one verification of `req`'s, and take it into its and the scheduler's rates."""
        num_kept = num_emitted - 1
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_kept
        self.acceptance_lengths.append(num_emitted)
        num_judged = num_kept + (num_kept < num_proposed)
        self.kept = self.kept * ACCEPTANCE_DECAY + num_kept
        self.tried = self.tried * ACCEPTANCE_DECAY + num_judged
        req.speculation_kept = req.speculation_kept * ACCEPTANCE_DECAY + num_kept
        req.speculation_tried = req.speculation_tried * ACCEPTANCE_DECAY + num_judged


def _same_bans(req: Request, proposal: np.ndarray) -> int:
    """How many of `proposal`, from the first, keep the tokens `req`'s bad words ban at each
    position of the span the same as at its first position (and are not banned there)."""
    assert req.bad_words is not None
    output = req.output_ids
    first = req.bad_words.banned(output)
    banned = set(first) | set(req.bad_words.always)
    for m in range(len(proposal)):
        if int(proposal[m]) in banned or req.bad_words.banned(output, proposal[: m + 1]) != first:
            return m
    return len(proposal)
