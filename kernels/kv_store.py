"""Writes the new tokens' K/V into the paged cache at their slots."""

# Triton convention: compile-time (tl.constexpr) kernel parameters are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference: k_cache[slot // B, slot % B] = k[t] (same for v), skipping slot -1."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    num_kv_heads,
    block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]  # a power of two, past HEAD_DIM (96, 80) masked off
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    # int64 offsets: block * block_stride overflows int32 for caches over 2^31 elements.
    dst = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_token
    dst += heads * stride_cache_head + dims
    k = tl.load(k_ptr + row * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + row * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton store: one program per token copies all its kv heads (a contiguous Hk*D run of the cache)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and slot_mapping.shape == (num_tokens,)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads), num_warps=4,
    )  # fmt: skip
