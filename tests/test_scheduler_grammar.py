"""Structured output in the scheduler core, without processes (services/scheduler/grammars.py and
its hooks in admission, decode, plan and results): the real grammar engine over SmolLM2's
tokenizer, and a fake worker that samples, seeded by (seed, position), among the tokens the plan's
bitmask allows. Outputs are validated with `jsonschema` and `re`; the bitmask rows are checked
against a matcher rebuilt independently from each request's output so far."""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest
from tokenizers import Tokenizer

from ipc.messages import PLACEHOLDER_TOKEN, ResultHeader, SamplingParams, StructuredOutput
from ipc.sampling_defaults import fill_defaults
from ipc.step_plan import STEP_PLAN, Dim, vocab_words
from services.common.grammar_compiler import (
    GrammarBudgets,
    GrammarCompiler,
    load_grammar_tokenizer,
    parser_limits,
)
from services.scheduler.core import Scheduler
from services.scheduler.grammar_matcher import BitmaskFiller, GrammarMatcher
from services.scheduler.grammars import Grammars
from services.scheduler.pipeline import StepPipeline
from services.scheduler.plan import ScheduledStep, build_plan, write_plan
from services.scheduler.proposers import DraftModelProposer
from services.scheduler.request import Request, RequestStatus
from tests.test_scheduler_core import scheduler_config

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "c": {"enum": ["x", "yz"]},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "c"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredOutput("json", json.dumps(SCHEMA))
REGEX = r"[ab]{2,4}-[0-9]"
REGEX_SPEC = StructuredOutput("regex", REGEX)
BAD_SPEC = StructuredOutput("json", json.dumps({"type": "array", "uniqueItems": True}))
BLOCK = 4


@pytest.fixture(scope="module")
def model(smollm2_dir: Path) -> dict:
    config = json.loads((smollm2_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    return {
        "dir": smollm2_dir,
        "vocab": config["vocab_size"],
        "eos": eos if isinstance(eos, list) else [eos],
        "hf": Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")),
    }


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_grammar_tokenizer(model["dir"], model["vocab"], model["eos"])


def make_core(model, tokenizer, grammars: Grammars | None = None, **overrides: object) -> Scheduler:
    values = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "block_size": BLOCK,
        "num_blocks": 256,
        "max_model_len": 256,
        "eos_token_ids": tuple(model["eos"]),
        "vocab_size": model["vocab"],
    }
    return Scheduler(
        scheduler_config(**{**values, **overrides}),
        grammars or Grammars(GrammarCompiler(tokenizer), model["vocab"]),
    )


def request(
    rid: str, spec: StructuredOutput | None, output_ids: list[int] | None = None, **params
) -> Request:
    params.setdefault("max_tokens", 40)
    params.setdefault("seed", sum(map(ord, rid)))
    prompt = np.arange(1, 6 + len(rid), dtype=np.int32)
    return Request(rid, 0, prompt, fill_defaults(SamplingParams(structured=spec, **params)), output_ids)


def allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])


