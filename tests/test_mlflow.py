"""The MLflow sink against a real local tracking store (sqlite): points computed from metrics real
processes wrote, the request sample, an unreachable server (bounded buffer, dropped points
counted, stop still prompt), and the serving benchmark's `--mlflow` logging."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from ipc.config import MlflowConfig  # noqa: E402
from services import metrics  # noqa: E402
from services.mlflow_sink import MlflowSink, histogram_quantile, point, snapshot  # noqa: E402
from services.request_sample import RequestSampler, take_samples  # noqa: E402
from tests.conftest import REPO_ROOT  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tracking(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One sqlite store for the module (creating its tables takes seconds), artifacts beside it."""
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", root / "artifacts"


def experiment(uri: str, artifacts: Path, name: str) -> str:
    client = MlflowClient(tracking_uri=uri)
    return client.create_experiment(name, artifact_location=(artifacts / name).as_uri())


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # 10 observations: 4 in (0, 1], 4 in (1, 2], 2 in (2, +Inf).
    buckets = [(1.0, 4.0), (2.0, 8.0), (math.inf, 10.0)]
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.5)  # rank 2 of 4 in (0, 1]
    assert histogram_quantile(0.5, buckets) == pytest.approx(1.25)  # rank 5: 1 of 4 into (1, 2]
    assert histogram_quantile(0.9, buckets) == 2.0  # in the +Inf bucket: its lower bound
    assert math.isnan(histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))


def test_interval_percentiles_follow_the_data(tmp_path: Path) -> None:
    """Only this interval's observations count; its percentiles are what interpolating inside
    numpy's own bucket counts of the same draws gives."""
    metrics.metrics_dir(tmp_path).mkdir()
    write_ttfts(tmp_path, [100.0] * 50)  # before the interval: must not count
    before = snapshot(tmp_path)
    draws = np.random.default_rng(0).uniform(0.0, 2.0, size=400)
    write_ttfts(tmp_path, draws.tolist())
    values = point(before, snapshot(tmp_path))
    bounds = np.array(metrics.LATENCY_BUCKETS)
    cumulative = (draws[:, None] <= bounds[None, :]).sum(axis=0)
    for q in (50, 90, 99):
        rank = q / 100 * len(draws)
        k = int(np.searchsorted(cumulative, rank))  # first bucket holding the rank-th draw
        lower, below = (bounds[k - 1], cumulative[k - 1]) if k else (0.0, 0)
        want = lower + (bounds[k] - lower) * (rank - below) / (cumulative[k] - below)
        assert values[f"ttft_p{q}_s"] == pytest.approx(want), q
    assert values["ttft_p50_s"] == pytest.approx(np.percentile(draws, 50), abs=0.15)


def write_ttfts(run_dir: Path, ttfts: list[float]) -> None:
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics.metrics_dir(run_dir)),
        "PYTHONPATH": str(REPO_ROOT),
    }
    code = textwrap.dedent(f"""
        from services.metrics import FinishedRequest, RequestMetrics
        r = RequestMetrics("m", max_model_len=2048)
        for x in {ttfts!r}:
            r.on_tokens(0.0, None, x, 3, 7)
    """)
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, check=True, timeout=60)


def write_requests(run_dir: Path, num: int) -> None:
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics.metrics_dir(run_dir)),
        "PYTHONPATH": str(REPO_ROOT),
    }
    code = textwrap.dedent(f"""
        from services.metrics import FinishedRequest, RequestMetrics
        r = RequestMetrics("m", max_model_len=2048)
        for i in range({num}):
            r.on_tokens(0.0, None, 0.3, 1, 10)
            r.on_tokens(0.0, 0.3, 0.4, 9, 10)
            r.on_finish("length", 0.0, 0.4, FinishedRequest(10, 10, 10, 0.3, 0.4))
    """)
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, check=True, timeout=60)


