"""Client SDK and CLI against fake tokenizers: real ZeroMQ ROUTER sockets in threads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from client import (
    AsyncClient,
    AuthenticationFailed,
    BrigadeError,
    Client,
    ClientClosed,
    InvalidRequest,
    Overloaded,
    PromptTooLong,
    RequestTimeout,
    ServerUnavailable,
    StreamDelta,
)
from client.sdk import Session
from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST
from ipc.endpoints import make_run_dir

from .conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


def token_text(token_id: int) -> str:
    """The fake model's detokenizer: multi-character pieces, some non-ASCII."""
    return f"<{token_id}é>"


def expected_ids(prompt: str, n: int) -> list[int]:
    return [100 + (len(prompt) * 7 + i) % 50 for i in range(n)]


@dataclass
class _Stream:
    identity: bytes
    request: m.Generate
    ids: list[int]
    next_index: int
    num_sent: int = 0


@dataclass
class FakeTokenizer:
    """A tokenizer replica that streams `expected_ids(prompt, max_tokens)` one token per delta.

    mode: "normal"; "dup" (every delta twice, plus an overlapping re-send); "error:<code>";
    "garbled" (answers Generate with an ErrorReply that has no request id, as a tokenizer does to a
    message it cannot read); "hang" (answers Health, never Generate). `die_after` tokens: then it goes silent for good
    (no deltas, no health replies), as a killed process would.
    """

    endpoint: str
    mode: str = "normal"
    die_after: int | None = None
    interval: float = 0.002
    tokenizer_id: int = 0
    curve_keys: tuple[bytes, bytes] | None = None
    received: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        if self.curve_keys is not None:
            self._sock.curve_server = True
            self._sock.curve_publickey, self._sock.curve_secretkey = self.curve_keys
        self._sock.bind(self.endpoint)
        self.last_endpoint = self._sock.last_endpoint.decode()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self.is_dead = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def requests(self, kind: type) -> list:
        return [r for r in list(self.received) if isinstance(r, kind)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()

    def _send(self, identity: bytes, reply: m.ClientReply) -> None:
        self._sock.send_multipart([identity, CLIENT_REPLY.encode(reply)])

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(int(self.interval * 1000) or 1):
                identity, data = self._sock.recv_multipart()
                request = CLIENT_REQUEST.decode(data)
                self.received.append(request)
                if not self.is_dead:
                    self._handle(identity, request)
            if not self.is_dead:
                for stream in list(self._streams.values()):
                    self._step(stream)

    def _handle(self, identity: bytes, request: m.ClientRequest) -> None:
        if isinstance(request, m.Health):
            self._send(identity, m.HealthReply(self.tokenizer_id, True, "fake", len(self._streams), 2048))
        elif isinstance(request, m.Abort):
            self._streams.pop(request.request_id, None)
        elif self.mode.startswith("error:"):
            self._send(identity, m.ErrorReply(request.request_id, self.mode[6:], "refused by the fake"))
        elif self.mode == "garbled":
            self._send(identity, m.ErrorReply("", "invalid_request", "malformed message"))
        elif request.params.embed is not None:  # one vector of the prompt's length, or refused
            if (request.prompt or "").startswith("bad"):
                self._send(
                    identity, m.ErrorReply(request.request_id, "invalid_request", "refused by the fake")
                )
            else:
                vector = np.full(4, len(request.prompt or ""), "<f4").tobytes()
                self._send(identity, m.Delta(request.request_id, 0, 0, "", b"", finish_reason="stop",
                                             usage=m.Usage(1, 0), embedding=vector))  # fmt: skip
        elif self.mode != "hang":
            prompt = request.prompt or "".join(msg.role for msg in request.messages or [])
            ids = expected_ids(prompt, request.params.max_tokens)
            resume = m.unpack_ids(request.resume_output_ids).tolist()
            assert resume == ids[: len(resume)], "resumed with ids this request never produced"
            assert request.resume_num_chars == len("".join(map(token_text, resume)))
            self._streams[request.request_id] = _Stream(identity, request, ids, len(resume))

    def _delta(self, stream: _Stream, start: int, end: int) -> m.Delta:
        ids = stream.ids[start:end]
        return m.Delta(
            request_id=stream.request.request_id,
            token_index=start,
            char_offset=len("".join(map(token_text, stream.ids[:start]))),
            text="".join(map(token_text, ids)),
            token_ids=m.pack_ids(ids),
            logprobs=np.asarray([-0.25 * i for i in range(start, end)], "<f4").tobytes(),
            finish_reason="length" if end == len(stream.ids) else None,
            usage=m.Usage(3, len(stream.ids), 1) if end == len(stream.ids) else None,
        )

    def _step(self, stream: _Stream) -> None:
        if self.die_after is not None and stream.num_sent >= self.die_after:
            self.is_dead = True
            return
        i = stream.next_index
        delta = self._delta(stream, i, i + 1)
        if self.mode == "dup":
            self._send(stream.identity, delta)
            self._send(stream.identity, delta)
            self._send(stream.identity, self._delta(stream, max(0, i - 2), i + 1))  # overlapping
        self._send(stream.identity, delta)
        stream.next_index += 1
        stream.num_sent += 1
        if stream.next_index == len(stream.ids):
            del self._streams[stream.request.request_id]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run_dir(tmp_path / "run")


@pytest.fixture
def fakes(run_dir: Path):
    made: list[FakeTokenizer] = []

    def make(i: int = 0, **kw) -> FakeTokenizer:
        fake = FakeTokenizer(f"ipc://{run_dir}/tokenizer-{i}.sock", tokenizer_id=i, **kw)
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.close()


def expected_text(prompt: str, n: int) -> str:
    return "".join(map(token_text, expected_ids(prompt, n)))


def test_generate_and_stream(fakes) -> None:
    fake = fakes()
    with Client(endpoints=[fake.endpoint]) as client:
        result = client.generate("hello", max_tokens=12)
        assert result.text == expected_text("hello", 12)
        assert result.token_ids == expected_ids("hello", 12)
        assert result.finish_reason == "length"
        assert result.usage == m.Usage(3, 12, 1)
        assert result.logprobs == [-0.25 * i for i in range(12)]
        deltas = list(client.stream("hey", max_tokens=5))
    assert [d.token_ids for d in deltas] == [[i] for i in expected_ids("hey", 5)]
    assert "".join(d.text for d in deltas) == expected_text("hey", 5)
    assert [d.finish_reason for d in deltas] == [None] * 4 + ["length"]
    (first, second) = fake.requests(m.Generate)
    assert first.request_id != second.request_id and len(first.request_id) == 32
    assert first.params.seed is not None  # assigned client-side: temperature 1.0 samples


def test_chat_sends_messages(fakes) -> None:
    fake = fakes()
    with Client(endpoints=[fake.endpoint]) as client:
        result = client.chat([{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0)
    (request,) = fake.requests(m.Generate)
    assert request.messages == [m.ChatMessage("user", "hi")] and request.prompt is None
    assert request.params.seed is None  # greedy needs none
    assert result.text == expected_text("user", 3)


def test_exactly_once_with_duplicated_and_overlapping_deltas(fakes) -> None:
    fake = fakes(mode="dup")
    with Client(endpoints=[fake.endpoint]) as client:
        deltas = list(client.stream("dups", max_tokens=20))
    assert [i for d in deltas for i in d.token_ids] == expected_ids("dups", 20)
    assert "".join(d.text for d in deltas) == expected_text("dups", 20)
    assert all(d.text or d.token_ids or d.finish_reason for d in deltas)


def test_out_of_order_deltas_are_assembled_in_order() -> None:
    from client.sdk import RequestState

    state = RequestState(m.Generate("r"), None, 0.0)
    texts = ["ab", "c", "déf"]
    deltas = [m.Delta("r", i, [0, 2, 3][i], t, m.pack_ids([i])) for i, t in enumerate(texts)]
    deltas[2].finish_reason = "stop"
    for d in (deltas[2], deltas[0], deltas[0], deltas[1]):
        state.apply(d)
    assert "".join(d.text for d in state.ready) == "abcdéf"
    assert state.token_ids == [0, 1, 2] and state.finish_reason == "stop"


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("invalid_request", InvalidRequest),
        ("prompt_too_long", PromptTooLong),
        ("overloaded", Overloaded),
        ("unavailable", ServerUnavailable),
        ("internal", BrigadeError),
    ],
)
def test_error_mapping(fakes, code: str, error: type[BrigadeError]) -> None:
    fake = fakes(mode=f"error:{code}")
    with (
        Client(endpoints=[fake.endpoint]) as client,
        pytest.raises(error, match="refused by the fake") as info,
    ):
        client.generate("x")
    assert info.value.code == code


def test_invalid_sampling_argument_is_an_invalid_request(fakes) -> None:
    fake = fakes()
    with (
        Client(endpoints=[fake.endpoint]) as client,
        pytest.raises(InvalidRequest, match=r"unknown sampling parameter\(s\): no_such_param$"),
    ):
        client.generate("x", no_such_param=1)


def test_top_k_minus_one_disables_top_k_as_in_vllm(fakes, run_dir: Path) -> None:
    """vLLM's and SGLang's clients send top_k=-1 for "no top-k", and the gateway takes it: the
    SDK and the CLI must too (the tokenizer refused it, "top_k must be in [0, ...]"), sending
    Brigade's 0."""
    fake = fakes()
    with Client(endpoints=[fake.endpoint]) as client:
        assert client.generate("x", top_k=-1, max_tokens=2).finish_reason == "length"
    write_run_json(run_dir, [fake.endpoint])
    out = run_cli("--run", str(run_dir), "generate", "x", "--top-k", "-1", "--max-tokens", "2")
    assert out.returncode == 0, out.stderr
    assert [r.params.top_k for r in fake.requests(m.Generate)] == [0, 0]


def test_timeout_raises_and_aborts(fakes) -> None:
    fake = fakes(mode="hang")
    with Client(endpoints=[fake.endpoint]) as client:
        start = time.monotonic()
        with pytest.raises(RequestTimeout):
            client.generate("x", timeout=0.3)
        assert 0.3 <= time.monotonic() - start < 3
        (request,) = fake.requests(m.Generate)
        wait_for(lambda: fake.requests(m.Abort))
    assert fake.requests(m.Abort)[0].request_id == request.request_id


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_breaking_out_of_a_stream_sends_abort(fakes) -> None:
    fake = fakes(interval=0.01)
    with Client(endpoints=[fake.endpoint]) as client:
        for i, _ in enumerate(client.stream("long", max_tokens=1000)):
            if i == 2:
                break
        wait_for(lambda: fake.requests(m.Abort))
        (request,) = fake.requests(m.Generate)
        assert fake.requests(m.Abort)[0].request_id == request.request_id
        assert client.session.requests == {}


def test_failover_resumes_on_another_replica(fakes) -> None:
    dying, spare = fakes(0, die_after=7), fakes(1)
    with Client(endpoints=[dying.endpoint, spare.endpoint], failover_after=0.3) as client:
        client.health()  # both connected
        client.session._next = 0  # the round robin starts on the dying one
        result = client.generate("failover", max_tokens=20)
        assert client.session.num_failovers == 1
    # One uninterrupted, duplicate-free result.
    assert result.text == expected_text("failover", 20)
    assert result.token_ids == expected_ids("failover", 20)
    (first,) = dying.requests(m.Generate)
    (resumed,) = spare.requests(m.Generate)
    assert resumed.request_id == first.request_id and resumed.params == first.params
    assert m.unpack_ids(resumed.resume_output_ids).tolist() == expected_ids("failover", 7)
    assert resumed.resume_num_chars == len(expected_text("failover", 7))
    # The run admitted it: a stopping run finishes it on the replica it moved to.
    assert (first.continues, resumed.continues) == (False, True)
    assert dying.requests(m.Health), "the silent replica was probed before failing over"


def test_requests_spread_across_replicas(fakes) -> None:
    a, b = fakes(0), fakes(1)
    with Client(endpoints=[a.endpoint, b.endpoint]) as client:
        streams = [client.stream(f"p{i}", max_tokens=30) for i in range(4)]
        firsts = [next(s) for s in streams]  # all four in flight at once
        assert all(f.token_ids for f in firsts)
        for s in streams:
            s.close()
    assert len(a.requests(m.Generate)) == 2 and len(b.requests(m.Generate)) == 2


def test_no_tokenizer_is_server_unavailable(run_dir: Path) -> None:
    with pytest.raises(ServerUnavailable, match=r"no run\.json"):
        Client(run_dir)
    for damaged in ("null", "[]", '"run"'):  # was AttributeError: 'NoneType' object has no attribute 'get'
        (run_dir / "run.json").write_text(damaged)
        with pytest.raises(ServerUnavailable, match="not a Brigade run file"):
            Client(run_dir)
    (run_dir / "run.json").unlink()
    with Client(
        endpoints=[f"ipc://{run_dir}/nobody.sock"], failover_after=0.1, unavailable_after=0.4
    ) as client:
        with pytest.raises(ServerUnavailable):
            client.generate("x")
        with pytest.raises(ServerUnavailable):
            client.health(timeout=0.2)


def test_health(fakes) -> None:
    a, b = fakes(0), fakes(1)
    with Client(endpoints=[a.endpoint, b.endpoint]) as client:
        replies = client.health()
    assert sorted(r.tokenizer_id for r in replies) == [0, 1] and all(r.is_ready for r in replies)


def test_curve_over_tcp() -> None:
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    server_public, server_secret = zmq.curve_keypair()
    fake = FakeTokenizer("tcp://127.0.0.1:*", curve_keys=(server_public, server_secret))
    endpoint = fake.last_endpoint
    try:
        keys = zmq.curve_keypair()  # the fake tokenizer has no authenticator: any client key passes
        with Client(endpoint, server_key=server_public, keys=keys) as client:
            assert client.generate("curvy", max_tokens=3).text == expected_text("curvy", 3)
        wrong_key = zmq.curve_keypair()[0]
        wrong = Client(endpoint, server_key=wrong_key, keys=keys, failover_after=0.1, unavailable_after=30)
        with wrong, pytest.raises(AuthenticationFailed, match="server_key"):
            wrong.generate("curvy", max_tokens=3)
    finally:
        fake.close()
    assert len(fake.requests(m.Generate)) == 1  # the wrong key never got through


def test_async_generate_stream_and_cancel(fakes) -> None:
    fake = fakes(interval=0.01)

    async def main() -> None:
        async with AsyncClient(endpoints=[fake.endpoint]) as client:
            result = await client.generate("async", max_tokens=8)
            assert result.text == expected_text("async", 8)
            assert result.token_ids == expected_ids("async", 8)

            received = []

            async def consume() -> None:
                async for delta in client.stream("cancel me", max_tokens=1000):
                    received.append(delta)

            task = asyncio.create_task(consume())
            while len(received) < 2:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 5
            while not fake.requests(m.Abort):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            with pytest.raises(RequestTimeout):
                await client.generate("x", max_tokens=10_000, timeout=0.05)

    asyncio.run(main())
    cancelled = fake.requests(m.Generate)[1].request_id
    assert cancelled in [a.request_id for a in fake.requests(m.Abort)]


def test_async_failover(fakes) -> None:
    dying, spare = fakes(0, die_after=4), fakes(1)

    async def main() -> m.Usage:
        async with AsyncClient(endpoints=[dying.endpoint, spare.endpoint], failover_after=0.3) as client:
            await client.health()
            client.session._next = 0  # the round robin starts on the dying one
            result = await client.generate("afail", max_tokens=10)
            assert result.text == expected_text("afail", 10)
            return result.usage

    assert asyncio.run(main()) == m.Usage(3, 10, 1)
    assert m.unpack_ids(spare.requests(m.Generate)[0].resume_output_ids).tolist() == expected_ids("afail", 4)


def test_clients_take_replicas_added_later(fakes) -> None:
    """add_replicas (a gateway's client, when a hot reload added tokenizers): requests go to the
    new replica too, and its replies are read, by the sync and the asyncio client alike."""
    first, added = fakes(0), fakes(1)
    with Client(endpoints=[first.endpoint]) as client:
        client.add_replicas([first.endpoint, added.endpoint])
        # Both answer (so both are connected: a send to one not connected yet goes to the other).
        assert len(client.health()) == 2
        client.session._next = 1
        assert client.generate("sync", max_tokens=5).text == expected_text("sync", 5)

    async def main() -> str:
        async with AsyncClient(endpoints=[first.endpoint]) as client:
            await client.health()  # the reader runs before the replica comes
            client.add_replicas([first.endpoint, added.endpoint])
            assert len(await client.health()) == 2
            client.session._next = 1
            return (await client.generate("async", max_tokens=5)).text

    assert asyncio.run(main()) == expected_text("async", 5)
    assert [g.prompt for g in added.requests(m.Generate)] == ["sync", "async"]
    assert first.requests(m.Generate) == []


def write_run_json(run_dir: Path, endpoints: list[str], supervisor_pid: int | None = None) -> None:
    info = {"run_id": "test", "tokenizers": endpoints, "model": "fake", "supervisor_pid": supervisor_pid}
    (run_dir / "run.json").write_text(json.dumps(info))


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "client", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_json(fakes, run_dir: Path) -> None:
    fake = fakes()
    write_run_json(run_dir, [fake.endpoint])
    out = run_cli(
        "--run",
        str(run_dir),
        "generate",
        "cli prompt",
        "--max-tokens",
        "6",
        "--seed",
        "3",
        "--stop",
        "a",
        "b",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {
        "text": expected_text("cli prompt", 6),
        "token_ids": expected_ids("cli prompt", 6),
        "finish_reason": "length",
        "usage": {"prompt_tokens": 3, "completion_tokens": 6, "cached_tokens": 1},
    }
    (request,) = fake.requests(m.Generate)
    assert request.prompt == "cli prompt" and request.params.stop == ["a", "b"] and request.params.seed == 3
    chat = run_cli("--run", str(run_dir), "chat", "hi there", "--max-tokens", "2", "--temperature", "0")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == expected_text("user", 2) + "\n"
    assert fake.requests(m.Generate)[1].messages == [m.ChatMessage("user", "hi there")]


def test_cli_health_fails_for_a_replica_that_does_not_answer(fakes, run_dir: Path) -> None:
    """`health` prints each replica that answered; one that stays silent (hung) is named on stderr
    and fails the command, so that a script or probe sees it in the exit status."""
    answering, hung = fakes(0), fakes(1)
    hung.is_dead = True  # receives, never answers
    write_run_json(run_dir, [answering.endpoint, hung.endpoint])
    out = run_cli("--run", str(run_dir), "--timeout", "1", "health")
    assert out.returncode == 1, out
    assert [json.loads(line)["tokenizer_id"] for line in out.stdout.splitlines()] == [0]
    assert out.stderr == f"error: no health reply within 1s from {hung.endpoint}\n"
    hung.is_dead = False
    out = run_cli("--run", str(run_dir), "--timeout", "5", "health")
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 2 and not out.stderr, out
    # --timeout 0 is no time at all, as for a request (it was taken as unset: 5 s).
    out = run_cli("--run", str(run_dir), "--timeout", "0", "health")
    assert out.returncode == 1 and "within 0s" in out.stderr, out


def test_cli_errors_are_one_line(fakes, run_dir: Path) -> None:
    out = run_cli("--run", str(run_dir), "generate", "x")
    assert out.returncode == 1 and out.stderr.startswith("error: no Brigade running")
    assert len(out.stderr.strip().splitlines()) == 1
    fake = fakes(mode="error:prompt_too_long")
    write_run_json(run_dir, [fake.endpoint])
    out = run_cli("--run", str(run_dir), "generate", "x", "--json")
    assert out.returncode == 1 and out.stderr.strip() == "error: refused by the fake" and out.stdout == ""


def test_cli_interactive_chat_keeps_history(fakes, run_dir: Path) -> None:
    fake = fakes()
    write_run_json(run_dir, [fake.endpoint])
    out = subprocess.run(
        [sys.executable, "-m", "client", "--run", str(run_dir), "chat", "--max-tokens", "2"],
        cwd=REPO_ROOT,
        input="first\nsecond\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    first, second = fake.requests(m.Generate)
    assert [msg.content for msg in second.messages] == ["first", expected_text("user", 2), "second"]
    assert first.request_id != second.request_id


@pytest.mark.parametrize(
    "module", ["client", "client.__main__", "services.common.text", "services.detokenizer.core"]
)
def test_light_modules_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)


def test_resubmission_keeps_everything_but_resume_fields() -> None:
    from client.sdk import RequestState, make_generate

    generate = make_generate(None, "p", None, {"temperature": 0.7, "stop": "x"})
    assert generate.params.stop == ["x"] and generate.params.seed is not None
    state = RequestState(generate, None, 0.0)
    state.apply(m.Delta(generate.request_id, 0, 0, "ab", m.pack_ids([5, 6])))
    again = state.resubmission()
    assert msgspec.structs.replace(again, resume_output_ids=b"", resume_num_chars=0) == generate
    assert m.unpack_ids(again.resume_output_ids).tolist() == [5, 6] and again.resume_num_chars == 2


def test_new_clients_spread_their_first_requests_over_the_replicas() -> None:
    """Each client's round robin starts at a random replica: clients that send one request each
    (the CLI, scripts) all went to replica 0, and a run's other tokenizers got none of them."""
    firsts: list[int] = []
    for i in range(40):
        session = Session(["ipc://a", "ipc://b"], lambda replica, frame: firsts.append(replica) or True)
        session.submit(m.Generate(f"r{i}", prompt="hi"), timeout=None)
    assert sorted(set(firsts)) == [0, 1]  # all on one replica: 2 in 2**40


def test_session_resubmits_what_a_probed_replica_does_not_hold() -> None:
    """A probe names the requests the session believes the replica runs. Those the reply lists
    as missing (a restarted process forgot them, or they were lost on a dropped connection) are
    resubmitted there with what was already received; the others, and a missing one that has
    ended since, are left alone."""
    clock = [0.0]
    sent: list[tuple[int, m.ClientRequest]] = []
    session = Session(
        ["ipc://a"],
        lambda i, frame: sent.append((i, CLIENT_REQUEST.decode(frame))) or True,
        failover_after=4.0,
        clock=lambda: clock[0],
    )
    lost = session.submit(m.Generate("lost", prompt="hi"), timeout=None)
    kept = session.submit(m.Generate("kept", prompt="hi"), timeout=None)
    ended = session.submit(m.Generate("ended", prompt="hi"), timeout=None)
    session.receive(0, CLIENT_REPLY.encode(m.Delta("lost", 0, 0, "Hel", m.pack_ids([5, 6]))))
    sent.clear()
    clock[0] = 1.1  # past the probe interval (failover_after / 4)
    session.tick()
    probes = [msg for _, msg in sent if isinstance(msg, m.Health)]
    assert len(probes) == 1 and sorted(probes[0].request_ids) == ["ended", "kept", "lost"]
    session.receive(
        0, CLIENT_REPLY.encode(m.Delta("ended", 0, 0, "x", m.pack_ids([7]), finish_reason="stop"))
    )
    sent.clear()
    session.receive(0, CLIENT_REPLY.encode(m.HealthReply(0, True, "x", 0, 2048, missing=["lost", "ended"])))
    resubmits = [msg for _, msg in sent if isinstance(msg, m.Generate)]
    assert [r.request_id for r in resubmits] == ["lost"]
    assert m.unpack_ids(resubmits[0].resume_output_ids).tolist() == [5, 6]
    assert resubmits[0].resume_num_chars == 3
    assert lost.replica == 0 and not lost.is_done and not kept.is_done and ended.finish_reason == "stop"
    sent.clear()
    session.receive(0, CLIENT_REPLY.encode(m.HealthReply(0, True, "x", 2, 2048)))
    assert not sent, "a reply that misses nothing resubmits nothing"


@pytest.mark.parametrize(
    "answer",
    [
        m.Delta("same", 3, 9, "", b"", finish_reason="abort"),  # the request was still running
        m.ErrorReply("same", "unknown_request", "no request 'same' of this connection is in flight"),
    ],
)
def test_a_request_id_reused_right_after_an_abort_gets_only_its_own_replies(answer: m.ClientReply) -> None:
    """A stream closed early sends an Abort, and the replica's answer, and any reply of the old
    request still on its way, comes after the client may have reused the id: none of them may end
    or fail the new request (they did: a generate() after a closed stream under the same id
    returned the old output with finish "abort", or failed with unknown_request)."""
    clock = [0.0]
    session = Session(["ipc://a"], lambda i, frame: True, failover_after=4.0, clock=lambda: clock[0])
    session.submit(m.Generate("same", prompt="hi"), timeout=None)
    session.receive(0, CLIENT_REPLY.encode(m.Delta("same", 0, 0, "old", m.pack_ids([5, 6, 7]))))
    session.cancel("same")
    new = session.submit(m.Generate("same", prompt="hi"), timeout=None)
    late = m.Delta("same", 3, 3, "!!!", m.pack_ids([8, 9, 10]))  # sent before the Abort arrived
    for reply in (late, answer):
        session.receive(0, CLIENT_REPLY.encode(reply))
        assert not new.is_done and new.error is None and not new.ready
    session.receive(0, CLIENT_REPLY.encode(m.Delta("same", 0, 0, "new", m.pack_ids([1, 2, 3]))))
    session.receive(
        0, CLIENT_REPLY.encode(m.Delta("same", 3, 3, "er", m.pack_ids([4]), finish_reason="stop"))
    )
    assert new.finish_reason == "stop" and "".join(d.text for d in new.ready) == "newer"
    # An Abort a dead replica never answers frees the id after failover_after.
    session.submit(m.Generate("gone", prompt="hi"), timeout=None)
    session.cancel("gone")
    clock[0] = 5.0
    session.tick()
    again = session.submit(m.Generate("gone", prompt="hi"), timeout=None)
    session.receive(
        0, CLIENT_REPLY.encode(m.Delta("gone", 0, 0, "ok", m.pack_ids([3]), finish_reason="stop"))
    )
    assert again.finish_reason == "stop"


def test_session_waits_out_one_dropped_handshake_but_not_a_run_of_them() -> None:
    """A tokenizer killed mid-handshake drops it once and answers after its restart: requests
    stay in flight. A wrong server key drops every retry: after HANDSHAKE_DROPS_FOR_S of drops with
    no success, every request fails with AuthenticationFailed. A refused key fails at once."""
    from client.sdk import HANDSHAKE_DROPS_FOR_S

    now = [0.0]
    session = Session(["tcp://a"], lambda i, frame: True, clock=lambda: now[0])
    state = session.submit(m.Generate("r1", prompt="hi"), timeout=None)
    session.on_handshake(0, "the server dropped the handshake", is_dropped=True)
    now[0] += HANDSHAKE_DROPS_FOR_S + 1  # no drop since: a restart, not a refusal
    session.tick()
    assert state.error is None
    session.on_handshake(0, None)  # the restarted tokenizer answers
    for _ in range(4):  # then drops on every retry, 0.1 s apart, for less than the grace
        now[0] += 0.1
        session.on_handshake(0, "the server dropped the handshake", is_dropped=True)
    session.tick()
    assert state.error is None
    now[0] += HANDSHAKE_DROPS_FOR_S
    session.on_handshake(0, "the server dropped the handshake", is_dropped=True)
    session.tick()
    assert isinstance(state.error, AuthenticationFailed) and "dropped the handshake" in str(state.error)
    refused = Session(["tcp://b"], lambda i, frame: True, clock=lambda: now[0])
    other = refused.submit(m.Generate("r2", prompt="hi"), timeout=None)
    refused.on_handshake(0, "the server refused this client's key (status 400)")
    refused.tick()
    assert isinstance(other.error, AuthenticationFailed)


# -- requests the SDK must refuse itself (issue 14, item 3) ---------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 16.0}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"top_k": 5.0}, "top_k"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 5]}, "stop"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"speculate": "no"}, "speculate"),
        ({"temperature": "hot"}, "temperature"),
        ({"seed": 1.5}, "seed"),
        ({"request_id": 5}, "request_id"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1.5, 2]}, "prompt"),
        ({"prompt": np.zeros(3, np.float32)}, "token ids"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages"),
        ({"prompt": b"abc"}, "bytes"),
        ({"prompt": bytearray(b"ab")}, "bytes"),
        ({"timeout": "5"}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"continue_final_message": True}, "continue_final_message"),  # a prompt has no final message
        ({"allowed_token_ids": ["5"]}, "allowed_token_ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": [3]}, "bad_words"),
        ({"bad_words_ids": [[5]]}, "^bad_words_ids are the tokenizer's to make from bad_words"),
        ({"continues": "yes"}, "continues"),
    ],
)
def test_wrongly_typed_arguments_are_refused_before_sending(fakes, kwargs: dict, field: str) -> None:
    fake = fakes()
    args = {"prompt": "x", **kwargs} if "messages" not in kwargs else kwargs
    args = {"timeout": 5, **args}
    with Client(endpoints=[fake.endpoint]) as client:
        with pytest.raises(InvalidRequest, match=field):
            next(iter(client.stream(**args)))
        assert client.session.requests == {}
        assert client.generate("after", max_tokens=2).text == expected_text("after", 2)
    assert [r.prompt for r in fake.requests(m.Generate)] == ["after"]


