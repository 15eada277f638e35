"""Per-step time and op profile of the worker's ModelRunner on the embedded SmolLM2-135M.

    python benchmarks/worker_profile.py --json FILE [--dtype float32] [--reps 5] [--top 12]

Three steps, each run as a real plan through `ModelRunner.execute`:
  decode1   batch-1 decode at context 256
  decode64  batch-64 decode at context 128
  mixed     8 prefills of 128 tokens plus 8 decodes at context 256
The KV cache is not prefilled (timing does not depend on its values), so the script starts in
seconds. It prints wall and process-CPU ms per step (median of --reps) and the top ops by self CPU time
(torch.profiler), and writes both as JSON. On a shared machine use --threads 1 and compare CPU ms.
With --int8-ab it runs only decode steps of 1, 4, 16 and 32 rows (context 256) and prefills of 32
and 42 tokens with engine.cpu_int8_activations off and on, alternating in one process, and prints
both and on / off; then the model's own GGUF-block GEMVs alone, off and on.
With --wide-ab it runs decode steps of 16 and 64 rows and a 512-token prefill on two runners, one
with float32 wide steps and one with engine.cpu_wide_step_dtype=bfloat16, alternating in one
process, and prints both and bf16 / float32; first the layer GEMMs alone, both ways, at 16, 64 and
512 rows.
With --kv-ab it runs decode steps at long contexts (1, 16 and 64 rows) and a 512-token prefill on
two runners, one with a float32 KV cache and one with engine.kv_cache_dtype=bfloat16, alternating
in one process, and prints both, bf16 / float32, and the bytes of KV each step's attention reads.
With --lora-ab it runs decode steps of 1 and 4 rows and a 42-token prefill on one runner with
lora.max_loras 8 (as lora_bench's run) and a random rank-16 adapter on every projection
(lora_bench's) in slot 0, each step with every row on the adapter and with none, alternating, and
prints both and adapter / none: the whole worker step, the adapter's Python bookkeeping included.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lora_bench import NUM_ADAPTERS as LORA_SLOTS
from benchmarks.lora_bench import RANK as LORA_RANK
from benchmarks.lora_bench import write_adapters
from benchmarks.model_bench import static_plan
from ipc.messages import StepHeader
from kernels import cpu_ops
from services.gpu_worker.loader import prepare_model
from services.gpu_worker.model import MixedQuantizedWeight, QuantizedWeight, onednn_linear
from services.gpu_worker.model_runner import ModelRunner

BLOCK_SIZE = 16
Plan = tuple[dict[str, np.ndarray], StepHeader]
Plans = dict[str, Plan]  # a step plan of each scenario's name


def concat_plans(
    parts: list[Plan],
) -> Plan:
    """One plan of several static plans' sequences, in order (their block tables padded to one width)."""
    if len(parts) == 1:
        return parts[0]
    width = max(a["block_tables"].shape[1] for a, _ in parts)
    arrays: dict[str, np.ndarray] = {}
    for name in parts[0][0]:
        values = [a[name] for a, _ in parts]
        if name == "block_tables":
            values = [np.pad(v, ((0, 0), (0, width - v.shape[1]))) for v in values]
        if name in ("query_start_loc", "history_offsets", "bias_offsets"):
            shifted, total = [values[0][:1]], 0
            for v in values:
                shifted.append(v[1:] + total)
                total += int(v[-1])
            values = shifted
        arrays[name] = np.concatenate(values)
    num_tokens = sum(h.num_tokens for _, h in parts)
    num_seqs = sum(h.num_seqs for _, h in parts)
    return arrays, StepHeader(step_id=0, num_tokens=num_tokens, num_seqs=num_seqs, max_top_logprobs=0)


