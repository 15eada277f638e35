"""Triton kernels vs their torch references (interpreter on CPU), and each reference vs an independent computation."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels import cpu_ops
from kernels.kv_store import store_kv_ref, store_kv_triton
from kernels.paged_attention import (
    paged_decode_ref,
    paged_decode_triton,
    paged_prefill_ref,
    paged_prefill_triton,
)
from kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kernels.rotary import make_cos_sin, rotary_ref, rotary_triton
from services.gpu_worker.attention import image_tails

# The interpreter's tl.dot mis-handles bfloat16 (numpy has no bf16), so attention is checked in
# fp32 and fp16; the element-wise kernels also run in bf16.
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=ATOL[actual.dtype], rtol=RTOL[actual.dtype])


# ---------------------------------------------------------------- rms_norm


def test_rms_norm_ref_matches_hf_and_formula():
    torch.manual_seed(0)
    x, residual, weight = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    out, residual_out = rms_norm_ref(x, weight, 1e-5, residual)
    summed = (x + residual).double()
    direct = summed / torch.sqrt((summed**2).sum(-1, keepdim=True) / 96 + 1e-5) * weight.double()
    torch.testing.assert_close(out, direct.float())
    assert torch.equal(residual_out, x + residual)
    hf = LlamaRMSNorm(96, eps=1e-5)
    hf.weight.data.copy_(weight)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-5)[0], hf(x).detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [64, 96, 576])
@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_triton(dtype: torch.dtype, hidden_size: int, has_residual: bool):
    torch.manual_seed(hidden_size)
    # A row-strided view (every other row of a wider buffer) checks the stride handling.
    x = torch.randn(14, hidden_size, dtype=dtype)[::2]
    residual = torch.randn(7, hidden_size, dtype=dtype) if has_residual else None
    weight = torch.rand(hidden_size, dtype=dtype) + 0.5
    out, residual_out = rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_residual_out = rms_norm_ref(x, weight, 1e-6, residual)
    assert_close(out, ref_out)
    assert_close(residual_out, ref_residual_out)


# ---------------------------------------------------------------- rotary


def _hf_rotary(head_dim: int, theta: float) -> LlamaRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, rope_theta=theta, max_position_embeddings=512
    )
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_make_cos_sin_matches_hf(head_dim: int):
    positions = torch.arange(300)
    cos, sin = _hf_rotary(head_dim, 100000.0)(torch.zeros(1, dtype=torch.float32), positions[None])
    table = make_cos_sin(300, head_dim, 100000.0, torch.float32, "cpu")
    torch.testing.assert_close(table[:, : head_dim // 2], cos[0, :, : head_dim // 2])
    torch.testing.assert_close(table[:, head_dim // 2 :], sin[0, :, : head_dim // 2])


def test_rotary_ref_matches_hf():
    torch.manual_seed(0)
    num_tokens, head_dim = 9, 32
    q, k = torch.randn(num_tokens, 6, head_dim), torch.randn(num_tokens, 2, head_dim)
    positions = torch.randint(0, 500, (num_tokens,))
    cos, sin = _hf_rotary(head_dim, 10000.0)(q, positions[None])
    # HF layout is [batch, heads, tokens, D]; ours is [tokens, heads, D].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rotary_ref(q, k, positions, make_cos_sin(512, head_dim, 10000.0, torch.float32, "cpu"))
    torch.testing.assert_close(q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 16), (6, 2, 32), (9, 3, 64), (4, 1, 64), (4, 2, 96), (3, 1, 80)],  # 96: Phi-3-mini's
)
def test_rotary_triton(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int):
    torch.manual_seed(num_q_heads * head_dim)
    num_tokens = 11
    # q and k are views into one fused qkv buffer, as the model produces them; v must stay untouched.
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    v_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].clone()
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    positions = torch.randint(0, 200, (num_tokens,), dtype=torch.int32)
    cos_sin = make_cos_sin(200, head_dim, 10000.0, torch.float32, qkv.device)  # the GPU check's device too
    q_ref, k_ref = q.clone(), k.clone()
    rotary_ref(q_ref, k_ref, positions, cos_sin)
    rotary_triton(q, k, positions, cos_sin)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], v_before)


def mrope_test_positions(num_tokens: int, max_pos: int) -> torch.Tensor:
    """[3, T] M-RoPE positions: text rows with one position on all axes, and an image's grid
    whose height and width positions differ from its temporal one."""
    torch.manual_seed(num_tokens)
    positions = torch.randint(0, max_pos - 8, (num_tokens,), dtype=torch.int32).repeat(3, 1)
    grid = torch.arange(6, dtype=torch.int32)
    positions[:, 2:8] = positions[0, 2]
    positions[1, 2:8] += grid // 3
    positions[2, 2:8] += grid % 3
    return positions


def test_mrope_rotary_ref_matches_hf():
    """The reference's M-RoPE against HF's Qwen2.5-VL rotary embedding and apply_rotary_pos_emb."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    section, head_dim = (2, 3, 3), 16
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section)},
        )
    ).text_config  # fmt: skip
    positions = mrope_test_positions(9, 64)
    q, k = torch.randn(9, 4, head_dim), torch.randn(9, 2, head_dim)
    cos, sin = Qwen2_5_VLRotaryEmbedding(config)(q, positions[:, None].long())
    q_hf, k_hf = apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    cos_sin = make_cos_sin(64, head_dim, 10000.0, torch.float32, "cpu")
    rotary_ref(q, k, positions, cos_sin, section)
    torch.testing.assert_close(q, q_hf[0])
    torch.testing.assert_close(k, k_hf[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("section", "head_dim"), [((2, 3, 3), 16), ((16, 24, 24), 128)])
def test_rotary_triton_mrope(dtype: torch.dtype, section: tuple[int, int, int], head_dim: int):
    """Per-frequency axes: each of the three sections rotates by its own position."""
    num_tokens, num_q_heads, num_kv_heads = 10, 4, 2
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    positions = mrope_test_positions(num_tokens, 100)
    cos_sin = make_cos_sin(100, head_dim, 10000.0, torch.float32, qkv.device)
    q_ref, k_ref = q.clone(), k.clone()
    q_plain, k_plain = q.clone(), k.clone()
    rotary_ref(q_ref, k_ref, positions, cos_sin, section)
    rotary_triton(q, k, positions, cos_sin, section)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    # Text rows rotate as plain rope at their one position; the image's grid rows do not.
    rotary_ref(q_plain, k_plain, positions[0], cos_sin)
    is_text = (positions == positions[0]).all(0)
    assert_close(q[is_text], q_plain[is_text])
    assert not torch.allclose(q[~is_text].float(), q_plain[~is_text].float(), atol=1e-2)


# ---------------------------------------------------------------- kv_store


def _slots(num_tokens: int, num_slots: int) -> torch.Tensor:
    """Distinct random slots with a few -1 (padding) entries."""
    slots = torch.randperm(num_slots)[:num_tokens].to(torch.int32)
    slots[::4] = -1
    return slots


def test_store_kv_ref_matches_flat_indexing():
    torch.manual_seed(0)
    k, v = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    k_cache, v_cache = torch.randn(6, 8, 2, 16), torch.randn(6, 8, 2, 16)
    slots = _slots(10, 48)
    expected_k, expected_v = k_cache.clone().view(48, 2, 16), v_cache.clone().view(48, 2, 16)
    is_stored = slots >= 0
    expected_k[slots[is_stored].long()] = k[is_stored]
    expected_v[slots[is_stored].long()] = v[is_stored]
    store_kv_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(48, 2, 16), expected_k)
    assert torch.equal(v_cache.view(48, 2, 16), expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"),
    [(1, 16, 16), (3, 64, 8), (4, 32, 16), (2, 96, 16), (3, 80, 8)],
)
def test_store_kv_triton(dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int):
    torch.manual_seed(num_kv_heads * head_dim)
    num_tokens, num_blocks = 13, 5
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, dtype=dtype)  # k and v as strided views
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slots = _slots(num_tokens, num_blocks * block_size)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_ref, v_ref, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    # A pure copy: bit-exact, and the random contents of unwritten slots survive.
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


