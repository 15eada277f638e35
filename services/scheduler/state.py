"""What every scheduling phase shares: the live requests (the waiting queue and the running line,
each in priority order), the KV block pool, the plan table, and the moves of a request between
them that take or free its blocks and its plan-table row.

Every change of the running line (a request starts running, leaves it or is preempted) bumps
`line_version`: the steady-decode caches (services/scheduler/decode.py) hold for one version.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from ipc.step_plan import vocab_words
from services.metrics import FinishedTimes
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.lora_residency import LoraResidency
from services.scheduler.plan import PlanTable
from services.scheduler.request import Request, RequestStatus

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from services.scheduler.grammars import Grammars


# Finished requests whose times the next heartbeat has not taken into the metrics yet.
FINISHED_TIMES_KEPT = 4096


def sort_key(req: Request) -> tuple[int, int]:
    """Line order: lower `params.priority` first, then first come first served."""
    return (req.priority, req.arrival_order)


class SchedulerState:
    """The scheduler's shared state; every phase module reads and changes it through here."""

    def __init__(self, config: SchedulerConfig, grammars: Grammars | None = None) -> None:
        self.config = config  # replaced on hot reload (max_num_waiting): read it here, never keep it
        self.block_size = config.block_size
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.engine.enable_prefix_caching)
        max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.table = PlanTable(config.engine.max_num_seqs, max_blocks_per_seq, config.max_model_len)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key
        self.grammars = grammars  # None: the engine refuses structured output
        # 32-bit words of a bitmask row (a grammar's, or allowed_token_ids'); 0: no vocabulary known
        self.mask_words = (
            vocab_words(config.vocab_size) if config.vocab_size else grammars.words if grammars else 0
        )
        self.compiling: list[Request] = []  # constrained, their grammar still compiling (arrival order)
        self.line_version = 0
        self.num_preemptions = 0
        self.finished_times: deque[FinishedTimes] = deque(maxlen=FINISHED_TIMES_KEPT)
        self.lora = LoraResidency(config.max_loras, max(config.lora_slots, config.max_loras))
        # (request, prompt tokens computed) to report, of requests that asked for their prompt's
        # progress (report_prompt_progress): when a prefill starts and after each of its chunks
        self.prompt_progress: list[tuple[Request, int]] = []

    def start_running(self, req: Request) -> None:
        """Put an admitted request (its row assigned) into the running line."""
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=sort_key)
        self.line_version += 1

    def stop_running(self, req: Request) -> None:
        """Take a running request out of the line (the caller then preempts or drops it)."""
        self.running.remove(req)
        self.line_version += 1

    def preempt(self, req: Request) -> None:
        """Free a running request's blocks and put it back in line (the caller took it out of
        `running`); it keeps its outputs and recomputes prompt + outputs when readmitted."""
        log.debug(
            "request %s preempted at %d output tokens: it recomputes them when readmitted",
            req.request_id,
            req.num_output_tokens,
        )
        self.release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=sort_key)

    def preempt_all(self) -> None:
        """Preempt the whole running line; the KV content is gone, so the prefix cache goes too."""
        for req in reversed(self.running):
            self.preempt(req)
        self.running.clear()
        self.line_version += 1
        self.blocks.clear_cache()

    def drop(self, req: Request, status: RequestStatus) -> None:
        """Remove a live request for good (finished, aborted or replaced)."""
        if req.status is RequestStatus.COMPILING:
            self.compiling.remove(req)
        else:
            queue = self.running if req.status is RequestStatus.RUNNING else self.waiting
            i = bisect.bisect_left(queue, sort_key(req), key=sort_key)
            while queue[i] is not req:  # equal keys: a replaced request shares its order
                i += 1
            del queue[i]
            self.line_version += 1
        self.release(req)
        req.status = status
        del self.requests[req.request_id]
        if status is RequestStatus.FINISHED:
            self.finished_times.append(times_of(req, time.monotonic()))

    def release(self, req: Request) -> None:
        """Free a request's row and blocks, first offering its full computed blocks to the cache."""
        if req.row >= 0:
            # A decode planned ahead counts its unknown input as computed: only known tokens hash.
            num_full = min(int(self.table.num_computed[req.row]), req.num_tokens) // self.block_size
            if self.blocks.enable_prefix_caching and num_full > req.num_registered_blocks:
                self.register_blocks(req, num_full)
            self.table.release(req)
        if req.lora_slot >= 0:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1
        self.blocks.release(req.block_ids[req.num_released_blocks :])
        req.block_ids = []
        req.num_registered_blocks = 0
        req.num_released_blocks = 0

    def release_before_window(self, req: Request, position: int) -> None:
        """Give back the running request's leading blocks that lie wholly before the sliding
        window of its query at `position` (config.sliding_window; later queries look later still).

        The block table keeps their ids: the attention of every layer reads only keys inside its
        window, so a released block that another sequence reuses is never read through this
        table. A full computed block joins the prefix cache first, as it would on release.
        """
        window = self.config.sliding_window
        num_before = min((position - window + 1) // self.block_size, len(req.block_ids))
        if not window or num_before <= req.num_released_blocks:
            return
        if self.blocks.enable_prefix_caching and num_before > req.num_registered_blocks:
            self.register_blocks(req, num_before)
        self.blocks.release(req.block_ids[req.num_released_blocks : num_before])
        req.num_released_blocks = num_before

    def register_blocks(self, req: Request, num_full: int) -> None:
        """Offer the request's blocks that are now full of computed tokens to the prefix cache."""
        blocks = self.blocks
        if num_full > len(req.block_hashes):
            start = len(req.block_hashes) * self.block_size
            blocks.extend_hashes(
                req.block_hashes,
                req.token_slice(start, num_full * self.block_size),
                req.hash_root,
                req.block_salts(len(req.block_hashes), num_full, self.block_size),
            )
        for j in range(req.num_registered_blocks, num_full):
            blocks.register(req.block_ids[j], req.block_hashes[j])
        req.num_registered_blocks = num_full

    def grow(self, req: Request, num_tokens: int) -> None:
        """Allocate the blocks that `num_tokens` tokens of the request need (the caller checked room)."""
        have = len(req.block_ids)
        need = -(-num_tokens // self.block_size) - have
        if need > 0:
            new = self.blocks.allocate(need)
            if req.row >= 0:
                self.table.block_tables[req.row, have : have + need] = new
            req.block_ids.extend(new)

    def make_room(self, req: Request, planned: list[Request]) -> bool:
        """Preempt from the back of the line (lowest priority, latest arrival), sparing sequences
        already planned in this step, until a block is free. False when `req` itself had to go."""
        running = self.running
        while not self.blocks.num_available:
            j = len(running) - 1
            while running[j] in planned:  # req is in running and unplanned, so this stops
                j -= 1
            victim = running.pop(j)
            self.line_version += 1
            self.preempt(victim)
            if victim is req:
                return False
        return True


def times_of(req: Request, now: float) -> FinishedTimes:
    if req.scheduled_at is None or req.first_token_at is None:
        return FinishedTimes(req.num_preemptions, None, None)
    return FinishedTimes(req.num_preemptions, req.first_token_at - req.scheduled_at, now - req.scheduled_at)
