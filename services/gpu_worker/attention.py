"""Attention over the paged KV cache, plus the few per-token ops that have a Triton kernel on CUDA.

The backend is chosen once at start: `TritonOps` on CUDA (kernels/), `TorchOps` on the CPU. Each
builds its per-step metadata once (`prepare`) and every layer reuses it.
Cache layout per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (DeepSeek's
latent attention keeps latents and rope keys in those two instead: mla.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_ops


@dataclass
class PrefillSeq:
    """One sequence with more than one query token in this step (a prompt or a prompt chunk)."""

    start: int  # first token in the flat batch
    end: int
    context_slots: torch.Tensor  # [L] flat KV slots of its whole context, long
    mask: torch.Tensor | None  # [q_len, L] bool, None when the chunk is the whole context (causal)


@dataclass
class StepMeta:
    """Everything attention needs for one step, built once from the plan arrays."""

    rope_rows: torch.Tensor  # [T] long: each token's row of the rotary table (see rotary_rows)
    slot_mapping: torch.Tensor  # [T] long
    # CPU: rotary tables of the step's positions, [T, 1, D]: cos repeated over both halves, and sin
    # negated in the first half, so a rotation is x * cos + swap_halves(x) * sin.
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    store_tokens: torch.Tensor | None = None  # CPU: tokens with a KV slot, None when all have one
    # CPU: the q_len == 1 sequences attend as one padded batch; the rest one by one.
    decode_tokens: torch.Tensor | None = None  # [Sd] token indices, long
    decode_blocks: torch.Tensor | None = None  # [Sd * num_blocks] block ids of the contexts, padded, long
    decode_len: int = 0  # L, padded context length
    decode_mask: torch.Tensor | None = None  # [Sd, 1, 1, L] additive (0 / -inf)
    # CPU with the C++ decode kernel, instead of the four above but decode_tokens: pages read in place.
    decode_tables: torch.Tensor | None = None  # [Sd, num_blocks] long
    decode_lens: torch.Tensor | None = None  # [Sd] long
    is_all_decode: bool = False
    prefills: tuple[PrefillSeq, ...] = ()
    # CUDA: the plan arrays themselves.
    block_tables: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    # CUDA, images that see each other both ways: [T] int32, how many later tokens (the rest of
    # its image) each token also sees (image_tails); None in a step without them.
    image_tails: torch.Tensor | None = None
    # CUDA, M-RoPE: [3, T] long, each token's temporal, height and width position (mrope_positions);
    # None when the step has none (its rope_rows then serve).
    mrope_positions: torch.Tensor | None = None


class Shapes:
    """Head geometry, the rotary table [max_pos, D] (cos in the first half, sin in the second;
    LongRoPE's has the long factors' rows after the short ones', from row `long_rope_rows`), and
    the attention variant: a sliding window (each query sees its last `window` keys, itself
    included; 0 = all) and a soft cap on the scores (cap * tanh(score / cap); 0 = none)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        cos_sin: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
        long_rope_rows: int = 0,
        mrope_section: tuple[int, ...] = (),
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.cos_sin = cos_sin
        self.window = window
        self.softcap = softcap
        self.long_rope_rows = long_rope_rows
        # M-RoPE: how many frequencies each axis (temporal, height, width) rotates, and the axis
        # each column of the rotary table rotates by.
        self.mrope_section = mrope_section
        self.mrope_axes = (
            torch.from_numpy(np.tile(np.repeat(np.arange(3), mrope_section), 2)) if mrope_section else None
        )
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim


def rotary_rows(
    arrays: dict[str, np.ndarray], num_tokens: int, num_seqs: int, long_rope_rows: int
) -> np.ndarray:
    """The row of the rotary table each token rotates by: its position, plus `long_rope_rows`
    for the tokens of the sequences the plan marks `long_rope` (LongRoPE's long factors)."""
    rows = arrays["positions"][:num_tokens].astype(np.int64)
    is_long = arrays.get("long_rope")
    if long_rope_rows and is_long is not None:
        q_lens = np.diff(arrays["query_start_loc"][: num_seqs + 1])
        rows += np.repeat(is_long[:num_seqs].astype(np.int64) * long_rope_rows, q_lens)
    return rows


def mrope_positions(arrays: dict[str, np.ndarray], num_tokens: int, num_seqs: int) -> np.ndarray | None:
    """[3, T] rotary positions (temporal, height, width) of M-RoPE (Qwen2.5-VL), from the plan's
    rope_deltas and image grids; None where the plan has neither (each token's one position
    on all three axes, plain rope's). A text token rotates by its position plus its row's delta
    on every axis; an image's tokens, from its first one's position p, by p on the temporal
    axis and p + row and p + column of their place in its grid on the others; the text after it
    in its row continues from p + max(rows, columns) (services/scheduler/request.py rope_delta)."""
    deltas, widths = arrays.get("rope_deltas"), arrays.get("image_grid_widths")
    if deltas is None and widths is None:
        return None
    query_start_loc = arrays["query_start_loc"][: num_seqs + 1]
    positions = arrays["positions"][:num_tokens].astype(np.int64)
    if deltas is not None:
        positions += np.repeat(deltas[:num_seqs].astype(np.int64), np.diff(query_start_loc))
    out = np.repeat(positions[None], 3, axis=0)
    if widths is None:
        return out
    # In step order, so an image's first position has its row's earlier images' shifts.
    sizes = np.bincount(arrays["image_groups"][arrays["image_groups"] >= 0], minlength=len(widths))
    for start, size, width in zip(
        arrays["image_starts"].tolist(), sizes.tolist(), widths.tolist(), strict=True
    ):
        if not width:
            continue
        row_end = int(query_start_loc[np.searchsorted(query_start_loc, start, side="right")])
        first = out[0, start]
        rows, columns = np.divmod(np.arange(size), width)
        out[0, start : start + size] = first
        out[1, start : start + size] = first + rows
        out[2, start : start + size] = first + columns
        out[:, start + size : row_end] += max(size // width, width) - size
    return out


def image_tails(groups: np.ndarray) -> np.ndarray:
    """[T] int32 from the plan's image_groups [T] (each image's tokens one run, in one sequence:
    ModelRunner._check_images): how many of the tokens after each one are its image's, which it
    sees too; 0 outside images. The prefill kernel's compact form of the CPU path's mask."""
    tails = np.zeros(len(groups), np.int32)
    in_image = groups >= 0
    if not in_image.any():
        return tails
    tokens = np.arange(len(groups))
    is_last = in_image & np.r_[groups[1:] != groups[:-1], True]
    last = np.zeros(int(groups.max()) + 1, np.int64)
    last[groups[is_last]] = tokens[is_last]
    tails[in_image] = last[groups[in_image]] - tokens[in_image]
    return tails


QKNorms = tuple[torch.Tensor, torch.Tensor, float]  # q_norm and k_norm weights [D], eps


def norm_qk(qk: torch.Tensor, num_heads: int, qk_norms: QKNorms) -> torch.Tensor:
    """RMSNorm over each head of qk [T, Hq + Hk, D]: the first num_heads with q_norm, the rest k_norm."""
    q_weight, k_weight, eps = qk_norms
    shape = (qk.shape[-1],)
    q = F.rms_norm(qk[:, :num_heads], shape, q_weight, eps)
    return torch.cat((q, F.rms_norm(qk[:, num_heads:], shape, k_weight, eps)), dim=1)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention that SDPA cannot do: scores capped to cap * tanh(score / cap) (Gemma 2), and/or a
    sink logit per row that joins the softmax's denominator and is then dropped (gpt-oss).
    q [B, Hk, R, D], k / v [B, Hk, L, D], mask broadcast to [B, Hk, R, L] (bool: True attends,
    or additive), sinks [Hk, R] (each row's query head's sink)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if softcap:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores = scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask)
    if sinks is None:
        return torch.matmul(scores.softmax(-1), v)
    sink_column = sinks.to(scores.dtype).unsqueeze(-1).expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v)