# ---------------------------------------------------------------- paged attention


class PagedKV:
    """Dense per-sequence K/V plus the same data scattered into a paged cache over shuffled blocks."""

    def __init__(
        self, seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ):
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold noise that must never be read
        self.k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        block_ids = torch.randperm(num_blocks).tolist()
        self.block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
        self.keys, self.values = [], []
        for i, seq_len in enumerate(seq_lens):
            k = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)
            v = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)
            for j in range(blocks_per_seq[i]):
                block = block_ids.pop()
                self.block_tables[i, j] = block
                self.k_cache[block, : len(k[j * block_size :])] = k[j * block_size : (j + 1) * block_size]
                self.v_cache[block, : len(v[j * block_size :])] = v[j * block_size : (j + 1) * block_size]
            self.keys.append(k)
            self.values.append(v)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense attention of the last q_len positions of a sequence over all its keys, in fp32."""
    q_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    q_pos = torch.arange(seq_len - q_len, seq_len)
    is_visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().repeat_interleave(group, dim=1).transpose(0, 1),
        v.float().repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=is_visible,
        scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)


def _queries(seq_lens: list[int], q_lens: list[int], num_q_heads: int, head_dim: int, dtype: torch.dtype):
    assert all(0 < q <= n for q, n in zip(q_lens, seq_lens, strict=True))
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, query_start_loc


def test_paged_refs_match_dense_sdpa():
    torch.manual_seed(0)
    seq_lens, q_lens = [1, 16, 17, 40, 53], [1, 16, 5, 40, 1]
    kv = PagedKV(seq_lens, 2, 32, 16, torch.float32)
    q, query_start_loc = _queries(seq_lens, q_lens, 8, 32, torch.float32)
    out = paged_prefill_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 0.2)
    starts = query_start_loc.tolist()
    for i in range(len(seq_lens)):
        rows = slice(starts[i], starts[i + 1])
        torch.testing.assert_close(out[rows], sdpa_causal(q[rows], kv.keys[i], kv.values[i], 0.2))
    q_decode = torch.randn(len(seq_lens), 8, 32)
    out = paged_decode_ref(q_decode, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
    for i in range(len(seq_lens)):
        torch.testing.assert_close(
            out[i : i + 1], sdpa_causal(q_decode[i : i + 1], kv.keys[i], kv.values[i], 0.2)
        )


@pytest.mark.parametrize("window", [0, 40])
def test_paged_decode_triton_splits_each_sequence_in_a_wide_table(window: int) -> None:
    """Key splits over each sequence's own keys (in its window), not over the block table's width:
    a table 8x wider than the longest context (a CUDA graph's, sized for max_model_len) whose
    extra columns name blocks of noise, with short and long sequences, gives the reference's
    output with the tight table."""
    torch.manual_seed(7 + window)
    block_size, seq_lens = 16, [1, 17, 70, 200]
    kv = PagedKV(seq_lens, 2, 32, block_size, torch.float32)
    wide = torch.randint(
        0, kv.k_cache.shape[0], (len(seq_lens), 8 * kv.block_tables.shape[1]), dtype=torch.int32
    )
    used = -(-kv.seq_lens // block_size)
    for i, n in enumerate(used.tolist()):
        wide[i, :n] = kv.block_tables[i, :n]
    q = torch.randn(len(seq_lens), 8, 32)
    want = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2, window=window)
    for num_splits in (2, 5):
        got = paged_decode_triton(
            q, kv.k_cache, kv.v_cache, wide, kv.seq_lens, 0.2, num_splits=num_splits, window=window
        )
        assert_close(got, want)


# (dtype, Hq, Hk, D): G = 1, 2, 4, 3 and MQA in fp32; fp16 (slow in the interpreter) on two of them.
ATTENTION_SHAPES = [
    (torch.float32, 4, 4, 32),
    (torch.float32, 4, 2, 16),
    (torch.float32, 8, 2, 64),
    (torch.float32, 6, 2, 32),
    (torch.float32, 4, 1, 32),
    (torch.float16, 8, 2, 64),
    (torch.float16, 6, 2, 32),
    # Head sizes no power of two: Phi-3-mini's 96, and 80; and 8, under tl.dot's 16.
    (torch.float32, 4, 2, 96),
    (torch.float16, 3, 1, 80),
    (torch.float32, 2, 1, 8),
]


@pytest.mark.parametrize(("dtype", "num_q_heads", "num_kv_heads", "head_dim"), ATTENTION_SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_triton(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, num_splits: int
):
    torch.manual_seed(num_q_heads * head_dim + num_splits)
    block_size = 16
    # 1, B, B+1 and several blocks; 130 spans three key tiles of 64. Short sequences leave later splits empty.
    seq_lens = [1, block_size, block_size + 1, 3 * block_size + 5, 130]
    kv = PagedKV(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, dtype=dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    assert_close(paged_decode_triton(*args, num_splits=num_splits), paged_decode_ref(*args))


@pytest.mark.parametrize(("dtype", "num_q_heads", "num_kv_heads", "head_dim"), ATTENTION_SHAPES)
@pytest.mark.parametrize(
    ("seq_lens", "q_lens", "block_size"),
    [
        ([1, 8, 9, 70], [1, 8, 9, 70], 8),  # fresh prompts at block boundaries; 70 spans two query tiles
        ([40, 100], [7, 36], 16),  # chunked: cached prefix + new chunk
        ([33, 5, 90, 17], [1, 5, 25, 1], 16),  # mixed: decodes, a fresh prompt and a chunk in one batch
    ],
)
def test_paged_prefill_triton(
    dtype: torch.dtype,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: list[int],
    q_lens: list[int],
    block_size: int,
):
    torch.manual_seed(num_q_heads * head_dim + sum(seq_lens))
    kv = PagedKV(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q, query_start_loc = _queries(seq_lens, q_lens, num_q_heads, head_dim, dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, head_dim**-0.5)
    assert_close(paged_prefill_triton(*args), paged_prefill_ref(*args))


def test_decode_is_prefill_with_one_query():
    """The two entry points agree on q_len == 1, so the model may route decodes through either."""
    torch.manual_seed(1)
    kv = PagedKV([3, 29, 64], 2, 32, 16, torch.float32)
    q = torch.randn(3, 4, 32)
    query_start_loc = torch.arange(4, dtype=torch.int32)
    decode = paged_decode_triton(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.25)
    prefill = paged_prefill_triton(
        q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 0.25
    )
    torch.testing.assert_close(decode, prefill)


# ---------------------------------------------------------------- C++ ops of the CPU path


def has_cpu_kernels() -> bool:
    """The C++ kernels must build wherever the CPU has AVX2 (a failed build fails these tests)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the C++ kernels need AVX2 + FMA")
    return cpu_ops.load()


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),  # SmolLM2-135M
        (4, 4, 32, 16),
        (4, 2, 16, 8),
        (8, 2, 128, 16),
        (6, 2, 96, 1),
        (4, 1, 256, 32),
    ],
)
@pytest.mark.usefixtures("cpu_isa")
def test_paged_decode_cpu_matches_ref(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
    assert has_cpu_kernels()
    torch.manual_seed(num_q_heads * head_dim + block_size)
    seq_lens = [1, block_size, block_size + 1, 3 * block_size + 5, 130]
    kv = PagedKV(seq_lens, num_kv_heads, head_dim, block_size, torch.float32)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    assert_close(cpu_ops.paged_decode(*args), paged_decode_ref(*args))
    # A strided q (a view into the fused qkv projection, as the model passes it) reads the same.
    qkv = torch.cat((q, torch.randn(len(seq_lens), 2, head_dim)), dim=1)
    strided = (qkv[:, :num_q_heads], *args[1:])
    assert_close(cpu_ops.paged_decode(*strided), paged_decode_ref(*args))


@pytest.fixture
def one_thread():
    """torch's (and the C++ ops') thread count at 1 for the test, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("cpu_isa", "one_thread")
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_decode_cpu_is_batch_independent(with_sinks: bool):
    """A sequence's output does not depend on the others in its batch, bit for bit. On one thread
    the batch of four is split by sequence (all of a sequence's heads in one work item) and a
    batch of one by KV head, so the two splits must agree too."""
    assert has_cpu_kernels()
    torch.manual_seed(1)
    kv = PagedKV([5, 40, 77, 16], 3, 64, 16, torch.float32)
    q = torch.randn(4, 9, 64)
    sinks = torch.randn(9) if with_sinks else None
    together = cpu_ops.paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, sinks)
    assert_close(
        together,
        paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, 0, 0.0, sinks),
    )
    for i in range(4):
        alone = cpu_ops.paged_decode(
            q[i : i + 1],
            kv.k_cache,
            kv.v_cache,
            kv.block_tables[i : i + 1],
            kv.seq_lens[i : i + 1],
            0.125,
            sinks,
        )
        assert torch.equal(alone, together[i : i + 1])


def test_paged_decode_cpu_refuses_bad_input():
    """Lengths, block ids and shapes are checked before any page is read: an error, not a crash."""
    assert has_cpu_kernels()
    kv = PagedKV([20, 3], 2, 32, 16, torch.float32)
    q = torch.randn(2, 4, 32)

    def run(**changes):
        args = {"q": q, "k_cache": kv.k_cache, "v_cache": kv.v_cache, "block_tables": kv.block_tables}
        args |= {"seq_lens": kv.seq_lens, "scale": 0.2, **changes}
        return cpu_ops.paged_decode(**args)

    bad_table = kv.block_tables.clone()
    bad_table[0, 1] = kv.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id"):
        run(block_tables=bad_table)
    for length in (0, kv.block_tables.shape[1] * 16 + 1):
        with pytest.raises(RuntimeError, match="length"):
            run(seq_lens=torch.tensor([length, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="float32"):
        run(q=q.double())
    with pytest.raises(RuntimeError, match="head_dim"):
        run(
            q=q[..., :24],
            k_cache=kv.k_cache[..., :24].contiguous(),
            v_cache=kv.v_cache[..., :24].contiguous(),
        )
    with pytest.raises(RuntimeError, match="heads"):
        run(q=torch.randn(2, 3, 32))
    assert not cpu_ops.has_paged_decode(32, torch.bfloat16)


def test_paged_decode_cpu_without_a_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A failed build is reported (False, logged), not raised: the CPU path keeps its torch ops."""
    monkeypatch.setenv("BRIGADE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    cpu_ops.load_isa.cache_clear()
    try:
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            assert not cpu_ops.load()
            assert not cpu_ops.has_paged_decode(64, torch.float32)
        assert list(tmp_path.rglob("*.so*")) == []  # no half-written build left behind
    finally:
        cpu_ops.load_isa.cache_clear()


def test_the_kernels_build_for_the_widest_instruction_set_the_cpu_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """isa() takes the widest build whose CPU flags are all present, BRIGADE_CPU_ISA overrides it
    (an unknown name is an error that lists the known ones), and a build the CPU cannot run is
    refused before anything is compiled."""
    avx2_only = cpu_ops.ISAS["avx2"].cpu_flags | {"sse4_2"}
    try:
        monkeypatch.delenv("BRIGADE_CPU_ISA", raising=False)
        for flags, widest in ((avx2_only, "avx2"), (avx2_only | cpu_ops.ISAS["avx512"].cpu_flags, "avx512")):
            monkeypatch.setattr(cpu_ops, "cpu_flags", lambda flags=flags: frozenset(flags))
            cpu_ops.isa.cache_clear()
            assert cpu_ops.isa() == widest
            assert cpu_ops.available_isas()[-1] == widest
        monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset(avx2_only))
        cpu_ops.load_isa.cache_clear()
        monkeypatch.setenv("BRIGADE_CACHE", "/nonexistent/never-built")
        assert not cpu_ops.load_isa("avx512")  # lacks avx512f: refused, nothing built
        monkeypatch.setenv("BRIGADE_CPU_ISA", "avx2")
        cpu_ops.isa.cache_clear()
        assert cpu_ops.isa() == "avx2"
        monkeypatch.setenv("BRIGADE_CPU_ISA", "sse9")
        cpu_ops.isa.cache_clear()
        with pytest.raises(ValueError, match="avx2, avx512"):
            cpu_ops.isa()
    finally:
        cpu_ops.isa.cache_clear()
        cpu_ops.load_isa.cache_clear()


def test_without_a_readable_cpuinfo_the_cpu_counts_as_avx2_by_torchs_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Unreadable:
        def __init__(self, *_: object) -> None:
            pass

        def read_text(self) -> str:
            raise PermissionError("/proc/cpuinfo")

    monkeypatch.setattr(cpu_ops, "Path", Unreadable)
    cpu_ops.cpu_flags.cache_clear()
    try:
        has_avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        assert cpu_ops.cpu_flags() == (cpu_ops.AVX2_CPU_FLAGS if has_avx2 else frozenset())
        assert cpu_ops.available_isas() == (["avx2"] if has_avx2 else [])
    finally:
        cpu_ops.cpu_flags.cache_clear()


def test_both_builds_load_into_one_process_under_their_own_namespaces() -> None:
    """Where the CPU runs both builds, each registers its ops apart (the tests use that to hold
    each against the references); their float results agree to rounding, their 8-bit ones exactly."""
    if cpu_ops.available_isas() != ["avx2", "avx512"]:
        pytest.skip("this CPU runs only the AVX2 build")
    assert all(cpu_ops.load_isa(name) for name in cpu_ops.ISAS)
    narrow, wide = (getattr(torch.ops, isa.namespace) for isa in cpu_ops.ISAS.values())
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 576, generator=gen).numpy()
    blocks = torch.from_numpy(cpu_ops.to_lanes(quantize(weight, GGMLQuantizationType.Q8_0), "Q8_0"))
    x = torch.randn(3, 576, generator=gen)
    assert_close(
        wide.few_rows_linear_quantized(x, blocks, "Q8_0"), narrow.few_rows_linear_quantized(x, blocks, "Q8_0")
    )
    assert torch.equal(
        wide.linear_quantized_int8(x, blocks, "Q8_0"), narrow.linear_quantized_int8(x, blocks, "Q8_0")
    )


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (40, 7), (3, 130)])
@pytest.mark.usefixtures("cpu_isa")
def test_few_rows_linear_matches_f_linear(in_features: int, out_features: int):
    """0-4 rows, with and without bias, a strided input; in_features off the 32-wide loop too."""
    assert has_cpu_kernels()
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for num_rows in range(5):
        x = torch.randn(in_features, num_rows, generator=gen).t()  # [num_rows, in], transposed strides
        for b in (None, bias):
            got = cpu_ops.few_rows_linear(x, weight, b)
            torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_few_rows_linear_refuses_bad_input():
    assert has_cpu_kernels()
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="at most 4 rows"):
        cpu_ops.few_rows_linear(torch.randn(5, 16), weight)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.few_rows_linear(torch.randn(2, 15), weight)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.few_rows_linear(torch.randn(2, 16, dtype=torch.float64), weight)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_ops.few_rows_linear(torch.randn(2, 16), weight, torch.randn(7))


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])  # the K-quants: test_few_rows_linear_k_quants_...
# Rows of 8 and 11 blocks: Q4_1's minimums all in the masked tail with 16 lanes, part with 8.
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(576, 960), (1536, 70), (32, 5), (256, 40), (352, 9)]
)
@pytest.mark.usefixtures("cpu_isa")
def test_few_rows_linear_quantized_matches_dequantized(fmt: str, in_features: int, out_features: int):
    """GGUF blocks (made by gguf's own quantizer), packed by to_lanes, multiply like their
    dequantization (gguf's own) does with F.linear: 0-4 rows, strided input."""
    assert has_cpu_kernels()
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[fmt]
    gen = torch.Generator().manual_seed(in_features + out_features)
    blocks = quantize(torch.randn(out_features, in_features, generator=gen).numpy(), qtype)
    weight = torch.from_numpy(dequantize(blocks, qtype).astype("float32"))
    lanes = torch.from_numpy(cpu_ops.to_lanes(blocks, fmt))
    num_blocks = in_features // cpu_ops.BLOCK_WEIGHTS
    assert lanes.shape == (out_features, num_blocks * cpu_ops.PACKED_BLOCK_BYTES[fmt])
    for num_rows in range(5):
        x = torch.randn(in_features, num_rows, generator=gen).t()
        got = cpu_ops.few_rows_linear_quantized(x, lanes, fmt)
        torch.testing.assert_close(got, F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_few_rows_linear_quantized_refuses_bad_input():
    assert has_cpu_kernels()
    blocks = torch.zeros(4, 48, dtype=torch.uint8)  # Q4_1: 2 packed blocks of 24 bytes a row = 64 inputs
    with pytest.raises(RuntimeError, match="unknown format"):
        cpu_ops.few_rows_linear_quantized(torch.randn(1, 64), blocks, "Q3_K")
    with pytest.raises(RuntimeError, match="bytes"):
        cpu_ops.few_rows_linear_quantized(torch.randn(1, 96), blocks, "Q4_1")
    with pytest.raises(RuntimeError, match="at most 4 rows"):
        cpu_ops.few_rows_linear_quantized(torch.randn(5, 64), blocks, "Q4_1")
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_ops.few_rows_linear_quantized(torch.randn(1, 64), blocks.float(), "Q4_1")
    with pytest.raises(ValueError, match="unknown quantized format"):
        cpu_ops.to_lanes(blocks.numpy(), "Q3_K")


@pytest.mark.usefixtures("cpu_isa")
def test_add_rms_norm_matches_torch():
    assert has_cpu_kernels()
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(576, generator=gen)
    for num_rows in (1, 4, 64):
        x, residual = torch.randn(num_rows, 576, generator=gen), torch.randn(num_rows, 576, generator=gen)
        normed, summed = cpu_ops.add_rms_norm(x, weight, 1e-5, residual)
        torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
        torch.testing.assert_close(
            normed, F.rms_norm(x + residual, (576,), weight, 1e-5), atol=1e-5, rtol=1e-5
        )
        normed, summed = cpu_ops.add_rms_norm(x, weight, 1e-5, None)
        assert torch.equal(summed, x)
        torch.testing.assert_close(normed, F.rms_norm(x, (576,), weight, 1e-5), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        cpu_ops.add_rms_norm(x, weight, 1e-5, torch.randn(2, 576))


@pytest.mark.usefixtures("cpu_isa")
def test_logsumexp_argmax_matches_torch():
    """The sampler's pass over the logits: torch.logsumexp's values and torch.argmax's indices,
    ties to the first largest, a NaN row's first NaN, rows of -inf, widths off the vector size."""
    assert has_cpu_kernels()
    gen = torch.Generator().manual_seed(5)
    for num_rows, vocab in ((1, 1), (3, 7), (2, 8), (5, 49152), (64, 1003)):
        x = torch.randn(num_rows, vocab, generator=gen) * 8
        log_norms, argmax = cpu_ops.logsumexp_argmax(x)
        torch.testing.assert_close(log_norms, torch.logsumexp(x, dim=-1), atol=1e-5, rtol=1e-6)
        assert torch.equal(argmax, x.argmax(dim=-1))
    x = torch.full((6, 37), -float("inf"))
    x[0, [3, 20, 29]] = 2.0  # ties: the first index, across lanes and in the tail
    x[1, [17, 9]] = 1.0
    x[2, [5, 33]] = float("nan")
    x[3, 11] = float("inf")
    x[4, :] = torch.randn(37, generator=gen)  # row 5 stays all -inf
    x[4, 36] = 50.0
    log_norms, argmax = cpu_ops.logsumexp_argmax(x)
    assert argmax.tolist() == [3, 9, 5, 11, 36, 0] == x.argmax(dim=-1).tolist()
    expected = torch.logsumexp(x, dim=-1)
    torch.testing.assert_close(log_norms[[0, 1, 4]], expected[[0, 1, 4]])
    assert torch.isnan(log_norms[2]) and log_norms[3] == float("inf") and log_norms[5] == -float("inf")
    # A strided view (every other row) reads the same as its copy.
    x = torch.randn(8, 300, generator=gen)
    assert torch.equal(cpu_ops.logsumexp_argmax(x[::2])[1], x[::2].argmax(dim=-1))
    for bad in (torch.randn(4), torch.randn(2, 3).double(), torch.randn(2, 0)):
        with pytest.raises(RuntimeError, match="float32"):
            cpu_ops.logsumexp_argmax(bad)


def test_few_rows_decode_layers_refuse_bad_arguments_before_writing():
    """The one-op decode step checks the KV slots, caches, weight shapes and formats before it
    writes a row: nothing may be thrown from inside its parallel region."""
    assert has_cpu_kernels()
    hidden, heads, kv_heads, head_dim = 32, 2, 1, 16
    qkv = torch.randn((heads + 2 * kv_heads) * head_dim, hidden)
    mlp = torch.randn(64, hidden)
    kv = PagedKV([3], kv_heads, head_dim, 16, torch.float32)

    def run(slots, k_cache=kv.k_cache, qkv=qkv, gate_up=mlp, gate_up_format=""):
        layers = cpu_ops.DecodeLayers(
            [torch.ones(hidden), torch.ones(hidden)],
            [qkv, torch.randn(hidden, heads * head_dim), gate_up, torch.randn(hidden, 32)],
            ["", "", gate_up_format, ""], [1, 1, 1, 1], [None],
        )  # fmt: skip
        return cpu_ops.few_rows_decode_layers(
            torch.randn(1, hidden), layers, 1e-5, torch.ones(1, head_dim), torch.zeros(1, head_dim),
            ([k_cache], [kv.v_cache]), slots, kv.block_tables.long(), kv.seq_lens.long(), heads, 0.25,
        )  # fmt: skip

    out, _ = run(torch.tensor([kv.block_tables[0, 0].item() * 16 + 2]))
    assert out.shape == (1, hidden)
    caches = kv.k_cache.clone(), kv.v_cache.clone()
    with pytest.raises(RuntimeError, match="slot"):
        run(torch.tensor([kv.k_cache.shape[0] * 16]))
    with pytest.raises(RuntimeError, match="caches"):
        run(torch.tensor([0]), k_cache=kv.k_cache.transpose(1, 2))
    with pytest.raises(RuntimeError, match="QKV has 60 output columns in 1 parts, the layer needs 64"):
        run(torch.tensor([0]), qkv=torch.randn(60, hidden))
    with pytest.raises(
        RuntimeError, match=r"down part 0 .* 24 inputs need 96"
    ):  # gate_up sets the MLP's width
        run(torch.tensor([0]), gate_up=torch.randn(48, hidden))
    with pytest.raises(RuntimeError, match="unknown format Q3_X"):
        run(torch.tensor([0]), gate_up=torch.zeros(64, 24, dtype=torch.uint8), gate_up_format="Q3_X")
    with pytest.raises(RuntimeError, match="bytes a row"):
        run(torch.tensor([0]), gate_up=torch.zeros(64, 23, dtype=torch.uint8), gate_up_format="Q4_1")
    assert torch.equal(kv.k_cache, caches[0]) and torch.equal(kv.v_cache, caches[1])  # nothing written


def test_paged_refs_window_and_softcap_match_dense():
    """The references' sliding window and soft cap against a dense computation written out here."""
    torch.manual_seed(2)
    seq_lens, q_lens, window, cap = [30, 45], [30, 6], 10, 1.5
    kv = PagedKV(seq_lens, 2, 16, 8, torch.float32)
    q, query_start_loc = _queries(seq_lens, q_lens, 4, 16, torch.float32)
    out = paged_prefill_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 0.3, window, cap
    )
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens):
        for j in range(q_lens[i]):
            pos = seq_len - q_lens[i] + j
            keys = range(max(pos - window + 1, 0), pos + 1)
            k = kv.keys[i][list(keys)].repeat_interleave(2, dim=1)  # [L, Hq, D]
            v = kv.values[i][list(keys)].repeat_interleave(2, dim=1)
            scores = torch.einsum("hd,khd->hk", q[starts[i] + j], k) * 0.3
            probs = (cap * torch.tanh(scores / cap)).softmax(-1)
            torch.testing.assert_close(out[starts[i] + j], torch.einsum("hk,khd->hd", probs, v))


