"""What the encoder stage buys (issue 36): the text-only requests that run beside a burst of
chats with new images, served with the vision tower in its own stage (`encoder.replicas: 1`)
against the same with it in the worker's process (`encoder.in_worker: true`, where each encode
holds up the next step, as a tower inside the model's process does); and a repeated image's TTFT
against a new one's.

    python benchmarks/encoder_bench.py [--images 16] [--text-rate 4] [--text-tokens 16]
        [--image-tokens 8] [--rounds 2] [--alone-s 5] [--repeats 3] [--set key=value ...]
        [--json FILE] [--smoke]

Both modes serve the same random Gemma 3 (built here on SmolLM2's tokenizer: a SigLIP tower on
224x224 images, 256 patches, 64 image tokens; a 4-layer language model). One run at a time, a new
one per round and mode, the rounds alternating which mode goes first (stage, in worker, in
worker, stage, ...), so a load drift on a shared host hits both. Per round and mode:
- **text alone**: text-only chats (`--text-tokens` each, greedy, ignore_eos) sent at
  `--text-rate` a second, an open loop, for `--alone-s` seconds;
- **with images**: the same text load, and `--images` concurrent chats each with an image the
  run has not seen, sent together as it starts, until the last of those ends;
- **repeated image**: one at a time on the idle run, a chat with a new image, then the same chat
  again (its embeddings in the encoder's cache, its KV blocks in the prefix cache), `--repeats`
  times.
For the text-only requests it reports TTFT p50 / p90 (those sent in the window), and the time
between their tokens that arrived in the window (ITL p50 / p90) with the decode throughput of a
stream it makes (tokens per second of those gaps); the image chats' TTFT;
the repeated image's TTFT against the new one's; and the ratios between the two modes. Prints a
table and writes JSON (`--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import math
import os
import sys
import tempfile
import time
from base64 import b64encode
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.serve import machine_info, percentile, started_brigade  # noqa: E402
from client.async_sdk import AsyncClient  # noqa: E402

REQUEST_TIMEOUT_S = 600.0
MODES = {"stage": ["encoder.replicas=1"], "in_worker": ["encoder.in_worker=true"]}
# The language model and the vision tower of the benchmark's model: a tower whose one encode
# takes tens of ms on a CPU, beside a language model whose decode step takes a few.
TEXT = dict(
    hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, sliding_window=512, layer_types=["sliding_attention"] * 3 + ["full_attention"],
)  # fmt: skip
VISION = dict(
    image_size=224, patch_size=14, hidden_size=192, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=3,
)  # fmt: skip
TOKENS_PER_IMAGE = 64
TEXT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "What are three tips for staying focused while studying?",
    "Explain why the sky is blue to a ten year old.",
    "Suggest a name for a coffee shop and explain your choice.",
]


def build_model(out: Path, smoke: bool) -> Path:
    """The benchmark's random Gemma 3 (the tests' tiny one with --smoke)."""
    from services.gpu_worker.loader import prepare_model
    from tests.vlm_models import write_gemma3_vlm

    if smoke:
        return write_gemma3_vlm(out, prepare_model(None))
    return write_gemma3_vlm(out, prepare_model(None), TEXT, VISION, TOKENS_PER_IMAGE)


def encode_ms(model_dir: Path, side: int) -> float:
    """One image through the tower in this process on one thread (the median of 5, after a
    warm-up): what the tower costs, without the runs' threads in the figure."""
    import torch

    from services.encoder.vision import VisionEncoder

    torch.set_num_threads(1)
    vision = VisionEncoder.load(model_dir)
    pixels = torch.rand(1, 3, side, side) * 2 - 1
    times = []
    for _ in range(6):
        started = time.perf_counter()
        vision.encode(pixels)
        times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times[1:]))


def png_data_url(side: int, seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return f"data:image/png;base64,{b64encode(out.getvalue()).decode()}"


def image_chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe this picture."},
    ]}]  # fmt: skip


@dataclass
class Timed:
    """One request: when it was sent, and when each of its tokens arrived."""

    started: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0][0] - self.started


