"""Speculative decoding, first slice: the n-gram proposer, the greedy acceptance rule, and the
worker's verification step on the real SmolLM2, against plain one-token-per-step greedy decoding
by the same ModelRunner (docs/speculative.md)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ipc import messages as m
from ipc.config import MAX_SPECULATIVE_TOKENS, ConfigError, load_config
from ipc.step_plan import STEP_RESULT, Dim, vocab_words
from services.gpu_worker.model_runner import InvalidPlan, ModelRunner
from services.gpu_worker.sampler import Sampler
from services.gpu_worker.speculation import emitted_tokens, num_accepted, target_tokens
from services.scheduler.__main__ import detokenizer_messages
from services.scheduler.core import Scheduler, StepOutputs
from services.scheduler.plan import ScheduledStep
from services.scheduler.proposers import NgramProposer
from services.scheduler.request import Request
from services.scheduler.speculation import (
    FULL_DEPTH_DECODES,
    MAX_SPECULATIVE_DECODES,
    MIN_KEPT_PROBABILITY,
    PROBE_INTERVAL,
    STEP_TIME_WEIGHT,
    Speculation,
    paying_depth,
    speculative_depth,
)
from tests.test_model import PlanBuilder
from tests.test_sampler import chi_square, make_plan, reference_distribution, reference_penalised
from tests.test_scheduler_core import (
    EOS,
    PREFIXES,
    VOCAB,
    FakeExecutor,
    assert_no_leaks,
    drive,
    engine_params,
    event_st,
    reference_outputs,
    request_st,
    run_traffic,
    scheduler_config,
    tokens_of,
)

# ---- the n-gram proposer ----------------------------------------------------------------------


def propose(
    tokens: list[int], num_tokens: int = 4, min_n: int = 1, max_n: int = 3, limit: int = 100
) -> list[int]:
    return NgramProposer(num_tokens, min_n, max_n).propose(np.array(tokens, np.int32), limit).tolist()


def test_ngram_proposes_what_followed_the_suffix():
    # The suffix [1, 2, 3] occurred at the start, followed by 4 5 6 7.
    assert propose([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3]) == [4, 5, 6, 7]


def test_ngram_longest_match_wins_over_a_later_shorter_one():
    # The 3-gram [7, 8, 3] occurred at 0 (then 10, 11); the 1-gram [3] occurs later, at 5 (then 20, 7).
    tokens = [7, 8, 3, 10, 11, 3, 20, 7, 8, 3]
    assert propose(tokens, num_tokens=2) == [10, 11]
    # With max_n 1 only the single token counts, and its latest occurrence wins.
    assert propose(tokens, num_tokens=2, max_n=1) == [20, 7]


def test_ngram_latest_occurrence_wins():
    assert propose([5, 6, 1, 5, 6, 2, 5, 6], num_tokens=1, min_n=2, max_n=2) == [2]


def test_ngram_no_match_below_min_n_is_empty():
    # Only the 1-gram [4] recurs; min_n 2 wants at least two tokens of context.
    assert propose([4, 1, 2, 4], min_n=2, max_n=3) == []
    assert propose([4, 1, 2, 4], min_n=1, max_n=3) == [1, 2, 4]
    assert propose([9]) == []  # nothing earlier to match
    assert propose([]) == []


def test_ngram_bounded_by_num_tokens_limit_and_the_end_of_the_sequence():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(tokens, num_tokens=3) == [3, 4, 5]
    assert propose(tokens, num_tokens=3, limit=2) == [3, 4]
    assert propose(tokens, num_tokens=3, limit=0) == []
    # A run of one token: the latest earlier [8, 8] is followed only by the last token.
    assert propose([8, 8, 8, 8], num_tokens=4, min_n=2, max_n=2) == [8]


@pytest.mark.parametrize(
    ("num_tokens", "min_n", "max_n"), [(0, 1, 2), (MAX_SPECULATIVE_TOKENS + 1, 1, 2), (4, 0, 2), (4, 3, 2)]
)
def test_ngram_refuses_bad_bounds(num_tokens, min_n, max_n):
    with pytest.raises(ValueError, match="must"):
        NgramProposer(num_tokens, min_n, max_n)


# ---- the acceptance rule ----------------------------------------------------------------------


def test_acceptance_keeps_the_longest_agreeing_prefix_and_the_target_token_after_it():
    target = np.array([10, 11, 12, 13])
    assert num_accepted(target, np.array([10, 11, 12])) == 3
    assert emitted_tokens(target, np.array([10, 11, 12])).tolist() == [10, 11, 12, 13]
    assert num_accepted(target, np.array([10, 99, 12])) == 1  # a later agreement does not count
    assert emitted_tokens(target, np.array([10, 99, 12])).tolist() == [10, 11]
    assert emitted_tokens(target, np.array([99, 11, 12])).tolist() == [10]
    assert emitted_tokens(target[:1], np.array([], np.int64)).tolist() == [10]


def test_acceptance_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="expected one more"):
        num_accepted(np.array([1, 2]), np.array([1, 2]))


# Logits at a verifying row's three positions (its last known token, then two proposals) over a
# six-token vocabulary, the proposals, and the request's sampling: temperature, top-k (token 5
# never survives it), a logit bias and penalties over a history (prompt, then outputs) that grows
# by the proposals along the span.
STAT_LOGITS = [
    [1.0, 0.2, 0.6, -0.3, 0.1, -2.0],
    [0.4, 1.1, -0.5, 0.3, 0.0, -1.5],
    [0.0, 0.3, 0.9, -0.2, 0.5, -1.0],
]
STAT_SAMPLING = {
    "temperature": 0.9,
    "top_k": 5,
    "bias": {3: 0.7},
    "repetition_penalty": 1.3,
    "presence_penalty": 0.4,
    "frequency_penalty": 0.2,
    "prompt": [4, 2],
    "output": [1],
}
NUM_STAT_ROWS = 30_000
# Chi-square 99.99% quantiles by degrees of freedom: a failure is a bug, not bad luck.
CHI2_LIMIT_BY_DF = {4: 23.5, 10: 35.6, 11: 37.4, 12: 39.1}


@pytest.mark.parametrize("proposals", [[0, 1], [2, 3], [5, 1]])
def test_sampled_verification_emits_the_target_distribution(proposals: list[int]) -> None:
    """Rejection sampling with the n-gram proposer's point-mass draft, on fixed logits: over many
    seeds, what a verifying row emits (its accepted proposals, then the target's token) has the
    target's distribution, position by position: [y] for y != x0 with p0(y), [x0, y] for y != x1
    with p0(x0) p1(y), [x0, x1, y] with p0(x0) p1(x1) p2(y) (chi-square), where p_m has the
    request's penalties over its outputs and the proposals before m. The last proposal set starts
    with a token top-k removes, which is never accepted."""
    vocab = len(STAT_LOGITS[0])
    depth = len(proposals)
    context = len(STAT_SAMPLING["prompt"]) + len(STAT_SAMPLING["output"])
    arrays = make_plan([{"seed": seed, **STAT_SAMPLING} for seed in range(NUM_STAT_ROWS)])
    # Each row's span: its last known token (the last output), then the proposals.
    span = [STAT_SAMPLING["output"][-1], *proposals]
    arrays["input_ids"] = np.tile(np.array(span, np.int32), NUM_STAT_ROWS)
    arrays["query_start_loc"] = np.arange(NUM_STAT_ROWS + 1, dtype=np.int32) * len(span)
    arrays["num_proposed"] = np.full(NUM_STAT_ROWS, depth, np.int32)
    arrays["seq_lens"] = np.full(NUM_STAT_ROWS, context + depth, np.int32)
    logits = torch.tensor(STAT_LOGITS * NUM_STAT_ROWS, dtype=torch.float32)
    targets = target_tokens(Sampler(vocab, "cpu"), logits, arrays, np.arange(NUM_STAT_ROWS))
    drawn = targets.sampled_ids.numpy().reshape(NUM_STAT_ROWS, depth + 1)
    counts: dict[tuple[int, ...], int] = {}
    for row in drawn:
        emitted = tuple(emitted_tokens(row, np.array(proposals)).tolist())
        counts[emitted] = counts.get(emitted, 0) + 1

    target = [
        reference_distribution(
            reference_penalised(
                logits_at, {**STAT_SAMPLING, "output": STAT_SAMPLING["output"] + proposals[:at]}
            ),
            STAT_SAMPLING["temperature"],
            top_k=STAT_SAMPLING["top_k"],
        )
        for at, logits_at in enumerate(STAT_LOGITS)
    ]
    expected: dict[tuple[int, ...], float] = {}
    prefix_prob = 1.0
    for at in range(depth + 1):
        for y in range(vocab):
            if at == depth or y != proposals[at]:
                expected[(*proposals[:at], y)] = prefix_prob * target[at][y]
        if at < depth:
            prefix_prob *= target[at][proposals[at]]
    assert set(counts) <= {e for e, p in expected.items() if p > 0}  # nothing the target cannot emit
    observed = np.array([counts.get(e, 0) for e in expected])
    statistic = chi_square(observed, list(expected.values()))
    df = sum(p > 0 for p in expected.values()) - 1
    assert statistic < CHI2_LIMIT_BY_DF[df], (statistic, df)
    # The position after the last known token is what plain decoding samples there, seed by seed.
    plain = make_plan([{"seed": seed, **STAT_SAMPLING, "position": context} for seed in range(NUM_STAT_ROWS)])
    first = Sampler(vocab, "cpu").sample(
        torch.tensor(STAT_LOGITS[:1] * NUM_STAT_ROWS), plain, np.arange(NUM_STAT_ROWS)
    )
    assert (first.sampled_ids.numpy() == drawn[:, 0]).all()


# ---- worker verification on SmolLM2 -------------------------------------------------------------

RESTATE = (
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.\n"
    "The quick brown fox jumps over the lazy dog near the river bank."
)
MAX_NEW = 24


@pytest.fixture(scope="module")
def runner(smollm2_dir) -> ModelRunner:
    return ModelRunner(smollm2_dir, dtype="float32", kv_cache_bytes=64 << 20, threads=2)


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    chats = [RESTATE, "What is the capital of France?"]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c in chats
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


# A sampled request as the OpenAI API can shape one: every transform verification applies.
SAMPLED = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.02,
    "seeds": 1234,
    "bias": {13: 1.5, 28: -2.0},
    "repetition_penalty": 1.15,
    "presence_penalty": 0.3,
    "frequency_penalty": 0.2,
}
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def with_sampling(
    arrays: dict[str, np.ndarray], sampling: dict, prompt: list[int], outputs: list[int]
) -> dict[str, np.ndarray]:
    """A one-row plan that samples as `sampling` says (plan array values, "bias" a logit bias,
    "lora_slots" the row's adapter slot), with the penalty history of a sequence whose known
    tokens are `prompt` and `outputs`."""
    for key, value in sampling.items():
        if key == "lora_slots":
            arrays[key] = np.array(value, np.int32)
        elif key == "bias":
            arrays["bias_offsets"] = np.array([0, len(value)], np.int32)
            arrays["bias_ids"] = np.array(list(value), np.int32)
            arrays["bias_values"] = np.array(list(value.values()), np.float32)
        else:
            arrays[key][:] = value
    if any(key in sampling for key in PENALTIES):
        arrays["history_ids"] = np.array(prompt + outputs, np.int32)
        arrays["history_offsets"] = np.array([0, len(prompt) + len(outputs)], np.int32)
        arrays["history_prompt_lens"] = np.array([len(prompt)], np.int32)
    return arrays


def plain_decode(
    runner: ModelRunner, prompt: list[int], sampling: dict | None = None
) -> tuple[list[int], list[float]]:
    """One token per step: what the engine emits without speculation, and its logprobs."""
    builder = PlanBuilder(runner.block_size)
    out: list[int] = []
    logprobs: list[float] = []
    chunk = prompt
    for _ in range(MAX_NEW):
        arrays, header = builder.plan([(0, chunk, True)])
        result = runner.execute(with_sampling(arrays, sampling or {}, prompt, out), header)
        out.append(int(result["sampled_ids"][0]))
        logprobs.append(float(result["sampled_logprobs"][0]))
        chunk = [out[-1]]
    return out, logprobs


def plain_greedy(runner: ModelRunner, prompt: list[int]) -> list[int]:
    return plain_decode(runner, prompt)[0]


def speculative_decode(
    runner: ModelRunner, prompt: list[int], proposals, sampling: dict | None = None
) -> tuple[list[int], list[float], int, int]:
    """Decode with verification steps: each step carries the row's last token and what
    `proposals(tokens so far, limit)` proposes; rejected positions are rolled back (their KV slots
    are overwritten by the next step). Returns the outputs, their logprobs, proposals made and
    proposals kept."""
    builder = PlanBuilder(runner.block_size)
    arrays, header = builder.plan([(0, prompt, True)])
    result = runner.execute(with_sampling(arrays, sampling or {}, prompt, []), header)
    out = [int(result["sampled_ids"][0])]
    logprobs = [float(result["sampled_logprobs"][0])]
    num_proposed = num_kept = 0
    while len(out) < MAX_NEW:
        draft = list(proposals(prompt + out, MAX_NEW - len(out) - 1))
        arrays, header = builder.plan([(0, [out[-1], *draft], True)])
        arrays["num_proposed"] = np.array([len(draft)], np.int32)
        result = runner.execute(with_sampling(arrays, sampling or {}, prompt, out), header)
        n = int(result["num_emitted"][0])
        new = result["emitted_ids"][0, :n].tolist()
        assert result["emitted_ids"][0, n:].tolist() == [-1] * (result["emitted_ids"].shape[1] - n)
        assert int(result["sampled_ids"][0]) == new[-1]
        assert result["sampled_logprobs"][0] == result["emitted_logprobs"][0, n - 1]
        STEP_RESULT.check(result, {Dim.ROWS: 1, Dim.TOP_K: 0})
        builder.num_cached[0] -= len(draft) - (n - 1)  # the rejected proposals' KV is not kept
        num_proposed += len(draft)
        num_kept += n - 1
        out.extend(new)
        logprobs.extend(result["emitted_logprobs"][0, :n].tolist())
    return out[:MAX_NEW], logprobs[:MAX_NEW], num_proposed, num_kept


def speculative_greedy(runner: ModelRunner, prompt: list[int], proposals) -> tuple[list[int], int, int]:
    out, _, made, kept = speculative_decode(runner, prompt, proposals)
    return out, made, kept


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verification_emits_exactly_the_plain_greedy_tokens(runner, prompts):
    ngram = NgramProposer(num_tokens=5, min_n=1, max_n=3)
    for prompt in prompts:
        reference = plain_greedy(runner, prompt)

        def oracle(tokens, limit, reference=reference, prompt=prompt):  # always right
            done = len(tokens) - len(prompt)
            return reference[done : done + min(limit, 5)]

        def wrong(tokens, limit, reference=reference, prompt=prompt):  # always wrong from the start
            done = len(tokens) - len(prompt)
            return [(t + 1) % runner.vocab_size for t in reference[done : done + min(limit, 3)]]

        out, made, kept = speculative_greedy(runner, prompt, oracle)
        assert out == reference
        assert kept == made > 0
        out, made, kept = speculative_greedy(runner, prompt, wrong)
        assert out == reference
        assert kept == 0 < made
        out, made, kept = speculative_greedy(
            runner, prompt, lambda tokens, limit: ngram.propose(np.array(tokens), limit)
        )
        assert out == reference
    # The restating prompt is where prompt lookup pays: most of what it proposed was kept.
    out, made, kept = speculative_greedy(
        runner, prompts[0], lambda tokens, limit: ngram.propose(np.array(tokens), limit)
    )
    assert kept > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sampled_verification_emits_exactly_the_plain_seeded_tokens(runner, prompts):
    """A seeded request with temperature, top-k, top-p, min-p, a logit bias and penalties: each
    position's draw is the one plain decoding makes there, so whatever is proposed (all right, all wrong,
    n-gram lookups) the row emits the tokens and logprobs of plain seeded decoding."""
    ngram = NgramProposer(num_tokens=5, min_n=1, max_n=3)
    for prompt in prompts:
        reference, reference_logprobs = plain_decode(runner, prompt, SAMPLED)
        assert reference != plain_greedy(runner, prompt)  # it samples

        def oracle(tokens, limit, reference=reference, prompt=prompt):
            done = len(tokens) - len(prompt)
            return reference[done : done + min(limit, 5)]

        def wrong(tokens, limit, reference=reference, prompt=prompt):
            done = len(tokens) - len(prompt)
            return [(t + 1) % runner.vocab_size for t in reference[done : done + min(limit, 3)]]

        def lookup(tokens, limit):
            return ngram.propose(np.array(tokens), limit)

        for proposals, kept_all in [(oracle, True), (wrong, False), (lookup, None)]:
            out, logprobs, made, kept = speculative_decode(runner, prompt, proposals, SAMPLED)
            assert out == reference, proposals.__name__
            np.testing.assert_allclose(logprobs, reference_logprobs, atol=1e-4)
            if kept_all is not None:
                assert made > 0 and (kept == made if kept_all else kept == 0), proposals.__name__


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verification_in_a_mixed_step(runner, prompts):
    """A verifying row beside a prefill chunk that samples and a plain decode: each row gets what
    it would alone, and the plain rows emit their one token in the emitted arrays."""
    restate, chat = prompts
    reference = plain_greedy(runner, restate)
    chat_reference = plain_greedy(runner, chat)
    builder = PlanBuilder(runner.block_size)
    runner.execute(*builder.plan([(0, restate, True), (1, chat, True)]))
    draft = reference[1:5]
    arrays, header = builder.plan(
        [(1, [chat_reference[0]], True), (0, [reference[0], *draft], True), (2, chat, True)]
    )
    arrays["num_proposed"] = np.array([0, len(draft), 0], np.int32)
    result = runner.execute(arrays, header)
    assert result["num_emitted"].tolist() == [1, len(draft) + 1, 1]
    # The restating row's input is its first token, then the right next four: all are kept.
    assert result["emitted_ids"][1].tolist() == reference[1 : len(draft) + 2]
    assert result["emitted_ids"][0, 0] == chat_reference[1] == result["sampled_ids"][0]
    assert result["emitted_ids"][2, 0] == chat_reference[0] == result["sampled_ids"][2]
    assert result["sampled_ids"][1] == reference[len(draft) + 1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plans_with_proposals_the_worker_refuses(runner, prompts):
    prompt = prompts[1]

    def plan(**overrides):
        builder = PlanBuilder(runner.block_size)
        arrays, header = builder.plan([(0, [*prompt[:6], 5, 6], True)])
        arrays["num_proposed"] = np.array([2], np.int32)
        arrays.update(
            {k: np.asarray(v, arrays[k].dtype if k in arrays else np.int32) for k, v in overrides.items()}
        )
        return arrays, header

    def masks(count: int) -> np.ndarray:
        return np.full((count, vocab_words(runner.vocab_size)), -1)

    runner.validate(*plan())
    runner.validate(
        *plan(temperature=[0.7], top_k=[5], seeds=[3], repetition_penalty=[1.2])
    )  # sampled, penalised
    runner.validate(*plan(grammar_rows=[0, 0, 0], grammar_bitmask=masks(3)))  # a mask per position
    for overrides, message in [
        ({"num_proposed": [MAX_SPECULATIVE_TOKENS + 1]}, "out of range"),
        ({"num_proposed": [8]}, "no room"),
        ({"is_sampled": [0]}, "samples nothing"),
        ({"grammar_rows": [0], "grammar_bitmask": masks(1)}, "once per position"),
    ]:
        with pytest.raises(InvalidPlan, match=message):
            runner.validate(*plan(**overrides))
    arrays, header = plan()
    arrays["input_ids"][-1] = -1  # a placeholder where a proposal goes
    with pytest.raises(InvalidPlan, match="placeholder"):
        runner.validate(arrays, header)


# ---- the scheduler with verifications, on the fake worker of tests/test_scheduler_core.py -----------


class ScriptedProposer:
    """Proposals that are right for a number of tokens that varies with the sequence's length,
    then wrong (or, for one length in k + 2, all right): the request's true continuation, as its
    `reference_outputs` gives it, found by the sequence's prompt and outputs so far."""

    drafts_in_worker = False

    def __init__(self, streams: list[tuple[list[int], list[int]]], num_tokens: int) -> None:
        self.streams = streams
        self.num_tokens = num_tokens

    def propose(self, token_ids: np.ndarray, limit: int) -> np.ndarray:
        tokens = token_ids.tolist()
        for prompt, full in self.streams:
            done = len(tokens) - len(prompt)
            if done >= 0 and tokens[: len(prompt)] == prompt and tokens[len(prompt) :] == full[:done]:
                rest = full[done:]
                good = len(tokens) % (self.num_tokens + 2)
                proposal = rest[:good] + [(t + 1) % VOCAB for t in rest[good : good + 1]]
                return np.array(proposal[: min(self.num_tokens, limit)], np.int32)
        return np.zeros(0, np.int32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([2, 4, 8]),
    extra_blocks=st.integers(0, 12),
    max_num_seqs=st.integers(1, 5),
    max_num_batched_tokens=st.integers(1, 24),
    caching=st.booleans(),
    num_tokens=st.integers(1, 5),
    requests=st.lists(request_st, min_size=1, max_size=8),
    events=event_st,
)
def test_random_traffic_with_verifications_gives_the_plain_outputs(
    block_size: int,
    extra_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    caching: bool,
    num_tokens: int,
    requests: list[dict],
    events: list[tuple[str, int]],
) -> None:
    """Traffic in which greedy requests, penalised and min_tokens ones included, verify proposals
    (most of them partly wrong; a min_tokens span never crosses the end of its eos ban, whose bias
    the fake worker applies at every position as the worker does): every request ends once with
    the outputs it generates alone, logprobs included, one step at a time and planned ahead; the fake
    worker checks every penalty history (its known tokens, never a proposal) and every KV read
    (no rejected proposal is ever read as context, through the prefix cache
    or otherwise), and no block leaks."""
    max_model_len = 48
    specs = []
    for idx, spec in enumerate(requests):
        prompt = (PREFIXES[spec["prefix"]] if spec["prefix"] is not None else []) + spec["suffix"]
        params = engine_params(
            temperature=0.0,
            max_tokens=spec["max_tokens"],
            min_tokens=spec["min_tokens"],
            ignore_eos=spec["ignore_eos"],
            stop_token_ids=[5] if spec["stop"] else [],
            priority=spec["priority"],
            seed=spec["seed"],
            repetition_penalty=1.2 if spec["penalty"] else 1.0,
        )
        full = reference_outputs(prompt, [], params, max_model_len)
        specs.append((f"r{idx}", prompt, params, full, full[: min(spec["resume"], len(full) - 1)]))
    proposer = ScriptedProposer([(prompt, full) for _, prompt, _, full, _ in specs], num_tokens)
    config = scheduler_config(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_blocks=max_model_len // block_size + extra_blocks,
        max_model_len=max_model_len,
        max_num_waiting=64,
        enable_prefix_caching=caching,
        eos_token_ids=(EOS,),
        proposer=proposer,
    )
    for overlap in (False, True):
        sched = Scheduler(config)
        got, ended = run_traffic(sched, FakeExecutor(sched), overlap, specs, events)
        assert set(ended) == {rid for rid, *_ in specs}, "every request ends exactly once"
        for rid, _, _, full, resumed in specs:
            tokens = [token for token, _ in got[rid]]
            if ended[rid] == "abort":
                assert tokens == full[: len(tokens)]
            else:
                assert tokens == full, rid
            # Each new token's logprob is the one its position and id give (FakeExecutor).
            for j, (token, logprob) in enumerate(got[rid][len(resumed) :], len(resumed)):
                position = len(specs[int(rid[1:])][1]) + j
                assert np.frombuffer(logprob, "<f4")[0] == np.float32(-(position % 7) - token / VOCAB)
        spec = sched.speculation
        assert spec is not None
        if spec.num_accepted_tokens:
            event("proposals accepted")
        if spec.num_draft_tokens > spec.num_accepted_tokens:
            event("proposals rejected")
        if sched.num_preemptions:
            event("preempted")
        assert_no_leaks(sched)


def test_a_request_that_cannot_be_verified_exactly_never_speculates():
    """A request that opts out (speculate false) decodes one token per step; the same prompt
    greedy, sampled, with a logit bias, with penalties, with min_tokens or with top logprobs
    verifies proposals, and a top-logprobs request gets its top logprobs with every token."""
    prompt = [3, 4, 3, 4, 3, 4, 3]  # [3] recurs: the proposer always has something

    def drafts_of(params: dict) -> int:
        sched = Scheduler(
            scheduler_config(
                block_size=4,
                num_blocks=64,
                max_model_len=64,
                eos_token_ids=(EOS,),
                proposer=NgramProposer(num_tokens=4, min_n=1, max_n=1),
            )
        )
        request_params = engine_params(max_tokens=30, seed=1, ignore_eos=True, **params)
        sched.add(Request("r", 0, np.array(prompt, np.int32), request_params))
        outputs = drive(sched, FakeExecutor(sched))["r"]
        assert tokens_of(outputs) == reference_outputs(prompt, [], request_params, 64)
        k = params.get("logprobs", 0)
        for out in outputs:  # the fake worker's top ids are 0..k-1
            assert out.top_logprobs == ([{i: 0.0 for i in range(k)}] if k else []), params
        assert sched.speculation is not None
        return sched.speculation.num_drafts

    assert drafts_of(dict(temperature=0.0, speculate=False)) == 0
    for params in [
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=0.0, logit_bias={9: 1.0}),
        dict(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5),
        dict(temperature=0.0, min_tokens=12),
    ]:
        assert drafts_of(params) > 0, params


