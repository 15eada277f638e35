"""Shared-memory rings: fixed slots in one POSIX segment, one writer, N readers (docs/internals.md).

Segment layout: a control page (ring geometry, generation, write index, per-reader read indices),
then `num_slots` slots. A slot: a 64-byte prefix (where its directory is), the arrays (64-byte
aligned, written in place by the writer), then the array directory (msgspec) and the header bytes.

Flow control: each reader r has a `space` semaphore (free slots for it, initially num_slots) and an
`avail` semaphore (published slots it has not read). The writer takes one `space` of every reader
before writing a slot and posts every `avail` after publishing it; a reader posts its `space` back
when it leaves `read`. Semaphore names carry the ring generation: `reset()` makes new ones, so a
peer that died or lags behind can never disturb the counts of the new generation.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import re
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import posix_ipc

from ipc.endpoints import SHM_PREFIX

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
ALIGN = 64
CONTROL_BYTES = 4096
SLOT_PREFIX_BYTES = ALIGN
MAGIC = 0x42524947414445  # "BRIGADE"
VERSION = 1

# Control page, as int64 words.
_MAGIC, _VERSION, _NUM_SLOTS, _SLOT_BYTES, _NUM_READERS, _GENERATION, _WRITE_INDEX, _OWNER_PID = range(8)
_READ_INDEX = 8  # + reader rank
MAX_READERS = CONTROL_BYTES // 8 - _READ_INDEX

# Slot prefix, as int64 words: where the directory starts (from the slot start), the directory's
# length and the header's length.
_SLOT_PREFIX_WORDS = 3

_Directory = list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, offset in slot)
_dir_encoder = msgspec.msgpack.Encoder()
_dir_decoder = msgspec.msgpack.Decoder(_Directory)


class RingTimeout(TimeoutError):
    """A ring wait ran out of time (the peer is slow, stuck or dead)."""


class SlotOverflow(ValueError):
    """The arrays and header do not fit in one slot."""


class RingGeometryError(ValueError):
    """A ring of no slots, or more readers than its control page tracks."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _acquire(sem: posix_ipc.Semaphore, deadline: float) -> bool:
    """False on timeout, and when a signal (SIGTERM: the stage is stopping) cut the wait short:
    the caller sees a timeout and gets to check its stop flag."""
    try:
        sem.acquire(max(deadline - time.monotonic(), 0.0))
    except (posix_ipc.BusyError, posix_ipc.SignalError):
        return False
    return True


