"""engine.cpu_wide_step_dtype=bfloat16: steps of more than cpu_ops.MAX_LINEAR_ROWS rows multiply
oneDNN-prepacked bfloat16 weights (services/gpu_worker/model.py, WIDE_STEP_DTYPES). The linear
against float64 references, the choice of the path (and its fallback on CPUs without bf16 dot
products), and the model's logits against HF float32."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kernels import cpu_ops
from services.gpu_worker.model import CAN_PREPACK, has_native_half_matmul, onednn_linear, prepack
from services.gpu_worker.model_runner import ModelRunner
from tests.test_model import BLOCK_SIZE, PlanBuilder, hf_last_logits, random_ids, runner_logits

pytestmark = pytest.mark.skipif(not CAN_PREPACK, reason="torch built without oneDNN")


def onednn_prepacks_bf16() -> bool:
    """Whether oneDNN prepacks bfloat16 weights on this CPU at all: it needs AVX-512 (or
    AVX-NE-CONVERT) even to emulate bf16 dot products, so on an AVX2-only CPU the tests that
    multiply in bf16 cannot run, whatever CPU flags they simulate."""
    try:
        prepack(torch.zeros(1, 1, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


needs_onednn_bf16 = pytest.mark.skipif(
    not (CAN_PREPACK and onednn_prepacks_bf16()), reason="oneDNN cannot prepack bfloat16 on this CPU"
)

WIDE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BF16_ULP = 2.0**-7  # bfloat16 keeps 8 significant bits: one unit in the last place, relative
# SmolLM2 teacher-forced on HF's greedy tokens, 8 prompts x 16 tokens: 127 / 128 agreed in
# docs/performance.md ("bf16 wide steps"), and still do with the LM head in bf16 (an AMX host,
# twenty-eighth session); two misses are tolerated (a thread count other than that run's blocks
# oneDNN's sums differently).
TOP1_MIN = 126 / 128


def bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().double()


@needs_onednn_bf16
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(5, 37, 13), (17, 100, 96), (64, 83, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_is_the_float_product_within_bf16_rounding(rows, in_features, out_features, with_bias):
    """A prepacked bfloat16 weight multiplies x rounded to bfloat16, in float32, the output rounded
    to bfloat16 once (within one bf16 ulp of the exact product of the rounded operands), and it is
    float32's F.linear within the rounding of both operands and the output. Odd widths (not
    multiples of oneDNN's blocks or of 32), 5 to 64 rows, a non-contiguous x, a float32 bias."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.1
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(in_features, rows, generator=gen).t()  # [rows, in], transposed strides
    out = onednn_linear(x, prepack(weight.bfloat16()), bias)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    bias64 = torch.zeros(out_features, dtype=torch.float64) if bias is None else bias.double()
    product = bf16_rounded(x) @ bf16_rounded(weight).T
    magnitude = x.double().abs() @ weight.double().abs().T  # bounds every sum's rounding error
    error = (out.double() - bias64 - product).abs()
    assert bool((error <= BF16_ULP * product.abs() + 1e-6 * magnitude).all()), float(error.max())
    exact = x.double() @ weight.double().T + bias64
    # Each product's operands rounded (2^-9 relative each), then the output's rounding.
    bound = 2 * 2.0**-9 * magnitude + BF16_ULP * (exact - bias64).abs() + 1e-6
    assert bool(((out.double() - exact).abs() <= bound).all())
    float32 = torch.nn.functional.linear(x, weight, bias)
    assert float((out - float32).abs().max()) > 0  # rounded: not the float32 path


@needs_onednn_bf16
def test_bf16_linear_of_zero_rows_and_nan():
    """No rows give no rows; a NaN in x makes its own row's outputs NaN and no other's."""
    weight = prepack(torch.randn(24, 40).bfloat16())
    assert onednn_linear(torch.empty(0, 40), weight).shape == (0, 24)
    x = torch.randn(6, 40)
    x[2, 5] = float("nan")
    out = onednn_linear(x, weight)
    assert bool(out[2].isnan().all()) and not bool(out[[0, 1, 3, 4, 5]].isnan().any())


