"""Least privilege for the stages (services/privileges.py): every stage runs with no_new_privs,
the tokenizer and the gateway may write only in the run dir (Landlock, where the kernel offers
it), and `status` says which protections each stage has. Real runs (tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.privileges import landlock_abi
from tests.conftest import REPO_ROOT
from tests.harness import assert_clean, brigade_run

pytestmark = pytest.mark.timeout(600)

CONFINED = ("tokenizer", "gateway")

# A real process that makes itself a tokenizer of the run (the stage's own argument parsing, from
# its run.json) and confines itself as the tokenizer does, then tries to write.
PROBE = """
import json, sys
from pathlib import Path
from services.stage import confine_writes, parse_stage_args

stage, _ = parse_stage_args("tokenizer", ["--run-dir", sys.argv[1], "--index", "9"])
confined = confine_writes(stage)
results = {"confined": confined}
for name, path in (("inside", stage.run_dir / "probe.txt"), ("outside", Path(sys.argv[2]))):
    try:
        path.write_text("written")
        results[name] = "written"
    except PermissionError as exc:
        results[name] = f"refused: {exc.strerror}"
print(json.dumps(results))
"""


def no_new_privs(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return "NoNewPrivs:\t1" in status


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    run_dir = tmp_path_factory.mktemp("privileges") / "run"
    with brigade_run(run_dir, f"model.path={tiny_model_dir}", "model.max_model_len=512") as live:
        yield live
    assert_clean(run_dir)


def test_every_stage_has_no_new_privs_and_status_says_what_protects_it(run) -> None:
    rows = {row["name"]: row for row in run.status() if row["kind"] != "supervisor"}
    assert {row["kind"] for row in rows.values()} >= {"tokenizer", "gateway", "scheduler", "gpu_worker"}
    for row in rows.values():
        assert no_new_privs(row["pid"]), row["name"]
        protections = row["protections"].split(",")
        assert protections[0] == "no_new_privs", row
        has_landlock = any(p.startswith("landlock_v") for p in protections)
        assert has_landlock == (row["kind"] in CONFINED and landlock_abi() > 0), row


@pytest.mark.skipif(landlock_abi() == 0, reason="this kernel offers no Landlock")
def test_a_confined_tokenizer_cannot_write_outside_the_run_dir(run, tmp_path: Path) -> None:
    outside = tmp_path / "escaped.txt"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(run.run_dir), str(outside)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == {"confined": True, "inside": "written", "outside": "refused: Permission denied"}
    assert not outside.exists()
    (run.run_dir / "probe.txt").unlink()