class MaskedWorker:
    """Runs plans like a worker that samples under the grammar bitmask: a masked row picks, by a
    hash of (seed, position), one of the tokens its bitmask row allows, eos first where it may (so
    walks end); an unmasked row picks a plain token. Neither picks a token its logit bias bans
    (-inf). Also checks every plan's grammar arrays, and keeps each mask row's tokens."""

    def __init__(self, model: dict) -> None:
        self.vocab = model["vocab"]
        self.eos = model["eos"]
        self.results: deque[tuple[ResultHeader, dict[str, np.ndarray]]] = deque()
        self.num_masked_rows = 0
        self.num_placeholder_rows_constrained = 0
        self.masks: list[tuple[str, set[int]]] = []  # (request id, allowed tokens) of each mask row

    def publish(self, step_id: int, step: ScheduledStep) -> None:
        header, a = build_plan(step, step_id, BLOCK)
        sizes = STEP_PLAN.check(
            a,
            {
                Dim.TOKENS: header.num_tokens,
                Dim.ROWS: header.num_seqs,
                Dim.VOCAB_WORDS: vocab_words(self.vocab),
            },
        )
        masks = {}
        bans = {}
        for i in range(header.num_seqs):
            span = slice(a["bias_offsets"][i], a["bias_offsets"][i + 1])
            banned = a["bias_ids"][span][a["bias_values"][span] == -np.inf]
            if len(banned):
                bans[i] = set(banned.tolist())
        if "grammar_rows" in a:
            assert sizes[Dim.CONSTRAINED] == len(a["grammar_rows"]) > 0
            assert a["is_sampled"][a["grammar_rows"]].all()
            for i, row in zip(a["grammar_rows"].tolist(), a["grammar_bitmask"], strict=True):
                masks[i] = allowed(row, self.vocab)
                self.masks.append((step.seqs[i].request_id, set(masks[i].tolist())))
                if i < step.num_decodes and a["input_ids"][i] == PLACEHOLDER_TOKEN:
                    self.num_placeholder_rows_constrained += 1
        sampled = np.full(header.num_seqs, -1, np.int32)
        for i in np.flatnonzero(a["is_sampled"]).tolist():
            position = int(a["sample_positions"][i])
            h = (int(a["seeds"][i]) * 1_000_003 + position * 7919) % 2**31
            if i in masks:
                ok = np.setdiff1d(masks[i], list(bans.get(i, ())))
                assert len(ok), "an all-zero bitmask row"
                eos_ok = [e for e in self.eos if e in set(ok.tolist())]
                sampled[i] = eos_ok[0] if eos_ok and h % 3 else ok[h % len(ok)]
                self.num_masked_rows += 1
            else:
                sampled[i] = 100 + h % 1000
                while sampled[i] in bans.get(i, ()):
                    sampled[i] += 1
        arrays = {
            "sampled_ids": sampled,
            "sampled_logprobs": np.zeros(header.num_seqs, np.float32),
            "top_ids": np.zeros((header.num_seqs, 0), np.int32),
            "top_logprobs": np.zeros((header.num_seqs, 0), np.float32),
        }
        self.results.append((ResultHeader(step_id, header.num_seqs), arrays))

    @contextmanager
    def result(self) -> Iterator[tuple[ResultHeader, dict[str, np.ndarray]]]:
        yield self.results.popleft()


def drive(core: Scheduler, worker: MaskedWorker, overlap: bool = True, max_steps: int = 2000) -> dict:
    """Run the core through a pipeline until it is idle; the outputs and finish of each request,
    and the failures that `poll_grammars` and the steps reported."""
    pipeline = StepPipeline(core, worker, on_failed=lambda reqs, error: pytest.fail(error), overlap=overlap)
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    failed: dict[str, str] = {}
    deadline = time.monotonic() + 120
    for _ in range(max_steps):
        done, bad = core.poll_grammars()
        finished.update((r.request_id, r.finish_reason) for r in done)
        failed.update((r.request_id, error) for r, error in bad)
        if not pipeline.has_work:
            break
        step = pipeline.advance()
        if step is None:
            assert time.monotonic() < deadline, "compiles never finished"
            time.sleep(0.002)
            continue
        failed.update((f.request_id, f"{f.code}: {f.message}") for f in step.failures)
        for out in step:
            if out.request_id in failed:
                continue
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert not pipeline.has_work, "the core never went idle"
    return {"outputs": outputs, "finished": finished, "failed": failed}


def text(model, tokens: list[int]) -> str:
    return model["hf"].decode([t for t in tokens if t not in model["eos"]])


def test_constrained_outputs_follow_their_grammar_while_others_run_free(model, tokenizer):
    core = make_core(model, tokenizer)
    worker = MaskedWorker(model)
    reqs = [
        request("json-1", JSON_SPEC),
        request("plain", None, max_tokens=12),
        request("json-2", JSON_SPEC),
        request("regex", REGEX_SPEC),
    ]
    for req in reqs:
        assert core.add(req) is None
    got = drive(core, worker)
    assert got["finished"] == {"json-1": "stop", "plain": "length", "json-2": "stop", "regex": "stop"}
    for rid in ("json-1", "json-2"):
        jsonschema.validate(json.loads(text(model, got["outputs"][rid])), SCHEMA)
    assert re.fullmatch(REGEX, text(model, got["outputs"]["regex"]))
    assert len(got["outputs"]["plain"]) == 12
    assert worker.num_masked_rows > 0 and worker.num_placeholder_rows_constrained == 0
    assert core.table.num_grammar_rows == 0 and not core.table.constrained.any()


