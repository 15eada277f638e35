"""A mixture-of-experts MLP as two grouped GEMMs (the Triton path; `fused_moe_ref` is its torch
reference): the step's (token, expert) pairs are sorted by expert and each expert's run padded to
a multiple of BLOCK_M (`align_pairs`), so every BLOCK_M-row tile of the sorted pairs belongs to
one expert; one program multiplies a tile by a BLOCK_N slice of that expert's weight, so each
selected expert's weights are read once per tile column and experts no token chose not at all.
The first GEMM gathers the tokens' rows of x and multiplies by the experts' gate / up; the
gated activation (and gpt-oss's expert biases) run in torch; the second multiplies by the
experts' down projection, scales each pair by its routing weight, and the pairs of a token are
summed."""

# Triton convention: compile-time (tl.constexpr) kernel parameters are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tl.dot's smallest tile


def fused_moe_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: sum over each token's top-k of weight * (down(glu(gate, up)) + down_bias)
    of x [T, H], with (gate, up) = gate_up x + gate_up_bias; gate_up [E, 2I, H], down [E, H, I],
    weights / experts [T, k], biases [E, 2I] and [E, H] (None: zero)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token].tolist(), experts[token].tolist(), strict=True):
            h = gate_up[expert].float() @ x[token].float()
            if gate_up_bias is not None:
                h += gate_up_bias[expert].float()
            y = down[expert].float() @ glu(*h.chunk(2))
            if down_bias is not None:
                y += down_bias[expert].float()
            out[token] += weight * y
    return out.to(x.dtype)


def align_pairs(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, tile_experts): the flat (token, expert) pair ids t * k + j sorted by expert,
    each expert's run padded with the invalid id T * k to a multiple of BLOCK_M; and the expert of
    each BLOCK_M-row tile."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    num_tiles_each = padded // BLOCK_M
    tile_experts = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), num_tiles_each)
    # Each sorted pair's slot: its expert's padded start plus its rank within the expert.
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    slots = (
        padded_start[sorted_experts] + torch.arange(flat.numel(), device=flat.device) - start[sorted_experts]
    )
    sorted_pairs = torch.full((int(padded.sum()),), flat.numel(), dtype=torch.int64, device=flat.device)
    sorted_pairs[slots] = order
    return sorted_pairs, tile_experts


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_pairs_ptr,
    tile_experts_ptr,
    pair_weights_ptr,
    num_pairs,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    ROWS_ARE_TOKENS: tl.constexpr,
    SCALE_BY_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair, n] = sum_k a[row(pair), k] * w[expert, n, k] (x weight[pair]) for one tile of
    BLOCK_M sorted pairs of one expert and BLOCK_N output columns."""
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    rows = pairs // TOP_K if ROWS_ARE_TOKENS else pairs
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + ks[None, :],
            mask=is_pair[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if SCALE_BY_WEIGHT:
        acc *= tl.load(pair_weights_ptr + pairs, mask=is_pair, other=0.0)[:, None]
    tl.store(
        out_ptr + pairs[:, None] * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=is_pair[:, None] & (cols[None, :] < N),
    )


def _grouped_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_pairs: torch.Tensor,
    tile_experts: torch.Tensor,
    num_pairs: int,
    top_k: int,
    pair_weights: torch.Tensor | None,
) -> torch.Tensor:
    """[num_pairs, N]: each pair's row of `a` (a token's row where a has fewer rows than pairs)
    times its expert's w [E, N, K]."""
    _, n, k = w.shape
    assert a.stride(-1) == 1 and w.is_contiguous() and a.shape[1] == k
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (tile_experts.numel(), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        a, w, out, sorted_pairs, tile_experts, pair_weights if pair_weights is not None else out,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, ROWS_ARE_TOKENS=a.shape[0] != num_pairs, SCALE_BY_WEIGHT=pair_weights is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def fused_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same contract as `fused_moe_ref`, through the grouped GEMMs."""
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    sorted_pairs, tile_experts = align_pairs(experts, gate_up.shape[0])
    # top_k == 1 gives as many pairs as tokens: the first GEMM's rows are then the tokens' anyway.
    h = _grouped_matmul(x, gate_up, sorted_pairs, tile_experts, num_pairs, top_k, None)
    if gate_up_bias is not None:  # row p of h is pair p = (token p // k, its (p % k)-th expert)
        h += gate_up_bias[experts.flatten()]
    h = glu(*h.chunk(2, dim=-1)).contiguous()
    pair_weights = weights.flatten().to(torch.float32).contiguous()
    out = _grouped_matmul(h, down, sorted_pairs, tile_experts, num_pairs, top_k, pair_weights)
    if down_bias is not None:
        out += down_bias[experts.flatten()] * pair_weights.unsqueeze(-1).to(out.dtype)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
