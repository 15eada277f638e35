"""Speculative decoding end to end on the embedded SmolLM2, through real processes: greedy and
seeded sampled outputs with `speculative.method: ngram` equal those with it off, token for token
and text for text (a prompt that restates its input, where proposals are accepted, an open chat,
stop strings, a prompt long enough to be chunked, structured output), streamed and not, with a logprob for every
token, and the spec_decode_* counters on /metrics say that proposals were verified and accepted
(docs/speculative.md)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

from client import Client
from services.common.text import Tokenizer
from tests.harness import assert_clean, brigade_run, free_port, spec_decode_counters
from tests.test_e2e import gateway_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NEW_TOKENS = 40
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
    "and wrote the weather in a leather logbook before the ships came past the rocks."
)
RESTATE = f"Repeat this text exactly, word for word:\n{TEXT}"
WORDS = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
    "required": ["words"],
    "additionalProperties": False,
}
# (prompt, extra sampling); every request is greedy.
GREEDY_REQUESTS = [
    (RESTATE, {}),
    ("What is the capital of France?", {}),
    (f"Repeat this text exactly:\n{TEXT}", {"stop": ["logbook"]}),
    # Over engine.max_num_batched_tokens (64): prefilled in chunks.
    (f"Summarize this story in one sentence.\n{TEXT} {TEXT} {TEXT}", {}),
    # Structured output: proposals are checked against the grammar, each position masked.
    (f"List the first words of this text as JSON:\n{TEXT}", {"json_schema": WORDS}),
]
# Seeded sampled requests, one with penalties: their draws are keyed by seed and position, so
# speculation keeps their text too (services/gpu_worker/speculation.py). The restating ones get
# proposals accepted.
SAMPLED_REQUESTS = [
    (RESTATE, {"temperature": 0.7, "top_p": 0.95, "seed": 11}),
    ("Write a short poem about the sea.", {"temperature": 1.0, "top_k": 50, "seed": 5}),
    (RESTATE, {"temperature": 0.5, "seed": 7, "repetition_penalty": 1.05, "presence_penalty": 0.2}),
    (
        f"List the first words of this text as JSON:\n{TEXT}",
        {"temperature": 0.8, "seed": 3, "json_schema": WORDS},
    ),
]
SETTINGS = ("model.dtype=float32", "model.max_model_len=1024", "engine.max_num_batched_tokens=64")
SPECULATE = ("speculative.method=ngram", "speculative.num_speculative_tokens=5")
# Top logprobs: verification returns them at each token it emits.
LOGPROBS_REQUESTS = [(RESTATE, {"logprobs": 3}), (RESTATE, {"temperature": 0.7, "seed": 3, "logprobs": 2})]
# Each of these tokenizes with and without a leading space into as many tokens, so that vLLM's
# rule bans both forms (" lighthouse" is one token, "lighthouse" two: vLLM bans only the latter).
BAD_WORDS = ["keeper", "great lamp", "past the rocks"]


def restricted_requests(tokenizer: Tokenizer) -> list[tuple[str, dict]]:
    """Restating under vLLM's allowed_token_ids (the text's own tokens: proposals are accepted, and
    each verified position is masked) and bad_words (proposals are cut where a word's bans would
    differ along the span)."""
    allowed = sorted({*tokenizer.encode(TEXT), *tokenizer.encode(RESTATE), *tokenizer.eos_token_ids})
    return [(RESTATE, {"allowed_token_ids": allowed}), (RESTATE, {"bad_words": BAD_WORDS})]


def serve_all(run_dir: Path, requests: list[tuple[str, dict]]) -> dict[int, tuple]:
    """Every request, streamed and not, all at once, on the run: for each (request index, stream)
    its (token ids, text, finish reason, top logprobs or None). Every request has a logprob for
    each of its tokens, and top logprobs for each where it asks for them."""
    jobs = [(prompt, sampling, stream) for prompt, sampling in requests for stream in (False, True)]

    def one(job: tuple[str, dict, bool]) -> tuple:
        prompt, sampling, stream = job
        messages = [{"role": "user", "content": prompt}]
        with Client(run_dir) as client:
            args = dict(max_tokens=NEW_TOKENS, timeout=300) | {"temperature": 0.0, **sampling}
            if stream:
                deltas = list(client.stream_chat(messages, **args))
                logprobs = [x for d in deltas for x in d.logprobs or []]
                assert len(logprobs) == sum(len(d.token_ids) for d in deltas)
                tops = [x for d in deltas for x in d.top_logprobs or []] or None
                return (
                    [t for d in deltas for t in d.token_ids],
                    "".join(d.text for d in deltas),
                    deltas[-1].finish_reason,
                    tops,
                )
            result = client.chat(messages, **args)
            assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
            assert all(x <= 0.0 for x in result.logprobs)
            return result.token_ids, result.text, result.finish_reason, result.top_logprobs

    with ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(range(len(jobs)), pool.map(one, jobs), strict=True))


def all_requests(smollm2_dir: Path) -> list[tuple[str, dict]]:
    return [
        *GREEDY_REQUESTS,
        *restricted_requests(Tokenizer(smollm2_dir)),
        *SAMPLED_REQUESTS,
        *LOGPROBS_REQUESTS,
    ]


class Served:
    """What one run answered to every request of this module, all at once: `outputs[i]` is
    request i's (non-streamed, streamed) outputs, as serve_all gives them; `counters` are the
    run's spec_decode_* counters after them."""

    def __init__(
        self, requests: list[tuple[str, dict]], results: dict[int, tuple], counters: dict[str, float]
    ):
        self.requests = requests
        self.outputs = [(results[2 * i], results[2 * i + 1]) for i in range(len(requests))]
        self.counters = counters

    def of(self, subset: list[tuple[str, dict]]) -> list[tuple]:
        """The outputs of these requests (each as listed in this module), non-streamed then streamed."""
        first = next(i for i in range(len(self.requests)) if self.requests[i : i + len(subset)] == subset)
        return [out for pair in self.outputs[first : first + len(subset)] for out in pair]


