"""Names of every socket and shared-memory object of a run. Nobody builds them by hand.

A ZeroMQ link is `ipc://` (a socket file in the run dir) when both of its ends run on one host,
and `tcp://` with CURVE when they do not, or when `network.transport` is `tcp`. `choose_link`
makes that choice for one link; `Endpoints` applies it to every link of a run. Shared memory
never leaves a host: a scheduler and its workers always share one.
"""

from __future__ import annotations

import os
import random
import socket
import stat
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ipc.keys import CurveClient, CurveServer, RunKeys
from ipc.ports import PORT_SPAN, is_loopback, link_port, tcp_endpoint

if TYPE_CHECKING:
    from ipc.config import NetworkConfig

SHM_PREFIX = "brigade-"
DIST_PORT_ENV = "BRIGADE_DIST_PORT"  # set by the supervisor: a worker group's torch.distributed port
_ROOT_UID = 0


class InsecureRunDir(PermissionError):
    """A run dir (or a directory above it, or its run.json) that another user could tamper with:
    whoever can replace run.json or a socket file there receives the clients' prompts."""


def default_run_dir() -> Path:
    """The per-user default run directory that the supervisor and the client agree on."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / "brigade" / "default"
    return Path(f"/tmp/brigade-{os.getuid()}") / "default"


def _trusted_owner(st: os.stat_result) -> bool:
    # root can replace anything anyway, so trusting its directories adds no exposure.
    return st.st_uid in (os.geteuid(), _ROOT_UID)


def check_private(path: Path, what: str = "run dir") -> None:
    """Refuse `path` unless it is a real directory (not a symlink) of ours that nobody else can
    read or write, under directories that only we or root can change."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise InsecureRunDir(f"{what} {path} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InsecureRunDir(f"{what} {path} is not a directory (a symlink?)")
    if st.st_uid != os.geteuid():
        raise InsecureRunDir(f"{what} {path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise InsecureRunDir(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}; it must be 0700")
    _check_ancestors(path.parent, path)


def _check_ancestors(start: Path, run_dir: Path) -> None:
    """`start` and every directory above it, as written and with symlinks resolved, are ours or
    root's, and others cannot rename their entries: not group/other writable, or sticky like
    /tmp (others may add entries there but not replace ours)."""
    written = Path(os.path.abspath(start))
    resolved = Path(os.path.realpath(start))
    for parent in {written, *written.parents, resolved, *resolved.parents}:
        st = parent.lstat()
        mode = stat.S_IMODE(st.st_mode)
        is_shared_writable = mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX)
        if not _trusted_owner(st) or (is_shared_writable and not stat.S_ISLNK(st.st_mode)):
            raise InsecureRunDir(
                f"{parent} (above the run dir {run_dir}) is owned by uid {st.st_uid} with mode {mode:o}: "
                "another user could replace the run dir"
            )


