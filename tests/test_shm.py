"""Shared-memory rings, across real processes (spawn), always cleaned up."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ipc.shm import RingTimeout, ShmRing, SlotOverflow, new_run_id, sweep_stale_runs
from tests.conftest import REPO_ROOT

SPAWN = mp.get_context("spawn")
WAIT = 30.0  # generous bound for any single wait on a loaded machine


def slot_data(i: int) -> np.ndarray:
    """The payload of slot i: its length and values both depend on i."""
    n = 1 + (i * 7919) % 512
    return np.arange(n, dtype=np.int64) + i * 1_000_003


def read_slots(name: str, rank: int, num_slots: int, results) -> None:
    """Reader process: check every slot against `slot_data`, report (rank, count, checksum, bad)."""
    ring = ShmRing.attach(name)
    checksum = num_bad = 0
    for _ in range(num_slots):
        with ring.read(rank, WAIT) as view:
            i = int.from_bytes(view.header, "little")
            data = view.arrays["data"]
            num_bad += int(not np.array_equal(data, slot_data(i)))
            checksum = (checksum + int(data.sum())) % (1 << 61)
    ring.close()
    results.put((rank, num_slots, checksum, num_bad))


def negate_in_place(name: str, done) -> None:
    """Reader process: negate the slot's array through its own view (proves shared memory)."""
    ring = ShmRing.attach(name)
    with ring.read(0, WAIT) as view:
        view.arrays["x"] *= -1
    ring.close()
    done.set()


def hold_slot(name: str, holding) -> None:
    """Reader process: take a slot and never give it back."""
    ring = ShmRing.attach(name)
    with ring.read(0, WAIT):
        holding.set()
        time.sleep(WAIT)


@pytest.fixture
def run_id() -> str:
    return new_run_id()


@pytest.fixture
def cleanup() -> Iterator[list]:
    """Rings and processes to tear down even when the test fails."""
    owned: list = []
    yield owned
    for obj in reversed(owned):
        if isinstance(obj, mp.process.BaseProcess):
            if obj.is_alive():
                obj.kill()
            obj.join(5)
        elif isinstance(obj, subprocess.Popen):
            obj.kill()
            obj.wait()
            sweep_stale_runs()  # its run is dead now: its lock proves it
        else:
            obj.close()
            obj.unlink()


def start(cleanup: list, target, *args) -> mp.process.BaseProcess:
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    cleanup.append(proc)
    return proc


def write_slots(ring: ShmRing, first: int, count: int) -> None:
    for i in range(first, first + count):
        with ring.reserve(WAIT) as slot:
            slot.put("data", slot_data(i))
            slot.publish(i.to_bytes(8, "little"))


@pytest.mark.timeout(120)
def test_one_writer_three_readers_pass_10k_slots_intact(run_id, cleanup):
    num_slots = 10_000
    ring = ShmRing.create(f"/brigade-{run_id}-step-0", num_slots=8, slot_bytes=8192, num_readers=3)
    cleanup.append(ring)
    results = SPAWN.Queue()
    for rank in range(3):
        start(cleanup, read_slots, ring.name, rank, num_slots, results)
    write_slots(ring, 0, num_slots)
    expected = sum(int(slot_data(i).sum()) for i in range(num_slots)) % (1 << 61)
    reports = sorted(results.get(timeout=WAIT) for _ in range(3))
    assert reports == [(rank, num_slots, expected, 0) for rank in range(3)]


def test_reader_reuses_views_only_while_the_slot_layout_is_unchanged(run_id, cleanup):
    ring = ShmRing.create(f"/brigade-{run_id}-step-0", num_slots=1, slot_bytes=4096, num_readers=1)
    cleanup.append(ring)
    reader = ShmRing.attach(ring.name)
    cleanup.append(reader)
    layouts = [("x", np.int32, (4,)), ("x", np.int32, (4,)), ("x", np.float64, (2, 3)), ("y", np.int32, (4,))]
    seen = []
    for i, (name, dtype, shape) in enumerate(layouts):
        with ring.reserve(WAIT) as slot:
            slot.alloc(name, dtype, shape)[:] = i + 1
            slot.publish(bytes([i]))
        with reader.read(0, WAIT) as view:
            assert view.header == bytes([i])
            assert list(view.arrays) == [name]
            tensor = view.tensors()[name]
            assert (view.arrays[name].dtype, view.arrays[name].shape) == (np.dtype(dtype), shape)
            assert tuple(tensor.shape) == shape and bool((tensor == i + 1).all())
            seen.append(tensor)
    # Same directory: the very same views; a new dtype, shape or name: new ones.
    assert seen[1] is seen[0]
    assert seen[2] is not seen[1] and seen[3] is not seen[2]


