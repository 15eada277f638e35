"""Request metrics of a frontend replica, in Prometheus multiprocess mode: every replica writes
its own files under PROMETHEUS_MULTIPROC_DIR and the supervisor serves the sum at /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RequestMetrics:
    """Outcome counts and TTFT / inter-token / end-to-end latency histograms."""

    def __init__(self) -> None:
        self.requests = Counter("brigade_requests", "Finished requests by outcome", ["outcome"])
        self.ttft = Histogram("brigade_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS)
        self.inter_token = Histogram(
            "brigade_inter_token_latency_seconds", "Time between output deltas, per token", buckets=LATENCY_BUCKETS
        )
        self.e2e = Histogram("brigade_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS)

    def on_tokens(self, arrival: float, last: float | None, now: float, num_tokens: int) -> None:
        if last is None:
            self.ttft.observe(now - arrival)
        elif num_tokens:
            self.inter_token.observe((now - last) / num_tokens)

    def on_finish(self, outcome: str, arrival: float, now: float) -> None:
        self.requests.labels(outcome).inc()
        self.e2e.observe(now - arrival)
