"""benchmarks/encoder_bench.py's `--smoke` run end to end: it builds its model, starts a run with
the encoder stage and one with the encoder in the worker, drives both with text-only and image
chats, writes its report, and stops everything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ipc.endpoints import SHM_PREFIX
from tests.conftest import REPO_ROOT, brigade_shm_objects
from tests.harness import stage_processes

SMOKE_TIMEOUT_S = 600


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_smoke_run_reports_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "encoder_bench.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/encoder_bench.py", "--smoke", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| text-only requests |" in done.stdout
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"stage", "in_worker"}
    for mode in report["modes"].values():
        for phase in ("text_alone", "text_with_images"):
            stats = mode[phase]
            assert stats["ttft_ms"]["n"] >= 1 and 0 < stats["ttft_ms"]["p50"] <= stats["ttft_ms"]["p90"]
            assert 0 < stats["itl_ms"]["p50"] <= stats["itl_ms"]["p90"]
            assert stats["decode_tok_s"] > 0 and stats["window_s"] > 0
        for key in ("image_ttft_ms", "new_image_ttft_ms", "repeated_image_ttft_ms"):
            assert mode[key]["n"] >= 1 and 0 < mode[key]["p50"] <= mode[key]["p90"]
    config = report["config"]
    for mode in report["modes"].values():
        assert mode["image_ttft_ms"]["n"] == config["images"] * config["rounds"]
    ratios = report["ratios"]
    for key in ("text_ttft_p50_in_worker_over_stage", "text_ttft_p90_in_worker_over_stage",
                "text_decode_tok_s_stage_over_in_worker"):  # fmt: skip
        assert ratios[key] > 0
    assert set(ratios["repeated_over_new_image_ttft_p50"]) == {"stage", "in_worker"}
    for own in ratios["with_images_over_alone"].values():
        assert own["text_ttft_p50"] > 0 and own["text_decode_tok_s"] > 0
    assert report["model"]["encode_ms_one_image"] > 0
    assert report["machine"]["loadavg_1m_at_start"] >= 0 and report["loadavg_1m_at_end"] >= 0
    # Both runs were stopped cleanly: no process, run dir or shared memory of theirs is left.
    assert config["rounds"] == 1 and [run["mode"] for run in report["runs"]] == ["stage", "in_worker"]
    for run in report["runs"]:
        assert not stage_processes(Path(run["run_dir"]))
        assert not Path(run["run_dir"]).exists()
        assert not [n for n in brigade_shm_objects() if f"{SHM_PREFIX}{run['supervisor_pid']}x" in n]
