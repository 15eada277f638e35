"""Scheduler core, driven without processes by a fake executor that keeps a simulated KV cache.

The fake executor writes each planned token into its KV slot and samples from what it reads
back through the block tables (the two previous tokens), the seed and the position. Outputs
therefore match an independent reference only when every plan reads the right KV: prefix
sharing, chunking, preemption and recompute are all checked by comparing outputs.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ipc import messages as m
from ipc.codec import DETOKENIZER_INPUT
from ipc.config import EngineConfig
from ipc.endpoints import shard_of
from ipc.messages import PLACEHOLDER_TOKEN, ResultHeader, SamplingParams
from ipc.sampling_defaults import fill_defaults
from ipc.step_plan import IMAGE_KEY_BYTES, STEP_PLAN, Dim
from services.gpu_worker.speculation import emitted_tokens
from services.scheduler.__main__ import detokenizer_messages
from services.scheduler.core import (
    Overloaded,
    PromptTooLong,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
    StepOutputs,
)
from services.scheduler.pipeline import StepPipeline, WorkerLost
from services.scheduler.plan import ScheduledStep, build_plan
from services.scheduler.request import Request

# The engine settings a scheduler reads (SchedulerConfig.engine); every other field is the model's.
SCHEDULER_ENGINE_FIELDS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_num_waiting",
    "enable_prefix_caching",
)


def scheduler_config(**fields: Any) -> SchedulerConfig:
    """A SchedulerConfig from one flat set of fields, as the tests size a scheduler."""
    engine = EngineConfig(**{k: v for k, v in fields.items() if k in SCHEDULER_ENGINE_FIELDS})
    return SchedulerConfig(engine, **{k: v for k, v in fields.items() if k not in SCHEDULER_ENGINE_FIELDS})


def engine_params(**fields) -> SamplingParams:
    """SamplingParams as the tokenizer forwards them: unset sampling fields take the engine's defaults."""
    return fill_defaults(SamplingParams(**fields))


VOCAB = 40
EOS = 0


def mix(seed: int, position: int, prev: int, prev2: int) -> int:
    """Deterministic 'model': the next token from seed, position and the two previous tokens."""
    x = (
        seed * 0x9E3779B1 + position * 0x85EBCA77 + (prev + 1) * 0xC2B2AE3D + (prev2 + 2) * 0x27D4EB2F
    ) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return x % VOCAB


def pick(seed: int, position: int, prev: int, prev2: int, banned: set[int]) -> int:
    token = mix(seed, position, prev, prev2)
    while token in banned:
        token = (token + 1) % VOCAB
    return token


def reference_outputs(
    prompt: list[int], outputs: list[int], params: SamplingParams, max_model_len: int
) -> list[int]:
    """What a request generates run alone, with the same finish rules as the scheduler."""
    tokens = list(prompt) + list(outputs)
    out = list(outputs)
    seed = params.seed
    while True:
        banned = {t for t, v in params.logit_bias.items() if v == -np.inf}
        if len(out) < params.min_tokens:
            banned |= set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
        p = len(tokens)
        token = pick(seed, p, tokens[p - 1], tokens[p - 2] if p >= 2 else -1, banned)
        tokens.append(token)
        out.append(token)
        if len(out) > params.min_tokens and (
            (token == EOS and not params.ignore_eos) or token in params.stop_token_ids
        ):
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out


class Refused(Exception):
    """The fake worker's InvalidPlan."""


