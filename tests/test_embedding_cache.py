"""The encoder's shared-memory embedding cache: a writer process and a reader in another, refs
that go stale on eviction or rewrite instead of reading wrong rows, and a restarted writer that
keeps what its previous life finished."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest

from ipc.embedding_cache import EmbeddingCache
from ipc.endpoints import SHM_PREFIX
from ipc.messages import SlotRef
from ipc.shm import new_run_id

pytestmark = pytest.mark.timeout(60)

ROWS, WIDTH = 4, 8


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def embeddings(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((ROWS, WIDTH)).astype(np.float32)


def write_in_child(name: str, num_slots: int, keys: list[int], out: multiprocessing.Queue) -> None:
    cache = EmbeddingCache.create_or_attach(name, num_slots, ROWS, WIDTH)
    out.put([cache.find(key(i)) or cache.put(key(i), embeddings(i)) for i in keys])
    cache.close()


def put_from_another_process(name: str, num_slots: int, keys: list[int]) -> list[SlotRef]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=write_in_child, args=(name, num_slots, keys, out))
    child.start()
    refs = out.get(timeout=30)
    child.join(timeout=30)
    assert child.exitcode == 0
    return refs


@pytest.fixture
def cache_name() -> Iterator[str]:
    name = f"/{SHM_PREFIX}{new_run_id()}-embeds-0"
    yield name
    posix_ipc.unlink_shared_memory(name)


def test_a_reader_gets_what_another_process_wrote(cache_name: str) -> None:
    refs = put_from_another_process(cache_name, 3, [1, 2])
    reader = EmbeddingCache.attach(cache_name)
    for i, ref in zip([1, 2], refs, strict=True):
        np.testing.assert_array_equal(reader.read(ref, key(i)), embeddings(i))
    assert reader.read(refs[0], key(2)) is None  # the slot holds another image
    reader.close()


def test_eviction_is_least_recently_used_and_stale_refs_read_none(cache_name: str) -> None:
    writer = EmbeddingCache.create_or_attach(cache_name, 2, ROWS, WIDTH)
    reader = EmbeddingCache.attach(cache_name)
    first, second = writer.put(key(1), embeddings(1)), writer.put(key(2), embeddings(2))
    assert writer.find(key(1)) == first  # 1 is now the most recently used: 2 goes next
    third = writer.put(key(3), embeddings(3))
    assert third.slot == second.slot
    assert writer.find(key(2)) is None
    assert reader.read(second, key(2)) is None  # evicted: the reader must ask again
    np.testing.assert_array_equal(reader.read(third, key(3)), embeddings(3))
    np.testing.assert_array_equal(reader.read(first, key(1)), embeddings(1))
    # The same slot written again: a ref of its earlier write no longer reads.
    again = writer.put(key(3), embeddings(4))
    assert again.slot == third.slot and again.sequence > third.sequence
    assert reader.read(third, key(3)) is None
    reader.close()
    writer.close()


def test_a_restarted_writer_keeps_finished_slots_and_drops_a_cut_off_one(cache_name: str) -> None:
    refs = put_from_another_process(cache_name, 3, [1, 2])
    # The second write cut off by a crash: its sequence number left odd.
    crashed = EmbeddingCache.attach(cache_name)
    crashed._words[refs[1].slot, 0] += 1
    crashed.close()
    # A new writer finds 1 cached (no recompute: the same ref) and 2 gone, written anew.
    again = put_from_another_process(cache_name, 3, [1, 2])
    assert again[0] == refs[0]
    assert again[1] != refs[1]
    reader = EmbeddingCache.attach(cache_name)
    np.testing.assert_array_equal(reader.read(again[1], key(2)), embeddings(2))
    reader.close()


def test_a_writer_of_another_geometry_starts_a_new_cache(cache_name: str) -> None:
    put_from_another_process(cache_name, 3, [1])
    writer = EmbeddingCache.create_or_attach(cache_name, 5, ROWS, WIDTH)
    assert writer.num_slots == 5 and writer.find(key(1)) is None
    with pytest.raises(ValueError, match=r"do not fit a \[4, 8\] slot"):
        writer.put(key(1), np.zeros((ROWS + 1, WIDTH), np.float32))
    writer.close()