def test_reader_views_share_the_segment(run_id, cleanup):
    ring = ShmRing.create(f"/brigade-{run_id}-step-0", num_slots=2, slot_bytes=4096, num_readers=1)
    cleanup.append(ring)
    reader = ShmRing.attach(ring.name)
    cleanup.append(reader)
    with ring.reserve(WAIT) as slot:
        written = slot.alloc("x", np.float32, (4, 8))
        written[:] = np.arange(32, dtype=np.float32).reshape(4, 8)
        slot.publish(b"h")
    with reader.read(0, WAIT) as view:
        x = view.arrays["x"]
        assert view.header == b"h"
        assert np.shares_memory(x, reader._buf)
        assert view.tensors()["x"].data_ptr() == x.ctypes.data
        np.testing.assert_array_equal(x, np.arange(32, dtype=np.float32).reshape(4, 8))

    # Another process writes through its view; the writer's own view of the slot sees it.
    with ring.reserve(WAIT) as slot:
        written = slot.alloc("x", np.int32, (1000,))
        written[:] = np.arange(1000)
        slot.publish()
    done = SPAWN.Event()
    start(cleanup, negate_in_place, ring.name, done)
    assert done.wait(WAIT)
    np.testing.assert_array_equal(written, -np.arange(1000))


def test_read_and_reserve_time_out(run_id, cleanup):
    ring = ShmRing.create(f"/brigade-{run_id}-step-0", num_slots=2, slot_bytes=4096, num_readers=1)
    cleanup.append(ring)
    t0 = time.monotonic()
    with pytest.raises(RingTimeout), ring.read(0, 0.2):
        pass
    write_slots(ring, 0, 2)
    with pytest.raises(RingTimeout), ring.reserve(0.2):
        pass
    assert time.monotonic() - t0 < 5
    with pytest.raises(RingTimeout), ring.reserve(0.0):
        pass  # the ring is still full: the failed reserve gave back what it took
    # Draining frees the slots again; an unpublished reservation is discarded.
    for i in range(2):
        with ring.read(0, WAIT) as view:
            assert int.from_bytes(view.header, "little") == i
    with ring.reserve(WAIT) as slot, pytest.raises(SlotOverflow):
        slot.alloc("big", np.uint8, (8192,))
    with pytest.raises(RingTimeout), ring.read(0, 0.1):
        pass


def test_restarted_reader_resumes_where_it_left(run_id, cleanup):
    ring = ShmRing.create(f"/brigade-{run_id}-result-0", num_slots=4, slot_bytes=4096, num_readers=1)
    cleanup.append(ring)
    write_slots(ring, 0, 3)
    first = ShmRing.attach(ring.name)
    with first.read(0, WAIT) as view:
        assert int.from_bytes(view.header, "little") == 0
    first.close()
    second = ShmRing.attach(ring.name)
    cleanup.append(second)
    for i in (1, 2):
        with second.read(0, WAIT) as view:
            assert int.from_bytes(view.header, "little") == i
            np.testing.assert_array_equal(view.arrays["data"], slot_data(i))


