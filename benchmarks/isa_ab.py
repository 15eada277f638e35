"""The AVX2 and AVX-512 builds of the CPU kernels (kernels/cpu_ops.py, ISAS) against each other,
A/B in one process, at the weight shapes of the embedded SmolLM2-135M.

    python benchmarks/isa_ab.py --json FILE [--repeats 15] [--threads 1] [--rows 1,4]

Both builds are loaded side by side (their ops live in their own torch.ops namespaces). Per case
(an op, a weight of SmolLM2's shapes, a number of rows) each repeat times the AVX2 op and then the
AVX-512 one on the same inputs, alternating, so that a load spike hits both; the table gives the
min / median microseconds per call and avx2 / avx512 of the medians (above 1, the AVX-512 build is
faster). Every case also checks that the two builds agree (float ops to rounding, the 8-bit op
exactly), so a figure never comes from a wrong result. A CPU without AVX-512 VNNI exits with a note.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_ops
from services.gpu_worker.loader import prepare_model

CALLS_PER_SAMPLE = 20


def weight_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of a decoder layer's four projections and the LM head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    return {
        "qkv": (qkv, hidden),
        "o_proj": (hidden, config["num_attention_heads"] * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (config["vocab_size"], hidden),
    }


def time_us(op, args: tuple) -> float:
    start = time.perf_counter()
    for _ in range(CALLS_PER_SAMPLE):
        op(*args)
    return (time.perf_counter() - start) / CALLS_PER_SAMPLE * 1e6


def cases(shapes: dict[str, tuple[int, int]], rows: list[int], seed: int = 0):
    """(op, weight name, rows, the op's name in torch.ops, its arguments) for each case."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    gen = torch.Generator().manual_seed(seed)
    for name, (out, inp) in shapes.items():
        weight = torch.randn(out, inp, generator=gen) * 0.05
        for num_rows in rows:
            x = torch.randn(num_rows, inp, generator=gen)
            for fmt in ("Q4_1", "Q8_0"):
                raw = quantize(weight.numpy(), GGMLQuantizationType[fmt])
                blocks = torch.from_numpy(cpu_ops.to_lanes(raw, fmt))
                yield (
                    f"few_rows_linear_quantized {fmt}",
                    name,
                    num_rows,
                    "few_rows_linear_quantized",
                    (x, blocks, fmt),
                )
                yield (
                    f"linear_quantized_int8 {fmt}",
                    name,
                    num_rows,
                    "linear_quantized_int8",
                    (x, blocks, fmt),
                )
            if name != "lm_head":  # float32 copies of the layers' weights only: the head's is 113 MB
                yield "few_rows_linear float32", name, num_rows, "few_rows_linear", (x, weight, None)


def run(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int) -> list[dict]:
    narrow, wide = (getattr(torch.ops, isa.namespace) for isa in cpu_ops.ISAS.values())
    results = []
    for op, weight, num_rows, name, args in cases(shapes, rows):
        a, b = getattr(narrow, name), getattr(wide, name)
        expected, got = a(*args), b(*args)
        exact = name == "linear_quantized_int8"
        matches = torch.equal(got, expected) if exact else torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
        samples: dict[str, list[float]] = {"avx2": [], "avx512": []}
        for _ in range(repeats):
            samples["avx2"].append(time_us(a, args))
            samples["avx512"].append(time_us(b, args))
        stats = {isa: {"min": min(s), "median": statistics.median(s)} for isa, s in samples.items()}
        results.append({
            "op": op, "weight": weight, "shape": list(shapes[weight]), "rows": num_rows, "us": stats,
            "avx2_over_avx512": stats["avx2"]["median"] / stats["avx512"]["median"], "matches": matches,
        })  # fmt: skip
    return results


def print_table(results: list[dict]) -> None:
    print(
        f"{'op':<32} {'weight':<9} {'rows':>4} {'avx2 us min/med':>18} {'avx512 us min/med':>18} {'avx2/avx512':>11} ok"
    )
    for r in results:
        n, w = r["us"]["avx2"], r["us"]["avx512"]
        print(
            f"{r['op']:<32} {r['weight']:<9} {r['rows']:>4} {n['min']:>9.1f}/{n['median']:>8.1f} "
            f"{w['min']:>9.1f}/{w['median']:>8.1f} {r['avx2_over_avx512']:>11.2f} {'yes' if r['matches'] else 'NO'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--rows", type=lambda t: [int(r) for r in t.split(",")], default=[1, cpu_ops.MAX_LINEAR_ROWS]
    )
    args = parser.parse_args()
    if cpu_ops.available_isas() != list(cpu_ops.ISAS):
        sys.exit("isa_ab: this CPU lacks AVX-512 F/BW/VL/DQ or VNNI, so it runs only the AVX2 build")
    if not all(cpu_ops.load_isa(name) for name in cpu_ops.ISAS):
        sys.exit("isa_ab: a build of the C++ ops failed (no compiler? see the log)")
    torch.set_num_threads(args.threads)
    config = json.loads((prepare_model(None) / "config.json").read_text())
    shapes = weight_shapes(config)
    results = run(shapes, args.rows, args.repeats)
    print_table(results)
    float_ops = [r["avx2_over_avx512"] for r in results if r["op"].startswith("few_rows")]
    print(
        f"few-rows float ops, avx2 / avx512 of the medians: geometric mean {float(np.exp(np.mean(np.log(float_ops)))):.2f}"
    )
    report = {"threads": args.threads, "repeats": args.repeats, "shapes": shapes, "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    if not all(r["matches"] for r in results):
        sys.exit("isa_ab: the two builds disagree (the 'ok' column)")


if __name__ == "__main__":
    main()
