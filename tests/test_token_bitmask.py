"""The token bitmask: kernels/token_bitmask.py (Triton under the interpreter, and its torch reference)
and the worker's apply step (services/gpu_worker/grammar_mask.py), each against a plain boolean mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton
from services.gpu_worker.grammar_mask import apply_grammar_bitmask, check_grammar_bitmask


def pack(allowed: np.ndarray) -> np.ndarray:
    """Boolean [R, V] -> packed int32 [R, ceil(V/32)], bit t % 32 of word t // 32 (numpy's own packing)."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = np.zeros((rows, words * 32), dtype=bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<i4").reshape(rows, words).copy()


def expected(logits: torch.Tensor, allowed: np.ndarray, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        out[row, torch.from_numpy(~allowed[i])] = float("-inf")
    return out


def case(num_logit_rows: int, rows: list[int], vocab: int, dtype: torch.dtype, seed: int):
    rng = np.random.default_rng(seed)
    allowed = rng.random((len(rows), vocab)) < rng.uniform(0.01, 0.9, size=(len(rows), 1))
    allowed[:, -1] = True  # the last bit of the last word (and bit 31 of full words: negative int32s)
    allowed[:, rng.integers(vocab)] = False
    logits = torch.from_numpy(rng.standard_normal((num_logit_rows, vocab)).astype(np.float32)).to(dtype)
    return logits, allowed, pack(allowed)


@pytest.mark.parametrize(
    "apply", [apply_token_bitmask_ref, apply_token_bitmask_triton], ids=["ref", "triton"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_logit_rows", "rows", "vocab"),
    [(1, [0], 32), (3, [2, 0], 100), (6, [1, 4, 5], 4096 + 33), (2, [1], 49152)],
)
def test_bitmask_matches_a_boolean_mask(apply, dtype, num_logit_rows, rows, vocab):
    logits, allowed, bitmask = case(num_logit_rows, rows, vocab, dtype, seed=vocab + len(rows))
    want = expected(logits, allowed, rows)
    apply(logits, torch.from_numpy(bitmask), torch.tensor(rows, dtype=torch.int32))
    # Bit-exact: allowed tokens and unconstrained rows keep their values, the rest is -inf.
    assert torch.equal(logits, want)
    untouched = [r for r in range(num_logit_rows) if r not in rows]
    assert not torch.isinf(logits[untouched]).any()


def test_pack_is_the_matchers_layout():
    allowed = np.zeros((1, 70), dtype=bool)
    allowed[0, [0, 31, 33, 69]] = True
    assert pack(allowed).tolist() == [[1 | (1 << 31) - (1 << 32), 1 << 1, 1 << 5]]


@pytest.mark.parametrize(
    "apply", [apply_token_bitmask_ref, apply_token_bitmask_triton], ids=["ref", "triton"]
)
def test_no_rows_is_a_no_op(apply):
    logits = torch.randn(3, 64)
    before = logits.clone()
    apply(logits, torch.zeros((0, 2), dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("layout", ["float32", "bfloat16", "float32 strided"])
@pytest.mark.parametrize("vocab", [300, 49152])
def test_worker_apply_step(layout, vocab):
    """Float32 takes the bit path; other dtypes and strided scores take the torch reference."""
    dtype = torch.bfloat16 if layout == "bfloat16" else torch.float32
    logits, allowed, bitmask = case(5, [3, 1], vocab, dtype, seed=7)
    want = expected(logits, allowed, [3, 1])
    if layout.endswith("strided"):
        logits = logits.t().contiguous().t()
        assert not logits.is_contiguous()
    apply_grammar_bitmask(logits, bitmask, np.array([3, 1], dtype=np.int32))
    assert torch.equal(logits, want)


def test_worker_apply_step_without_a_bitmask_does_nothing():
    logits = torch.randn(4, 300)
    before = logits.clone()
    apply_grammar_bitmask(logits, None, None)
    apply_grammar_bitmask(logits, np.zeros((0, 10), dtype=np.int32), np.zeros(0, dtype=np.int32))
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    ("bitmask", "rows", "message"),
    [
        (np.zeros((1, 9), dtype=np.int32), [0], r"int32 \[C, 10\]"),
        (np.zeros((1, 10), dtype=np.int64), [0], "int32"),
        (np.zeros((2, 10), dtype=np.int32), [0], "does not match"),
        (np.zeros((1, 10), dtype=np.int32), [4], "below 4"),
        (np.zeros((1, 10), dtype=np.int32), [-1], "below 4"),
        (np.zeros((2, 10), dtype=np.int32), [1, 1], "distinct"),
    ],
)
def test_a_bad_bitmask_is_refused(bitmask, rows, message):
    with pytest.raises(ValueError, match=message):
        check_grammar_bitmask(bitmask, np.array(rows, dtype=np.int32), num_rows=4, vocab_size=300)
    logits = torch.randn(4, 300)
    before = logits.clone()
    with pytest.raises(ValueError, match=message):
        apply_grammar_bitmask(logits, bitmask, np.array(rows, dtype=np.int32))
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="without grammar_rows"):
        apply_grammar_bitmask(logits, np.zeros((1, 10), dtype=np.int32), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_worker_apply_step_on_cuda():
    logits, allowed, bitmask = case(8, [0, 5, 7], 49152, torch.bfloat16, seed=3)
    want = expected(logits, allowed, [0, 5, 7])
    cuda = logits.cuda()
    apply_grammar_bitmask(cuda, bitmask, np.array([0, 5, 7], dtype=np.int32))
    assert torch.equal(cuda.cpu(), want)
