"""The scheduler core: continuous batching over the paged KV pool (pure logic, no sockets).

`Scheduler` is the facade the scheduler process drives; each phase is its own module:
admission.py (add, abort, the waiting queue and its bound), decode.py (decodes and the
steady-decode fast path with its caches), prefill.py (chunks, prefix-cache hits, entry into the
running line) and results.py (update, finish checks, outputs); state.py holds what they share.

Each `schedule()` plans one step: single-token decodes of running sequences first, then the rest
of partially computed prompts, then new (or preempted) requests from the waiting queue, in
priority order (lower `params.priority` first, then first come first served), within
`max_num_batched_tokens` and `max_num_seqs`. A prompt longer than what is left of the token budget
is chunked over steps; only its final chunk samples. When a decode needs a block and none is
left, the lowest-priority, latest-arrived running sequence is preempted by recompute: its blocks
are freed and it goes back to waiting with the tokens it generated, to be prefilled again later
(sampling depends only on seed and position, so its outputs do not change).

`schedule()` may plan the next step while the previous one still executes (at most one step in
flight: the scheduler process's pipeline). A running sequence whose sample is in flight then
decodes that token without knowing it: the plan carries a placeholder that the worker fills in
from its own previous sample. `update()` applies results in order; whatever was planned for a
sequence that finishes, leaves or is preempted meanwhile is dropped by its row's epoch. A
sequence that applies penalties, is constrained by a grammar or has bad words of several tokens,
or whose sample in flight is its last by length, sits such a step out (its history, its grammar
bitmask or its bad words' bans would need the unknown token; or there is nothing left to decode).
allowed_token_ids are a static bitmask row: such a sequence decodes ahead.

Structured output (grammars.py): a constrained request compiles its grammar outside the queue
(`poll_grammars` lets it in, or fails it), each step's plan carries the bitmask rows of its
constrained sampled rows (and of those with allowed_token_ids), and `update()` advances their
matchers. Bad words (request.py `BadWords`) are -inf entries of the plan's logit bias.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from services.scheduler.admission import Admission, Overloaded, PromptTooLong
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.decode import SteadyDecode
from services.scheduler.grammars import Grammars, plan_grammar
from services.scheduler.lora_residency import PREFETCH_LOOKAHEAD
from services.scheduler.plan import PlanTable, ScheduledStep
from services.scheduler.prefill import Prefill
from services.scheduler.request import Request, RequestStatus
from services.scheduler.results import EmittedArrays, PromptScoreArrays, RequestOutput, Results, StepOutputs
from services.scheduler.speculation import Speculation
from services.scheduler.state import SchedulerState

# The facade's API: the process and the tests import these from here.
__all__ = ["Overloaded", "PromptTooLong", "RequestOutput", "Scheduler", "SchedulerConfig", "StepOutputs"]


class Scheduler:
    """Owns the live requests of one engine group (waiting and running), the KV block pool and
    the plan table; turns them into steps and step results into request outputs."""

    def __init__(self, config: SchedulerConfig, grammars: Grammars | None = None) -> None:
        self.state = SchedulerState(config, grammars)
        self.admission = Admission(self.state)
        self.decode = SteadyDecode(self.state)
        self.prefill = Prefill(self.state)
        proposer = config.proposer
        # Speculative decoding (docs/speculative.md); off for a sliding window or LongRoPE, whose
        # block release and regime change assume one new token per decode.
        self.speculation = (
            Speculation(self.state, proposer)
            if proposer is not None and not config.sliding_window and not config.long_rope_from
            else None
        )
        self.results = Results(self.state, self.decode, self.speculation)

    @property
    def config(self) -> SchedulerConfig:
        return self.state.config

    @config.setter
    def config(self, config: SchedulerConfig) -> None:
        """Hot reload changes settings that take effect at the next call (max_num_waiting)."""
        self.state.config = config

    @property
    def blocks(self) -> BlockManager:
        return self.state.blocks

    @property
    def table(self) -> PlanTable:
        return self.state.table

    @property
    def requests(self) -> dict[str, Request]:
        return self.state.requests

    # -- counters -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.state.running)

    @property
    def num_waiting(self) -> int:
        return len(self.state.waiting) + len(self.state.compiling)

    @property
    def num_compiling(self) -> int:
        """Constrained requests whose grammar is still compiling."""
        return len(self.state.compiling)

    @property
    def has_work(self) -> bool:
        return bool(self.state.requests)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks referenced by live sequences."""
        return self.state.blocks.num_used / self.state.blocks.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens looked up, at admission."""
        queried = self.prefill.num_prefix_query_tokens
        return self.prefill.num_prefix_hit_tokens / queried if queried else 0.0

    @property
    def num_prefix_query_tokens(self) -> int:
        return self.prefill.num_prefix_query_tokens

    @property
    def num_prefix_hit_tokens(self) -> int:
        return self.prefill.num_prefix_hit_tokens

    def recent_ttft_p90(self) -> float:
        """p90 seconds from a request's arrival here to its first token, over the recent ones."""
        return self.results.recent_ttft_p90()

    @property
    def queue_times(self) -> deque[float]:
        """Queue times of requests scheduled for the first time, for the process to drain."""
        return self.prefill.queue_times

    @property
    def num_preemptions(self) -> int:
        return self.state.num_preemptions

    @property
    def num_unknown_aborts(self) -> int:
        return self.admission.num_unknown_aborts

    # -- requests in and out --------------------------------------------------------------------

    def add(self, req: Request) -> RequestOutput | None:
        """Queue a request (`Admission.add`): None, or the final output of a resubmission that
        already met its end. Raises `PromptTooLong`, `Overloaded`, or ValueError."""
        return self.admission.add(req)

    def abort(self, request_id: str) -> bool:
        """Drop a live request without further output; False (and counted) when it is unknown."""
        return self.admission.abort(request_id)

    def poll_grammars(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Let in the constrained requests whose grammar is compiled (`Admission.poll_compiling`).
        Returns the resubmissions already complete (finished, nothing more to output) and the
        requests that failed, each with its error; both are gone from the scheduler."""
        return self.admission.poll_compiling()

    def recompute(self, requests: list[Request]) -> None:
        """Put running requests back in line to recompute: a step of theirs will never have a
        result (the worker refused it). They keep their outputs, like a preempted request."""
        state = self.state
        for req in requests:
            if req.status is RequestStatus.RUNNING:
                state.stop_running(req)
                state.preempt(req)

    def preempt_all(self) -> None:
        """The worker was lost: every running sequence recomputes later, keeping its outputs.
        The KV content is gone, so the prefix cache is cleared too."""
        self.state.preempt_all()
        self.decode.invalidate()

    # -- planning -------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Plan the next step, or None when no sequence has anything to compute: decodes of
        running sequences first (in line order), then prompts under way, then waiting requests
        (prefill), within `max_num_batched_tokens` and `max_num_seqs`.

        With a step in flight (at most one), its sampling sequences decode ahead on placeholders
        where `SteadyDecode` allows; `build_plan` must follow before anything else changes."""
        state = self.state
        budget = state.config.engine.max_num_batched_tokens
        state.lora.next_step()
        decodes = self.decode.plan(budget)
        seqs = decodes.seqs
        rows, starts, is_placeholder = decodes.rows, decodes.starts, decodes.is_placeholder
        proposals: list[np.ndarray] = []
        if self.speculation is not None and seqs:
            verifications = self.speculation.plan(seqs, rows, starts, is_placeholder, budget - len(seqs))
            if verifications.decodes:
                # Verifying decodes go after the single-token ones, in plan order; none is steady.
                self.decode.drop_steady_line()
                proposals = verifications.proposals
                order = np.ones(len(seqs), np.bool_)
                order[verifications.decodes] = False
                plain = np.flatnonzero(order)
                order = np.concatenate((plain, np.array(verifications.decodes, np.intp)))
                seqs = [seqs[j] for j in order.tolist()]
                rows, starts, is_placeholder = rows[order], starts[order], is_placeholder[plain]
                budget -= verifications.num_tokens
        num_decodes = len(seqs) - len(proposals)
        num_decode_seqs = len(seqs)
        chunks = self.prefill.plan(decodes.partial, seqs, budget - num_decode_seqs)
        if not seqs:
            return None
        if state.lora.names:
            waiting = state.waiting[:PREFETCH_LOOKAHEAD]
            state.lora.prefetch(req.params.adapter for req in waiting)
        lora_slots, lora_prefetch = state.lora.header()
        table = state.table
        if chunks.num_new or proposals:
            rows = np.concatenate((rows, np.array(chunks.rows, np.intp)))
            starts = np.concatenate((starts, np.array(chunks.starts, np.int32)))
            new_array = np.concatenate(
                (
                    np.ones(num_decodes, np.int32),
                    np.array([1 + len(p) for p in proposals], np.int32),
                    np.array(chunks.num_new, np.int32),
                )
            )
            is_sampled = np.ones(len(seqs), np.bool_)
            for j in range(num_decode_seqs, len(seqs)):
                is_sampled[j] = starts[j] + new_array[j] == seqs[j].num_tokens
        else:
            is_sampled, new_array = self.decode.all_decode_columns(num_decodes)
        prompt_spans: list[tuple[int, int, int]] = []
        for j in range(num_decode_seqs, len(seqs)):
            first = seqs[j].scores_from
            if first is not None:
                # Positions whose next token is a prompt token, from the first not yet scored.
                start = max(first, int(starts[j]))
                end = min(int(starts[j] + new_array[j]), seqs[j].num_prompt_tokens - 1)
                if end > start:
                    prompt_spans.append((j, start, end - start))
        return ScheduledStep(
            seqs=seqs,
            rows=rows,
            row_epochs=table.epoch.take(rows),
            num_releases=table.num_releases,
            starts=starts,
            num_new_tokens=new_array,
            is_sampled=is_sampled,
            num_decodes=num_decodes,
            is_placeholder=is_placeholder,
            table=table,
            eos_token_ids=state.config.eos_token_ids,
            lora_slots=lora_slots,
            lora_prefetch=lora_prefetch,
            line_version=-1 if chunks.num_new or proposals else decodes.line_version,
            steady=None if chunks.num_new or proposals else decodes.steady,
            grammar=(
                plan_grammar(
                    state.grammars,
                    state.mask_words,
                    seqs,
                    table.constrained.take(rows) | table.allowed.take(rows),
                    is_sampled,
                    starts + new_array,
                    state.config.eos_token_ids,
                    num_decodes,
                    proposals,
                )
                if table.num_grammar_rows or table.num_allowed_rows
                else None
            ),
            prompt_spans=tuple(prompt_spans),
            proposals=tuple(proposals),
        )

    @property
    def can_plan_ahead(self) -> bool:
        """False while some running sequence applies penalties (see `SteadyDecode.can_plan_ahead`),
        or may speculate and the adaptive rule lets the next step propose, or the step in flight
        verifies (`Speculation.wants_step_results`): a decode planned ahead has no known last
        token to look up proposals from, and after a verification in flight the next positions
        are unknown until it is applied. The caller then plans each step after the last one's
        result. A batch too large to speculate is planned ahead as without speculation."""
        if (
            self.speculation is not None
            and self.state.table.num_may_speculate_rows
            and self.speculation.wants_step_results(self.state.running)
        ):
            return False
        if self.state.config.pooling:  # an embedding request ends with its one step: no decode follows
            return False
        return self.decode.can_plan_ahead

    # -- results --------------------------------------------------------------------------------

    def update(
        self,
        step: ScheduledStep,
        sampled_ids: np.ndarray,
        sampled_logprobs: np.ndarray,
        top_ids: np.ndarray | None = None,
        top_logprobs: np.ndarray | None = None,
        prompt_scores: PromptScoreArrays | None = None,
        emitted: EmittedArrays | None = None,
        pooled: np.ndarray | None = None,
    ) -> StepOutputs:
        """Apply one step's result (`Results.update`): append sampled tokens (and the tokens each
        verification emitted), finish sequences, cache full blocks, keep prompt logprobs, take an
        embedding step's vectors. Entries of requests gone since the step was planned are ignored."""
        return self.results.update(
            step, sampled_ids, sampled_logprobs, top_ids, top_logprobs, prompt_scores, emitted, pooled
        )
