"""Changing a live run's topology: ipc/topology.py's `Transition`, carried out against the stage set.

A hot reload of the replica and engine group counts (`Transitions.change`) starts the new stages
before anyone routes to them, and stops removed ones only after no new request goes to them and
what they hold has drained (everyone keeps the links its replies need until then): no request is
dropped. An engine group the
cluster placed on another node (`Transitions.move_group`) takes its links along. The running
stages hear each new topology as `TopologyChanged`. Every wait here goes on watching the run
(`Watch`): a stage that dies meanwhile is restarted as at any other time."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Protocol

import msgspec

from ipc import messages as m
from ipc.config import Config
from ipc.topology import STOP_ORDER, StageSpec, Topology, Transition, diff
from services.audit import AuditLog
from supervision.live_settings import (
    SETTING_OF_KIND,
    TOPOLOGY_SETTINGS,
    get_setting,
    reconfigure_message,
    with_setting,
)
from supervision.policy import StartFailed
from supervision.preflight import Refused, check_encoders, check_layout, check_tls_files
from supervision.run import Run
from supervision.stages import StageHandle, StageSet

STOP_GRACE_S = 5.0
# The stages that keep links to their peers (services/peers.py) and so take TopologyChanged.
PEER_KINDS = ("tokenizer", "detokenizer", "scheduler")
# ... and those that hear it too: a gateway's client connects to tokenizer replicas added live.
TOPOLOGY_KINDS = (*PEER_KINDS, "gateway")
# The stages that take requests from clients: a hot reload starts those it adds last.
ENTRY_KINDS = ("tokenizer", "gateway")

log = logging.getLogger("supervisor")


class Watch(Protocol):
    """What a change needs of the supervisor's watch loop, which goes on while it waits."""

    config: Config  # the run's config: a change replaces it once run.json has the new one
    signals: list[int]  # SIGINT/SIGTERM received: a second one cuts the change's waits short

    def tick(self) -> None: ...

    def read_control(self, timeout: float) -> None: ...

    def wait_ready(self, stages: list[StageHandle], since: float | None = None) -> None: ...

    def command(self, stage: StageHandle, message: m.ControlDown) -> None: ...


