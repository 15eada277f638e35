"""benchmarks/embed_bench.py's `--smoke` run end to end: it starts a run serving all-MiniLM-L6-v2,
checks Brigade's vectors against sentence-transformers' before timing anything, times both sides
at batch 1 and batch 64, writes its report, and stops everything it started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, brigade_shm_objects

SMOKE_TIMEOUT_S = 600


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_smoke_run_compares_brigade_with_sentence_transformers(tmp_path: Path) -> None:
    before = set(brigade_shm_objects())
    out = tmp_path / "embed_bench.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/embed_bench.py", "--smoke", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| batch 1 |" in done.stdout and "| batch 64 |" in done.stdout
    report = json.loads(out.read_text())
    assert report["min_cosine_vs_sentence_transformers"] >= 0.9999
    for shape in ("batch_1", "batch_64"):
        rates = report["inputs_per_s"][shape]
        assert set(rates) == {"brigade", "sentence_transformers"}
        assert all(len(runs) == 1 and runs[0] > 0 for runs in rates.values())
        assert report["ratio_brigade_over_st"][shape] > 0
    assert set(brigade_shm_objects()) <= before  # the run it started left no shared memory behind
