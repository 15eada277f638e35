"""CPU that each process of a Brigade run spends per streamed output token, beside the worker's
own step time and the wall time per token.

    python benchmarks/stage_cpu.py [--concurrency 1 4] [--output-len 128] [--requests 4]
        [--config FILE] [--set key=value ...] [--json FILE] [--profile DIR]

It starts a supervisor (`--config`, float32 by default), streams `--requests` chat prompts per
concurrency over the gateway's /v1/completions (greedy, ignore_eos), and reads every process's
user + system CPU from /proc before and after: the supervisor, each stage and this client. On a
host with fewer cores than the worker has threads, every millisecond another process spends per
token is taken from the worker, so "non-worker CPU per token" is the figure to keep small.

The worker's step time comes from the scheduler's `brigade:step_execute_time_seconds` histogram
(the worker measures each step, model and sampling). TTFT is split into the prefill step's
execute time and the rest (HTTP, tokenizer, scheduler, rings, detokenizer, and back).
`--profile DIR` records each non-worker stage with py-spy (`PY_SPY` names the binary) during
the first concurrency's requests, one raw flame file per stage.
Everything it starts (processes, run dir, /dev/shm objects) is removed, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import datasets, peers  # noqa: E402
from benchmarks.datasets import BenchRequest  # noqa: E402
from benchmarks.serve import BrigadeProcess, percentile  # noqa: E402
from services.metrics import PREFIX, registry_for_run  # noqa: E402
from services.stage import read_run_info  # noqa: E402
from services.stage_rows import STATUS_FILE  # noqa: E402

READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0
WORKER = "gpu_worker"
CLIENT = "client"
EXECUTE_TIME = f"{PREFIX}step_execute_time_seconds"


def process_cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of `pid` so far, from the scheduler's nanosecond counts
    (utime and stime in /proc/PID/stat count 10 ms ticks, too coarse for an idle stage); 0 for a
    process that is gone."""
    total_ns = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):  # a thread that just ended
                total_ns += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    except OSError:
        return 0.0
    return total_ns / 1e9


def run_processes(run_dir: Path, supervisor_pid: int) -> dict[str, tuple[str, int]]:
    """name -> (kind, pid) of the supervisor and every stage (from status.json)."""
    rows = json.loads((run_dir / STATUS_FILE).read_text())
    return {"supervisor": ("supervisor", supervisor_pid), **{r["name"]: (r["kind"], r["pid"]) for r in rows}}


def execute_totals(run_dir: Path) -> dict[str, tuple[float, float]]:
    """phase -> (sum of seconds, count) of the workers' step times, over every engine group."""
    totals: dict[str, list[float]] = {}
    for family in registry_for_run(run_dir).collect():
        if family.name != EXECUTE_TIME:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                entry = totals.setdefault(sample.labels["phase"], [0.0, 0.0])
                entry[sample.name.endswith("_count")] += sample.value
    return {phase: (s, c) for phase, (s, c) in totals.items()}


