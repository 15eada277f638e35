"""A topology change carried out (supervision/transition.py) against the local stage set with its
process launches and stops recorded instead of made, and a watch loop that brings every new stage
up at once: the order of spawns, readiness, TopologyChanged, Reconfigure, drains and stops that
keeps every request (tests/test_reload.py checks the same with real processes and requests)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import posix_ipc
import pytest

from ipc import messages as m
from ipc.config import Config, load_config
from ipc.shm import new_run_id
from ipc.topology import Topology
from services.audit import AuditLog
from services.stage import read_run_info
from supervision.live_settings import with_setting
from supervision.policy import StartFailed
from supervision.preflight import Refused
from supervision.run import Run
from supervision.stages import StageHandle, StageSet
from supervision.transition import PEER_KINDS, Transitions

Event = tuple  # (what happened, stage names... or stage name and command)


class RecordedStages(StageSet):
    """The local stage set, its processes only recorded in `events`."""

    def __init__(self, config: Config, run_dir: Path, events: list[Event]) -> None:
        super().__init__(config, run_dir, "text")
        self.events = events
        self.topology_at_spawn: dict[str, Topology | None] = {}  # what the stage reads from run.json

    def launch(self, stage: StageHandle) -> None:
        self.events.append(("spawn", stage.name))
        self.topology_at_spawn[stage.name] = read_run_info(self.run_dir).topology

    def stop(self, stages: Iterable[StageHandle], grace_s: float, sig: int = signal.SIGTERM) -> None:
        names = sorted(s.name for s in stages)
        if names:
            self.events.append(("stop", *names))


class Running:
    """A process that has not exited (RecordedStages launches none)."""

    pid = 0

    def poll(self) -> None:
        return None


class Loop:
    """The supervisor's side: commands recorded, every new stage ready at once, nothing in flight."""

    def __init__(self, config: Config, events: list[Event]) -> None:
        self.config = config
        self.events = events
        # Each once, at the change's next wait for stages to come up or for loads.
        self.meanwhile: list[Callable[[], None]] = []
        # Stages that fail their first start; the stages in `up_first` come up before they do.
        self.failing: set[str] = set()
        self.up_first: set[str] = set()
        self.signals: list[int] = []
        # Stages that report nothing at a Shutdown (the others at once: draining, none in flight).
        self.silent_at_shutdown: set[str] = set()

    def tick(self) -> None:
        pass

    def read_control(self, timeout: float) -> None:
        self.run_meanwhile()

    def run_meanwhile(self) -> None:
        """Those queued before this wait (one may queue another for the next)."""
        queued, self.meanwhile = self.meanwhile, []
        for action in queued:
            action()

    def wait_ready(self, stages: list[StageHandle], since: float | None = None) -> None:
        if failed := sorted(s.name for s in stages if s.name in self.failing):
            for stage in stages:
                if stage.name in self.up_first:
                    stage.on_ready(0.0)
            self.failing -= set(failed)
            raise StartFailed(f"{failed[0]} failed to start (exit code 1): no model", failed)
        if stages:
            self.run_meanwhile()
        for stage in stages:
            stage.on_ready(0.0)
        self.events.append(("ready", *sorted(s.name for s in stages)))

    def command(self, stage: StageHandle, message: m.ControlDown) -> None:
        self.events.append(("command", stage.name, message))
        if isinstance(message, m.Shutdown) and stage.name not in self.silent_at_shutdown:
            stage.load = m.StageLoad(is_draining=True)


class Harness:
    def __init__(self, tmp_path: Path, config: Config) -> None:
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir()
        model_dir = tmp_path / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps({"vocab_size": 64}))
        self.run = Run(self.run_dir, new_run_id())
        self.run.claim_shared_memory()
        self.run.publish(config, model_dir, topology=Topology.of(config))
        self.events: list[Event] = []
        self.stages = RecordedStages(config, self.run_dir, self.events)
        self.loop = Loop(config, self.events)
        self.audit_path = tmp_path / "audit.jsonl"
        self.transitions = Transitions(
            self.loop, self.stages, self.run, AuditLog(self.audit_path, "supervisor")
        )
        for spec in self.transitions.current.stages():
            self.stages.spawn(self.stages.add(spec))
            self.stages[spec.name].on_ready(0.0)
        self.run.create_rings(config, model_dir, range(config.engine.data_parallel), self.stages.create_rings)
        self.events.clear()

    def close(self) -> None:
        self.run.remove_rings()
        self.run.release(keep_keys=False)

    def index(self, event: Event) -> int:
        return self.events.index(event)

    def commands(self, kind: type) -> list[tuple[int, str, object]]:
        """(position in events, stage, command) of each command of `kind` sent."""
        return [
            (i, e[1], e[2]) for i, e in enumerate(self.events) if e[0] == "command" and isinstance(e[2], kind)
        ]

    def topologies(self) -> list[tuple[int, str, Topology]]:
        """(position in events, stage, topology) of each TopologyChanged sent."""
        return [(i, name, message.topology) for i, name, message in self.commands(m.TopologyChanged)]


