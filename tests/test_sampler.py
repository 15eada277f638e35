"""The sampler against plain-Python references: greedy, batch invariance of seeded sampling,
distributions of temperature / top-k / top-p / min-p, penalties and bias, raw logprobs, the hash."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from services.gpu_worker.sampler import TOP_P_CANDIDATES, Sampler, hash_uniform, vocab_col_keys

MASK64 = 2**64 - 1
MASK32 = 2**32 - 1
GOLDEN = 0x9E3779B97F4A7C15

DEFAULTS: dict[str, Any] = {
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "seed": 0,
    "position": 0,
    "num_logprobs": 0,
    "prompt": [],
    "output": [],
    "bias": {},
}


def make_plan(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Step-plan sampling arrays (docs/internals.md) for one row per dict (missing keys: off)."""
    rows = [{**DEFAULTS, **r} for r in rows]

    def column(key: str, dtype: Any) -> np.ndarray:
        return np.array([r[key] for r in rows], dtype=dtype)

    histories = [list(r["prompt"]) + list(r["output"]) for r in rows]
    biases = [r["bias"] for r in rows]
    return {
        "temperature": column("temperature", np.float32),
        "top_k": column("top_k", np.int32),
        "top_p": column("top_p", np.float32),
        "min_p": column("min_p", np.float32),
        "repetition_penalty": column("repetition_penalty", np.float32),
        "presence_penalty": column("presence_penalty", np.float32),
        "frequency_penalty": column("frequency_penalty", np.float32),
        "seeds": column("seed", np.int64),
        "sample_positions": column("position", np.int32),
        "num_logprobs": column("num_logprobs", np.int32),
        "history_offsets": np.cumsum([0] + [len(h) for h in histories]).astype(np.int32),
        "history_ids": np.array([t for h in histories for t in h], dtype=np.int32),
        "history_prompt_lens": np.array([len(r["prompt"]) for r in rows], dtype=np.int32),
        "bias_offsets": np.cumsum([0] + [len(b) for b in biases]).astype(np.int32),
        "bias_ids": np.array([t for b in biases for t in b], dtype=np.int32),
        "bias_values": np.array([v for b in biases for v in b.values()], dtype=np.float32),
    }


def sample(logits: torch.Tensor, rows: list[dict[str, Any]], order: list[int] | None = None):
    """Sample plan rows `order` (default: all, in order) whose logits are `logits[order]`."""
    order = list(range(len(rows))) if order is None else order
    return Sampler(logits.shape[1], "cpu").sample(logits[order], make_plan(rows), np.array(order))


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    return [e / sum(exps) for e in exps]


def reference_distribution(logits: list[float], temperature: float, top_k=0, top_p=1.0, min_p=0.0):
    """HF order, in plain Python: temperature, top-k, top-p on the survivors, min-p."""
    probs = softmax([x / temperature for x in logits])
    ranked = sorted(range(len(probs)), key=lambda v: -probs[v])
    allowed = set(ranked[:top_k] if top_k else ranked)
    mass = sum(probs[v] for v in allowed)
    kept, total = set(), 0.0
    for v in (v for v in ranked if v in allowed):
        if total >= top_p * mass:
            break
        kept.add(v)
        total += probs[v]
    top = max(probs[v] for v in kept)
    kept = {v for v in kept if probs[v] >= min_p * top}
    norm = sum(probs[v] for v in kept)
    return [probs[v] / norm if v in kept else 0.0 for v in range(len(probs))]


def draw_counts(logits_row: list[float], num_draws: int, seed: int = 7, **params: Any) -> np.ndarray:
    """Empirical counts over `num_draws` distinct sample positions of one request."""
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(num_draws, -1).contiguous()
    rows = [{"seed": seed, "position": p, **params} for p in range(num_draws)]
    ids = sample(logits, rows).sampled_ids.numpy()
    return np.bincount(ids, minlength=len(logits_row))


def chi_square(counts: np.ndarray, expected_probs: list[float]) -> float:
    total = counts.sum()
    return sum(
        (c - total * p) ** 2 / (total * p) for c, p in zip(counts, expected_probs, strict=True) if p > 0
    )