async def timed(client: AsyncClient, messages: list[dict], max_tokens: int) -> Timed:
    record = Timed(time.perf_counter())
    async for delta in client.stream(
        messages=messages, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=REQUEST_TIMEOUT_S
    ):
        if delta.token_ids:
            record.arrivals.append((time.perf_counter(), len(delta.token_ids)))
    if not record.arrivals:
        raise RuntimeError("a request ended without a token")
    return record


async def text_load(client: AsyncClient, args: argparse.Namespace, stop: asyncio.Event) -> list[Timed]:
    """Text-only chats sent at `--text-rate` a second, whether or not the earlier ones are done
    (an open loop: a slow engine gets a queue, not fewer requests), until `stop`; every one sent."""
    sent: list[asyncio.Task[Timed]] = []
    next_at = time.perf_counter()
    while not stop.is_set():
        messages = [{"role": "user", "content": TEXT_PROMPTS[len(sent) % len(TEXT_PROMPTS)]}]
        sent.append(asyncio.create_task(timed(client, messages, args.text_tokens)))
        next_at += 1 / args.text_rate
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.perf_counter()))
    return list(await asyncio.gather(*sent))


@dataclass
class Window:
    """The text-only requests of one window [start, end]."""

    start: float
    end: float
    records: list[Timed]

    def ttfts_s(self) -> list[float]:
        return [r.ttft_s for r in self.records if self.start <= r.started < self.end]

    def token_gaps_s(self) -> list[float]:
        """The time each text-only token after a request's first took, for the tokens that
        arrived in the window (a delta of n tokens: its gap over n, n times): what the steps
        beside the images cost a stream."""
        gaps = []
        for r in self.records:
            for (before, _), (at, n) in itertools.pairwise(r.arrivals):
                if self.start <= at <= self.end:
                    gaps += [(at - before) / n] * n
        return gaps


async def text_alone(client: AsyncClient, args: argparse.Namespace) -> Window:
    stop = asyncio.Event()
    start = time.perf_counter()
    load = asyncio.create_task(text_load(client, args, stop))
    await asyncio.sleep(args.alone_s)
    end = time.perf_counter()
    stop.set()
    return Window(start, end, await load)


async def with_images(
    client: AsyncClient, args: argparse.Namespace, urls: list[str]
) -> tuple[Window, list[float]]:
    """The text load, and the image chats sent together as it starts; the window ends with the
    last image chat. Returns it and the image chats' TTFTs."""
    stop = asyncio.Event()
    start = time.perf_counter()
    load = asyncio.create_task(text_load(client, args, stop))
    images = await asyncio.gather(*(timed(client, image_chat(url), args.image_tokens) for url in urls))
    end = time.perf_counter()
    stop.set()
    return Window(start, end, await load), [r.ttft_s for r in images]


async def repeated_image(
    client: AsyncClient, args: argparse.Namespace, urls: list[str]
) -> dict[str, list[float]]:
    ttfts: dict[str, list[float]] = {"new": [], "repeated": []}
    for url in urls:
        for kind in ("new", "repeated"):
            ttfts[kind].append((await timed(client, image_chat(url), args.image_tokens)).ttft_s)
    return ttfts


def ms(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50) * 1000, "p90": percentile(values, 90) * 1000, "n": len(values)}


def text_stats(windows: list[Window]) -> dict:
    ttfts = [t for w in windows for t in w.ttfts_s()]
    gaps = [g for w in windows for g in w.token_gaps_s()]
    return {
        "ttft_ms": ms(ttfts),
        "itl_ms": ms(gaps),
        # A stream's decode rate: its tokens over their time (the mean gap's inverse).
        "decode_tok_s": len(gaps) / sum(gaps) if gaps else math.nan,
        "window_s": sum(w.end - w.start for w in windows),
    }


@dataclass
class Measured:
    """What one mode's runs measured, over the rounds."""

    alone: list[Window] = field(default_factory=list)
    mixed: list[Window] = field(default_factory=list)
    image_ttfts: list[float] = field(default_factory=list)
    repeats: dict[str, list[float]] = field(default_factory=lambda: {"new": [], "repeated": []})

    def report(self) -> dict:
        return {
            "text_alone": text_stats(self.alone),
            "text_with_images": text_stats(self.mixed),
            "image_ttft_ms": ms(self.image_ttfts),
            "new_image_ttft_ms": ms(self.repeats["new"]),
            "repeated_image_ttft_ms": ms(self.repeats["repeated"]),
        }


