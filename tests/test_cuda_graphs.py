"""Decode steps replayed from CUDA graphs (services/gpu_worker/cuda_graphs.py).

Without a GPU, the padded forward over the graphs' own buffers runs eagerly (capture=False) with
the Triton kernels in the interpreter, against the runner's ordinary eager steps on the same
weights: the padding, the buffers' copies and the placeholders filled into them. On a GPU
(`benchmarks/gpu_check.py` runs the `on_cuda` tests) the graphs are captured and replayed."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from ipc.messages import PLACEHOLDER_TOKEN, AdapterSource, StepHeader
from services.gpu_worker.cuda_graphs import DecodeGraphs, capture_sizes, unsupported_reason
from services.gpu_worker.model import LlamaModel
from services.gpu_worker.model_runner import ModelRunner
from tests.test_model import PlanBuilder

pytestmark = pytest.mark.timeout(300)

KV_BYTES = 4 << 20
VOCAB = 256
PLAN_WIDTH = 8  # block-table columns of every plan here (PlanBuilder's max_blocks)
# The graphs' block tables: wider than the plans', as a worker's are (sized for max_model_len),
# so columns past a plan's are stale or zero and the kernels' key splits must not follow them.
GRAPH_WIDTH = 2 * PLAN_WIDTH
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def random_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (GQA, two blocks of context per sequence at most), weights only:
    the runner needs no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("graph-llama")
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def test_capture_sizes_pad_at_most_seven_rows() -> None:
    for max_batch in (1, 2, 3, 5, 8, 20, 64, 256):
        sizes = capture_sizes(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_batch
        for n in range(1, max_batch + 1):
            padded = min(size for size in sizes if size >= n)
            assert padded - n < 8, (max_batch, n, padded)


def with_top_logprobs(
    arrays: dict[str, np.ndarray], header: StepHeader, k: int
) -> tuple[dict[str, np.ndarray], StepHeader]:
    """Every row of the plan asks for its k top logprobs."""
    arrays["num_logprobs"][:] = k
    return arrays, msgspec.structs.replace(header, max_top_logprobs=k)


Schedule = list[dict[int, list[int]] | list[int]]  # a prefill {row: prompt}, or a decode's rows


def run(runner: ModelRunner, schedule: Schedule, top_logprobs: int = 4) -> list[dict[str, np.ndarray]]:
    """Run prefills and decode steps; a decode row's token is a placeholder where the row
    sampled in the step just before (the scheduler's way), else the token it sampled last."""
    builder = PlanBuilder(runner.block_size)
    results: list[dict[str, np.ndarray]] = []
    last: dict[int, int] = {}
    previous: set[int] = set()
    for step in schedule:
        if isinstance(step, dict):
            chunks = [(row, prompt, True) for row, prompt in step.items()]
        else:
            chunks = [(row, [PLACEHOLDER_TOKEN if row in previous else last[row]], True) for row in step]
        result = runner.execute(
            *with_top_logprobs(*builder.plan(chunks, max_blocks=PLAN_WIDTH), top_logprobs)
        )
        results.append(result)
        previous = {row for row, _, _ in chunks}
        last.update(zip(previous, result["sampled_ids"].tolist(), strict=True))
    return results


@needs_interpreter
def test_padded_buffers_decode_as_the_eager_steps(random_llama_dir: Path) -> None:
    """Batches of 3 (padded to 4), 4, 1 and 2, crossing a block boundary, with a prefill between
    them (which runs eagerly): the same tokens, logprobs and KV cache as plain eager steps. The
    cache equal everywhere also says the padding rows stored nothing."""
    eager = ModelRunner(random_llama_dir, dtype="float32", kv_cache_bytes=KV_BYTES, backend="triton")
    padded = ModelRunner(random_llama_dir, dtype="float32", kv_cache_bytes=KV_BYTES, backend="triton")
    graphs = DecodeGraphs(padded.model, padded.kv_cache, 4, GRAPH_WIDTH, capture=False)
    padded.decode_graphs = graphs
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (14, 5, 9, 16)]
    decodes: Schedule = [[0, 1, 2]] * 3 + [[0, 1, 2, 3]] * 2 + [[2]] * 2 + [[3, 1]] * 2
    schedule = [dict(enumerate(prompts[:3])), *decodes[:3], {3: prompts[3]}, *decodes[3:]]
    want, got = run(eager, schedule), run(padded, schedule)
    assert graphs.num_replays == len(decodes)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        np.testing.assert_array_equal(b["sampled_ids"], a["sampled_ids"], err_msg=f"step {step}")
        assert (a["top_ids"] >= 0).all()  # every row asked for its top logprobs
        np.testing.assert_array_equal(b["top_ids"], a["top_ids"], err_msg=f"step {step}")
        np.testing.assert_allclose(
            b["sampled_logprobs"], a["sampled_logprobs"], atol=1e-5, err_msg=f"step {step}"
        )
        np.testing.assert_allclose(b["top_logprobs"], a["top_logprobs"], atol=1e-5, err_msg=f"step {step}")
    for (k0, v0), (k1, v1) in zip(eager.kv_cache, padded.kv_cache, strict=True):
        torch.testing.assert_close(k1, k0, atol=1e-6, rtol=0)
        torch.testing.assert_close(v1, v0, atol=1e-6, rtol=0)


