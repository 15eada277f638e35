"""benchmarks/gpu_check.py --dry-run: every part runs on the CPU and reports sane numbers, and
--write-docs replaces only its marked section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
BATCHES = ("1", "16", "64", "256")


@pytest.mark.timeout(600)
def test_dry_run_reports_every_section(tmp_path: Path) -> None:
    out, docs = tmp_path / "gpu_check.json", tmp_path / "performance.md"
    docs.write_text("# before\n\n<!-- gpu_check:begin -->\nold figures\n<!-- gpu_check:end -->\n\n# after\n")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--json", str(out), "--write-docs",
         "--docs", str(docs)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())

    assert result["dry_run"] is True
    tests = result["kernel_tests"]
    assert tests["mode"] == "interpreter" and "error" not in tests, tests
    assert tests["passed"] == 6 and tests["failed"] == 0, tests
    serving = result["serving_test"]  # the whole pipeline on a GPU: skipped on the CPU
    assert "error" not in serving and (serving["passed"], serving["skipped"]) == (0, 1), serving
    # Each pytest run's whole output beside the JSON: the cause of a failure on a lent GPU.
    assert "6 passed" in (tmp_path / "gpu_check.kernel_tests.log").read_text()
    assert "1 skipped" in (tmp_path / "gpu_check.serving_test.log").read_text()

    assert result["matmul_tflops"] > 0 and result["roofline_tok_s"] > 0
    model = result["model"]
    assert model["hidden_size"] == 64 and model["num_params"] > 0
    # roofline = measured FLOP/s / (2 x parameters)
    assert result["roofline_tok_s"] == pytest.approx(
        result["matmul_tflops"] * 1e12 / (2 * model["num_params"])
    )
    # A decode step's roofline: the larger of its bytes at the copy bandwidth and its FLOPs.
    assert result["bandwidth_gb_s"] > 0
    rooflines = [result["decode_roofline_tok_s"][b] for b in BATCHES]
    assert all(0 < r <= result["roofline_tok_s"] * (1 + 1e-9) for r in rooflines)
    assert rooflines == sorted(rooflines)  # more sequences share each weight read
    assert result["errors"] == {}
    for b in BATCHES:
        assert result["prefill_tok_s"][b] > 0 and result["decode_tok_s"][b] > 0
        assert result["decode_graphs_tok_s"][b] is None  # the runner captured none on the CPU
    assert result["runner_graphs"] is None

    graphs = result["cuda_graphs"]
    assert graphs["available"] is False and "CUDA" in graphs["reason"]
    for b in BATCHES:
        assert graphs["per_batch"][b]["eager_ms"] > 0 and graphs["per_batch"][b]["graph_ms"] is None

    # The vision-language kernels ran (the interpreter: tests/conftest.py sets it for the child too).
    vlm = result["vlm_kernels"]
    assert "error" not in vlm, vlm
    for name in ("prefill_attention_ms", "prefill_attention_images_ms", "rotary_ms", "rotary_mrope_ms"):
        assert vlm[name] > 0, name

    text = docs.read_text()
    assert "Vision-language kernels (batch 2" in text
    assert "- Serving on the GPU (" in text and "0 passed, 0 failed, 1 skipped" in text
    assert text.startswith("# before\n\n<!-- gpu_check:begin -->") and text.endswith(
        "<!-- gpu_check:end -->\n\n# after\n"
    )
    assert "old figures" not in text and text.count("| 256 |") == 1


def test_refuses_a_full_run_without_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--json", str(tmp_path / "x.json")],
        cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
    assert not (tmp_path / "x.json").exists()
