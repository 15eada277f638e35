"""Scheduler benchmarks, both through the scheduler process's own step loop (`StepPipeline`,
which plans step N+1 while step N executes).

Planning: the pure core's cost per step (schedule() + build_plan() + update() + turning the
outputs into the detokenizers' messages and encoding them, as the scheduler process's emit() does)
with a batch of sequences in steady decode and an executor that answers at once with canned
results, so the number is the scheduler's own work per step: what the worker would wait for if
planning did not overlap with execution. Its "schedule" column includes the pipeline's own code.

Worker busy fraction: the real worker (ModelRunner on the embedded SmolLM2-135M, float32 on the
CPU) in its own process, fed through the real step and result rings by the pipeline and the
scheduler core, 64 sequences decoding together: the fraction of the decode phase's wall time that
the worker spends inside execute(), timed by the worker itself. What is missing is the time the
worker waits between steps (its gap: the ring hop, and planning where it does not overlap).

    python benchmarks/scheduler_bench.py --json results/scheduler.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import platform
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

# Run as a script from anywhere: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.codec import DETOKENIZER_INPUT, RESULT_HEADER, STEP_HEADER
from ipc.config import EngineConfig
from ipc.endpoints import Endpoints
from ipc.messages import ResultHeader, SamplingParams
from ipc.sampling_defaults import fill_defaults
from ipc.shm import RingTimeout, ShmRing, new_run_id
from services.gpu_worker.loader import prepare_model
from services.scheduler.__main__ import detokenizer_messages
from services.scheduler.core import Scheduler, SchedulerConfig
from services.scheduler.pipeline import RingExecutor, StepPipeline, StepResult
from services.scheduler.plan import ScheduledStep, write_plan
from services.scheduler.request import Request


def engine_params(**fields) -> SamplingParams:
    """SamplingParams as the tokenizer forwards them: unset sampling fields take the engine's defaults."""
    return fill_defaults(SamplingParams(**fields))


VOCAB_SIZE = 49152
TARGETS = {"plan_us_p50": ("<", 300.0), "worker_busy_fraction": (">=", 0.95)}
WORKER_DTYPE = "float32"  # the CPU's native matmul dtype (4 bytes, as the KV sizing assumes)
BLOCK_SIZE = 16
STEP_SLOT_BYTES = 4 << 20
RESULT_SLOT_BYTES = 1 << 20
STEP_TIMEOUT_S = 120.0


