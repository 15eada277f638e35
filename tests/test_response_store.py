"""The gateway's store of /v1/responses replies (services/gateway/response_store.py): bounded by
count and age, and a file it cannot trust reads as absent instead of failing anything."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from services.gateway.protocol import ChatMessageIn
from services.gateway.response_store import ResponseStore, StoredResponse

MAX_ENTRY_BYTES = 4096


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def entry(text: str = "hi") -> StoredResponse:
    return StoredResponse(time.time(), {"output_text": text}, [ChatMessageIn("user", text)])


def store(tmp_path: Path, max_stored: int = 3, max_age_s: float = 3600.0) -> ResponseStore:
    return ResponseStore(tmp_path / "responses", max_stored, max_age_s, MAX_ENTRY_BYTES)


def test_put_get_delete_and_a_second_store_on_the_same_directory_sees_it(tmp_path: Path) -> None:
    one, other = store(tmp_path), store(tmp_path)  # two replicas of a run
    response_id = new_id()
    assert one.put(response_id, entry("hello"))
    got = other.get(response_id)
    assert got is not None and got.response == {"output_text": "hello"}
    assert got.conversation == [ChatMessageIn("user", "hello")]
    assert other.delete(response_id) and one.get(response_id) is None and not one.delete(response_id)
    assert not [p for p in (tmp_path / "responses").iterdir()]  # no temporary file left


def test_oldest_pruned_past_the_count_and_old_ones_past_the_age(tmp_path: Path) -> None:
    responses = store(tmp_path, max_stored=3)
    ids = [new_id() for _ in range(5)]
    start = time.time() - 100
    for k, response_id in enumerate(ids):
        assert responses.put(response_id, entry())
        path = tmp_path / "responses" / f"{response_id}.json"
        os.utime(path, (start + k, start + k))  # written in this order, however coarse the clock
    kept = [i for i in ids if responses.get(i) is not None]
    assert kept == ids[2:]
    aged = store(tmp_path, max_stored=3, max_age_s=60.0)
    stale = new_id()
    aged.put(stale, StoredResponse(time.time() - 120, {}, []))  # its write prunes those of 100 s ago
    assert [i for i in ids if aged.get(i) is not None] == []
    assert aged.get(stale) is None  # made 120 s ago
    assert list((tmp_path / "responses").iterdir()) == []


def test_untrusted_files_and_ids_read_as_absent(tmp_path: Path) -> None:
    responses = store(tmp_path)
    directory = tmp_path / "responses"
    directory.mkdir()
    garbage, wrong_shape, huge = new_id(), new_id(), new_id()
    (directory / f"{garbage}.json").write_bytes(b"\xff{not json")
    (directory / f"{wrong_shape}.json").write_text('{"created_at": "yesterday"}')
    (directory / f"{huge}.json").write_bytes(b" " * (MAX_ENTRY_BYTES + 1))
    for response_id in (garbage, wrong_shape, huge, "../run", "resp_x", new_id()):
        assert responses.get(response_id) is None
    assert not responses.put("../../escape", entry()) and not (tmp_path / "escape.json").exists()
    assert not responses.put(new_id(), entry("x" * MAX_ENTRY_BYTES))  # over the size limit
    off = ResponseStore(directory, 0, 60.0, MAX_ENTRY_BYTES)
    assert not off.enabled and not off.put(new_id(), entry())
