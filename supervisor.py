"""Brigade supervisor: config -> shared memory and processes -> watch, restart -> clean shutdown.

    python supervisor.py --config configs/default.yaml [--set key.path=value ...] [--run-dir DIR]
    python supervisor.py status --run DIR [--json] [--watch | --once]

The supervisor owns the run: the run directory, every shared-memory object (named after the run
id), and every stage process. It restarts a stage that exits or hangs, and triggers the recovery
that keeps every request (docs/architecture.md invariant 4). Its parts are in supervision/: the
restart policy and the hang rule (pure), the stage set (every process operation), the table of
live settings, the checks before start; this file is the watch loop around them.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
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
    Endpoints,
    InsecureRunDir,
    NetworkPlan,
    default_run_dir,
    free_port_base,
    make_run_dir,
)
from ipc.keys import SECRET_SUFFIX, BadKeyFile, create_key_files, load_run_keys
from ipc.ports import PORT_SPAN
from ipc.sampling_defaults import describe_defaults
from ipc.shm import RunLock, ShmRing, new_run_id, sweep_stale_runs
from ipc.sockets import RouterSocket, close_context
from ipc.step_plan import STEP_PLAN, STEP_RESULT, plan_limits, result_limits
from ipc.topology import STOP_ORDER, Topology, diff
from services import metrics
from services.audit import AuditLog, audit_log_path
from services.mlflow_sink import MlflowSink
from services.stage import RUN_FILE, AuthFailures, RunInfo, setup_logging, write_run_info
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
from supervision.preflight import Refused, check_hosts, check_layout, check_model
from supervision.stages import METRICS_DIR, REPO_ROOT, RingSpec, StageProcess
from supervision.status import STATUS_FILE, status

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


def step_slot_bytes(config: Config, vocab_size: int) -> int:
    """Bytes of one step-plan slot at the configured maxima (ipc/step_plan.py declares the arrays),
    for a model of `vocab_size` (every row constrained: a full grammar bitmask)."""
    engine = config.engine
    max_model_len = config.model.max_model_len
    limits = plan_limits(
        engine.max_num_seqs, engine.max_num_batched_tokens, max_model_len, engine.block_size, vocab_size
    )
    return STEP_PLAN.slot_bytes(limits)


def result_slot_bytes(config: Config) -> int:
    return STEP_RESULT.slot_bytes(
        result_limits(config.engine.max_num_seqs, config.engine.max_num_batched_tokens)
    )


def gateway_port_lock(port: int) -> socket.socket:
    """A lock on `port` among Brigade runs: an abstract Unix socket named after it, which only one
    process of a network namespace (the scope of TCP ports) can bind, and which the kernel frees
    when its holder dies. Raises OSError (EADDRINUSE) while another run holds it."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(f"\0brigade-gateway-port-{port}")
    except OSError:
        lock.close()
        raise
    return lock


