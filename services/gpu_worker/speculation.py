"""Greedy verification of proposed tokens (speculative decoding, docs/speculative.md).

A verifying row's span in the step is its last known token followed by d proposed tokens, so one
forward pass gives the target model's logits at d + 1 positions: the prediction after the last
known token, and after each proposal. The target's greedy token at position m is what plain
decoding would have produced there if every proposal before m was right, so the row keeps the
longest prefix of proposals equal to those greedy tokens, then the target's own token after that
prefix: between 1 and d + 1 new tokens, each exactly the one plain greedy decoding emits.
"""

from __future__ import annotations

import numpy as np


def num_accepted(target_ids: np.ndarray, proposed: np.ndarray) -> int:
    """How many of the `proposed` tokens [d] greedy verification keeps, given the target's greedy
    token at each of the d + 1 positions (`target_ids`, the first after the last known token):
    the length of their longest common prefix."""
    if len(target_ids) != len(proposed) + 1:
        raise ValueError(f"{len(target_ids)} target tokens for {len(proposed)} proposals: expected one more")
    mismatches = np.flatnonzero(target_ids[: len(proposed)] != proposed)
    return int(mismatches[0]) if len(mismatches) else len(proposed)


def emitted_tokens(target_ids: np.ndarray, proposed: np.ndarray) -> np.ndarray:
    """The row's new tokens: the accepted proposals and the target's token after them. They equal
    the target's greedy tokens up to and including the first disagreement, so they are a prefix
    of `target_ids`."""
    return target_ids[: num_accepted(target_ids, proposed) + 1]
