"""The GPU check: Triton kernel tests on CUDA, decode / prefill tokens/s of a Llama-3-8B-shaped
model against the roofline, decode steps with and without CUDA graphs, and the vision-language
kernels' cost over the text-only ones at the model's head shapes, in one run.

    python benchmarks/gpu_check.py --json FILE [--write-docs] [--docs docs/performance.md] [--dry-run]

The model has random bf16 weights made on the device (nothing is written to disk but its
config.json), and runs through `ModelRunner.execute` on static batches of 1, 16, 64 and 256
sequences. Roofline tok/s = the bf16 matmul FLOP/s measured in the same run / (2 x parameters).
`--dry-run` runs every part on the CPU on a tiny model (CI): a few kernel tests in the Triton
interpreter, the same timings, and the CUDA-graph part reported as unavailable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.model_bench import static_plan
from kernels.paged_attention import paged_prefill_triton
from kernels.rotary import make_cos_sin, rotary_triton
from services.gpu_worker import model_runner
from services.gpu_worker.attention import image_tails
from services.gpu_worker.model import LlamaModel
from services.gpu_worker.model_runner import ModelRunner

REPO_ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 16, 64, 256)
LLAMA3_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 128001,
}
TINY = LLAMA3_8B | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "eos_token_id": 1,
}
KERNEL_TEST_FILES = (
    "tests/test_kernels.py",
    "tests/test_token_bitmask.py",
    "tests/test_lora_kernels.py",
    "tests/test_cuda_graphs.py",
)
# The Triton kernels' tests (the files also hold the C++ CPU ops' tests, which need CPU tensors).
CUDA_TEST_SELECTION = "triton or decode_is_prefill or on_cuda"
DRY_RUN_TEST_SELECTION = "rms_norm_triton and 576"  # six tests, seconds in the interpreter
TESTS_TIMEOUT_S = 300  # the kernel tests' pytest run
SERVING_TEST_TIMEOUT_S = 600  # the serving test's: it starts the pipeline twice, Triton compiling cold
# The whole pipeline as processes on the GPU, against HF (skips without CUDA).
SERVING_TEST_FILES = ("tests/test_gpu_serving.py",)
DOCS_BEGIN = "<!-- gpu_check:begin -->"
DOCS_END = "<!-- gpu_check:end -->"


# ---------------------------------------------------------------- kernel tests


def run_kernel_tests(dry_run: bool, log: Path) -> dict:
    """The Triton kernels' tests: on CUDA with the launchers' plugin, or a few in the interpreter."""
    if dry_run:
        return run_tests(KERNEL_TEST_FILES, DRY_RUN_TEST_SELECTION, log, interpreter=True)
    return run_tests(KERNEL_TEST_FILES, CUDA_TEST_SELECTION, log, ("-p", "benchmarks.cuda_default_device"))


def run_tests(
    files: tuple[str, ...],
    selection: str,
    log: Path,
    plugin: tuple[str, ...] = (),
    interpreter: bool = False,
    timeout_s: float = TESTS_TIMEOUT_S,
) -> dict:
    """pytest on `files` (`-k selection` unless empty) in a subprocess; counts from its JUnit XML.
    Its whole output goes to `log`: a GPU machine is lent for minutes, and a failure's cause must
    come back from the first run."""
    # The repository first, then whatever PYTHONPATH already holds (packages installed beside the image's).
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    )
    # "0", not unset: tests/conftest.py turns the interpreter on when the variable is unset.
    env["TRITON_INTERPRET"] = "1" if interpreter else "0"
    mode = "interpreter" if interpreter else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", *plugin,
               *(["-k", selection] if selection else []), f"--junitxml={report}"]  # fmt: skip
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            log.write_bytes((exc.stdout or b"") + (exc.stderr or b""))
            return {"mode": mode, "selection": selection, "error": f"timed out after {timeout_s:.0f} s"}
        log.write_text(proc.stdout + proc.stderr)
        result = {
            "mode": mode,
            "selection": selection,
            "returncode": proc.returncode,
            "seconds": time.perf_counter() - start,
        }
        if not report.exists():
            return result | {
                "error": "pytest wrote no report",
                "output_tail": (proc.stdout + proc.stderr)[-2000:],
            }
        counts = junit_counts(ET.parse(report).getroot())
        if counts["passed"] + counts["failed"] + counts["skipped"] == 0:
            counts["error"] = f"no test matched -k {selection!r}"
        return result | counts


def junit_counts(root: ET.Element) -> dict:
    passed, failed, skipped, failures = 0, 0, 0, {}
    for case in root.iter("testcase"):
        problem = case.find("failure")
        problem = case.find("error") if problem is None else problem
        if case.find("skipped") is not None:
            skipped += 1
        elif problem is not None:
            failed += 1
            message = " ".join((problem.get("message") or problem.text or "").split())
            failures[f"{case.get('classname')}::{case.get('name')}"] = message[:300]
        else:
            passed += 1
    return {"passed": passed, "failed": failed, "skipped": skipped, "failures": failures}


# ---------------------------------------------------------------- the model


def hf_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The HF Llama weights of `config` (what the loader would read from safetensors)."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in per_layer.items()}
    return shapes


@contextmanager
def random_weights(config: dict) -> Iterator[None]:
    """While active, ModelRunner fills its model with random weights made on its device, one HF
    weight at a time (peak memory: the model plus one weight), instead of reading them from disk:
    8B parameters in bf16 would be 16 GB of safetensors."""

    def fill(model: LlamaModel, model_dir: Path) -> None:
        gen = torch.Generator(model.device).manual_seed(0)
        for name, shape in hf_weight_shapes(config).items():
            if name.endswith("norm.weight"):
                tensor = torch.ones(shape, dtype=model.dtype, device=model.device)
            else:
                tensor = torch.randn(shape, generator=gen, dtype=model.dtype, device=model.device) * 0.02
            model.load_hf_weight(name, tensor)
            del tensor
        model.finish_loading()

    with mock.patch.object(model_runner, "load_weights", fill):
        yield


def build_runner(config: dict, device: str, max_context: int, model_dir: Path) -> ModelRunner:
    (model_dir / "config.json").write_text(json.dumps(config))
    block_size = 16
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    blocks = max(BATCHES) * -(-max_context // block_size)
    kv_bytes = (
        blocks * 2 * config["num_hidden_layers"] * block_size * config["num_key_value_heads"] * head_dim * 2
    )
    with random_weights(config):
        # As the worker builds it: decode steps of up to the largest batch replay CUDA graphs,
        # their block tables as wide as the longest sequence served.
        return ModelRunner(
            model_dir, dtype="bfloat16", device=device, kv_cache_bytes=kv_bytes, block_size=block_size,
            max_model_len=max_context, cuda_graph_max_batch=max(BATCHES),
        )  # fmt: skip


def num_parameters(config: dict) -> int:
    return sum(int(np.prod(shape)) for shape in hf_weight_shapes(config).values())


# ---------------------------------------------------------------- timings


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(device: torch.device, size: int, reps: int) -> float:
    """bf16 FLOP/s of x @ W^T (the layout of every serving GEMM)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        torch.nn.functional.linear(a, b)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(a, b)
    synchronize(device)
    return 2 * size**3 * reps / (time.perf_counter() - start)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """Bytes/s of a device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    synchronize(device)
    return 2 * src.numel() * src.element_size() * reps / (time.perf_counter() - start)


def decode_roofline(config: dict, batch: int, context: int, flops: float, bandwidth: float) -> float:
    """The most decode tok/s a step of `batch` sequences at `context` allows: it reads every bf16
    weight once and each sequence's KV, and multiplies 2 x parameters FLOPs per token, so its time
    is at least the larger of the two."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_bytes = 2 * config["num_hidden_layers"] * context * config["num_key_value_heads"] * head_dim * 2
    num_params = num_parameters(config)
    step_s = max((2 * num_params + batch * kv_bytes) / bandwidth, 2 * num_params * batch / flops)
    return batch / step_s


