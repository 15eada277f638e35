"""Speculative decoding benchmark (docs/speculative.md): time per output token at one stream,
n-gram speculation on against off, on prompts that restate or edit a given text and on open chat;
and llama.cpp's server with and without its own n-gram speculation on the same prompts.

    python benchmarks/spec_bench.py [--rounds 3] [--output-len 96] [--num-speculative-tokens 4]
        [--llama-server PATH | --no-llama] [--llama-spec-args "--spec-type ngram-simple"]
        [--set key=value ...] [--json FILE] [--draft-layers N]
        [--concurrency 16,64] [--throughput-rounds 3]

Two Brigade runs of the same config serve side by side, one with `speculative.method: ngram`
(with `--draft-layers N`, a third with `speculative.method: draft_model` whose draft is the
model's first N layers, a truncated copy written to a temporary directory), and
two llama-servers (one slot each, the same GGUF), one started with `--llama-spec-args`. Each
prompt goes to every engine in turn, rotating which goes first, one request at a time (c=1), so
all see the same host load. Greedy, the same max_tokens, the same chat template (the GGUF's);
the restate set's requests end at the end of the text (the model's end of turn: what follows
it under ignore_eos is a conversation the model makes up, which restates nothing), the chat
set's run to max_tokens (ignore_eos). Per prompt set it reports each engine's TPOT p50 / mean, each speculating engine's p50
against its own engine without speculation, and how much was accepted: Brigade's mean acceptance
length (1 + accepted proposals per verification, from its spec_decode_* counters on /metrics) and
llama.cpp's accepted share of drafted tokens (from its `timings`).

Then, per `--concurrency` c, the Brigade runs' output throughput: c greedy chat requests (the
restate and chat prompts in turn) sent at once, `--throughput-rounds` times to each run, rotating
which goes first, against the run without speculation (the adaptive rule must keep a loaded
batch from losing to speculation). llama-servers have one slot each and take no part in it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from functools import partial
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
IGNORE_EOS = {"restate": False, "chat": True}  # see the module's docstring
COUNTERS = ("brigade:spec_decode_num_drafts_total", "brigade:spec_decode_num_accepted_tokens_total")


def brigade_tpot_ms(client, prompt: str, output_len: int, ignore_eos: bool = True) -> float | None:
    """One streamed greedy chat request to Brigade; its time per output token after the first."""
    arrivals = []
    for delta in client.stream(
        messages=[{"role": "user", "content": prompt}],
        max_tokens=output_len,
        temperature=0.0,
        ignore_eos=ignore_eos,
        timeout=600,
    ):
        if delta.token_ids:
            arrivals.append((time.perf_counter(), len(delta.token_ids)))
    return peers.tpot_ms(arrivals)


class LlamaEngine:
    """One llama-server: the prompt through its own chat template (/apply-template), then a
    streamed greedy /completion; the drafted and accepted tokens it reports are summed."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.drafted = self.accepted = 0

    def tpot_ms(self, prompt: str, output_len: int, ignore_eos: bool = True) -> float | None:
        body = json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/apply-template", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            text = json.loads(reply.read())["prompt"]
        arrivals, timings = asyncio.run(
            peers.llama_timed_completion(self.port, text, output_len, ignore_eos=ignore_eos)
        )
        self.drafted += timings.get("draft_n", 0)
        self.accepted += timings.get("draft_n_accepted", 0)
        return peers.tpot_ms(arrivals)


async def brigade_throughput(run_dir: Path, concurrency: int, output_len: int) -> float:
    """Output tokens per second of `concurrency` greedy chat requests sent at once, the restate
    and chat prompts in turn."""
    from client import AsyncClient

    prompts = RESTATE + CHAT
    async with AsyncClient(run_dir) as client:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                client.chat(
                    [{"role": "user", "content": prompts[j % len(prompts)]}],
                    max_tokens=output_len,
                    temperature=0.0,
                    ignore_eos=True,
                    timeout=1200,
                )
                for j in range(concurrency)
            )
        )
        elapsed = time.perf_counter() - started
    return sum(len(result.token_ids) for result in results) / elapsed


