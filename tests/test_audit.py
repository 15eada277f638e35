"""services/audit.py: one JSON line per administrative event, from several processes at once,
never raising; CURVE handshake failures seen on a real socket."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import zmq

from services.audit import ApiKeyFailures, AuditLog, CurveFailureMonitor, audit_log_path
from tests.conftest import REPO_ROOT

CHANGE = {"type": "object", "additionalProperties": {"type": "array", "minItems": 2, "maxItems": 2}}
COMMON = {
    "time": {"type": "string", "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$"},
    "ts": {"type": "number"},
    "source": {"type": "string", "minLength": 1},
}
SCHEMAS = {
    "reload": {"outcome": {"enum": ["applied", "partial", "refused"]}, "applied": CHANGE, "refused": CHANGE,
               "error": {"type": "string"}},
    "rescale": {"changes": CHANGE},
    "stage_restart": {"stage": {"type": "string"}, "reason": {"type": "string"}, "restart": {"type": "integer"},
                      "backoff_s": {"type": "number"}},
    "auth_failure": {"mechanism": {"enum": ["api_key", "curve"]}, "peer": {"type": "string"},
                     "reason": {"type": "string"}},
}  # fmt: skip


def check(line: dict) -> None:
    fields = SCHEMAS[line["event"]]
    schema = {
        "type": "object",
        "properties": {**COMMON, "event": {"const": line["event"]}, **fields},
        "required": [*COMMON, "event", *fields],
    }
    jsonschema.validate(line, schema)


def lines(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def test_path_default_and_configured(tmp_path: Path) -> None:
    assert audit_log_path(tmp_path) == tmp_path / "audit.log"
    assert audit_log_path(tmp_path, "/var/log/brigade/audit.log") == Path("/var/log/brigade/audit.log")


def test_every_event_kind_is_one_valid_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = AuditLog(path, "supervisor")
    before = time.time()
    audit.reload(applied={"tokenizer.replicas": [1, 2]}, refused={"engine.block_size": [16, 32]})
    audit.reload(applied={"supervisor.log_level": ["INFO", "DEBUG"]})
    audit.reload(applied={}, error="engine.max_num_seqs: expected int >= 1, got -3")
    audit.rescale({"tokenizer.replicas": [1, 2], "detokenizer.replicas": [2, 1]})
    audit.stage_restart("scheduler-0", "exited with code -9", restart=1, backoff_s=0.2)
    audit.auth_failure("api_key", "10.0.0.7:51234", "unknown API key", presented_key="sk-secret-123")
    audit.auth_failure("curve", "tcp://0.0.0.0:7000", "cryptographic error")
    got = lines(path)
    for line in got:
        check(line)
        assert line["source"] == "supervisor"
        assert before - 1 <= line["ts"] <= time.time() + 1
    assert [g["event"] for g in got] == ["reload"] * 3 + [
        "rescale",
        "stage_restart",
        "auth_failure",
        "auth_failure",
    ]
    assert [g["outcome"] for g in got[:3]] == ["partial", "applied", "refused"]
    assert got[0]["refused"] == {"engine.block_size": [16, 32]}
    assert "expected int >= 1" in got[2]["error"]
    assert got[3]["changes"]["detokenizer.replicas"] == [2, 1]
    assert got[4]["stage"] == "scheduler-0" and got[4]["restart"] == 1
    assert got[5]["key_sha256"] == hashlib.sha256(b"sk-secret-123").hexdigest()[:12]
    assert "sk-secret-123" not in path.read_text()
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_hostile_text_stays_on_one_bounded_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    AuditLog(path, "gateway-0").auth_failure("api_key", 'evil\n{"event": "forged"}\r', "x" * 10_000)
    (line,) = lines(path)
    check(line)
    assert line["peer"] == 'evil\n{"event": "forged"}\r'
    assert len(line["reason"]) < 600


def test_processes_appending_at_once_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    code = (
        "import sys; from pathlib import Path; from services.audit import AuditLog\n"
        "a = AuditLog(Path(sys.argv[1]), sys.argv[2])\n"
        "for i in range(300): a.rescale({'tokenizer.replicas': [i, i + 1], 'pad': ['y' * 2000, 0]})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    writers = [
        subprocess.Popen([sys.executable, "-c", code, str(path), f"gateway-{k}"], env=env, cwd=REPO_ROOT)
        for k in range(3)
    ]
    for writer in writers:
        assert writer.wait(120) == 0
    got = lines(path)
    assert len(got) == 900
    for k in range(3):
        mine = [g["changes"]["tokenizer.replicas"][0] for g in got if g["source"] == f"gateway-{k}"]
        assert mine == list(range(300))


def test_a_failed_write_is_counted_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    audit = AuditLog(tmp_path / "missing-dir" / "audit.log", "supervisor")
    with caplog.at_level(logging.WARNING, logger="audit"):
        audit.stage_restart("tokenizer-0", "exited with code 1", restart=2, backoff_s=0.4)
    assert audit.num_failed_writes == 1
    assert "could not write a stage_restart event" in caplog.text


def test_a_failing_audit_log_is_logged_once_until_it_works_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk fails every write: one warning then, one when writes work again."""
    path = tmp_path / "missing-dir" / "audit.log"
    audit = AuditLog(path, "supervisor")
    with caplog.at_level(logging.WARNING, logger="audit"):
        for restart in range(50):
            audit.stage_restart("tokenizer-0", "exited with code 1", restart=restart, backoff_s=0.4)
        path.parent.mkdir()
        audit.stage_restart("tokenizer-0", "exited with code 1", restart=50, backoff_s=0.4)
    assert audit.num_failed_writes == 50
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "could not write a stage_restart event" in messages[0]
    assert "written again; 50 event(s) were lost" in messages[1]
    assert [line["restart"] for line in lines(path)] == [50]


