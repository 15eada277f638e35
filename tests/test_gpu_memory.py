"""The worker's GPU memory monitor: nothing to sample on the CPU; on CUDA the allocator's counters,
refreshed at most once per interval (runs only where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from ipc import messages as m
from services.gpu_worker.memory import MemoryMonitor


def test_cpu_worker_reports_no_gpu_memory() -> None:
    monitor = MemoryMonitor(torch.device("cpu"), interval_s=0.0)
    assert monitor.load() == m.StageLoad()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_counters_sampled_once_per_interval() -> None:
    device = torch.device("cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    block = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    monitor = MemoryMonitor(device, interval_s=3600.0)
    first = monitor.load()
    assert first.gpu_memory_allocated >= base + (256 << 20)
    assert first.gpu_memory_reserved >= first.gpu_memory_allocated
    more = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    assert monitor.load() == first  # within the interval: the last sample, no new read
    monitor.interval_s = 0.0
    second = monitor.load()
    assert second.gpu_memory_allocated >= first.gpu_memory_allocated + (512 << 20)
    del block, more
