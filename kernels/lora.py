"""Batched LoRA deltas for the rows of a step (SGMV; decode rows are segments too): every row with
an adapter slot gets out[row] += B[slot] @ (A[slot] @ x[row]) for each module of one merged
projection, each present slot's A and B read once per step, whatever its number of rows.

The contract the three implementations share (`lora_add_ref` the torch reference, the Triton kernels
below for the GPU, cpu_ops.lora_add in C++ for the CPU in float32):

- out [T, W]: a merged projection's output (q/k/v, or gate/up, or one module), whose modules'
  columns follow one another from column 0 in the order of `a` / `b`;
- x [T, in]: its input;
- a[m] [slots, max_rank, in] and b[m] [slots, max_rank, width_m]: module m's slots, each rank
  zero-padded to max_rank (the adapter's scaling folded into b). B is kept as its rank rows (B^T
  of PEFT's [out, r]) so that each rank row's output columns lie side by side: the expand is then
  a stream of multiply-adds over the columns, on the CPU's vectors and the GPU's loads alike;
- ranks [modules, slots] int64, on out's device: module m's rank in each slot, 0 where the slot's
  adapter does not target it (that work is skipped);
- rows [N] int64: the token indices that have a slot, grouped by slot (`group_rows`);
- segments [G, 3] int64: (slot, start, end) of each group's run of `rows`; the Triton path splits
  them into tiles of at most BLOCK_M rows (`group_rows(tile_rows=BLOCK_M)`). Triton's tiles may
  be followed by empty ones (start == end: a CUDA graph's grid, the most tiles a step may have),
  which read and write nothing.
"""

# Triton convention: compile-time (tl.constexpr) kernel parameters are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tl.dot's smallest tile: the Triton path's rows per program