def small_config(*overrides: str) -> Config:
    return load_config(
        None,
        [
            "gateway.replicas=0",
            "engine.max_num_seqs=4",
            "engine.max_num_batched_tokens=64",
            "model.max_model_len=64",
            *overrides,
        ],
    )


@pytest.fixture
def harness(tmp_path: Path):
    made = Harness(tmp_path, small_config("engine.data_parallel=2"))
    yield made
    made.close()


def test_new_stages_are_up_before_anyone_routes_to_them_and_a_group_drains_before_it_stops(harness: Harness):
    old = harness.loop.config
    new = with_setting(with_setting(old, "tokenizer.replicas", 2), "engine.data_parallel", 1)
    harness.transitions.change(new)

    spawned, ready = harness.index(("spawn", "tokenizer-1")), harness.index(("ready", "tokenizer-1"))
    changes = harness.topologies()
    reconfigures = harness.commands(m.Reconfigure)
    stopped = harness.index(("stop", "gpu_worker-1-0", "scheduler-1"))
    # During: every peer-keeping stage hears the new counts, group 1 still there but not routed,
    # before the added tokenizer starts; it reads them from run.json (and hears them at Ready).
    during = [c for c in changes if c[2].num_groups == 2]
    assert sorted(name for _, name, _ in during) == [
        "detokenizer-0",
        "scheduler-0",
        "scheduler-1",
        "tokenizer-0",
    ]
    assert all(t.num_routed_groups == 1 and t.num_tokenizers == 2 for _, _, t in during)
    assert max(i for i, _, _ in during) < spawned < ready
    assert harness.stages.topology_at_spawn["tokenizer-1"] == during[0][2]
    # Every stage gets the live settings, then group 1 stops, then the rest hear it is gone.
    every_stage = [s.name for s in Topology.of(old).stages()] + ["tokenizer-1"]
    assert sorted(name for _, name, _ in reconfigures) == sorted(every_stage)
    assert max(i for i, _, _ in during) < min(i for i, _, _ in reconfigures)
    assert max(i for i, _, _ in reconfigures) < stopped
    after = [c for c in changes if c[2].num_groups == 1]
    assert after and min(i for i, _, _ in after) > stopped
    assert sorted(name for _, name, _ in after) == [
        "detokenizer-0",
        "scheduler-0",
        "tokenizer-0",
        "tokenizer-1",
    ]
    assert all(kind in PEER_KINDS for kind in (harness.stages[name].kind for _, name, _ in after))

    assert harness.loop.config is not old and harness.loop.config.engine.data_parallel == 1
    assert harness.run.info is not None and harness.run.info.config == harness.loop.config
    assert harness.transitions.current == Topology.of(new)
    assert sorted(s.name for s in harness.stages) == sorted(s.name for s in Topology.of(new).stages())
    ring_names = {r.name for r in harness.run.rings}
    assert ring_names == {harness.run.endpoints.step_ring(0), harness.run.endpoints.result_ring(0)}
    [event] = [json.loads(line) for line in harness.audit_path.read_text().splitlines()]
    assert event["event"] == "rescale"
    assert event["changes"] == {"tokenizer.replicas": [1, 2], "engine.data_parallel": [2, 1]}