def test_graphs_fit_steps_of_at_most_their_rows_in_tokens(random_llama_dir: Path) -> None:
    """A step fits while its tokens (a row each) are no more than the largest graph's rows and its
    block table is no wider than the buffers (what a step carries, the runner checks: below)."""
    runner = ModelRunner(random_llama_dir, dtype="float32", kv_cache_bytes=KV_BYTES)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, 4, PLAN_WIDTH, capture=False)
    builder = PlanBuilder(runner.block_size)
    arrays, header = builder.plan([(row, [5, 6], True) for row in range(3)], max_blocks=PLAN_WIDTH)
    assert not graphs.fits(arrays, header.num_tokens)  # 6 tokens > 4
    arrays, header = builder.plan([(0, [5, 6, 7], True), (1, [8], True)], max_blocks=PLAN_WIDTH)
    assert graphs.fits(arrays, header.num_tokens)  # a verification's 3 tokens and a decode
    arrays, header = builder.plan([(row, [7], True) for row in range(5)], max_blocks=PLAN_WIDTH)
    assert not graphs.fits(arrays, header.num_tokens)  # 5 rows > 4
    arrays, header = builder.plan([(row, [9], True) for row in range(2)], max_blocks=PLAN_WIDTH + 1)
    assert not graphs.fits(arrays, header.num_tokens)


def test_adapter_tiles_fit_the_grid_of_the_size_that_holds_the_step() -> None:
    """`_max_tiles(size)`, the adapters' grid in a graph of `size` rows, holds every tile
    `group_rows` makes of a step that size holds, whichever slots its tokens use (its rows, at
    most one a token, fit the size too): every assignment of up to 6 tokens, random ones of up
    to 64, for tiles of 1-3 rows, BLOCK_M's and whole runs (the kernels other than Triton's)."""
    import itertools

    from kernels.lora import BLOCK_M, group_rows

    sizes = capture_sizes(64)
    rng = np.random.default_rng(0)
    for max_loras, tile_rows in itertools.product((1, 2, 3), (1, 2, 3, BLOCK_M, None)):
        stub = SimpleNamespace(lora=SimpleNamespace(max_loras=max_loras, tile_rows=tile_rows))
        steps = [
            np.array(slots, np.int64)
            for num_tokens in range(1, 7)
            for slots in itertools.product(range(-1, max_loras), repeat=num_tokens)
        ]
        steps += [rng.integers(-1, max_loras, rng.integers(8, 65)) for _ in range(300)]
        for token_slots in steps:
            size = next(size for size in sizes if size >= len(token_slots))
            rows, segments = group_rows(token_slots, tile_rows)
            assert len(rows) <= size
            assert len(segments) <= DecodeGraphs._max_tiles(stub, size), (token_slots, tile_rows)