def bench_planning(num_seqs: int, num_steps: int, prompt_len: int, mixed_params: bool) -> dict[str, float]:
    """Per-step planning time in µs over `num_steps` steps of `num_seqs` decoding sequences.

    `mixed_params`: every 8th request uses penalties, logprobs, min_tokens and a logit bias,
    so the ragged history / bias paths are exercised too."""
    block_size = 16
    max_model_len = prompt_len + num_steps + 64
    config = SchedulerConfig(
        EngineConfig(
            max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs), max_num_waiting=num_seqs
        ),
        block_size=block_size,
        num_blocks=num_seqs * (max_model_len // block_size + 2),
        max_model_len=max_model_len,
        eos_token_ids=(2,),
    )
    sched = Scheduler(config)
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        params = engine_params(max_tokens=num_steps + 32, seed=i, ignore_eos=True)
        if mixed_params and i % 8 == 0:
            params = engine_params(
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

    executor = InstantExecutor(block_size, num_seqs)
    pipeline = StepPipeline(sched, executor, on_failed=refused)
    while not executor.is_steady:  # prefill until a step is all decodes
        detokenizer_messages(pipeline.advance(), {}, 1)

    clock = time.perf_counter
    totals = np.empty(num_steps)
    emits = np.empty(num_steps)
    executor.times.clear()
    planned_ahead = pipeline.num_planned_ahead
    for t in range(num_steps):
        t0 = clock()
        outputs = pipeline.advance()
        t1 = clock()
        messages = [DETOKENIZER_INPUT.encode(message) for message in detokenizer_messages(outputs, {}, 1)[0]]
        t2 = clock()
        totals[t], emits[t] = t1 - t0, t2 - t1
        assert len(DETOKENIZER_INPUT.decode(messages[0]).request_ids) == num_seqs
    assert executor.is_steady
    plan_s, update_s = np.array(executor.times).T
    us = 1e6
    total = (totals + emits) * us
    return {
        "num_seqs": num_seqs,
        "planned_ahead_fraction": (pipeline.num_planned_ahead - planned_ahead) / num_steps,
        "p50_us": float(np.percentile(total, 50)),
        "p90_us": float(np.percentile(total, 90)),
        "per_seq_us": float(np.percentile(total, 50)) / num_seqs,
        "schedule_us_p50": float(np.percentile((totals - plan_s - update_s) * us, 50)),
        "build_plan_us_p50": float(np.percentile(plan_s * us, 50)),
        "update_us_p50": float(np.percentile(update_s * us, 50)),
        "emit_us_p50": float(np.percentile(emits * us, 50)),
    }


class PlanSlot(dict):
    """A step slot in plain memory: keeps the plan's arrays (no copy into shared memory)."""

    def put(self, name: str, array: np.ndarray) -> None:
        self[name] = array


class InstantExecutor:
    """A worker that answers every step at once, with random tokens that are never an eos (2), so
    the batch stays in steady decode; times write_plan() and the update() in its result block.
    The canned results are made ahead, outside the timed steps."""

    def __init__(self, block_size: int, num_seqs: int) -> None:
        self.block_size = block_size
        self.num_seqs = num_seqs
        rng = np.random.default_rng(1)
        self.token_pool = itertools.cycle(
            [rng.integers(3, VOCAB_SIZE, num_seqs, dtype=np.int32) for _ in range(64)]
        )
        self.zeros: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.results: deque[StepResult] = deque()
        self.is_steady = False
        self.times: list[tuple[float, float]] = []  # per applied step: plan, update (seconds)
        self._plan_s: deque[float] = deque()

    def publish(self, step_id: int, step: ScheduledStep) -> None:
        t0 = time.perf_counter()
        header = write_plan(step, step_id, self.block_size, PlanSlot())
        self._plan_s.append(time.perf_counter() - t0)
        self.is_steady = step.num_decodes == self.num_seqs
        num, k = header.num_seqs, header.max_top_logprobs
        if (num, k) not in self.zeros:
            self.zeros[num, k] = (
                np.zeros(num, np.float32),
                np.zeros((num, k), np.int32),
                np.zeros((num, k), np.float32),
            )
        logprobs, top_ids, top_logprobs = self.zeros[num, k]
        arrays = {
            "sampled_ids": next(self.token_pool)[:num],
            "sampled_logprobs": logprobs,
            "top_ids": top_ids,
            "top_logprobs": top_logprobs,
        }
        self.results.append((ResultHeader(step_id, num), arrays))

    @contextmanager
    def result(self) -> Iterator[StepResult]:
        t0 = time.perf_counter()
        yield self.results.popleft()
        self.times.append((self._plan_s.popleft(), time.perf_counter() - t0))


def refused(requests: list[Request], error: str) -> None:
    raise RuntimeError(f"the worker refused a step: {error}")


def worker_main(
    model_dir: str, num_kv_blocks: int, step_ring: str, result_ring: str, conn: Connection
) -> None:
    """The worker side, as services/gpu_worker/__main__.py runs it, timing each execute()."""
    from services.gpu_worker.model_runner import ModelRunner  # torch: this process only

    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bytes_per_block = (
        2 * config["num_hidden_layers"] * BLOCK_SIZE * config["num_key_value_heads"] * head_dim * 4
    )
    runner = ModelRunner(
        Path(model_dir), dtype=WORKER_DTYPE, device="cpu", kv_cache_bytes=num_kv_blocks * bytes_per_block
    )
    steps, results = ShmRing.attach(step_ring), ShmRing.attach(result_ring)
    conn.send((runner.max_model_len, runner.eos_token_ids, runner.num_kv_blocks))
    spans: list[tuple[int, float, float]] = []  # step id, execute start, execute end
    clock = time.perf_counter
    try:
        while not conn.poll():  # the scheduler side says when to stop
            try:
                with steps.read(0, 0.2) as view:
                    header = STEP_HEADER.decode(view.header)
                    t0 = clock()
                    arrays = runner.execute(view.arrays, header)
                    t1 = clock()
                    with results.reserve(STEP_TIMEOUT_S) as slot:
                        for name, array in arrays.items():
                            slot.put(name, array)
                        slot.publish(RESULT_HEADER.encode(ResultHeader(header.step_id, header.num_seqs, "")))
                spans.append((header.step_id, t0, t1))
            except RingTimeout:
                continue
        conn.send(spans)
    finally:
        steps.close()
        results.close()


class DecodeRecordingExecutor(RingExecutor):
    """The scheduler's ring executor, noting which steps decode the whole batch."""

    def __init__(self, num_seqs: int, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.num_seqs = num_seqs
        self.decode_step_ids: set[int] = set()

    def publish(self, step_id: int, step: ScheduledStep) -> None:
        super().publish(step_id, step)
        if step.num_decodes == self.num_seqs:
            self.decode_step_ids.add(step_id)


def bench_worker_busy(num_seqs: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    """Drive the real worker process through the real rings with the scheduler core."""
    model_dir = prepare_model(None)
    block_size = BLOCK_SIZE
    blocks_per_seq = -(-(prompt_len + max_tokens) // block_size)
    num_kv_blocks = num_seqs * blocks_per_seq + 16
    endpoints = Endpoints(tempfile.gettempdir(), new_run_id())
    rings = [
        ShmRing.create(endpoints.step_ring(0), 2, STEP_SLOT_BYTES, 1),
        ShmRing.create(endpoints.result_ring(0), 2, RESULT_SLOT_BYTES, 1),
    ]
    step_ring, result_ring = rings
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    worker = ctx.Process(
        target=worker_main,
        args=(str(model_dir), num_kv_blocks, step_ring.name, result_ring.name, child_conn),
        daemon=True,
    )
    worker.start()
    try:
        if not conn.poll(300):
            raise RuntimeError("the worker did not load the model in 300 s")
        max_model_len, eos_token_ids, num_blocks = conn.recv()
        sched = Scheduler(
            SchedulerConfig(
                EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=2048, max_num_waiting=num_seqs),
                block_size=block_size,
                num_blocks=num_blocks,
                max_model_len=min(max_model_len, 2048),
                eos_token_ids=tuple(eos_token_ids),
            )
        )
        rng = np.random.default_rng(0)
        for i in range(num_seqs):
            params = engine_params(max_tokens=max_tokens, seed=i, ignore_eos=True)
            sched.add(Request(f"req-{i}", 0, rng.integers(3, VOCAB_SIZE, prompt_len, dtype=np.int32), params))
        executor = DecodeRecordingExecutor(
            num_seqs, step_ring, result_ring, block_size, STEP_TIMEOUT_S, worker.is_alive
        )
        pipeline = StepPipeline(sched, executor, on_failed=refused)
        num_tokens = 0
        while pipeline.has_work:
            outputs = pipeline.advance()
            if outputs is not None:
                num_tokens += len(outputs)
        conn.send("stop")
        if not conn.poll(60):
            raise RuntimeError("the worker did not report its timings")
        spans = [span for span in conn.recv() if span[0] in executor.decode_step_ids]
    finally:
        if worker.is_alive():
            conn.send("stop")
            worker.join(10)
        if worker.is_alive():
            worker.kill()
            worker.join(10)
        conn.close()
        for ring in rings:
            ring.close()
            ring.unlink()
    busy = sum(t1 - t0 for _, t0, t1 in spans)
    wall = spans[-1][2] - spans[0][1]
    # The worker's wait from the end of one decode step to the start of the next.
    gaps = [b[1] - a[2] for a, b in itertools.pairwise(spans) if b[0] == a[0] + 1]
    return {
        "num_seqs": num_seqs,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "dtype": WORKER_DTYPE,
        "num_tokens": num_tokens,
        "num_decode_steps": len(spans),
        "decode_step_ms_p50": float(np.median([t1 - t0 for _, t0, t1 in spans]) * 1e3),
        "worker_gap_us_p50": float(np.median(gaps) * 1e6),
        "num_planned_ahead": pipeline.num_planned_ahead,
        "worker_busy_fraction": busy / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--skip-worker", action="store_true", help="only the pure-core planning numbers")
    parser.add_argument("--worker-seqs", type=int, default=64)
    parser.add_argument("--worker-prompt-len", type=int, default=128)
    parser.add_argument("--worker-new-tokens", type=int, default=128)
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
        f"{'schedule':>10}{'plan':>8}{'update':>8}{'emit':>8}{'ahead':>7}"
    )
    for name, r in (("default", plain), ("mixed (1/8)", mixed)):
        print(
            f"{name:<14}{r['p50_us']:>9.1f}{r['p90_us']:>9.1f}{r['per_seq_us']:>8.2f}"
            f"{r['schedule_us_p50']:>10.1f}{r['build_plan_us_p50']:>8.1f}{r['update_us_p50']:>8.1f}"
            f"{r['emit_us_p50']:>8.1f}{r['planned_ahead_fraction']:>7.2f}"
        )

    # -- the real worker through the real rings --------------------------------------------------
    if not args.skip_worker:
        busy = bench_worker_busy(args.worker_seqs, args.worker_prompt_len, args.worker_new_tokens)
        results["worker_busy_fraction"] = busy["worker_busy_fraction"]
        results["worker"] = busy
        print(
            f"\nworker ({busy['dtype']}, CPU): {busy['num_seqs']} seqs, prompt {busy['prompt_len']}, "
            f"{busy['max_tokens']} new tokens: decode step p50 {busy['decode_step_ms_p50']:.1f} ms, "
            f"worker gap p50 {busy['worker_gap_us_p50']:.0f} µs, busy {busy['worker_busy_fraction']:.4f}"
        )

    print(f"\n{'metric':<24}{'value':>12}{'target':>12}  met")
    for key, (op, target) in TARGETS.items():
        if key in results:
            value = float(results[key])  # type: ignore[arg-type]
            met = value < target if op == "<" else value >= target
            print(f"{key:<24}{value:>12.4g}{op + ' ' + format(target, 'g'):>12}  {'yes' if met else 'NO'}")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
