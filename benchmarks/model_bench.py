"""Decode throughput of the ModelRunner vs HF transformers `generate`, against the roofline.

    python benchmarks/model_bench.py --json FILE [--dtype bfloat16] [--quick]

Both sides run the embedded SmolLM2-135M on the same static batches (random prompts of equal
length, greedy, no eos). Decode tokens/s excludes the prefill: the runner times its decode steps,
HF's is (generate(N) - generate(1)) over N - 1 steps. Roofline = the matmul GFLOP/s measured here in
the same dtype / (2 x parameters).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.messages import StepHeader
from ipc.step_plan import STEP_PLAN, Dim
from services.gpu_worker.loader import prepare_model
from services.gpu_worker.model_runner import ModelRunner

BATCHES = (1, 16, 64)
TARGETS = {"64": 1.5, "1": 1.2}  # runner / HF, in bfloat16


def static_plan(
    tokens: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray, block_size: int
) -> tuple[dict[str, np.ndarray], StepHeader]:
    """A greedy step plan for a static batch; tokens [S, q_len] of the sequences."""
    s, q_len = tokens.shape
    flat_pos = positions.reshape(-1)
    seq_of = np.repeat(np.arange(s), q_len)
    slots = tables[seq_of, flat_pos // block_size] * block_size + flat_pos % block_size
    arrays = STEP_PLAN.neutral(
        {Dim.TOKENS: s * q_len, Dim.ROWS: s},
        rows=np.arange(s),
        input_ids=tokens.reshape(-1),
        positions=flat_pos,
        slot_mapping=slots,
        query_start_loc=np.arange(s + 1) * q_len,
        seq_lens=seq_lens,
        block_tables=tables,
        sample_positions=seq_lens,
    )
    return arrays, StepHeader(step_id=0, num_tokens=s * q_len, num_seqs=s, max_top_logprobs=0)


def runner_decode_tok_s(runner: ModelRunner, prompts: np.ndarray, new_tokens: int) -> float:
    """Prefill once, then time `new_tokens - 1` decode steps."""
    batch, prompt_len = prompts.shape
    bs = runner.block_size
    blocks_per_seq = -(-(prompt_len + new_tokens) // bs)
    # Interleaved block ids, as a running scheduler would hand them out.
    tables = (np.arange(blocks_per_seq)[None, :] * batch + np.arange(batch)[:, None]).astype(np.int32)
    positions = np.tile(np.arange(prompt_len), (batch, 1))
    out = runner.execute(*static_plan(prompts, positions, np.full(batch, prompt_len), tables, bs))
    start = time.perf_counter()
    for step in range(1, new_tokens):
        pos = prompt_len + step - 1
        tokens = out["sampled_ids"][:, None]
        plan = static_plan(tokens, np.full((batch, 1), pos), np.full(batch, pos + 1), tables, bs)
        out = runner.execute(*plan)
    return batch * (new_tokens - 1) / (time.perf_counter() - start)


def hf_decode_tok_s(hf, prompts: np.ndarray, new_tokens: int) -> float:
    ids = torch.from_numpy(prompts.astype(np.int64))

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - start

    prefill = timed(1)
    return prompts.shape[0] * (new_tokens - 1) / max(timed(new_tokens) - prefill, 1e-9)


def matmul_gflops(dtype: torch.dtype, size: int = 1024, reps: int = 10) -> float:
    """x @ W^T, the layout of every serving GEMM (torch's half-precision mm of two row-major
    operands takes a much slower path on CPUs)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.nn.functional.linear(a, b)
    start = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(a, b)
    return 2 * size**3 * reps / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="short prompts and few new tokens")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_len, new_tokens = (32, 8) if args.quick else (128, 128)
    model_dir = prepare_model(None)
    dtype = getattr(torch, args.dtype)
    max_batch = max(BATCHES)
    config = json.loads((model_dir / "config.json").read_text())
    blocks = max_batch * -(-(prompt_len + new_tokens) // 16)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_bytes = blocks * 2 * config["num_hidden_layers"] * 16 * config["num_key_value_heads"] * head_dim
    kv_bytes *= dtype.itemsize
    runner = ModelRunner(model_dir, dtype=args.dtype, kv_cache_bytes=kv_bytes, threads=args.threads)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    num_params = sum(p.numel() for p in hf.parameters())
    rng = np.random.default_rng(0)
    result: dict = {"dtype": args.dtype, "prompt_len": prompt_len, "new_tokens": new_tokens,
                    "threads": torch.get_num_threads(), "num_params": num_params,
                    "runner_tok_s": {}, "hf_tok_s": {}}  # fmt: skip
    for batch in BATCHES:
        prompts = rng.integers(3, runner.vocab_size, (batch, prompt_len))
        result["runner_tok_s"][str(batch)] = runner_decode_tok_s(runner, prompts, new_tokens)
        result["hf_tok_s"][str(batch)] = hf_decode_tok_s(hf, prompts, new_tokens)
        print(f"batch {batch}: runner {result['runner_tok_s'][str(batch)]:.1f} tok/s, "
              f"hf {result['hf_tok_s'][str(batch)]:.1f} tok/s", flush=True)  # fmt: skip
    gflops = matmul_gflops(dtype)
    result["matmul_gflops"] = gflops
    result["roofline_tok_s"] = gflops * 1e9 / (2 * num_params)
    result["targets"] = {
        b: result["runner_tok_s"][b] >= ratio * result["hf_tok_s"][b] for b, ratio in TARGETS.items()
    }
    print(f"\n{'batch':>5} {'runner tok/s':>13} {'hf tok/s':>10} {'ratio':>6}")
    for b in map(str, BATCHES):
        r, h = result["runner_tok_s"][b], result["hf_tok_s"][b]
        print(f"{b:>5} {r:>13.1f} {h:>10.1f} {r / h:>6.2f}")
    print(f"roofline {result['roofline_tok_s']:.1f} tok/s ({gflops:.1f} GFLOP/s {args.dtype} matmul)")
    for b, ratio in TARGETS.items():
        print(f"target runner >= {ratio}x hf at batch {b}: {'holds' if result['targets'][b] else 'MISSED'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
