"""Each C++ op of kernels/cpu_ops.py against its torch reference, at the shapes of the embedded
SmolLM2-135M, A/B in one run.

    python benchmarks/kernels_bench.py --json FILE [--repeats 15] [--threads N] [--quick]
        [--ops OP,OP] [--weight OUTxIN ...]

The shapes come from the converted model's config.json (`prepare_model(None)`); the weights and
activations are random float32 (GGUF blocks made by gguf's own quantizer for the quantized
linear). Each repeat times the op and then its reference on the same inputs (alternating, so a
load spike on this shared machine hits both); the table gives min / median / max microseconds per
call of each and the median ratio (reference / op: above 1, the op is faster). Every case also
checks that the two agree (`matches`), so a figure never comes from a wrong result. `--ops`
runs only the named ops; `--weight` adds a weight shape to the linear ops' cases (a larger one
than SmolLM2's, streamed from memory rather than cache, or one whose rows are whole K-quant
super-blocks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_ops
from kernels.paged_attention import paged_decode_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import make_cos_sin, rotary_ref
from services.gpu_worker.loader import prepare_model
from services.gpu_worker.model import CAN_PREPACK, INT8_BLOCKS_MAX_ROWS, onednn_linear, prepack

BLOCK_SIZE = 16
MIN_SAMPLE_S = 2e-3  # each timed sample repeats a call until it lasts this long (timer resolution)
# Float32 sums in another order; the absolute tolerance scales with the output's largest value.
ATOL, RTOL = 1e-5, 1e-4


class Shapes:
    """The model dimensions the ops run at."""

    def __init__(self, config: dict) -> None:
        self.hidden = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_dim = config.get("head_dim") or self.hidden // self.heads
        self.intermediate = config["intermediate_size"]
        self.vocab = config["vocab_size"]
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.rope_theta = float(config.get("rope_theta") or 10000.0)
        self.extra_linears: dict[str, tuple[int, int]] = {}  # --weight

    def linears(self) -> dict[str, tuple[int, int]]:
        """name -> (out, in) of the model's fused projections and its LM head."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return {
            "qkv": (qkv, self.hidden),
            "o_proj": (self.hidden, self.heads * self.head_dim),
            "gate_up": (2 * self.intermediate, self.hidden),
            "down": (self.hidden, self.intermediate),
            "lm_head": (self.vocab, self.hidden),
            **self.extra_linears,
        }


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def calls_per_sample(fn: Callable[[], object]) -> int:
    fn()  # warm-up
    once = max(per_call_us(fn, 1), 1.0) / 1e6
    return max(1, int(MIN_SAMPLE_S / once))


def compare(
    op: str,
    case: str,
    kernel: Callable[[], torch.Tensor],
    ref: Callable[[], torch.Tensor],
    repeats: int,
    baseline: Callable[[], torch.Tensor] | None = None,
) -> dict:
    """A/B timing of one case plus the agreement of the two outputs. `baseline`, where given, is a
    third side timed in the same alternation (an op this one would replace, not a reference:
    its output is not compared), reported as `baseline_us` and `speedup_vs_baseline`."""
    got, want = kernel(), ref()
    sides = {"kernel": kernel, "ref": ref, **({"baseline": baseline} if baseline else {})}
    calls = {name: calls_per_sample(fn) for name, fn in sides.items()}
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            samples[name].append(per_call_us(fn, calls[name]))
    stats = {
        name: {"min": min(s), "median": statistics.median(s), "max": max(s)} for name, s in samples.items()
    }
    result = {
        "op": op,
        "case": case,
        "kernel_us": stats["kernel"],
        "ref_us": stats["ref"],
        "speedup": stats["ref"]["median"] / stats["kernel"]["median"],
        "max_abs_diff": (got - want).abs().max().item(),
        "matches": torch.allclose(got, want, atol=ATOL * max(1.0, want.abs().max().item()), rtol=RTOL),
    }
    if baseline:
        result["baseline_us"] = stats["baseline"]
        result["speedup_vs_baseline"] = stats["baseline"]["median"] / stats["kernel"]["median"]
    return result


# ---------------------------------------------------------------- the cases