class Blocks:
    """Hands out disjoint block tables, as the scheduler would."""

    def __init__(self) -> None:
        self.next = 0

    def table(self, batch: int, context: int) -> np.ndarray:
        n = -(-context // BLOCK_SIZE)
        table = self.next + np.arange(batch * n, dtype=np.int32).reshape(batch, n)
        self.next += batch * n
        return table


def decode_plan(blocks: Blocks, batch: int, context: int, rng: np.random.Generator):
    """batch sequences with context - 1 tokens cached, running their next token."""
    tokens = rng.integers(3, 40000, (batch, 1))
    positions = np.full((batch, 1), context - 1)
    return static_plan(tokens, positions, np.full(batch, context), blocks.table(batch, context), BLOCK_SIZE)


def prefill_plan(blocks: Blocks, batch: int, length: int, rng: np.random.Generator):
    tokens = rng.integers(3, 40000, (batch, length))
    positions = np.tile(np.arange(length), (batch, 1))
    return static_plan(tokens, positions, np.full(batch, length), blocks.table(batch, length), BLOCK_SIZE)


# Each mode's steps: a name and its sequences, ("decode", sequences, context) running their next
# token or ("prefill", sequences, prompt length), several parts making one mixed step.
Part = tuple[str, int, int]
MODE_STEPS: dict[str, dict[str, list[Part]]] = {
    "profile": {
        "decode1": [("decode", 1, 256)],
        "decode64": [("decode", 64, 128)],
        "mixed": [("prefill", 8, 128), ("decode", 8, 256)],
    },
    "int8_ab": {
        "decode1": [("decode", 1, 256)],
        "decode4": [("decode", 4, 256)],
        "decode16": [("decode", 16, 256)],
        "decode32": [("decode", 32, 256)],
        "prefill32": [("prefill", 1, 32)],
        # Past INT8_BLOCKS_MAX_ROWS: the option reaches only the one-row LM head here.
        "prefill42": [("prefill", 1, 42)],
    },
    "wide_ab": {
        "decode16": [("decode", 16, 256)],
        "decode64": [("decode", 64, 128)],
        "prefill512": [("prefill", 1, 512)],
    },
    "kv_ab": {
        "decode1@2048": [("decode", 1, 2048)],
        "decode16@1024": [("decode", 16, 1024)],
        "decode64@128": [("decode", 64, 128)],
        "decode64@512": [("decode", 64, 512)],
        "prefill512": [("prefill", 1, 512)],
    },
    "lora_ab": {
        "decode1": [("decode", 1, 256)],
        "decode4": [("decode", 4, 256)],
        "prefill42": [("prefill", 1, 42)],
    },
}


def mode_plans(mode: str) -> Plans:
    """MODE_STEPS[mode] as plans, on disjoint blocks, with the mode's own random tokens."""
    rng, blocks = np.random.default_rng(list(MODE_STEPS).index(mode)), Blocks()
    make = {"decode": decode_plan, "prefill": prefill_plan}
    return {
        name: concat_plans([make[kind](blocks, sequences, length, rng) for kind, sequences, length in parts])
        for name, parts in MODE_STEPS[mode].items()
    }


def time_step(runner: ModelRunner, plan: Plan, reps: int) -> tuple[list[float], list[float]]:
    """Wall and process CPU ms of each rep. With one thread the CPU time hardly moves with the
    machine's load (the wall time does), so it is the figure to compare on a shared host."""
    runner.execute(*plan)  # warm-up
    wall, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        runner.execute(*plan)
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return wall, cpu


def int8_ab(runner: ModelRunner, plans: Plans, reps: int) -> dict:
    """Each plan with engine.cpu_int8_activations off and on, in one process on the same weights
    (the model reads the flag per step), alternating."""

    def with_int8(int8: bool) -> Callable[[str], None]:
        def run(name: str) -> None:
            runner.model.int8_activations = int8
            runner.execute(*plans[name])

        return run

    try:
        return alternating_ab({"off": with_int8(False), "on": with_int8(True)}, plans, reps)
    finally:
        runner.model.int8_activations = False


def executing(runner: ModelRunner, plans: Plans) -> Callable[[str], None]:
    """A side of alternating_ab: `runner` running its own plan of each name."""
    return lambda name: runner.execute(*plans[name])


def on_adapter(plan: Plan, name: str, num_slots: int) -> Plan:
    """`plan` with every row on adapter `name`, held in slot 0 of `num_slots`."""
    arrays, header = plan
    arrays = {**arrays, "lora_slots": np.zeros(header.num_seqs, dtype=np.int32)}
    return arrays, msgspec.structs.replace(header, lora_slots=[name] + [""] * (num_slots - 1))


def kv_bytes_read(runner: ModelRunner, plan: Plan) -> int:
    """Bytes of keys and values a step's attention reads: each sequence's whole context, once a layer."""
    k_cache = runner.kv_cache[0][0]
    per_token = 2 * len(runner.kv_cache) * k_cache[0, 0].numel() * k_cache.element_size()
    return int(plan[0]["seq_lens"].sum()) * per_token


def alternating_ab(sides: dict[str, Callable[[str], None]], plans: Plans, reps: int) -> dict:
    """Each plan run by each of two sides (a side runs the step of a plan's name its own way: on
    its own runner, with its own version of the plan, with an option set), alternating ABBA rep by
    rep so that load on a shared host hits both sides alike; wall and process CPU ms, median and
    min, and the second side over the first."""
    result = {}
    names = list(sides)
    for name, plan in plans.items():
        wall: dict[str, list[float]] = {side: [] for side in names}
        cpu: dict[str, list[float]] = {side: [] for side in names}
        for run in sides.values():  # warm-up
            run(name)
        for rep in range(reps):
            for side in names if rep % 2 == 0 else names[::-1]:
                start, start_cpu = time.perf_counter(), time.process_time()
                sides[side](name)
                wall[side].append((time.perf_counter() - start) * 1e3)
                cpu[side].append((time.process_time() - start_cpu) * 1e3)
        entry: dict = {
            side: {
                "ms_p50": statistics.median(wall[side]),
                "ms_min": min(wall[side]),
                "cpu_ms_p50": statistics.median(cpu[side]),
                "cpu_ms_min": min(cpu[side]),
            }
            for side in names
        }
        a, b = names
        for stat in ("ms_p50", "ms_min", "cpu_ms_p50", "cpu_ms_min"):
            entry[f"{b}_over_{a}_{stat}"] = entry[b][stat] / entry[a][stat]
        print(
            f"{name} ({plan[1].num_tokens} rows) {a} / {b}: "
            f"{entry[a]['ms_p50']:.1f} / {entry[b]['ms_p50']:.1f} ms wall p50, "
            f"{entry[a]['cpu_ms_p50']:.1f} / {entry[b]['cpu_ms_p50']:.1f} ms CPU p50, "
            f"{entry[a]['cpu_ms_min']:.1f} / {entry[b]['cpu_ms_min']:.1f} ms CPU min "
            f"({b}/{a}: {entry[f'{b}_over_{a}_ms_p50']:.2f} wall, {entry[f'{b}_over_{a}_cpu_ms_p50']:.2f} CPU; "
            f"{reps} reps)",
            flush=True,
        )
        result[name] = entry
    return result


def wide_gemm_ab(runners: dict[str, ModelRunner], reps: int) -> dict:
    """The four layer GEMMs alone (the first layer's oneDNN copies of each runner: float32 and
    bf16, activations converted per call as the model does) at 16, 64 and 512 rows, alternating:
    process CPU ms per call (min of reps) and GFLOP/s."""
    result = {}
    weights = {side: runner.model.layers[0].onednn for side, runner in runners.items()}
    shapes = [(w.shape[0], w.shape[1]) for w in weights["float32"]]
    flops_per_row = 2 * sum(n * k for n, k in shapes)
    for rows in (16, 64, 512):
        inputs = [torch.randn(rows, k) for _, k in shapes]
        calls = max(1, 1024 // rows)
        cpu: dict[str, list[float]] = {side: [] for side in runners}
        for rep in range(reps + 1):  # the first round warms up
            for side in list(runners) if rep % 2 == 0 else list(runners)[::-1]:
                start = time.process_time()
                for _ in range(calls):
                    for x, w in zip(inputs, weights[side], strict=True):
                        onednn_linear(x, w)
                if rep:
                    cpu[side].append((time.process_time() - start) / calls * 1e3)
        entry = {
            side: {"cpu_ms_min": min(v), "gflop_s": flops_per_row * rows / min(v) / 1e6}
            for side, v in cpu.items()
        }
        print(
            f"layer GEMMs alone, {rows} rows: "
            + ", ".join(f"{side} {e['gflop_s']:.1f} GFLOP/s" for side, e in entry.items())
            + f" (bf16 / float32 rate {entry['bfloat16']['gflop_s'] / entry['float32']['gflop_s']:.2f}x; "
            f"CPU time, min of {reps})",
            flush=True,
        )
        result[f"{rows} rows"] = entry
    return result


def in_features(weight: QuantizedWeight) -> int:
    per_block = cpu_ops.SUPER_BLOCK_WEIGHTS if weight.format in cpu_ops.K_QUANTS else cpu_ops.BLOCK_WEIGHTS
    return weight.blocks.shape[1] // cpu_ops.PACKED_BLOCK_BYTES[weight.format] * per_block


def int8_gemv_ab(runner: ModelRunner, reps: int) -> dict:
    """The model's own GGUF-block GEMVs alone (the 30 layers' four, then the LM head) with float32
    and with 8-bit activations, alternating, at 1 and 4 rows: thread CPU ms, min and median."""
    model, result = runner.model, {}
    # A fused weight of several formats is its parts, each multiplied on its own.
    quantized = [q for layer in model.layers for q in layer.quantized if q is not None]
    weights = [p for q in quantized for p in (q.parts if isinstance(q, MixedQuantizedWeight) else (q,))]
    head = model.lm_head_quantized
    assert isinstance(head, QuantizedWeight)  # one tensor, so one format
    sides = {"off": False, "on": True}
    for rows in (1, cpu_ops.MAX_LINEAR_ROWS):
        inputs = {in_features(q): torch.randn(rows, in_features(q)) for q in weights}
        head_x = torch.randn(rows, in_features(head))
        samples: dict[str, dict[str, list[float]]] = {side: {"layers": [], "lm_head": []} for side in sides}
        for _ in range(reps):
            for side, int8 in sides.items():
                start = time.thread_time()
                for q in weights:
                    q.multiply(inputs[in_features(q)], int8)
                middle = time.thread_time()
                head.multiply(head_x, int8)
                samples[side]["layers"].append((middle - start) * 1e3)
                samples[side]["lm_head"].append((time.thread_time() - middle) * 1e3)
        entry = {
            side: {part: {"min": min(v), "median": statistics.median(v)} for part, v in parts.items()}
            for side, parts in samples.items()
        }
        print(
            f"{rows} rows, GEMVs alone, int8 activations off / on (thread CPU ms, min): layers "
            f"{entry['off']['layers']['min']:.2f} / {entry['on']['layers']['min']:.2f}, LM head "
            f"{entry['off']['lm_head']['min']:.2f} / {entry['on']['lm_head']['min']:.2f}"
        )
        result[f"{rows} rows"] = entry
    return result


def top_ops(runner: ModelRunner, plan: Plan, top: int) -> list[dict]:
    """Ops by self CPU time over one step (ms per step and share of the step)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.execute(*plan)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_ms": e.self_cpu_time_total / 1e3,
            "share": e.self_cpu_time_total / total,
        }
        for e in events[:top]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-profile", action="store_true", help="timings only")
    parser.add_argument(
        "--int8-ab",
        action="store_true",
        help="only decode1 / 4 / 16 / 32, prefill32 and prefill42 with 8-bit activations off vs on, alternating",
    )
    parser.add_argument(
        "--wide-ab",
        action="store_true",
        help="only decode16 / 64 and prefill512 with float32 vs bfloat16 wide steps, alternating",
    )
    parser.add_argument(
        "--lora-ab",
        action="store_true",
        help="only decode1 / 4 and prefill42 with a rank-16 adapter on every projection vs none, alternating",
    )
    parser.add_argument(
        "--kv-ab",
        action="store_true",
        help="only long-context decodes and prefill512 with a float32 vs a bfloat16 KV cache, alternating",
    )
    args = parser.parse_args()
    modes = [mode for mode in MODE_STEPS if getattr(args, mode, False)]
    if len(modes) > 1:
        parser.error("one of --int8-ab, --wide-ab, --kv-ab and --lora-ab at a time")
    plans = mode_plans(modes[0] if modes else "profile")
    num_blocks = max(int(a["block_tables"].max()) for a, _ in plans.values()) + 1
    model_dir = prepare_model(None)
    config = json.loads((model_dir / "config.json").read_text())
    itemsize = getattr(torch, args.dtype).itemsize
    kv_bytes = num_blocks * 2 * config["num_hidden_layers"] * BLOCK_SIZE * config["num_key_value_heads"]
    kv_bytes *= config["head_dim"] * itemsize
    lora: dict = {}
    if args.lora_ab:
        adapter_dir = Path(tempfile.mkdtemp(prefix="brigade-lora-ab-"))
        atexit.register(shutil.rmtree, adapter_dir, ignore_errors=True)
        adapters = write_adapters(model_dir, adapter_dir, 1, LORA_RANK)
        # As many slots as lora_bench's run has (their size decides whether they lie in huge pages).
        lora = {
            "max_loras": LORA_SLOTS,
            "max_lora_rank": LORA_RANK,
            "lora_adapters": {n: str(p) for n, p in adapters.items()},
        }
    runner = ModelRunner(model_dir, dtype=args.dtype, kv_cache_bytes=kv_bytes, threads=args.threads, **lora)
    result: dict = {"dtype": args.dtype, "threads": torch.get_num_threads(), "steps": {}}
    if args.wide_ab:
        bf16 = ModelRunner(
            model_dir,
            dtype=args.dtype,
            kv_cache_bytes=kv_bytes,
            threads=args.threads,
            wide_step_dtype="bfloat16",
        )
        if bf16.model.wide_step_dtype != torch.bfloat16:
            sys.exit("bf16 wide steps are not available here (see the warning above)")
        result["wide_gemm_ab"] = wide_gemm_ab({"float32": runner, "bfloat16": bf16}, args.reps)
        result["wide_ab"] = alternating_ab(
            {"float32": executing(runner, plans), "bfloat16": executing(bf16, plans)}, plans, args.reps
        )
        plans = {}
    if args.kv_ab:
        runners = {
            "float32": runner,
            "bfloat16": ModelRunner(
                model_dir,
                dtype=args.dtype,
                kv_cache_bytes=kv_bytes,
                threads=args.threads,
                kv_cache_dtype="bfloat16",
            ),
        }
        result["kv_ab"] = alternating_ab(
            {side: executing(r, plans) for side, r in runners.items()}, plans, args.reps
        )
        print(
            f"\n{'step':<14} {'KV read f32':>12} {'KV read bf16':>13} {'bf16/f32 wall':>14} {'bf16/f32 CPU':>13}"
        )
        for name, plan in plans.items():
            entry = result["kv_ab"][name]
            entry["kv_bytes_read"] = {side: kv_bytes_read(r, plan) for side, r in runners.items()}
            print(
                f"{name:<14} {entry['kv_bytes_read']['float32'] / 2**20:>9.1f} MB "
                f"{entry['kv_bytes_read']['bfloat16'] / 2**20:>10.1f} MB "
                f"{entry['bfloat16_over_float32_ms_p50']:>14.2f} {entry['bfloat16_over_float32_cpu_ms_p50']:>13.2f}"
            )
        plans = {}
    if args.lora_ab:
        (name,) = lora["lora_adapters"]
        adapted = {step: on_adapter(plan, name, LORA_SLOTS) for step, plan in plans.items()}
        result["lora_ab"] = alternating_ab(
            {"none": executing(runner, plans), "adapter": executing(runner, adapted)}, plans, args.reps
        )
        plans = {}
    if args.int8_ab:
        result["int8_ab"] = int8_ab(runner, plans, args.reps)
        plans = {}
        result["int8_gemv_ab"] = int8_gemv_ab(runner, args.reps)
    for name, plan in plans.items():
        wall, cpu = time_step(runner, plan, args.reps)
        entry = {
            "tokens": plan[1].num_tokens,
            "ms_p50": statistics.median(wall),
            "cpu_ms_p50": statistics.median(cpu),
            "ms": wall,
            "cpu_ms": cpu,
        }
        print(
            f"\n{name}: {plan[1].num_tokens} tokens, {entry['ms_p50']:.1f} ms/step wall, "
            f"{entry['cpu_ms_p50']:.1f} ms CPU (p50 of {args.reps})"
        )
        if not args.no_profile:
            entry["top_ops"] = top_ops(runner, plan, args.top)
            for op in entry["top_ops"]:
                print(
                    f"  {op['op'][:44]:<44} {op['calls']:>6} calls {op['self_ms']:>8.2f} ms {op['share']:>6.1%}"
                )
        result["steps"][name] = entry
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
