"""What every stage process shares: its identity, the run's config, logging, the control channel
to the supervisor (Ready, heartbeats up; commands down), and dying with its parent.

Light: no torch here (the tokenizer and the detokenizer import it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import msgspec
import zmq

from ipc import messages as m
from ipc.codec import CONTROL_DOWN, CONTROL_UP, Codec, MalformedMessage
from ipc.config import Config
from ipc.endpoints import Endpoints, Link, NetworkPlan
from ipc.sockets import DealerSocket, PushQueue, close_context
from ipc.topology import Topology
from services import privileges
from services.audit import AuditLog, CurveFailureMonitor, audit_log_path
from services.cpu_cores import light_stage_cores, pin_process, usable_cores

RUN_FILE = "run.json"
# The gateways' stored /v1/responses (services/gateway/response_store.py): every replica's, kept
# across a replica's restart within a run; the supervisor removes them with the run.
RESPONSES_DIR = "responses"
# The gateways' streams recorded for replay (services/gateway/stream_replay.py), likewise.
STREAMS_DIR = "streams"
# The scheduler's table of LoRA adapters, one per engine group (services/scheduler/adapters.py):
# it carries the adapters loaded at run time across a scheduler's restart within a run, and the
# supervisor removes it with the run, so that the next run of the run dir serves its lora.adapters.
LORA_TABLE_PREFIX = "lora-adapters-"


def lora_table_path(run_dir: Path, group: int) -> Path:
    """Engine group `group`'s table of LoRA adapters."""
    return run_dir / f"{LORA_TABLE_PREFIX}{group}.json"


def lora_table_files(run_dir: Path) -> list[Path]:
    """Every engine group's table of LoRA adapters in `run_dir`, a half-written one (.tmp) too."""
    return list(run_dir.glob(f"{LORA_TABLE_PREFIX}*.json*"))


# Set by the supervisor for the stages it spawns; stages that tests start on their own lack it.
SUPERVISOR_PID_ENV = "BRIGADE_SUPERVISOR_PID"
# Set when a stage's parent is not the supervisor: on a Ray node its parent is the stage's host
# actor (supervision/ray_stages.py), and the stage lives and dies with that instead.
PARENT_PID_ENV = "BRIGADE_PARENT_PID"


class RunInfo(msgspec.Struct, frozen=True):
    """run.json: what the supervisor tells stages and clients about a run."""

    run_id: str
    supervisor_pid: int
    model_dir: str
    model: str
    tokenizers: list[str]  # the client-facing endpoints SDK clients connect to
    config: Config
    is_ready: bool = False
    network: NetworkPlan = NetworkPlan()  # ports, hosts and CURVE keys (ipc/endpoints.py)
    curve_server_key: str = ""  # the server public key, for SDK clients of a tcp:// run
    curve_client_keys: str = ""  # the client's secret certificate file (ipc/keys.py)
    # The longest sequence served (supervision/preflight.py served_max_model_len): below
    # model.max_model_len where the model or its draft model has fewer positions; 0 = that.
    max_model_len: int = 0
    # The run's topology as the supervisor holds it now (ipc/topology.py): during a hot reload it
    # lags the config, which has the new counts before the stages they add are up, and it counts
    # the engine groups still draining. None in a run.json written without it (a test's).
    topology: Topology | None = None

    @property
    def served_max_model_len(self) -> int:
        return self.max_model_len or self.config.model.max_model_len


def read_run_info(run_dir: Path) -> RunInfo:
    return msgspec.json.decode((run_dir / RUN_FILE).read_bytes(), type=RunInfo)


def write_run_info(run_dir: Path, info: RunInfo) -> None:
    """Atomically, and private to the run dir's owner (the supervisor's user, or supervisor.run_as
    when a root supervisor handed the run dir over): it carries the run's CURVE secret keys."""
    tmp = run_dir / (RUN_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if os.geteuid() == 0:
        owner = run_dir.stat()
        os.fchown(fd, owner.st_uid, owner.st_gid)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.encode(info))
    tmp.chmod(0o600)
    tmp.replace(run_dir / RUN_FILE)


def run_endpoints(run_dir: Path, info: RunInfo, here: str = "") -> Endpoints:
    """The run's links as the process on host `here` (default: `network.host`) sees them."""
    return Endpoints(run_dir, info.run_id, info.config.network, info.network, here)


class JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": round(record.created, 3),
                "level": record.levelname,
                "stage": record.name,
                "pid": record.process,
                "msg": record.getMessage(),
            }
        )


def setup_logging(name: str, level: str = "INFO", fmt: str = "text") -> logging.Logger:
    """One line per event, with stage name and pid; `fmt="json"` for machines."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s [%(name)s pid=%(process)d] %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger(name)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when our parent (the supervisor, or a Ray node's stage host)
    dies, even by SIGKILL (Linux). Not SIGTERM: a stage busy in a long native call may not get to
    its stop flag, and with the parent gone there is nothing left to shut down cleanly (it owns the shared memory, and the next
    start sweeps it)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@dataclass
class Stage:
    """Identity and shared context of one stage process."""

    name: str
    index: int
    run_dir: Path
    info: RunInfo
    endpoints: Endpoints
    log: logging.Logger
    is_supervised: bool  # spawned by the supervisor (not by a test), so it must not outlive it
    parent_pid: int  # the supervisor, or the Ray actor that hosts this stage

    @property
    def config(self) -> Config:
        return self.info.config

    @property
    def topology(self) -> Topology:
        """The run's topology when this process read run.json: the one its peers link by (a stage
        started or restarted in the middle of a hot reload must not go by the new config, whose
        added stages may not be up yet); the config's where run.json has none."""
        return self.info.topology or Topology.of(self.config, self.info.network.hosts)

    def relink(self, hosts: dict[str, str]) -> Endpoints:
        """Take the run's new stage hosts (TopologyChanged): this stage's endpoints are re-planned from
        them. Returns the endpoints as they were, to tell which links moved (`reconnect_moved`)."""
        old = self.endpoints
        network = msgspec.structs.replace(self.info.network, hosts=hosts)
        self.info = msgspec.structs.replace(self.info, network=network)
        self.endpoints = run_endpoints(self.run_dir, self.info, hosts.get(self.name, ""))
        return old


def reconnect_moved(
    ctx: zmq.Context,
    queues: list[PushQueue],
    old: Callable[[int], Link],
    new: Callable[[int], Link],
    codec: Codec,
    log: logging.Logger,
) -> None:
    """Replace, in place, each of `queues` (the PUSH to link `old(i)`) whose link moved to
    another endpoint by one to `new(i)`. What the old socket still held was bound for a process
    that is gone; the resubmission after its restart covers it."""
    for i, queue in enumerate(queues):
        link = new(i)
        if link.connect != old(i).connect:
            queue.close()
            queues[i] = PushQueue(ctx, link, codec)
            log.info("reconnected %s -> %s", old(i).connect, link.connect)