@pytest.fixture(scope="module")
def without_speculation(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Served:
    requests = all_requests(smollm2_dir)
    run_dir = tmp_path_factory.mktemp("spec-off")
    metrics_port = free_port()
    with brigade_run(run_dir, *SETTINGS, f"supervisor.metrics_port={metrics_port}") as run:
        results = serve_all(run.run_dir, requests)
        served = Served(requests, results, spec_decode_counters(metrics_port))
    assert_clean(run_dir)
    return served


@pytest.fixture(scope="module")
def ngram_run(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    """A run with n-gram speculation, and its metrics port."""
    run_dir = tmp_path_factory.mktemp("spec-ngram")
    metrics_port = free_port()
    with brigade_run(run_dir, *SETTINGS, f"supervisor.metrics_port={metrics_port}", *SPECULATE) as run:
        yield run, metrics_port
    assert_clean(run_dir)


@pytest.fixture(scope="module")
def with_speculation(ngram_run, smollm2_dir: Path) -> Served:
    run, metrics_port = ngram_run
    requests = all_requests(smollm2_dir)
    results = serve_all(run.run_dir, requests)
    return Served(requests, results, spec_decode_counters(metrics_port))


def test_ngram_speculation_never_changes_a_greedy_output(
    without_speculation: Served, with_speculation: Served, smollm2_dir: Path
) -> None:
    tokenizer = Tokenizer(smollm2_dir)
    requests = [*GREEDY_REQUESTS, *restricted_requests(tokenizer)]
    plain, speculated = without_speculation.of(requests), with_speculation.of(requests)
    assert not without_speculation.counters.get("brigade:spec_decode_num_drafts_total")
    for (prompt, sampling), i in zip(requests, range(0, 2 * len(requests), 2), strict=True):
        for stream in (0, 1):
            assert speculated[i + stream] == plain[i + stream], f"{prompt[:40]!r} {sampling} stream={stream}"
    # The stop string ended its request; the structured one follows its schema.
    assert plain[4][2] == "stop" and "logbook" not in plain[4][1]
    jsonschema.validate(json.loads(plain[8][1]), WORDS)
    allowed = requests[5][1]["allowed_token_ids"]
    assert set(plain[10][0]) <= set(allowed) and len(plain[10][0]) > 10
    sequences = []  # vLLM's tokenization of the bad words (services/tokenizer/core.py bad_words_ids)
    for word in BAD_WORDS:
        bare, spaced = tokenizer.encode(word), tokenizer.encode(" " + word)
        sequences += [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])

    def contains(tokens: list[int], ids: list[int]) -> bool:
        return any(tokens[k : k + len(ids)] == ids for k in range(len(tokens)))

    assert len(sequences) == 6 and any(
        contains(plain[0][0], ids) for ids in sequences
    )  # the restatement writes one
    assert not any(contains(plain[12][0], ids) for ids in sequences) and len(plain[12][0]) > 10
    counters = with_speculation.counters
    assert counters["brigade:spec_decode_num_drafts_total"] > 0
    assert counters["brigade:spec_decode_num_draft_tokens_total"] > 0
    assert counters["brigade:spec_decode_num_accepted_tokens_total"] > 0


def test_seeded_sampled_requests_speculate_and_keep_their_text(
    without_speculation: Served, with_speculation: Served
) -> None:
    """Sampled requests verify proposals by rejection sampling: they complete with a logprob for
    every token, proposals were verified and some accepted, and each seeded request emits what it
    emits without speculation, token for token."""
    plain, speculated = without_speculation.of(SAMPLED_REQUESTS), with_speculation.of(SAMPLED_REQUESTS)
    assert speculated == plain
    assert all(finish in ("stop", "length") for _, _, finish, _ in speculated)
    jsonschema.validate(json.loads(plain[6][1]), WORDS)
    assert plain[0] == plain[1]  # streamed or not, the same seed gives the same text
    counters = with_speculation.counters
    drafts = counters["brigade:spec_decode_num_drafts_total"]
    accepted = counters["brigade:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and accepted > 0
    assert counters["brigade:spec_decode_num_draft_tokens_total"] >= accepted
    # The acceptance length histogram has one observation per verification, of accepted + 1.
    assert counters["brigade:spec_decode_acceptance_length_count"] == drafts
    assert counters["brigade:spec_decode_acceptance_length_sum"] == drafts + accepted
    # vLLM's per-position counter: every accepted token at its position, each position accepted
    # no more often than the one before it (a proposal is accepted from its start).
    per_pos = [
        counters.get(f"brigade:spec_decode_num_accepted_tokens_per_pos_total[{i}]", 0.0) for i in range(5)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True) and per_pos[0] > 0


def test_a_request_that_opts_out_through_the_openai_client_does_not_speculate(ngram_run) -> None:
    """`speculate: false` in the openai client's extra_body reaches the scheduler: the restating
    request verifies nothing, and the same request without it verifies proposals, with the
    same text."""
    import openai

    run, metrics_port = ngram_run
    prompt = [{"role": "user", "content": RESTATE}]
    api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=300)

    def chat(**extra: object) -> str:
        reply = api.chat.completions.create(
            model=api.models.list().data[0].id,
            messages=prompt,  # type: ignore[arg-type]
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            extra_body=extra,
        )
        return reply.choices[0].message.content or ""

    def drafts() -> float:
        return spec_decode_counters(metrics_port).get("brigade:spec_decode_num_drafts_total", 0.0)

    before = drafts()
    opted_out = chat(speculate=False)
    assert drafts() == before
    assert chat() == opted_out
    assert drafts() > before


def test_requests_with_top_logprobs_speculate_and_keep_them(
    without_speculation: Served, with_speculation: Served
) -> None:
    """Verification returns the top logprobs at each token it emits: a greedy and a seeded
    sampled request asking for them speculate (proposals accepted), and emit the tokens and the
    top logprobs (the same ids, the values within float32 noise: a verification computes several
    positions in one pass) that they emit without speculation."""
    requests = LOGPROBS_REQUESTS
    plain, speculated = without_speculation.of(requests), with_speculation.of(requests)
    assert with_speculation.counters["brigade:spec_decode_num_accepted_tokens_total"] > 0
    for (_, sampling), i in zip(requests, range(0, 2 * len(requests), 2), strict=True):
        for stream in (0, 1):
            want, got = plain[i + stream], speculated[i + stream]
            assert got[:3] == want[:3], f"{sampling} stream={stream}"
            k = sampling["logprobs"]
            assert want[3] is not None and len(want[3]) == len(want[0])
            assert got[3] is not None and len(got[3]) == len(got[0])
            for position, (mine, theirs) in enumerate(zip(got[3], want[3], strict=True)):
                assert len(mine) == k and list(mine) == list(theirs), f"{sampling} token {position}"
                assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-3)


