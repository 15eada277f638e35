"""Applies the step plan's grammar bitmask to the scores of the constrained rows, before sampling.

The plan is to carry it only when some sampled row is constrained (`grammar_bitmask [C, ceil(V/32)]`
int32 and `grammar_rows [C]`, docs/structured_output.md; the layout is
services/scheduler/grammar_matcher.py's). Here `rows` are the logits rows the bitmask rows are for.
A step without a bitmask does no work at all, and rows not named are never touched. Masking depends
on the row alone, so sampling stays batch-invariant.

On CUDA the Triton kernel writes -inf over the disallowed tokens only (kernels/token_bitmask.py).
On the CPU, float32 scores are masked branch-free on their bits, `x & keep | ~keep & bits(-inf)`
with `keep` all ones where a token is allowed: select-style ops (masked_fill, where) run several
times slower over the scattered masks a grammar makes. Other CPU dtypes take the torch reference.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from kernels.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton


def check_grammar_bitmask(
    bitmask: np.ndarray, rows: np.ndarray, num_rows: int, vocab_size: int, distinct: bool = True
) -> None:
    """Raise ValueError unless the plan's bitmask arrays fit a step of `num_rows` sampled rows
    (`distinct`: each row masked once, as scores are; a plan names a verifying row repeatedly)."""
    words = (vocab_size + 31) // 32
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != words:
        raise ValueError(f"grammar_bitmask must be int32 [C, {words}], got {bitmask.dtype} {bitmask.shape}")
    if rows.ndim != 1 or rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"grammar_rows {rows.shape} does not match grammar_bitmask {bitmask.shape}")
    if len(rows) and (rows.min() < 0 or rows.max() >= num_rows):
        raise ValueError(f"grammar_rows must be indices below {num_rows}")
    if distinct and len(np.unique(rows)) != len(rows):
        raise ValueError("grammar_rows must be distinct")


def apply_grammar_bitmask(scores: torch.Tensor, bitmask: np.ndarray | None, rows: np.ndarray | None) -> None:
    """In place: scores[rows[i], t] = -inf for every token t that bitmask[i] does not allow."""
    if bitmask is None or len(bitmask) == 0:
        return
    if rows is None:
        raise ValueError("grammar_bitmask without grammar_rows")
    check_grammar_bitmask(bitmask, rows, scores.shape[0], scores.shape[1])
    fast = sys.byteorder == "little" and scores.dtype == torch.float32 and scores.is_contiguous()
    if not scores.is_cuda and fast:
        _apply_float32_bits(scores.numpy(), bitmask, rows)
        return
    device = scores.device
    mask = torch.from_numpy(np.ascontiguousarray(bitmask)).to(device, non_blocking=True)
    index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int32)).to(device, non_blocking=True)
    if scores.is_cuda:
        apply_token_bitmask_triton(scores, mask, index)
    else:
        apply_token_bitmask_ref(scores, mask, index)


_NEG_INF_BITS = np.array(-np.inf, dtype=np.float32).view(np.int32)


def _apply_float32_bits(scores: np.ndarray, bitmask: np.ndarray, rows: np.ndarray) -> None:
    vocab_size = scores.shape[1]
    bits = scores.view(np.int32)
    # One row at a time through one reused buffer: it stays in cache, and nothing large is allocated.
    keep = np.empty(vocab_size, dtype=np.int32)
    for words, row in zip(bitmask, rows, strict=True):
        # The bytes of a little-endian int32 hold its bits 0-7, 8-15, ...: bit t % 32 comes out t-th.
        allowed = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")[:vocab_size]
        np.negative(allowed, out=keep, dtype=np.int32, casting="unsafe")  # 1 -> all ones, 0 -> 0
        target = bits[row]
        target &= keep
        np.invert(keep, out=keep)
        keep &= _NEG_INF_BITS
        target |= keep