@pytest.mark.parametrize(("window", "softcap"), [(10, 0.0), (0, 2.0), (21, 1.5)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_triton_window_softcap(window: int, softcap: float, num_splits: int):
    torch.manual_seed(window + num_splits)
    seq_lens = [1, 9, 16, 17, 53, 130]  # shorter and longer than the window; 130 spans three tiles
    kv = PagedKV(seq_lens, 2, 32, 16, torch.float32)
    q = torch.randn(len(seq_lens), 4, 32)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 32**-0.5)
    got = paged_decode_triton(*args, num_splits=num_splits, window=window, softcap=softcap)
    assert_close(got, paged_decode_ref(*args, window, softcap))


@pytest.mark.parametrize(("window", "softcap"), [(10, 0.0), (0, 2.0), (21, 1.5)])
def test_paged_prefill_triton_window_softcap(window: int, softcap: float):
    torch.manual_seed(window)
    seq_lens, q_lens = [33, 5, 90, 17, 70], [1, 5, 25, 1, 70]  # decodes, prompts, a chunk
    kv = PagedKV(seq_lens, 2, 32, 16, torch.float32)
    q, query_start_loc = _queries(seq_lens, q_lens, 4, 32, torch.float32)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 32**-0.5)
    assert_close(
        paged_prefill_triton(*args, window=window, softcap=softcap), paged_prefill_ref(*args, window, softcap)
    )


