"""Grammar-engine benchmark: xgrammar vs llguidance under the SmolLM2 tokenizer.

- import: wall time of `import <library>` in a fresh interpreter, and whether that pulls in torch
  (the scheduler process does not import torch today, and the light stages never may);
- tokenizer: building the library's tokenizer object from the model's tokenizer (once per process);
- compile: a 20-property JSON schema to a ready matcher, each repeat a distinct schema (a new
  description) so that no cache of either library can answer;
- mask: 64 matchers, each walking through the tokens of its own valid JSON instance of that schema;
  per step one batched fill of the packed int32 bitmask [64, ceil(vocab/32)] (the libraries'
  parallel APIs) and one accept per row. Every row stays live for the whole walk;
- worker apply: masking 64 float32 score rows with a mid-walk bitmask on the CPU
  (services/gpu_worker/grammar_mask.py).

Each measurement runs `--repeats` times; the table reports min and median (the host is shared).

    python benchmarks/grammar_bench.py --json results/grammar.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Run as a script from anywhere: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCH = 64
LIBRARIES = ("llguidance", "xgrammar")


def schema_20(tag: int) -> dict:
    """20 properties of every JSON kind a structured-output request uses; `tag` makes it distinct."""
    props: dict[str, dict] = {}
    for i in range(4):
        props[f"name_{i}"] = {"type": "string", "maxLength": 24}
        props[f"count_{i}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
        props[f"score_{i}"] = {"type": "number"}
        props[f"flag_{i}"] = {"type": "boolean"}
    props["color"] = {"enum": ["red", "green", "blue"]}
    props["tags"] = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}
    props["point"] = {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"],
        "additionalProperties": False,
    }
    props["note"] = {"type": "string", "maxLength": 40}
    return {
        "type": "object",
        "description": f"bench schema {tag}",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def instance(rng: random.Random) -> dict:
    """A valid instance of schema_20, in property order (the grammars fix the order)."""
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma"]
    out: dict = {}
    for i in range(4):
        out[f"name_{i}"] = rng.choice(words) + str(rng.randrange(100))
        out[f"count_{i}"] = rng.randrange(1001)
        out[f"score_{i}"] = round(rng.uniform(-100, 100), 3)
        out[f"flag_{i}"] = rng.random() < 0.5
    out["color"] = rng.choice(["red", "green", "blue"])
    out["tags"] = [rng.choice(words) for _ in range(rng.randrange(5))]
    out["point"] = {"x": rng.randrange(-50, 50), "y": rng.randrange(-50, 50)}
    out["note"] = " ".join(rng.choice(words) for _ in range(4))
    return out


def import_cost(library: str) -> dict:
    code = f"import sys, time; t = time.perf_counter(); import {library}; "
    code += "print(time.perf_counter() - t, 'torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    seconds, torch, transformers = out.stdout.split()
    return {
        "import_s": float(seconds),
        "imports_torch": torch == "True",
        "imports_transformers": transformers == "True",
    }


def summary(samples: list[float]) -> dict:
    return {"min": min(samples), "median": statistics.median(samples), "samples": samples}


class LlguidanceEngine:
    name = "llguidance"

    def __init__(self, model_dir: Path, vocab_size: int, eos_id: int, threads: int) -> None:
        import llguidance

        self.llg = llguidance
        start = time.perf_counter()
        text = (model_dir / "tokenizer.json").read_text()
        self.tokenizer = llguidance.LLTokenizer(
            text, n_vocab=vocab_size, eos_token=eos_id, slices=llguidance.LLTokenizer.json_slices()
        )
        self.tokenizer_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matchers(self, compiled, n: int) -> list:
        # A request's matcher is a copy of the compiled one (what services/scheduler/grammar.py does).
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )

    def accept(self, matchers: list, tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            assert m.consume_token(t), m.get_error()


class XgrammarEngine:
    name = "xgrammar"

    def __init__(self, model_dir: Path, vocab_size: int, eos_id: int, threads: int) -> None:
        import torch
        import xgrammar
        from transformers import AutoTokenizer

        self.torch = torch
        self.xgr = xgrammar
        start = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(model_dir)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos_id])
        self.tokenizer_s = time.perf_counter() - start
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, self.torch.from_numpy(bitmask))

    def accept(self, matchers: list, tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            assert m.accept_token(t)


def bench_engine(engine, token_rows: list[list[int]], vocab_size: int, repeats: int) -> dict:
    compile_s = []
    for r in range(repeats):
        start = time.perf_counter()
        engine.compile(schema_20(1000 + r))
        compile_s.append(time.perf_counter() - start)
    compiled = engine.compile(schema_20(0))
    steps = min(len(row) for row in token_rows)
    bitmask = np.zeros((len(token_rows), (vocab_size + 31) // 32), dtype=np.int32)
    fill_ms, accept_ms = [], []
    for _ in range(repeats):
        matchers = engine.matchers(compiled, len(token_rows))
        fill_total = accept_total = 0.0
        for step in range(steps):
            start = time.perf_counter()
            engine.fill(matchers, bitmask)
            fill_total += time.perf_counter() - start
            tokens = [row[step] for row in token_rows]
            # The walk must stay valid: every next token is allowed by the mask just filled.
            for i, t in enumerate(tokens):
                assert bitmask[i, t >> 5] >> (t & 31) & 1, (engine.name, step, i, t)
            if step == steps // 2:
                mid_walk_mask = bitmask.copy()
            start = time.perf_counter()
            engine.accept(matchers, tokens)
            accept_total += time.perf_counter() - start
        fill_ms.append(fill_total / steps * 1e3)
        accept_ms.append(accept_total / steps * 1e3)
    return {
        "tokenizer_s": engine.tokenizer_s,
        "compile_ms": summary([s * 1e3 for s in compile_s]),
        "mask_fill_ms_per_step_batch64": summary(fill_ms),
        "accept_ms_per_step_batch64": summary(accept_ms),
        "steps": steps,
    }, mid_walk_mask


def bench_worker_apply(bitmask: np.ndarray, vocab_size: int, repeats: int) -> dict:
    """The worker's masking of 64 float32 rows (services/gpu_worker/grammar_mask.py, CPU path)."""
    import torch

    from services.gpu_worker.grammar_mask import apply_grammar_bitmask

    scores = torch.randn(len(bitmask), vocab_size)
    rows = np.arange(len(bitmask), dtype=np.int32)
    samples = []
    for _ in range(repeats * 10):
        start = time.perf_counter()
        apply_grammar_bitmask(scores, bitmask, rows)
        samples.append((time.perf_counter() - start) * 1e3)
    return summary(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from tokenizers import Tokenizer

    from services.gpu_worker.loader import prepare_model

    model_dir = prepare_model(None)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = config["vocab_size"]
    eos_id = config["eos_token_id"]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(0)
    texts = [json.dumps(instance(rng), separators=(",", ":")) for _ in range(BATCH)]
    token_rows = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]

    result: dict = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "threads": args.threads,
        "vocab_size": vocab_size,
        "batch": BATCH,
        "repeats": args.repeats,
        "libraries": {},
    }
    for name, cls in (("llguidance", LlguidanceEngine), ("xgrammar", XgrammarEngine)):
        entry = {"version": importlib.metadata.version(name), **import_cost(name)}
        engine = cls(model_dir, vocab_size, eos_id, args.threads)
        measured, mid_walk_mask = bench_engine(engine, token_rows, vocab_size, args.repeats)
        entry.update(measured)
        result["libraries"][name] = entry
    result["worker_apply_ms_batch64"] = bench_worker_apply(mid_walk_mask, vocab_size, args.repeats)

    print(f"batch {BATCH}, {args.threads} threads, {args.repeats} repeats, load {result['load_avg'][0]:.1f}")
    print(
        f"{'library':<12} {'import s':>9} {'torch?':>7} {'tokenizer s':>12} {'compile ms':>16} {'mask ms/step':>16} {'accept ms/step':>16}"
    )

    def mm(s: dict) -> str:
        return f"{s['min']:.2f}/{s['median']:.2f}"

    for name, e in result["libraries"].items():
        print(
            f"{name:<12} {e['import_s']:>9.2f} {e['imports_torch']!s:>7} {e['tokenizer_s']:>12.2f} "
            f"{mm(e['compile_ms']):>16} {mm(e['mask_fill_ms_per_step_batch64']):>16} "
            f"{mm(e['accept_ms_per_step_batch64']):>16}"
        )
    print("(min/median; mask and accept: one step of all 64 rows, so per row-token divide by 64)")
    print(f"worker CPU masking of 64 float32 rows, ms: {mm(result['worker_apply_ms_batch64'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