def measure_throughput(args: argparse.Namespace, runs: dict[str, tuple]) -> dict:
    """Per concurrency, each Brigade run's output tokens/s (median of the rounds, engines rotated)
    and each speculating run's median against the run without speculation."""
    out: dict = {}
    names = list(runs)
    for concurrency in args.concurrency:
        speeds: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.throughput_rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                speed = asyncio.run(brigade_throughput(runs[name][0].run_dir, concurrency, args.output_len))
                speeds[name].append(speed)
        stats: dict = {name: {"tok_s_median": percentile(v, 50), "tok_s": v} for name, v in speeds.items()}
        for name in names[1:]:
            stats[f"{name}_ratio"] = stats[name]["tok_s_median"] / stats["off"]["tok_s_median"]
        out[str(concurrency)] = stats
    return out


def counters(port: int) -> dict[str, float]:
    from tests.harness import spec_decode_counters

    return spec_decode_counters(port)


def truncated_draft(args: argparse.Namespace, out: Path) -> Path:
    """The runs' model cut to its first `args.draft_layers` layers (config and weights), with its
    tokenizer files: a draft that agrees with it often enough to measure (docs/speculative.md)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from services.gpu_worker.loader import prepare_model

    source = next((s.split("=", 1)[1] for s in args.set if s.startswith("model.path=")), None)
    model_dir = prepare_model(source)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = args.draft_layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    for shard in model_dir.glob("*.safetensors"):  # each file kept whole but for the layers cut
        with safe_open(shard, "pt") as tensors:
            metadata = tensors.metadata()
        kept = {}
        for name, tensor in load_file(shard).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= args.draft_layers:
                continue
            kept[name] = tensor
        save_file(kept, out / shard.name, metadata)
    for extra in model_dir.iterdir():
        if extra.suffix in (".json", ".jinja", ".txt", ".model") and extra.name not in (
            "config.json",
            "model.safetensors.index.json",  # sharded checkpoints: each shard is copied, cut
        ):
            shutil.copy(extra, out / extra.name)
    return out


def speculating(args: argparse.Namespace, log_dir: Path) -> dict[str, list[str]]:
    """The speculating runs' overrides by name: n-gram, and the truncated draft if asked for."""
    k = f"speculative.num_speculative_tokens={args.num_speculative_tokens}"
    runs = {"ngram": ["speculative.method=ngram", k]}
    if args.draft_layers:
        draft = truncated_draft(args, log_dir / "draft")
        runs["draft"] = ["speculative.method=draft_model", f"speculative.model={draft}", k]
    return runs


def start_brigades(
    args: argparse.Namespace, stack: contextlib.ExitStack, log_dir: Path, speculating: dict[str, list[str]]
) -> dict[str, tuple]:
    """The Brigade runs, off and each speculating one, started together: name -> (run, metrics port)."""
    runs = {}
    for name, extra in (("off", []), *speculating.items()):
        metrics_port = peers.free_port()
        overrides = [
            "model.dtype=float32",
            f"gateway.port={peers.free_port()}",
            f"supervisor.metrics_port={metrics_port}",
            *args.set,
            *extra,
        ]
        run_dir = Path(tempfile.mkdtemp(prefix=f"spec-bench-{name}-"))
        run = BrigadeProcess(run_dir, args.config, overrides, log_dir / f"{name}.log")
        stack.callback(stop_run, name, run)
        runs[name] = (run, metrics_port)
    for run, _ in runs.values():
        run.wait_ready(READY_TIMEOUT_S)
    return runs


def stop_run(name: str, run: BrigadeProcess) -> None:
    leftovers = run.stop()
    shutil.rmtree(run.run_dir, ignore_errors=True)
    if leftovers:
        print(f"warning: the {name} run left {leftovers} behind (removed)", file=sys.stderr)


