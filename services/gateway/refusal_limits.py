"""Per client, its recent requests refused for what they cost before the refusal (issue 29).

Two kinds are counted, each in a `RecentRefusals` of its own:
- constraints the scheduler refused as over a compile budget: each cost its compile, up to
  `structured.compile_timeout_ms` of CPU and `structured.max_grammar_mib` of memory, on the cores
  every stream shares (one distinct pathological regex after another, `(a{700}){700}b{k}`, a new k
  each time so that the compile cache cannot help, slowed 16 normal streams 2.6x). A client with
  `structured.max_costly_compiles` of them within `structured.costly_compile_window_s` gets a 429
  for its constrained requests.
- requests refused for their size (over `gateway.max_body_bytes`, `tokenizer.max_messages`,
  `tokenizer.max_prompt_chars`, or too deeply nested): each was read and measured whole first,
  megabytes of receiving and decoding on the gateway's loop (a 102,400-message chat sent in a loop
  slowed 16 normal streams 1.6x even after the count moved before the decode). A client with
  `gateway.max_oversized_requests` of them within `gateway.oversized_window_s` gets a 429 for its
  requests with bodies over SMALL_BODY_BYTES, answered before the body is read, and the
  connection is closed.
Either way, until the oldest refusal leaves the window (Retry-After); its other requests, and every
other client, are not affected.

A client is its API key where the run has keys, else its address. Each gateway replica keeps its
own counts: with R replicas a client may get R times the limit through before all refuse it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from services.common.grammar_compiler import COMPILE_BUDGETS

# A body this small is cheap to read and measure: a client past its oversized requests may still
# send it (its next small chat, say).
SMALL_BODY_BYTES = 64 << 10

# Clients remembered at once, the least recently refused forgotten first: bounds the memory an
# attacker with many addresses can make this take (each entry is at most `limit` floats).
MAX_CLIENTS = 10_000


def is_costly_refusal(message: str) -> bool:
    """Whether an engine error is a constraint refused for what its compile cost."""
    return any(f"({budget})" in message for budget in COMPILE_BUDGETS)


class RecentRefusals:
    """The recent refusals of one kind of each client, and whether it may send another.

    `limit` 0 turns the check off."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 0 or window_s <= 0:
            raise ValueError(f"need limit >= 0 and window_s > 0, got {limit} and {window_s}")
        self.limit = limit
        self.window_s = window_s
        self.clock = clock
        self._refusals: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after_s(self, client: str) -> int:
        """Whole seconds until `client` may send such a request again; 0: it may now."""
        times = self._recent(client)
        if not self.limit or times is None or len(times) < self.limit:
            return 0
        return max(1, math.ceil(times[0] + self.window_s - self.clock()))

    def record(self, client: str) -> None:
        """`client` had a request of this kind refused."""
        if not self.limit:
            return
        times = self._recent(client)
        if times is None:
            times = self._refusals[client] = deque(maxlen=self.limit)
            if len(self._refusals) > MAX_CLIENTS:
                self._refusals.popitem(last=False)
        times.append(self.clock())
        self._refusals.move_to_end(client)

    def _recent(self, client: str) -> deque[float] | None:
        times = self._refusals.get(client)
        if times is None:
            return None
        horizon = self.clock() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._refusals[client]
            return None
        return times