def group_rows(token_slots: np.ndarray, tile_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows, segments) of a step whose token t uses slot token_slots[t] (-1: none): the tokens with
    a slot, stably sorted by slot, and each slot's (slot, start, end) run of them, split into runs
    of at most `tile_rows` where given."""
    rows = np.flatnonzero(token_slots >= 0)
    rows = rows[np.argsort(token_slots[rows], kind="stable")]
    sorted_slots = token_slots[rows]
    starts = np.flatnonzero(np.diff(sorted_slots, prepend=-1)).tolist()
    ends = [*starts[1:], len(rows)] if starts else []
    step = tile_rows or max(len(rows), 1)
    segments = [
        (sorted_slots[start], first, min(first + step, end))
        for start, end in zip(starts, ends, strict=True)
        for first in range(start, end, step)
    ]
    return rows.astype(np.int64), np.array(segments, dtype=np.int64).reshape(-1, 3)


def lora_add_ref(
    out: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    ranks: torch.Tensor,
    rows: torch.Tensor,
    segments: torch.Tensor,
) -> None:
    """Torch reference (and the path of dtypes and hosts without the kernels): each segment's rows
    times its slot's A then B, per module, added in place into that module's columns."""
    start_col = 0
    for module, (a_m, b_m) in enumerate(zip(a, b, strict=True)):
        width = b_m.shape[2]
        for slot, start, end in segments.tolist():
            rank = int(ranks[module, slot])
            if rank == 0:
                continue
            seg_rows = rows[start:end]
            # Adapters may be kept in a narrower dtype than x (lora.dtype): computed in x's.
            delta = (x[seg_rows] @ a_m[slot, :rank].T.to(x.dtype)) @ b_m[slot, :rank].to(x.dtype)
            out[seg_rows, start_col : start_col + width] += delta
        start_col += width


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    rows_ptr,
    segments_ptr,
    ranks_ptr,
    K,
    stride_x,
    stride_as,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h[p, :rank] = a[slot, :rank] @ x[rows[p]] for the tile's positions p (float32); a slot of
    rank 0, or a tile of no rows, reads nothing (its h is never read either)."""
    tile = tl.program_id(0)
    slot = tl.load(segments_ptr + 3 * tile).to(tl.int64)
    start = tl.load(segments_ptr + 3 * tile + 1)
    end = tl.load(segments_ptr + 3 * tile + 2)
    # An empty tile (a CUDA graph's grid runs past the step's tiles) is as a rank of 0: it reads
    # nothing, not its slot's A or B.
    rank = tl.where(end > start, tl.load(ranks_ptr + slot), 0)
    positions = start + tl.arange(0, BLOCK_M)
    is_row = positions < tl.where(rank > 0, end, start)  # no rows where the rank is 0
    rows = tl.load(rows_ptr + positions, mask=is_row, other=0)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :],
            mask=is_row[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * stride_as + ranks[None, :] * stride_ar + ks[:, None],
            mask=(ranks[None, :] < rank) & (ks[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(h_ptr + positions[:, None] * BLOCK_R + ranks[None, :], acc, mask=is_row[:, None])


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    segments_ptr,
    ranks_ptr,
    N,
    column,
    stride_out,
    stride_bs,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[rows[p], column + n] += h[p, :rank] . b[slot, :rank, n] for the tile's positions and
    BLOCK_N columns; a slot of rank 0, or a tile of no rows, leaves out as it is, unread."""
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    slot = tl.load(segments_ptr + 3 * tile).to(tl.int64)
    start = tl.load(segments_ptr + 3 * tile + 1)
    end = tl.load(segments_ptr + 3 * tile + 2)
    rank = tl.where(end > start, tl.load(ranks_ptr + slot), 0)  # an empty tile: as _shrink_kernel
    positions = start + tl.arange(0, BLOCK_M)
    is_row = positions < tl.where(rank > 0, end, start)  # no rows where the rank is 0
    rows = tl.load(rows_ptr + positions, mask=is_row, other=0)
    ranks = tl.arange(0, BLOCK_R)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(
        h_ptr + positions[:, None] * BLOCK_R + ranks[None, :],
        mask=is_row[:, None] & (ranks[None, :] < rank),
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :],
        mask=(cols[None, :] < N) & (ranks[:, None] < rank),
        other=0.0,
    )
    delta = tl.dot(h, b.to(tl.float32), input_precision="ieee")
    targets = out_ptr + rows[:, None] * stride_out + column + cols[None, :]
    is_out = is_row[:, None] & (cols[None, :] < N)
    before = tl.load(targets, mask=is_out, other=0.0)
    tl.store(targets, (before.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=is_out)


def lora_add_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    ranks: torch.Tensor,
    rows: torch.Tensor,
    segments: torch.Tensor,
) -> None:
    """The same contract through the Triton kernels, with `segments` split into tiles of at most
    BLOCK_M rows and `ranks` on the device: per module, one program per tile shrinks its rows to
    the slot's rank (x A^T, float32), then one per (tile, BLOCK_N columns) expands them (h B^T)
    into out. The programs of a slot whose rank is 0 for the module do nothing; no host sync."""
    num_rows, num_tiles = rows.numel(), segments.shape[0]
    if num_rows == 0:
        return
    assert out.stride(1) == 1 and x.stride(1) == 1, "lora_add_triton: rows of out and x must be contiguous"
    column = 0
    for module, (a_m, b_m) in enumerate(zip(a, b, strict=True)):
        _, max_rank, in_features = a_m.shape
        width = b_m.shape[2]
        assert a_m.is_contiguous() and b_m.is_contiguous()
        block_r = max(16, triton.next_power_of_2(max_rank))
        h = torch.empty(num_rows, block_r, dtype=torch.float32, device=x.device)
        module_ranks = ranks[module]
        _shrink_kernel[(num_tiles,)](
            x, a_m, h, rows, segments, module_ranks, in_features, x.stride(0), a_m.stride(0), a_m.stride(1),
            BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=min(64, max(16, triton.next_power_of_2(in_features))),
        )  # fmt: skip
        block_n = min(64, max(16, triton.next_power_of_2(width)))
        _expand_kernel[(num_tiles, triton.cdiv(width, block_n))](
            h, b_m, out, rows, segments, module_ranks, width, column, out.stride(0), b_m.stride(0),
            b_m.stride(1), BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=block_n,
        )  # fmt: skip
        column += width