def test_a_first_step_that_verifies_gives_every_token_its_logprob(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> None:
    """A prompt one token over engine.max_num_batched_tokens ends with a one-token chunk (and,
    asked again, with the same token after a prefix-cache hit), which verifies what the n-gram
    lookup finds in the prompt: the request's first step emits several tokens, and its first
    output goes as its whole history (services/scheduler/__main__.py `detokenizer_messages`).
    Each of those tokens keeps its logprob and top logprobs, streamed and not."""
    from transformers import AutoTokenizer

    text = "over there are some but use an each her look now. " * 4 + "over"
    prompt = AutoTokenizer.from_pretrained(smollm2_dir)(text)["input_ids"]
    run_dir = tmp_path_factory.mktemp("spec-first-step")
    metrics_port = free_port()
    settings = (
        "model.dtype=float32", "model.max_model_len=1024", f"engine.max_num_batched_tokens={len(prompt) - 1}",
        f"supervisor.metrics_port={metrics_port}", "speculative.method=ngram",
        "speculative.num_speculative_tokens=16",
    )  # fmt: skip
    with brigade_run(run_dir, *settings) as run, Client(run.run_dir) as client:
        args = dict(max_tokens=24, temperature=0.0, logprobs=1, timeout=300)
        deltas = list(client.stream(prompt, **args))
        streamed = (
            [t for d in deltas for t in d.token_ids],
            [x for d in deltas for x in d.logprobs or []],
            [x for d in deltas for x in d.top_logprobs or []],
        )
        result = client.generate(prompt, **args)
        assert spec_decode_counters(metrics_port)["brigade:spec_decode_num_accepted_tokens_total"] > 0
    assert_clean(run_dir)
    for token_ids, logprobs, tops in (streamed, (result.token_ids, result.logprobs, result.top_logprobs)):
        assert len(token_ids) == 24 and logprobs is not None and len(logprobs) == 24
        assert all(x <= 0.0 for x in logprobs), logprobs  # NaN is not
        assert tops is not None and len(tops) == 24 and all(len(top) == 1 for top in tops)
