"""The nesting depth of JSON text measured before decoding (ipc/json_depth.py), against the depth
of what Python's json module decodes from the same text."""

from __future__ import annotations

import json
import random

import pytest

from ipc.json_depth import MAX_JSON_DEPTH, check_json_depth, json_depth
from ipc.validation import InvalidParams


def decoded_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(decoded_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(decoded_depth, value), default=0)
    return 0


TRICKY_STRINGS = ["[", '{"', 'a\\"[', "\\\\", '\\\\"', "]]}}", 'x\\\\\\"{', '"', "é{[", "\\u005b"]


def random_value(rng: random.Random, depth: int) -> object:
    kind = rng.random()
    if depth > 6 or kind < 0.35:
        return rng.choice([1, None, True, rng.choice(TRICKY_STRINGS), "plain"])
    if kind < 0.7:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        rng.choice(TRICKY_STRINGS) + str(i): random_value(rng, depth + 1) for i in range(rng.randint(0, 3))
    }


@pytest.mark.parametrize("seed", range(300))
def test_depth_equals_the_decoded_values_depth(seed: int) -> None:
    value = random_value(random.Random(seed), 0)
    text = json.dumps(value, ensure_ascii=seed % 2 == 0)
    assert json_depth(text) == json_depth(text.encode()) == decoded_depth(value), text


def test_deep_text_is_refused_and_wide_text_is_not() -> None:
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(InvalidParams, match=f"nested {MAX_JSON_DEPTH + 1} levels deep"):
        check_json_depth(deep, "body")
    wide = json.dumps({"messages": [{"role": "user", "content": "[{"} for _ in range(10_000)]})
    check_json_depth(wide, "body")  # many openers, two levels
    assert json_depth(wide) == 3
