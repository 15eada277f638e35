"""The frontend's core without sockets: admission, group choice, journal, and relaying deltas by
absolute position (exactly once, whatever upstream re-sends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipc import messages as m
from services.tokenizer.frontend import FrontendCore, RequestError, trim_delta
from services.tokenizer.text import Tokenizer


@pytest.fixture(scope="module")
def core_factory(smollm2_dir: Path):
    tokenizer = Tokenizer(smollm2_dir)

    def make(num_groups: int = 1) -> FrontendCore:
        return FrontendCore(tokenizer, 0, num_groups, max_model_len=256, max_prompt_chars=1000, default_max_tokens=7)

    return make


def test_admission_fills_seed_and_default_max_tokens(core_factory) -> None:
    core = core_factory()
    entry = core.admit(b"c", m.Generate("r", prompt="Hello there"))
    assert entry.submit.params.max_tokens == 7
    assert entry.submit.params.seed is not None
    assert m.unpack_ids(entry.submit.prompt_ids).tolist() == core.tokenizer.encode("Hello there")


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (m.Generate("", prompt="x"), "invalid_request"),
        (m.Generate("r"), "invalid_request"),
        (m.Generate("r", prompt="x", messages=[m.ChatMessage("user", "y")]), "invalid_request"),
        (m.Generate("r", messages=[m.ChatMessage("robot", "y")]), "invalid_request"),
        (m.Generate("r", prompt="x" * 1001), "prompt_too_long"),
        (m.Generate("r", prompt="hello " * 300), "prompt_too_long"),
        (m.Generate("r", prompt_token_ids=m.pack_ids([10**8])), "invalid_request"),
        (m.Generate("r", prompt_token_ids=b"\x01\x02\x03"), "invalid_request"),
        (m.Generate("r", prompt="x", params=m.SamplingParams(top_p=0.0)), "invalid_request"),
    ],
)
def test_bad_requests_get_specific_codes(core_factory, request_: m.Generate, code: str) -> None:
    core = core_factory()
    with pytest.raises(RequestError) as info:
        core.admit(b"c", request_)
    assert info.value.code == code
    assert not core.journal


def test_group_choice_follows_reported_load(core_factory) -> None:
    core = core_factory(num_groups=2)
    core.group_loads = [10.0, 2.0]
    assert core.admit(b"c", m.Generate("a", prompt="x")).group == 1
    core.group_loads = [1.0, 2.0]
    assert core.admit(b"c", m.Generate("b", prompt="x")).group == 0
    core.abort("b")
    core.group_loads = [0.0, 0.0]  # equal reports: our own in-flight request ("a") breaks the tie
    assert core.admit(b"c", m.Generate("c", prompt="x")).group == 0


def test_relay_is_exactly_once_by_position(core_factory) -> None:
    core = core_factory()
    core.admit(b"c", m.Generate("r", prompt="x"))
    first = core.relay(m.Delta("r", 0, 0, "Hel", m.pack_ids([1, 2])))
    assert first is not None and first.message.text == "Hel"
    again = m.Delta("r", 0, 0, "Hello", m.pack_ids([1, 2, 3]))  # re-sent from the start (a resync)
    reply = core.relay(again)
    assert reply is not None
    assert (reply.message.text, reply.message.token_index, reply.message.char_offset) == ("lo", 2, 3)
    assert m.unpack_ids(reply.message.token_ids).tolist() == [3]
    assert core.relay(again) is None  # nothing new
    assert core.relay(m.Delta("r", 9, 20, "gap", m.pack_ids([9]))) is None  # a gap is not forwarded
    done = core.relay(m.Delta("r", 3, 5, "!", m.pack_ids([4]), finish_reason="stop"))
    assert done is not None and done.message.finish_reason == "stop"
    assert "r" not in core.journal


def test_resubmission_carries_what_the_client_has(core_factory) -> None:
    core = core_factory(num_groups=2)
    entry = core.admit(b"c", m.Generate("r", prompt="x"))
    core.relay(m.Delta("r", 0, 0, "ab", m.pack_ids([5, 6])))
    (again,) = core.resubmissions(entry.group)
    assert m.unpack_ids(again.output_ids).tolist() == [5, 6]
    assert again.params.seed == entry.submit.params.seed
    assert core.resubmissions(1 - entry.group) == []


def test_trim_delta_keeps_logprobs_aligned() -> None:
    delta = m.Delta("r", 0, 0, "abc", m.pack_ids([1, 2, 3]), logprobs=b"".join(
        x.to_bytes(4, "little") for x in (11, 22, 33)
    ))
    trimmed = trim_delta(delta, num_tokens=2, num_chars=1)
    assert trimmed is not None
    assert m.unpack_ids(trimmed.token_ids).tolist() == [3]
    assert trimmed.logprobs == (33).to_bytes(4, "little")
    assert trimmed.text == "bc"