def image_groups_of(q_lens: list[int], images: list[tuple[int, int, int]]) -> np.ndarray:
    """The plan's image_groups [T] for images given as (sequence, first query token, tokens)."""
    groups = np.full(sum(q_lens), -1, np.int32)
    for g, (seq, first, size) in enumerate(images):
        start = sum(q_lens[:seq]) + first
        groups[start : start + size] = g
    return groups


# Prompt chunks after a cached prefix (an image at the chunk's first token and one at its last),
# several images in one prompt, one across the kernel's query tiles (32 tokens at G = 2), and decodes.
IMAGE_SEQ_LENS, IMAGE_Q_LENS = [33, 40, 90, 17, 70], [1, 20, 70, 1, 70]
IMAGES = [(1, 0, 6), (1, 16, 4), (2, 3, 5), (2, 28, 9), (2, 50, 20), (4, 10, 16)]


def test_paged_ref_images_match_dense():
    """The reference's image tails against a dense mask written out here: causal, or the same
    image both ways (then the window, as HF's Gemma 3 mask)."""
    torch.manual_seed(5)
    window = 12
    kv = PagedKV(IMAGE_SEQ_LENS, 2, 16, 8, torch.float32)
    q, query_start_loc = _queries(IMAGE_SEQ_LENS, IMAGE_Q_LENS, 4, 16, torch.float32)
    groups = image_groups_of(IMAGE_Q_LENS, IMAGES)
    tails = torch.from_numpy(image_tails(groups))
    out = paged_prefill_ref(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        query_start_loc,
        kv.seq_lens,
        0.3,
        window,
        0.0,
        None,
        tails,
    )
    starts = query_start_loc.tolist()
    for i, (seq_len, q_len) in enumerate(zip(IMAGE_SEQ_LENS, IMAGE_Q_LENS, strict=True)):
        rows = slice(starts[i], starts[i + 1])
        q_pos = torch.arange(seq_len - q_len, seq_len)
        k_pos = torch.arange(seq_len)
        key_groups = torch.full((seq_len,), -1, dtype=torch.int32)
        key_groups[seq_len - q_len :] = torch.from_numpy(groups[rows])
        query_groups = key_groups[seq_len - q_len :]
        same_image = (query_groups[:, None] == key_groups[None, :]) & (query_groups[:, None] >= 0)
        mask = ((k_pos[None, :] <= q_pos[:, None]) | same_image) & (k_pos[None, :] > q_pos[:, None] - window)
        group = 2
        expected = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),
            kv.keys[i].repeat_interleave(group, dim=1).transpose(0, 1),
            kv.values[i].repeat_interleave(group, dim=1).transpose(0, 1),
            attn_mask=mask,
            scale=0.3,
        ).transpose(0, 1)
        torch.testing.assert_close(out[rows], expected)
    # The images change the answer: without them, the tokens before each image's last differ.
    causal = paged_prefill_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 0.3, window
    )
    assert not torch.allclose(causal, out)