def test_bitmask_rows_are_those_of_a_matcher_rebuilt_from_the_outputs(model, tokenizer):
    """Each plan's bitmask row for a request equals the mask of a matcher built independently
    from that request's outputs so far; the unconstrained row has no bitmask row."""
    core = make_core(model, tokenizer)
    compiled = GrammarCompiler(tokenizer).compile_now(JSON_SPEC)
    core.add(request("plain", None, max_tokens=6))
    core.add(request("json", JSON_SPEC))
    while core.num_compiling:
        core.poll_grammars()
        time.sleep(0.002)
    worker = MaskedWorker(model)
    num_checked = 0
    while core.has_work:
        step = core.schedule()
        assert step is not None
        _, plan = build_plan(step, 0, BLOCK)
        seqs = {req.request_id: i for i, req in enumerate(step.seqs)}
        json_req = core.requests.get("json")
        if json_req is not None and step.is_sampled[seqs["json"]]:
            assert plan["grammar_rows"].tolist() == [seqs["json"]]
            expected = np.zeros((1, vocab_words(model["vocab"])), np.int32)
            GrammarMatcher(compiled, json_req.output_ids).fill(expected, 0)
            assert np.array_equal(plan["grammar_bitmask"], expected)
            num_checked += 1
        else:
            assert "grammar_rows" not in plan and "grammar_bitmask" not in plan
        worker.publish(0, step)
        with worker.result() as (_, arrays):
            core.update(step, arrays["sampled_ids"], arrays["sampled_logprobs"])
    assert num_checked >= 3


def test_write_plan_fills_the_bitmask_in_the_slot_itself(model, tokenizer):
    core = make_core(model, tokenizer)
    core.add(request("json", JSON_SPEC))
    while core.num_compiling:
        core.poll_grammars()
        time.sleep(0.002)
    step = core.schedule()

    class Slot(dict):
        def put(self, name, array):
            self[name] = array.copy()

        def alloc(self, name, dtype, shape):
            self[name] = np.full(shape, -7, dtype)  # not zeros: every word must be written
            return self[name]

    slot = Slot()
    write_plan(step, 0, BLOCK, slot)
    _, expected = build_plan(step, 0, BLOCK)
    assert slot["grammar_rows"].tolist() == expected["grammar_rows"].tolist() == [0]
    assert np.array_equal(slot["grammar_bitmask"], expected["grammar_bitmask"])
    assert not core.can_plan_ahead  # a constrained row runs: no step planned ahead of its sample


def test_a_request_waits_for_its_compile_without_holding_up_others(model, tokenizer):
    core = make_core(model, tokenizer)
    core.add(request("json", JSON_SPEC))
    core.add(request("plain", None, max_tokens=4))
    if core.num_compiling:  # the usual case: a new schema compiles on the compiler's thread
        assert core.requests["json"].status is RequestStatus.COMPILING
        step = core.schedule()
        assert [r.request_id for r in step.seqs] == ["plain"]
    # A second request with the same constraint finds it cached: queued at once.
    while core.num_compiling:
        core.poll_grammars()
        time.sleep(0.002)
    core.add(request("json-again", JSON_SPEC))
    assert core.requests["json-again"].status is RequestStatus.WAITING
    assert core.num_compiling == 0


def test_an_uncompilable_constraint_fails_alone(model, tokenizer):
    core = make_core(model, tokenizer)
    core.add(request("json", JSON_SPEC))
    core.add(request("bad", BAD_SPEC))
    core.add(request("plain", None, max_tokens=5))
    got = drive(core, MaskedWorker(model))
    assert set(got["failed"]) == {"bad"} and "structured.json:" in got["failed"]["bad"]
    assert "uniqueItems" in got["failed"]["bad"]
    assert got["finished"] == {"json": "stop", "plain": "length"}
    # Now cached as a failure: refused at once, naming the field.
    with pytest.raises(ValueError, match=r"structured\.json: .*uniqueItems"):
        core.add(request("bad-again", BAD_SPEC))
    assert "bad-again" not in core.requests


@pytest.mark.parametrize("cause", ["mask_budget", "engine_limit", "no_finite_match"])
def test_a_constraint_too_costly_to_generate_fails_alone_with_its_reason(model, tokenizer, cause):
    """`(a{600}){611}` under llguidance's own limits takes 0.15-0.3 s per mask (every other
    request's step waited for it); under a lower lexer fuel the engine gives up on its first
    token. Either way it used to finish "error" with no reason, or not at all; now it fails alone,
    with its reason, and the others run to their ends. A grammar with no finite match passes the
    compile and fails at its first token on the engine's item limit: the constraint's fault too
    (it was an "internal" failure, a 500)."""
    constraint = StructuredOutput("regex", "(a{600}){611}")
    if cause == "mask_budget":
        limits, filler = llguidance.LLParserLimits(), BitmaskFiller(budget_s=0.05)
        reason = r"invalid_request: structured\.regex: too complex: .* \(structured\.mask_timeout_ms\)"
    elif cause == "no_finite_match":
        limits, filler = llguidance.LLParserLimits(), BitmaskFiller()
        constraint = StructuredOutput("grammar", 'root ::= "a" root')
        reason = r"invalid_request: structured\.grammar: while generating: .* refused by the grammar: parser error: Too many items.*"
    else:
        limits, filler = parser_limits(), BitmaskFiller()
        reason = r"invalid_request: structured\.regex: while generating: token \d+ at output position 0 refused by the grammar: lexer error: too many expressions constructed"
    budgets = GrammarBudgets(compile_timeout_s=120, max_grammar_bytes=1 << 40, limits=limits)
    grammars = Grammars(GrammarCompiler(tokenizer, budgets=budgets), model["vocab"], filler)
    core = make_core(model, tokenizer, grammars)
    core.add(request("json", JSON_SPEC))
    core.add(request("slow", constraint))
    core.add(request("plain", None, max_tokens=5))
    got = drive(core, MaskedWorker(model))
    assert set(got["failed"]) == {"slow"}
    assert re.fullmatch(reason, got["failed"]["slow"]), got["failed"]["slow"]
    assert got["finished"] == {"json": "stop", "plain": "length"}
    jsonschema.validate(json.loads(text(model, got["outputs"]["json"])), SCHEMA)
    assert "slow" not in core.requests and core.table.num_grammar_rows == 0