def parse_stage_args(kind: str, argv: list[str] | None = None) -> tuple[Stage, argparse.Namespace]:
    """Common command line of every stage: `--run-dir DIR --index I [--rank R]`."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{kind}")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--index", type=int, default=0, help="replica / shard / engine group index")
    parser.add_argument("--rank", type=int, default=0, help="tensor-parallel rank (gpu_worker)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    info = read_run_info(args.run_dir)
    name = f"{kind}-{args.index}" + (f"-{args.rank}" if kind == "gpu_worker" else "")
    log = setup_logging(name, info.config.supervisor.log_level, args.log_format)
    is_supervised = os.environ.get(SUPERVISOR_PID_ENV) == str(info.supervisor_pid)
    parent_pid = int(os.environ.get(PARENT_PID_ENV, info.supervisor_pid))
    if is_supervised:
        die_with_parent()
        # PDEATHSIG only covers a parent dying from now on: one that died while we were still
        # importing (torch takes seconds) has already orphaned us.
        if os.getppid() != parent_pid:
            log.error("parent %d died before this stage started; exiting", parent_pid)
            sys.exit(1)
    privileges.set_no_new_privs()
    if kind != "gateway":  # the gateway binds its port first (services/gateway/__main__.py)
        drop_privileges(info.config.supervisor.run_as, is_supervised)
    if kind != "gpu_worker" and (cores := light_stage_cores(info.config, usable_cores())):
        pin_process(cores)  # off the workers' main cores (services/cpu_cores.py)
    endpoints = run_endpoints(args.run_dir, info, info.network.hosts.get(name, ""))
    stage = Stage(name, args.index, args.run_dir, info, endpoints, log, is_supervised, parent_pid)
    return stage, args


def drop_privileges(run_as: str, is_supervised: bool) -> None:
    """Become supervisor.run_as when started as root (services/privileges.py). A change of user
    clears the parent-death signal, so it is asked for again."""
    if privileges.drop_to(run_as) and is_supervised:
        die_with_parent()


def writable_paths(stage: Stage) -> list[Path]:
    """Where a confined stage may still write: the run dir, the directories of the audit and
    access logs where they are configured elsewhere (the access log is rotated by renames), and
    /dev/null."""
    observability, gateway = stage.config.observability, stage.config.gateway
    logs = [Path(p).parent for p in (observability.audit_log, gateway.access_log.path) if p]
    return [stage.run_dir, *logs, Path(os.devnull)]


def confine_writes(stage: Stage) -> bool:
    """Landlock (services/privileges.py): from now on this process writes only `writable_paths`;
    whether the kernel enforces it."""
    return privileges.restrict_writes(writable_paths(stage))


class AuthFailures:
    """Refused CURVE handshakes on one process's server sockets: logged, written to the audit log
    and counted (the count rides on the heartbeats to /metrics). Polled from the owner's loop;
    never blocks, never raises."""

    def __init__(self, audit: AuditLog, log: logging.Logger) -> None:
        self.audit = audit
        self.log = log
        self.monitors: list[CurveFailureMonitor] = []
        self.count = 0

    def watch(self, *sockets: object) -> None:
        """Watch those of `sockets` (ipc/sockets.py wrappers) that are CURVE servers."""
        for sock in sockets:
            if getattr(sock, "is_curve_server", False):
                self.monitors.append(CurveFailureMonitor(sock.socket, self.audit))  # type: ignore[attr-defined]

    def poll(self) -> None:
        for monitor in self.monitors:
            new = monitor.poll()
            if new:
                self.count += new
                self.log.warning(
                    "refused %d CURVE handshake(s) on %s (%d so far; see the audit log)",
                    new, monitor.socket.last_endpoint.decode(), self.count,
                )  # fmt: skip


class ControlChannel:
    """DEALER to the supervisor: Ready once, heartbeats (rate-limited) and commands down. Also
    watches the stage's CURVE server sockets (`watch`): each heartbeat reports their refusals."""

    def __init__(self, ctx: zmq.Context, stage: Stage) -> None:
        self.stage = stage
        self.interval = stage.config.supervisor.heartbeat_interval_s
        self.socket = DealerSocket(
            ctx, stage.endpoints.supervisor(), CONTROL_DOWN, CONTROL_UP, identity=stage.name.encode()
        )
        self.last_beat = 0.0
        self.num_malformed = 0  # commands that did not decode: counted into each heartbeat
        self.reported_in_flight = -1  # while draining: the last num_in_flight sent
        audit = AuditLog(audit_log_path(stage.run_dir, stage.config.observability.audit_log), stage.name)
        self.auth_failures = AuthFailures(audit, stage.log)

    def watch(self, *sockets: object) -> None:
        self.auth_failures.watch(*sockets)

    def ready(self, **info: str) -> None:
        """Up; `info` (free-form) goes with the protections the process runs under (`status`)."""
        protections = ",".join(privileges.active()) or "none"
        self.socket.send(m.Ready(self.stage.name, os.getpid(), {**info, "protections": protections}))

    def seconds_until_due(self) -> float:
        """How long until `heartbeat` sends again: how long a stage with nothing to do and all of
        its inputs in a poll may sleep."""
        return max(0.0, self.last_beat + self.interval - time.monotonic())

    def heartbeat(
        self, progress: int, has_work: bool, load: m.StageLoad | None = None, force: bool = False
    ) -> None:
        """Send one every heartbeat interval, or now if `force`. While the stage drains, every
        change of what it has in flight goes at once: the supervisor's drain ends on it rather
        than on the next heartbeat."""
        now = time.monotonic()
        if load is not None and load.is_draining and load.num_in_flight != self.reported_in_flight:
            force = True
            self.reported_in_flight = load.num_in_flight
        if force or now - self.last_beat >= self.interval:
            self.last_beat = now
            if self.stage.is_supervised and os.getppid() != self.stage.parent_pid:
                # The parent is gone (PDEATHSIG did not reach us): nothing is left to serve.
                self.stage.log.error("parent %d is gone; exiting", self.stage.parent_pid)
                os._exit(1)
            self.auth_failures.poll()
            load = load or m.StageLoad()
            load = msgspec.structs.replace(
                load,
                num_auth_failures=self.auth_failures.count,
                num_malformed=load.num_malformed + self.num_malformed,
            )
            self.socket.send(m.Heartbeat(self.stage.name, os.getpid(), progress, has_work, load))

    def command(self) -> m.ControlDown | None:
        """The next command from the supervisor, if any; a log level change applies here."""
        try:
            command = self.socket.recv(0)
        except MalformedMessage:
            self.num_malformed += 1
            return None
        if isinstance(command, m.Reconfigure):
            logging.getLogger().setLevel(command.log_level)
        return command