def test_graphs_hold_the_tokens_a_step_may_carry(
    random_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graphs' rows count tokens, up to what a step of decodes and verifications can hold:
    max_num_seqs without speculation (no graph that no step fills, nor logits rows for one: a
    [rows, vocab] float32 buffer), max_num_seqs x (1 + num_speculative_tokens) with it, within
    engine.cuda_graph_max_batch. (Capture itself needs a GPU: the sizes asked for are recorded.)"""
    from services.gpu_worker import model_runner

    asked: list[int] = []

    def record(
        model: LlamaModel, kv_cache: list, max_batch: int, max_blocks_per_seq: int, lora: object
    ) -> SimpleNamespace:
        asked.append(max_batch)
        return SimpleNamespace(sizes=capture_sizes(max_batch), capture_s=0.0)

    monkeypatch.setattr(model_runner, "DecodeGraphs", record)
    for num_speculative_tokens in (0, 3, 16):
        runner = ModelRunner(
            random_llama_dir, dtype="float32", kv_cache_bytes=KV_BYTES, backend="triton", max_num_seqs=16,
            num_speculative_tokens=num_speculative_tokens,
        )  # fmt: skip
        runner.device = torch.device("cuda")  # as a GPU worker's: the model's checks pass on the CPU
        assert runner._capture_decode_graphs(256) is not None
    assert asked == [16, 64, 256]


@needs_interpreter
def test_steps_carrying_what_the_graphs_ignore_run_eagerly(random_llama_dir: Path, tmp_path: Path) -> None:
    """Decode steps with an adapter on a row (graphs made without the adapter slots) or prompt
    logprobs are not replayed, and give what a runner without graphs gives; the same runner
    replays the plain decode steps between them (an adapter loaded, no row using it, or
    speculation's arrays with nothing proposed)."""
    from tests.test_lora import save_random_adapter

    adapter = save_random_adapter(random_llama_dir, tmp_path / "adapter", 3, r=4, lora_alpha=8,
                                  target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    kwargs = {"dtype": "float32", "kv_cache_bytes": KV_BYTES, "backend": "triton", "max_loras": 1,
              "lora_adapters": {"a": str(adapter)}}  # fmt: skip
    eager, padded = ModelRunner(random_llama_dir, **kwargs), ModelRunner(random_llama_dir, **kwargs)
    graphs = DecodeGraphs(padded.model, padded.kv_cache, 4, GRAPH_WIDTH, capture=False)
    padded.decode_graphs = graphs
    builders = [PlanBuilder(eager.block_size), PlanBuilder(padded.block_size)]

    def step(chunks: list[tuple[int, list[int], bool]], **extra: list[int]) -> list[dict[str, np.ndarray]]:
        results = []
        for runner, builder in zip((eager, padded), builders, strict=True):
            arrays, header = builder.plan(chunks, max_blocks=PLAN_WIDTH)
            arrays.update({name: np.array(values, np.int32) for name, values in extra.items()})
            results.append(runner.execute(*with_top_logprobs(arrays, header, 2)))
        return results

    def same(results: list[dict[str, np.ndarray]]) -> None:
        want, got = results
        assert want.keys() == got.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)

    same(step([(0, [5, 6, 7, 8], True), (1, [9, 10], True)]))
    cases = [
        ({"lora_slots": [0, -1]}, False),  # row 0 uses the adapter
        ({"num_proposed": [0, 0]}, True),  # speculation's arrays, nothing proposed: a decode
        ({"prompt_targets": [11, -1], "num_prompt_logprobs": [2, 0]}, False),
        ({"lora_slots": [-1, -1]}, True),  # the adapter loaded, unused: plain
        ({}, True),
    ]
    for token, (extra, replays) in enumerate(cases, start=20):
        before = graphs.num_replays
        same(step([(0, [token], True), (1, [token + 1], True)], **extra))
        assert graphs.num_replays == before + replays, extra


@needs_interpreter
def test_verifications_replay_as_rows_of_one_token(random_llama_dir: Path) -> None:
    """A step of several tokens in a sequence replays the graphs a row per token: a greedy
    verification (two proposals right, one wrong) and a sampled one, each beside a decode, give
    the eager runner's results to the array, the greedy one the tokens of plain decoding, and
    leave the same KV cache; a step with a prefill chunk beside them runs eagerly."""
    check_verifications(random_llama_dir, "cpu", atol=1e-5)


@needs_cuda
def test_verifications_replay_captured_graphs_on_cuda(random_llama_dir: Path) -> None:
    """The same on the GPU, the graphs captured: float32, within the kernels' rounding (the eager
    verification runs the prefill kernel, the graphs the decode kernel)."""
    check_verifications(random_llama_dir, "cuda", atol=2e-3)


@needs_interpreter
def test_steps_with_adapters_replay_the_graphs_captured_with_them(
    random_llama_dir: Path, tmp_path: Path
) -> None:
    """Graphs made with the run's adapter slots replay steps whose rows use them: rows of two
    adapters and none, fewer tiles after more (an earlier step's tiles must not apply again), a
    step with no adapter row, a verification on an adapter, and the adapters loaded into the
    slots only after the graphs were made, then swapped between them, against the eager runner:
    the same results and KV cache."""
    check_adapter_steps(random_llama_dir, tmp_path, "cpu", atol=1e-5)


@needs_cuda
def test_steps_with_adapters_replay_captured_graphs_on_cuda(random_llama_dir: Path, tmp_path: Path) -> None:
    """The same on the GPU, the graphs captured (each size with and without the adapters) while
    the slots were empty: a graph reads the slots' ranks and weights when it replays."""
    check_adapter_steps(random_llama_dir, tmp_path, "cuda", atol=2e-3)


def check_adapter_steps(model_dir: Path, tmp_path: Path, device: str, atol: float) -> None:
    from tests.test_lora import save_random_adapter

    adapters = {
        "a": str(save_random_adapter(model_dir, tmp_path / "a", 3, r=4, lora_alpha=8,
                                     target_modules=["q_proj", "v_proj", "down_proj"])),
        "b": str(save_random_adapter(model_dir, tmp_path / "b", 4, r=8, lora_alpha=8,
                                     target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])),
    }  # fmt: skip
    kwargs = {"dtype": "float32", "device": device, "kv_cache_bytes": KV_BYTES, "backend": "triton",
              "max_loras": 2}  # fmt: skip
    eager = ModelRunner(model_dir, lora_adapters=adapters, **kwargs)
    # The graphs are made while the slots are empty (every rank 0): the adapters are loaded after.
    if device == "cuda":
        padded = ModelRunner(model_dir, cuda_graph_max_batch=8, **kwargs)
        graphs = padded.decode_graphs
        assert graphs is not None and len(graphs.graphs) == 2 * len(graphs.sizes)
    else:
        padded = ModelRunner(model_dir, **kwargs)
        graphs = DecodeGraphs(padded.model, padded.kv_cache, 8, GRAPH_WIDTH, lora=padded.lora, capture=False)
        padded.decode_graphs = graphs
    assert padded.lora is not None and padded.lora.names == [None, None]
    for name, path in adapters.items():
        assert padded.load_lora(AdapterSource(name, path)) == ""
    builders = [PlanBuilder(eager.block_size), PlanBuilder(padded.block_size)]
    lora_slots = ["a", "b"]  # the eager runner's slots 0 and 1 already; the padded one's copied in

    def step(
        chunks: list[tuple[int, list[int], bool]], slots: list[int], num_proposed: list[int] | None = None
    ):
        results = []
        for runner, builder in zip((eager, padded), builders, strict=True):
            arrays, header = builder.plan(chunks, max_blocks=PLAN_WIDTH)
            header = msgspec.structs.replace(header, lora_slots=lora_slots)
            arrays["lora_slots"] = np.array(slots, np.int32)
            if num_proposed is not None:
                arrays["num_proposed"] = np.array(num_proposed, np.int32)
            results.append(runner.execute(*with_top_logprobs(arrays, header, 2)))
        want, got = results
        assert want.keys() == got.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=atol, err_msg=name)
        return got

    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (6, 9, 4, 7)]
    step([(row, prompt, True) for row, prompt in enumerate(prompts)], [0, 1, 0, -1])  # 26 tokens: eager
    assert graphs.num_replays == 0 and padded.lora.names == ["a", "b"]
    decode = [(row, [PLACEHOLDER_TOKEN], True) for row in range(4)]
    for replays, slots in enumerate(
        ([0, 1, 0, -1], [-1, 1, -1, -1], [-1, -1, -1, -1], [1, 1, 0, 0]), start=1
    ):
        step(decode, slots)
        assert graphs.num_replays == replays, slots
    lora_slots = ["b", "a"]  # each slot's weights and ranks replaced in place, after replays
    step(decode, [0, 1, 1, -1])
    assert graphs.num_replays == 5 and padded.lora.names == ["b", "a"]
    got = step([(0, [PLACEHOLDER_TOKEN, 5, 6], True), *decode[1:]], [0, -1, 1, -1], [2, 0, 0, 0])
    assert graphs.num_replays == 6 and got["num_emitted"][0] >= 1
    for (k0, v0), (k1, v1) in zip(eager.kv_cache, padded.kv_cache, strict=True):
        torch.testing.assert_close(k1, k0, atol=atol, rtol=0)
        torch.testing.assert_close(v1, v0, atol=atol, rtol=0)


