"""Image embeddings in shared memory: an encoder's cache, which the processes that need the
embeddings read in place of receiving them (docs/internals.md "Image embeddings").

Why not the step rings' shape (slots handed over with semaphores): embeddings are read later and
elsewhere than they are made (a worker's prefill, maybe after a preemption or a resubmission),
and a hand-over would need every reader to give each slot back, which a reader killed mid-request
never does. So the segment is a content-addressed cache instead, with one writer (its encoder)
and any number of readers:

- fixed slots, each holding one image's embeddings [rows, width] (float32) under a 64-byte
  header: a sequence number, the image's content key (`services/common/images.pixels_key`) and
  the number of rows;
- the writer puts an image's embeddings in a free slot or the least recently used one, and
  answers the request with a `SlotRef` (slot and sequence number) in its control message: the
  tensor itself never crosses a socket;
- a reader copies the slot out and checks, seqlock style, that the sequence number it read
  before and after the copy is the ref's and even (odd while the writer writes) and that the key
  is the one it asked for. A slot evicted or rewritten meanwhile reads as `None`: the reader asks
  the encoder again, which recomputes. Nothing is ever owed back, so no crash leaks a slot.

The writer writes the header's sequence number last and the readers read it first and last
(8-byte aligned int64 stores and loads are single instructions, ordered on x86-64's total store
order; a port to a weakly ordered CPU needs fences here). The segment is named with the run id
(invariant 6) and outlives its encoder: a restarted encoder attaches to it and keeps the cache,
so a resubmission after a crash of any stage finds the embeddings still there, or recomputes
them. Memory is bounded by the segment: `num_slots` x `rows` x `width` x 4 bytes.
"""

from __future__ import annotations

import contextlib
import mmap
from collections import OrderedDict

import numpy as np
import posix_ipc

from ipc.messages import SlotRef
from ipc.step_plan import IMAGE_KEY_BYTES

MAGIC = 0x494D4745424544  # "IMGEBED"
VERSION = 1
CONTROL_BYTES = 64
HEADER_BYTES = 64
KEY_BYTES = IMAGE_KEY_BYTES
# Control words: magic, version, slots, rows per slot, width.
_MAGIC, _VERSION, _NUM_SLOTS, _ROWS, _WIDTH = range(5)
# Slot header: int64 words 0 (sequence) and 1 (rows used), then the key's bytes from byte 16.
_SEQUENCE, _ROWS_USED = 0, 1
_KEY_OFFSET = 16


