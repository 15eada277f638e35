"""The gateway's per-client counts of requests refused for their cost before the refusal: for
their compile's cost, and for their size (issue 29). End to end, through the real gateway:
tests/test_gateway.py `test_a_client_whose_constraints_keep_costing_too_much_gets_429` and
`test_a_client_whose_requests_keep_being_too_large_gets_429_before_its_body_is_read`."""

from __future__ import annotations

import pytest

from ipc.config import ConfigError, load_config
from services.gateway.refusal_limits import MAX_CLIENTS, RecentRefusals, is_costly_refusal


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_client_past_its_limit_waits_until_its_oldest_refusal_leaves_the_window() -> None:
    clock = Clock()
    costly = RecentRefusals(limit=3, window_s=60.0, clock=clock)
    for _ in range(2):
        costly.record("key:a")
        clock.now += 10
    assert costly.retry_after_s("key:a") == 0  # 2 of 3
    costly.record("key:a")  # at 1020; the oldest is from 1000
    assert costly.retry_after_s("key:a") == 40
    assert costly.retry_after_s("key:b") == 0  # another client is not affected
    clock.now += 39.5
    assert costly.retry_after_s("key:a") == 1  # rounded up: never "retry now" while refused
    clock.now += 0.5
    assert costly.retry_after_s("key:a") == 0  # the oldest left the window


def test_limit_zero_is_off_and_the_clients_remembered_are_bounded() -> None:
    off = RecentRefusals(limit=0, window_s=60.0)
    for _ in range(10):
        off.record("peer:1.2.3.4")
    assert off.retry_after_s("peer:1.2.3.4") == 0
    costly = RecentRefusals(limit=1, window_s=60.0)
    for i in range(MAX_CLIENTS + 5):
        costly.record(f"peer:{i}")
    assert costly.retry_after_s("peer:0") == 0  # forgotten, the least recently refused first
    assert costly.retry_after_s(f"peer:{MAX_CLIENTS + 4}") > 0
    with pytest.raises(ValueError):
        RecentRefusals(limit=-1, window_s=60.0)


def test_only_refusals_naming_a_compile_budget_count() -> None:
    assert is_costly_refusal(
        "structured.regex: too complex: compiling it took 38.1 MiB, over the budget of 16.0 MiB "
        "(structured.max_grammar_mib)"
    )
    assert is_costly_refusal(
        "too complex: compiling it took 1007 ms, over the budget of 1000 ms (structured.compile_timeout_ms)"
    )
    assert not is_costly_refusal("structured.regex: the constraint matches no output at all")
    assert not is_costly_refusal("while generating: lexer error: too many expressions constructed")


@pytest.mark.parametrize(
    "override",
    [
        "structured.max_costly_compiles=-1",
        "structured.costly_compile_window_s=0",
        "gateway.max_oversized_requests=-1",
        "gateway.oversized_window_s=0",
    ],
)
def test_the_budgets_are_validated(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[1]):
        load_config(None, [override])
