"""A mixture-of-experts MLP stack against a dense MLP stack with the same active parameters, as
Brigade's worker runs them (services/gpu_worker/model.py: `moe_mlp` for the sparse layers, the
dense layers' gate_up / down through the few-rows C++ linear where it is built, else F.linear).

    python benchmarks/moe_bench.py --json FILE [--experts 64] [--top-k 4] [--hidden 512]
        [--expert-intermediate 256] [--layers 4] [--batch 1,16] [--repeats 15] [--threads N]
        [--quantized Q8_0,Q4_1,MXFP4 [--quantized-batch 1,8,64]]
        [--llama-server PATH [--serve-concurrency 1,16] [--serve-input-len 32] [--serve-output-len 32]]

The dense stack's intermediate size is top_k x the experts' (the same multiply-adds per token
as the selected experts). Each repeat times one step of `batch` rows through every layer of the
MoE stack and then of the dense stack (alternating, so a load spike on this shared machine hits
both); the report gives the median step time of each and their ratio. The weight bytes a step
reads are counted from the weights each F.linear / few-rows call of one step actually multiplies
(a wrapper counts them, outside the timed repeats): against the floor, the router plus each
distinct selected expert once, and against reading every (token, expert) pair's expert.

With --quantized, for each format both stacks again from GGUF blocks of it (gguf's quantizer):
the MoE's experts through cpu_ops.moe_experts (the fused op; its bytes counted as the
blocks of each distinct expert a step hands it, which it reads once), the dense layers through
cpu_ops.few_rows_linear_quantized (so at most MAX_LINEAR_ROWS rows: wider steps time the MoE
alone), "quantized_stacks" in the JSON. "targets" gives per stack the issue's two figures: MoE /
dense at one row against 1.3x, and the bytes read per token at the widest batch against the floor.
Then one sparse layer with its experts as blocks of each format, against the same layer with the
experts' float32 dequantization (what the worker held before): `moe_mlp` timed on both at each
--quantized-batch rows (the blocks through the fused op up to cpu_ops.MOE_MAX_ROWS rows, each
selected expert dequantized for the GEMM above), and the expert bytes each holds ("quantized").

With --llama-server, a random-weight Mixtral of the shape (SmolLM2's vocabulary) written as a
`llama` GGUF with Q8_0 experts (cached under Brigade's cache by shape) is served by that
llama-server and then by Brigade through benchmarks/serve.py, same prompts as token ids, greedy,
ignore_eos: output tokens/s and TPOT p50 of each at each --serve-concurrency ("llamacpp").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_ops
from services.gpu_worker import model as model_module
from services.gpu_worker.architectures import ModelConfig, MoeConfig
from services.gpu_worker.model import (
    FewRowsMoe,
    LlamaLayer,
    QuantizedExperts,
    QuantizedWeight,
    Shard,
    moe_mlp,
)
from services.gpu_worker.parallel import Parallel

DECODE_RATIO_TARGET = 1.3  # issue 33: a MoE decode step within 1.3x of the dense stack's
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
        if sparse:
            layer.few_rows_moe = FewRowsMoe.of(layer, cpu_ops.has_kernels(torch.float32), is_silu=True)
        layers.append(layer)
    return layers


def dense_mlp(x: torch.Tensor, layer: LlamaLayer, use_kernel: bool) -> torch.Tensor:
    linear = cpu_ops.few_rows_linear if use_kernel and x.shape[0] <= cpu_ops.MAX_LINEAR_ROWS else F.linear
    gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate).mul_(up), layer.down)


@dataclass(frozen=True)
class QuantizedDenseLayer:
    """A dense layer's MLP as GGUF blocks, as a GGUF model's dense layer keeps it."""

    gate_up: QuantizedWeight
    down: QuantizedWeight
    moe = None  # run_stack: not sparse


def quantized_dense_mlp(x: torch.Tensor, layer: QuantizedDenseLayer) -> torch.Tensor:
    """The dense MLP from its blocks through the few-rows C++ op (at most MAX_LINEAR_ROWS rows)."""
    gate, up = layer.gate_up.multiply(x).chunk(2, dim=-1)
    return layer.down.multiply(F.silu(gate).mul_(up))


def mlp_input(x: torch.Tensor) -> torch.Tensor:
    """The RMSNorm a decoder layer applies before its MLP: without it the random stacks' residual
    grows layer by layer until the routers' softmax saturates into ties and NaNs, which the MoE
    stack routes through torch's fallback (a path real models do not take)."""
    return F.rms_norm(x, (x.shape[-1],))