def paged_kv(shapes: Shapes, batch: int, context: int, gen: torch.Generator):
    """Caches over shuffled blocks, each sequence `context` long, and its block table."""
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    cache_shape = (num_blocks, BLOCK_SIZE, shapes.kv_heads, shapes.head_dim)
    k_cache, v_cache = torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).long()
    return k_cache, v_cache, tables, torch.full((batch,), context, dtype=torch.long)


def paged_decode_cases(shapes: Shapes, batches: tuple[int, ...], context: int, repeats: int) -> list[dict]:
    gen, out = torch.Generator().manual_seed(0), []
    scale = shapes.head_dim**-0.5
    for batch in batches:
        k_cache, v_cache, tables, lens = paged_kv(shapes, batch, context, gen)
        q = torch.randn(batch, shapes.heads, shapes.head_dim, generator=gen)
        args = (q, k_cache, v_cache, tables, lens, scale)
        out.append(
            compare(
                "paged_decode",
                f"batch {batch}, context {context}",
                lambda a=args: cpu_ops.paged_decode(*a),
                lambda a=args: paged_decode_ref(*a),
                repeats,
            )
        )
    return out


def few_rows_linear_cases(
    shapes: Shapes, rows: tuple[int, ...], names: list[str], repeats: int
) -> list[dict]:
    gen, out = torch.Generator().manual_seed(1), []
    for name in names:
        out_features, in_features = shapes.linears()[name]
        weight = torch.randn(out_features, in_features, generator=gen)
        for num_rows in rows:
            x = torch.randn(num_rows, in_features, generator=gen)
            out.append(
                compare(
                    "few_rows_linear",
                    f"{name} {out_features}x{in_features}, {num_rows} rows",
                    lambda x=x, w=weight: cpu_ops.few_rows_linear(x, w),
                    lambda x=x, w=weight: F.linear(x, w),
                    repeats,
                )
            )
    return out


def gguf_blocks(weight: np.ndarray, fmt: str, rng: np.random.Generator) -> np.ndarray:
    """GGUF blocks [rows, bytes] of `weight` from gguf's quantizer; for the K-quants, which it
    cannot make, random super-blocks of the weight's shape (every byte random but the float16
    scales, kept small and finite): the GEMV's speed does not depend on the values."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[fmt]
    if fmt not in cpu_ops.K_QUANTS:
        return quantize(weight, qtype)
    per_block, size = GGML_QUANT_SIZES[qtype]
    num_rows, num_blocks = weight.shape[0], weight.shape[1] // per_block
    blocks = rng.integers(0, 256, (num_rows, num_blocks, size), dtype=np.uint8)
    scales = (rng.random((num_rows, num_blocks, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if fmt == "Q6_K":  # d is the last two bytes
        blocks[..., size - 2 :] = scales[..., :2]
    else:  # d and dmin lead the block
        blocks[..., :4] = scales.reshape(num_rows, num_blocks, 4)
    return blocks.reshape(num_rows, -1)


def few_rows_linear_quantized_cases(
    shapes: Shapes, rows: tuple[int, ...], names: list[str], formats: tuple[str, ...], repeats: int
) -> tuple[list[dict], list[str]]:
    """The reference multiplies the blocks' float32 dequantization (gguf's own). Returns the
    cases and the (format, weight) pairs skipped: a row must be whole blocks of its format."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    rng, gen, out, skipped = np.random.default_rng(2), torch.Generator().manual_seed(2), [], []
    for name in names:
        out_features, in_features = shapes.linears()[name]
        weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
        for fmt in formats:
            qtype = GGMLQuantizationType[fmt]
            per_block = GGML_QUANT_SIZES[qtype][0]
            if in_features % per_block:
                skipped.append(f"{fmt} {name}: {in_features} inputs are not whole blocks of {per_block}")
                continue
            blocks = gguf_blocks(weight, fmt, rng)
            dequantized = torch.from_numpy(dequantize(blocks, qtype).astype(np.float32))
            lanes = torch.from_numpy(cpu_ops.to_lanes(blocks, fmt))
            for num_rows in rows:
                x = torch.randn(num_rows, in_features, generator=gen)
                out.append(
                    compare(
                        "few_rows_linear_quantized",
                        f"{fmt} {name} {out_features}x{in_features}, {num_rows} rows",
                        lambda x=x, b=lanes, f=fmt: cpu_ops.few_rows_linear_quantized(x, b, f),
                        lambda x=x, w=dequantized: F.linear(x, w),
                        repeats,
                    )
                )
    return out, skipped


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as linear_quantized_int8 rounds it: blocks of 32, d = max|x| / 127, d * rint(x * (1 / d))."""
    blocks = x.reshape(x.shape[0], -1, cpu_ops.BLOCK_WEIGHTS)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


def int8_linear_cases(
    shapes: Shapes, rows: tuple[int, ...], names: list[str], formats: tuple[str, ...], repeats: int
) -> list[dict]:
    """8-bit activations: the reference multiplies x's 8-bit rounding (int8_rounded) by the blocks'
    dequantization; the baseline is what the option replaces: the float-activation kernel on the
    same blocks for steps of few rows, oneDNN on the prepacked dequantization for wider ones.
    Weights that are not whole blocks are skipped (listed by the float cases)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    rng, gen, out = np.random.default_rng(5), torch.Generator().manual_seed(5), []
    for name in names:
        out_features, in_features = shapes.linears()[name]
        weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
        for fmt in formats:
            qtype = GGMLQuantizationType[fmt]
            if in_features % GGML_QUANT_SIZES[qtype][0]:
                continue
            blocks = gguf_blocks(weight, fmt, rng)
            dequantized = torch.from_numpy(dequantize(blocks, qtype).astype(np.float32))
            lanes = torch.from_numpy(cpu_ops.to_lanes(blocks, fmt))
            prepacked = prepack(dequantized) if CAN_PREPACK else dequantized
            for num_rows in rows:
                x = torch.randn(num_rows, in_features, generator=gen)
                if num_rows <= cpu_ops.MAX_LINEAR_ROWS:
                    baseline = partial(cpu_ops.few_rows_linear_quantized, x, lanes, fmt)
                else:
                    baseline = (
                        partial(onednn_linear, x, prepacked)
                        if CAN_PREPACK
                        else partial(F.linear, x, prepacked)
                    )
                out.append(
                    compare(
                        "linear_quantized_int8",
                        f"{fmt} {name} {out_features}x{in_features}, {num_rows} rows",
                        lambda x=x, b=lanes, f=fmt: cpu_ops.linear_quantized_int8(x, b, f),
                        lambda x=x, w=dequantized: F.linear(int8_rounded(x), w),
                        repeats,
                        baseline=baseline,
                    )
                )
    return out


