"""A pool of variable-size tensors in one shared-memory segment, referred to by descriptors.

The creating process owns the allocator (first-fit free list) and is the only one that allocates and
frees; a receiver on the same host attaches by name and maps a descriptor with no copy. A remote
receiver gets the bytes as a ZeroMQ frame next to the descriptor instead (`frame` / `array_from_frame`).
"""

from __future__ import annotations

import bisect
import contextlib
import math
import mmap
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import posix_ipc

if TYPE_CHECKING:
    import torch

ALIGN = 64
BFLOAT16 = "bfloat16"  # numpy has none: stored as uint16, viewed as torch.bfloat16 by `tensor`


class PoolFull(MemoryError):
    """No free block is large enough."""


class TensorDescriptor(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Where a tensor lives: pool segment, byte offset, dtype name, shape."""

    segment: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numpy_dtype(self.dtype).itemsize * math.prod(self.shape)


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(np.uint16) if name == BFLOAT16 else np.dtype(name)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class TensorPool:
    """Owns one mapping of a pool segment and, in the creating process, its free list."""

    def __init__(self, name: str, segment: posix_ipc.SharedMemory, is_owner: bool) -> None:
        self.name = name
        self.is_owner = is_owner
        self.capacity = segment.size
        self._mmap = mmap.mmap(segment.fd, segment.size)
        segment.close_fd()
        self._buf = np.frombuffer(self._mmap, dtype=np.uint8)
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if is_owner else []  # (offset, size)
        self._used: dict[int, int] = {}  # offset -> size

    @classmethod
    def create(cls, name: str, capacity_bytes: int) -> TensorPool:
        segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=_align(capacity_bytes))
        return cls(name, segment, is_owner=True)

    @classmethod
    def attach(cls, name: str) -> TensorPool:
        return cls(name, posix_ipc.SharedMemory(name), is_owner=False)

    @property
    def num_free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    def alloc(self, shape: tuple[int, ...] | int, dtype: str = "uint8") -> TensorDescriptor:
        """First fit; `alloc(nbytes)` gives a flat uint8 buffer. Raises PoolFull."""
        if not self.is_owner:
            raise RuntimeError("only the process that created the pool allocates from it")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        size = _align(max(_numpy_dtype(dtype).itemsize * math.prod(shape), 1))
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._used[offset] = size
                return TensorDescriptor(self.name, offset, dtype, shape)
        raise PoolFull(f"{self.name}: no free block of {size} bytes ({self.num_free_bytes} free in all)")

    def free(self, desc: TensorDescriptor) -> None:
        """Give a block back, merging it with free neighbours."""
        if desc.segment != self.name or desc.offset not in self._used:
            raise ValueError(f"{desc} is not allocated in {self.name}")
        size = self._used.pop(desc.offset)
        i = bisect.bisect(self._free, (desc.offset, 0))
        offset = desc.offset
        if i < len(self._free) and self._free[i][0] == offset + size:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            i -= 1
            offset, size = self._free[i][0], self._free.pop(i)[1] + size
        self._free.insert(i, (offset, size))

    def view(self, desc: TensorDescriptor) -> np.ndarray:
        """The tensor as a zero-copy numpy array (bfloat16 as uint16)."""
        if desc.segment != self.name or desc.offset + desc.nbytes > self.capacity or desc.offset < 0:
            raise ValueError(f"{desc} does not lie in {self.name}")
        return np.ndarray(desc.shape, _numpy_dtype(desc.dtype), self._buf, desc.offset)

    def tensor(self, desc: TensorDescriptor) -> torch.Tensor:
        """The tensor as a zero-copy torch tensor (torch is imported only here)."""
        import torch

        tensor = torch.from_numpy(self.view(desc))
        return tensor.view(torch.bfloat16) if desc.dtype == BFLOAT16 else tensor

    def frame(self, desc: TensorDescriptor) -> memoryview:
        """The tensor's bytes for a remote receiver; send it with copy=True (or keep the block
        allocated until ZeroMQ is done with it)."""
        return memoryview(self.view(desc).reshape(-1).view(np.uint8))

    def close(self) -> None:
        self._buf = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a caller still holds a view: the GC unmaps later
            self._mmap.close()

    def unlink(self) -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)


def array_from_frame(desc: TensorDescriptor, frame: bytes | memoryview) -> np.ndarray:
    """A remote receiver's view of a tensor that came as a ZeroMQ frame (no copy)."""
    if memoryview(frame).nbytes != desc.nbytes:
        raise ValueError(f"frame of {memoryview(frame).nbytes} bytes for {desc}")
    return np.frombuffer(frame, dtype=_numpy_dtype(desc.dtype)).reshape(desc.shape)