@pytest.mark.parametrize(
    ("dtype", "window", "softcap"),
    [(torch.float32, 0, 0.0), (torch.float32, 12, 1.5), (torch.float16, 0, 0.0)],
)
def test_paged_prefill_triton_images(dtype: torch.dtype, window: int, softcap: float):
    """Image tokens that see their whole image: the kernel against the reference."""
    torch.manual_seed(window)
    kv = PagedKV(IMAGE_SEQ_LENS, 2, 32, 16, dtype)
    q, query_start_loc = _queries(IMAGE_SEQ_LENS, IMAGE_Q_LENS, 4, 32, dtype)
    tails = torch.from_numpy(image_tails(image_groups_of(IMAGE_Q_LENS, IMAGES))).to(q.device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 32**-0.5)
    assert_close(
        paged_prefill_triton(*args, window=window, softcap=softcap, image_tails=tails),
        paged_prefill_ref(*args, window, softcap, None, tails),
    )


def test_paged_refs_sinks_match_dense():
    """The references' sinks (with a window) against a dense computation written out here: each
    query head's sink logit joins its softmax's denominator, and takes no value."""
    torch.manual_seed(3)
    seq_lens, q_lens, window = [30, 45], [30, 6], 10
    kv = PagedKV(seq_lens, 2, 16, 8, torch.float32)
    q, query_start_loc = _queries(seq_lens, q_lens, 4, 16, torch.float32)
    sinks = torch.randn(4) * 2
    out = paged_prefill_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 0.3, window, 0.0, sinks
    )
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens):
        for j in range(q_lens[i]):
            pos = seq_len - q_lens[i] + j
            keys = list(range(max(pos - window + 1, 0), pos + 1))
            k = kv.keys[i][keys].repeat_interleave(2, dim=1)  # [L, Hq, D]
            v = kv.values[i][keys].repeat_interleave(2, dim=1)
            exp_scores = (torch.einsum("hd,khd->hk", q[starts[i] + j], k) * 0.3).exp()
            probs = exp_scores / (exp_scores.sum(-1, keepdim=True) + sinks.exp()[:, None])
            torch.testing.assert_close(out[starts[i] + j], torch.einsum("hk,khd->hd", probs, v))


@pytest.mark.parametrize("window", [0, 10])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_triton_sinks(window: int, num_splits: int):
    """Sinks over key splits: only the first split carries a head's sink into the merge."""
    torch.manual_seed(window + num_splits)
    seq_lens = [1, 9, 17, 53, 130]
    kv = PagedKV(seq_lens, 2, 32, 16, torch.float32)
    q = torch.randn(len(seq_lens), 4, 32)
    sinks = torch.randn(4) * 2
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 32**-0.5)
    got = paged_decode_triton(*args, num_splits=num_splits, window=window, sinks=sinks)
    assert_close(got, paged_decode_ref(*args, window, 0.0, sinks))


@pytest.mark.parametrize("window", [0, 10])
def test_paged_prefill_triton_sinks(window: int):
    torch.manual_seed(window)
    seq_lens, q_lens = [33, 5, 90, 17, 70], [1, 5, 25, 1, 70]
    kv = PagedKV(seq_lens, 2, 32, 16, torch.float32)
    q, query_start_loc = _queries(seq_lens, q_lens, 4, 32, torch.float32)
    sinks = torch.randn(4) * 2
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens, 32**-0.5)
    assert_close(
        paged_prefill_triton(*args, window=window, sinks=sinks), paged_prefill_ref(*args, window, 0.0, sinks)
    )


