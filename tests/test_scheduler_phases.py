"""Each scheduler phase on its own (services/scheduler/{admission,prefill,decode,results}.py) over
a shared SchedulerState, without processes; and the plan table's named columns.

tests/test_scheduler_core.py checks the phases together, through the `Scheduler` facade and the
step pipeline, against an independent reference."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.messages import PLACEHOLDER_TOKEN, SamplingParams
from ipc.sampling_defaults import fill_defaults
from services.scheduler.admission import Admission, Overloaded, PromptTooLong
from services.scheduler.core import Scheduler, SchedulerConfig
from services.scheduler.plan import SCHEDULE_COLUMNS, UPDATE_COLUMNS, IntColumn, PlanTable, build_plan
from services.scheduler.prefill import Prefill
from services.scheduler.request import Request, RequestStatus
from services.scheduler.results import finish_reason
from services.scheduler.state import SchedulerState
from tests.test_scheduler_core import scheduler_config


def engine_params(**fields) -> SamplingParams:
    """SamplingParams as the tokenizer forwards them: unset sampling fields take the engine's defaults."""
    return fill_defaults(SamplingParams(**fields))


EOS = 0


def config(**overrides: object) -> SchedulerConfig:
    values = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 32,
        "block_size": 4,
        "num_blocks": 32,
        "max_model_len": 64,
        "max_num_waiting": 3,
        "eos_token_ids": (EOS,),
    }
    return scheduler_config(**{**values, **overrides})


def request(rid: str, prompt: list[int], **params: object) -> Request:
    params.setdefault("seed", 1)
    params.setdefault("max_tokens", 8)
    return Request(rid, 0, np.array(prompt, np.int32), engine_params(**params))


# -- plan-table columns --------------------------------------------------------------------------


def test_plan_table_columns_are_named_and_grouped_for_one_take_each():
    assert [c.value for c in IntColumn] == list(range(len(IntColumn)))
    names = list(IntColumn)
    assert names[SCHEDULE_COLUMNS] == [IntColumn.NUM_COMPUTED, IntColumn.LENGTH_LIMIT, IntColumn.NUM_TOKENS]
    assert names[UPDATE_COLUMNS] == [IntColumn.NUM_TOKENS, IntColumn.CHECK_FROM, IntColumn.NUM_PROMPT]
    table = PlanTable(num_rows=3, max_blocks_per_seq=2, max_model_len=16)
    assert table.ints.shape == (len(IntColumn), 3)
    for column in IntColumn:
        view = getattr(table, column.name.lower())
        view[1] = 100 + column.value  # each named view is its row of ints, not a copy
        assert table.ints[column, 1] == 100 + column.value, column.name


# -- admission ---------------------------------------------------------------------------------


def test_admission_queues_in_priority_order_and_refuses_overload():
    state = SchedulerState(config(max_num_seqs=1))  # 1 free slot + max_num_waiting=3
    admission = Admission(state)
    for rid, priority in (("a", 1), ("b", 0), ("c", 1), ("x", 2)):
        assert admission.add(request(rid, [1, 2, 3], priority=priority)) is None
    assert [r.request_id for r in state.waiting] == ["b", "a", "c", "x"]
    with pytest.raises(Overloaded, match="max_num_waiting=3"):
        admission.add(request("d", [1]))
    # The refusal goes back to the request it is about: its words do not repeat the engine's
    # id for it (which the client never chose: a user read "request 'cmpl-..#0': ...").
    with pytest.raises(PromptTooLong, match=r"^64 prompt \+ 0 output tokens .* max_model_len=64$"):
        admission.add(request("a", list(range(1, 65))))  # a resubmission is not overload
    with pytest.raises(ValueError, match=r"^the prompt is empty$"):
        admission.add(request("e", []))
    assert set(state.requests) == {"a", "b", "c", "x"}


def test_admission_replaces_a_resubmission_in_place_and_finishes_one_that_is_done():
    state = SchedulerState(config())
    admission = Admission(state)
    for rid in "abc":
        admission.add(request(rid, [1, 2]))
    again = request("a", [1, 2])
    again.output_ids = [5, 6]
    admission.add(again)
    assert [r.request_id for r in state.waiting] == ["a", "b", "c"] and state.requests["a"] is again
    done = request("b", [1, 2], max_tokens=2)
    done.output_ids = [5, 6]
    out = admission.add(done)
    assert out is not None and (out.finish_reason, out.start_index, out.new_token_ids) == ("length", 2, [])
    assert "b" not in state.requests and [r.request_id for r in state.waiting] == ["a", "c"]


def test_abort_drops_a_live_request_and_counts_unknown_ones():
    state = SchedulerState(config())
    admission = Admission(state)
    admission.add(request("a", [1, 2]))
    assert admission.abort("a") and not state.requests and not state.waiting
    assert not admission.abort("a") and not admission.abort("zzz")
    assert admission.num_unknown_aborts == 2