def add_rms_norm_cases(shapes: Shapes, rows: tuple[int, ...], repeats: int) -> list[dict]:
    """Both outputs (the normed rows and the residual sum) compared, as one concatenation."""
    gen, out = torch.Generator().manual_seed(3), []
    weight = torch.randn(shapes.hidden, generator=gen)
    for num_rows in rows:
        x, residual = (
            torch.randn(num_rows, shapes.hidden, generator=gen),
            torch.randn(num_rows, shapes.hidden, generator=gen),
        )
        out.append(
            compare(
                "add_rms_norm",
                f"{num_rows} rows",
                lambda x=x, r=residual: torch.cat(cpu_ops.add_rms_norm(x, weight, shapes.eps, r)),
                lambda x=x, r=residual: torch.cat(rms_norm_ref(x, weight, shapes.eps, r)),
                repeats,
            )
        )
    return out


def logsumexp_argmax_cases(shapes: Shapes, rows: tuple[int, ...], repeats: int) -> list[dict]:
    """What a greedy step's sampler returns (each row's argmax and its logprob) from the op, against
    torch's log_softmax and argmax, which the sampler ran before it."""
    gen, out = torch.Generator().manual_seed(4), []
    for num_rows in rows:
        logits = torch.randn(num_rows, shapes.vocab, generator=gen) * 4

        def kernel(x=logits) -> torch.Tensor:
            log_norms, argmax = cpu_ops.logsumexp_argmax(x)
            return x.gather(1, argmax[:, None])[:, 0] - log_norms

        def ref(x=logits) -> torch.Tensor:
            return torch.log_softmax(x, dim=-1).gather(1, x.argmax(dim=-1)[:, None])[:, 0]

        out.append(compare("logsumexp_argmax", f"{num_rows} rows x {shapes.vocab}", kernel, ref, repeats))
    return out


