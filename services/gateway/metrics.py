"""Timing one HTTP generation request into the replica's `services.metrics.HttpMetrics`.

Every replica writes its own multiprocess files under the run's metrics directory; GET /metrics
on any replica renders `services.metrics.registry_for_run`, the sum over every process of the run,
so a scrape sees the same totals whichever replica the kernel hands it to.
"""

from __future__ import annotations

import time

from client.sdk import StreamDelta
from services.metrics import HttpMetrics


class RequestTimer:
    """One HTTP generation request's timestamps, observed into the replica's histograms."""

    def __init__(self, metrics: HttpMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        # When each choice last output tokens: with n > 1 the choices' deltas interleave, and the
        # gap between two choices' outputs of one step is no inter-token latency.
        self.last_token: dict[int, float] = {}

    def on_output(self, item: tuple[int, StreamDelta] | None) -> None:
        """Choice `item[0]` output `item[1]`'s tokens now (None: the request ended)."""
        if item is None or not item[1].token_ids:
            return
        index, delta = item
        now = time.monotonic()
        if not self.last_token:
            self.metrics.ttft.observe(now - self.arrival)
        elif index in self.last_token:
            self.metrics.inter_token.observe((now - self.last_token[index]) / len(delta.token_ids))
        self.last_token[index] = now

    def on_finish(self) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
