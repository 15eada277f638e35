"""IPC benchmarks: what a hop between stages costs, and what the shared-memory ring saves.

- memcpy bandwidth of a 64 MiB numpy buffer (the yardstick);
- control round trip DEALER <-> ROUTER over ipc://: bare pyzmq vs the typed sockets with a real
  msgspec message (echo server in another process); and the typed sockets over each kind of link
  a run can have: ipc://, tcp:// on loopback, tcp:// with CURVE (`--links` measures only these);
- bulk handoff to another process, for 4 KiB, 1 MiB and 64 MiB: the shm ring (writer publishes a
  slot it already filled in place -> reader holds a torch view), one ZeroMQ frame with copy=True
  (-> torch.frombuffer), and multiprocessing.Queue (pickle). Latencies are perf_counter_ns values
  compared across processes (CLOCK_MONOTONIC is system-wide).

    python benchmarks/ipc_bench.py --json results/ipc.json
    python benchmarks/ipc_bench.py --links
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import zmq

# Run as a script from anywhere: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc import codec as C
from ipc import messages as m
from ipc.config import NetworkConfig
from ipc.endpoints import Link, choose_link, free_port_base
from ipc.keys import create_key_files
from ipc.shm import ShmRing, new_run_id
from ipc.sockets import DealerSocket, RouterSocket

SPAWN = mp.get_context("spawn")
SIZES = (4096, 1 << 20, 64 << 20)
WAIT = 30.0
STOP = b"stop"
RTT_WARMUP, RTT_SAMPLES = 500, 3000
# Iterations per payload size, per transport (the slow ones get fewer at 64 MiB).
SHM_ITERS = {4096: 300, 1 << 20: 300, 64 << 20: 100}
ZMQ_ITERS = {4096: 300, 1 << 20: 100, 64 << 20: 15}
PICKLE_ITERS = {4096: 300, 1 << 20: 100, 64 << 20: 10}
PACING_S = 0.0005  # let the receiver park in its wait, as a worker waiting for the next step does


def p50_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1000


# ---------------------------------------------------------------------------
# memcpy
# ---------------------------------------------------------------------------


def bench_memcpy(nbytes: int = 64 << 20, repeats: int = 10) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


# ---------------------------------------------------------------------------
# control round trip
# ---------------------------------------------------------------------------


def raw_echo(endpoint: str, ready) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        identity = sock.recv()
        msg = sock.recv()
        sock.send(identity, zmq.SNDMORE)
        sock.send(msg)
        if msg == STOP:
            break
    sock.close()
    ctx.term()


def typed_echo(endpoint: str | Link, ready) -> None:
    ctx = zmq.Context()
    with RouterSocket(ctx, endpoint, C.SCHEDULER_INPUT, C.SCHEDULER_INPUT) as router:
        ready.set()
        while True:
            got = router.recv(WAIT)
            if got is None:
                break
            router.send(*got)
            if got[1].request_id == "stop":
                break
    ctx.term()


def bench_rtt(run_dir: Path) -> tuple[float, float]:
    """p50 round trips (µs): bare pyzmq and the typed sockets."""
    raw_ep, typed_ep = f"ipc://{run_dir}/raw.sock", f"ipc://{run_dir}/typed.sock"
    ready = [SPAWN.Event(), SPAWN.Event()]
    procs = [
        SPAWN.Process(target=raw_echo, args=(raw_ep, ready[0]), daemon=True),
        SPAWN.Process(target=typed_echo, args=(typed_ep, ready[1]), daemon=True),
    ]
    for proc in procs:
        proc.start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(raw_ep)
    typed = DealerSocket(ctx, typed_ep, C.SCHEDULER_INPUT, C.SCHEDULER_INPUT)
    payload = bytes(64)
    message = m.AbortRequest("req-0123456789abcdef0123456789", "abort")
    raw_ns: list[int] = []
    typed_ns: list[int] = []
    try:
        assert all(event.wait(WAIT) for event in ready), "echo servers did not start"
        for i in range(RTT_WARMUP + RTT_SAMPLES):  # alternate, so both see the same machine load
            t0 = time.perf_counter_ns()
            raw.send(payload)
            raw.recv()
            t1 = time.perf_counter_ns()
            typed.send(message)
            reply = typed.recv(WAIT)
            t2 = time.perf_counter_ns()
            assert reply == message
            if i >= RTT_WARMUP:
                raw_ns.append(t1 - t0)
                typed_ns.append(t2 - t1)
        raw.send(STOP)
        raw.recv()
        typed.send(m.AbortRequest("stop"))
        typed.recv(WAIT)
    finally:
        raw.close(0)
        typed.close()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        ctx.term()
    return p50_us(raw_ns), p50_us(typed_ns)


def run_links(run_dir: Path) -> dict[str, Link]:
    """One link of each kind a run can have, on this host."""
    keys = create_key_files(run_dir / "curve")
    base = free_port_base("127.0.0.1")
    common = {"same_host": True, "host": "127.0.0.1", "run_dir": run_dir}
    return {
        "ipc": choose_link("rtt", port=0, network=NetworkConfig(), keys=None, **common),
        "tcp": choose_link(
            "rtt", port=base, network=NetworkConfig(transport="tcp", curve=False), keys=None, **common
        ),
        "tcp_curve": choose_link(
            "rtt", port=base + 1, network=NetworkConfig(transport="tcp"), keys=keys, **common
        ),
    }


def bench_link_rtt(run_dir: Path) -> dict[str, float]:
    """p50 round trips (µs) of the typed sockets over each kind of link, alternated so that all
    see the same machine load."""
    links = run_links(run_dir)
    ready = {name: SPAWN.Event() for name in links}
    procs = [SPAWN.Process(target=typed_echo, args=(links[n], ready[n]), daemon=True) for n in links]
    for proc in procs:
        proc.start()
    ctx = zmq.Context()
    dealers = {
        name: DealerSocket(ctx, link, C.SCHEDULER_INPUT, C.SCHEDULER_INPUT) for name, link in links.items()
    }
    message = m.AbortRequest("req-0123456789abcdef0123456789", "abort")
    samples: dict[str, list[int]] = {name: [] for name in links}
    try:
        assert all(event.wait(WAIT) for event in ready.values()), "echo servers did not start"
        for i in range(RTT_WARMUP + RTT_SAMPLES):
            for name, dealer in dealers.items():
                t0 = time.perf_counter_ns()
                dealer.send(message)
                reply = dealer.recv(WAIT)
                t1 = time.perf_counter_ns()
                assert reply == message, f"{name}: no echo"
                if i >= RTT_WARMUP:
                    samples[name].append(t1 - t0)
        for dealer in dealers.values():
            dealer.send(m.AbortRequest("stop"))
            dealer.recv(WAIT)
    finally:
        for dealer in dealers.values():
            dealer.close()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        ctx.term()
    return {name: p50_us(ns) for name, ns in samples.items()}


def print_link_rtt(link_rtt: dict[str, float]) -> None:
    print(
        "typed round trip p50 by link: " + ", ".join(f"{name} {us:.1f} µs" for name, us in link_rtt.items())
    )


# ---------------------------------------------------------------------------
# bulk handoff: one receiver process for the three transports, in turn
# ---------------------------------------------------------------------------


def receiver(ring_name: str, zmq_ep: str, ack_ep: str, queue, acks, results) -> None:
    import torch

    warnings.filterwarnings("ignore", message=".*not writable.*")  # frombuffer on a zmq frame
    out: dict[str, dict[int, list[int]]] = {"shm": {}, "zmq": {}, "pickle": {}}

    ring = ShmRing.attach(ring_name)
    for size in SIZES:
        lat = out["shm"][size] = []
        for i in range(SHM_ITERS[size]):
            with ring.read(0, WAIT) as view:
                tensor = view.tensors()["x"]
                t1 = time.perf_counter_ns()
                lat.append(t1 - int.from_bytes(view.header, "little"))
                assert tensor.numel() == size and int(tensor[0]) == i % 251
    ring.close()

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(zmq_ep)
    ack = ctx.socket(zmq.PUSH)
    ack.connect(ack_ep)
    for size in SIZES:
        lat = out["zmq"][size] = []
        for _ in range(ZMQ_ITERS[size]):
            frame = pull.recv(copy=False)
            tensor = torch.frombuffer(frame, dtype=torch.uint8)
            t1 = time.perf_counter_ns()
            lat.append(t1 - int.from_bytes(memoryview(frame)[:8], "little"))
            assert tensor.numel() == size
            ack.send(b"")
    pull.close(0)
    ack.close(0)
    ctx.term()

    for size in SIZES:
        lat = out["pickle"][size] = []
        for _ in range(PICKLE_ITERS[size]):
            t0, array = queue.get(timeout=WAIT)
            tensor = torch.from_numpy(array)
            lat.append(time.perf_counter_ns() - t0)
            assert tensor.numel() == size
            acks.put(None)
    results.put(out)


def bench_handoff(run_dir: Path) -> dict[str, dict[str, float]]:
    ring = ShmRing.create(
        f"/brigade-{new_run_id()}-bench", num_slots=1, slot_bytes=max(SIZES) + 4096, num_readers=1
    )
    zmq_ep, ack_ep = f"ipc://{run_dir}/bulk.sock", f"ipc://{run_dir}/ack.sock"
    queue, acks, results = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=receiver, args=(ring.name, zmq_ep, ack_ep, queue, acks, results), daemon=True)
    proc.start()
    ctx = zmq.Context()
    try:
        for size in SIZES:
            for i in range(SHM_ITERS[size]):
                with ring.reserve(WAIT) as slot:
                    x = slot.alloc("x", np.uint8, (size,))
                    if i == 0:
                        x[:] = 1  # written in place once; the slot keeps it (one slot, reused)
                    x[0] = i % 251
                    time.sleep(PACING_S)
                    slot.publish(time.perf_counter_ns().to_bytes(8, "little"))

        push = ctx.socket(zmq.PUSH)
        push.connect(zmq_ep)
        ack = ctx.socket(zmq.PULL)
        ack.bind(ack_ep)
        ack.rcvtimeo = int(WAIT * 1000)
        for size in SIZES:
            payload = np.ones(size, dtype=np.uint8)
            stamp = payload[:8].view(np.int64)
            for _ in range(ZMQ_ITERS[size]):
                time.sleep(PACING_S)
                stamp[0] = time.perf_counter_ns()
                push.send(payload, copy=True)
                ack.recv()
        push.close(0)
        ack.close(0)

        for size in SIZES:
            payload = np.ones(size, dtype=np.uint8)
            for _ in range(PICKLE_ITERS[size]):
                time.sleep(PACING_S)
                queue.put((time.perf_counter_ns(), payload))
                acks.get(timeout=WAIT)
        out = results.get(timeout=WAIT)
        proc.join(WAIT)
    finally:
        if proc.is_alive():
            proc.kill()
        ctx.destroy(0)
        ring.close()
        ring.unlink()
    return {
        transport: {str(size): p50_us(samples) for size, samples in by_size.items()}
        for transport, by_size in out.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--links", action="store_true", help="only the round trip by kind of link")
    args = parser.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="brigade-bench-"))
    t_start = time.perf_counter()
    if args.links:
        try:
            link_rtt = bench_link_rtt(run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        print_link_rtt(link_rtt)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"link_rtt_us_p50": link_rtt}, indent=2))
        return
    try:
        memcpy_gbps = bench_memcpy()
        raw_rtt, typed_rtt = bench_rtt(run_dir)
        link_rtt = bench_link_rtt(run_dir)
        handoff = bench_handoff(run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    shm, zmq_copy = handoff["shm"], handoff["zmq"]
    big = str(max(SIZES))
    targets = {
        "shm_handoff_64MiB_le_100us": shm[big] <= 100.0,
        "shm_handoff_64MiB_20x_below_zmq_copy": shm[big] * 20 <= zmq_copy[big],
        "brigade_rtt_le_1.5x_raw": typed_rtt <= 1.5 * raw_rtt,
    }
    result = {
        "memcpy_gbps": memcpy_gbps,
        "raw_zmq_rtt_us_p50": raw_rtt,
        "brigade_rtt_us_p50": typed_rtt,
        "link_rtt_us_p50": link_rtt,
        "shm_handoff_us_p50": shm,
        "zmq_copy_us_p50": zmq_copy,
        "pickle_queue_us_p50": handoff["pickle"],
        "targets_met": targets,
        "seconds": time.perf_counter() - t_start,
        "platform": {
            "machine": platform.machine(),
            "cpus": mp.cpu_count(),
            "python": platform.python_version(),
        },
    }

    print(f"memcpy 64 MiB: {memcpy_gbps:.1f} GB/s")
    print(f"round trip p50: raw pyzmq {raw_rtt:.1f} µs, typed sockets {typed_rtt:.1f} µs")
    print_link_rtt(link_rtt)
    print(f"{'bytes':>10} {'shm ring µs':>12} {'zmq copy µs':>12} {'mp.Queue µs':>12}")
    for size in map(str, SIZES):
        print(f"{size:>10} {shm[size]:>12.1f} {zmq_copy[size]:>12.1f} {handoff['pickle'][size]:>12.1f}")
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")
    print(f"total {result['seconds']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
