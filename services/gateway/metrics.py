"""HTTP metrics of a gateway replica, in Prometheus multiprocess mode.

Every replica writes its own files under PROMETHEUS_MULTIPROC_DIR (the run's metrics directory,
which the frontends write to too); GET /metrics on any replica renders the sum over every process
of the run, so a scrape sees the same totals whichever replica the kernel hands it to.
Latencies are measured at the HTTP edge: TTFT from the request's arrival to its first output token.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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


class HttpMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.requests = Counter(
            "brigade:http_requests", "HTTP requests by path and status", ["path", "status"]
        )
        self.ttft = Histogram(
            "brigade:http_time_to_first_token_seconds", "HTTP time to first token", buckets=LATENCY_BUCKETS
        )
        self.inter_token = Histogram(
            "brigade:http_inter_token_latency_seconds",
            "HTTP time between output tokens",
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "brigade:http_e2e_request_latency_seconds", "HTTP request latency", buckets=LATENCY_BUCKETS
        )

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def on_response(self, path: str, status: int) -> None:
        # Unknown paths share one label: a scanner must not create a series per URL it tries.
        known = path in KNOWN_PATHS
        self.requests.labels(path if known else "other", str(status)).inc()

    @staticmethod
    def render(metrics_dir: str | None) -> bytes:
        registry = CollectorRegistry()
        if metrics_dir:
            MultiProcessCollector(registry, metrics_dir)
        return generate_latest(registry)


KNOWN_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
    }
)
