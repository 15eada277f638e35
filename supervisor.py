"""Brigade supervisor: config -> shared memory and processes -> watch, restart -> clean shutdown.

    python supervisor.py --config configs/default.yaml [--set key.path=value ...] [--run-dir DIR]
    python supervisor.py status --run DIR [--json] [--watch | --once]

The supervisor owns the run: the run directory, every shared-memory object (named after the run
id), and every stage process. It restarts a stage that exits or hangs, and triggers the recovery
that keeps every request (docs/architecture.md invariant 4). Its parts: the run's topology and
the transition between two (ipc/topology.py, pure); in supervision/, the restart policy and the
hang rule (pure), the stage set (every process operation), the run's resources (run.py), the
status files (status.py), the table of live settings, the checks before start. This file is the
watch loop around them: start, watch, restart, reload and change the topology, drain, stop.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import msgspec
import zmq

from ipc import messages as m
from ipc.codec import CONTROL_DOWN, CONTROL_UP, MalformedMessage
from ipc.config import Config, ConfigError, load_config
from ipc.endpoints import (
    InsecureRunDir,
    default_run_dir,
    make_run_dir,
)
from ipc.sampling_defaults import describe_defaults
from ipc.shm import new_run_id, sweep_stale_runs
from ipc.sockets import RouterSocket, close_context
from ipc.topology import STOP_ORDER, Topology, diff
from services import metrics
from services.audit import AuditLog, audit_log_path
from services.mlflow_sink import MlflowSink
from services.stage import AuthFailures, setup_logging
from supervision.backends import make_stage_set
from supervision.live_settings import (
    LIVE_SETTINGS,
    apply_live,
    diff_fields,
    get_setting,
    reconfigure_message,
    with_setting,
)
from supervision.policy import RestartPolicy, is_fatal_start_failure
from supervision.preflight import Refused, check_layout, check_model
from supervision.run import Run, prepare_model
from supervision.stages import METRICS_DIR, StageProcess
from supervision.status import StatusWriter, status

STOP_GRACE_S = 5.0
RING_SLOTS = 2  # the scheduler keeps two steps in flight (services/scheduler/pipeline.py)
CURVE_DIR = "curve"  # the run's own key set, when network.keys_dir names none
RUN_DIR_LOCK = "supervisor.lock"  # flocked by the run dir's live supervisor (Supervisor.claim_run_dir)
# The stages that keep links to their peers (services/peers.py) and so take TopologyChanged.
PEER_KINDS = ("tokenizer", "detokenizer", "scheduler")
PREPARE_TIMEOUT_S = 3600.0  # converting a large GGUF takes minutes; a hung conversion must not hang the start

log = logging.getLogger("supervisor")


class GiveUp(Exception):
    """The run cannot go on (a stage failed too often, or cannot start at all); the run ends."""


def file_signature(path: str | None) -> tuple[int, int, int, int] | None:
    """What tells a changed config file: its inode as well as its mtime and size, because a
    Kubernetes ConfigMap update swaps a symlink over to a new file, whose mtime may equal the
    old one's; None while it cannot be read."""
    if not path:
        return None
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


SECRET_FIELD = re.compile(r"(^|_)(keys?|secret|password)$")


def flat_config(config: msgspec.Struct, prefix: str = "") -> dict[str, str]:
    """Every config field as `dotted.path: value` (the MLflow run's parameters); keys and
    secrets (`gateway.api_keys`, ...) only as redacted."""
    flat: dict[str, str] = {}
    for spec in msgspec.structs.fields(config):
        value = getattr(config, spec.name)
        if isinstance(value, msgspec.Struct):
            flat.update(flat_config(value, f"{prefix}{spec.name}."))
        else:
            flat[f"{prefix}{spec.name}"] = "<redacted>" if SECRET_FIELD.search(spec.name) else str(value)
    return flat


