"""engine.kv_cache_dtype=bfloat16: a float32 model on the CPU keeps its paged KV cache in bfloat16
(services/gpu_worker/model_runner.py `_kv_cache_dtype`). The C++ decode attention against the same
pages widened to float32, the stores' rounding against torch's, the model's logits against HF
float32 whose cache rounds its keys and values the same way, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipc.config import ConfigError, load_config
from kernels import cpu_ops
from services.gpu_worker.model_runner import ModelRunner
from tests.test_model import BLOCK_SIZE, PlanBuilder, random_ids, runner_logits

needs_kernels = pytest.mark.skipif(not cpu_ops.load(), reason="the CPU kernels did not build here")


def loaded_isas() -> list[str]:
    return [name for name in cpu_ops.ISAS if cpu_ops.load_isa(name)]


@needs_kernels
@pytest.mark.parametrize("isa", loaded_isas())
@pytest.mark.parametrize(
    ("head_dim", "num_seqs", "with_sinks"), [(16, 3, False), (64, 40, True), (128, 2, False)]
)
def test_paged_decode_over_bf16_pages_equals_float32_pages(isa, head_dim, num_seqs, with_sinks, monkeypatch):
    """The bfloat16 pages are read widened exactly, so attention over them gives the bits that
    the same values in float32 pages give (both builds; lengths across page boundaries, GQA,
    enough sequences for whole-sequence items and few enough for per-head ones)."""
    monkeypatch.setattr(cpu_ops, "isa", lambda: isa)
    gen = torch.Generator().manual_seed(head_dim + num_seqs)
    num_heads, num_kv_heads, num_blocks, block_size = 6, 2, 24, 16
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen).bfloat16() for _ in range(2))
    tables = torch.randint(0, num_blocks, (num_seqs, 6), generator=gen)
    lens = torch.randint(1, 6 * block_size + 1, (num_seqs,), generator=gen)
    sinks = torch.randn(num_heads, generator=gen) if with_sinks else None
    out = cpu_ops.paged_decode(q, k, v, tables, lens, 0.3, sinks)
    assert torch.equal(out, cpu_ops.paged_decode(q, k.float(), v.float(), tables, lens, 0.3, sinks))
    with pytest.raises(RuntimeError, match="two caches of one dtype"):
        cpu_ops.paged_decode(q, k, v.float(), tables, lens, 0.3, sinks)
    with pytest.raises(RuntimeError, match="caches must be float32 or bfloat16"):
        cpu_ops.paged_decode(q, k.half(), v.half(), tables, lens, 0.3, sinks)


class RoundingCache:
    """HF's DynamicCache whose stored keys and values are rounded to bfloat16 (and widened back)
    before any attention reads them: what Brigade's bfloat16 cache holds, in HF's own code."""

    def __new__(cls):
        from transformers import DynamicCache

        class Rounding(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                rounded = (key_states.bfloat16().float(), value_states.bfloat16().float())
                return super().update(*rounded, layer_idx, *args, **kwargs)

        return Rounding()


def hf_logits_with_bf16_cache(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids]), cache=RoundingCache(), use_cache=True).logits[0, -1].float()


def tiny_runner(model_dir, kv_cache_dtype: str, dtype: str = "float32") -> ModelRunner:
    return ModelRunner(
        model_dir, dtype=dtype, kv_cache_bytes=4 << 20, block_size=BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype
    )


@pytest.mark.parametrize("decode_kernels", [True, False], ids=["c++ decode", "torch decode"])
def test_bf16_cache_matches_hf_with_rounded_keys_and_values(tiny_model_dir, decode_kernels, monkeypatch):
    """Prefills (the torch path), a wide decode step of 6 sequences (the C++ decode attention) and
    few-row decode steps (the one-op decode layers, which store in C++) give the logits of HF float32
    whose cache rounds keys and values to bfloat16, and not those of the float32 cache; the cache
    holds twice the blocks in the same budget. Without the decode kernels (windowed or soft-capped
    attention, other head sizes) the torch decode path reads the same cache to the same logits."""
    from transformers import AutoModelForCausalLM

    if not decode_kernels:
        monkeypatch.setattr(cpu_ops, "has_paged_decode", lambda head_dim, dtype: False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runner, float32 = tiny_runner(tiny_model_dir, "bfloat16"), tiny_runner(tiny_model_dir, "auto")
    for r in (runner, float32):
        r.model.has_one_op_layers = r.model.has_one_op_layers and decode_kernels
        assert r.model.ops.has_decode_kernel == decode_kernels
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in runner.kv_cache)
    assert all(k.dtype == v.dtype == torch.float32 for k, v in float32.kv_cache)
    assert runner.num_kv_blocks == 2 * float32.num_kv_blocks
    builders = {runner: PlanBuilder(), float32: PlanBuilder()}
    rng = np.random.default_rng(11)
    vocab = runner.vocab_size
    histories = {i: random_ids(rng, 7 + 6 * i, vocab) for i in range(6)}
    chunks = [(i, list(h), True) for i, h in histories.items()]
    ours_off = float32_off = 0.0  # the largest |difference| from HF with the rounding cache
    for num_seqs in (None, 6, 3, 1, 1):
        if num_seqs is not None:
            chunks = []
            for i in range(num_seqs):
                histories[i].append(int(rng.integers(0, vocab)))
                chunks.append((i, histories[i][-1:], True))
        logits = runner_logits(runner, builders[runner], chunks)
        reference = runner_logits(float32, builders[float32], chunks)
        for row, (seq, _, _) in enumerate(chunks):
            expected = hf_logits_with_bf16_cache(hf, histories[seq])
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
            ours_off = max(ours_off, float((logits[row] - expected).abs().max()))
            float32_off = max(float32_off, float((reference[row] - expected).abs().max()))
    # The rounding shows: the float32 cache's logits are several times further from that reference.
    assert float32_off > 20 * ours_off, (ours_off, float32_off)


def test_one_op_decode_stores_as_torch_rounds(tiny_model_dir):
    """The first layer's keys and values of a decode step (stored by the C++ one-op layers) and of
    a prefill (stored by torch) are the float32 cache's, rounded to nearest even by torch."""
    runner, float32 = tiny_runner(tiny_model_dir, "bfloat16"), tiny_runner(tiny_model_dir, "auto")
    assert runner.model.has_one_op_layers
    rng = np.random.default_rng(3)
    prompt = random_ids(rng, 21, runner.vocab_size)
    builders = {runner: PlanBuilder(), float32: PlanBuilder()}
    for chunks in ([(0, prompt, True)], [(0, [5], True)], [(0, [9], True)]):
        for r, builder in builders.items():
            runner_logits(r, builder, chunks)
    used = builders[runner].blocks[0]
    for cache, reference in zip(runner.kv_cache[0], float32.kv_cache[0], strict=True):
        stored, expected = cache[used].flatten(0, 1)[:23], reference[used].flatten(0, 1)[:23]
        assert torch.equal(stored, expected.bfloat16())
        assert not torch.equal(stored.float(), expected)