def decode_layer_ref(shapes: Shapes, hidden, residual, norms, weights, positions, cos_sin, kv_cache, slots,
                     tables, lens) -> torch.Tensor:  # fmt: skip
    """One decoder layer from the kernels' torch references (rms_norm_ref, rotary_ref,
    paged_decode_ref) and F.linear: the per-op path the one-op decode layers replace."""
    qkv_w, o_w, gate_up_w, down_w = weights
    k_cache, v_cache = kv_cache
    t, d = hidden.shape[0], shapes.head_dim
    x, summed = rms_norm_ref(hidden, norms[0], shapes.eps, residual)
    q, k, v = F.linear(x, qkv_w).split([shapes.heads * d, shapes.kv_heads * d, shapes.kv_heads * d], dim=-1)
    q, k, v = (
        q.reshape(t, shapes.heads, d),
        k.reshape(t, shapes.kv_heads, d),
        v.reshape(t, shapes.kv_heads, d),
    )
    rotary_ref(q, k, positions, cos_sin)
    # Flat slot indexing (as the CPU path stores K/V), not store_kv_ref's per-token Python loop.
    k_cache.view(-1, shapes.kv_heads, d)[slots] = k
    v_cache.view(-1, shapes.kv_heads, d)[slots] = v
    attn = paged_decode_ref(q, k_cache, v_cache, tables, lens, d**-0.5)
    x, summed = rms_norm_ref(F.linear(attn.reshape(t, -1), o_w), norms[1], shapes.eps, summed)
    gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
    return torch.cat((F.linear(F.silu(gate) * up, down_w), summed))


def few_rows_decode_layers_cases(
    shapes: Shapes, batches: tuple[int, ...], context: int, repeats: int
) -> list[dict]:
    """float32 weights; K/V of each step written to its slot (the same slot every call) in each
    side's own caches."""
    gen, out = torch.Generator().manual_seed(4), []
    linears = shapes.linears()
    weights = tuple(
        torch.randn(*linears[n], generator=gen) * 0.05 for n in ("qkv", "o_proj", "gate_up", "down")
    )
    norms = (torch.rand(shapes.hidden, generator=gen) + 0.5, torch.rand(shapes.hidden, generator=gen) + 0.5)
    cos_sin = make_cos_sin(context, shapes.head_dim, shapes.rope_theta, torch.float32, "cpu")
    layer = cpu_ops.DecodeLayers(list(norms), list(weights), [""] * 4, [1] * 4, [None])
    half = shapes.head_dim // 2
    full_cos = torch.cat((cos_sin[:, :half], cos_sin[:, :half]), dim=-1)
    signed_sin = torch.cat((-cos_sin[:, half:], cos_sin[:, half:]), dim=-1)
    for batch in batches:
        k_cache, v_cache, tables, lens = paged_kv(shapes, batch, context, gen)
        ref_cache = (k_cache.clone(), v_cache.clone())
        positions = lens - 1
        slots = tables[torch.arange(batch), positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        hidden, residual = (
            torch.randn(batch, shapes.hidden, generator=gen),
            torch.randn(batch, shapes.hidden, generator=gen),
        )

        def kernel(hidden=hidden, residual=residual, cache=(k_cache, v_cache), slots=slots, tables=tables,
                   lens=lens, positions=positions) -> torch.Tensor:  # fmt: skip
            # The op starts a step's residual stream from its input: give it the sum the ref's norm takes.
            return torch.cat(cpu_ops.few_rows_decode_layers(
                hidden + residual, layer, shapes.eps, full_cos[positions], signed_sin[positions],
                ([cache[0]], [cache[1]]), slots, tables, lens, shapes.heads, shapes.head_dim**-0.5,
            ))  # fmt: skip

        def ref(hidden=hidden, residual=residual, cache=ref_cache, slots=slots, tables=tables, lens=lens,
                positions=positions) -> torch.Tensor:  # fmt: skip
            return decode_layer_ref(
                shapes, hidden, residual, norms, weights, positions, cos_sin, cache, slots, tables, lens
            )

        out.append(
            compare("few_rows_decode_layers", f"batch {batch}, context {context}", kernel, ref, repeats)
        )
    return out


# ---------------------------------------------------------------- main


OPS = ("paged_decode", "few_rows_linear", "few_rows_linear_quantized", "linear_quantized_int8",
       "add_rms_norm", "logsumexp_argmax", "few_rows_decode_layers")  # fmt: skip


def run(
    shapes: Shapes, quick: bool, repeats: int, ops: tuple[str, ...] = OPS
) -> tuple[list[dict], list[str]]:
    rows = (1, cpu_ops.MAX_LINEAR_ROWS)
    # 8-bit activations also reach wider steps, up to INT8_BLOCKS_MAX_ROWS (AVX2's, the widest).
    int8_rows = rows if quick else (*rows, 16, INT8_BLOCKS_MAX_ROWS["avx2"])
    names = ["qkv", "down", *shapes.extra_linears] if quick else list(shapes.linears())
    context = 64 if quick else 256
    batches = (1, cpu_ops.MAX_LINEAR_ROWS) if quick else (1, cpu_ops.MAX_LINEAR_ROWS, 16, 64)
    formats = cpu_ops.QUANTIZED_FORMATS
    skipped: list[str] = []

    def quantized() -> list[dict]:
        found, skips = few_rows_linear_quantized_cases(shapes, rows, names, formats, repeats)
        skipped.extend(skips)
        return found

    cases = {
        "paged_decode": lambda: paged_decode_cases(shapes, batches, context, repeats),
        "few_rows_linear": lambda: few_rows_linear_cases(shapes, rows, names, repeats),
        "few_rows_linear_quantized": quantized,
        "linear_quantized_int8": lambda: int8_linear_cases(shapes, int8_rows, names, formats, repeats),
        "add_rms_norm": lambda: add_rms_norm_cases(shapes, (1, cpu_ops.MAX_LINEAR_ROWS, 64), repeats),
        "logsumexp_argmax": lambda: logsumexp_argmax_cases(shapes, (1, 16, 64), repeats),
        "few_rows_decode_layers": lambda: few_rows_decode_layers_cases(shapes, rows, context, repeats),
    }
    return [result for op in ops for result in cases[op]()], skipped


def weight_shape(text: str) -> tuple[int, int]:
    out_features, _, in_features = text.partition("x")
    try:
        shape = int(out_features), int(in_features)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not OUTxIN (e.g. 6144x4096)") from None
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both sizes must be positive")
    return shape


def op_list(text: str) -> tuple[str, ...]:
    ops = tuple(op for op in text.split(",") if op)
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"unknown op(s) {unknown or text!r}: choose from {', '.join(OPS)}")
    return ops


