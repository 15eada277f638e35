"""HTTPS and mTLS at the gateway, and its access log: real runs (tiny model) whose certificates
the test makes (tests/tls_certs.py), driven by the real `openai` client (its httpx2 client given
the test CA and a client certificate), curl, and http.client over `ssl`."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import json
import multiprocessing
import os
import pty
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest
from cryptography.hazmat.primitives import serialization

from client import Client
from ipc.config import AccessLogConfig
from services.gateway.access_log import AccessLog
from tests.conftest import REPO_ROOT
from tests.harness import assert_clean, brigade_run, free_port
from tests.tls_certs import CertificateAuthority, Issued

pytestmark = pytest.mark.timeout(600)

API_KEY = "sk-tls-test"
HTTP_TIMEOUT_S = 120.0
CHAT = [{"role": "user", "content": "Name a colour of the sea."}]
LOG_MAX_BYTES = 16 << 10
LOG_BACKUPS = 20
CURL = shutil.which("curl")
HEADER_TIMEOUT_S = 3.0


@dataclass
class TlsRun:
    run: object
    port: int
    model: str
    ca: CertificateAuthority
    server: Issued
    access_log: Path
    certs: Path
    client_cert: Issued | None = None  # what served_subject presents (an mTLS run needs one)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def context(self, client_cert: Issued | None = None, ca: Path | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(ca or self.ca.cert_path))
        if client_cert is not None:
            context.load_cert_chain(str(client_cert.cert), str(client_cert.key))
        return context

    def openai(self, client_cert: Issued | None = None) -> openai.OpenAI:
        http_client = httpx2.Client(verify=self.context(client_cert), timeout=HTTP_TIMEOUT_S)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, http_client=http_client)

    def request(
        self, method: str, path: str, body: dict | None = None, client_cert: Issued | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.port, timeout=HTTP_TIMEOUT_S, context=self.context(client_cert)
        )
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, data, {"authorization": f"Bearer {API_KEY}"})
            reply = conn.getresponse()
            return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
        finally:
            conn.close()

    def served_subject(self) -> str:
        """The subject of the certificate a new connection is served."""
        with (
            socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock,
            self.context(self.client_cert).wrap_socket(sock, server_hostname="127.0.0.1") as tls,
        ):
            return dict(rdn[0] for rdn in tls.getpeercert()["subject"])["commonName"]

    def access_lines(self) -> list[dict]:
        files = self.access_log.parent.glob(self.access_log.name + "*")  # and its rotated ones
        return [
            json.loads(line)
            for path in files
            if not path.name.endswith(".lock")
            for line in path.read_text().splitlines()
        ]

    def wait_access_lines(self, request_ids: set[str], timeout: float = 30.0) -> dict[str, dict]:
        """The lines of these requests (each written once its response has been sent)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = {
                line["request_id"]: line for line in self.access_lines() if line["request_id"] in request_ids
            }
            if len(lines) == len(request_ids) or time.monotonic() > deadline:
                return lines
            time.sleep(0.1)


def start(tmp: Path, model: Path, mtls: bool) -> Iterator[TlsRun]:
    certs = tmp / "certs"
    certs.mkdir()
    ca = CertificateAuthority(certs, "test-ca")
    server = ca.issue("server", server=True)
    port = free_port()
    access_log = tmp / "logs" / "access.log"
    access_log.parent.mkdir()
    run_dir = tmp / "run"
    overrides = [
        f"model.path={model}",
        "model.max_model_len=1024",
        f"gateway.port={port}",
        f"gateway.api_keys=[{API_KEY}]",
        f"gateway.tls.certfile={server.cert}",
        f"gateway.tls.keyfile={server.key}",
        f"gateway.access_log.path={access_log}",
        f"gateway.access_log.max_bytes={LOG_MAX_BYTES}",
        f"gateway.access_log.backups={LOG_BACKUPS}",
        f"gateway.header_timeout_s={HEADER_TIMEOUT_S}",
    ]
    if mtls:  # and the access log with the text, which the other run leaves out
        overrides += [f"gateway.tls.client_ca={ca.cert_path}", "gateway.access_log.include_text=true"]
    config = tmp / "brigade.yaml"  # the default config, in a file a test may edit to reload
    shutil.copyfile(REPO_ROOT / "configs" / "default.yaml", config)
    with brigade_run(run_dir, *overrides, config=str(config)) as run:
        ready = next(line for line in run.log if line.startswith("Brigade ready:"))
        assert f"https://127.0.0.1:{port}/v1" in ready
        yield TlsRun(run, port, str(model), ca, server, access_log, certs)
    assert_clean(run_dir)


