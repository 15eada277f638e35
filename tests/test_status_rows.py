"""The supervisor's two files about its stages, status.json and metrics/stages.json, carry one row
shape (services/stage_rows.py), and status.json keeps every key `brigade status --json` printed
before the two shapes became one. No run: a StageHandle with a load, as a heartbeat leaves it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipc import messages as m
from services.gateway.app import engine_group_ready
from services.metrics import METRICS_DIR, STAGES_FILE
from services.stage import RUN_FILE
from services.stage_rows import STATUS_FILE
from supervision.stages import StageHandle
from supervision.status import STALE_STATUS_S, StatusWriter, format_table, status

from .conftest import REPO_ROOT

# The keys of a status.json row that scripts read (docs/operations.md): never renamed.
STATUS_KEYS = {
    "name", "kind", "pid", "state", "restarts", "uptime_s", "queue_depth", "running", "kv_usage",
    "tokens_per_s", "malformed", "node",
}  # fmt: skip


@pytest.fixture
def scheduler() -> StageHandle:
    stage = StageHandle("scheduler-1", "scheduler", [], {}, group=1, state="running", node="node-a")
    stage.started_at = time.monotonic() - 30.0
    stage.num_restarts = 2
    stage.tokens_rate = 12.34
    stage.load = m.StageLoad(
        num_running=3, num_waiting=4, kv_usage=0.123456, num_in_flight=5, num_malformed=6,
        gpu_memory_allocated=7, gpu_memory_reserved=8, num_auth_failures=9,
        lora_adapters=["chat", "sql"], lora_running=["sql"], lora_waiting=["chat", "sql"],
    )  # fmt: skip
    return stage


def written(run_dir: Path, stage: StageHandle) -> tuple[list[dict], dict]:
    (run_dir / METRICS_DIR).mkdir()
    writer = StatusWriter(run_dir)
    writer.write_status([stage], is_due=True)
    writer.write_samples([stage], [], "tiny", "cpu", num_auth_failures=11)
    status_rows = json.loads((run_dir / STATUS_FILE).read_text())
    samples = json.loads((run_dir / METRICS_DIR / STAGES_FILE).read_text())
    return status_rows, samples


def test_both_files_carry_one_row_shape(tmp_path: Path, scheduler: StageHandle):
    [row], samples = written(tmp_path, scheduler)
    supervisor, sample = samples["stages"]
    assert set(row) == set(sample) == set(supervisor)
    assert {key: value for key, value in row.items() if key != "uptime_s"} == {
        key: value for key, value in sample.items() if key != "uptime_s"
    }
    assert supervisor["name"] == supervisor["kind"] == "supervisor"
    assert supervisor["auth_failures"] == 11


def test_status_rows_keep_the_keys_scripts_read_with_the_stage_values(tmp_path: Path, scheduler: StageHandle):
    [row], _ = written(tmp_path, scheduler)
    assert set(row) >= STATUS_KEYS
    assert row["name"] == "scheduler-1" and row["kind"] == "scheduler" and row["state"] == "running"
    assert row["pid"] == 0 and row["restarts"] == 2 and row["node"] == "node-a"
    assert 30.0 <= row["uptime_s"] < 60.0
    assert row["queue_depth"] == 4 + 5  # waiting plus in flight
    assert row["running"] == 3 and row["waiting"] == 4 and row["engine"] == 1
    assert row["kv_usage"] == 0.123456
    assert row["tokens_per_s"] == 12.3
    assert row["malformed"] == 6 and row["auth_failures"] == 9
    assert row["gpu_memory_allocated"] == 7 and row["gpu_memory_reserved"] == 8
    assert (row["lora_adapters"], row["lora_running"], row["lora_waiting"]) == (
        ["chat", "sql"],
        ["sql"],
        ["chat", "sql"],
    )


def test_a_stage_off_any_node_and_group_says_so_with_defaults(tmp_path: Path):
    stage = StageHandle("tokenizer-0", "tokenizer", [], {})
    [row], _ = written(tmp_path, stage)
    assert row["node"] == "" and row["engine"] == -1 and row["uptime_s"] == 0.0 and row["state"] == "starting"


def test_status_prints_the_rows_as_json_and_as_a_table(tmp_path: Path, scheduler: StageHandle, capsys):
    [row], _ = written(tmp_path, scheduler)
    assert status(tmp_path, as_json=True) == 0
    assert json.loads(capsys.readouterr().out) == [row]
    assert status(tmp_path, watch=False) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].split() == ["scheduler-1", "0", "running", "2", "30s", "9", "3", "12.3%", "12.3"]
    assert format_table([]).splitlines()[0].split()[0] == "stage"


def test_status_of_a_run_dir_without_a_run_says_so(tmp_path: Path, capsys):
    assert status(tmp_path, as_json=True) == 1
    assert "no live Brigade run" in capsys.readouterr().err


def test_status_of_a_run_whose_supervisor_was_killed_says_so(tmp_path: Path, scheduler: StageHandle, capsys):
    """A SIGKILLed supervisor removes nothing: its status.json still says `running`. The run is
    alive while run.json's supervisor is."""
    written(tmp_path, scheduler)
    (tmp_path / RUN_FILE).write_text(json.dumps({"supervisor_pid": os.getpid()}))
    assert status(tmp_path, watch=False) == 0 and "scheduler-1" in capsys.readouterr().out
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    (tmp_path / RUN_FILE).write_text(json.dumps({"supervisor_pid": gone.pid}))
    # A fresh status.json: a live supervisor elsewhere (a run dir shared with another host).
    assert status(tmp_path, as_json=True) == 0 and json.loads(capsys.readouterr().out)
    stale = time.time() - 2 * STALE_STATUS_S
    os.utime(tmp_path / STATUS_FILE, (stale, stale))
    assert status(tmp_path, as_json=True) == 1
    assert f"its supervisor (pid {gone.pid}) is gone" in capsys.readouterr().err


def test_status_piped_into_a_reader_that_leaves_ends_quietly(tmp_path: Path, scheduler: StageHandle) -> None:
    written(tmp_path, scheduler)
    code = f"from pathlib import Path; from supervision.status import status; status(Path({str(tmp_path)!r}), watch=True)"
    reader = subprocess.run(
        f"{sys.executable} -c {shlex.quote(code)} | head -1", shell=True, capture_output=True, text=True,
        timeout=60, cwd=REPO_ROOT,
    )  # fmt: skip
    assert reader.stdout and "Traceback" not in reader.stderr, reader.stderr


def test_the_gateway_reads_an_engine_group_as_ready_once_all_its_stages_run(tmp_path: Path):
    def group_stage(name: str, kind: str, group: int, state: str) -> StageHandle:
        return StageHandle(name, kind, [], {}, group=group, state=state)

    writer = StatusWriter(tmp_path)
    assert not engine_group_ready(tmp_path)  # no status.json yet
    stages = [
        group_stage("scheduler-0", "scheduler", 0, "running"),
        group_stage("gpu_worker-0-0", "gpu_worker", 0, "restarting"),
        group_stage("scheduler-1", "scheduler", 1, "running"),
        group_stage("gpu_worker-1-0", "gpu_worker", 1, "starting"),
        StageHandle("tokenizer-0", "tokenizer", [], {}, state="running"),
    ]
    writer.write_status(stages, is_due=True)
    assert not engine_group_ready(tmp_path)
    stages[3].state = "running"
    writer.write_status(stages, is_due=True)
    assert engine_group_ready(tmp_path)