def test_wrongly_typed_timeouts_of_embed_health_and_the_client_are_refused(fakes) -> None:
    fake = fakes()
    with pytest.raises(InvalidRequest, match="timeout"):
        Client(endpoints=[fake.endpoint], timeout="x")
    with pytest.raises(InvalidRequest, match="failover_after"):
        Client(endpoints=[fake.endpoint], failover_after=float("inf"))
    with Client(endpoints=[fake.endpoint]) as client:
        with pytest.raises(InvalidRequest, match="timeout"):
            client.health(timeout="x")
        with pytest.raises(InvalidRequest, match="timeout"):
            client.embed(["a"], timeout=float("nan"))
        with pytest.raises(InvalidRequest, match="bytes"):
            client.embed(b"abc")
        assert client.session.requests == {}


@pytest.mark.parametrize("use_async", [False, True])
def test_an_embed_call_stops_sending_once_an_input_is_refused(fakes, monkeypatch, use_async: bool) -> None:
    """Each input is a request of its own, sent a window at a time: once one is refused the call
    fails, and the inputs after the window are not sent to be computed for nobody."""
    import client.async_sdk
    import client.sdk

    for module in (client.sdk, client.async_sdk):
        monkeypatch.setattr(module, "MAX_EMBEDS_IN_FLIGHT", 4)
    fake = fakes()
    texts = ["a", "bad", *(f"text {i}" for i in range(40))]

    async def embed_async(inputs: list[str]):
        async with AsyncClient(endpoints=[fake.endpoint]) as sdk:
            return await sdk.embed(inputs, timeout=30)

    def embed(inputs: list[str]):
        if use_async:
            return asyncio.run(embed_async(inputs))
        with Client(endpoints=[fake.endpoint]) as sdk:
            return sdk.embed(inputs, timeout=30)

    ok = embed(["a", "bb", "ccc"])
    assert ok.embeddings[:, 0].tolist() == [1.0, 2.0, 3.0]
    sent_before = len(fake.requests(m.Generate))
    with pytest.raises(InvalidRequest, match=r"^input\[1\]: refused by the fake"):
        embed(texts)
    sent = len(fake.requests(m.Generate)) - sent_before
    assert 2 <= sent <= 2 + 4, f"{sent} of {len(texts)} inputs sent after input[1] was refused"


