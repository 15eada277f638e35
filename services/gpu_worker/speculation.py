"""Verification of proposed tokens (speculative decoding, docs/speculative.md).

A verifying row's span in the step is its last known token followed by d proposed tokens, so one
forward pass gives the target model's logits at d + 1 positions: the prediction after the last
known token, and after each proposal. At each of them the sampler draws the target's token as
plain decoding draws it at that position (`target_tokens`): the request's temperature, top-k,
top-p, min-p and logit bias, and its seed with the position's own noise (the sampler's
position-keyed Gumbel-max). The row keeps the longest prefix of proposals equal to those tokens,
then the target's own token after that prefix (`emitted_tokens`): between 1 and d + 1 new tokens.

For a greedy row that is the longest prefix equal to the argmax. For a sampled row it is
rejection sampling with a point-mass draft, as a proposer that looks tokens up (n-gram) has: the
proposal x at a position is accepted exactly when the target's draw there is x, which has the
target's probability p(x); when it is not, the draw is a token other than x, distributed as p
with x removed and renormalised (the residual), and it is emitted; when every proposal is
accepted, the draw after the last one is the bonus token. Each position's draw depends only on
the logits, the seed and the position, so a row emits exactly the tokens plain decoding emits
with the same seed, whichever proposals it was given, and the emitted distribution is the
target's. A draft model whose proposals are themselves sampled from a distribution q would need
the general rule (accept with min(1, p/q), resample from max(0, p - q)); none is built.
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


def target_tokens(
    sampler: Sampler, logits: torch.Tensor, arrays: dict[str, np.ndarray], verifying: np.ndarray
) -> SamplerOutput:
    """The target's token at every verified position of the `verifying` plan rows, drawn by the
    sampler as plain decoding draws it there. `logits` [sum(num_proposed + 1), V] are the rows'
    positions in plan order, each row's last known token first. The last known token's position
    is its row's seq_len minus its proposals and 1, and a token is sampled for the position after
    its input (the plan's sample position is the context length)."""
    proposed = arrays["num_proposed"][verifying].astype(np.int64)
    counts = proposed + 1
    rows = np.repeat(verifying, counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.repeat(arrays["seq_lens"][verifying].astype(np.int64) - proposed, counts) + within
    return sampler.sample(logits, arrays, rows, positions)
