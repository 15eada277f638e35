"""Image embeddings in shared memory: an encoder's cache, which the processes that need the
embeddings read in place of receiving them (docs/internals.md "Image embeddings").

Why not the step rings' shape (slots handed over with semaphores): embeddings are read later and
elsewhere than they are made (a worker's prefill, maybe after a preemption or a resubmission),
and a hand-over would need every reader to give each slot back, which a reader killed mid-request
never does. So the segment is a content-addressed cache instead, with one writer (its encoder)
and any number of readers:

- the data is `num_pages` pages of `page_rows` rows of `width` float32s, contiguous, and apart
  from it an array of 64-byte page headers: a sequence number, the number of rows held and the
  image's content key (`services/common/images.pixels_key`). An image's embeddings [rows, width]
  take a run of consecutive pages, as many as its rows need (images' sizes differ: Qwen2.5-VL's
  take their own, from a few tokens to thousands), described by the header of its first page;
  the other pages' headers hold no rows;
- the writer puts an image's embeddings in a run of free pages, evicting the least recently used
  images until one is long enough (free pages scattered in short runs are not), and answers the
  request with a `SlotRef` (first page and sequence number) in its control message: the tensor
  itself never crosses a socket;
- a reader copies the rows out and checks, seqlock style, that the sequence number it read
  before and after the copy is the ref's and even (odd while the writer writes) and that the key
  is the one it asked for. The writer changes an image's sequence number before it lets another
  image's rows over any of its pages (an eviction: odd, no rows, then even), so an image evicted
  or rewritten meanwhile reads as `None`: the reader asks the encoder again, which recomputes.
  Nothing is ever owed back, so no crash leaks a page.

The writer writes the header's sequence number last and the readers read it first and last
(8-byte aligned int64 stores and loads are single instructions, ordered on x86-64's total store
order; a port to a weakly ordered CPU needs fences here). The segment is named with the run id
(invariant 6) and outlives its encoder: a restarted encoder attaches to it and rebuilds its index
from the headers, so a resubmission after a crash of any stage finds the embeddings still there,
or recomputes them. Memory is bounded by the segment: `num_pages` x (64 + `page_rows` x `width`
x 4) bytes.
"""

from __future__ import annotations

import contextlib
import mmap
from collections import OrderedDict
from collections.abc import Collection, Sequence

import numpy as np
import posix_ipc

from ipc.messages import SlotRef
from ipc.step_plan import IMAGE_KEY_BYTES

MAGIC = 0x494D4745424544  # "IMGEBED"
VERSION = 2  # 1: one fixed-size slot per image
CONTROL_BYTES = 64
HEADER_BYTES = 64
KEY_BYTES = IMAGE_KEY_BYTES
# Control words: magic, version, pages, rows per page, width.
_MAGIC, _VERSION, _NUM_PAGES, _PAGE_ROWS, _WIDTH = range(5)
# Page header: int64 words 0 (sequence) and 1 (rows held from this page on: 0 but on an image's
# first page), then the key's bytes from byte 16.
_SEQUENCE, _ROWS_USED = 0, 1
_KEY_OFFSET = 16