def test_a_cut_off_output_is_a_length_finish(model, tokenizer):
    core = make_core(model, tokenizer)
    core.add(request("json", JSON_SPEC, max_tokens=3))
    got = drive(core, MaskedWorker(model))
    assert got["finished"] == {"json": "length"} and len(got["outputs"]["json"]) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(text(model, got["outputs"]["json"]))


@pytest.mark.parametrize("cut", [1, 4, 7])
def test_a_resubmission_continues_exactly_like_the_calm_run(model, tokenizer, cut):
    """A new scheduler (a restart: empty cache) given the outputs so far continues with the same
    tokens as a run that was never interrupted; outputs that already complete the grammar finish
    at once."""
    calm_core = make_core(model, tokenizer)
    calm_core.add(request("json", JSON_SPEC))
    calm = drive(calm_core, MaskedWorker(model))
    tokens = calm["outputs"]["json"]
    assert calm["finished"] == {"json": "stop"} and len(tokens) > cut
    core = make_core(model, tokenizer)
    core.add(request("json", JSON_SPEC, output_ids=tokens[:cut]))
    resumed = drive(core, MaskedWorker(model))
    assert tokens[:cut] + resumed["outputs"]["json"] == tokens
    assert resumed["finished"] == {"json": "stop"}
    done = make_core(model, tokenizer)
    complete = [t for t in tokens if t not in model["eos"]]
    finished = done.add(request("json", JSON_SPEC, output_ids=complete))
    if finished is None:  # compiling: poll tells it is complete
        got = drive(done, MaskedWorker(model))
        assert got["finished"] == {"json": "stop"} and not got["outputs"]
    else:
        assert finished.finish_reason == "stop" and finished.new_token_ids == []


def test_outputs_from_history_that_break_the_grammar_are_refused(model, tokenizer):
    core = make_core(model, tokenizer)
    bad_history = model["hf"].encode("not json").ids
    core.add(request("json", JSON_SPEC))  # warm the cache
    drive(core, MaskedWorker(model))
    with pytest.raises(ValueError, match="output_ids do not follow the constraint"):
        core.add(request("resumed", JSON_SPEC, output_ids=bad_history))


def grammar_tokens(model, compiled, text: str) -> list[int]:
    """`text` as tokens the grammar takes: at each position the longest allowed token that
    continues it (the grammar fixes its own tokenization of separators)."""
    matcher = GrammarMatcher(compiled)
    mask = np.zeros((1, vocab_words(model["vocab"])), np.int32)
    tokens: list[int] = []
    while text:
        matcher.fill(mask, 0)
        pieces = {int(t): model["hf"].decode([int(t)]) for t in allowed(mask[0], model["vocab"])}
        token = max(
            (t for t, piece in pieces.items() if piece and text.startswith(piece)),
            key=lambda t: len(pieces[t]),
        )
        tokens.append(token)
        matcher.advance((token,))
        text = text[len(pieces[token]) :]
    return tokens


class ListedProposer:
    """Proposes `proposals[len(token_ids)]` (nothing for other lengths)."""

    num_tokens = 4
    drafts_in_worker = False

    def __init__(self, proposals: dict[int, list[int]]) -> None:
        self.proposals = proposals

    def propose(self, token_ids: np.ndarray, limit: int) -> np.ndarray:
        return np.array(self.proposals.get(len(token_ids), [])[:limit], np.int32)


