"""Same-run A/B of a fused weight whose parts mix K-quant formats (Q4_K_M's Q4_K q / k with Q6_K v):
multiplied from its blocks (what the worker does) or from its float32 dequantization.

    python benchmarks/mixed_quant_ab.py [--shape small|8b] [--threads 1] [--reps 15]

Writes once (into /tmp) a random Llama whose projections are random K-quant super-blocks, as
converting a Q4_K_M GGUF stores them: q, k, o, gate, up Q4_K; v, down Q6_K. `small` is 8 layers of
hidden 1024, `8b` 2 layers of Llama-3-8B's shapes. Loads it three times: as the worker does (the
mixed qkv from its blocks, each layer one C++ op), the same run op by op (as the worker did while
the one-op layer took one format per weight), and with mixed fused weights left float32 (their
layer one C++ op). Prints the median and minimum process CPU ms of decode steps of 1 and 4
sequences, the three alternating within each rep, and each side's ratio to float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.worker_profile import Blocks, decode_plan
from services.gpu_worker import loader
from services.gpu_worker import model as model_module
from services.gpu_worker.model_runner import ModelRunner

FORMATS = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
           "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"}  # fmt: skip
# hidden, intermediate, layers, heads, KV heads, head_dim, vocabulary
SHAPES = {"small": (1024, 2816, 8, 16, 4, 64, 40960), "8b": (4096, 14336, 2, 32, 8, 128, 40960)}


def write_model(out: Path, shape: str) -> Path:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    from tests.test_kernels import random_k_quant_blocks

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    h, inter, num_layers, heads, kv_heads, d, vocab = SHAPES[shape]
    rng = np.random.default_rng(0)
    weights = {
        "model.embed_tokens.weight": (rng.standard_normal((vocab, h)) * 0.02).astype(np.float32),
        "lm_head.weight": (rng.standard_normal((vocab, h)) * 0.02).astype(np.float32),
        "model.norm.weight": np.ones(h, np.float32),
    }
    shapes = {"q_proj": (heads * d, h), "k_proj": (kv_heads * d, h), "v_proj": (kv_heads * d, h),
              "o_proj": (h, heads * d), "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}  # fmt: skip
    blocks, formats = {}, {}
    for i in range(num_layers):
        weights[f"model.layers.{i}.input_layernorm.weight"] = np.ones(h, np.float32)
        weights[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(h, np.float32)
        for projection, (rows, cols) in shapes.items():
            module = "self_attn" if projection[0] in "qkvo" else "mlp"
            name = f"model.layers.{i}.{module}.{projection}.weight"
            fmt = FORMATS[projection]
            blocks[name] = random_k_quant_blocks(fmt, rows, cols, seed=len(blocks))
            formats[name] = fmt
            weights[name] = dequantize(blocks[name], GGMLQuantizationType[fmt]).astype(np.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(blocks, str(out / loader.QUANTIZED_FILE), metadata={"formats": json.dumps(formats)})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": d, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    model_dir = write_model(Path(f"/tmp/brigade-mixed-k-quants-{args.shape}"), args.shape)

    def runner() -> ModelRunner:
        return ModelRunner(model_dir, dtype="float32", kv_cache_bytes=256 << 20, threads=args.threads)

    runners = {"one op": runner(), "op by op": runner()}
    runners["op by op"].model.has_one_op_layers = False
    blocks_of = model_module.blocks_of
    model_module.blocks_of = lambda parts, formats: (
        blocks_of(parts, formats) if len(set(formats)) == 1 else None
    )
    runners["float32"] = runner()
    model_module.blocks_of = blocks_of
    assert isinstance(runners["one op"].model.layers[0].quantized[0], model_module.MixedQuantizedWeight)
    assert runners["float32"].model.layers[0].quantized[0] is None
    rng, tables = np.random.default_rng(0), Blocks()
    for batch in (1, 4):
        plan = decode_plan(tables, batch, 128, rng)
        cpu_ms: dict[str, list[float]] = {name: [] for name in runners}
        for r in runners.values():
            r.execute(*plan)  # warm-up
        for _ in range(args.reps):
            for name, r in runners.items():
                start = time.process_time()
                r.execute(*plan)
                cpu_ms[name].append((time.process_time() - start) * 1e3)
        median = {name: statistics.median(ms) for name, ms in cpu_ms.items()}
        least = {name: min(ms) for name, ms in cpu_ms.items()}
        ratios = {name: f" ({median[name] / median['float32']:.2f} / {least[name] / least['float32']:.2f})"
                  for name in runners if name != "float32"}  # fmt: skip
        sides = ", ".join(
            f"{name} {median[name]:.1f} / {least[name]:.1f} ms{ratios.get(name, '')}" for name in runners
        )
        print(
            f"{args.shape} decode{batch} ({args.threads} threads), median / min (/ float32): {sides}",
            flush=True,
        )


if __name__ == "__main__":
    main()
