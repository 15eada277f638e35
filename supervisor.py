"""Brigade supervisor: config -> shared memory and processes -> watch, restart -> clean shutdown.

    python supervisor.py --config configs/default.yaml [--set key.path=value ...] [--run-dir DIR]
    python supervisor.py status --run DIR [--json] [--once]

The supervisor owns the run: the run directory, every shared-memory object (named after the run
id), and every stage process. It restarts a stage that exits or hangs, and triggers the recovery
that keeps every request (docs/architecture.md invariant 4).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Metric, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from ipc import messages as m
from ipc.codec import CONTROL_DOWN, CONTROL_UP, MalformedMessage
from ipc.config import Config, ConfigError, load_config
from ipc.endpoints import DIST_PORT_ENV, Endpoints, default_run_dir, make_run_dir
from ipc.shm import ShmRing, new_run_id, sweep_stale_runs
from ipc.sockets import RouterSocket
from ipc.step_plan import STEP_PLAN, STEP_RESULT, plan_limits, result_limits
from services.stage import RUN_FILE, SUPERVISOR_PID_ENV, RunInfo, read_run_info, setup_logging, write_run_info

STATUS_FILE = "status.json"
STOP_GRACE_S = 5.0
RING_SLOTS = 2  # the scheduler keeps two steps in flight (services/scheduler/pipeline.py)

METRICS_DIR = "metrics"

log = logging.getLogger("supervisor")


class GiveUp(Exception):
    """A stage restarted more often than the policy allows; the run ends."""


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def step_slot_bytes(config: Config) -> int:
    """Bytes of one step-plan slot at the configured maxima (ipc/step_plan.py declares the arrays)."""
    engine = config.engine
    max_model_len = config.model.max_model_len
    limits = plan_limits(engine.max_num_seqs, engine.max_num_batched_tokens, max_model_len, engine.block_size)
    return STEP_PLAN.slot_bytes(limits)


def result_slot_bytes(config: Config) -> int:
    return STEP_RESULT.slot_bytes(result_limits(config.engine.max_num_seqs))


@dataclass
class StageProcess:
    """One stage: how to start it, its process, and its health as the supervisor sees it."""

    name: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    group: int = -1  # engine group of schedulers and workers
    process: subprocess.Popen | None = None
    is_ready: bool = False
    restarts: deque = field(default_factory=deque)
    num_restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None
    last_beat: float = 0.0
    progress: int = -1
    progress_at: float = 0.0
    load: m.StageLoad = field(default_factory=m.StageLoad)
    tokens_rate: float = 0.0
    rate_at: float = 0.0
    has_work: bool = False
    state: str = "starting"

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0


class StageCollector:
    """Prometheus gauges read from the stages' latest heartbeats (the supervisor's own view)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        stages = self.supervisor.stages.values()
        schedulers = [s for s in stages if s.kind == "scheduler"]
        running = GaugeMetricFamily("brigade_running_sequences", "Sequences running", labels=["stage"])
        waiting = GaugeMetricFamily("brigade_waiting_sequences", "Sequences waiting", labels=["stage"])
        kv = GaugeMetricFamily("brigade_kv_cache_usage", "Fraction of KV blocks in use", labels=["stage"])
        hits = GaugeMetricFamily("brigade_prefix_cache_hit_rate", "Prompt tokens served from cache", labels=["stage"])
        for s in schedulers:
            running.add_metric([s.name], s.load.num_running)
            waiting.add_metric([s.name], s.load.num_waiting)
            kv.add_metric([s.name], s.load.kv_usage)
            hits.add_metric([s.name], s.load.prefix_hit_rate)
        slots = GaugeMetricFamily("brigade_shm_slots_in_use", "Shared-memory ring slots in use", labels=["ring"])
        for ring in self.supervisor.rings:
            slots.add_metric([ring.name], ring.num_in_use)
        restarts = CounterMetricFamily("brigade_stage_restarts", "Restarts per stage", labels=["stage"])
        malformed = CounterMetricFamily("brigade_malformed_messages", "Malformed messages rejected", labels=["stage"])
        for s in stages:
            restarts.add_metric([s.name], s.num_restarts)
            malformed.add_metric([s.name], s.load.num_malformed)
        yield from (running, waiting, kv, hits, slots, restarts, malformed)


