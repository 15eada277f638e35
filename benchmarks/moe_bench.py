"""A mixture-of-experts MLP stack against a dense MLP stack with the same active parameters, as
Brigade's worker runs them (services/gpu_worker/model.py: `moe_mlp` for the sparse layers, the
dense layers' gate_up / down through the few-rows C++ linear where it is built, else F.linear).

    python benchmarks/moe_bench.py --json FILE [--experts 64] [--top-k 4] [--hidden 512]
        [--expert-intermediate 256] [--layers 4] [--batch 1,16] [--repeats 15] [--threads N]
        [--quantized Q8_0,Q4_1 [--quantized-batch 1,8,64]]

The dense stack's intermediate size is top_k x the experts' (the same multiply-adds per token
as the selected experts). Each repeat times one step of `batch` rows through every layer of the
MoE stack and then of the dense stack (alternating, so a load spike on this shared machine hits
both); the report gives the median step time of each and their ratio. The weight bytes a step
reads are counted from the weights each F.linear / few-rows call of one step actually multiplies
(a wrapper counts them, outside the timed repeats): against the floor, the router plus each
distinct selected expert once, and against reading every (token, expert) pair's expert.

With --quantized, one sparse layer of the shape with its experts as GGUF blocks of each format
(gguf's quantizer), as a GGUF model's layer keeps them, against the same layer with the experts'
float32 dequantization (what the worker held before): `moe_mlp` timed on both at each
--quantized-batch rows (the blocks through cpu_ops.moe_experts_quantized up to
cpu_ops.MOE_MAX_ROWS rows, each selected expert dequantized for the GEMM above), and the expert
bytes each holds. A table on stdout, and "quantized" in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_ops
from services.gpu_worker import model as model_module
from services.gpu_worker.architectures import ModelConfig, MoeConfig
from services.gpu_worker.model import LlamaLayer, QuantizedExperts, Shard, moe_mlp
from services.gpu_worker.parallel import Parallel

MIN_SAMPLE_S = 2e-3  # each timed sample repeats a step until it lasts this long (timer resolution)


def make_layers(config: ModelConfig, sparse: bool, seed: int) -> list[LlamaLayer]:
    """Random float32 layers of `config` (only their MLP weights are filled)."""
    generator = torch.Generator().manual_seed(seed)
    shard = Shard.of(config, Parallel())
    layers = []
    for _ in range(config.num_hidden_layers):
        layer = LlamaLayer(config, shard, torch.float32, torch.device("cpu"), is_sparse=sparse)
        weights = (
            [layer.router, layer.experts_gate_up, layer.experts_down]
            if sparse
            else [layer.gate_up, layer.down]
        )
        for w in weights:
            w.copy_(torch.randn(w.shape, generator=generator) * 0.05)
        layers.append(layer)
    return layers


def dense_mlp(x: torch.Tensor, layer: LlamaLayer, use_kernel: bool) -> torch.Tensor:
    linear = cpu_ops.few_rows_linear if use_kernel and x.shape[0] <= cpu_ops.MAX_LINEAR_ROWS else F.linear
    gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate).mul_(up), layer.down)


def run_stack(x: torch.Tensor, layers: list[LlamaLayer], use_kernel: bool) -> torch.Tensor:
    for layer in layers:
        x = x + (
            moe_mlp(x, layer, F.silu, use_kernel)
            if layer.moe is not None
            else dense_mlp(x, layer, use_kernel)
        )
    return x


@contextmanager
def counting_weight_bytes(counts: list[int]):
    """Counts the bytes of every weight that F.linear or the few-rows linear multiplies (the MoE
    path's only matmuls)."""
    originals = (F.linear, cpu_ops.few_rows_linear)

    def counting(original):
        def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            counts.append(weight.numel() * weight.element_size())
            return original(x, weight, bias)

        return counted

    F.linear, cpu_ops.few_rows_linear = (counting(f) for f in originals)
    try:
        yield
    finally:
        F.linear, cpu_ops.few_rows_linear = originals


def time_step(fn, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= MIN_SAMPLE_S:
                break
        samples.append(elapsed / calls)
    return samples


def quantized_layers(config: ModelConfig, fmt: str, seed: int) -> tuple[LlamaLayer, LlamaLayer]:
    """One sparse layer of `config` with random experts as `fmt` blocks (gguf's quantizer), and
    the same layer with their float32 dequantization instead."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    (float_layer,) = make_layers(replace(config, num_hidden_layers=1), sparse=True, seed=seed)
    (blocks_layer,) = make_layers(replace(config, num_hidden_layers=1), sparse=True, seed=seed)
    qtype = GGMLQuantizationType[fmt]
    inter = config.moe.intermediate_size
    projections = (float_layer.experts_gate_up[:, :inter], float_layer.experts_gate_up[:, inter:],
                   float_layer.experts_down)  # fmt: skip
    per_expert = []
    for weight in projections:
        raw = quantize(weight.flatten(0, 1).numpy(), qtype)
        weight.copy_(torch.from_numpy(dequantize(raw, qtype)).view_as(weight))
        per_expert.append(list(torch.from_numpy(raw).view(weight.shape[0], weight.shape[1], -1)))
    blocks_layer.router.copy_(float_layer.router)
    blocks_layer.experts_quantized = QuantizedExperts.of(*per_expert, (fmt, fmt, fmt))
    blocks_layer.experts_gate_up = blocks_layer.experts_down = torch.empty(0)
    return float_layer, blocks_layer


def quantized_table(config: ModelConfig, formats: list[str], batches: list[int], repeats: int) -> list[dict]:
    """moe_mlp from float32 experts and from their blocks, at each batch: median step times."""
    rows = []
    print(f"{'format':>6} {'rows':>5} {'float32 ms':>11} {'blocks ms':>10} {'speedup':>8} "
          f"{'float32 MB':>11} {'blocks MB':>10}  blocks path")  # fmt: skip
    for fmt in formats:
        float_layer, blocks_layer = quantized_layers(config, fmt, seed=2)
        float_bytes = (float_layer.experts_gate_up.numel() + float_layer.experts_down.numel()) * 4
        blocks_bytes = blocks_layer.experts_quantized.nbytes
        for batch in batches:
            x = torch.randn(batch, config.hidden_size, generator=torch.Generator().manual_seed(batch))
            with torch.inference_mode():
                float_times, blocks_times = [], []
                for _ in range(repeats):
                    float_times += time_step(partial(moe_mlp, x, float_layer, F.silu, True), 1)
                    blocks_times += time_step(partial(moe_mlp, x, blocks_layer, F.silu, True), 1)
            float_s, blocks_s = statistics.median(float_times), statistics.median(blocks_times)
            path = "fused op" if batch <= cpu_ops.MOE_MAX_ROWS else "dequantize + GEMM"
            row = {
                "format": fmt, "rows": batch, "float32_ms": round(float_s * 1e3, 4),
                "blocks_ms": round(blocks_s * 1e3, 4), "float32_expert_bytes": float_bytes,
                "blocks_expert_bytes": blocks_bytes, "blocks_path": path,
            }  # fmt: skip
            rows.append(row)
            print(f"{fmt:>6} {batch:>5} {row['float32_ms']:>11.3f} {row['blocks_ms']:>10.3f} "
                  f"{float_s / blocks_s:>7.2f}x {float_bytes / 2**20:>11.1f} {blocks_bytes / 2**20:>10.1f}  {path}",
                  flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-intermediate", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", default="1,16", help="rows per step, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--quantized", default="", help="GGUF formats of the quantized-experts table (Q8_0, Q4_1)"
    )
    parser.add_argument("--quantized-batch", default="1,8,64", help="rows per step of that table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    h, ei, k, e = args.hidden, args.expert_intermediate, args.top_k, args.experts
    base = ModelConfig(
        architecture="bench", vocab_size=1, hidden_size=h, intermediate_size=k * ei,
        num_hidden_layers=args.layers, num_attention_heads=1, num_key_value_heads=1, head_dim=h,
        max_position_embeddings=1, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip
    moe_config = replace(base, moe=MoeConfig(e, k, ei, True, 0, (True,) * args.layers))
    moe_layers = make_layers(moe_config, sparse=True, seed=0)
    dense_layers = make_layers(base, sparse=False, seed=1)
    use_kernel = cpu_ops.has_kernels(torch.float32)
    expert_bytes = 3 * ei * h * 4
    router_bytes = e * h * 4
    results = []
    for batch in (int(b) for b in args.batch.split(",")):
        x = torch.randn(batch, h, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            counts: list[int] = []
            with counting_weight_bytes(counts):
                run_stack(x, moe_layers, use_kernel)
            # The floor: per layer, the router and each distinct expert the step's rows selected.
            floor = 0
            hidden = x
            for layer in moe_layers:
                _, experts = model_module.moe_route(F.linear(hidden, layer.router), layer.moe)
                floor += router_bytes + len(set(experts.flatten().tolist())) * expert_bytes
                hidden = hidden + moe_mlp(hidden, layer, F.silu, use_kernel)
            moe_times, dense_times = [], []
            for _ in range(args.repeats):
                moe_times += time_step(partial(run_stack, x, moe_layers, use_kernel), 1)
                dense_times += time_step(partial(run_stack, x, dense_layers, use_kernel), 1)
        moe_s, dense_s = statistics.median(moe_times), statistics.median(dense_times)
        result = {
            "batch": batch,
            "moe_step_ms": round(moe_s * 1e3, 4),
            "dense_step_ms": round(dense_s * 1e3, 4),
            "moe_over_dense": round(moe_s / dense_s, 3),
            "weight_bytes_read_per_token": sum(counts) / batch,
            "floor_bytes_per_token": floor / batch,
            "read_over_floor": round(sum(counts) / floor, 4),
            "per_pair_bytes_per_token": args.layers * (router_bytes + k * expert_bytes),
        }
        results.append(result)
        print(json.dumps(result), flush=True)
    report = {
        "shape": {"experts": e, "top_k": k, "hidden": h, "expert_intermediate": ei, "layers": args.layers},
        "dense_linear": "cpu_ops.few_rows_linear" if use_kernel else "F.linear",
        "threads": torch.get_num_threads(),
        "results": results,
    }
    if args.quantized:
        if not use_kernel:
            sys.exit("--quantized needs the C++ kernels (kernels/cpu_ops.py)")
        batches = [int(b) for b in args.quantized_batch.split(",")]
        report["quantized"] = quantized_table(moe_config, args.quantized.split(","), batches, args.repeats)
    args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
