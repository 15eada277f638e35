"""Timing one HTTP generation request into the replica's `services.metrics.HttpMetrics`.

Every replica writes its own multiprocess files under the run's metrics directory; GET /metrics
on any replica renders `services.metrics.registry_for_run`, the sum over every process of the run,
so a scrape sees the same totals whichever replica the kernel hands it to.
"""

from __future__ import annotations

import time

from services.metrics import HttpMetrics


class RequestTimer:
    """One HTTP generation request's timestamps, observed into the replica's histograms."""

    def __init__(self, metrics: HttpMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last_token: float | None = None

    def on_output(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.inter_token.observe((now - self.last_token) / len(token_ids))
        self.last_token = now

    def on_finish(self) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
