"""A whole run with every link over tcp:// and CURVE (`network.transport: tcp`), real processes on
the tiny random Llama: SDK requests are served (greedy ids equal HF transformers'); clients with
a wrong key, no key or the wrong server key are refused within a deadline, counted in
`brigade:curve_auth_failures_total`, written to the audit log, and the run serves on; the client
key opens no internal link; hostile messages over CURVE kill nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import struct
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
import zmq

from client import AsyncClient, AuthenticationFailed, Client
from ipc import messages as m
from ipc.codec import CLIENT_REPLY, SCHEDULER_INPUT
from ipc.keys import load_secret_file
from ipc.ports import PORT_SPAN
from services.stage import read_run_info, run_endpoints
from tests import harness
from tests.conftest import REPO_ROOT
from tests.harness import (
    Run,
    assert_clean,
    brigade_run,
    free_port,
    hostile_messages,
    node_address,
    tokenizer_dealer,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REFUSED_WITHIN_S = 20.0  # a refused client hears it this soon (it is about a second when idle)
WAIT_S = 120.0
PROMPT_IDS = [1, 450, 4996, 17354, 1701, 284, 1190, 690]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tcp_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("tcp-run")
    config = run_dir.parent / "tcp-run.yaml"  # a file of its own: the rescale test edits it
    shutil.copy(REPO_ROOT / "configs" / "default.yaml", config)
    port, http_port = free_port(), free_port()
    with brigade_run(
        run_dir,
        "network.transport=tcp",
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "model.max_model_len=512",
        "engine.kv_cache_mib=32",
        "engine.threads=1",
        f"gateway.port={http_port}",
        f"supervisor.metrics_port={port}",
        config=str(config),
    ) as run:
        run.metrics_port = port
        run.http_port = http_port
        run_id = read_run_info(run_dir).run_id
        yield run
    assert_clean(run_dir, run_id)
    assert not (run_dir / "curve").exists(), "the run's keys outlived it"


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir: Path) -> list[int]:
    return harness.hf_greedy(tiny_model_dir, PROMPT_IDS, NEW_TOKENS)


def greedy(client: Client) -> list[int]:
    result = client.generate(
        PROMPT_IDS, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=WAIT_S
    )
    assert result.finish_reason == "length"
    return result.token_ids


def metric(run: Run, name: str, stage: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10).read().decode()
    samples = re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.MULTILINE)
    return sum(float(value) for labels, value in samples if f'stage="{stage}"' in labels.split(","))


def curve_failures(run: Run, source: str) -> list[dict]:
    path = run.run_dir / "audit.log"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        x
        for x in lines
        if x["event"] == "auth_failure" and x["mechanism"] == "curve" and x["source"] == source
    ]


def wait_for(what: str, condition, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.2)


def test_every_link_is_tcp_and_the_keys_are_private(tcp_run: Run) -> None:
    info = read_run_info(tcp_run.run_dir)
    assert not list(tcp_run.run_dir.glob("*.sock")), "an ipc:// socket in a tcp run"
    assert info.tokenizers == [f"tcp://127.0.0.1:{info.network.port_base + 64}"]
    assert info.network.keys is not None and info.curve_server_key == info.network.keys.server_public
    endpoints = run_endpoints(tcp_run.run_dir, info)
    for link in (endpoints.supervisor(), endpoints.scheduler_in(0), endpoints.scheduler_workers(0)):
        assert link.connect.startswith("tcp://127.0.0.1:") and link.server_curve is not None
    for path in [tcp_run.run_dir / "run.json", *(tcp_run.run_dir / "curve").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_sdk_requests_over_tcp_with_curve(tcp_run: Run, hf_greedy: list[int], tmp_path: Path) -> None:
    info = read_run_info(tcp_run.run_dir)
    with Client(tcp_run.run_dir) as client:
        assert greedy(client) == hf_greedy
    # As a remote client would: the endpoint, the server key and the client's certificate.
    keys_file = tmp_path / "client.key_secret"
    shutil.copy(info.curve_client_keys, keys_file)
    with Client(info.tokenizers[0], server_key=info.curve_server_key, keys=keys_file) as client:
        assert greedy(client) == hf_greedy
    # Or with a copy of run.json and the key file beside it (the path run.json names is elsewhere).
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    run_json = json.loads((tcp_run.run_dir / "run.json").read_text())
    run_json["curve_client_keys"] = "/on/the/server/host/curve/client.key_secret"
    (bundle / "run.json").write_text(json.dumps(run_json))
    shutil.copy(keys_file, bundle / "client.key_secret")
    with Client(bundle / "run.json") as client:
        assert greedy(client) == hf_greedy


def test_the_gateway_and_the_async_client_over_tcp(tcp_run: Run, hf_greedy: list[int]) -> None:
    """The gateway reaches the tokenizers through the asyncio SDK with the stage key; an
    AsyncClient of our own, with the run's keys, and one with a wrong key."""
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{tcp_run.http_port}/v1", api_key="open", timeout=WAIT_S)
    reply = api.completions.create(
        model=api.models.list().data[0].id,
        prompt=PROMPT_IDS,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    with Client(tcp_run.run_dir) as client:
        want = client.generate(
            PROMPT_IDS, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=WAIT_S
        )
    assert want.token_ids == hf_greedy
    assert (reply.choices[0].text, reply.usage.completion_tokens) == (want.text, NEW_TOKENS)
    info = read_run_info(tcp_run.run_dir)

    async def main() -> None:
        async with AsyncClient(tcp_run.run_dir) as client:
            result = await client.generate(
                PROMPT_IDS, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=WAIT_S
            )
            assert result.token_ids == hf_greedy
        wrong = AsyncClient(info.tokenizers[0], server_key=info.curve_server_key, keys=zmq.curve_keypair())
        async with wrong:
            start = time.monotonic()
            with pytest.raises(AuthenticationFailed, match="refused this client's key"):
                await wrong.generate("let me in", max_tokens=4, timeout=WAIT_S)
            assert time.monotonic() - start < REFUSED_WITHIN_S

    asyncio.run(main())


def refused_within(make_client, match: str) -> float:
    start = time.monotonic()
    with make_client() as client, pytest.raises(AuthenticationFailed, match=match):
        client.generate("let me in", max_tokens=4, timeout=WAIT_S)
    elapsed = time.monotonic() - start
    assert elapsed < REFUSED_WITHIN_S, f"refused only after {elapsed:.1f}s"
    return elapsed


def test_wrong_and_missing_keys_are_refused_counted_and_audited(tcp_run: Run, hf_greedy: list[int]) -> None:
    info = read_run_info(tcp_run.run_dir)
    endpoint, server_key = info.tokenizers[0], info.curve_server_key
    before = metric(tcp_run, "brigade:curve_auth_failures_total", "tokenizer-0")
    refused_within(
        lambda: Client(endpoint, server_key=server_key, keys=zmq.curve_keypair()), "refused this client's key"
    )
    refused_within(lambda: Client(endpoint), "needs server_key and keys|disagree on CURVE")
    wrong_server = zmq.curve_keypair()[0]
    refused_within(
        lambda: Client(endpoint, server_key=wrong_server, keys=info.curve_client_keys), "server_key"
    )
    # A client that gives up at once may close before the server has read its greeting; a plain
    # socket that stays makes sure the server sees a client without CURVE.
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)
        plain.linger = 0
        plain.connect(endpoint)

        def reasons() -> str:
            return " | ".join(line["reason"] for line in curve_failures(tcp_run, "tokenizer-0"))

        wait_for("a client without CURVE audited", lambda: "does not speak CURVE" in reasons())
    finally:
        ctx.destroy(linger=0)
    assert "not one of the run's client keys" in reasons()
    assert "does not hold this server's key" in reasons()
    wait_for(
        "the refusals counted on /metrics",
        lambda: metric(tcp_run, "brigade:curve_auth_failures_total", "tokenizer-0") >= before + 3,
    )
    assert all(row["restarts"] == 0 for row in tcp_run.status())
    with Client(tcp_run.run_dir) as client:
        assert greedy(client) == hf_greedy


