"""The opt-in 8-bit-activation GEMV (cpu_ops.linear_quantized_int8) against an independent
numpy reference: the activations quantized the same way (blocks of 32, d = max|x| / 127,
q = rint(x / d)), then exact integer dot products with the weight quants and the scales applied
after, in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels import cpu_ops
from tests.test_kernels import has_cpu_kernels, random_k_quant_blocks


def quantize_activations_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [R, in] float32 -> (q [R, in / 32, 32] int64, d [R, in / 32] float32), computed as the
    kernel does in float32: d = max|x| / 127, q = rint(x * (1 / d)), ties to even; a block whose
    d is below float32's smallest normal number is all zeros."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    d[d < np.finfo(np.float32).tiny] = 0  # a block below the smallest normal scale counts as zeros
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    return np.rint(blocks * inverse[..., None]).astype(np.int64), d


def q4_1_or_q8_0_ref(x: np.ndarray, blocks: np.ndarray, fmt: str) -> np.ndarray:
    """x @ W^T from GGUF Q4_1 / Q8_0 blocks in the file's order: per block, d_w d_x (q_w . q_x)
    in exact integers, plus m_w d_x sum(q_x) for Q4_1."""
    out_features = blocks.shape[0]
    size = cpu_ops.BLOCK_BYTES[fmt]
    raw = blocks.reshape(out_features, -1, size)
    d_w = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [out, blocks]
    if fmt == "Q4_1":
        m_w = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        packed = raw[..., 4:].astype(np.int64)
        q_w = np.concatenate((packed & 0x0F, packed >> 4), axis=-1)  # weight k < 16: low nibble of byte k
    else:
        q_w = raw[..., 2:].copy().view(np.int8).astype(np.int64)
    q_x, d_x = quantize_activations_ref(x)
    dots = np.einsum("rbk,obk->rob", q_x, q_w)  # exact: int64
    out = np.einsum("rob,ob,rb->ro", dots.astype(np.float64), d_w, d_x.astype(np.float64))
    if fmt == "Q4_1":
        out += np.einsum("ob,rb->ro", m_w, d_x.astype(np.float64) * q_x.sum(-1))
    return out


def k_quant_ref(x: np.ndarray, blocks: np.ndarray, fmt: str) -> np.ndarray:
    """x @ W^T with W from gguf's own K-quant dequantizer and x its 8-bit rounding (d_x q_x): the
    same sum as the kernel's integer dots with scales after (each sub-block's weights are
    d s q - dmin m), up to the rounding of W's float32 values."""
    weight = dequantize(blocks, GGMLQuantizationType[fmt]).astype(np.float64)
    q_x, d_x = quantize_activations_ref(x)
    rounded = (q_x * d_x[..., None].astype(np.float64)).reshape(x.shape)
    return rounded @ weight.T


def make_blocks(fmt: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    if fmt in cpu_ops.K_QUANTS:  # gguf cannot quantize to these: random super-blocks
        return random_k_quant_blocks(fmt, out_features, in_features, seed)
    weight = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    return quantize(weight, GGMLQuantizationType[fmt])


SHAPES = {  # (in, out): SmolLM2's qkv and down, an odd number of blocks and of output rows, one block
    "Q4_1": [(576, 960), (1536, 70), (96, 7), (32, 1)],
    "Q8_0": [(576, 960), (1536, 70), (96, 7), (32, 1)],
    "Q4_K": [(512, 70), (256, 3)],
    "Q5_K": [(512, 70), (256, 3)],
    "Q6_K": [(512, 70), (256, 3)],
}
CASES = [(fmt, *shape) for fmt, shapes in SHAPES.items() for shape in shapes]


@pytest.mark.parametrize(("fmt", "in_features", "out_features"), CASES)
@pytest.mark.usefixtures("cpu_isa")
def test_int8_linear_matches_the_integer_reference(fmt: str, in_features: int, out_features: int):
    """0-5 and 11 rows (chunks of four and a partial one), strided input: the kernel equals the
    reference up to float32 summation order, and stays within the activations' rounding of the
    float-activation result."""
    assert has_cpu_kernels()
    blocks = make_blocks(fmt, out_features, in_features, seed=in_features + out_features)
    packed = torch.from_numpy(cpu_ops.to_lanes(blocks, fmt))
    reference = k_quant_ref if fmt in cpu_ops.K_QUANTS else q4_1_or_q8_0_ref
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).astype(np.float32))
    for num_rows in (0, 1, 2, 3, 4, 5, 11):
        x = torch.randn(in_features, num_rows, generator=gen).t()  # [num_rows, in], transposed strides
        got = cpu_ops.linear_quantized_int8(x, packed, fmt)
        assert got.shape == (num_rows, out_features) and got.dtype == torch.float32
        if num_rows == 0:
            continue
        expected = reference(x.numpy(), blocks, fmt)
        scale = float(np.abs(expected).max())
        # One unit off in one integer dot moves an output by about 1e-4 of its largest value.
        np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=5e-6 * scale)
        float_activations = torch.nn.functional.linear(x, weight).double().numpy()
        assert np.abs(float_activations - expected).max() < 0.05 * scale


