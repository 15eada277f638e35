"""The request rules: each rejects its bad values naming the field and accepts its edge values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from ipc.messages import SamplingParams, StructuredOutput
from ipc.sampling_defaults import fill_defaults
from ipc.validation import InvalidParams, PromptTooLong, validate_params, validate_prompt_ids

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 2000  # > 1024, so the entry-count limits are reachable with valid ids
MAX_LEN = 256
INF = float("inf")
NAN = float("nan")


def check(num_prompt_tokens: int = 10, **fields: Any) -> None:
    fields.setdefault("max_tokens", 128)  # the tokenizer fills in its defaults before validating
    validate_params(
        fill_defaults(SamplingParams(**fields)),
        vocab_size=VOCAB,
        max_model_len=MAX_LEN,
        num_prompt_tokens=num_prompt_tokens,
    )


def test_defaults_are_valid():
    check()


def test_unfilled_max_tokens_is_refused():
    with pytest.raises(InvalidParams, match="max_tokens"):
        check(max_tokens=None)


@pytest.mark.parametrize("name", ["temperature", "top_p", "top_k", "min_p", "repetition_penalty"])
def test_an_unfilled_sampling_default_is_refused(name: str):
    """The scheduler validates too: a request that skipped the tokenizer's defaults never runs."""
    params = msgspec.structs.replace(fill_defaults(SamplingParams(max_tokens=8)), **{name: None})
    with pytest.raises(InvalidParams, match=f"{name} is unset"):
        validate_params(params, vocab_size=VOCAB, max_model_len=MAX_LEN, num_prompt_tokens=3)


BAD: list[tuple[str, Any]] = [
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1_000_001),
    ("temperature", -1.0),
    ("temperature", 100.5),
    ("temperature", NAN),
    ("temperature", INF),
    ("top_k", -1),
    ("top_k", 1_000_000),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", NAN),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", INF),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 10.01),
    ("repetition_penalty", NAN),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.01),
    ("presence_penalty", -INF),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", NAN),
    ("logit_bias", {VOCAB: 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: -INF}),
    ("logit_bias", {5: NAN}),
    ("logit_bias", {i: 0.0 for i in range(1025)}),
    ("min_tokens", -1),
    ("min_tokens", 129),  # > max_tokens (128 by default)
    ("stop_token_ids", [VOCAB]),
    ("stop_token_ids", [-3]),
    ("stop_token_ids", list(range(1025))),
    ("stop", [""]),
    ("stop", ["x" * 257]),
    ("stop", ["a"] * 17),
    ("logprobs", -1),
    ("logprobs", 21),
    ("seed", -1),
    ("seed", 2**63),
    ("priority", 2**31),
    ("temperature", "hot"),
    ("max_tokens", 3.5),
    ("top_k", True),
    ("structured", "json"),
    ("structured.kind", StructuredOutput("yaml", "x")),  # type: ignore[arg-type]
    ("structured.spec", StructuredOutput("regex", "")),
    ("structured.spec: 65537 bytes", StructuredOutput("regex", "a" * (64 * 1024 + 1))),
    ("structured.strict", StructuredOutput("json", "{}", strict=1)),  # type: ignore[arg-type]
    ("adapter", "x" * 257),
    ("adapter", 3),
    ("speculate", "no"),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [VOCAB]),
    ("allowed_token_ids", [0, -1]),
    ("allowed_token_ids", [1.0]),
    ("allowed_token_ids", [True]),
    ("allowed_token_ids", [*range(VOCAB), 0]),  # more entries than the vocabulary has tokens
    ("allowed_token_ids", 5),
    ("bad_words", [""]),
    ("bad_words", ["  \n"]),
    ("bad_words", ["x" * 257]),
    ("bad_words", ["a"] * 65),
    ("bad_words", [3]),
    ("bad_words", "word"),
    ("bad_words_ids", [[]]),
    ("bad_words_ids", [[VOCAB]]),
    ("bad_words_ids", [[-1]]),
    ("bad_words_ids", [[1] * 257]),
    ("bad_words_ids", [[1]] * 129),
    ("bad_words_ids", [5]),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_bad_values_are_rejected_naming_the_field(field: str, value: Any):
    with pytest.raises(InvalidParams, match=field) as info:
        check(**{field.split(".")[0]: value})
    assert info.type is InvalidParams  # not PromptTooLong
    assert info.value.code == "invalid_request"


