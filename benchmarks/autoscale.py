"""Autoscaling benchmark: a burst of requests against a run with a fixed single engine group and
against the same run with `autoscale.enabled` (up to `--max-groups`), started here one after the
other on the local backend.

    python benchmarks/autoscale.py [--config FILE] [--set key=value ...] [--rate 4] [--burst-s 20]
        [--output-len 64] [--max-num-seqs 2] [--max-groups 2] [--json FILE]

The burst is open-loop: `--rate` requests per second for `--burst-s` seconds, each a greedy stream
of `--output-len` tokens. Reported per run: TTFT (mean, p50, p90, p99) of the burst's requests,
and with autoscaling the time from the burst's first request to the second group being up
(`scheduler-1` ready in status.json) and to it serving (its first request scheduled:
`brigade:request_queue_time_seconds_count{engine="1"}`). Each request's text is compared between
the two runs (greedy: they must be equal). A printed table, and the whole report as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.peers import free_port  # noqa: E402
from benchmarks.serve import READY_TIMEOUT_S, REQUEST_TIMEOUT_S, BrigadeProcess, summarize_ms  # noqa: E402
from client import Client  # noqa: E402
from services.stage_rows import read_status  # noqa: E402

POLL_S = 0.1
# Tight enough to act within a short burst; the defaults (30 s, 60 s, 120 s) suit production.
AUTOSCALE = ("autoscale.enabled=true", "autoscale.target_waiting=2", "autoscale.scale_up_cooldown_s=5",
             "autoscale.scale_down_window_s=10", "autoscale.scale_down_cooldown_s=30")  # fmt: skip


class Burst:
    """Open-loop greedy streams, one thread each: (seconds from the burst's start to the first
    token, text) per request, or the error it ended in."""

    def __init__(self, run_dir: Path, args: argparse.Namespace) -> None:
        self.run_dir = run_dir
        self.args = args
        self.ttft_s: dict[int, float] = {}
        self.texts: dict[int, str] = {}
        self.errors: dict[int, str] = {}

    def one(self, i: int) -> None:
        sent = time.monotonic()
        try:
            with Client(self.run_dir, unavailable_after=REQUEST_TIMEOUT_S) as client:
                text = []
                for delta in client.stream(
                    f"Request {i}: write a short story about a lighthouse keeper",
                    max_tokens=self.args.output_len, temperature=0.0, ignore_eos=True, timeout=REQUEST_TIMEOUT_S,
                ):  # fmt: skip
                    if i not in self.ttft_s:
                        self.ttft_s[i] = time.monotonic() - sent
                    text.append(delta.text)
                self.texts[i] = "".join(text)
        except Exception as exc:  # a benchmark reports failures, it does not stop on them
            self.errors[i] = f"{type(exc).__name__}: {exc}"

    def run(self) -> float:
        """Send the burst and wait for every request; returns when it started (monotonic)."""
        start = time.monotonic()
        threads = []
        for i in range(round(self.args.rate * self.args.burst_s)):
            time.sleep(max(0.0, start + i / self.args.rate - time.monotonic()))
            threads.append(threading.Thread(target=self.one, args=(i,), daemon=True))
            threads[-1].start()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S)
        return start


def queue_time_count(port: int, engine: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "brigade:request_queue_time_seconds_count" and sample.labels.get("engine") == engine
    )


class GroupWatch:
    """When the second engine group came up and when it first scheduled a request (monotonic)."""

    def __init__(self, run_dir: Path, metrics_port: int) -> None:
        self.run_dir = run_dir
        self.metrics_port = metrics_port
        self.ready_at: float | None = None
        self.serving_at: float | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self) -> None:
        while not self.stop.wait(POLL_S) and self.serving_at is None:
            try:
                if self.ready_at is None and any(
                    row.name == "scheduler-1" and row.state == "running" for row in read_status(self.run_dir)
                ):
                    self.ready_at = time.monotonic()
                if self.ready_at is not None and queue_time_count(self.metrics_port, "1") > 0:
                    self.serving_at = time.monotonic()
            except (OSError, ValueError):
                continue  # status.json being replaced, /metrics not up yet

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def run_once(args: argparse.Namespace, autoscale: bool, log_dir: Path) -> tuple[dict, dict[int, str]]:
    """One run (fixed or autoscaled) through the burst: its report, and each request's text."""
    run_dir = Path(tempfile.mkdtemp(prefix="brigade-autoscale-"))
    metrics_port = free_port()
    overrides = [
        f"gateway.port={free_port()}", f"supervisor.metrics_port={metrics_port}", "engine.threads=1",
        f"engine.max_num_seqs={args.max_num_seqs}", "supervisor.heartbeat_interval_s=0.2", *args.set,
    ]  # fmt: skip
    if autoscale:
        overrides += [*AUTOSCALE, f"autoscale.max_groups={args.max_groups}"]
    name = "autoscale" if autoscale else "fixed"
    run = BrigadeProcess(run_dir, args.config, overrides, log_dir / f"brigade-{name}.log")
    try:
        run.wait_ready(READY_TIMEOUT_S)
        watch = GroupWatch(run_dir, metrics_port)
        burst = Burst(run_dir, args)
        start = burst.run()
        watch.close()
    finally:
        leftovers = run.stop()
        shutil.rmtree(run_dir, ignore_errors=True)

    def since_start(at: float | None) -> float | None:
        return None if at is None else round(at - start, 2)

    report = {
        "requests": len(burst.ttft_s) + len(burst.errors),
        "failed": len(burst.errors),
        "errors": sorted(set(burst.errors.values()))[:5],
        "ttft_ms": summarize_ms(list(burst.ttft_s.values())),
        "burst_to_group_ready_s": since_start(watch.ready_at),
        "burst_to_group_serving_s": since_start(watch.serving_at),
        "leftovers": leftovers,
    }
    return report, burst.texts