def probe_port(host: str, port: int) -> None:
    """Raises OSError when any socket listens on (host, port): one of another run's gateways, or
    another server. Bound without SO_REUSEPORT, which the gateway replicas set to share the port,
    so that their port-sharing group admits nobody else's."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR: a closed connection of an earlier run, in TIME_WAIT, is no owner.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


class RunDirWrites:
    """The files the watch loop rewrites in the run dir (status.json, metrics/stages.json): a full
    disk must not end the run. A failed write is logged once, when that file's writes start
    failing, and once when they work again; meanwhile the file keeps its last content, and each
    later update tries again."""

    def __init__(self) -> None:
        self.failing: set[str] = set()

    def attempt(self, what: str, write: Callable[[], None]) -> None:
        try:
            write()
        except OSError as exc:
            if what not in self.failing:
                log.error(
                    "could not write %s (%s); serving on, and retrying with each update", what, exc.strerror
                )
                self.failing.add(what)
            return
        if what in self.failing:
            self.failing.discard(what)
            log.info("%s written again", what)


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
        self.endpoints = Endpoints(run_dir, self.run_id)  # ipc:// until plan_network
        self.ctx = zmq.Context()
        self.control: RouterSocket | None = None
        self.rings: list[ShmRing] = []
        self.stages = make_stage_set(config, run_dir, log_format, self.run_id)
        self.topology = Topology.of(config)  # with the stages' hosts once placed (start)
        self.policy = RestartPolicy.from_config(config.supervisor)
        self.audit = AuditLog(audit_log_path(run_dir, config.observability.audit_log), "supervisor")
        self.auth_failures = AuthFailures(self.audit, log)
        self.mlflow: MlflowSink | None = None
        self.signals: list[int] = []
        self.loads_sent_at = 0.0
        self.status_states: list[tuple[str, int, str, int]] = []  # what status.json last said of each stage
        self.info: RunInfo | None = None  # run.json, once the model is prepared
        self.network_plan = NetworkPlan()
        self.client_keys_file = ""
        self.stages.on_group_moved = self.move_group
        # What this supervisor holds, and so may remove at stop (docs/architecture.md invariant 9).
        self.run_dir_lock: int | None = None  # claim_run_dir; the run dir's files are ours
        self.run_lock: RunLock | None = None  # the run's shared memory is alive (ipc/shm.py)
        self.gateway_port: socket.socket | None = None  # claim_gateway_port
        self.writes = RunDirWrites()

    # -- start ---------------------------------------------------------------------------------

    def claim_run_dir(self) -> None:
        """Take the run dir for this run: an flock on its lock file, held until the supervisor
        exits (the kernel drops it even on SIGKILL), tells a live run, in whatever PID namespace,
        from a dead one's leftovers, from the first moment (run.json comes only after the model
        is prepared). Raises GiveUp, having touched nothing, while another supervisor holds it."""
        fd = os.open(self.run_dir / RUN_DIR_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise GiveUp(
                f"a Brigade run is already live in {self.run_dir} (supervisor pid {holder}); "
                "stop it first or pass --run-dir"
            ) from None
        self.run_dir_lock = fd
        try:  # the holder's pid, for the refusal above: nice to have, on a full disk too
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        for stale in [self.run_dir / RUN_FILE, *self.run_dir.glob("*.sock")]:
            stale.unlink(missing_ok=True)  # a dead run's leftovers

    def claim_gateway_port(self) -> None:
        """Hold gateway.port for this run's gateway replicas (they share it through SO_REUSEPORT,
        which would as well let another run's replicas in, and the kernel split the connections
        between the runs): refused when another Brigade run holds it or anything listens on it.
        On a Ray cluster the gateways may run on another host than this one: not checked there."""
        gateway = self.config.gateway
        if self.config.cluster.backend != "local":
            return
        try:
            lock = gateway_port_lock(gateway.port)
        except OSError:
            raise GiveUp(
                f"gateway.port {gateway.port} is already served by another Brigade run on this host; "
                "set gateway.port to another port (or stop that run)"
            ) from None
        try:
            probe_port(gateway.host, gateway.port)
        except OSError as exc:
            lock.close()
            raise GiveUp(
                f"gateway.port {gateway.port} on {gateway.host} is in use ({exc.strerror}); "
                "set gateway.port to a free port"
            ) from None
        self.gateway_port = lock

    def prepare_model(self) -> Path:
        """Convert the model once (cached) in a child, so the supervisor never imports torch."""
        model = self.config.model
        what = model.path or "(embedded SmolLM2-135M-Instruct)"
        log.info("preparing model %s", what)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "services.gpu_worker.prepare", model.path, model.cache_dir, model.revision],
                capture_output=True, text=True, cwd=REPO_ROOT, check=False,
                timeout=PREPARE_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise GiveUp(
                f"could not prepare model {what}: no result within {PREPARE_TIMEOUT_S:.0f}s"
            ) from None
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            sys.stderr.write(done.stderr)
            raise GiveUp(
                f"could not prepare model {what}: {lines[-1] if lines else f'exit {done.returncode}'}"
            )
        return Path(done.stdout.strip().splitlines()[-1])

    def plan_network(self, hosts: dict[str, str] | None = None) -> None:
        """Ports and CURVE keys of the run's tcp:// links: the configured port base or a free one,
        and the keys of `network.keys_dir` or a fresh set in the run dir. `hosts` places stages
        on other hosts (stage name -> address; the rest run on `network.host`): their links go
        over tcp:// whatever `network.transport` says. None of this for a one-host ipc:// run."""
        network, hosts = self.config.network, hosts or {}
        if network.transport != "tcp" and not hosts:
            self.endpoints = Endpoints(self.run_dir, self.run_id, network)
            return
        try:
            check_hosts(network, hosts)
        except Refused as exc:
            raise GiveUp(str(exc)) from None
        try:
            port_base = network.port_base or free_port_base(network.bind_host or network.host)
            keys_dir = Path(network.keys_dir) if network.keys_dir else self.run_dir / CURVE_DIR
            keys = None
            if network.curve:
                keys = load_run_keys(keys_dir) if network.keys_dir else create_key_files(keys_dir)
        except (BadKeyFile, OSError) as exc:
            raise GiveUp(f"network: {exc}") from None
        self.network_plan = NetworkPlan(port_base, hosts, keys)
        self.client_keys_file = str(keys_dir / f"client{SECRET_SUFFIX}") if keys else ""
        self.endpoints = Endpoints(self.run_dir, self.run_id, network, self.network_plan)
        first, last, curve = port_base, port_base + PORT_SPAN - 1, " with CURVE" if keys else ""
        log.info("tcp:// links on ports %d-%d%s", first, last, curve)

    def move_group(self, group: int, address: str) -> None:
        """The cluster placed engine group `group` on a node at `address`, another than its links
        have (its node died, or a hot reload added it there): re-plan the links whose server is
        in the group (same ports and CURVE keys, the new address), publish them in run.json for
        the group's new processes, and tell the running stages (TopologyChanged), whose links to
        the group reconnect before it starts there. Raises Refused when this run's links cannot
        follow: links that are ipc:// because every stage ran on this host at start, or an
        address that the checks at start would refuse."""
        network = self.config.network
        if self.endpoints.is_single_host and network.transport != "tcp":
            raise Refused(
                f"engine group {group} is placed on a node at {address}, but this run's links are "
                "ipc:// (all its stages were on one host at start): set network.transport: tcp for a run "
                "whose engine groups may move to other hosts"
            )
        names = [s.name for s in self.stages if s.group == group]
        hosts = {**self.network_plan.hosts, **dict.fromkeys(names, address)}
        check_hosts(network, hosts)
        self.network_plan = msgspec.structs.replace(self.network_plan, hosts=hosts)
        self.endpoints = Endpoints(self.run_dir, self.run_id, network, self.network_plan)
        if self.info is not None:
            self.info = msgspec.structs.replace(self.info, network=self.network_plan)
            write_run_info(self.run_dir, self.info)
        log.info("engine group %d moved to a node at %s: its links follow", group, address)
        self.broadcast_topology(msgspec.structs.replace(self.topology, hosts=hosts))

    def create_rings(self, model_dir: Path, groups: range) -> None:
        """The step and result rings of engine groups `groups`, where the stage set puts them."""
        engine = self.config.engine
        # check_model has read this config.json already: it is there and well-formed.
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        specs = []
        for group in groups:
            step, result = self.endpoints.step_ring(group), self.endpoints.result_ring(group)
            step_bytes = step_slot_bytes(self.config, vocab_size)
            specs.append(RingSpec(group, step, RING_SLOTS, step_bytes, engine.tensor_parallel))
            specs.append(RingSpec(group, result, RING_SLOTS, result_slot_bytes(self.config), 1))
        self.rings += self.stages.create_rings(specs)

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
        params["model"] = self.info.model if self.info else ""
        self.mlflow = MlflowSink(config, self.run_dir, f"brigade-{self.run_id}", params)
        self.mlflow.start()

    def start(self) -> None:
        self.claim_run_dir()
        if self.config.gateway.replicas:
            self.claim_gateway_port()
        self.run_lock = RunLock(self.run_id)  # before any shared memory of the run exists
        try:
            check_layout(self.config)
            swept = sweep_stale_runs()
            if swept:
                log.info("swept %d shared-memory objects of dead runs", len(swept))
            model_dir = self.prepare_model()
            sampling_defaults = check_model(self.config, model_dir)
            hosts = self.stages.place()
            self.plan_network(hosts)
            self.topology = Topology.of(self.config, hosts)
        except Refused as exc:
            raise GiveUp(str(exc)) from None
        log.info("a request that sets no sampling values takes %s", describe_defaults(sampling_defaults))
        self.create_rings(model_dir, range(self.config.engine.data_parallel))
        metrics_dir = self.run_dir / METRICS_DIR
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(mode=0o700)
        self.serve_metrics()
        self.control = RouterSocket(self.ctx, self.endpoints.supervisor(), CONTROL_UP, CONTROL_DOWN)
        self.auth_failures.watch(self.control)
        keys = self.network_plan.keys
        self.info = RunInfo(
            run_id=self.run_id,
            supervisor_pid=os.getpid(),
            model_dir=str(model_dir),
            model=self.config.model.path or "SmolLM2-135M-Instruct",
            tokenizers=[str(self.endpoints.tokenizer(i)) for i in range(self.config.tokenizer.replicas)],
            config=self.config,
            network=self.network_plan,
            curve_server_key=keys.server_public if keys else "",
            curve_client_keys=self.client_keys_file,
        )
        self.write_run_file()
        for spec in self.topology.stages():
            self.stages.spawn(self.stages.add(spec))
        deadline = time.monotonic() + self.config.supervisor.start_timeout_s
        last_note = 0.0
        while not all(s.is_ready for s in self.stages):
            if self.signals:
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                waiting = [s.name for s in self.stages if not s.is_ready]
                raise GiveUp(
                    f"stages did not come up within {self.config.supervisor.start_timeout_s:.0f}s: {waiting}"
                )
            self.tick()
            if time.monotonic() - last_note > 5:
                waiting = [s.name for s in self.stages if not s.is_ready]
                log.info("waiting for %d stage(s) to come up: %s", len(waiting), ", ".join(waiting))
                last_note = time.monotonic()
        self.info = msgspec.structs.replace(self.info, is_ready=True)
        self.write_run_file()
        client = f"python -m client --run {self.run_dir}"
        self.start_mlflow()
        ready = f"Brigade ready: {len(self.stages)} stages, run {self.run_id} in {self.run_dir}"
        print(ready + http_line(self.config), flush=True)
        print(
            f"  try: {client} chat 'Hello!'    or    {client} generate 'Once upon a time' --json", flush=True
        )

    def write_run_file(self) -> None:
        try:
            write_run_info(self.run_dir, self.info)
        except OSError as exc:
            raise GiveUp(f"could not write {self.run_dir / RUN_FILE}: {exc.strerror}") from None

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
            self.writes.attempt(STATUS_FILE, self.write_status)
            self.status_states = states
        if is_due:
            self.send_group_loads()
            self.writes.attempt(f"{METRICS_DIR}/{metrics.STAGES_FILE}", self.write_stage_samples)
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

    def write_stage_samples(self) -> None:
        """What /metrics reports of each stage (services/metrics.py reads it at scrape time)."""
        stages = [
            metrics.StageSample(
                s.name, s.kind, s.pid, s.state, s.num_restarts, s.group, s.load.num_running, s.load.num_waiting,
                s.load.kv_usage, s.load.num_malformed, s.load.gpu_memory_allocated, s.load.gpu_memory_reserved,
                s.load.num_auth_failures,
            )
            for s in self.stages
        ]  # fmt: skip
        supervisor = metrics.StageSample(
            "supervisor", "supervisor", os.getpid(), "running", num_auth_failures=self.auth_failures.count
        )
        rings = [metrics.RingSample(r.name, r.num_in_use) for r in self.rings]
        model = self.info.model if self.info else ""
        samples = metrics.StageSamples(model, self.config.engine.device, [supervisor, *stages], rings)
        metrics.write_stage_samples(self.run_dir, samples)

    def write_status(self) -> None:
        now = time.monotonic()
        rows = [
            {
                "name": s.name,
                "kind": s.kind,
                "pid": s.pid,
                "state": s.state,
                "restarts": s.num_restarts,
                "uptime_s": round(now - s.started_at, 1) if s.state == "running" else 0.0,
                "queue_depth": s.load.num_waiting + s.load.num_in_flight,
                "running": s.load.num_running,
                "kv_usage": round(s.load.kv_usage, 4),
                "tokens_per_s": round(s.tokens_rate, 1),
                "malformed": s.load.num_malformed,
                **({"node": s.node} if s.node else {}),
            }
            for s in self.stages
        ]
        tmp = self.run_dir / (STATUS_FILE + ".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.replace(self.run_dir / STATUS_FILE)

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

    def publish_config(self, config: Config) -> None:
        """New stages read run.json at start; clients read the tokenizer list from it. Raises
        OSError (a full disk), and then nothing changed."""
        info = msgspec.structs.replace(
            self.info,
            config=config,
            tokenizers=[str(self.endpoints.tokenizer(i)) for i in range(config.tokenizer.replicas)],
        )
        write_run_info(self.run_dir, info)
        self.config, self.info = config, info

    def wait_ready(self, stages: list[StageProcess]) -> None:
        deadline = time.monotonic() + self.config.supervisor.start_timeout_s
        while not all(s.is_ready for s in stages):
            if time.monotonic() > deadline or self.signals:
                raise GiveUp(f"stages not ready in time: {[s.name for s in stages if not s.is_ready]}")
            self.tick()

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
            if config.gateway.replicas and self.gateway_port is None:
                self.claim_gateway_port()  # gateway.port and host are not live: the same
            self.publish_config(config)
        except (GiveUp, OSError) as exc:
            self.stages.release_groups(self.config.engine)  # what place_groups reserved
            reason = f"could not write {RUN_FILE}: {exc.strerror}" if isinstance(exc, OSError) else str(exc)
            raise Refused(reason) from None
        new_counts = self.replica_counts(config)
        changes = {path: [old_counts[path], n] for path, n in new_counts.items() if n != old_counts[path]}
        if changes:
            self.audit.rescale(changes)
        step = diff(self.topology, Topology.of(config, self.topology.hosts))
        self.create_rings(
            Path(self.info.model_dir), range(self.topology.num_groups, config.engine.data_parallel)
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
        names = {
            name for g in groups for name in (self.endpoints.step_ring(g), self.endpoints.result_ring(g))
        }
        for ring in [r for r in self.rings if r.name in names]:
            ring.close()
            ring.unlink()
            self.rings.remove(ring)
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
        """Stop the stages in order and remove what this supervisor created: its shared memory,
        and the run dir's sockets and files once it had claimed the run dir. A supervisor
        refused at start leaves the live run there untouched (docs/architecture.md invariant 9)."""
        if self.mlflow is not None:
            self.mlflow.stop()
        for kind in STOP_ORDER:
            self.stages.stop(self.stages.of_kind(kind), STOP_GRACE_S)
        for ring in self.rings:
            ring.close()
            ring.unlink()
        self.stages.close()
        close_context(self.ctx, 0)
        if self.run_lock is not None:
            self.run_lock.release()  # last of the run's shared memory
        if self.gateway_port is not None:
            self.gateway_port.close()
        if self.run_dir_lock is None:
            return
        for path in [*self.run_dir.glob("*.sock"), self.run_dir / RUN_FILE, self.run_dir / STATUS_FILE]:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir / METRICS_DIR, ignore_errors=True)
        if not self.config.network.keys_dir:
            shutil.rmtree(self.run_dir / CURVE_DIR, ignore_errors=True)  # this run's keys die with it
        # The lock file stays: unlinking it would let a supervisor that opened it meanwhile lock
        # a file nobody else can see any more.
        os.close(self.run_dir_lock)
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
        log.info("interrupted during start")
    finally:
        supervisor.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
