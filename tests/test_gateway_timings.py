"""llama-server's timings of a request's choices (services/gateway/timings.py), on a simulated clock."""

from __future__ import annotations

import pytest

from client.sdk import StreamDelta
from ipc import messages as m
from services.gateway.timings import RequestTimings, llama_timings


def test_each_choice_counts_its_tokens_and_the_request_counts_each_prompt_once() -> None:
    # choices 0 and 1 share prompt 0 (n=2); choice 2 is prompt 1's
    timings = RequestTimings(arrival=100.0, prompt_of={0: 0, 1: 0, 2: 1})
    timings.add(0, StreamDelta("abc", [1, 2, 3], usage=m.Usage(10, 0, cached_tokens=4)), now=100.5)
    timings.add(1, StreamDelta("d", [4], usage=m.Usage(10, 0, cached_tokens=8)), now=100.75)
    timings.add(0, StreamDelta("ef", [5, 6]), now=101.5)
    timings.add(2, StreamDelta("g", [7], usage=m.Usage(6, 0)), now=102.0)

    first = timings.of_choice(0, now=102.5)
    assert (first.cache_n, first.prompt_n, first.predicted_n) == (4, 6, 5)
    assert first.prompt_ms == pytest.approx(500.0) and first.predicted_ms == pytest.approx(2000.0)
    assert first.predicted_per_second == pytest.approx(2.5)
    assert first.prompt_per_token_ms == pytest.approx(500 / 6)

    whole = timings.of_request(now=102.5)
    # prompt 0 counted once, with what the cache held before the call (choice 1 found the blocks
    # choice 0 had just computed), and prompt 1
    assert (whole.cache_n, whole.prompt_n, whole.predicted_n) == (4, 6 + 6, 7)
    assert whole.prompt_ms == pytest.approx(500.0) and whole.predicted_ms == pytest.approx(2000.0)


def test_a_prompt_only_request_outputs_no_token() -> None:
    """max_tokens 0 (echo): the one token the engine samples is not the reply's."""
    timings = RequestTimings(arrival=0.0, prompt_of={0: 0}, is_prompt_only=True)
    timings.add(0, StreamDelta("x", [9], finish_reason="length", usage=m.Usage(5, 1)), now=1.0)
    assert timings.of_choice(0, now=1.0).predicted_n == timings.of_request(now=1.0).predicted_n == 0


def test_a_choice_without_output_yet_has_zero_rates() -> None:
    timings = RequestTimings(arrival=5.0, prompt_of={0: 0})
    early = timings.of_choice(0, now=7.0)
    assert (early.predicted_n, early.predicted_ms, early.predicted_per_second) == (0, 0.0, 0.0)
    assert early.prompt_ms == pytest.approx(2000.0) and early.prompt_per_second == 0.0
    assert llama_timings(0, 0, 0.0, 0, 0.0).predicted_per_token_ms == 0.0