def block_tables(batch: int, context: int, block_size: int) -> np.ndarray:
    per_seq = -(-context // block_size)
    return np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)


def prefill_and_decode(
    runner: ModelRunner, batch: int, prompt_len: int, steps: int
) -> tuple[float, float, float | None]:
    """(prefill tok/s, decode tok/s eager, decode tok/s replaying the runner's CUDA graphs, None
    without them) of one static batch, through `execute`. Each is run once untimed first, so
    compilation (Triton's, the allocator's first growth) stays out of the figures."""
    bs, rng = runner.block_size, np.random.default_rng(batch)
    tables = block_tables(batch, prompt_len + steps + 1, bs)
    prompts = rng.integers(3, runner.vocab_size, (batch, prompt_len))
    positions = np.tile(np.arange(prompt_len), (batch, 1))
    prefill = static_plan(prompts, positions, np.full(batch, prompt_len), tables, bs)
    runner.execute(*prefill)
    start = time.perf_counter()
    out = runner.execute(*prefill)  # returns host arrays, so the device is done
    prefill_s = time.perf_counter() - start

    def decode_step(step: int, tokens: np.ndarray) -> np.ndarray:
        pos = prompt_len + step
        plan = static_plan(tokens[:, None], np.full((batch, 1), pos), np.full(batch, pos + 1), tables, bs)
        return runner.execute(*plan)["sampled_ids"]

    def decode_tok_s() -> float:
        tokens = decode_step(0, out["sampled_ids"])
        start = time.perf_counter()
        for step in range(1, steps + 1):
            tokens = decode_step(step, tokens)
        return batch * steps / (time.perf_counter() - start)

    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        eager = decode_tok_s()
    finally:
        runner.decode_graphs = graphs
    return batch * prompt_len / prefill_s, eager, None if graphs is None else decode_tok_s()