def start_llamas(
    args: argparse.Namespace, stack: contextlib.ExitStack, log_dir: Path
) -> tuple[dict[str, LlamaEngine], str]:
    """llama-server without and with its n-gram speculation, or none (printing why); and how they
    ran, for the report: the binary and its --no-repack retry if it needed one ("" when none ran)."""
    binary = (
        None
        if args.no_llama
        else Path(args.llama_server)
        if args.llama_server
        else peers.default_llama_server()
    )
    if binary is None:
        print(
            "llama.cpp skipped: "
            + ("--no-llama" if args.no_llama else "no llama-server (give --llama-server PATH)")
        )
        return {}, ""
    from services.gpu_worker.loader import default_model_path

    gguf = Path(default_model_path())
    context = 4096  # the longest prompt and its output, with room
    engines = {}
    for name, extra in (("llama", []), ("llama_ngram", shlex.split(args.llama_spec_args))):
        port = stack.enter_context(
            peers.llama_server(binary, gguf, 1, context, args.threads, log_dir / f"{name}.log", extra)
        )
        engines[name] = LlamaEngine(port)
    return engines, f"{binary}{peers.llama_server_note(binary)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], help="config overrides for both runs")
    parser.add_argument("--rounds", type=int, default=3, help="times each prompt is sent to each engine")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--llama-server", help="llama-server binary (default: PATH, then the cached build)")
    parser.add_argument("--no-llama", action="store_true", help="Brigade only")
    parser.add_argument(
        "--llama-spec-args",
        default="--spec-type ngram-simple",
        help="llama-server's speculation options for its speculating instance",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server threads")
    parser.add_argument("--json", type=Path, default=Path("spec_bench.json"))
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=0,
        help="also a draft-model run, the model's first N layers (0: none)",
    )
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(c) for c in text.split(",") if c],
        default=[16, 64],
        help="comma-separated concurrencies of the throughput part ('' for none)",
    )
    parser.add_argument(
        "--throughput-rounds", type=int, default=3, help="times each run serves each concurrency"
    )
    args = parser.parse_args(argv)
    from client import Client

    log_dir = Path(tempfile.mkdtemp(prefix="spec-bench-logs-"))
    report: dict = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "sets": {}}
    with contextlib.ExitStack() as stack:
        spec_runs = speculating(args, log_dir)
        runs = start_brigades(args, stack, log_dir, spec_runs)
        llamas, report["llama_server"] = start_llamas(args, stack, log_dir)
        engines: dict[str, Callable[[str, int, bool], float | None]] = {
            name: partial(brigade_tpot_ms, stack.enter_context(Client(run.run_dir)))
            for name, (run, _) in runs.items()
        }
        engines.update({name: engine.tpot_ms for name, engine in llamas.items()})
        for measure in engines.values():  # warm each engine up once
            measure(CHAT[0], 8)
        for set_name, prompts in SETS.items():
            before = {name: counters(runs[name][1]) for name in spec_runs}
            drafted_before = {name: (e.drafted, e.accepted) for name, e in llamas.items()}
            tpots: dict[str, list[float]] = {name: [] for name in engines}
            # A prompt that some engine answered in one event (no time between tokens) counts for
            # none of them, so that every engine's figures come from the same prompts.
            too_short = 0
            names = list(engines)
            for r in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    shift = (r * len(prompts) + i) % len(names)
                    answers = {
                        name: engines[name](prompt, args.output_len, IGNORE_EOS[set_name])
                        for name in names[shift:] + names[:shift]
                    }
                    if any(tpot is None for tpot in answers.values()):
                        too_short += 1
                        continue
                    for name, tpot in answers.items():
                        tpots[name].append(tpot)
            if too_short == args.rounds * len(prompts):
                raise RuntimeError(
                    f"every {set_name} prompt had an answer in one event from some engine: no time per "
                    "token to compare (raise --output-len?)"
                )
            stats: dict = {
                name: {"tpot_p50_ms": percentile(v, 50), "tpot_mean_ms": sum(v) / len(v), "n": len(v)}
                for name, v in tpots.items()
            }
            stats["prompts_left_out"] = too_short
            for name in spec_runs:  # n-gram's keys unprefixed, as before the draft run existed
                after = counters(runs[name][1])
                drafts = after.get(COUNTERS[0], 0) - before[name].get(COUNTERS[0], 0)
                accepted = after.get(COUNTERS[1], 0) - before[name].get(COUNTERS[1], 0)
                prefix = "" if name == "ngram" else f"{name}_"
                stats[f"{prefix}ratio_p50"] = stats[name]["tpot_p50_ms"] / stats["off"]["tpot_p50_ms"]
                stats[f"{prefix}acceptance_length"] = 1 + accepted / drafts if drafts else None
                stats[f"{prefix}verifications"] = drafts
            if "llama_ngram" in llamas:
                engine = llamas["llama_ngram"]
                drafted = engine.drafted - drafted_before["llama_ngram"][0]
                kept = engine.accepted - drafted_before["llama_ngram"][1]
                stats["llama_ratio_p50"] = stats["llama_ngram"]["tpot_p50_ms"] / stats["llama"]["tpot_p50_ms"]
                stats["llama_accepted_share"] = kept / drafted if drafted else None
                stats["ngram_vs_llama_ngram_p50"] = (
                    stats["ngram"]["tpot_p50_ms"] / stats["llama_ngram"]["tpot_p50_ms"]
                )
            report["sets"][set_name] = stats
        report["throughput"] = measure_throughput(args, runs)
    print_table(report, args, log_dir)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