class Transitions:
    """The run's current topology (`current`, with the hosts of its placed stages) and every
    change of it."""

    def __init__(self, watch: Watch, stages: StageSet, run: Run, audit: AuditLog) -> None:
        self.watch = watch
        self.stages = stages
        self.run = run
        self.audit = audit
        self.current = Topology.of(watch.config)  # with the stages' hosts once placed (start)
        # Each encoder replica's embedding cache outlives the replica (run.remove_embedding_caches).
        self.most_encoders = self.current.num_encoders
        # The removed tokenizer replicas told to drain and not stopped yet: one that restarts
        # meanwhile (a crash) is told again once it is up (Supervisor.on_ready), or it would take
        # new calls from the clients that still know it.
        self.draining: set[str] = set()
        stages.on_group_moved = self.move_group

    def broadcast(self, topology: Topology, kinds: tuple[str, ...] = TOPOLOGY_KINDS) -> None:
        """Make `topology`'s counts the current ones, in run.json for the stages that start from
        now on, and tell the running stages of `kinds` (by default every stage that keeps peer
        links, and the gateways). The hosts stay those of `current`: only `move_group` changes
        them, and a group may move while a change waits for its stages. Every tokenizer replica
        still in the stage set stays linked, whatever `topology` counts: one that a change
        removes or takes back finishes what it holds first, and its replies need those links."""
        linked = max((s.index + 1 for s in self.stages if s.kind == "tokenizer"), default=0)
        topology = msgspec.structs.replace(
            topology,
            hosts=self.current.hosts,
            num_tokenizers=max(topology.num_tokenizers, linked),
        )
        self.current = topology
        self.most_encoders = max(self.most_encoders, topology.num_encoders)
        self.run.publish_topology(topology)
        for stage in self.stages:
            if stage.kind in kinds:
                self.watch.command(stage, m.TopologyChanged(topology))

    def move_group(self, group: int, address: str) -> None:
        """The cluster placed engine group `group` on a node at `address`, another than its links
        have (its node died, or a hot reload added it there): its links follow (Run.move_stages),
        and the running stages hear it (TopologyChanged) before the group starts there. Raises
        Refused when the links cannot follow."""
        names = [s.name for s in self.stages if s.group == group]
        hosts = self.run.move_stages(self.watch.config, names, address)
        log.info("engine group %d moved to a node at %s: its links follow", group, address)
        self.current = msgspec.structs.replace(self.current, hosts=hosts)
        self.broadcast(self.current)

    def change(self, config: Config) -> None:
        """Apply `config`'s replica and engine group counts without dropping a request, in the
        order of ipc/topology.py's Transition. The live settings reach every stage as
        Reconfigure once the new stages are up. Raises Refused, having changed nothing, when
        run.json cannot take the new config, the gateway port cannot be held, gateway.tls's
        files do not load for an added gateway replica, or the added engine groups' rings cannot
        be made. A setting whose added stages do not start stays at `old`'s value, and the rest of
        the change goes on (`take_back`)."""
        old = self.watch.config
        assert self.run.info is not None  # published at start
        if config.gateway.replicas > old.gateway.replicas:
            # An added replica loads gateway.tls's files as they are now: a set the running
            # replicas refused at a rotation (they serve on with the last good one) would fail
            # its start, and a stage that fails its first start ends the run.
            check_tls_files(config)
        if config.encoder.num_encoders > old.encoder.num_encoders:
            check_encoders(config, Path(self.run.info.model_dir))  # as at start: preflight.check_model
        if config.engine.data_parallel > self.current.num_groups:
            config = self.place_groups(old, config)
        added_groups = range(self.current.num_groups, config.engine.data_parallel)
        try:
            self.run.create_rings(
                config, Path(self.run.info.model_dir), added_groups, self.stages.create_rings
            )
            self.run.claim_gateway_port(config)  # gateway replicas from none; port and host are not live
            self.run.publish(config)
        except Refused:
            self.run.remove_rings(added_groups)  # those it made
            self.stages.release_groups(old.engine)  # what place_groups reserved
            raise
        self.watch.config = config
        changes = {
            path: [get_setting(old, path), get_setting(config, path)]
            for path in TOPOLOGY_SETTINGS
            if get_setting(old, path) != get_setting(config, path)
        }
        if changes:
            self.audit.rescale(changes)
        before = self.current
        step = diff(before, Topology.of(config, before.hosts))
        attempted = step.added
        # An encoder replica makes its embedding cache as it starts, whether it is taken back or not.
        self.most_encoders = max(self.most_encoders, step.after.num_encoders)
        self.run.hand_over(config)  # the new rings, to supervisor.run_as
        # Downstream first, as at start: the added detokenizer shards, engine groups and encoders
        # are up, and every stage links to them and to the tokenizer replicas about to start,
        # before an added tokenizer takes a request. One started with them routed by the new
        # config to engine groups not up yet, and its replies found no link back (the others
        # link to the tokenizers of the current topology): its requests waited for the watchdog.
        failed = self.start_stages([spec for spec in step.added if spec.kind not in ENTRY_KINDS])
        if failed:  # no stage has heard of the ones added with them: they just stop
            attempted_groups = config.engine.data_parallel
            config, step = self.take_back(failed, old, config, before)
            known = {spec.name for spec in [*before.stages(), *step.during.stages()]}
            unheard_of = [stage for stage in self.stages if stage.name not in known]
            self.stages.remove(unheard_of)
            self.stages.stop(unheard_of, STOP_GRACE_S)
            self.stages.release_groups(config.engine)
            self.run.remove_rings(range(config.engine.data_parallel, attempted_groups))
        # Schedulers move every live request to its new detokenizer shard (full history, so the
        # new shard rebuilds its text; receivers drop what they already have by position).
        # Tokenizers route new requests to the groups that still take them. A PUSH to a tokenizer
        # replica not up yet keeps what it is sent until it is.
        self.broadcast(step.during, PEER_KINDS)
        # They read `during` from run.json (Stage.topology): the groups up and routed now.
        failed = self.start_stages([spec for spec in step.added if spec.kind in ENTRY_KINDS])
        if failed:  # stopped with the removed replicas below, which may have taken calls already
            config, step = self.take_back(failed, old, config, before)
            self.broadcast(step.during, PEER_KINDS)
        self.broadcast(self.current, ("gateway",))  # the tokenizer replicas added are up now
        for stage in self.stages:
            self.watch.command(stage, reconfigure_message(config))
        # The removed tokenizer replicas (and those taken back) take no new calls from now, while
        # any groups retire too; they finish what they hold, with their links kept, below.
        kept = {spec.name for spec in step.after.stages()}
        removed_tokenizers = [s for s in self.stages if s.kind == "tokenizer" and s.name not in kept]
        self.draining = {stage.name for stage in removed_tokenizers}
        for stage in removed_tokenizers:
            self.watch.command(stage, m.Shutdown())
        if step.draining:
            self.retire_groups(step.draining)
            # The tokenizers move what was left on them, the removed replicas too.
            self.broadcast(step.after)
        # The retired groups' stages are gone already; the removed replicas go now, and the
        # entry replicas taken back.
        removed = sorted(
            (s for s in self.stages if s.name not in kept), key=lambda s: STOP_ORDER.index(s.kind)
        )
        drain_timeout_s = config.supervisor.drain_timeout_s
        # A gateway stops accepting at SIGTERM and finishes its open requests (uvicorn's graceful
        # shutdown, bounded by drain_timeout_s); the other replicas keep the port. Its streams
        # may run on tokenizers that stay, so it is waited for itself, out of the stage set first
        # so that the watch does not take its exit for a crash and restart it.
        removed_gateways = [s for s in removed if s.kind == "gateway"]
        self.stages.remove(removed_gateways)
        for stage in removed_gateways:
            self.stages.send_signal(stage, signal.SIGTERM)
        deadline = time.monotonic() + drain_timeout_s

        def is_draining() -> bool:
            # By loads sent since the Shutdown, as the run's drain: one sent before it may miss
            # a call the replica admitted meanwhile, whose replies need the links kept.
            return not all(s.has_drained for s in removed_tokenizers) or any(
                s.is_alive for s in removed_gateways
            )

        while is_draining() and time.monotonic() < deadline and not self.is_cut_short():
            self.watch.read_control(0.2)
        self.watch.read_control(1.0)  # let in-flight batches to the old shards land first
        self.stages.remove([s for s in removed if s.kind != "gateway"])
        self.draining = set()
        if self.current.num_tokenizers != step.after.num_tokenizers:  # the links to them close
            self.broadcast(step.after)
        self.stages.stop(removed, STOP_GRACE_S)
        taken_back = [spec for spec in attempted if spec.name not in kept]
        self.run.remove_sockets([*step.removed, *taken_back])  # the retired groups' stages' too
        for stage in removed:
            log.info("retired %s", stage.name)

    def is_cut_short(self) -> bool:
        """A second signal came: the run stops now (supervisor.py), and so does what a change
        waits for: a retiring group's or a removed replica's requests, a group's placement. A
        first one lets them finish within supervisor.drain_timeout_s, as the run's drain does."""
        return len(self.watch.signals) > 1

    def start_stages(self, specs: list[StageSpec]) -> dict[str, str]:
        """Spawn the stages `specs` name, in their order, and watch until they are up. A stage that
        fails its first start, or is not up within supervisor.start_timeout_s, is stopped and out
        of the stage set, with those of its setting not up yet (a group's scheduler would wait for
        its workers in vain). Returns those settings, each with why."""
        added = [self.stages.add(spec) for spec in specs]
        started = time.monotonic()
        for stage in added:
            self.stages.spawn(stage)
        failed: dict[str, str] = {}  # setting path -> why
        while True:
            waiting = [s for s in added if self.stages.get(s.name) is s]
            try:
                self.watch.wait_ready(waiting, since=started)
                return failed
            except StartFailed as exc:
                if not set(exc.names) <= {stage.name for stage in waiting}:
                    raise  # a stage this change did not start
                for stage in waiting:
                    if stage.name in exc.names:
                        failed.setdefault(SETTING_OF_KIND[stage.kind], str(exc))
                gone = [
                    s
                    for s in waiting
                    if s.name in exc.names or (SETTING_OF_KIND[s.kind] in failed and not s.is_ready)
                ]
                self.stages.remove(gone)
                self.stages.stop(gone, STOP_GRACE_S)

    def take_back(
        self, failed: dict[str, str], old: Config, config: Config, before: Topology
    ) -> tuple[Config, Transition]:
        """`config` with the settings in `failed` (whose added stages did not start) back at
        `old`'s values, in run.json and as the run's config, and the transition to it from
        `before`."""
        attempted = config
        for path in failed:
            config = with_setting(config, path, get_setting(old, path))
        for path, why in failed.items():
            log.error("%s stays %s (the rest of the change goes on): %s", path, get_setting(old, path), why)
        self.audit.rescale({path: [get_setting(attempted, path), get_setting(old, path)] for path in failed})
        try:
            self.run.publish(config)
        except Refused as exc:  # the change is half made: it goes on, by the config it keeps
            log.error("run.json still names the counts taken back: %s", exc)
        self.watch.config = config
        return config, diff(before, Topology.of(config, before.hosts))

    def place_groups(self, old: Config, config: Config) -> Config:
        """Room for the engine groups that `config` adds: `config`, or, when the cluster has no
        room for them within cluster.placement_timeout_s (or this host lacks their devices),
        `config` with `old`'s engine.data_parallel (the reload keeps it, and says why)."""
        old_groups = old.engine.data_parallel
        try:
            check_layout(config)
            self.stages.place_groups(config.engine)
            deadline = time.monotonic() + config.cluster.placement_timeout_s
            while self.stages.unplaced():
                if self.is_cut_short():
                    raise Refused("the run is stopping")
                if time.monotonic() > deadline:
                    raise Refused(
                        f"engine groups {self.stages.unplaced()} found no room within "
                        f"cluster.placement_timeout_s={config.cluster.placement_timeout_s:g}s"
                    )
                self.watch.tick()
        except Refused as exc:
            log.error("reload: engine.data_parallel stays %d: %s", old_groups, exc)
            self.stages.release_groups(old.engine)
            return with_setting(config, "engine.data_parallel", old_groups)
        return config

    def retire_groups(self, groups: range) -> None:
        """Stop engine groups `groups`, which the tokenizers no longer send new requests to: they
        finish what they run, up to supervisor.drain_timeout_s, then stop, and their rings go."""
        config = self.watch.config
        retiring = [s for s in self.stages if s.group in groups]
        schedulers = [s for s in retiring if s.kind == "scheduler"]
        log.info(
            "retiring engine groups %d-%d: they finish what they run, within %gs",
            groups.start, groups.stop - 1, config.supervisor.drain_timeout_s,
        )  # fmt: skip
        # Loads from after the TopologyChanged: a request sent just before it is counted too.
        self.watch.read_control(2 * config.supervisor.heartbeat_interval_s)
        deadline = time.monotonic() + config.supervisor.drain_timeout_s

        def is_busy() -> bool:
            return any(s.load.num_running or s.load.num_waiting for s in schedulers)

        while is_busy() and time.monotonic() < deadline and not self.is_cut_short():
            self.watch.read_control(0.2)
        self.stages.remove(retiring)
        self.stages.stop(retiring, STOP_GRACE_S)
        self.stages.release_groups(config.engine)
        self.run.remove_rings(groups)
        log.info("retired engine groups %d-%d", groups.start, groups.stop - 1)