def install_stop_handler(wakeup: socket.socket) -> list[bool]:
    """SIGTERM / SIGINT set a flag that the stage's loop checks (then it exits cleanly), and write
    a byte to `wakeup`: Python runs a handler only once the native call it interrupted returns,
    and pyzmq resumes an interrupted poll, so a loop blocked in one would otherwise notice the
    flag only at the poll's timeout (an idle scheduler's: its next heartbeat)."""
    stopping = [False]

    def on_signal(signum: int, frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.set_wakeup_fd(wakeup.fileno(), warn_on_full_buffer=False)
    return stopping


class StageProcess:
    """The skeleton of a stage process: its command line (`parse_stage_args`), its zmq context and
    control channel, the stop flag, the busy loop and the close. A stage names its `kind`, opens
    its own sockets in `__init__` and fills in the loop, which reads:

        while not stopping:
            self.step()                   # wait on its inputs, and handle what came
            self.on_command(command)      # when the supervisor sent one
            self.heartbeat()              # rate-limited by the control channel

    A stage whose loop has another shape (the worker's, on the step ring) overrides `serve`."""

    kind: ClassVar[str]
    stop_linger_ms: ClassVar[int] = 0  # how long the close lets queued messages out
    # A stage that parses untrusted input may write only in the run dir once its sockets are
    # made (`confine_writes`).
    confines_writes: ClassVar[bool] = False

    def __init__(self, argv: list[str] | None = None) -> None:
        self.stage, self.args = parse_stage_args(self.kind, argv)
        self.log = self.stage.log
        self.ctx = zmq.Context()
        self.control = ControlChannel(self.ctx, self.stage)
        self.stopping = [False]  # set by SIGTERM / SIGINT once `run` starts
        # Readable once a stop signal came: a stage registers `stop_fd` in the poll its loop waits
        # in, so that the wait ends at the signal (install_stop_handler).
        self.stop_reader, self.stop_writer = socket.socketpair()
        for end in (self.stop_reader, self.stop_writer):
            end.setblocking(False)
        self.stop_fd = self.stop_reader.fileno()
        self.num_malformed = 0  # messages on the stage's own inputs that did not decode

    def run(self) -> None:
        """Serve until SIGTERM / SIGINT, then close."""
        if self.confines_writes:
            confine_writes(self.stage)
        self.stopping = install_stop_handler(self.stop_writer)
        self.serve()
        self.close()

    def serve(self) -> None:
        self.start()
        stopping, control = self.stopping, self.control
        while not stopping[0]:
            self.step()
            command = control.command()
            if command is not None:
                self.on_command(command)
            self.heartbeat()

    def start(self) -> None:
        """Just before the loop, with the stop handler on: a stage ready by now says Ready here."""

    def step(self) -> None:
        raise NotImplementedError

    def on_command(self, command: m.ControlDown) -> None:
        """A command from the supervisor (a log level change is applied already)."""

    def heartbeat(self) -> None:
        raise NotImplementedError

    def drain(self) -> str:
        """What the stage owes on its way out, done after the loop; returns what it adds to the
        "stopping" log line."""
        return ""

    def close(self) -> None:
        self.log.info("stopping%s", self.drain())
        close_context(self.ctx, self.stop_linger_ms)
        signal.set_wakeup_fd(-1)
        self.stop_reader.close()
        self.stop_writer.close()
