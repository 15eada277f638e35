"""Which LoRA adapter each of the workers' `lora.max_loras` slots holds, as the scheduler plans it.

Every loaded adapter waits in the workers' host memory (up to `lora.max_cpu_loras`); a request
takes a slot when it enters the running line: its adapter's, if resident, else a slot no running
request uses (an empty one, else the least recently used), into which the workers copy the
adapter before the step that admits it (the step header's `lora_slots`). A slot is never swapped
while a running request uses it, so the running line never needs more distinct adapters than
there are slots, and a running request's adapter never changes under it. A swap copies a whole
adapter on the step's path: a step does at most `MAX_SWAPS_PER_STEP`, and a request that would
need another waits for the next step (docs/lora.md "Adapters beyond the slots").
"""

from __future__ import annotations

MAX_SWAPS_PER_STEP = 1


class LoraResidency:
    def __init__(self, max_loras: int) -> None:
        self.names: list[str] = [""] * max_loras  # "" = empty
        self.num_users = [0] * max_loras  # running requests on each slot
        self.last_used = [0] * max_loras  # the step count when a request last left the slot
        self.num_steps = 0
        self.num_swaps_this_step = 0
        self.num_swaps = 0  # since start: a counter for the metrics

    def acquire(self, name: str) -> int:
        """The slot a request for adapter `name` runs in, or -1 when it must wait (every slot is
        in use by running requests, or this step already swapped)."""
        if name in self.names:
            slot = self.names.index(name)
        else:
            free = [slot for slot, users in enumerate(self.num_users) if users == 0]
            if not free or self.num_swaps_this_step >= MAX_SWAPS_PER_STEP:
                return -1
            slot = min(free, key=lambda s: (self.names[s] != "", self.last_used[s]))
            self.names[slot] = name
            self.num_swaps_this_step += 1
            self.num_swaps += 1
        self.num_users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.num_users[slot] -= 1
        self.last_used[slot] = self.num_steps

    def next_step(self) -> None:
        self.num_steps += 1
        self.num_swaps_this_step = 0

    def forget(self, name: str) -> None:
        """An adapter unloaded (no request uses it): its slot is empty again."""
        if name in self.names:
            self.names[self.names.index(name)] = ""

    def reset(self) -> None:
        """New workers (their slots start empty), after every running request was preempted."""
        self.names = [""] * len(self.names)
        self.num_users = [0] * len(self.names)

    @property
    def num_running_adapters(self) -> int:
        return sum(1 for users in self.num_users if users)