class FakeExecutor:
    """Checks every plan against the contract and runs it on a simulated KV cache, in order.

    Like the worker, it fills a placeholder input with the token it sampled for that plan-table
    row in the previous step, and refuses the step when it has none. It also serves as the
    `StepExecutor` of a `StepPipeline`: a published step runs at once (the worker runs steps in
    the order they are published, so running it before later changes to the scheduler is exact).
    """

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bs = sched.config.block_size
        self.kv = np.full(sched.config.num_blocks * self.bs, -1, np.int64)  # token id per slot
        # LongRoPE: whether each slot's key was rotated with the long factors (the plan's long_rope).
        self.kv_long = np.zeros(sched.config.num_blocks * self.bs, np.bool_)
        self.num_steps = 0
        self.last_sampled: dict[int, tuple[int, int, int]] = {}  # row -> (step id, position, token)
        self.refuse_step_ids: set[int] = set()
        self.num_placeholders = 0
        self.results: deque[tuple[ResultHeader, dict[str, np.ndarray]]] = deque()
        self.die_at_step: int | None = None  # result() of this step raises WorkerLost, once
        # The emitted_* result arrays of the step `run` ran last, when it verified proposals.
        self.emitted: dict[str, np.ndarray] = {}

    def lose_kv(self) -> None:
        """The worker died: a new one knows nothing, and the old one's results are gone."""
        self.kv[:] = -1
        self.last_sampled.clear()
        self.results.clear()

    def publish(self, step_id: int, step: ScheduledStep) -> None:
        try:
            sampled, logprobs, top_ids, top_logprobs = self.run(step, step_id)
        except Refused as exc:
            self.results.append((ResultHeader(step_id, step.num_seqs, str(exc)), {}))
            return
        arrays = {
            "sampled_ids": sampled,
            "sampled_logprobs": logprobs,
            "top_ids": top_ids,
            "top_logprobs": top_logprobs,
            **self.emitted,
        }
        self.results.append((ResultHeader(step_id, step.num_seqs), arrays))

    @contextmanager
    def result(self) -> Iterator[tuple[ResultHeader, dict[str, np.ndarray]]]:
        if self.results[0][0].step_id == self.die_at_step:
            self.die_at_step = None
            raise WorkerLost("the fake worker died")
        yield self.results.popleft()

    def run(
        self, step: ScheduledStep, step_id: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        sched, bs, cfg = self.sched, self.bs, self.sched.config
        step_id = self.num_steps if step_id is None else step_id
        header, a = build_plan(step, step_id, bs)
        self.num_steps = step_id + 1
        if step_id in self.refuse_step_ids:
            raise Refused(f"step {step_id} refused on purpose")
        num_seqs = header.num_seqs
        check_plan_shapes(a, header.num_tokens, num_seqs)
        long_from = cfg.long_rope_from
        is_long = a["long_rope"].astype(np.bool_) if "long_rope" in a else np.zeros(num_seqs, np.bool_)
        assert long_from or not is_long.any()
        assert 0 < header.num_tokens <= cfg.engine.max_num_batched_tokens
        assert 0 < num_seqs <= cfg.engine.max_num_seqs
        assert a["rows"].tolist() == [req.row for req in step.seqs]
        qsl, seq_lens, bt = a["query_start_loc"], a["seq_lens"], a["block_tables"]
        ids = a["input_ids"].astype(np.int64)
        written_blocks: dict[int, int] = {}
        for i, req in enumerate(step.seqs):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            pos = a["positions"][lo:hi]
            assert pos.tolist() == list(range(int(seq_lens[i]) - (hi - lo), int(seq_lens[i])))
            for j in np.flatnonzero(ids[lo:hi] == PLACEHOLDER_TOKEN).tolist():
                # Only the one token being sampled is unknown, and only in a decode.
                assert i < step.num_decodes and pos[j] == req.num_tokens
                step_of, position, token = self.last_sampled.get(int(a["rows"][i]), (-1, -1, -1))
                if (step_of, position) != (step_id - 1, int(pos[j])):
                    raise Refused(f"placeholder of row {a['rows'][i]} with no sample in step {step_id - 1}")
                ids[lo + j] = token
                self.num_placeholders += 1
            known = min(hi - lo, req.num_tokens - int(pos[0]))
            assert (ids[lo : lo + known] == req.token_slice(int(pos[0]), int(pos[0]) + known)).all()
            if long_from:  # long exactly when the sequence is longer than the original length
                assert is_long[i] == (req.num_tokens > long_from), "a sequence in the wrong rope regime"
                assert is_long[i] or seq_lens[i] <= long_from
            assert (a["slot_mapping"][lo:hi] == bt[i, pos // bs] * bs + pos % bs).all()
            num_blocks = -(-int(seq_lens[i]) // bs)
            assert (bt[i, num_blocks:] == 0).all()
            for block in set((a["slot_mapping"][lo:hi] // bs).tolist()):
                # A written block belongs to this sequence alone.
                assert written_blocks.setdefault(block, i) == i, "two sequences write one block"
                assert sched.blocks.ref_counts[block] == 1, "a write into a shared block"
                assert sched.blocks.block_hash[block] is None, "a write into a cached block"
        self.kv[a["slot_mapping"]] = ids
        self.kv_long[a["slot_mapping"]] = np.repeat(is_long, np.diff(qsl))

        sampled = np.full(num_seqs, -1, np.int32)
        logprobs = np.zeros(num_seqs, np.float32)
        num_proposed = a.get("num_proposed", np.zeros(num_seqs, np.int32))
        width = 1 + int(num_proposed.max(initial=0))
        k = header.max_top_logprobs
        emitted = {
            "emitted_ids": np.full((num_seqs, width), -1, np.int32),
            "emitted_logprobs": np.zeros((num_seqs, width), np.float32),
            "num_emitted": np.zeros(num_seqs, np.int32),
            "emitted_top_ids": np.tile(np.arange(k, dtype=np.int32), (num_seqs, width, 1)),
            "emitted_top_logprobs": np.zeros((num_seqs, width, k), np.float32),
        }
        for i, req in enumerate(step.seqs):
            n = int(seq_lens[i])
            # Everything the sequence attends to (all of it, or the sliding_window keys up to each of
            # its queries, the first at n - q_len) must be its own tokens, read through its table,
            # in blocks it still holds; a decode planned ahead also attends to its placeholder,
            # filled in above.
            slots = bt[i, np.arange(n) // bs] * bs + np.arange(n) % bs
            known = min(n, req.num_tokens)
            q_len = int(qsl[i + 1] - qsl[i])
            first = max(n - q_len - cfg.sliding_window + 1, 0) if cfg.sliding_window else 0
            assert (self.kv[slots[first:known]] == req.token_slice(first, known)).all(), (
                "stale or foreign KV read"
            )
            read_blocks = np.unique(slots[first:n] // bs)
            assert (np.array(sched.blocks.ref_counts)[read_blocks] > 0).all(), "a read of a released block"
            assert (self.kv_long[slots[first:n]] == is_long[i]).all(), "a key rotated in the other regime"
            if not a["is_sampled"][i]:
                continue
            assert a["sample_positions"][i] == n
            # A penalised row's history is its known tokens, never a proposal.
            history = a["history_ids"][a["history_offsets"][i] : a["history_offsets"][i + 1]]
            if len(history):
                assert (history == req.token_slice(0, req.num_tokens)).all(), "a stale penalty history"
                assert a["history_prompt_lens"][i] == req.num_prompt_tokens
            lo, hi = a["bias_offsets"][i], a["bias_offsets"][i + 1]
            banned = {
                int(t)
                for t, v in zip(a["bias_ids"][lo:hi], a["bias_values"][lo:hi], strict=True)
                if v == -np.inf
            }
            # A verifying row: the target's token after its last known one and after each proposal
            # (read from the KV just written), and what greedy verification keeps of them.
            d = int(num_proposed[i])
            targets = np.array(
                [
                    pick(
                        int(a["seeds"][i]),
                        p,
                        int(self.kv[slots[p - 1]]),
                        int(self.kv[slots[p - 2]]) if p >= 2 else -1,
                        banned,
                    )
                    for p in range(n - d, n + 1)
                ],
                np.int32,
            )
            new = emitted_tokens(targets, ids[int(qsl[i + 1]) - d : int(qsl[i + 1])]) if d else targets
            sampled[i] = new[-1]
            logprobs[i] = -(n % 7) - sampled[i] / VOCAB  # a function of the sample alone
            emitted["emitted_ids"][i, : len(new)] = new
            emitted["emitted_logprobs"][i, : len(new)] = [
                -((n - d + j) % 7) - t / VOCAB for j, t in enumerate(new)
            ]
            emitted["num_emitted"][i] = len(new)
            self.last_sampled[int(a["rows"][i])] = (step_id, n - d + len(new) - 1, int(sampled[i]))
        self.emitted = emitted if "num_proposed" in a else {}
        top_ids = np.tile(np.arange(k, dtype=np.int32), (num_seqs, 1))
        return sampled, logprobs, top_ids, np.zeros((num_seqs, k), np.float32)


def check_plan_shapes(a: dict[str, np.ndarray], num_tokens: int, num_seqs: int) -> None:
    """The plan is exactly the declared one (ipc/step_plan.py), and every required array is there
    (the optional grammar arrays only come with constrained rows, which this traffic has none of;
    long_rope with LongRoPE's long rows; the image arrays with images, rope_deltas with M-RoPE's)."""
    optional = {"long_rope", "num_proposed", "rope_deltas"} | {
        name for name in a if name.startswith("image_")
    }
    assert set(a) - optional == set(STEP_PLAN.required)
    STEP_PLAN.check(a, {Dim.TOKENS: num_tokens, Dim.ROWS: num_seqs, Dim.IMAGE_KEY: IMAGE_KEY_BYTES})


def make_request(rid: str, prompt: list[int], **params: object) -> Request:
    params.setdefault("seed", 7)
    return Request(rid, 0, np.array(prompt, np.int32), engine_params(**params))


def drive(
    sched: Scheduler, executor: FakeExecutor, overlap: bool = False, max_steps: int = 10_000
) -> dict[str, list[RequestOutput]]:
    """Run everything to the end through a step pipeline (one step at a time, or planned ahead)."""
    pipeline = StepPipeline(sched, executor, on_failed=refuse_nothing, overlap=overlap)
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not pipeline.has_work:
            break
        for out in pipeline.advance() or []:
            outputs.setdefault(out.request_id, []).append(out)
    assert not pipeline.has_work
    return outputs


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    tokens: list[int] = []
    for out in outs:
        assert out.start_index == len(tokens)
        tokens.extend(out.new_token_ids)
    return tokens


def assert_no_leaks(sched: Scheduler) -> None:
    bm = sched.blocks
    assert all(r == 0 for r in bm.ref_counts)
    assert bm.num_used == 0 and sched.kv_usage == 0.0
    assert len(bm.free) + len(bm.evictable) == bm.num_blocks
    assert set(bm.free).isdisjoint(bm.evictable)
    assert all(bm.block_hash[b] is not None for b in bm.evictable)


# -- property test ----------------------------------------------------------------------------

PREFIXES = [[1 + (i * 7) % (VOCAB - 1) for i in range(12)], [3 + (i * 5) % (VOCAB - 3) for i in range(9)]]

request_st = st.fixed_dictionaries(
    {
        "prefix": st.sampled_from([0, 1, None]),
        "suffix": st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20),
        "max_tokens": st.integers(1, 16),
        "min_tokens": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "stop": st.booleans(),
        "priority": st.integers(0, 2),
        "seed": st.integers(0, 2**31),
        "penalty": st.booleans(),
        "resume": st.integers(0, 3),
    }
)
event_st = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "add", "step", "step", "abort", "unknown_abort", "lose_worker"]),
        st.integers(0, 100),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([2, 4, 8]),
    extra_blocks=st.integers(0, 12),
    max_num_seqs=st.integers(1, 5),
    max_num_batched_tokens=st.integers(1, 24),
    caching=st.booleans(),
    sliding_window=st.sampled_from([0, 0, 2, 5, 9]),
    long_rope_from=st.sampled_from([0, 0, 7, 13]),
    requests=st.lists(request_st, min_size=1, max_size=8),
    events=event_st,
)
def test_random_traffic_keeps_invariants_and_outputs(
    block_size: int,
    extra_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    caching: bool,
    sliding_window: int,
    long_rope_from: int,
    requests: list[dict],
    events: list[tuple[str, int]],
) -> None:
    """The same traffic through the step pipeline one step at a time and planned ahead: every
    request ends exactly once, with the outputs it generates alone (a prefix when aborted)."""
    max_model_len = 48
    config = scheduler_config(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_blocks=max_model_len // block_size + extra_blocks,
        max_model_len=max_model_len,
        max_num_waiting=64,
        enable_prefix_caching=caching,
        eos_token_ids=(EOS,),
        sliding_window=sliding_window,  # decodes release the blocks behind the window
        long_rope_from=long_rope_from,  # sequences growing past it recompute in the long regime
    )
    specs = []
    for idx, spec in enumerate(requests):
        prompt = (PREFIXES[spec["prefix"]] if spec["prefix"] is not None else []) + spec["suffix"]
        params = engine_params(
            max_tokens=spec["max_tokens"],
            min_tokens=spec["min_tokens"],
            ignore_eos=spec["ignore_eos"],
            stop_token_ids=[5] if spec["stop"] else [],
            priority=spec["priority"],
            seed=spec["seed"],
            repetition_penalty=1.2 if spec["penalty"] else 1.0,
            logit_bias={7: -np.inf} if spec["penalty"] else {},
        )
        full = reference_outputs(prompt, [], params, max_model_len)
        # Some requests arrive as resubmissions that already carry their first outputs.
        specs.append((f"r{idx}", prompt, params, full, full[: min(spec["resume"], len(full) - 1)]))
    streams: dict[bool, dict[str, list[tuple[int, bytes]]]] = {}
    for overlap in (False, True):
        sched = Scheduler(config)
        executor = FakeExecutor(sched)
        streams[overlap], ended = run_traffic(sched, executor, overlap, specs, events)
        got = {rid: [token for token, _ in stream] for rid, stream in streams[overlap].items()}
        assert set(ended) == {rid for rid, *_ in specs}, "every request ends exactly once"
        for rid, _, params, full, _ in specs:
            if ended[rid] == "abort":
                assert got[rid] == full[: len(got[rid])]
                continue
            assert got[rid] == full, rid
            last = full[-1]
            is_stop = len(full) > params.min_tokens and (
                (last == EOS and not params.ignore_eos) or last in params.stop_token_ids
            )
            assert ended[rid] == ("stop" if is_stop else "length")
        if sched.num_preemptions:
            event(f"preempted (overlap={overlap})")
        if sched.num_prefix_hit_tokens:
            event(f"prefix cache hit (overlap={overlap})")
        if executor.num_placeholders:
            event("decoded from a placeholder")
        assert_no_leaks(sched)
    # Token for token, logprobs included, what the detokenizers get is the same either way (an
    # abort lands at a different point of a request's life, so one stream is a prefix then).
    for rid, stream in streams[False].items():
        shorter = min(len(stream), len(streams[True][rid]))
        assert stream[:shorter] == streams[True][rid][:shorter]
        if ended[rid] != "abort":
            assert stream == streams[True][rid]


def run_traffic(
    sched: Scheduler,
    executor: FakeExecutor,
    overlap: bool,
    specs: list[tuple[str, list[int], SamplingParams, list[int], list[int]]],
    events: list[tuple[str, int]],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, list[tuple[int, bytes]]], dict[str, str]]:
    """Drive the events, then run until idle; returns each request's outputs (token, packed
    logprob) as the detokenizer gets them, and how it ended. `clock`: the pipeline's."""
    pipeline = StepPipeline(sched, executor, on_failed=refuse_nothing, overlap=overlap, clock=clock)
    got: dict[str, list[tuple[int, bytes]]] = {}
    ended: dict[str, str] = {}
    pending = list(specs)

    def add_next() -> None:
        rid, prompt, params, _, resumed = pending.pop(0)
        got[rid] = [(token, b"") for token in resumed]
        assert sched.add(Request(rid, 0, np.array(prompt, np.int32), params, output_ids=resumed)) is None

    def step_once() -> bool:
        outputs = pipeline.advance()
        if outputs is None:
            return False
        for update in outputs.step_tokens().to_updates():  # what the detokenizer gets
            rid = update.request_id
            assert rid not in ended, "output after the end"
            assert update.start_index == len(got[rid]), "a gap or a duplicate"
            got[rid].append((int(m.unpack_ids(update.token_ids)[0]), update.logprobs))
            if update.finish_reason is not None:
                ended[rid] = update.finish_reason
        return True

    for kind, arg in events:
        if kind == "add" and pending:
            add_next()
        elif kind == "step":
            step_once()
        elif kind == "abort" and got:
            rid = sorted(got)[arg % len(got)]
            was_live = rid in sched.requests
            assert sched.abort(rid) == was_live
            if was_live:
                ended[rid] = "abort"
        elif kind == "unknown_abort":
            before = sched.num_unknown_aborts
            assert not sched.abort(f"nope-{arg}")
            assert sched.num_unknown_aborts == before + 1
        elif kind == "lose_worker":
            pipeline.drop_in_flight()
            sched.preempt_all()
            executor.lose_kv()
            assert sched.num_running == 0 and not sched.blocks.cached
    while pending:
        add_next()
    for _ in range(5000):
        if not step_once() and not pipeline.has_work:
            break
    assert not pipeline.has_work and sched.num_waiting == 0 and sched.num_running == 0
    return got, ended


def refuse_nothing(requests: list[Request], error: str) -> None:
    raise AssertionError(f"the fake worker refused a step: {error}")


# -- targeted behaviour ---------------------------------------------------------------------------


def small_config(**kw: object) -> SchedulerConfig:
    base = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
        num_blocks=256,
        max_model_len=1024,
        max_num_waiting=16,
        eos_token_ids=(EOS,),
    )
    base.update(kw)
    return scheduler_config(**base)


def test_shared_prefix_computes_only_the_rest() -> None:
    sched = Scheduler(small_config(max_num_batched_tokens=512))
    executor = FakeExecutor(sched)
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, VOCAB, 256).tolist()
    first = make_request("a", [*prefix, 11, 12, 13], max_tokens=3, ignore_eos=True)
    sched.add(first)
    drive(sched, executor)
    assert sched.prefix_hit_rate == 0.0

    sched.add(make_request("b", [*prefix, 21, 22, 23, 24, 25], max_tokens=3, ignore_eos=True))
    step = sched.schedule()
    assert step is not None and step.num_seqs == 1
    assert int(step.starts[0]) == 256 and int(step.num_new_tokens[0]) == 5
    assert step.seqs[0].num_cached_tokens == 256
    assert sched.prefix_hit_rate == pytest.approx(256 / (259 + 261))
    outs = sched.update(step, *executor.run(step))
    assert outs[0].num_cached_tokens == 256
    rest = drive(sched, executor)
    params = step.seqs[0].params
    assert tokens_of([*outs, *rest["b"]]) == reference_outputs(
        [*prefix, 21, 22, 23, 24, 25], [], params, 1024
    )
    assert_no_leaks(sched)


def test_identical_prompt_recomputes_its_last_token() -> None:
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    prompt = list(range(1, 33))  # exactly two full blocks
    sched.add(make_request("a", prompt, max_tokens=1))
    drive(sched, executor)
    sched.add(make_request("b", prompt, max_tokens=1))
    step = sched.schedule()
    assert step is not None
    # The last block is a hit too, but its last token must be computed to sample: only the
    # first block is reused and the second is recomputed into a private block.
    assert int(step.starts[0]) == 16 and int(step.num_new_tokens[0]) == 16
    sched.update(step, *executor.run(step))


def test_chunked_prefill_splits_within_budget_while_others_decode() -> None:
    sched = Scheduler(small_config(max_num_batched_tokens=32))
    executor = FakeExecutor(sched)
    sched.add(make_request("short", [1, 2, 3], max_tokens=20, ignore_eos=True))
    step = sched.schedule()
    sched.update(step, *executor.run(step))
    long_prompt = list(np.random.default_rng(1).integers(1, VOCAB, 100))
    sched.add(make_request("long", long_prompt, max_tokens=2, ignore_eos=True))
    chunks = []
    while True:
        step = sched.schedule()
        assert step.num_tokens <= 32
        assert step.seqs[0].request_id == "short" and step.num_decodes >= 1  # decodes go first
        i = (
            [r.request_id for r in step.seqs].index("long")
            if "long" in [r.request_id for r in step.seqs]
            else None
        )
        outs = sched.update(step, *executor.run(step))
        if i is None:
            continue
        chunks.append((int(step.num_new_tokens[i]), bool(step.is_sampled[i])))
        if step.is_sampled[i]:
            assert [o.request_id for o in outs].count("long") == 1
            break
        assert "long" not in [o.request_id for o in outs]
    assert chunks == [(31, False), (31, False), (31, False), (7, True)]


def test_overload_and_prompt_too_long() -> None:
    sched = Scheduler(small_config(max_num_seqs=2, max_num_waiting=2, max_model_len=64, num_blocks=8))
    for rid in "abcd":  # 2 for the free slots, 2 waiting
        sched.add(make_request(rid, [1, 2]))
    with pytest.raises(Overloaded, match="max_num_waiting=2"):
        sched.add(make_request("e", [1, 2]))
    sched.add(make_request("a", [3, 4]))  # a resubmission replaces, it does not queue more
    assert sched.num_waiting == 4
    with pytest.raises(PromptTooLong):
        sched.add(make_request("d", list(range(1, 65))))
    # A resubmission that already reached max_model_len is finished, not refused.
    done = sched.add(Request("e", 0, np.arange(1, 60, dtype=np.int32), engine_params(), output_ids=[1] * 5))
    assert done is not None and done.finish_reason == "length" and "e" not in sched.requests


def hello(rank: int, num_kv_blocks: int, max_model_len: int = 4096) -> m.WorkerHello:
    return m.WorkerHello(
        rank, 2, 100 + rank, "tiny", "float32", "cpu", num_kv_blocks, 16, VOCAB, max_model_len,
        eos_token_ids=[EOS, 7], sliding_window=32, long_rope_from=64,
    )  # fmt: skip


def test_a_groups_config_takes_the_engine_settings_and_the_smallest_ranks_kv_blocks() -> None:
    engine = EngineConfig(
        max_num_seqs=3, max_num_batched_tokens=96, max_num_waiting=5, enable_prefix_caching=False
    )
    config = SchedulerConfig.of(engine, 1024, [hello(0, 900), hello(1, 700)])
    assert config.engine == engine
    assert (config.block_size, config.num_blocks, config.max_model_len) == (16, 700, 1024)
    assert (config.eos_token_ids, config.sliding_window, config.long_rope_from) == ((EOS, 7), 32, 64)
    assert SchedulerConfig.of(engine, 8192, [hello(0, 900), hello(1, 700)]).max_model_len == 4096
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        SchedulerConfig.of(engine, 1024, [hello(0, 900), hello(1, 10)])


def test_a_hot_reload_of_max_num_waiting_bounds_the_next_add() -> None:
    sched = Scheduler(small_config(max_num_seqs=1, max_num_waiting=1))
    sched.add(make_request("a", [1, 2]))
    sched.add(make_request("b", [1, 2]))
    with pytest.raises(Overloaded, match="max_num_waiting=1"):
        sched.add(make_request("c", [1, 2]))
    before = sched.config
    sched.config = sched.config.with_max_num_waiting(2)
    assert sched.config.engine.max_num_waiting == 2
    assert sched.config == dataclasses.replace(
        before, engine=msgspec.structs.replace(before.engine, max_num_waiting=2)
    )
    assert sched.add(make_request("c", [1, 2])) is None


def test_burst_fills_free_slots_before_the_waiting_bound_applies() -> None:
    """Issue 14 item 12: with every slot idle, a burst is admitted up to the free slots plus
    max_num_waiting; once the slots run, the bound counts only what waits beyond them."""
    sched = Scheduler(small_config(max_num_seqs=8, max_num_waiting=2, max_num_batched_tokens=256))
    accepted = []
    for i in range(20):
        try:
            sched.add(make_request(f"r{i}", [1, 2, 3]))
            accepted.append(i)
        except Overloaded:
            pass
    assert accepted == list(range(10))
    step = sched.schedule()
    assert step is not None and len(step.seqs) == 8  # every slot runs; 2 still wait
    assert (sched.num_running, sched.num_waiting) == (8, 2)
    with pytest.raises(Overloaded):  # no slot free now: the 2 waiting are the bound
        sched.add(make_request("late", [1, 2, 3]))
    assert sched.abort("r0")  # a slot frees: one more may queue for it
    sched.add(make_request("late", [1, 2, 3]))
    with pytest.raises(Overloaded):
        sched.add(make_request("later", [1, 2, 3]))


def test_each_request_times_its_first_token_once_for_the_autoscaler() -> None:
    """recent_ttft_p90 (the heartbeat's ttft_p90_s): one sample per request, at its first output
    token (after the last chunk of a chunked prompt), from its arrival; old samples leave it."""
    sched = Scheduler(small_config(max_num_batched_tokens=32))
    executor = FakeExecutor(sched)
    assert sched.recent_ttft_p90() == 0.0
    begin = time.monotonic()
    waits = {"long": 2.0, "short": 0.5}  # seconds each had waited before the scheduler got it
    prompts = {"long": list(range(1, 101)), "short": [5, 6, 7]}  # the long one takes 4 chunks
    for rid, wait in waits.items():
        params = engine_params(max_tokens=4, ignore_eos=True, seed=7)
        sched.add(Request(rid, 0, np.array(prompts[rid], np.int32), params, arrival_time=begin - wait))
    drive(sched, executor)
    elapsed = time.monotonic() - begin
    samples = [seconds for _, seconds in sched.results.first_token_times]
    assert len(samples) == 2  # not one per token or per chunk
    assert 2.0 <= max(samples) <= 2.0 + elapsed and 0.5 <= min(samples) <= 0.5 + elapsed
    assert sched.recent_ttft_p90() == pytest.approx(float(np.percentile(samples, 90)))
    assert min(samples) + 0.9 * (max(samples) - min(samples)) == pytest.approx(sched.recent_ttft_p90())
    assert sched.results.recent_ttft_p90(window_s=0.0) == 0.0  # the window forgets them
    assert sched.recent_ttft_p90() == 0.0


def test_resubmission_continues_at_its_position() -> None:
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    prompt = [4, 5, 6, 7, 8]
    params = engine_params(max_tokens=8, seed=3, ignore_eos=True)
    full = reference_outputs(prompt, [], params, 1024)
    sched.add(Request("x", 0, np.array(prompt, np.int32), params))
    step = sched.schedule()
    sched.update(step, *executor.run(step))  # the old copy has one output
    # The tokenizer resubmits with 3 outputs (it saw more than this scheduler did): replace.
    sched.add(Request("x", 0, np.array(prompt, np.int32), params, output_ids=full[:3]))
    assert sched.num_running == 0 and sched.num_waiting == 1 and sched.blocks.num_used == 0
    step = sched.schedule()
    assert int(step.starts[0]) + int(step.num_new_tokens[0]) == len(prompt) + 3
    _, arrays = build_plan(step, 0, 16)
    assert int(arrays["sample_positions"][0]) == len(prompt) + 3
    outs = sched.update(step, *executor.run(step))
    assert outs[0].start_index == 3
    rest = drive(sched, executor)["x"]
    assert [o.start_index for o in [*outs, *rest]] == list(range(3, 8))
    assert [o.new_token_ids[0] for o in [*outs, *rest]] == full[3:]


def test_resubmission_already_finished_ends_at_once() -> None:
    sched = Scheduler(small_config())
    params = engine_params(max_tokens=2, seed=1)
    out = sched.add(Request("y", 0, np.array([1, 2], np.int32), params, output_ids=[9, 9]))
    assert out is not None and out.finish_reason == "length" and out.start_index == 2
    assert out.new_token_ids == [] and not sched.has_work


def test_abort_is_idempotent_and_unknown_ids_are_counted() -> None:
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    sched.add(make_request("a", [1, 2, 3], max_tokens=50, ignore_eos=True))
    sched.add(make_request("b", [1, 2, 3], max_tokens=50, ignore_eos=True))
    step = sched.schedule()
    result = executor.run(step)  # in flight
    assert sched.abort("a") is True
    assert sched.abort("a") is False
    assert sched.abort("zzz") is False
    assert sched.num_unknown_aborts == 2
    # The in-flight step's result for "a" is dropped; "b" still gets its token.
    outs = sched.update(step, *result)
    assert [o.request_id for o in outs] == ["b"]
    assert sched.abort("b") is True
    assert_no_leaks(sched)


def test_min_tokens_suppresses_eos_and_stop_ids_in_the_plan() -> None:
    sched = Scheduler(small_config())
    sched.add(make_request("m", [1, 2, 3], min_tokens=2, stop_token_ids=[5], logit_bias={9: 1.5}))
    sched.add(make_request("p", [4, 5, 6], repetition_penalty=1.3, logprobs=3))
    sched.add(make_request("q", [4, 5, 6], min_tokens=1, ignore_eos=True))
    step = sched.schedule()
    header, a = build_plan(step, 41, 16)
    check_plan_shapes(a, header.num_tokens, header.num_seqs)
    assert header.step_id == 41 and header.max_top_logprobs == 3
    order = [r.request_id for r in step.seqs]
    m, p, q = order.index("m"), order.index("p"), order.index("q")
    lo, hi = a["bias_offsets"][m], a["bias_offsets"][m + 1]
    bias = dict(zip(a["bias_ids"][lo:hi].tolist(), a["bias_values"][lo:hi].tolist(), strict=True))
    assert bias == {9: 1.5, 5: -np.inf, EOS: -np.inf}
    lo, hi = a["bias_offsets"][q], a["bias_offsets"][q + 1]
    assert a["bias_ids"][lo:hi].tolist() == []  # ignore_eos and no stop ids: nothing to suppress
    assert a["history_ids"][a["history_offsets"][p] : a["history_offsets"][p + 1]].tolist() == [4, 5, 6]
    assert a["history_prompt_lens"][p] == 3 and a["history_offsets"][m] == a["history_offsets"][m + 1]
    assert a["repetition_penalty"][p] == pytest.approx(1.3) and a["num_logprobs"][p] == 3
    assert a["seeds"].tolist() == [r.seed for r in step.seqs]

    executor = FakeExecutor(sched)
    outs = {o.request_id: o for o in sched.update(step, *executor.run(step))}
    assert outs["p"].top_logprobs == [{0: 0.0, 1: 0.0, 2: 0.0}] and outs["m"].top_logprobs == []
    # Two more outputs for m: once it has min_tokens outputs, its eos/stop ids are no longer biased.
    for _ in range(2):
        step = sched.schedule()
        if step is None or "m" not in [r.request_id for r in step.seqs]:
            break
        header, a = build_plan(step, 0, 16)
        i = [r.request_id for r in step.seqs].index("m")
        n_out = len(step.seqs[i].output_ids)
        lo, hi = a["bias_offsets"][i], a["bias_offsets"][i + 1]
        assert (-np.inf in a["bias_values"][lo:hi].tolist()) == (n_out < 2)
        sched.update(step, *executor.run(step))


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_resumes_with_the_same_outputs(overlap: bool, caplog: pytest.LogCaptureFixture) -> None:
    # 3 sequences, blocks for about two: the latest arrival gets preempted and recomputes.
    caplog.set_level(logging.DEBUG, logger="services.scheduler.state")
    config = small_config(block_size=4, num_blocks=16, max_model_len=64, max_num_batched_tokens=64)
    params = [engine_params(max_tokens=30, seed=s, ignore_eos=True) for s in range(3)]
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7] for i in range(3)]
    sched = Scheduler(config)
    executor = FakeExecutor(sched)
    for i in range(3):
        sched.add(Request(f"s{i}", 0, np.array(prompts[i], np.int32), params[i]))
    outs = drive(sched, executor, overlap)
    assert sched.num_preemptions > 0 and (executor.num_placeholders > 0) == overlap
    preempted = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert len(preempted) == sched.num_preemptions and all(
        re.match(r"request s\d preempted at \d+ output", p) for p in preempted
    )
    for i in range(3):
        assert tokens_of(outs[f"s{i}"]) == reference_outputs(prompts[i], [], params[i], 64)
    assert_no_leaks(sched)


