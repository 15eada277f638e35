"""Every Prometheus metric Brigade exports, defined here and nowhere else (docs/metrics.md).

Names follow vLLM's with the `brigade:` prefix, so dashboards and alerts written for vLLM work
after a prefix swap. Two sources feed one /metrics page:

- Request and engine metrics are observed where they happen (the tokenizer replicas, the
  schedulers) in Prometheus multiprocess mode: each process writes its own files under the run's
  metrics directory (PROMETHEUS_MULTIPROC_DIR, set by the supervisor for every stage), and a
  reader sums them. Counters of a process that died stay in the sum, so a stage restart never
  makes a counter go back.
- Stage gauges (queue depths, KV usage, restarts, CPU, memory) come from the heartbeats the
  supervisor already receives. It writes them to `stages.json` in the metrics directory
  (`write_stage_samples`); `StageCollector` turns that file into metric families at scrape
  time, and reads each stage's CPU and resident memory from /proc then.

Whoever serves /metrics (the supervisor's `metrics_port`, or the gateway) serves
`registry_for_run(run_dir)`, so every server shows the same numbers. Light: no torch.
"""

from __future__ import annotations

import gzip
import logging
import os
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

import msgspec
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    Metric,
    generate_latest,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.multiprocess import MultiProcessCollector

from ipc.config import MAX_SPECULATIVE_TOKENS
from services.stage_rows import StageRow

PREFIX = "brigade:"
METRICS_DIR = "metrics"  # under the run directory; the stages' PROMETHEUS_MULTIPROC_DIR
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
STAGES_FILE = "stages.json"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Inter-token gaps of a CPU decode sit between a few ms and a few hundred.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)
# vLLM's buckets for its per-request histograms, so that a panel's quantiles read alike: time per
# output token and a request's phase durations (decode).
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20)  # vLLM's request_num_preemptions
STEP_TOKEN_BUCKETS = (
    1,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
)  # iteration_tokens_total
# Exported only by runs on CUDA; a dashboard panel over them is empty on the CPU.
CUDA_ONLY = (f"{PREFIX}gpu_memory_allocated_bytes", f"{PREFIX}gpu_memory_reserved_bytes")

log = logging.getLogger("metrics")


