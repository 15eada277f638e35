"""LoRA adapters' cost (docs/lora.md): SmolLM2 with random rank-16 PEFT adapters on every projection
(q/k/v/o/gate/up/down of every layer), served against the same model without adapters, and the
same comparison on llama.cpp's server with one of those adapters as a GGUF LoRA file.

    python benchmarks/lora_bench.py [--rounds 2] [--requests 64] [--output-len 32] [--tpot-requests 4]
        [--set key=value ...] [--llama-server PATH | --no-llama] [--threads N] [--json lora_bench.json]

One Brigade run of the config (the embedded SmolLM2 by default) with `lora.max_loras` 8 and eight
adapters in `lora.adapters` (the first as a GGUF file, services/gpu_worker/lora_gguf.py, the others
as PEFT directories). Throughput: `--requests` greedy requests at once (c=64 by default), all on
the base model, then spread round robin over the eight adapters, alternating which goes first each
round so that both see the same host load; output tokens per second over the wall time of the
batch. TPOT: one stream at a time (c=1), with and without an adapter in turn, the time per output
token after the first. Targets (issue 35): adapters >= 0.75x the base model's throughput at c=64,
and c=1 TPOT with an adapter <= 1.15x without.

Then, Brigade stopped, llama.cpp's `llama-server` on the embedded SmolLM2 GGUF with the first
adapter's GGUF file (`--lora`), `--parallel` = the concurrency: the same throughput and TPOT
measurements with every request on that adapter or on none (the request's `lora` scale 0).
llama.cpp batches together only requests of one LoRA configuration, so it gets one adapter
where Brigade spreads the requests over eight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import peers  # noqa: E402
from benchmarks.serve import READY_TIMEOUT_S, BrigadeProcess, machine_info, percentile  # noqa: E402
from services.gpu_worker.lora_gguf import write_gguf_adapter  # noqa: E402

NUM_ADAPTERS = 8
RANK = 16
MODULES = {  # PEFT module -> (its attention/MLP block, in features attribute, out features attribute)
    "q_proj": ("self_attn", "hidden", "q"), "k_proj": ("self_attn", "hidden", "kv"),
    "v_proj": ("self_attn", "hidden", "kv"), "o_proj": ("self_attn", "q", "hidden"),
    "gate_proj": ("mlp", "hidden", "inter"), "up_proj": ("mlp", "hidden", "inter"),
    "down_proj": ("mlp", "inter", "hidden"),
}  # fmt: skip
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# A llama-server request's scale of its one --lora adapter (id 0): on, or off.
LLAMA_LORA = {"base": [{"id": 0, "scale": 0.0}], "adapter": [{"id": 0, "scale": 1.0}]}


def write_adapters(model_dir: Path, out: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` random PEFT adapters of `rank` on every projection of every layer of the model."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = {
        "hidden": config["hidden_size"],
        "q": config["num_attention_heads"] * head_dim,
        "kv": config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim,
        "inter": config["intermediate_size"],
    }
    adapters = {}
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module, (block, fan_in, fan_out) in MODULES.items():
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, sizes[fan_in], generator=generator) * 0.02
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(sizes[fan_out], rank, generator=generator) * 0.02
                )
        path = out / f"lora-{i}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES)}
        (path / "adapter_config.json").write_text(json.dumps(adapter_config))
        adapters[f"lora-{i}"] = path
    return adapters


async def throughput(run_dir: Path, adapters: list[str], num_requests: int, output_len: int) -> float:
    """Output tokens per second of `num_requests` greedy requests sent at once, request j under
    adapters[j % len(adapters)] ("" = the base model)."""
    from client import AsyncClient

    async with AsyncClient(run_dir) as client:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                client.generate(
                    PROMPT,
                    max_tokens=output_len,
                    temperature=0.0,
                    ignore_eos=True,
                    timeout=1200,
                    adapter=adapters[j % len(adapters)],
                )
                for j in range(num_requests)
            )
        )
        elapsed = time.perf_counter() - started
    return sum(len(result.token_ids) for result in results) / elapsed


def tpot_ms(client, adapter: str, output_len: int) -> float:
    """One streamed greedy request; its time per output token after the first, in ms."""
    times: list[tuple[float, int]] = []
    for delta in client.stream(
        PROMPT, max_tokens=output_len, temperature=0.0, ignore_eos=True, timeout=600, adapter=adapter
    ):
        if delta.token_ids:
            times.append((time.perf_counter(), len(delta.token_ids)))
    return stream_tpot_ms(times)


def stream_tpot_ms(arrivals: list[tuple[float, int]]) -> float:
    """peers.tpot_ms of a stream of `--output-len` tokens (eos ignored), which has one."""
    tpot = peers.tpot_ms(arrivals)
    if tpot is None:
        raise RuntimeError(f"a stream of {sum(n for _, n in arrivals)} tokens came in one event: no TPOT")
    return tpot


async def llama_throughput(port: int, lora: list[dict], num_requests: int, output_len: int) -> float:
    """Output tokens per second of `num_requests` greedy llama-server requests sent at once."""
    started = time.perf_counter()
    results = await asyncio.gather(
        *(peers.llama_timed_completion(port, PROMPT, output_len, lora) for _ in range(num_requests))
    )
    elapsed = time.perf_counter() - started
    return sum(n for arrivals, _ in results for _, n in arrivals) / elapsed


def measure_llamacpp(args: argparse.Namespace, lora_gguf: Path, log_path: Path) -> dict:
    """llama-server with `lora_gguf` (--lora): throughput and c=1 TPOT with every request on the
    adapter and on none, as Brigade's are measured; or why it was skipped."""
    from services.gpu_worker.loader import default_model_path

    if args.no_llama:
        return {"skipped": "--no-llama"}
    binary = Path(args.llama_server) if args.llama_server else peers.default_llama_server()
    if binary is None or not binary.exists():
        return {"skipped": "no llama-server (give --llama-server PATH)"}
    base_gguf = Path(default_model_path())
    ctx_per_slot = 64 + args.output_len  # the prompt's few dozen tokens and the output, with room
    rates: dict[str, list[float]] = {"base": [], "adapter": []}
    tpots: dict[str, list[float]] = {"base": [], "adapter": []}
    with peers.llama_server(
        binary, base_gguf, args.requests, ctx_per_slot, args.threads, log_path, ["--lora", str(lora_gguf)]
    ) as port:
        asyncio.run(llama_throughput(port, LLAMA_LORA["base"], 4, 4))  # warm up
        for r in range(args.rounds):
            for name in ("base", "adapter") if r % 2 == 0 else ("adapter", "base"):
                rates[name].append(
                    asyncio.run(llama_throughput(port, LLAMA_LORA[name], args.requests, args.output_len))
                )
        for i in range(args.tpot_requests):
            for name in ("base", "adapter") if i % 2 == 0 else ("adapter", "base"):
                arrivals, _ = asyncio.run(
                    peers.llama_timed_completion(port, PROMPT, args.output_len, LLAMA_LORA[name])
                )
                tpots[name].append(stream_tpot_ms(arrivals))
    return {
        "server": f"{binary} --parallel {args.requests} --threads {args.threads}, {base_gguf.name} "
        f"--lora {lora_gguf.name}{peers.llama_server_note(binary)}",
        "throughput_tok_s": {**rates, "ratio": mean(rates["adapter"]) / mean(rates["base"])},
        "tpot_ms": {**tpots, "ratio_p50": percentile(tpots["adapter"], 50) / percentile(tpots["base"], 50)},
    }


