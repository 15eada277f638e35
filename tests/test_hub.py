"""`model.path` as a Hugging Face hub id: resolved from an HF cache laid out here (refs and
snapshots, as huggingface_hub writes them), with a revision; refused clearly when missing offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.gpu_worker.loader import prepare_model
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

MAIN_COMMIT = "a" * 40
V2_COMMIT = "b" * 40


@pytest.fixture
def hub_cache(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An HF hub cache holding acme/tiny at two commits: main and the branch v2."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    for ref, commit in (("main", MAIN_COMMIT), ("v2", V2_COMMIT)):
        shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    (repo / "snapshots" / V2_COMMIT / "marker.txt").write_text("v2")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the test never reaches the network
    return cache


def test_hub_id_resolves_from_the_local_cache(hub_cache: Path) -> None:
    repo = hub_cache / "models--acme--tiny" / "snapshots"
    assert prepare_model("acme/tiny") == repo / MAIN_COMMIT
    assert prepare_model("acme/tiny", revision="v2") == repo / V2_COMMIT
    assert prepare_model("acme/tiny", revision=V2_COMMIT) == repo / V2_COMMIT


def test_hub_id_under_hf_home(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = hub_cache.parent / "hf-home"
    shutil.move(hub_cache, home / "hub")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(home))
    assert prepare_model("acme/tiny") == home / "hub" / "models--acme--tiny" / "snapshots" / MAIN_COMMIT


def test_missing_hub_model_offline_is_refused(hub_cache: Path) -> None:
    with pytest.raises(
        FileNotFoundError, match=r"'acme/absent' is not in the local HF cache .*HF_HUB_OFFLINE"
    ):
        prepare_model("acme/absent")
    with pytest.raises(FileNotFoundError, match="at revision 'v3'"):
        prepare_model("acme/tiny", revision="v3")


def test_revision_of_a_local_path_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="applies to hub ids only"):
        prepare_model(str(tiny_model_dir), revision="main")


def test_refusal_in_a_fresh_process_names_the_model(hub_cache: Path) -> None:
    """As the supervisor's preparation child sees it: a non-zero exit and the reason on stderr."""
    code = "from services.gpu_worker.loader import prepare_model; prepare_model('acme/absent')"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=100,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert done.returncode != 0
    assert "'acme/absent' is not in the local HF cache" in done.stderr


def test_supervisor_refuses_an_absent_hub_revision_before_ready(hub_cache: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(tmp_path / "run"),
         "--set", "model.path=acme/tiny", "--set", "model.revision=v3"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode != 0
    assert "'acme/tiny' at revision 'v3' is not in the local HF cache" in done.stderr
    assert "ready" not in done.stdout