def print_table(report: dict) -> None:
    header = f"{'run':<10}{'requests':>9}{'failed':>7}{'TTFT p50':>10}{'TTFT p90':>10}{'TTFT p99':>10}{'group up':>10}{'serving':>9}"
    print(header)
    print("-" * len(header))
    for name in ("fixed", "autoscale"):
        r = report[name]
        ttft = r["ttft_ms"]

        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}s"

        print(
            f"{name:<10}{r['requests']:>9}{r['failed']:>7}{ttft['p50']:>8.0f}ms{ttft['p90']:>8.0f}ms"
            f"{ttft['p99']:>8.0f}ms{seconds(r['burst_to_group_ready_s']):>10}{seconds(r['burst_to_group_serving_s']):>9}"
        )
    print(f"texts equal between the runs: {report['texts_equal']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second during the burst")
    parser.add_argument("--burst-s", type=float, default=20.0, help="how long the burst lasts")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--max-num-seqs", type=int, default=2, help="engine.max_num_seqs: small, so a burst queues"
    )
    parser.add_argument("--max-groups", type=int, default=2, help="autoscale.max_groups")
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.burst_s <= 0 or args.output_len < 1 or args.max_groups < 2:
        parser.error("--rate and --burst-s must be > 0, --output-len >= 1 and --max-groups >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="brigade-autoscale-logs-"))
    fixed, fixed_texts = run_once(args, autoscale=False, log_dir=log_dir)
    scaled, scaled_texts = run_once(args, autoscale=True, log_dir=log_dir)
    both = sorted(set(fixed_texts) & set(scaled_texts))
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "fixed": fixed,
        "autoscale": scaled,
        "texts_equal": all(fixed_texts[i] == scaled_texts[i] for i in both)
        and len(both) == fixed["requests"],
        "logs": str(log_dir),
    }
    print_table(report)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0 if report["texts_equal"] and not fixed["failed"] and not scaled["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
