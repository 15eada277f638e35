"""BlockManager: reference counts, the free list, the prefix cache and its LRU eviction."""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.block_manager import BlockManager, NoFreeBlocks, hash_block


def test_allocate_and_release_count_references() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_used == 3 and bm.num_available == 1
    assert all(bm.ref_counts[b] == 1 for b in a)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(2)
    bm.release(a)
    assert bm.num_used == 0 and bm.num_available == 4
    assert sorted(bm.free) == [0, 1, 2, 3]


def test_hash_chains_over_parents() -> None:
    tokens = np.arange(4, dtype=np.int32)
    assert hash_block(b"", tokens) == hash_block(b"", tokens.copy())
    assert hash_block(b"", tokens) != hash_block(hash_block(b"", tokens), tokens)
    bm = BlockManager(num_blocks=4, block_size=2)
    hashes: list[bytes] = []
    bm.extend_hashes(hashes, np.array([1, 2, 3, 4, 5], np.int32))  # the partial 3rd block is not hashed
    assert len(hashes) == 2
    assert hashes[1] == hash_block(hashes[0], np.array([3, 4], np.int32))
    more = list(hashes)
    bm.extend_hashes(more, np.array([5, 6], np.int32))
    assert more[:2] == hashes and more[2] == hash_block(hashes[1], np.array([5, 6], np.int32))


def test_cached_blocks_are_shared_then_evicted_lru() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    hashes: list[bytes] = []
    bm.extend_hashes(hashes, np.array([7, 8, 9, 10], np.int32))
    blocks = bm.allocate(2)
    for b, h in zip(blocks, hashes, strict=True):
        bm.register(b, h)
    assert bm.match_prefix(hashes) == blocks

    # A second sequence shares them: references add up, nothing new is used.
    bm.acquire(bm.match_prefix(hashes))
    assert [bm.ref_counts[b] for b in blocks] == [2, 2]
    bm.release(blocks)
    bm.release(blocks)
    # Unreferenced but cached: still matchable, and counted as available.
    assert bm.num_used == 0 and bm.num_available == 3
    assert bm.match_prefix(hashes) == blocks
    assert bm.num_available_besides(blocks) == 1

    # The free block goes first; then the least recently released cached block is evicted
    # (release is tail first, so the prefix's first block is evicted last).
    (free_block,) = set(range(3)) - set(blocks)
    assert bm.allocate(1) == [free_block]
    assert bm.allocate(1) == [blocks[1]]
    assert bm.num_evictions == 1
    assert bm.match_prefix(hashes) == [blocks[0]]


def test_register_keeps_first_copy_and_clear_cache_frees() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    h = hash_block(b"", np.array([1, 2], np.int32))
    a, b = bm.allocate(2)
    bm.register(a, h)
    bm.register(b, h)  # same content computed twice: b stays private
    assert bm.cached == {h: a} and bm.block_hash[b] is None
    bm.release([a, b])
    assert list(bm.evictable) == [a] and b in bm.free
    bm.clear_cache()
    assert not bm.cached and not bm.evictable and sorted(bm.free) == [0, 1, 2, 3]
    assert bm.match_prefix([h]) == []