def test_finished_requests_report_vllms_engine_times_and_preemptions() -> None:
    """Each request the scheduler finishes leaves its preemptions and, where its first step and
    first token were here, its prefill and inference seconds for the metrics (vLLM's
    request_prefill_time / request_inference_time / request_num_preemptions); a request that came
    back with output (resubmitted) started elsewhere and reports no times."""
    config = small_config(block_size=4, num_blocks=16, max_model_len=64, max_num_batched_tokens=64)
    sched = Scheduler(config)
    executor = FakeExecutor(sched)
    for i in range(3):  # blocks for about two: the latest arrival is preempted
        sched.add(make_request(f"s{i}", [1 + i, 2, 3, 4, 5, 6, 7], max_tokens=30, ignore_eos=True))
    resubmitted = make_request("back", [9, 8, 7], max_tokens=4, ignore_eos=True)
    resubmitted.output_ids = [5, 6]
    sched.add(resubmitted)
    drive(sched, executor)
    times = list(sched.state.finished_times)
    assert len(times) == 4 and sum(t.num_preemptions for t in times) == sched.num_preemptions > 0
    timed = [t for t in times if t.prefill_s is not None]
    assert len(timed) == 3  # the resubmitted one has none
    assert all(0 <= t.prefill_s <= t.inference_s for t in timed)