def print_table(results: list[dict]) -> None:
    print(
        f"{'op':<30} {'case':<40} {'op us min/med/max':>24} {'ref us min/med/max':>24} {'ref/op':>7} ok"
        f" {'baseline/op':>11}"
    )
    for r in results:
        k, f = r["kernel_us"], r["ref_us"]
        vs_baseline = f" {r['speedup_vs_baseline']:>11.2f}" if "baseline_us" in r else ""
        print(
            f"{r['op']:<30} {r['case']:<40} {k['min']:>8.1f}/{k['median']:>7.1f}/{k['max']:>7.1f} "
            f"{f['min']:>8.1f}/{f['median']:>7.1f}/{f['max']:>7.1f} {r['speedup']:>7.2f} "
            f"{'yes' if r['matches'] else 'NO ':<3}{vs_baseline}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and 3 repeats (CI)")
    parser.add_argument("--ops", type=op_list, default=OPS, help=f"comma-separated, of {', '.join(OPS)}")
    parser.add_argument("--weight", type=weight_shape, action="append", default=[], metavar="OUTxIN",
                        help="an extra weight shape for the linear ops (repeatable)")  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_ops.load():
        sys.exit(
            "kernels_bench: the C++ ops are not available here (no AVX2 + FMA, or no compiler; see the log)"
        )
    model_dir = prepare_model(None)
    config = json.loads((model_dir / "config.json").read_text())
    shapes = Shapes(config)
    shapes.extra_linears = {f"weight{n}": shape for n, shape in enumerate(args.weight, 1)}
    repeats = 3 if args.quick else args.repeats
    results, skipped = run(shapes, args.quick, repeats, args.ops)
    print_table(results)
    for reason in skipped:
        print(f"skipped {reason}")
    report = {
        "model": model_dir.name,
        "shapes": vars(shapes),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "quick": args.quick,
        "results": results,
        "skipped": skipped,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    if not all(r["matches"] for r in results):
        sys.exit("kernels_bench: an op disagrees with its reference (the 'ok' column)")


if __name__ == "__main__":
    main()