@pytest.fixture(scope="module")
def tls_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TlsRun]:
    yield from start(tmp_path_factory.mktemp("tls"), tiny_model_dir, mtls=False)


@pytest.fixture(scope="module")
def mtls_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TlsRun]:
    for run in start(tmp_path_factory.mktemp("mtls"), tiny_model_dir, mtls=True):
        run.client_cert = run.ca.issue("alice", server=False)
        yield run


def refused(call) -> Exception:
    """The exception a connection attempt that the server refuses raises."""
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException, OSError)) as info:
        call()
    return info.value


# -- HTTPS ----------------------------------------------------------------------------------------


def test_the_openai_client_is_served_over_https(tls_run: TlsRun) -> None:
    reply = tls_run.openai().chat.completions.create(
        model=tls_run.model, messages=CHAT, max_tokens=16, temperature=0
    )
    with Client(tls_run.run.run_dir) as sdk:
        want = sdk.chat(CHAT, max_tokens=16, temperature=0.0, timeout=HTTP_TIMEOUT_S)
    assert reply.choices[0].message.content == want.text
    assert tls_run.served_subject() == "server"


def test_plain_http_is_refused_when_tls_is_on(tls_run: TlsRun) -> None:
    def plain() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", tls_run.port, timeout=10)
        try:
            conn.request("GET", "/v1/models", headers={"authorization": f"Bearer {API_KEY}"})
            conn.getresponse().read()
        finally:
            conn.close()

    refused(plain)
    # A client that does not trust the server's CA (the system's CAs only) is refused by itself.
    error = refused(
        lambda: http.client.HTTPSConnection("127.0.0.1", tls_run.port, timeout=10).request("GET", "/")
    )
    assert isinstance(error, ssl.SSLCertVerificationError)
    status, _, _ = tls_run.request("GET", "/v1/models")
    assert status == 200  # the server is serving: the refusals above were the protocol's


def test_a_connection_without_a_handshake_is_closed_at_the_header_deadline(tls_run: TlsRun) -> None:
    """A client that opens connections and never says ClientHello (slowloris at the TLS layer)
    held each one for asyncio's 60 s handshake timeout: gateway.header_timeout_s started only
    once a handshake was done. The replica serves on meanwhile."""
    start = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", tls_run.port), timeout=30) for _ in range(20)]
    try:
        assert tls_run.request("GET", "/v1/models")[0] == 200
        for sock in idle:
            assert sock.recv(1) == b""  # closed by the server, not timed out here
        assert time.monotonic() - start < HEADER_TIMEOUT_S + 5
    finally:
        for sock in idle:
            sock.close()
    assert tls_run.request("GET", "/v1/models")[0] == 200


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_curl_over_https(tls_run: TlsRun) -> None:
    base = [CURL, "-sS", "--max-time", "60", "-H", f"authorization: Bearer {API_KEY}"]
    done = subprocess.run([*base, "--cacert", str(tls_run.ca.cert_path), f"{tls_run.url}/v1/models"],
                          capture_output=True, text=True, timeout=90)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["data"][0]["id"] == tls_run.model
    plain = subprocess.run([*base, f"http://127.0.0.1:{tls_run.port}/v1/models"], capture_output=True, text=True,
                           timeout=90)  # fmt: skip
    assert plain.returncode != 0 and not plain.stdout
    untrusted = subprocess.run(
        [*base, f"{tls_run.url}/v1/models"], capture_output=True, text=True, timeout=90
    )
    assert untrusted.returncode == 60, untrusted.stderr  # curl: peer certificate cannot be authenticated


# -- the access log -------------------------------------------------------------------------------