def test_worker_loss_recomputes_and_ignores_the_lost_step() -> None:
    sched = Scheduler(small_config(block_size=4))
    executor = FakeExecutor(sched)
    params = engine_params(max_tokens=12, seed=5, ignore_eos=True)
    sched.add(Request("w", 0, np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32), params))
    got: list[RequestOutput] = []
    for _ in range(4):
        step = sched.schedule()
        got += sched.update(step, *executor.run(step))
    lost = sched.schedule()
    result = executor.run(lost)
    sched.preempt_all()
    executor.lose_kv()
    assert sched.num_waiting == 1 and sched.kv_usage == 0.0 and not sched.blocks.cached
    assert len(sched.update(lost, *result)) == 0  # the lost step's result arrives late: ignored
    step = sched.schedule()
    assert int(step.starts[0]) == 0 and int(step.num_new_tokens[0]) == 8 + 4  # prompt + outputs
    got += sched.update(step, *executor.run(step))
    got += drive(sched, executor).get("w", [])
    assert tokens_of(got) == reference_outputs([3, 1, 4, 1, 5, 9, 2, 6], [], params, 1024)


def test_priority_and_fcfs_order_admission() -> None:
    sched = Scheduler(small_config(max_num_seqs=2))
    sched.add(make_request("late-low", [1], priority=1))
    sched.add(make_request("first", [1], priority=0))
    sched.add(make_request("second", [1], priority=0))
    step = sched.schedule()
    assert [r.request_id for r in step.seqs] == ["first", "second"]
    assert sched.num_waiting == 1 and sched.num_running == 2