def test_a_constrained_decode_verifies_what_its_grammar_allows_with_a_mask_per_position(model, tokenizer):
    """Speculative decoding of a constrained request: proposals are cut at the first token the
    grammar refuses, and the plan names the verifying row once per verified position, each
    bitmask row the mask of a matcher built independently from the outputs and the proposals
    before that position."""
    compiled = GrammarCompiler(tokenizer).compile_now(JSON_SPEC)
    target = grammar_tokens(model, compiled, '{"n": 12, "c": "yz", "ok": true}')
    bad = model["hf"].token_to_id("Z")
    assert GrammarMatcher(compiled, target[:5]).num_valid(np.array([bad])) == 0  # "Z" cannot follow
    req = request("json", JSON_SPEC, output_ids=target[:2], max_tokens=30)
    prompt_len = req.num_prompt_tokens
    # After the prefill samples target[2]: two right tokens, then "Z", then a right one again.
    proposer = ListedProposer({prompt_len + 3: [target[3], target[4], bad, target[5]]})
    core = make_core(model, tokenizer, proposer=proposer)
    core.add(req)
    while core.num_compiling:
        core.poll_grammars()
        time.sleep(0.002)
    prefill = core.schedule()
    assert prefill is not None and not prefill.proposals
    core.update(prefill, np.array([target[2]], np.int32), np.zeros(1, np.float32))

    step = core.schedule()
    assert step is not None and [p.tolist() for p in step.proposals] == [[target[3], target[4]]]
    _, plan = build_plan(step, 1, BLOCK)
    assert plan["num_proposed"].tolist() == [2] and plan["grammar_rows"].tolist() == [0, 0, 0]
    expected = np.zeros((3, vocab_words(model["vocab"])), np.int32)
    for i in range(3):
        GrammarMatcher(compiled, target[: 3 + i]).fill(expected, i)
    assert np.array_equal(plan["grammar_bitmask"], expected)
    assert not np.array_equal(expected[0], expected[1])  # the masks do differ along the span
    assert core.requests["json"].grammar.num_tokens == 3  # the span's masks left the matcher where it was


def test_a_constrained_decode_takes_no_draft_model_places(model, tokenizer):
    """A draft model's tokens exist only in the worker, and a span's masks are the scheduler's:
    a constrained request decodes one token per step beside an unconstrained one that drafts."""
    core = make_core(model, tokenizer, proposer=DraftModelProposer(num_tokens=4))
    core.add(request("json", JSON_SPEC))
    core.add(request("plain", None))
    while core.num_compiling:
        core.poll_grammars()
        time.sleep(0.002)
    prefill = core.schedule()
    assert prefill is not None and len(prefill.seqs) == 2
    first = model["hf"].encode("{", add_special_tokens=False).ids
    core.update(prefill, np.array([first[0], 7], np.int32), np.zeros(2, np.float32))
    step = core.schedule()
    assert step is not None and step.num_decodes == 1
    assert [req.request_id for req in step.seqs] == ["json", "plain"] and len(step.proposals) == 1


# -- allowed_token_ids and bad_words ------------------------------------------------------------