class ShmRing:
    """Owns one mapping of a ring segment and this process's semaphore handles."""

    def __init__(
        self, name: str, segment: posix_ipc.SharedMemory, is_owner: bool, geometry: list[int] | None = None
    ) -> None:
        self.name = name
        self.is_owner = is_owner
        self._mmap = mmap.mmap(segment.fd, segment.size)
        segment.close_fd()
        self._buf = np.frombuffer(self._mmap, dtype=np.uint8)
        self._control = self._buf[:CONTROL_BYTES].view(np.int64)
        if geometry is not None:
            self._control[: len(geometry)] = geometry
        if self._control[_MAGIC] != MAGIC or self._control[_VERSION] != VERSION:
            self.close()
            raise ValueError(f"{name} is not a brigade ring (or another version)")
        self.num_slots = int(self._control[_NUM_SLOTS])
        self.slot_bytes = int(self._control[_SLOT_BYTES])
        self.num_readers = int(self._control[_NUM_READERS])
        self._generation = -1
        self._space: list[posix_ipc.Semaphore] = []
        # The reader's views of each slot, rebuilt only when the slot's directory changes.
        self._layouts: dict[int, _SlotLayout] = {}
        self._avail: list[posix_ipc.Semaphore] = []

    # -- lifecycle ---------------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, num_slots: int, slot_bytes: int, num_readers: int) -> ShmRing:
        """Create the segment and its semaphores; the creator owns them (reset, unlink).
        `slot_bytes` must hold a slot's arrays (each 64-byte aligned), directory and header."""
        if not 1 <= num_readers <= MAX_READERS or num_slots < 1:
            raise RingGeometryError(f"bad ring geometry: {num_slots} slots, {num_readers} readers")
        slot_bytes = _align(slot_bytes + SLOT_PREFIX_BYTES)
        size = CONTROL_BYTES + num_slots * slot_bytes
        if size >= 1 << 63:  # posix_ipc would take the size modulo 2^64 and make a small segment
            raise ValueError(f"a ring of {size} bytes is past any address space")
        segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        geometry = [MAGIC, VERSION, num_slots, slot_bytes, num_readers, 0, 0, os.getpid()]
        try:
            ring = cls(name, segment, is_owner=True, geometry=geometry)
            ring._make_semaphores(0)
        except BaseException:
            # A segment too large to map (ENOMEM) or semaphores the system refuses: nothing of
            # the ring stays in /dev/shm for a later run's sweep to find.
            if segment.fd >= 0:
                segment.close_fd()
            unlink_ring(name)
            raise
        return ring

    @classmethod
    def attach(cls, name: str) -> ShmRing:
        """Map an existing ring; the geometry comes from its control page."""
        return cls(name, posix_ipc.SharedMemory(name), is_owner=False)

    @property
    def num_in_use(self) -> int:
        """Slots published but not yet released by the slowest reader (for metrics)."""
        readers = self._control[_READ_INDEX : _READ_INDEX + self.num_readers]
        return int(self._control[_WRITE_INDEX] - readers.min())

    def _sem_name(self, generation: int, kind: str, rank: int) -> str:
        return f"{self.name}-g{generation}-{kind}{rank}"

    def _make_semaphores(self, generation: int) -> None:
        for r in range(self.num_readers):
            for kind, value in (("space", self.num_slots), ("avail", 0)):
                posix_ipc.Semaphore(self._sem_name(generation, kind, r), posix_ipc.O_CREX, 0o600, value)

    def _unlink_semaphores(self, generation: int) -> None:
        for r in range(self.num_readers):
            for kind in ("space", "avail"):
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_semaphore(self._sem_name(generation, kind, r))

    def _sync_generation(self) -> None:
        """Open the current generation's semaphores if the ring was reset since we last looked."""
        generation = int(self._control[_GENERATION])
        if generation == self._generation:
            return
        self._close_semaphores()
        self._space = [
            posix_ipc.Semaphore(self._sem_name(generation, "space", r)) for r in range(self.num_readers)
        ]
        self._avail = [
            posix_ipc.Semaphore(self._sem_name(generation, "avail", r)) for r in range(self.num_readers)
        ]
        self._generation = generation

    def _close_semaphores(self) -> None:
        for sem in (*self._space, *self._avail):
            sem.close()
        self._space, self._avail = [], []

    def reset(self) -> None:
        """Empty the ring after a peer died: new semaphores and indices, both sides start over.

        Call it while no live peer is inside `reserve` / `read`; peers pick up the new generation on
        their next call.
        """
        old = int(self._control[_GENERATION])
        self._make_semaphores(old + 1)
        self._control[_WRITE_INDEX] = 0
        self._control[_READ_INDEX : _READ_INDEX + self.num_readers] = 0
        self._control[_GENERATION] = old + 1
        self._unlink_semaphores(old)
        self._sync_generation()

    def close(self) -> None:
        """Drop this process's mapping and handles (views handed out keep the memory mapped)."""
        self._close_semaphores()
        self._control = self._buf = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a caller still holds a view: the GC unmaps later
            self._mmap.close()

    def unlink(self) -> None:
        """Remove the segment and its semaphores (owner, at shutdown)."""
        unlink_ring(self.name)

    # -- writer ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def reserve(self, timeout: float) -> Iterator[SlotWriter]:
        """The next free slot; raises RingTimeout when some reader has not freed one in time.
        A slot left without `publish` is discarded."""
        self._sync_generation()
        deadline = time.monotonic() + timeout
        taken = []
        for r, sem in enumerate(self._space):
            if not _acquire(sem, deadline):
                for sem_taken in taken:
                    sem_taken.release()
                raise RingTimeout(f"{self.name}: reader {r} has no free slot after {timeout}s")
            taken.append(sem)
        index = int(self._control[_WRITE_INDEX])
        slot = SlotWriter(self, index)
        try:
            yield slot
        finally:
            if not slot.is_published:
                for sem in taken:
                    sem.release()

    def _view(self, slot: int) -> SlotView:
        start = self._slot_start(slot)
        meta, dir_bytes, header_bytes = np.ndarray((_SLOT_PREFIX_WORDS,), np.int64, self._buf, start).tolist()
        meta += start
        directory = self._buf[meta : meta + dir_bytes].tobytes()
        layout = self._layouts.get(slot)
        if layout is None or layout.directory != directory:
            layout = self._layouts[slot] = _SlotLayout(directory, self._buf, start)
        header = self._buf[meta + dir_bytes : meta + dir_bytes + header_bytes].tobytes()
        return SlotView(header, layout)

    def _slot_start(self, index: int) -> int:
        return CONTROL_BYTES + (index % self.num_slots) * self.slot_bytes

    def _publish(self, index: int) -> None:
        self._control[_WRITE_INDEX] = index + 1
        for sem in self._avail:
            sem.release()  # sem_post is a full barrier: the slot is visible before the signal

    # -- reader ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def read(self, reader_rank: int, timeout: float) -> Iterator[SlotView]:
        """The next published slot for this reader, in order; raises RingTimeout. The views are
        valid inside the with-block only: the slot is handed back to the writer on exit."""
        if not 0 <= reader_rank < self.num_readers:
            raise ValueError(f"reader rank {reader_rank} not in [0, {self.num_readers})")
        self._sync_generation()
        generation = self._generation
        if not _acquire(self._avail[reader_rank], time.monotonic() + timeout):
            raise RingTimeout(f"{self.name}: nothing published for reader {reader_rank} in {timeout}s")
        index = int(self._control[_READ_INDEX + reader_rank])
        try:
            yield self._view(index % self.num_slots)
        finally:
            # After a reset this slot belongs to a dead generation: leave the new counts alone.
            if int(self._control[_GENERATION]) == generation:
                self._control[_READ_INDEX + reader_rank] = index + 1
                self._space[reader_rank].release()