def test_config_rejects_a_pool_smaller_than_one_sequence() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler_config(block_size=16, num_blocks=4, max_model_len=128)


def test_overlap_plans_the_next_step_before_the_last_result() -> None:
    # Planning step N+1 before step N's result: a sequence whose sample is in flight decodes it
    # from a placeholder, a chunked prompt keeps going, a sample known to be the last (length)
    # is not planned ahead, and the results still apply in order.
    sched = Scheduler(small_config(max_num_batched_tokens=16))
    executor = FakeExecutor(sched)
    params = engine_params(max_tokens=6, seed=9, ignore_eos=True)
    sched.add(Request("d", 0, np.array([1, 2, 3], np.int32), params))
    sched.add(Request("c", 0, np.arange(1, 31, dtype=np.int32), params))
    got: dict[str, list[RequestOutput]] = {"d": [], "c": []}
    planned = {"d": 0, "c": 0}  # tokens computed
    in_flight: deque[tuple[ScheduledStep, tuple]] = deque()
    for _ in range(100):
        step = sched.schedule()
        if step is not None:
            sampling = {
                req.request_id
                for prev, _ in in_flight
                for req, is_sampled in zip(prev.seqs, prev.is_sampled, strict=True)
                if is_sampled
            }
            for j, req in enumerate(step.seqs):
                is_placeholder = j < step.num_decodes and bool(step.is_placeholder[j])
                assert is_placeholder == (req.request_id in sampling)
                planned[req.request_id] += int(step.num_new_tokens[j])
            in_flight.append((step, executor.run(step)))
        if not in_flight:
            break
        if len(in_flight) == 2 or step is None:
            done, result = in_flight.popleft()
            for out in sched.update(done, *result):
                got[out.request_id].append(out)
    assert not sched.has_work and executor.num_placeholders >= 8
    assert tokens_of(got["d"]) == reference_outputs([1, 2, 3], [], params, 1024)
    assert tokens_of(got["c"]) == reference_outputs(list(range(1, 31)), [], params, 1024)
    assert planned == {"d": 3 + 5, "c": 30 + 5}  # never a decode past the last output


