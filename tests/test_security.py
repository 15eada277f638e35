"""Who may touch a run: the run dir and run.json must be private to the user (another local user
must not be able to swap in their own run and receive the prompts), and a request belongs to the
client connection that made it. "Another user" is simulated with os.chown to uid 65534, which
these tests may do because the suite runs as root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client import Client, ServerUnavailable, UntrustedRunDir
from ipc.endpoints import InsecureRunDir, make_run_dir
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

OTHER_UID = 65534  # nobody


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("simulating another user needs root (os.chown)")


def owned_by_other(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(mode=mode)
    path.chmod(mode)
    os.chown(path, OTHER_UID, OTHER_UID)
    return path


def write_run(run_dir: Path, mode: int = 0o644) -> Path:
    run_file = run_dir / "run.json"
    run_file.write_text(json.dumps({"run_id": "t", "tokenizers": [f"ipc://{run_dir}/tokenizer-0.sock"]}))
    run_file.chmod(mode)
    return run_file


def test_a_parent_made_by_another_user_is_refused(tmp_path: Path) -> None:
    """The attack on the default run dir: another user creates /tmp/brigade-$UID first."""
    parent = owned_by_other(tmp_path / "brigade-0")
    with pytest.raises(InsecureRunDir, match="owned by uid 65534"):
        make_run_dir(parent / "default")
    assert not (parent / "default").exists()


def test_a_run_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    run_dir = owned_by_other(tmp_path / "run", mode=0o700)
    with pytest.raises(InsecureRunDir, match="owned by uid 65534"):
        make_run_dir(run_dir)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_parent_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(mode)
    with pytest.raises(InsecureRunDir, match="another user could replace"):
        make_run_dir(parent / "run")


def test_a_sticky_shared_parent_like_tmp_is_accepted(tmp_path: Path) -> None:
    parent = tmp_path / "tmp-like"
    parent.mkdir()
    parent.chmod(0o1777)
    run_dir = make_run_dir(parent / "brigade" / "default")
    assert (run_dir.stat().st_mode & 0o777) == 0o700


def test_a_symlinked_run_dir_is_refused(tmp_path: Path) -> None:
    target = owned_by_other(tmp_path / "theirs", mode=0o700)
    link = tmp_path / "run"
    link.symlink_to(target)
    with pytest.raises(InsecureRunDir, match="symlink"):
        make_run_dir(link)


def test_a_run_dir_of_ours_made_by_hand_is_tightened(tmp_path: Path) -> None:
    run_dir = tmp_path / "mine"
    run_dir.mkdir(mode=0o755)
    assert (make_run_dir(run_dir).stat().st_mode & 0o777) == 0o700


def test_the_supervisor_refuses_an_untrusted_run_dir(tmp_path: Path) -> None:
    parent = owned_by_other(tmp_path / "brigade-0")
    out = subprocess.run(
        [sys.executable, "supervisor.py", "--run-dir", str(parent / "default")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: ") and "uid 65534" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_client_does_not_trust_a_run_dir_of_another_user(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    write_run(run_dir)
    os.chown(run_dir, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedRunDir, match="owned by uid 65534"):
        Client(run_dir)


@pytest.mark.parametrize("how", ["other_owner", "group_writable", "symlink"])
def test_the_client_does_not_trust_a_run_json_others_control(tmp_path: Path, how: str) -> None:
    run_dir = make_run_dir(tmp_path / "run")
    if how == "symlink":
        theirs = write_run(owned_by_other(tmp_path / "theirs"))
        (run_dir / "run.json").symlink_to(theirs)
    else:
        run_file = write_run(run_dir, mode=0o664 if how == "group_writable" else 0o644)
        if how == "other_owner":
            os.chown(run_file, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedRunDir, match=r"run\.json"):
        Client(run_dir)


def test_the_client_trusts_a_private_run_dir(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run")
    write_run(run_dir)
    with (
        Client(run_dir, failover_after=0.1, unavailable_after=0.3) as client,
        pytest.raises(ServerUnavailable),
    ):
        client.health(timeout=0.2)