# -- prefill -----------------------------------------------------------------------------------


def test_prefill_chunks_to_the_budget_and_enters_the_running_line():
    state = SchedulerState(config(max_num_batched_tokens=6))
    Admission(state).add(request("long", list(range(1, 11))))
    Admission(state).add(request("next", [1, 2]))
    prefill = Prefill(state)
    seqs: list[Request] = []
    version = state.line_version
    chunks = prefill.plan([], seqs, 6)
    (long,) = seqs  # the budget is spent: "next" waits
    assert (long.request_id, chunks.starts, chunks.num_new) == ("long", [0], [6])
    assert long.status is RequestStatus.RUNNING and state.running == [long] and state.line_version > version
    assert state.table.num_computed[long.row] == 6 and len(long.block_ids) == 2  # 6 tokens, blocks of 4
    # The rest of the prompt next step, then the next request in what is left of the budget.
    seqs = []
    chunks = prefill.plan([long], seqs, 6)
    assert [r.request_id for r in seqs] == ["long", "next"] and chunks.num_new == [4, 2]


def test_prefill_starts_from_prefix_cache_hits_and_keeps_the_last_token_to_compute():
    state = SchedulerState(config())
    prompt = list(range(1, 10))  # 9 tokens: two full blocks of 4
    first = request("first", prompt)
    Admission(state).add(first)
    prefill = Prefill(state)
    prefill.plan([], [], 32)
    state.register_blocks(first, 2)
    second = request("second", prompt)
    Admission(state).add(second)
    seqs: list[Request] = []
    chunks = prefill.plan([], seqs, 32)
    assert seqs == [second] and chunks.starts == [8] and chunks.num_new == [1]
    assert second.block_ids[:2] == first.block_ids[:2] and second.num_cached_tokens == 8
    assert (prefill.num_prefix_query_tokens, prefill.num_prefix_hit_tokens) == (18, 8)
    # A prompt that is all cached blocks still computes its last token.
    third = request("third", prompt[:8])
    Admission(state).add(third)
    chunks = prefill.plan([], [], 32)
    assert chunks.starts == [4] and chunks.num_new == [4]


def test_a_resumed_request_counts_only_its_prompt_as_cached():
    """A preempted or resubmitted request looks up its prompt and its output so far; the hits in
    its output are no prompt tokens, so its usage's cached_tokens stays within its prompt."""
    state = SchedulerState(config())
    tokens = list(range(1, 10))  # 9 tokens: two full blocks of 4
    first = request("first", tokens)
    Admission(state).add(first)
    prefill = Prefill(state)
    prefill.plan([], [], 32)
    state.register_blocks(first, 2)
    resumed = Request("resumed", 0, np.array(tokens[:5], np.int32), engine_params(seed=1, max_tokens=8),
                      output_ids=tokens[5:])  # fmt: skip
    Admission(state).add(resumed)
    seqs: list[Request] = []
    chunks = prefill.plan([], seqs, 32)
    assert seqs == [resumed] and chunks.starts == [8]  # both blocks are hits, output included
    assert resumed.num_cached_tokens == 5
    assert prefill.num_prefix_hit_tokens == 8  # the cache's own counters see every hit


def test_queue_time_is_observed_once_per_request():
    """A request resubmitted with its output so far (its scheduler restarted, or its tokenizer died)
    waited once already: only requests without output add a queue time."""
    state = SchedulerState(config())
    prefill = Prefill(state)
    fresh = request("fresh", [1, 2, 3])
    resubmitted = Request("again", 0, np.array([1, 2, 3], np.int32), engine_params(seed=1, max_tokens=8),
                          output_ids=[4, 5])  # fmt: skip
    for req in (fresh, resubmitted):
        Admission(state).add(req)
    seqs: list[Request] = []
    prefill.plan([], seqs, 32)
    assert seqs == [fresh, resubmitted] and len(prefill.queue_times) == 1


def test_prefill_admits_at_most_max_num_seqs():
    state = SchedulerState(config(max_num_seqs=2))
    for rid in "abc":
        Admission(state).add(request(rid, [1, 2]))
    seqs: list[Request] = []
    Prefill(state).plan([], seqs, 32)
    assert [r.request_id for r in seqs] == ["a", "b"] and [r.request_id for r in state.waiting] == ["c"]


# -- steady decode -----------------------------------------------------------------------------


def decoding(num: int, **overrides: object) -> Scheduler:
    """A scheduler whose `num` requests have prefilled and sampled once: all in steady decode."""
    sched = Scheduler(config(**overrides))
    for i in range(num):
        sched.add(request(f"r{i}", [1, 2, 3], ignore_eos=True, max_tokens=20))
    step = sched.schedule()
    assert step is not None and step.num_decodes == 0
    sched.update(step, np.full(num, 7, np.int32), np.zeros(num, np.float32))
    return sched