def decode_forward_graphs(runner: ModelRunner, batch: int, context: int, reps: int) -> dict:
    """ms per decode forward of `batch` sequences at `context`, eager and replayed from a CUDA
    graph over the same inputs (prepared once: the graph replays fixed device buffers). Where
    capture fails, the reason is recorded."""
    model, device = runner.model, runner.device
    tables = block_tables(batch, context, runner.block_size)
    tokens = np.random.default_rng(batch).integers(3, runner.vocab_size, (batch, 1))
    arrays, header = static_plan(
        tokens, np.full((batch, 1), context - 1), np.full(batch, context), tables, runner.block_size
    )
    metas = model.prepare(arrays, header.num_tokens, header.num_seqs)
    input_ids = torch.from_numpy(tokens.reshape(-1)).to(device)
    sample_tokens = torch.arange(batch, device=device)

    def forward() -> torch.Tensor:
        return model.forward(input_ids, metas, runner.kv_cache, sample_tokens)

    def timed(step) -> float:
        step()
        synchronize(device)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    result: dict = {"eager_ms": timed(forward)}
    if device.type != "cuda":
        return result | {"graph_ms": None, "error": "CUDA graphs need a CUDA device"}
    try:
        expected = forward()
        # Capture needs the kernels compiled and the allocator warmed on a side stream.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = forward()
        graph.replay()
        synchronize(device)
        diff = (captured - expected).abs().max().item()
        graph_ms = timed(graph.replay)
    except Exception as exc:  # any capture failure is a finding, not a crash of the check
        return result | {"graph_ms": None, "error": one_line(exc)}
    return result | {"graph_ms": graph_ms, "speedup": result["eager_ms"] / graph_ms, "max_abs_diff": diff}


# ---------------------------------------------------------------- report