class SlotWriter:
    """One reserved slot: arrays are placed in order, then `publish` hands it to the readers."""

    def __init__(self, ring: ShmRing, index: int) -> None:
        self._ring = ring
        self._index = index
        self._buf = ring._buf
        self._start = ring._slot_start(index)
        self._cursor = SLOT_PREFIX_BYTES
        self._directory: _Directory = []
        self.is_published = False

    def alloc(self, name: str, dtype: Any, shape: tuple[int, ...] | int) -> np.ndarray:
        """A zero-copy view into the slot; write the data in place before `publish`."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        offset = _align(self._cursor)
        end = offset + dtype.itemsize * math.prod(shape)
        if end > self._ring.slot_bytes:
            raise SlotOverflow(f"array {name!r} ends at {end} > slot of {self._ring.slot_bytes} bytes")
        self._cursor = end
        self._directory.append((name, dtype.str, shape, offset))
        return np.ndarray(shape, dtype, self._buf, self._start + offset)

    def put(self, name: str, array: np.ndarray) -> None:
        """Copy a finished array into the slot."""
        np.copyto(self.alloc(name, array.dtype, array.shape), array)

    def publish(self, header: bytes = b"") -> None:
        """Write the directory and header after the arrays, then signal every reader."""
        directory = _dir_encoder.encode(self._directory)
        meta = self._start + _align(self._cursor)
        end = meta + len(directory) + len(header)
        if end > self._start + self._ring.slot_bytes:
            raise SlotOverflow(f"slot needs {end - self._start} bytes > {self._ring.slot_bytes}")
        self._buf[meta:end] = np.frombuffer(directory + header, np.uint8)
        prefix = np.ndarray((_SLOT_PREFIX_WORDS,), np.int64, self._buf, self._start)
        prefix[:] = (meta - self._start, len(directory), len(header))
        self.is_published = True
        self._ring._publish(self._index)


class _SlotLayout:
    """Zero-copy views of the arrays a slot's directory describes. Steady decode publishes the same
    shapes step after step, so a reader keeps them and skips rebuilding views after each wake-up:
    that work sits on the handoff's latency path."""

    def __init__(self, directory: bytes, buf: np.ndarray, start: int) -> None:
        self.directory = directory
        self.arrays: dict[str, np.ndarray] = {
            name: np.ndarray(shape, np.dtype(dtype), buf, start + offset)
            for name, dtype, shape, offset in _dir_decoder.decode(directory)
        }
        self.tensors: dict[str, torch.Tensor] | None = None


