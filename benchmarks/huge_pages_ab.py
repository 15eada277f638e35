"""Decode steps of a float32 model with its weights in huge pages against ordinary pages.

    python benchmarks/huge_pages_ab.py --json FILE [--rounds 3] [--batch 1,16] [--steps 48]
        [--threads N] [--hidden 1024] [--layers 8]

A random float32 Llama (SmolLM2's vocabulary and tokenizer, `--hidden` wide, `--layers` deep;
written once under Brigade's cache) is loaded twice into one process through ModelRunner: once
with its weights and KV pages in transparent huge pages (the worker's default,
services/gpu_worker/huge_pages.py) and once in ordinary 4 KB pages (BRIGADE_HUGE_PAGES=0 while
it loads). Each prefills one prompt per sequence, then the two take decode steps in turn (each
first every other step), `--steps` each, `--rounds` times per batch. The report gives the median
step time of each side, their ratio, and the weight bytes each step reads per second against a
plain copy's bandwidth measured in the same run (the physical limit of a memory-bound step).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.model_bench import static_plan
from services.gpu_worker.huge_pages import HUGE_PAGE_BYTES, SWITCH

PROMPT_LEN = 32


def random_llama(hidden: int, layers: int) -> Path:
    """A random float32 Llama of the shape (cached): SmolLM2's vocabulary and tokenizer, an
    intermediate size of 2.75 x hidden, heads of 64 with four query heads a KV head."""
    from benchmarks.peers import brigade_cache

    path = brigade_cache() / "huge-pages-bench" / f"llama-f32-h{hidden}-{layers}l"
    if (path / "config.json").exists():
        return path
    import transformers

    from services.gpu_worker.loader import prepare_model
    from tests.conftest import save_random_model

    smollm2 = prepare_model(None)
    vocab = json.loads((smollm2 / "config.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256, max_position_embeddings=2048,
        tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    print(f"writing a random float32 Llama to {path} (once)", flush=True)
    return save_random_model(config, path, seed=0, std=0.02, tokenizer_from=smollm2)


class Side:
    """One runner of the model and its decode state: a prompt prefilled per sequence, then steps."""

    def __init__(self, model_dir: Path, batch: int, steps: int, huge: bool) -> None:
        from services.gpu_worker.model_runner import ModelRunner

        # huge_page_empty reads the switch at each allocation: this runner's weights follow it.
        before = os.environ.get(SWITCH)
        os.environ[SWITCH] = "1" if huge else "0"
        try:
            self.runner = ModelRunner(model_dir, dtype="float32", kv_cache_bytes=256 << 20)
        finally:
            if before is None:
                del os.environ[SWITCH]
            else:
                os.environ[SWITCH] = before
        model = self.runner.model
        weights = [w for layer in model.layers for w in layer.plain] + [model.lm_head]
        self.weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        large = [w for w in weights if w.nbytes >= HUGE_PAGE_BYTES]
        self.aligned = sum(w.data_ptr() % HUGE_PAGE_BYTES == 0 for w in large) / len(large)
        self.batch, self.bs = batch, self.runner.block_size
        blocks = -(-(PROMPT_LEN + steps + 1) // self.bs)
        self.tables = (np.arange(blocks)[None, :] * batch + np.arange(batch)[:, None]).astype(np.int32)
        prompts = np.random.default_rng(batch).integers(3, self.runner.vocab_size, (batch, PROMPT_LEN))
        positions = np.tile(np.arange(PROMPT_LEN), (batch, 1))
        self.out = self.runner.execute(
            *static_plan(prompts, positions, np.full(batch, PROMPT_LEN), self.tables, self.bs)
        )
        self.position = PROMPT_LEN
        self.times: list[float] = []

    def step(self) -> None:
        b, position = self.batch, self.position
        plan = static_plan(self.out["sampled_ids"][:, None], np.full((b, 1), position),
                           np.full(b, position + 1), self.tables, self.bs)  # fmt: skip
        start = time.perf_counter()
        self.out = self.runner.execute(*plan)
        self.times.append(time.perf_counter() - start)
        self.position += 1


def copy_gb_s(size: int = 1 << 28) -> float:
    """A plain copy of 1 GiB of float32 (read + write): the memory's bandwidth in this run."""
    src, dst = torch.ones(size), torch.empty(size)
    dst.copy_(src)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        samples.append(2 * src.nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", default="1,16", help="sequences a step, comma-separated")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = random_llama(args.hidden, args.layers)
    bandwidth = copy_gb_s()
    rows = []
    print(
        f"copy bandwidth {bandwidth:.1f} GB/s (read + write), {torch.get_num_threads()} threads", flush=True
    )
    print(f"{'batch':>5} {'round':>5} {'huge ms':>8} {'4 KB ms':>8} {'4 KB / huge':>11} "
          f"{'huge GB/s':>9} {'4 KB GB/s':>9}")  # fmt: skip
    for batch in (int(b) for b in args.batch.split(",")):
        for round_ in range(args.rounds):
            huge, ordinary = (
                Side(model_dir, batch, args.steps, True),
                Side(model_dir, batch, args.steps, False),
            )
            assert huge.aligned == 1.0, "the huge-pages side's large weights do not start on huge pages"
            for step in range(args.steps):  # alternating, each side first every other step
                for side in (huge, ordinary) if step % 2 else (ordinary, huge):
                    side.step()
            huge_ms, ordinary_ms = (
                statistics.median(side.times[args.steps // 4 :]) * 1e3 for side in (huge, ordinary)
            )
            row = {
                "batch": batch, "round": round_, "huge_step_ms": huge_ms, "ordinary_step_ms": ordinary_ms,
                "ordinary_over_huge": ordinary_ms / huge_ms, "weight_bytes": huge.weight_bytes,
                "huge_weight_gb_s": huge.weight_bytes / huge_ms / 1e6,
                "ordinary_weight_gb_s": ordinary.weight_bytes / ordinary_ms / 1e6,
            }  # fmt: skip
            rows.append(row)
            print(f"{batch:>5} {round_:>5} {huge_ms:>8.2f} {ordinary_ms:>8.2f} {row['ordinary_over_huge']:>10.2f}x "
                  f"{row['huge_weight_gb_s']:>9.1f} {row['ordinary_weight_gb_s']:>9.1f}", flush=True)  # fmt: skip
            del huge, ordinary
            gc.collect()  # the runners' memory, before the next round's
    report = {
        "model": {"hidden": args.hidden, "layers": args.layers, "dtype": "float32"},
        "threads": torch.get_num_threads(), "copy_gb_s": bandwidth, "rows": rows,
    }  # fmt: skip
    args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
