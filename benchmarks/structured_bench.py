"""Structured-output serving benchmark (issue 18's targets), constrained against unconstrained in
one run of one Brigade, through the SDK:

    python benchmarks/structured_bench.py [--run DIR] [--set key=value ...] [--batch 64]
        [--output-len 48] [--ttft-requests 10] [--json FILE] [--smoke]

- **Decode throughput at batch B**: B requests at once, every one under a 10-property JSON schema
  (whose outputs are longer than `--output-len`, so every row decodes `--output-len` tokens and
  ends by length), against B unconstrained requests of the same length (`ignore_eos`). The decode
  rate counts the tokens after the last request's first token, over the time they took (prefill
  excluded). Target: constrained >= 0.9x unconstrained.
- **TTFT** (one request at a time, interleaved so that load drifts hit all three alike): no
  constraint, a schema already cached (target: <= +5 ms at p50), and a new schema every request
  (a property name varies, so each one compiles: its p50 is reported).

Both sides run back to back in the same invocation; on a shared host the ratios are what count.
Prints a table and writes JSON (`--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import peers  # noqa: E402
from benchmarks.serve import started_brigade  # noqa: E402
from client.async_sdk import AsyncClient  # noqa: E402
from ipc.messages import StructuredOutput  # noqa: E402

REQUEST_TIMEOUT_S = 900.0
PROMPT = "Write a detailed product record for a household item as JSON."
TARGET_DECODE_RATIO = 0.9
TARGET_CACHED_TTFT_MS = 5.0


def ten_property_schema(tag: str = "") -> dict:
    """Ten properties whose strings are long enough that no output completes in a few dozen tokens.
    `tag` renames one property: a different schema text, so a compile of its own."""
    text = {"type": "string", "minLength": 24, "maxLength": 48}
    props = {
        f"name{tag}": text,
        "brand": text,
        "category": {"enum": ["kitchen", "garden", "bath", "office"]},
        "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "stock": {"type": "integer", "minimum": 0, "maximum": 100000},
        "in_sale": {"type": "boolean"},
        "colour": text,
        "material": text,
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
        "description": text,
    }
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


async def timed_stream(client: AsyncClient, **kwargs: Any) -> dict:
    """One streamed request: its first-token time and the time of each delta (perf_counter)."""
    start = time.perf_counter()
    times: list[tuple[float, int]] = []
    finish = None
    stream = client.stream(messages=[{"role": "user", "content": PROMPT}], temperature=0.0, **kwargs)
    async with contextlib.aclosing(stream):
        async for delta in stream:
            if delta.token_ids:
                times.append((time.perf_counter(), len(delta.token_ids)))
            finish = delta.finish_reason
    return {"start": start, "times": times, "finish_reason": finish}


def decode_stats(results: list[dict]) -> dict:
    """Tokens after the last first token, over the time they took (the steady decode of the batch)."""
    t0 = max(r["times"][0][0] for r in results)
    end = max(r["times"][-1][0] for r in results)
    tokens = sum(n for r in results for t, n in r["times"] if t > t0)
    total = sum(n for r in results for _, n in r["times"])
    return {
        "decode_tok_s": tokens / (end - t0) if end > t0 else float("nan"),
        "output_tokens": total,
        "wall_s": end - min(r["start"] for r in results),
        "finish_reasons": sorted({r["finish_reason"] for r in results}),
    }


async def decode_phase(client: AsyncClient, batch: int, output_len: int, schema: dict) -> dict[str, dict]:
    spec = StructuredOutput("json", json.dumps(schema))
    out = {}
    for name, kwargs in (
        ("unconstrained", {"ignore_eos": True}),
        ("constrained", {"structured": spec}),
        # The same again, the other order first: a load drift between the two halves cancels out.
        ("constrained_2", {"structured": spec}),
        ("unconstrained_2", {"ignore_eos": True}),
    ):
        results = await asyncio.gather(
            *(timed_stream(client, max_tokens=output_len, **kwargs) for _ in range(batch))
        )
        out[name] = decode_stats(list(results))
        print(f"  {name:<16} {out[name]['decode_tok_s']:8.1f} decode tok/s  {out[name]['finish_reasons']}")
    return out


async def ttft_phase(client: AsyncClient, num_requests: int) -> dict[str, list[float]]:
    cached = StructuredOutput("json", json.dumps(ten_property_schema()))
    await timed_stream(client, max_tokens=1, structured=cached)  # compiled and cached from here on
    ttfts: dict[str, list[float]] = {"unconstrained": [], "cached_schema": [], "new_schema": []}
    nonce = f"{os.getpid()}{time.time_ns()}"  # new to this run's cache, whatever ran before
    for i in range(num_requests):
        cases = {
            "unconstrained": {},
            "cached_schema": {"structured": cached},
            "new_schema": {
                "structured": StructuredOutput("json", json.dumps(ten_property_schema(f"_{nonce}_{i}")))
            },
        }
        for name, kwargs in cases.items():
            result = await timed_stream(client, max_tokens=1, **kwargs)
            ttfts[name].append((result["times"][0][0] - result["start"]) * 1000)
    return ttfts


def report(decode: dict[str, dict], ttfts: dict[str, list[float]], args: argparse.Namespace) -> dict:
    unconstrained = (decode["unconstrained"]["decode_tok_s"] + decode["unconstrained_2"]["decode_tok_s"]) / 2
    constrained = (decode["constrained"]["decode_tok_s"] + decode["constrained_2"]["decode_tok_s"]) / 2
    p50 = {name: statistics.median(values) for name, values in ttfts.items()}
    out = {
        "batch": args.batch,
        "output_len": args.output_len,
        "decode": decode,
        "decode_tok_s": {"unconstrained": unconstrained, "constrained": constrained},
        "decode_ratio": constrained / unconstrained,
        "ttft_ms": ttfts,
        "ttft_p50_ms": p50,
        "cached_schema_ttft_delta_ms": p50["cached_schema"] - p50["unconstrained"],
        "new_schema_ttft_delta_ms": p50["new_schema"] - p50["unconstrained"],
        "targets": {
            "decode_ratio_ge_0.9": constrained / unconstrained >= TARGET_DECODE_RATIO,
            "cached_ttft_delta_le_5ms": p50["cached_schema"] - p50["unconstrained"] <= TARGET_CACHED_TTFT_MS,
        },
        "loadavg_1m": os.getloadavg()[0],
    }
    print()
    print(
        f"| measure (batch {args.batch}, {args.output_len} tokens) | unconstrained | constrained | ratio / delta |"
    )
    print("| --- | --- | --- | --- |")
    print(f"| decode tok/s | {unconstrained:.1f} | {constrained:.1f} | {out['decode_ratio']:.3f}x |")
    for name in ("cached_schema", "new_schema"):
        delta = p50[name] - p50["unconstrained"]
        print(
            f"| p50 TTFT, {name.replace('_', ' ')} (ms) | {p50['unconstrained']:.1f} | {p50[name]:.1f} | {delta:+.1f} ms |"
        )
    print(f"targets: {out['targets']}  (load average {out['loadavg_1m']:.1f})")
    return out


async def bench(run_dir: Path, args: argparse.Namespace) -> dict:
    async with AsyncClient(run_dir, timeout=REQUEST_TIMEOUT_S) as client:
        await timed_stream(client, max_tokens=2)  # warm up
        print(f"decode, batch {args.batch}:")
        decode = await decode_phase(client, args.batch, args.output_len, ten_property_schema())
        print(f"TTFT, {args.ttft_requests} requests of each kind, one at a time")
        ttfts = await ttft_phase(client, args.ttft_requests)
    return report(decode, ttfts, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", help="an already running Brigade's run dir (else one is started here)")
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], help="config override for a started run")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--ttft-requests", type=int, default=10)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes: checks that it runs, measures nothing"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.output_len, args.ttft_requests = 2, 4, 2
    if args.run:
        out = asyncio.run(bench(Path(args.run), args))
    else:
        overrides = [
            f"model.dtype={args.dtype}",
            f"gateway.port={peers.free_port()}",
            f"engine.max_num_seqs={max(args.batch, 8)}",
            *args.set,
        ]
        with started_brigade(args.config, overrides, "brigade-structured-bench-") as run:
            out = asyncio.run(bench(run.run_dir, args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
