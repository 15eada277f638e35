"""The step pipeline of one engine group: it keeps up to two steps in flight so that the workers
never wait on planning in steady decode (docs/architecture.md, "Data plane").

    scheduler: publish N | plan, publish N+1 | wait for N, update(N), emit | plan, publish N+2 | ...
    worker:               executes N ......................| executes N+1 .........................

Step N+1 is planned before N's result is applied: decodes of the sequences that N samples run on
a placeholder the worker fills in (services/scheduler/core.py), and results are applied strictly
in order. The pipeline runs one step at a time (plan, execute, apply) while the core cannot plan
ahead (a running sequence applies penalties) and right after a refused step (see `_fail`).

The executor is the transport: the shared-memory rings (`RingExecutor`) in the scheduler process
and the scheduler benchmark, a fake in the core tests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

import numpy as np

from ipc.codec import RESULT_HEADER, STEP_HEADER
from ipc.messages import ResultHeader
from ipc.shm import RingTimeout, ShmRing
from ipc.step_plan import EMITTED_ARRAYS, STEP_RESULT, Dim, SlotMismatch
from services.scheduler.core import Scheduler, StepOutputs
from services.scheduler.plan import ScheduledStep, write_plan
from services.scheduler.request import Request
from services.scheduler.results import EmittedArrays, PromptScoreArrays

RING_POLL_S = 0.2  # how often a wait on a ring looks whether the worker is still alive
MAX_EXECUTE_TIMES = 4096  # step times kept for the metrics until the next heartbeat takes them

StepResult = tuple[ResultHeader, dict[str, np.ndarray]]
T = TypeVar("T")
# The result arrays of prompt logprobs, in PromptScoreArrays' order.
PROMPT_SCORE_ARRAYS = ("prompt_logprobs", "prompt_ranks", "prompt_top_ids", "prompt_top_logprobs")


class WorkerLost(Exception):
    """The workers died or stopped answering: their steps are gone, every sequence recomputes."""


class StepTooLate(WorkerLost):
    """The workers are alive, but a step's result did not come within the step timeout."""


class StepExecutor(Protocol):
    def publish(self, step_id: int, step: ScheduledStep) -> None:
        """Hand a step to the workers, building its plan now (before the core changes again)."""
        ...

    def result(self) -> AbstractContextManager[StepResult]:
        """The oldest step result not read yet; its arrays are valid inside the with-block."""
        ...


@dataclass(slots=True)
class InFlight:
    step_id: int
    step: ScheduledStep
    after_failure: bool = False  # planned before an earlier step was refused (see `_fail`)