@pytest.fixture
def cpu_with_bf16(monkeypatch: pytest.MonkeyPatch):
    """Sets which CPU flags the model sees (cpu_ops.cpu_flags): with bf16_dot=False a CPU without
    AVX-512 BF16 or AMX, else one with AVX-512 BF16. The kernels' build is chosen (and cached)
    from the real flags first, so only the wide steps' choice sees the simulated CPU."""
    cpu_ops.isa()
    cpu_ops.load()
    real = cpu_ops.cpu_flags() - {"avx512_bf16", "amx_bf16"}

    def simulate(bf16_dot: bool) -> None:
        flags = real | {"avx512_bf16"} if bf16_dot else real
        monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset(flags))

    return simulate


def tiny_runner(model_dir, dtype: str = "float32", wide_step_dtype: str = "float32") -> ModelRunner:
    return ModelRunner(
        model_dir, dtype=dtype, kv_cache_bytes=4 << 20, block_size=BLOCK_SIZE, wide_step_dtype=wide_step_dtype
    )


@needs_onednn_bf16
def test_wide_steps_take_bf16_where_asked_and_the_cpu_has_it(tiny_model_dir, cpu_with_bf16):
    """float32 unless asked for; asked for, bfloat16 copies on a CPU with bf16 dot products."""
    cpu_with_bf16(True)
    default = tiny_runner(tiny_model_dir).model
    assert default.wide_step_dtype == torch.float32
    assert all(w.dtype == torch.float32 for layer in default.layers for w in layer.onednn)
    model = tiny_runner(tiny_model_dir, wide_step_dtype="bfloat16").model
    assert model.wide_step_dtype == torch.bfloat16 and model._layout(5) == "onednn"
    assert all(w.dtype == torch.bfloat16 for layer in model.layers for w in layer.onednn)
    # The few-rows kernel still reads float32 (a float32 checkpoint: no GGUF blocks), the LM head
    # too; wide steps' head is a bf16 copy beside it.
    assert all(w.dtype == torch.float32 for layer in model.layers for w in layer.plain)
    assert model.lm_head.dtype == torch.float32 and model.lm_head_onednn.dtype == torch.bfloat16
    assert default.lm_head_onednn is default.lm_head


def test_wide_steps_stay_float32_where_the_cpu_lacks_bf16(tiny_model_dir, cpu_with_bf16, caplog):
    """Asked for, float32 with a warning on a CPU without bf16 dot products (where oneDNN would
    emulate bf16, slower than float32, or cannot prepack it at all) or where the model is not
    float32; an unknown dtype is an error."""
    cpu_with_bf16(False)
    for dtype, reason in (
        ("float32", "this CPU has neither AVX-512 BF16 nor AMX"),
        ("bfloat16", "applies to the CPU path in float32 with oneDNN only"),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="services.gpu_worker.model"):
            model = tiny_runner(tiny_model_dir, dtype=dtype, wide_step_dtype="bfloat16").model
        assert model.wide_step_dtype == torch.float32
        assert f"wide steps in bfloat16: {reason}; they stay float32" in caplog.text
        if dtype == "float32":
            assert all(w.dtype == torch.float32 for layer in model.layers for w in layer.onednn)
    with pytest.raises(ValueError, match="wide_step_dtype 'float16': expected one of float32, bfloat16"):
        tiny_runner(tiny_model_dir, wide_step_dtype="float16")