def test_the_access_log_has_a_line_for_every_request_of_a_mixed_run(tls_run: TlsRun) -> None:
    api = tls_run.openai()
    chat = api.chat.completions.with_raw_response.create(
        model=tls_run.model, messages=CHAT, max_tokens=8, temperature=0
    )
    completion = api.completions.with_raw_response.create(
        model=tls_run.model, prompt="The sea is", max_tokens=6, temperature=0
    )
    stream = api.chat.completions.with_raw_response.create(
        model=tls_run.model, messages=CHAT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    stream_usage = next(chunk.usage for chunk in stream.parse() if chunk.usage is not None)
    bad_status, bad_headers, _ = tls_run.request(
        "POST", "/v1/chat/completions", {"model": tls_run.model, "messages": CHAT, "max_tokens": "many"}
    )
    missing_status, missing_headers, _ = tls_run.request("GET", "/v1/no-such-thing")
    assert (bad_status, missing_status) == (400, 404)
    want = {
        chat.headers["x-request-id"]: ("/v1/chat/completions", 200, chat.parse().usage),
        completion.headers["x-request-id"]: ("/v1/completions", 200, completion.parse().usage),
        stream.headers["x-request-id"]: ("/v1/chat/completions", 200, stream_usage),
        bad_headers["x-request-id"]: ("/v1/chat/completions", 400, None),
        missing_headers["x-request-id"]: ("/v1/no-such-thing", 404, None),
    }
    lines = tls_run.wait_access_lines(set(want))
    assert set(lines) == set(want)
    key_id = "key:" + hashlib.sha256(API_KEY.encode()).hexdigest()[:12]
    for request_id, (endpoint, status, usage) in want.items():
        line = lines[request_id]
        assert (line["endpoint"], line["status"], line["peer"]) == (endpoint, status, "127.0.0.1"), line
        assert line["caller"] == (key_id if endpoint != "/v1/no-such-thing" else None), line
        if usage is not None:
            assert (line["tokens_in"], line["tokens_out"]) == (usage.prompt_tokens, usage.completion_tokens)
        else:
            assert line["tokens_in"] is None and line["tokens_out"] is None
        assert "prompt" not in line and "output" not in line
    text = "".join(p.read_text() for p in tls_run.access_log.parent.iterdir())
    assert CHAT[0]["content"] not in text and "The sea is" not in text  # no text unless asked for


def _write_lines(path: str, writer: int, count: int) -> None:
    log = AccessLog(AccessLogConfig(path=path, max_bytes=2000, backups=2), f"writer-{writer}")
    for i in range(count):
        log.write({"writer": writer, "i": i, "pad": "x" * (i % 50)})


def test_access_log_rotation_keeps_its_bound_with_several_writers(tmp_path: Path) -> None:
    """Two processes (as two gateway replicas) append to one log at 2000 bytes, 2 backups."""
    path = str(tmp_path / "access.log")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_lines, args=(path, w, 300)) for w in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    files = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert files == ["access.log", "access.log.1", "access.log.2"]
    lines = []
    for name in files:
        data = (tmp_path / name).read_bytes()
        assert len(data) <= 2000, name
        lines += [json.loads(line) for line in data.splitlines()]  # whole lines only
    # What is kept is the newest lines: of each writer, the last ones it wrote (none, if it
    # finished early enough), and the last line written of all.
    for writer in (0, 1):
        kept = sorted(line["i"] for line in lines if line["writer"] == writer)
        assert kept == list(range(kept[0], 300)) if kept else True, (writer, kept)
    assert {(line["writer"], line["i"]) for line in lines} & {(0, 299), (1, 299)}


# -- mTLS -----------------------------------------------------------------------------------------


def test_mtls_serves_a_client_certificate_and_logs_its_subject_as_the_caller(mtls_run: TlsRun) -> None:
    reply = mtls_run.openai(mtls_run.client_cert).chat.completions.with_raw_response.create(
        model=mtls_run.model, messages=CHAT, max_tokens=4, temperature=0
    )
    assert reply.parse().choices[0].finish_reason in ("stop", "length")
    line = mtls_run.wait_access_lines({reply.headers["x-request-id"]})[reply.headers["x-request-id"]]
    assert line["caller"] == "cert:" + mtls_run.client_cert.subject == "cert:CN=alice,O=brigade tests"
    # include_text: the messages and the output, as sent and as served
    assert line["prompt"] == [CHAT] and line["output"] == [reply.parse().choices[0].message.content]


