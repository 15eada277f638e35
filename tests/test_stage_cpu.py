"""benchmarks/stage_cpu.py end to end on the tiny model: every process of the run is in the
table with a positive CPU per token, the worker's step times come from the metrics, and the run
leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, brigade_shm_objects

OUTPUT_LEN = 8
REQUESTS = 2
STAGE_KINDS = {"supervisor", "tokenizer", "scheduler", "gpu_worker", "detokenizer", "gateway", "client"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stage_cpu_reports_every_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "stage_cpu.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/stage_cpu.py", "--concurrency", "1", "2", "--requests", str(REQUESTS),
         "--output-len", str(OUTPUT_LEN), "--idle-s", "0.5", "--set", f"model.path={tiny_model_dir}",
         "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["leftovers"] == []
    assert not [name for name in brigade_shm_objects() if report["run_id"] in name]
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    # The supervisor serves no token and ticks every 0.1 s, so a fast host's window of a few dozen
    # ms can hold none of its ticks; the half-second idle window holds several.
    supervisors = [name for name, kind in report["results"][0]["kinds"].items() if kind == "supervisor"]
    assert supervisors and all(report["idle_cpu_ms_per_s"][name] > 0 for name in supervisors)
    for result in report["results"]:
        assert result["output_tokens"] == REQUESTS * OUTPUT_LEN
        assert set(result["kinds"].values()) == STAGE_KINDS
        for name, ms in result["cpu_ms_per_token"].items():
            if result["kinds"][name] == "supervisor":
                assert ms >= 0, name
            else:
                assert ms > 0, f"{name}, on every token's way, spent no CPU"
            assert name in done.stdout  # the printed table
        assert result["non_worker_cpu_ms_per_token"] == pytest.approx(
            sum(
                ms for name, ms in result["cpu_ms_per_token"].items() if result["kinds"][name] != "gpu_worker"
            )
        )
        assert result["worker_decode_step_ms"] > 0
        assert result["worker_prefill_step_ms"] > 0
        assert result["wall_ms_per_token"] > 0
    assert report["results"][0]["ttft_outside_prefill_ms"] is not None
