"""Masks the logits of constrained rows with a packed token bitmask: disallowed tokens get -inf.

Layout (the grammar matcher's, services/scheduler/grammar_matcher.py): `bitmask [R, W]` int32 with
`W = ceil(V / 32)`; bit `t % 32` of word `t // 32` of row i is 1 when token t is allowed in logits
row `rows[i]`. Rows not named in `rows` are never read or written.
"""

# Triton convention: compile-time (tl.constexpr) kernel parameters are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 4096 tokens = 128 words per program: a vocabulary of 32k-256k is 8-64 programs per row.
BLOCK_V = 4096


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Torch reference, in place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0."""
    num_rows, vocab_size = bitmask.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(num_rows, -1)[:, :vocab_size].bool()
    rows = rows.long()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


@triton.jit
def _token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    stride_logits,
    stride_bitmask,
    vocab_size,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    words = tl.load(bitmask_ptr + i * stride_bitmask + tokens // 32, mask=in_vocab, other=-1)
    disallowed = ((words >> (tokens % 32)) & 1) == 0
    # Only masked tokens are written and the logits are never read: an allowed token costs nothing.
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=in_vocab & disallowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Triton, in place: one program per (constrained row, BLOCK_V tokens)."""
    num_rows, vocab_size = bitmask.shape[0], logits.shape[1]
    assert bitmask.dtype == torch.int32 and bitmask.shape[1] == (vocab_size + 31) // 32
    assert rows.shape == (num_rows,) and logits.stride(1) == 1 and bitmask.stride(1) == 1
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK_V))
    _token_bitmask_kernel[grid](
        logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab_size, BLOCK=BLOCK_V, num_warps=4
    )