class Supervisor:
    """Owns one run: its directory, shared memory and control socket; drives the stage set."""

    def __init__(
        self, config: Config, config_path: str | None, overrides: list[str], run_dir: Path, log_format: str
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides
        self.config_signature = file_signature(config_path)
        self.is_reload_requested = False
        self.run_dir = run_dir
        self.run_id = new_run_id()
        self.run = Run(run_dir, self.run_id)
        self.ctx = zmq.Context()
        self.control: RouterSocket | None = None
        self.stages = make_stage_set(config, run_dir, log_format, self.run_id)
        self.topology = Topology.of(config)  # with the stages' hosts once placed (start)
        self.policy = RestartPolicy.from_config(config.supervisor)
        self.audit = AuditLog(audit_log_path(run_dir, config.observability.audit_log), "supervisor")
        self.auth_failures = AuthFailures(self.audit, log)
        self.mlflow: MlflowSink | None = None
        self.signals: list[int] = []
        self.loads_sent_at = 0.0
        self.status_states: list[tuple[str, int, str, int]] = []  # what status.json last said of each stage
        self.status = StatusWriter(run_dir)
        self.stages.on_group_moved = self.move_group

    # -- start ---------------------------------------------------------------------------------

    def move_group(self, group: int, address: str) -> None:
        """The cluster placed engine group `group` on a node at `address`, another than its links
        have (its node died, or a hot reload added it there): its links follow (Run.move_stages),
        and the running stages hear it (TopologyChanged) before the group starts there. Raises
        Refused when the links cannot follow."""
        names = [s.name for s in self.stages if s.group == group]
        hosts = self.run.move_stages(self.config, names, address)
        log.info("engine group %d moved to a node at %s: its links follow", group, address)
        self.broadcast_topology(msgspec.structs.replace(self.topology, hosts=hosts))

    def create_rings(self, model_dir: Path, groups: range) -> None:
        self.run.create_rings(self.config, model_dir, groups, self.stages.create_rings)

    def serve_metrics(self) -> None:
        """/metrics of the whole run (docs/metrics.md) on supervisor.metrics_port, at
        supervisor.metrics_host (by default the gateway's host: a loopback-only API exports no
        numbers to the network either)."""
        supervisor = self.config.supervisor
        if supervisor.metrics_port:
            metrics.serve(
                self.run_dir, supervisor.metrics_port, supervisor.metrics_host or self.config.gateway.host
            )

    def start_mlflow(self) -> None:
        config = self.config.observability.mlflow
        if not config.tracking_uri:
            return
        params = flat_config(self.config)
        params["model"] = self.run.info.model if self.run.info else ""
        self.mlflow = MlflowSink(config, self.run_dir, f"brigade-{self.run_id}", params)
        self.mlflow.start()

    def start(self) -> None:
        try:
            self.run.claim_run_dir()
            self.run.claim_gateway_port(self.config)
            self.run.claim_shared_memory()
            check_layout(self.config)
            swept = sweep_stale_runs()
            if swept:
                log.info("swept %d shared-memory objects of dead runs", len(swept))
            model_dir = prepare_model(self.config)
            sampling_defaults = check_model(self.config, model_dir)
            hosts = self.stages.place()
            self.run.plan_network(self.config, hosts)
            self.topology = Topology.of(self.config, hosts)
            log.info("a request that sets no sampling values takes %s", describe_defaults(sampling_defaults))
            self.create_rings(model_dir, range(self.config.engine.data_parallel))
            metrics_dir = self.run_dir / METRICS_DIR
            shutil.rmtree(metrics_dir, ignore_errors=True)
            metrics_dir.mkdir(mode=0o700)
            self.serve_metrics()
            self.control = RouterSocket(self.ctx, self.run.endpoints.supervisor(), CONTROL_UP, CONTROL_DOWN)
            self.auth_failures.watch(self.control)
            self.run.publish(self.config, model_dir)
        except Refused as exc:
            raise GiveUp(str(exc)) from None
        for spec in self.topology.stages():
            self.stages.spawn(self.stages.add(spec))
        self.wait_ready(list(self.stages))
        try:
            self.run.publish(self.config, is_ready=True)
        except Refused as exc:
            raise GiveUp(str(exc)) from None
        self.start_mlflow()
        client = f"python -m client --run {self.run_dir}"
        ready = f"Brigade ready: {len(self.stages)} stages, run {self.run_id} in {self.run_dir}"
        print(ready + http_line(self.config), flush=True)
        print(
            f"  try: {client} chat 'Hello!'    or    {client} generate 'Once upon a time' --json", flush=True
        )

    # -- watch ---------------------------------------------------------------------------------

    def watch(self) -> None:
        while not self.signals:
            self.tick()
            if self.is_reload_requested or self.config_file_changed():
                self.is_reload_requested = False
                self.reload()

    def tick(self) -> None:
        """One round of watching: control messages, exits, hangs, due restarts, status file."""
        self.read_control(0.1)
        self.auth_failures.poll()
        now = time.monotonic()
        for stage in self.stages:
            if stage.restart_at is not None and now >= stage.restart_at:
                self.stages.spawn(stage)
        for stage, code in self.stages.reap():
            if stage.restart_at is not None:
                continue  # it went down with a peer handled before it in this round
            if is_fatal_start_failure(stage.was_ever_ready, code):
                raise GiveUp(
                    f"{stage.name} failed to start (exit code {code}): {stage.last_words() or 'no message'}"
                )
            self.on_failure(stage, f"exited with code {code}")
        hang_timeout_s = self.config.supervisor.hang_timeout_s
        for stage in self.stages:
            reason = stage.health.hang_reason(now, hang_timeout_s) if stage.is_ready else None
            if reason is not None and stage.restart_at is None:
                self.stages.kill([stage])
                self.on_failure(stage, reason)
        # status.json is rewritten when a stage changed state, at once (the gateway's /health and
        # `status` read it), and with fresh loads once per heartbeat interval: a rewrite costs a
        # file write and a rename, too much for every tick.
        is_due = now - self.loads_sent_at >= self.config.supervisor.heartbeat_interval_s
        states = [(s.name, s.pid, s.state, s.num_restarts) for s in self.stages]
        if is_due or states != self.status_states:
            self.status.write_status(self.stages)
            self.status_states = states
        if is_due:
            self.send_group_loads()
            rings = [metrics.RingSample(r.name, r.num_in_use) for r in self.run.rings]
            model = self.run.info.model if self.run.info else ""
            self.status.write_samples(
                self.stages, rings, model, self.config.engine.device, self.auth_failures.count
            )
            self.stages.gather_metrics()
            self.loads_sent_at = now

    def on_failure(self, stage: StageProcess, reason: str) -> None:
        """`stage` exited or was killed: restart it, and the group stages that went with it."""
        log.warning("%s (pid %d) %s", stage.name, stage.pid, reason)
        self.schedule_restart(stage, reason)
        # Workers handshake with one scheduler, and tensor-parallel ranks wait on each other in
        # collectives: either loss takes the group's other workers down with it.
        is_group_loss = stage.kind == "scheduler" or (
            stage.kind == "gpu_worker" and self.config.engine.tensor_parallel > 1
        )
        if not is_group_loss:
            return
        peers = [
            s for s in self.stages.of_kind("gpu_worker") if s.group == stage.group and s.restart_at is None
        ]
        self.stages.kill(peers)
        for peer in peers:
            self.schedule_restart(peer, f"{stage.name} {reason}")

    def schedule_restart(self, stage: StageProcess, reason: str) -> None:
        delay = self.policy.on_failure(stage.failures)
        if delay is None:
            raise GiveUp(
                f"{stage.name} failed {len(stage.failures)} times within {self.policy.period_s:.0f}s "
                f"(last: {reason}); giving up"
            )
        stage.num_restarts += 1
        stage.restart_at = time.monotonic() + delay
        stage.is_ready = False
        stage.state = "restarting"
        log.info("restarting %s in %.1fs (restart %d)", stage.name, delay, stage.num_restarts)
        self.audit.stage_restart(stage.name, reason, stage.num_restarts, delay)

    def send_group_loads(self) -> None:
        loads = [0.0] * self.config.engine.data_parallel
        for stage in self.stages.of_kind("scheduler"):
            if stage.group < len(loads):
                loads[stage.group] = stage.load.num_running + stage.load.num_waiting + stage.load.kv_usage
        message = m.GroupLoads(loads)
        for stage in self.stages.of_kind("tokenizer"):
            if stage.is_ready:
                self.command(stage, message)

    def read_control(self, timeout: float) -> None:
        assert self.control is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                received = self.control.recv(max(0.0, deadline - time.monotonic()))
            except MalformedMessage:
                continue
            if received is None:
                return
            _, message = received
            stage = self.stages.get(message.name)
            if stage is None or not self.stages.is_current(stage, message.pid):
                continue  # a late message from a process we already replaced
            now = time.monotonic()
            if isinstance(message, m.Ready):
                stage.health.on_beat(now)
                self.on_ready(stage)
                continue
            stage.health.on_beat(now, message.progress, message.has_work)
            new_tokens = message.load.tokens_total - stage.load.tokens_total
            if stage.rate_at and new_tokens >= 0:
                instant = new_tokens / max(now - stage.rate_at, 1e-3)
                stage.tokens_rate = 0.7 * stage.tokens_rate + 0.3 * instant
            stage.rate_at = now
            stage.load = message.load

    def on_ready(self, stage: StageProcess) -> None:
        was_restart = stage.num_restarts > 0
        stage.is_ready = stage.was_ever_ready = True
        stage.state = "running"
        log.info("%s up (pid %d)%s", stage.name, stage.pid, " after restart" if was_restart else "")
        if stage.kind in PEER_KINDS:
            # It sized its links from run.json's config, which does not show engine groups
            # still retiring, nor a group that moved after it read run.json (move_group).
            self.command(stage, m.TopologyChanged(self.topology))
        if not was_restart:
            return
        if stage.kind == "detokenizer":
            # The tokenizers re-drive the shard: only their journals still know the requests the
            # scheduler finished whose last text died with the detokenizer.
            shard = m.ResubmitShard(int(stage.name.rsplit("-", 1)[1]), self.config.detokenizer.replicas)
            for other in self.stages.of_kind("tokenizer"):
                self.command(other, shard)
        elif stage.kind == "scheduler":
            for other in self.stages.of_kind("tokenizer"):
                self.command(other, m.ResubmitAll(stage.group))

    def command(self, stage: StageProcess, message: m.ControlDown) -> None:
        assert self.control is not None
        self.control.send(stage.name.encode(), message)

    def config_file_changed(self) -> bool:
        signature = file_signature(self.config_path)
        changed, self.config_signature = signature != self.config_signature, signature
        return changed and signature is not None

    # -- hot reload ----------------------------------------------------------------------------

    def reload(self) -> None:
        """Apply the live settings (supervision/live_settings.py); log the changes that need a
        restart. A config that does not load is refused and the run goes on unchanged."""
        try:
            # Only a regular file, read without blocking: a FIFO put in its place must not stop
            # the watch loop (no restarts, no signals) until someone writes to it.
            new = load_config(self.config_path, self.overrides, regular_file_only=True)
        except ConfigError as exc:
            log.error("reload refused, config unchanged: %s", exc)
            self.audit.reload({}, error=str(exc))
            return
        except Exception:  # whatever a config file does, it must not end a live run
            log.exception("reload refused, config unchanged: the config could not be read")
            self.audit.reload({}, error="the config could not be read")
            return
        changed = diff_fields(self.config, new)
        diff = {path: [get_setting(self.config, path), get_setting(new, path)] for path in changed}
        if diff:
            self.audit.reload(
                applied={p: v for p, v in diff.items() if p in LIVE_SETTINGS},
                refused={p: v for p, v in diff.items() if p not in LIVE_SETTINGS},
            )
        for path in sorted(set(changed) - set(LIVE_SETTINGS)):
            log.warning("reload: %s changed but needs a restart to take effect; keeping the old value", path)
        live = sorted(set(changed) & set(LIVE_SETTINGS))
        if not live:
            log.info("reload: nothing to apply live")
            return
        applied = apply_live(self.config, new)
        logging.getLogger().setLevel(applied.supervisor.log_level)
        try:
            self.change_topology(applied)
        except Refused as exc:
            log.error("reload: replica and engine group counts stay as they were: %s", exc)
            self.audit.reload({}, error=str(exc))
            return
        log.info("reload applied: %s", ", ".join(live))

    def wait_ready(self, stages: list[StageProcess]) -> None:
        """Watch until `stages` are up (at start, and new stages of a topology change)."""
        timeout_s = self.config.supervisor.start_timeout_s
        deadline = last_note = time.monotonic()
        deadline += timeout_s
        while not all(s.is_ready for s in stages):
            if self.signals:
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                waiting = [s.name for s in stages if not s.is_ready]
                raise GiveUp(f"stages did not come up within {timeout_s:.0f}s: {waiting}")
            self.tick()
            if time.monotonic() - last_note > 5:
                waiting = [s.name for s in stages if not s.is_ready]
                log.info("waiting for %d stage(s) to come up: %s", len(waiting), ", ".join(waiting))
                last_note = time.monotonic()

    def place_groups(self, config: Config) -> Config:
        """Room for the engine groups that `config` adds: `config`, or, when the cluster has no
        room for them within cluster.placement_timeout_s (or this host lacks their devices),
        `config` with the old engine.data_parallel (the reload keeps it, and says why)."""
        old_groups = self.config.engine.data_parallel
        try:
            check_layout(config)
            self.stages.place_groups(config.engine)
            deadline = time.monotonic() + config.cluster.placement_timeout_s
            while self.stages.unplaced():
                if time.monotonic() > deadline:
                    raise Refused(
                        f"engine groups {self.stages.unplaced()} found no room within "
                        f"cluster.placement_timeout_s={config.cluster.placement_timeout_s:g}s"
                    )
                self.tick()
        except Refused as exc:
            log.error("reload: engine.data_parallel stays %d: %s", old_groups, exc)
            self.stages.release_groups(self.config.engine)
            return with_setting(config, "engine.data_parallel", old_groups)
        return config

    def change_topology(self, config: Config) -> None:
        """Apply `config`'s replica and engine group counts without dropping a request
        (ipc/topology.py's Transition): new stages start before anyone routes to them; removed
        ones stop only after everyone routes around them, and a removed engine group after it has
        drained. The live settings reach every stage as Reconfigure once the new ones are up."""
        old_counts = self.replica_counts(self.config)
        if config.engine.data_parallel > self.topology.num_groups:
            config = self.place_groups(config)
        try:
            self.run.claim_gateway_port(config)  # gateway replicas from none; port and host are not live
            self.run.publish(config)
        except Refused:
            self.stages.release_groups(self.config.engine)  # what place_groups reserved
            raise
        self.config = config
        new_counts = self.replica_counts(config)
        changes = {path: [old_counts[path], n] for path, n in new_counts.items() if n != old_counts[path]}
        if changes:
            self.audit.rescale(changes)
        step = diff(self.topology, Topology.of(config, self.topology.hosts))
        assert self.run.info is not None  # published at start
        self.create_rings(
            Path(self.run.info.model_dir), range(self.topology.num_groups, config.engine.data_parallel)
        )
        added = [self.stages.add(spec) for spec in step.added]
        for stage in added:
            self.stages.spawn(stage)
        self.wait_ready(added)
        # Schedulers move every live request to its new detokenizer shard (full history, so the
        # new shard rebuilds its text; receivers drop what they already have by position).
        # Tokenizers route new requests to the groups that still take them.
        self.broadcast_topology(step.during)
        for stage in self.stages:
            self.command(stage, reconfigure_message(self.config))
        if step.draining:
            self.retire_groups(step.draining)
            self.broadcast_topology(step.after)  # the tokenizers move what was left on them
        # The retired groups' stages are gone already; the removed replicas go now.
        removed = [stage for spec in step.removed if (stage := self.stages.get(spec.name))]
        removed_tokenizers = [s for s in removed if s.kind == "tokenizer"]
        for stage in removed_tokenizers:
            self.command(stage, m.Shutdown(self.config.supervisor.drain_timeout_s))
        deadline = time.monotonic() + self.config.supervisor.drain_timeout_s
        while any(s.load.num_in_flight for s in removed_tokenizers) and time.monotonic() < deadline:
            self.read_control(0.2)
        # A gateway stops accepting at SIGTERM and finishes its open requests (uvicorn's graceful
        # shutdown); the other replicas keep the port.
        self.read_control(1.0)  # let in-flight batches to the old shards land first
        self.stages.remove(removed)
        self.stages.stop(removed, STOP_GRACE_S)
        for stage in removed:
            log.info("retired %s", stage.name)

    @staticmethod
    def replica_counts(config: Config) -> dict[str, int]:
        """The counts a reload may change, by config path (for the audit log)."""
        return {
            "tokenizer.replicas": config.tokenizer.replicas,
            "detokenizer.replicas": config.detokenizer.replicas,
            "gateway.replicas": config.gateway.replicas,
            "engine.data_parallel": config.engine.data_parallel,
        }

    def retire_groups(self, groups: range) -> None:
        """Stop engine groups `groups`, which the tokenizers no longer send new requests to: they
        finish what they run, up to supervisor.drain_timeout_s, then stop, and their rings go."""
        retiring = [s for s in self.stages if s.group in groups]
        schedulers = [s for s in retiring if s.kind == "scheduler"]
        # Loads from after the TopologyChanged: a request sent just before it is counted too.
        self.read_control(2 * self.config.supervisor.heartbeat_interval_s)
        deadline = time.monotonic() + self.config.supervisor.drain_timeout_s

        def is_busy() -> bool:
            return any(s.load.num_running or s.load.num_waiting for s in schedulers)

        while is_busy() and time.monotonic() < deadline:
            self.read_control(0.2)
        self.stages.remove(retiring)
        self.stages.stop(retiring, STOP_GRACE_S)
        self.stages.release_groups(self.config.engine)
        self.run.remove_rings(groups)
        log.info("retired engine groups %d-%d", groups.start, groups.stop - 1)

    def broadcast_topology(self, topology: Topology) -> None:
        self.topology = topology
        for stage in self.stages:
            if stage.kind in PEER_KINDS:
                self.command(stage, m.TopologyChanged(topology))

    # -- stop ----------------------------------------------------------------------------------

    def drain(self) -> None:
        """Let in-flight requests finish, up to the grace period; a second signal cuts it short."""
        tokenizers = self.stages.of_kind("tokenizer")
        for stage in tokenizers:
            self.command(stage, m.Shutdown(self.config.supervisor.drain_timeout_s))
        deadline = time.monotonic() + self.config.supervisor.drain_timeout_s
        num_signals = len(self.signals)
        while time.monotonic() < deadline and len(self.signals) == num_signals:
            self.read_control(0.2)
            in_flight = sum(s.load.num_in_flight for s in tokenizers)
            if in_flight == 0:
                return
        log.info("drain ended with requests still in flight")

    def stop(self) -> None:
        """Stop the stages in order and remove what this supervisor created (supervision/run.py):
        a supervisor refused at start leaves the live run there untouched (invariant 9)."""
        if self.mlflow is not None:
            self.mlflow.stop()
        for kind in STOP_ORDER:
            self.stages.stop(self.stages.of_kind(kind), STOP_GRACE_S)
        self.run.remove_rings()
        self.stages.close()
        close_context(self.ctx, 0)
        self.run.release(keep_keys=bool(self.config.network.keys_dir))
        log.info("stopped; shared memory and sockets removed")


def http_line(config: Config) -> str:
    """Where the OpenAI-compatible API listens, for the ready line ("" when it is off)."""
    gateway = config.gateway
    if not gateway.replicas:
        return ""
    host = f"[{gateway.host}]" if ":" in gateway.host else gateway.host
    return f"; OpenAI API at http://{host}:{gateway.port}/v1"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":
        parser = argparse.ArgumentParser(prog="supervisor.py status")
        parser.add_argument("--run", type=Path, default=default_run_dir())
        parser.add_argument("--json", action="store_true", help="print one JSON list and exit")
        refresh = parser.add_mutually_exclusive_group()
        refresh.add_argument(
            "--watch", action="store_true", help="refresh every second even when not a terminal"
        )
        refresh.add_argument("--once", action="store_true", help="print the table once, even on a terminal")
        args = parser.parse_args(argv[1:])
        return status(args.run, args.json, watch=True if args.watch else False if args.once else None)
    parser = argparse.ArgumentParser(prog="supervisor.py", description="Run a Brigade serving pipeline.")
    parser.add_argument("--config", help="YAML config file (see docs/config.md)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config field"
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="run directory (default: per-user)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    setup_logging("supervisor", config.supervisor.log_level, args.log_format)
    try:
        run_dir = make_run_dir(args.run_dir or default_run_dir())
    except InsecureRunDir as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    supervisor = Supervisor(config, args.config, args.set, run_dir, args.log_format)

    def on_signal(signum: int, frame: object) -> None:
        supervisor.signals.append(signum)
        if len(supervisor.signals) > 1:
            log.warning("second signal: stopping now")

    def on_hangup(signum: int, frame: object) -> None:
        supervisor.is_reload_requested = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    code = 0
    try:
        supervisor.start()
        supervisor.watch()
        log.info("signal received: draining")
        supervisor.drain()
    except GiveUp as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        log.info("interrupted before the stages were up")
    finally:
        supervisor.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
