"""Names of every socket and shared-memory object of a run. Nobody builds them by hand."""

from __future__ import annotations

import os
import stat
import zlib
from pathlib import Path

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


class Endpoints:
    """Every endpoint and shared-memory name of one run."""

    def __init__(self, run_dir: Path | str, run_id: str) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id

    def _ipc(self, name: str) -> str:
        return f"ipc://{self.run_dir / name}.sock"

    def frontend(self, i: int) -> str:
        return self._ipc(f"frontend-{i}")

    def frontend_in(self, i: int) -> str:
        return self._ipc(f"frontend-{i}-in")

    def scheduler_in(self, group: int) -> str:
        return self._ipc(f"scheduler-{group}-in")

    def scheduler_workers(self, group: int) -> str:
        return self._ipc(f"scheduler-{group}-workers")

    def detokenizer_in(self, shard: int) -> str:
        return self._ipc(f"detokenizer-{shard}-in")

    def supervisor(self) -> str:
        return self._ipc("supervisor")

    def step_ring(self, group: int) -> str:
        return f"/{SHM_PREFIX}{self.run_id}-step-{group}"

    def result_ring(self, group: int) -> str:
        return f"/{SHM_PREFIX}{self.run_id}-result-{group}"

    def tensor_pool(self, i: int) -> str:
        return f"/{SHM_PREFIX}{self.run_id}-pool-{i}"

    def shm_prefix(self) -> str:
        return f"/{SHM_PREFIX}{self.run_id}-"
