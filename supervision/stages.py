"""The stage processes of a run: which stages a config needs, and every process operation on
them (spawn, kill-and-wait, reap) in one place. Each stage runs as `python -m services.<kind>`
in a session of its own; its stderr passes through the supervisor, which keeps the last line
as the reason when it fails to start."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ipc import messages as m
from ipc.config import Config, EngineConfig
from ipc.endpoints import DIST_PORT_ENV
from ipc.shm import ShmRing
from ipc.topology import STOP_ORDER, StageSpec
from services.cpu_cores import usable_cores, worker_env
from services.metrics import METRICS_DIR, METRICS_DIR_ENV
from services.stage import SUPERVISOR_PID_ENV
from supervision.health import Health
from supervision.preflight import cuda_device_count

REPO_ROOT = Path(__file__).resolve().parent.parent
STDERR_JOIN_S = 2.0  # for the last line of a stage that exited

log = logging.getLogger("supervisor")


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class RingSpec:
    """One shared-memory ring of an engine group, as ShmRing.create takes it."""

    group: int
    name: str
    num_slots: int
    slot_bytes: int
    num_readers: int


@dataclass
class StageHandle:
    """The supervisor's handle on one stage: how to start it, its current process, its state.
    (The stage's own side is services/stage.py `StageProcess`.)"""

    name: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    group: int = -1  # engine group of schedulers and workers
    index: int = 0  # which replica of its kind (StageSpec.index)
    process: subprocess.Popen | None = None
    is_ready: bool = False
    was_ever_ready: bool = False
    failures: deque[float] = field(default_factory=deque)  # for the restart policy
    num_restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None
    health: Health = field(default_factory=lambda: Health.started(0.0))
    load: m.StageLoad = field(default_factory=m.StageLoad)
    tokens_rate: float = 0.0
    load_at: float = 0.0  # when `load` came (0: none from this process yet)
    state: str = "starting"
    last_stderr_line: str = ""
    stderr_pump: threading.Thread | None = None
    node: str = ""  # the Ray node it runs on; "" on the local backend
    protections: str = ""  # what its current process said it runs under (services/privileges.py)

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    @property
    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def on_ready(self, now: float, protections: str = "") -> None:
        """Its current process said Ready: it is up, and heard from now; `protections`: what it
        runs under (services/privileges.py)."""
        self.protections = protections
        self.health.on_beat(now)
        self.is_ready = self.was_ever_ready = True
        self.state = "running"

    def on_heartbeat(self, beat: m.Heartbeat, now: float) -> None:
        """Its liveness and load; the tokens per second average over heartbeats (0.3 to the newest)."""
        self.health.on_beat(now, beat.progress, beat.has_work)
        new_tokens = beat.load.tokens_total - self.load.tokens_total
        if self.load_at and new_tokens >= 0:
            instant = new_tokens / max(now - self.load_at, 1e-3)
            self.tokens_rate = 0.7 * self.tokens_rate + 0.3 * instant
        self.load, self.load_at = beat.load, now

    @property
    def is_draining(self) -> bool:
        """Whether it said it took the drain's Shutdown, or is down (it says nothing more, and is
        not waited for)."""
        return self.load.is_draining or self.is_down

    @property
    def has_drained(self) -> bool:
        """Whether it reported nothing in flight since it took the drain's Shutdown (a load sent
        before may miss a call it admitted meanwhile), or is down."""
        return self.is_down or (self.load.is_draining and self.load.num_in_flight == 0)

    @property
    def is_down(self) -> bool:
        return not (self.is_ready and self.is_alive)

    def restart_after(self, delay_s: float) -> None:
        """It went down (exited, hung, or taken down with its group): it starts again in `delay_s`."""
        self.num_restarts += 1
        self.restart_at = time.monotonic() + delay_s
        self.is_ready = False
        self.state = "restarting"

    def last_words(self) -> str:
        """The last line the exited process wrote to stderr (its error, typically)."""
        if self.stderr_pump is not None:
            self.stderr_pump.join(STDERR_JOIN_S)
        return self.last_stderr_line


class StageSet:
    """Every stage of the run by name, and the process operations on them: here, processes on
    this host (supervision/ray_stages.py has the same interface over a Ray cluster)."""

    def __init__(self, config: Config, run_dir: Path, log_format: str) -> None:
        self.engine = config.engine  # a reload changes only data_parallel (place_groups, release_groups)
        self.dist_host = config.network.host
        self.run_dir = run_dir
        self.log_format = log_format
        self.stages: dict[str, StageHandle] = {}
        # (group, address): the cluster placed an engine group again on a host at another address;
        # the supervisor re-plans its links or raises Refused. Only a cluster's stage set calls it.
        self.on_group_moved: Callable[[int, str], None] | None = None
        # Per engine group: where its tensor-parallel rank 0 listens for torch.distributed.
        self.dist_ports = [free_tcp_port(self.dist_host) for _ in range(self.engine.data_parallel)]

    def __iter__(self) -> Iterator[StageHandle]:
        return iter(list(self.stages.values()))

    def __len__(self) -> int:
        return len(self.stages)

    def __getitem__(self, name: str) -> StageHandle:
        return self.stages[name]

    def get(self, name: str) -> StageHandle | None:
        return self.stages.get(name)

    def of_kind(self, kind: str) -> list[StageHandle]:
        return [s for s in self.stages.values() if s.kind == kind]

    def add(self, spec: StageSpec) -> StageHandle:
        """The stage `spec` names (ipc/topology.py gives them, in start order); spawns nothing."""
        if spec.kind not in STOP_ORDER:
            raise ValueError(
                f"stage kind {spec.kind!r} has no place in STOP_ORDER, so it would never be stopped"
            )
        argv = [sys.executable, "-m", f"services.{spec.kind}", "--run-dir", str(self.run_dir)]
        argv += ["--log-format", self.log_format, "--index", str(spec.index)]
        if spec.rank is not None:
            argv += ["--rank", str(spec.rank)]
        env = {**os.environ, **self.stage_env(spec.group, spec.rank)}
        stage = StageHandle(spec.name, spec.kind, argv, env, group=spec.group, index=spec.index)
        self.stages[spec.name] = stage
        return stage

    def stage_env(self, group: int, rank: int | None) -> dict[str, str]:
        """What a stage's environment adds to the supervisor's."""
        env = {
            METRICS_DIR_ENV: str(self.run_dir / METRICS_DIR),
            SUPERVISOR_PID_ENV: str(os.getpid()),
        }
        if rank is not None:
            env[DIST_PORT_ENV] = str(self.dist_ports[group])
            if self.engine.device == "cuda":
                devices = self.engine.devices or list(
                    range(self.engine.data_parallel * self.engine.tensor_parallel)
                )
                env["CUDA_VISIBLE_DEVICES"] = str(devices[group * self.engine.tensor_parallel + rank])
            else:
                env |= worker_env(self.engine, group, rank, usable_cores())
        return env

    # -- the run's resources ---------------------------------------------------------------------

    def place(self) -> dict[str, str]:
        """Reserve where the engine groups run; returns the address of every stage that runs on
        another host than the supervisor's (none here), for the run's links."""
        return {}

    def place_groups(self, engine: EngineConfig) -> None:
        """Reserve room for the engine groups a hot reload adds (up to engine.data_parallel);
        `unplaced` tells those still waiting for it."""
        self.engine = engine
        added = range(len(self.dist_ports), engine.data_parallel)
        self.dist_ports += [free_tcp_port(self.dist_host) for _ in added]

    def unplaced(self) -> list[int]:
        return []

    def max_groups(self) -> int | None:
        """The most engine groups this host holds (None: no limit but the cluster's): one per
        engine.tensor_parallel CUDA devices, or on the CPU per engine.threads x tensor_parallel
        cores (engine.threads 0 shares the cores out, one each at least)."""
        if self.engine.device == "cuda":
            return cuda_device_count() // self.engine.tensor_parallel
        return max(1, len(usable_cores()) // ((self.engine.threads or 1) * self.engine.tensor_parallel))

    def release_groups(self, engine: EngineConfig) -> None:
        """Give back what the engine groups at or above engine.data_parallel held (a hot reload
        retired them, and their stages have stopped)."""
        self.engine = engine
        del self.dist_ports[engine.data_parallel :]

    def create_rings(self, specs: list[RingSpec]) -> list[ShmRing]:
        """The engine groups' shared-memory rings, on this host; the supervisor unlinks them."""
        rings: list[ShmRing] = []
        try:
            for spec in specs:
                rings.append(ShmRing.create(spec.name, spec.num_slots, spec.slot_bytes, spec.num_readers))
        except BaseException:  # none of them, rather than some the run does not know to unlink
            for ring in rings:
                ring.close()
                ring.unlink()
            raise
        return rings

    def gather_metrics(self) -> None:
        """Bring the Prometheus files of stages on other hosts into this run's metrics dir (there
        are none here: every stage writes to it directly)."""

    def close(self) -> list[str]:
        """Release what `place` reserved, once every stage has stopped. Returns what could not be
        cleaned up, one description each (none here: the supervisor removes this host's files)."""
        return []

    # -- processes -------------------------------------------------------------------------------

    def spawn(self, stage: StageHandle) -> None:
        self.launch(stage)
        now = time.monotonic()
        stage.is_ready, stage.state, stage.started_at, stage.restart_at = False, "starting", now, None
        stage.health = Health.started(now)
        stage.load, stage.load_at = m.StageLoad(), 0.0
        log.info("started %s (pid %d)", stage.name, stage.pid)

    def launch(self, stage: StageHandle) -> None:
        stage.process = subprocess.Popen(
            stage.argv, env=stage.env, start_new_session=True, cwd=REPO_ROOT, stderr=subprocess.PIPE
        )
        stage.last_stderr_line = ""
        stage.stderr_pump = threading.Thread(
            target=_pump_stderr, args=(stage, stage.process.stderr), name=f"stderr-{stage.name}", daemon=True
        )
        stage.stderr_pump.start()

    def is_current(self, stage: StageHandle, pid: int) -> bool:
        """Whether a message from `pid` comes from the stage's current process (not one that
        was replaced)."""
        return pid == stage.pid

    def reap(self) -> list[tuple[StageHandle, int]]:
        """The stages whose process exited since the last look (and that are not waiting for a
        restart), with their exit codes."""
        exited = []
        for stage in self.stages.values():
            if stage.restart_at is None and stage.process is not None:
                code = stage.process.poll()
                if code is not None:
                    exited.append((stage, code))
        return exited

    def stop(self, stages: Iterable[StageHandle], grace_s: float, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to every live stage's process group, wait for them all together up to
        `grace_s`, and SIGKILL whatever is left (then wait for it too)."""
        live = [s for s in stages if s.is_alive]
        for stage in live:
            self.send_signal(stage, sig)
        deadline = time.monotonic() + grace_s
        for stage in live:
            assert stage.process is not None
            try:
                stage.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.send_signal(stage, signal.SIGKILL)
                stage.process.wait()

    def kill(self, stages: Iterable[StageHandle]) -> None:
        """SIGKILL and wait: for stages that are hung or must go with another one."""
        self.stop(stages, 0.0, signal.SIGKILL)

    def send_signal(self, stage: StageHandle, sig: int) -> None:
        """`sig` to the stage's whole process group (it runs in a session of its own)."""
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.killpg(stage.pid, sig)

    def remove(self, stages: Iterable[StageHandle]) -> None:
        for stage in stages:
            del self.stages[stage.name]


def _pump_stderr(stage: StageHandle, pipe: IO[bytes]) -> None:
    """Pass a stage's stderr through to ours, line by line, remembering the last one."""
    out = sys.stderr.buffer
    for line in pipe:
        try:
            out.write(line)
            out.flush()
        except (OSError, ValueError):
            pass  # our stderr is gone; keep draining, so that the stage never blocks on a full pipe
        if line.strip():
            stage.last_stderr_line = line.decode("utf-8", "replace").strip()
    pipe.close()