def test_mtls_refuses_a_client_without_a_certificate_or_with_another_cas(mtls_run: TlsRun) -> None:
    other_ca = CertificateAuthority(mtls_run.certs, "other-ca")
    mallory = other_ca.issue("mallory", server=False)
    for client_cert in (None, mallory):
        refused(lambda: mtls_run.request("GET", "/v1/models", client_cert=client_cert))  # noqa: B023
        with pytest.raises(openai.APIConnectionError):
            mtls_run.openai(client_cert).models.list()
    status, _, _ = mtls_run.request("GET", "/v1/models", client_cert=mtls_run.client_cert)
    assert status == 200


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_curl_with_and_without_a_client_certificate(mtls_run: TlsRun) -> None:
    base = [CURL, "-sS", "--max-time", "60", "--cacert", str(mtls_run.ca.cert_path),
            "-H", f"authorization: Bearer {API_KEY}", f"{mtls_run.url}/v1/models"]  # fmt: skip
    alice = mtls_run.client_cert
    done = subprocess.run([*base, "--cert", str(alice.cert), "--key", str(alice.key)],
                          capture_output=True, text=True, timeout=90)  # fmt: skip
    assert done.returncode == 0 and json.loads(done.stdout)["object"] == "list", done.stderr
    without = subprocess.run(base, capture_output=True, text=True, timeout=90)
    assert without.returncode != 0 and not without.stdout


