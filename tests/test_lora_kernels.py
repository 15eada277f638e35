"""The batched LoRA kernels (kernels/lora.py's contract): the torch reference, the Triton kernels
(in the interpreter) and the CPU's C++ op, each against an independent float64 loop over the rows,
on steps that mix slots, rows of none (-1), ranks below the padded max_rank, modules a slot does not
target (rank 0), and a merged projection's modules side by side; and the C++ op's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_ops
from kernels.lora import BLOCK_M, group_rows, lora_add_ref, lora_add_triton
from tests.test_kernels import PagedKV, has_cpu_kernels

NUM_SLOTS = 4
# (number of tokens, in features, each module's width, max_rank): a decode step of one row, a
# few-rows decode, a prefill longer than a tile (BLOCK_M) and a 16-row task, odd widths (masked
# columns, scalar tails) and a max_rank that is not a power of two.
SHAPES = [
    (1, 48, (48, 16, 16), 16),
    (4, 40, (40,), 8),
    (37, 64, (72, 72), 12),
    (70, 33, (20, 9, 9), 64),
]


def random_step(num_tokens: int, in_features: int, widths: tuple[int, ...], max_rank: int, seed: int):
    """x, a, b, ranks and each token's slot of a step whose slots have ranks up to max_rank, one
    module per slot left untargeted (rank 0), and a quarter of the tokens without a slot."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    # On the CPU by name: the GPU check runs the Triton test with CUDA as the default device.
    x = torch.randn(num_tokens, in_features, generator=generator, device="cpu")
    ranks = torch.from_numpy(rng.integers(1, max_rank + 1, (len(widths), NUM_SLOTS))).long()
    ranks[:, 0] = max_rank  # one slot at the full (padded) rank
    ranks[rng.integers(len(widths)), 1] = 0
    a, b = [], []
    for module, width in enumerate(widths):
        a_m = torch.randn(NUM_SLOTS, max_rank, in_features, generator=generator, device="cpu") * 0.3
        b_m = torch.randn(NUM_SLOTS, max_rank, width, generator=generator, device="cpu") * 0.3
        for slot in range(NUM_SLOTS):  # zero past the rank, as LoraSlots keeps them
            a_m[slot, ranks[module, slot] :] = 0
            b_m[slot, ranks[module, slot] :] = 0
        a.append(a_m)
        b.append(b_m)
    token_slots = rng.integers(0, NUM_SLOTS, num_tokens).astype(np.int32)
    token_slots[rng.random(num_tokens) < 0.25] = -1
    token_slots[0] = 0 if num_tokens == 1 else -1  # a decode row of the full rank, else a row of none
    return x, a, b, ranks, token_slots


def expected_out(out, x, a, b, ranks, token_slots) -> torch.Tensor:
    """out plus each token's deltas, row by row in float64: independent of any grouping."""
    result = out.double().clone()
    column = 0
    for module, (a_m, b_m) in enumerate(zip(a, b, strict=True)):
        width = b_m.shape[2]
        for token, slot in enumerate(token_slots.tolist()):
            if slot >= 0 and ranks[module, slot] > 0:
                h = a_m[slot].double() @ x[token].double()
                result[token, column : column + width] += h @ b_m[slot].double()
        column += width
    return result.float()


def run(kernel, x, a, b, ranks, token_slots, tile_rows=None) -> torch.Tensor:
    rows, segments = group_rows(token_slots, tile_rows)
    width = sum(b_m.shape[2] for b_m in b)
    out = torch.randn(x.shape[0], width, generator=torch.Generator().manual_seed(9), device="cpu")
    before = out.clone()
    kernel(out, x, a, b, ranks, torch.from_numpy(rows), torch.from_numpy(segments))
    expected = expected_out(before, x, a, b, ranks, token_slots)
    assert (expected - before).abs().max() > 0.1  # the deltas are not negligible
    return out, expected


def test_group_rows_groups_tokens_by_slot():
    token_slots = np.array([2, -1, 0, 2, 2, -1, 0, 3], dtype=np.int32)
    rows, segments = group_rows(token_slots)
    assert rows.tolist() == [2, 6, 0, 3, 4, 7]
    assert segments.tolist() == [[0, 0, 2], [2, 2, 5], [3, 5, 6]]
    rows, segments = group_rows(token_slots, tile_rows=2)
    assert segments.tolist() == [[0, 0, 2], [2, 2, 4], [2, 4, 5], [3, 5, 6]]
    rows, segments = group_rows(np.full(3, -1, dtype=np.int32))
    assert rows.shape == (0,) and segments.shape == (0, 3)