@needs_onednn_bf16
def test_tiny_wide_steps_in_bf16_stay_close_to_hf(tiny_model_dir, cpu_with_bf16):
    """Prefills of 6 sequences and a decode step of all 6 in bfloat16 give HF float32's logits
    within bf16 rounding, and not float32's (whose runner matches HF to 1e-4), each logit a
    bfloat16 number (the LM head's output); a decode step of 3 rows after them (the few-rows
    kernel, float32 over the bf16-made cache, the float32 head) stays close to HF too."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    cpu_with_bf16(True)
    runners = {wide: tiny_runner(tiny_model_dir, wide_step_dtype=wide) for wide in ("float32", "bfloat16")}
    builders = {wide: PlanBuilder() for wide in runners}
    vocab = runners["float32"].vocab_size
    rng = np.random.default_rng(5)
    histories = {i: random_ids(rng, 9 + 5 * i, vocab) for i in range(6)}
    chunks = [(i, list(h), True) for i, h in histories.items()]
    for num_seqs in (None, 6, 3):
        if num_seqs is not None:
            chunks = []
            for i in range(num_seqs):
                histories[i].append(int(rng.integers(0, vocab)))
                chunks.append((i, histories[i][-1:], True))
        logits = {wide: runner_logits(runners[wide], builders[wide], chunks) for wide in runners}
        for row, (seq, _, _) in enumerate(chunks):
            expected = hf_last_logits(hf, histories[seq])
            torch.testing.assert_close(logits["float32"][row], expected, atol=1e-4, rtol=1e-4)
            assert torch.nn.functional.cosine_similarity(logits["bfloat16"][row], expected, dim=0) > 0.9999
            torch.testing.assert_close(logits["bfloat16"][row], expected, atol=0.05, rtol=0.05)
        if sum(len(c[1]) for c in chunks) > cpu_ops.MAX_LINEAR_ROWS:
            assert float((logits["bfloat16"] - logits["float32"]).abs().max()) > 1e-4
        is_bf16 = [torch.equal(rows, rows.bfloat16().float()) for rows in logits.values()]
        assert is_bf16 == [False, len(chunks) > cpu_ops.MAX_LINEAR_ROWS], is_bf16


@needs_onednn_bf16
def test_moe_with_bf16_wide_steps_stays_close_to_hf(tmp_path, cpu_with_bf16):
    """A Qwen2-MoE (a dense layer between sparse ones, whose dense weights are empty; QKV bias):
    its dense layers' weights take bf16 copies, the experts stay float32, and a prefill's logits
    are HF float32's within bf16 rounding."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import save_random_model
    from tests.test_moe import random_moe_config

    cpu_with_bf16(True)
    path = save_random_model(random_moe_config("qwen2-moe-shared-expert"), tmp_path / "moe", seed=7, std=0.08)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = tiny_runner(path, wide_step_dtype="bfloat16")
    model = runner.model
    assert model.wide_step_dtype == torch.bfloat16 and [layer.moe is not None for layer in model.layers] == [
        False,
        True,
        False,
    ]
    assert all(w.dtype == torch.bfloat16 for w in model.layers[0].onednn)
    assert model.layers[1].onednn[0].dtype == torch.bfloat16 and model.layers[1].onednn[2].numel() == 0
    ids = random_ids(np.random.default_rng(8), 21, runner.vocab_size)
    logits = runner_logits(runner, PlanBuilder(), [(0, ids, True)])[0]
    expected = hf_last_logits(hf, ids)
    assert torch.nn.functional.cosine_similarity(logits, expected, dim=0) > 0.9999
    torch.testing.assert_close(logits, expected, atol=0.05, rtol=0.05)


@needs_onednn_bf16
@pytest.mark.parametrize("tied", [True, False])
def test_an_embedding_run_with_bf16_wide_steps_loads_no_head(tmp_path, cpu_with_bf16, tied):
    """An embedding run (no LM head: an empty tensor) with bf16 wide steps loads, keeps no bf16
    head copy (tied or not), and pools 6 prompts in one wide step as the float32 run does, within
    bf16 rounding."""
    from transformers import LlamaConfig

    from ipc.config import ModelConfig
    from services.common.pooling import embedding_of
    from tests.conftest import TINY_VOCAB_SIZE, save_random_model

    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    path = save_random_model(config, tmp_path / "embed", seed=3, std=0.1)
    embedding = embedding_of(ModelConfig(task="embed"), path)
    cpu_with_bf16(True)
    pooled = {}
    for wide in ("float32", "bfloat16"):
        runner = ModelRunner(
            path, dtype="float32", kv_cache_bytes=4 << 20, block_size=BLOCK_SIZE, wide_step_dtype=wide,
            embedding=embedding,
        )  # fmt: skip
        model = runner.model
        assert model.wide_step_dtype == WIDE[wide]
        assert model.lm_head is model.embed if tied else model.lm_head.numel() == 0
        assert model.lm_head_onednn is None or model.lm_head_onednn.dtype == torch.float32
        rng = np.random.default_rng(4)
        prompts = [random_ids(rng, 5 + 3 * i, runner.vocab_size) for i in range(6)]
        result = runner.execute(*PlanBuilder().plan([(i, p, True) for i, p in enumerate(prompts)]))
        pooled[wide] = torch.from_numpy(np.asarray(result["pooled"]))
    assert pooled["bfloat16"].shape == pooled["float32"].shape == (6, 64)
    cosines = torch.nn.functional.cosine_similarity(pooled["bfloat16"], pooled["float32"], dim=1)
    assert bool((cosines > 0.999).all()), cosines
    assert not torch.equal(pooled["bfloat16"], pooled["float32"])  # the wide step ran in bf16


