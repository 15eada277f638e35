"""What the supervisor says of each stage, in one row shape for both files it writes
(supervision/status.py): status.json in the run dir, which `brigade status` prints and the
gateways' /health reads, and metrics/stages.json, which /metrics turns into the stage gauges."""

from __future__ import annotations

from pathlib import Path

import msgspec

STATUS_FILE = "status.json"


class StageRow(msgspec.Struct, frozen=True):
    """One stage as the supervisor last saw it, from its process and its last heartbeat.
    `brigade status --json` prints these: a rename here is a change users see."""

    name: str
    kind: str
    pid: int
    state: str  # starting, running, restarting
    restarts: int = 0
    engine: int = -1  # the engine group of a scheduler or worker; -1 for other stages
    uptime_s: float = 0.0  # since its current process came up; 0 while it is not running
    queue_depth: int = 0  # requests waiting plus those in flight through it
    running: int = 0  # requests in a scheduler's running batch
    waiting: int = 0  # requests a scheduler has not admitted yet
    kv_usage: float = 0.0  # a scheduler's fraction of KV-cache blocks in use
    tokens_per_s: float = 0.0
    malformed: int = 0  # messages it rejected as malformed
    auth_failures: int = 0  # CURVE handshakes its tcp:// server sockets refused
    gpu_memory_allocated: int = 0  # bytes, CUDA workers only
    gpu_memory_reserved: int = 0
    node: str = ""  # the Ray node it runs on; "" on the local backend
    # What the process runs under, comma-separated (services/privileges.py): no_new_privs,
    # landlock_vN (writes only in the run dir), user=NAME (dropped from root); "" until Ready.
    protections: str = ""
    # A scheduler's LoRA adapters (docs/lora.md): every one loaded, and those that its running
    # requests and its waiting requests use.
    lora_adapters: list[str] = []
    lora_running: list[str] = []
    lora_waiting: list[str] = []


def read_status(run_dir: Path) -> list[StageRow]:
    """The rows of the run's status.json. Raises OSError when there is none (no run, or it
    stopped: the file goes with it) and msgspec.DecodeError when it is not rows."""
    return msgspec.json.decode((run_dir / STATUS_FILE).read_bytes(), type=list[StageRow])
