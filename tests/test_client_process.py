"""The client SDK and the tokenizer with real processes, on the tiny random Llama: an error names
the request it is about, a request belongs to the connection that made it, a dead client's
requests stop computing, and the end of a run reaches its clients at once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import zmq

from client import Client, InvalidRequest, ServerUnavailable
from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST
from ipc.shm import sweep_stale_runs
from tests.conftest import REPO_ROOT
from tests.harness import Run, assert_clean, brigade_run, stage_processes, tokenizer_dealer
from tests.test_supervisor import free_port, wait_all_gone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_MODEL_LEN = 4096
LONG = m.SamplingParams(max_tokens=MAX_MODEL_LEN - 64, temperature=0.0, ignore_eos=True)
WAIT_S = 120.0  # every wait in these tests has this deadline unless it says otherwise


def tiny_args(model_dir: Path, metrics_port: int = 0) -> tuple[str, ...]:
    return (
        f"model.path={model_dir}",
        "model.dtype=float32",
        f"model.max_model_len={MAX_MODEL_LEN}",
        "engine.kv_cache_mib=128",
        "engine.threads=1",
        f"supervisor.metrics_port={metrics_port}",
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("client-run")
    port = free_port()
    with brigade_run(run_dir, *tiny_args(tiny_model_dir, port)) as run:
        run.metrics_port = port
        yield run
    assert_clean(run_dir)


@contextmanager
def raw_dealer(run: Run) -> Iterator[zmq.Socket]:
    """A bare DEALER to tokenizer 0, as a client that speaks the wire protocol itself."""
    ctx = zmq.Context()
    sock = tokenizer_dealer(ctx, run.run_dir)
    try:
        yield sock
    finally:
        ctx.destroy(linger=0)


def next_reply(sock: zmq.Socket, timeout: float = WAIT_S) -> m.Delta | m.ErrorReply:
    """The next Delta or ErrorReply (keepalive HealthReplies skipped); fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), "no reply before the deadline"
        reply = CLIENT_REPLY.decode(sock.recv())
        if not isinstance(reply, m.HealthReply):
            return reply


def collect(sock: zmq.Socket, request_id: str, first: m.Delta | None = None) -> tuple[list[int], str]:
    """Every delta of one streamed request up to its finish; (token ids, finish reason)."""
    ids: list[int] = []
    delta = first
    while True:
        if delta is not None:
            assert isinstance(delta, m.Delta) and delta.request_id == request_id, delta
            assert delta.token_index == len(ids)
            ids += m.unpack_ids(delta.token_ids).tolist()
            if delta.finish_reason is not None:
                return ids, delta.finish_reason
        delta = next_reply(sock)


def metric(run: Run, name: str, label: str) -> float:
    """The sum of `name`'s samples whose labels include `label` (e.g. 'finished_reason="abort"')."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10).read().decode()
    samples = re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.MULTILINE)
    return sum(float(value) for labels, value in samples if label in labels.split(","))


# -- item 3: an error about a request names it ------------------------------------------------------


def test_errors_about_unreadable_parameters_carry_the_request_id(tiny_run: Run) -> None:
    encoder = msgspec.msgpack.Encoder()
    generate = {"type": "Generate", "prompt": "x"}
    valid = CLIENT_REQUEST.encode(m.Generate("bad-extra", prompt="x"))
    with raw_dealer(tiny_run) as sock:
        sock.send(encoder.encode({**generate, "request_id": "bad-float", "params": [16.0]}))
        sock.send(encoder.encode({**generate, "request_id": "bad-str", "params": ["16"]}))
        sock.send(encoder.encode({**generate, "request_id": "bad-top-k", "params": [16, 1.0, 5.0]}))
        defaults = [16, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, {}, 0, False, []]  # SamplingParams up to stop
        sock.send(encoder.encode({**generate, "request_id": "bad-stop", "params": [*defaults, 5]}))
        sock.send_multipart([valid, b"an extra frame"])
        sock.send(b"\xc1 not msgpack")
        replies = [next_reply(sock, 60) for _ in range(6)]
    assert all(isinstance(r, m.ErrorReply) and r.code == "invalid_request" for r in replies), replies
    assert [r.request_id for r in replies] == [
        "bad-float",
        "bad-str",
        "bad-top-k",
        "bad-stop",
        "bad-extra",
        "",
    ]
    with Client(tiny_run.run_dir) as client:
        with pytest.raises(InvalidRequest, match="max_tokens"):
            client.generate("x", max_tokens=16.0, timeout=60)
        assert client.generate("x", max_tokens=3, temperature=0.0, timeout=60).finish_reason == "length"


# -- item 7: a request belongs to the connection that made it ---------------------------------------


def test_another_connection_can_neither_take_over_nor_abort_a_request(tiny_run: Run) -> None:
    params = msgspec.structs.replace(LONG, max_tokens=300)
    with Client(tiny_run.run_dir) as client:
        want = client.generate("Hello", timeout=WAIT_S, **msgspec.structs.asdict(params)).token_ids
    with raw_dealer(tiny_run) as owner, raw_dealer(tiny_run) as other:
        owner.send(CLIENT_REQUEST.encode(m.Generate("job-1", prompt="Hello", params=params)))
        first = next_reply(owner)
        # The same id from another connection is that connection's own request.
        other.send(
            CLIENT_REQUEST.encode(m.Generate("job-1", prompt="Other", params=m.SamplingParams(max_tokens=5)))
        )
        theirs, reason = collect(other, "job-1")
        assert len(theirs) == 5 and reason == "length"
        assert collect(owner, "job-1", first) == (want, "length")

        owner.send(CLIENT_REQUEST.encode(m.Generate("job-2", prompt="Hello", params=params)))
        first = next_reply(owner)
        other.send(CLIENT_REQUEST.encode(m.Abort("job-2")))
        refused = next_reply(other)
        assert isinstance(refused, m.ErrorReply)
        assert (refused.request_id, refused.code) == ("job-2", "unknown_request")
        assert collect(owner, "job-2", first) == (want, "length")

        owner.send(CLIENT_REQUEST.encode(m.Generate("job-3", prompt="Hello", params=params)))
        first = next_reply(owner)
        owner.send(CLIENT_REQUEST.encode(m.Abort("job-3")))  # its owner may
        ids, reason = collect(owner, "job-3", first)
        assert reason == "abort" and len(ids) < len(want)


# -- item 6: a dead client's requests stop computing -------------------------------------------------

DEAD_CLIENT = """
import sys, time, zmq
from pathlib import Path
from ipc import messages as m
from ipc.codec import CLIENT_REQUEST
from tests.harness import tokenizer_dealer
ctx = zmq.Context()
sock = tokenizer_dealer(ctx, Path(sys.argv[1]))
params = m.SamplingParams(max_tokens=int(sys.argv[2]), temperature=0.0, ignore_eos=True)
for i in range(20):
    sock.send(CLIENT_REQUEST.encode(m.Generate(f"quiet-{i}", prompt=f"Tell me about {i}", params=params, stream=False)))