def print_table(report: dict, args: argparse.Namespace, log_dir: Path) -> None:
    print(
        f"\nc=1, greedy, at most {args.output_len} tokens (restate: to the end of the text); "
        f"Brigade k={args.num_speculative_tokens}; logs in {log_dir}"
    )
    print("| set | engine | TPOT p50 (ms) | TPOT mean (ms) | speculation / off (p50) | accepted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for set_name, s in report["sets"].items():
        rows = [
            ("Brigade", "off", None, None),
            ("Brigade n-gram", "ngram", s["ratio_p50"], s["acceptance_length"]),
        ]
        if "draft" in s:
            rows.append(("Brigade draft model", "draft", s["draft_ratio_p50"], s["draft_acceptance_length"]))
        if "llama" in s:
            rows += [
                ("llama.cpp", "llama", None, None),
                ("llama.cpp n-gram", "llama_ngram", s["llama_ratio_p50"], s["llama_accepted_share"]),
            ]
        for label, key, ratio, accepted in rows:
            ratio_text = f"{ratio:.2f}x" if ratio is not None else ""
            if accepted is None:
                accepted_text = ""
            elif key in ("ngram", "draft"):
                accepted_text = f"length {accepted:.2f}"
            else:
                accepted_text = f"{accepted:.0%} of drafts"
            e = s[key]
            print(
                f"| {set_name} | {label} | {e['tpot_p50_ms']:.1f} | {e['tpot_mean_ms']:.1f} | {ratio_text} | {accepted_text} |"
            )
    for set_name, s in report["sets"].items():
        if s["prompts_left_out"]:
            print(
                f"({set_name}: {s['prompts_left_out']} prompt(s) answered in one event by some engine, left out)"
            )
    if report["throughput"]:
        print(f"\nthroughput, {args.output_len} tokens a request, median of {args.throughput_rounds} rounds")
        print("| c | engine | output tok/s | speculation / off |")
        print("| --- | --- | --- | --- |")
        labels = {"off": "Brigade", "ngram": "Brigade n-gram", "draft": "Brigade draft model"}
        for concurrency, s in report["throughput"].items():
            for key, label in labels.items():
                if key in s:
                    ratio = f"{s[f'{key}_ratio']:.2f}x" if key != "off" else ""
                    print(f"| {concurrency} | {label} | {s[key]['tok_s_median']:.0f} | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
