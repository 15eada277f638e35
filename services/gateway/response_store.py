"""Stored /v1/responses replies, for `previous_response_id`, GET / DELETE /v1/responses/{id} and
GET /v1/responses/{id}/input_items.

One msgspec-JSON file per response in a directory of the run (`<run-dir>/responses`), so every
gateway replica of the run sees every stored response and a replica restarted after SIGKILL still
finds them. A file appears whole or not at all (written to a temporary name, then renamed); the
store is bounded by count and by age (`gateway.responses_max_stored`, `gateway.responses_max_age_s`),
pruned oldest first after each write. A file that is unreadable, oversized, of another shape or
too old reads as absent: the store is a cache of conversations, never a reason to fail a request
other than the one that names a missing id.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any

import msgspec

from services.gateway.protocol import ChatMessageIn

SUFFIX = ".json"
TMP_PREFIX = "."  # temporary files: hidden, never read as responses
# A temporary file older than this was left by a replica killed mid-write.
STALE_TMP_S = 600.0
_ID = re.compile(r"^resp_[0-9a-f]{32}$")  # ids we make; anything else names no file


class StoredResponse(msgspec.Struct):
    """The Response body as returned, and the conversation it ended (chat messages, instructions
    left out: OpenAI does not carry them over to the next response). Typed, so that a file of
    another shape reads as absent rather than failing the request that continues it."""

    created_at: float
    response: dict[str, Any]
    conversation: list[ChatMessageIn]
    input_items: list[dict[str, Any]] = []  # its own input, as GET .../input_items lists it


class ResponseStore:
    def __init__(self, directory: Path, max_stored: int, max_age_s: float, max_entry_bytes: int) -> None:
        self.directory = directory
        self.max_stored = max_stored
        self.max_age_s = max_age_s
        self.max_entry_bytes = max_entry_bytes
        self._decoder = msgspec.json.Decoder(StoredResponse)

    @property
    def enabled(self) -> bool:
        return self.max_stored > 0

    def _path(self, response_id: str) -> Path | None:
        return self.directory / f"{response_id}{SUFFIX}" if _ID.match(response_id) else None

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store `entry` (False: the store is off, the entry is over the size limit, or the
        disk refused it)."""
        path = self._path(response_id)
        data = msgspec.json.encode(entry)
        if not self.enabled or path is None or len(data) > self.max_entry_bytes:
            return False
        tmp = self.directory / f"{TMP_PREFIX}{response_id}.{os.getpid()}.tmp"
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:  # a full disk costs the conversation its continuation, not the reply
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        self.prune()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        path = self._path(response_id)
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                data = f.read(self.max_entry_bytes + 1)
        except OSError:
            return None
        if len(data) > self.max_entry_bytes:
            return None
        try:
            entry = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if time.time() - entry.created_at > self.max_age_s:
            self.delete(response_id)
            return None
        return entry

    def delete(self, response_id: str) -> bool:
        path = self._path(response_id)
        if path is None:
            return False
        try:
            path.unlink()
        except OSError:
            return False
        return True

    def prune(self) -> None:
        """Drop responses past the age limit, then the oldest ones past the count limit (by file
        time: replicas write concurrently, so names say nothing of order)."""
        now = time.time()
        kept: list[tuple[float, Path]] = []
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return
        for entry in entries:
            with contextlib.suppress(OSError):  # another replica may have pruned it already
                mtime = entry.stat().st_mtime
                if entry.name.startswith(TMP_PREFIX):
                    if now - mtime > STALE_TMP_S:
                        os.unlink(entry.path)
                elif entry.name.endswith(SUFFIX):
                    if now - mtime > self.max_age_s:
                        os.unlink(entry.path)
                    else:
                        kept.append((mtime, Path(entry.path)))
        kept.sort()
        for _, path in kept[: max(0, len(kept) - self.max_stored)]:
            with contextlib.suppress(OSError):
                path.unlink()