# Distinct, well separated probabilities, so top-p / min-p boundaries are unambiguous.
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]
LOGITS = [math.log(p) + 1.5 for p in PROBS]
NUM_DRAWS = 20_000
# Chi-square 99.99% quantiles for 1..6 degrees of freedom: a failure is a bug, not bad luck.
CHI2_LIMIT = {1: 15.2, 2: 18.5, 3: 21.2, 4: 23.6, 5: 25.8, 6: 27.9}


def test_greedy_is_argmax_of_logits():
    torch.manual_seed(0)
    logits = torch.randn(9, 1000)
    out = sample(logits, [{"seed": i, "position": 3 * i} for i in range(9)])
    assert torch.equal(out.sampled_ids, logits.argmax(dim=-1).int())
    assert out.sampled_ids.dtype == torch.int32


def test_seeded_sample_is_independent_of_batch_order_and_split():
    torch.manual_seed(1)
    vocab_size = 4096
    target = {
        "temperature": 0.9,
        "top_k": 200,
        "top_p": 0.95,
        "min_p": 0.01,
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.3,
        "seed": 1234,
        "position": 57,
        "prompt": [5, 6, 7],
        "output": [7, 9],
        "bias": {11: 1.5},
    }
    target_logits = torch.randn(vocab_size) * 3
    alone = [
        sample(target_logits[None], [{**target, "position": p}]).sampled_ids.item() for p in range(57, 65)
    ]

    rng = np.random.default_rng(0)
    for slot in (0, 7, 15):
        rows: list[dict[str, Any]] = []
        for i in range(16):
            rows.append(
                {
                    "temperature": float(rng.uniform(0, 1.5)),
                    "top_k": int(rng.integers(0, 50)),
                    "top_p": float(rng.uniform(0.5, 1.0)),
                    "seed": int(rng.integers(0, 2**63)),
                    "position": int(rng.integers(0, 4000)),
                    "presence_penalty": float(rng.uniform(-1, 1)),
                    "output": rng.integers(0, vocab_size, 5).tolist(),
                    "num_logprobs": int(rng.integers(0, 5)),
                }
                if i != slot
                else target
            )
        logits = torch.randn(16, vocab_size) * 3
        logits[slot] = target_logits
        together = sample(logits, rows).sampled_ids
        assert together[slot].item() == alone[0]
        # The rows in a shuffled order, and split into separate calls: every row samples the same.
        order = rng.permutation(16).tolist()
        assert torch.equal(sample(logits, rows, order).sampled_ids, together[order])
        split = [sample(logits, rows, order[i : i + 5]).sampled_ids for i in range(0, 16, 5)]
        assert torch.equal(torch.cat(split), together[order])
        # And again (a recompute after a fault): the same tokens.
        assert torch.equal(sample(logits, rows).sampled_ids, together)

    # Different positions draw different noise: the 8 positions do not all sample the same token.
    assert len(set(alone)) > 1


def test_different_positions_and_seeds_give_different_noise():
    col_keys = vocab_col_keys(10_000, "cpu")
    u = hash_uniform(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), col_keys)
    assert (u[0] == u[1]).float().mean() < 0.01
    assert (u[0] == u[2]).float().mean() < 0.01
    # Uncorrelated streams, not shifted copies of each other.
    assert abs(torch.corrcoef(u[:2])[0, 1]) < 0.05
    assert torch.equal(hash_uniform(torch.tensor([5]), torch.tensor([1]), col_keys)[0], u[1])


