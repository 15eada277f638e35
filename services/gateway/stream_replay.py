"""llama-server's resumable streams: a stream POSTed with `X-Conversation-Id` outlives its
connection, and a client (llama.cpp's web UI after a page reload) reattaches to it.

The stream's bytes, exactly as sent, are also appended to a file of the run
(`<run-dir>/streams/<digest>.sse`), beside a small record of it (`<digest>.json`: the id, the
replica that writes it, when it started and ended), so that every gateway replica can replay any
stream: `GET /v1/stream?conv_id=ID&from=N` sends the bytes from offset N and then, until the
stream ends, each new one as it comes; `POST /v1/streams/lookup` says which of the ids a client
names have a stream (each id also matches its `ID::model` variants); `DELETE /v1/stream?conv_id=ID`
stops the stream and forgets it. A stream with the id of a live one replaces it (the old one is
stopped). While it is recorded a stream runs to its end whether or not its client stays, and
stops when it is deleted or replaced: the writer notices at its next event or keep-alive, since
the record it wrote is then gone or another's.

A record is written whole (a temporary file renamed); a stream's bytes past `MAX_BYTES` are not
kept (the replay then ends with an error event, and a stream nobody reads any more is stopped).
Ended streams are forgotten `TTL_S` after their end, and a stream whose writer died (its replica
killed) ends, for its readers, with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

import msgspec

CONVERSATION_HEADER = "x-conversation-id"
MAX_BYTES = 4 << 20  # of one stream, as llama-server keeps
TTL_S = 300.0  # an ended stream is kept this long, as llama-server
POLL_S = 0.05  # how often a reader at the end of the bytes looks for more
MAX_ID_CHARS = 512


class StreamRecord(msgspec.Struct):
    conversation_id: str
    token: str  # this stream's own: another stream of the id has another
    writer_pid: int
    started_at: float  # unix seconds
    completed_at: float = 0.0  # 0 while it runs
    is_truncated: bool = False  # its bytes passed MAX_BYTES: the rest is not kept


class StreamSession(msgspec.Struct):
    """One stream, as `POST /v1/streams/lookup` answers (llama-server's fields; unix seconds)."""

    conversation_id: str
    is_done: bool
    total_bytes: int
    started_at: int
    completed_at: int


class StreamStopped(ConnectionError):
    """The stream was deleted or replaced, or nobody can read the rest: its writer stops it, as
    one whose connection went away (its engine requests are aborted)."""


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Recorder:
    """The writing end of one stream: appends its bytes, and notices when it is stopped."""

    def __init__(self, streams: StreamReplay, conversation_id: str) -> None:
        self.streams = streams
        self.key = streams.key(conversation_id)
        self.record = StreamRecord(conversation_id, uuid.uuid4().hex, os.getpid(), time.time())
        self.num_bytes = 0
        self.data = streams.create(self.key)
        self.record_inode = streams.write_record(self.key, self.record)

    @property
    def is_stopped(self) -> bool:
        """Deleted or replaced since it began (its record gone or another's)."""
        try:
            return os.stat(self.streams.record_path(self.key)).st_ino != self.record_inode
        except OSError:
            return True

    def write(self, chunk: bytes) -> None:
        if self.is_stopped:
            raise StreamStopped
        if not chunk or self.record.is_truncated:
            return
        if self.num_bytes + len(chunk) > MAX_BYTES:
            self.record.is_truncated = True
            self.record_inode = self.streams.write_record(self.key, self.record)
            return
        self.data.write(chunk)
        self.data.flush()
        self.num_bytes += len(chunk)

    def finish(self) -> None:
        self.data.close()
        if self.is_stopped:
            return
        self.record.completed_at = time.time()
        self.streams.write_record(self.key, self.record)


class StreamReplay:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._decoder = msgspec.json.Decoder(StreamRecord)

    @staticmethod
    def key(conversation_id: str) -> str:
        """The files' name: any id (slashes, `::model`) names one file, and only that one."""
        return hashlib.sha256(conversation_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]

    def record_path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def data_path(self, key: str) -> Path:
        return self.directory / f"{key}.sse"

    def _replace(self, path: Path, data: bytes) -> int:
        """Write `path` whole (a temporary file renamed over it); its new inode."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return os.stat(path).st_ino

    def write_record(self, key: str, record: StreamRecord) -> int:
        return self._replace(self.record_path(key), msgspec.json.encode(record))

    def create(self, key: str) -> BinaryIO:
        """A new, empty file for a stream's bytes; one of a stream it replaces stays open for its
        writer and readers until they notice."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.prune()
        self._replace(self.data_path(key), b"")
        return open(self.data_path(key), "ab")  # the Recorder closes it

    def start(self, conversation_id: str) -> Recorder:
        return Recorder(self, conversation_id)

    def read_record(self, key: str) -> StreamRecord | None:
        try:
            return self._decoder.decode(self.record_path(key).read_bytes())
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    def lookup(self, conversation_ids: list[str]) -> list[StreamSession]:
        """The streams of the ids asked about (each id's own, and its `ID::model` variants); the
        ids of others are never listed."""
        wanted = [cid for cid in conversation_ids if cid]
        sessions = []
        for path in sorted(self.directory.glob("*.json")) if wanted else ():
            record = self.read_record(path.stem)
            if record is None:
                continue
            cid = record.conversation_id
            if not any(cid == w or cid.startswith(f"{w}::") for w in wanted):
                continue
            try:
                total = os.stat(self.data_path(path.stem)).st_size
            except OSError:
                continue
            is_done = record.completed_at > 0 or not _is_alive(record.writer_pid)
            sessions.append(
                StreamSession(cid, is_done, total, int(record.started_at), int(record.completed_at))
            )
        return sessions

    def stop(self, conversation_id: str) -> None:
        """Forget the stream (its writer stops at its next event); nothing if there is none."""
        key = self.key(conversation_id)
        self.record_path(key).unlink(missing_ok=True)
        self.data_path(key).unlink(missing_ok=True)

    def open_replay(self, conversation_id: str, offset: int) -> AsyncIterator[bytes] | None:
        """The stream's bytes from `offset`, then each new one until it ends; None if there is no
        such stream."""
        key = self.key(conversation_id)
        record = self.read_record(key)
        if record is None or record.conversation_id != conversation_id:
            return None
        try:
            data = open(self.data_path(key), "rb")  # noqa: SIM115 (the replay closes it)
        except OSError:
            return None
        return self._replay(key, record.token, data, offset)

    async def _replay(self, key: str, token: str, data: BinaryIO, offset: int) -> AsyncIterator[bytes]:
        try:
            while True:
                data.seek(offset)
                chunk = data.read(1 << 16)
                if chunk:
                    offset += len(chunk)
                    yield chunk
                    continue
                record = self.read_record(key)
                if record is None or record.token != token:
                    return  # deleted or replaced
                if record.is_truncated:
                    yield _error_event(f"this stream passed {MAX_BYTES} bytes: its replay ends here")
                    return
                if record.completed_at > 0:
                    if not data.read(1):  # the last bytes came before the record said so
                        return
                    continue
                if not _is_alive(record.writer_pid):
                    yield _error_event("the gateway replica that ran this stream stopped before its end")
                    return
                await asyncio.sleep(POLL_S)
        finally:
            data.close()

    def prune(self) -> None:
        """Forget streams ended TTL_S ago, and those whose writer died as long ago."""
        cutoff = time.time() - TTL_S
        for path in self.directory.glob("*.json"):
            record = self.read_record(path.stem)
            if record is None:
                continue
            ended = record.completed_at or (0.0 if _is_alive(record.writer_pid) else record.started_at)
            if ended and ended < cutoff:
                with contextlib.suppress(OSError):
                    path.unlink()
                    self.data_path(path.stem).unlink(missing_ok=True)


def _error_event(message: str) -> bytes:
    error = {"message": message, "type": "server_error", "param": None, "code": "stream_replay"}
    return b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"