@pytest.mark.parametrize("use_async", [False, True])
def test_an_embed_calls_inputs_past_its_first_window_continue_the_call(
    fakes, monkeypatch, use_async: bool
) -> None:
    """The first window's inputs go as a new call, which a stopping run refuses; those sent once
    an earlier one was served continue a call the run admitted (m.Generate.continues), which a
    stopping run takes: the call finishes instead of failing midway."""
    import client.async_sdk
    import client.sdk

    for module in (client.sdk, client.async_sdk):
        monkeypatch.setattr(module, "MAX_EMBEDS_IN_FLIGHT", 4)
    fake = fakes()
    texts = [f"text {i:02}" for i in range(10)]

    async def embed_async():
        async with AsyncClient(endpoints=[fake.endpoint]) as sdk:
            return await sdk.embed(texts, timeout=30)

    if use_async:
        result = asyncio.run(embed_async())
    else:
        with Client(endpoints=[fake.endpoint]) as sdk:
            result = sdk.embed(texts, timeout=30)
    assert len(result.embeddings) == len(texts)
    continues = {r.prompt: r.continues for r in fake.requests(m.Generate)}
    assert [continues[text] for text in texts] == [False] * 4 + [True] * 6


def test_continues_is_sent_as_given_and_off_by_default(fakes) -> None:
    fake = fakes()
    with Client(endpoints=[fake.endpoint]) as client:
        client.generate("first", max_tokens=2)
        client.generate("later", max_tokens=2, continues=True)
    assert [(r.prompt, r.continues) for r in fake.requests(m.Generate)] == [("first", False), ("later", True)]