def test_refusals(tiny_model_dir):
    """bfloat16 under a model of another half dtype, an unknown dtype, and (in the config) a GPU
    model that is not bfloat16 are refused by name; a bfloat16 model's cache is bfloat16 anyway."""
    with pytest.raises(ValueError, match="only a float32 model's cache can be bfloat16; use auto"):
        tiny_runner(tiny_model_dir, "bfloat16", dtype="float16")
    with pytest.raises(ValueError, match="expected auto or bfloat16"):
        tiny_runner(tiny_model_dir, "float16")
    with pytest.raises(ValueError, match="the Triton backend keeps the cache in the model's dtype"):
        ModelRunner(
            tiny_model_dir,
            dtype="float32",
            kv_cache_bytes=4 << 20,
            backend="triton",
            kv_cache_dtype="bfloat16",
        )
    same = tiny_runner(tiny_model_dir, "bfloat16", dtype="bfloat16")
    assert same.kv_dtype == torch.bfloat16 and same.kv_cache[0][0].dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"engine\.kv_cache_dtype=bfloat16"):
        load_config(None, ["engine.device=cuda", "model.dtype=float16", "engine.kv_cache_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        load_config(None, ["engine.kv_cache_dtype=float8"])
    for sets in (
        ["engine.kv_cache_dtype=bfloat16"],
        ["engine.device=cuda", "engine.kv_cache_dtype=bfloat16"],
    ):
        assert load_config(None, sets).engine.kv_cache_dtype == "bfloat16"


@pytest.mark.timeout(300)
def test_served_run_takes_the_option(tiny_model_dir, tmp_path):
    """`engine.kv_cache_dtype=bfloat16` reaches the worker: a served prompt's greedy tokens and
    their logprobs are an in-process runner's with a bfloat16 cache (the prefill reads the rounded
    keys back, so even the first token's logprob moves), not the float32 cache's."""
    from client import Client
    from tests.harness import assert_clean, brigade_run

    prompt = random_ids(np.random.default_rng(8), 40, 1000)
    expected = {}
    for kv in ("auto", "bfloat16"):
        runner = tiny_runner(tiny_model_dir, kv)
        builder, tokens, logprobs = PlanBuilder(runner.block_size), [], []
        chunk = prompt
        for _ in range(4):
            result = runner.execute(*builder.plan([(0, chunk, True)]))
            tokens.append(int(result["sampled_ids"][0]))
            logprobs.append(float(result["sampled_logprobs"][0]))
            chunk = tokens[-1:]
        expected[kv] = (tokens, logprobs)
    assert max(abs(a - b) for a, b in zip(expected["auto"][1], expected["bfloat16"][1], strict=True)) > 1e-5
    run_dir = tmp_path / "run"
    with (
        brigade_run(
            run_dir,
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            f"engine.block_size={BLOCK_SIZE}",
            "engine.kv_cache_dtype=bfloat16",
            "engine.enable_prefix_caching=false",
        ) as run,
        Client(run.run_dir) as client,
    ):
        result = client.generate(prompt, max_tokens=4, temperature=0.0, ignore_eos=True, timeout=120)
    tokens, logprobs = expected["bfloat16"]
    assert result.token_ids == tokens
    assert result.logprobs is not None
    assert max(abs(a - b) for a, b in zip(result.logprobs, logprobs, strict=True)) < 1e-5, (
        result.logprobs,
        logprobs,
    )
    assert_clean(run_dir)
