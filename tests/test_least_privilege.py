"""Least privilege for the stages (services/privileges.py): every stage runs with no_new_privs,
the tokenizer and the gateway may write only in the run dir (Landlock, where the kernel offers
it), `status` says which protections each stage has, and a root supervisor with
supervisor.run_as runs its stages as that user. Real runs (tiny model)."""

from __future__ import annotations

import http.client
import json
import os
import pwd
import re
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from services.privileges import landlock_abi
from tests.conftest import REPO_ROOT
from tests.harness import assert_clean, brigade_run, free_port

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


def chat(run, max_tokens: int = 12) -> str:
    """A greedy chat through the run's gateway (plain HTTP), its text."""
    port = int(
        re.search(r"http://127\.0\.0\.1:(\d+)/v1", next(line for line in run.log if "ready" in line)).group(1)
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        body = {
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        reply = conn.getresponse()
        data = json.loads(reply.read())
        assert reply.status == 200, data
        return data["choices"][0]["message"]["content"]
    finally:
        conn.close()


def test_a_root_supervisor_runs_its_stages_as_run_as(run, tmp_path: Path, tiny_model_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping to another user needs a supervisor started as root")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this host has no user nobody to run as")
    # The user must reach the run dir and the model: pytest's own tmp dirs are private to root.
    shared = Path(tempfile.mkdtemp(prefix="brigade-run-as-", dir="/tmp"))
    shared.chmod(0o755)
    model = shutil.copytree(tiny_model_dir, shared / "model")
    for path in [model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    run_dir = shared / "run"
    try:
        command, env = (sys.executable, "supervisor.py"), None
        if not user_can_run_python(sys.executable, nobody):
            # This Python is private to root (say, under /root): the supervisor must refuse, with
            # what to fix, before any stage starts, rather than let stages fail as they go.
            done = subprocess.run(
                [sys.executable, "supervisor.py", "--run-dir", str(run_dir), "--set", f"model.path={model}",
                 "--set", "supervisor.run_as=nobody", "--set", "supervisor.metrics_port=0",
                 "--set", f"gateway.port={free_port()}"],
                cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
            assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
            assert errors[0].startswith("error: supervisor.run_as: user 'nobody' could not run the stages"), (
                errors
            )
            assert not list(run_dir.glob("*.sock")) and "started gateway" not in done.stderr
            # The run itself, then, on the system's interpreter of the same version, if nobody can
            # run that one, with this environment's packages on its path.
            system_python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
            if not (os.path.exists(system_python) and user_can_run_python(system_python, nobody)):
                pytest.skip(f"no Python here that nobody can run ({sys.executable} is private to root)")
            command = (system_python, "supervisor.py")
            code = [str(REPO_ROOT), *site.getsitepackages()]
            env = {"PYTHONPATH": os.pathsep.join(code)}
            if not user_can_list(system_python, code, nobody):
                # This checkout or its packages are private to root too (a clone in a mkdtemp dir):
                # refused by name before any stage starts, rather than a stage failing on a lazy import.
                done = subprocess.run(
                    [system_python, "supervisor.py", "--run-dir", str(run_dir), "--set", f"model.path={model}",
                     "--set", "supervisor.run_as=nobody", "--set", "supervisor.metrics_port=0",
                     "--set", f"gateway.port={free_port()}"],
                    cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env,
                )  # fmt: skip
                assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
                assert "error: supervisor.run_as: user 'nobody' could not run the stages" in done.stderr
                pytest.skip(f"nobody cannot read this checkout or its packages ({code})")
        with brigade_run(
            run_dir, f"model.path={model}", "model.max_model_len=512", "supervisor.run_as=nobody",
            command=command, env=env,
        ) as as_nobody:  # fmt: skip
            check_served_as(as_nobody, run, nobody)
        assert_clean(run_dir)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def user_can_run_python(python: str, user: pwd.struct_passwd) -> bool:
    try:
        done = subprocess.run([python, "-c", "import encodings.unicode_escape"], user=user.pw_uid,
                              group=user.pw_gid, extra_groups=[], capture_output=True, cwd="/", timeout=60)  # fmt: skip
    except PermissionError:  # the interpreter itself is out of its reach
        return False
    return done.returncode == 0


def user_can_list(python: str, paths: list[str], user: pwd.struct_passwd) -> bool:
    done = subprocess.run([python, "-c", "import os, sys; [os.listdir(p) for p in sys.argv[1:]]", *paths],
                          user=user.pw_uid, group=user.pw_gid, extra_groups=[], capture_output=True, cwd="/",
                          timeout=60)  # fmt: skip
    return done.returncode == 0


def check_served_as(as_nobody, run, nobody: pwd.struct_passwd) -> None:
    """The stages of `as_nobody` run as that user, say so in status, and serve as `run` (root) does."""
    # `brigade status` as root would refuse a run dir of another user: status.json, as /health reads it
    rows = [row for row in as_nobody.read_status() if row["kind"] != "supervisor"]
    assert {row["kind"] for row in rows} >= {"tokenizer", "gateway", "scheduler", "gpu_worker"}
    for row in rows:
        uids = Path(f"/proc/{row['pid']}/status").read_text().split("Uid:")[1].split()[:4]
        assert uids == [str(nobody.pw_uid)] * 4, row["name"]  # real, effective, saved, filesystem
        assert f"user={nobody.pw_name}" in row["protections"].split(","), row
    assert os.stat(as_nobody.run_dir).st_uid == nobody.pw_uid
    # It serves, and as the same run as root does.
    assert chat(as_nobody) == chat(run)