def test_an_async_client_whose_calls_all_continue_marks_every_request(fakes) -> None:
    """A draining gateway's client (continues_calls): every request it still sends belongs to a
    call the gateway admitted before, which a stopping run takes, embedding inputs included."""
    fake = fakes()

    async def send() -> None:
        async with AsyncClient(endpoints=[fake.endpoint]) as sdk:
            await sdk.generate("before", max_tokens=2, timeout=30)
            sdk.continues_calls = True
            await sdk.generate("after", max_tokens=2, timeout=30)
            await sdk.embed(["an input"], timeout=30)

    asyncio.run(send())
    sent = [(r.prompt, r.continues) for r in fake.requests(m.Generate)]
    assert sent == [("before", False), ("after", True), ("an input", True)]


def test_a_closed_client_says_so(fakes) -> None:
    fake = fakes()
    client = Client(endpoints=[fake.endpoint])
    stream = client.stream("late", max_tokens=2)
    client.close()
    for call in (lambda: client.generate("x", max_tokens=2), client.health, lambda: next(stream)):
        with pytest.raises(ClientClosed, match="closed"):
            call()

    async def closed_async() -> None:
        aclient = AsyncClient(endpoints=[fake.endpoint])
        await aclient.close()
        with pytest.raises(ClientClosed, match="closed"):
            await aclient.generate("x", max_tokens=2)

    asyncio.run(closed_async())
    assert fake.requests(m.Generate) == []