class EmbeddingCache:
    """One mapping of an encoder's cache segment. `create_or_attach` for its encoder (the one
    writer), `attach` for readers."""

    def __init__(self, name: str, segment: posix_ipc.SharedMemory, geometry: list[int] | None = None) -> None:
        self.name = name
        self._mmap = mmap.mmap(segment.fd, segment.size)
        segment.close_fd()
        buf = np.frombuffer(self._mmap, dtype=np.uint8)
        control = buf[:CONTROL_BYTES].view(np.int64)
        if geometry is not None:
            control[: len(geometry)] = geometry
        if control[_MAGIC] != MAGIC or control[_VERSION] != VERSION:
            raise ValueError(f"{name} is not an embedding cache (or another version)")
        self.num_slots, self.rows, self.width = (int(x) for x in control[_NUM_SLOTS : _WIDTH + 1])
        self.slot_bytes = HEADER_BYTES + self.rows * self.width * 4
        slots = buf[CONTROL_BYTES : CONTROL_BYTES + self.num_slots * self.slot_bytes]
        self._slots = slots.reshape(self.num_slots, self.slot_bytes)
        self._headers = self._slots[:, :HEADER_BYTES]
        self._words = self._headers.view(np.int64)  # [slots, 8]
        self._data = (
            self._slots[:, HEADER_BYTES:].view(np.float32).reshape(self.num_slots, self.rows, self.width)
        )
        # The writer's index: key -> slot, least recently used first.
        self._index: OrderedDict[bytes, int] = OrderedDict()

    @staticmethod
    def segment_bytes(num_slots: int, rows: int, width: int) -> int:
        return CONTROL_BYTES + num_slots * (HEADER_BYTES + rows * width * 4)

    @classmethod
    def create_or_attach(cls, name: str, num_slots: int, rows: int, width: int) -> EmbeddingCache:
        """The writer's mapping: the segment its previous life left, if it has this geometry
        (its finished slots are the cache again; one cut off mid-write is dropped), else a new one."""
        with contextlib.suppress(posix_ipc.ExistentialError, ValueError):
            cache = cls(name, posix_ipc.SharedMemory(name))
            if (cache.num_slots, cache.rows, cache.width) == (num_slots, rows, width):
                cache._rebuild_index()
                return cache
            cache.close()
            posix_ipc.unlink_shared_memory(name)
        segment = posix_ipc.SharedMemory(
            name, posix_ipc.O_CREX, mode=0o600, size=cls.segment_bytes(num_slots, rows, width)
        )
        return cls(name, segment, geometry=[MAGIC, VERSION, num_slots, rows, width])

    @classmethod
    def attach(cls, name: str) -> EmbeddingCache:
        return cls(name, posix_ipc.SharedMemory(name))

    def close(self) -> None:
        self._slots = self._headers = self._words = self._data = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view is still held: the GC unmaps later
            self._mmap.close()

    def _key(self, slot: int) -> bytes:
        return self._headers[slot, _KEY_OFFSET : _KEY_OFFSET + KEY_BYTES].tobytes()

    def _rebuild_index(self) -> None:
        for slot in range(self.num_slots):
            sequence = int(self._words[slot, _SEQUENCE])
            if sequence % 2:  # its writer died mid-write: the slot is free again
                self._words[slot, _SEQUENCE] = sequence + 1
                self._words[slot, _ROWS_USED] = 0
            elif self._words[slot, _ROWS_USED] > 0:
                self._index[self._key(slot)] = slot

    def held(self) -> dict[bytes, SlotRef]:
        """What the cache holds now, from its slots' headers (a reader's view: the writer's
        index is its own); a slot being written reads as its coming key at an odd sequence."""
        return {
            self._key(slot): SlotRef(slot, int(self._words[slot, _SEQUENCE]))
            for slot in range(self.num_slots)
            if self._words[slot, _ROWS_USED] > 0
        }

    # -- writer ------------------------------------------------------------------------------------

    def find(self, key: bytes) -> SlotRef | None:
        """The cached embeddings of `key`, now the most recently used; None on a miss."""
        slot = self._index.get(key)
        if slot is None:
            return None
        self._index.move_to_end(key)
        return SlotRef(slot, int(self._words[slot, _SEQUENCE]))

    def put(self, key: bytes, embeddings: np.ndarray) -> SlotRef:
        """Store one image's [rows, width] embeddings under `key`, evicting the least recently
        used image when every slot is taken."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
        rows = embeddings.shape[0]
        if embeddings.ndim != 2 or embeddings.shape[1] != self.width or not 0 < rows <= self.rows:
            raise ValueError(
                f"embeddings of shape {embeddings.shape} do not fit a [{self.rows}, {self.width}] slot"
            )
        if key in self._index:
            slot = self._index.pop(key)
        elif len(self._index) < self.num_slots:
            taken = set(self._index.values())
            slot = next(s for s in range(self.num_slots) if s not in taken)
        else:
            _, slot = self._index.popitem(last=False)
        sequence = int(self._words[slot, _SEQUENCE]) + 1  # odd: being written
        self._words[slot, _SEQUENCE] = sequence
        self._data[slot, :rows] = embeddings
        self._words[slot, _ROWS_USED] = rows
        self._headers[slot, _KEY_OFFSET : _KEY_OFFSET + KEY_BYTES] = np.frombuffer(key, dtype=np.uint8)
        self._words[slot, _SEQUENCE] = sequence + 1  # even: readable
        self._index[key] = slot
        return SlotRef(slot, sequence + 1)

    # -- reader ------------------------------------------------------------------------------------

    def read(self, ref: SlotRef, key: bytes) -> np.ndarray | None:
        """A copy of the embeddings `ref` points to, or None if the slot no longer holds them
        (evicted, or being rewritten): then ask the encoder again."""
        if not 0 <= ref.slot < self.num_slots:
            raise ValueError(f"slot {ref.slot} is not in this cache's {self.num_slots}")
        words = self._words[ref.slot]
        if int(words[_SEQUENCE]) != ref.sequence or ref.sequence % 2:
            return None
        rows = int(words[_ROWS_USED])
        if self._key(ref.slot) != key or not 0 < rows <= self.rows:
            return None
        out = self._data[ref.slot, :rows].copy()
        if int(words[_SEQUENCE]) != ref.sequence:  # rewritten while we copied
            return None
        return out