@pytest.mark.parametrize("server", ["scheduler-0", "supervisor"])
def test_the_client_key_opens_no_internal_link(tcp_run: Run, server: str) -> None:
    """The client key reaches the tokenizers only: a client that tries the scheduler's inbox or
    the supervisor's control socket with it is refused there, counted, and the run goes on.

    The probe is the socket type each server expects (PUSH to the scheduler's PULL, DEALER to
    the supervisor's ROUTER): libzmq checks the peer's socket type while the ZAP request is out,
    and a mismatch drops the connection before the refusal is ever reported."""
    info = read_run_info(tcp_run.run_dir)
    endpoints = run_endpoints(tcp_run.run_dir, info)
    link = endpoints.scheduler_in(0) if server == "scheduler-0" else endpoints.supervisor()
    assert link.client_curve is not None
    client_keys = load_secret_file(info.curve_client_keys)
    ctx = zmq.Context()
    try:
        probe = ctx.socket(zmq.PUSH if server == "scheduler-0" else zmq.DEALER)
        probe.linger = 0
        probe.immediate = 1  # a send fails unless the handshake succeeded
        probe.curve_serverkey = link.client_curve.server_public_key
        probe.curve_publickey, probe.curve_secretkey = client_keys.public, client_keys.secret
        probe.connect(link.connect)
        deadline = time.monotonic() + REFUSED_WITHIN_S
        while not curve_failures(tcp_run, server):
            assert time.monotonic() < deadline, f"{server} did not refuse the client key"
            with pytest.raises(zmq.Again):
                probe.send(SCHEDULER_INPUT.encode(m.AbortRequest("never-seen")), zmq.NOBLOCK)
            time.sleep(0.2)
    finally:
        ctx.destroy(linger=0)
    assert "not one of the run's client keys" in curve_failures(tcp_run, server)[0]["reason"]
    wait_for("the refusal counted", lambda: metric(tcp_run, "brigade:curve_auth_failures_total", server) >= 1)
    assert all(row["restarts"] == 0 for row in tcp_run.status())