def run_stack(x: torch.Tensor, layers: list, use_kernel: bool) -> torch.Tensor:
    for layer in layers:
        h = mlp_input(x)
        if layer.moe is not None:
            x = x + moe_mlp(h, layer, F.silu, use_kernel)
        elif isinstance(layer, QuantizedDenseLayer):
            x = x + quantized_dense_mlp(h, layer)
        else:
            x = x + dense_mlp(h, layer, use_kernel)
    return x


@contextmanager
def counting_weight_bytes(counts: list[int]):
    """Counts the bytes of every weight that F.linear or the few-rows linear multiplies (the float32
    MoE path's only matmuls) and of the router that cpu_ops.moe_route multiplies, and for
    cpu_ops.moe_experts the blocks of each distinct expert it is given: the op groups a
    step's (row, expert) pairs by expert and reads each selected expert's blocks once
    (cpu_ops.cpp), so those are its reads. cpu_ops.moe_layer (both in one call) counts as both,
    its experts found by routing x again outside it."""
    originals = (F.linear, cpu_ops.few_rows_linear, cpu_ops.moe_experts, cpu_ops.moe_route, cpu_ops.moe_layer)

    def counting(original):
        def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            counts.append(weight.numel() * weight.element_size())
            return original(x, weight, bias)

        return counted

    def counted_experts(x, weights, experts, *projections, **biases_and_swiglu):
        for expert in set(experts.flatten().tolist()):
            counts.append(sum(w[expert].numel() * w.element_size() for w, _ in projections))
        return originals[2](x, weights, experts, *projections, **biases_and_swiglu)

    def counted_router(x, router, *options):
        counts.append(router.numel() * router.element_size())
        return originals[3](x, router, *options)

    def counted_layer(x, *layer):
        out, tied = originals[4](x, *layer)
        if tied:  # the step is routed again by torch, and its experts counted there
            return out, tied
        # moe_layer's arguments: moe_route's six after x, then the projections as (weight, format).
        routing, projections = layer[:6], list(zip(layer[6:12:2], layer[7:12:2], strict=True))
        counts.append(routing[0].numel() * routing[0].element_size())
        for expert in set(originals[3](x, *routing)[1].flatten().tolist()):
            counts.append(sum(w[expert].numel() * w.element_size() for w, _ in projections))
        return out, tied

    F.linear, cpu_ops.few_rows_linear = (counting(f) for f in originals[:2])
    cpu_ops.moe_experts, cpu_ops.moe_route, cpu_ops.moe_layer = counted_experts, counted_router, counted_layer
    try:
        yield
    finally:
        F.linear, cpu_ops.few_rows_linear, cpu_ops.moe_experts, cpu_ops.moe_route, cpu_ops.moe_layer = (
            originals
        )


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


