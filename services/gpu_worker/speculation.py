"""Verification of proposed tokens (speculative decoding, docs/speculative.md).

A verifying row's span in the step is its last known token followed by d proposed tokens, so one
forward pass gives the target model's logits at d + 1 positions: the prediction after the last
known token, and after each proposal. At each of them the sampler draws the target's token as
plain decoding draws it at that position (`target_tokens`): the request's temperature, top-k,
top-p, min-p, logit bias and penalties (over its history and the proposals before the position),
its grammar's mask after the proposals before the position (the scheduler's), and its seed with
the position's own noise (the sampler's position-keyed Gumbel-max). The row keeps the longest prefix of proposals equal to those tokens,
then the target's own token after that prefix (`emitted_tokens`): between 1 and d + 1 new tokens.

For a greedy row that is the longest prefix equal to the argmax. For a sampled row it is
rejection sampling with a point-mass draft, as a proposer that looks tokens up (n-gram) has: the
proposal x at a position is accepted exactly when the target's draw there is x, which has the
target's probability p(x); when it is not, the draw is a token other than x, distributed as p
with x removed and renormalised (the residual), and it is emitted; when every proposal is
accepted, the draw after the last one is the bonus token. Each position's draw depends only on
the logits, the seed and the position, so a row emits exactly the tokens plain decoding emits
with the same seed, whichever proposals it was given, and the emitted distribution is the
target's. The draft model (services/gpu_worker/draft.py) drafts greedily, a point mass too; a draft
whose proposals were sampled from a distribution q would need the general rule (accept with
min(1, p/q), resample from max(0, p - q)); none is built.
"""

from __future__ import annotations

import numpy as np
import torch

from services.gpu_worker.sampler import Sampler, SamplerOutput


def num_accepted(target_ids: np.ndarray, proposed: np.ndarray) -> int:
    """How many of the `proposed` tokens [d] verification keeps, given the target's token at each
    of the d + 1 positions (`target_ids`, the first after the last known token): the length of
    their longest common prefix."""
    if len(target_ids) != len(proposed) + 1:
        raise ValueError(f"{len(target_ids)} target tokens for {len(proposed)} proposals: expected one more")
    mismatches = np.flatnonzero(target_ids[: len(proposed)] != proposed)
    return int(mismatches[0]) if len(mismatches) else len(proposed)


def emitted_tokens(target_ids: np.ndarray, proposed: np.ndarray) -> np.ndarray:
    """The row's new tokens: the accepted proposals and the target's token after them. They equal
    the target's tokens up to and including the first disagreement, so they are a prefix of
    `target_ids`."""
    return target_ids[: num_accepted(target_ids, proposed) + 1]


# The sampler's per-row plan arrays (services/gpu_worker/sampler.py) that are the same at every
# position of a verifying row's span.
_ROW_CONSTANTS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seeds",
    "num_logprobs",
    "history_prompt_lens",
)


def position_arrays(arrays: dict[str, np.ndarray], verifying: np.ndarray) -> dict[str, np.ndarray]:
    """The sampler's arrays for every verified position of the `verifying` plan rows, one row per
    position in plan order (each row's last known token first), as plain decoding would plan
    that position: the row's sampling parameters and logit bias; its sample position (the
    context length: the last known token's position, the row's seq_len minus its proposals and
    1, plus 1 plus the position's index); its penalty history (prompt and outputs) followed
    by the proposals before the position, which plain decoding would have emitted by then if
    they are accepted (and if not, the position's draw is discarded); and a constrained row's
    grammar mask at the position, which the scheduler computed after the proposals before it
    (the plan names the row once per position, in order)."""
    proposed = arrays["num_proposed"][verifying].astype(np.int64)
    counts = proposed + 1
    rows = np.repeat(verifying, counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    out = {name: arrays[name][rows] for name in _ROW_CONSTANTS}
    out["sample_positions"] = (
        np.repeat(arrays["seq_lens"][verifying].astype(np.int64) - proposed, counts) + within
    )
    bias_offsets, history_offsets = arrays["bias_offsets"], arrays["history_offsets"]
    ends = arrays["query_start_loc"][verifying + 1].astype(np.int64)
    bias_ids, bias_values, histories = [], [], []
    for i, end, d in zip(verifying.tolist(), ends.tolist(), proposed.tolist(), strict=True):
        bias = slice(bias_offsets[i], bias_offsets[i + 1])
        history = arrays["history_ids"][history_offsets[i] : history_offsets[i + 1]]
        has_history = len(history) > 0  # only rows with penalties carry one
        for m in range(d + 1):
            bias_ids.append(arrays["bias_ids"][bias])
            bias_values.append(arrays["bias_values"][bias])
            histories.append(
                np.concatenate((history, arrays["input_ids"][end - d : end - d + m]))
                if has_history
                else history
            )
    out["bias_offsets"] = _offsets(bias_ids)
    out["bias_ids"] = np.concatenate(bias_ids)
    out["bias_values"] = np.concatenate(bias_values)
    out["history_offsets"] = _offsets(histories)
    out["history_ids"] = np.concatenate(histories)
    if "grammar_rows" in arrays:  # a constrained row's masks, one per position, in order
        grammar_rows = arrays["grammar_rows"]
        here = np.isin(grammar_rows, verifying)
        firsts = np.cumsum(counts) - counts  # each verifying row's first position
        at = dict(zip(verifying.tolist(), firsts.tolist(), strict=True))
        named = grammar_rows[here]
        within_row = np.arange(len(named)) - np.searchsorted(named, named)  # 0, 1, ... per row
        out["grammar_rows"] = np.array([at[r] for r in named.tolist()], np.int64) + within_row
        out["grammar_bitmask"] = arrays["grammar_bitmask"][here]
    return out


def _offsets(spans: list[np.ndarray]) -> np.ndarray:
    offsets = np.zeros(len(spans) + 1, np.int64)
    np.cumsum([len(span) for span in spans], out=offsets[1:])
    return offsets


def target_tokens(
    sampler: Sampler, logits: torch.Tensor, arrays: dict[str, np.ndarray], verifying: np.ndarray
) -> SamplerOutput:
    """The target's token at every verified position of the `verifying` plan rows, drawn by the
    sampler as plain decoding draws it there (`position_arrays`). `logits` [sum(num_proposed +
    1), V] are the rows' positions in plan order, each row's last known token first."""
    per_position = position_arrays(arrays, verifying)
    return sampler.sample(logits, per_position, np.arange(len(logits)))


def proposal_mask(query_start_loc: np.ndarray, num_proposed: np.ndarray, num_tokens: int) -> np.ndarray:
    """Which of a step's `num_tokens` tokens are proposals: the last `num_proposed[i]` of row i's
    span (`query_start_loc`)."""
    mask = np.zeros(num_tokens, np.bool_)
    for end, count in zip(query_start_loc[1:].tolist(), num_proposed.tolist(), strict=True):
        mask[end - count : end] = True
    return mask
