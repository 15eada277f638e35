"""A worker's model load: its resident memory and decode speed (SmolLM2), and the load time of a
1B-class model from safetensors.

    python benchmarks/load_bench.py memory [--threads N]     # the embedded SmolLM2, float32 CPU
    python benchmarks/load_bench.py load-1b [--dir DIR]      # a random Llama-1B-shaped bf16 checkpoint

`memory` loads a ModelRunner (float32 on the CPU, as a worker does) in a fresh process and prints
its RSS after loading and its high-water mark, then times batch-1 decode steps and a 128-token
prefill. `load-1b` writes (once, into DIR) a checkpoint of Llama 3.2 1B's shapes with random
bfloat16 weights, then, in a fresh process each time, times building the model and loading the
weights (safetensors mmap -> the model's tensors) for dtype bfloat16 and float32 on the CPU.
Each measurement is its own child process so that nothing cached or allocated by an earlier one
counts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Llama 3.2 1B's shapes (1.24B parameters, tied embeddings).
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def child_memory(threads: int | None) -> dict:
    import torch

    from benchmarks.model_bench import static_plan
    from services.gpu_worker.loader import prepare_model
    from services.gpu_worker.model_runner import ModelRunner

    model_dir = prepare_model(None)
    base, _ = rss_mib()
    start = time.perf_counter()
    runner = ModelRunner(model_dir, dtype="float32", kv_cache_bytes=64 << 20, threads=threads)
    load_s = time.perf_counter() - start
    loaded, loaded_peak = rss_mib()
    bs, rng = runner.block_size, np.random.default_rng(0)
    prompt_len, steps = 128, 32
    tables = np.arange(-(-(prompt_len + steps + 4) // bs), dtype=np.int32)[None, :]
    prompt = rng.integers(3, runner.vocab_size, (1, prompt_len))
    prefill = static_plan(prompt, np.arange(prompt_len)[None, :], np.array([prompt_len]), tables, bs)
    runner.execute(*prefill)  # warm-up
    start = time.perf_counter()
    out = runner.execute(*prefill)
    prefill_ms = (time.perf_counter() - start) * 1e3
    times = []
    for step in range(steps):
        pos = prompt_len + step
        plan = static_plan(out["sampled_ids"][:, None], np.array([[pos]]), np.array([pos + 1]), tables, bs)
        start = time.perf_counter()
        out = runner.execute(*plan)
        times.append(time.perf_counter() - start)
    after, peak = rss_mib()
    return {
        "threads": torch.get_num_threads(),
        "rss_before_load_mib": base,
        "rss_loaded_mib": loaded,
        "peak_while_loading_mib": loaded_peak,
        "rss_after_steps_mib": after,
        "peak_mib": peak,
        "load_s": load_s,
        "prefill_128_ms": prefill_ms,
        "decode_step_ms_median": float(np.median(times) * 1e3),
    }


def write_llama_1b(out: Path) -> Path:
    """A Llama-1B-shaped checkpoint of random bfloat16 weights (written once; HF names)."""
    import torch
    from safetensors.torch import save_file

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    c, gen = LLAMA_1B, torch.Generator().manual_seed(0)
    h, d = c["hidden_size"], c["head_dim"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rand(c["vocab_size"], h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(c["num_attention_heads"] * d, h),
            p + "self_attn.k_proj.weight": rand(c["num_key_value_heads"] * d, h),
            p + "self_attn.v_proj.weight": rand(c["num_key_value_heads"] * d, h),
            p + "self_attn.o_proj.weight": rand(h, c["num_attention_heads"] * d),
            p + "mlp.gate_proj.weight": rand(c["intermediate_size"], h),
            p + "mlp.up_proj.weight": rand(c["intermediate_size"], h),
            p + "mlp.down_proj.weight": rand(h, c["intermediate_size"]),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2))
    return out


def child_load(model_dir: Path, dtype_name: str) -> dict:
    import torch

    from services.gpu_worker.architectures import ModelConfig
    from services.gpu_worker.loader import load_weights
    from services.gpu_worker.model import LlamaModel

    config = ModelConfig.from_dir(model_dir)
    start = time.perf_counter()
    model = LlamaModel(config, getattr(torch, dtype_name), torch.device("cpu"), 16)
    built = time.perf_counter()
    load_weights(model, model_dir)
    done = time.perf_counter()
    rss, peak = rss_mib()
    return {
        "dtype": dtype_name,
        "threads": torch.get_num_threads(),
        "allocate_s": built - start,
        "load_weights_s": done - built,
        "total_s": done - start,
        "rss_mib": rss,
        "peak_mib": peak,
    }


def in_child(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["memory", "load-1b"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/brigade-llama-1b-random"))
    parser.add_argument(
        "--dtype", action="append", choices=["bfloat16", "float32"], help="load-1b: repeatable"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one measurement, in this fresh process
        result = child_memory(args.threads) if args.what == "memory" else child_load(args.dir, args.dtype[0])
        print(json.dumps(result))
        return
    threads = ["--threads", str(args.threads)] if args.threads else []
    if args.what == "memory":
        print(json.dumps(in_child("memory", *threads), indent=2))
        return
    start = time.perf_counter()
    write_llama_1b(args.dir)
    print(f"checkpoint {args.dir} ({(args.dir / 'model.safetensors').stat().st_size / 2**30:.2f} GiB) "
          f"ready in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    for dtype in args.dtype or ["bfloat16", "float32"]:
        print(json.dumps(in_child("load-1b", "--dir", str(args.dir), "--dtype", dtype)), flush=True)


if __name__ == "__main__":
    main()
