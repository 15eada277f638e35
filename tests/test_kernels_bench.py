"""benchmarks/kernels_bench.py --quick: every C++ op is timed against its reference at the
embedded model's shapes, and agrees with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_ops

REPO_ROOT = Path(__file__).resolve().parent.parent
OPS = {
    "paged_decode",
    "few_rows_linear",
    "few_rows_linear_quantized",
    "linear_quantized_int8",
    "add_rms_norm",
    "logsumexp_argmax",
    "few_rows_decode_layers",
}


@pytest.mark.timeout(600)
def test_quick_run_times_every_op_against_its_reference(tmp_path: Path) -> None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the C++ kernels need AVX2 + FMA")
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/kernels_bench.py", "--quick", "--json", str(out)],
        cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True,
        timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["shapes"]["hidden"] == 576 and report["shapes"]["head_dim"] == 64  # SmolLM2-135M
    assert {r["op"] for r in report["results"]} == OPS
    formats = {r["case"].split()[0] for r in report["results"] if r["op"] == "few_rows_linear_quantized"}
    assert formats == set(cpu_ops.QUANTIZED_FORMATS)  # each format on at least one weight
    int8 = [r for r in report["results"] if r["op"] == "linear_quantized_int8"]
    assert {r["case"].split()[0] for r in int8} == set(cpu_ops.QUANTIZED_FORMATS)
    # Timed against the float-activation kernel it replaces, in the same alternation.
    assert all(r["baseline_us"]["min"] > 0 and r["speedup_vs_baseline"] > 0 for r in int8)
    # A format whose blocks do not tile a row is reported, not run.
    assert all("not whole blocks" in reason for reason in report["skipped"])
    for r in report["results"]:
        for side in ("kernel_us", "ref_us"):
            t = r[side]
            assert 0 < t["min"] <= t["median"] <= t["max"], r
        assert r["speedup"] > 0 and r["matches"] and r["max_abs_diff"] < 1e-3, r
    assert report["repeats"] == 3 and report["quick"] is True
    assert "paged_decode" in proc.stdout and "ref/op" in proc.stdout  # the printed table


@pytest.mark.timeout(300)
def test_isa_ab_times_both_builds_on_every_weight_and_they_agree(tmp_path: Path) -> None:
    """benchmarks/isa_ab.py: each few-rows op of the AVX2 build against the AVX-512 one, on every
    SmolLM2 weight shape, in one process; the builds agree on every case."""
    if cpu_ops.available_isas() != list(cpu_ops.ISAS):
        pytest.skip("this CPU runs only the AVX2 build")
    out = tmp_path / "isa.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/isa_ab.py", "--repeats", "1", "--rows", "1,3", "--json", str(out)],
        cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert {r["weight"] for r in results} == {"qkv", "o_proj", "gate_up", "down", "lm_head"}
    assert {r["rows"] for r in results} == {1, 3}
    assert {r["op"] for r in results} == {
        "few_rows_linear_quantized Q4_1", "few_rows_linear_quantized Q8_0",
        "linear_quantized_int8 Q4_1", "linear_quantized_int8 Q8_0", "few_rows_linear float32",
    }  # fmt: skip
    assert all(r["matches"] and r["us"]["avx2"]["min"] > 0 and r["avx2_over_avx512"] > 0 for r in results)
