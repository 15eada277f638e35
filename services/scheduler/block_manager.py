"""The paged KV block pool: reference counts, a free list and the prefix cache."""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np


class NoFreeBlocks(RuntimeError):
    """The pool cannot hand out the blocks asked for (callers check `num_available` first)."""


def hash_block(parent: bytes, token_ids: np.ndarray) -> bytes:
    """Chained hash of one full block: it names the block's tokens and everything before them."""
    return hashlib.blake2b(parent + token_ids.tobytes(), digest_size=16).digest()


class BlockManager:
    """Owns the KV blocks of one engine group.

    A block is in exactly one of three states: referenced (ref count > 0, owned by live
    sequences), free (ref count 0, content meaningless) or evictable (ref count 0, but it holds
    a full block of the prefix cache that a later request may reuse). Allocation takes free blocks
    first and evicts the least recently released cached block only when no free block is left.
    A cached block is never written again: sequences only write their own last, non-full block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding it
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.num_evictions = 0

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free) - len(self.evictable)

    def extend_hashes(
        self,
        block_hashes: list[bytes],
        token_ids: np.ndarray,
        root: bytes = b"",
        salts: Sequence[bytes] = (),
    ) -> None:
        """Append the chained hashes of the full blocks in `token_ids`, the tokens that follow
        the blocks already hashed; the chain starts from `root` (Request.hash_root), so that
        blocks of the same tokens computed differently never match. `salts`, when given, holds
        for each of these blocks what its token ids do not say (Request.block_salts: the keys
        of the images its image tokens show)."""
        bs = self.block_size
        parent = block_hashes[-1] if block_hashes else root
        for k, start in enumerate(range(0, len(token_ids) - bs + 1, bs)):
            parent = hash_block(parent + salts[k] if salts else parent, token_ids[start : start + bs])
            block_hashes.append(parent)

    def match_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """Cached blocks for the longest prefix of these hashes (references are not taken)."""
        hits = []
        for h in block_hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_available_besides(self, hit_blocks: list[int]) -> int:
        """Blocks that can still be allocated once these cache hits are referenced."""
        evictable = self.evictable
        return self.num_available - sum(1 for b in hit_blocks if b in evictable)

    def acquire(self, block_ids: list[int]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1

    def allocate(self, num: int) -> list[int]:
        """Hand out `num` fresh blocks, each referenced once."""
        if num > self.num_available:
            raise NoFreeBlocks(f"asked for {num} blocks, {self.num_available} available")
        out = []
        for _ in range(num):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                del self.cached[self.block_hash[b]]
                self.block_hash[b] = None
                self.num_evictions += 1
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, tail first so that shared prefixes are evicted last."""
        refs = self.ref_counts
        for b in reversed(block_ids):
            refs[b] -= 1
            if refs[b] == 0:
                if self.block_hash[b] is None:
                    self.free.append(b)
                else:
                    self.evictable[b] = None

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Offer a block that just became full of computed tokens to the prefix cache.

        A block already cached (a hit) keeps its hash; when another block already holds the same
        content (two requests computed the same prefix at once) this one stays private.
        """
        if self.block_hash[block_id] is None and block_hash not in self.cached:
            self.block_hash[block_id] = block_hash
            self.cached[block_hash] = block_id

    def clear_cache(self) -> None:
        """Forget every cached block (the KV content was lost with a worker)."""
        for b in self.cached.values():
            self.block_hash[b] = None
        self.cached.clear()
        self.free.extend(self.evictable)
        self.evictable.clear()