def test_an_async_stream_in_flight_when_its_client_closes_raises_client_closed(fakes) -> None:
    """It was left waiting for a wakeup that the cancelled reader task would never give."""
    fake = fakes(mode="hang")

    async def in_flight() -> None:
        aclient = AsyncClient(endpoints=[fake.endpoint])

        async def read() -> None:
            async with contextlib.aclosing(aclient.stream("z", max_tokens=2)) as deltas:
                async for _ in deltas:
                    pass

        task = asyncio.create_task(read())
        deadline = time.monotonic() + 10
        while not fake.requests(m.Generate) and time.monotonic() < deadline:  # out, and unanswered
            await asyncio.sleep(0.02)
        await aclient.close()
        with pytest.raises(ClientClosed):
            await asyncio.wait_for(task, 10)

    asyncio.run(in_flight())


def test_zero_failover_or_unavailable_seconds_are_refused(fakes) -> None:
    fake = fakes()
    for name in ("failover_after", "unavailable_after"):
        with pytest.raises(InvalidRequest, match=f"{name} must be more than 0"):
            Client(endpoints=[fake.endpoint], **{name: 0})


@pytest.mark.parametrize("endpoint", ["garbage", "tcp://localhost"])
def test_an_endpoint_zmq_cannot_take_is_an_invalid_request_and_the_cli_exits(endpoint: str) -> None:
    with pytest.raises(InvalidRequest, match="expected tcp://HOST:PORT"):
        Client(endpoints=[endpoint])
    out = run_cli("--endpoint", endpoint, "health")  # it hung at exit, on the socket left open
    assert out.returncode == 1 and out.stderr.startswith("error: endpoint"), out.stderr
    assert "Traceback" not in out.stderr


