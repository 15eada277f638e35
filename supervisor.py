"""Brigade supervisor: config -> shared memory and processes -> watch, restart -> clean shutdown.

    python supervisor.py --config configs/default.yaml [--set key.path=value ...] [--run-dir DIR]
    python supervisor.py status --run DIR [--json] [--watch | --once]

The supervisor owns the run: the run directory, every shared-memory object (named after the run
id), and every stage process. It restarts a stage that exits or hangs, and triggers the recovery
that keeps every request (docs/architecture.md invariant 4). Its parts: the run's topology and
the transition between two (ipc/topology.py, pure); in supervision/, the restart policy and the
hang rule (pure), the stage set (every process operation), the run's resources (run.py), the
status files (status.py), the config file and its live settings (reload.py, live_settings.py),
carrying out a topology change (transition.py), autoscaling the engine groups (autoscale.py,
group_scaler.py), the checks before start. This file is the watch loop around them: start,
watch, restart, reload, drain, stop.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
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
from ipc.sampling_defaults import check_generation_overrides, describe_defaults
from ipc.shm import new_run_id
from ipc.sockets import RouterSocket, close_context
from ipc.topology import STOP_ORDER, Topology
from services import metrics
from services.audit import AuditLog, audit_log_path
from services.mlflow_sink import MlflowSink
from services.stage import AuthFailures, setup_logging
from supervision.backends import make_stage_set
from supervision.group_scaler import GroupScaler
from supervision.live_settings import get_setting
from supervision.policy import GiveUp, RestartPolicy, StartFailed, is_fatal_start_failure
from supervision.preflight import Refused, check_layout, check_model, check_tls_files, served_max_model_len
from supervision.reload import ConfigFile
from supervision.run import Run, prepare_model
from supervision.stages import METRICS_DIR, StageHandle
from supervision.status import StatusWriter, status
from supervision.transition import PEER_KINDS, STOP_GRACE_S, Transitions

log = logging.getLogger("supervisor")


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


def start_metrics(config: Config, run_dir: Path) -> None:
    """An empty metrics dir for the stages' Prometheus files, and /metrics of the whole run
    (docs/metrics.md) on supervisor.metrics_port, at supervisor.metrics_host (by default the
    gateway's host: a loopback-only API exports no numbers to the network either)."""
    metrics_dir = run_dir / METRICS_DIR
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(mode=0o700)
    supervisor = config.supervisor
    if supervisor.metrics_port:
        metrics.serve(run_dir, supervisor.metrics_port, supervisor.metrics_host or config.gateway.host)


def start_mlflow(config: Config, run: Run) -> MlflowSink | None:
    """The MLflow run of observability.mlflow, started; None when no tracking URI is set."""
    if not config.observability.mlflow.tracking_uri:
        return None
    params = flat_config(config)
    params["model"] = run.info.model if run.info else ""
    sink = MlflowSink(config.observability.mlflow, run.run_dir, f"brigade-{run.run_id}", params)
    sink.start()
    return sink


class Supervisor:
    """Owns one run: its directory, shared memory and control socket; drives the stage set."""

    def __init__(
        self, config: Config, config_path: str | None, overrides: list[str], run_dir: Path, log_format: str
    ) -> None:
        self.config = config
        self.config_file = ConfigFile(config_path, overrides)
        self.is_reload_requested = False
        self.run_dir = run_dir
        self.run_id = new_run_id()
        self.run = Run(run_dir, self.run_id)
        self.ctx = zmq.Context()
        self.control: RouterSocket | None = None
        self.stages = make_stage_set(config, run_dir, log_format, self.run_id)
        self.policy = RestartPolicy.from_config(config.supervisor)
        self.audit = AuditLog(audit_log_path(run_dir, config.observability.audit_log), "supervisor")
        self.auth_failures = AuthFailures(self.audit, log)
        self.transitions = Transitions(self, self.stages, self.run, self.audit)
        self.scaler = GroupScaler(self, self.stages, self.transitions, self.audit)
        self.mlflow: MlflowSink | None = None
        self.signals: list[int] = []
        self.loads_sent_at = 0.0
        self.status = StatusWriter(run_dir)
        self.is_serving = False  # every stage came up once: a stop from now on drains first
        self.is_stopping = False  # draining: a gateway or tokenizer that comes up now stops too

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        try:
            # The config's own faults first: they must be reported whatever holds the port.
            check_layout(self.config)
            check_tls_files(self.config)
            self.run.claim_run_dir()
            self.run.claim_gateway_port(self.config)
            self.run.claim_shared_memory()
            model_dir = prepare_model(self.config)
            sampling_defaults = check_model(self.config, model_dir)
            hosts = self.stages.place()
            self.run.plan_network(self.config, hosts)
            self.transitions.current = Topology.of(self.config, hosts)
            log.info("a request that sets no sampling values takes %s", describe_defaults(sampling_defaults))
            groups = range(self.config.engine.data_parallel)
            self.run.create_rings(self.config, model_dir, groups, self.stages.create_rings)
            start_metrics(self.config, self.run_dir)
            self.control = RouterSocket(self.ctx, self.run.endpoints.supervisor(), CONTROL_UP, CONTROL_DOWN)
            self.auth_failures.watch(self.control)
            self.run.publish(
                self.config,
                model_dir,
                max_model_len=served_max_model_len(self.config, model_dir),
                topology=self.transitions.current,
            )
            self.run.hand_over(self.config)
        except Refused as exc:
            raise GiveUp(str(exc)) from None
        for spec in self.transitions.current.stages():
            self.stages.spawn(self.stages.add(spec))
        self.wait_ready(list(self.stages))
        try:
            self.run.publish(self.config, is_ready=True)
        except Refused as exc:
            raise GiveUp(str(exc)) from None
        self.mlflow = start_mlflow(self.config, self.run)
        self.is_serving = True
        print(ready_lines(self.config, len(self.stages), self.run), flush=True)

    def wait_ready(self, stages: list[StageHandle], since: float | None = None) -> None:
        """Watch until `stages` are up (at start, and new stages of a topology change). A signal
        stops the run: at start at once, during a topology change (a hot reload, the autoscaler)
        once it has drained what is in flight, within supervisor.drain_timeout_s as at any other
        stop (the stages not up yet are not waited for). Raises StartFailed for a stage that fails
        its first start or is not up within supervisor.start_timeout_s of `since` (now)."""
        timeout_s = self.config.supervisor.start_timeout_s
        last_note = time.monotonic()
        deadline = (last_note if since is None else since) + timeout_s
        while not all(s.is_ready for s in stages):
            if self.signals:
                if self.is_serving and len(self.signals) == 1:
                    log.info("signal received during a topology change: draining")
                    self.drain()
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                waiting = [s.name for s in stages if not s.is_ready]
                raise StartFailed(f"stages did not come up within {timeout_s:.0f}s: {waiting}", waiting)
            self.tick()
            waiting = [s.name for s in stages if not s.is_ready]
            if waiting and time.monotonic() - last_note > 5:
                log.info("waiting for %d stage(s) to come up: %s", len(waiting), ", ".join(waiting))
                last_note = time.monotonic()

    # -- watch ---------------------------------------------------------------------------------

    def watch(self) -> None:
        while not self.signals:
            self.tick()
            self.scaler.step()
            if self.is_reload_requested or self.config_file.has_changed():
                self.is_reload_requested = False
                self.reload()

    def tick(self) -> None:
        """One round of watching: control messages, exits, hangs, due restarts, status files."""
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
                raise StartFailed(
                    f"{stage.name} failed to start (exit code {code}): {stage.last_words() or 'no message'}",
                    [stage.name],
                )
            self.on_failure(stage, f"exited with code {code}")
        hang_timeout_s = self.config.supervisor.hang_timeout_s
        for stage in self.stages:
            reason = stage.health.hang_reason(now, hang_timeout_s) if stage.is_ready else None
            if reason is not None and stage.restart_at is None:
                self.stages.kill([stage])
                self.on_failure(stage, reason)
        is_due = now - self.loads_sent_at >= self.config.supervisor.heartbeat_interval_s
        self.status.write_status(self.stages, is_due)
        if is_due:
            self.send_group_loads()
            rings = [metrics.RingSample(r.name, r.num_in_use) for r in self.run.rings]
            model = self.run.info.model if self.run.info else ""
            device, groups = self.config.engine.device, self.scaler.sample()
            self.status.write_samples(self.stages, rings, model, device, self.auth_failures.count, groups)
            self.stages.gather_metrics()
            self.loads_sent_at = now

    def on_failure(self, stage: StageHandle, reason: str) -> None:
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

    def schedule_restart(self, stage: StageHandle, reason: str) -> None:
        delay = self.policy.on_failure(stage.failures)
        if delay is None and not stage.was_ever_ready:  # killed by a signal each time it started
            raise StartFailed(
                f"{stage.name} failed to start {len(stage.failures)} times (last: {reason})", [stage.name]
            )
        if delay is None:
            raise GiveUp(
                f"{stage.name} failed {len(stage.failures)} times within {self.policy.period_s:.0f}s "
                f"(last: {reason}); giving up"
            )
        stage.restart_after(delay)
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
            if isinstance(message, m.Ready):
                self.on_ready(stage, message.info.get("protections", ""))
            else:
                stage.on_heartbeat(message, time.monotonic())

    def on_ready(self, stage: StageHandle, protections: str) -> None:
        was_restart = stage.num_restarts > 0
        stage.on_ready(time.monotonic(), protections)
        log.info("%s up (pid %d)%s", stage.name, stage.pid, " after restart" if was_restart else "")
        is_draining = self.is_stopping or stage.name in self.transitions.draining
        if is_draining and stage.kind in ("gateway", "tokenizer"):
            # Up in the middle of the run's drain or of its removal by a topology change (started
            # then, or restarted): it takes no new calls either, and the drain waits for what it
            # says it holds, not for its deadline.
            self.command(stage, m.Shutdown())
        if stage.kind in PEER_KINDS:
            # It sized its links from run.json's config, which does not show engine groups
            # still retiring, nor a group that moved after it read run.json (Transitions.move_group).
            self.command(stage, m.TopologyChanged(self.transitions.current))
        if not was_restart:
            return
        if stage.kind == "detokenizer":
            # The tokenizers re-drive the shard: only their journals still know the requests the
            # scheduler finished whose last text died with the detokenizer. By the shard count the
            # schedulers send by now: in the middle of a reload the config's may not be it yet.
            num_shards = self.transitions.current.num_detokenizers
            shard = m.ResubmitShard(int(stage.name.rsplit("-", 1)[1]), num_shards)
            for other in self.stages.of_kind("tokenizer"):
                self.command(other, shard)
        elif stage.kind == "scheduler":
            for other in self.stages.of_kind("tokenizer"):
                self.command(other, m.ResubmitAll(stage.group))

    def command(self, stage: StageHandle, message: m.ControlDown) -> None:
        assert self.control is not None
        self.control.send(stage.name.encode(), message)

    # -- hot reload ----------------------------------------------------------------------------

    def reload(self) -> None:
        """Apply the config file's live settings (supervision/reload.py): the replica and engine
        group counts through a topology change (supervision/transition.py). A config that does
        not load, or a topology that cannot be reached, is refused and the run goes on unchanged."""
        reloaded = self.config_file.live_settings(self.config, self.audit)
        if reloaded is None:
            return
        config, live = reloaded
        logging.getLogger().setLevel(config.supervisor.log_level)
        try:
            self.transitions.change(config)
        except Refused as exc:
            log.error("reload: replica and engine group counts stay as they were: %s", exc)
            self.audit.reload({}, error=str(exc))
            return
        # A count whose added stages did not start stayed as it was (logged by the change).
        applied = [path for path in live if get_setting(self.config, path) == get_setting(config, path)]
        log.info("reload applied: %s", ", ".join(applied) or "nothing")

    # -- stop ----------------------------------------------------------------------------------

    def drain(self) -> None:
        """Let what is in flight finish, up to the grace period; a second signal cuts it short.

        The gateways refuse new calls first (Shutdown); once each says so, the tokenizers refuse
        new requests, but take those that continue a call admitted before (m.Generate.continues:
        a beam search's next step, an embedding call's next window, and whatever a draining
        gateway sends). Between two requests of such a call no tokenizer holds any of it, so the
        drain waits for the gateways' calls as well. Each stage reports its load as it takes
        the Shutdown and whenever that changes after."""
        if len(self.signals) > 1:  # came in the middle of a topology change
            log.info("second signal: stopping without a drain")
            return
        gateways, tokenizers = self.stages.of_kind("gateway"), self.stages.of_kind("tokenizer")
        deadline = time.monotonic() + self.config.supervisor.drain_timeout_s
        self.is_stopping = True
        num_signals = len(self.signals)

        def wait_until(done: Callable[[], bool]) -> bool:
            while time.monotonic() < deadline and len(self.signals) == num_signals:
                if done():
                    return True
                self.read_control(0.2)
            return False

        for stage in gateways:
            self.command(stage, m.Shutdown())
        wait_until(lambda: all(stage.is_draining for stage in gateways))
        for stage in tokenizers:
            self.command(stage, m.Shutdown())
        if wait_until(lambda: all(stage.has_drained for stage in [*gateways, *tokenizers])):
            log.info("drained: nothing in flight")
        else:
            log.info("drain ended with requests still in flight")

    def stop(self) -> None:
        """Stop the stages in order and remove what this supervisor created (supervision/run.py):
        a supervisor refused at start leaves the live run there untouched (invariant 9)."""
        if self.mlflow is not None:
            self.mlflow.stop()
        for kind in STOP_ORDER:
            self.stages.stop(self.stages.of_kind(kind), STOP_GRACE_S)
        self.run.remove_rings()
        # Every replica's cache the run ever had (retired ones' too), or the in-worker encoder's.
        self.run.remove_embedding_caches(
            max(self.transitions.most_encoders, self.config.encoder.num_encoders)
        )
        left = self.stages.close()
        close_context(self.ctx, 0)
        claimed = self.run.run_dir_lock is not None  # a refused start removes nothing of the live run
        self.run.release(keep_keys=bool(self.config.network.keys_dir))
        if not claimed:
            log.info("stopped")
        elif left:
            log.warning(
                "stopped; the run dir's sockets and files removed, but the cleanup did not finish on: %s; "
                "the run's shared memory there (and off this host the run dir's files) may be left, "
                "this host's is swept at the next start",
                "; ".join(left),
            )
        else:
            log.info("stopped; shared memory and sockets removed")


def ready_lines(config: Config, num_stages: int, run: Run) -> str:
    """What the supervisor prints once the run is up: where it is, where the OpenAI-compatible
    API listens (when a gateway runs), and how to try it."""
    ready = f"Brigade ready: {num_stages} stages, run {run.run_id} in {run.run_dir}"
    gateway = config.gateway
    if gateway.replicas:
        host = f"[{gateway.host}]" if ":" in gateway.host else gateway.host
        scheme = "https" if gateway.tls.certfile else "http"
        ready += f"; OpenAI API at {scheme}://{host}:{gateway.port}/v1"
        if gateway.tls.client_ca:
            ready += " (client certificates required)"
    client = f"python -m client --run {run.run_dir}"
    return f"{ready}\n  try: {client} chat 'Hello!'    or    {client} generate 'Once upon a time' --json"


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
        check_generation_overrides(config)
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
        if supervisor.is_serving:
            log.info("stopping in the middle of a topology change")
        else:
            log.info("interrupted before the stages were up")
    finally:
        supervisor.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