@pytest.mark.usefixtures("cpu_isa")
def test_paged_decode_cpu_sinks_match_ref():
    assert has_cpu_kernels()
    torch.manual_seed(4)
    seq_lens = [1, 16, 17, 53]
    kv = PagedKV(seq_lens, 2, 64, 16, torch.float32)
    q = torch.randn(len(seq_lens), 6, 64)
    sinks = torch.randn(6) * 2
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    assert_close(cpu_ops.paged_decode(*args, sinks), paged_decode_ref(*args, 0, 0.0, sinks))
    with pytest.raises(RuntimeError, match="sinks"):
        cpu_ops.paged_decode(*args, sinks[:5])


def random_k_quant_blocks(
    fmt: str, num_rows: int, in_features: int, seed: int, scale: float = 0.01
) -> np.ndarray:
    """Random super-blocks [rows, bytes] of a K-quant, every byte random except the float16
    super-scales, set to finite values below `scale` (random bytes could make them inf or nan)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (num_rows, in_features // weights, size), dtype=np.uint8)
    scales = (rng.random((num_rows, in_features // weights, 2)) * scale).astype(np.float16).view(np.uint8)
    if fmt == "Q6_K":  # d is the last two bytes
        blocks[..., size - 2 :] = scales[..., :2]
    else:  # d and dmin lead the block
        blocks[..., :4] = scales.reshape(num_rows, -1, 4)
    return blocks.reshape(num_rows, -1)


@pytest.mark.skipif(not has_cpu_kernels(), reason="no C++ compiler / AVX2")
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize(("in_features", "out_features"), [(512, 70), (256, 3), (1536, 33)])
@pytest.mark.usefixtures("cpu_isa")
def test_few_rows_linear_k_quants_match_gguf_dequantize(fmt: str, in_features: int, out_features: int):
    """Each K-quant GEMV from its own super-blocks against x @ W^T with W from gguf's dequantizer:
    one to six super-blocks a row (random bytes: every quant, high-bit and scale pattern), an odd
    number of outputs, 0-4 rows, a strided x."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = random_k_quant_blocks(fmt, out_features, in_features, seed=len(fmt) + ord(fmt[1]) + in_features)
    weight = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).astype(np.float32))
    assert weight.shape == (out_features, in_features) and torch.isfinite(weight).all()
    packed = torch.from_numpy(cpu_ops.to_lanes(blocks, fmt))
    for num_rows in range(5):
        x = torch.randn(in_features, num_rows, generator=torch.Generator().manual_seed(num_rows)).t()
        got, expected = cpu_ops.few_rows_linear_quantized(x, packed, fmt), x @ weight.T
        scale = float(expected.abs().max()) if num_rows else 1.0
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * scale)
    with pytest.raises(RuntimeError, match="super-blocks"):
        cpu_ops.few_rows_linear_quantized(torch.randn(1, in_features + 256), packed, fmt)


# ---------------------------------------------------------------- fused MoE


def random_gguf_blocks(fmt: str, num_rows: int, in_features: int, seed: int) -> np.ndarray:
    """GGUF blocks [rows, bytes] of a format: gguf's own quantizer's for Q4_1 / Q8_0 (of random
    weights), random super-blocks for the K-quants (random_k_quant_blocks)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if fmt in cpu_ops.K_QUANTS:
        return random_k_quant_blocks(fmt, num_rows, in_features, seed)
    weights = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(seed)) * 0.1
    return quantize(weights.numpy(), GGMLQuantizationType[fmt])


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def routing_cases(num_experts: int, hidden: int, gen: torch.Generator):
    """(x, weights, experts) of a MoE step: 0-16 rows (x strided), top-1 / 2 / 4, expert 0 never
    chosen and expert 1 by every row (more rows than one chunk of four)."""
    for num_rows, top_k in ((0, 2), (1, 1), (1, 4), (3, 2), (8, 2), (16, 4)):
        x = torch.randn(hidden, num_rows, generator=gen).t()
        logits = torch.randn(num_rows, num_experts, generator=gen)
        logits[:, 0], logits[:, 1] = -100.0, 100.0
        yield x, torch.rand(num_rows, top_k, generator=gen), torch.topk(logits, top_k)[1]


# Each supported format for all three projections (MXFP4 from gguf's quantizer, as llama.cpp's
# MXFP4_MOE files hold any MoE's experts), and a Q4_K_M file's experts (gate and up Q4_K, down Q6_K).
MOE_EXPERT_FORMATS = [(fmt, fmt, fmt) for fmt in cpu_ops.EXPERT_FORMATS] + [("Q4_K", "Q4_K", "Q6_K")]


@pytest.mark.skipif(not has_cpu_kernels(), reason="no C++ compiler / AVX2")
@pytest.mark.parametrize("formats", MOE_EXPERT_FORMATS, ids="-".join)
@pytest.mark.usefixtures("cpu_isa")
def test_moe_experts_matches_the_float32_reference(formats: tuple[str, str, str]) -> None:
    """The fused few-rows MoE op from each expert's own blocks against fused_moe_ref on their
    dequantization (gguf's dequantizer): 0-16 rows, top-1 / 2 / 4, an expert every row chooses
    (more rows than one chunk of four), one no row chooses, a strided x; dequantize_blocks gives
    gguf's values exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kernels.fused_moe import fused_moe_ref

    num_experts, hidden, inter = 6, 512, 256  # whole super-blocks both ways
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))  # gate, up, down: [out, in] an expert
    projections, dense = [], []
    for seed, (fmt, (rows, columns)) in enumerate(zip(formats, shapes, strict=True)):
        raw = random_gguf_blocks(fmt, num_experts * rows, columns, seed)
        weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32))
        packed = torch.from_numpy(cpu_ops.to_lanes(raw, fmt))
        assert torch.equal(cpu_ops.dequantize_blocks(packed, fmt), weight)
        projections.append((packed.view(num_experts, rows, -1), fmt))
        dense.append(weight.view(num_experts, rows, columns))
    gate_up, down = torch.cat(dense[:2], dim=1), dense[2]
    for x, weights, experts in routing_cases(num_experts, hidden, torch.Generator().manual_seed(7)):
        got = cpu_ops.moe_experts(x, weights, experts, *projections)
        want = fused_moe_ref(x, gate_up, down, weights, experts, silu_glu)
        scale = float(want.abs().max()) if len(x) else 1.0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.skipif(not has_cpu_kernels(), reason="no C++ compiler / AVX2")
@pytest.mark.parametrize("swiglu", [None, (1.702, 0.5)], ids=["silu", "gpt-oss"])
@pytest.mark.usefixtures("cpu_isa")
def test_moe_experts_float32_matches_the_reference(swiglu: tuple[float, float] | None) -> None:
    """The fused few-rows MoE op on float32 experts (format ""): gate and up as views of one
    [E, 2I, H] gate_up, as the model holds them, against fused_moe_ref on the same weights, 0-16
    rows, top-1 / 2 / 4, an expert every row chooses, one none does, a strided x; with gpt-oss's
    biases and clamped SwiGLU (a limit of 0.5 clamps most gates and ups) as well as SiLU. Float32
    summation order apart, the same values."""
    from kernels.fused_moe import fused_moe_ref
    from services.gpu_worker.model import clamped_swiglu

    num_experts, hidden, inter = 6, 200, 72  # no whole number of 64-wide vectors: the tails too
    gen = torch.Generator().manual_seed(11)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.1
    biases, glu = {}, silu_glu
    if swiglu is not None:
        biases = dict(
            gate_up_bias=torch.randn(num_experts, 2 * inter, generator=gen),
            down_bias=torch.randn(num_experts, hidden, generator=gen),
        )
        glu = partial(clamped_swiglu, alpha=swiglu[0], limit=swiglu[1])
    projections = ((gate_up[:, :inter], ""), (gate_up[:, inter:], ""), (down, ""))
    for x, weights, experts in routing_cases(num_experts, hidden, gen):
        got = cpu_ops.moe_experts(x, weights, experts, *projections, swiglu=swiglu, **biases)
        want = fused_moe_ref(x, gate_up, down, weights, experts, glu, **biases)
        scale = float(want.abs().max()) if len(x) else 1.0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
    # Each expert's rows must be contiguous [out, in]: a transposed weight is refused, by name.
    with pytest.raises(
        RuntimeError, match=r"down \(float32\) must be \[6, 200, 72\] with each expert's rows"
    ):
        cpu_ops.moe_experts(x, weights, experts, *projections[:2], (down.transpose(1, 2).contiguous().mT, ""))
    with pytest.raises(RuntimeError, match=r"gate must be contiguous uint8"):
        cpu_ops.moe_experts(x, weights, experts, (gate_up[:, :inter], "Q8_0"), *projections[1:])