@pytest.mark.parametrize("fmt", cpu_ops.QUANTIZED_FORMATS)
@pytest.mark.usefixtures("cpu_isa")
def test_int8_linear_rows_are_independent_and_zero_rows_give_zero(fmt: str):
    """Each row is quantized on its own (no batch-wide scale): a row's output does not depend on
    its batchmates; an all-zero row (d = 0) gives zeros, not NaN."""
    assert has_cpu_kernels()
    in_features = 512
    packed = torch.from_numpy(cpu_ops.to_lanes(make_blocks(fmt, 9, in_features, seed=1), fmt))
    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(2))
    x[2] = 0.0
    x[3] *= 1000.0
    together = cpu_ops.linear_quantized_int8(x, packed, fmt)
    for r in range(4):
        alone = cpu_ops.linear_quantized_int8(x[r : r + 1], packed, fmt)
        torch.testing.assert_close(together[r : r + 1], alone, rtol=0, atol=0)
    assert torch.equal(together[2], torch.zeros(9))


@pytest.mark.parametrize("fmt", cpu_ops.QUANTIZED_FORMATS)
@pytest.mark.usefixtures("cpu_isa")
def test_int8_linear_counts_a_block_of_tiny_values_as_zeros(fmt: str):
    """A block whose largest value is below 127 times float32's smallest normal number (1 / d
    would overflow) multiplies as zeros, with the right sign everywhere else; a block of small
    normal values still quantizes."""
    in_features = 256 if fmt in cpu_ops.K_QUANTS else 64
    blocks = make_blocks(fmt, 9, in_features, seed=5)
    packed = torch.from_numpy(cpu_ops.to_lanes(blocks, fmt))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, in_features, generator=gen)
    x[0, :32] *= 1e-38  # denormal scale: zeros
    x[1] *= 1e-37  # every block below the threshold: the whole row is zeros
    x[2, :32] *= 1e-30  # small but normal: quantized as usual
    got = cpu_ops.linear_quantized_int8(x, packed, fmt)
    reference = k_quant_ref if fmt in cpu_ops.K_QUANTS else q4_1_or_q8_0_ref
    expected = reference(x.numpy(), blocks, fmt)
    assert torch.isfinite(got).all()
    zeroed = x.clone()
    zeroed[0, :32] = 0
    torch.testing.assert_close(
        got[0], cpu_ops.linear_quantized_int8(zeroed[:1], packed, fmt)[0], rtol=0, atol=0
    )
    assert got[1].abs().max() == 0
    np.testing.assert_allclose(
        got.double().numpy(), expected, rtol=1e-5, atol=5e-6 * float(np.abs(expected).max())
    )


@pytest.mark.parametrize("fmt", cpu_ops.QUANTIZED_FORMATS)
@pytest.mark.usefixtures("cpu_isa")
def test_int8_linear_propagates_nan_and_inf(fmt: str):
    """A non-finite activation makes its row's outputs NaN, as float32 would, rather than being
    quantized into plausible numbers; the other rows are untouched."""
    assert has_cpu_kernels()
    packed = torch.from_numpy(cpu_ops.to_lanes(make_blocks(fmt, 5, 256, seed=3), fmt))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    x[0, 7], x[1, 200] = float("nan"), float("inf")
    out = cpu_ops.linear_quantized_int8(x, packed, fmt)
    assert out[:2].isnan().all() and out[2].isfinite().all()


def test_int8_linear_refuses_bad_input():
    assert has_cpu_kernels()
    blocks = torch.zeros(4, 48, dtype=torch.uint8)  # Q4_1: 2 packed blocks of 24 bytes a row = 64 inputs
    int8_linear = cpu_ops.linear_quantized_int8
    with pytest.raises(RuntimeError, match="unknown format"):
        int8_linear(torch.randn(1, 64), blocks, "Q3_K")
    with pytest.raises(RuntimeError, match="bytes"):
        int8_linear(torch.randn(1, 96), blocks, "Q4_1")
    with pytest.raises(RuntimeError, match="bytes"):
        int8_linear(torch.randn(1, 64), blocks, "Q8_0")  # 64 inputs need 2 packed Q8_0 blocks, 72 bytes
    with pytest.raises(RuntimeError, match="bytes"):
        int8_linear(torch.randn(1, 64), blocks, "Q4_K")  # 64 inputs are not whole super-blocks
    with pytest.raises(RuntimeError, match="uint8"):
        int8_linear(torch.randn(1, 64), blocks.float(), "Q4_1")
    with pytest.raises(RuntimeError, match="float32"):
        int8_linear(torch.randn(1, 64, dtype=torch.float64), blocks, "Q4_1")
    with pytest.raises(RuntimeError, match=r"x \[R, in\]"):
        int8_linear(torch.randn(64), blocks, "Q4_1")


