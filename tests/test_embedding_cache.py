"""The encoder's shared-memory embedding cache: a writer process and a reader in another, images
of different sizes in runs of pages, refs that go stale on eviction or rewrite instead of reading
wrong rows (also mid-copy), and a restarted writer that keeps what its previous life finished."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest

from ipc.embedding_cache import EmbeddingCache, NoRoom
from ipc.endpoints import SHM_PREFIX
from ipc.messages import SlotRef
from ipc.shm import new_run_id

pytestmark = pytest.mark.timeout(60)

ROWS, WIDTH = 4, 8  # rows per page


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def embeddings(i: int, rows: int = ROWS) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((rows, WIDTH)).astype(np.float32)


def write_in_child(
    name: str, num_pages: int, keys: list[int], rows: dict[int, int], out: multiprocessing.Queue
) -> None:
    cache = EmbeddingCache.create_or_attach(name, num_pages, ROWS, WIDTH)
    out.put([cache.find(key(i)) or cache.put(key(i), embeddings(i, rows.get(i, ROWS))) for i in keys])
    cache.close()


def put_from_another_process(
    name: str, num_pages: int, keys: list[int], rows: dict[int, int] | None = None
) -> list[SlotRef]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=write_in_child, args=(name, num_pages, keys, rows or {}, out))
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
    assert third.slot == second.slot  # one page each: the freed page is the run
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
    # A write under way (odd) reads as nothing, even to a ref of its own number.
    assert crashed.read(SlotRef(refs[1].slot, refs[1].sequence + 1), key(2)) is None
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
    assert writer.num_pages == 5 and writer.find(key(1)) is None
    with pytest.raises(ValueError, match=r"do not fit a cache of \[20, 8\]"):
        writer.put(key(1), np.zeros((5 * ROWS + 1, WIDTH), np.float32))
    writer.close()


def test_images_of_different_sizes_take_runs_of_pages(cache_name: str) -> None:
    writer = EmbeddingCache.create_or_attach(cache_name, 8, ROWS, WIDTH)
    reader = EmbeddingCache.attach(cache_name)
    sizes = {1: 1, 2: ROWS, 3: ROWS + 1, 4: 3 * ROWS}  # 1, 1, 2 and 3 pages
    refs = {i: writer.put(key(i), embeddings(i, rows)) for i, rows in sizes.items()}
    assert [ref.slot for ref in refs.values()] == [0, 1, 2, 4]
    for i, ref in refs.items():
        np.testing.assert_array_equal(reader.read(ref, key(i)), embeddings(i, sizes[i]))
    assert reader.held() == {key(i): ref for i, ref in refs.items()}
    reader.close()
    writer.close()


def test_a_large_image_evicts_least_recently_used_images_until_a_run_is_free(cache_name: str) -> None:
    writer = EmbeddingCache.create_or_attach(cache_name, 6, ROWS, WIDTH)
    reader = EmbeddingCache.attach(cache_name)
    refs = {i: writer.put(key(i), embeddings(i)) for i in range(1, 5)}  # pages 0 to 3
    refs[5] = writer.put(key(5), embeddings(5, 2 * ROWS))  # pages 4 and 5: the cache is full
    assert writer.find(key(1)) == refs[1]  # 1 is now the most recently used: 2, 3, 4 go first
    large = writer.put(key(6), embeddings(6, 3 * ROWS))
    assert large.slot == 1
    for i in (2, 3, 4):
        assert writer.find(key(i)) is None and reader.read(refs[i], key(i)) is None
    np.testing.assert_array_equal(reader.read(large, key(6)), embeddings(6, 3 * ROWS))
    for i, rows in ((1, ROWS), (5, 2 * ROWS)):  # still there, untouched
        np.testing.assert_array_equal(reader.read(refs[i], key(i)), embeddings(i, rows))
    reader.close()
    writer.close()


def test_scattered_free_pages_are_no_run_eviction_goes_on_until_one_is(cache_name: str) -> None:
    writer = EmbeddingCache.create_or_attach(cache_name, 6, ROWS, WIDTH)
    refs = {i: writer.put(key(i), embeddings(i)) for i in range(6)}  # image i on page i
    for i in (1, 3, 5):
        writer.find(key(i))  # least recently used now: 0, 2, 4, then 1, 3, 5
    # Evicting 0, 2 and 4 frees three pages but no two in a row; evicting 1 too makes pages 0-2.
    ref = writer.put(key(6), embeddings(6, 2 * ROWS))
    assert ref.slot == 0
    assert [i for i in range(6) if writer.find(key(i))] == [3, 5]
    assert writer.find(key(3)) == refs[3] and writer.find(key(5)) == refs[5]
    np.testing.assert_array_equal(writer.read(ref, key(6)), embeddings(6, 2 * ROWS))
    # Images the writer keeps are never evicted: with them in the way, there is no room.
    with pytest.raises(NoRoom):
        writer.put(key(7), embeddings(7, 4 * ROWS), keep={key(3), key(5)})
    writer.close()


def test_fits_is_a_dry_run_of_the_puts_it_answers_for(cache_name: str) -> None:
    writer = EmbeddingCache.create_or_attach(cache_name, 6, ROWS, WIDTH)
    refs = {i: writer.put(key(i), embeddings(i)) for i in range(6)}  # image i on page i
    held = writer.held()
    # Image 2 kept splits the pages into runs of 2 and 3: a 3-page and a 2-page image fit
    # (evicting all but 2), a 4-page one does not; neither answer evicts anything.
    keep = {key(2), key(6), key(7)}
    assert writer.fits([3 * ROWS, 2 * ROWS], keep)
    assert not writer.fits([4 * ROWS], keep)
    assert writer.held() == held and all(writer.find(key(i)) == refs[i] for i in range(6))
    # The puts do what the dry run played.
    assert writer.put(key(6), embeddings(6, 3 * ROWS), keep).slot == 3
    assert writer.put(key(7), embeddings(7, 2 * ROWS), keep).slot == 0
    assert set(writer.held()) == keep and writer.find(key(2)) == refs[2]
    writer.close()


class EvictedMidCopy:
    """A reader's data whose slicing (the reader's copy, between its two sequence reads) first
    lets the writer evict the image being read and write another over its pages."""

    def __init__(self, data: np.ndarray, writer: EmbeddingCache, key: bytes, rows: np.ndarray) -> None:
        self.data, self.writer, self.key, self.rows = data, writer, key, rows

    def __getitem__(self, index: slice) -> np.ndarray:
        self.writer.put(self.key, self.rows)
        return self.data[index]


def test_a_reader_racing_an_eviction_reads_none_never_the_new_rows(cache_name: str) -> None:
    writer = EmbeddingCache.create_or_attach(cache_name, 3, ROWS, WIDTH)
    reader = EmbeddingCache.attach(cache_name)
    writer.put(key(1), embeddings(1))  # page 0
    target = writer.put(key(2), embeddings(2))  # page 1
    # Image 3 takes pages 0 and 1 (evicting 1, then 2) while the reader copies page 1's rows.
    reader._data = EvictedMidCopy(reader._data, writer, key(3), embeddings(3, 2 * ROWS))  # type: ignore[assignment]
    assert reader.read(target, key(2)) is None
    assert writer.find(key(3)) == SlotRef(0, writer.held()[key(3)].sequence)
    assert writer.find(key(2)) is None
    reader.close()
    writer.close()


def test_a_restarted_writer_rebuilds_its_pages_from_the_headers(cache_name: str) -> None:
    sizes = {1: 2 * ROWS, 2: 1, 3: 3 * ROWS}  # pages 0-1, 2, 3-5
    refs = put_from_another_process(cache_name, 8, [1, 2, 3], sizes)
    # The second image's write cut off by a crash: its sequence number left odd.
    crashed = EmbeddingCache.attach(cache_name)
    crashed._words[refs[1].slot, 0] += 1
    crashed.close()
    writer = EmbeddingCache.create_or_attach(cache_name, 8, ROWS, WIDTH)
    assert writer.find(key(1)) == refs[0] and writer.find(key(3)) == refs[2] and writer.find(key(2)) is None
    # The free pages are 2, 6 and 7: a two-page image takes 6-7, a one-page one 2; nothing kept
    # is overwritten (no eviction needed: the cache is full but holds all four).
    assert writer.put(key(4), embeddings(4, 2 * ROWS)).slot == 6
    assert writer.put(key(2), embeddings(2, 1)).slot == 2
    reader = EmbeddingCache.attach(cache_name)
    for i, rows in {**sizes, 4: 2 * ROWS}.items():
        ref = writer.find(key(i))
        assert ref is not None
        np.testing.assert_array_equal(reader.read(ref, key(i)), embeddings(i, rows))
    reader.close()
    writer.close()
