"""Speculative decoding benchmark (docs/speculative.md): time per output token at one stream,
n-gram speculation on against off, on prompts that restate or edit a given text and on open chat.

    python benchmarks/spec_bench.py [--rounds 3] [--output-len 96] [--num-speculative-tokens 4]
        [--set key=value ...] [--json FILE]

Two Brigade runs of the same config serve side by side, one with `speculative.method: ngram`;
each prompt goes to one and then the other, alternating which goes first, one request at a time
(c=1), so both see the same host load. Greedy, ignore_eos, the same max_tokens. Per prompt set it
reports TPOT p50 / mean of each, their ratio, and the mean acceptance length (1 + accepted
proposals per verification, from the run's spec_decode_* counters on /metrics).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import peers  # noqa: E402
from benchmarks.serve import READY_TIMEOUT_S, BrigadeProcess, machine_info, percentile  # noqa: E402

TEXTS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and "
    "wrote the weather in a leather logbook before the fishing boats came past the rocks.",
    "def total_price(items):\n    total = 0\n    for item in items:\n        total = total + item.price * "
    "item.quantity\n    return total\n",
    "Order 5521 was shipped on March 3 to Dana Whitfield, 14 Elm Street, Springfield. It held two "
    "blue notebooks, one desk lamp and a box of pencils, and the invoice total was 48 dollars.",
    "Our team meets every Monday at nine to review the backlog, assign the week's tasks and check "
    "the release schedule; notes go to the shared drive by noon.",
]
RESTATE = [
    f"Repeat the following text exactly as it is:\n\n{TEXTS[0]}",
    f"Rename the function total_price to order_total and return the code:\n\n{TEXTS[1]}",
    f"Extract the name, the street address and the invoice total from this text, quoting it:\n\n{TEXTS[2]}",
    f"Rewrite this note, keeping every word but changing Monday to Tuesday:\n\n{TEXTS[3]}",
]
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are three tips for staying focused while studying?",
    "Explain why the sky is blue to a ten year old.",
    "Suggest a name for a coffee shop and explain your choice.",
]
SETS = {"restate": RESTATE, "chat": CHAT}
COUNTERS = ("brigade:spec_decode_num_drafts_total", "brigade:spec_decode_num_accepted_tokens_total")


def tpot_ms(client, prompt: str, output_len: int) -> float:
    """One streamed greedy chat request; its time per output token after the first, in ms."""
    times: list[tuple[float, int]] = []
    for delta in client.stream(
        messages=[{"role": "user", "content": prompt}],
        max_tokens=output_len,
        temperature=0.0,
        ignore_eos=True,
        timeout=600,
    ):
        if delta.token_ids:
            times.append((time.perf_counter(), len(delta.token_ids)))
    num_tokens = sum(n for _, n in times)
    if num_tokens < 2:
        raise RuntimeError(f"{num_tokens} tokens for {prompt[:40]!r}")
    # Tokens after the first delta's, over the time since it.
    return (times[-1][0] - times[0][0]) * 1000 / (num_tokens - times[0][1])


def counters(port: int) -> dict[str, float]:
    from tests.harness import spec_decode_counters

    return spec_decode_counters(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], help="config overrides for both runs")
    parser.add_argument("--rounds", type=int, default=3, help="times each prompt is sent to each run")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--json", type=Path, default=Path("spec_bench.json"))
    args = parser.parse_args(argv)
    from client import Client

    log_dir = Path(tempfile.mkdtemp(prefix="spec-bench-logs-"))
    runs: dict[str, tuple[BrigadeProcess, int]] = {}
    report: dict = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "sets": {}}
    try:
        for name, extra in (
            ("off", []),
            (
                "ngram",
                [
                    "speculative.method=ngram",
                    f"speculative.num_speculative_tokens={args.num_speculative_tokens}",
                ],
            ),
        ):
            metrics_port = peers.free_port()
            overrides = [
                "model.dtype=float32",
                f"gateway.port={peers.free_port()}",
                f"supervisor.metrics_port={metrics_port}",
                *args.set,
                *extra,
            ]
            run_dir = Path(tempfile.mkdtemp(prefix=f"spec-bench-{name}-"))
            runs[name] = (
                BrigadeProcess(run_dir, args.config, overrides, log_dir / f"{name}.log"),
                metrics_port,
            )
        for run, _ in runs.values():
            run.wait_ready(READY_TIMEOUT_S)
        with Client(runs["off"][0].run_dir) as off, Client(runs["ngram"][0].run_dir) as on:
            clients = {"off": off, "ngram": on}
            for name in clients:  # warm up each run once
                tpot_ms(clients[name], CHAT[0], 8)
            for set_name, prompts in SETS.items():
                before = counters(runs["ngram"][1])
                tpots: dict[str, list[float]] = {"off": [], "ngram": []}
                for r in range(args.rounds):
                    for i, prompt in enumerate(prompts):
                        order = ("off", "ngram") if (r + i) % 2 == 0 else ("ngram", "off")
                        for name in order:
                            tpots[name].append(tpot_ms(clients[name], prompt, args.output_len))
                after = counters(runs["ngram"][1])
                drafts = after.get(COUNTERS[0], 0) - before.get(COUNTERS[0], 0)
                accepted = after.get(COUNTERS[1], 0) - before.get(COUNTERS[1], 0)
                stats = {
                    name: {"tpot_p50_ms": percentile(v, 50), "tpot_mean_ms": sum(v) / len(v), "n": len(v)}
                    for name, v in tpots.items()
                }
                stats["ratio_p50"] = stats["ngram"]["tpot_p50_ms"] / stats["off"]["tpot_p50_ms"]
                stats["acceptance_length"] = 1 + accepted / drafts if drafts else None
                stats["verifications"] = drafts
                report["sets"][set_name] = stats
    finally:
        for name, (run, _) in runs.items():
            leftovers = run.stop()
            shutil.rmtree(run.run_dir, ignore_errors=True)
            if leftovers:
                print(f"warning: the {name} run left {leftovers} behind (removed)", file=sys.stderr)
    print(f"\nc=1, {args.output_len} tokens, greedy; k={args.num_speculative_tokens}; logs in {log_dir}")
    print(
        f"{'set':<10}{'off p50':>10}{'ngram p50':>11}{'ratio':>8}{'off mean':>10}{'ngram mean':>12}{'accept len':>12}"
    )
    for set_name, s in report["sets"].items():
        accept = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] else "-"
        print(
            f"{set_name:<10}{s['off']['tpot_p50_ms']:>10.1f}{s['ngram']['tpot_p50_ms']:>11.1f}{s['ratio_p50']:>8.2f}"
            f"{s['off']['tpot_mean_ms']:>10.1f}{s['ngram']['tpot_mean_ms']:>12.1f}{accept:>12}"
        )
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