class NoRoom(Exception):
    """No run of free pages is long enough for an image without evicting one the writer keeps."""


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
        self.num_pages, self.page_rows, self.width = (int(x) for x in control[_NUM_PAGES : _WIDTH + 1])
        headers_end = CONTROL_BYTES + self.num_pages * HEADER_BYTES
        self._headers = buf[CONTROL_BYTES:headers_end].reshape(self.num_pages, HEADER_BYTES)
        self._words = self._headers.view(np.int64)  # [pages, 8]
        self.max_rows = self.num_pages * self.page_rows
        self._data = buf[headers_end : headers_end + self.max_rows * self.width * 4].view(np.float32)
        self._data = self._data.reshape(self.max_rows, self.width)
        # The writer's index: key -> first page, least recently used first; and each page's
        # image's first page (-1: free).
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._owner = np.full(self.num_pages, -1, dtype=np.int64)

    @staticmethod
    def segment_bytes(num_pages: int, page_rows: int, width: int) -> int:
        return CONTROL_BYTES + num_pages * (HEADER_BYTES + page_rows * width * 4)

    @staticmethod
    def pages_in(cache_bytes: int, page_rows: int, width: int) -> int:
        """The pages of a cache of `cache_bytes` (encoder.cache_bytes): as many as a segment
        within it holds (`segment_bytes(n, ...)` bytes hold n), one at least."""
        page_bytes = HEADER_BYTES + page_rows * width * 4
        return max((cache_bytes - CONTROL_BYTES) // page_bytes, 1)

    @classmethod
    def create_or_attach(cls, name: str, num_pages: int, page_rows: int, width: int) -> EmbeddingCache:
        """The writer's mapping: the segment its previous life left, if it has this geometry
        (its finished images are the cache again; one cut off mid-write is dropped), else a new one."""
        if num_pages < 1 or page_rows < 1 or width < 1:
            raise ValueError(f"bad embedding cache geometry: {num_pages} pages of {page_rows} x {width}")
        with contextlib.suppress(posix_ipc.ExistentialError, ValueError):
            cache = cls(name, posix_ipc.SharedMemory(name))
            if (cache.num_pages, cache.page_rows, cache.width) == (num_pages, page_rows, width):
                cache._rebuild_index()
                return cache
            cache.close()
            posix_ipc.unlink_shared_memory(name)
        segment = posix_ipc.SharedMemory(
            name, posix_ipc.O_CREX, mode=0o600, size=cls.segment_bytes(num_pages, page_rows, width)
        )
        return cls(name, segment, geometry=[MAGIC, VERSION, num_pages, page_rows, width])

    @classmethod
    def attach(cls, name: str) -> EmbeddingCache:
        return cls(name, posix_ipc.SharedMemory(name))

    def close(self) -> None:
        self._headers = self._words = self._data = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view is still held: the GC unmaps later
            self._mmap.close()

    def pages_of(self, rows: int) -> int:
        """The pages an image of `rows` embeddings takes."""
        return -(-rows // self.page_rows)

    def _key(self, page: int) -> bytes:
        return self._headers[page, _KEY_OFFSET : _KEY_OFFSET + KEY_BYTES].tobytes()

    def _rebuild_index(self) -> None:
        """The index from the headers, in page order (the previous life's recency is lost). A
        header left odd was cut off mid-write or mid-eviction: its pages are free again."""
        for page in range(self.num_pages):
            sequence, rows = int(self._words[page, _SEQUENCE]), int(self._words[page, _ROWS_USED])
            if sequence % 2:
                self._evict_header(page, sequence - 1)
                continue
            if rows <= 0:
                continue
            pages = slice(page, page + self.pages_of(rows))
            if pages.stop > self.num_pages or (self._owner[pages] >= 0).any():  # never written so
                self._evict_header(page, sequence)
                continue
            self._owner[pages] = page
            self._index[self._key(page)] = page

    def held(self) -> dict[bytes, SlotRef]:
        """What the cache holds now, from its pages' headers (a reader's view: the writer's
        index is its own); an image being written reads as its coming key at an odd sequence."""
        return {
            self._key(page): SlotRef(page, int(self._words[page, _SEQUENCE]))
            for page in np.flatnonzero(self._words[:, _ROWS_USED] > 0).tolist()
        }

    # -- writer ------------------------------------------------------------------------------------

    def find(self, key: bytes) -> SlotRef | None:
        """The cached embeddings of `key`, now the most recently used; None on a miss."""
        page = self._index.get(key)
        if page is None:
            return None
        self._index.move_to_end(key)
        return SlotRef(page, int(self._words[page, _SEQUENCE]))

    def put(self, key: bytes, embeddings: np.ndarray, keep: Collection[bytes] = ()) -> SlotRef:
        """Store one image's [rows, width] embeddings under `key` in a run of free pages,
        evicting the least recently used images (but those in `keep`) until a run is long
        enough. NoRoom when only evicting `keep`'s would make one."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
        rows = embeddings.shape[0]
        if embeddings.ndim != 2 or embeddings.shape[1] != self.width or not 0 < rows <= self.max_rows:
            raise ValueError(
                f"embeddings of shape {embeddings.shape} do not fit a cache of [{self.max_rows}, {self.width}]"
            )
        if key in self._index:
            self.evict(key)
        num_pages = self.pages_of(rows)
        plan = self._plan([rows], keep)
        if plan is None:
            raise NoRoom(f"no {num_pages} free pages in a row without evicting a kept image")
        [(first, victims)] = plan
        for victim in victims:
            self.evict(victim)
        # Every header over these pages is free (rows 0, sequence changed at its eviction): no
        # ref of an earlier image reads them any more.
        sequence = int(self._words[first, _SEQUENCE]) + 1  # odd: being written
        self._words[first, _SEQUENCE] = sequence
        start = first * self.page_rows
        self._data[start : start + rows] = embeddings
        self._words[first, _ROWS_USED] = rows
        self._headers[first, _KEY_OFFSET : _KEY_OFFSET + KEY_BYTES] = np.frombuffer(key, dtype=np.uint8)
        self._words[first, _SEQUENCE] = sequence + 1  # even: readable
        self._owner[first : first + num_pages] = first
        self._index[key] = first
        return SlotRef(first, sequence + 1)

    def fits(self, rows: Sequence[int], keep: Collection[bytes]) -> bool:
        """Whether images of these rows, put one after another with `keep` (which holds their
        keys, so that none evicts one put before it), would all find room: a dry run of those
        puts' evictions, which changes nothing (a put that fails half way has evicted every image
        but `keep`'s already)."""
        return self._plan(rows, keep) is not None

    def clear(self) -> None:
        """Evict every image."""
        for key in list(self._index):
            self.evict(key)

    def evict(self, key: bytes) -> None:
        """Free a cached image's pages; its refs read None from now on."""
        first = self._index.pop(key)
        self._evict_header(first, int(self._words[first, _SEQUENCE]))
        self._owner[self._owner == first] = -1

    def _plan(self, rows: Sequence[int], keep: Collection[bytes]) -> list[tuple[int, list[bytes]]] | None:
        """For images of these rows put one after another, none evicting one put before it: each
        one's first page and the images its put evicts (least recently used first, but `keep`'s)
        until a run is long enough. None if one finds no room. Played on a copy of the page map,
        so that `put` and `fits` evict alike."""
        owner = self._owner.copy()
        victims = ((key, first) for key, first in self._index.items() if key not in keep)
        plan = []
        for image_rows in rows:
            num_pages = self.pages_of(image_rows)
            evicted = []
            first = self._free_run(num_pages, owner)
            while first is None:
                victim = next(victims, None)
                if victim is None:
                    return None
                evicted.append(victim[0])
                owner[owner == victim[1]] = -1
                first = self._free_run(num_pages, owner)
            # An image's pages are marked with its first page, which no image still cached has:
            # that page was free.
            owner[first : first + num_pages] = first
            plan.append((first, evicted))
        return plan

    @staticmethod
    def _free_run(num_pages: int, owner: np.ndarray) -> int | None:
        """The first page of the first run of `num_pages` free pages in `owner` (each page's
        image's first page, -1: free); None if there is none."""
        free = np.concatenate(([0], (owner < 0).view(np.int8), [0]))
        edges = np.flatnonzero(np.diff(free))  # alternately a run's start and its end
        starts, ends = edges[::2], edges[1::2]
        long_enough = np.flatnonzero(ends - starts >= num_pages)
        return int(starts[long_enough[0]]) if len(long_enough) else None

    def _evict_header(self, page: int, sequence: int) -> None:
        """Free an image's pages: its sequence number changes first, so that a reader mid-copy
        sees it gone before another image's rows land there."""
        self._words[page, _SEQUENCE] = sequence + 1
        self._words[page, _ROWS_USED] = 0
        self._words[page, _SEQUENCE] = sequence + 2

    # -- reader ------------------------------------------------------------------------------------

    def read(self, ref: SlotRef, key: bytes) -> np.ndarray | None:
        """A copy of the embeddings `ref` points to, or None if its pages no longer hold them
        (evicted, or being rewritten): then ask the encoder again."""
        if not 0 <= ref.slot < self.num_pages:
            raise ValueError(f"page {ref.slot} is not in this cache's {self.num_pages}")
        words = self._words[ref.slot]
        if int(words[_SEQUENCE]) != ref.sequence or ref.sequence % 2:
            return None
        rows = int(words[_ROWS_USED])
        start = ref.slot * self.page_rows
        if self._key(ref.slot) != key or not 0 < rows <= self.max_rows - start:
            return None
        out = self._data[start : start + rows].copy()
        if int(words[_SEQUENCE]) != ref.sequence:  # evicted or rewritten while we copied
            return None
        return out