def test_integral_values_convert_where_the_field_is_a_number(fakes) -> None:
    fake = fakes()
    with Client(endpoints=[fake.endpoint]) as client:
        client.generate("x", max_tokens=2, temperature=1, top_p=1, logit_bias={5: 1}, stop_token_ids=(7,),
                        allowed_token_ids=(5, 7), bad_words=("no", "never"))  # fmt: skip
        client.generate(np.arange(3, dtype=np.int64), max_tokens=2)
    first, second = fake.requests(m.Generate)
    assert first.params.temperature == 1.0 and first.params.logit_bias == {5: 1.0}
    assert first.params.stop_token_ids == [7]
    assert first.params.allowed_token_ids == [5, 7] and first.params.bad_words == ["no", "never"]
    assert first.params.bad_words_ids == [] and second.params.allowed_token_ids is None
    assert m.unpack_ids(second.prompt_token_ids).tolist() == [0, 1, 2]


def test_keywords_given_as_none_take_their_defaults(fakes) -> None:
    """adapter=None (a caller passing "no adapter" through), stop=None, top_k=None: each is
    the field's default, as the gateway takes JSON null; a wrong type beside them still fails."""
    fake = fakes()
    with Client(endpoints=[fake.endpoint]) as client:
        client.generate("x", adapter=None, stop=None, top_k=None, max_tokens=3, temperature=0.0)
        with pytest.raises(InvalidRequest, match="stop"):
            client.generate("x", adapter=None, stop=7)
    (sent,) = fake.requests(m.Generate)
    assert sent.params.adapter == "" and sent.params.stop == [] and sent.params.top_k is None
    assert sent.params.max_tokens == 3