async def measure(run_dir: Path, args: argparse.Namespace, round_: int, into: Measured) -> None:
    """One round on one run: text alone, with images, then new and repeated images."""
    side = args.image_side
    # The same new images for both modes in a round: each run is new, with empty caches.
    urls = [png_data_url(side, seed=round_ * 1000 + i) for i in range(args.images)]
    repeat_urls = [png_data_url(side, seed=500_000 + round_ * 1000 + i) for i in range(args.repeats)]
    async with AsyncClient(run_dir, timeout=REQUEST_TIMEOUT_S) as client:
        # The run's first image and text chat, untimed.
        await timed(client, image_chat(png_data_url(side, seed=10**6)), 2)
        await timed(client, [{"role": "user", "content": TEXT_PROMPTS[0]}], 2)
        into.alone.append(await text_alone(client, args))
        window, ttfts = await with_images(client, args, urls)
        into.mixed.append(window)
        into.image_ttfts += ttfts
        for url in repeat_urls:
            for kind in ("new", "repeated"):
                into.repeats[kind].append((await timed(client, image_chat(url), args.image_tokens)).ttft_s)
    alone = into.alone[-1]
    print(
        f"  round {round_}: text TTFT p50 alone {percentile(alone.ttfts_s(), 50) * 1000:7.1f} ms, with images "
        f"{percentile(window.ttfts_s(), 50) * 1000:7.1f} ms over {window.end - window.start:5.2f} s",
        flush=True,
    )


def ratios_of(modes: dict[str, dict]) -> dict:
    stage, in_worker = modes["stage"]["text_with_images"], modes["in_worker"]["text_with_images"]
    return {
        "text_ttft_p50_in_worker_over_stage": in_worker["ttft_ms"]["p50"] / stage["ttft_ms"]["p50"],
        "text_ttft_p90_in_worker_over_stage": in_worker["ttft_ms"]["p90"] / stage["ttft_ms"]["p90"],
        "text_decode_tok_s_stage_over_in_worker": stage["decode_tok_s"] / in_worker["decode_tok_s"],
        # Each mode against its own text-alone figures: what the images cost it, whatever the
        # host did to the mode as a whole.
        "with_images_over_alone": {
            mode: {
                "text_ttft_p50": m["text_with_images"]["ttft_ms"]["p50"] / m["text_alone"]["ttft_ms"]["p50"],
                "text_decode_tok_s": m["text_with_images"]["decode_tok_s"] / m["text_alone"]["decode_tok_s"],
            }
            for mode, m in modes.items()
        },
        "repeated_over_new_image_ttft_p50": {
            mode: m["repeated_image_ttft_ms"]["p50"] / m["new_image_ttft_ms"]["p50"]
            for mode, m in modes.items()
        },
    }


