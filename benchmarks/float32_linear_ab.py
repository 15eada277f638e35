"""Same-run A/B of what multiplies a float32 CPU step of more than cpu_ops.MAX_LINEAR_ROWS rows.

    python benchmarks/float32_linear_ab.py [--model smollm2|1b] [--reps 5]

`one-copy` is what the worker does for a float32 checkpoint: oneDNN on the plain [out, in]
weights, which the few-rows kernel also reads. `prepacked` adds a second float32 copy of every
weight in oneDNN's blocked layout (what the worker held before issue 17's one-copy change);
`F.linear` is torch's MKL sgemm on the plain weights. One model, loaded once, one thread; the
variants alternate within each rep so that the machine's load moves them alike, and the printed
figure is the median process CPU ms of a step. `smollm2` is the embedded model as a float32
checkpoint (its GGUF blocks not used); `1b` is load_bench.py's random Llama-1B-shaped checkpoint
(write it first with `load_bench.py load-1b`). Each variant's greedy tokens must be equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.worker_profile import Blocks, decode_plan, prefill_plan
from services.gpu_worker import model as model_module
from services.gpu_worker.loader import prepare_model
from services.gpu_worker.model_runner import ModelRunner

VARIANTS = ("one-copy", "prepacked", "F.linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["smollm2", "1b"], default="smollm2")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/brigade-llama-1b-random"), help="--model 1b")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.model == "smollm2":
        model_module.LlamaModel.takes_quantized = property(lambda self: False)  # a float32 checkpoint
        model_dir = prepare_model(None)
    else:
        model_dir = args.dir
    runner = ModelRunner(model_dir, dtype="float32", kv_cache_bytes=1 << 30, threads=1)
    model = runner.model
    if model.lm_head_onednn is None:
        raise SystemExit("torch without oneDNN: nothing to compare")
    one_copy = [layer.onednn for layer in model.layers], model.lm_head_onednn
    prepacked = [tuple(map(model_module.prepack, layer.plain)) for layer in model.layers]
    prepacked_head = model_module.prepack(model.lm_head)
    shipped_layout = model._layout

    def use(variant: str) -> None:
        weights, head = (prepacked, prepacked_head) if variant == "prepacked" else one_copy
        for layer, w in zip(model.layers, weights, strict=True):
            layer.onednn = w
        model.lm_head_onednn = head
        wide = "plain" if variant == "F.linear" else "onednn"
        model._layout = lambda n: "few_rows" if shipped_layout(n) == "few_rows" else wide

    rng, blocks = np.random.default_rng(0), Blocks()
    plans = {
        "decode1": decode_plan(blocks, 1, 128, rng),
        "decode16": decode_plan(blocks, 16, 128, rng),
        "decode64": decode_plan(blocks, 64, 128, rng),
        "prefill128": prefill_plan(blocks, 1, 128, rng),
    }
    for name, plan in plans.items():
        tokens = set()
        for variant in VARIANTS:
            use(variant)
            tokens.add(tuple(runner.execute(*plan)["sampled_ids"].tolist()))  # also the warm-up
        assert len(tokens) == 1, f"{name}: the variants sample different tokens"
        cpu_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.reps):
            for variant in VARIANTS:
                use(variant)
                start = time.process_time()
                runner.execute(*plan)
                cpu_ms[variant].append((time.process_time() - start) * 1e3)
        median = {v: statistics.median(ms) for v, ms in cpu_ms.items()}
        ratios = ", ".join(
            f"{v} / prepacked {median[v] / median['prepacked']:.2f}" for v in ("one-copy", "F.linear")
        )
        print(
            f"{args.model} {name}: "
            + ", ".join(f"{v} {m:.1f} ms" for v, m in median.items())
            + f"; {ratios}",
            flush=True,
        )
    use("one-copy")


if __name__ == "__main__":
    main()