class Supervisor:
    """Owns one run: its directory, shared memory, stage processes and their restarts."""

    def __init__(
        self, config: Config, config_path: str | None, overrides: list[str], run_dir: Path, log_format: str
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides
        self.config_mtime = Path(config_path).stat().st_mtime if config_path else 0.0
        self.is_reload_requested = False
        self.run_dir = run_dir
        self.log_format = log_format
        self.run_id = new_run_id()
        self.endpoints = Endpoints(run_dir, self.run_id)
        self.ctx = zmq.Context()
        self.control: RouterSocket | None = None
        self.rings: list[ShmRing] = []
        self.stages: dict[str, StageProcess] = {}
        self.signals: list[int] = []
        self.loads_sent_at = 0.0
        self.dist_ports: list[int] = []  # torch.distributed port of each engine group
        self.info: RunInfo | None = None  # run.json, once the model is prepared

    # -- start ---------------------------------------------------------------------------------

    def check_run_dir(self) -> None:
        run_file = self.run_dir / RUN_FILE
        if run_file.exists():
            try:
                other = read_run_info(self.run_dir)
                os.kill(other.supervisor_pid, 0)
            except (ProcessLookupError, msgspec.DecodeError, msgspec.ValidationError, OSError):
                run_file.unlink(missing_ok=True)  # a dead run's leftovers
            else:
                raise GiveUp(
                    f"a Brigade run is already live in {self.run_dir} (supervisor pid {other.supervisor_pid}); "
                    "stop it first or pass --run-dir"
                )
        for stale in self.run_dir.glob("*.sock"):
            stale.unlink(missing_ok=True)

    def check_layout(self) -> None:
        """Refuse a device layout this host cannot run, before anything starts."""
        engine = self.config.engine
        num_workers = engine.data_parallel * engine.tensor_parallel
        if engine.devices and len(engine.devices) != num_workers:
            raise GiveUp(
                f"engine.devices lists {len(engine.devices)} devices but data_parallel x tensor_parallel = "
                f"{engine.data_parallel} x {engine.tensor_parallel} = {num_workers} workers need one each"
            )
        if len(set(engine.devices)) != len(engine.devices):
            raise GiveUp(f"engine.devices has duplicates: {engine.devices}")
        if engine.device != "cuda":
            return
        count = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip
        present = int(count.stdout.strip() or 0) if count.returncode == 0 else 0
        wanted = engine.devices or list(range(num_workers))
        missing = [d for d in wanted if d >= present]
        if missing:
            raise GiveUp(
                f"engine.device is cuda and the layout needs devices {wanted}, but this host has {present} "
                f"CUDA device(s): {missing} missing. Lower data_parallel / tensor_parallel or set engine.devices."
            )

    def prepare_model(self) -> Path:
        """Convert the model once (cached) in a child, so the supervisor never imports torch."""
        model = self.config.model
        log.info("preparing model %s", model.path or "(embedded SmolLM2-135M-Instruct)")
        code = (
            "import sys; from pathlib import Path; from services.gpu_worker.loader import prepare_model; "
            "print(prepare_model(sys.argv[1] or None, Path(sys.argv[2]) if sys.argv[2] else None))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, model.path, model.cache_dir],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=False,
        )
        if done.returncode != 0:
            raise GiveUp(f"could not prepare model {model.path or '(embedded)'} (exit {done.returncode})")
        return Path(done.stdout.strip().splitlines()[-1])

    def create_rings(self) -> None:
        engine = self.config.engine
        for group in range(engine.data_parallel):
            self.rings.append(
                ShmRing.create(
                    self.endpoints.step_ring(group), RING_SLOTS, step_slot_bytes(self.config), engine.tensor_parallel
                )
            )
            self.rings.append(
                ShmRing.create(self.endpoints.result_ring(group), RING_SLOTS, result_slot_bytes(self.config), 1)
            )

    def add_stage(self, kind: str, index: int, group: int = -1, rank: int | None = None) -> StageProcess:
        name = f"{kind}-{index}" + (f"-{rank}" if rank is not None else "")
        argv = [sys.executable, "-m", f"services.{kind}", "--run-dir", str(self.run_dir)]
        argv += ["--log-format", self.log_format, "--index", str(index)]
        env = {
            **os.environ,
            "PROMETHEUS_MULTIPROC_DIR": str(self.run_dir / METRICS_DIR),
            SUPERVISOR_PID_ENV: str(os.getpid()),
        }
        if rank is not None:
            argv += ["--rank", str(rank)]
            env[DIST_PORT_ENV] = str(self.dist_ports[group])
            engine = self.config.engine
            if engine.device == "cuda":
                devices = engine.devices or list(range(engine.data_parallel * engine.tensor_parallel))
                env["CUDA_VISIBLE_DEVICES"] = str(devices[group * engine.tensor_parallel + rank])
        stage = StageProcess(name, kind, argv, env, group=group)
        self.stages[name] = stage
        return stage

    def plan_stages(self) -> None:
        engine = self.config.engine
        self.dist_ports = [free_tcp_port() for _ in range(engine.data_parallel)]
        for j in range(self.config.detokenizer.replicas):
            self.add_stage("detokenizer", j)
        for g in range(engine.data_parallel):
            self.add_stage("scheduler", g, group=g)
            for r in range(engine.tensor_parallel):
                self.add_stage("gpu_worker", g, group=g, rank=r)
        for i in range(self.config.frontend.replicas):
            self.add_stage("tokenizer", i)

    def spawn(self, stage: StageProcess) -> None:
        stage.process = subprocess.Popen(stage.argv, env=stage.env, start_new_session=True, cwd=Path(__file__).parent)
        stage.is_ready = False
        stage.state = "starting"
        stage.started_at = time.monotonic()
        stage.last_beat = stage.started_at
        stage.progress, stage.progress_at = -1, stage.started_at
        stage.load, stage.rate_at, stage.has_work = m.StageLoad(), 0.0, False
        stage.restart_at = None
        log.info("started %s (pid %d)", stage.name, stage.pid)

    def serve_metrics(self) -> None:
        """/metrics: the frontends' request metrics (multiprocess files) plus the stage gauges."""
        port = self.config.supervisor.metrics_port
        if not port:
            return
        registry = CollectorRegistry()
        MultiProcessCollector(registry, str(self.run_dir / METRICS_DIR))
        registry.register(StageCollector(self))
        start_http_server(port, registry=registry)
        log.info("metrics at http://localhost:%d/metrics", port)

    def start(self) -> None:
        self.check_run_dir()
        self.check_layout()
        swept = sweep_stale_runs()
        if swept:
            log.info("swept %d shared-memory objects of dead runs", len(swept))
        model_dir = self.prepare_model()
        self.create_rings()
        metrics_dir = self.run_dir / METRICS_DIR
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(mode=0o700)
        self.serve_metrics()
        self.control = RouterSocket(self.ctx, self.endpoints.supervisor(), CONTROL_UP, CONTROL_DOWN)
        self.info = RunInfo(
            run_id=self.run_id,
            supervisor_pid=os.getpid(),
            model_dir=str(model_dir),
            model=self.config.model.path or "SmolLM2-135M-Instruct",
            frontends=[self.endpoints.frontend(i) for i in range(self.config.frontend.replicas)],
            config=self.config,
        )
        write_run_info(self.run_dir, self.info)
        self.plan_stages()
        for stage in self.stages.values():
            self.spawn(stage)
        deadline = time.monotonic() + self.config.supervisor.start_timeout_s
        last_note = 0.0
        while not all(s.is_ready for s in self.stages.values()):
            if self.signals:
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                waiting = [s.name for s in self.stages.values() if not s.is_ready]
                raise GiveUp(f"stages did not come up within {self.config.supervisor.start_timeout_s:.0f}s: {waiting}")
            self.tick()
            if time.monotonic() - last_note > 5:
                waiting = [s.name for s in self.stages.values() if not s.is_ready]
                log.info("waiting for %d stage(s) to come up: %s", len(waiting), ", ".join(waiting))
                last_note = time.monotonic()
        self.info = msgspec.structs.replace(self.info, is_ready=True)
        write_run_info(self.run_dir, self.info)
        client = f"python -m client --run {self.run_dir}"
        print(f"Brigade ready: {len(self.stages)} stages, run {self.run_id} in {self.run_dir}", flush=True)
        print(f"  try: {client} chat 'Hello!'    or    {client} generate 'Once upon a time' --json", flush=True)

    # -- watch ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """One round of watching: control messages, exits, hangs, due restarts, status file."""
        self.read_control(0.1)
        now = time.monotonic()
        policy = self.config.supervisor
        for stage in self.stages.values():
            if stage.restart_at is not None:
                if now >= stage.restart_at:
                    self.spawn(stage)
                continue
            code = stage.process.poll() if stage.process else None
            if code is not None:
                self.on_exit(stage, f"exited with code {code}")
            elif stage.is_ready and now - stage.last_beat > policy.hang_timeout_s:
                self.on_exit(stage, f"no heartbeat for {now - stage.last_beat:.0f}s", kill=True)
            elif stage.is_ready and stage.has_work and now - stage.progress_at > policy.hang_timeout_s:
                self.on_exit(stage, f"no progress for {now - stage.progress_at:.0f}s with work pending", kill=True)
        self.write_status()
        if now - self.loads_sent_at >= policy.heartbeat_interval_s:
            self.send_group_loads()
            self.loads_sent_at = now

    def send_group_loads(self) -> None:
        loads = [0.0] * self.config.engine.data_parallel
        for stage in self.stages.values():
            if stage.kind == "scheduler" and stage.group < len(loads):
                loads[stage.group] = stage.load.num_running + stage.load.num_waiting + stage.load.kv_usage
        message = m.GroupLoads(loads)
        for stage in self.stages.values():
            if stage.kind == "tokenizer" and stage.is_ready:
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
            if stage is None or message.pid != stage.pid:
                continue  # a late message from a process we already replaced
            now = time.monotonic()
            stage.last_beat = now
            if isinstance(message, m.Ready):
                self.on_ready(stage)
            else:
                if message.progress != stage.progress:
                    stage.progress, stage.progress_at = message.progress, now
                new_tokens = message.load.tokens_total - stage.load.tokens_total
                if stage.rate_at and new_tokens >= 0:
                    instant = new_tokens / max(now - stage.rate_at, 1e-3)
                    stage.tokens_rate = 0.7 * stage.tokens_rate + 0.3 * instant
                stage.rate_at = now
                stage.load = message.load
                stage.has_work = message.has_work

    def on_ready(self, stage: StageProcess) -> None:
        was_restart = stage.num_restarts > 0
        stage.is_ready = True
        stage.state = "running"
        log.info("%s up (pid %d)%s", stage.name, stage.pid, " after restart" if was_restart else "")
        if not was_restart:
            return
        if stage.kind == "detokenizer":
            # The frontends re-drive the shard: only their journals still know the requests the
            # scheduler finished whose last text died with the detokenizer.
            shard = m.ResubmitShard(int(stage.name.rsplit("-", 1)[1]), self.config.detokenizer.replicas)
            for other in self.stages.values():
                if other.kind == "tokenizer":
                    self.command(other, shard)
        elif stage.kind == "scheduler":
            for other in self.stages.values():
                if other.kind == "tokenizer":
                    self.command(other, m.ResubmitAll(stage.group))

    def command(self, stage: StageProcess, message: m.ControlDown) -> None:
        assert self.control is not None
        self.control.send(stage.name.encode(), message)

    def on_exit(self, stage: StageProcess, reason: str, kill: bool = False) -> None:
        if kill and stage.process and stage.process.poll() is None:
            os.killpg(stage.process.pid, signal.SIGKILL)
            stage.process.wait()
        log.warning("%s (pid %d) %s", stage.name, stage.pid, reason)
        self.schedule_restart(stage, reason)
        # Workers handshake with one scheduler, and tensor-parallel ranks wait on each other in
        # collectives: either loss takes the group's other workers down with it.
        is_group_loss = stage.kind == "scheduler" or (
            stage.kind == "gpu_worker" and self.config.engine.tensor_parallel > 1
        )
        if not is_group_loss:
            return
        for other in self.stages.values():
            if other.kind == "gpu_worker" and other.group == stage.group and other.restart_at is None:
                if other.process and other.process.poll() is None:
                    os.killpg(other.process.pid, signal.SIGKILL)
                    other.process.wait()
                self.schedule_restart(other, f"{stage.name} {reason}")

    def schedule_restart(self, stage: StageProcess, reason: str) -> None:
        policy = self.config.supervisor
        now = time.monotonic()
        stage.restarts.append(now)
        while stage.restarts and now - stage.restarts[0] > policy.restart_period_s:
            stage.restarts.popleft()
        if len(stage.restarts) > policy.restart_intensity:
            raise GiveUp(
                f"{stage.name} failed {len(stage.restarts)} times within {policy.restart_period_s:.0f}s "
                f"(last: {reason}); giving up"
            )
        stage.num_restarts += 1
        backoff = min(policy.backoff_initial_s * 2 ** (len(stage.restarts) - 1), policy.backoff_max_s)
        stage.restart_at = now + backoff
        stage.is_ready = False
        stage.state = "restarting"
        log.info("restarting %s in %.1fs (restart %d)", stage.name, backoff, stage.num_restarts)

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
            }
            for s in self.stages.values()
        ]
        tmp = self.run_dir / (STATUS_FILE + ".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.replace(self.run_dir / STATUS_FILE)

    def watch(self) -> None:
        while not self.signals:
            self.tick()
            if self.is_reload_requested or self.config_file_changed():
                self.is_reload_requested = False
                self.reload()

    def config_file_changed(self) -> bool:
        if not self.config_path:
            return False
        try:
            mtime = Path(self.config_path).stat().st_mtime
        except OSError:
            return False
        changed, self.config_mtime = mtime != self.config_mtime, mtime
        return changed

    # -- hot reload ----------------------------------------------------------------------------

    def reload(self) -> None:
        """Apply what is safe live (log level, replica counts of frontends and detokenizers,
        the overload bound); log what needs a restart instead."""
        try:
            new = load_config(self.config_path, self.overrides)
        except ConfigError as exc:
            log.error("reload refused, config unchanged: %s", exc)
            return
        old = self.config
        live = {
            "supervisor.log_level",
            "frontend.replicas",
            "frontend.default_max_tokens",
            "detokenizer.replicas",
            "engine.max_num_waiting",
        }
        changed = diff_fields(old, new)
        for path in sorted(set(changed) - live):
            log.warning("reload: %s changed but needs a restart to take effect; keeping the old value", path)
        if not set(changed) & live:
            log.info("reload: nothing to apply live")
            return
        applied = msgspec.structs.replace(
            old,
            supervisor=msgspec.structs.replace(old.supervisor, log_level=new.supervisor.log_level),
            frontend=msgspec.structs.replace(
                old.frontend, replicas=new.frontend.replicas, default_max_tokens=new.frontend.default_max_tokens
            ),
            detokenizer=msgspec.structs.replace(old.detokenizer, replicas=new.detokenizer.replicas),
            engine=msgspec.structs.replace(old.engine, max_num_waiting=new.engine.max_num_waiting),
        )
        logging.getLogger().setLevel(applied.supervisor.log_level)
        self.rescale(applied)
        log.info("reload applied: %s", ", ".join(sorted(set(changed) & live)))

    def publish_config(self, config: Config) -> None:
        """New stages read run.json at start; clients read the frontend list from it."""
        self.config = config
        self.info = msgspec.structs.replace(
            self.info,
            config=config,
            frontends=[self.endpoints.frontend(i) for i in range(config.frontend.replicas)],
        )
        write_run_info(self.run_dir, self.info)

    def reconfigure(self) -> None:
        message = m.Reconfigure(
            log_level=self.config.supervisor.log_level,
            num_detokenizers=self.config.detokenizer.replicas,
            num_frontends=self.config.frontend.replicas,
            max_num_waiting=self.config.engine.max_num_waiting,
            default_max_tokens=self.config.frontend.default_max_tokens,
        )
        for stage in self.stages.values():
            self.command(stage, message)

    def wait_ready(self, stages: list[StageProcess]) -> None:
        deadline = time.monotonic() + self.config.supervisor.start_timeout_s
        while not all(s.is_ready for s in stages):
            if time.monotonic() > deadline or self.signals:
                raise GiveUp(f"stages not ready in time: {[s.name for s in stages if not s.is_ready]}")
            self.tick()

    def retire(self, stages: list[StageProcess]) -> None:
        for stage in stages:
            del self.stages[stage.name]
            if stage.process and stage.process.poll() is None:
                os.killpg(stage.process.pid, signal.SIGTERM)
        for stage in stages:
            if stage.process:
                try:
                    stage.process.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(stage.process.pid, signal.SIGKILL)
                    stage.process.wait()
            log.info("retired %s", stage.name)

    def rescale(self, config: Config) -> None:
        """Change replica counts without dropping a request: new replicas start before anyone
        routes to them; removed ones stop only after everyone routes around them."""
        old_frontends, old_detoks = self.config.frontend.replicas, self.config.detokenizer.replicas
        self.publish_config(config)
        added = [self.add_stage("detokenizer", j) for j in range(old_detoks, config.detokenizer.replicas)]
        added += [self.add_stage("tokenizer", i) for i in range(old_frontends, config.frontend.replicas)]
        for stage in added:
            self.spawn(stage)
        self.wait_ready(added)
        # Schedulers move every live request to its new detokenizer shard (full history, so the
        # new shard rebuilds its text; receivers drop what they already have by position).
        self.reconfigure()
        removed_frontends = [self.stages[f"tokenizer-{i}"] for i in range(config.frontend.replicas, old_frontends)]
        for stage in removed_frontends:
            self.command(stage, m.Shutdown(self.config.supervisor.drain_timeout_s))
        deadline = time.monotonic() + self.config.supervisor.drain_timeout_s
        while any(s.load.num_in_flight for s in removed_frontends) and time.monotonic() < deadline:
            self.read_control(0.2)
        removed = removed_frontends + [
            self.stages[f"detokenizer-{j}"] for j in range(config.detokenizer.replicas, old_detoks)
        ]
        self.read_control(1.0)  # let in-flight batches to the old shards land first
        self.retire(removed)

    # -- stop ----------------------------------------------------------------------------------

    def drain(self) -> None:
        """Let in-flight requests finish, up to the grace period; a second signal cuts it short."""
        frontends = [s for s in self.stages.values() if s.kind == "tokenizer"]
        for stage in frontends:
            self.command(stage, m.Shutdown(self.config.supervisor.drain_timeout_s))
        deadline = time.monotonic() + self.config.supervisor.drain_timeout_s
        num_signals = len(self.signals)
        while time.monotonic() < deadline and len(self.signals) == num_signals:
            self.read_control(0.2)
            in_flight = sum(s.load.num_in_flight for s in frontends)
            if in_flight == 0:
                return
        log.info("drain ended with requests still in flight")

    def stop(self) -> None:
        """Stop stages in order, unlink every shared-memory object and socket file."""
        order = ["tokenizer", "scheduler", "gpu_worker", "detokenizer"]
        for kind in order:
            group = [s for s in self.stages.values() if s.kind == kind and s.process and s.process.poll() is None]
            for stage in group:
                os.killpg(stage.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for stage in group:
                try:
                    stage.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(stage.process.pid, signal.SIGKILL)
                    stage.process.wait()
        for ring in self.rings:
            ring.close()
            ring.unlink()
        self.ctx.destroy(linger=0)
        for path in [*self.run_dir.glob("*.sock"), self.run_dir / RUN_FILE, self.run_dir / STATUS_FILE]:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir / METRICS_DIR, ignore_errors=True)
        log.info("stopped; shared memory and sockets removed")


def diff_fields(old: msgspec.Struct, new: msgspec.Struct, prefix: str = "") -> list[str]:
    """Dotted paths of the fields whose values differ between two configs."""
    paths = []
    for spec in msgspec.structs.fields(old):
        a, b = getattr(old, spec.name), getattr(new, spec.name)
        if isinstance(a, msgspec.Struct):
            paths += diff_fields(a, b, f"{prefix}{spec.name}.")
        elif a != b:
            paths.append(f"{prefix}{spec.name}")
    return paths


def status(run_dir: Path, as_json: bool, once: bool) -> int:
    path = run_dir / STATUS_FILE
    while True:
        if not path.exists():
            print(f"no live Brigade run in {run_dir}", file=sys.stderr)
            return 1
        rows = json.loads(path.read_text())
        if as_json:
            print(json.dumps(rows))
            return 0
        header = f"{'stage':<18}{'pid':>8}  {'state':<11}{'restarts':>8}{'uptime':>9}{'queue':>7}{'running':>8}{'kv':>7}{'tok/s':>8}"
        lines = [header, "-" * len(header)]
        for r in rows:
            lines.append(
                f"{r['name']:<18}{r['pid']:>8}  {r['state']:<11}{r['restarts']:>8}{r['uptime_s']:>8.0f}s"
                f"{r['queue_depth']:>7}{r['running']:>8}{r['kv_usage'] * 100:>6.1f}%{r['tokens_per_s']:>8.1f}"
            )
        if once:
            print("\n".join(lines))
            return 0
        print("\033[2J\033[H" + "\n".join(lines), flush=True)
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":
        parser = argparse.ArgumentParser(prog="supervisor.py status")
        parser.add_argument("--run", type=Path, default=default_run_dir())
        parser.add_argument("--json", action="store_true", help="print one JSON list and exit")
        parser.add_argument("--once", action="store_true", help="print the table once instead of refreshing")
        args = parser.parse_args(argv[1:])
        return status(args.run, args.json, args.once)
    parser = argparse.ArgumentParser(prog="supervisor.py", description="Run a Brigade serving pipeline.")
    parser.add_argument("--config", help="YAML config file (see docs/config.md)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config field")
    parser.add_argument("--run-dir", type=Path, default=None, help="run directory (default: per-user)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    setup_logging("supervisor", config.supervisor.log_level, args.log_format)
    run_dir = make_run_dir(args.run_dir or default_run_dir())
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