def compare_stacks(moe_layers: list[LlamaLayer], dense_layers: list, batches: list[int], expert_bytes: int,
                   repeats: int, use_kernel: bool) -> list[dict]:  # fmt: skip
    """At each batch: the median step time of each stack (alternating, so a load spike on this shared
    machine hits both) and their ratio, and the MoE stack's weight bytes read per token against the
    floor (per layer, the router and each distinct selected expert once) and against reading every
    (token, expert) pair's expert. A quantized dense stack runs only up to MAX_LINEAR_ROWS rows (its
    step time is None above)."""
    moe = moe_layers[0].moe
    hidden = moe_layers[0].router.shape[1]
    router_bytes = moe_layers[0].router.numel() * 4
    results = []
    for batch in batches:
        x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(batch))
        runs_dense = not isinstance(dense_layers[0], QuantizedDenseLayer) or batch <= cpu_ops.MAX_LINEAR_ROWS
        with torch.inference_mode():
            counts: list[int] = []
            with counting_weight_bytes(counts):
                run_stack(x, moe_layers, use_kernel)
            floor = 0
            state = x
            for layer in moe_layers:
                h = mlp_input(state)
                _, experts = model_module.moe_route(F.linear(h, layer.router), moe)
                floor += router_bytes + len(set(experts.flatten().tolist())) * expert_bytes
                state = state + moe_mlp(h, layer, F.silu, use_kernel)
            moe_times, dense_times = [], []
            for _ in range(repeats):
                moe_times += time_step(partial(run_stack, x, moe_layers, use_kernel), 1)
                if runs_dense:
                    dense_times += time_step(partial(run_stack, x, dense_layers, use_kernel), 1)
        moe_s = statistics.median(moe_times)
        dense_s = statistics.median(dense_times) if runs_dense else None
        result = {
            "batch": batch,
            "moe_step_ms": round(moe_s * 1e3, 4),
            "dense_step_ms": round(dense_s * 1e3, 4) if dense_s else None,
            "moe_over_dense": round(moe_s / dense_s, 3) if dense_s else None,
            "weight_bytes_read_per_token": sum(counts) / batch,
            "floor_bytes_per_token": floor / batch,
            "read_over_floor": round(sum(counts) / floor, 4),
            "per_pair_bytes_per_token": len(moe_layers) * (router_bytes + moe.top_k * expert_bytes),
        }
        results.append(result)
        print(json.dumps(result), flush=True)
    return results


def targets(results: list[dict]) -> dict:
    """The issue's two targets from one stack comparison: MoE over dense at one row (at most
    DECODE_RATIO_TARGET), and the bytes read per token at the widest batch against the floor."""
    by_rows = {r["batch"]: r for r in results}
    one, widest = by_rows.get(1), by_rows[max(by_rows)]
    ratio = one["moe_over_dense"] if one else None
    return {
        "moe_over_dense_1_row": ratio,
        "ratio_target": DECODE_RATIO_TARGET,
        "ratio_met": ratio is not None and ratio <= DECODE_RATIO_TARGET,
        "widest_rows": widest["batch"],
        "bytes_read_per_token": widest["weight_bytes_read_per_token"],
        "floor_bytes_per_token": widest["floor_bytes_per_token"],
        "read_over_floor": widest["read_over_floor"],
    }


def print_targets(per_stack: dict[str, dict]) -> None:
    for stack, t in per_stack.items():
        ratio = "n/a" if t["moe_over_dense_1_row"] is None else f"{t['moe_over_dense_1_row']:.2f}x"
        print(f"{stack:>8}: MoE / dense at 1 row {ratio} (target <= {t['ratio_target']}x: "
              f"{'met' if t['ratio_met'] else 'NOT met'}); at {t['widest_rows']} rows "
              f"{t['bytes_read_per_token'] / 1e6:.2f} MB read per token, floor "
              f"{t['floor_bytes_per_token'] / 1e6:.2f} MB ({t['read_over_floor']:.3f}x)", flush=True)  # fmt: skip