@pytest.mark.timeout(90)
def test_killed_reader_times_out_writer_and_reset_recovers(run_id, cleanup):
    ring = ShmRing.create(f"/brigade-{run_id}-step-0", num_slots=4, slot_bytes=8192, num_readers=1)
    cleanup.append(ring)
    holding = SPAWN.Event()
    victim = start(cleanup, hold_slot, ring.name, holding)
    write_slots(ring, 0, 1)
    assert holding.wait(WAIT)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(WAIT)
    write_slots(ring, 1, 3)  # the free slots fill up, then the writer waits for a dead reader
    t0 = time.monotonic()
    with pytest.raises(RingTimeout), ring.reserve(0.5):
        pass
    assert time.monotonic() - t0 < 5

    ring.reset()
    results = SPAWN.Queue()
    start(cleanup, read_slots, ring.name, 0, 50, results)
    write_slots(ring, 100, 50)
    expected = sum(int(slot_data(i).sum()) for i in range(100, 150)) % (1 << 61)
    assert results.get(timeout=WAIT) == (0, 50, expected, 0)


HOLD_A_RUN = """
import sys, time
from ipc.shm import RunLock, ShmRing
run_id = sys.argv[1]
lock = RunLock(run_id)
ring = ShmRing.create(f"/brigade-{run_id}-step-0", num_slots=2, slot_bytes=4096, num_readers=2)
print("holding", flush=True)
time.sleep(120)
"""


def hold_a_run(run_id: str, cleanup: list) -> subprocess.Popen:
    """A process that owns a run as a supervisor does: its lock, then a ring."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_RUN, run_id], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    cleanup.append(process)
    assert process.stdout.readline() == "holding\n"
    return process


def run_objects(run_id: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if run_id in n}


def test_sweep_removes_dead_runs_only(cleanup):
    """Only a run whose lock nobody holds is dead. A live run seen from another PID namespace
    (containers sharing /dev/shm) names a pid this one does not have: its lock keeps it."""
    dead_run, other_namespace_run = f"999999997x{os.urandom(4).hex()}", f"999999999x{os.urandom(4).hex()}"
    dead = hold_a_run(dead_run, cleanup)
    live = hold_a_run(other_namespace_run, cleanup)
    dead.kill()
    dead.wait(WAIT)
    unlocked_run = f"999999998x{os.urandom(4).hex()}"  # no lock file: nothing proves it dead
    unlocked = ShmRing.create(f"/brigade-{unlocked_run}-step-0", num_slots=2, slot_bytes=4096, num_readers=1)
    cleanup.append(unlocked)
    live_objects = run_objects(other_namespace_run)
    removed = sweep_stale_runs()
    ring_objects = {
        "brigade-{}-step-0",
        *(f"sem.brigade-{{}}-step-0-g0-{kind}{r}" for kind in ("space", "avail") for r in range(2)),
    }
    assert (
        run_objects(other_namespace_run)
        == live_objects
        == {
            *(n.format(other_namespace_run) for n in ring_objects),
            f"brigade-{other_namespace_run}-run.lock",
        }
    )
    assert {n for n in removed if dead_run in n} == {
        *(n.format(dead_run) for n in ring_objects),
        f"brigade-{dead_run}-run.lock",
    }
    assert removed[-1] == f"brigade-{dead_run}-run.lock"  # the lock file goes last
    assert not run_objects(dead_run)
    assert len(run_objects(unlocked_run)) == 3  # segment + 2 semaphores
    live.kill()
    live.wait(WAIT)
    assert {n for n in sweep_stale_runs() if other_namespace_run in n} == live_objects


def test_a_ring_too_large_to_map_leaves_nothing_in_dev_shm(run_id):
    """A config can size a ring past the address space (engine.max_num_seqs of 2**40): the
    segment is made (tmpfs files are sparse), its mapping fails. The error reaches the caller,
    and neither the segment nor a semaphore stays for a later run's sweep."""
    name = f"/brigade-{run_id}-step-0"
    with pytest.raises(OSError):
        ShmRing.create(name, num_slots=2, slot_bytes=1 << 50, num_readers=1)  # 2 PiB, past x86-64's 128 TiB
    assert not run_objects(run_id)


def test_a_ring_past_64_bits_is_refused_not_made_small(run_id):
    """posix_ipc takes a segment's size modulo 2**64: four slots of 2**62 bytes made a ring of a
    few bytes' worth of segment, whose first write would have been past its end."""
    with pytest.raises(ValueError, match="past any address space"):
        ShmRing.create(f"/brigade-{run_id}-step-0", num_slots=4, slot_bytes=1 << 62, num_readers=1)
    assert not run_objects(run_id)