def test_added_tokenizers_start_once_the_added_groups_are_up_and_everyone_links_to_them(tmp_path: Path):
    """engine.data_parallel 1 -> 2 with tokenizer.replicas 1 -> 2: the new group is up and every
    peer-keeping stage links to both tokenizers and routes to both groups before tokenizer-1
    starts, and tokenizer-1 reads that topology from run.json. It started with the group and went
    by the new config: it routed to group 1 before it was up, and the detokenizer, which still
    knew one tokenizer, dropped its replies, so its requests waited for the stall watchdog."""
    harness = Harness(tmp_path, small_config())
    try:
        old = harness.loop.config
        new = with_setting(with_setting(old, "tokenizer.replicas", 2), "engine.data_parallel", 2)
        harness.transitions.change(new)
        group_ready = harness.index(("ready", "gpu_worker-1-0", "scheduler-1"))
        spawned, ready = harness.index(("spawn", "tokenizer-1")), harness.index(("ready", "tokenizer-1"))
        changes = harness.topologies()
        peers = [(i, name) for i, name, t in changes if name != "tokenizer-1"]
        assert all(t == Topology.of(new) for _, _, t in changes)
        assert sorted(name for _, name in peers) == [
            "detokenizer-0",
            "scheduler-0",
            "scheduler-1",
            "tokenizer-0",
        ]
        assert group_ready < min(i for i, _ in peers) and max(i for i, _ in peers) < spawned < ready
        assert harness.stages.topology_at_spawn["tokenizer-1"] == Topology.of(new)
        # The group started while the old topology was current, as the rest of the run had it.
        assert harness.stages.topology_at_spawn["scheduler-1"] == Topology.of(old)
    finally:
        harness.close()


def test_a_tokenizer_restarted_in_the_middle_of_a_change_reads_the_topology_of_that_moment(tmp_path: Path):
    """A tokenizer that crashed and restarts while a reload waits for added engine groups to come
    up, or for retired ones to drain, reads from run.json the topology the rest of the run has
    then (Stage.topology), not the new config's counts: it routes to no group that is not up yet,
    nor to one that is draining, and links to every group still running."""
    harness = Harness(tmp_path, small_config())
    try:
        old = harness.loop.config
        restarted: list[Topology | None] = []

        def restart_tokenizer() -> None:
            harness.stages.spawn(harness.stages["tokenizer-0"])
            restarted.append(harness.stages.topology_at_spawn["tokenizer-0"])
            assert harness.run.info is not None and harness.run.info.config == harness.loop.config

        harness.loop.meanwhile.append(restart_tokenizer)  # while group 1 starts
        grown = with_setting(old, "engine.data_parallel", 2)
        harness.transitions.change(grown)
        assert restarted == [Topology.of(old)]

        harness.loop.meanwhile.append(restart_tokenizer)  # while group 1 drains
        harness.transitions.change(old)
        draining = msgspec.structs.replace(Topology.of(old), num_groups=2)
        assert restarted[1] == draining and restarted[1].num_routed_groups == 1
    finally:
        harness.close()


def test_a_removed_tokenizer_drains_linked_and_stops_after_its_links_close(tmp_path: Path):
    """Its streams' replies come back from the detokenizers and the schedulers: they keep their
    links to it while it drains, and close them only before it stops."""
    harness = Harness(tmp_path, small_config("tokenizer.replicas=2"))
    sockets = ["tokenizer-0.sock", "tokenizer-0-in.sock", "tokenizer-1.sock", "tokenizer-1-in.sock"]
    for name in sockets:  # what the processes would have bound
        (harness.run_dir / name).touch()
    try:
        harness.transitions.change(with_setting(harness.loop.config, "tokenizer.replicas", 1))
        assert sorted(p.name for p in harness.run_dir.glob("*.sock")) == sorted(sockets[:2])
        shutdowns = harness.commands(m.Shutdown)
        assert [name for _, name, _ in shutdowns] == ["tokenizer-1"]
        drain_at = shutdowns[0][0]
        changes = harness.topologies()
        assert {t.num_tokenizers for i, _, t in changes if i < drain_at} == {2}
        closed = [(i, name) for i, name, t in changes if t.num_tokenizers == 1]
        peers = {s.name for s in harness.stages if s.kind in PEER_KINDS}
        assert {name for _, name in closed} >= peers and all(i > drain_at for i, _ in closed)
        stopped = harness.index(("stop", "tokenizer-1"))
        assert max(i for i, _ in closed) < stopped
        assert harness.transitions.current.num_tokenizers == 1
        assert read_run_info(harness.run_dir).topology == harness.transitions.current
        assert not any(e[0] == "spawn" for e in harness.events)
        assert "tokenizer-1" not in {s.name for s in harness.stages}
    finally:
        harness.close()


