"""The access log (gateway.access_log): one JSON line per API call, beside the audit log.

Each line: `time`, `ts`, `source` (the replica), `request_id` (also sent back as the
`x-request-id` header), `caller` (`cert:<subject>` under mTLS, else `key:<first 12 hex digits of
the key's SHA-256>` where the run has API keys; null for a call that presented neither),
`peer`, `method`, `endpoint`, `status` (499: the client went away first), `tokens_in`,
`tokens_out` (generation calls), `duration_s`; with `include_text`, `prompt` and `output` too.

The file is bounded: a line that would take it past `max_bytes` first moves it to `path.1` (and
`path.1` to `path.2`, ... up to `backups`; the oldest is dropped). Every replica appends to the
one file, each line a single O_APPEND write, and the size check, the rotation and the write are
done under an flock on `path.lock`, so two replicas never both rotate, nor write past the bound.
Like the audit log, writing never raises: a failed write is counted and logged once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ipc.config import AccessLogConfig
from services.gateway.connection import client_cert_name

CLIENT_CLOSED = 499
ACCESS_STATE_KEY = "brigade_access"  # where a request's AccessRecord sits in its scope["state"]

log = logging.getLogger(__name__)


def key_id(key: str) -> str:
    """An API key as the logs name it: never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass
class AccessRecord:
    """What the handlers add to a request's line: who called (once authenticated), the tokens,
    and with include_text the prompts and the output."""

    include_text: bool
    caller: str | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    prompt: list[Any] | None = None
    output: dict[int, str] = field(default_factory=dict)


def access_record(scope: Scope) -> AccessRecord | None:
    """The request's record, where the access log is on."""
    return scope.get("state", {}).get(ACCESS_STATE_KEY)


class AccessLog:
    """Appends lines to gateway.access_log.path, rotating it at max_bytes."""

    def __init__(self, config: AccessLogConfig, source: str) -> None:
        self.path = Path(config.path)
        self.lock_path = Path(config.path + ".lock")
        self.max_bytes = config.max_bytes
        self.backups = config.backups
        self.source = source
        self.include_text = config.include_text
        self.num_failed_writes = 0
        self._encoder = msgspec.json.Encoder(enc_hook=str)

    def write(self, fields: dict[str, Any]) -> None:
        now = time.time()
        stamp = datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        line = (
            self._encoder.encode({"time": stamp, "ts": round(now, 3), "source": self.source, **fields})
            + b"\n"
        )
        try:
            lock = os.open(self.lock_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self._append(line)
            finally:
                os.close(lock)  # and the lock with it
        except OSError as exc:
            self.num_failed_writes += 1
            if self.num_failed_writes == 1:
                log.warning(
                    "access log %s: could not write (%s); further failures are counted",
                    self.path,
                    exc.strerror,
                )

    def _append(self, line: bytes) -> None:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(line) > self.max_bytes:
            self._rotate()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        if self.backups == 0:
            os.unlink(self.path)
            return
        for index in range(self.backups - 1, 0, -1):
            older = Path(f"{self.path}.{index}")
            if older.exists():
                older.replace(f"{self.path}.{index + 1}")
        self.path.replace(f"{self.path}.1")


class AccessLogMiddleware:
    """Writes one line per HTTP request once its response has been sent (a stream: its end)."""

    def __init__(self, app: ASGIApp, access_log: AccessLog) -> None:
        self.app = app
        self.access_log = access_log
        self.include_text = access_log.include_text

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        request_id = uuid.uuid4().hex
        subject = client_cert_name(scope)
        record = AccessRecord(self.include_text, caller=f"cert:{subject}" if subject else None)
        scope.setdefault("state", {})[ACCESS_STATE_KEY] = record
        status = CLIENT_CLOSED

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            client = scope.get("client")
            fields: dict[str, Any] = {
                "request_id": request_id,
                "caller": record.caller,
                "peer": client[0] if client else None,
                "method": scope["method"],
                "endpoint": scope["path"],
                "status": status,
                "tokens_in": record.tokens_in,
                "tokens_out": record.tokens_out,
                "duration_s": round(time.monotonic() - started, 4),
            }
            if self.include_text:
                fields["prompt"] = record.prompt
                fields["output"] = (
                    [record.output[i] for i in sorted(record.output)] if record.output else None
                )
            self.access_log.write(fields)