def sink_rows(sinks: torch.Tensor, num_kv_heads: int, rows_per_head: int) -> torch.Tensor:
    """[Hk, G * R]: the sink of each row of the grouped layout, where the G query heads of a KV
    head each bring R rows (query tokens), head by head."""
    return sinks.view(num_kv_heads, -1, 1).expand(-1, -1, rows_per_head).reshape(num_kv_heads, -1)


class TorchOps:
    """CPU path: torch ops over the same paged layout. In float32, decode attention and the
    residual add + RMSNorm run the C++ ops of kernels/cpu_ops.cpp (decode reads the pages in
    place). Otherwise (other dtypes, or no kernels) decode gathers each sequence's pages once per layer (one index_select of contiguous [Hk*D]
    rows) and runs one batched SDPA with the query heads of a KV group as the query rows, so
    grouped KV heads are never repeated. A bfloat16 cache under a float32 model
    (engine.kv_cache_dtype) holds the keys and values rounded, and every path reads them widened
    back to float32 (the C++ decode in place)."""

    def __init__(self, shapes: Shapes, device: torch.device, dtype: torch.dtype) -> None:
        self.s = shapes
        self.block_size = shapes.block_size
        self.device = device
        self.dtype = dtype
        # The C++ decode reads whole contexts without a soft cap (sinks it takes): windowed or
        # capped attention keeps the torch path, which reads only the blocks inside the window.
        self.has_decode_kernel = (
            cpu_ops.has_paged_decode(shapes.head_dim, dtype) and not shapes.window and not shapes.softcap
        )
        self.has_norm_kernel = cpu_ops.has_kernels(dtype)
        # Full-width rotary tables [max_pos, D] (see StepMeta.cos), built once.
        half = shapes.head_dim // 2
        cos, sin = shapes.cos_sin[:, :half], shapes.cos_sin[:, half:]
        self.cos = torch.cat((cos, cos), dim=-1)
        self.sin = torch.cat((-sin, sin), dim=-1)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.has_norm_kernel:  # one op instead of about ten, whose dispatch dominates at few rows
            return cpu_ops.add_rms_norm(x, weight, eps, residual)
        if residual is not None:
            x = x + residual
        return F.rms_norm(x, weight.shape, weight, eps), x

    def qkv_rotary(
        self, qkv: torch.Tensor, meta: StepMeta, qk_norms: QKNorms | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split qkv [T, (Hq + 2Hk) D] into q [T, Hq, D], k, v [T, Hk, D], q and k rotated (NeoX
        style), after their per-head RMSNorm where the model has one."""
        s, num_tokens = self.s, qkv.shape[0]
        qk = qkv[:, : s.q_size + s.kv_size].view(num_tokens, -1, s.head_dim)
        if qk_norms is not None:
            qk = norm_qk(qk, s.num_heads, qk_norms)
        half = s.head_dim // 2
        # One rotation for q and k heads together, in three ops with the signed tables of `prepare`
        # (seven with half-width ones), since per-op dispatch is most of a layer's time at few tokens.
        swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        qk = torch.addcmul(qk * meta.cos, swapped, meta.sin)
        v = qkv[:, s.q_size + s.kv_size :].view(num_tokens, s.num_kv_heads, s.head_dim)
        return qk[:, : s.num_heads], qk[:, s.num_heads :], v

    def prepare(
        self,
        arrays: dict[str, np.ndarray],
        num_tokens: int,
        num_seqs: int,
        rope_positions: np.ndarray | None = None,
    ) -> StepMeta:
        """`rope_positions`: M-RoPE's [3, T] (mrope_positions), None for the plan's positions."""
        bs = self.block_size
        qsl = arrays["query_start_loc"][: num_seqs + 1].astype(np.int64)
        seq_lens = arrays["seq_lens"][:num_seqs].astype(np.int64)
        tables = arrays["block_tables"][:num_seqs].astype(np.int64)
        q_lens = np.diff(qsl)
        slot_mapping = arrays["slot_mapping"][:num_tokens].astype(np.int64)
        rope_rows = torch.from_numpy(rotary_rows(arrays, num_tokens, num_seqs, self.s.long_rope_rows))
        if rope_positions is None or self.s.mrope_axes is None:
            cos, sin = self.cos[rope_rows], self.sin[rope_rows]
        else:  # each column from the row of its axis's position
            axes = self.s.mrope_axes.view(1, 1, -1).expand(1, num_tokens, -1)
            rows = torch.from_numpy(rope_positions)
            cos, sin = (table[rows].gather(0, axes)[0] for table in (self.cos, self.sin))
        meta = StepMeta(
            rope_rows=rope_rows,
            slot_mapping=torch.from_numpy(slot_mapping),
            cos=cos.unsqueeze(1),
            sin=sin.unsqueeze(1),
        )
        if (slot_mapping < 0).any():
            stored = np.flatnonzero(slot_mapping >= 0)
            meta.store_tokens = torch.from_numpy(stored)
            meta.slot_mapping = torch.from_numpy(slot_mapping[stored])
        image_groups = arrays.get("image_groups")
        if self._attends_token_by_token(num_tokens, q_lens, slot_mapping, image_groups):
            # Every token a decode row over its own sequence's table, seeing keys up to its own
            # position: the step's keys are all stored before any attends, so a span is causal.
            token_seqs = np.repeat(np.arange(num_seqs), q_lens)
            lens = (
                np.repeat(seq_lens - q_lens, q_lens) + np.arange(num_tokens) - np.repeat(qsl[:-1], q_lens) + 1
            )
            num_blocks = int(-(-lens.max() // bs))
            meta.decode_tokens = torch.arange(num_tokens)
            meta.is_all_decode = True
            meta.decode_tables = torch.from_numpy(np.ascontiguousarray(tables[token_seqs, :num_blocks]))
            meta.decode_lens = torch.from_numpy(lens)
            return meta
        window = self.s.window
        decode = np.flatnonzero(q_lens == 1)
        if len(decode):
            lens = seq_lens[decode]
            meta.decode_tokens = torch.from_numpy(qsl[decode])
            meta.is_all_decode = len(decode) == num_tokens
            if self.has_decode_kernel:
                num_blocks = int(-(-lens.max() // bs))
                meta.decode_tables = torch.from_numpy(np.ascontiguousarray(tables[decode, :num_blocks]))
                meta.decode_lens = torch.from_numpy(lens)
            else:
                # Each context from its first block inside the window (block 0 without one):
                # blocks wholly before it are never read.
                first = np.maximum(lens - window, 0) // bs if window else np.zeros_like(lens)
                needed = -(-lens // bs)
                num_blocks = int((needed - first).max())
                columns = first[:, None] + np.arange(num_blocks)[None, :]
                # Past a context's last block: its first block again (any real block; masked out).
                columns = np.where(columns < needed[:, None], columns, first[:, None])
                decode_tables = np.take_along_axis(tables[decode], columns, axis=1)
                length = num_blocks * bs
                key_pos = first[:, None] * bs + np.arange(length)[None, :]
                is_key = key_pos < lens[:, None]
                if window:
                    is_key &= key_pos >= (lens - window)[:, None]
                mask = np.where(is_key, 0.0, -np.inf).astype(np.float32)
                meta.decode_blocks = torch.from_numpy(np.ascontiguousarray(decode_tables).reshape(-1))
                meta.decode_len = length
                meta.decode_mask = torch.from_numpy(mask).to(self.dtype).view(len(decode), 1, 1, length)
        prefills = []
        for i in np.flatnonzero(q_lens > 1):
            length, q_len = int(seq_lens[i]), int(q_lens[i])
            # The first key any query of the chunk sees, and the block holding it.
            start = max(length - q_len - window + 1, 0) if window else 0
            first_block, num_blocks = start // bs, -(-length // bs)
            block_slots = tables[i, first_block:num_blocks, None] * bs + np.arange(bs)
            slots = block_slots.reshape(-1)[start - first_block * bs : length - first_block * bs]
            mask = None
            is_windowed = window and length > window
            groups = None if image_groups is None else image_groups[qsl[i] : qsl[i + 1]]
            has_images = groups is not None and bool((groups >= 0).any())
            if q_len != length or is_windowed or has_images:
                query_pos = length - q_len + np.arange(q_len)
                key_pos = np.arange(start, length)
                is_key = key_pos[None, :] <= query_pos[:, None]
                if has_images:
                    # An image's tokens see each other both ways (HF's Gemma 3 mask: causal OR
                    # same image, then AND the window). The image lies within this chunk, so only
                    # the chunk's own keys (the last q_len) can share a query's image.
                    same = (groups[:, None] == groups[None, :]) & (groups[:, None] >= 0)
                    is_key[:, len(key_pos) - q_len :] |= same
                if is_windowed:
                    is_key &= key_pos[None, :] > query_pos[:, None] - window
                mask = torch.from_numpy(is_key)
            prefills.append(PrefillSeq(int(qsl[i]), int(qsl[i + 1]), torch.from_numpy(slots), mask))
        meta.prefills = tuple(prefills)
        return meta

    def _attends_token_by_token(
        self,
        num_tokens: int,
        q_lens: np.ndarray,
        slot_mapping: np.ndarray,
        image_groups: np.ndarray | None,
    ) -> bool:
        """Whether a step with spans of several query tokens (speculative verification, a short
        prompt chunk) attends as decode rows, one per token: with the C++ decode kernel, for steps
        of few rows, which then take the one-op decode layers instead of a per-layer path. Not with
        a token whose key is not stored (a later one could not see it) or with image tokens (they
        see each other both ways)."""
        return (
            self.has_decode_kernel
            and 1 < num_tokens <= cpu_ops.MAX_LINEAR_ROWS
            and bool((q_lens > 1).any())
            and bool((slot_mapping >= 0).all())
            and (image_groups is None or not bool((image_groups[:num_tokens] >= 0).any()))
        )

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMeta,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq * D]; stores k/v into the cache first. `sinks`
        [Hq]: each query head's sink logit (gpt-oss), None without."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        k_rows = k_cache.view(-1, num_kv_heads * head_dim)
        v_rows = v_cache.view(-1, num_kv_heads * head_dim)
        if meta.store_tokens is not None:
            k, v = k[meta.store_tokens], v[meta.store_tokens]
        # A bfloat16 cache under a float32 model (engine.kv_cache_dtype) stores the rounded values.
        k_rows.index_copy_(0, meta.slot_mapping, k.reshape(k.shape[0], -1).to(k_rows.dtype))
        v_rows.index_copy_(0, meta.slot_mapping, v.reshape(v.shape[0], -1).to(v_rows.dtype))
        if meta.is_all_decode:
            return self._decode(q, k_cache, v_cache, meta, scale, sinks).view(num_tokens, -1)
        out = q.new_empty(num_tokens, num_heads, head_dim)
        if meta.decode_tokens is not None:
            out[meta.decode_tokens] = self._decode(
                q[meta.decode_tokens], k_cache, v_cache, meta, scale, sinks
            )
        for seq in meta.prefills:
            ctx_k = k_rows.index_select(0, seq.context_slots).to(q.dtype).view(1, -1, num_kv_heads, head_dim)
            ctx_v = v_rows.index_select(0, seq.context_slots).to(q.dtype).view(1, -1, num_kv_heads, head_dim)
            seq_q = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            if self.s.softcap or sinks is not None:
                q_len, length = seq_q.shape[2], ctx_k.shape[1]
                mask = seq.mask
                if mask is None:
                    mask = torch.ones(q_len, length, dtype=torch.bool).tril_(length - q_len)
                # The G query heads of a KV head as G * q_len rows against it, as in decode.
                grouped_q = seq_q.reshape(1, num_kv_heads, group * q_len, head_dim)
                o = eager_attention(
                    grouped_q, ctx_k.transpose(1, 2), ctx_v.transpose(1, 2), mask.repeat(group, 1),
                    scale, self.s.softcap, None if sinks is None else sink_rows(sinks, num_kv_heads, q_len),
                ).view(1, num_heads, q_len, head_dim)  # fmt: skip
            else:
                o = F.scaled_dot_product_attention(
                    seq_q, ctx_k.transpose(1, 2), ctx_v.transpose(1, 2),
                    attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=group > 1,
                )  # fmt: skip
            out[seq.start : seq.end] = o[0].transpose(0, 1)
        return out.view(num_tokens, -1)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMeta,
        scale: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        if meta.decode_tables is not None:
            return cpu_ops.paged_decode(
                q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, scale, sinks
            )
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        shape = (num_seqs, meta.decode_len, num_kv_heads, head_dim)
        # Whole blocks are gathered (12 KiB rows: far fewer, larger copies than per-slot rows) and used in place,
        # transposed: CPU flash SDPA reads the strided [S, Hk, L, D] view without another copy.
        ctx_k = k_cache.index_select(0, meta.decode_blocks).to(q.dtype).view(shape).transpose(1, 2)
        ctx_v = v_cache.index_select(0, meta.decode_blocks).to(q.dtype).view(shape).transpose(1, 2)
        # The G query heads sharing a KV head become G query rows against it: no KV repeat.
        grouped_q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if self.s.softcap or sinks is not None:
            o = eager_attention(
                grouped_q, ctx_k, ctx_v, meta.decode_mask, scale, self.s.softcap,
                None if sinks is None else sinks.view(num_kv_heads, -1),
            )  # fmt: skip
        else:
            o = F.scaled_dot_product_attention(
                grouped_q, ctx_k, ctx_v, attn_mask=meta.decode_mask, scale=scale
            )
        return o.reshape(num_seqs, num_heads, head_dim)


class TritonOps:
    """CUDA path: the Triton kernels of kernels/ (imported here so CPU-only hosts never need them)."""

    def __init__(self, shapes: Shapes, device: torch.device, dtype: torch.dtype) -> None:
        from kernels.kv_store import store_kv_triton
        from kernels.paged_attention import paged_decode_triton, paged_prefill_triton
        from kernels.rms_norm import rms_norm_triton
        from kernels.rotary import rotary_triton

        self.s = shapes
        self.block_size = shapes.block_size
        self.device = device
        self.dtype = dtype
        self._rms_norm = rms_norm_triton
        self._store_kv = store_kv_triton
        self._rotary = rotary_triton
        self._decode = paged_decode_triton
        self._prefill = paged_prefill_triton

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rms_norm(x, weight, eps, residual)

    def qkv_rotary(
        self, qkv: torch.Tensor, meta: StepMeta, qk_norms: QKNorms | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, num_tokens = self.s, qkv.shape[0]
        q = qkv[:, : s.q_size].view(num_tokens, s.num_heads, s.head_dim)
        k = qkv[:, s.q_size : s.q_size + s.kv_size].view(num_tokens, s.num_kv_heads, s.head_dim)
        if qk_norms is not None:
            qk = norm_qk(torch.cat((q, k), dim=1), s.num_heads, qk_norms)
            q, k = qk.split((s.num_heads, s.num_kv_heads), dim=1)
        v = qkv[:, s.q_size + s.kv_size :].view(num_tokens, s.num_kv_heads, s.head_dim)
        if meta.mrope_positions is None:
            self._rotary(q, k, meta.rope_rows, s.cos_sin)
        else:
            self._rotary(q, k, meta.mrope_positions, s.cos_sin, s.mrope_section)
        return q, k, v

    def prepare(
        self,
        arrays: dict[str, np.ndarray],
        num_tokens: int,
        num_seqs: int,
        rope_positions: np.ndarray | None = None,
    ) -> StepMeta:
        """`rope_positions`: M-RoPE's [3, T] (mrope_positions), None for the plan's positions."""

        def to_device(name: str, n: int) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(arrays[name][:n])).to(self.device, non_blocking=True)

        rope_rows = rotary_rows(arrays, num_tokens, num_seqs, self.s.long_rope_rows)
        meta = StepMeta(
            rope_rows=torch.from_numpy(rope_rows).to(self.device, non_blocking=True),
            slot_mapping=to_device("slot_mapping", num_tokens),
            is_all_decode=num_tokens == num_seqs,
            block_tables=to_device("block_tables", num_seqs),
            query_start_loc=to_device("query_start_loc", num_seqs + 1),
            seq_lens=to_device("seq_lens", num_seqs),
        )
        groups = arrays.get("image_groups")
        if groups is not None and not meta.is_all_decode and (groups[:num_tokens] >= 0).any():
            tails = image_tails(groups[:num_tokens])
            meta.image_tails = torch.from_numpy(tails).to(self.device, non_blocking=True)
        if rope_positions is not None and self.s.mrope_section:
            meta.mrope_positions = torch.from_numpy(rope_positions).to(self.device, non_blocking=True)
        return meta

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMeta,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        window, softcap = self.s.window, self.s.softcap
        if meta.is_all_decode:
            out = self._decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window=window, softcap=softcap,
                sinks=sinks,
            )  # fmt: skip
        else:
            out = self._prefill(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                window=window, softcap=softcap, sinks=sinks, image_tails=meta.image_tails,
            )  # fmt: skip
        return out.view(q.shape[0], -1)


def make_ops(
    shapes: Shapes, device: torch.device, dtype: torch.dtype, backend: str | None = None
) -> TorchOps | TritonOps:
    """The backend for `device`, chosen once at start. `backend` ("torch" or "triton") forces one:
    tests run the Triton path on CPU tensors under TRITON_INTERPRET=1 to check its wiring."""
    if backend is None:
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        return TritonOps(shapes, device, dtype)
    if backend == "torch":
        return TorchOps(shapes, device, dtype)
    raise ValueError(f"unknown attention backend {backend!r}: 'torch' or 'triton'")