def test_a_min_tokens_span_never_crosses_the_end_of_its_eos_ban():
    """min_tokens bans eos below a position through the plan's bias, which the worker applies at
    every position of a span: a span from inside the ban to past its end would lose the ban (or
    keep it too long), so proposals stop short of it. Here the eos would come at the second output
    were it allowed, and an oracle proposes eight right tokens at a time."""
    prompt = [2, 7, 1, 8]
    seed = next(
        s
        for s in range(10_000)
        if reference_outputs(prompt, [], engine_params(max_tokens=20, seed=s), 64)[1:] == [EOS]
    )
    params = engine_params(max_tokens=20, min_tokens=6, seed=seed, ignore_eos=False)
    full = reference_outputs(prompt, [], params, 64)
    assert len(full) > 6 and EOS not in full[:6]

    class Oracle:
        num_tokens = 8

        def propose(self, token_ids: np.ndarray, limit: int) -> np.ndarray:
            done = len(token_ids) - len(prompt)
            return np.array(full[done : done + min(limit, self.num_tokens)], np.int32)

    sched = Scheduler(
        scheduler_config(
            block_size=4, num_blocks=64, max_model_len=64, eos_token_ids=(EOS,), proposer=Oracle()
        )
    )
    got, _ = run_traffic(sched, FakeExecutor(sched), False, [("m", prompt, params, full, [])], [])
    assert [token for token, _ in got["m"]] == full
    assert sched.speculation is not None and sched.speculation.num_accepted_tokens > 0


