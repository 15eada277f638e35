"""Memory for the tensors a CPU step reads again and again: weights, KV pages, adapter slots.

Such a tensor of at least HUGE_PAGE_BYTES lies in memory asked for as transparent huge pages
(madvise), as numpy already asks for its arrays of 4 MB or more (the GGUF blocks). A decode step
streams hundreds of megabytes of weights, and a mixture's step reads a few experts anywhere in its
layer's: with 4 KB pages every page it enters costs a TLB miss and a page walk, which the
hardware's prefetchers do not run ahead of (docs/performance.md, "Huge pages for the CPU's
weights"). Where the kernel grants none (`transparent_hugepage` set to `never`, or built without
them), the memory is ordinary pages; so are the copies torch makes later (oneDNN's prepacked
weights, the transposed copies of a CPU without the C++ kernels).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os

import torch

HUGE_PAGE_BYTES = 2 << 20
# Set to 0, the worker asks for ordinary pages (benchmarks/huge_pages_ab.py's other side, or a host
# where huge pages misbehave).
SWITCH = "BRIGADE_HUGE_PAGES"


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty(shape), on the CPU in huge pages where it is large enough to fill one."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (
        device.type != "cpu"
        or nbytes < HUGE_PAGE_BYTES
        or os.environ.get(SWITCH) == "0"
        or not hasattr(mmap, "MADV_HUGEPAGE")  # not Linux
    ):
        return torch.empty(shape, dtype=dtype, device=device)
    # One huge page more than asked, so that the tensor can start on a huge page's boundary (a
    # huge page backs only a whole, aligned 2 MB of the mapping). Private: a shared mapping's
    # huge pages follow another setting (shmem_enabled). A tensor's last, partial huge page is
    # resident whole: up to 2 MB more than its bytes, which no memory budget counts.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel built without huge pages: ordinary pages
        region.madvise(mmap.MADV_HUGEPAGE)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE_BYTES
    # The tensor keeps the mapping alive; it is unmapped with the tensor's last view.
    return torch.frombuffer(region, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), in huge pages as huge_page_empty."""
    return huge_page_empty(shape, dtype, device).zero_()
