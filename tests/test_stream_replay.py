"""llama-server's resumable streams (services/gateway/stream_replay.py), end to end on the run of
tests/test_gateway.py (two gateway replicas behind one port, so a replay often reads a stream
another replica runs): a stream POSTed with X-Conversation-Id runs on after its client leaves and
is replayed, whole or from an offset, live or ended; lookup, DELETE, replacement and bad input."""

from __future__ import annotations

import json
import socket
import time

import pytest

from services.gateway.stream_replay import _is_asked_about
from tests import test_gateway
from tests.test_gateway import (
    CHAT,
    CONFIG_KEY,
    HTTP_TIMEOUT_S,
    MAX_MODEL_LEN,
    Gateway,
    http_requests_count,
    parse_sse,
    wait_idle,
)

pytestmark = pytest.mark.timeout(600)

gw = test_gateway.gw


def chat_body(gw: Gateway, max_tokens: int) -> dict:
    return {"model": gw.model, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip


def leave_after_first_event(gw: Gateway, body: dict, conversation_id: str) -> bytes:
    """POST a stream with the id, read up to its first event, and close the connection."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CONFIG_KEY}\r\n"
        f"X-Conversation-Id: {conversation_id}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=HTTP_TIMEOUT_S) as sock:
        sock.sendall(head + data)
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 "), received
    return received


def lookup(gw: Gateway, *ids: str) -> list[dict]:
    status, _, data = gw.request("POST", "/v1/streams/lookup", {"conversation_ids": list(ids)})
    assert status == 200, data
    return json.loads(data)


def replay(gw: Gateway, conversation_id: str, offset: int = 0) -> tuple[int, bytes]:
    status, _, data = gw.request("GET", f"/v1/stream?conv_id={conversation_id}&from={offset}")
    return status, data


def content(sse: bytes) -> str:
    events = [e for e in parse_sse(sse.decode()) if e.get("data") and e["data"] != "[DONE]"]
    return "".join(
        (choice.get("delta") or {}).get("content") or ""
        for e in events
        for choice in json.loads(e["data"])["choices"]
    )


def wait_done(gw: Gateway, conversation_id: str) -> dict:
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while time.monotonic() < deadline:
        sessions = lookup(gw, conversation_id)
        if sessions and sessions[0]["is_done"]:
            return sessions[0]
        time.sleep(0.2)
    raise AssertionError(f"stream {conversation_id} did not end")


def test_a_stream_outlives_its_client_and_is_replayed_whole_or_from_an_offset(gw: Gateway) -> None:
    body = chat_body(gw, 24)
    _, expected_events = gw.curl_stream(body)  # not recorded: the oracle
    expected = "".join(
        (json.loads(e["data"])["choices"][0].get("delta") or {}).get("content") or ""
        for e in expected_events
        if e["data"] != "[DONE]" and json.loads(e["data"])["choices"]
    )
    leave_after_first_event(gw, body, "conv-a::model")
    # While it runs, and once it ended: a replay from 0 is the whole stream, live to its end.
    status, live = replay(gw, "conv-a::model")
    assert status == 200 and live.endswith(b"data: [DONE]\n\n"), live[-200:]
    assert content(live) == expected
    session = wait_done(gw, "conv-a")  # the id matches its ::model variant, as llama-server's
    assert session["conversation_id"] == "conv-a::model" and session["total_bytes"] == len(live), session
    assert 0 < session["started_at"] <= session["completed_at"], session
    for _ in range(4):  # two replicas: either reads the other's stream
        offset = len(live) // 3
        status, tail = replay(gw, "conv-a::model", offset)
        assert status == 200 and tail == live[offset:]
    for offset in (len(live), 10**17):  # at or past the end (past any file's largest offset)
        assert replay(gw, "conv-a::model", offset) == (200, b"")
    assert lookup(gw, "conv-b", "conv-a::other", "") == []  # only what is asked about, exactly
    # A long conversation list, with an id too long to name a stream, is answered all the same.
    assert lookup(gw, "x" * 513, *map(str, range(2000)), "conv-a") == [session]
    assert wait_idle(gw.run) == (0, 0.0)


def stopped_streams(gw: Gateway) -> float:
    """Chat requests ended before their end (a stopped stream's request counts as a closed one)."""
    return http_requests_count(gw, "/v1/chat/completions", 499)


def wait_stopped(gw: Gateway, count: float) -> None:
    deadline = time.monotonic() + 30
    while stopped_streams(gw) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stopped_streams(gw) == count


def test_delete_and_replacement_stop_a_running_stream(gw: Gateway) -> None:
    long_body = chat_body(gw, MAX_MODEL_LEN - 64)  # seconds of output: stopped long before its end
    before = stopped_streams(gw)
    leave_after_first_event(gw, long_body, "conv-del")
    assert lookup(gw, "conv-del")[0]["is_done"] is False
    status, _, _ = gw.request("DELETE", "/v1/stream?conv_id=conv-del")
    assert status == 204
    assert lookup(gw, "conv-del") == []
    assert replay(gw, "conv-del")[0] == 404
    wait_stopped(gw, before + 1)  # its engine request aborted, not run to its end (a 200)
    assert gw.request("DELETE", "/v1/stream?conv_id=conv-del")[0] == 204  # again: nothing there

    leave_after_first_event(gw, long_body, "conv-re")
    leave_after_first_event(gw, chat_body(gw, 4), "conv-re")  # the same id: replaces it
    session = wait_done(gw, "conv-re")
    status, data = replay(gw, "conv-re")
    assert status == 200 and len(data) == session["total_bytes"] and data.endswith(b"data: [DONE]\n\n")
    assert 1 <= len([e for e in parse_sse(data.decode()) if e.get("id")]) <= 6  # the short one's
    wait_stopped(gw, before + 2)  # the long one was stopped
    assert wait_idle(gw.run) == (0, 0.0)


def test_bad_replay_requests_get_clear_errors(gw: Gateway) -> None:
    for path, param in (("/v1/stream", "conv_id"), ("/v1/stream?conv_id=x&from=-1", "from"),
                        ("/v1/stream?conv_id=x&from=ab", "from")):  # fmt: skip
        status, _, data = gw.request("GET", path)
        assert status == 400 and json.loads(data)["error"]["param"] == param, data
    status, _, data = gw.request("GET", "/v1/stream?conv_id=never-seen")
    assert status == 404 and "never-seen" in json.loads(data)["error"]["message"], data
    status, error = gw.error("/v1/streams/lookup", b'{"conversation_ids": "x"}')
    assert status == 400 and error["param"] == "conversation_ids", error
    for method in ("GET", "DELETE"):
        status, _, data = gw.request(method, "/v1/stream?conv_id=" + "x" * 513)
        assert status == 400 and json.loads(data)["error"]["param"] == "conv_id", (method, data)
    status, error = gw.error("/v1/chat/completions", chat_body(gw, 2), {"x-conversation-id": "x" * 513})
    assert status == 400 and error["param"] == "X-Conversation-Id", error
    # An empty one records nothing, as llama-server's: the stream is served as any other.
    status, _, data = gw.request("POST", "/v1/chat/completions", chat_body(gw, 2), {"x-conversation-id": ""})
    assert status == 200 and data.endswith(b"data: [DONE]\n\n"), data
    status, _, data = gw.request("GET", f"/v1/stream?conv_id=x&from={10**20}")
    assert status == 400 and json.loads(data)["error"]["param"] == "from", data
    for method, path, body in (("GET", "/v1/stream?conv_id=x", None), ("DELETE", "/v1/stream?conv_id=x", None),
                               ("POST", "/v1/streams/lookup", {"conversation_ids": ["x"]})):  # fmt: skip
        status, _, data = gw.request(method, path, body, {"authorization": "Bearer nope"})
        assert status == 401, (method, path, data)


def test_a_stream_whose_recording_fails_is_still_served(gw: Gateway) -> None:
    """llama.cpp's web UI sends X-Conversation-Id with every chat: a run dir that refuses the
    recording (here a file where its directory goes) costs the stream its replay, not its reply."""
    streams = gw.run.run_dir / "streams"
    aside = gw.run.run_dir / "streams.aside"
    if streams.exists():
        streams.rename(aside)
    streams.write_bytes(b"")
    try:
        status, _, data = gw.request(
            "POST", "/v1/chat/completions", chat_body(gw, 8), {"x-conversation-id": "conv-disk"}
        )
        assert status == 200 and data.endswith(b"data: [DONE]\n\n"), data[-300:]
        assert len([e for e in parse_sse(data.decode()) if e.get("id")]) >= 8
    finally:
        streams.unlink()
        if aside.exists():
            aside.rename(streams)
    assert wait_idle(gw.run) == (0, 0.0)


def test_a_lookup_matches_ids_and_their_model_variants_only() -> None:
    wanted = {"conv-a", "b::x"}
    assert _is_asked_about("conv-a", wanted) and _is_asked_about("conv-a::model", wanted)
    assert _is_asked_about("b::x::model", wanted) and _is_asked_about("conv-a::m::n", wanted)
    assert not _is_asked_about("conv-ab", wanted) and not _is_asked_about("conv", wanted)
    assert not _is_asked_about("b", wanted) and not _is_asked_about("b::y", wanted)
    assert not _is_asked_about("x::conv-a", wanted) and not _is_asked_about("conv-a:model", wanted)
