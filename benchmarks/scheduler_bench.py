"""Scheduler benchmarks.

Planning: the pure core's cost per step (schedule() + build_plan() + update() + the conversion
of the outputs to the detokenizers' TokenUpdate messages, as the scheduler process's emit() does)
with a batch of sequences in steady decode and a fake executor, so the number is the scheduler's
own overhead, the time a worker would wait if planning did not overlap with execution.

    python benchmarks/scheduler_bench.py --json results/scheduler.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

# Run as a script from anywhere: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.messages import SamplingParams
from services.scheduler.__main__ import token_batches
from services.scheduler.core import Scheduler, SchedulerConfig
from services.scheduler.plan import build_plan
from services.scheduler.request import Request

VOCAB_SIZE = 49152


def bench_planning(num_seqs: int, num_steps: int, prompt_len: int, mixed_params: bool) -> dict[str, float]:
    """Per-step planning time in µs over `num_steps` steps of `num_seqs` decoding sequences.

    `mixed_params`: every 8th request uses penalties, logprobs, min_tokens and a logit bias,
    so the ragged history / bias paths are exercised too."""
    block_size = 16
    max_model_len = prompt_len + num_steps + 64
    config = SchedulerConfig(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(8192, num_seqs),
        block_size=block_size,
        num_blocks=num_seqs * (max_model_len // block_size + 2),
        max_model_len=max_model_len,
        max_num_waiting=num_seqs,
        eos_token_ids=(2,),
    )
    sched = Scheduler(config)
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        params = SamplingParams(max_tokens=num_steps + 32, seed=i, ignore_eos=True)
        if mixed_params and i % 8 == 0:
            params = SamplingParams(
                max_tokens=num_steps + 32,
                seed=i,
                repetition_penalty=1.1,
                presence_penalty=0.5,
                logprobs=5,
                min_tokens=4,
                logit_bias={17: 2.0, 23: -1.0},
            )
        prompt = rng.integers(3, VOCAB_SIZE, prompt_len, dtype=np.int32)
        sched.add(Request(f"req-{i}", 0, prompt, params))

    def fake_result(num: int, k: int) -> tuple[np.ndarray, ...]:
        # Never an eos id (2), so the batch stays in steady decode.
        ids = rng.integers(3, VOCAB_SIZE, num, dtype=np.int32)
        return ids, np.zeros(num, np.float32), np.zeros((num, k), np.int32), np.zeros((num, k), np.float32)

    step_id = 0
    is_steady = False
    while not is_steady:  # prefill until a step is all decodes
        step = sched.schedule()
        header, _ = build_plan(step, step_id, block_size)
        token_batches(sched.update(step, *fake_result(header.num_seqs, header.max_top_logprobs)), {}, 1)
        is_steady = step.num_decodes == num_seqs
        step_id += 1

    clock = time.perf_counter
    times = np.empty((num_steps, 4))  # schedule, build_plan, update, conversion to TokenUpdates
    for t in range(num_steps):
        result = fake_result(num_seqs, 5 if mixed_params else 0)
        t0 = clock()
        step = sched.schedule()
        t1 = clock()
        header, _ = build_plan(step, step_id, block_size)
        t2 = clock()
        outputs = sched.update(step, *result)
        t3 = clock()
        batches = token_batches(outputs, {}, 1)
        t4 = clock()
        times[t] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        assert header.num_seqs == num_seqs and header.num_tokens == num_seqs and len(batches[0]) == num_seqs
        step_id += 1
    us = times * 1e6
    total = us.sum(axis=1)
    return {
        "num_seqs": num_seqs,
        "p50_us": float(np.percentile(total, 50)),
        "p90_us": float(np.percentile(total, 90)),
        "per_seq_us": float(np.percentile(total, 50)) / num_seqs,
        "schedule_us_p50": float(np.percentile(us[:, 0], 50)),
        "build_plan_us_p50": float(np.percentile(us[:, 1], 50)),
        "update_us_p50": float(np.percentile(us[:, 2], 50)),
        "emit_us_p50": float(np.percentile(us[:, 3], 50)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()

    results: dict[str, object] = {"machine": platform.processor() or platform.machine()}

    # -- planning (pure core) ---------------------------------------------------------------------
    plain = bench_planning(args.num_seqs, args.num_steps, args.prompt_len, mixed_params=False)
    mixed = bench_planning(args.num_seqs, args.num_steps, args.prompt_len, mixed_params=True)
    results["plan_us_p50"] = plain["p50_us"]
    results["plan_us_p90"] = plain["p90_us"]
    results["planning"] = {"default_params": plain, "mixed_params": mixed}
    print(f"planning: schedule + build_plan + update + emit, {args.num_seqs} seqs in steady decode")
    print(
        f"{'params':<14}{'p50 µs':>9}{'p90 µs':>9}{'µs/seq':>8}"
        f"{'schedule':>10}{'plan':>8}{'update':>8}{'emit':>8}"
    )
    for name, r in (("default", plain), ("mixed (1/8)", mixed)):
        print(
            f"{name:<14}{r['p50_us']:>9.1f}{r['p90_us']:>9.1f}{r['per_seq_us']:>8.2f}"
            f"{r['schedule_us_p50']:>10.1f}{r['build_plan_us_p50']:>8.1f}{r['update_us_p50']:>8.1f}"
            f"{r['emit_us_p50']:>8.1f}"
        )

    # Further sections (e.g. the worker's busy fraction with a real worker) add their keys to
    # `results` here.

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
