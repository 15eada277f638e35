"""The scheduler core: continuous batching over the paged KV pool (pure logic, no sockets).

Each `schedule()` plans one step: single-token decodes of running sequences first, then the rest
of partially computed prompts, then new (or preempted) requests from the waiting queue, in
priority order (lower `params.priority` first, then first come first served), within
`max_num_batched_tokens` and `max_num_seqs`. A prompt longer than what is left of the token budget
is chunked over steps; only its final chunk samples. When a decode needs a block and none is
left, the lowest-priority, latest-arrived running sequence is preempted by recompute: its blocks
are freed and it goes back to waiting with the tokens it generated, to be prefilled again later
(sampling depends only on seed and position, so its outputs do not change).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import msgspec
import numpy as np

from ipc.messages import SamplingParams
from services.scheduler.block_manager import BlockManager
from services.scheduler.plan import (
    EOS_FROM,
    HAS_STOP_IDS,
    LAST_TOKEN,
    NEEDS_HISTORY,
    NUM_LOGPROBS,
    STOP_LEN,
    PlanTable,
    ScheduledStep,
)
from services.scheduler.request import Request, RequestStatus


class Overloaded(RuntimeError):
    """The waiting queue is full: the request is refused rather than queued without bound."""


class PromptTooLong(ValueError):
    """Prompt plus outputs leave no room to generate under max_model_len."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 2048
    max_num_waiting: int = 1024
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0, got {self.max_num_waiting}")
        # One sequence alone must always fit, or it would preempt itself forever.
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"{self.num_blocks} KV blocks of {self.block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len}; lower max_model_len or give the KV cache more memory"
            )


class RequestOutput(msgspec.Struct, gc=False):
    """New tokens of one request from one step; `start_index` is the output index of the first."""

    request_id: str
    frontend_id: int
    start_index: int
    new_token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


def _sort_key(req: Request) -> tuple[int, int]:
    return (req.priority, req.arrival_order)