def check_verifications(model_dir: Path, device: str, atol: float) -> None:
    kwargs = {"dtype": "float32", "device": device, "kv_cache_bytes": KV_BYTES, "backend": "triton"}
    reference, eager = ModelRunner(model_dir, **kwargs), ModelRunner(model_dir, **kwargs)
    if device == "cuda":
        padded = ModelRunner(model_dir, cuda_graph_max_batch=8, **kwargs)
        graphs = padded.decode_graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    else:
        padded = ModelRunner(model_dir, **kwargs)
        graphs = DecodeGraphs(padded.model, padded.kv_cache, 8, GRAPH_WIDTH, capture=False)
        padded.decode_graphs = graphs
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (14, 5, 3)]
    plain = [int(r["sampled_ids"][0]) for r in run(reference, [{0: prompts[0]}, [0], [0], [0], [0]])]
    builders = [PlanBuilder(eager.block_size), PlanBuilder(padded.block_size)]

    def step(chunks: list[tuple[int, list[int], bool]], num_proposed: list[int], sampled: bool = False):
        results = []
        for runner, builder in zip((eager, padded), builders, strict=True):
            arrays, header = builder.plan(chunks, max_blocks=PLAN_WIDTH)
            arrays["num_proposed"] = np.array(num_proposed, np.int32)
            if sampled:
                arrays["temperature"][:] = 0.9
                arrays["seeds"][:] = 7
            results.append(runner.execute(*with_top_logprobs(arrays, header, 3)))
        want, got = results
        assert want.keys() == got.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=atol, err_msg=name)
        # The rejected proposals' KV is not kept: the next step overwrites their slots.
        for builder in builders:
            for (row, _, _), proposed, emitted in zip(
                chunks, num_proposed, got["num_emitted"].tolist(), strict=True
            ):
                builder.num_cached[row] -= proposed - (emitted - 1) if proposed else 0
        return got

    first = step([(0, prompts[0], True), (1, prompts[1], True)], [0, 0])  # 19 tokens: eager
    assert graphs.num_replays == 0 and first["sampled_ids"][0] == plain[0]
    # Row 0 verifies plain's next two tokens and a wrong third; row 1 decodes.
    wrong = next(token for token in range(2, VOCAB) if token != plain[3])
    got = step(
        [(0, [PLACEHOLDER_TOKEN, plain[1], plain[2], wrong], True), (1, [PLACEHOLDER_TOKEN], True)], [3, 0]
    )
    assert graphs.num_replays == 1
    assert got["emitted_ids"][0, : got["num_emitted"][0]].tolist() == plain[1:4]
    # Sampled: row 0 verifies two proposals (whatever is kept).
    got = step([(0, [PLACEHOLDER_TOKEN, 5, 6], True), (1, [PLACEHOLDER_TOKEN], True)], [2, 0], sampled=True)
    assert graphs.num_replays == 2 and got["num_emitted"][0] >= 1
    # A prefill chunk of three tokens beside them: eager.
    step(
        [(0, [PLACEHOLDER_TOKEN, 9], True), (1, [PLACEHOLDER_TOKEN], True), (2, prompts[2], True)],
        [1, 0, 0],
    )
    assert graphs.num_replays == 2
    for (k0, v0), (k1, v1) in zip(eager.kv_cache, padded.kv_cache, strict=True):
        torch.testing.assert_close(k1, k0, atol=atol, rtol=0)
        torch.testing.assert_close(v1, v0, atol=atol, rtol=0)