def test_steady_decode_keeps_its_line_and_advances_it_in_place():
    sched = decoding(3)
    decode = sched.decode
    first = decode.plan(32)
    assert first.line_version == sched.state.line_version and first.steady is not None
    assert [r.request_id for r in first.seqs] == ["r0", "r1", "r2"] and not first.partial
    assert first.starts.tolist() == [3, 3, 3] and not first.is_placeholder.any()
    assert first.steady.slot_mapping.tolist() == [
        sched.table.block_tables[r.row, 0] * 4 + 3 for r in first.seqs
    ]
    # Planned ahead (the sample of the first is in flight): the same line, advanced in place.
    second = decode.plan(32)
    assert second.steady is first.steady and second.is_placeholder.all()
    assert second.starts.tolist() == [4, 4, 4]  # each entered a new block
    assert second.steady.slot_mapping.tolist() == [r.block_ids[1] * 4 for r in second.seqs]
    assert decode.running_rows() is decode.running_rows()


def test_a_change_of_the_line_makes_a_new_steady_line():
    sched = decoding(3)
    step = sched.schedule()
    assert step is not None and step.steady is not None
    sched.update(step, np.full(3, 9, np.int32), np.zeros(3, np.float32))
    sched.abort("r1")
    after = sched.schedule()
    assert after is not None and after.line_version == sched.state.line_version > step.line_version
    assert after.steady is not None and after.steady is not step.steady
    assert [r.request_id for r in after.seqs] == ["r0", "r2"]


def test_part_of_the_line_is_not_steady_and_a_sample_known_last_is_not_decoded_ahead():
    sched = decoding(2)
    sched.table.length_limit[sched.state.running[1].row] = 5  # r1's sample in flight is its last
    decode = sched.decode
    decode.plan(32)
    ahead = decode.plan(32)
    assert [r.request_id for r in ahead.seqs] == ["r0"] and ahead.is_placeholder.tolist() == [True]
    assert ahead.line_version == -1 and ahead.steady is None


def test_invalidate_drops_every_cache():
    sched = decoding(2)
    decode = sched.decode
    step = sched.schedule()
    assert step is not None and step.line_version >= 0
    build_plan(step, 0, 4)
    rows = decode.running_rows()
    columns = decode.row_columns(rows, step.line_version)
    assert decode.row_columns(rows, step.line_version) is columns  # cached for the line
    assert decode.row_columns(rows, -1) is not columns  # not a whole-line step: gathered afresh
    assert sched.table.decode_constants is not None
    decode.invalidate()
    assert sched.table.decode_constants is None
    assert decode.running_rows() is not rows and decode.running_rows().tolist() == rows.tolist()
    assert decode.row_columns(rows, step.line_version) is not columns
    assert decode.plan(32).steady is not None  # rebuilt


def test_decode_plans_the_placeholder_of_a_sample_in_flight():
    sched = decoding(1)
    step = sched.schedule()
    ahead = sched.schedule()
    assert step is not None and ahead is not None
    _, plan = build_plan(ahead, 1, 4)
    assert plan["input_ids"].tolist() == [PLACEHOLDER_TOKEN] and plan["positions"].tolist() == [4]


# -- results -----------------------------------------------------------------------------------


def test_finish_reason_rules():
    eos = frozenset({EOS})
    p = engine_params(max_tokens=4, stop_token_ids=[9], min_tokens=1)
    assert finish_reason(p, EOS, 1, 10, eos, 64) is None  # min_tokens holds
    assert finish_reason(p, EOS, 2, 10, eos, 64) == "stop"
    assert finish_reason(p, 9, 2, 10, eos, 64) == "stop"
    assert finish_reason(p, 5, 4, 10, eos, 64) == "length"
    assert finish_reason(p, 5, 2, 64, eos, 64) == "length"
    assert finish_reason(engine_params(ignore_eos=True), EOS, 3, 10, eos, 64) is None


def test_results_append_finish_and_drop_entries_gone_since_planning():
    sched = Scheduler(config())
    state, admission, results = sched.state, sched.admission, sched.results
    for rid, max_tokens in (("a", 1), ("b", 5), ("c", 5)):
        admission.add(request(rid, [1, 2, 3], max_tokens=max_tokens, ignore_eos=rid != "b"))
    step = sched.schedule()
    assert step is not None and step.num_seqs == 3
    admission.abort("c")  # after planning: its entry is dropped
    outputs = results.update(step, np.array([4, EOS, 6], np.int32), np.array([-1.0, -2.0, -3.0], np.float32))
    assert [(o.request_id, o.new_token_ids, o.finish_reason, o.start_index) for o in outputs] == [
        ("a", [4], "length", 0),
        ("b", [EOS], "stop", 0),
    ]
    assert outputs.logprobs.tolist() == [-1.0, -2.0] and not state.requests and not state.running
    assert state.blocks.num_used == 0