print("sent", flush=True)
time.sleep(600)
"""


def test_a_dead_clients_non_streamed_requests_are_aborted(tiny_run: Run) -> None:
    """Nothing is sent to a client while its non-streamed requests compute, so only the
    tokenizer's keepalive can find it gone: its requests end as aborted, not as finished."""
    aborted, finished = (
        metric(tiny_run, "brigade:request_success_total", 'finished_reason="abort"'),
        metric(tiny_run, "brigade:request_success_total", 'finished_reason="length"'),
    )
    client = subprocess.Popen(
        [sys.executable, "-c", DEAD_CLIENT, str(tiny_run.run_dir), str(LONG.max_tokens)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    try:
        assert client.stdout.readline() == "sent\n"
        deadline = time.monotonic() + WAIT_S
        while sum(r["running"] for r in tiny_run.status() if r["kind"] == "scheduler") < 20:
            assert time.monotonic() < deadline, "the 20 requests never all ran"
            time.sleep(0.2)
    finally:
        client.kill()
        client.wait(30)
    deadline = time.monotonic() + WAIT_S
    while metric(tiny_run, "brigade:request_success_total", 'finished_reason="abort"') < aborted + 20:
        assert time.monotonic() < deadline, "the dead client's requests were not aborted"
        time.sleep(0.5)
    assert metric(tiny_run, "brigade:request_success_total", 'finished_reason="length"') == finished
    deadline = time.monotonic() + WAIT_S
    while sum(r["running"] + r["queue_depth"] for r in tiny_run.status() if r["kind"] == "scheduler"):
        assert time.monotonic() < deadline, "the scheduler still runs the dead client's requests"
        time.sleep(0.2)


# -- item 5: the end of a run reaches its clients at once ----------------------------------------


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_run_that_ends_fails_its_requests_at_once(tmp_path: Path, tiny_model_dir: Path, how: str) -> None:
    """SIGTERM: the supervisor stops its tokenizers, which fail what is in flight first. SIGKILL:
    the stages die with the supervisor and nobody is left to say so; the client sees that the run's
    supervisor is gone. Either way the client knows within seconds, not after unavailable_after."""
    run_dir = tmp_path / "run"
    try:
        with brigade_run(run_dir, *tiny_args(tiny_model_dir), "supervisor.drain_timeout_s=0.5") as run:
            stages = {r["pid"]: r["name"] for r in run.status()}
            with Client(run_dir, unavailable_after=WAIT_S) as client:
                stream = client.stream("Once upon a time", timeout=WAIT_S, **msgspec.structs.asdict(LONG))
                next(stream)
                # Not reaped until the stream ends: a killed supervisor may linger as a zombie.
                run.process.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
                start = time.monotonic()
                with pytest.raises(ServerUnavailable) as info:
                    for _ in stream:
                        pass
                waited = time.monotonic() - start
            run.process.wait(60)
            assert not wait_all_gone(stages, 90)
    finally:
        sweep_stale_runs()  # after a SIGKILL nobody was left to unlink the run's shared memory
    assert ("run ended" if how == "sigkill" else "tokenizer stopped") in str(info.value)
    assert waited < 20, f"the client heard of the end after {waited:.1f}s"
    assert not stage_processes(run_dir)
    if how == "sigterm":
        assert_clean(run_dir)
