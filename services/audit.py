"""The audit log: every administrative event of a run as one JSON line in `<run-dir>/audit.log`
(`observability.audit_log` moves it), with its time and its source.

Events (the `event` field) and what else each line carries:

- `reload`: `outcome` (`applied`, `partial` or `refused`), `applied` and `refused` (each
  `{field path: [old, new]}`), `error` (why a config was refused outright);
- `rescale`: `changes` (`{field path: [old, new]}`);
- `autoscale`: a decision of the autoscale policy (supervision/autoscale.py) and its inputs:
  `direction` (`up` or `down`), `current` and `target` (engine groups), `reason`, `needed` (per
  target, the groups that would hold the load at it), `loads` (per group: `waiting`, `running`,
  `kv_usage`), then `groups` (what the run has after carrying it out) and `error` (why not, when
  it could not);
- `stage_restart`: `stage`, `reason`, `restart` (its count), `backoff_s`;
- `auth_failure`: `mechanism` (`api_key` or `curve`), `peer`, `reason`, `count` (the refusals
  the line stands for), and for an API key `key_sha256` (the first 12 hex digits of the
  presented key's SHA-256, never the key; of the first key presented, when the line stands for
  several). Refusals are aggregated, not one line each: a client retrying with a wrong key, or
  hammering the HTTP API without one, would otherwise fill the disk. CURVE: one line per
  endpoint and reason per poll. API keys (`ApiKeyFailures`): the first refusal of a client
  address and reason within a second is written at once, the rest of that second as one line.

Several processes (the supervisor, gateway replicas) append to one file: each line is a single
`write()` on an O_APPEND descriptor, which the kernel never interleaves with another's. Writing
never raises: a full disk must not stop serving, so a failed write is counted, and logged once
when writes start failing and once when they work again. Light (no torch): the gateway imports it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

AUDIT_FILE = "audit.log"
MAX_TEXT_CHARS = 512  # peers and reasons may come from the network: bounded
MAX_LINE_BYTES = 64 << 10

log = logging.getLogger("audit")


def audit_log_path(run_dir: Path, configured: str = "") -> Path:
    """`observability.audit_log`, or `<run-dir>/audit.log` when it is empty."""
    return Path(configured) if configured else run_dir / AUDIT_FILE


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS] + "..."


class AuditLog:
    """Appends audit events of one source (`supervisor`, `gateway-0`, ...) to the audit file."""

    def __init__(self, path: Path, source: str) -> None:
        self.path = path
        self.source = source
        self.num_failed_writes = 0
        self.failing_since = 0  # num_failed_writes when writes last started failing (is_failing)
        self.is_failing = False
        self._encoder = msgspec.json.Encoder(enc_hook=str)  # anything unusual is written as text

    def record(self, event: str, **fields: Any) -> None:
        now = time.time()
        stamp = datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        line = self._encoder.encode(
            {"time": stamp, "ts": round(now, 3), "source": self.source, "event": event, **fields}
        )
        if len(line) > MAX_LINE_BYTES:
            line = self._encoder.encode(
                {"time": stamp, "ts": round(now, 3), "source": self.source, "event": event, "truncated": True}
            )
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line + b"\n")
            finally:
                os.close(fd)
        except OSError as exc:
            self.num_failed_writes += 1
            if not self.is_failing:
                self.is_failing, self.failing_since = True, self.num_failed_writes - 1
                log.warning(
                    "audit log %s: could not write a %s event: %s (further failures are counted, not logged)",
                    self.path, event, exc.strerror,
                )  # fmt: skip
            return
        if self.is_failing:
            self.is_failing = False
            lost = self.num_failed_writes - self.failing_since
            log.warning("audit log %s written again; %d event(s) were lost meanwhile", self.path, lost)

    def reload(
        self,
        applied: dict[str, list[Any]],
        refused: dict[str, list[Any]] | None = None,
        error: str = "",
    ) -> None:
        """A config reload: what took effect, what needs a restart, or why nothing could."""
        refused = refused or {}
        outcome = "refused" if error or not applied else ("partial" if refused else "applied")
        self.record("reload", outcome=outcome, applied=applied, refused=refused, error=_bounded(error))

    def rescale(self, changes: dict[str, list[Any]]) -> None:
        self.record("rescale", changes=changes)

    def autoscale(
        self,
        direction: str,
        current: int,
        target: int,
        reason: str,
        needed: dict[str, float],
        loads: list[dict[str, float]],
        groups: int,
        error: str = "",
    ) -> None:
        self.record(
            "autoscale",
            direction=direction,
            current=current,
            target=target,
            reason=_bounded(reason),
            needed=needed,
            loads=loads,
            groups=groups,
            error=_bounded(error),
        )

    def stage_restart(self, stage: str, reason: str, restart: int, backoff_s: float) -> None:
        self.record(
            "stage_restart",
            stage=stage,
            reason=_bounded(reason),
            restart=restart,
            backoff_s=round(backoff_s, 3),
        )

    def auth_failure(
        self,
        mechanism: Literal["api_key", "curve"],
        peer: str,
        reason: str,
        presented_key: str | None = None,
        count: int = 1,
    ) -> None:
        fields: dict[str, Any] = {"mechanism": mechanism, "peer": _bounded(peer), "reason": _bounded(reason)}
        fields["count"] = count
        if presented_key is not None:
            fields["key_sha256"] = hashlib.sha256(presented_key.encode()).hexdigest()[:12]
        self.record("auth_failure", **fields)


class ApiKeyFailures:
    """Refused API keys of one gateway replica, aggregated per client address and reason: the
    first of each within `interval_s` is written at once, the others of that interval as one line
    with their `count` when it ends (`flush`, which the owner's loop calls; `record` too). Bounded
    whatever the clients send: at most MAX_PEERS addresses are tracked an interval, the rest
    counted under the peer "(other clients)"."""

    MAX_PEERS = 64
    OTHERS = "(other clients)"

    def __init__(self, audit: AuditLog, interval_s: float = 1.0) -> None:
        self.audit = audit
        self.interval_s = interval_s
        self.window_start = time.monotonic()
        # (peer, reason) -> [refusals not yet written, the first such key presented]
        self.pending: dict[tuple[str, str], list[Any]] = {}

    def record(self, peer: str, reason: str, presented_key: str | None = None) -> None:
        self.flush()
        if (peer, reason) not in self.pending and len(self.pending) >= self.MAX_PEERS:
            peer = self.OTHERS
        entry = self.pending.get((peer, reason))
        if entry is None:  # the first in this interval: written now, so that it is seen at once
            self.pending[peer, reason] = [0, None]
            self.audit.auth_failure("api_key", peer, reason, presented_key)
        else:
            entry[0] += 1
            entry[1] = entry[1] if entry[1] is not None else presented_key

    def flush(self, force: bool = False) -> None:
        """Write the interval's aggregated refusals once it has ended (now, with `force`)."""
        now = time.monotonic()
        if not force and now - self.window_start < self.interval_s:
            return
        for (peer, reason), (count, key) in self.pending.items():
            if count:
                self.audit.auth_failure("api_key", peer, reason, key, count=count)
        self.pending.clear()
        self.window_start = now


class CurveFailureMonitor:
    """Audits CURVE handshakes that fail on a server socket (a client with the wrong server key,
    or one its authenticator refused), from the socket's monitor events. Call `poll()` from
    the owner's loop; it never blocks."""

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

    def __init__(self, socket: zmq.Socket, audit: AuditLog) -> None:
        self.audit = audit
        self.socket = socket
        self.monitor = socket.get_monitor_socket(self.EVENTS)

    def poll(self) -> int:
        """Record every failure seen since the last call, one line per endpoint and reason; how
        many there were."""
        counts: dict[tuple[str, str], int] = {}
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            endpoint = event["endpoint"].decode(errors="replace")
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                reason = f"refused by the authenticator (status {event['value']}): not one of the run's client keys"
            elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                reason = "cryptographic error: the client does not hold this server's key"
            elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                reason = "mechanism mismatch: the client does not speak CURVE (no keys)"
            else:
                reason = f"handshake protocol error {event['value']:#x}"
            counts[endpoint, reason] = counts.get((endpoint, reason), 0) + 1
        for (endpoint, reason), count in counts.items():
            self.audit.auth_failure("curve", endpoint, reason, count=count)
        return sum(counts.values())

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
