"""The autoscaler's wiring (supervision/group_scaler.py) without processes: the loads it reads
from the schedulers' heartbeats, the change it asks of the transitions (the live data_parallel
path, faked here: tests/test_autoscale_run.py runs the real one), its audit line with the inputs,
a change that cannot be made, and its metrics sample."""

from __future__ import annotations

import json
from pathlib import Path

from ipc import messages as m
from ipc.config import Config, load_config
from ipc.topology import Topology
from services.audit import AuditLog
from services.metrics import EngineGroupsSample
from supervision.group_scaler import GroupScaler
from supervision.live_settings import with_setting
from supervision.preflight import Refused
from supervision.stages import StageSet

AUTOSCALE = ["autoscale.enabled=true", "autoscale.max_groups=2", "autoscale.target_waiting=2",
             "autoscale.scale_up_cooldown_s=0", "engine.threads=1", "supervisor.heartbeat_interval_s=0.01"]  # fmt: skip


class FakeWatch:
    def __init__(self, config: Config) -> None:
        self.config = config


class FakeTransitions:
    """Records each change, or refuses it as a placement that found no room does."""

    def __init__(self, watch: FakeWatch, refusal: str = "") -> None:
        self.watch = watch
        self.refusal = refusal
        self.changes: list[int] = []

    def change(self, config: Config) -> None:
        self.changes.append(config.engine.data_parallel)
        if self.refusal:
            raise Refused(self.refusal)
        self.watch.config = config


def scaler_for(
    tmp_path: Path, overrides: list[str], refusal: str = ""
) -> tuple[GroupScaler, StageSet, FakeTransitions]:
    config = load_config(None, [*AUTOSCALE, *overrides])
    stages = StageSet(config, tmp_path, "text")
    for spec in Topology.of(config).stages():
        stages.add(spec).is_ready = True
    watch = FakeWatch(config)
    transitions = FakeTransitions(watch, refusal)
    audit = AuditLog(tmp_path / "audit.log", "supervisor")
    return GroupScaler(watch, stages, transitions, audit), stages, transitions  # type: ignore[arg-type]


def audit_events(tmp_path: Path) -> list[dict]:
    path = tmp_path / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_queue_on_the_scheduler_adds_a_group_through_the_transition_and_is_audited(tmp_path: Path) -> None:
    scaler, stages, transitions = scaler_for(tmp_path, [])
    before = scaler.watch.config
    stages["scheduler-0"].load = m.StageLoad(num_running=2, num_waiting=6, kv_usage=0.25)
    scaler.step()
    assert transitions.changes == [2]
    assert scaler.watch.config == with_setting(before, "engine.data_parallel", 2)  # nothing else changes
    [event] = audit_events(tmp_path)
    assert event["event"] == "autoscale"
    assert {k: event[k] for k in ("direction", "current", "target", "groups", "error")} == {
        "direction": "up",
        "current": 1,
        "target": 2,
        "groups": 2,
        "error": "",
    }
    assert event["loads"] == [{"waiting": 6, "running": 2, "kv_usage": 0.25, "ttft_s": None}]
    assert event["needed"]["waiting"] == 3.0
    assert scaler.sample() == EngineGroupsSample(current=2, target=2, decisions_up=1, decisions_down=0)


def test_a_change_that_cannot_be_made_leaves_the_groups_and_says_why(tmp_path: Path) -> None:
    scaler, stages, transitions = scaler_for(tmp_path, [], refusal="run.json could not be written")
    stages["scheduler-0"].load = m.StageLoad(num_waiting=6)
    scaler.step()
    assert transitions.changes == [2]
    [event] = audit_events(tmp_path)
    assert (event["target"], event["groups"], event["error"]) == (2, 1, "run.json could not be written")
    assert (scaler.sample().current, scaler.sample().target) == (1, 1)


def test_nothing_is_decided_while_a_scheduler_is_not_up(tmp_path: Path) -> None:
    scaler, stages, transitions = scaler_for(tmp_path, [])
    stages["scheduler-0"].load = m.StageLoad(num_waiting=6)
    stages["scheduler-0"].is_ready = False  # restarting: its last load is stale
    scaler.step()
    assert transitions.changes == [] and audit_events(tmp_path) == []


def test_off_by_default_it_only_reports_the_groups(tmp_path: Path) -> None:
    config = load_config(None, ["engine.data_parallel=2"])
    stages = StageSet(config, tmp_path, "text")
    for spec in Topology.of(config).stages():
        stages.add(spec).is_ready = True
    stages["scheduler-0"].load = m.StageLoad(num_waiting=100)
    watch = FakeWatch(config)
    transitions = FakeTransitions(watch)
    scaler = GroupScaler(watch, stages, transitions, AuditLog(tmp_path / "audit.log", "supervisor"))  # type: ignore[arg-type]
    scaler.step()
    assert transitions.changes == []
    assert (scaler.sample().current, scaler.sample().target, scaler.sample().decisions_up) == (2, 2, 0)


def test_the_host_limit_caps_a_burst(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(StageSet, "max_groups", lambda self: 1)
    scaler, stages, transitions = scaler_for(tmp_path, [])
    stages["scheduler-0"].load = m.StageLoad(num_waiting=60)
    scaler.step()
    assert transitions.changes == []  # one group is all this host holds