def test_an_error_without_a_request_id_fails_the_unanswered_request(fakes) -> None:
    """A tokenizer that could not read a request answers with an empty id; the request it sent
    must fail at once, not wait for a reply that never comes."""
    fake = fakes(mode="garbled")
    with Client(endpoints=[fake.endpoint]) as client:
        start = time.monotonic()
        with pytest.raises(InvalidRequest, match="could not read request"):
            client.generate("x", timeout=20)
        assert time.monotonic() - start < 10


# -- one bad request must not poison a Client; an unclosed one must not hang (item 4) ---------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt": "\ud800"},
        {"messages": [{"role": "user", "content": "a\udfffb"}]},
        {"prompt": "x", "stop": "\ud800"},
        {"prompt": "x", "request_id": "\ud800"},
        {"prompt": "x", "bad_words": ["ok", "\ud800"]},
    ],
)
def test_a_bad_text_does_not_poison_the_client(fakes, kwargs: dict) -> None:
    fake = fakes()
    with Client(endpoints=[fake.endpoint]) as client:
        for _ in range(2):
            with pytest.raises(InvalidRequest, match="not valid text"):
                client.generate(timeout=5, **kwargs) if "prompt" in kwargs else client.chat(
                    timeout=5, **kwargs
                )
        assert client.session.requests == {}
        assert client.generate("fine", max_tokens=3, timeout=5).text == expected_text("fine", 3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": [2**31]}, "prompt"),
        ({"prompt": np.array([1, 2**40], np.int64)}, "prompt"),  # would wrap silently into another id
        ({"prompt": "x", "max_tokens": 2**64}, "max_tokens"),
        ({"prompt": "x", "logit_bias": {2**70: 1.0}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [1, -(2**63) - 1]}, "stop_token_ids"),
        ({"prompt": "x", "allowed_token_ids": [1, 2**63]}, "allowed_token_ids"),
        ({"prompt": "x", "seed": 2**64 + 5}, "seed"),
        ({"prompt": "x", "truncate_prompt_tokens": 2**64}, "truncate_prompt_tokens"),
    ],
)
def test_integers_wider_than_the_wire_are_refused_naming_the_field(fakes, kwargs: dict, field: str) -> None:
    """Integers past what the wire carries (int64 parameters, int32 token ids) made the packer
    raise OverflowError, which no caller expected: the gateway's job task died silently and its
    HTTP request hung. They are an InvalidRequest naming the field, for both clients."""
    fake = fakes()
    with Client(endpoints=[fake.endpoint]) as client:
        with pytest.raises(InvalidRequest, match=f"^{field}: .* out of range"):
            client.generate(timeout=5, **kwargs)
        assert client.session.requests == {}
        assert client.generate("after", max_tokens=2, timeout=5).text == expected_text("after", 2)

    async def main() -> None:
        async with AsyncClient(endpoints=[fake.endpoint]) as client:
            with pytest.raises(InvalidRequest, match=f"^{field}: .* out of range"):
                await client.generate(timeout=5, **kwargs)
            assert (await client.generate("async", max_tokens=2, timeout=5)).text == expected_text("async", 2)

    asyncio.run(main())
    assert [r.prompt for r in fake.requests(m.Generate)] == ["after", "async"]


def test_session_submit_turns_any_encoding_failure_into_an_invalid_request() -> None:
    """A Generate built without make_generate (a caller of the sans-IO Session) that the encoder
    cannot pack is that request's InvalidRequest, not an exception that escapes a task."""
    session = Session(["inproc://nowhere"], lambda replica, frame: True)
    for generate in (
        m.Generate("big", prompt="x", params=m.SamplingParams(max_tokens=2**64)),
        m.Generate("bias", prompt="x", params=m.SamplingParams(logit_bias={2**70: 1.0})),
    ):
        with pytest.raises(InvalidRequest, match="cannot be encoded: OverflowError"):
            session.submit(generate, timeout=None)
    assert session.requests == {}


UNCLOSED_CLIENTS = """
import gc, sys
from concurrent.futures import ThreadPoolExecutor
from client import Client, ServerUnavailable

def one(i):
    client = Client(endpoints=[sys.argv[1]], failover_after=0.1, unavailable_after=0.3)
    if i % 2:
        return client.generate("x", max_tokens=2, timeout=5).text
    try:
        client.health(timeout=0.2)
    except ServerUnavailable:
        pass
    # dropped without close(), as a thread pool's per-thread clients are

with ThreadPoolExecutor(8) as pool:
    texts = [t for t in pool.map(one, range(32)) if t]
gc.collect()
print(len(texts), len(set(texts)), flush=True)
"""


