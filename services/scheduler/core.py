"""The scheduler core: continuous batching over the paged KV pool (pure logic, no sockets).

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
sequence that applies penalties, or whose sample in flight is its last by length, sits such a
step out (its history would end in the unknown token; or there is nothing left to decode).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np

from ipc.messages import SamplingParams, StepTokens
from services.scheduler.block_manager import BlockManager
from services.scheduler.plan import (
    EOS_FROM,
    FRONTEND,
    LAST_TOKEN,
    NEEDS_HISTORY,
    NUM_CACHED,
    NUM_COMPUTED,
    NUM_LOGPROBS,
    NUM_PROMPT,
    NUM_TOKENS,
    PlanTable,
    ScheduledStep,
    SteadyLine,
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


NO_TOP_LOGPROBS: list[dict[int, float]] = []  # shared by outputs without top logprobs: never mutated


class StepOutputs:
    """One step's results, packed: one new token for each request that sampled, in plan order,
    as columns (lists and arrays) gathered from the plan table.

    `step_tokens()` is the wire message, made of the columns as they are (the per-step hot path);
    indexing or iterating gives a `RequestOutput` per request (for tests and tools)."""

    __slots__ = (
        "finish_reasons",
        "frontend_ids",
        "logprobs",
        "num_cached_tokens",
        "num_prompt_tokens",
        "request_ids",
        "start_indices",
        "token_ids",
        "top_logprobs",
    )

    def __init__(
        self,
        request_ids: list[str],
        frontend_ids: list[int],
        start_indices: np.ndarray,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        top_logprobs: list[list[dict[int, float]]],
        finish_reasons: list[str | None],
        num_prompt_tokens: list[int],
        num_cached_tokens: list[int],
    ) -> None:
        self.request_ids = request_ids
        self.frontend_ids = frontend_ids
        self.start_indices = start_indices  # [N] int32: output index of each new token
        self.token_ids = token_ids  # [N] int32
        self.logprobs = logprobs  # [N] float32
        self.top_logprobs = top_logprobs
        self.finish_reasons = finish_reasons
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens

    @classmethod
    def empty(cls) -> StepOutputs:
        return cls([], [], np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32), [], [], [], [])

    def __len__(self) -> int:
        return len(self.request_ids)

    def __getitem__(self, j: int) -> RequestOutput:
        return RequestOutput(
            self.request_ids[j],
            self.frontend_ids[j],
            int(self.start_indices[j]),
            [int(self.token_ids[j])],
            [float(self.logprobs[j])],
            list(self.top_logprobs[j]),
            self.finish_reasons[j],
            self.num_prompt_tokens[j],
            self.num_cached_tokens[j],
        )

    def __iter__(self) -> Iterator[RequestOutput]:
        return (self[j] for j in range(len(self)))

    def step_tokens(self, entries: list[int] | None = None) -> StepTokens:
        """The wire message of these outputs (of `entries` only, when given), columns as they are."""

        def listed(column: list) -> list:
            return column if entries is None else [column[e] for e in entries]

        def packed(column: np.ndarray, dtype: str) -> bytes:
            return (column if entries is None else column[entries]).astype(dtype, copy=False).tobytes()

        return StepTokens(
            listed(self.request_ids),
            listed(self.frontend_ids),
            packed(self.start_indices, "<i4"),
            packed(self.token_ids, "<i4"),
            packed(self.logprobs, "<f4"),
            listed(self.top_logprobs),
            listed(self.finish_reasons),
            listed(self.num_prompt_tokens),
            listed(self.num_cached_tokens),
        )


# Per-row lists that update() gathers: output lists, request ids, frontend ids, prompt lengths,
# prefix hits.
RowColumns = tuple[list[list[int]], list[str], list[int], list[int], list[int]]


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
        self._order: np.ndarray | None = None  # plan-table rows of `running`; None when it changed
        self._line_columns: tuple[np.ndarray, RowColumns] | None = None  # see _row_columns
        self._decode_columns: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # see _all_decode_columns
        self._steady: SteadyLine | None = None  # of the line while it decodes whole, step after step
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

    def recompute(self, requests: list[Request]) -> None:
        """Put running requests back in line to recompute: a step of theirs will never have a
        result (the worker refused it). They keep their outputs, like a preempted request."""
        for req in requests:
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
                self._preempt(req)
        self._order = None

    def preempt_all(self) -> None:
        """The worker was lost: every running sequence recomputes later, keeping its outputs.
        The KV content is gone, so the prefix cache is cleared too."""
        for req in reversed(self.running):
            self._preempt(req)
        self.running.clear()
        self._order = None
        self.blocks.clear_cache()

    # -- planning -------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Plan the next step, or None when no sequence has anything to compute.

        With a step in flight (at most one), its sampling sequences decode ahead on placeholders
        where `_may_plan_ahead` allows; `build_plan` must follow before anything else changes."""
        bs = self.block_size
        blocks = self.blocks
        table = self.table
        num_computed = table.ints[NUM_COMPUTED]
        running = self.running
        budget = self.config.max_num_batched_tokens

        # 1. Decodes: running sequences with only their last sampled token to compute, in line
        # order, up to the budget; found and advanced with numpy over their plan-table rows.
        # That token is known (pending 1) or still being sampled by the step in flight (pending 0:
        # the decode's input is a placeholder).
        order = self._running_rows()
        computed, limits, known = table.ints[NUM_COMPUTED : NUM_TOKENS + 1].take(order, axis=1)
        pending = known - computed
        in_flight = pending == 0
        # count_nonzero: a third of the cost of any()/all() on arrays this small, every step.
        num_in_flight = np.count_nonzero(in_flight)
        if num_in_flight == len(running):  # steady decode planned ahead: every sample is in flight
            is_decode = self._may_plan_ahead(order, known, limits)
        else:
            is_decode = pending == 1
            if num_in_flight:
                is_decode |= in_flight & self._may_plan_ahead(order, known, limits)
        if len(running) <= budget and np.count_nonzero(is_decode) == len(running):  # steady decode: the whole line
            partial = []
            seqs = running[:]
            rows, starts, is_placeholder = order, computed, in_flight
        else:
            decodes = is_decode.nonzero()[0][:budget]
            partial = [running[i] for i in (pending > 1).nonzero()[0].tolist()]
            seqs = [running[i] for i in decodes.tolist()]
            rows, starts, is_placeholder = order[decodes], computed[decodes], in_flight[decodes]
        # A running sequence holds exactly the blocks of its computed tokens, so a decode whose
        # context fills its last block needs a new one; that may preempt the back of the line.
        entering = (starts % bs == 0).nonzero()[0]
        columns = starts[entering] // bs
        new_blocks: list[int] = []
        if 0 < len(entering) <= blocks.num_available:  # the usual case: one batch, nobody preempted
            new_blocks = blocks.allocate(len(entering))
            table.block_tables[rows[entering], columns] = new_blocks
            for j, b in zip(entering.tolist(), new_blocks, strict=True):
                seqs[j].block_ids.append(b)
        elif len(entering):
            self._steady = None  # these block-table writes are not mirrored in it
            if self._grow_decodes(seqs, entering.tolist()):
                seqs = [req for req in seqs if req.status is RequestStatus.RUNNING]
                rows = np.array([req.row for req in seqs], np.intp)
                starts = num_computed.take(rows)
                is_placeholder = starts == table.ints[NUM_TOKENS].take(rows)
        # The whole line decodes: keep its SteadyLine in step (any other step may write block
        # tables that it does not see, so it goes).
        if rows is order:
            steady = self._steady
            if steady is not None and steady.rows is order:
                steady.advance(entering, columns, new_blocks, bs)
            else:
                steady = self._steady = SteadyLine(order, table.block_tables, starts, bs)
        else:
            steady = self._steady = None
        num_computed.put(rows, starts + 1)
        budget -= len(seqs)
        num_decodes = len(seqs)
        more_rows: list[int] = []
        more_starts: list[int] = []
        num_new: list[int] = []

        # 2. Prompts (or recomputes) already under way, chunked to the budget and the free blocks.
        for req in partial:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted above
                continue
            done = int(num_computed[req.row])
            room = (len(req.block_ids) + blocks.num_available) * bs - done
            if room <= 0:
                if not self._make_room(req, seqs):
                    continue
                room = (len(req.block_ids) + blocks.num_available) * bs - done
            n = min(req.num_tokens - done, budget, room)
            self._grow(req, done + n)
            seqs.append(req)
            more_rows.append(req.row)
            more_starts.append(done)
            num_new.append(n)
            num_computed[req.row] = done + n
            budget -= n

        # 3. Waiting requests, best first; stop at the first that does not fit (no overtaking).
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            req = waiting[0]
            hits = self._prefix_hits(req)
            done = len(hits) * bs
            room = (len(hits) + blocks.num_available_besides(hits)) * bs - done
            n = min(req.num_tokens - done, budget, room)
            if n <= 0:
                break
            waiting.pop(0)
            blocks.acquire(hits)
            req.block_ids = hits
            req.num_registered_blocks = len(hits)
            req.num_cached_tokens = done
            self.num_prefix_query_tokens += req.num_tokens
            self.num_prefix_hit_tokens += done
            self._grow(req, done + n)
            req.status = RequestStatus.RUNNING
            table.assign(req, done + n)
            bisect.insort(running, req, key=_sort_key)
            self._order = None
            seqs.append(req)
            more_rows.append(req.row)
            more_starts.append(done)
            num_new.append(n)
            budget -= n

        if not seqs:
            return None
        if num_new:
            rows = np.concatenate((rows, np.array(more_rows, np.intp)))
            starts = np.concatenate((starts, np.array(more_starts, np.int32)))
            new_array = np.concatenate((np.ones(num_decodes, np.int32), np.array(num_new, np.int32)))
            is_sampled = np.ones(len(seqs), np.bool_)
            for j in range(num_decodes, len(seqs)):
                is_sampled[j] = starts[j] + new_array[j] == seqs[j].num_tokens
        else:
            is_sampled, new_array = self._all_decode_columns(num_decodes)
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
            eos_token_ids=self.config.eos_token_ids,
            steady=steady if not num_new else None,
        )

    def _all_decode_columns(self, num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
        """is_sampled and num_new_tokens of a step of `num_seqs` decodes: all ones, made once
        per size and read-only, since steady decode asks for the same ones every step."""
        columns = self._decode_columns.get(num_seqs)
        if columns is None:
            columns = (np.ones(num_seqs, np.bool_), np.ones(num_seqs, np.int32))
            for column in columns:
                column.flags.writeable = False
            self._decode_columns[num_seqs] = columns
        return columns

    def _may_plan_ahead(self, rows: np.ndarray, known: np.ndarray, limits: np.ndarray) -> np.ndarray:
        """Which of these rows, each with a sample in flight, `known` tokens and its LENGTH_LIMIT,
        may decode that sample before it is known: not when it is the last one by length, nor
        when the row applies penalties (the worker would need the unknown token in its history)."""
        allowed = known + 1 < limits
        if self.table.history:
            allowed &= self.table.ints[NEEDS_HISTORY].take(rows) == 0
        return allowed

    @property
    def can_plan_ahead(self) -> bool:
        """False while some running sequence applies penalties: planned ahead, it would sit out
        every other step, so the caller rather plans synchronously until it leaves."""
        return not self.table.history

    def _running_rows(self) -> np.ndarray:
        """Plan-table rows of the running sequences, in line order (cached until the line changes)."""
        if self._order is None:
            self._order = np.array([req.row for req in self.running], np.intp)
        return self._order

    def _grow_decodes(self, seqs: list[Request], entering: list[int]) -> bool:
        """Give each decode `seqs[j]`, j in `entering`, its next block, preempting from the back
        of the line when none is left; True when some of `seqs` were preempted."""
        blocks = self.blocks
        block_tables = self.table.block_tables
        num_preemptions = self.num_preemptions
        for j in entering:
            req = seqs[j]
            if req.status is not RequestStatus.RUNNING:  # preempted for an earlier decode
                continue
            if not blocks.num_available and not self._make_room(req, seqs[:j]):
                break  # req itself was preempted: it was the last in line, and so were those after it
            b = blocks.allocate(1)[0]
            block_tables[req.row, len(req.block_ids)] = b
            req.block_ids.append(b)
        return self.num_preemptions != num_preemptions

    def _make_room(self, req: Request, planned: list[Request]) -> bool:
        """Preempt from the back of the line (lowest priority, latest arrival), sparing sequences
        already planned in this step, until a block is free. False when `req` itself had to go."""
        running = self.running
        while not self.blocks.num_available:
            j = len(running) - 1
            while running[j] in planned:  # req is in running and unplanned, so this stops
                j -= 1
            victim = running.pop(j)
            self._order = None
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
    ) -> StepOutputs:
        """Apply one step's result: append sampled tokens, finish sequences, cache full blocks.

        Entries of requests preempted, aborted or replaced since the step was planned are ignored.
        The result arrays may be views into a ring slot: nothing returned refers to them.
        """
        table = self.table
        bs = self.block_size
        seqs = step.seqs
        rows = step.rows
        # A row's epoch moves when it is released (finish, abort, preemption, replacement);
        # when no row was released since planning, every entry is live.
        is_all_live = table.num_releases == step.num_releases
        live = None if is_all_live else table.epoch.take(rows) == step.row_epochs
        # Prompt blocks filled by this step join the prefix cache at once, for requests that
        # arrive while this one runs; blocks of generated tokens join when the sequence leaves.
        if self.blocks.enable_prefix_caching and step.num_decodes < len(seqs):
            ends = step.starts + step.num_new_tokens
            for i in range(step.num_decodes, len(seqs)):
                req = seqs[i]
                if (live is None or live[i]) and ends[i] // bs > req.num_registered_blocks:
                    self._register_blocks(req, int(ends[i]) // bs)
        if live is None and step.num_decodes == len(seqs):  # steady decode: all of them
            sampled = np.arange(len(seqs))
        else:
            sampled = np.flatnonzero(step.is_sampled if live is None else live & step.is_sampled)
        num_sampled = len(sampled)
        if num_sampled == 0:
            return StepOutputs.empty()
        all_sampled = num_sampled == len(seqs)
        sampled_rows = rows if all_sampled else rows[sampled]
        # Copies, never views of the result slot.
        tokens = np.array(sampled_ids if all_sampled else sampled_ids[sampled], np.int32)
        logprobs = np.array(sampled_logprobs if all_sampled else sampled_logprobs[sampled], np.float32)
        ints = table.ints
        ints[LAST_TOKEN].put(sampled_rows, tokens)
        known, check_from, num_prompt = ints[NUM_TOKENS : NUM_PROMPT + 1].take(sampled_rows, axis=1)
        num_tokens = known + 1
        ints[NUM_TOKENS].put(sampled_rows, num_tokens)
        # Finish checks, vectorized over the batch; only candidates get a look in Python.
        candidates = num_tokens >= check_from
        for e in self.eos_token_ids:
            is_eos = tokens == e
            if np.count_nonzero(is_eos):
                candidates |= is_eos & (num_tokens > ints[EOS_FROM].take(sampled_rows))
        num_logprobs = ints[NUM_LOGPROBS].take(sampled_rows) if table.num_logprob_rows else None
        output_lists, request_ids, frontend_ids, prompt_lens, cached_lens = self._row_columns(sampled_rows)

        token_list = tokens.tolist()
        # list.append over the rows' output lists, run by map() in C (append returns None).
        any(map(list.append, output_lists, token_list))
        reasons: list[str | None] = [None] * num_sampled
        finishing = np.flatnonzero(candidates).tolist() if np.count_nonzero(candidates) else []
        for j in finishing:
            req = seqs[int(sampled[j])]
            reasons[j] = self._finish_reason(req.params, token_list[j], req.num_output_tokens, req.num_tokens)
        tops: list[list[dict[int, float]]] = [NO_TOP_LOGPROBS] * num_sampled
        if top_ids is not None and top_logprobs is not None and num_logprobs is not None:
            for j in np.flatnonzero(num_logprobs).tolist():
                k = int(num_logprobs[j])
                i = int(sampled[j])
                tops[j] = [dict(zip(top_ids[i, :k].tolist(), top_logprobs[i, :k].tolist(), strict=True))]
        if table.history:  # only rows that apply penalties have one
            for j in np.flatnonzero(ints[NEEDS_HISTORY].take(sampled_rows)).tolist():
                req = seqs[int(sampled[j])]
                table.history[req.row][req.num_tokens - 1] = token_list[j]
        outputs = StepOutputs(
            request_ids,
            frontend_ids,
            known - num_prompt,  # the new token's output index
            tokens,
            logprobs,
            tops,
            reasons,
            prompt_lens,
            cached_lens,
        )
        for j in finishing:
            if reasons[j] is not None:
                req = seqs[int(sampled[j])]
                self._drop(req, RequestStatus.FINISHED)
                req.finish_reason = reasons[j]
        return outputs

    def _row_columns(self, rows: np.ndarray) -> RowColumns:
        """What update() reads of these rows as Python lists: their output lists, request ids,
        frontend ids, prompt lengths and prefix hits, none of which change while a row's request
        runs. A steady decode step samples the whole running line (`rows is self._order`), so
        the line's lists are gathered once, not once per step. The lists are shared by the
        steps' outputs, which never change them.

        A cached line still fits a later step that samples all of its rows: a row changes
        request only when it is released, which makes a new line and changes the row's epoch, so
        a step planned on the old line would not have sampled that row."""
        if self._line_columns is not None and self._line_columns[0] is rows:
            return self._line_columns[1]
        table, ints = self.table, self.table.ints
        columns = (
            table.output_ids.take(rows).tolist(),
            table.request_ids.take(rows).tolist(),
            ints[FRONTEND].take(rows).tolist(),
            ints[NUM_PROMPT].take(rows).tolist(),
            ints[NUM_CACHED].take(rows).tolist(),
        )
        if rows is self._order:  # a new line is a new array: the old entry can never match it
            self._line_columns = (rows, columns)
        return columns

    def _finish_reason(
        self, params: SamplingParams, token: int, num_outputs: int, num_tokens: int
    ) -> str | None:
        """Why a request stops once `token` is its latest output (with these counts), or None."""
        if num_outputs > params.min_tokens and (
            (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        ):
            return "stop"
        # max_tokens None (the frontend fills in its default): only max_model_len bounds it.
        if (params.max_tokens is not None and num_outputs >= params.max_tokens) or (
            num_tokens >= self.config.max_model_len
        ):
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
        if req.row >= 0:
            # A decode planned ahead counts its unknown input as computed: only known tokens hash.
            num_full = min(int(self.table.ints[NUM_COMPUTED, req.row]), req.num_tokens) // self.block_size
            if self.blocks.enable_prefix_caching and num_full > req.num_registered_blocks:
                self._register_blocks(req, num_full)
            self.table.release(req)
        self.blocks.release(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0

    def _drop(self, req: Request, status: RequestStatus) -> None:
        """Remove a live request for good (finished, aborted or replaced)."""
        queue = self.running if req.status is RequestStatus.RUNNING else self.waiting
        i = bisect.bisect_left(queue, _sort_key(req), key=_sort_key)
        while queue[i] is not req:  # equal keys: a replaced request shares its order
            i += 1
        del queue[i]
        self._order = None
        self._release(req)
        req.status = status
        del self.requests[req.request_id]