def test_the_speculative_section_is_validated_when_the_config_loads():
    assert load_config(None).speculative.method == "none"  # off unless asked
    # Off with its draft still named: turning speculation off is changing the method alone.
    assert load_config(None, ["speculative.model=/models/draft"]).speculative.method == "none"
    config = load_config(None, ["speculative.method=ngram", "speculative.prompt_lookup_max=2"])
    assert (config.speculative.method, config.speculative.prompt_lookup_max) == ("ngram", 2)
    for overrides, message in [
        (["speculative.method=draft"], "speculative.method"),
        ([f"speculative.num_speculative_tokens={MAX_SPECULATIVE_TOKENS + 1}"], "num_speculative_tokens"),
        (["speculative.num_speculative_tokens=0"], "num_speculative_tokens"),
        (["speculative.prompt_lookup_min=3", "speculative.prompt_lookup_max=2"], "prompt_lookup_min"),
        (["speculative.method=ngram", "speculative.model=/models/draft"], "would ignore it"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_a_resumed_request_with_several_tokens_in_a_step_gets_its_history_once():
    """A verification gives a request several entries in one step; one that waits for its whole
    history (resubmitted) gets it once, with its last entry's finish reason and logprob."""
    resumed = Request("a", 0, np.array([1, 2], np.int32), engine_params(max_tokens=4), output_ids=[7, 8, 9])
    outputs = StepOutputs(
        ["a", "a", "b"],
        [0, 0, 0],
        np.array([1, 2, 5], np.int32),
        np.array([8, 9, 3], np.int32),
        np.array([-0.5, -0.25, -1.0], np.float32),
        [[], [], []],
        [None, "length", None],
        [2, 2, 4],
        [0, 0, 0],
    )
    needs_full_history = {"a": resumed}
    messages = detokenizer_messages(outputs, needs_full_history, 1)[0]
    assert not needs_full_history
    updates = [u for message in messages for u in message.to_updates()]
    assert [(u.request_id, u.start_index) for u in updates] == [("a", 0), ("b", 5)]
    full = updates[0]
    assert m.unpack_ids(full.token_ids).tolist() == [7, 8, 9] and full.finish_reason == "length"
    assert np.frombuffer(full.logprobs, "<f4")[-1] == np.float32(-0.25)


# ---- the adaptive rule --------------------------------------------------------------------------


def test_speculative_depth_shrinks_with_the_batch_and_the_acceptance_rate():
    # Full depth for a few decodes at a good rate, shrinking with the batch, none above the limit.
    assert [speculative_depth(4, n, 1.0) for n in (1, 4, 5, 8, 16, 17, 64)] == [4, 4, 3, 2, 1, 0, 0]
    assert speculative_depth(4, 0, 1.0) == 0  # no decodes, nothing to propose
    # The k-th proposal is kept with probability rate**k; it is proposed while that is >= 0.3.
    assert [speculative_depth(8, 1, rate) for rate in (0.9, 0.8, 0.6, 0.5, 0.3, 0.29, 0.0)] == [
        8,
        5,
        2,
        1,
        1,
        0,
        0,
    ]
    assert speculative_depth(2, 1, 0.9) == 2  # never above the configured number
    for max_depth in range(1, MAX_SPECULATIVE_TOKENS + 1):
        for num_decodes in range(0, 70):
            for rate in np.linspace(0.0, 1.0, 21):
                depth = speculative_depth(max_depth, num_decodes, float(rate))
                assert 0 <= depth <= max_depth
                # Never more proposals per step than FULL_DEPTH_DECODES decodes at full depth.
                assert depth * num_decodes <= FULL_DEPTH_DECODES * max_depth
                assert depth == 0 or float(rate) ** depth >= MIN_KEPT_PROBABILITY - 1e-9


def speculating_scheduler(max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        scheduler_config(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=256,
            block_size=4,
            num_blocks=512,
            max_model_len=96,
            eos_token_ids=(EOS,),
            proposer=NgramProposer(num_tokens=4, min_n=1, max_n=1),
        )
    )


def test_a_request_turns_off_as_its_acceptance_rate_falls_and_probes_to_come_back():
    sched = speculating_scheduler()
    spec = sched.speculation
    assert spec is not None
    params = engine_params(temperature=0.0, max_tokens=40, seed=0, ignore_eos=True)
    chat, restate = (Request(rid, 0, np.array([3, 4], np.int32), params) for rid in ("chat", "restate"))
    assert spec.depth(1, chat) == 4  # the scheduler's prior starts it on
    for _ in range(60):  # every proposal of one request rejected
        spec.applied(chat, num_proposed=4, num_emitted=1)
    rate = spec.acceptance_rate(chat)
    assert rate < MIN_KEPT_PROBABILITY
    # A new request starts from the scheduler's rate, then follows its own text: a few kept
    # proposals of its own (a probe's) turn it on while the other stays off.
    assert spec.acceptance_rate(restate) == pytest.approx(spec.kept / spec.tried)
    assert spec.depth(1, restate) == 0
    for _ in range(3):
        spec.applied(restate, num_proposed=1, num_emitted=2)
    assert spec.depth(1, restate) > 0
    assert spec.depth(1, chat) == 0
    depths = []
    for _ in range(2 * PROBE_INTERVAL):
        depths.append(spec.depth(1, chat))
        chat.speculation_steps_off = chat.speculation_steps_off + 1 if depths[-1] == 0 else 0
    # Off, except one probe of one token in every PROBE_INTERVAL of its steps.
    assert depths.count(1) == 2 and set(depths) == {0, 1}
    assert depths.index(1) == PROBE_INTERVAL - 1
    chat.speculation_steps_off = PROBE_INTERVAL
    assert spec.depth(MAX_SPECULATIVE_DECODES + 1, chat) == 0  # no probe where the batch forbids it
    for _ in range(60):  # the text turned repetitive: every proposal kept
        spec.applied(chat, num_proposed=1, num_emitted=2)
    assert spec.depth(1, chat) == 4
    # The histogram's observations: the tokens each verification emitted.
    assert list(spec.acceptance_lengths) == [1] * 60 + [2] * 3 + [2] * 60


def linear_step_time(per_extra_token: float):
    """A step's time by its tokens: 10 ms for one, `per_extra_token` times that for each more."""
    return lambda num_tokens: 10e-3 * (1 + per_extra_token * (num_tokens - 1))


def test_paying_depth_speculates_where_verifying_is_nearly_free_and_not_where_it_costs():
    step_time = linear_step_time(0.01)  # bound by reading the weights: tokens nearly free
    nearly_free = {t: step_time(t) for t in range(1, 5)}
    assert paying_depth(3, 1, 0.7, nearly_free) == 3
    # A CPU whose few-row kernels are bound by compute: verifying 3 proposals costs 2.2x a plain
    # step, and at a rate of 0.4 a verification of 3 emits 1.62 tokens expected.
    costly = {1: 10e-3, 2: 14.5e-3, 3: 18e-3, 4: 22e-3}
    expected_tokens = sum(0.4**k for k in range(4))
    assert expected_tokens == pytest.approx(1.62, abs=0.01)
    assert paying_depth(3, 1, 0.4, costly) == 0  # 1.4 tokens for 1.45x the time at best
    # Where verifying one proposal costs little, the smaller depth pays: 1.4 tokens for 1.1x.
    assert paying_depth(3, 1, 0.4, {**costly, 2: 11e-3}) == 1
    # Every step is bound by compute alike: tokens per second are best without proposals.
    step_time = linear_step_time(1.0)
    assert paying_depth(4, 2, 0.9, {t: step_time(t) for t in range(1, 11)}) == 0
    # A size not measured yet is taken as free, so that it is tried; nothing measured: the bound.
    assert paying_depth(3, 1, 0.4, {1: costly[1], 4: costly[4]}) == 2
    assert paying_depth(3, 1, 0.4, {4: costly[4]}) == 0  # the plain step is measured first
    assert paying_depth(3, 1, 0.4, {}) == 3


def test_speculation_measures_each_depth_keeps_the_one_that_pays_and_measures_it_again():
    sched = speculating_scheduler()
    spec = sched.speculation
    assert spec is not None and spec.proposer.num_tokens == 4
    params = engine_params(temperature=0.0, max_tokens=40, seed=0, ignore_eos=True)
    req = Request("r", 0, np.array([3, 4], np.int32), params)
    assert spec.acceptance_rate(req) == pytest.approx(0.8)  # the prior's: the bound is the full 4
    step_time = linear_step_time(0.5)  # speeds 1.2, 1.22, 1.18, 1.12 at depths 1 to 4
    assert spec.depth(1, req) == 4  # nothing measured: workers that report no times
    spec.step_executed(1, 5, step_time(5))
    depths = []
    for _ in range(5):
        depth = spec.depth(1, req)
        depths.append(depth)
        spec.step_executed(1, 1 + depth, step_time(1 + depth))
    # A plain step to compare with, then each depth not measured yet from the deepest, then
    # the one that pays most.
    assert depths == [0, 3, 2, 1, 2]
    assert spec.depth(1, req) == 2
    # What a step could not carry, a batch too large to speculate and unmeasured times are not kept.
    spec.step_executed(1, 6, 1.0)
    spec.step_executed(MAX_SPECULATIVE_DECODES + 1, MAX_SPECULATIVE_DECODES + 1, 1.0)
    spec.step_executed(2, 2, 0.0)
    assert sorted(spec.step_times) == [1, 2, 3, 4, 5]
    # The times decay toward new measurements: a slower plain step moves its estimate.
    spec.step_executed(1, 1, 20e-3)
    assert spec.step_times[1] == pytest.approx(10e-3 + STEP_TIME_WEIGHT * 10e-3)
    # While the times hold it below the bound, one step in PROBE_INTERVAL proposes the bound.
    spec.steps_below_bound = PROBE_INTERVAL - 1
    assert spec.depth(1, req) == 4


class TimedExecutor(FakeExecutor):
    """The fake worker on a fake clock: reading a step's result advances `clock` by the step's
    time from a cost model (all-decode steps by their tokens, steps with a prompt chunk a full
    second, which no estimate may take in), as if the worker ran each step when its result was
    waited for; the header reports the same time as its execute_s."""

    def __init__(self, sched: Scheduler, step_time) -> None:
        super().__init__(sched)
        self.step_time = step_time
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def publish(self, step_id: int, step: ScheduledStep) -> None:
        super().publish(step_id, step)
        header, arrays = self.results[-1]
        has_prompt = step.num_decodes + step.num_verifying < step.num_seqs
        execute_s = 1.0 if has_prompt else self.step_time(step.num_tokens)
        self.results[-1] = (m.ResultHeader(header.step_id, header.num_seqs, header.error, execute_s), arrays)

    @contextmanager
    def result(self) -> Iterator[tuple[m.ResultHeader, dict[str, np.ndarray]]]:
        with super().result() as (header, arrays):
            self.now += header.execute_s
            yield header, arrays


def test_the_pipeline_times_all_decode_steps_and_speculation_stays_off_where_it_never_pays(monkeypatch):
    """Steps with prompt chunks never reach the step times; where every token costs as much as a
    plain step (bound by compute), speculation measures its depths and then verifies only in its
    probes, while where tokens are nearly free it verifies throughout; outputs are the same."""
    prompt = [3, 4, 3, 4, 3, 4, 3]

    def run(step_time) -> tuple[dict[int, float], int]:
        sched = speculating_scheduler(max_num_seqs=1)
        specs = []
        for i in range(2):  # one stream at a time
            params = engine_params(temperature=0.0, max_tokens=40, seed=i, ignore_eos=True)
            specs.append((f"r{i}", prompt, params, reference_outputs(prompt, [], params, 96), []))
        assert sched.speculation is not None
        # A rate of 0.9 whatever the fake model's tokens: the bound stays at the full depth.
        monkeypatch.setattr(Speculation, "acceptance_rate", lambda self, req: 0.9)
        executor = TimedExecutor(sched, step_time)
        got, _ = run_traffic(sched, executor, True, specs, [], clock=executor.clock)
        for rid, _, _, full, _ in specs:
            assert [token for token, _ in got[rid]] == full
        return sched.speculation.step_times, sched.speculation.num_drafts

    step_time = linear_step_time(1.0)
    times, compute_bound_drafts = run(step_time)
    assert times and all(t == pytest.approx(step_time(num_tokens)) for num_tokens, t in times.items())
    step_time = linear_step_time(0.01)
    times, nearly_free_drafts = run(step_time)
    assert times and all(t == pytest.approx(step_time(num_tokens)) for num_tokens, t in times.items())
    assert nearly_free_drafts > 2 * compute_bound_drafts, (compute_bound_drafts, nearly_free_drafts)


def test_a_batch_too_large_to_speculate_is_planned_ahead_and_verifies_nothing():
    """Above MAX_SPECULATIVE_DECODES decodes no step proposes, and the pipeline plans ahead (on
    placeholders) as without speculation; the same requests two at a time verify proposals, each
    step planned after the last one's result."""
    prompt = [3, 4, 3, 4, 3, 4, 3]  # [3] recurs: the proposer always has something

    def run(num_requests: int) -> tuple[int, int]:
        sched = speculating_scheduler(max_num_seqs=num_requests)
        specs = []
        for i in range(num_requests):
            params = engine_params(temperature=0.0, max_tokens=12, seed=i, ignore_eos=True)
            specs.append((f"r{i}", prompt, params, reference_outputs(prompt, [], params, 96), []))
        executor = FakeExecutor(sched)
        got, _ = run_traffic(sched, executor, True, specs, [])
        for rid, _, _, full, _ in specs:
            assert [token for token, _ in got[rid]] == full
        assert sched.speculation is not None
        return sched.speculation.num_drafts, executor.num_placeholders

    drafts, placeholders = run(2)
    assert drafts > 0 and placeholders == 0
    drafts, placeholders = run(MAX_SPECULATIVE_DECODES + 1)
    assert drafts == 0 and placeholders > 0


def record_verifications(monkeypatch, record) -> None:
    """Calls record(request) at each verification applied (Speculation.applied), then applies it."""
    applied = Speculation.applied

    def recorded(self, req, num_proposed, num_emitted):
        record(req)
        return applied(self, req, num_proposed, num_emitted)

    monkeypatch.setattr(Speculation, "applied", recorded)


def test_each_request_of_a_batch_speculates_by_its_own_rate(monkeypatch):
    """Two requests in one batch: the one whose own acceptance rate is below the bound never
    verifies, the other verifies throughout; the outputs are the same as without speculation."""
    sched = speculating_scheduler()
    prompt = [3, 4, 3, 4, 3, 4, 3]  # [3] recurs: the proposer always has something
    specs = []
    for rid in ("low", "high"):
        params = engine_params(temperature=0.0, max_tokens=20, seed=5, ignore_eos=True)
        specs.append((rid, prompt, params, reference_outputs(prompt, [], params, 96), []))
    rates = {"low": MIN_KEPT_PROBABILITY / 2, "high": 0.9}
    monkeypatch.setattr(Speculation, "acceptance_rate", lambda self, req: rates[req.request_id])
    verified: list[str] = []
    record_verifications(monkeypatch, lambda req: verified.append(req.request_id))
    got, _ = run_traffic(sched, FakeExecutor(sched), False, specs, [])
    for rid, _, _, full, _ in specs:
        assert [token for token, _ in got[rid]] == full
    assert "high" in verified and "low" not in verified
    # Longer: the low one probes one token in every PROBE_INTERVAL of its own steps, though the
    # other proposes in every step.
    sched = speculating_scheduler()
    verified.clear()
    params = engine_params(temperature=0.0, max_tokens=3 * PROBE_INTERVAL - 20, seed=5, ignore_eos=True)
    specs = [(rid, prompt, params, reference_outputs(prompt, [], params, 96), []) for rid in ("low", "high")]
    got, _ = run_traffic(sched, FakeExecutor(sched), False, specs, [])
    for rid, _, _, full, _ in specs:
        assert [token for token, _ in got[rid]] == full
    assert 1 <= verified.count("low") <= 2


def test_steps_planned_ahead_count_toward_the_time_probe(monkeypatch):
    """Where the step times keep speculation off, steps are planned ahead (their decodes are
    placeholders, which propose nothing) and still count toward the probe that measures the
    bound again: verifications keep coming, one in about PROBE_INTERVAL steps."""
    monkeypatch.setattr(Speculation, "acceptance_rate", lambda self, req: 0.9)
    sched = speculating_scheduler(max_num_seqs=1)
    prompt = [3, 4, 3, 4, 3, 4, 3]
    params = engine_params(temperature=0.0, max_tokens=80, seed=0, ignore_eos=True)
    specs = [("r", prompt, params, reference_outputs(prompt, [], params, 96), [])]
    executor = TimedExecutor(sched, linear_step_time(1.0))  # every token costs a plain step
    verified_at: list[int] = []
    record_verifications(monkeypatch, lambda req: verified_at.append(executor.num_steps))
    got, _ = run_traffic(sched, executor, True, specs, [], clock=executor.clock)
    assert [token for token, _ in got["r"]] == specs[0][3]
    assert executor.num_placeholders > 0  # planned ahead while off
    assert any(step > 2 * PROBE_INTERVAL for step in verified_at), verified_at


def test_a_request_that_opts_out_never_speculates():
    """`speculate: false` keeps a request that could speculate to one token per step, with the
    same outputs."""
    sched = speculating_scheduler()
    prompt = [3, 4, 3, 4, 3, 4, 3]
    specs = []
    for rid, speculate in (("in", True), ("out", False)):
        params = engine_params(temperature=0.7, max_tokens=20, seed=3, ignore_eos=True, speculate=speculate)
        specs.append((rid, prompt, params, reference_outputs(prompt, [], params, 96), []))
    got, _ = run_traffic(sched, FakeExecutor(sched), False, specs, [])
    for rid, _, _, full, _ in specs:
        assert [token for token, _ in got[rid]] == full
    spec = sched.speculation
    assert spec is not None and spec.num_drafts > 0
    # Only "in" verified: with "out" alone, nothing would have.
    alone = speculating_scheduler()
    got, _ = run_traffic(alone, FakeExecutor(alone), False, specs[1:], [])
    assert alone.speculation is not None and alone.speculation.num_drafts == 0