def test_a_removed_tokenizer_takes_no_new_calls_while_groups_retire(tmp_path: Path):
    """tokenizer.replicas 2 -> 1 with engine.data_parallel 2 -> 1: tokenizer-1 heard its Shutdown
    only after group 1 had drained (up to drain_timeout_s), taking new calls all that while. It
    hears it before the retirement now, and keeps its links until it has drained itself."""
    harness = Harness(tmp_path, small_config("tokenizer.replicas=2", "engine.data_parallel=2"))
    try:
        new = with_setting(harness.loop.config, "tokenizer.replicas", 1)
        harness.transitions.change(with_setting(new, "engine.data_parallel", 1))
        [(shutdown_at, name, _)] = harness.commands(m.Shutdown)
        assert name == "tokenizer-1"
        assert shutdown_at < harness.index(("stop", "gpu_worker-1-0", "scheduler-1"))
        heard = [t for _, name, t in harness.topologies() if name == "tokenizer-0"]
        assert [(t.num_groups, t.num_tokenizers) for t in heard] == [(2, 2), (1, 2), (1, 1)]
    finally:
        harness.close()


def test_a_removed_tokenizer_is_waited_for_by_the_loads_it_sends_after_its_shutdown(tmp_path: Path):
    """Its last load before the Shutdown said nothing in flight, but it admitted a call between
    that load and the Shutdown: the wait took the old load, and closed the links the call's
    replies needed at once. Now only a load sent since the Shutdown counts."""
    harness = Harness(tmp_path, small_config("tokenizer.replicas=2"))
    try:
        harness.loop.silent_at_shutdown = {"tokenizer-1"}
        removed = harness.stages["tokenizer-1"]
        removed.process = Running()  # a stage that is down is not waited for

        def report(in_flight: int) -> None:
            removed.load = m.StageLoad(num_in_flight=in_flight, is_draining=True)
            harness.events.append(("load", removed.name, in_flight))
            if in_flight:
                harness.loop.meanwhile.append(lambda: report(in_flight - 1))

        harness.loop.meanwhile.append(lambda: report(1))
        harness.transitions.change(with_setting(harness.loop.config, "tokenizer.replicas", 1))
        drained = harness.index(("load", "tokenizer-1", 0))
        closed = [i for i, _, t in harness.topologies() if t.num_tokenizers == 1]
        assert closed and drained < min(closed)
    finally:
        harness.close()


def test_a_removed_tokenizer_that_restarts_while_it_drains_is_told_to_drain_again(tmp_path: Path):
    """tokenizer-1, removed, crashes during its drain and is restarted: it came up taking new calls
    from the clients that still knew it, and what they sent kept the drain waiting to its
    deadline. Once up it hears Shutdown again (Supervisor.on_ready), while the drain lasts only."""
    from supervisor import Supervisor

    harness = Harness(tmp_path, small_config("tokenizer.replicas=2"))
    try:
        seen: list[set[str]] = []
        harness.loop.meanwhile.append(lambda: seen.append(set(harness.transitions.draining)))
        harness.transitions.change(with_setting(harness.loop.config, "tokenizer.replicas", 1))
        assert seen == [{"tokenizer-1"}] and harness.transitions.draining == set()
    finally:
        harness.close()
    config = small_config("tokenizer.replicas=2")
    supervisor = Supervisor(config, None, [], tmp_path / "supervisor-run", "text")
    sent: list[tuple[str, object]] = []
    supervisor.command = lambda stage, message: sent.append((stage.name, message))  # type: ignore[method-assign]
    try:
        tokenizers = [
            supervisor.stages.add(spec) for spec in Topology.of(config).stages() if spec.kind == "tokenizer"
        ]
        supervisor.transitions.draining = {"tokenizer-1"}
        for stage in tokenizers:
            supervisor.on_ready(stage, "")
        assert [name for name, message in sent if isinstance(message, m.Shutdown)] == ["tokenizer-1"]
        supervisor.transitions.draining = set()
        sent.clear()
        supervisor.on_ready(tokenizers[1], "")
        assert not [message for _, message in sent if isinstance(message, m.Shutdown)]
    finally:
        supervisor.ctx.term()


def test_a_change_run_json_cannot_take_is_refused_with_nothing_changed(harness: Harness):
    old = harness.loop.config
    (harness.run_dir / "run.json").unlink()
    (harness.run_dir / "run.json").mkdir()  # the new run.json cannot replace a directory
    (harness.run_dir / "run.json" / "keep").write_text("")
    with pytest.raises(Refused, match="could not write"):
        harness.transitions.change(with_setting(old, "tokenizer.replicas", 2))
    assert harness.loop.config is old
    assert harness.events == []
    assert harness.transitions.current == Topology.of(old)