def test_sink_logs_points_params_and_samples(tmp_path: Path, tracking: tuple[str, Path]) -> None:
    uri, artifacts = tracking
    experiment(uri, artifacts, "sink")
    metrics.metrics_dir(tmp_path).mkdir()
    config = MlflowConfig(tracking_uri=uri, experiment="sink", interval_s=0.5, sample_requests=2)
    sink = MlflowSink(config, tmp_path, "run-1", {"model.path": "tiny", "engine.max_num_seqs": "8"})
    sink.start()
    sampler = RequestSampler(tmp_path, 0, per_interval=2, interval_s=60.0)
    for i in range(3):  # the third is over the per-interval bound
        if sampler.wants(time.monotonic()):
            sampler.record(f"r{i}", f"prompt {i}", f"output {i}", "length")
    write_requests(tmp_path, 20)
    deadline = time.monotonic() + 60
    while sink.num_logged < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    sink.stop(timeout=60)
    assert sink.num_logged >= 3 and sink.num_dropped == 0
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(sink.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"model.path": "tiny", "engine.max_num_seqs": "8"}
    history = client.get_metric_history(run.info.run_id, "generation_tok_per_s")
    assert len(history) >= 3
    # 20 requests of 10 tokens landed within one interval: the rate times the interval is 200 tokens.
    assert max(h.value for h in history) * config.interval_s == pytest.approx(200, rel=0.5)
    assert [h.step for h in history] == sorted(h.step for h in history)
    ttft = client.get_metric_history(run.info.run_id, "ttft_p50_s")
    assert ttft and 0.25 <= ttft[0].value <= 0.5  # every TTFT was 0.3 s: in the (0.25, 0.5] bucket
    files = [f.path for f in client.list_artifacts(run.info.run_id, "samples")]
    assert len(files) == 1
    local = client.download_artifacts(run.info.run_id, files[0], str(tmp_path))
    samples = json.loads(Path(local).read_text())
    assert [s["request_id"] for s in samples] == ["r0", "r1"]
    assert samples[0]["prompt"] == "prompt 0" and samples[0]["output"] == "output 0"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_buffers_drops_and_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics.metrics_dir(tmp_path).mkdir()
    config = MlflowConfig(tracking_uri=f"http://127.0.0.1:{closed_port()}", interval_s=0.05, max_buffered=3)
    sink = MlflowSink(config, tmp_path, "run-2", {})
    with caplog.at_level(logging.WARNING, logger="mlflow_sink"):
        sink.start()
        deadline = time.monotonic() + 60
        while sink.num_dropped < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        sink.stop(timeout=30)
        stopped_in = time.monotonic() - started
    assert sink.num_dropped >= 5, "the sampler stopped sampling while the server was down"
    assert len(sink.buffer) <= config.max_buffered
    assert sink.num_logged == 0
    assert stopped_in < 30
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1, "one warning per outage, not one per retry"


def test_samples_files_are_taken_once(tmp_path: Path) -> None:
    metrics.metrics_dir(tmp_path).mkdir()
    a, b = RequestSampler(tmp_path, 0, 5, 60.0), RequestSampler(tmp_path, 1, 5, 60.0)
    a.record("x", "p", "o", "stop")
    b.record("y", "p" * 20_000, "o", "length")
    taken = take_samples(tmp_path, limit=10)
    assert {t["request_id"] for t in taken} == {"x", "y"}
    assert max(len(t["prompt"]) for t in taken) == 8192
    assert take_samples(tmp_path, limit=10) == []
    assert not RequestSampler(tmp_path, 2, 0, 60.0).wants(time.monotonic())


def test_benchmark_logs_params_metrics_and_plot(tmp_path: Path, tracking: tuple[str, Path]) -> None:
    from benchmarks.serve import log_to_mlflow, plot

    uri, artifacts = tracking
    experiment(uri, artifacts, "bench")
    settings = {
        "1": {"output_tok_s": 50.0, "request_throughput": 0.5, "ttft_ms": {"p50": 120.0}, "tpot_ms": {"p50": 18.0},
              "failures": {"total": 0, "examples": []}},
        "16": {"output_tok_s": 110.0, "request_throughput": 1.2, "ttft_ms": {"p50": 300.0},
               "tpot_ms": {"p50": 40.0}, "failures": {"total": 1, "examples": ["boom"]}},
    }  # fmt: skip
    report = {
        "command": "python benchmarks/serve.py --smoke",
        "model": "SmolLM2-135M-Instruct",
        "machine": {"cpu": "test", "cores": 2},
        "config": {"dataset": "chat", "concurrency": [1, 16], "output_len": "4", "dtype": "float32"},
        "brigade": {
            "settings": settings,
            "output_tok_s": {c: s["output_tok_s"] for c, s in settings.items()},
        },
        "llamacpp": {"skipped": "not selected"},
    }
    plot_path = tmp_path / "serve.png"
    plot(report, plot_path)
    run_id = log_to_mlflow(report, plot_path, uri, "bench")
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.params["config.dataset"] == "chat"
    assert run.data.params["machine.cores"] == "2"
    history = client.get_metric_history(run_id, "brigade.output_tok_s")
    assert sorted((h.step, h.value) for h in history) == [(1, 50.0), (16, 110.0)]
    assert {h.value for h in client.get_metric_history(run_id, "brigade.ttft_ms.p50")} == {120.0, 300.0}
    names = {f.path for f in client.list_artifacts(run_id)}
    assert {"serve.json", "serve.png"} <= names


class SecretsInner(msgspec.Struct, frozen=True):
    api_keys: tuple[str, ...] = ("sk-1",)
    curve_secret_key: str = "s3cret"
    max_num_batched_tokens: int = 2048


class SecretsOuter(msgspec.Struct, frozen=True):
    gateway: SecretsInner = SecretsInner()


def test_run_params_are_the_config_with_secrets_redacted() -> None:
    from ipc.config import load_config
    from supervisor import flat_config

    assert flat_config(SecretsOuter()) == {
        "gateway.api_keys": "<redacted>",
        "gateway.curve_secret_key": "<redacted>",
        "gateway.max_num_batched_tokens": "2048",
    }
    params = flat_config(load_config(REPO_ROOT / "configs" / "default.yaml"))
    assert params["engine.max_num_seqs"] == "64" and params["observability.mlflow.interval_s"] == "30.0"
