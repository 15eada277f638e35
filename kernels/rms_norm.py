"""RMSNorm with an optional fused residual add: one program per token row."""

# Triton convention: compile-time (tl.constexpr) kernel parameters are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: returns (rmsnorm(x + residual) * weight, x + residual)."""
    residual_out = x if residual is None else x + residual
    h = residual_out.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h * weight.float()).to(x.dtype), residual_out


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first, as the torch path does, so the norm
        # sees exactly the residual stream that is handed to the next layer.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / hidden_size + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (h * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm over rows of x [T, H]; same contract as `rms_norm_ref`."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.shape == (x.shape[1],)
    num_tokens, hidden_size = x.shape
    out = torch.empty_like(x)
    # The whole row fits in one block (hidden sizes are at most a few thousand), so the
    # reduction is a single pass over registers with fully coalesced row loads.
    block_h = triton.next_power_of_2(hidden_size)
    num_warps = min(max(block_h // 256, 1), 16)
    if residual is None:
        residual_out = x
        _rms_norm_kernel[(num_tokens,)](
            x, x, weight, out, x, x.stride(0), 0, out.stride(0), 0, hidden_size, eps,
            HAS_RESIDUAL=False, BLOCK_H=block_h, num_warps=num_warps,
        )  # fmt: skip
    else:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        residual_out = torch.empty_like(x)
        _rms_norm_kernel[(num_tokens,)](
            x, residual, weight, out, residual_out,
            x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0), hidden_size, eps,
            HAS_RESIDUAL=True, BLOCK_H=block_h, num_warps=num_warps,
        )  # fmt: skip
    return out, residual_out