def test_refused_api_keys_are_aggregated_and_bounded(tmp_path: Path) -> None:
    """A client hammering the HTTP API with a wrong key, or many without one, cost a few lines an
    interval, not one per request; the counts add up to every refusal."""
    path = tmp_path / "audit.log"
    failures = ApiKeyFailures(AuditLog(path, "gateway-0"), interval_s=3600)
    for _ in range(1000):
        failures.record("10.0.0.7", "unknown API key", "sk-wrong")
    for i in range(1000):
        failures.record(f"10.1.{i // 256}.{i % 256}", "no Authorization: Bearer header")
    assert len(lines(path)) == 1 + ApiKeyFailures.MAX_PEERS  # each first refusal is written at once
    failures.flush(force=True)
    got = lines(path)
    for line in got:
        check(line)
    assert sum(line["count"] for line in got) == 2000
    assert len(got) <= 2 * (ApiKeyFailures.MAX_PEERS + 1)
    wrong_key = [line for line in got if line["peer"] == "10.0.0.7"]
    assert [line["count"] for line in wrong_key] == [1, 999]
    assert {line["key_sha256"] for line in wrong_key} == {hashlib.sha256(b"sk-wrong").hexdigest()[:12]}
    assert "sk-wrong" not in path.read_text()
    assert sum(line["count"] for line in got if line["peer"] == ApiKeyFailures.OTHERS) == 1000 - 63


@pytest.mark.timeout(60)
def test_curve_handshake_failures_are_audited(tmp_path: Path) -> None:
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    path = tmp_path / "audit.log"
    ctx = zmq.Context()
    try:
        server_public, server_secret = zmq.curve_keypair()
        server = ctx.socket(zmq.ROUTER)
        server.curve_server = True
        server.curve_publickey, server.curve_secretkey = server_public, server_secret
        port = server.bind_to_random_port("tcp://127.0.0.1")
        monitor = CurveFailureMonitor(server, AuditLog(path, "tokenizer-0"))

        def client(server_key: bytes) -> zmq.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.curve_serverkey = server_key
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.connect(f"tcp://127.0.0.1:{port}")
            return sock

        good = client(server_public)
        good.send(b"hello")
        assert server.poll(20_000), "the client with the right key never got through"
        server.recv_multipart()
        assert monitor.poll() == 0
        wrong_public, _ = zmq.curve_keypair()
        bad = client(wrong_public)
        bad.send(b"let me in")
        deadline = time.monotonic() + 20
        seen = 0
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = monitor.poll()
        assert seen >= 1, "no handshake failure reported"
        assert not server.poll(200), "a client without the server key got a message through"
        got = lines(path)
        for line in got:
            check(line)
        assert got[0]["mechanism"] == "curve" and got[0]["source"] == "tokenizer-0"
        assert "server's key" in got[0]["reason"]
        assert got[0]["peer"] == f"tcp://127.0.0.1:{port}"
        monitor.close()
        for sock in (good, bad, server):
            sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)