def timed_ms(run, device: torch.device, reps: int) -> float:
    """ms per call of `run`, after one untimed call (compilation)."""
    run()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        run()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / reps


def vlm_kernels(config: dict, device: torch.device, batch: int, prompt_len: int, reps: int) -> dict:
    """ms per launch of the vision-language paths against the text-only ones, at the model's head
    shapes on a static prefill of `batch` prompts: the prefill attention kernel with Gemma 3's
    image tails (each prompt's middle half one image) and without, and the rotary kernel with
    Qwen2.5-VL's M-RoPE (the image's rows on a grid, sections in the proportions of Qwen's
    (16, 24, 24)) and with plain positions."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"error": "the Triton kernels need a CUDA device or TRITON_INTERPRET=1"}
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, block_size = config["hidden_size"] // num_heads, 16
    num_tokens = batch * prompt_len
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    num_blocks = batch * -(-prompt_len // block_size)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.from_numpy(block_tables(batch, prompt_len, block_size)).to(device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device) * prompt_len
    seq_lens = torch.full((batch,), prompt_len, dtype=torch.int32, device=device)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    first, size = prompt_len // 4, prompt_len // 2
    groups = np.full((batch, prompt_len), -1, np.int32)
    groups[:, first : first + size] = np.arange(batch)[:, None]
    tails = torch.from_numpy(image_tails(groups.reshape(-1))).to(device)
    args = (q, k_cache, v_cache, tables, query_start_loc, seq_lens, head_dim**-0.5)
    half = head_dim // 2
    section = (half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8)
    positions = np.tile(np.arange(prompt_len), batch)
    grid_width = max(1, int(size**0.5))
    mrope = np.repeat(positions[None], 3, axis=0).reshape(3, batch, prompt_len)
    grid = np.arange(size)
    mrope[1, :, first : first + size] = first + grid // grid_width
    mrope[2, :, first : first + size] = first + grid % grid_width
    mrope[0, :, first : first + size] = first
    cos_sin = make_cos_sin(prompt_len, head_dim, 10000.0, dtype, device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    plain_positions = torch.from_numpy(positions).to(device)
    mrope_positions = torch.from_numpy(np.ascontiguousarray(mrope.reshape(3, -1))).to(device)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "prefill_attention_ms": timed_ms(lambda: paged_prefill_triton(*args), device, reps),
        "prefill_attention_images_ms": timed_ms(
            lambda: paged_prefill_triton(*args, image_tails=tails), device, reps
        ),
        "rotary_ms": timed_ms(lambda: rotary_triton(q, k, plain_positions, cos_sin), device, reps),
        "rotary_mrope_ms": timed_ms(
            lambda: rotary_triton(q, k, mrope_positions, cos_sin, section), device, reps
        ),
    }


def one_line(exc: Exception) -> str:
    """An error for the JSON and a markdown table cell."""
    return " ".join(f"{type(exc).__name__}: {exc}".split()).replace("|", "/")[:500]


def markdown(result: dict) -> str:
    tests, model = result["kernel_tests"], result["model"]
    lines = [
        DOCS_BEGIN,
        f"GPU check on {result['device_name']} ({'dry run' if result['dry_run'] else 'full'}; "
        f"`python benchmarks/gpu_check.py`, {result['seconds']:.0f} s).",
        "",
        test_line(f'Triton kernel tests ({tests["mode"]}, `-k "{tests["selection"]}"`)', tests),
        test_line(
            "Serving on the GPU (`tests/test_gpu_serving.py`: every stage a process, greedy tokens "
            "against HF, CUDA graphs replayed, a worker SIGKILLed mid-stream)",
            result["serving_test"],
        ),
        f"- Model: {model['num_params']:,} parameters (hidden {model['hidden_size']}, "
        f"{model['num_hidden_layers']} layers), random bf16 weights, prompt {model['prompt_len']}, "
        f"{model['decode_steps']} decode steps",
        f"- bf16 matmul: {result['matmul_tflops']:.3g} TFLOP/s ({result['matmul_size']}^3), "
        f"so at most {result['roofline_tok_s']:.0f} tok/s (2 x parameters FLOPs a token); copy "
        f"{result['bandwidth_gb_s']:.0f} GB/s read + written. A decode step's roofline is the larger of "
        "its FLOPs and its bytes (every weight once, each sequence's KV) at those rates.",
        "",
        vlm_line(result["vlm_kernels"]),
        "",
        "| batch | prefill tok/s | of roofline | decode tok/s | decode roofline | of roofline "
        "| decode tok/s, graphs | of roofline | eager ms/step | graph ms/step | graph speedup |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in map(str, BATCHES):
        if b in result["errors"]:
            lines.append(f"| {b} | failed: {result['errors'][b]} | | | | | | | | | |")
            continue
        g = result["cuda_graphs"]["per_batch"][b]
        graph = "n/a" if g["graph_ms"] is None else f"{g['graph_ms']:.2f}"
        speedup = f"{g['speedup']:.2f}x" if "speedup" in g else "n/a"
        prefill, decode = result["prefill_tok_s"][b], result["decode_tok_s"][b]
        roofline = result["decode_roofline_tok_s"][b]
        replayed = result["decode_graphs_tok_s"][b]
        replayed_cells = "n/a | n/a" if replayed is None else f"{replayed:.1f} | {replayed / roofline:.1%}"
        lines.append(
            f"| {b} | {prefill:.0f} | {prefill / result['roofline_tok_s']:.1%} | {decode:.1f} | "
            f"{roofline:.0f} | {decode / roofline:.1%} | {replayed_cells} | {g['eager_ms']:.2f} | "
            f"{graph} | {speedup} |"
        )
    errors = {b: g["error"] for b, g in result["cuda_graphs"]["per_batch"].items() if "error" in g}
    if errors:
        lines += ["", "CUDA graphs not captured: " + "; ".join(f"batch {b}: {e}" for b, e in errors.items())]
    return "\n".join([*lines, DOCS_END])


def test_line(title: str, tests: dict) -> str:
    counts = (
        f"{tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, {tests.get('skipped', 0)} skipped"
    )
    failures = [f"  - failed: `{test}`: {message}" for test, message in tests.get("failures", {}).items()]
    return "\n".join(
        [f"- {title}: {counts}" + (f"; {tests['error']}" if "error" in tests else ""), *failures]
    )


def vlm_line(vlm: dict) -> str:
    if "error" in vlm:
        return f"- Vision-language kernels: not run ({vlm['error']})"
    return (
        f"- Vision-language kernels (batch {vlm['batch']}, prompt {vlm['prompt_len']}, its middle half "
        f"an image): prefill attention {vlm['prefill_attention_images_ms']:.3f} ms with Gemma 3's image "
        f"tails, {vlm['prefill_attention_ms']:.3f} ms causal; rotary {vlm['rotary_mrope_ms']:.3f} ms "
        f"with M-RoPE, {vlm['rotary_ms']:.3f} ms plain"
    )


def write_docs(path: Path, section: str) -> None:
    """Replace the marked section of `path`, or append one where there is none."""
    text = path.read_text() if path.exists() else ""
    if DOCS_BEGIN in text and DOCS_END in text:
        head, rest = text.split(DOCS_BEGIN, 1)
        text = head + section + rest.split(DOCS_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, a few interpreter tests")
    parser.add_argument("--write-docs", action="store_true", help="replace the marked section of --docs")
    parser.add_argument("--docs", type=Path, default=REPO_ROOT / "docs" / "performance.md")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run on the CPU")
    started = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda")
    config = TINY if args.dry_run else LLAMA3_8B
    prompt_len, steps, reps = (16, 4, 3) if args.dry_run else (128, 32, 20)
    matmul_size, matmul_reps = (256, 5) if args.dry_run else (8192, 50)
    copy_bytes, copy_reps = (2**24, 5) if args.dry_run else (2**32, 20)

    result: dict = {
        "dry_run": args.dry_run,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
    }
    print("kernel tests ...", flush=True)
    result["kernel_tests"] = run_kernel_tests(args.dry_run, args.json.with_suffix(".kernel_tests.log"))
    print(json.dumps(result["kernel_tests"], indent=1), flush=True)
    print("serving test ...", flush=True)
    result["serving_test"] = run_tests(
        SERVING_TEST_FILES,
        "",
        args.json.with_suffix(".serving_test.log"),
        interpreter=args.dry_run,
        timeout_s=SERVING_TEST_TIMEOUT_S,
    )
    print(json.dumps(result["serving_test"], indent=1), flush=True)

    flops = matmul_flops(device, matmul_size, matmul_reps)
    bandwidth = copy_bandwidth(device, copy_bytes, copy_reps)
    num_params = num_parameters(config)
    context = prompt_len + steps // 2  # the decode steps' mean
    result |= {
        "matmul_size": matmul_size,
        "matmul_tflops": flops / 1e12,
        "roofline_tok_s": flops / (2 * num_params),
        "copy_bytes": copy_bytes,
        "bandwidth_gb_s": bandwidth / 1e9,
        "decode_roofline_tok_s": {
            str(b): decode_roofline(config, b, context, flops, bandwidth) for b in BATCHES
        },
    }
    with tempfile.TemporaryDirectory() as model_dir:
        runner = build_runner(config, str(device), prompt_len + steps + 1, Path(model_dir))
    # Captured as the worker captures them at start (None on the CPU: the eager steps alone).
    graphs_captured = runner.decode_graphs
    result["runner_graphs"] = (
        {"sizes": graphs_captured.sizes, "capture_s": graphs_captured.capture_s} if graphs_captured else None
    )
    result["model"] = {k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    result["model"] |= {"num_params": num_params, "prompt_len": prompt_len, "decode_steps": steps}
    result["prefill_tok_s"], result["decode_tok_s"], result["decode_graphs_tok_s"] = {}, {}, {}
    graphs: dict = {"available": device.type == "cuda", "per_batch": {}}
    result["errors"] = {}
    for batch in BATCHES:
        try:
            prefill, decode, replayed = prefill_and_decode(runner, batch, prompt_len, steps)
            graph = decode_forward_graphs(runner, batch, prompt_len + 1, reps)
        except RuntimeError as exc:  # out of memory, a kernel that fails: the other batches still run
            result["errors"][str(batch)] = one_line(exc)
            print(f"batch {batch}: {result['errors'][str(batch)]}", flush=True)
            continue
        result["prefill_tok_s"][str(batch)], result["decode_tok_s"][str(batch)] = prefill, decode
        result["decode_graphs_tok_s"][str(batch)] = replayed
        graphs["per_batch"][str(batch)] = graph
        print(
            f"batch {batch}: prefill {prefill:.0f} tok/s, decode {decode:.1f} tok/s eager, "
            f"{replayed} replayed, forward {graph}",
            flush=True,
        )
    print("vision-language kernels ...", flush=True)
    vlm_batch = 2 if args.dry_run else 64
    try:
        result["vlm_kernels"] = vlm_kernels(config, device, vlm_batch, prompt_len, reps)
    except RuntimeError as exc:
        result["vlm_kernels"] = {"error": one_line(exc)}
    print(json.dumps(result["vlm_kernels"]), flush=True)
    if not graphs["available"]:
        graphs["reason"] = "CUDA graphs need a CUDA device; the eager forward is timed alone"
    result["cuda_graphs"] = graphs
    result["seconds"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    section = markdown(result)
    print(section)
    if args.write_docs:
        write_docs(args.docs, section)


if __name__ == "__main__":
    main()