def quantized_blocks(weight: torch.Tensor, fmt: str) -> tuple[np.ndarray, torch.Tensor]:
    """`weight` [..., in] as `fmt` GGUF blocks (gguf's quantizer): (the blocks, their float32
    dequantization, shaped as `weight`)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[fmt]
    raw = quantize(weight.reshape(-1, weight.shape[-1]).numpy(), qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype)).view_as(weight)


def quantized_layers(config: ModelConfig, fmt: str, seed: int) -> tuple[LlamaLayer, LlamaLayer]:
    """One sparse layer of `config` with random experts as `fmt` blocks (gguf's quantizer), and
    the same layer with their float32 dequantization instead."""
    (float_layer,) = make_layers(replace(config, num_hidden_layers=1), sparse=True, seed=seed)
    (blocks_layer,) = make_layers(replace(config, num_hidden_layers=1), sparse=True, seed=seed)
    inter = config.moe.intermediate_size
    projections = (float_layer.experts_gate_up[:, :inter], float_layer.experts_gate_up[:, inter:],
                   float_layer.experts_down)  # fmt: skip
    per_expert = []
    for weight in projections:
        raw, exact = quantized_blocks(weight, fmt)
        weight.copy_(exact)
        per_expert.append(list(torch.from_numpy(raw).view(weight.shape[0], weight.shape[1], -1)))
    blocks_layer.router.copy_(float_layer.router)
    blocks_layer.experts_quantized = QuantizedExperts.of(*per_expert, (fmt, fmt, fmt))
    blocks_layer.experts_gate_up = blocks_layer.experts_down = torch.empty(0)
    # As LlamaModel.finish_loading binds them, once the weights are final.
    float_layer.few_rows_moe = FewRowsMoe.of(float_layer, True, is_silu=True)
    blocks_layer.few_rows_moe = FewRowsMoe.of(blocks_layer, True, is_silu=True)
    return float_layer, blocks_layer


def quantized_dense_layers(config: ModelConfig, fmt: str, seed: int) -> list[QuantizedDenseLayer]:
    """The dense stack of `config` with its gate_up and down as `fmt` blocks packed for the kernels."""

    def packed(weight: torch.Tensor) -> QuantizedWeight:
        raw, _ = quantized_blocks(weight, fmt)
        return QuantizedWeight(torch.from_numpy(cpu_ops.to_lanes(raw, fmt)), fmt)

    return [
        QuantizedDenseLayer(packed(layer.gate_up), packed(layer.down))
        for layer in make_layers(config, sparse=False, seed=seed)
    ]


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


def moe_gguf(shape: dict) -> Path:
    """A random-weight Mixtral of the benchmark's shape (SmolLM2's vocabulary and tokenizer, 8
    heads of 64) as a `llama` GGUF with Q8_0 experts and float32 elsewhere, written as llama.cpp's
    converter writes one (tests/test_moe.py's writer); cached under Brigade's cache by shape."""
    from benchmarks.peers import brigade_cache

    name = "mixtral-{experts}e-top{top_k}-h{hidden}-i{expert_intermediate}-{layers}l-q8_0.gguf".format(
        **shape
    )
    path = brigade_cache() / "moe-bench" / name
    if path.exists():
        return path
    import transformers

    from services.gpu_worker.loader import default_model_path, prepare_model
    from tests.conftest import save_random_model
    from tests.test_moe import write_moe_gguf

    smollm2 = json.loads((prepare_model(None) / "config.json").read_text())
    config = transformers.MixtralConfig(
        vocab_size=smollm2["vocab_size"], hidden_size=shape["hidden"], intermediate_size=shape["expert_intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["hidden"] // 64, num_key_value_heads=shape["hidden"] // 64,
        head_dim=64, num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"], max_position_embeddings=2048,
        bos_token_id=smollm2["bos_token_id"], eos_token_id=smollm2["eos_token_id"], tie_word_embeddings=False,
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        hf_dir = save_random_model(config, Path(scratch) / "hf", seed=0, std=0.05)
        written = write_moe_gguf(
            hf_dir, Path(scratch) / name, "llama", tokenizer_from=Path(default_model_path())
        )
        written.rename(path)  # whole or not at all: a stopped run leaves no half-written cache entry
    return path


def llamacpp_comparison(args: argparse.Namespace, shape: dict) -> dict:
    """llama-server and Brigade on the same random-weight GGUF MoE of the benchmark's shape, one
    after the other in one run through benchmarks/serve.py (same prompts as token ids, greedy,
    ignore_eos): output tokens/s and TPOT p50 of each at each concurrency, and Brigade's over llama.cpp's."""
    binary = Path(args.llama_server)
    if not binary.exists():
        note = f"skipped: no llama-server at {binary} (benchmarks/build_llama_server.sh builds one)"
        print(f"llama.cpp {note}", flush=True)
        return {"skipped": note}
    from benchmarks import serve

    gguf = moe_gguf(shape)
    threads = args.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="moe-bench-serve-") as scratch:
        out = Path(scratch) / "serve.json"
        serve.main([
            "--engines", "brigade,llamacpp", "--llama-server", str(binary), "--gguf", str(gguf),
            "--set", f"model.path={gguf}", "--set", f"engine.threads={threads}", "--threads", str(threads),
            "--concurrency", args.serve_concurrency, "--dataset", "random", "--input-len", str(args.serve_input_len),
            "--output-len", str(args.serve_output_len), "--json", str(out),
        ])  # fmt: skip
        served = json.loads(out.read_text())
    comparison: dict = {"gguf": str(gguf), "llama_server": str(binary), "threads": threads, "concurrency": {}}
    if "skipped" in served["llamacpp"]:
        return comparison | {"skipped": served["llamacpp"]["skipped"]}
    for c, brigade_setting in served["brigade"]["settings"].items():
        llama_setting = served["llamacpp"]["settings"][c]
        row = {
            engine: {"output_tok_s": round(s["output_tok_s"], 2), "tpot_p50_ms": round(s["tpot_ms"]["p50"], 2),
                     "failures": s["failures"]["total"]}
            for engine, s in (("brigade", brigade_setting), ("llamacpp", llama_setting))
        }  # fmt: skip
        row["brigade_over_llamacpp_tok_s"] = round(
            row["brigade"]["output_tok_s"] / row["llamacpp"]["output_tok_s"], 3
        )
        row["brigade_over_llamacpp_tpot"] = round(
            row["brigade"]["tpot_p50_ms"] / row["llamacpp"]["tpot_p50_ms"], 3
        )
        comparison["concurrency"][c] = row
        print(f"c={c}: Brigade {row['brigade']['output_tok_s']} tok/s, TPOT p50 {row['brigade']['tpot_p50_ms']} ms; "
              f"llama.cpp {row['llamacpp']['output_tok_s']} tok/s, TPOT p50 {row['llamacpp']['tpot_p50_ms']} ms; "
              f"Brigade / llama.cpp tok/s {row['brigade_over_llamacpp_tok_s']}x, TPOT "
              f"{row['brigade_over_llamacpp_tpot']}x", flush=True)  # fmt: skip
    return comparison


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
        "--quantized",
        default="",
        help="GGUF formats of the quantized stacks and table (Q8_0, Q4_1, MXFP4, ...)",
    )
    parser.add_argument("--quantized-batch", default="1,8,64", help="rows per step of that table")
    parser.add_argument(
        "--llama-server",
        help="also serve a random GGUF MoE of the shape with this llama-server and with Brigade",
    )
    parser.add_argument("--serve-concurrency", default="1,16", help="concurrencies of that comparison")
    parser.add_argument("--serve-input-len", type=int, default=32, help="prompt tokens of that comparison")
    parser.add_argument("--serve-output-len", type=int, default=32, help="output tokens of that comparison")
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
    batches = [int(b) for b in args.batch.split(",")]
    compare = partial(compare_stacks, batches=batches, repeats=args.repeats, use_kernel=use_kernel)
    print("float32 stacks", flush=True)
    results = compare(moe_layers, dense_layers, expert_bytes=3 * ei * h * 4)
    report = {
        "shape": {"experts": e, "top_k": k, "hidden": h, "expert_intermediate": ei, "layers": args.layers},
        "dense_linear": "cpu_ops.few_rows_linear" if use_kernel else "F.linear",
        "threads": torch.get_num_threads(),
        "results": results,
        "targets": {"float32": targets(results)},
    }
    if args.quantized:
        if not use_kernel:
            sys.exit("--quantized needs the C++ kernels (kernels/cpu_ops.py)")
        formats = args.quantized.split(",")
        report["quantized_stacks"] = {}
        for fmt in formats:
            # Both stacks from `fmt` blocks: the experts through cpu_ops.moe_experts, the
            # dense layers through cpu_ops.few_rows_linear_quantized (at most MAX_LINEAR_ROWS rows).
            print(f"{fmt} stacks (experts: the fused op; dense: the few-rows op)", flush=True)
            moe_blocks = [quantized_layers(moe_config, fmt, seed=i)[1] for i in range(args.layers)]
            dense_blocks = quantized_dense_layers(base, fmt, seed=1)
            per_expert = moe_blocks[0].experts_quantized.nbytes // e
            report["quantized_stacks"][fmt] = compare(moe_blocks, dense_blocks, expert_bytes=per_expert)
            report["targets"][fmt] = targets(report["quantized_stacks"][fmt])
        batches = [int(b) for b in args.quantized_batch.split(",")]
        report["quantized"] = quantized_table(moe_config, formats, batches, args.repeats)
    print_targets(report["targets"])
    if args.llama_server:
        report["llamacpp"] = llamacpp_comparison(args, report["shape"])
    args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