def test_a_change_whose_rings_cannot_be_made_is_refused_with_nothing_changed(harness: Harness):
    """A third engine group's result ring name already held in /dev/shm (here by a squatter; on
    a host short of memory, ENOMEM): the change is refused before run.json or the watch take the
    new group count, and the group's step ring, made before, is not left behind."""
    old = harness.loop.config
    squatter = posix_ipc.SharedMemory(harness.run.endpoints.result_ring(2), posix_ipc.O_CREX, size=4096)
    try:
        rings_before = list(harness.run.rings)
        with pytest.raises(
            Refused, match=r"rings could not be made: Shared memory with the specified name already exists"
        ):
            harness.transitions.change(with_setting(old, "engine.data_parallel", 3))
        assert harness.loop.config is old
        assert read_run_info(harness.run_dir).config.engine.data_parallel == 2
        assert harness.events == []
        assert harness.run.rings == rings_before
        left = [n for n in os.listdir("/dev/shm") if harness.run.endpoints.step_ring(2).lstrip("/") in n]
        assert not left, left
    finally:
        squatter.unlink()


def test_added_stages_that_fail_to_start_take_their_setting_back_and_the_rest_goes_on(tmp_path: Path):
    """engine.data_parallel 1 -> 2, detokenizer.replicas 1 -> 2 and tokenizer.replicas 1 -> 3,
    where gpu_worker-1-0 and tokenizer-2 fail their first start (tokenizer-1 is up by then): the
    failure ended the run. Now engine.data_parallel and tokenizer.replicas stay 1: group 1 stops
    (its scheduler was still waiting for the worker) before anyone hears of it, and its rings go;
    tokenizer-1 is told to drain and stops after everyone routes around it; detokenizer-1 stays."""
    harness = Harness(tmp_path, small_config())
    try:
        old = harness.loop.config
        new = with_setting(old, "engine.data_parallel", 2)
        new = with_setting(with_setting(new, "detokenizer.replicas", 2), "tokenizer.replicas", 3)
        harness.loop.failing = {"gpu_worker-1-0", "tokenizer-2"}
        harness.loop.up_first = {"detokenizer-1", "tokenizer-1"}
        harness.transitions.change(new)

        kept = with_setting(old, "detokenizer.replicas", 2)
        assert harness.loop.config == kept
        assert harness.run.info is not None and harness.run.info.config == kept
        assert harness.transitions.current == Topology.of(kept)
        assert sorted(s.name for s in harness.stages) == sorted(s.name for s in Topology.of(kept).stages())
        assert {r.name for r in harness.run.rings} == {
            harness.run.endpoints.step_ring(0),
            harness.run.endpoints.result_ring(0),
        }
        assert len(harness.stages.dist_ports) == 1  # group 1's reservation went back too
        group_stopped = harness.index(("stop", "gpu_worker-1-0", "scheduler-1"))
        changes = harness.topologies()
        assert all(t.num_groups == 1 and t.num_detokenizers == 2 for _, _, t in changes)
        assert min(i for i, _, _ in changes) > group_stopped
        # The peers heard of three tokenizers before tokenizer-1 and -2 started, and keep their
        # links to tokenizer-1 (it may have taken calls already) until it has drained, but not to
        # tokenizer-2, which never came up; then they hear of one, and tokenizer-1 stops.
        assert [t.num_tokenizers for _, name, t in changes if name == "detokenizer-0"] == [3, 2, 1]
        [(shutdown_at, name, _)] = harness.commands(m.Shutdown)
        assert name == "tokenizer-1"
        assert shutdown_at < min(i for i, _, t in changes if t.num_tokenizers == 1)
        assert max(i for i, _, _ in changes) < harness.index(("stop", "tokenizer-1"))
        events = [json.loads(line) for line in harness.audit_path.read_text().splitlines()]
        assert [e["changes"] for e in events] == [
            {"detokenizer.replicas": [1, 2], "tokenizer.replicas": [1, 3], "engine.data_parallel": [1, 2]},
            {"engine.data_parallel": [2, 1]},
            {"tokenizer.replicas": [3, 1]},
        ]
    finally:
        harness.close()