def print_row(label: str, base: float, with_lora: float) -> None:
    print(f"{label:<32}{base:>10.1f}{with_lora:>10.1f}{with_lora / base:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], help="config overrides")
    parser.add_argument("--rounds", type=int, default=2, help="base / adapter throughput pairs")
    parser.add_argument("--requests", type=int, default=64, help="requests sent at once (the concurrency)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--tpot-requests", type=int, default=4, help="c=1 streams each way")
    parser.add_argument("--llama-server", help="llama-server binary (default: PATH, then the cached build)")
    parser.add_argument("--no-llama", action="store_true", help="Brigade only")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server threads")
    parser.add_argument("--json", type=Path, default=Path("lora_bench.json"))
    args = parser.parse_args(argv)
    from client import Client
    from ipc.config import load_config
    from supervision.run import prepare_model

    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    model_dir = prepare_model(load_config(REPO / args.config, args.set))
    adapters = write_adapters(model_dir, work / "adapters", NUM_ADAPTERS, RANK)
    # The adapter both servers get, as a GGUF LoRA file (F32, llama.cpp's converter's default).
    lora_gguf = write_gguf_adapter(
        adapters["lora-0"], json.loads((model_dir / "config.json").read_text()), work / "lora-0.gguf"
    )
    adapters["lora-0"] = lora_gguf
    listed = "{" + ", ".join(f"{name}: {path}" for name, path in adapters.items()) + "}"
    overrides = [
        f"lora.max_loras={NUM_ADAPTERS}", f"lora.max_rank={RANK}", f"lora.adapters={listed}",
        f"gateway.port={peers.free_port()}", "supervisor.metrics_port=0", *args.set,
    ]  # fmt: skip
    run = BrigadeProcess(work / "run", args.config, overrides, work / "brigade.log")
    report: dict = {
        "machine": machine_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "model_dir": str(model_dir),
        "adapters": f"{NUM_ADAPTERS} random rank-{RANK} adapters on q/k/v/o/gate/up/down of every layer "
        "(lora-0 as a GGUF file, the others as PEFT directories)",
    }
    try:
        run.wait_ready(READY_TIMEOUT_S)
        asyncio.run(throughput(run.run_dir, [""], 4, 4))  # warm up
        rates: dict[str, list[float]] = {"base": [], "adapters": []}
        for r in range(args.rounds):
            order = ("base", "adapters") if r % 2 == 0 else ("adapters", "base")
            for name in order:
                names = [""] if name == "base" else list(adapters)
                rates[name].append(
                    asyncio.run(throughput(run.run_dir, names, args.requests, args.output_len))
                )
        tpots: dict[str, list[float]] = {"base": [], "adapter": []}
        with Client(run.run_dir) as client:
            for i in range(args.tpot_requests):
                order = ("base", "adapter") if i % 2 == 0 else ("adapter", "base")
                for name in order:
                    tpots[name].append(tpot_ms(client, "" if name == "base" else "lora-0", args.output_len))
    finally:
        leftovers = run.stop()
        if leftovers:
            print(f"warning: the run left {leftovers} behind (removed)", file=sys.stderr)
    c = args.requests
    base_rate, lora_rate = mean(rates["base"]), mean(rates["adapters"])
    base_tpot, lora_tpot = (percentile(tpots[name], 50) for name in ("base", "adapter"))
    report["throughput_tok_s"] = {**rates, "ratio": lora_rate / base_rate, "concurrency": c}
    report["tpot_ms"] = {**tpots, "ratio_p50": lora_tpot / base_tpot}
    report["targets"] = {
        f"c={c} adapters / base >= 0.75": lora_rate / base_rate >= 0.75,
        "c=1 TPOT adapter / base <= 1.15": lora_tpot / base_tpot <= 1.15,
    }
    print(f"\n{report['adapters']}; {args.output_len} output tokens, greedy; logs in {work}")
    print(f"{'':<32}{'base':>10}{'adapters':>10}{'ratio':>8}")
    print_row(f"Brigade c={c} tok/s (mean)", base_rate, lora_rate)
    print_row("Brigade c=1 TPOT ms (p50)", base_tpot, lora_tpot)
    report["llamacpp"] = llama = measure_llamacpp(args, lora_gguf, work / "llama-server.log")
    if "skipped" in llama:
        print(f"llama.cpp skipped: {llama['skipped']}")
    else:
        throughput_tok_s, tpot = llama["throughput_tok_s"], llama["tpot_ms"]
        print_row(
            f"llama.cpp c={c} tok/s (1 LoRA)",
            mean(throughput_tok_s["base"]),
            mean(throughput_tok_s["adapter"]),
        )
        print_row(
            "llama.cpp c=1 TPOT ms (p50)", percentile(tpot["base"], 50), percentile(tpot["adapter"], 50)
        )
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    shutil.rmtree(work / "adapters", ignore_errors=True)
    lora_gguf.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