def token_count_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len`: vLLM's buckets for per-request token
    counts, which no request can exceed."""
    buckets = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def metrics_dir(run_dir: Path) -> Path:
    return run_dir / METRICS_DIR


# Each process's multiprocess files, one per metric type (Brigade has counters and histograms),
# allocated in full before prometheus_client maps them: it makes them sparse and writes through
# the mapping, and a page written on a full filesystem (a tmpfs run dir) faults with SIGBUS,
# which killed a stage at every restart. 1 MiB holds thousands of series, far more than a stage
# makes, so prometheus_client never grows them (growing is sparse again).
METRICS_FILE_BYTES = 1 << 20
METRICS_FILE_TYPES = ("counter", "histogram")
_reserved_by_pid = 0


def reserve_metrics_files() -> None:
    """Allocate this process's multiprocess files (once). On a full disk the process's metrics
    stay in its memory instead, off /metrics (logged): serving matters more than its numbers."""
    global _reserved_by_pid
    directory = os.environ.get(METRICS_DIR_ENV)
    if (
        not directory
        or _reserved_by_pid == os.getpid()
        or not getattr(values.ValueClass, "_multiprocess", False)
    ):
        return
    _reserved_by_pid = os.getpid()
    try:
        for kind in METRICS_FILE_TYPES:
            fd = os.open(os.path.join(directory, f"{kind}_{os.getpid()}.db"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, METRICS_FILE_BYTES)
            finally:
                os.close(fd)
    except OSError as exc:
        values.ValueClass = values.MutexValue
        log.warning("no room for this process's metrics files in %s (%s): its metrics are off /metrics until it restarts",
                    directory, exc.strerror)  # fmt: skip


# -- observed in the stages (multiprocess files) -------------------------------------------------


class FinishedRequest(msgspec.Struct, frozen=True):
    """What the per-request histograms observe of a request as it ends. Times are the
    tokenizer's (time.monotonic()) when output tokens reached the client; None: none did."""

    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None  # None: unbounded (an embedding), not observed, as vLLM
    first_token_time: float | None
    last_token_time: float | None
    num_cached_tokens: int = 0  # known only from a final delta's usage (not for an abort)
    # Of the output, the tokens another (dead) replica delivered before the request was resumed
    # here: the first and last token times are this replica's, of the tokens after them.
    num_resumed_tokens: int = 0


class RequestMetrics:
    """Per-request metrics of a tokenizer replica, observed as deltas reach the client."""

    def __init__(
        self, model_name: str, *, max_model_len: int, registry: CollectorRegistry = REGISTRY
    ) -> None:
        reserve_metrics_files()
        labels = ["model_name"]
        self.model_name = model_name
        self.success = Counter(
            f"{PREFIX}request_success",
            "Finished requests by finish reason",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self.failure = Counter(
            f"{PREFIX}request_failure",
            "Requests that ended in an error, by code",
            [*labels, "code"],
            registry=registry,
        )
        # Children bound once: labels() is a dict lookup plus a lock, not worth paying per token.
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens",
            "Prompt tokens of requests whose prefill finished",
            labels,
            registry=registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Output tokens delivered", labels, registry=registry
        ).labels(model_name)
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Arrival to first output token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.inter_token = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between output deltas, per token",
            labels,
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Arrival to last delta",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ).labels(model_name)
        # vLLM's per-request histograms: one observation per request counted in request_success.
        token_buckets = token_count_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            f"{PREFIX}request_prompt_tokens", "Prompt tokens of each finished request",
            labels, buckets=token_buckets, registry=registry,
        ).labels(model_name)  # fmt: skip
        self.request_generation_tokens = Histogram(
            f"{PREFIX}request_generation_tokens", "Output tokens of each finished request",
            labels, buckets=token_buckets, registry=registry,
        ).labels(model_name)  # fmt: skip
        self.request_max_tokens = Histogram(
            f"{PREFIX}request_params_max_tokens", "The max_tokens parameter of each finished request",
            labels, buckets=token_buckets, registry=registry,
        ).labels(model_name)  # fmt: skip
        self.request_time_per_output_token = Histogram(
            f"{PREFIX}request_time_per_output_token_seconds",
            "Each finished request's decode time divided by its output tokens after the first",
            labels, buckets=TPOT_BUCKETS, registry=registry,
        ).labels(model_name)  # fmt: skip
        self.request_decode_time = Histogram(
            f"{PREFIX}request_decode_time_seconds",
            "Each finished request's time from its first output token to its last",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry,
        ).labels(model_name)  # fmt: skip
        self.prompt_tokens_cached = Counter(
            f"{PREFIX}prompt_tokens_cached", "Prompt tokens of finished requests found in the prefix cache",
            labels, registry=registry,
        ).labels(model_name)  # fmt: skip
        self.slow_clients_dropped = Counter(
            f"{PREFIX}slow_clients_dropped",
            "Clients whose full queues took none of their replies for tokenizer.slow_client_timeout_s; "
            "their requests are aborted (and counted in request_success, finished_reason abort)",
            labels, registry=registry,
        ).labels(model_name)  # fmt: skip

    def on_tokens(
        self, arrival: float, last: float | None, now: float, num_tokens: int, num_prompt_tokens: int
    ) -> None:
        """`num_tokens` new output tokens reached the client; `last` is when the previous ones did."""
        self.generation_tokens.inc(num_tokens)
        if last is None:
            self.ttft.observe(now - arrival)
            self.prompt_tokens.inc(num_prompt_tokens)
        elif num_tokens:
            self.inter_token.observe((now - last) / num_tokens)

    def on_resumed_tokens(self, num_tokens: int) -> None:
        """The first new tokens of a request resumed from another replica: its time to first token
        and its prompt were observed there, and the gap since its last token there is unknown."""
        self.generation_tokens.inc(num_tokens)

    def on_finish(self, reason: str, arrival: float, now: float, request: FinishedRequest) -> None:
        """A request finished with `reason`: stop, length or abort."""
        self.success.labels(self.model_name, reason).inc()
        self.e2e.observe(now - arrival)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generation_tokens)
        if request.max_tokens:
            self.request_max_tokens.observe(request.max_tokens)
        decode_s = 0.0  # as vLLM's, for a request that got no output token
        if request.first_token_time is not None and request.last_token_time is not None:
            decode_s = request.last_token_time - request.first_token_time
        self.request_decode_time.observe(decode_s)
        # The first output token is the prefill's: vLLM divides by the others, 0 without any. The
        # decode time of a resumed request spans only the tokens delivered since its resumption.
        decoded = request.num_generation_tokens - request.num_resumed_tokens - 1
        self.request_time_per_output_token.observe(decode_s / decoded if decoded > 0 else 0.0)
        self.prompt_tokens_cached.inc(request.num_cached_tokens)

    def on_slow_client_dropped(self) -> None:
        """A client stopped reading and was treated as gone (services/tokenizer/__main__.py)."""
        self.slow_clients_dropped.inc()

    def on_failure(self, code: str) -> None:
        """A request ended in an error (`overloaded`, `invalid_request`, ...). Not in the latency
        histograms: a refusal's few microseconds would hide the latency of the served."""
        self.failure.labels(self.model_name, code).inc()


class ChoicesMetrics:
    """vLLM's histograms of a request's `n` parameter and of the most output tokens any of its
    choices got. Only a gateway replica sees a request's choices together (services/gateway/jobs.py):
    it submits each as a request of its own, so no tokenizer knows `n`."""

    def __init__(
        self, model_name: str, *, max_model_len: int, registry: CollectorRegistry = REGISTRY
    ) -> None:
        reserve_metrics_files()
        labels = ["model_name"]
        self.n = Histogram(
            f"{PREFIX}request_params_n", "The n parameter of each finished request (per prompt)",
            labels, buckets=N_BUCKETS, registry=registry,
        ).labels(model_name)  # fmt: skip
        self.max_generation_tokens = Histogram(
            f"{PREFIX}request_max_num_generation_tokens",
            "The most output tokens any of a finished request's n choices got",
            labels, buckets=token_count_buckets(max_model_len), registry=registry,
        ).labels(model_name)  # fmt: skip

    def on_finish(self, n: int, max_generation_tokens: int) -> None:
        """A prompt's `n` choices all finished, the longest with `max_generation_tokens` tokens."""
        self.n.observe(n)
        self.max_generation_tokens.observe(max_generation_tokens)


class HttpMetrics:
    """A gateway replica's HTTP metrics: responses by path and status, and the latencies a client
    sees at the HTTP edge (arrival to first token, between tokens, to the last byte)."""

    # The gateway's routes (services/gateway/routes.py), a templated one by its template; unknown
    # paths share one label, so that a scanner does not create a series per URL it tries.
    PATHS = frozenset(
        {
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
            "/score",
            "/v1/score",
            "/rerank",
            "/v1/rerank",
            "/v2/rerank",
            "/invocations",
            "/completion",
            "/completions",
            "/apply-template",
            "/props",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/responses",
            "/v1/models",
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/health",
            "/ping",
            "/version",
            "/load",
            "/metrics",
            "/tokenize",
            "/detokenize",
            "/tokenizer_info",
        }
    )
    TEMPLATES = (("/v1/responses/", "/v1/responses/{response_id}"), ("/v1/models/", "/v1/models/{model_id}"))

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        reserve_metrics_files()
        self.registry = registry  # the replica's other metrics (ChoicesMetrics) register here too
        self.requests = Counter(
            f"{PREFIX}http_requests",
            "HTTP responses by path and status",
            ["path", "status"],
            registry=registry,
        )
        self.tls_reloads = Counter(
            f"{PREFIX}gateway_tls_reloads",
            "Certificate files read again after they changed on disk, by outcome (applied, refused)",
            ["outcome"],
            registry=registry,
        )
        self.ttft = Histogram(
            f"{PREFIX}http_time_to_first_token_seconds", "HTTP arrival to first output token",
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.inter_token = Histogram(
            f"{PREFIX}http_inter_token_latency_seconds", "HTTP time between output tokens, per token",
            buckets=TOKEN_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.e2e = Histogram(
            f"{PREFIX}http_e2e_request_latency_seconds", "HTTP arrival to the end of the reply",
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip

    def on_response(self, path: str, status: int) -> None:
        self.requests.labels(self.path_label(path), str(status)).inc()

    @classmethod
    def path_label(cls, path: str) -> str:
        if path in cls.PATHS:
            return path
        for prefix, template in cls.TEMPLATES:
            if path.startswith(prefix) and len(path) > len(prefix):
                return template
        return "other"


class FinishedTimes(NamedTuple):
    """A request this scheduler finished, as vLLM's per-request engine histograms see it: its
    preemptions, and, where its first step and first token were here, seconds from its first
    step to its first token (prefill) and to its last (inference)."""

    num_preemptions: int
    prefill_s: float | None
    inference_s: float | None


class EngineMetrics:
    """Metrics a scheduler observes: time in the waiting queue, prefix-cache lookups, and the
    workers' time per step."""

    def __init__(self, model_name: str, engine: int, registry: CollectorRegistry = REGISTRY) -> None:
        reserve_metrics_files()
        labels = ["model_name", "engine"]
        values = (model_name, str(engine))
        self.queue_time = Histogram(
            f"{PREFIX}request_queue_time_seconds",
            "Arrival at the scheduler to first being scheduled",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ).labels(*values)
        self.prefix_queries = Counter(
            f"{PREFIX}prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            labels,
            registry=registry,
        ).labels(*values)
        self.prefix_hits = Counter(
            f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=registry
        ).labels(*values)
        execute_time = Histogram(
            f"{PREFIX}step_execute_time_seconds",
            "The worker's time to run one step (model and sampling)",
            [*labels, "phase"],
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=registry,
        )
        self.execute_time = {
            is_prefill: execute_time.labels(*values, "prefill" if is_prefill else "decode")
            for is_prefill in (False, True)
        }
        self.queries_seen = 0
        self.hits_seen = 0
        self.preemptions = Counter(
            f"{PREFIX}num_preemptions",
            "Running requests preempted: their KV cache freed, to be computed again",
            labels,
            registry=registry,
        ).labels(*values)
        self.preemptions_seen = 0

        # vLLM's per-request engine histograms: from the scheduler's first step of a request to
        # its first token and to its last, and its preemptions; and the tokens of each step.
        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"{PREFIX}{name}", documentation, labels, buckets=buckets, registry=registry
            ).labels(*values)

        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "A finished request's time from its first step to its first output token",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "A finished request's time from its first step to its last output token",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_preemptions = histogram(
            "request_num_preemptions", "A finished request's preemptions", PREEMPTION_BUCKETS
        )
        self.step_tokens = histogram(
            "iteration_tokens_total",
            "Tokens computed in one step (prompt and output tokens of every sequence)",
            STEP_TOKEN_BUCKETS,
        )
        # Speculative decoding (docs/speculative.md), as vLLM's spec_decode_* counters: the mean
        # acceptance length is 1 + accepted tokens / drafts.
        self.spec_drafts = Counter(
            f"{PREFIX}spec_decode_num_drafts", "Verifications of proposed tokens", labels, registry=registry
        ).labels(*values)
        self.spec_draft_tokens = Counter(
            f"{PREFIX}spec_decode_num_draft_tokens", "Proposed tokens verified", labels, registry=registry
        ).labels(*values)
        self.spec_accepted_tokens = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens",
            "Proposed tokens the target model agreed with",
            labels,
            registry=registry,
        ).labels(*values)
        self.spec_seen = (0, 0, 0)
        self.spec_accepted_per_pos = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens the target model agreed with, by their position in the proposal (from 0)",
            [*labels, "position"],
            registry=registry,
        )
        self.spec_values = values
        self.spec_acceptance_length = Histogram(
            f"{PREFIX}spec_decode_acceptance_length",
            "Tokens each verification emitted: its accepted proposals and the target's next token",
            labels,
            buckets=tuple(range(1, MAX_SPECULATIVE_TOKENS + 2)),
            registry=registry,
        ).labels(*values)
        # LoRA adapters (docs/lora.md): loads at run time, and adapters copied into a slot.
        self.lora_loads = Counter(
            f"{PREFIX}lora_adapter_loads", "LoRA adapters loaded at run time", labels, registry=registry
        ).labels(*values)
        self.lora_swaps = Counter(
            f"{PREFIX}lora_adapter_swaps",
            "LoRA adapters copied from host memory into a worker slot for a step",
            labels,
            registry=registry,
        ).labels(*values)
        self.lora_prefetches = Counter(
            f"{PREFIX}lora_adapter_prefetches",
            "Of the LoRA adapter swaps, those copied in ahead of the step that needs them",
            labels,
            registry=registry,
        ).labels(*values)
        self.lora_seen = (0, 0, 0)

    def update(
        self,
        queue_times: deque[float],
        num_queries: int,
        num_hits: int,
        executed_steps: deque[tuple[bool, float, int]],
        num_preemptions: int,
        finished: deque[FinishedTimes],
    ) -> None:
        """Observe queue times, steps (whether the step computed prompt tokens, its seconds and
        tokens) and finished requests, taking each out of its deque; and take the cache's
        running totals and the preemptions' into the counters."""
        while queue_times:
            self.queue_time.observe(queue_times.popleft())
        while executed_steps:
            is_prefill, seconds, num_tokens = executed_steps.popleft()
            self.execute_time[is_prefill].observe(seconds)
            self.step_tokens.observe(num_tokens)
        while finished:
            times = finished.popleft()
            self.request_preemptions.observe(times.num_preemptions)
            if times.prefill_s is not None and times.inference_s is not None:
                self.prefill_time.observe(times.prefill_s)
                self.inference_time.observe(times.inference_s)
        if num_queries > self.queries_seen:
            self.prefix_queries.inc(num_queries - self.queries_seen)
            self.prefix_hits.inc(num_hits - self.hits_seen)
            self.queries_seen, self.hits_seen = num_queries, num_hits
        if num_preemptions > self.preemptions_seen:
            self.preemptions.inc(num_preemptions - self.preemptions_seen)
            self.preemptions_seen = num_preemptions

    def update_speculation(
        self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int, acceptance_lengths: deque[int]
    ) -> None:
        """Take the scheduler's running totals of verifications into the counters, and each
        verification's acceptance length (taking them out of their deque) into the histogram."""
        while acceptance_lengths:
            length = acceptance_lengths.popleft()
            self.spec_acceptance_length.observe(length)
            for position in range(length - 1):  # its accepted proposals, the first ones
                self.spec_accepted_per_pos.labels(*self.spec_values, str(position)).inc()
        totals = (num_drafts, num_draft_tokens, num_accepted_tokens)
        counters = (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens)
        for counter, total, seen in zip(counters, totals, self.spec_seen, strict=True):
            if total > seen:
                counter.inc(total - seen)
        self.spec_seen = totals

    def update_lora(self, num_loads: int, num_swaps: int, num_prefetches: int) -> None:
        """Take the scheduler's running totals of adapter loads, swaps and prefetches (the swaps
        copied in ahead) into the counters."""
        totals = (num_loads, num_swaps, num_prefetches)
        counters = (self.lora_loads, self.lora_swaps, self.lora_prefetches)
        for counter, total, seen in zip(counters, totals, self.lora_seen, strict=True):
            if total > seen:
                counter.inc(total - seen)
        self.lora_seen = totals


ENCODER_OUTCOMES = ("answered", "refused", "failed")  # failed: the encoder's own error, not the image's


class EncoderMetrics:
    """Metrics an encoder replica observes (services/encoder/): the images it ran through its
    vision tower or found in its cache, and each request's wait for it and time in it."""

    def __init__(self, model_name: str, encoder: int, registry: CollectorRegistry = REGISTRY) -> None:
        reserve_metrics_files()
        labels = ["model_name", "encoder"]
        values = (model_name, str(encoder))
        self.images_encoded = Counter(
            f"{PREFIX}encoder_images_encoded", "Images run through the vision tower (cache misses)",
            labels, registry=registry,
        ).labels(*values)  # fmt: skip
        self.cache_hits = Counter(
            f"{PREFIX}encoder_cache_hits", "Images whose embeddings the encoder's cache held already",
            labels, registry=registry,
        ).labels(*values)  # fmt: skip
        requests = Counter(
            f"{PREFIX}encoder_requests",
            "Requests an encoder handled, by outcome (answered, refused: a bad image, failed: its own error)",
            [*labels, "outcome"], registry=registry,
        )  # fmt: skip
        self.requests = {outcome: requests.labels(*values, outcome) for outcome in ENCODER_OUTCOMES}
        self.queue_time = Histogram(
            f"{PREFIX}encoder_queue_time_seconds", "A tokenizer's first ask to the encoder starting on it",
            labels, buckets=LATENCY_BUCKETS, registry=registry,
        ).labels(*values)  # fmt: skip
        self.encode_time = Histogram(
            f"{PREFIX}encoder_encode_time_seconds",
            "One request in the encoder: its images decoded, and the tower run on those not cached",
            labels, buckets=LATENCY_BUCKETS, registry=registry,
        ).labels(*values)  # fmt: skip

    def on_request(
        self, outcome: str, queue_s: float, encode_s: float, num_encoded: int, num_cached: int
    ) -> None:
        """A request answered with `outcome` (ENCODER_OUTCOMES) after `queue_s` waiting and
        `encode_s` in the encoder, having encoded `num_encoded` images and found `num_cached`."""
        self.requests[outcome].inc()
        self.queue_time.observe(max(queue_s, 0.0))  # two hosts' clocks may disagree a little
        self.encode_time.observe(encode_s)
        self.images_encoded.inc(num_encoded)
        self.cache_hits.inc(num_cached)


# -- stage gauges (from heartbeats, through stages.json) -----------------------------------------


class RingSample(msgspec.Struct, frozen=True):
    name: str
    slots_in_use: int


class EngineGroupsSample(msgspec.Struct, frozen=True):
    """The run's engine groups, and the autoscaler's target and decisions (supervision/group_scaler.py)."""

    current: int
    target: int
    decisions_up: int = 0
    decisions_down: int = 0


class StageSamples(msgspec.Struct, frozen=True):
    model_name: str
    device: str
    stages: list[StageRow]  # the supervisor's own row first
    rings: list[RingSample] = []
    groups: EngineGroupsSample | None = None


def write_stage_samples(run_dir: Path, samples: StageSamples) -> None:
    """Atomically replace the run's stages.json (readers never see half a file)."""
    directory = metrics_dir(run_dir)
    tmp = directory / (STAGES_FILE + ".tmp")
    tmp.write_bytes(msgspec.json.encode(samples))
    tmp.replace(directory / STAGES_FILE)


def read_stage_samples(run_dir: Path) -> StageSamples | None:
    try:
        return msgspec.json.decode((metrics_dir(run_dir) / STAGES_FILE).read_bytes(), type=StageSamples)
    except (OSError, msgspec.DecodeError):
        return None  # not written yet, or a run that is gone


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def process_usage(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) of a live process, from /proc; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        statm = Path(f"/proc/{pid}/statm").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; the fields we need follow its closing paren.
    fields = stat.rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _CLOCK_TICKS, int(statm.split()[1]) * _PAGE_SIZE


class StageCollector:
    """Metric families from the run's stages.json, read at each scrape."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def collect(self) -> Iterator[Metric]:
        samples = read_stage_samples(self.run_dir)
        if samples is None:
            return
        engine_labels = ["model_name", "engine"]
        running = GaugeMetricFamily(
            f"{PREFIX}num_requests_running", "Requests in the running batch", labels=engine_labels
        )
        waiting = GaugeMetricFamily(
            f"{PREFIX}num_requests_waiting", "Requests waiting to run", labels=engine_labels
        )
        kv = GaugeMetricFamily(
            f"{PREFIX}kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full)",
            labels=engine_labels,
        )
        stage_labels = ["stage", "kind"]
        restarts = CounterMetricFamily(
            f"{PREFIX}stage_restarts", "Restarts of each stage", labels=stage_labels
        )
        malformed = CounterMetricFamily(
            f"{PREFIX}malformed_messages", "Malformed messages a stage rejected", labels=stage_labels
        )
        curve_failures = CounterMetricFamily(
            f"{PREFIX}curve_auth_failures",
            "CURVE handshakes a stage's tcp:// server sockets refused (a wrong or missing key)",
            labels=stage_labels,
        )
        cpu = CounterMetricFamily(
            f"{PREFIX}stage_cpu_seconds", "CPU time of the stage's current process", labels=stage_labels
        )
        rss = GaugeMetricFamily(
            f"{PREFIX}stage_resident_memory_bytes", "Resident memory", labels=stage_labels
        )
        up = GaugeMetricFamily(
            f"{PREFIX}stage_up", "1 while the stage is running and ready", labels=stage_labels
        )
        lora_info = GaugeMetricFamily(
            f"{PREFIX}lora_requests_info",
            "LoRA adapters of the running and of the waiting requests (as vLLM's lora_requests_info)",
            labels=[*engine_labels, "running_lora_adapters", "waiting_lora_adapters"],
        )
        encoder_queue = GaugeMetricFamily(
            f"{PREFIX}encoder_queue_depth",
            "Requests an encoder has received and not answered yet",
            labels=stage_labels,
        )
        families = [
            running,
            waiting,
            kv,
            lora_info,
            encoder_queue,
            restarts,
            malformed,
            curve_failures,
            cpu,
            rss,
            up,
        ]
        is_cuda = samples.device == "cuda"
        if is_cuda:
            allocated = GaugeMetricFamily(CUDA_ONLY[0], "GPU memory held by tensors", labels=stage_labels)
            reserved = GaugeMetricFamily(
                CUDA_ONLY[1], "GPU memory reserved by the allocator", labels=stage_labels
            )
            families += [allocated, reserved]
        for s in samples.stages:
            values = [s.name, s.kind]
            if s.kind == "scheduler":
                engine = [samples.model_name, str(s.engine)]
                running.add_metric(engine, s.running)
                waiting.add_metric(engine, s.waiting)
                kv.add_metric(engine, s.kv_usage)
                if s.lora_adapters:  # adapters on, and some loaded
                    adapters = [",".join(s.lora_running), ",".join(s.lora_waiting)]
                    lora_info.add_metric([*engine, *adapters], 1.0)
            if s.kind == "encoder":
                encoder_queue.add_metric(values, s.queue_depth)
            restarts.add_metric(values, s.restarts)
            malformed.add_metric(values, s.malformed)
            curve_failures.add_metric(values, s.auth_failures)
            up.add_metric(values, 1.0 if s.state == "running" else 0.0)
            usage = process_usage(s.pid) if s.pid else None
            if usage is not None:
                cpu.add_metric(values, usage[0])
                rss.add_metric(values, usage[1])
            if is_cuda and s.kind == "gpu_worker":
                allocated.add_metric(values, s.gpu_memory_allocated)
                reserved.add_metric(values, s.gpu_memory_reserved)
        slots = GaugeMetricFamily(
            f"{PREFIX}shm_slots_in_use", "Shared-memory ring slots in use", labels=["ring"]
        )
        for ring in samples.rings:
            slots.add_metric([ring.name], ring.slots_in_use)
        yield from families
        yield slots
        if samples.groups is not None:
            yield from engine_group_families(samples.model_name, samples.groups)


def engine_group_families(model_name: str, groups: EngineGroupsSample) -> list[Metric]:
    labels = ["model_name"]
    current = GaugeMetricFamily(f"{PREFIX}engine_groups", "Engine groups in the run", labels=labels)
    current.add_metric([model_name], groups.current)
    target = GaugeMetricFamily(
        f"{PREFIX}engine_groups_target",
        "Engine groups the autoscaler is bringing the run to (the current count when it is off or done)",
        labels=labels,
    )
    target.add_metric([model_name], groups.target)
    decisions = CounterMetricFamily(
        f"{PREFIX}autoscale_decisions", "Changes of the engine groups the autoscaler decided, by direction",
        labels=[*labels, "direction"],
    )  # fmt: skip
    decisions.add_metric([model_name, "up"], groups.decisions_up)
    decisions.add_metric([model_name, "down"], groups.decisions_down)
    return [current, target, decisions]


def registry_for_run(run_dir: Path) -> CollectorRegistry:
    """Everything of one run: the stages' multiprocess files plus the stage gauges."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(metrics_dir(run_dir)))
    registry.register(StageCollector(run_dir))
    return registry


# Each scrape's connection holds a thread of the supervisor: one that sends no request, or takes
# no bytes of the page, for this long is closed rather than kept for as long as its client likes.
SCRAPE_SOCKET_TIMEOUT_S = 10.0


class _ScrapeHandler(WSGIRequestHandler):
    timeout = SCRAPE_SOCKET_TIMEOUT_S  # socketserver sets it on each connection's socket

    def log_message(self, format: str, *args: object) -> None:
        """No line per scrape."""


class _ScrapeServer(ThreadingWSGIServer):
    def handle_error(self, request: object, client_address: tuple) -> None:
        """socketserver prints a traceback to stderr for any error, outside the run's log format;
        a scraper that went away or timed out is its own business, anything else a logged bug."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("metrics scrape from %s ended: %r", client_address, exc)
        else:
            log.exception("metrics scrape from %s failed", client_address)


class SamplesNamed:
    """`registry`'s samples of these names only, each in its family (prometheus_client's
    restricted_registry skips a registry's unnamed collectors, which the multiprocess one is)."""

    def __init__(self, registry: CollectorRegistry, names: set[str]) -> None:
        self.registry = registry
        self.names = names

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            samples = [sample for sample in family.samples if sample.name in self.names]
            if samples:
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = samples
                yield kept


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header takes gzip (named, or `*`, without q=0)."""
    for item in accept_encoding.lower().split(","):
        coding, *params = (part.strip() for part in item.split(";"))
        if coding in ("gzip", "*"):
            quality = next((param[2:] for param in params if param.startswith("q=")), "1")
            try:
                return float(quality) > 0
            except ValueError:
                return False
    return False


def scrape_page(registry: CollectorRegistry, query_string: str, accept_encoding: str) -> tuple[bytes, list]:
    """The body and headers of a /metrics page, as prometheus_client's own server makes them for
    Prometheus: only the families that `name[]` query parameters name (`?name[]=a&name[]=b`;
    all without), and gzipped when the scraper accepts it. Always Prometheus' text format, never
    OpenMetrics, whatever the Accept header asks: prometheus_client answers a scraper that names no
    `escaping` (Prometheus 2's default header) with every `:` of a name escaped to `_`, and no
    `brigade:` metric that docs/metrics.md and the dashboard name is left."""
    names = parse_qs(query_string).get("name[]")
    body = generate_latest(SamplesNamed(registry, set(names)) if names else registry)  # type: ignore[arg-type]
    headers = [("Content-Type", CONTENT_TYPE_LATEST)]
    if accepts_gzip(accept_encoding):
        body = gzip.compress(body)
        headers.append(("Content-Encoding", "gzip"))
    return body, headers


def scrape_app(registry: CollectorRegistry) -> Callable[[dict, Callable], list[bytes]]:
    """A WSGI app answering every request with `registry` (scrape_page), as the gateway's /metrics
    page does."""

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        body, headers = scrape_page(
            registry, environ.get("QUERY_STRING", ""), environ.get("HTTP_ACCEPT_ENCODING", "")
        )
        start_response("200 OK", [*headers, ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve(run_dir: Path, port: int, host: str) -> bool:
    """Serve /metrics on `host`:`port` in a thread. A port already taken is logged, not fatal:
    serving requests matters more than exporting numbers about them."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("ScrapeServer", (_ScrapeServer,), {"address_family": family})
        server = make_server(host, port, scrape_app(registry_for_run(run_dir)), server_class, _ScrapeHandler)
    except OSError as exc:
        log.warning("metrics port %d unavailable (%s); /metrics is off for this run", port, exc.strerror)
        return False
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics at http://%s:%d/metrics", f"[{host}]" if ":" in host else host, port)
    return True