def test_finish_while_planned_ahead_drops_what_followed() -> None:
    # The eos comes back while the next decode is already in flight: that decode's result never
    # reaches anyone, and the freed blocks go to the prefix cache with known tokens only.
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = next(
        p
        for p in (engine_params(max_tokens=40, seed=s) for s in range(1000))
        if 4 <= len(reference_outputs(prompt, [], p, 1024)) < 40
    )
    expected = reference_outputs(prompt, [], params, 1024)
    assert expected[-1] == EOS
    sched = Scheduler(small_config(block_size=4))
    executor = FakeExecutor(sched)
    pipeline = StepPipeline(sched, executor, on_failed=refuse_nothing)
    sched.add(Request("e", 0, np.array(prompt, np.int32), params))
    outputs = []
    while pipeline.has_work:
        out = pipeline.advance()
        if out is not None:
            outputs += list(out)
    assert tokens_of(outputs) == expected and outputs[-1].finish_reason == "stop"
    # One decode ran past the end (planned before the eos was known) and was dropped.
    assert executor.num_steps == len(expected) + 1 and executor.num_placeholders == len(expected)
    num_known = len(prompt) + len(expected)
    assert len(sched.blocks.cached) == num_known // 4
    assert_no_leaks(sched)


def test_worker_lost_with_two_steps_in_flight_recomputes() -> None:
    # The worker dies while the scheduler waits for step 0 and step 1 is queued behind it. Step
    # 1's placeholder decode counts its unknown input as computed, here the last token of a
    # block: preempting must not hash that block. Everything recomputes with the same outputs.
    sched = Scheduler(small_config(block_size=4))
    executor = FakeExecutor(sched)
    executor.die_at_step = 0
    pipeline = StepPipeline(sched, executor, on_failed=refuse_nothing)
    params = engine_params(max_tokens=10, seed=2, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10, 11]  # samples position 7; step 1 computes it, filling block 1
    sched.add(Request("a", 0, np.array(prompt, np.int32), params))
    with pytest.raises(WorkerLost):
        pipeline.advance()
    assert [entry.step_id for entry in pipeline.in_flight] == [1]
    pipeline.drop_in_flight()
    sched.preempt_all()
    executor.lose_kv()
    assert sched.num_waiting == 1 and not sched.blocks.cached
    outputs = drive(sched, executor, overlap=True)["a"]
    assert tokens_of(outputs) == reference_outputs(prompt, [], params, 1024)
    assert_no_leaks(sched)