def test_clients_dropped_without_close_never_hang_the_process(fakes) -> None:
    fake = fakes()
    out = subprocess.run(
        [sys.executable, "-c", UNCLOSED_CLIENTS, fake.endpoint],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["16", "1"]  # every generate answered, the same way


# -- a run that ends is heard at once (item 5) ------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    return child.pid


def test_a_dead_run_fails_requests_at_once(fakes, run_dir: Path) -> None:
    """The supervisor was SIGKILLed (its stages die with it): run.json is left behind naming a
    supervisor that is gone, and the client fails its requests without waiting out
    unavailable_after. The fake answers health probes as if alive, so only the run check can tell."""
    fake = fakes(mode="hang")
    write_run_json(run_dir, [fake.endpoint], supervisor_pid=dead_pid())
    with Client(run_dir, unavailable_after=60) as client:
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="run ended"):
            client.generate("x", timeout=30)
        assert time.monotonic() - start < 10


def test_a_health_check_of_a_dead_run_says_so_at_once(fakes, run_dir: Path) -> None:
    """`brigade health` against a run whose supervisor is gone (run.json left behind) waited out
    its whole timeout and said "no tokenizer answered"; a probe learns at once that the run
    ended. The fake is silent, as the stages of a killed run are."""
    fake = fakes()
    fake.is_dead = True
    write_run_json(run_dir, [fake.endpoint], supervisor_pid=dead_pid())
    with Client(run_dir) as client:
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="run ended"):
            client.health(timeout=30)
        assert time.monotonic() - start < 5
    out = run_cli("--run", str(run_dir), "--timeout", "30", "health")
    assert (out.returncode, out.stderr) == (1, "error: the Brigade run ended (its supervisor is gone)\n")


def test_a_live_run_is_waited_for(fakes, run_dir: Path) -> None:
    fake = fakes(mode="hang")
    write_run_json(run_dir, [fake.endpoint], supervisor_pid=os.getpid())
    with Client(run_dir, unavailable_after=60) as client, pytest.raises(RequestTimeout):
        client.generate("x", timeout=2)


def test_every_replica_stopping_fails_the_request_instead_of_bouncing(fakes) -> None:
    a, b = fakes(0, mode="error:unavailable"), fakes(1, mode="error:unavailable")
    with Client(endpoints=[a.endpoint, b.endpoint]) as client:
        client.health()
        with pytest.raises(ServerUnavailable, match="refused by the fake"):
            client.generate("x", timeout=10)
    assert len(a.requests(m.Generate)) + len(b.requests(m.Generate)) == 2


def test_a_request_a_stopping_replica_refused_is_not_a_continuation_elsewhere(fakes) -> None:
    """A refusal admits nothing: the replica that takes the request next sees a new request, which
    a stopping run refuses too (unlike a failover after output, which continues an admitted call)."""
    stopping, live = fakes(0, mode="error:unavailable"), fakes(1)
    with Client(endpoints=[stopping.endpoint, live.endpoint]) as client:
        client.health()
        client.session._next = 0  # the round robin starts on the stopping one
        assert client.generate("moved", max_tokens=3).token_ids == expected_ids("moved", 3)
    ((refused,), (taken,)) = stopping.requests(m.Generate), live.requests(m.Generate)
    assert taken.request_id == refused.request_id and (refused.continues, taken.continues) == (False, False)


def test_async_stream_chat(fakes) -> None:
    fake = fakes()

    async def main() -> list[StreamDelta]:
        async with AsyncClient(endpoints=[fake.endpoint]) as client:
            with pytest.raises(InvalidRequest, match="max_tokens"):
                await client.generate("x", max_tokens="3")
            stream = client.stream_chat([{"role": "user", "content": "hi"}], max_tokens=3)
            return [d async for d in stream]

    deltas = asyncio.run(main())
    assert "".join(d.text for d in deltas) == expected_text("user", 3)
    (request,) = fake.requests(m.Generate)
    assert request.messages == [m.ChatMessage("user", "hi")]


# -- output constraints: `structured=` or one shorthand ----------------------------------------------


def test_output_constraints_reach_the_tokenizer_as_structured(fakes) -> None:
    """Each shorthand sends the StructuredOutput it means (what the gateway's API forms give too);
    the async client takes them alike."""
    fake = fakes()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    wanted = [
        m.StructuredOutput("json", '{"type":"object","properties":{"a":{"type":"integer"}}}'),
        m.StructuredOutput("json", '{"type":"object"}'),
        m.StructuredOutput("regex", "[0-9]+"),
        m.StructuredOutput("choice", '["yes", "no"]'),
        m.StructuredOutput("grammar", 'root ::= "x"'),
        m.StructuredOutput("regex", "a|b", strict=True),
    ]
    with Client(endpoints=[fake.endpoint]) as client:
        client.generate("x", max_tokens=1, json_schema=schema)
        client.generate("x", max_tokens=1, json_schema='{"type": "object"}')
        client.generate("x", max_tokens=1, regex="[0-9]+")
        client.chat([{"role": "user", "content": "ok?"}], max_tokens=1, choice=["yes", "no"])
        client.generate("x", max_tokens=1, grammar='root ::= "x"')
        client.generate("x", max_tokens=1, structured=m.StructuredOutput("regex", "a|b"))

    async def main() -> None:
        async with AsyncClient(endpoints=[fake.endpoint]) as client:
            await client.generate("x", max_tokens=1, regex="[0-9]+")

    asyncio.run(main())
    assert [g.params.structured for g in fake.requests(m.Generate)] == [*wanted, wanted[2]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"regex": "a", "choice": ["a"]}, "at most one output constraint, got regex, choice"),
        ({"structured": m.StructuredOutput("regex", "a"), "json_schema": {}}, "got structured, json_schema"),
        ({"json_schema": 5}, "json_schema must be a dict or its JSON text"),
        ({"json_schema": "{not json"}, "json_schema: not valid JSON"),
        ({"choice": "yes"}, "choice: must be a non-empty list"),
        ({"choice": []}, "choice: must be a non-empty list"),
        ({"regex": 5}, "regex: must be a non-empty string"),
        ({"grammar": ""}, "grammar: must be a non-empty string"),
        ({"structured": "json"}, "structured="),
    ],
)
def test_bad_output_constraints_are_refused_before_sending(fakes, kwargs: dict, message: str) -> None:
    fake = fakes()
    with Client(endpoints=[fake.endpoint]) as client, pytest.raises(InvalidRequest, match=re.escape(message)):
        client.generate("x", max_tokens=1, timeout=5, **kwargs)
    assert fake.requests(m.Generate) == []
