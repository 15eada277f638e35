"""Names of every socket and shared-memory object of a run. Nobody builds them by hand."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

SHM_PREFIX = "brigade-"
DIST_PORT_ENV = "BRIGADE_DIST_PORT"  # set by the supervisor: a worker group's torch.distributed port


def default_run_dir() -> Path:
    """The per-user default run directory that the supervisor and the client agree on."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / "brigade" / "default"
    return Path(f"/tmp/brigade-{os.getuid()}") / "default"


def make_run_dir(path: Path) -> Path:
    """Create the run directory with mode 0700 (socket files inside are private)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
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
