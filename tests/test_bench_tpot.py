"""The benchmarks' time per output token (benchmarks/peers.py, used by spec_bench and lora_bench),
from a stream's (arrival time, tokens) events."""

from __future__ import annotations

import pytest

from benchmarks.peers import tpot_ms


def test_time_per_token_after_the_first_event():
    """The first event's tokens start the clock; the rest share the time to the last event, however
    many tokens each event carries (a verification emits several at once)."""
    assert tpot_ms([(1.0, 1), (1.01, 1), (1.02, 1)]) == pytest.approx(10.0)
    assert tpot_ms([(2.0, 2), (2.03, 3)]) == pytest.approx(10.0)
    assert tpot_ms([(0.0, 1), (0.01, 1), (0.04, 3)]) == pytest.approx(10.0)


@pytest.mark.parametrize("arrivals", [[], [(1.0, 1)], [(1.0, 4)]], ids=["none", "one token", "one event"])
def test_an_answer_in_one_event_has_no_time_per_token(arrivals):
    assert tpot_ms(arrivals) is None
