"""llama-server's resumable streams: a stream POSTed with `X-Conversation-Id` outlives its
connection, and a client (llama.cpp's web UI after a page reload) reattaches to it.

The stream's bytes, exactly as sent, are also appended to a file of the run
(`<run-dir>/streams/<digest>.sse`), beside a small record of it (`<digest>.json`: the id, the
replica that writes it, when it started and ended), so that every gateway replica can replay any
stream: `GET /v1/stream?conv_id=ID&from=N` sends the bytes from offset N and then, until the
stream ends, each new one as it comes; `POST /v1/streams/lookup` says which of the ids a client
names have a stream (each id also matches its `ID::model` variants); `DELETE /v1/stream?conv_id=ID`
stops the stream and forgets it. A stream claims its id when its request comes, replacing a
stream of the id (which stops). While it is recorded a stream runs to its end whether or not its
client stays; it stops when it is deleted or replaced (its request looks every STOP_CHECK_S
whether the record it wrote is gone or another's), or once nobody can read the rest.

A record is written whole (a temporary file renamed); a stream's first `MAX_BYTES` are kept (past
them a replay ends with an error event: llama-server keeps the last 4 MiB instead). A request
refused before its stream began leaves no stream. Ended streams are forgotten `TTL_S` after their
end; a stream whose writer died, or was stopped with its replica, ends its replays with an error
event. A disk that refuses a stream's files costs it its recording, never its reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from ipc.endpoints import is_process_alive

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "x-conversation-id"
MAX_BYTES = 4 << 20  # of one stream (llama-server keeps as many)
TTL_S = 300.0  # an ended stream is kept this long, as llama-server
POLL_S = 0.1  # how often a reader at the end of the bytes looks for more
IDLE_S = (
    120.0  # a replay of a live stream that grows no byte for this long ends (keep-alives come every few s)
)
STOP_CHECK_S = 0.25  # how often a recorded stream's request looks whether it was stopped
PRUNE_INTERVAL_S = 60.0  # how often a replica forgets streams past TTL_S (as llama-server's GC)
TMP_PREFIX = "."
MAX_ID_CHARS = 512


class StreamRecord(msgspec.Struct):
    conversation_id: str
    token: str  # this stream's own: another stream of the id has another
    writer_pid: int
    started_at: float  # unix seconds
    completed_at: float = 0.0  # 0 while it runs
    is_truncated: bool = False  # its bytes passed MAX_BYTES: the rest is not kept
    is_interrupted: bool = False  # it ended before its end (its replica stopping)


class StreamSession(msgspec.Struct):
    """One stream, as `POST /v1/streams/lookup` answers (llama-server's fields; unix seconds)."""

    conversation_id: str
    is_done: bool
    total_bytes: int
    started_at: int
    completed_at: int


class Recorder:
    """The writing end of one stream: claims its id when the request comes (a stream of the id
    that runs is replaced: it stops), appends the bytes of its 200, and says when it is stopped.
    A disk that refuses a write costs the stream its recording, never its reply."""

    def __init__(self, streams: StreamReplay, conversation_id: str) -> None:
        self.streams = streams
        self.key = streams.key(conversation_id)
        self.record = StreamRecord(conversation_id, uuid.uuid4().hex, os.getpid(), time.time())
        self.num_bytes = 0
        self.data: BinaryIO | None = None
        self.is_claimed = False  # its record written: the id is this stream's
        try:
            self.data = streams.create(self.key)
            streams.write_record(self.key, self.record)
            self.is_claimed = True
        except OSError as exc:
            self._fail(exc)

    @property
    def is_recording(self) -> bool:
        return self.data is not None and not self.record.is_truncated

    def _fail(self, exc: OSError) -> None:
        log.warning("stream %r is not recorded for replay: %s", self.record.conversation_id[:80], exc)
        if self.data is not None:
            self.data.close()
            self.data = None

    def is_stopped(self) -> bool:
        """Deleted or replaced since it came (its record gone, or another stream's)."""
        if not self.is_claimed:
            return False  # never recorded: nothing can stop it but its client
        try:
            record = self.streams.read_record(self.key)
        except OSError:
            return False  # unreadable for now: not a stop
        return record is None or record.token != self.record.token

    def write(self, chunk: bytes) -> None:
        if not chunk or not self.is_recording:
            return
        assert self.data is not None
        try:
            if self.num_bytes + len(chunk) > MAX_BYTES:
                self.record.is_truncated = True
                if not self.is_stopped():
                    self.streams.write_record(self.key, self.record)
                return
            self.data.write(chunk)
            self.data.flush()
            self.num_bytes += len(chunk)
        except OSError as exc:
            self._fail(exc)

    def finish(self, *, was_streamed: bool, is_interrupted: bool) -> None:
        """The request ended: a stream that ran records its end; one that never began (refused
        before its 200) is forgotten, as llama-server forgets it."""
        if self.data is not None:
            self.data.close()
            self.data = None
        try:
            if not self.is_claimed or self.is_stopped():
                return
            if not was_streamed:
                self.streams.remove(self.key)
                return
            self.record.completed_at = time.time()
            self.record.is_interrupted = is_interrupted
            self.streams.write_record(self.key, self.record)
        except OSError as exc:
            log.warning("stream %r: its end is not recorded: %s", self.record.conversation_id[:80], exc)


class StreamReplay:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._decoder = msgspec.json.Decoder(StreamRecord)
        self.pruned_at = -PRUNE_INTERVAL_S

    @staticmethod
    def key(conversation_id: str) -> str:
        """The files' name: any id (slashes, `::model`) names one file, and only that one."""
        return hashlib.sha256(conversation_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]

    def record_path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def data_path(self, key: str) -> Path:
        return self.directory / f"{key}.sse"

    def _replace(self, path: Path, data: bytes) -> None:
        """Write `path` whole (a temporary file renamed over it)."""
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def write_record(self, key: str, record: StreamRecord) -> None:
        self._replace(self.record_path(key), msgspec.json.encode(record))

    def create(self, key: str) -> BinaryIO:
        """A new, empty file for a stream's bytes; one of a stream it replaces stays open for its
        writer and readers until they notice."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if time.monotonic() - self.pruned_at >= PRUNE_INTERVAL_S:
            self.pruned_at = time.monotonic()
            self.prune()
        self._replace(self.data_path(key), b"")
        return open(self.data_path(key), "ab")  # the Recorder closes it

    def start(self, conversation_id: str) -> Recorder:
        return Recorder(self, conversation_id)

    def read_record(self, key: str) -> StreamRecord | None:
        """The stream's record; None if there is none (or it is not one). An error other than
        its absence (EMFILE, EIO) is raised: it says nothing of the stream."""
        try:
            return self._decoder.decode(self.record_path(key).read_bytes())
        except (FileNotFoundError, NotADirectoryError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    def live_record(self, key: str) -> StreamRecord | None:
        """The record, if it is of a stream still kept (not past TTL_S since its end)."""
        try:
            record = self.read_record(key)
        except OSError:
            return None
        if record is None or 0 < _ended_at(record) < time.time() - TTL_S:
            return None
        return record

    def lookup(self, conversation_ids: list[str]) -> list[StreamSession]:
        """The streams of the ids asked about (each id's own, and its `ID::model` variants); the
        ids of others are never listed."""
        # An id past MAX_ID_CHARS names no stream (none is recorded under one): it matches nothing.
        wanted = {cid for cid in conversation_ids if 0 < len(cid) <= MAX_ID_CHARS}
        sessions = []
        for path in sorted(self.directory.glob("*.json")) if wanted else ():
            record = self.live_record(path.stem)
            if record is None:
                continue
            cid = record.conversation_id
            if not _is_asked_about(cid, wanted):
                continue
            try:
                total = os.stat(self.data_path(path.stem)).st_size
            except OSError:
                continue
            is_done = record.completed_at > 0 or not is_process_alive(record.writer_pid)
            sessions.append(
                StreamSession(cid, is_done, total, int(record.started_at), int(record.completed_at))
            )
        return sessions

    def stop(self, conversation_id: str) -> None:
        """Forget the stream (its writer notices within STOP_CHECK_S and stops); nothing if
        there is none."""
        self.remove(self.key(conversation_id))

    def remove(self, key: str) -> None:
        self.record_path(key).unlink(missing_ok=True)
        self.data_path(key).unlink(missing_ok=True)

    def open_replay(self, conversation_id: str, offset: int) -> AsyncIterator[bytes] | None:
        """The stream's bytes from `offset`, then each new one until it ends; None if there is no
        such stream."""
        key = self.key(conversation_id)
        record = self.live_record(key)
        if record is None or record.conversation_id != conversation_id:
            return None
        try:
            data = open(self.data_path(key), "rb")  # noqa: SIM115 (the replay closes it)
        except OSError:
            return None
        again = self.live_record(key)
        if again is None or again.token != record.token:  # replaced meanwhile: its bytes may be the new one's
            data.close()
            return None
        return self._replay(key, record.token, data, offset)

    async def _replay(self, key: str, token: str, data: BinaryIO, offset: int) -> AsyncIterator[bytes]:
        last_bytes_at = time.monotonic()
        try:
            while True:
                data.seek(offset)
                chunk = data.read(1 << 16)
                if chunk:
                    offset += len(chunk)
                    last_bytes_at = time.monotonic()
                    yield chunk
                    continue
                with contextlib.suppress(OSError):  # unreadable for now: looked at again
                    record = self.read_record(key)
                    if record is None or record.token != token:
                        return  # deleted or replaced
                    if (
                        record.completed_at > 0
                        or record.is_truncated
                        or not is_process_alive(record.writer_pid)
                    ):
                        if data.read(1):  # bytes came before the record said it ended
                            continue
                        if record.is_truncated:
                            yield _error_event(f"this stream passed {MAX_BYTES} bytes: its replay ends here")
                        elif record.is_interrupted or record.completed_at == 0:
                            yield _error_event(
                                "the gateway replica that ran this stream stopped before its end"
                            )
                        return
                if time.monotonic() - last_bytes_at > IDLE_S:
                    yield _error_event(f"this stream sent nothing for {IDLE_S:.0f} s: its replay ends here")
                    return
                await asyncio.sleep(POLL_S)
        finally:
            data.close()

    def prune(self) -> None:
        """Forget streams ended TTL_S ago and those whose writer died as long ago, and files a
        killed writer left (temporary ones, bytes without a record)."""
        cutoff = time.time() - TTL_S
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.name.endswith(".json") and not entry.name.startswith(TMP_PREFIX):
                        record = self.read_record(entry.name[: -len(".json")])
                        ended = _ended_at(record) if record is not None else entry.stat().st_mtime
                        if ended and ended < cutoff:
                            self.remove(entry.name[: -len(".json")])
                    elif entry.stat().st_mtime < cutoff and (
                        entry.name.startswith(TMP_PREFIX)
                        or not self.record_path(entry.name.removesuffix(".sse")).exists()
                    ):
                        os.unlink(entry.path)


def _ended_at(record: StreamRecord) -> float:
    """When the stream ended (its writer's death counts from its start), or 0.0 while it runs."""
    return record.completed_at or (0.0 if is_process_alive(record.writer_pid) else record.started_at)


def _error_event(message: str) -> bytes:
    error = {"message": message, "type": "server_error", "param": None, "code": "stream_replay"}
    return b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"


def _is_asked_about(conversation_id: str, wanted: set[str]) -> bool:
    """`conversation_id` is one of `wanted`, or `W::model` of one: each prefix ending at a `::`
    is looked up once, so that a lookup of many ids against many streams stays linear."""
    if conversation_id in wanted:
        return True
    at = conversation_id.find("::")
    while at >= 0:
        if conversation_id[:at] in wanted:
            return True
        at = conversation_id.find("::", at + 1)
    return False
