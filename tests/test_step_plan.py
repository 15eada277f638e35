"""The declared step plan and step result (ipc/step_plan.py): what a slot must hold, how big a slot
must be, and the refusals (each naming the array) on both sides of the rings."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.codec import RESULT_HEADER, STEP_HEADER
from ipc.config import MAX_ADAPTER_NAME_CHARS, MAX_LORA_SLOTS, Config
from ipc.messages import ResultHeader, StepHeader
from ipc.shm import ShmRing, new_run_id
from ipc.step_plan import (
    MAX_BIAS_ENTRIES_PER_ROW,
    MAX_CONSTRAINED_PROPOSALS,
    STEP_PLAN,
    STEP_RESULT,
    Dim,
    SlotMismatch,
    SlotSpec,
    plan_limits,
    result_limits,
)
from ipc.validation import MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from services.scheduler.lora_residency import MAX_PREFETCHES_PER_STEP
from services.scheduler.pipeline import RingExecutor
from supervision.run import result_slot_bytes, step_slot_bytes

SIZES = {Dim.TOKENS: 5, Dim.ROWS: 2}


def plan(**arrays: np.ndarray) -> dict[str, np.ndarray]:
    """A two-row, five-token plan: one prefill of 4 tokens, one decode."""
    tables = np.array([[3, 0], [5, 6]])
    return STEP_PLAN.neutral(
        SIZES,
        **{
            "input_ids": np.arange(5),
            "positions": np.array([0, 1, 2, 3, 17]),
            "query_start_loc": np.array([0, 4, 5]),
            "seq_lens": np.array([4, 18]),
            "block_tables": tables,
            "rows": np.array([0, 1]),
            **arrays,
        },
    )


def test_neutral_plan_matches_the_declaration():
    arrays = plan()
    assert list(arrays) == list(STEP_PLAN.required)  # declared order; no optional array
    sizes = STEP_PLAN.check(arrays, SIZES)
    assert sizes[Dim.BLOCKS] == 2 and sizes[Dim.HISTORY] == 0 and sizes[Dim.BIAS] == 0
    assert arrays["top_p"].tolist() == [1.0, 1.0] and arrays["repetition_penalty"].tolist() == [1.0, 1.0]
    assert arrays["temperature"].tolist() == [0.0, 0.0] and arrays["is_sampled"].tolist() == [1, 1]
    assert arrays["seeds"].dtype == np.int64 and arrays["bias_values"].dtype == np.float32
    with pytest.raises(SlotMismatch, match="unknown arrays"):
        STEP_PLAN.neutral(SIZES, bogus=np.zeros(2))


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("seq_lens", "drop", "'seq_lens' is missing"),
        ("seeds", np.zeros(2, np.int32), "'seeds' is int32, expected int64"),
        ("is_sampled", np.ones(2, np.bool_), "'is_sampled' is bool, expected uint8"),
        ("positions", np.zeros(4, np.int32), r"'positions' has shape \(4,\), expected \(5,\)"),
        (
            "query_start_loc",
            np.array([0, 5], np.int32),
            r"'query_start_loc' has shape \(2,\), expected \(3,\)",
        ),
        ("block_tables", np.zeros(4, np.int32), "'block_tables' has 1 dimensions, expected 2"),
        ("block_tables", np.zeros((3, 2), np.int32), r"'block_tables' has shape \(3, 2\)"),
        ("extra_mask", np.zeros(2, np.int32), "unknown array 'extra_mask'"),
    ],
)
def test_a_plan_that_does_not_match_is_refused_naming_the_array(name, change, message):
    arrays = plan()
    if isinstance(change, str):
        del arrays[name]
    else:
        arrays[name] = change
    with pytest.raises(SlotMismatch, match=message):
        STEP_PLAN.check(arrays, SIZES)


def test_ragged_spans_are_sized_by_their_offsets():
    arrays = plan(
        history_offsets=np.array([0, 3, 3]),
        history_ids=np.array([1, 2, 3]),
        bias_offsets=np.array([0, 0, 2]),
        bias_ids=np.array([7, 8]),
        bias_values=np.array([1.0, -1.0]),
    )
    sizes = STEP_PLAN.check(arrays, SIZES)
    assert (sizes[Dim.HISTORY], sizes[Dim.BIAS]) == (3, 2)
    arrays["bias_values"] = np.zeros(1, np.float32)
    with pytest.raises(SlotMismatch, match=r"'bias_values' has shape \(1,\), expected \(2,\) \(bias\)"):
        STEP_PLAN.check(arrays, SIZES)
    arrays = plan(history_offsets=np.array([0, 3, 4]), history_ids=np.array([1, 2, 3]))
    with pytest.raises(SlotMismatch, match="'history_ids'"):
        STEP_PLAN.check(arrays, SIZES)


def test_the_grammar_arrays_may_be_absent_but_not_wrong():
    """The structured-output arrays: only some steps carry them, with one bitmask row per
    constrained row (measured from grammar_rows), each as wide as the vocabulary in words."""
    sizes = {**SIZES, Dim.VOCAB_WORDS: 4}
    arrays = plan()
    assert "grammar_rows" not in arrays and "grammar_bitmask" not in arrays
    STEP_PLAN.check(arrays, sizes)  # absent: fine
    one = {"grammar_rows": np.array([1], np.int32), "grammar_bitmask": np.zeros((1, 4), np.int32)}
    assert STEP_PLAN.check({**arrays, **one}, sizes)[Dim.CONSTRAINED] == 1
    with pytest.raises(SlotMismatch, match="'grammar_bitmask' has shape"):
        STEP_PLAN.check({**arrays, **one, "grammar_bitmask": np.zeros((1, 3), np.int32)}, sizes)
    with pytest.raises(SlotMismatch, match="'grammar_bitmask' has shape"):
        STEP_PLAN.check({**arrays, **one, "grammar_bitmask": np.zeros((2, 4), np.int32)}, sizes)
    with pytest.raises(SlotMismatch, match="'grammar_rows' is int64"):
        STEP_PLAN.check({**arrays, **one, "grammar_rows": np.array([1])}, sizes)
    assert "grammar_bitmask" not in STEP_PLAN.neutral({**sizes, Dim.BLOCKS: 2})
    limits = plan_limits(4, 16, 64, 16, vocab_size=32000)
    # A row per sequence, and one per proposal a step's constrained rows verify.
    assert limits[Dim.VOCAB_WORDS] == 1000 and limits[Dim.CONSTRAINED] == 4 + MAX_CONSTRAINED_PROPOSALS
    without = SlotSpec(
        "step plan",
        tuple(s for s in STEP_PLAN.arrays if not s.optional),
        STEP_PLAN.measured,
        STEP_PLAN.ragged,
    )
    assert STEP_PLAN.slot_bytes(limits) >= without.slot_bytes(limits) + 4 * 1000 * 4


class DictSlot(dict):
    def put(self, name: str, array: np.ndarray) -> None:
        self[name] = array


def test_write_puts_the_declared_arrays_in_order_and_refuses_the_rest():
    arrays = dict(reversed(plan().items()))
    slot = DictSlot()
    STEP_PLAN.write(slot, arrays)
    assert list(slot) == list(STEP_PLAN.required)
    with pytest.raises(SlotMismatch, match="'rows' is missing"):
        STEP_PLAN.write(DictSlot(), {k: v for k, v in arrays.items() if k != "rows"})
    with pytest.raises(SlotMismatch, match=r"unknown arrays \['mask'\]"):
        STEP_PLAN.write(DictSlot(), {**arrays, "mask": np.zeros(2, np.int32)})


@pytest.fixture
def run_id():
    return new_run_id()


def test_slots_sized_from_the_spec_hold_the_largest_plan_and_result(run_id):
    """The largest plan the engine settings allow (every row with the most history and bias),
    written into a real ring slot of the size the supervisor gives it; the same for a result."""
    config = Config()
    engine = config.engine
    vocab_size = 49152
    limits = plan_limits(
        engine.max_num_seqs,
        engine.max_num_batched_tokens,
        config.model.max_model_len,
        engine.block_size,
        vocab_size,
    )
    assert limits[Dim.BIAS] == engine.max_num_seqs * MAX_BIAS_ENTRIES_PER_ROW
    assert MAX_BIAS_ENTRIES_PER_ROW > MAX_LOGIT_BIAS_ENTRIES + MAX_STOP_TOKEN_IDS
    rows = limits[Dim.ROWS]
    largest = STEP_PLAN.neutral(
        limits,
        history_offsets=np.arange(rows + 1) * config.model.max_model_len,
        bias_offsets=np.arange(rows + 1) * MAX_BIAS_ENTRIES_PER_ROW,
        grammar_rows=np.arange(rows),  # every row constrained
        grammar_bitmask=np.zeros((rows, limits[Dim.VOCAB_WORDS])),
    )
    sizes = {Dim.TOKENS: limits[Dim.TOKENS], Dim.ROWS: rows, Dim.VOCAB_WORDS: limits[Dim.VOCAB_WORDS]}
    STEP_PLAN.check(largest, sizes)
    # The largest header: every LoRA slot named (lora.max_loras and the spare), by the longest
    # names, and copies in ahead.
    names = ["x" * MAX_ADAPTER_NAME_CHARS] * (MAX_LORA_SLOTS + 1)
    ahead = names[:MAX_PREFETCHES_PER_STEP] + [""] * (len(names) - MAX_PREFETCHES_PER_STEP)
    header = STEP_HEADER.encode(StepHeader(2**62, limits[Dim.TOKENS], rows, MAX_LOGPROBS, names, ahead))
    ring = ShmRing.create(f"/brigade-{run_id}-step-0", 1, step_slot_bytes(config, vocab_size), 1)
    try:
        with ring.reserve(1.0) as slot:
            STEP_PLAN.write(slot, largest)
            slot.publish(header)
        with ring.read(0, 1.0) as view:
            STEP_PLAN.check(view.arrays, sizes)
    finally:
        ring.close()
        ring.unlink()

    limits = result_limits(engine.max_num_seqs, engine.max_num_batched_tokens)
    scored = (limits[Dim.SCORED], limits[Dim.PROMPT_TOP_K])
    result = STEP_RESULT.neutral(  # with every prompt token of the step scored, at the most top-N
        limits,
        prompt_logprobs=np.zeros(scored[0]),
        prompt_ranks=np.ones(scored[0]),
        prompt_top_ids=np.zeros(scored),
        prompt_top_logprobs=np.zeros(scored),
    )
    assert result["top_ids"].shape == (engine.max_num_seqs, MAX_LOGPROBS)
    ring = ShmRing.create(f"/brigade-{run_id}-result-0", 1, result_slot_bytes(config), 1)
    try:
        with ring.reserve(1.0) as slot:
            STEP_RESULT.write(slot, result)
            slot.publish(RESULT_HEADER.encode(ResultHeader(2**62, engine.max_num_seqs, "x" * 4096)))
    finally:
        ring.close()
        ring.unlink()


def test_the_scheduler_fails_a_step_whose_result_does_not_match(run_id):
    """A result slot with a wrong array reaches the pipeline as a failed step naming the array."""
    step_ring = ShmRing.create(f"/brigade-{run_id}-step-0", 2, 1 << 16, 1)
    result_ring = ShmRing.create(f"/brigade-{run_id}-result-0", 2, 1 << 16, 1)
    try:
        executor = RingExecutor(step_ring, result_ring, 16, 5.0, lambda: True)
        good = STEP_RESULT.neutral({Dim.ROWS: 3, Dim.TOP_K: 2})
        for arrays in (good, {**good, "sampled_logprobs": np.zeros(3, np.float64)}):
            with result_ring.reserve(1.0) as slot:
                for name, array in arrays.items():
                    slot.put(name, array)
                slot.publish(RESULT_HEADER.encode(ResultHeader(7, 3)))
        with executor.result() as (header, arrays):
            assert header.error == "" and arrays["top_ids"].shape == (3, 2)
        with executor.result() as (header, arrays):
            assert "'sampled_logprobs' is float64, expected float32" in header.error
            assert arrays == {}
    finally:
        for ring in (step_ring, result_ring):
            ring.close()
            ring.unlink()
