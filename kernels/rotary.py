"""Rotary position embedding (NeoX / HF `rotate_half` style), applied in place to q and k; with
M-RoPE (Qwen2.5-VL) each token has three positions (temporal, height, width) and each frequency
rotates by the position of its section's axis."""

# Triton convention: compile-time (tl.constexpr) kernel parameters are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl


def make_cos_sin(
    max_pos: int, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Table [max_pos, head_dim]: cos of each (position, frequency) in the first half, sin in the second."""
    # Same float32 recipe as HF's default rope so positions match bit for bit before the cast.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float, device=device), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    mrope_section: tuple[int, ...] = (),
) -> None:
    """Torch reference: rotates pairs (i, i + D/2) of every head of q [T,Hq,D] and k [T,Hk,D] in
    place. With `mrope_section` (the frequencies of each axis, summing to D/2), positions are
    [3, T] and frequency i's cos and sin come from the row of its axis's position."""
    half = q.shape[-1] // 2
    table = cos_sin[positions.long()].float()
    if mrope_section:
        axes = torch.arange(3, device=q.device).repeat_interleave(
            torch.tensor(mrope_section, device=q.device)
        )
        columns = torch.cat((axes, axes)).view(1, 1, -1).expand(1, *table.shape[1:])
        table = table.gather(0, columns)[0]
    cos, sin = table[:, None, :half], table[:, None, half:]
    _rotate_ref(q, cos, sin)
    _rotate_ref(k, cos, sin)


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_t,
    stride_h,
    row,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # a power of two, past HALF masked off
    mask = (heads < num_heads) & (dims < HALF)
    ptr1 = x_ptr + row * stride_t + heads * stride_h + dims
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    out_dtype = x_ptr.dtype.element_ty
    tl.store(ptr1, (x1 * cos - x2 * sin).to(out_dtype), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos + x1 * sin).to(out_dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_positions_axis,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    MROPE_TEMPORAL_END: tl.constexpr,
    MROPE_HEIGHT_END: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    is_dim = dims < HALF
    if MROPE_TEMPORAL_END > 0:
        # M-RoPE: frequencies [0, TEMPORAL_END) take the temporal position, then the height's up
        # to HEIGHT_END, the width's after; the table is gathered per frequency.
        temporal = tl.load(positions_ptr + row).to(tl.int64)
        height = tl.load(positions_ptr + stride_positions_axis + row).to(tl.int64)
        width = tl.load(positions_ptr + 2 * stride_positions_axis + row).to(tl.int64)
        pos = tl.where(dims < MROPE_TEMPORAL_END, temporal, tl.where(dims < MROPE_HEIGHT_END, height, width))
    else:
        pos = tl.load(positions_ptr + row).to(tl.int64)
    # One cos/sin row serves every head of this token: load it once, keep it in registers.
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims, mask=is_dim, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims, mask=is_dim, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, row, num_q_heads, cos, sin, HALF, BLOCK_HALF, BLOCK_QH)
    _rotate_heads(k_ptr, stride_kt, stride_kh, row, num_k_heads, cos, sin, HALF, BLOCK_HALF, BLOCK_KH)


def rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    mrope_section: tuple[int, ...] = (),
) -> None:
    """Triton rotary, in place; q and k may be strided views (e.g. slices of a fused qkv).
    positions [T], or [3, T] with M-RoPE's `mrope_section` (as rotary_ref)."""
    num_tokens, num_q_heads, head_dim = q.shape
    expected_positions = (3, num_tokens) if mrope_section else (num_tokens,)
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and positions.shape == expected_positions
    assert not mrope_section or (len(mrope_section) == 3 and sum(mrope_section) == head_dim // 2)
    assert positions.stride(-1) == 1
    assert head_dim >= 2 and head_dim % 2 == 0, "head_dim must be even"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    assert cos_sin.shape[1] == head_dim
    if num_tokens == 0:
        return
    temporal_end, height_end = (
        (mrope_section[0], mrope_section[0] + mrope_section[1]) if mrope_section else (0, 0)
    )
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin, positions.stride(0) if mrope_section else 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        num_q_heads, k.shape[1],
        HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        MROPE_TEMPORAL_END=temporal_end, MROPE_HEIGHT_END=height_end,
        num_warps=4,
    )  # fmt: skip
