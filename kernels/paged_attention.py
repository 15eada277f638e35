"""Causal attention of new query tokens over the paged KV cache (prefill, chunked prefill, decode),
optionally over a sliding window (each query sees its last `window` keys, itself included), with
soft-capped scores (cap * tanh(score / cap), Gemma 2), with a sink logit per query head that
joins the softmax's denominator without a value (gpt-oss), and, in prefill, with images whose
tokens see each other both ways (Gemma 3): each query token's `image_tails` says how many of the
tokens after it (the rest of its image) it sees too."""

# Triton convention: compile-time (tl.constexpr) kernel parameters are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

LN2 = tl.constexpr(math.log(2.0))  # the kernel's scores are on the log2 scale


def _gather_kv(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence as a dense [seq_len, Hk, D] tensor."""
    num_blocks = -(-seq_len // cache.shape[1])
    return cache[block_row[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    image_tails: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: query j of sequence i sits at seq_lens[i] - q_len_i + j and sees keys up to
    it plus its image_tails [T] entry (and, with a window, after its position - window); sinks
    [Hq] join each head's softmax."""
    group = q.shape[1] // k_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    out = torch.empty_like(q)
    for i, seq_len in enumerate(lens):
        begin, end = starts[i], starts[i + 1]
        k = _gather_kv(k_cache, block_tables[i], seq_len).float().repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, block_tables[i], seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[begin:end].float(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = seq_len - (end - begin) + torch.arange(end - begin, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        sees_to = q_pos if image_tails is None else q_pos + image_tails[begin:end].long()
        is_visible = k_pos <= sees_to[:, None]
        if window:
            is_visible &= k_pos > q_pos[:, None] - window
        scores = scores.masked_fill(~is_visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:
            sink_column = sinks.float()[:, None, None].expand(-1, end - begin, 1)
            probs = torch.cat((scores, sink_column), dim=-1).softmax(dim=-1)[..., :-1]
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference for one new token per sequence (the q_len == 1 case of prefill)."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window, softcap, sinks
    )


# num_seqs feeds the loop-carried bounds of the binary search: specializing it to constexpr 1
# would change their type across iterations.
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,
    image_tails_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_bt,
    num_seqs,
    window,
    KV_BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_DECODE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_IMAGES: tl.constexpr,
):
    # Rows of the tile are (query token, query head) pairs: the GROUP query heads that share this
    # kv head ride along, so each K/V tile is loaded once for the whole group.
    kv_head = tl.program_id(1)
    if IS_DECODE:
        seq = tl.program_id(0)
        q_start = seq
        q_len = 1
        q_block = 0
    else:
        # Sequence i owns programs [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): a grid of
        # T // BLOCK_Q + S programs covers every sequence without reading lengths on the host.
        pid = tl.program_id(0)
        lo = num_seqs * 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            is_at_or_before = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid
            lo = tl.where(is_at_or_before, mid, lo)
            hi = tl.where(is_at_or_before, hi, mid - 1)
        seq = lo
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_block = pid - (q_start // BLOCK_Q + seq)
        if q_block * BLOCK_Q >= q_len:
            return
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    is_row = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    q_pos = context_len + q_idx
    # Head dimensions in a power of two (tl.arange, tl.dot); past HEAD_DIM (96, 80) zeros, which
    # add nothing to a score and are never stored.
    dims = tl.arange(0, BLOCK_D)
    is_dim = dims < HEAD_DIM
    q_offs = (q_start + q_idx).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=is_row[:, None] & is_dim[None, :], other=0.0)

    # Causality bounds the keys this tile can see: up to the position of its last query row.
    kv_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    if HAS_IMAGES:
        # A token inside an image also sees the rest of its image (its tail: the image lies
        # within this chunk), and the tile the furthest of its rows' image ends.
        tail = tl.load(image_tails_ptr + q_start + q_idx, mask=is_row, other=0)
        sees_to = q_pos + tail
        kv_end = tl.maximum(kv_end, tl.max(tl.where(is_row, sees_to + 1, 0), axis=0))
    else:
        sees_to = q_pos
    kv_lo = kv_end * 0
    kv_hi = kv_end
    if window > 0:
        # ... and the window its first query row: keys before that are never loaded.
        kv_lo = tl.maximum(kv_lo, context_len + q_block * BLOCK_Q - window + 1)
    if NUM_SPLITS > 1:
        # Each sequence's own keys in NUM_SPLITS parts of whole tiles: a short context beside long
        # ones, or in a block table wider than it (a CUDA graph's), still spreads over every split.
        span = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * span
        kv_hi = tl.minimum(kv_hi, kv_lo + span)

    # Finite floor for the running max keeps fully masked rows free of (-inf) - (-inf) = nan.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        # The sink starts each row's running softmax as a score of weight exp(sink) and no value;
        # only the first key split carries it, so the merge counts it once.
        sink = tl.load(sinks_ptr + head, mask=is_row, other=0.0).to(tl.float32) / LN2  # to the log2 scale
        is_first_split = split == 0
        m_i = tl.where(is_first_split, sink, m_i)
        l_i = tl.where(is_first_split, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        is_key = offs_n < kv_hi
        # Per-token block lookup: a tile may span several cache blocks, so BLOCK_N is free of block_size.
        block_id = tl.load(block_tables_ptr + seq * stride_bt + offs_n // KV_BLOCK_SIZE, mask=is_key, other=0)
        kv_offs = block_id.to(tl.int64) * stride_cache_block + (offs_n % KV_BLOCK_SIZE) * stride_cache_token
        kv_offs = kv_offs[:, None] + kv_head * stride_cache_head + dims[None, :]
        kv_mask = is_key[:, None] & is_dim[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP > 0.0:
            # cap * tanh(score / cap) on the natural-log scale, via tanh(x) = 1 - 2 / (exp(2x) + 1).
            capped = 1.0 - 2.0 / (tl.exp(2.0 * (s * LN2) / SOFTCAP) + 1.0)
            s = capped * (SOFTCAP / LN2)
        is_visible = is_key[None, :] & (offs_n[None, :] <= sees_to[:, None])
        if window > 0:
            is_visible &= offs_n[None, :] > q_pos[:, None] - window
        s = tl.where(is_visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        out_offs = (
            (q_start + q_idx).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        )
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_dim[None, :])
    else:
        # Partials are [S, Hq, NUM_SPLITS, (D)] fp32 with a base-2 log-sum-exp; -inf marks an empty split.
        part = (seq.to(tl.int64) * GROUP * tl.num_programs(1) + head) * NUM_SPLITS + split
        tl.store(
            partial_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=is_row[:, None] & is_dim[None, :],
        )
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(partial_lse_ptr + part, lse, mask=is_row)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (seq * tl.num_programs(1) + head) * num_splits
    splits = tl.arange(0, BLOCK_SPLITS)
    is_split = splits < num_splits
    lse = tl.load(partial_lse_ptr + part + splits, mask=is_split, other=float("-inf"))
    # Some split holds the query's own key, so the max is finite and empty splits (all before the
    # window, or past the context) get weight exp2(-inf) = 0.
    weight = tl.math.exp2(lse - tl.max(lse, axis=0))
    dims = tl.arange(0, BLOCK_D)
    is_dim = dims < HEAD_DIM
    partial = tl.load(
        partial_out_ptr + (part + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=is_split[:, None] & is_dim[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=is_dim
    )


def _check_shapes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> int:
    """Validates the layout the kernel assumes and returns the GQA group size."""
    head_dim = q.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[3] == head_dim and q.shape[1] % k_cache.shape[2] == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    return q.shape[1] // k_cache.shape[2]


def _dot_precision(q: torch.Tensor) -> str:
    # fp32 models expect fp32 attention; tl.dot would otherwise round fp32 operands to tf32.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    """The head dimensions a tile holds: a power of two (tl.arange), at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(head_dim))


def _launch_config(head_dim: int, is_decode: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps): the largest key tile that ptxas compiles for sm_90 without spills.

    The per-token block lookup makes every K/V element its own address, so register pressure,
    not shared memory, bounds the tile: decode (16 rows) keeps 64 keys up to D = 128, prefill
    (64 rows) trades keys for head_dim at a constant 4096-element K/V tile.
    """
    if is_decode:
        return (64 if head_dim <= 128 else 32), (4 if head_dim <= 64 else 8)
    return min(64, max(16, 4096 // head_dim)), 8


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_num_splits(num_ctas: int, max_context: int, device: torch.device) -> int:
    """Split the keys of each sequence only when (sequence, kv head) programs cannot fill the GPU."""
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    # Each split should still walk at least 512 keys, or the merge costs more than it saves.
    return max(1, min(2 * num_sms // max(num_ctas, 1), triton.cdiv(max_context, 512), 16))


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton decode: grid (sequence, kv head, key split); num_splits=None picks it from the GPU size."""
    group = _check_shapes(q, k_cache, v_cache, block_tables)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        # The block table's width bounds every context length without a device-to-host sync.
        num_splits = _auto_num_splits(num_seqs * num_kv_heads, block_tables.shape[1] * block_size, q.device)
    block_n, num_warps = _launch_config(_block_d(head_dim), is_decode=True)
    if num_splits > 1:
        partial_out = torch.empty(
            num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_lse = out
    _paged_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, partial_out, partial_lse, block_tables, seq_lens, seq_lens,
        out if sinks is None else sinks, seq_lens, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_seqs, window,
        KV_BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_M=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_Q=1, BLOCK_N=block_n,
        IS_DECODE=True, NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(q), SOFTCAP=float(softcap),
        HAS_SINKS=sinks is not None, HAS_IMAGES=False, num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_q_heads)](
            partial_out, partial_lse, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            num_warps=1,
        )  # fmt: skip
    return out


def paged_prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    image_tails: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton prefill over ragged sequences: grid (query tile, kv head), tiles of BLOCK_M (token, head) rows.
    `image_tails` [T] int32: how many later tokens (the rest of its image) each query token also
    sees; None (a step without images) compiles the causal kernel alone."""
    group = _check_shapes(q, k_cache, v_cache, block_tables)
    num_tokens, _, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    assert image_tails is None or (image_tails.shape == (num_tokens,) and image_tails.dtype == torch.int32)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    # 64 rows = 64 // group query tokens of the whole group: one wgmma M tile on Hopper, and each
    # K/V tile is reused by all of them.
    block_m = max(64, triton.next_power_of_2(group))
    block_q = block_m // group
    block_n, num_warps = _launch_config(_block_d(head_dim), is_decode=False)
    _paged_attention_kernel[(num_tokens // block_q + num_seqs, num_kv_heads, 1)](
        q, k_cache, v_cache, out, out, out, block_tables, query_start_loc, seq_lens,
        out if sinks is None else sinks, seq_lens if image_tails is None else image_tails, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_seqs, window,
        KV_BLOCK_SIZE=k_cache.shape[1], GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        IS_DECODE=False, NUM_SPLITS=1, DOT_PRECISION=_dot_precision(q), SOFTCAP=float(softcap),
        HAS_SINKS=sinks is not None, HAS_IMAGES=image_tails is not None, num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    return out