class Scheduler:
    """Owns the live requests of one engine group (waiting and running), the KV block pool and
    the plan table; turns them into steps and step results into request outputs."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.table = PlanTable(config.max_num_seqs, max_blocks_per_seq, config.max_model_len)
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by _sort_key
        self.running: list[Request] = []  # sorted by _sort_key
        self._next_arrival = 0
        self.num_unknown_aborts = 0
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    # -- counters -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks referenced by live sequences."""
        return self.blocks.num_used / self.blocks.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens looked up, at admission."""
        return (
            self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0
        )

    # -- requests in and out --------------------------------------------------------------------

    def add(self, req: Request) -> RequestOutput | None:
        """Queue a request; a live request with the same id is replaced (resubmission).

        A resubmitted request whose outputs already meet a finish condition is not queued: its
        final (empty) output is returned instead. Raises `PromptTooLong`, `Overloaded`, or
        ValueError for an empty prompt.
        """
        if not req.num_prompt_tokens:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        old = self.requests.get(req.request_id)
        if req.output_ids:
            reason = self._finish_reason(
                req.params, req.output_ids[-1], req.num_output_tokens, req.num_tokens
            )
            if reason is not None:
                if old is not None:
                    self._drop(old, RequestStatus.ABORTED)
                req.status = RequestStatus.FINISHED
                req.finish_reason = reason
                return RequestOutput(
                    req.request_id,
                    req.frontend_id,
                    req.num_output_tokens,
                    [],
                    [],
                    [],
                    reason,
                    req.num_prompt_tokens,
                    0,
                )
        if req.num_tokens >= self.config.max_model_len:
            raise PromptTooLong(
                f"request {req.request_id!r}: {req.num_prompt_tokens} prompt + {req.num_output_tokens} output "
                f"tokens leave no room under max_model_len={self.config.max_model_len}"
            )
        if old is not None:
            req.arrival_order = old.arrival_order  # a resubmission keeps its place in line
            self._drop(old, RequestStatus.ABORTED)
        else:
            if len(self.waiting) >= self.config.max_num_waiting:
                raise Overloaded(
                    f"scheduler overloaded: {len(self.waiting)} requests already waiting "
                    f"(max_num_waiting={self.config.max_num_waiting}); retry later"
                )
            req.arrival_order = self._next_arrival
            self._next_arrival += 1
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=_sort_key)
        return None

    def abort(self, request_id: str) -> bool:
        """Drop a live request without further output; False (and counted) when it is unknown."""
        req = self.requests.get(request_id)
        if req is None:
            self.num_unknown_aborts += 1
            return False
        self._drop(req, RequestStatus.ABORTED)
        req.finish_reason = "abort"
        return True

    def preempt_all(self) -> None:
        """The worker was lost: every running sequence recomputes later, keeping its outputs.
        The KV content is gone, so the prefix cache is cleared too."""
        for req in reversed(self.running):
            self._preempt(req)
        self.running.clear()
        self.blocks.clear_cache()

    # -- planning -------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Plan the next step, or None when no sequence has anything to compute."""
        bs = self.block_size
        blocks = self.blocks
        table = self.table
        running = self.running
        budget = self.config.max_num_batched_tokens
        seqs: list[Request] = []
        rows: list[int] = []
        starts: list[int] = []
        partial: list[Request] = []

        # 1. Decodes: one token each; one entering a new block may preempt the back of the line.
        # Preemption only removes sequences behind `req`, which this loop then never reaches.
        for req in running:
            if budget == 0:
                break
            computed = req.num_computed_tokens
            n = req.num_tokens - computed
            if n != 1:
                if n > 1:
                    partial.append(req)
                continue
            if not computed % bs and computed == len(req.block_ids) * bs:
                if not blocks.num_available and not self._make_room(req, seqs):
                    break  # req itself was preempted: it was the last in line
                b = blocks.allocate(1)[0]
                table.block_tables[req.row, len(req.block_ids)] = b
                req.block_ids.append(b)
            seqs.append(req)
            rows.append(req.row)
            starts.append(computed)
            req.num_computed_tokens = computed + 1
            budget -= 1
        num_decodes = len(seqs)
        num_new = [1] * num_decodes

        # 2. Prompts (or recomputes) already under way, chunked to the budget and the free blocks.
        for req in partial:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted above
                continue
            computed = req.num_computed_tokens
            room = (len(req.block_ids) + blocks.num_available) * bs - computed
            if room <= 0:
                if not self._make_room(req, seqs):
                    continue
                room = (len(req.block_ids) + blocks.num_available) * bs - computed
            n = min(req.num_tokens - computed, budget, room)
            self._grow(req, computed + n)
            seqs.append(req)
            rows.append(req.row)
            starts.append(computed)
            num_new.append(n)
            req.num_computed_tokens = computed + n
            budget -= n

        # 3. Waiting requests, best first; stop at the first that does not fit (no overtaking).
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            req = waiting[0]
            hits = self._prefix_hits(req)
            computed = len(hits) * bs
            room = (len(hits) + blocks.num_available_besides(hits)) * bs - computed
            n = min(req.num_tokens - computed, budget, room)
            if n <= 0:
                break
            waiting.pop(0)
            blocks.acquire(hits)
            req.block_ids = hits
            req.num_registered_blocks = len(hits)
            req.num_cached_tokens = computed
            self.num_prefix_query_tokens += req.num_tokens
            self.num_prefix_hit_tokens += computed
            self._grow(req, computed + n)
            req.status = RequestStatus.RUNNING
            table.assign(req)
            bisect.insort(running, req, key=_sort_key)
            seqs.append(req)
            rows.append(req.row)
            starts.append(computed)
            num_new.append(n)
            req.num_computed_tokens = computed + n
            budget -= n

        if not seqs:
            return None
        row_array = np.array(rows, np.intp)
        start_array = np.array(starts, np.int32)
        new_array = np.array(num_new, np.int32)
        is_sampled = np.ones(len(seqs), np.bool_)
        for j in range(num_decodes, len(seqs)):
            is_sampled[j] = starts[j] + num_new[j] == seqs[j].num_tokens
        return ScheduledStep(
            seqs=seqs,
            rows=row_array,
            row_epochs=table.epoch[row_array],
            starts=start_array,
            num_new_tokens=new_array,
            is_sampled=is_sampled,
            num_decodes=num_decodes,
            table=table,
            eos_token_ids=self.config.eos_token_ids,
        )

    def _make_room(self, req: Request, planned: list[Request]) -> bool:
        """Preempt from the back of the line (lowest priority, latest arrival), sparing sequences
        already planned in this step, until a block is free. False when `req` itself had to go."""
        running = self.running
        while not self.blocks.num_available:
            j = len(running) - 1
            while running[j] in planned:  # req is in running and unplanned, so this stops
                j -= 1
            victim = running.pop(j)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _grow(self, req: Request, num_tokens: int) -> None:
        """Allocate the blocks that `num_tokens` tokens of the request need (the caller checked room)."""
        have = len(req.block_ids)
        need = -(-num_tokens // self.block_size) - have
        if need > 0:
            new = self.blocks.allocate(need)
            if req.row >= 0:
                self.table.block_tables[req.row, have : have + need] = new
            req.block_ids.extend(new)

    def _prefix_hits(self, req: Request) -> list[int]:
        """Cached blocks covering a prefix of the request, always leaving its last token to compute
        (so there are logits to sample, and no write lands in a shared block)."""
        if not self.blocks.enable_prefix_caching:
            return []
        num_full = (req.num_tokens - 1) // self.block_size
        if num_full > len(req.block_hashes):
            start = len(req.block_hashes) * self.block_size
            self.blocks.extend_hashes(req.block_hashes, req.token_slice(start, num_full * self.block_size))
        return self.blocks.match_prefix(req.block_hashes[:num_full])

    # -- results --------------------------------------------------------------------------------

    def update(
        self,
        step: ScheduledStep,
        sampled_ids: np.ndarray,
        sampled_logprobs: np.ndarray,
        top_ids: np.ndarray | None = None,
        top_logprobs: np.ndarray | None = None,
    ) -> list[RequestOutput]:
        """Apply one step's result: append sampled tokens, finish sequences, cache full blocks.

        Entries of requests preempted, aborted or replaced since the step was planned are ignored.
        """
        table = self.table
        bs = self.block_size
        seqs = step.seqs
        rows = step.rows
        ends = step.starts + step.num_new_tokens
        # A row's epoch moves when it is released (finish, abort, preemption, replacement).
        live = table.epoch[rows] == step.row_epochs
        # Prompt blocks filled by this step join the prefix cache at once, for requests that
        # arrive while this one runs; blocks of generated tokens join when the sequence leaves.
        if self.blocks.enable_prefix_caching and step.num_decodes < len(seqs):
            for i in range(step.num_decodes, len(seqs)):
                req = seqs[i]
                if live[i] and ends[i] // bs > req.num_registered_blocks:
                    self._register_blocks(req, int(ends[i]) // bs)
        sampled = np.flatnonzero(live & step.is_sampled)
        num_sampled = len(sampled)
        if num_sampled == 0:
            return []
        all_sampled = num_sampled == len(seqs)
        sampled_rows = rows if all_sampled else rows[sampled]
        tokens = sampled_ids if all_sampled else sampled_ids[sampled]
        ints = table.ints
        ints[LAST_TOKEN][sampled_rows] = tokens
        # Finish checks, vectorized over the batch; only candidates get a look in Python.
        lens_after = (ends if all_sampled else ends[sampled]) + 1
        candidates = lens_after >= ints[STOP_LEN][sampled_rows]
        candidates |= ints[HAS_STOP_IDS][sampled_rows] != 0
        if self.eos_token_ids:
            eos_from = ints[EOS_FROM][sampled_rows]
            for e in self.eos_token_ids:
                candidates |= (tokens == e) & (lens_after > eos_from)
        num_logprobs = ints[NUM_LOGPROBS][sampled_rows]
        needs_history = ints[NEEDS_HISTORY][sampled_rows]

        token_list = tokens.tolist()
        logprob_list = (sampled_logprobs if all_sampled else sampled_logprobs[sampled]).tolist()
        sampled_seqs = seqs if all_sampled else [seqs[i] for i in sampled.tolist()]
        reasons: list[str | None] = [None] * num_sampled
        finishing = np.flatnonzero(candidates).tolist() if np.count_nonzero(candidates) else []
        for j in finishing:
            req = sampled_seqs[j]
            reasons[j] = self._finish_reason(
                req.params, token_list[j], req.num_output_tokens + 1, req.num_tokens + 1
            )
        tops: list[list[dict[int, float]]] = [[]] * num_sampled  # shared only until replaced below
        if top_ids is not None and top_logprobs is not None and np.count_nonzero(num_logprobs):
            for j in np.flatnonzero(num_logprobs).tolist():
                k = int(num_logprobs[j])
                i = int(sampled[j])
                tops[j] = [dict(zip(top_ids[i, :k].tolist(), top_logprobs[i, :k].tolist(), strict=True))]

        outputs: list[RequestOutput] = []
        add_output = outputs.append
        for req, token, logprob, top, reason in zip(
            sampled_seqs, token_list, logprob_list, tops, reasons, strict=True
        ):
            output_ids = req.output_ids
            add_output(
                RequestOutput(
                    req.request_id,
                    req.frontend_id,
                    len(output_ids),
                    [token],
                    [logprob],
                    top or [],
                    reason,
                    len(req.prompt_ids),
                    req.num_cached_tokens,
                )
            )
            output_ids.append(token)
            req.num_tokens += 1
        if np.count_nonzero(needs_history):
            for j in np.flatnonzero(needs_history).tolist():
                req = sampled_seqs[j]
                table.history[req.row][req.num_tokens - 1] = token_list[j]
        for j in finishing:
            if reasons[j] is not None:
                req = sampled_seqs[j]
                self._drop(req, RequestStatus.FINISHED)
                req.finish_reason = reasons[j]
        return outputs

    def _finish_reason(
        self, params: SamplingParams, token: int, num_outputs: int, num_tokens: int
    ) -> str | None:
        """Why a request stops once `token` is its latest output (with these counts), or None."""
        if num_outputs > params.min_tokens and (
            (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        ):
            return "stop"
        if num_outputs >= params.max_tokens or num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _register_blocks(self, req: Request, num_full: int) -> None:
        """Offer the request's blocks that are now full of computed tokens to the prefix cache."""
        blocks = self.blocks
        if num_full > len(req.block_hashes):
            start = len(req.block_hashes) * self.block_size
            blocks.extend_hashes(req.block_hashes, req.token_slice(start, num_full * self.block_size))
        for j in range(req.num_registered_blocks, num_full):
            blocks.register(req.block_ids[j], req.block_hashes[j])
        req.num_registered_blocks = num_full

    # -- internals ------------------------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and put it back in line (the caller removed it from
        `running`); it keeps its outputs and recomputes prompt + outputs when readmitted."""
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=_sort_key)

    def _release(self, req: Request) -> None:
        """Free a request's row and blocks, first offering its full computed blocks to the cache."""
        if (
            self.blocks.enable_prefix_caching
            and req.num_computed_tokens // self.block_size > req.num_registered_blocks
        ):
            self._register_blocks(req, req.num_computed_tokens // self.block_size)
        if req.row >= 0:
            self.table.release(req)
        self.blocks.release(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0

    def _drop(self, req: Request, status: RequestStatus) -> None:
        """Remove a live request for good (finished, aborted or replaced)."""
        queue = self.running if req.status is RequestStatus.RUNNING else self.waiting
        i = bisect.bisect_left(queue, _sort_key(req), key=_sort_key)
        while queue[i] is not req:  # equal keys: a replaced request shares its order
            i += 1
        del queue[i]
        self._release(req)
        req.status = status
        del self.requests[req.request_id]