def test_cpu_runner_captures_no_graphs(random_llama_dir: Path) -> None:
    runner = ModelRunner(random_llama_dir, dtype="float32", kv_cache_bytes=KV_BYTES, cuda_graph_max_batch=8)
    assert runner.decode_graphs is None


@needs_cuda
def test_cuda_graph_decode_on_cuda(random_llama_dir: Path) -> None:
    """Captured graphs replayed by `execute` against eager steps on the GPU, fed the same tokens
    (the eager runner's) so that a near-tie cannot make the two diverge: batches of 3 and 5
    (padded to 4 and 8) and 1, the same top-1 wherever the eager top two are apart, logprobs
    within bf16's rounding."""
    kwargs = {"dtype": "bfloat16", "device": "cuda", "kv_cache_bytes": KV_BYTES, "backend": "triton"}
    eager = ModelRunner(random_llama_dir, **kwargs)
    graphed = ModelRunner(random_llama_dir, cuda_graph_max_batch=8, **kwargs)
    assert eager.decode_graphs is None
    assert graphed.decode_graphs is not None and graphed.decode_graphs.sizes == [1, 2, 4, 8]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (3, 17, 8, 12, 30)]
    plans = [[(row, prompt, True) for row, prompt in enumerate(prompts)]]
    batches = [[0, 1, 2]] * 4 + [[0, 1, 2, 3, 4]] * 4 + [[4]] * 3
    builders = PlanBuilder(eager.block_size), PlanBuilder(graphed.block_size)
    last: dict[int, int] = {}
    for step in range(len(batches) + 1):
        chunks = plans[0] if step == 0 else [(row, [last[row]], True) for row in batches[step - 1]]
        results = []
        for runner, builder in zip((eager, graphed), builders, strict=True):
            results.append(
                runner.execute(*with_top_logprobs(*builder.plan(chunks, max_blocks=PLAN_WIDTH), 2))
            )
        want, got = results
        assert np.isfinite(want["top_logprobs"]).all()  # every row asked for its top two
        apart = (want["top_logprobs"][:, 0] - want["top_logprobs"][:, 1]) > 0.05
        np.testing.assert_array_equal(
            got["top_ids"][apart, 0], want["top_ids"][apart, 0], err_msg=f"step {step}"
        )
        np.testing.assert_allclose(
            got["top_logprobs"], want["top_logprobs"], atol=0.05, err_msg=f"step {step}"
        )
        last.update(zip((row for row, _, _ in chunks), want["sampled_ids"].tolist(), strict=True))
    assert graphed.decode_graphs.num_replays == len(batches)