class SlotView:
    """A published slot as seen by a reader: the header bytes and zero-copy array views (shared
    with later reads of the same slot layout: do not keep them past the with-block)."""

    def __init__(self, header: bytes, layout: _SlotLayout) -> None:
        self.header = header
        self._layout = layout

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return self._layout.arrays

    def tensors(self) -> dict[str, torch.Tensor]:
        """The arrays as torch tensors sharing the slot's memory (torch is imported only here)."""
        if self._layout.tensors is None:
            import torch

            self._layout.tensors = {name: torch.from_numpy(array) for name, array in self.arrays.items()}
        return self._layout.tensors


# ---------------------------------------------------------------------------
# Run ids, the run's liveness lock, and the sweep of dead runs (docs/architecture.md
# invariants 6 and 9)
# ---------------------------------------------------------------------------

_RUN_OBJECT = re.compile(rf"^(?:sem\.)?{re.escape(SHM_PREFIX)}(\d+x[0-9a-f]+)-")
RUN_LOCK_SUFFIX = "-run.lock"


def new_run_id() -> str:
    """`{pid}x{random hex}`: unique (the pid only helps a person tell runs apart)."""
    return f"{os.getpid()}x{secrets.token_hex(4)}"


def run_lock_path(run_id: str, shm_dir: str = SHM_DIR) -> str:
    return os.path.join(shm_dir, f"{SHM_PREFIX}{run_id}{RUN_LOCK_SUFFIX}")


class RunLock:
    """An exclusive flock, held for a run's whole life, on a file beside its shared memory. It
    proves the run alive to a sweep from any process that sees the same /dev/shm, whatever PID
    namespace it runs in (containers started with --ipc=host share /dev/shm, not their pids).
    The kernel drops the lock when the holder dies, even by SIGKILL."""

    def __init__(self, run_id: str, shm_dir: str = SHM_DIR) -> None:
        self.path = run_lock_path(run_id, shm_dir)
        # Locked under another name first, so that no sweep ever sees the file unlocked. Not
        # inherited by the stages (Python's descriptors are close-on-exec): only the
        # supervisor's life counts, as only the supervisor unlinks the run's objects.
        locking = f"{self.path}.new"
        self._fd = os.open(locking, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(locking, self.path)

    def release(self) -> None:
        """At shutdown, after the run's other objects are unlinked: the lock file goes last."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1


def _lock_if_dead(lock_path: str) -> int | None:
    """A descriptor holding the run's lock when its holder is gone (close it when done); None
    while the run lives or when it has no lock file (one of a Brigade from before run locks, or
    objects a test made by hand: nothing proves those dead, so they are left alone)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: the run is alive, in this PID namespace or another
        os.close(fd)
        return None
    return fd


def sweep_stale_runs(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the segments and semaphores of runs proven dead: their run lock file is there and
    nobody holds its lock. Returns the names removed (the lock file last of each run)."""
    runs: dict[str, list[str]] = {}
    for entry in sorted(os.listdir(shm_dir)):
        match = _RUN_OBJECT.match(entry)
        if match is not None:
            runs.setdefault(match.group(1), []).append(entry)
    removed = []
    for run_id, entries in runs.items():
        lock_path = run_lock_path(run_id, shm_dir)
        fd = _lock_if_dead(lock_path)
        if fd is None:
            continue
        try:
            lock_name = os.path.basename(lock_path)
            for entry in [e for e in entries if e != lock_name] + [lock_name]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shm_dir, entry))
                    removed.append(entry)
        finally:
            os.close(fd)
    return removed


def unlink_ring(name: str) -> None:
    """Remove ring `name`'s segment and semaphores, whichever of them exist (no process needs to
    have it open: a node's cleanup after the ring's users are gone)."""
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)
    # Every generation's, in case a reset was cut short; Linux keeps them as SHM_DIR/sem.NAME.
    prefix = f"sem.{name.lstrip('/')}-g"
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(prefix):
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_semaphore("/" + entry[len("sem.") :])
