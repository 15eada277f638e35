"""A run's resources (supervision/run.py) and the status writer (supervision/status.py), in this
process: no stage starts here."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from ipc import messages as m
from ipc.config import load_config
from ipc.endpoints import make_run_dir
from ipc.shm import ShmRing, new_run_id
from ipc.sockets import close_context
from ipc.topology import Topology
from services.stage import RESPONSES_DIR, RUN_FILE, read_run_info
from services.stage_rows import STATUS_FILE
from supervision.live_settings import with_setting
from supervision.preflight import Refused
from supervision.run import Run
from supervision.stages import StageHandle
from supervision.status import StatusWriter, status


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run_dir(tmp_path / "run")


def test_a_claimed_run_dir_refuses_a_second_run_and_its_release_leaves_the_first_alone(run_dir: Path):
    first, second = Run(run_dir, new_run_id()), Run(run_dir, new_run_id())
    first.claim_run_dir()
    (run_dir / "tokenizer-0.sock").touch()
    (run_dir / RUN_FILE).write_text("{}")
    with pytest.raises(Refused, match="already live"):
        second.claim_run_dir()
    second.release(keep_keys=False)  # a refused supervisor's stop()
    assert (run_dir / "tokenizer-0.sock").exists() and (run_dir / RUN_FILE).exists()
    first.release(keep_keys=False)
    assert not (run_dir / "tokenizer-0.sock").exists() and not (run_dir / RUN_FILE).exists()
    Run(run_dir, new_run_id()).claim_run_dir()  # the lock went with its holder's release


def test_stored_responses_end_with_their_run(run_dir: Path):
    """A dead run's stored responses (its clients' conversations) are gone when the next run claims
    the run dir, and a run's own when it is released: a new run serves none of them."""
    stale = run_dir / RESPONSES_DIR / ("resp_" + "0" * 32 + ".json")
    stale.parent.mkdir()
    stale.write_text("{}")
    refused = Run(run_dir, new_run_id())
    holder = Run(run_dir, new_run_id())
    holder.claim_run_dir()
    assert not stale.parent.exists()
    stale.parent.mkdir()
    stale.write_text("{}")  # this run's
    with pytest.raises(Refused):
        refused.claim_run_dir()
    refused.release(keep_keys=False)
    assert stale.exists()  # a refused supervisor touches nothing of the live run
    holder.release(keep_keys=False)
    assert not stale.parent.exists()


def test_run_json_is_published_with_the_config_and_the_tokenizers(run_dir: Path, tmp_path: Path):
    run = Run(run_dir, new_run_id())
    run.claim_run_dir()
    config = load_config(None, ["tokenizer.replicas=2"])
    run.publish(config, tmp_path / "model")
    info = read_run_info(run_dir)
    assert info.model_dir == str(tmp_path / "model") and len(info.tokenizers) == 2 and not info.is_ready
    run.publish(load_config(None, ["tokenizer.replicas=3"]), is_ready=True)
    info = read_run_info(run_dir)
    assert len(info.tokenizers) == 3 and info.is_ready and info.config.tokenizer.replicas == 3
    run.release(keep_keys=False)


def test_run_json_that_cannot_be_written_is_refused_and_changes_nothing(run_dir: Path, tmp_path: Path):
    run = Run(run_dir, new_run_id())
    run.publish(load_config(None), tmp_path / "model")
    before = run.info
    (run_dir / (RUN_FILE + ".tmp")).mkdir()  # the atomic write's temporary name is taken
    with pytest.raises(Refused, match="could not write"):
        run.publish(load_config(None, ["tokenizer.replicas=4"]))
    assert run.info == before


def test_rings_of_retired_groups_go_and_the_rest_stay(run_dir: Path, tmp_path: Path):
    run = Run(run_dir, new_run_id())
    run.claim_shared_memory()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 64}))
    config = load_config(
        None, ["engine.max_num_seqs=4", "engine.max_num_batched_tokens=64", "model.max_model_len=64"]
    )

    def create(specs):
        return [ShmRing.create(s.name, s.num_slots, s.slot_bytes, s.num_readers) for s in specs]

    run.create_rings(config, model_dir, range(3), create)
    assert len(run.rings) == 6
    run.remove_rings(range(1, 3))
    assert sorted(r.name for r in run.rings) == sorted(
        [run.endpoints.step_ring(0), run.endpoints.result_ring(0)]
    )
    run.remove_rings()
    assert run.rings == []
    run.release(keep_keys=False)


@pytest.mark.parametrize(
    ("readers", "slot_bytes", "advice"),
    [
        (600, None, False),  # more readers than a ring tracks: not the sizes' fault
        (1, 2**63, True),  # a segment no host maps: lower the sizes
    ],
)
def test_ring_refusals_advise_lowering_the_sizes_only_when_the_sizes_are_at_fault(
    run_dir: Path, tmp_path: Path, readers: int, slot_bytes: int | None, advice: bool
):
    run = Run(run_dir, new_run_id())
    run.claim_shared_memory()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 64}))
    config = load_config(None, ["engine.max_num_seqs=4", "model.max_model_len=64"])

    def create(specs):
        return [ShmRing.create(s.name, s.num_slots, slot_bytes or s.slot_bytes, readers) for s in specs]

    try:
        with pytest.raises(Refused, match="rings could not be made") as info:
            run.create_rings(config, model_dir, range(1), create)
        assert ("lower them" in str(info.value)) == advice
        assert run.rings == [] and not any(
            Path("/dev/shm").glob(run.endpoints.step_ring(0).lstrip("/") + "*")
        )
    finally:
        run.release(keep_keys=False)