def test_models_graphs_cannot_hold_are_named(random_llama_dir: Path, tmp_path: Path) -> None:
    """Which models' decode steps replay graphs, and why not where they cannot (the runner logs
    the reason and serves eagerly; on the CPU it never asks)."""
    from tests.conftest import save_random_model
    from tests.test_moe import random_moe_config

    def model(path: Path, backend: str) -> LlamaModel:
        return ModelRunner(path, dtype="float32", kv_cache_bytes=KV_BYTES, backend=backend).model

    assert unsupported_reason(model(random_llama_dir, "triton")) is None
    assert "not the Triton backend's" in unsupported_reason(model(random_llama_dir, "torch"))
    moe = save_random_model(random_moe_config("qwen2-moe-shared-expert"), tmp_path / "moe", seed=50, std=0.08)
    assert "fused-MoE" in unsupported_reason(model(moe, "triton"))


@needs_cuda
def test_moe_model_serves_eagerly_on_cuda(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A mixture of experts on the GPU asked for graphs: the runner says why it keeps none and
    serves eagerly, HF's logits and tokens, and the same steps as a runner never asked."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import save_random_model
    from tests.test_families import BLOCK, check_against_hf
    from tests.test_moe import random_moe_config

    path = save_random_model(
        random_moe_config("qwen2-moe-shared-expert"), tmp_path / "moe", seed=50, std=0.08
    )
    kwargs = {"dtype": "float32", "device": "cuda", "kv_cache_bytes": 2 << 20, "block_size": BLOCK}
    with caplog.at_level(logging.WARNING, logger="services.gpu_worker.model_runner"):
        runner = ModelRunner(path, cuda_graph_max_batch=8, **kwargs)
    assert runner.decode_graphs is None
    assert "decode steps run eagerly (the fused-MoE kernels" in caplog.text
    schedule: Schedule = [{0: [5, 6, 7], 1: list(range(10, 30))}, [0, 1], [0, 1], [1]]
    plain = ModelRunner(path, **kwargs)
    for a, b in zip(run(plain, schedule), run(runner, schedule), strict=True):
        np.testing.assert_array_equal(b["sampled_ids"], a["sampled_ids"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    check_against_hf(hf, runner)