@pytest.mark.slow
@pytest.mark.timeout(900)  # HF and Brigade on SmolLM2, on a loaded machine
@pytest.mark.skipif(not has_native_half_matmul(torch.device("cpu")), reason="no AVX-512 BF16 or AMX")
def test_smollm2_with_bf16_wide_steps_stays_close_to_hf(smollm2_dir, smollm2_hf_dir):
    """Teacher-forced on HF float32's greedy tokens the way a loaded server runs them
    (benchmarks/int8_accuracy.py's batched mode, on fewer tokens: each prompt's prefill, then
    decode steps of all 8 prompts, every step wide), bf16 wide steps pick HF's token nearly
    always, and their logits move by bf16's rounding: more than float32 summation order would,
    no more than that. The bf16 copies replace the float32 oneDNN ones of the GGUF-block weights."""
    from transformers import AutoModelForCausalLM

    from benchmarks.int8_accuracy import chat_prompts, compare_batched, hf_greedy

    runner = ModelRunner(
        smollm2_dir, dtype="float32", kv_cache_bytes=64 << 20, threads=2, wide_step_dtype="bfloat16"
    )
    model = runner.model
    assert model.wide_step_dtype == torch.bfloat16 and model.reads_gguf_blocks
    assert model.lm_head_onednn.dtype == torch.bfloat16 and model.lm_head is model.embed  # tied
    for layer in model.layers:
        assert all(w.dtype == torch.bfloat16 for w in layer.onednn)
        assert all(w.numel() == 0 for w, q in zip(layer.plain, layer.quantized, strict=True) if q is not None)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    prompts = chat_prompts(smollm2_dir)
    references = [hf_greedy(hf, prompt, 16) for prompt in prompts]
    report = compare_batched(runner, prompts, references)
    assert report["steps"] == 8 * 16
    assert report["top1_agreement"] >= TOP1_MIN, report
    assert 0.01 < report["max_abs_logit_diff"] < 3.0, report


@pytest.mark.slow
@pytest.mark.timeout(900)  # SmolLM2 served through real processes, on a loaded machine
@pytest.mark.skipif(not has_native_half_matmul(torch.device("cpu")), reason="no AVX-512 BF16 or AMX")
def test_served_smollm2_takes_the_option(smollm2_dir, tmp_path):
    """`engine.cpu_wide_step_dtype=bfloat16` reaches the worker: a served prompt's first token
    (its prefill, a wide step) has the logprob of an in-process runner with bf16 wide steps, which
    differs from the float32 runner's by more than their agreement."""
    from benchmarks.int8_accuracy import chat_prompts
    from client import Client
    from tests.harness import assert_clean, brigade_run

    prompt = chat_prompts(smollm2_dir)[6]
    expected = {}
    for wide in ("float32", "bfloat16"):
        runner = ModelRunner(
            smollm2_dir, dtype="float32", kv_cache_bytes=16 << 20, threads=2, wide_step_dtype=wide
        )
        result = runner.execute(*PlanBuilder(runner.block_size).plan([(0, prompt, True)]))
        expected[wide] = (int(result["sampled_ids"][0]), float(result["sampled_logprobs"][0]))
        del runner
    assert abs(expected["bfloat16"][1] - expected["float32"][1]) > 1e-4, expected
    run_dir = tmp_path / "run"
    with (
        brigade_run(
            run_dir,
            "model.dtype=float32",
            "engine.threads=2",
            "engine.cpu_wide_step_dtype=bfloat16",
            "engine.enable_prefix_caching=false",
        ) as run,
        Client(run.run_dir) as client,
    ):
        result = client.generate(prompt, max_tokens=1, temperature=0.0, ignore_eos=True, timeout=300)
    assert result.token_ids == [expected["bfloat16"][0]]
    assert result.logprobs is not None
    assert abs(result.logprobs[0] - expected["bfloat16"][1]) < 1e-5, (result.logprobs, expected)
    assert_clean(run_dir)