def test_hostile_messages_over_curve_kill_nothing(tcp_run: Run, hf_greedy: list[int]) -> None:
    ctx = zmq.Context()
    hostile = hostile_messages(random.Random(2))
    try:
        sock = tokenizer_dealer(ctx, tcp_run.run_dir)
        sock.sndtimeo = 10_000  # CURVE handshake first; then the tokenizer reads as fast as it can
        for i in range(2000):
            sock.send(hostile[i % len(hostile)]())
        num_replies = 0
        while sock.poll(3000):
            reply = CLIENT_REPLY.decode(sock.recv())
            assert isinstance(reply, m.ErrorReply | m.Delta | m.HealthReply)
            num_replies += 1
        assert num_replies > 200  # every answerable message got an error reply
    finally:
        ctx.destroy(linger=0)
    with Client(tcp_run.run_dir) as client:
        assert greedy(client) == hf_greedy
    assert all(row["restarts"] == 0 for row in tcp_run.status())


def test_new_replicas_get_their_own_tcp_links(tcp_run: Run, hf_greedy: list[int]) -> None:
    """A hot reload to 2 tokenizers and 2 detokenizers: the new ones listen on their own ports
    (with CURVE), run.json lists both tokenizers, and requests over either are served."""
    config = tcp_run.run_dir.parent / "tcp-run.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["tokenizer"]["replicas"] = raw["detokenizer"]["replicas"] = 2
    config.write_text(yaml.safe_dump(raw))
    tcp_run.process.send_signal(signal.SIGHUP)
    wait_for("two tokenizers in run.json", lambda: len(read_run_info(tcp_run.run_dir).tokenizers) == 2)
    wait_for(
        "every stage running",
        lambda: len(tcp_run.stage_pids("tokenizer")) == 2 and len(tcp_run.stage_pids("detokenizer")) == 2,
    )
    info = read_run_info(tcp_run.run_dir)
    assert info.tokenizers[1] == f"tcp://127.0.0.1:{info.network.port_base + 65}"
    for endpoint in info.tokenizers:
        with Client(endpoint, server_key=info.curve_server_key, keys=info.curve_client_keys) as client:
            assert greedy(client) == hf_greedy
            assert client.health(timeout=30)[0].is_ready


def tcp_peers(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the remote end of every established IPv4 TCP connection of `pid`."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    peers = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if state == "01" and inode in inodes:  # ESTABLISHED
            address, port = remote.split(":")
            peers.add((socket.inet_ntoa(struct.pack("<I", int(address, 16))), int(port, 16)))
    return peers


@pytest.mark.timeout(900)
def test_a_run_on_the_node_address_with_tensor_parallel(
    tmp_path: Path, tiny_model_dir: Path, hf_greedy: list[int]
) -> None:
    """Every link, and torch.distributed between the two tensor-parallel ranks, on the node's
    address rather than loopback: the workers hold no connection to 127.0.0.1."""
    host = node_address()
    if host is None:
        pytest.skip("no non-loopback IPv4 address")
    run_dir = tmp_path / "run"
    with brigade_run(
        run_dir,
        "network.transport=tcp",
        f"network.host={host}",
        "engine.tensor_parallel=2",
        f"model.path={tiny_model_dir}",
        "model.dtype=float32",
        "model.max_model_len=512",
        "engine.kv_cache_mib=32",
        "engine.threads=1",
        "gateway.replicas=0",
    ) as run:
        info = read_run_info(run_dir)
        assert info.tokenizers[0].startswith(f"tcp://{host}:")
        with Client(run_dir) as client:
            result = client.generate(
                PROMPT_IDS, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=WAIT_S
            )
        assert result.token_ids == hf_greedy
        links = range(info.network.port_base, info.network.port_base + PORT_SPAN)
        for pid in run.stage_pids("gpu_worker"):
            peers = tcp_peers(pid)
            assert peers and all(address == host for address, _ in peers), peers
            assert any(port not in links for _, port in peers), f"no torch.distributed connection: {peers}"
        run_id = info.run_id
    assert_clean(run_dir, run_id)