@pytest.mark.parametrize(("num_tokens", "in_features", "widths", "max_rank"), SHAPES)
def test_lora_add_ref_matches_rows_one_by_one(num_tokens, in_features, widths, max_rank):
    out, expected = run(
        lora_add_ref, *random_step(num_tokens, in_features, widths, max_rank, seed=num_tokens)
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("num_tokens", "in_features", "widths", "max_rank"), SHAPES)
def test_lora_add_triton_matches_rows_one_by_one(num_tokens, in_features, widths, max_rank):
    step = random_step(num_tokens, in_features, widths, max_rank, seed=num_tokens)
    out, expected = run(lora_add_triton, *step, tile_rows=BLOCK_M)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_lora_add_triton_skips_a_graphs_empty_tiles_and_stale_rows():
    """A CUDA graph's arguments (cuda_graphs.py): `rows` as long as the padded step, stale past
    the step's rows, and the step's tiles followed by empty ones (slot 0, of the full rank) up to
    the grid the graph was captured with: only the step's rows get deltas."""
    x, a, b, ranks, token_slots = random_step(37, 64, (72, 72), 12, seed=37)
    rows, segments = group_rows(token_slots, BLOCK_M)
    padded_rows = np.full(40, 3, np.int64)  # a stale row that has a slot: it must not be added again
    padded_rows[: len(rows)] = rows
    padded_segments = np.concatenate([segments, np.zeros((5, 3), np.int64)])
    width = sum(b_m.shape[2] for b_m in b)
    out = torch.randn(x.shape[0], width, generator=torch.Generator().manual_seed(9), device="cpu")
    expected = expected_out(out, x, a, b, ranks, token_slots)
    lora_add_triton(out, x, a, b, ranks, torch.from_numpy(padded_rows), torch.from_numpy(padded_segments))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("num_tokens", "in_features", "widths", "max_rank"), SHAPES)
