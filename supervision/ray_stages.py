"""The stage set on a Ray cluster (`cluster.backend: ray`): Ray places, Brigade supervises.

Ray does what it is good at: each engine group (a scheduler and its tensor-parallel workers) is
one STRICT_PACK placement group, so its stages share a node, and with it /dev/shm for the step
rings; that node has the group's resources (`cluster.engine_resources`, `cluster.engine_cpus`,
a GPU per worker); when the node dies, Ray places the group again on a node with room. The
tokenizers, detokenizers and gateways go to the head node, or where `cluster.light_resources` are.

Each stage still runs as its own OS process, spawned exactly as the local StageSet spawns it, by
a small host actor (`StageHost`) on the stage's node. The supervisor sees it through
`RemoteProcess`, which has the part of Popen's interface StageSet uses (pid, poll, wait), so the
watch loop, the restart policy, the heartbeats, resubmission and hot reload stay Brigade's; an
actor that dies with its node reads as a process killed by SIGKILL, which Brigade restarts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import posix_ipc
import ray
from ray.autoscaler.sdk import request_resources
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ipc.config import Config, EngineConfig
from ipc.endpoints import DIST_PORT_ENV, SHM_PREFIX
from ipc.shm import SHM_DIR, ShmRing, unlink_ring
from ipc.topology import StageSpec
from services.metrics import METRICS_DIR, METRICS_DIR_ENV
from services.stage import PARENT_PID_ENV, RUN_FILE, lora_table_files
from supervision.preflight import Refused
from supervision.stages import REPO_ROOT, RingSpec, StageHandle, StageSet, free_tcp_port

POLL_INTERVAL_S = 0.2  # how often a stage's host is asked whether its process is still alive
START_WAIT_S = 30.0  # a message may come from a process whose host has not yet told us its pid
METRICS_GATHER_S = 2.0  # how often the Prometheus files of stages on other nodes are copied here
CALL_TIMEOUT_S = 30.0  # for the calls that stop and clean up (a dead node answers with an error)
NODE_LOST = -signal.SIGKILL  # a stage whose host died with its node was killed, not failing by itself
ENGINE_KINDS = ("scheduler", "gpu_worker")
FIRST_ROOM_S = 1.0  # engine groups not placed by then at start find no room: Ray's autoscaler is asked

log = logging.getLogger("supervisor")


def boot_id() -> str:
    """Tells hosts apart: Ray nodes on one machine (as in tests) share it, and so share the run
    directory and /dev/shm with the supervisor."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


# -- on the node --------------------------------------------------------------------------------