def reference_uniform(seed: int, position: int, v: int) -> float:
    """The hash in plain Python, on explicit unsigned integers: splitmix64 row key, lowbias32."""

    def splitmix64(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    key = splitmix64(splitmix64((seed * GOLDEN + GOLDEN) & MASK64) ^ position)
    h = ((v + 1) * 0x9E3779B9 + key) & MASK32
    h = ((h ^ (h >> 16)) * 0x7FEB352D) & MASK32
    h ^= key >> 32
    h = ((h ^ (h >> 15)) * 0x846CA68B) & MASK32
    h ^= h >> 16
    return ((h >> 9) + 0.5) / 2**23


def test_hash_matches_unsigned_64_bit_reference_and_is_uniform():
    seeds = [0, 1, 2**63 - 1, 987654321987654321]
    positions = [0, 5, 2**31 - 1, 4096]
    u = hash_uniform(torch.tensor(seeds), torch.tensor(positions), vocab_col_keys(70_000, "cpu"))
    for i, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        for v in (0, 1, 12345, 69_999):
            assert u[i, v].item() == reference_uniform(seed, position, v)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.002
    assert abs(u.var().item() - 1 / 12) < 0.001
    # Every eighth of (0, 1) gets its share.
    shares = torch.histc(u, bins=8, min=0, max=1) / u.numel()
    assert torch.all((shares - 1 / 8).abs() < 0.003)


def test_temperature_sampling_matches_softmax():
    for temperature in (1.0, 0.6):
        counts = draw_counts(LOGITS, NUM_DRAWS, temperature=temperature)
        expected = reference_distribution(LOGITS, temperature)
        assert chi_square(counts, expected) < CHI2_LIMIT[6], (counts, expected)


@pytest.mark.parametrize(
    ("params", "num_kept"),
    [
        ({"top_k": 3}, 3),
        ({"top_p": 0.75}, 3),  # 0.4 + 0.25 < 0.75 <= 0.4 + 0.25 + 0.15
        ({"top_p": 0.3}, 1),  # the top token alone already holds the mass
        ({"top_k": 3, "top_p": 0.8}, 2),  # top-p on the top-k survivors, renormalised
        ({"min_p": 0.2}, 4),  # drops p < 0.2 * 0.4 = 0.08
        ({"top_k": 6, "top_p": 0.95, "min_p": 0.1}, 5),
    ],
)
def test_filters_keep_exactly_their_set_and_renormalise(params: dict[str, Any], num_kept: int):
    counts = draw_counts(LOGITS, NUM_DRAWS, temperature=1.0, **params)
    expected = reference_distribution(LOGITS, 1.0, **params)
    kept = [v for v, p in enumerate(expected) if p > 0]
    assert kept == list(range(num_kept))
    assert counts[num_kept:].sum() == 0, counts
    assert np.all(counts[:num_kept] > 0)
    if num_kept > 1:
        assert chi_square(counts, expected) < CHI2_LIMIT[num_kept - 1], (counts, expected)


def test_top_k_on_large_vocab_never_leaves_the_k_most_likely():
    torch.manual_seed(2)
    logits = torch.randn(1, 2000) * 2
    rows = [{"temperature": 1.5, "top_k": 10, "seed": 3, "position": p} for p in range(1000)]
    ids = sample(logits.expand(1000, -1).contiguous(), rows).sampled_ids
    top10 = set(torch.topk(logits[0], 10).indices.tolist())
    assert set(ids.tolist()) <= top10
    assert len(set(ids.tolist())) == 10


def reference_penalised(logits: list[float], row: dict[str, Any]) -> list[float]:
    """Bias, then HF repetition penalty over prompt + output, then OpenAI presence / frequency."""
    row = {**DEFAULTS, **row}
    out = list(logits)
    for token, value in row["bias"].items():
        out[token] += value
    for token in set(row["prompt"]) | set(row["output"]):
        penalty = row["repetition_penalty"]
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    for token in set(row["output"]):
        count = row["output"].count(token)
        out[token] -= row["presence_penalty"] + row["frequency_penalty"] * count
    return out


PENALTY_ROWS: list[dict[str, Any]] = [
    {"repetition_penalty": 1.3, "prompt": [1, 2, 3], "output": [3, 4, 4]},
    {},  # no penalties: untouched, even next to rows that have them
    {"presence_penalty": 0.5, "frequency_penalty": 0.3, "prompt": [0, 5], "output": [5, 6, 6, 6]},
    {"bias": {3: 2.0, 7: float("-inf"), 0: -1.5}},
    {
        "repetition_penalty": 0.8,
        "presence_penalty": -0.4,
        "frequency_penalty": 1.1,
        "bias": {2: 0.7},
        "prompt": [2, 2, 8],
        "output": [8, 9, 2, 9],
    },
    {"presence_penalty": 1.0, "prompt": [4, 4, 4], "output": []},  # prompt tokens are not output
]


def test_penalties_and_bias_match_reference():
    torch.manual_seed(3)
    logits = torch.randn(len(PENALTY_ROWS), 12) * 2
    order = [4, 0, 3, 5, 2, 1]  # rows out of plan order: local rows != plan rows
    got = Sampler(12, "cpu").apply_bias_and_penalties(logits[order], make_plan(PENALTY_ROWS), np.array(order))
    for i, r in enumerate(order):
        expected = reference_penalised(logits[r].tolist(), PENALTY_ROWS[r])
        assert torch.allclose(got[i], torch.tensor(expected), atol=1e-5), (r, got[i], expected)
    # Greedy sampling follows the penalised logits; logprobs stay those of the raw logits.
    out = sample(logits, PENALTY_ROWS, order)
    assert torch.equal(out.sampled_ids, got.argmax(dim=-1).int())
    raw = torch.log_softmax(logits[order], dim=-1)
    assert torch.allclose(out.sampled_logprobs, raw.gather(1, out.sampled_ids.long()[:, None])[:, 0])


def test_bias_minus_inf_is_never_sampled():
    logits = torch.tensor([LOGITS]).expand(3000, -1).contiguous()
    rows = [{"temperature": 2.0, "seed": 1, "position": p, "bias": {0: float("-inf")}} for p in range(3000)]
    counts = np.bincount(sample(logits, rows).sampled_ids.numpy(), minlength=len(LOGITS))
    assert counts[0] == 0 and np.all(counts[1:] > 0)


def test_out_of_vocab_history_fails_the_step():
    with pytest.raises(ValueError, match="vocabulary"):
        sample(torch.zeros(1, 12), [{"repetition_penalty": 1.2, "prompt": [3, 12]}])


def test_logprobs_are_raw_log_softmax_with_k_shapes():
    torch.manual_seed(4)
    logits = torch.randn(6, 300) * 3
    rows = [
        {
            "temperature": 0.7,
            "seed": 9,
            "position": 10,
            "num_logprobs": 3,
            "frequency_penalty": 1.0,
            "output": [1],
        },
        {"num_logprobs": 0},
        {"temperature": 1.3, "top_k": 5, "seed": 2, "position": 1, "num_logprobs": 5},
        {"temperature": 0.5, "top_p": 0.5, "seed": 2, "position": 2},
        {"repetition_penalty": 2.0, "prompt": [0, 1, 2], "num_logprobs": 1},
        {"temperature": 0.8, "seed": 1, "bias": {7: 100.0}, "num_logprobs": 2},
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.sampled_ids[5].item() == 7  # the bias decides the token, not its logprob
    assert out.top_ids.shape == (6, 5) and out.top_logprobs.shape == (6, 5)
    assert out.top_ids.dtype == torch.int32 and out.top_logprobs.dtype == torch.float32
    expected_top = torch.topk(raw, 5, dim=-1)
    assert torch.equal(out.top_ids, expected_top.indices.int())
    assert torch.allclose(out.top_logprobs, expected_top.values, atol=1e-5)
    assert torch.allclose(
        out.sampled_logprobs, raw.gather(1, out.sampled_ids.long()[:, None])[:, 0], atol=1e-5
    )

    # K = max(num_logprobs) of the sampled rows only; 0 gives [S, 0].
    out = sample(logits, rows, [1, 3])
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    arrays = out.numpy()
    assert arrays["top_ids"].shape == (2, 0) and arrays["sampled_ids"].dtype == np.int32


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(5)
    logits = torch.randn(6, 2000)
    greedy_temperatures = [0.0, 1e-40, 0.0]  # a vanishing temperature is greedy, not inf / NaN
    rows = [
        {"temperature": greedy_temperatures[i // 2] if i % 2 else 1.0, "seed": 40 + i, "position": i}
        for i in range(6)
    ]
    out = sample(logits, rows).sampled_ids
    for i in range(6):
        assert out[i].item() == sample(logits[i : i + 1], [rows[i]]).sampled_ids.item()
    assert torch.equal(out[1::2], logits[1::2].argmax(dim=-1).int())


def test_sampling_leaves_the_callers_logits_alone():
    logits = torch.randn(2, 50)
    before = logits.clone()
    sample(
        logits,
        [
            {"temperature": 0.5, "top_k": 3, "seed": 1, "bias": {1: 5.0}},
            {"repetition_penalty": 2.0, "prompt": [1]},
        ],
    )
    assert torch.equal(logits, before)


def test_top_p_nucleus_beyond_the_candidates_falls_back_to_a_full_sort():
    vocab_size = 3000
    flat = [-0.0002 * v for v in range(vocab_size)]  # nearly uniform: the nucleus is ~1700 wide
    expected = reference_distribution(flat, 1.0, top_p=0.6)
    nucleus_size = sum(p > 0 for p in expected)
    assert nucleus_size > TOP_P_CANDIDATES
    draws = 3000
    peaked = torch.tensor(LOGITS + [-30.0] * (vocab_size - len(LOGITS)))
    logits = torch.cat([torch.tensor([flat]).expand(draws, -1), peaked[None]])
    rows = [{"temperature": 1.0, "top_p": 0.6, "seed": 11, "position": p} for p in range(draws)]
    rows.append({"temperature": 1.0, "top_p": 0.75, "top_k": 40, "seed": 11, "position": 0})
    ids = sample(logits, rows).sampled_ids
    assert ids[:draws].max() < nucleus_size
    assert (ids[:draws] >= TOP_P_CANDIDATES).sum() > 0  # the tail past the candidates is reachable
    assert ids[draws] < 3
    # The same rows alone (no fallback needed for the peaked one, a full sort for a flat one).
    assert sample(logits[draws:], rows[draws:]).sampled_ids.item() == ids[draws]
    assert sample(logits[5:6], rows[5:6]).sampled_ids.item() == ids[5]


def grammar_arrays(plan_rows: list[int], allowed: list[list[int]], vocab_size: int) -> dict[str, np.ndarray]:
    bits = np.zeros((len(allowed), -(-vocab_size // 32) * 32), np.uint8)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = 1
    return {
        "grammar_rows": np.array(plan_rows, np.int32),
        "grammar_bitmask": np.packbits(bits, axis=1, bitorder="little").view(np.int32),
    }


def test_grammar_bitmask_is_applied_per_row_and_stays_batch_invariant():
    """A constrained row samples among its allowed tokens only, with raw logprobs; seeded, it
    samples the same token alone and in a batch in any order, with its bitmask row following it."""
    vocab = 100
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    rows = [
        {"temperature": 1.0, "seed": 5, "position": 9},
        {"temperature": 0.0},
        {"temperature": 0.7, "seed": 2},
    ]
    allowed = [[1, 2, 3, 40], [7, 8]]
    plan = {**make_plan(rows), **grammar_arrays([0, 2], allowed, vocab)}
    sampler = Sampler(vocab, "cpu")
    batch = sampler.sample(logits.clone(), plan, np.arange(3))
    ids = batch.sampled_ids.tolist()
    assert ids[0] in allowed[0] and ids[2] in allowed[1]
    assert ids[1] == int(logits[1].argmax())  # unconstrained: untouched
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(3), torch.tensor(ids)]
    torch.testing.assert_close(batch.sampled_logprobs, expected)
    for order in ([2, 0], [0], [2]):
        local = [i for i, r in enumerate(order) if r in (0, 2)]
        sub = {**make_plan(rows), **grammar_arrays(order, [allowed[(0, None, 1)[r]] for r in order], vocab)}
        sub_ids = sampler.sample(logits[order].clone(), sub, np.array(order)).sampled_ids.tolist()
        assert [sub_ids[i] for i in local] == [ids[order[i]] for i in local], order
