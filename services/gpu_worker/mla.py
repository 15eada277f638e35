"""DeepSeek's multi-head latent attention (architectures.MlaConfig) over a paged cache that holds,
per token and layer, only the normed latent (kv_lora_rank) and the rotated rope key shared by the
heads (qk_rope_head_dim): [num_blocks, block_size, 1, width] each, in place of the K and V pages.

Prefill chunks up-project their context's latents through kv_b_proj into each head's nope key and
value and attend as ordinary heads. Decode rows attend in the absorbed form: kv_b_proj's key half
is folded into the query (q_nope W_uk, per head, against the latent itself) and its value half
applied after the softmax, so a decode step reads the latents once and never expands them into
heads; `absorbed_decode=False` decodes in the up-projected form too (the tests compare both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.nn.functional as F

from services.gpu_worker.architectures import MLA_NORM_EPS, MlaConfig
from services.gpu_worker.attention import Shapes, StepMeta, TorchOps
from services.gpu_worker.huge_pages import huge_page_empty

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class MlaWeights:
    """One layer's latent attention weights, this rank's heads of the per-head ones (q_b, kv_b,
    and o_proj's columns, which the layer keeps as its o_proj); q_a, kv_a and the norms whole."""

    config: MlaConfig
    num_heads: int  # this rank's
    q_a: torch.Tensor | None  # [q_lora_rank, H]; None: q_b is q_proj, straight from the hidden state
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: torch.Tensor  # [heads * qk_head_dim, q_lora_rank or H]
    kv_a: torch.Tensor  # [kv_lora_rank + qk_rope_head_dim, H]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]

    @classmethod
    def empty(
        cls, config: MlaConfig, hidden_size: int, num_heads: int, dtype: torch.dtype, device: torch.device
    ) -> MlaWeights:
        def empty(*shape: int) -> torch.Tensor:
            return huge_page_empty(shape, dtype, device)

        q_rank = config.q_lora_rank
        return cls(
            config, num_heads,
            q_a=empty(q_rank, hidden_size) if q_rank else None,
            q_a_norm=empty(q_rank) if q_rank else None,
            q_b=empty(num_heads * config.qk_head_dim, q_rank or hidden_size),
            kv_a=empty(config.cache_width, hidden_size),
            kv_a_norm=empty(config.kv_lora_rank),
            kv_b=empty(num_heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank),
        )  # fmt: skip

    def slots(self) -> dict[str, torch.Tensor | None]:
        """The checkpoint's names (after model.layers.N.self_attn.) of these weights."""
        q = {"q_proj.weight": self.q_b} if self.q_a is None else {
            "q_a_proj.weight": self.q_a, "q_a_layernorm.weight": self.q_a_norm, "q_b_proj.weight": self.q_b,
        }  # fmt: skip
        return {
            **q,
            "kv_a_proj_with_mqa.weight": self.kv_a,
            "kv_a_layernorm.weight": self.kv_a_norm,
            "kv_b_proj.weight": self.kv_b,
        }


class MlaOps(TorchOps):
    """The step metadata of latent attention: TorchOps' (the rotary rows of the rope dims, the
    prefill chunks' context slots and masks), with decode rows as one padded batch of their
    contexts' pages (the C++ paged decode reads K/V heads, not latents), on any device."""

    def __init__(self, shapes: Shapes, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(shapes, device, dtype)
        self.has_decode_kernel = False
        self.has_norm_kernel = self.has_norm_kernel and device.type == "cpu"

    def prepare(
        self,
        arrays: dict[str, np.ndarray],
        num_tokens: int,
        num_seqs: int,
        rope_positions: np.ndarray | None = None,
    ) -> StepMeta:
        meta = super().prepare(arrays, num_tokens, num_seqs, rope_positions)
        if self.device.type == "cpu":
            return meta
        tensors = {f.name: getattr(meta, f.name) for f in fields(meta)}
        moved = {name: t.to(self.device) for name, t in tensors.items() if isinstance(t, torch.Tensor)}
        prefills = tuple(
            replace(
                seq,
                context_slots=seq.context_slots.to(self.device),
                mask=None if seq.mask is None else seq.mask.to(self.device),
            )
            for seq in meta.prefills
        )
        return replace(meta, **moved, prefills=prefills)


def rotate(x: torch.Tensor, meta: StepMeta, interleaved: bool) -> torch.Tensor:
    """The rope dims x [T, heads, D] rotated by each token's position. Interleaved (x0, x1) pairs
    are first laid out as halves (evens, then odds), as DeepseekV3's apply_rotary_pos_emb_interleave
    leaves them; q and k alike, so their dot products are V2's complex-pair rotation's too."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * meta.cos, swapped, meta.sin)


def mla_attention(
    x: torch.Tensor,
    weights: MlaWeights,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    meta: StepMeta,
    scale: float,
    linear: Linear = F.linear,
    absorbed_decode: bool = True,
) -> torch.Tensor:
    """x [T, hidden] (after the input norm) -> the heads' outputs [T, heads * v_head_dim], for
    o_proj; stores each token's latent and rope key into the caches first."""
    c, num_heads, num_tokens = weights.config, weights.num_heads, x.shape[0]
    if weights.q_a is None:
        q = linear(x, weights.q_b)
    else:
        q_latent = F.rms_norm(linear(x, weights.q_a), (c.q_lora_rank,), weights.q_a_norm, MLA_NORM_EPS)
        q = linear(q_latent, weights.q_b)
    q_nope, q_rope = q.view(num_tokens, num_heads, c.qk_head_dim).split(
        (c.qk_nope_head_dim, c.qk_rope_head_dim), dim=-1
    )
    q_rope = rotate(q_rope, meta, c.rope_interleave)
    latent, k_rope = linear(x, weights.kv_a).split((c.kv_lora_rank, c.qk_rope_head_dim), dim=-1)
    latent = F.rms_norm(latent, (c.kv_lora_rank,), weights.kv_a_norm, MLA_NORM_EPS)
    k_rope = rotate(k_rope.unsqueeze(1), meta, c.rope_interleave).squeeze(1)

    latent_rows = latent_cache.view(-1, c.kv_lora_rank)
    rope_rows = rope_cache.view(-1, c.qk_rope_head_dim)
    stored_latent, stored_rope = latent, k_rope
    if meta.store_tokens is not None:
        stored_latent, stored_rope = latent[meta.store_tokens], k_rope[meta.store_tokens]
    latent_rows.index_copy_(0, meta.slot_mapping, stored_latent)
    rope_rows.index_copy_(0, meta.slot_mapping, stored_rope)

    out = q.new_empty(num_tokens, num_heads, c.v_head_dim)
    if meta.decode_tokens is not None:
        rows = meta.decode_tokens
        num_seqs = rows.shape[0]
        shape = (num_seqs, meta.decode_len)
        ctx_latent = latent_cache.index_select(0, meta.decode_blocks).view(*shape, c.kv_lora_rank)
        ctx_rope = rope_cache.index_select(0, meta.decode_blocks).view(*shape, c.qk_rope_head_dim)
        if absorbed_decode:
            out[rows] = absorbed(
                q_nope[rows], q_rope[rows], ctx_latent, ctx_rope, weights, meta.decode_mask, scale
            )
        else:
            out[rows] = expanded(
                q_nope[rows].unsqueeze(1), q_rope[rows].unsqueeze(1), ctx_latent, ctx_rope, weights,
                meta.decode_mask, scale,
            )[:, 0]  # fmt: skip
    for seq in meta.prefills:
        span = slice(seq.start, seq.end)
        ctx_latent = latent_rows.index_select(0, seq.context_slots).unsqueeze(0)
        ctx_rope = rope_rows.index_select(0, seq.context_slots).unsqueeze(0)
        mask = seq.mask
        if mask is None:  # the chunk is its whole context: causal
            q_len = seq.end - seq.start
            mask = torch.ones(q_len, q_len, dtype=torch.bool, device=x.device).tril_()
        out[span] = expanded(
            q_nope[span].unsqueeze(0), q_rope[span].unsqueeze(0), ctx_latent, ctx_rope, weights, mask, scale
        )[0]
    return out.view(num_tokens, -1)


def expanded(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    ctx_latent: torch.Tensor,
    ctx_rope: torch.Tensor,
    weights: MlaWeights,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention with the contexts' latents up-projected into each head's nope key and value, as
    DeepseekV3Attention computes it. q_nope / q_rope [B, R, heads, *] (R query rows of each of B
    sequences), ctx_latent / ctx_rope [B, L, *], mask broadcast to [B, heads, R, L] (bool: True
    attends, or additive) -> [B, R, heads, v_head_dim]."""
    c, num_heads = weights.config, weights.num_heads
    batch, length = ctx_latent.shape[:2]
    kv = F.linear(ctx_latent, weights.kv_b).view(batch, length, num_heads, -1)
    k_nope, value = kv.split((c.qk_nope_head_dim, c.v_head_dim), dim=-1)
    key = torch.cat((k_nope, ctx_rope.unsqueeze(2).expand(-1, -1, num_heads, -1)), dim=-1)
    query = torch.cat((q_nope, q_rope), dim=-1)
    o = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return o.transpose(1, 2)


def absorbed(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    ctx_latent: torch.Tensor,
    ctx_rope: torch.Tensor,
    weights: MlaWeights,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention with kv_b_proj absorbed: each head's query q_nope W_uk (kv_lora_rank
    wide) and its rope part score against the cached latent and rope key directly (one KV head
    that every query head shares), the softmax-weighted latents then go through W_uv. Decode
    rows: q_nope / q_rope [B, heads, *], ctx [B, L, *], mask [B, 1, 1, L] -> [B, heads, v_head_dim]."""
    c, num_heads = weights.config, weights.num_heads
    kv_b = weights.kv_b.view(num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    w_uk, w_uv = kv_b.split((c.qk_nope_head_dim, c.v_head_dim), dim=1)
    q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    query = torch.cat((q_latent, q_rope), dim=-1).unsqueeze(1)  # [B, 1, heads, rank + rope]
    key = torch.cat((ctx_latent, ctx_rope), dim=-1).unsqueeze(1)  # [B, 1, L, rank + rope]
    o = F.scaled_dot_product_attention(query, key, ctx_latent.unsqueeze(1), attn_mask=mask, scale=scale)
    return torch.einsum("bhr,hvr->bhv", o[:, 0], w_uv)