def random_mxfp4(
    num_experts: int, out_features: int, in_features: int, seed: int, exponents: tuple[int, int]
):
    """Random MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32] as gpt-oss's
    checkpoints store them (every code in both nibbles), exponents in [low, high)."""
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // cpu_ops.BLOCK_WEIGHTS
    blocks = torch.randint(0, 256, (num_experts, out_features, groups, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(*exponents, (num_experts, out_features, groups), dtype=torch.uint8, generator=gen)
    return blocks, scales


@pytest.mark.skipif(not has_cpu_kernels(), reason="no C++ compiler / AVX2")
@pytest.mark.usefixtures("cpu_isa")
def test_mxfp4_blocks_multiply_like_dequantize_mxfp4() -> None:
    """gpt-oss's MXFP4 blocks (loader.dequantize_mxfp4 is their float32, held to transformers'
    own by test_moe) as the kernels read them: cpu_ops.mxfp4_rows, then to_lanes. dequantize_blocks
    gives dequantize_mxfp4's values exactly, for every code and every E8M0 exponent 0-255 (2^-127
    subnormals, and the overflow to inf of 2^128 times a code of 1 or more), and gguf's MXFP4
    dequantizer's on the same rows. The few-rows linear (0-4 rows, strided x, three experts'
    rows at once) then differs from F.linear on those values only by float32 summation order:
    within 1e-5 of the output's scale, for exponents that keep the weights of order 1."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from services.gpu_worker.loader import dequantize_mxfp4

    num_experts, out_features, in_features = 3, 70, 1536
    blocks, scales = random_mxfp4(num_experts, out_features, in_features, seed=0, exponents=(0, 256))
    scales[0, 0, :] = torch.arange(scales.shape[-1], dtype=torch.uint8) % 4 * 85  # 0, 85, 170, 255 surely
    rows = cpu_ops.mxfp4_rows(blocks.numpy(), scales.numpy()).reshape(num_experts * out_features, -1)
    packed = torch.from_numpy(cpu_ops.to_lanes(rows, "MXFP4"))
    assert rows.shape[1] == in_features // 32 * cpu_ops.BLOCK_BYTES["MXFP4"]
    assert packed.shape[1] == in_features // 32 * cpu_ops.PACKED_BLOCK_BYTES["MXFP4"]
    got = cpu_ops.dequantize_blocks(packed, "MXFP4")
    want = dequantize_mxfp4(blocks, scales).transpose(1, 2).reshape_as(got)
    assert torch.isinf(want).any() and (want.abs() == 2.0**-127).any()  # the extremes are in play
    assert torch.equal(got, want)
    with np.errstate(over="ignore"):
        assert torch.equal(got, torch.from_numpy(dequantize(rows, GGMLQuantizationType.MXFP4)))

    blocks, scales = random_mxfp4(num_experts, out_features, in_features, seed=1, exponents=(120, 128))
    rows = cpu_ops.mxfp4_rows(blocks.numpy(), scales.numpy()).reshape(num_experts * out_features, -1)
    packed = torch.from_numpy(cpu_ops.to_lanes(rows, "MXFP4"))
    weight = dequantize_mxfp4(blocks, scales).transpose(1, 2).reshape(num_experts * out_features, -1)
    for num_rows in range(5):
        x = torch.randn(in_features, num_rows, generator=torch.Generator().manual_seed(num_rows)).t()
        got, expected = cpu_ops.few_rows_linear_quantized(x, packed, "MXFP4"), F.linear(x, weight)
        scale = float(expected.abs().max()) if num_rows else 1.0
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.skipif(not has_cpu_kernels(), reason="no C++ compiler / AVX2")
@pytest.mark.parametrize("experts", ["Q4_1", "Q4_K", "float32-gpt-oss"])
@pytest.mark.usefixtures("cpu_isa")
def test_moe_layer_is_the_router_then_the_experts(experts: str) -> None:
    """cpu_ops.moe_layer, router and experts in one call, gives exactly what moe_route and then
    moe_experts on its choice give (the same code, no Python between): blocks of two formats,
    and float32 experts with gpt-oss's router bias, softmax after the top k, expert biases and
    clamped SwiGLU; 1-16 rows. A tie is reported with an empty output; bad input is refused."""
    num_experts, hidden, inter, top_k = 8, 256, 256, 2  # whole super-blocks (Q4_K) both ways
    gen = torch.Generator().manual_seed(5)
    router = torch.randn(num_experts, hidden, generator=gen)
    router_bias, biases, swiglu, softmax_after_topk = None, (None, None), (0.0, 0.0), False
    if experts == "float32-gpt-oss":
        gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1
        down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.1
        projections = ((gate_up[:, :inter], ""), (gate_up[:, inter:], ""), (down, ""))
        router_bias, softmax_after_topk, swiglu = torch.randn(num_experts, generator=gen), True, (1.702, 0.5)
        biases = (
            torch.randn(num_experts, 2 * inter, generator=gen),
            torch.randn(num_experts, hidden, generator=gen),
        )
    else:
        shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
        projections = tuple(
            (torch.from_numpy(cpu_ops.to_lanes(random_gguf_blocks(experts, num_experts * rows, columns, seed),
                                                experts)).view(num_experts, rows, -1), experts)
            for seed, (rows, columns) in enumerate(shapes)
        )  # fmt: skip
    routing = (router, router_bias, top_k, True, softmax_after_topk, 1.5)
    flat = [part for projection in projections for part in projection]
    for rows in (1, 3, 16):
        x = torch.randn(rows, hidden, generator=gen)
        out, tied = cpu_ops.moe_layer(x, *routing, *flat, *biases, *swiglu)
        weights, chosen, route_tied = cpu_ops.moe_route(x, *routing)
        assert not tied and not route_tied
        want = cpu_ops.moe_experts(
            x, weights, chosen, *projections, gate_up_bias=biases[0], down_bias=biases[1],
            swiglu=swiglu if swiglu[1] else None,
        )  # fmt: skip
        assert torch.equal(out, want)
    tied_router = torch.zeros_like(router)  # every score equal (no bias): the top k is a tie
    out, tied = cpu_ops.moe_layer(x, tied_router, None, *routing[2:], *flat, *biases, *swiglu)
    assert tied and out.numel() == 0
    with pytest.raises(RuntimeError, match=r"top_k 0 outside"):
        cpu_ops.moe_layer(x, router, router_bias, 0, *routing[3:], *flat, *biases, *swiglu)
    with pytest.raises(RuntimeError, match="moe_experts"):  # the experts' checks, after routing
        cpu_ops.moe_layer(x, *routing, *flat[:4], flat[4][:, :, :-1], *flat[5:], *biases, *swiglu)


@pytest.mark.skipif(not has_cpu_kernels(), reason="no C++ compiler / AVX2")
@pytest.mark.parametrize("swiglu_limit", [7.0, 0.5])
@pytest.mark.usefixtures("cpu_isa")
def test_moe_experts_gpt_oss_matches_hfs_experts(swiglu_limit: float) -> None:
    """gpt-oss's experts from MXFP4 blocks in the fused op (gate and up rows split from the
    checkpoint's interleaved gate_up, as the model loads them; per-expert gate/up and down biases;
    the clamped SwiGLU) against transformers' GptOssExperts itself on dequantize_mxfp4's weights:
    1-16 rows, top-1 / 4, an expert every row chooses, one none does. gpt-oss's limit 7, and 0.5,
    which clamps most gates and ups, so both clamps are exercised. Float32 summation order apart,
    the same values: within 1e-5 of the output's scale."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from services.gpu_worker.loader import dequantize_mxfp4

    num_experts, hidden, inter = 6, 128, 96
    config = GptOssConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts, swiglu_limit=swiglu_limit
    )
    hf = GptOssExperts(config).eval()
    gate_up_blocks, gate_up_scales = random_mxfp4(
        num_experts, 2 * inter, hidden, seed=2, exponents=(122, 125)
    )
    down_blocks, down_scales = random_mxfp4(num_experts, hidden, inter, seed=3, exponents=(122, 125))
    gen = torch.Generator().manual_seed(4)
    gate_up_bias, down_bias = (
        torch.randn(num_experts, 2 * inter, generator=gen),
        torch.randn(num_experts, hidden, generator=gen),
    )
    with torch.no_grad():
        hf.gate_up_proj.copy_(dequantize_mxfp4(gate_up_blocks, gate_up_scales))
        hf.down_proj.copy_(dequantize_mxfp4(down_blocks, down_scales))
        hf.gate_up_proj_bias.copy_(gate_up_bias)
        hf.down_proj_bias.copy_(down_bias)

    def packed(rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(cpu_ops.to_lanes(rows.reshape(-1, rows.shape[-1]), "MXFP4")).view(
            *rows.shape[:2], -1
        )

    gate_up_rows = cpu_ops.mxfp4_rows(gate_up_blocks.numpy(), gate_up_scales.numpy())
    projections = [(packed(rows), "MXFP4") for rows in (gate_up_rows[:, 0::2], gate_up_rows[:, 1::2])]
    projections.append((packed(cpu_ops.mxfp4_rows(down_blocks.numpy(), down_scales.numpy())), "MXFP4"))
    # The model's bias layout: each expert's gate columns, then its up columns.
    split_bias = torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), dim=1)
    for num_rows, top_k in ((1, 1), (1, 4), (3, 4), (16, 4)):
        x = torch.randn(num_rows, hidden, generator=gen)
        logits = torch.randn(num_rows, num_experts, generator=gen)
        logits[:, 0], logits[:, 1] = -100.0, 100.0  # expert 0 never chosen, expert 1 always
        experts = torch.topk(logits, top_k)[1]
        weights = torch.rand(num_rows, top_k, generator=gen)
        got = cpu_ops.moe_experts(
            x, weights, experts, *projections, gate_up_bias=split_bias, down_bias=down_bias,
            swiglu=(config.swiglu_alpha, swiglu_limit),
        )  # fmt: skip
        with torch.no_grad():
            want = hf(x, router_indices=experts, routing_weights=weights)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_moe_experts_refuses_bad_input() -> None:
    assert has_cpu_kernels()
    num_experts, hidden, inter = 4, 64, 32
    gate = torch.zeros(num_experts, inter, 2 * cpu_ops.PACKED_BLOCK_BYTES["Q8_0"], dtype=torch.uint8)
    down = torch.zeros(num_experts, hidden, cpu_ops.PACKED_BLOCK_BYTES["Q8_0"], dtype=torch.uint8)
    x, weights, experts = torch.randn(2, hidden), torch.rand(2, 2), torch.tensor([[0, 3], [1, 2]])
    projections = ((gate, "Q8_0"), (gate, "Q8_0"), (down, "Q8_0"))
    assert cpu_ops.moe_experts(x, weights, experts, *projections).shape == (2, hidden)
    with pytest.raises(RuntimeError, match=r"expert id 4 outside 0\.\.3"):
        cpu_ops.moe_experts(x, weights, torch.tensor([[0, 4], [1, 2]]), *projections)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_ops.moe_experts(x, weights, experts.int(), *projections)
    with pytest.raises(RuntimeError, match="one row per row of x"):
        cpu_ops.moe_experts(x[:1], weights, experts, *projections)
    with pytest.raises(RuntimeError, match="bytes of blocks a row"):
        cpu_ops.moe_experts(x, weights, experts, (gate, "Q4_1"), *projections[1:])
    with pytest.raises(RuntimeError, match=r"down must be contiguous uint8 \[4, 64, bytes\]"):
        cpu_ops.moe_experts(x, weights, experts, *projections[:2], (gate, "Q8_0"))
    with pytest.raises(RuntimeError, match="unknown format"):
        cpu_ops.moe_experts(x, weights, experts, (gate, "Q3_K"), *projections[1:])
    with pytest.raises(RuntimeError, match="not whole Q4_K blocks"):
        cpu_ops.dequantize_blocks(torch.zeros(2, 100, dtype=torch.uint8), "Q4_K")
    with pytest.raises(RuntimeError, match=r"gate_up_bias must be float32 \[4, 64\]"):
        cpu_ops.moe_experts(x, weights, experts, *projections, gate_up_bias=torch.zeros(4, 32))
    with pytest.raises(RuntimeError, match=r"down_bias must be float32 \[4, 64\]"):
        cpu_ops.moe_experts(x, weights, experts, *projections, down_bias=torch.zeros(4, 64).double())
    with pytest.raises(RuntimeError, match="swiglu_limit must be >= 0"):
        cpu_ops.moe_experts(x, weights, experts, *projections, swiglu=(1.702, -1.0))
    mxfp4 = torch.zeros(4, 2 * cpu_ops.PACKED_BLOCK_BYTES["MXFP4"], dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="MXFP4 blocks have no 8-bit activation kernel"):
        cpu_ops.linear_quantized_int8(torch.randn(1, 64), mxfp4, "MXFP4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 2), (7, 1), (21, 4)])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_fused_moe_triton_matches_ref(dtype: torch.dtype, num_tokens: int, top_k: int, gpt_oss: bool) -> None:
    """Tokens sorted to experts in BLOCK_M tiles (some experts chosen by more tokens than a tile
    holds, some by none), odd intermediate and hidden sizes (masked tiles), routing weights; and
    gpt-oss's experts: gate/up and down biases, the clamped SwiGLU."""

    from kernels.fused_moe import align_pairs, fused_moe_ref, fused_moe_triton
    from services.gpu_worker.model import clamped_swiglu

    torch.manual_seed(num_tokens)
    num_experts, hidden, inter = 6, 40, 24
    x = torch.randn(num_tokens, hidden, dtype=dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden) * 0.2).to(dtype)
    down = (torch.randn(num_experts, hidden, inter) * 0.2).to(dtype)
    # Expert 0 is never chosen; expert 1 is every token's first choice (over a tile at 21 tokens).
    logits = torch.randn(num_tokens, num_experts)
    logits[:, 0], logits[:, 1] = -100.0, 10.0
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), top_k)
    weights = torch.rand(num_tokens, top_k)
    sorted_pairs, tile_experts = align_pairs(experts, num_experts)
    assert 0 not in tile_experts.tolist()
    assert sorted(p for p in sorted_pairs.tolist() if p < num_tokens * top_k) == list(
        range(num_tokens * top_k)
    )
    if gpt_oss:  # a limit the gate and up reach, so the clamps matter
        glu = partial(clamped_swiglu, alpha=1.702, limit=0.8)
        biases = dict(gate_up_bias=torch.randn(num_experts, 2 * inter).to(dtype),
                      down_bias=torch.randn(num_experts, hidden).to(dtype))  # fmt: skip
    else:
        glu, biases = silu_glu, {}
    got = fused_moe_triton(x, gate_up, down, weights, experts, glu, **biases)
    want = fused_moe_ref(x, gate_up, down, weights, experts, glu, **biases)
    assert_close(got, want)