class StepPipeline:
    """Drives the `Scheduler` core through an executor, one applied step per `advance()`."""

    def __init__(
        self,
        core: Scheduler,
        executor: StepExecutor,
        on_failed: Callable[[list[Request], str], None],
        overlap: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.core = core
        self.executor = executor
        self.on_failed = on_failed  # the requests of a step the worker refused, and why
        self.overlap = overlap
        self.in_flight: deque[InFlight] = deque()
        self.next_step_id = 0  # consecutive: a placeholder means "sampled in step_id - 1"
        self.num_planned_ahead = 0
        # (computed prompt tokens, the worker's execute_s) of each applied step, for the metrics.
        # Each step's (whether it computed prompt tokens, the worker's seconds, its tokens).
        self.executed_steps: deque[tuple[bool, float, int]] = deque(maxlen=MAX_EXECUTE_TIMES)
        # When the last result came, while steps kept coming: None once `advance` found nothing to
        # run (the scheduler's loop may also skip `advance` while idle without clearing it; the
        # first step after that carries a prompt, which is never timed) or the workers were lost.
        # The adaptive speculation rule times each step from it (see `_apply_oldest`).
        self.clock = clock
        self.last_result_at: float | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.in_flight) or self.core.has_work

    def advance(self) -> StepOutputs | None:
        """Publish what may run now, then wait for the oldest step in flight and apply its result.
        None when there was nothing to run. Raises WorkerLost (then call `drop_in_flight`)."""
        if not self.in_flight and not self._publish_next():
            self.last_result_at = None
            return None
        if self._may_plan_ahead() and self._publish_next():
            # Step N+1 is out before N's result: the worker starts it as soon as N is done.
            self.num_planned_ahead += 1
        return self._apply_oldest()

    def drop_in_flight(self) -> None:
        """The workers were lost with the steps they held; the caller recomputes everything."""
        self.in_flight.clear()
        self.last_result_at = None

    def _may_plan_ahead(self) -> bool:
        # Only one step ahead: a placeholder stands for the previous step's sample, no older one.
        return (
            self.overlap
            and len(self.in_flight) == 1
            and not self.in_flight[0].after_failure
            and self.core.can_plan_ahead
        )

    def _publish_next(self) -> bool:
        step = self.core.schedule()
        if step is None:
            return False
        step_id = self.next_step_id
        self.next_step_id += 1
        self.executor.publish(step_id, step)
        self.in_flight.append(InFlight(step_id, step))
        return True

    def _apply_oldest(self) -> StepOutputs:
        entry = self.in_flight.popleft()
        with self.executor.result() as (header, arrays):
            if header.step_id != entry.step_id:  # results come in order; anything else is a bug
                raise WorkerLost(f"got the result of step {header.step_id}, expected step {entry.step_id}")
            if not header.error and entry.step.prompt_spans and "prompt_logprobs" not in arrays:
                header = ResultHeader(header.step_id, header.num_seqs, "step result: no prompt logprobs")
            if not header.error and entry.step.proposals and "emitted_ids" not in arrays:
                header = ResultHeader(header.step_id, header.num_seqs, "step result: no emitted tokens")
            if not header.error and self.core.config.pooling and "pooled" not in arrays:
                header = ResultHeader(header.step_id, header.num_seqs, "step result: no pooled vectors")
            now, last_result_at = self.clock(), self.last_result_at
            self.last_result_at = now
            if header.error:
                self._fail(entry, header.error)
                return StepOutputs.empty()
            step = entry.step
            has_prompt = step.num_decodes + step.num_verifying < step.num_seqs
            self.executed_steps.append((has_prompt, header.execute_s, step.num_tokens))
            if (
                self.core.speculation is not None
                and not has_prompt
                and header.execute_s > 0  # a worker that measures nothing is not timed
                and last_result_at is not None
            ):
                # What the step cost the loop, from the last result to this one: its execution,
                # and, where it was not planned ahead (a verifying step never is), the planning
                # it waited for, which execute_s leaves out.
                self.core.speculation.step_executed(step.num_seqs, step.num_tokens, now - last_result_at)
            return self.core.update(
                entry.step,
                arrays["sampled_ids"],
                arrays["sampled_logprobs"],
                arrays["top_ids"],
                arrays["top_logprobs"],
                PromptScoreArrays(*(arrays[name] for name in PROMPT_SCORE_ARRAYS))
                if "prompt_logprobs" in arrays
                else None,
                EmittedArrays(*(arrays.get(name) for name in EMITTED_ARRAYS))
                if "emitted_ids" in arrays
                else None,
                arrays.get("pooled"),
            )

    def _fail(self, entry: InFlight, error: str) -> None:
        """The worker refused a step (a bug, not a fault): its requests fail rather than loop.

        A step planned ahead of it ran on placeholders of the refused step, which sampled
        nothing, so the worker refuses it too: its other sequences are not at fault and
        recompute instead. The pipeline waits for that step before planning again.

        Nothing of a refused step was computed: its live rows' computed counts go back to where
        it started them, so that releasing them offers the prefix cache no block whose keys and
        values the step would have written (a resubmission of the same prompt would hit it)."""
        step = entry.step
        is_live = step.table.epoch.take(step.rows) == step.row_epochs
        rows = step.rows[is_live]
        step.table.num_computed[rows] = np.minimum(step.table.num_computed[rows], step.starts[is_live])
        live = step.live_seqs()
        if entry.after_failure:
            self.core.recompute(live)
            return
        self.on_failed(live, error)
        for later in self.in_flight:
            later.after_failure = True


class RingExecutor:
    """Steps through a group's shared-memory rings: plans into the step ring (every rank reads
    them), results from the result ring (rank 0 writes them). Waits in slices of RING_POLL_S to
    notice a dead worker early, and gives up after `timeout_s`. Between slices it calls
    `on_wait` (the scheduler heartbeats there: it is alive while its worker is slow or stuck, and
    the supervisor must not blame it)."""

    def __init__(
        self,
        step_ring: ShmRing,
        result_ring: ShmRing,
        block_size: int,
        timeout_s: float,
        is_alive: Callable[[], bool],
        on_wait: Callable[[], None] = lambda: None,
    ) -> None:
        self.step_ring = step_ring
        self.result_ring = result_ring
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.is_alive = is_alive
        self.on_wait = on_wait

    def publish(self, step_id: int, step: ScheduledStep) -> None:
        with ExitStack() as stack:
            slot = self._enter(stack, self.step_ring.reserve, f"no free step slot for step {step_id}")
            header = write_plan(step, step_id, self.block_size, slot)
            slot.publish(STEP_HEADER.encode(header))

    @contextmanager
    def result(self) -> Iterator[StepResult]:
        with ExitStack() as stack:
            view = self._enter(stack, partial(self.result_ring.read, 0), "no step result")
            header, arrays = RESULT_HEADER.decode(view.header), view.arrays
            if not header.error:
                try:
                    STEP_RESULT.check(arrays, {Dim.ROWS: header.num_seqs})
                except SlotMismatch as exc:  # a worker bug: the step fails like a refused one
                    header, arrays = ResultHeader(header.step_id, header.num_seqs, str(exc)), {}
            yield header, arrays

    def _enter(
        self, stack: ExitStack, open_slot: Callable[[float], AbstractContextManager[T]], what: str
    ) -> T:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return stack.enter_context(open_slot(RING_POLL_S))
            except RingTimeout:
                if not self.is_alive():
                    raise WorkerLost("worker process exited") from None
                if time.monotonic() > deadline:
                    raise StepTooLate(f"{what} within {self.timeout_s:.0f}s") from None
                self.on_wait()