def print_table(report: dict) -> None:
    modes = report["modes"]
    print()
    print(
        "| text-only requests | stage: alone | stage: with images | in worker: alone | in worker: with images |"
    )
    print("| --- | --- | --- | --- | --- |")
    cells = [
        (modes[mode], phase)
        for mode in ("stage", "in_worker")
        for phase in ("text_alone", "text_with_images")
    ]
    for label, key in (("TTFT p50 (ms)", "p50"), ("TTFT p90 (ms)", "p90")):
        print(f"| {label} | " + " | ".join(f"{m[phase]['ttft_ms'][key]:.1f}" for m, phase in cells) + " |")
    for label, key in (("ITL p50 (ms)", "p50"), ("ITL p90 (ms)", "p90")):
        print(f"| {label} | " + " | ".join(f"{m[phase]['itl_ms'][key]:.1f}" for m, phase in cells) + " |")
    print(
        "| decode tok/s, a stream | "
        + " | ".join(f"{m[phase]['decode_tok_s']:.1f}" for m, phase in cells)
        + " |"
    )
    print()
    print("| image chats, TTFT p50 / p90 (ms) | stage | in worker |")
    print("| --- | --- | --- |")
    for label, key in (("burst of new images", "image_ttft_ms"), ("one new image, idle", "new_image_ttft_ms"),
                       ("the same image again", "repeated_image_ttft_ms")):  # fmt: skip
        row = " | ".join(
            f"{modes[mode][key]['p50']:.1f} / {modes[mode][key]['p90']:.1f}"
            for mode in ("stage", "in_worker")
        )
        print(f"| {label} | {row} |")
    ratios = report["ratios"]
    print()
    print(
        f"with images, in worker / stage: text TTFT p50 {ratios['text_ttft_p50_in_worker_over_stage']:.2f}x, "
        f"p90 {ratios['text_ttft_p90_in_worker_over_stage']:.2f}x; text decode tok/s stage / in worker "
        f"{ratios['text_decode_tok_s_stage_over_in_worker']:.2f}x"
    )
    for mode, own in ratios["with_images_over_alone"].items():
        print(
            f"{mode}, with images / alone: text TTFT p50 {own['text_ttft_p50']:.2f}x, "
            f"decode tok/s {own['text_decode_tok_s']:.2f}x"
        )
    repeated = ratios["repeated_over_new_image_ttft_p50"]
    print(
        f"repeated / new image TTFT p50: stage {repeated['stage']:.2f}x, in worker {repeated['in_worker']:.2f}x"
    )
    print(
        f"one encode on one thread: {report['model']['encode_ms_one_image']:.1f} ms; load average "
        f"{report['machine']['loadavg_1m_at_start']:.1f} at start, {report['loadavg_1m_at_end']:.1f} at the end"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], help="config override for both modes")
    parser.add_argument("--images", type=int, default=16, help="concurrent chats with a new image")
    parser.add_argument("--text-rate", type=float, default=4.0, help="text-only chats sent a second")
    parser.add_argument("--text-tokens", type=int, default=16, help="output tokens of a text-only chat")
    parser.add_argument("--image-tokens", type=int, default=8, help="output tokens of a chat with an image")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating which mode goes first")
    parser.add_argument("--alone-s", type=float, default=5.0, help="seconds of text-only load per round")
    parser.add_argument("--repeats", type=int, default=3, help="new-then-repeated image pairs per round")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--smoke", action="store_true", help="the tests' tiny model, tiny sizes: checks that it runs"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.images, args.text_rate, args.text_tokens, args.image_tokens = 2, 4.0, 4, 2
        args.rounds, args.alone_s, args.repeats = 1, 1.0, 1
    args.image_side = 64 if args.smoke else VISION["image_size"]  # the model's: no resizing
    machine = machine_info()
    measured = {mode: Measured() for mode in MODES}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="brigade-encoder-bench-model-") as model_tmp:
        model_dir = build_model(Path(model_tmp), args.smoke)
        model = {
            "text": TEXT if not args.smoke else "tests' tiny",
            "vision": VISION if not args.smoke else "tests' tiny",
            "tokens_per_image": TOKENS_PER_IMAGE if not args.smoke else 4,
            "encode_ms_one_image": encode_ms(model_dir, args.image_side),
        }
        common = [
            f"model.path={model_dir}", "model.dtype=float32", "model.max_model_len=1024",
            "gateway.replicas=0", "supervisor.metrics_port=0", *args.set,
        ]  # fmt: skip
        for round_ in range(args.rounds):
            order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
            for mode in order:
                # One run at a time, a new one each round: nothing of the other mode's run (its
                # worker's threads, its polling) runs beside the one measured.
                prefix = f"brigade-encoder-bench-{mode}-"
                with started_brigade(args.config, [*common, *MODES[mode]], prefix) as run:
                    print(f"{mode}:", flush=True)
                    asyncio.run(measure(run.run_dir, args, round_, measured[mode]))
                runs.append({"mode": mode, "run_dir": str(run.run_dir), "supervisor_pid": run.process.pid})
    modes = {mode: m.report() for mode, m in measured.items()}
    out = {
        "model": model,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": machine,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "runs": runs,
        "modes": modes,
        "ratios": ratios_of(modes),
    }
    print_table(out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