def packed(tokens, vocab: int) -> np.ndarray:
    """The bitmask row allowing `tokens`, packed independently of the scheduler's code."""
    bits = np.zeros(vocab_words(vocab) * 32, np.uint8)
    bits[list(tokens)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_allowed_token_ids_mask_every_sampled_row_and_decode_ahead(model, tokenizer):
    """A request with allowed_token_ids gets the same mask row at every sampled position, exactly
    its ids, and samples nothing else; the mask does not depend on the last token, so its decodes
    are planned ahead of their samples (placeholders) as a plain request's are."""
    core = make_core(model, tokenizer)
    ids = [5, 17, 300, 4000, 17]
    core.add(request("allowed", None, allowed_token_ids=ids, max_tokens=20))
    core.add(request("plain", None, max_tokens=12))
    worker = MaskedWorker(model)
    got = drive(core, worker)
    assert got["finished"] == {"allowed": "length", "plain": "length"}
    assert len(got["outputs"]["allowed"]) == 20 and set(got["outputs"]["allowed"]) <= set(ids)
    rows = [tokens for rid, tokens in worker.masks if rid == "allowed"]
    assert len(rows) == 20 and all(tokens == set(ids) for tokens in rows)
    assert not any(rid == "plain" for rid, _ in worker.masks)
    assert worker.num_placeholder_rows_constrained > 0  # decoded ahead, with its mask
    assert core.table.num_allowed_rows == 0 and not core.table.allowed.any()


def test_a_grammar_with_allowed_token_ids_masks_with_both(model, tokenizer):
    """Each bitmask row of a constrained request with allowed_token_ids is its grammar's mask
    (a matcher rebuilt independently from the outputs so far) AND its allowed tokens; the output
    follows the schema in allowed tokens only."""
    compiled = GrammarCompiler(tokenizer).compile_now(JSON_SPEC)
    # Every token but those with a digit above 2 in their text: "n" is written in 0, 1 and 2.
    hf = model["hf"]
    ids = [t for t in range(model["vocab"]) if not set(hf.decode([t])) & set("3456789")]
    assert 40_000 < len(ids) < model["vocab"]
    core = make_core(model, tokenizer)
    core.add(request("json", JSON_SPEC, allowed_token_ids=ids))
    while core.num_compiling:
        core.poll_grammars()
        time.sleep(0.002)
    worker = MaskedWorker(model)
    outputs: list[int] = []
    while core.has_work:
        step = core.schedule()
        assert step is not None
        _, plan = build_plan(step, 0, BLOCK)
        expected = np.zeros((1, vocab_words(model["vocab"])), np.int32)
        GrammarMatcher(compiled, outputs).fill(expected, 0)
        expected &= packed(ids, model["vocab"])
        assert plan["grammar_rows"].tolist() == [0] and np.array_equal(plan["grammar_bitmask"], expected)
        worker.publish(0, step)
        with worker.result() as (_, arrays):
            out = core.update(step, arrays["sampled_ids"], arrays["sampled_logprobs"])
        assert not out.failures
        outputs += [o.new_token_ids[0] for o in out]
    assert set(outputs) <= set(ids) and len(outputs) > 5
    value = json.loads(text(model, outputs))
    jsonschema.validate(value, SCHEMA)
    assert set(str(value["n"])) <= set("012")


def test_allowed_token_ids_that_no_grammar_token_satisfies_fail_that_request_alone(model, tokenizer):
    """Where the grammar and allowed_token_ids together allow nothing, the request fails saying
    so (its field first, where the gateway reads it), its token goes nowhere, and the others run
    on; the worker is never given an all-zero row."""
    digits = [model["hf"].token_to_id(d) for d in "123"]
    core = make_core(model, tokenizer)
    core.add(request("json", JSON_SPEC))
    core.add(request("digits", JSON_SPEC, allowed_token_ids=digits))
    core.add(request("plain", None, max_tokens=5))
    got = drive(core, MaskedWorker(model))
    assert got["failed"] == {
        "digits": "invalid_request: allowed_token_ids: no token is left to sample at output position 0: "
        "allowed_token_ids and structured.json together allow none"
    }
    assert "digits" not in got["outputs"] and "digits" not in core.requests
    assert got["finished"] == {"json": "stop", "plain": "length"}
    assert core.table.num_allowed_rows == 0 and core.table.num_grammar_rows == 0


def test_allowed_eos_is_held_back_until_min_tokens(model, tokenizer):
    """Under min_tokens the plan's bias bans eos and the stop ids in the row that allowed_token_ids
    mask: a worker that takes eos wherever it may still writes min_tokens tokens first (each the
    other allowed one), then ends on eos; a stop id among the allowed ends a request the same way."""
    eos = model["eos"][0]
    core = make_core(model, tokenizer)
    core.add(request("eos", None, allowed_token_ids=[eos, 7], min_tokens=3, max_tokens=30))
    core.add(
        request("stop-id", None, allowed_token_ids=[9, 7], stop_token_ids=[9], min_tokens=2, max_tokens=30)
    )
    worker = PreferringWorker(model, {})
    worker.prefer = {req.seed: [eos] if rid == "eos" else [9] for rid, req in core.requests.items()}
    got = drive(core, worker)
    assert got["outputs"]["eos"] == [7, 7, 7, eos] and got["finished"]["eos"] == "stop"
    assert got["outputs"]["stop-id"] == [7, 7, 9] and got["finished"]["stop-id"] == "stop"


def test_allowed_token_ids_that_leave_nothing_to_sample_are_refused_at_admission(model, tokenizer):
    eos = model["eos"][0]
    core = make_core(model, tokenizer)
    with pytest.raises(
        ValueError,
        match=r"^allowed_token_ids: every allowed token is eos or a stop token id, which min_tokens",
    ):
        core.add(request("eos-only", None, allowed_token_ids=[eos], min_tokens=2))
    with pytest.raises(
        ValueError, match=r"^allowed_token_ids: every allowed token is eos or a stop token id"
    ):
        core.add(request("stops", None, allowed_token_ids=[7, eos], stop_token_ids=[7], min_tokens=1))
    with pytest.raises(ValueError, match=r"^allowed_token_ids: bad_words ban every allowed token"):
        core.add(request("banned", None, allowed_token_ids=[7, 8], bad_words_ids=[[7], [8], [9, 10]]))
    assert not core.requests
    core.add(request("ignore-eos", None, allowed_token_ids=[eos], min_tokens=2, ignore_eos=True))
    core.add(request("eos-later", None, allowed_token_ids=[eos], min_tokens=2, output_ids=[eos, eos]))
    core.add(request("one-left", None, allowed_token_ids=[7, 8], bad_words_ids=[[7]]))
    assert set(core.requests) == {"ignore-eos", "eos-later", "one-left"}
    unknown = Scheduler(scheduler_config(max_num_seqs=8, block_size=BLOCK, num_blocks=256, max_model_len=256))
    with pytest.raises(ValueError, match=r"^allowed_token_ids: this engine does not know its vocabulary"):
        unknown.add(request("x", None, allowed_token_ids=[7]))


def banned_by(bad_words: list[list[int]], outputs: list[int]) -> set[int]:
    """vLLM's rule, written out again: a word's last token is banned where the output ends with
    the word's other tokens (a one-token word everywhere)."""
    return {
        w[-1]
        for w in bad_words
        if len(w) - 1 <= len(outputs) and outputs[len(outputs) - len(w) + 1 :] == w[:-1]
    }


class PreferringWorker(MaskedWorker):
    """Samples each row's `prefer[seed]` token for its output position (cycling) unless the
    plan's bias bans it (-inf) or its mask refuses it; then the least token its mask allows and
    its bias does not ban, or without a mask 900 + the position. Records the bans each sampled
    row's plan gave it."""

    def __init__(self, model: dict, prefer: dict[int, list[int]]) -> None:
        super().__init__(model)
        self.prefer = prefer
        self.bans: list[tuple[int, int, set[int]]] = []  # (seed, output position, banned)

    def publish(self, step_id: int, step: ScheduledStep) -> None:
        header, a = build_plan(step, step_id, BLOCK)
        masks = dict(
            zip(
                a.get("grammar_rows", np.zeros(0, np.int32)).tolist(),
                a.get("grammar_bitmask", []),
                strict=True,
            )
        )
        sampled = np.full(header.num_seqs, -1, np.int32)
        for i in np.flatnonzero(a["is_sampled"]).tolist():
            span = slice(a["bias_offsets"][i], a["bias_offsets"][i + 1])
            banned = set(a["bias_ids"][span][a["bias_values"][span] == -np.inf].tolist())
            if i in masks:
                banned |= set(range(self.vocab)) - set(allowed(masks[i], self.vocab).tolist())
            seed, position = (
                int(a["seeds"][i]),
                int(a["sample_positions"][i]) - step.seqs[i].num_prompt_tokens,
            )
            self.bans.append((seed, position, banned))
            want = self.prefer[seed][position % len(self.prefer[seed])]
            if want not in banned:
                sampled[i] = want
            elif i in masks:
                sampled[i] = min(set(allowed(masks[i], self.vocab).tolist()) - banned)
            else:
                sampled[i] = 900 + position
        self.results.append(
            (
                ResultHeader(step_id, header.num_seqs),
                {
                    "sampled_ids": sampled,
                    "sampled_logprobs": np.zeros(header.num_seqs, np.float32),
                    "top_ids": np.zeros((header.num_seqs, 0), np.int32),
                    "top_logprobs": np.zeros((header.num_seqs, 0), np.float32),
                },
            )
        )


BAD_WORDS = [[11], [21, 22], [31, 32, 33], [41, 42]]
WANTS = [21, 22, 11, 31, 32, 33, 21, 21, 22, 41, 7, 31, 32, 31, 32, 33]


@pytest.mark.parametrize("overlap", [False, True])
def test_bad_words_ban_each_words_last_token_after_its_others(model, tokenizer, overlap):
    """A worker that wants to write every bad word is kept from each: a one-token word never
    comes, a longer one's last token is banned exactly where the output ends with its other
    tokens (checked against the rule computed anew from the outputs at every step). Only the
    output counts: the prompt ends with 41, and 42 is not banned at the first token. A request
    with multi-token bad words is never decoded ahead of its sample, and its output is the same
    with the pipeline overlapping steps or not."""
    core = make_core(model, tokenizer)
    prompt = np.array([3, 4, 41], np.int32)
    req = Request(
        "bad",
        0,
        prompt,
        fill_defaults(SamplingParams(max_tokens=len(WANTS), seed=1, bad_words_ids=BAD_WORDS)),
    )
    core.add(req)
    core.add(request("plain", None, max_tokens=8, seed=2))
    prefer = [42, *WANTS[1:]]
    worker = PreferringWorker(model, {1: prefer, 2: [11, 22, 33]})
    got = drive(core, worker, overlap=overlap)
    out = got["outputs"]["bad"]
    assert len(out) == len(WANTS) and out[0] == 42  # 41 ended the prompt, not the output
    for seed, position, banned in worker.bans:
        if seed == 1:
            assert banned == banned_by(BAD_WORDS, out[:position]), position
        else:
            assert banned == set()  # the plain request's bias is its own
    assert 11 not in out
    for word in BAD_WORDS:
        assert not any(out[k : k + len(word)] == word for k in range(len(out))), word
    # The output a worker gets that writes what it wants wherever the rule does not ban it.
    expected: list[int] = []
    for position, want in enumerate(prefer):
        expected.append(900 + position if want in banned_by(BAD_WORDS, expected) else want)
    assert out == expected and expected.count(900 + 7) == 0 and 900 + 8 in expected  # 21 21 22: 22 banned
    assert got["outputs"]["plain"][:3] == [11, 22, 33]  # another request's bad words are not its own
    assert worker.num_placeholder_rows_constrained == 0
    assert core.table.num_bad_word_prefix_rows == 0 and core.table.num_bias_rows == 0


def test_a_request_with_multi_token_bad_words_sits_out_steps_planned_ahead(model, tokenizer):
    core = make_core(model, tokenizer)
    core.add(request("one-token", None, bad_words_ids=[[11]]))
    core.add(request("plain", None))
    step = core.schedule()
    core.update(step, np.array([5, 6], np.int32), np.zeros(2, np.float32))
    assert core.can_plan_ahead  # a one-token bad word is a static bias
    core.add(request("multi", None, bad_words_ids=[[11], [12, 13]]))
    step = core.schedule()
    core.update(step, np.array([5, 6, 7], np.int32), np.zeros(3, np.float32))
    assert not core.can_plan_ahead
    core.schedule()  # in flight: the next plan decodes the others ahead, not "multi"
    ahead = core.schedule()
    assert ahead is not None and sorted(r.request_id for r in ahead.seqs) == ["one-token", "plain"]


def test_speculation_keeps_allowed_tokens_and_bad_words_exact(model, tokenizer):
    """Proposals are cut at the first token allowed_token_ids refuse, and where a bad word would
    ban other tokens further along the span than at its first position (the plan gives the whole
    span its first position's bias); the allowed row's mask is named once per verified position."""
    ids = [5, 6, 7, 8, 9]
    allowed_req = request("allowed", None, allowed_token_ids=ids, max_tokens=30)
    bad_req = request("bad", None, bad_words_ids=[[50, 51]], max_tokens=30)
    p_allowed, p_bad = allowed_req.num_prompt_tokens, bad_req.num_prompt_tokens
    assert p_allowed != p_bad
    proposer = ListedProposer({p_allowed + 1: [6, 7, 40, 8], p_bad + 1: [60, 50, 51, 61]})
    core = make_core(model, tokenizer, proposer=proposer)
    core.add(allowed_req)
    core.add(bad_req)
    prefill = core.schedule()
    assert prefill is not None and not prefill.proposals
    core.update(prefill, np.array([5, 70], np.int32), np.zeros(2, np.float32))
    step = core.schedule()
    assert step is not None
    by_id = {step.seqs[i].request_id: p.tolist() for i, p in enumerate(step.proposals, step.num_decodes)}
    # 40 is not allowed; after 60 50 the bad word would ban 51 at the next position, not at the first.
    assert by_id == {"allowed": [6, 7], "bad": [60]}
    _, plan = build_plan(step, 1, BLOCK)
    row = [r.request_id for r in step.seqs].index("allowed")
    assert plan["grammar_rows"].tolist() == [row] * 3
    assert all(np.array_equal(mask, packed(ids, model["vocab"])) for mask in plan["grammar_bitmask"])


def test_a_row_with_allowed_token_ids_verifies_a_draft_models_places(model, tokenizer):
    """Its mask is the same at every position: a draft's places are verified under it, as a
    grammar's could not be; a request with multi-token bad words decodes one token per step."""
    core = make_core(model, tokenizer, proposer=DraftModelProposer(num_tokens=4))
    core.add(request("allowed", None, allowed_token_ids=[5, 6, 7]))
    core.add(request("bad", None, bad_words_ids=[[50, 51]]))
    prefill = core.schedule()
    core.update(prefill, np.array([5, 7], np.int32), np.zeros(2, np.float32))
    step = core.schedule()
    assert step is not None and step.num_decodes == 1 and len(step.proposals) == 1
    assert [req.request_id for req in step.seqs] == ["bad", "allowed"]
    _, plan = build_plan(step, 1, BLOCK)
    assert plan["grammar_rows"].tolist() == [1] * (1 + len(step.proposals[0]))
