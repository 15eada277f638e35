"""Carrying out the autoscale policy (supervision/autoscale.py) on a live run: once per heartbeat
interval the engine groups' loads (their schedulers' heartbeats) go to the policy, and a decision
goes the way a hot reload of engine.data_parallel does (supervision/transition.py): new groups
are placed, started, then routed to; removed ones are the highest, drained, and what they still
ran is resubmitted. Each decision is written to the audit log with its inputs, and the groups,
the target and the decisions are exported as metrics (`sample`)."""

from __future__ import annotations

import logging
import time

from services.audit import AuditLog
from services.metrics import EngineGroupsSample
from supervision.autoscale import AutoscalePolicy, Decision, GroupLoad
from supervision.live_settings import with_setting
from supervision.preflight import Refused
from supervision.stages import StageSet
from supervision.transition import Transitions, Watch

log = logging.getLogger("supervisor")


class GroupScaler:
    """The run's engine group count under autoscale.enabled; with it off, only the metrics."""

    def __init__(self, watch: Watch, stages: StageSet, transitions: Transitions, audit: AuditLog) -> None:
        self.watch = watch
        self.stages = stages
        self.transitions = transitions
        self.audit = audit
        self.policy = AutoscalePolicy(watch.config.autoscale)
        # The most groups the backend holds, asked once (on CUDA it starts a child to count devices).
        self.host_limit = stages.max_groups() if watch.config.autoscale.enabled else None
        self.target = watch.config.engine.data_parallel
        self.decisions = {"up": 0, "down": 0}
        self.sampled_at = 0.0

    def step(self) -> None:
        """Once per heartbeat interval, while every group's scheduler is up (a group that starts
        or restarts has no load to tell): its decision on the groups' loads, carried out."""
        config = self.watch.config
        now = time.monotonic()
        if not config.autoscale.enabled or now - self.sampled_at < config.supervisor.heartbeat_interval_s:
            return
        self.sampled_at = now
        current = config.engine.data_parallel
        schedulers = sorted(
            (s for s in self.stages.of_kind("scheduler") if s.group < current), key=lambda s: s.group
        )
        if len(schedulers) < current or not all(s.is_ready for s in schedulers):
            return
        loads = [
            GroupLoad(s.load.num_waiting, s.load.num_running, s.load.kv_usage, s.load.ttft_p90_s or None)
            for s in schedulers
        ]
        decision = self.policy.decide(current, loads, self.host_limit)
        if decision is not None:
            self.apply(decision, loads)

    def apply(self, decision: Decision, loads: list[GroupLoad]) -> None:
        """Change the run to `decision.target` groups; a change that cannot be made (no room for
        a new group within cluster.placement_timeout_s, run.json unwritable) leaves the run as it
        was, and says why in the log and the audit line."""
        log.info("autoscale: engine groups %d -> %d (%s)", decision.current, decision.target, decision.reason)
        self.target = decision.target
        self.decisions[decision.direction] += 1
        error = ""
        try:
            self.transitions.change(with_setting(self.watch.config, "engine.data_parallel", decision.target))
        except Refused as exc:
            error = str(exc)
        groups = self.watch.config.engine.data_parallel
        if groups != decision.target and not error:
            error = "the added engine groups found no room or did not come up (see the log)"
        if error:
            log.error("autoscale: engine groups stay %d: %s", groups, error)
        self.target = groups
        inputs = [
            {"waiting": g.num_waiting, "running": g.num_running, "kv_usage": g.kv_usage, "ttft_s": g.ttft_s}
            for g in loads
        ]
        self.audit.autoscale(
            decision.direction, decision.current, decision.target, decision.reason, decision.needed,
            inputs, groups, error,
        )  # fmt: skip

    def sample(self) -> EngineGroupsSample:
        """The metrics' numbers: the groups now, the target (ahead of them while a change is
        under way), and the decisions so far by direction."""
        current = self.watch.config.engine.data_parallel
        return EngineGroupsSample(current, self.target, self.decisions["up"], self.decisions["down"])