def test_penalties_run_one_step_at_a_time() -> None:
    # A penalty history cannot end in an unknown token: while such a sequence runs, the pipeline
    # waits for each result before planning, and plans ahead again once it has left.
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    pipeline = StepPipeline(sched, executor, on_failed=refuse_nothing)
    plain = engine_params(max_tokens=12, seed=4, ignore_eos=True)
    penalized = engine_params(max_tokens=5, seed=5, ignore_eos=True, repetition_penalty=1.3)
    sched.add(Request("plain", 0, np.array([1, 2, 3], np.int32), plain))
    sched.add(Request("penalized", 0, np.array([4, 5, 6], np.int32), penalized))
    got: dict[str, list[RequestOutput]] = {"plain": [], "penalized": []}
    while pipeline.has_work:
        for out in pipeline.advance() or []:
            got[out.request_id].append(out)
        if "penalized" in sched.requests:
            assert not sched.can_plan_ahead and not pipeline.in_flight
    assert tokens_of(got["plain"]) == reference_outputs([1, 2, 3], [], plain, 1024)
    assert tokens_of(got["penalized"]) == reference_outputs([4, 5, 6], [], penalized, 1024)
    assert pipeline.num_planned_ahead > 0


def test_penalized_sequence_sits_out_a_step_planned_ahead() -> None:
    # The core alone, planning with a step in flight: the penalized sequence, whose history would
    # end in the unknown token, waits for its sample; the other one decodes on a placeholder.
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    params = engine_params(max_tokens=3, seed=4, ignore_eos=True)
    penalized = engine_params(max_tokens=3, seed=5, ignore_eos=True, presence_penalty=0.5)
    sched.add(Request("plain", 0, np.array([1, 2, 3], np.int32), params))
    sched.add(Request("penalized", 0, np.array([4, 5, 6], np.int32), penalized))
    first = sched.schedule()
    first_result = executor.run(first)
    ahead = sched.schedule()
    assert [r.request_id for r in ahead.seqs] == ["plain"] and ahead.is_placeholder.all()
    ahead_result = executor.run(ahead)
    sched.update(first, *first_result)
    sched.update(ahead, *ahead_result)
    step = sched.schedule()  # nothing in flight: both decode known tokens, in line order
    assert [r.request_id for r in step.seqs] == ["plain", "penalized"]
    assert not step.is_placeholder.any()


def test_min_tokens_counts_the_output_in_flight() -> None:
    # The eos ban of min_tokens covers outputs before the one sampled; planned ahead, that count
    # includes the output still in flight. Here the eos comes at the first output it may.
    prompt = [2, 7, 1, 8]
    params = next(
        p
        for p in (engine_params(max_tokens=20, min_tokens=3, seed=s) for s in range(10_000))
        if len(reference_outputs(prompt, [], p, 1024)) == 4
    )
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    sched.add(Request("m", 0, np.array(prompt, np.int32), params))
    outputs = drive(sched, executor, overlap=True)["m"]
    assert tokens_of(outputs) == reference_outputs(prompt, [], params, 1024)
    assert outputs[-1].new_token_ids == [EOS] and executor.num_placeholders >= 3


def test_refused_step_fails_its_requests_and_recomputes_the_next() -> None:
    # The worker refuses step 1 (a bug): its request fails. Step 2, planned ahead of it, decodes
    # from step 1's placeholders, so the worker refuses it too: the request that only joined
    # in step 2 is not at fault, recomputes, and completes as if nothing happened.
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    executor.refuse_step_ids = {1}
    failed: list[tuple[list[str], str]] = []

    def fail(requests: list[Request], error: str) -> None:  # as the scheduler process does
        failed.append(([r.request_id for r in requests], error))
        for req in requests:
            sched.abort(req.request_id)

    pipeline = StepPipeline(sched, executor, on_failed=fail)
    params = engine_params(max_tokens=8, seed=6, ignore_eos=True)
    sched.add(Request("bad", 0, np.array([1, 2, 3], np.int32), params))
    pipeline.advance()  # applies step 0; step 1 (bad's decode) is in flight
    sched.add(Request("good", 0, np.array([7, 8, 9], np.int32), params))
    outputs = []
    while pipeline.has_work:
        outputs += list(pipeline.advance() or [])
    assert [ids for ids, _ in failed] == [["bad"]] and "refused on purpose" in failed[0][1]
    assert {o.request_id for o in outputs} == {"good"}
    assert tokens_of(outputs) == reference_outputs([7, 8, 9], [], params, 1024)
    assert sched.num_preemptions == 1  # good, recomputed once
    assert_no_leaks(sched)


def test_a_refused_prefill_offers_the_prefix_cache_none_of_its_blocks() -> None:
    # Its blocks were planned full but never written: the same prompt again must compute them.
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    executor.refuse_step_ids = {0}

    def fail(requests: list[Request], error: str) -> None:  # as the scheduler process does
        for req in requests:
            sched.abort(req.request_id)

    pipeline = StepPipeline(sched, executor, on_failed=fail)
    params = engine_params(max_tokens=4, seed=6, ignore_eos=True)
    prompt = np.arange(1, 41, dtype=np.int32) % VOCAB
    sched.add(Request("refused", 0, prompt, params))
    while pipeline.has_work:
        assert not pipeline.advance()
    sched.add(Request("again", 0, prompt, params))
    outputs = []
    while pipeline.has_work:
        outputs += list(pipeline.advance() or [])
    assert outputs[0].num_cached_tokens == 0
    assert tokens_of(outputs) == reference_outputs(prompt.tolist(), [], params, 1024)
    assert_no_leaks(sched)


def test_decodes_entering_blocks_together_preempt_from_the_back() -> None:
    # Equal prompts decode in lockstep, so every sequence needs its next block in the same step;
    # with fewer blocks left than that, the back of the line is preempted and recomputes later.
    config = small_config(block_size=4, num_blocks=20, max_model_len=64, max_num_batched_tokens=64)
    params = [engine_params(max_tokens=20, seed=s, ignore_eos=True) for s in range(6)]
    prompts = [[1 + i, 2, 3, 4] for i in range(6)]
    sched = Scheduler(config)
    executor = FakeExecutor(sched)
    for i in range(6):
        sched.add(Request(f"s{i}", 0, np.array(prompts[i], np.int32), params[i]))
    outs: dict[str, list[RequestOutput]] = {}
    num_batched_grows = 0
    for _ in range(1000):
        step = sched.schedule()
        if step is None:
            break
        starts = step.starts[: step.num_decodes]
        num_batched_grows += int(np.count_nonzero(starts % 4 == 0) > 1)
        for out in sched.update(step, *executor.run(step)):
            outs.setdefault(out.request_id, []).append(out)
    assert not sched.has_work
    assert sched.num_preemptions > 0 and num_batched_grows > 0
    for i in range(6):
        assert tokens_of(outs[f"s{i}"]) == reference_outputs(prompts[i], [], params[i], 64)
    assert_no_leaks(sched)