EDGES: list[dict[str, Any]] = [
    {"max_tokens": 1},
    {"max_tokens": 1_000_000},  # the scheduler clamps it to the room left
    {"temperature": 0.0},
    {"temperature": 100.0},
    {"temperature": 1},  # an int where a float is expected
    {"top_k": 0},
    {"top_k": 999_999},
    {"top_p": 1.0},
    {"top_p": 1e-9},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"repetition_penalty": 1e-6},
    {"repetition_penalty": 10.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"presence_penalty": 2.0, "frequency_penalty": -2.0},
    {"logit_bias": {0: -100.0, VOCAB - 1: 100.0}},
    {"logit_bias": {i: 0.0 for i in range(1024)}},
    {"min_tokens": 0},
    {"min_tokens": 128},
    {"max_tokens": 5, "min_tokens": 5},
    {"stop_token_ids": [0, VOCAB - 1]},
    {"stop": ["x" * 256] + ["a"] * 15},
    {"stop": ["\n"]},
    {"logprobs": 0},
    {"logprobs": 20},
    {"seed": None},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"priority": -(2**31)},
    {"structured": StructuredOutput("json", '{"type":"object"}')},
    {"structured": StructuredOutput("choice", '["a","b"]'), "stop_token_ids": [0]},
    {"allowed_token_ids": None},
    {"allowed_token_ids": [0]},
    {"allowed_token_ids": [VOCAB - 1, VOCAB - 1]},
    {"allowed_token_ids": list(range(VOCAB))},
    {"allowed_token_ids": [1, 2], "structured": StructuredOutput("regex", "[0-9]+")},
    {"bad_words": ["x" * 256, *["a"] * 63]},
    {"bad_words": [" leading space", "two words", "\u2603"]},
    {"bad_words_ids": [[0], [VOCAB - 1] * 256, *[[1]] * 126]},
]


@pytest.mark.parametrize("field", ["min_tokens", "ignore_eos"])
def test_structured_output_refuses_min_tokens_and_ignore_eos(field: str):
    """The grammar decides where a constrained output ends: eos cannot be held back."""
    value = {"min_tokens": 2, "ignore_eos": True}[field]
    with pytest.raises(InvalidParams, match=f"{field} cannot be combined with structured output"):
        check(structured=StructuredOutput("regex", "[0-9]+"), **{field: value})


@pytest.mark.parametrize("fields", EDGES)
def test_edge_values_are_accepted(fields: dict[str, Any]):
    check(**fields)


def test_a_wire_decoded_nan_is_rejected():
    """NaN arrives through msgpack, not only from Python callers."""
    data = msgspec.msgpack.encode(fill_defaults(SamplingParams(max_tokens=8, top_p=NAN)))
    params = msgspec.msgpack.decode(data, type=SamplingParams)
    with pytest.raises(InvalidParams, match="top_p must be finite"):
        validate_params(params, vocab_size=VOCAB, max_model_len=MAX_LEN, num_prompt_tokens=3)


def test_message_states_range_and_value():
    with pytest.raises(InvalidParams) as info:
        check(temperature=-1.0)
    assert str(info.value) == "temperature must be in [0, 100], got -1"


def test_prompt_length_limits():
    check(num_prompt_tokens=MAX_LEN - 1)
    with pytest.raises(PromptTooLong, match=rf"{MAX_LEN} tokens .* max_model_len is {MAX_LEN}") as info:
        check(num_prompt_tokens=MAX_LEN)
    assert info.value.code == "prompt_too_long"
    with pytest.raises(InvalidParams, match="empty"):
        check(num_prompt_tokens=0)


@pytest.mark.parametrize("as_array", [False, True])
def test_prompt_ids(as_array: bool):
    def ids(values: list[int]) -> Any:
        return np.array(values, dtype=np.int32) if as_array else values

    validate_prompt_ids(ids([0, 5, VOCAB - 1]), VOCAB, MAX_LEN)
    validate_prompt_ids(ids([1] * (MAX_LEN - 1)), VOCAB, MAX_LEN)
    with pytest.raises(InvalidParams, match=rf"prompt token id {VOCAB} at index 2"):
        validate_prompt_ids(ids([0, 5, VOCAB, 7]), VOCAB, MAX_LEN)
    with pytest.raises(InvalidParams, match="prompt token id -4 at index 0"):
        validate_prompt_ids(ids([-4]), VOCAB, MAX_LEN)
    with pytest.raises(InvalidParams, match="empty"):
        validate_prompt_ids(ids([]), VOCAB, MAX_LEN)
    with pytest.raises(PromptTooLong):
        validate_prompt_ids(ids([1] * MAX_LEN), VOCAB, MAX_LEN)
    # An embedding's input has no output to make room for: it may fill the context, not more.
    validate_prompt_ids(ids([1] * MAX_LEN), VOCAB, MAX_LEN, generates=False)
    # ... and is named as the embeddings API names it (its `input`), not a prompt.
    with pytest.raises(PromptTooLong, match=rf"^input has {MAX_LEN + 1} tokens .* at most {MAX_LEN}$"):
        validate_prompt_ids(ids([1] * (MAX_LEN + 1)), VOCAB, MAX_LEN, generates=False)
    with pytest.raises(InvalidParams, match=r"^input is empty"):
        validate_prompt_ids(ids([]), VOCAB, MAX_LEN, generates=False)
    with pytest.raises(InvalidParams, match=rf"^input token id {VOCAB} at index 1"):
        validate_prompt_ids(ids([0, VOCAB]), VOCAB, MAX_LEN, generates=False)


def test_importing_validation_does_not_import_torch():
    code = "import sys, ipc.validation; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False"
