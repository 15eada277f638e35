"""The serving benchmark: its percentile stats against numpy, and a `--smoke` run end to end (it
starts its own Brigade, drives it through the client SDK, runs the HF peer and stops everything)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.peers import RequestResult
from benchmarks.serve import evaluate_targets, parse_args, percentile, setting_stats, summarize_ms
from ipc.endpoints import SHM_PREFIX
from tests.conftest import REPO_ROOT, brigade_shm_objects
from tests.harness import stage_processes

SMOKE_TIMEOUT_S = 300


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n: int) -> None:
    values = np.random.default_rng(n).exponential(size=n).tolist()
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-15)


def test_summary_is_in_ms_and_matches_numpy() -> None:
    values = np.random.default_rng(3).uniform(0.001, 0.5, size=57)
    summary = summarize_ms(values.tolist())
    ms = values * 1000
    assert summary["mean"] == pytest.approx(ms.mean())
    for q in (50, 90, 99):
        assert summary[f"p{q}"] == pytest.approx(np.percentile(ms, q))


def test_setting_stats_counts_tokens_failures_and_tpot() -> None:
    ok = [
        RequestResult(start=0.0, num_output=5, ttft=0.1, e2e=0.5, itls=[0.1] * 4),
        RequestResult(start=0.0, num_output=3, ttft=0.2, e2e=0.4, itls=[0.1] * 2),
    ]
    overload = RequestResult(start=0.0, error="overloaded", is_overload=True)
    other = RequestResult(start=0.0, error="boom")
    stats = setting_stats([*ok, overload, other], duration=2.0)
    assert stats["output_tok_s"] == pytest.approx(8 / 2.0)
    assert stats["request_throughput"] == pytest.approx(2 / 2.0)
    assert stats["failures"] == {"total": 2, "overload": 1, "other": 1, "examples": ["boom"]}
    assert stats["tpot_ms"]["mean"] == pytest.approx(np.mean([(0.5 - 0.1) / 4, (0.4 - 0.2) / 2]) * 1000)
    assert stats["ttft_ms"]["p50"] == pytest.approx(150.0)


@pytest.mark.slow
def test_smoke_run_reports_brigade_and_hf(tmp_path) -> None:
    out = tmp_path / "serve.json"
    plot = tmp_path / "serve.png"
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/serve.py",
            "--smoke",
            "--json",
            str(out),
            "--plot",
            str(plot),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    concurrency = [str(c) for c in report["config"]["concurrency"]]
    for engine in ("brigade", "hf"):
        section = report[engine]
        assert sorted(section["output_tok_s"]) == sorted(concurrency)
        for c in concurrency:
            stats = section["settings"][c]
            assert section["output_tok_s"][c] > 0
            assert stats["failures"]["total"] == 0, stats["failures"]
            assert section["failures"][c] == 0
            assert stats["num_output_tokens"] == stats["num_requests"] * int(report["config"]["output_len"])
            for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                assert set(stats[key]) == {"mean", "p50", "p90", "p99"}
                assert 0 < stats[key]["p50"] <= stats[key]["p99"]
    assert "skipped" in report["llamacpp"]
    assert {t["target"] for t in report["targets"]}
    assert plot.stat().st_size > 0
    # The benchmark stopped its Brigade cleanly: no process, socket or shared memory of it is left.
    run_dir, pid = Path(report["brigade"]["run_dir"]), report["brigade"]["supervisor_pid"]
    assert report["brigade"]["leftovers"] == []
    assert not stage_processes(run_dir)
    assert not run_dir.exists()
    assert not [n for n in brigade_shm_objects() if f"{SHM_PREFIX}{pid}x" in n]


@pytest.mark.slow
def test_smoke_run_over_http_counts_every_token(tmp_path) -> None:
    """`--backend http` drives Brigade through the gateway's streamed OpenAI API."""
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/serve.py", "--smoke", "--engines", "brigade", "--backend", "http",
         "--json", str(out), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "brigade" not in report  # only the HTTP backend was asked for
    assert report["brigade_http"]["note"] == "driven through the http backend"
    for stats in report["brigade_http"]["settings"].values():
        assert stats["failures"]["total"] == 0, stats["failures"]
        assert stats["num_output_tokens"] == stats["num_requests"] * int(report["config"]["output_len"])
        assert stats["ttft_ms"]["p50"] > 0
    assert report["brigade_http"]["leftovers"] == []


def _engine(settings: dict[str, dict]) -> dict:
    return {"settings": settings}


def test_http_targets_compare_against_the_sdk_in_the_same_report() -> None:
    """The gateway's targets: c=64 tok/s >= 0.95x the SDK's; c=1 TTFT p50 <= 1.05x the SDK's + 2 ms."""
    sdk = _engine({"1": {"ttft_ms": {"p50": 100.0}}, "64": {"output_tok_s": 200.0}})

    def verdicts(tok_s: float, ttft: float) -> list[bool | None]:
        http = _engine({"1": {"ttft_ms": {"p50": ttft}}, "64": {"output_tok_s": tok_s}})
        return [t["met"] for t in evaluate_targets({"brigade": sdk, "brigade_http": http})[:2]]

    assert verdicts(190.0, 107.0) == [True, True]  # 0.95x exactly; 1.05 x 100 + 2
    assert verdicts(189.0, 107.1) == [False, False]
    assert [t["met"] for t in evaluate_targets({"brigade": sdk})[:2]] == [None, None]  # HTTP not measured


def test_backend_takes_one_or_both_and_refuses_others() -> None:
    assert parse_args(["--backend", "sdk,http"]).backends == ["sdk", "http"]
    assert parse_args([]).backends == ["sdk"]
    with pytest.raises(SystemExit):
        parse_args(["--backend", "grpc"])