@ray.remote(num_cpus=0, max_restarts=0)  # a dead host is restarted by Brigade's policy, not Ray's
class StageHost:
    """Runs one stage process on its node, as the local StageSet runs one on the supervisor's
    host: `python -m services.<kind>` in a session of its own, its stderr passed through."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.last_line = ""
        self.metrics_dir: Path | None = None  # where its stage writes Prometheus files, off the head node

    def locate(self) -> str:
        """The address of the node Ray placed this host on."""
        return ray.util.get_node_ip_address()

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        run_file: bytes,
        supervisor_host: str,
        address: str,
        group: GroupSetup | None,
        head_node: str,
    ) -> dict[str, Any]:
        """Spawn the stage; `address` is where the run's links expect this node to be (what
        `locate` said, unless the node changed in between)."""
        here = ray.util.get_node_ip_address()
        if here != address:
            raise RuntimeError(f"this stage's node is at {here}, but the run's links have it at {address}")
        run_dir = Path(argv[argv.index("--run-dir") + 1])
        if boot_id() != supervisor_host:
            _materialize_run_dir(run_dir, run_file)
        env = {**os.environ, **env, PARENT_PID_ENV: str(os.getpid())}
        node = ray.get_runtime_context().get_node_id()
        if node != head_node:
            # A directory per node: the supervisor gathers each node's files (`read_metrics`)
            # into its own metrics dir, where a node's own could collide with another's pids.
            self.metrics_dir = run_dir / METRICS_DIR / f"node-{node}"
            self.metrics_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            env[METRICS_DIR_ENV] = str(self.metrics_dir)
        if group is not None:
            env[DIST_PORT_ENV] = str(group.prepare())
        # Ray's sync actors run their methods on the main thread, the one whose exit PDEATHSIG
        # follows: the stage (services/stage.py die_with_parent) dies with this actor.
        self.process = subprocess.Popen(
            [sys.executable, *argv], env=env, start_new_session=True, cwd=REPO_ROOT, stderr=subprocess.PIPE
        )
        threading.Thread(target=self._pump_stderr, args=(self.process.stderr,), daemon=True).start()
        return {"pid": self.process.pid, "node": node}

    def read_metrics(self) -> dict[str, bytes]:
        """The Prometheus multiprocess files of the run's stages on this node."""
        return read_node_metrics(self.metrics_dir) if self.metrics_dir else {}

    def poll(self) -> tuple[int | None, str]:
        assert self.process is not None
        return self.process.poll(), self.last_line

    def send_signal(self, sig: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def _pump_stderr(self, pipe: IO[bytes]) -> None:
        for line in pipe:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.buffer.write(line)
                sys.stderr.flush()
            if line.strip():
                self.last_line = line.decode("utf-8", "replace").strip()
        pipe.close()


def group_state_path(run_id: str, group: int) -> Path:
    """Where GroupSetup keeps an engine group's state on its node."""
    return Path(SHM_DIR) / f"{SHM_PREFIX}{run_id}-group-{group}.json"


def remove_group(ring_names: list[str], state_path: str) -> None:
    """On the node that held a retired engine group, once its stages have stopped: what
    GroupSetup made there (the rings, the state file). The run goes on, so this is not
    clean_node's sweep of the whole run."""
    for name in ring_names:
        unlink_ring(name)
    Path(state_path).unlink(missing_ok=True)


class GroupSetup:
    """What an engine group's stages need on the node that holds the group: its shared-memory
    rings and its torch.distributed port. Whichever stage of the group starts first on a node
    makes them; the others find them (under a lock, in a file named like the rings, so the same
    cleanup and the same sweep of dead runs remove it)."""

    def __init__(self, run_id: str, group: int, rings: list[RingSpec], dist_host: str) -> None:
        self.state_path = group_state_path(run_id, group)
        self.rings = rings
        self.dist_host = dist_host  # where rank 0 listens (Endpoints.dist_host: the node's address)

    def prepare(self) -> int:
        """The group's dist port on this node, after making sure its rings exist here."""
        fd = os.open(self.state_path, os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+") as state:
            fcntl.flock(state, fcntl.LOCK_EX)
            text = state.read()
            if text and json.loads(text)["dist_host"] == self.dist_host:
                return json.loads(text)["dist_port"]
            for spec in self.rings:
                with contextlib.suppress(posix_ipc.ExistentialError):  # left by an earlier host here
                    ShmRing.create(spec.name, spec.num_slots, spec.slot_bytes, spec.num_readers).close()
            # A group placed again at another address (nodes of one machine share /dev/shm) picks
            # its port afresh: the old one was free only on the old address.
            port = free_tcp_port(self.dist_host)
            state.seek(0)
            state.truncate()
            state.write(json.dumps({"dist_host": self.dist_host, "dist_port": port}))
            return port


def _materialize_run_dir(run_dir: Path, run_file: bytes) -> None:
    """On a host other than the supervisor's, the run directory a stage reads its run.json from."""
    from ipc.endpoints import make_run_dir

    make_run_dir(run_dir)
    (run_dir / METRICS_DIR).mkdir(mode=0o700, exist_ok=True)
    tmp = run_dir / f"{RUN_FILE}.{os.getpid()}.tmp"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        out.write(run_file)  # private, as the supervisor writes it: it may carry the run's keys
    tmp.replace(run_dir / RUN_FILE)


def clean_node(shm_prefix: str, run_dir: str, supervisor_host: str) -> list[str]:
    """Remove what the run left on one node: shared memory (rings, semaphores, group state) and,
    off the supervisor's host, the run directory's files."""
    removed = []
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(shm_prefix) or entry.startswith("sem." + shm_prefix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, entry))
                removed.append(entry)
    if boot_id() != supervisor_host:
        root = Path(run_dir)
        for path in [root / RUN_FILE, *root.glob("*.sock"), *lora_table_files(root)]:
            path.unlink(missing_ok=True)
        shutil.rmtree(root / METRICS_DIR, ignore_errors=True)
    return removed


def read_node_metrics(metrics_dir: Path) -> dict[str, bytes]:
    """The Prometheus multiprocess files in `metrics_dir`, each only its used part (the first 4
    bytes say how much of the preallocated file that is)."""
    files = {}
    for path in metrics_dir.glob("*.db"):
        with contextlib.suppress(OSError):
            data = path.read_bytes()
            if len(data) >= 8:
                files[path.name] = data[: max(8, int.from_bytes(data[:4], "little"))]
    return files


def write_node_metrics(metrics_dir: Path, node: str, files: dict[str, bytes]) -> None:
    """Copies of one node's Prometheus files (StageHost.read_metrics) in the run's metrics dir,
    their pids tagged with the node (`counter_123.db` -> `counter_<node>-123.db`), each replaced
    whole so that a scrape never reads half a file."""
    for name, data in files.items():
        head, _, pid = name.rpartition("_")
        if not head or "/" in name:
            continue  # not a multiprocess file's name
        tmp = metrics_dir / f".{name}.{node}.tmp"
        tmp.write_bytes(data)
        tmp.replace(metrics_dir / f"{head}_{node[:16]}-{pid}")


_clean_node = ray.remote(num_cpus=0)(clean_node)
_remove_group = ray.remote(num_cpus=0)(remove_group)


# -- in the supervisor --------------------------------------------------------------------------


class RemoteProcess:
    """A stage process on a Ray node, seen through its host actor with the part of Popen's
    interface that StageSet uses (pid, poll, wait): stop, kill and reap stay the local ones.

    It starts in two steps, neither of which blocks the supervisor: the host says where Ray
    placed it (`locate`), then `start(address)` spawns the process there, after the run's links
    have followed the node if it has a new address (RayStageSet.start_at)."""

    def __init__(self, host: ray.actor.ActorHandle, start: Callable[[str], ray.ObjectRef]) -> None:
        self.host = host
        self.start = start
        self.located: ray.ObjectRef | None = host.locate.remote()  # until Ray has placed the host
        self.started: ray.ObjectRef | None = None  # then until the host has spawned the process
        self.pid = 0
        self.node = ""
        self.returncode: int | None = None
        self.last_line = ""
        self._poll: ray.ObjectRef | None = None
        self._poll_at = 0.0

    @property
    def is_settled(self) -> bool:
        return self.located is None and self.started is None

    def settle(self, timeout: float = 0.0) -> bool:
        """Take the host's answers to `locate` and `start` if they came (within `timeout`);
        False while they have not."""
        deadline = time.monotonic() + timeout
        if self.located is not None:
            ready, _ = ray.wait([self.located], timeout=timeout)
            if not ready:
                return False
            try:
                address = ray.get(self.located)
                self.started = self.start(address)
            except RayActorError:
                self.returncode, self.last_line = NODE_LOST, "its Ray node (or host actor) died at start"
            except Refused as exc:  # the run's links cannot follow it there
                self.returncode, self.last_line = 1, str(exc)
            self.located = None
        if self.started is None:
            return True
        ready, _ = ray.wait([self.started], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
        try:
            info = ray.get(self.started)
        except RayActorError:
            self.returncode, self.last_line = NODE_LOST, "its Ray node (or host actor) died before it started"
        except RayError as exc:  # the host could not start it: a fault of the run, not of the node
            self.returncode, self.last_line = 1, str(exc).strip().splitlines()[-1]
        else:
            self.pid, self.node = info["pid"], info["node"]
        self.started = None
        return True

    def poll(self) -> int | None:
        if self.returncode is not None or not self.settle() or self.returncode is not None:
            return self.returncode
        now = time.monotonic()
        if self._poll is None:
            if now < self._poll_at:
                return None
            self._poll = self.host.poll.remote()
        ready, _ = ray.wait([self._poll], timeout=0)
        if not ready:
            return None
        answer, self._poll, self._poll_at = self._poll, None, now + POLL_INTERVAL_S
        try:
            code, self.last_line = ray.get(answer)
        except RayActorError:
            code, self.last_line = NODE_LOST, "its Ray node (or host actor) died"
        self.returncode = code
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"stage pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if not self.settle():
            self.release()  # still waiting for a node: there is no process to signal
            self.returncode = -sig
            return
        if self.returncode is not None:
            return
        with contextlib.suppress(RayError, GetTimeoutError):
            ray.get(self.host.send_signal.remote(sig), timeout=CALL_TIMEOUT_S)
        if sig == signal.SIGKILL:
            self.release()  # if the node no longer answers, its process goes with its actor

    def release(self) -> None:
        """End the host actor (and so, by PDEATHSIG, whatever is left of its process)."""
        with contextlib.suppress(RayError):
            ray.kill(self.host, no_restart=True)


class RayStageSet(StageSet):
    """StageSet whose processes run on a Ray cluster's nodes (see the module docstring)."""

    def __init__(self, config: Config, run_dir: Path, log_format: str, run_id: str) -> None:
        super().__init__(config, run_dir, log_format)
        self.cluster = config.cluster
        self.network = config.network
        self.run_id = run_id
        self.supervisor_host = boot_id()
        self.groups: list[PlacementGroup] = []
        self.placing: dict[int, ray.ObjectRef] = {}  # group -> its placement group's ready(), until ready
        self.requested_groups = 0  # the engine groups whose bundles Ray's autoscaler was last asked to hold
        self.rings: dict[int, list[RingSpec]] = {}
        self.head_node = ""
        self.head_address = ""
        self.addresses: dict[str, str] = {}  # stage name -> its node's address, off the head's
        self.hosts: list[ray.actor.ActorHandle] = []  # every host ever started, for close
        self.old_pids: dict[str, set[int]] = {}  # of each stage's replaced processes
        self.metrics_answers: dict[str, ray.ObjectRef] = {}  # node -> its StageHost.read_metrics, pending
        self.metrics_due = 0.0

    def add(self, spec: StageSpec) -> StageHandle:
        stage = super().add(spec)
        # The node gives the rest: its own environment (Ray sets CUDA_VISIBLE_DEVICES there) and
        # the group's dist port (GroupSetup).
        stage.env = super().stage_env(spec.group, None)
        return stage

    # -- the run's resources ---------------------------------------------------------------------

    def group_bundle(self) -> dict[str, float]:
        bundle = dict(self.cluster.engine_resources)
        if self.cluster.engine_cpus:
            bundle["CPU"] = self.cluster.engine_cpus
        if self.engine.device == "cuda":
            bundle["GPU"] = float(self.engine.tensor_parallel)
        return bundle

    def place(self) -> dict[str, str]:
        """Join the cluster and reserve a node for every engine group, or refuse the start.
        Returns the address of each engine stage whose node has another address than the
        head node's (where the supervisor and, by default, the light stages run)."""
        address = self.cluster.ray_address
        # Ray's core worker installs its own handlers for these (SIGTERM dumps a stack and aborts);
        # the supervisor's drain-then-stop on a signal must stay.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            ray.init(address=address, namespace="brigade", logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise Refused(f"cannot join the Ray cluster at cluster.ray_address={address!r}: {exc}") from None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        self.head_node = ray.get_runtime_context().get_node_id()
        self.head_address = ray.util.get_node_ip_address()
        self.place_groups(self.engine)
        bundle = self.group_bundle()
        timeout = self.cluster.placement_timeout_s
        pending = list(self.placing.values())
        first_wait_s = min(FIRST_ROOM_S, timeout)
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=first_wait_s)
        if len(ready) < len(pending):
            self.unplaced()  # asks Ray's autoscaler for room
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout - first_wait_s)
        self.placing.clear()
        if len(ready) < len(self.groups):
            raise Refused(
                f"{len(self.groups) - len(ready)} of {len(self.groups)} engine group(s) found no Ray node "
                f"with {bundle} free within cluster.placement_timeout_s={timeout:g}s "
                f"(the cluster has {ray.available_resources()} free)"
            )
        address_of = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        for group, pg in enumerate(self.groups):
            node = ray.util.placement_group_table(pg)["bundles_to_node_id"][0]
            log.info(
                "engine group %d placed on Ray node %s at %s (%s)", group, node, address_of[node], bundle
            )
            if address_of[node] != self.head_address:
                self.addresses.update(dict.fromkeys(self.group_names(group), address_of[node]))
        return dict(self.addresses)

    def place_groups(self, engine: EngineConfig) -> None:
        """A placement group for each engine group that has none yet; Ray finds them a node."""
        super().place_groups(engine)
        bundle = self.group_bundle()
        for group in range(len(self.groups), engine.data_parallel):
            name = f"{SHM_PREFIX}{self.run_id}-group-{group}"
            self.groups.append(placement_group([bundle], strategy="STRICT_PACK", name=name))
            self.placing[group] = self.groups[group].ready()

    def unplaced(self) -> list[int]:
        """The engine groups still without a node; while there are any, Ray's autoscaler is asked
        for every group's bundle (a node joins for them where the cluster can grow)."""
        if self.placing:
            ready, _ = ray.wait(list(self.placing.values()), num_returns=len(self.placing), timeout=0)
            self.placing = {group: ref for group, ref in self.placing.items() if ref not in ready}
        if self.placing and self.requested_groups < len(self.groups):
            self.request_resources(len(self.groups))
        return sorted(self.placing)

    def request_resources(self, num_groups: int) -> None:
        """Ask Ray's autoscaler to keep room for `num_groups` engine groups: a standing request
        that replaces the previous one (ray.autoscaler.sdk.request_resources), so that a pending
        group gets a node at once, and retired groups' nodes may go idle and be given back."""
        bundles = [self.group_bundle()] * num_groups
        log.info("asking Ray's autoscaler for room for %d engine group(s) of %s", num_groups, bundles[:1])
        try:
            request_resources(bundles=bundles)
        except RayError as exc:  # a hint: without it, Ray still sees the pending placement group
            log.warning("Ray's autoscaler did not take the request: %s", exc)
        self.requested_groups = num_groups

    def release_groups(self, engine: EngineConfig) -> None:
        """Clean each retired group's node (the local stage set unlinks rings on its own host),
        then give back its placement group, after which Ray's autoscaler may end the node."""
        super().release_groups(engine)
        cleanups = []
        for group, pg in enumerate(self.groups[engine.data_parallel :], start=engine.data_parallel):
            with contextlib.suppress(RayError, IndexError, KeyError):
                node = ray.util.placement_group_table(pg)["bundles_to_node_id"][0]
                if not node:  # never placed (a reload that found no room): nothing was made anywhere
                    continue
                names = [spec.name for spec in self.rings.get(group, [])]
                cleanups.append(
                    _remove_group.options(
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                    ).remote(names, str(group_state_path(self.run_id, group)))
                )
        with contextlib.suppress(RayError):  # a node gone took its shared memory with it
            ray.wait(cleanups, num_returns=len(cleanups), timeout=CALL_TIMEOUT_S)
        for pg in self.groups[engine.data_parallel :]:
            with contextlib.suppress(RayError):
                remove_placement_group(pg)
        del self.groups[engine.data_parallel :]
        self.placing = {group: ref for group, ref in self.placing.items() if group < engine.data_parallel}
        self.rings = {group: specs for group, specs in self.rings.items() if group < engine.data_parallel}
        if self.requested_groups > engine.data_parallel:
            self.request_resources(engine.data_parallel)

    def max_groups(self) -> int | None:
        return None  # the cluster's: Ray's autoscaler adds nodes up to its own max_workers

    def create_rings(self, specs: list[RingSpec]) -> list[ShmRing]:
        """The rings are made on each group's node, by the first of its stages to start there."""
        for spec in specs:
            self.rings.setdefault(spec.group, []).append(spec)
        return []

    def close(self) -> list[str]:
        """No actor, placement group or shared memory of the run is left on any node. Returns the
        nodes whose cleanup did not finish within CALL_TIMEOUT_S or failed, or that the cluster
        could not be reached: their shared memory (and off this host their run dir's files) may
        be left."""
        if not ray.is_initialized():
            return []
        for host in self.hosts:
            with contextlib.suppress(RayError):
                ray.kill(host, no_restart=True)
        for pg in self.groups:
            with contextlib.suppress(RayError):
                remove_placement_group(pg)
        # Every live node cleans up before the request that keeps the nodes is dropped: were it
        # dropped first, Ray's autoscaler could end an idle node in the middle. A node that goes
        # anyway took its leftovers with it, and the other nodes' cleanups still finish (waited
        # for together, then each read: one failure must not abandon the rest). A cluster that
        # went away took them all; this host's are swept at the next start (sweep_stale_runs).
        # What did not finish, or failed, goes back to the supervisor's last line.
        left: list[str] = []
        try:
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            cleanups = {
                _clean_node.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote(f"{SHM_PREFIX}{self.run_id}-", str(self.run_dir), self.supervisor_host): node
                for node in nodes
            }
            done, pending = ray.wait(list(cleanups), num_returns=len(cleanups), timeout=CALL_TIMEOUT_S)
            left += [
                f"node {cleanups[ref]} (its cleanup did not finish in {CALL_TIMEOUT_S:.0f}s)"
                for ref in pending
            ]
            for ref in done:
                try:
                    ray.get(ref)
                except RayTaskError as exc:  # the cleanup itself failed; a node that died took its leftovers
                    left.append(f"node {cleanups[ref]} (its cleanup failed: {exc.cause!r})")
                except RayError:
                    pass
        except (RayError, ConnectionError) as exc:
            left.append(f"every node (the cluster could not be reached: {exc})")
        if self.requested_groups:
            self.request_resources(0)  # a stopped run keeps no nodes up
        ray.shutdown()
        return left

    # -- processes -------------------------------------------------------------------------------

    def launch(self, stage: StageHandle) -> None:
        if isinstance(stage.process, RemoteProcess):
            stage.process.release()  # the host of the process this one replaces
            self.old_pids.setdefault(stage.name, set()).add(stage.process.pid)
        options: dict[str, Any] = {}
        if stage.kind in ENGINE_KINDS:
            pg = self.groups[stage.group]
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0
            )
            if stage.kind == "gpu_worker" and self.engine.device == "cuda":
                options["num_gpus"] = 1
        elif self.cluster.light_resources:
            options["resources"] = dict(self.cluster.light_resources)
        else:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.head_node, soft=False)
        host = StageHost.options(**options).remote()
        self.hosts.append(host)
        stage.process = RemoteProcess(host, lambda address: self.start_at(stage, host, address))  # type: ignore[assignment]
        stage.node, stage.stderr_pump, stage.last_stderr_line = "", None, ""

    def start_at(self, stage: StageHandle, host: ray.actor.ActorHandle, address: str) -> ray.ObjectRef:
        """Start `stage` on its host, which Ray placed on a node at `address`. An engine group
        found at another address than its links have moved there (its node died): the links
        follow it first (`on_group_moved`). Raises Refused when they cannot."""
        planned = self.addresses.get(stage.name, self.head_address)
        if address != planned:
            if stage.kind not in ENGINE_KINDS or self.on_group_moved is None:
                raise Refused(
                    f"Ray placed {stage.name} on a node at {address}, but the run's links have it at {planned}: "
                    "only engine groups can move to another address while the run goes on"
                )
            self.on_group_moved(stage.group, address)
            self.addresses.update(dict.fromkeys(self.group_names(stage.group), address))
        setup = None
        if stage.kind in ENGINE_KINDS:
            # Where its rank 0 listens, as Endpoints.dist_host has it.
            dist_host = self.addresses.get(f"scheduler-{stage.group}", self.network.host)
            setup = GroupSetup(self.run_id, stage.group, self.rings[stage.group], dist_host)
        run_file = (self.run_dir / RUN_FILE).read_bytes()  # after any move: the links as they are now
        return host.start.remote(
            stage.argv[1:], stage.env, run_file, self.supervisor_host, address, setup, self.head_node
        )

    def group_names(self, group: int) -> list[str]:
        """The stages of engine group `group`: its scheduler and its workers."""
        workers = [f"gpu_worker-{group}-{r}" for r in range(self.engine.tensor_parallel)]
        return [f"scheduler-{group}", *workers]

    def gather_metrics(self) -> None:
        """Every METRICS_GATHER_S, ask one host on each node but the head for its node's
        Prometheus files, and copy the answers that came into this run's metrics dir: /metrics
        then sums them with the head's (a dead node's last copies stay, as a dead process's
        files do). Never waits."""
        for node, answer in list(self.metrics_answers.items()):
            if not ray.wait([answer], timeout=0)[0]:
                continue
            del self.metrics_answers[node]
            with contextlib.suppress(RayError, OSError):  # a node that went meanwhile keeps its last copies
                write_node_metrics(self.run_dir / METRICS_DIR, node, ray.get(answer))
        now = time.monotonic()
        if now < self.metrics_due:
            return
        self.metrics_due = now + METRICS_GATHER_S
        for stage in self.stages.values():
            process = stage.process
            if not isinstance(process, RemoteProcess) or process.returncode is not None:
                continue
            if process.node and process.node != self.head_node and process.node not in self.metrics_answers:
                self.metrics_answers[process.node] = process.host.read_metrics.remote()

    def is_current(self, stage: StageHandle, pid: int) -> bool:
        # A stage can talk before its host's answer to `start` (which carries the pid) is read;
        # a replaced process's late messages must not wait for a host that has no node yet.
        process = stage.process
        is_replaced = pid in self.old_pids.get(stage.name, ())
        if isinstance(process, RemoteProcess) and not process.is_settled and not is_replaced:
            process.settle(START_WAIT_S)
        return pid == stage.pid

    def reap(self) -> list[tuple[StageHandle, int]]:
        for stage in self.stages.values():
            process = stage.process
            if isinstance(process, RemoteProcess):
                process.poll()
                stage.node = process.node
                stage.last_stderr_line = process.last_line
        return super().reap()

    def send_signal(self, stage: StageHandle, sig: int) -> None:
        if isinstance(stage.process, RemoteProcess):
            stage.process.send_signal(sig)

    def stop(self, stages: Iterable[StageHandle], grace_s: float, sig: int = signal.SIGTERM) -> None:
        stages = list(stages)
        super().stop(stages, grace_s, sig)
        for stage in stages:  # a retired replica's host has nothing left to do
            if isinstance(stage.process, RemoteProcess):
                stage.process.release()