def mean_ms(
    after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]], phase: str
) -> float | None:
    s1, c1 = after.get(phase, (0.0, 0.0))
    s0, c0 = before.get(phase, (0.0, 0.0))
    return (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None


async def stream_one(port: int, request: BenchRequest) -> dict:
    """One streamed request: its TTFT and TPOT (ms) and its number of output tokens."""
    start = time.perf_counter()
    first = last = 0.0
    num_tokens = 0
    async for n in peers.openai_stream(port, request):
        if n:
            last = time.perf_counter()
            first = first or last
            num_tokens += n
    if not num_tokens:
        raise RuntimeError("a request streamed no tokens")
    tpot = (last - first) / (num_tokens - 1) * 1e3 if num_tokens > 1 else 0.0
    return {"ttft_ms": (first - start) * 1e3, "tpot_ms": tpot, "num_tokens": num_tokens}


async def stream_all(port: int, requests: list[BenchRequest], concurrency: int) -> list[dict]:
    pending = list(reversed(requests))
    results: list[dict] = []

    async def lane() -> None:
        while pending:
            results.append(await stream_one(port, pending.pop()))

    await asyncio.wait_for(asyncio.gather(*(lane() for _ in range(concurrency))), REQUEST_TIMEOUT_S)
    return results


def start_profiles(
    processes: dict[str, tuple[str, int]], out_dir: Path, seconds: float
) -> list[subprocess.Popen]:
    binary = os.environ.get("PY_SPY", "py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            # --gil: only samples that hold the GIL, so time blocked in a poll or a semaphore is left out.
            [
                binary,
                "record",
                "--gil",
                "--nonblocking",
                "-r",
                "100",
                "-f",
                "raw",
                "-d",
                f"{seconds:.0f}",
                "-o",
                str(out_dir / f"{name}.txt"),
                "-p",
                str(pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, (kind, pid) in processes.items()
        if kind != WORKER
    ]


def profile(run_dir: Path, supervisor_pid: int, requests: list[BenchRequest], concurrency: int,
            out_dir: Path) -> None:  # fmt: skip
    """The requests once more with py-spy on every non-worker process (not measured: py-spy takes
    CPU of its own)."""
    port = read_run_info(run_dir).config.gateway.port
    spies = start_profiles(run_processes(run_dir, supervisor_pid), out_dir, 3600)
    try:
        asyncio.run(stream_all(port, requests, concurrency))
    finally:
        for spy in spies:  # py-spy writes its file on SIGINT
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()


def idle_cpu(run_dir: Path, supervisor_pid: int, seconds: float) -> dict[str, float]:
    """ms of CPU per second of each process while the run serves nothing: its polling and timers."""
    processes = run_processes(run_dir, supervisor_pid)
    before = {name: process_cpu_s(pid) for name, (_, pid) in processes.items()}
    time.sleep(seconds)
    return {name: (process_cpu_s(pid) - before[name]) / seconds * 1e3 for name, (_, pid) in processes.items()}


def measure(
    run_dir: Path, supervisor_pid: int, requests: list[BenchRequest], concurrency: int, idle: dict[str, float]
) -> dict:
    """One concurrency: CPU per token of each process, the worker's step times, TTFT split.
    `idle` (ms CPU per second while idle) splits each process's CPU into what it spends by the
    clock (polls, timers, status files) and what each token adds, so that runs on a loaded host,
    which stream fewer tokens per second, compare with runs on a quiet one."""
    port = read_run_info(run_dir).config.gateway.port
    processes = run_processes(run_dir, supervisor_pid)
    steps_before = execute_totals(run_dir)
    cpu_before = {name: process_cpu_s(pid) for name, (_, pid) in processes.items()}
    client_before, wall_before = time.process_time(), time.perf_counter()
    results = asyncio.run(stream_all(port, requests, concurrency))
    wall_s = time.perf_counter() - wall_before
    client_s = time.process_time() - client_before
    cpu_after = {name: process_cpu_s(pid) for name, (_, pid) in processes.items()}
    time.sleep(2 * read_run_info(run_dir).config.supervisor.heartbeat_interval_s)  # the last step times
    steps_after = execute_totals(run_dir)
    num_tokens = sum(r["num_tokens"] for r in results)
    per_token = {name: (cpu_after[name] - cpu_before[name]) / num_tokens * 1e3 for name in processes}
    per_token[CLIENT] = client_s / num_tokens * 1e3
    marginal = {name: ms - idle.get(name, 0.0) * wall_s / num_tokens for name, ms in per_token.items()}
    kinds = {name: kind for name, (kind, _) in processes.items()} | {CLIENT: CLIENT}
    non_worker = sum(ms for name, ms in per_token.items() if kinds[name] != WORKER)
    decode_ms = mean_ms(steps_after, steps_before, "decode")
    prefill_ms = mean_ms(steps_after, steps_before, "prefill")
    ttft_mean = sum(r["ttft_ms"] for r in results) / len(results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "output_tokens": num_tokens,
        "wall_s": round(wall_s, 3),
        "wall_ms_per_token": wall_s / num_tokens * 1e3,
        "tpot_ms_p50": percentile([r["tpot_ms"] for r in results], 50),
        "ttft_ms_p50": percentile([r["ttft_ms"] for r in results], 50),
        "ttft_ms_mean": ttft_mean,
        "worker_decode_step_ms": decode_ms,
        "worker_prefill_step_ms": prefill_ms,
        # At one stream the first token waits for one prefill step; the rest is the pipeline's.
        "ttft_outside_prefill_ms": ttft_mean - prefill_ms
        if prefill_ms is not None and concurrency == 1
        else None,
        "cpu_ms_per_token": per_token,
        "cpu_ms_per_s": {name: ms * num_tokens / wall_s for name, ms in per_token.items()},
        "marginal_cpu_ms_per_token": marginal,
        "kinds": kinds,
        "non_worker_cpu_ms_per_token": non_worker,
        "non_worker_marginal_cpu_ms_per_token": sum(
            ms for name, ms in marginal.items() if kinds[name] != WORKER
        ),
    }


def print_idle(idle: dict[str, float], seconds: float) -> None:
    print(f"idle ({seconds:.0f} s, nothing served): ms CPU per second")
    for name, ms in sorted(idle.items(), key=lambda item: -item[1]):
        print(f"  {name:24s} {ms:15.3f}")


def print_table(result: dict) -> None:
    print(
        f"\nconcurrency {result['concurrency']}: {result['requests']} requests, {result['output_tokens']} tokens "
        f"in {result['wall_s']:.2f} s"
    )
    print(f"  {'process':24s} {'ms CPU / token':>15s} {'of it by the clock':>19s} {'per token':>10s}")
    marginal = result["marginal_cpu_ms_per_token"]
    for name, ms in sorted(result["cpu_ms_per_token"].items(), key=lambda item: -item[1]):
        print(f"  {name:24s} {ms:15.3f} {ms - marginal[name]:19.3f} {marginal[name]:10.3f}")
    total, total_marginal = (
        result["non_worker_cpu_ms_per_token"],
        result["non_worker_marginal_cpu_ms_per_token"],
    )
    print(f"  {'non-worker total':24s} {total:15.3f} {total - total_marginal:19.3f} {total_marginal:10.3f}")

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f} ms"

    print(
        f"  wall per token {fmt(result['wall_ms_per_token'])}, TPOT p50 {fmt(result['tpot_ms_p50'])}, "
        f"worker decode step {fmt(result['worker_decode_step_ms'])}"
    )
    print(
        f"  TTFT mean {fmt(result['ttft_ms_mean'])} (p50 {fmt(result['ttft_ms_p50'])}), worker prefill step "
        f"{fmt(result['worker_prefill_step_ms'])}, outside the prefill {fmt(result['ttft_outside_prefill_ms'])}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4, help="requests per concurrency")
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-s", type=float, default=5.0, help="seconds of idle CPU measured first")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="py-spy raw profiles of each non-worker stage"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="brigade-stage-cpu-"))
    overrides = [f"model.dtype={args.dtype}", f"gateway.port={peers.free_port()}", "supervisor.metrics_port=0",
                 *args.set]  # fmt: skip
    run = BrigadeProcess(run_dir, args.config, overrides, run_dir.parent / f"{run_dir.name}.log")
    report: dict = {
        "config": args.config,
        "overrides": overrides,
        "output_len": args.output_len,
        "results": [],
    }
    try:
        run.wait_ready(READY_TIMEOUT_S)
        report["run_id"] = read_run_info(run_dir).run_id
        model_dir = Path(read_run_info(run_dir).model_dir)
        total = max(args.requests, max(args.concurrency))
        prompts = datasets.chat_requests(model_dir, total, (args.output_len, args.output_len), args.seed)
        asyncio.run(stream_all(read_run_info(run_dir).config.gateway.port,
                               [BenchRequest(prompts[0].prompt_ids, 4)], 1))  # warm-up  # fmt: skip
        report["idle_cpu_ms_per_s"] = idle_cpu(run_dir, run.process.pid, args.idle_s)
        print_idle(report["idle_cpu_ms_per_s"], args.idle_s)
        for concurrency in args.concurrency:
            requests = prompts[: max(args.requests, concurrency)]
            result = measure(run_dir, run.process.pid, requests, concurrency, report["idle_cpu_ms_per_s"])
            report["results"].append(result)
            print_table(result)
        if args.profile:
            first = args.concurrency[0]
            profile(run_dir, run.process.pid, prompts[: max(args.requests, first)], first, args.profile)
            print(f"\npy-spy profiles (c={first}) in {args.profile}")
    except BaseException:
        print(f"the run's log is kept: {run.log_path}", file=sys.stderr)
        raise
    finally:
        report["leftovers"] = run.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    run.log_path.unlink()
    if report["leftovers"]:
        print(f"warning: the run left {report['leftovers']} behind (removed)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