def check_run_file(path: Path) -> None:
    """run.json must be a regular file of ours (or root's) that nobody else can write."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode) or not _trusted_owner(st) or stat.S_IMODE(st.st_mode) & 0o022:
        raise InsecureRunDir(
            f"{path} is not a regular file owned by this user and writable only by it "
            f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
        )


def make_run_dir(path: Path) -> Path:
    """Create the run directory with mode 0700 (socket files inside are private), or check an
    existing one: raises InsecureRunDir when another user could tamper with it."""
    # Check what exists before creating anything in it: root could create (and use) a run dir
    # inside another user's directory.
    existing = next(p for p in (path.parent, *path.parent.parents) if os.path.lexists(p))
    _check_ancestors(existing, path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.lstat()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        path.chmod(0o700)  # ours: tighten a dir made by hand with the default umask
    check_private(path)
    return path


def shard_of(request_id: str, num_shards: int) -> int:
    """Stable detokenizer shard of a request (the same in every process and run)."""
    return zlib.crc32(request_id.encode()) % num_shards


_PORT_BASE_TRIES = 100
_EPHEMERAL_LOW = 32768  # Linux's default ip_local_port_range starts here: stay below it


class Link(str):
    """One ZeroMQ link. As a string it is the endpoint its clients connect to, so it goes wherever
    an endpoint string goes (zmq's connect, logs, run.json); `bind` is the endpoint its server
    binds, and `server_curve` / `client_curve` the CURVE settings of each side (None on ipc://).
    The socket wrappers in ipc/sockets.py pick the side, and its CURVE, from their `bind` flag."""

    bind: str
    server_curve: CurveServer | None
    client_curve: CurveClient | None

    def __new__(
        cls,
        bind: str,
        connect: str,
        server_curve: CurveServer | None = None,
        client_curve: CurveClient | None = None,
    ) -> Link:
        link = super().__new__(cls, connect)
        link.bind, link.server_curve, link.client_curve = bind, server_curve, client_curve
        return link

    @property
    def connect(self) -> str:
        return str.__str__(self)

    def __getnewargs__(self) -> tuple:  # type: ignore[override]
        return (self.bind, self.connect, self.server_curve, self.client_curve)

    def __repr__(self) -> str:
        curve = " with CURVE" if self.server_curve is not None else ""
        return f"Link(bind={self.bind!r}, connect={self.connect!r}{curve})"


class NetworkPlan(msgspec.Struct, frozen=True):
    """What the supervisor decided about the run's links (in run.json): the port base it chose,
    the host of every stage that does not run on `network.host`, and the CURVE keys."""

    port_base: int = 0
    # Stage name (`scheduler-1`) -> its host's address. A stage that the cluster places back on
    # `network.host` keeps its entry: a run with any entry spans hosts for good, so that its
    # links stay the tcp:// ones its running stages use.
    hosts: dict[str, str] = {}
    keys: RunKeys | None = None


def choose_link(
    name: str,
    *,
    same_host: bool,
    host: str,
    port: int,
    run_dir: Path | str,
    network: NetworkConfig,
    keys: RunKeys | None,
    is_public: bool = False,
) -> Link:
    """The endpoints and CURVE settings of one link, from where its two ends run.

    `same_host`: whether the server and every client of the link run on one host; `host`: the
    server's host address (what clients connect to); `port`: its tcp port (`link_port`).
    ipc:// (`RUN_DIR/NAME.sock`) when `same_host` and `network.transport` is `ipc`; otherwise
    tcp://, listening on `network.bind_host` (or `host`), with CURVE from `keys` unless
    `network.curve` is off. `is_public`: a link SDK clients connect to (a tokenizer's), whose
    server accepts the client key as well as the stage key. Raises ValueError for a tcp:// link
    without CURVE that would listen beyond loopback, or one with CURVE but no keys.
    """
    if same_host and network.transport == "ipc":
        endpoint = f"ipc://{Path(run_dir) / name}.sock"
        return Link(endpoint, endpoint)
    listen = network.bind_host or host
    bind, connect = tcp_endpoint(listen, port), tcp_endpoint(host, port)
    if not network.curve:
        if not (is_loopback(listen) and is_loopback(host)):
            raise ValueError(f"{name}: plain tcp:// on {listen} without CURVE is refused beyond loopback")
        return Link(bind, connect)
    if keys is None:
        raise ValueError(f"{name}: a tcp:// link with CURVE needs the run's keys")
    server = keys.public_server() if is_public else keys.internal_server()
    return Link(bind, connect, server, keys.stage_client())


def free_port_base(host: str) -> int:
    """A port base whose PORT_SPAN ports are all free on `host` now (below the ephemeral range,
    where the kernel does not hand out ports to outgoing connections)."""
    low = 10_000
    for _ in range(_PORT_BASE_TRIES):
        base = random.randrange(low, _EPHEMERAL_LOW - PORT_SPAN)
        if all(_is_free(host, port) for port in range(base, base + PORT_SPAN)):
            return base
    raise OSError(f"no {PORT_SPAN} free consecutive tcp ports on {host}; set network.port_base")


def _is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


class Endpoints:
    """Every link and shared-memory name of one run, as seen from the process on host `here`.

    Without `network` (tests, tools) every link is ipc://. A run spread over several hosts
    (`plan.hosts`) puts every link on tcp:// but the scheduler-workers one: a scheduler and its
    workers share a host, and its shared memory.
    """

    def __init__(
        self,
        run_dir: Path | str,
        run_id: str,
        network: NetworkConfig | None = None,
        plan: NetworkPlan | None = None,
        here: str = "",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.network = network
        self.plan = plan or NetworkPlan()
        self.default_host = network.host if network is not None else "127.0.0.1"
        self.here = here or self.default_host
        self.is_single_host = not self.plan.hosts

    def host_of(self, stage: str) -> str:
        """The address of the host that stage `stage` (`scheduler-0`, `tokenizer-1`) runs on."""
        return self.plan.hosts.get(stage, self.default_host)

    def _link(self, kind: str, index: int, name: str, server: str, is_public: bool = False) -> Link:
        if self.network is None:
            endpoint = f"ipc://{self.run_dir / name}.sock"
            return Link(endpoint, endpoint)
        same_host = self.is_single_host or kind == "scheduler_workers"
        is_tcp = self.network.transport == "tcp" or not same_host
        return choose_link(
            name,
            same_host=same_host,
            host=self.host_of(server),
            port=link_port(self.plan.port_base, kind, index) if is_tcp else 0,
            run_dir=self.run_dir,
            network=self.network,
            keys=self.plan.keys,
            is_public=is_public,
        )

    def tokenizer(self, i: int) -> Link:
        """A tokenizer replica's client-facing ROUTER (SDK clients and gateways connect)."""
        return self._link("tokenizer", i, f"tokenizer-{i}", f"tokenizer-{i}", is_public=True)

    def tokenizer_in(self, i: int) -> Link:
        return self._link("tokenizer_in", i, f"tokenizer-{i}-in", f"tokenizer-{i}")

    def scheduler_in(self, group: int) -> Link:
        return self._link("scheduler_in", group, f"scheduler-{group}-in", f"scheduler-{group}")

    def scheduler_workers(self, group: int) -> Link:
        return self._link("scheduler_workers", group, f"scheduler-{group}-workers", f"scheduler-{group}")

    def detokenizer_in(self, shard: int) -> Link:
        return self._link("detokenizer_in", shard, f"detokenizer-{shard}-in", f"detokenizer-{shard}")

    def encoder(self, i: int) -> Link:
        """An encoder replica's ROUTER (the tokenizers ask it for images' embeddings)."""
        return self._link("encoder", i, f"encoder-{i}", f"encoder-{i}")

    def supervisor(self) -> Link:
        return self._link("supervisor", 0, "supervisor", "supervisor")

    def dist_host(self, group: int) -> str:
        """Where tensor-parallel rank 0 of `group` listens for torch.distributed: its node's address."""
        return self.host_of(f"scheduler-{group}")

    def step_ring(self, group: int) -> str:
        return f"/{SHM_PREFIX}{self.run_id}-step-{group}"

    def result_ring(self, group: int) -> str:
        return f"/{SHM_PREFIX}{self.run_id}-result-{group}"

    def embedding_cache(self, i: int) -> str:
        """Encoder replica i's embeddings (ipc/embedding_cache.py); it outlives the replica."""
        return f"/{SHM_PREFIX}{self.run_id}-embeds-{i}"

    def shm_prefix(self) -> str:
        return f"/{SHM_PREFIX}{self.run_id}-"


def is_process_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, not yet reaped by its parent) does not, nor does a
    number that is no process id (from a damaged file: 0 and -1 would name process groups)."""
    if not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by someone else
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc to tell a zombie apart