@pytest.mark.usefixtures("cpu_isa")
def test_lora_add_cpu_matches_rows_one_by_one(num_tokens, in_features, widths, max_rank):
    assert has_cpu_kernels()
    out, expected = run(
        cpu_ops.lora_add, *random_step(num_tokens, in_features, widths, max_rank, seed=num_tokens)
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def bfloat16_and_float32(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors rounded to bfloat16, and the same values held in float32."""
    rounded = [t.bfloat16() for t in tensors]
    return rounded, [t.float() for t in rounded]


@pytest.mark.parametrize(("num_tokens", "in_features", "widths", "max_rank"), SHAPES)
@pytest.mark.usefixtures("cpu_isa")
def test_lora_add_cpu_bfloat16_adapters_are_the_float32_values(num_tokens, in_features, widths, max_rank):
    """A and B kept in bfloat16 (lora.dtype) are widened exactly: the same bits as float32 A and B
    holding the same values, which match the float64 loop; the torch reference agrees."""
    assert has_cpu_kernels()
    x, a, b, ranks, token_slots = random_step(num_tokens, in_features, widths, max_rank, seed=num_tokens)
    (a16, a32), (b16, b32) = bfloat16_and_float32(a), bfloat16_and_float32(b)
    out16, expected = run(cpu_ops.lora_add, x, a16, b16, ranks, token_slots)
    out32, _ = run(cpu_ops.lora_add, x, a32, b32, ranks, token_slots)
    assert torch.equal(out16, out32)
    torch.testing.assert_close(out16, expected, atol=1e-4, rtol=1e-4)
    reference, _ = run(lora_add_ref, x, a16, b16, ranks, token_slots)
    torch.testing.assert_close(reference, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("cpu_isa")
def test_lora_add_cpu_refuses_what_does_not_fit():
    """Arguments that would read or write out of bounds, or race, are errors naming the problem."""
    assert has_cpu_kernels()
    x, a, b, ranks, token_slots = random_step(6, 16, (16, 8), 8, seed=1)
    rows, segments = (torch.from_numpy(t) for t in group_rows(token_slots))
    out = torch.zeros(6, 24)
    cases = {
        "widths add up to 24, out has 20 columns": dict(out=torch.zeros(6, 20)),
        "row 6 out of range": dict(rows=torch.where(rows == rows[0], 6, rows)),
        "listed twice": dict(rows=torch.full_like(rows, int(rows[0]))),
        "out of range": dict(segments=torch.tensor([[NUM_SLOTS, 0, len(rows)]])),
        "segments overlap": dict(segments=torch.tensor([[0, 0, len(rows)], [1, 0, 1]])),
        "rank 9 outside 0..8": dict(ranks=torch.full_like(ranks, 9)),
        "ranks \\[modules, slots\\] int64": dict(ranks=ranks.int()),
        "must be contiguous \\[slots, max_rank, in\\]": dict(
            a=[a[0].transpose(1, 2).contiguous().transpose(1, 2), a[1]]
        ),
        "must be float32 or bfloat16": dict(a=[t.half() for t in a], b=[t.half() for t in b]),
        "B of module 0 must be contiguous \\[slots, max_rank, width\\] of BFloat16": dict(
            a=[t.bfloat16() for t in a]
        ),
    }
    for message, change in cases.items():
        args = dict(out=out, x=x, a=a, b=b, ranks=ranks, rows=rows, segments=segments) | change
        with pytest.raises(RuntimeError, match=message):
            cpu_ops.lora_add(**args)


def decode_layers_with_lora(num_layers: int = 2, seed: int = 3):
    """A call of few_rows_decode_layers (two layers, three sequences) whose rows take adapter
    deltas: the first two rows slots 1 and 0, the third none; every module of every layer at a
    rank below the padded max_rank of 8. Returns run(ranks, caches, a, b) -> (outputs, the K and V
    caches, fresh copies unless given), the ranks, fresh copies of the caches and (A, B)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, heads, kv_heads, head_dim, inter = 32, 2, 1, 16, 24
    widths_in = [hidden] * 3 + [heads * head_dim] + [hidden] * 2 + [inter]
    widths_out = [heads * head_dim, head_dim, head_dim, hidden, inter, inter, hidden]
    norms, weights = [], []
    for _ in range(num_layers):
        norms += [torch.rand(hidden, generator=generator) + 0.5 for _ in range(2)]
        qkv, o, gate_up, down = (heads + 2 * kv_heads) * head_dim, heads * head_dim, 2 * inter, inter
        for shape in ((qkv, hidden), (hidden, o), (gate_up, hidden), (hidden, down)):
            weights.append(torch.randn(*shape, generator=generator) * 0.2)
    layers = cpu_ops.DecodeLayers(
        norms, weights, [""] * len(weights), [1] * len(weights), [None] * num_layers
    )
    a = [torch.randn(num_layers, NUM_SLOTS, 8, n, generator=generator) * 0.3 for n in widths_in]
    b = [torch.randn(num_layers, NUM_SLOTS, 8, n, generator=generator) * 0.3 for n in widths_out]
    ranks = torch.randint(1, 8, (num_layers, 7, NUM_SLOTS), generator=generator)
    rows, segments = (torch.from_numpy(t) for t in group_rows(np.array([1, 0, -1], dtype=np.int32)))
    kv = PagedKV([5, 19, 33], kv_heads, head_dim, 16, torch.float32)
    lens = kv.seq_lens.long()
    slots = torch.tensor(
        [int(kv.block_tables[s, (n - 1) // 16]) * 16 + (n - 1) % 16 for s, n in enumerate(lens)]
    )
    x = torch.randn(3, hidden, generator=generator)
    cos, sin = torch.rand(3, head_dim, generator=generator), torch.rand(3, head_dim, generator=generator)

    def fresh_caches():
        return [kv.k_cache.clone() for _ in range(num_layers)], [
            kv.v_cache.clone() for _ in range(num_layers)
        ]

    def run(ranks=ranks, caches=None, a=a, b=b):
        caches = caches or fresh_caches()
        out = cpu_ops.few_rows_decode_layers(
            x, layers, 1e-5, cos, sin, caches, slots, kv.block_tables.long(), lens, heads, 0.25,
            lora=(a, b, ranks, rows, segments),
        )  # fmt: skip
        return torch.cat(out), caches

    return run, ranks, fresh_caches, (a, b)


@pytest.mark.usefixtures("cpu_isa")
def test_decode_layers_lora_deltas_do_not_depend_on_the_thread_count():
    """The one-op decode step shares each projection's adapter deltas among its threads (the
    shrink by rank rows, the expand by the base weight's columns): one, two and three threads (some
    with empty shares) give the same bits, and the deltas change the output. (Their values against
    PEFT's: tests/test_lora.py, test_each_lora_kernel_matches_peft.)"""
    assert has_cpu_kernels()
    run, ranks, _, _ = decode_layers_with_lora()
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(run())
    finally:
        torch.set_num_threads(threads)
    (alone, caches_alone), *others = results
    for shared, caches_shared in others:
        assert torch.equal(alone, shared)
        assert all(
            torch.equal(p, q)
            for p, q in zip(
                caches_alone[0] + caches_alone[1], caches_shared[0] + caches_shared[1], strict=True
            )
        )
    without, _ = run(torch.zeros_like(ranks))  # rank 0 everywhere: no deltas
    assert (alone[:2] - without[:2]).abs().max() > 1e-2  # rows 0, 1 have adapters (and the stream)
    assert torch.equal(alone[2], without[2]) and torch.equal(alone[5], without[5])  # row 2 has none


@pytest.mark.usefixtures("cpu_isa")
def test_decode_layers_bfloat16_adapters_are_the_float32_values():
    """The one-op decode step with every layer's A and B in bfloat16: the same bits, outputs and KV
    caches, as with float32 A and B holding the same values."""
    assert has_cpu_kernels()
    run, ranks, _, (a, b) = decode_layers_with_lora()
    (a16, a32), (b16, b32) = bfloat16_and_float32(a), bfloat16_and_float32(b)
    out16, caches16 = run(ranks, a=a16, b=b16)
    out32, caches32 = run(ranks, a=a32, b=b32)
    assert torch.equal(out16, out32)
    assert all(
        torch.equal(p, q) for p, q in zip(caches16[0] + caches16[1], caches32[0] + caches32[1], strict=True)
    )
    without, _ = run(torch.zeros_like(ranks))
    assert (out16[:2] - without[:2]).abs().max() > 1e-2


@pytest.mark.usefixtures("cpu_isa")
def test_decode_layers_refuse_bad_lora_arguments_before_writing():
    """The one-op decode step checks every layer's adapters before its parallel region: a rank
    past max_rank is an error naming it, with nothing written to the KV caches."""
    assert has_cpu_kernels()
    run, ranks, fresh_caches, (a, b) = decode_layers_with_lora()
    bad = ranks.clone()
    bad[1, 6, 0] = 9  # the last layer's down_proj, slot 0
    caches, before = fresh_caches(), fresh_caches()
    with pytest.raises(RuntimeError, match=r"rank 9 outside 0\.\.8"):
        run(bad, caches)
    assert all(torch.equal(p, q) for p, q in zip(caches[0] + caches[1], before[0] + before[1], strict=True))
    # One padded max_rank for every module: the step's shrink buffer is sized by the first.
    wide_o = list(a), list(b)
    for matrices in wide_o:
        matrices[3] = torch.zeros(*matrices[3].shape[:2], 12, matrices[3].shape[3])  # o_proj at max_rank 12
    with pytest.raises(RuntimeError, match="every LoRA A and B needs the first A's 4 slots and max_rank 8"):
        run(ranks, caches, *wide_o)
    # Each module's A and B hold every layer's: a list of one a layer is refused.
    per_layer = [t[layer] for layer in range(2) for t in a], [t[layer] for layer in range(2) for t in b]
    with pytest.raises(RuntimeError, match="A and B of seven modules \\(each every layer's\\)"):
        run(ranks, caches, *per_layer)
    with pytest.raises(
        RuntimeError, match="A of module 2 must be contiguous \\[layers, slots, max_rank, in\\]"
    ):
        run(ranks, caches, [t if m != 2 else t[:1] for m, t in enumerate(a)], b)
    assert all(torch.equal(p, q) for p, q in zip(caches[0] + caches[1], before[0] + before[1], strict=True))
