"""The MLflow sink (`observability.mlflow`): every `interval_s`, a point of the run's throughput,
latency percentiles and engine state goes to an MLflow run, plus, when `sample_requests` > 0,
a bounded sample of requests and their outputs as a JSON artifact.

Nothing here may slow serving, whatever the tracking server does. The sink runs in threads of the
supervisor, reads only what /metrics reads (the run's metrics directory, off every stage's hot
path), and splits sampling from sending: the sampler appends each point to a bounded buffer;
the sender logs the buffer. While the server is unreachable the sender warns once and retries;
the buffer keeps the newest `max_buffered` points and counts the ones it drops
(`num_dropped`, also logged as the `sink_dropped_points` metric once the server is back).
MLflow is an optional extra (`pip install '.[mlflow]'`), imported only when the sink starts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.samples import Sample

from ipc.config import MlflowConfig
from services.metrics import PREFIX, registry_for_run
from services.request_sample import take_samples

QUANTILES = (0.5, 0.9, 0.99)
HISTOGRAMS = {
    "ttft": "time_to_first_token_seconds",
    "itl": "inter_token_latency_seconds",
    "e2e": "e2e_request_latency_seconds",
    "queue": "request_queue_time_seconds",
}
COUNTERS = {
    "generation_tok_per_s": "generation_tokens_total",
    "prompt_tok_per_s": "prompt_tokens_total",
    "requests_per_s": "request_success_total",
    "failures_per_s": "request_failure_total",
}
GAUGES = {"requests_running": "num_requests_running", "requests_waiting": "num_requests_waiting"}
RETRY_S = 5.0

log = logging.getLogger("mlflow_sink")


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs, sorted by bound:
    linear inside the bucket that holds the q-th observation; NaN without observations."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # beyond the last finite bound: its bound is all we know
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


@dataclass
class Snapshot:
    """Totals of one scrape, summed over labels (every tokenizer, engine and model)."""

    at: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # metric -> le -> cumulative


def snapshot(run_dir: Path) -> Snapshot:
    snap = Snapshot(time.monotonic())
    wanted_counters = {PREFIX + n for n in COUNTERS.values()}
    wanted_gauges = {PREFIX + n for n in GAUGES.values()} | {PREFIX + "kv_cache_usage_perc"}
    wanted_buckets = {PREFIX + n + "_bucket" for n in HISTOGRAMS.values()}
    for family in registry_for_run(run_dir).collect():
        for s in family.samples:
            _add(snap, s, wanted_counters, wanted_gauges, wanted_buckets)
    return snap


def _add(snap: Snapshot, s: Sample, counters: set[str], gauges: set[str], buckets: set[str]) -> None:
    if s.name in counters:
        snap.counters[s.name] = snap.counters.get(s.name, 0.0) + s.value
    elif s.name in gauges:
        # KV usage is a fraction per engine: the busiest engine says more than a sum.
        combine = max if s.name.endswith("kv_cache_usage_perc") else (lambda a, b: a + b)
        snap.gauges[s.name] = combine(snap.gauges.get(s.name, 0.0), s.value)
    elif s.name in buckets:
        by_le = snap.buckets.setdefault(s.name, {})
        le = float(s.labels["le"])
        by_le[le] = by_le.get(le, 0.0) + s.value


def point(previous: Snapshot, current: Snapshot) -> dict[str, float]:
    """MLflow metrics of the interval between two snapshots: rates, percentiles, gauges."""
    seconds = max(current.at - previous.at, 1e-9)
    values: dict[str, float] = {}
    for key, name in COUNTERS.items():
        full = PREFIX + name
        values[key] = max(current.counters.get(full, 0.0) - previous.counters.get(full, 0.0), 0.0) / seconds
    for key, name in GAUGES.items():
        values[key] = current.gauges.get(PREFIX + name, 0.0)
    values["kv_cache_usage"] = current.gauges.get(PREFIX + "kv_cache_usage_perc", 0.0)
    for key, name in HISTOGRAMS.items():
        now = current.buckets.get(PREFIX + name + "_bucket", {})
        before = previous.buckets.get(PREFIX + name + "_bucket", {})
        # A counter that went back (a restarted process whose files were replaced) restarts the window.
        delta = sorted((le, max(count - before.get(le, 0.0), 0.0)) for le, count in now.items())
        for q in QUANTILES:
            value = histogram_quantile(q, delta)
            if not math.isnan(value):
                values[f"{key}_p{round(q * 100)}_s"] = value
    return values


class MlflowSink:
    """Samples the run every `interval_s` and logs to MLflow from a thread of its own."""

    def __init__(self, config: MlflowConfig, run_dir: Path, run_name: str, params: dict[str, str]) -> None:
        self.config = config
        self.run_dir = run_dir
        self.run_name = run_name
        self.params = params
        self.buffer: deque[tuple[int, int, dict[str, float], list[dict[str, Any]]]] = deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.num_dropped = 0
        self.num_logged = 0
        self.is_down = False
        self.mlflow_run_id: str | None = None
        self.threads = [
            threading.Thread(target=self._sample_loop, name="mlflow-sampler", daemon=True),
            threading.Thread(target=self._send_loop, name="mlflow-sender", daemon=True),
        ]

    def start(self) -> None:
        # Bound each HTTP call: MLflow's own default retries a dead server for minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        for thread in self.threads:
            thread.start()
        log.info("logging to MLflow at %s every %.0fs", self.config.tracking_uri, self.config.interval_s)

    def stop(self, timeout: float = 10.0) -> None:
        """One last point, then whatever can be sent within `timeout`."""
        self.stopping.set()
        self.wake.set()
        for thread in self.threads:
            thread.join(timeout)

    # -- sampling (never waits on the network) -----------------------------------------------

    def _sample_loop(self) -> None:
        previous = snapshot(self.run_dir)
        step = 0
        while True:
            is_last = self.stopping.wait(self.config.interval_s)
            try:
                current = snapshot(self.run_dir)
                samples = (
                    take_samples(self.run_dir, self.config.sample_requests)
                    if self.config.sample_requests
                    else []
                )
            except Exception:  # a metrics file mid-rewrite, say: skip this point, never stop sampling
                log.exception("could not sample the run's metrics")
                continue
            self._enqueue((step, int(time.time() * 1000), point(previous, current), samples))
            previous, step = current, step + 1
            if is_last:
                return

    def _enqueue(self, item: tuple[int, int, dict[str, float], list[dict[str, Any]]]) -> None:
        with self.lock:
            self.buffer.append(item)
            while len(self.buffer) > self.config.max_buffered:
                self.buffer.popleft()
                self.num_dropped += 1
        self.wake.set()

    # -- sending -----------------------------------------------------------------------------

    def _send_loop(self) -> None:
        try:
            import mlflow  # noqa: F401  (the optional extra)
        except ImportError:
            log.warning(
                "observability.mlflow is set but mlflow is not installed (pip install '.[mlflow]'); sink off"
            )
            return
        sampler_done = False
        while True:
            self.wake.wait(RETRY_S)
            self.wake.clear()
            sampler_done = sampler_done or not self.threads[0].is_alive()
            try:
                self._send_buffered()
            except Exception as exc:  # any failure of the server or the network: keep the points
                if not self.is_down:
                    log.warning("MLflow at %s unreachable (%s); buffering up to %d points",
                                self.config.tracking_uri, exc, self.config.max_buffered)  # fmt: skip
                self.is_down = True
                if self.stopping.is_set() and sampler_done:
                    return
                self.stopping.wait(RETRY_S)
                continue
            if self.is_down:
                log.info("MLflow reachable again; %d points dropped meanwhile", self.num_dropped)
                self.is_down = False
            if sampler_done:
                self._finish()
                return

    def _client(self) -> Any:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.config.tracking_uri)
        if self.mlflow_run_id is None:
            experiment = client.get_experiment_by_name(self.config.experiment)
            experiment_id = (
                experiment.experiment_id if experiment else client.create_experiment(self.config.experiment)
            )
            run = client.create_run(
                experiment_id, run_name=self.run_name, tags={"brigade.run": self.run_name}
            )
            self.mlflow_run_id = run.info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in sorted(self.params.items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                client.log_batch(self.mlflow_run_id, params=params[i : i + 100])
        return client

    def _send_buffered(self) -> None:
        from mlflow.entities import Metric

        client = self._client()
        while True:
            with self.lock:
                if not self.buffer:
                    return
                step, at_ms, values, samples = self.buffer[0]
                dropped = self.num_dropped
            metrics = [Metric(k, v, at_ms, step) for k, v in sorted(values.items())]
            metrics.append(Metric("sink_dropped_points", float(dropped), at_ms, step))
            client.log_batch(self.mlflow_run_id, metrics=metrics)
            if samples:
                client.log_text(
                    self.mlflow_run_id, json.dumps(samples, indent=1), f"samples/step-{step:06d}.json"
                )
            with self.lock:
                if self.buffer and self.buffer[0][0] == step:
                    self.buffer.popleft()
                self.num_logged += 1

    def _finish(self) -> None:
        if self.mlflow_run_id is not None:
            self._client().set_terminated(self.mlflow_run_id)