def test_status_survives_a_failing_write_and_says_so_once(tmp_path: Path, caplog):
    (tmp_path / "file").write_text("")
    writer = StatusWriter(tmp_path / "file")  # a run dir that is a file: every write fails
    stage = StageHandle("tokenizer-0", "tokenizer", [], {}, state="running")
    with caplog.at_level(logging.INFO, "supervisor"):
        for _ in range(3):
            writer.write_status([stage], is_due=True)
        assert sum("could not write status.json" in r.message for r in caplog.records) == 1
        writer.run_dir = tmp_path
        writer.write_status([stage], is_due=True)
    assert "status.json written again" in caplog.text
    rows = json.loads((tmp_path / STATUS_FILE).read_text())
    assert rows[0]["name"] == "tokenizer-0" and rows[0]["state"] == "running"


@pytest.mark.parametrize(
    ("left", "expected"),
    [
        ([], "stopped; shared memory and sockets removed"),
        (
            ["node abc (its cleanup did not finish in 30s)"],
            "the cleanup did not finish on: node abc (its cleanup",
        ),
    ],
)
def test_the_stop_line_names_what_the_stage_set_could_not_clean_up(
    run_dir: Path, caplog, left: list[str], expected: str
):
    """A Ray node whose end-of-run cleanup timed out (RayStageSet.close returns it) is named in the
    supervisor's last line, a warning; it said "shared memory and sockets removed" all the same."""
    from supervisor import Supervisor

    supervisor = Supervisor(load_config(None, []), None, [], run_dir, "text")
    supervisor.run.claim_run_dir()
    supervisor.stages.close = lambda: left  # what the stage set reports it could not remove
    with caplog.at_level(logging.INFO, logger="supervisor"):
        supervisor.stop()
    [line] = [r for r in caplog.records if r.getMessage().startswith("stopped")]
    assert expected in line.getMessage()
    assert line.levelno == (logging.WARNING if left else logging.INFO)


def test_a_detokenizer_restarted_in_the_middle_of_a_reload_is_re_driven_by_the_current_shard_count(
    run_dir: Path,
):
    """detokenizer.replicas 1 -> 2 while the added shard starts: run.json's config says 2, but the
    schedulers still send every request to shard 0. detokenizer-0 restarting then has the
    tokenizers resubmit the requests of shard 0 of 1 (all of them), not of 0 of 2 (about half:
    the rest waited for the stall watchdog)."""
    from supervisor import Supervisor

    config = load_config(None, [])
    supervisor = Supervisor(with_setting(config, "detokenizer.replicas", 2), None, [], run_dir, "text")
    supervisor.transitions.current = Topology.of(config)
    sent: list[tuple[str, object]] = []
    supervisor.command = lambda stage, message: sent.append((stage.name, message))
    for spec in Topology.of(config).stages():
        supervisor.stages.add(spec)
    restarted = supervisor.stages["detokenizer-0"]
    restarted.num_restarts = 1
    supervisor.on_ready(restarted, "")
    assert ("tokenizer-0", m.ResubmitShard(0, 1)) in sent
    close_context(supervisor.ctx, 0)


def test_status_of_a_damaged_or_dead_run_dir_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    """`supervisor.py status` printed a traceback on a status.json that is not one (empty, cut
    short, a directory in its place) or a run dir that is a file, and run.json's pid, if too
    large for os.kill, raised OverflowError (0 and -1 named process groups: "alive")."""
    runs = {
        name: tmp_path / name for name in ("empty", "cut", "object", "dir", "pid_huge", "pid_0", "pid_-1")
    }
    for path in runs.values():
        path.mkdir(mode=0o700)
    (runs["empty"] / STATUS_FILE).write_text("")
    (runs["cut"] / STATUS_FILE).write_text('[{"name": "tokeni')
    (runs["object"] / STATUS_FILE).write_text("{}")
    (runs["dir"] / STATUS_FILE).mkdir()
    runs["file"] = tmp_path / "file"
    runs["file"].write_text("")
    for name, pid in (("pid_huge", 1 << 64), ("pid_0", 0), ("pid_-1", -1)):
        (runs[name] / STATUS_FILE).write_text("[]")
        (runs[name] / RUN_FILE).write_text(json.dumps({"supervisor_pid": pid}))
        os.utime(runs[name] / STATUS_FILE, (0, 0))  # not rewritten for long: its supervisor was killed
    for name, path in runs.items():
        for as_json in (False, True):
            assert status(path, as_json, watch=False) == 1, name
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1 and str(path) in err, (name, err)
            if name.startswith("pid_"):
                assert "its supervisor (pid" in err and "is gone" in err, (name, err)
