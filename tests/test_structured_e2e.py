"""Structured output end to end, through real processes on SmolLM2-135M: the SDK's request reaches
the frontend (which checks the constraint), the scheduler (compile, matcher, bitmask rows in the
step ring) and the worker (masking before sampling). Outputs are validated independently: JSON
with the `jsonschema` package, regex with Python's `re`, choices by membership.

Short outputs and few requests: every wait has a deadline, and the whole module stays cheap on a
loaded 2-core host.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from client import Client, InvalidRequest
from ipc.messages import StructuredOutput
from tests.harness import assert_clean, brigade_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TIMEOUT_S = 300.0  # every client wait

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "age", "role", "address", "tags", "score"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Describe a user of a web service as JSON."}]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    run_dir = tmp_path_factory.mktemp("structured")
    with brigade_run(
        run_dir, "model.dtype=float32", "engine.max_num_seqs=8", "model.max_model_len=1024"
    ) as run:
        yield run
    assert_clean(run_dir)


def json_spec(schema: dict) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema))


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 11), (1.0, 12)])
def test_json_schema_outputs_validate(run, temperature, seed):
    with Client(run.run_dir) as client:
        result = client.chat(
            PROMPT,
            structured=json_spec(PERSON),
            max_tokens=200,
            temperature=temperature,
            seed=seed,
            timeout=TIMEOUT_S,
        )
    assert result.finish_reason == "stop", result
    jsonschema.validate(json.loads(result.text), PERSON)


def test_regex_and_choice_outputs(run):
    with Client(run.run_dir) as client:
        date = client.generate(
            "Today's date is",
            structured=StructuredOutput("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"),
            max_tokens=30,
            temperature=1.0,
            seed=3,
            timeout=TIMEOUT_S,
        )
        choices = ["red", "green", "blue"]
        colour = client.chat(
            [{"role": "user", "content": "Name a colour."}],
            structured=StructuredOutput("choice", json.dumps(choices)),
            max_tokens=10,
            temperature=0.0,
            timeout=TIMEOUT_S,
        )
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", date.text), date.text
    assert date.finish_reason == "stop"
    assert colour.text in choices and colour.finish_reason == "stop", colour


def test_json_cut_short_by_max_tokens_is_a_length_finish(run):
    with Client(run.run_dir) as client:
        result = client.chat(
            PROMPT, structured=json_spec(PERSON), max_tokens=5, temperature=0.0, timeout=TIMEOUT_S
        )
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


def test_an_uncompilable_schema_is_refused_naming_the_field(run):
    bad = StructuredOutput("json", json.dumps({"type": "array", "uniqueItems": True}))
    with Client(run.run_dir) as client:
        with pytest.raises(InvalidRequest, match=r"structured\.json: .*uniqueItems"):
            client.generate("x", structured=bad, max_tokens=5, timeout=TIMEOUT_S)
        with pytest.raises(InvalidRequest, match=r"min_tokens cannot be combined with structured output"):
            client.generate("x", structured=json_spec(PERSON), min_tokens=2, max_tokens=5, timeout=TIMEOUT_S)
