"""A run's resources, which its supervisor creates and alone removes (docs/architecture.md
invariants 6 and 9): the run dir (claimed with a lock), run.json, the gateway port, the engine
groups' shared-memory rings, and the network plan with the endpoints it gives. Errors that stop a
start or a change are `Refused`, with what to do about them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import posix_ipc

from ipc.config import EMBEDDED_MODEL, Config, served_model_name
from ipc.endpoints import SHM_PREFIX, Endpoints, NetworkPlan, free_port_base
from ipc.keys import SECRET_SUFFIX, BadKeyFile, create_key_files, load_run_keys
from ipc.ports import PORT_SPAN
from ipc.shm import RingGeometryError, RunLock, ShmRing, sweep_stale_runs
from ipc.step_plan import STEP_PLAN, STEP_RESULT, plan_limits, result_limits
from ipc.topology import StageSpec, Topology
from services.audit import AUDIT_FILE
from services.common.pooling import embedding_of
from services.common.vision_language import language_model_config
from services.metrics import METRICS_DIR
from services.privileges import resolve_user
from services.stage import RESPONSES_DIR, RUN_FILE, STREAMS_DIR, RunInfo, lora_table_files, write_run_info
from services.stage_rows import STATUS_FILE
from supervision.preflight import Refused, check_hosts
from supervision.stages import REPO_ROOT, RingSpec

RING_SLOTS = 2  # the scheduler keeps two steps in flight (services/scheduler/pipeline.py)
CURVE_DIR = "curve"  # the run's own key set, when network.keys_dir names none
RUN_DIR_LOCK = "supervisor.lock"  # flocked by the run dir's live supervisor (Run.claim_run_dir)
PREPARE_TIMEOUT_S = 3600.0  # converting a large GGUF takes minutes; a hung conversion must not hang the start

log = logging.getLogger("supervisor")


def step_slot_bytes(config: Config, vocab_size: int) -> int:
    """Bytes of one step-plan slot at the configured maxima (ipc/step_plan.py declares the arrays),
    for a model of `vocab_size` (every row constrained: a full grammar bitmask)."""
    engine = config.engine
    max_model_len = config.model.max_model_len
    limits = plan_limits(
        engine.max_num_seqs, engine.max_num_batched_tokens, max_model_len, engine.block_size, vocab_size
    )
    return STEP_PLAN.slot_bytes(limits)


def result_slot_bytes(config: Config, pooled_width: int = 0) -> int:
    """Bytes of one step-result slot; `pooled_width`: an embedding model's vector width (0: none)."""
    return STEP_RESULT.slot_bytes(
        result_limits(config.engine.max_num_seqs, config.engine.max_num_batched_tokens, pooled_width)
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


def prepare_model(config: Config) -> Path:
    """The model as an HF-format dir, converted once (cached) in a child process, so that the
    supervisor never imports torch; a draft model (speculative.model) is checked against it there."""
    model = config.model
    what = model.path or f"(embedded {EMBEDDED_MODEL})"
    log.info("preparing model %s", what)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "services.gpu_worker.prepare", model.path, model.cache_dir, model.revision,
             *([config.speculative.model] if config.speculative.method == "draft_model" else [])],
            capture_output=True, text=True, cwd=REPO_ROOT, check=False, timeout=PREPARE_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise Refused(f"could not prepare model {what}: no result within {PREPARE_TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        sys.stderr.write(done.stderr)
        raise Refused(f"could not prepare model {what}: {lines[-1] if lines else f'exit {done.returncode}'}")
    return Path(done.stdout.strip().splitlines()[-1])


# What a stage needs once it is another user: the interpreter and its standard library (imported
# lazily: a codec, say), every directory it imports from (uvicorn, transformers and others import
# modules as they first need them, after the drop), and to read the model and reach the run dir.
USER_PROBE = "import encodings.unicode_escape, os, sys; [os.listdir(p) for p in sys.argv[1:]]"


def import_dirs() -> list[Path]:
    """The directories this process imports from (the code and its packages): the stages'."""
    return [Path(entry) for entry in sys.path if entry and os.path.isdir(entry)]


def check_user_can_run(name: str, uid: int, gid: int, paths: list[Path]) -> None:
    """Refuse, with what to fix, a supervisor.run_as user who could not run the stages: one who
    cannot read this Python installation, the model or the run dir's parent."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", USER_PROBE, *map(str, paths)],
            user=uid, group=gid, extra_groups=[], capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
        error = done.stderr.strip().splitlines()[-1] if done.returncode else ""
    except OSError as exc:
        error = f"{sys.executable}: {exc.strerror}"
    if error:
        raise Refused(
            f"supervisor.run_as: user {name!r} could not run the stages ({error}); the Python installation, "
            f"the code, the model and the run dir's parent must be readable by that user"
        )


class Run:
    """What one supervisor holds for its run; `release` removes exactly that."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.endpoints = Endpoints(run_dir, run_id)  # ipc:// until plan_network
        self.network_plan = NetworkPlan()
        self.client_keys_file = ""
        self.info: RunInfo | None = None  # run.json, once the model is prepared
        self.rings: list[ShmRing] = []
        self.run_dir_lock: int | None = None  # claim_run_dir: the run dir's files are ours
        self.run_lock: RunLock | None = None  # the run's shared memory is alive (ipc/shm.py)
        self.gateway_port: socket.socket | None = None  # claim_gateway_port

    # -- claims ------------------------------------------------------------------------------

    def claim_run_dir(self) -> None:
        """Take the run dir for this run: an flock on its lock file, held until the supervisor
        exits (the kernel drops it even on SIGKILL), tells a live run, in whatever PID namespace,
        from a dead one's leftovers, from the first moment (run.json comes only after the model
        is prepared). Raises Refused, having touched nothing, while another supervisor holds it."""
        fd = os.open(self.run_dir / RUN_DIR_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise Refused(
                f"a Brigade run is already live in {self.run_dir} (supervisor pid {holder}); "
                "stop it first or pass --run-dir"
            ) from None
        self.run_dir_lock = fd
        try:  # the holder's pid, for the refusal above: nice to have, on a full disk too
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        # A dead run's leftovers; its tables of LoRA adapters would replace this run's lora.adapters,
        # and its stored responses (its clients' conversations) are no business of this run's.
        for stale in [self.run_dir / RUN_FILE, *self.run_dir.glob("*.sock"), *lora_table_files(self.run_dir)]:
            stale.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir / RESPONSES_DIR, ignore_errors=True)
        shutil.rmtree(self.run_dir / STREAMS_DIR, ignore_errors=True)

    def claim_shared_memory(self) -> None:
        """Before any shared memory of the run exists: its lock tells sweeps that it is alive;
        then remove what dead runs left in /dev/shm."""
        self.run_lock = RunLock(self.run_id)
        swept = sweep_stale_runs()
        if swept:
            log.info("swept %d shared-memory objects of dead runs", len(swept))

    def claim_gateway_port(self, config: Config) -> None:
        """Hold gateway.port for this run's gateway replicas (they share it through SO_REUSEPORT,
        which would as well let another run's replicas in, and the kernel split the connections
        between the runs): refused when another Brigade run holds it or anything listens on it.
        On a Ray cluster the gateways may run on another host than this one: not checked there."""
        gateway = config.gateway
        if self.gateway_port is not None or not gateway.replicas or config.cluster.backend != "local":
            return
        try:
            lock = gateway_port_lock(gateway.port)
        except OSError:
            raise Refused(
                f"gateway.port {gateway.port} is already served by another Brigade run on this host; "
                "set gateway.port to another port (or stop that run)"
            ) from None
        try:
            probe_port(gateway.host, gateway.port)
        except OSError as exc:
            lock.close()
            raise Refused(
                f"gateway.port {gateway.port} on {gateway.host} is in use ({exc.strerror}); "
                "set gateway.port to a free port"
            ) from None
        self.gateway_port = lock

    # -- links -------------------------------------------------------------------------------

    def plan_network(self, config: Config, hosts: dict[str, str]) -> None:
        """Ports and CURVE keys of the run's tcp:// links: the configured port base or a free one,
        and the keys of `network.keys_dir` or a fresh set in the run dir. `hosts` places stages
        on other hosts (stage name -> address; the rest run on `network.host`): their links go
        over tcp:// whatever `network.transport` says. None of this for a one-host ipc:// run."""
        network = config.network
        if network.transport != "tcp" and not hosts:
            self.endpoints = Endpoints(self.run_dir, self.run_id, network)
            return
        check_hosts(network, hosts)
        try:
            port_base = network.port_base or free_port_base(network.bind_host or network.host)
            keys_dir = Path(network.keys_dir) if network.keys_dir else self.run_dir / CURVE_DIR
            keys = None
            if network.curve:
                keys = load_run_keys(keys_dir) if network.keys_dir else create_key_files(keys_dir)
        except (BadKeyFile, OSError) as exc:
            raise Refused(f"network: {exc}") from None
        self.network_plan = NetworkPlan(port_base, hosts, keys)
        self.client_keys_file = str(keys_dir / f"client{SECRET_SUFFIX}") if keys else ""
        self.endpoints = Endpoints(self.run_dir, self.run_id, network, self.network_plan)
        first, last, curve = port_base, port_base + PORT_SPAN - 1, " with CURVE" if keys else ""
        log.info("tcp:// links on ports %d-%d%s", first, last, curve)

    def move_stages(self, config: Config, names: list[str], address: str) -> dict[str, str]:
        """Stages `names` (an engine group's) now run on a node at `address`: re-plan the links
        whose server is among them (same ports and CURVE keys, the new address) and publish them
        in run.json for their new processes. Returns the run's stage hosts now. Raises Refused
        when the links cannot follow: ipc:// because every stage ran on this host at start, or
        an address that the checks at start would refuse."""
        network = config.network
        if self.endpoints.is_single_host and network.transport != "tcp":
            raise Refused(
                f"{', '.join(names)} are placed on a node at {address}, but this run's links are "
                "ipc:// (all its stages were on one host at start): set network.transport: tcp for a run "
                "whose engine groups may move to other hosts"
            )
        hosts = {**self.network_plan.hosts, **dict.fromkeys(names, address)}
        check_hosts(network, hosts)
        self.network_plan = msgspec.structs.replace(self.network_plan, hosts=hosts)
        self.endpoints = Endpoints(self.run_dir, self.run_id, network, self.network_plan)
        if self.info is not None:
            self.info = msgspec.structs.replace(self.info, network=self.network_plan)
            write_run_info(self.run_dir, self.info)
        return hosts

    # -- run.json ------------------------------------------------------------------------------

    def publish(
        self,
        config: Config,
        model_dir: Path | None = None,
        is_ready: bool | None = None,
        max_model_len: int = 0,
        topology: Topology | None = None,
    ) -> None:
        """run.json, which new stages read at start and clients read the tokenizers from: first
        with `model_dir`, the longest sequence served (`max_model_len`, 0 = the config's) and the
        run's `topology`, then again for a new config or once ready (`publish_topology` for a new
        topology). Raises Refused when it cannot be written (a full disk), and then nothing
        changed."""
        if self.info is None:
            assert model_dir is not None, "the first run.json names the model"
            keys = self.network_plan.keys
            info = RunInfo(
                run_id=self.run_id,
                supervisor_pid=os.getpid(),
                model_dir=str(model_dir),
                model=served_model_name(config),
                tokenizers=[],
                config=config,
                network=self.network_plan,
                curve_server_key=keys.server_public if keys else "",
                curve_client_keys=self.client_keys_file,
                max_model_len=max_model_len,
            )
        else:
            info = self.info
        info = msgspec.structs.replace(
            info,
            config=config,
            topology=info.topology if topology is None else topology,
            tokenizers=[str(self.endpoints.tokenizer(i)) for i in range(config.tokenizer.replicas)],
            is_ready=info.is_ready if is_ready is None else is_ready,
        )
        try:
            write_run_info(self.run_dir, info)
        except OSError as exc:
            raise Refused(f"could not write {self.run_dir / RUN_FILE}: {exc.strerror}") from None
        self.info = info

    def publish_topology(self, topology: Topology) -> None:
        """The run's new topology in run.json, for the stages that start or restart from now on:
        they link and route by it, not by the config (which a hot reload changes before the
        stages it adds are up). A run.json that cannot be written keeps the one before: a stage
        started meanwhile hears the new one at its Ready (TopologyChanged) all the same."""
        assert self.info is not None  # published at start
        info = msgspec.structs.replace(self.info, topology=topology)
        try:
            write_run_info(self.run_dir, info)
        except OSError as exc:
            log.error("could not write the new topology to %s: %s", self.run_dir / RUN_FILE, exc.strerror)
            return
        self.info = info

    # -- shared memory ---------------------------------------------------------------------------

    def hand_over(self, config: Config) -> None:
        """Started as root with supervisor.run_as: give the run dir, what is in it and the run's
        shared memory (rings and their semaphores) to that user, whom the stages become
        (services/privileges.py) and who must then reach all of them. Called before stages are
        spawned (the files made later, run.json included, take the run dir's owner)."""
        if not config.supervisor.run_as or os.geteuid() != 0:
            return
        uid, gid = resolve_user(config.supervisor.run_as)
        assert self.info is not None  # published first
        needed = [self.run_dir.parent, Path(self.info.model_dir), *import_dirs()]
        check_user_can_run(config.supervisor.run_as, uid, gid, needed)
        audit = self.run_dir / AUDIT_FILE
        if not config.observability.audit_log and not audit.exists():
            audit.touch(0o600)  # the stages append to it too: not a file only root may write
        for path in [self.run_dir, *self.run_dir.rglob("*")]:
            os.lchown(path, uid, gid)
        for path in Path("/dev/shm").glob(f"*{SHM_PREFIX}{self.run_id}-*"):
            os.chown(path, uid, gid)

    def create_rings(
        self,
        config: Config,
        model_dir: Path,
        groups: range,
        create: Callable[[list[RingSpec]], list[ShmRing]],
    ) -> None:
        """The step and result rings of engine groups `groups`, made by `create` (the stage set,
        which knows the host of each group)."""
        engine = config.engine
        # check_model has read this config.json already: it is there and well-formed.
        raw = language_model_config(json.loads((model_dir / "config.json").read_text()))
        vocab_size = raw["vocab_size"]
        # An embedding model's result slots carry each row's pooled vector.
        pooled_width = raw["hidden_size"] if embedding_of(config.model, model_dir) else 0
        specs = []
        for group in groups:
            step, result = self.endpoints.step_ring(group), self.endpoints.result_ring(group)
            specs.append(
                RingSpec(group, step, RING_SLOTS, step_slot_bytes(config, vocab_size), engine.tensor_parallel)
            )
            specs.append(RingSpec(group, result, RING_SLOTS, result_slot_bytes(config, pooled_width), 1))
        try:
            self.rings += create(specs)
        except (OSError, ValueError, OverflowError, posix_ipc.Error) as exc:
            is_size = getattr(exc, "errno", None) == errno.ENOMEM or (
                isinstance(exc, ValueError | OverflowError) and not isinstance(exc, RingGeometryError)
            )
            if not is_size:
                raise Refused(f"the engine groups' shared-memory rings could not be made: {exc}") from None
            # Sized by the config: an engine.max_num_seqs or model.max_model_len far past what the
            # host can map (ENOMEM, a size over the address space or posix_ipc's "size is
            # invalid") is the config's fault, not a bug.
            largest_slot = max(spec.slot_bytes for spec in specs)
            raise Refused(
                f"the engine groups' shared-memory rings could not be made ({exc}): each step slot "
                f"takes {largest_slot} bytes, {RING_SLOTS} slots a ring, at engine.max_num_seqs "
                f"{engine.max_num_seqs}, engine.max_num_batched_tokens {engine.max_num_batched_tokens} "
                f"and model.max_model_len {config.model.max_model_len}; lower them"
            ) from None

    def remove_rings(self, groups: range | None = None) -> None:
        """Unlink the rings of engine groups `groups` (retired), or all of them (the run ends)."""
        for ring in list(self.rings):
            if groups is None or any(
                ring.name in (self.endpoints.step_ring(g), self.endpoints.result_ring(g)) for g in groups
            ):
                ring.close()
                ring.unlink()
                self.rings.remove(ring)

    def remove_sockets(self, stages: Iterable[StageSpec]) -> None:
        """The ipc:// socket files that `stages` bound in the run dir, once a hot reload has
        retired them and they have stopped: nothing links to them any more, and they stayed until
        the run ended. tcp:// links have none; a file on another node's run dir goes with the
        cleanup of that node (supervision/ray_stages.py)."""
        bound_by = {
            "tokenizer": (Endpoints.tokenizer, Endpoints.tokenizer_in),
            "detokenizer": (Endpoints.detokenizer_in,),
            "scheduler": (Endpoints.scheduler_in, Endpoints.scheduler_workers),
            "encoder": (Endpoints.encoder,),
        }
        for stage in stages:
            for link in bound_by.get(stage.kind, ()):
                bind = link(self.endpoints, stage.index).bind
                path = Path(bind.removeprefix("ipc://"))
                if bind.startswith("ipc://") and path.parent == self.run_dir:
                    path.unlink(missing_ok=True)

    def remove_embedding_caches(self, num_encoders: int) -> None:
        """Unlink the embedding caches (ipc/embedding_cache.py) of encoder replicas 0 to
        `num_encoders` - 1, once the encoders have stopped: each encoder makes its own, and it
        outlives the encoder's restarts and its retirement by a hot reload (a request it encoded
        may still wait for its prefill), not the run."""
        for i in range(num_encoders):
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(self.endpoints.embedding_cache(i))

    # -- the end -------------------------------------------------------------------------------

    def release(self, keep_keys: bool) -> None:
        """Remove what is left of what this run created, once its stages have stopped and its
        rings are gone: the run's lock on its shared memory, and the run dir's sockets and files
        if it had claimed the run dir (a supervisor refused at start leaves the live run there
        untouched). `keep_keys`: the CURVE keys are the user's (network.keys_dir), not this run's."""
        if self.run_lock is not None:
            self.run_lock.release()  # last of the run's shared memory
        if self.gateway_port is not None:
            self.gateway_port.close()
        if self.run_dir_lock is None:
            return
        for path in [
            *self.run_dir.glob("*.sock"),
            self.run_dir / RUN_FILE,
            self.run_dir / STATUS_FILE,
            *lora_table_files(self.run_dir),
        ]:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir / METRICS_DIR, ignore_errors=True)
        shutil.rmtree(self.run_dir / RESPONSES_DIR, ignore_errors=True)  # its clients' conversations
        shutil.rmtree(self.run_dir / STREAMS_DIR, ignore_errors=True)
        if not keep_keys:
            shutil.rmtree(self.run_dir / CURVE_DIR, ignore_errors=True)  # this run's keys die with it
        # The lock file stays: unlinking it would let a supervisor that opened it meanwhile lock
        # a file nobody else can see any more.
        os.close(self.run_dir_lock)
        self.run_dir_lock = None
