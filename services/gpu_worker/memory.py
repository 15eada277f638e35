"""GPU memory of a worker, sampled for its heartbeats: at most once per heartbeat interval and
only between steps, so the step loop never waits on it. On the CPU there is nothing to sample."""

from __future__ import annotations

import time

import torch

from ipc import messages as m


class MemoryMonitor:
    """The worker's heartbeat load: CUDA memory allocated and reserved, refreshed every `interval_s`."""

    def __init__(self, device: torch.device, interval_s: float) -> None:
        self.device = device
        self.interval_s = interval_s
        self.sampled_at = -float("inf")
        self.last = m.StageLoad()

    def load(self) -> m.StageLoad:
        if self.device.type != "cuda":
            return self.last
        now = time.monotonic()
        if now - self.sampled_at >= self.interval_s:
            self.sampled_at = now
            # Both read the caching allocator's own counters: no device sync, no driver call.
            self.last = m.StageLoad(
                gpu_memory_allocated=torch.cuda.memory_allocated(self.device),
                gpu_memory_reserved=torch.cuda.memory_reserved(self.device),
            )
        return self.last