def replace_file(path: Path, data: bytes) -> None:
    """As an operator's tooling rotates a file: written beside it, then renamed over it."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.1)


def test_rotation_mid_traffic(mtls_run: TlsRun) -> None:
    """A new pair on disk: a stream in flight goes on over its connection, new connections get
    the new certificate; then a pair that does not match, or an encrypted key, is refused and the
    last good one kept."""
    assert mtls_run.served_subject() == "server"
    api = mtls_run.openai(mtls_run.client_cert)
    stream = api.completions.create(
        model=mtls_run.model, prompt="Once", max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = next(iter(stream))
    rotated = mtls_run.ca.issue("server-rotated", server=True)
    replace_file(mtls_run.server.key, rotated.key.read_bytes())
    replace_file(mtls_run.server.cert, rotated.cert.read_bytes())
    wait_for(lambda: mtls_run.served_subject() == "server-rotated")
    rest = list(stream)  # the stream's connection, made before the rotation, is read to its end
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    assert rest[-1].choices[0].finish_reason == "length"
    with Client(mtls_run.run.run_dir) as sdk:
        want = sdk.generate("Once", max_tokens=400, temperature=0.0, ignore_eos=True, timeout=HTTP_TIMEOUT_S)
    assert text == want.text

    # A key that is not the certificate's: refused, and the rotated pair serves on.
    stranger = mtls_run.ca.issue("stranger", server=True)
    replace_file(mtls_run.server.key, stranger.key.read_bytes())
    audit = mtls_run.run.run_dir / "audit.log"
    wait_for(lambda: '"tls_reload","outcome":"refused"' in audit.read_text())
    assert mtls_run.served_subject() == "server-rotated"
    # The rotated key, encrypted: refused with the reason (not asked for on a terminal, nor "Invalid argument").
    replace_file(mtls_run.server.key, encrypted_copy(rotated.key).read_bytes())
    wait_for(lambda: audit.read_text().count('"tls_reload","outcome":"refused"') == 2)
    refusals = [json.loads(line) for line in audit.read_text().splitlines() if '"tls_reload"' in line]
    assert "is encrypted, and Brigade takes no passphrase" in refusals[-1]["error"], refusals[-1]
    assert mtls_run.served_subject() == "server-rotated"
    status, _, metrics = mtls_run.request("GET", "/metrics", client_cert=mtls_run.client_cert)
    assert status == 200
    assert 'brigade:gateway_tls_reloads_total{outcome="refused"} 2.0' in metrics.decode()
    assert 'brigade:gateway_tls_reloads_total{outcome="applied"} 1.0' in metrics.decode()

    # A hot reload that adds a gateway replica now: the new replica could not load the files, and
    # a stage failing its first start ended the whole run. The reload is refused, the run serves on.
    run, config = mtls_run.run, mtls_run.run.run_dir.parent / "brigade.yaml"
    config.write_text(config.read_text() + "gateway:\n  replicas: 2\n")
    run.process.send_signal(signal.SIGHUP)
    line = run.wait_for_line("reload: replica and engine group counts stay as they were", 60)
    assert "gateway.tls.keyfile" in line and "is encrypted" in line, line
    assert run.process.poll() is None and mtls_run.served_subject() == "server-rotated"
    assert mtls_run.request("GET", "/v1/models", client_cert=mtls_run.client_cert)[0] == 200
    # With a good pair on disk again, the same reload adds the replica.
    replace_file(mtls_run.server.key, rotated.key.read_bytes())
    wait_for(lambda: audit.read_text().count('"tls_reload","outcome":"applied"') == 2)
    run.process.send_signal(signal.SIGHUP)
    run.wait_for_line("reload applied: gateway.replicas", 120)
    assert [r["state"] for r in run.status() if r["kind"] == "gateway"] == ["running", "running"]
    assert mtls_run.served_subject() == "server-rotated"


def supervisor_argv(tmp_path: Path, cert: Path, key: Path, client_ca: Path) -> list[str]:
    return [sys.executable, "supervisor.py", "--run-dir", str(tmp_path / "run"), "--set", f"gateway.port={free_port()}",
            "--set", "supervisor.metrics_port=0", "--set", f"gateway.tls.certfile={cert}",
            "--set", f"gateway.tls.keyfile={key}", "--set", f"gateway.tls.client_ca={client_ca}"]  # fmt: skip


def encrypted_copy(key: Path) -> Path:
    """`key` encrypted with a passphrase, as `openssl pkey -aes256` writes it."""
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    encrypted = key.with_name("encrypted.key")
    encrypted.write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase"),
    ))  # fmt: skip
    return encrypted


# Each a way an operator's files go wrong, and what the refusal must name (ssl's own errors name
# no file: "[SSL] PEM lib (_ssl.c:3905)", "[Errno 22] Invalid argument" for an encrypted key).
BROKEN = {
    "missing_key": "gateway.tls.keyfile: no file '{key}'",
    "key_of_another_certificate": "gateway.tls.keyfile: '{key}' is not the key of '{cert}'",
    "ca_without_certificates": "gateway.tls.client_ca: '{client_ca}' holds no CA certificate",
    "empty_certificate": "gateway.tls.certfile: '{cert}' holds no PEM certificate",
    "certificate_as_key": "gateway.tls.keyfile: '{key}' holds no PEM private key",
    "certificate_is_a_directory": "gateway.tls.certfile: '{cert}' is not a regular file",
    "encrypted_key": "gateway.tls.keyfile: '{key}' is encrypted, and Brigade takes no passphrase",
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_the_supervisor_refuses_certificate_files_that_do_not_load(tmp_path: Path, broken: str) -> None:
    ca = CertificateAuthority(tmp_path, "ca")
    server, other = ca.issue("server", server=True), ca.issue("other", server=True)
    cert, key, client_ca = server.cert, server.key, ca.cert_path
    if broken == "missing_key":
        key = tmp_path / "no-such.key"
    elif broken == "key_of_another_certificate":
        key = other.key
    elif broken == "ca_without_certificates":
        client_ca = tmp_path / "empty.pem"
        client_ca.write_text("")
    elif broken == "empty_certificate":
        cert = tmp_path / "empty.crt"
        cert.write_text("")
    elif broken == "certificate_as_key":
        key = server.cert
    elif broken == "certificate_is_a_directory":
        cert = tmp_path / "certs.d"
        cert.mkdir()
    else:
        key = encrypted_copy(server.key)
    done = subprocess.run(
        supervisor_argv(tmp_path, cert, key, client_ca),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert errors and errors[0].startswith("error: gateway.tls: the certificate files do not load: "), errors
    assert BROKEN[broken].format(cert=cert, key=key, client_ca=client_ca) in errors[0], errors


def test_an_encrypted_key_is_refused_not_prompted_for_on_the_terminal(tmp_path: Path) -> None:
    """Started from a terminal, OpenSSL asked for the key's passphrase there ("Enter PEM pass
    phrase:"), and the supervisor (or a replica's event loop, at a rotation) waited for ever."""
    ca = CertificateAuthority(tmp_path, "ca")
    server = ca.issue("server", server=True)
    key = encrypted_copy(server.key)
    primary, secondary = pty.openpty()

    def with_the_terminal() -> None:  # the pty, the child's controlling terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    argv = supervisor_argv(tmp_path, server.cert, key, ca.cert_path)
    child = subprocess.Popen(argv, cwd=REPO_ROOT, stdin=secondary, stdout=secondary, stderr=secondary,
                             preexec_fn=with_the_terminal)  # fmt: skip
    os.close(secondary)
    output = b""
    deadline = time.monotonic() + 90
    try:
        while child.poll() is None and time.monotonic() < deadline:
            if select.select([primary], [], [], 0.5)[0]:
                with contextlib.suppress(OSError):
                    output += os.read(primary, 4096)
        assert child.poll() == 1, f"still running after 90 s: {output.decode(errors='replace')[-2000:]}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        os.close(primary)
    assert b"pass phrase" not in output and b"is encrypted, and Brigade takes no passphrase" in output, output