# ---- SmolLM2 with engine.cpu_int8_activations ----------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_int8(smollm2_dir):
    from services.gpu_worker.model_runner import ModelRunner

    assert has_cpu_kernels()
    runner = ModelRunner(
        smollm2_dir, dtype="float32", kv_cache_bytes=64 << 20, threads=2, int8_activations=True
    )
    assert runner.model.int8_activations and runner.model.reads_gguf_blocks
    return runner


@pytest.mark.slow
@pytest.mark.timeout(900)  # HF and Brigade on SmolLM2, on a loaded machine
def test_smollm2_with_int8_activations_stays_close_to_hf(smollm2_int8, smollm2_dir, smollm2_hf_dir):
    """Teacher-forced on HF float32's greedy tokens (benchmarks/int8_accuracy.py, on fewer prompts
    and tokens): the 8-bit decode steps pick HF's token nearly always, their logits move by the
    activations' rounding (more than float32 summation order would), and no more than that."""
    from transformers import AutoModelForCausalLM

    from benchmarks.int8_accuracy import chat_prompts, compare, hf_greedy

    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    prompts = chat_prompts(smollm2_dir)[:4]
    references = [hf_greedy(hf, prompt, 16) for prompt in prompts]
    report = compare(smollm2_int8, prompts, references)
    assert report["steps"] == 4 * 15
    assert report["top1_agreement"] >= 0.9, report
    assert 0.01 < report["max_abs_logit_diff"] < 3.0, report


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_int8_activations_reach_both_decode_paths(smollm2_int8):
    """Decode steps of 1-4 rows with the option on move the logits off the float-activation ones,
    by the activations' rounding and no more, through the one-op layers
    (cpu_ops.few_rows_decode_layers) and through the per-op path alike. (The two int8 paths are not
    compared with each other: one rounding that flips between them, from float32 summation order,
    changes the next layers' activations by a quant, which flips many more: they differ about as
    much as either does from float.)"""
    from tests.test_model import PlanBuilder, random_ids, runner_logits

    runner = smollm2_int8
    model = runner.model
    assert model.has_one_op_layers
    rng = np.random.default_rng(11)
    builder = PlanBuilder(runner.block_size)
    histories = {i: random_ids(rng, 20 + 3 * i, runner.vocab_size) for i in range(4)}
    runner_logits(runner, builder, [(i, h, True) for i, h in histories.items()])
    try:
        for num_seqs in (1, 4, 2, 3):
            chunks = [(i, [int(rng.integers(0, runner.vocab_size))], True) for i in range(num_seqs)]
            arrays, header = builder.plan(chunks)
            # The same plan four times: each run writes the same K/V slots, so all read one context.
            logits = {}
            for one_op in (True, False):
                for int8 in (True, False):
                    model.has_one_op_layers, model.int8_activations = one_op, int8
                    metas = model.prepare(arrays, header.num_tokens, header.num_seqs)
                    ids = torch.from_numpy(arrays["input_ids"].astype(np.int64))
                    logits[one_op, int8] = model.forward(ids, metas, runner.kv_cache, torch.arange(num_seqs))
            torch.testing.assert_close(logits[True, False], logits[False, False], atol=1e-4, rtol=1e-4)
            for one_op in (True, False):
                moved = float((logits[one_op, True] - logits[one_op, False]).abs().max())
                assert 0.01 < moved < 3.0, (num_seqs, one_op, moved)
    finally:
        model.has_one_op_layers, model.int8_activations = True, True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_int8_activations_reach_wider_steps_up_to_their_limit(smollm2_int8, monkeypatch):
    """Steps of 5 to INT8_BLOCKS_MAX_ROWS rows (decodes of 8 sequences, prefills of 20 and of
    exactly the limit) multiply every layer's GGUF blocks by 8-bit activations, at the step's
    width, and their logits move off the float ones by the activations' rounding. One row more
    and the layers keep oneDNN's float32 GEMM; with every row sampled the LM head is as wide, and
    the option changes nothing at all."""
    from services.gpu_worker.model import INT8_BLOCKS_MAX_ROWS
    from tests.test_model import PlanBuilder, random_ids, runner_logits

    runner = smollm2_int8
    model = runner.model
    # The widest limit of any build (AVX2's); the AVX-512 build's own stops at the few-rows steps.
    assert model.int8_blocks_max_rows == INT8_BLOCKS_MAX_ROWS[cpu_ops.isa()]
    monkeypatch.setattr(model, "int8_blocks_max_rows", INT8_BLOCKS_MAX_ROWS["avx2"])
    widths: list[int] = []  # rows of every 8-bit multiply
    int8_linear = cpu_ops.linear_quantized_int8

    def recording(x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
        widths.append(x.shape[0])
        return int8_linear(x, blocks, fmt)

    rng = np.random.default_rng(12)
    builder = PlanBuilder(runner.block_size)
    histories = {i: random_ids(rng, 12 + i, runner.vocab_size) for i in range(8)}
    runner_logits(runner, builder, [(i, h, True) for i, h in histories.items()])
    limit = model.int8_blocks_max_rows
    steps = {  # name: (chunks, rows sampled, width of the layers' 8-bit multiplies or None)
        "decode of 8": ([(i, [int(rng.integers(0, runner.vocab_size))], True) for i in range(8)], 8, 8),
        "prefill of 20": ([(100, random_ids(rng, 20, runner.vocab_size), True)], 1, 20),
        "prefill at the limit": ([(101, random_ids(rng, limit, runner.vocab_size), True)], 1, limit),
        "prefill past it": ([(102, random_ids(rng, limit + 1, runner.vocab_size), True)], limit + 1, None),
    }
    monkeypatch.setattr(cpu_ops, "linear_quantized_int8", recording)
    try:
        for name, (chunks, num_sampled, width) in steps.items():
            arrays, header = builder.plan(chunks)
            sampled = torch.arange(header.num_tokens - num_sampled, header.num_tokens)
            logits = {}
            for int8 in (True, False):  # the same plan twice: both runs write the same K/V slots
                model.int8_activations = int8
                widths.clear()
                metas = model.prepare(arrays, header.num_tokens, header.num_seqs)
                ids = torch.from_numpy(arrays["input_ids"].astype(np.int64))
                logits[int8] = model.forward(ids, metas, runner.kv_cache, sampled)
                if int8:
                    int8_widths = list(widths)
            moved = float((logits[True] - logits[False]).abs().max())
            if width is None:
                assert int8_widths == [], name
                assert moved == 0.0, (name, moved)
            else:
                # qkv, o_proj, gate_up and down of every layer, then the LM head at the sampled rows.
                assert int8_widths == [width] * 4 * len(model.layers) + [num_sampled], name
                assert 0.01 < moved < 3.0, (name, moved)
    finally:
        model.int8_activations = True


@pytest.mark.slow
@pytest.mark.timeout(900)  # SmolLM2 served through real processes, on a loaded machine
def test_served_smollm2_takes_the_option(smollm2_int8, smollm2_dir, tmp_path):
    """`engine.cpu_int8_activations=true` reaches the worker: served greedy chats give the tokens
    of an in-process runner with 8-bit activations, on prompts where those differ from the
    float32 ones (so the float path could not pass). Prefix caching is off: with the option a
    row's numbers depend on its step's width (8-bit up to INT8_BLOCKS_MAX_ROWS rows, float32
    past it), so a prompt whose cached prefix was computed in another step would not compare with
    the runner's single prefill."""
    from benchmarks.int8_accuracy import chat_prompts
    from client import Client
    from services.gpu_worker.model_runner import ModelRunner
    from tests.harness import assert_clean, brigade_run
    from tests.test_model import CHATS, generate

    new_tokens = 32
    prompts = chat_prompts(smollm2_dir)
    int8_ids = [generate(smollm2_int8, [p], new_tokens)[0][0] for p in prompts]
    float_runner = ModelRunner(smollm2_dir, dtype="float32", kv_cache_bytes=64 << 20, threads=2)
    float_ids = [generate(float_runner, [p], new_tokens)[0][0] for p in prompts]
    differing = [i for i in range(len(prompts)) if int8_ids[i] != float_ids[i]]
    assert differing, "no prompt tells the two paths apart"
    run_dir = tmp_path / "run"
    with (
        brigade_run(
            run_dir,
            "model.dtype=float32",
            "engine.threads=2",
            "engine.cpu_int8_activations=true",
            "engine.enable_prefix_caching=false",
        ) as run,
        Client(run.run_dir) as client,
    ):
        for i in differing:
            messages = [{"role": "user", "content": CHATS[i]}]
            result = client.chat(messages, max_tokens=new_tokens, temperature=0.0, timeout=300)
            assert result.token_ids == int8_ids[i][: len(result.token_ids)], CHATS[i]
            assert result.finish_reason == "stop" or len(result.token_ids) == new_tokens
    assert_clean(run_dir)