def test_step_tokens_carry_each_output_over_the_wire() -> None:
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    sched.add(make_request("a", [1, 2, 3], max_tokens=2, ignore_eos=True, logprobs=2))
    sched.add(make_request("b", [4, 5, 6, 7], max_tokens=1, ignore_eos=True))
    for expected_finish in ({"a": None, "b": "length"}, {"a": "length"}):
        step = sched.schedule()
        outputs = sched.update(step, *executor.run(step))
        # What the scheduler process sends, decoded as the detokenizer decodes it.
        message = DETOKENIZER_INPUT.decode(DETOKENIZER_INPUT.encode(outputs.step_tokens()))
        assert isinstance(message, m.StepTokens)
        updates = message.to_updates()
        assert len(updates) == len(outputs) == len(expected_finish)
        for out, got in zip(outputs, updates, strict=True):
            assert out.finish_reason == expected_finish[out.request_id]
            assert got.request_id == out.request_id and got.tokenizer_id == out.tokenizer_id
            assert got.start_index == out.start_index
            assert m.unpack_ids(got.token_ids).tolist() == out.new_token_ids
            assert np.frombuffer(got.logprobs, "<f4").tolist() == out.logprobs
            assert got.top_logprobs == out.top_logprobs and got.finish_reason == out.finish_reason
            assert got.prompt_tokens == out.num_prompt_tokens and got.cached_tokens == out.num_cached_tokens
    assert not sched.has_work


def first_outputs(num_requests: int) -> tuple[Scheduler, list[Request], StepOutputs]:
    """A scheduler after the first step of `num_requests` short prompts (each samples its first token)."""
    sched = Scheduler(small_config())
    executor = FakeExecutor(sched)
    requests = [
        make_request(f"r{i}", [1, 2, 3 + i], max_tokens=3, ignore_eos=True) for i in range(num_requests)
    ]
    for req in requests:
        sched.add(req)
    step = sched.schedule()
    return sched, requests, sched.update(step, *executor.run(step))


def test_detokenizer_messages_group_by_shard_and_resend_full_histories() -> None:
    sched, requests, outputs = first_outputs(6)
    needs_full_history = {"r1": requests[1], "r4": requests[4]}
    messages = detokenizer_messages(outputs, needs_full_history, 3)
    assert not needs_full_history  # taken out once sent
    sent_list = [
        (u.request_id, (shard, u)) for shard, ms in messages.items() for msg in ms for u in msg.to_updates()
    ]
    sent = dict(sent_list)
    assert len(sent_list) == len(sent) == len(requests)  # each exactly once
    assert set(sent) == {r.request_id for r in requests}
    for rid, (shard, update) in sent.items():
        assert shard == shard_of(rid, 3)
        if rid in ("r1", "r4"):
            assert update.start_index == 0 and update.params is not None
            assert m.unpack_ids(update.token_ids).tolist() == sched.requests[rid].output_ids
        else:
            assert update.params is None and len(update.token_ids) == 4
            assert update.start_index == 0 and update.token_ids == m.pack_ids(sched.requests[rid].output_ids)


def test_detokenizer_messages_one_shard_sends_full_histories_only_for_this_steps_requests() -> None:
    # Requests wait in needs_full_history until their first token: others must not leave it.
    _, requests, outputs = first_outputs(3)
    waiting = make_request("w", [4, 5], max_tokens=3)
    needs_full_history = {"w": waiting}
    messages = detokenizer_messages(outputs, needs_full_history, 1)
    assert list(messages) == [0] and len(messages[0]) == 1
    assert messages[0][0].request_ids == ["r0", "r1", "r2"]
    assert needs_full_history == {"w": waiting}
    needs_full_history["r1"] = requests[1]
    batch, columns = detokenizer_messages(outputs, needs_full_history, 1)[0]
    assert isinstance(batch, m.TokenBatch) and [u.request_id for u in batch.updates] == ["r1"]
    assert isinstance(columns, m.StepTokens) and columns.request_ids == ["r0", "r2"]
    assert needs_full_history == {"w": waiting}


def test_a_full_history_carries_the_logprobs_of_every_token_its_step_verified() -> None:
    """A request's first step may verify proposals (its last prompt token, a one-token chunk, and
    what the n-gram lookup found in the prompt) and emit several tokens at once: its whole history
    goes then, and no receiver has any of those tokens' logprobs. Only tokens from before the step
    (a resumed request's) go as NaN and {}."""
    fresh = make_request("fresh", [1, 2, 3], max_tokens=8, logprobs=1)
    resumed = make_request("resumed", [1, 2, 3], max_tokens=8, logprobs=1)
    fresh.output_ids = [7, 8, 9]  # all three emitted by this step
    resumed.output_ids = [5, 6, 7, 8, 9]  # 5, 6 before it (the receivers have them)
    logprobs = [-0.5, -0.25, -0.125]
    tops = [[{7: -0.5}], [{8: -0.25}], [{9: -0.125}]]
    outputs = StepOutputs(
        ["fresh"] * 3 + ["resumed"] * 3,
        [0] * 6,
        np.array([0, 1, 2, 2, 3, 4], np.int32),
        np.array([7, 8, 9] * 2, np.int32),
        np.array(logprobs * 2, np.float32),
        tops * 2,
        [None, None, "length"] * 2,
        [3] * 6,
        [0] * 6,
    )
    (batch,) = detokenizer_messages(outputs, {"fresh": fresh, "resumed": resumed}, 1)[0]
    assert isinstance(batch, m.TokenBatch)
    updates = {u.request_id: u for u in batch.updates}
    assert np.frombuffer(updates["fresh"].logprobs, "<f4").tolist() == logprobs
    assert updates["fresh"].top_logprobs == [{7: -0.5}, {8: -0.25}, {9: -0.125}]
    got = np.frombuffer(updates["resumed"].logprobs, "<f4")
    assert np.isnan(got[:2]).all() and got[2:].tolist() == logprobs
    assert updates["resumed"].top_logprobs == [{}, {}, {7: -0.5}, {8: -0.25}, {9: -0.125}]
    assert updates["fresh"].finish_reason == updates["resumed"].finish_reason == "length"


def test_max_tokens_none_runs_to_max_model_len() -> None:
    # The tokenizer fills in its default; a request that still has none is bounded by the model.
    sched = Scheduler(small_config(max_model_len=40, num_blocks=8))
    executor = FakeExecutor(sched)
    sched.add(make_request("n", [1, 2, 3, 4, 5], ignore_eos=True))
    outs = drive(sched, executor)["n"]
    assert len(tokens_of(outs)) == 40 - 5 and outs[-1].finish_reason == "length"
    assert_no_leaks(sched)
