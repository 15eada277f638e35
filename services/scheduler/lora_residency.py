"""Which LoRA adapter each of the workers' slots holds, as the scheduler plans it.

Every loaded adapter waits in the workers' host memory (up to `lora.max_cpu_loras`); a request
takes a slot when it enters the running line: its adapter's, if resident, else a slot no running
request uses (an empty one, else the least recently used), into which the workers copy the
adapter before the step that admits it (the step header's `lora_slots`). A slot is never swapped
while a running request uses it, so the running line never needs more distinct adapters than
there are slots, and a running request's adapter never changes under it. A swap copies a whole
adapter on the step's path: a step does at most `MAX_SWAPS_PER_STEP`, and a request that would
need another waits for the next step (docs/lora.md "Adapters beyond the slots").

Most copies leave that path: each step also names (`lora_prefetch`) adapters that waiting
requests will need, copied into slots no running request uses while the step runs, so that the
step that admits their requests finds them resident (`prefetch`). Where adapters outnumber the
slots (lora.max_cpu_loras above lora.max_loras) the workers keep one slot more than
lora.max_loras and running requests hold at most lora.max_loras of them, so a slot is always
free to copy the next adapter into, even while every other one is in use.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_SWAPS_PER_STEP = 1
# Copies started ahead by one step: each reads the adapter's whole host copy while the step runs.
MAX_PREFETCHES_PER_STEP = 1
# Waiting requests, from the head of the queue, whose adapters a step may copy in ahead.
PREFETCH_LOOKAHEAD = 8


class LoraResidency:
    def __init__(self, max_loras: int, num_slots: int | None = None) -> None:
        """`max_loras` adapters run at once, in `num_slots` slots (default: as many)."""
        num_slots = max_loras if num_slots is None else num_slots
        if num_slots < max_loras:
            raise ValueError(f"{num_slots} LoRA slots cannot run {max_loras} adapters at once")
        self.max_running = max_loras
        self.names: list[str] = [""] * num_slots  # "" = empty
        self.num_users = [0] * num_slots  # running requests on each slot
        self.last_used = [0] * num_slots  # the step count when a request last left the slot
        self.num_steps = 0
        self.num_swaps_this_step = 0
        self.prefetching: dict[int, str] = {}  # slot -> adapter copied in ahead, this step
        self.num_swaps = 0  # adapters put in a slot, since start: a counter for the metrics
        self.num_prefetches = 0  # of those, the ones copied in ahead of the step that needs them

    def acquire(self, name: str) -> int:
        """The slot a request for adapter `name` runs in, or -1 when it must wait (running
        requests already hold max_loras slots, or every slot, or this step already swapped)."""
        if name in self.names:
            slot = self.names.index(name)
            if self.num_users[slot] == 0 and self.num_running_adapters >= self.max_running:
                return -1
        else:
            free = self._free_slots(set())
            if (
                not free
                or self.num_running_adapters >= self.max_running
                or self.num_swaps_this_step >= MAX_SWAPS_PER_STEP
            ):
                return -1
            slot = self._least_recently_used(free)
            self.names[slot] = name
            self.num_swaps_this_step += 1
            self.num_swaps += 1
        self.num_users[slot] += 1
        return slot

    def prefetch(self, waiting: Iterable[str]) -> None:
        """Copy in ahead the adapters of waiting requests (`waiting`: their adapters in queue
        order, "" for the base model), up to MAX_PREFETCHES_PER_STEP: each into a slot that no
        running request uses and that holds no adapter of a request ahead of its own (empty
        first, else the least recently used). Marked just used, so that a swap does not take it
        back before its request is admitted."""
        kept: set[str] = set()
        for name in waiting:
            if len(self.prefetching) >= MAX_PREFETCHES_PER_STEP:
                return
            if not name or name in kept:
                continue
            kept.add(name)
            if name in self.names:
                continue
            free = self._free_slots(kept)
            if not free:
                return
            slot = self._least_recently_used(free)
            self.names[slot] = name
            self.last_used[slot] = self.num_steps
            self.prefetching[slot] = name
            self.num_swaps += 1
            self.num_prefetches += 1

    def _free_slots(self, kept: set[str]) -> list[int]:
        return [s for s, users in enumerate(self.num_users) if users == 0 and self.names[s] not in kept]

    def _least_recently_used(self, free: list[int]) -> int:
        return min(free, key=lambda s: (self.names[s] != "", self.last_used[s]))

    def header(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The step header's `lora_slots` (the adapter of each slot a running request uses, ""
        elsewhere: a slot being copied in ahead is not waited for) and `lora_prefetch` (the
        adapters to copy in ahead, by slot), each () when it names none."""
        slots = tuple(name if users else "" for name, users in zip(self.names, self.num_users, strict=True))
        prefetch = tuple(self.prefetching.get(slot, "") for slot in range(len(self.names)))
        return (slots if any(slots) else (), prefetch if self.prefetching else ())

    def release(self, slot: int) -> None:
        self.num_users[slot] -= 1
        self.last_used[slot] = self.num_steps

    def next_step(self) -> None:
        self.num_steps += 1
        self.num_swaps_this_step = 0
        self.prefetching = {}

    def forget(self, name: str) -> None:
        """An adapter unloaded (no request uses it): its slot is empty again."""
        if name in self.names:
            slot = self.names.index(name)
            self.names[slot] = ""
            self.prefetching.pop(slot, None)

    def reset(self) -> None:
        """New workers (their slots start empty), after every running request was preempted."""
        self.names = [""] * len(self.names)
        self.num_users = [0] * len(self.names)
        self.prefetching = {}

    @property
    def num_running_adapters(self) -> int:
        return sum(1 for users in self.num_users if users)