def test_a_second_signal_cuts_a_retiring_groups_wait_short(tmp_path: Path):
    """engine.data_parallel 2 -> 1 while group 1 keeps running a request, with a long drain
    timeout: two signals during the wait (the operator's "stop now") ended nothing until
    supervisor.drain_timeout_s was over. Now the second one ends the wait, and group 1 stops."""
    harness = Harness(tmp_path, small_config("engine.data_parallel=2", "supervisor.drain_timeout_s=60"))
    try:
        harness.stages["scheduler-1"].load = m.StageLoad(num_running=1)
        harness.loop.meanwhile = [
            lambda: harness.loop.signals.append(signal.SIGTERM),
            lambda: harness.loop.signals.append(signal.SIGTERM),
        ]
        started = time.monotonic()
        harness.transitions.change(with_setting(harness.loop.config, "engine.data_parallel", 1))
        assert time.monotonic() - started < 10
        assert ("stop", "gpu_worker-1-0", "scheduler-1") in harness.events
    finally:
        harness.close()


def test_an_added_stage_killed_by_a_signal_at_each_start_fails_its_start(tmp_path: Path):
    """A stage never ready that a signal kills each time it starts (a segfault, the OOM killer)
    is restarted, and once the restart intensity is spent the supervisor gave up with a GiveUp that
    a topology change cannot tell from any other: the run ended. It is a StartFailed now, which a
    change takes back (and which ends the run at its start, as before); a stage that was ready once
    still ends the run with a plain GiveUp."""
    from supervisor import GiveUp, Supervisor

    config = small_config("supervisor.restart_intensity=0")
    supervisor = Supervisor(config, None, [], tmp_path, "text")
    try:
        stage = supervisor.stages.add(Topology.of(config).stages()[0])
        with pytest.raises(
            StartFailed, match=r"failed to start 1 times \(last: killed by signal 9\)"
        ) as failed:
            supervisor.on_failure(stage, "killed by signal 9")
        assert failed.value.names == [stage.name]
        stage.on_ready(0.0)
        stage.failures.clear()
        with pytest.raises(GiveUp) as gave_up:
            supervisor.on_failure(stage, "exited with code -9")
        assert not isinstance(gave_up.value, StartFailed)
        # start_timeout_s bounds a change's start as a whole: a wait again after a failure keeps
        # the deadline of the first.
        waiting = supervisor.stages.add(Topology.of(config).stages()[1])
        timeout_s = config.supervisor.start_timeout_s
        with pytest.raises(StartFailed, match="did not come up") as late:
            supervisor.wait_ready([waiting], since=time.monotonic() - timeout_s - 1)
        assert late.value.names == [waiting.name]
    finally:
        supervisor.ctx.term()


def test_an_encoder_taken_back_still_has_its_embedding_cache_removed_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """An encoder replica makes its embedding cache in shared memory as it starts; one taken
    back was left out of the count of caches the run removes at its end (`most_encoders`)."""
    monkeypatch.setattr(
        "supervision.transition.check_encoders", lambda config, model_dir: None
    )  # no VLM here
    harness = Harness(tmp_path, small_config("encoder.replicas=1"))
    try:
        harness.loop.failing = {"encoder-1"}
        harness.transitions.change(with_setting(harness.loop.config, "encoder.replicas", 2))
        assert harness.loop.config.encoder.replicas == 1
        assert harness.transitions.most_encoders == 2
    finally:
        harness.close()


def test_a_group_moved_while_a_change_waits_keeps_its_new_host(tmp_path: Path):
    """Engine group 1 is placed on another node (its node died) while a reload's added
    detokenizer starts: the change's next TopologyChanged carried the hosts from before the change
    began, and sent every stage's links to group 1 back to the dead node."""
    config = small_config("engine.data_parallel=2", "network.transport=tcp", "network.host=0.0.0.0")
    harness = Harness(tmp_path, config)
    try:
        harness.loop.meanwhile.append(lambda: harness.transitions.move_group(1, "127.0.0.2"))
        harness.transitions.change(with_setting(config, "detokenizer.replicas", 2))
        moved = {"scheduler-1": "127.0.0.2", "gpu_worker-1-0": "127.0.0.2"}
        assert harness.transitions.current.hosts == moved
        info = read_run_info(harness.run_dir)
        assert info.topology is not None and info.topology.hosts == moved
        heard = harness.topologies()
        counts = [t.num_detokenizers for _, _, t in heard]
        assert counts[0] == 1 and counts[-1] == 2 and counts == sorted(counts)  # the move, the change
        assert all(t.hosts == moved for _, _, t in heard)
    finally:
        harness.close()
