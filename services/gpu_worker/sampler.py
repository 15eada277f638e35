"""Token sampling with position-keyed randomness (docs/architecture.md invariant 5).

Noise comes from a counter-based hash of (seed, sample_position, vocab index), so a request
samples the same token alone, in any batch, in any row order, and after a recompute. Sampling is
Gumbel-max: argmax(logits / T + gumbel) over the tokens that top-k / top-p / min-p allow, which
draws from softmax(logits / T) renormalised over that set. A constrained row's grammar bitmask
removes the tokens its grammar refuses first (after bias and penalties); it depends on the row
alone, so sampling stays batch-invariant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels import cpu_ops
from services.gpu_worker.grammar_mask import apply_grammar_bitmask

# Hash constants as the signed values of their bit patterns (torch integer ops wrap).
_GOLDEN64 = 0x9E3779B97F4A7C15 - 2**64  # splitmix64
_MIX64 = (0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64)
_GOLDEN32 = 0x9E3779B9 - 2**32  # lowbias32 (C. Wellons), per vocab index
_MIX32 = (0x7FEB352D, 0x846CA68B - 2**32)
MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (as vLLM): logits / T would overflow
TOP_P_CANDIDATES = 1024  # top-p without top-k looks for the nucleus among these first
_NUM_UNIFORM_BITS = 23  # (k + 0.5) / 2**23 is exact in float32 and strictly inside (0, 1)


def _xorshift_(h: torch.Tensor, shift: int, tmp: torch.Tensor) -> None:
    """h ^= h >>> shift, in place. torch's >> is arithmetic, so mask off the sign fill."""
    torch.bitwise_right_shift(h, shift, out=tmp)
    tmp &= (1 << (h.element_size() * 8 - shift)) - 1
    h ^= tmp


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 as a signed int32, without relying on an overflowing cast."""
    return (((x & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).int()


def _splitmix64_(z: torch.Tensor, tmp: torch.Tensor) -> None:
    """The splitmix64 finaliser, in place: a bijection on 64 bits with full avalanche."""
    for shift, mult in zip((30, 27), _MIX64, strict=True):
        _xorshift_(z, shift, tmp)
        z *= mult
    _xorshift_(z, 31, tmp)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 stream key per (seed, position) (cheap: one per row)."""
    z = seeds.long() * _GOLDEN64 + _GOLDEN64
    tmp = torch.empty_like(z)
    _splitmix64_(z, tmp)
    z ^= positions.long()
    _splitmix64_(z, tmp)
    return z


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, col_keys: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), [n, V] float32: element (i, v) depends only on (seeds[i], positions[i], v).

    Per element it is a 32-bit hash (CPUs vectorize int32 arithmetic twice as wide as int64) of the vocab
    index, keyed by the 64-bit row key: its low half offsets the input, its high half is mixed in
    between the two rounds, so different rows are unrelated streams, not shifts of each other.
    `col_keys` is `vocab_col_keys(V, device)`.
    """
    keys = row_keys(seeds, positions)
    h = col_keys[None, :] + _to_int32(keys)[:, None]
    tmp = torch.empty_like(h)
    _xorshift_(h, 16, tmp)
    h *= _MIX32[0]
    h ^= _to_int32(keys >> 32)[:, None]
    _xorshift_(h, 15, tmp)
    h *= _MIX32[1]
    _xorshift_(h, 16, tmp)
    h >>= 32 - _NUM_UNIFORM_BITS  # keep the top bits (the best mixed by the multiplies)
    h &= (1 << _NUM_UNIFORM_BITS) - 1
    return h.float().add_(0.5).mul_(1.0 / 2**_NUM_UNIFORM_BITS)


def vocab_col_keys(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """Per-column int32 hash inputs: (v + 1) * golden ratio, wrapped to 32 bits."""
    return _to_int32((torch.arange(vocab_size, dtype=torch.int64, device=device) + 1) * _GOLDEN32)


@dataclass
class SamplerOutput:
    """One step's samples, on the sampler's device; K = max num_logprobs of the step (may be 0)."""

    sampled_ids: torch.Tensor  # [S] int32
    sampled_logprobs: torch.Tensor  # [S] float32, raw log-softmax at the sampled id
    top_ids: torch.Tensor  # [S, K] int32
    top_logprobs: torch.Tensor  # [S, K] float32

    def numpy(self) -> dict[str, np.ndarray]:
        """The result-ring arrays of docs/internals.md, on the host."""
        return {
            "sampled_ids": self.sampled_ids.cpu().numpy(),
            "sampled_logprobs": self.sampled_logprobs.cpu().numpy(),
            "top_ids": self.top_ids.cpu().numpy(),
            "top_logprobs": self.top_logprobs.cpu().numpy(),
        }


class Sampler:
    """Owns the per-column hash keys of one vocabulary on one device, and turns logits into tokens.

    Decisions about which work to do are made from the host-side plan arrays, so the device is
    never waited on, except once in a step with top-p rows that have no top-k (to check that
    the nucleus lies within the candidates).
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.col_keys = vocab_col_keys(vocab_size, self.device)

    def sample(self, logits: torch.Tensor, arrays: dict[str, np.ndarray], rows: np.ndarray) -> SamplerOutput:
        """Sample one token per row of `logits` [S, V]; `rows` are their step-plan row indices."""
        rows = np.asarray(rows, dtype=np.int64)
        if logits.shape != (len(rows), self.vocab_size):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(rows)} rows x {self.vocab_size} vocab"
            )
        logits = logits.float()

        # Logprobs are of the raw logits (before bias, penalties and temperature): a token's is its
        # logit less its row's log-sum-exp, so no [S, V] log_softmax is written.
        log_norms, raw_argmax = logsumexp_argmax(logits)
        num_top = int(arrays["num_logprobs"][rows].max(initial=0))
        top_logits, top_ids = torch.topk(logits, num_top, dim=-1)

        scores = self.apply_bias_and_penalties(logits, arrays, rows)
        bitmask = arrays.get("grammar_bitmask")
        scores_are_raw = scores is logits and (bitmask is None or not len(bitmask))
        if bitmask is not None and len(bitmask):
            # In place, even on the raw logits: what the logprobs read of them below is the sampled
            # token's, which the mask allows. Only these rows' (a verifying row's masks are its
            # positions', services/gpu_worker/speculation.py `position_arrays`).
            grammar_rows = arrays["grammar_rows"]
            here = np.isin(grammar_rows, rows)
            if not here.all():
                grammar_rows, bitmask = grammar_rows[here], bitmask[here]
            apply_grammar_bitmask(scores, bitmask, _local_rows(rows, grammar_rows))
        random_local = np.flatnonzero(arrays["temperature"][rows] >= MIN_TEMPERATURE)
        if len(random_local) == len(rows):
            sampled = self._sample_random(scores, arrays, rows)
        else:
            sampled = raw_argmax if scores_are_raw else logsumexp_argmax(scores)[1]
            if len(random_local):
                index = self._to_device(random_local)
                sampled[index] = self._sample_random(scores[index], arrays, rows[random_local])

        return SamplerOutput(
            sampled_ids=sampled.int(),
            sampled_logprobs=logits.gather(1, sampled[:, None])[:, 0] - log_norms,
            top_ids=top_ids.int(),
            top_logprobs=top_logits - log_norms[:, None],
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    def _sample_random(
        self, scores: torch.Tensor, arrays: dict[str, np.ndarray], plan_rows: np.ndarray
    ) -> torch.Tensor:
        """Gumbel-max for rows with temperature > 0 (`scores` holds just those rows)."""
        x = scores / self._to_device(arrays["temperature"][plan_rows].astype(np.float32))[:, None]
        x = _filter(x, arrays, plan_rows, self._to_device)
        u = hash_uniform(
            self._to_device(arrays["seeds"][plan_rows].astype(np.int64)),
            self._to_device(arrays["sample_positions"][plan_rows].astype(np.int64)),
            self.col_keys,
        )
        # x + Gumbel(u) = x - log(-log(u)); filtered tokens stay -inf because the noise is finite.
        return x.sub_(u.log_().neg_().log_()).argmax(dim=-1)

    def apply_bias_and_penalties(
        self, logits: torch.Tensor, arrays: dict[str, np.ndarray], rows: np.ndarray
    ) -> torch.Tensor:
        """Logit bias, then repetition (prompt + output), then presence / frequency (output only).

        Returns `logits` itself when no row uses any of them. The ragged index work is done on
        the host (the plan is there) and only for rows that use it; the device sees one gather /
        scatter per kind over the touched (row, token) pairs of the flattened logits.
        """
        bias_offsets = arrays["bias_offsets"]
        has_bias = bias_offsets[rows + 1] > bias_offsets[rows]
        repetition = arrays["repetition_penalty"][rows]
        presence = arrays["presence_penalty"][rows]
        frequency = arrays["frequency_penalty"][rows]
        has_repetition = repetition != 1.0
        has_output_penalty = (presence != 0.0) | (frequency != 0.0)
        if not (has_bias.any() or has_repetition.any() or has_output_penalty.any()):
            return logits

        vocab_size = logits.shape[1]
        scores = logits.clone()
        flat = scores.view(-1)

        if has_bias.any():
            local, index, _ = _ragged(bias_offsets, rows, has_bias)
            keys = _flat_keys(local, arrays["bias_ids"][index], vocab_size)
            values = arrays["bias_values"][index].astype(np.float32)
            flat.index_put_((self._to_device(keys),), self._to_device(values), accumulate=True)

        history_offsets = arrays["history_offsets"]
        history_ids = arrays["history_ids"]
        if has_repetition.any():
            local, index, _ = _ragged(history_offsets, rows, has_repetition)
            keys = np.unique(_flat_keys(local, history_ids[index], vocab_size))
            keys_dev = self._to_device(keys)
            penalty = self._to_device(repetition[keys // vocab_size].astype(np.float32))
            values = flat[keys_dev]
            # HF: a repeated token becomes less likely whatever the sign of its logit.
            flat[keys_dev] = torch.where(values > 0, values / penalty, values * penalty)

        if has_output_penalty.any():
            local, index, within = _ragged(history_offsets, rows, has_output_penalty)
            is_output = within >= arrays["history_prompt_lens"][rows[local]]
            keys, counts = np.unique(
                _flat_keys(local[is_output], history_ids[index[is_output]], vocab_size), return_counts=True
            )
            key_rows = keys // vocab_size
            delta = presence[key_rows] + frequency[key_rows] * counts
            flat.index_put_(
                (self._to_device(keys),), self._to_device(-delta.astype(np.float32)), accumulate=True
            )
        return scores


def logsumexp_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of float32 logits [S, V]: its log-sum-exp (a token's logprob is its logit less
    it) and its argmax (the first largest). On the CPU one C++ pass each, where torch's argmax
    alone takes longer than its log_softmax; elsewhere torch's."""
    if logits.device.type == "cpu" and cpu_ops.has_kernels(logits.dtype):
        return cpu_ops.logsumexp_argmax(logits)
    return torch.logsumexp(logits, dim=-1), logits.argmax(dim=-1)


def _filter(
    x: torch.Tensor,
    arrays: dict[str, np.ndarray],
    plan_rows: np.ndarray,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> torch.Tensor:
    """Top-k, then top-p on the renormalised survivors, then min-p, as -inf masks (HF order).

    Masks `x` in place (the caller owns it) and returns it. Both top-k and top-p work on one
    `topk` of the candidates instead of sorting the whole vocabulary: the top-k survivors, or the
    top `TOP_P_CANDIDATES` tokens, which nearly always hold the nucleus (rows where they do not
    fall back to a full sort).

    Every step is per row and exact except the top-p mass (a float32 sum): its rounding may
    depend on the candidate width, so a token whose mass-above lies within ~1e-7 of top_p could
    flip between batch mixes. Greedy, temperature, top-k and min-p are exactly batch invariant.
    """
    top_k = arrays["top_k"][plan_rows]
    top_p = arrays["top_p"][plan_rows]
    min_p = arrays["min_p"][plan_rows]
    vocab_size = x.shape[1]
    neg_inf = float("-inf")

    is_top_k = (top_k > 0) & (top_k < vocab_size)
    is_top_p = top_p < 1.0
    if is_top_k.any() or is_top_p.any():
        k = np.where(is_top_k, top_k, vocab_size).astype(np.int64)
        is_wide = is_top_p & ~is_top_k  # top-p rows whose nucleus is not bounded by a top-k
        width = min(vocab_size, max(int(k[is_top_k].max(initial=1)), TOP_P_CANDIDATES * bool(is_wide.any())))
        k_dev = to_device(k)[:, None]
        top_x = torch.topk(x, width, dim=-1).values  # sorted, descending
        if is_top_k.any():
            kth = top_x.gather(1, k_dev.clamp(max=width) - 1)
            kth.masked_fill_(~to_device(is_top_k)[:, None], neg_inf)
            x.masked_fill_(x < kth, neg_inf)
            top_x.masked_fill_(torch.arange(width, device=x.device)[None, :] >= k_dev, neg_inf)
        if is_top_p.any():
            p = to_device(top_p.astype(np.float32))[:, None]
            log_norm = torch.logsumexp(x, dim=-1, keepdim=True)  # over the top-k survivors
            cutoff, candidate_mass = _nucleus_cutoff(top_x, log_norm, p)
            if is_wide.any():
                is_short = to_device(is_wide)[:, None] & (candidate_mass < p)
                if is_short.any():  # the nucleus extends past the candidates: sort those rows
                    short = is_short[:, 0].nonzero()[:, 0]
                    sorted_x = torch.sort(x[short], dim=-1, descending=True).values
                    cutoff[short] = _nucleus_cutoff(sorted_x, log_norm[short], p[short])[0]
            cutoff.masked_fill_(~to_device(is_top_p)[:, None], neg_inf)
            x.masked_fill_(x < cutoff, neg_inf)

    if (min_p > 0).any():
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps all.
        with np.errstate(divide="ignore"):
            log_min_p = np.log(min_p.astype(np.float32))
        floor = x.max(dim=-1, keepdim=True).values + to_device(log_min_p)[:, None]
        x.masked_fill_(x < floor, neg_inf)
    return x


def _nucleus_cutoff(
    sorted_x: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest kept logit of each row's nucleus, and the mass of the given sorted prefix.

    A token is kept while the mass ranked above it is < top_p: the smallest set whose mass
    reaches top_p, and always at least the top token.
    """
    probs = (sorted_x - log_norm).exp_()
    mass = probs.cumsum(dim=-1)
    num_keep = (mass - probs < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    return sorted_x.gather(1, num_keep - 1), mass[:, -1:]


def _local_rows(rows: np.ndarray, plan_rows: np.ndarray) -> np.ndarray:
    """Where each of `plan_rows` (plan indices, all among `rows`) is in `rows`: its logits row."""
    order = np.argsort(rows, kind="stable")
    return order[np.searchsorted(rows, plan_rows, sorter=order)]


def _ragged(
    offsets: np.ndarray, rows: np.ndarray, is_used: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flatten the ragged spans of the used rows, vectorised.

    Returns, per entry: its local row (an index into the sampled batch, not the plan), its index
    into the flat ragged array, and its index within its own span.
    """
    local = np.flatnonzero(is_used)
    plan_rows = rows[local]
    starts = offsets[plan_rows].astype(np.int64)
    lengths = offsets[plan_rows + 1].astype(np.int64) - starts
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(local, lengths), np.repeat(starts, lengths) + within, within


def _flat_keys(local: np.ndarray, ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """(row, token) -> index into the flattened [S, V] logits. An id outside the vocab would land
    in another row, so it fails the step instead."""
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token id out of the vocabulary [0, {vocab_size}) in a sampling array")
    return local * vocab_size + ids
