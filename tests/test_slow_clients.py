"""Back-pressure to clients, with real processes on the tiny random Llama: a client that reads
slowly (its socket's queue fills) keeps every request and gets each one's output exactly once; one
that never reads again is dropped after `tokenizer.slow_client_timeout_s`, its requests aborted
and counted; one that vanishes is still aborted at once (docs/architecture.md, "Back-pressure to
clients")."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST
from tests.harness import Run, assert_clean, brigade_run, free_port, tokenizer_dealer
from tests.test_client_process import metric, tiny_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SLOW_CLIENT_TIMEOUT_S = 8.0
NUM_REQUESTS = 16
# 16 streams of 2000 tokens are 32000 replies, one per token: more than the tokenizer's send queue
# to one client (ipc/sockets.py DEFAULT_HWM, 10000) and the kernel's socket buffers hold, with the
# client's own receive queue cut to 10.
PARAMS = m.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
# Four run at a time, the rest wait: so that a client held for the timeout still has requests
# to abort however fast the host generates (a loaded one sends fewer, fuller deltas, and its
# queue fills later).
MAX_NUM_SEQS = 4
WAIT_S = 120.0
# Malformed frames from a client that never reads (enough to fill its queues several times over,
# sent for at most FLOOD_S), then a polite client's one-token requests one after the other: each
# takes tens of ms; without the fix every turn of the tokenizer's loop waited the 100 ms send
# timeout on a flood frame, and each request needs at least two turns (over 20 s for the 100).
FLOOD_FRAMES = 60_000
FLOOD_S = 20.0
POLITE_REQUESTS = 100
POLITE_S = 12.0
PARAMS_ONE = m.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
HELD = "is not reading: holding its replies"  # the tokenizer's log line when a client's queue fills
GONE = "disconnected; aborting it"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("slow-clients")
    port = free_port()
    with brigade_run(
        run_dir,
        *tiny_args(tiny_model_dir, port),
        f"tokenizer.slow_client_timeout_s={SLOW_CLIENT_TIMEOUT_S}",
        f"engine.max_num_seqs={MAX_NUM_SEQS}",
    ) as brigade:
        brigade.metrics_port = port
        yield brigade
    assert_clean(run_dir)


def slow_dealer(ctx: zmq.Context, run: Run, prefix: str) -> zmq.Socket:
    """A bare client named after its requests (the tokenizer's log lines about it then name it),
    its own receive queue cut to 10 messages."""
    return tokenizer_dealer(ctx, run.run_dir, identity=prefix.encode(), rcvhwm=10)


def send_streams(sock: zmq.Socket, prefix: str) -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(NUM_REQUESTS)]
    for i, request_id in enumerate(ids):
        sock.send(CLIENT_REQUEST.encode(m.Generate(request_id, prompt=f"Tell me about {i}", params=PARAMS)))
    return ids


def wait_until_full(run: Run, prefix: str) -> None:
    """Until the tokenizer finds this client's queue full: it says so (with the fix), or takes the
    client for gone and aborts its requests (without)."""
    held, gone = f"client {prefix.encode().hex()} {HELD}", f"client of {prefix}-0 {GONE}"
    line = run.wait_for_line("tokenizer-0", WAIT_S)
    while held not in line:
        assert gone not in line, f"a slow client was taken for gone: {line}"
        line = run.wait_for_line("tokenizer-0", WAIT_S)


def aborted(run: Run) -> float:
    return metric(run, "brigade:request_success_total", 'finished_reason="abort"')


def finished(run: Run) -> float:
    return metric(run, "brigade:request_success_total", 'finished_reason="length"')


def num_dropped(run: Run) -> float:
    """Clients the tokenizers dropped for not reading (the one sample per model)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10).read().decode()
    return sum(
        float(v) for v in re.findall(r"^brigade:slow_clients_dropped_total\{[^}]*\} (\S+)$", text, re.M)
    )


def wait_idle(run: Run) -> None:
    deadline = time.monotonic() + WAIT_S
    while sum(r["running"] + r["queue_depth"] for r in run.status() if r["kind"] == "scheduler"):
        assert time.monotonic() < deadline, "the scheduler still runs the client's requests"
        time.sleep(0.2)


def test_a_slow_client_gets_every_request_whole_and_once(run: Run) -> None:
    ctx = zmq.Context()
    try:
        sock = slow_dealer(ctx, run, "slow")
        ids = send_streams(sock, "slow")
        wait_until_full(run, "slow")
        time.sleep(2.0)  # still not reading: what comes meanwhile is held, coalesced
        tokens = dict.fromkeys(ids, 0)
        chars = dict.fromkeys(ids, 0)
        reasons: dict[str, str] = {}
        deadline = time.monotonic() + WAIT_S
        while len(reasons) < len(ids):
            left = deadline - time.monotonic()
            assert left > 0 and sock.poll(int(left * 1000)), f"unfinished: {sorted(set(ids) - set(reasons))}"
            reply = CLIENT_REPLY.decode(sock.recv())
            if isinstance(reply, m.HealthReply):
                continue  # the keep-alive of a client with requests in flight
            assert isinstance(reply, m.Delta), reply
            rid = reply.request_id
            assert rid not in reasons, f"{rid}: a reply after its final one"
            # Exactly once: each delta starts where the previous one ended.
            assert (reply.token_index, reply.char_offset) == (tokens[rid], chars[rid]), reply
            tokens[rid] += len(m.unpack_ids(reply.token_ids))
            chars[rid] += len(reply.text)
            if reply.finish_reason is not None:
                reasons[rid] = reply.finish_reason
    finally:
        ctx.destroy(linger=0)
    assert reasons == dict.fromkeys(ids, "length")
    assert tokens == dict.fromkeys(ids, PARAMS.max_tokens)


def test_a_client_that_never_reads_again_is_dropped_after_the_timeout(run: Run) -> None:
    """Held, not aborted, while the timeout runs (the engine goes on generating for it, and may
    finish some); then treated as gone: every request still running or waiting aborted and
    counted, and the drop counted once."""
    before_aborted, before_finished, dropped = aborted(run), finished(run), num_dropped(run)
    ctx = zmq.Context()
    try:
        sock = slow_dealer(ctx, run, "stuck")
        send_streams(sock, "stuck")
        wait_until_full(run, "stuck")
        held_at = time.monotonic()
        deadline = held_at + SLOW_CLIENT_TIMEOUT_S + WAIT_S
        while num_dropped(run) < dropped + 1:
            assert time.monotonic() < deadline, "a client that never reads was not dropped"
            time.sleep(0.2)
        waited = time.monotonic() - held_at
        wait_idle(run)
    finally:
        ctx.destroy(linger=0)
    assert waited >= SLOW_CLIENT_TIMEOUT_S - 1.0, f"dropped {waited:.1f}s after its queue filled"
    num_aborted = aborted(run) - before_aborted
    assert num_aborted >= 1, "no request of the dropped client was aborted"
    assert num_aborted + finished(run) - before_finished == NUM_REQUESTS  # each ended once
    assert num_dropped(run) == dropped + 1


def test_a_slow_client_that_vanishes_is_aborted_at_once(run: Run) -> None:
    """Its held replies do not keep it alive until the timeout: the next try to send them finds it
    gone."""
    before_aborted, before_finished, dropped = aborted(run), finished(run), num_dropped(run)
    ctx = zmq.Context()
    sock = slow_dealer(ctx, run, "vanishing")
    send_streams(sock, "vanishing")
    wait_until_full(run, "vanishing")
    ctx.destroy(linger=0)
    closed_at = time.monotonic()
    # Each request ends once: aborted, or finished before its client went (the first ones to run
    # may have, before the queue filled).
    while aborted(run) - before_aborted + finished(run) - before_finished < NUM_REQUESTS:
        assert time.monotonic() - closed_at < SLOW_CLIENT_TIMEOUT_S / 2, "a gone client's requests ran on"
        time.sleep(0.1)
    assert aborted(run) - before_aborted >= 1, "no request of the gone client was aborted"
    assert num_dropped(run) == dropped
    wait_idle(run)


def test_garbage_from_a_client_that_never_reads_does_not_stall_the_others(run: Run) -> None:
    """Each malformed frame is answered with an error; once the sender's queue is full the error
    is dropped at once, not waited for (the send timeout per frame held up the tokenizer's loop,
    so every other client's requests, one turn of it each) nor held."""
    ctx = zmq.Context()
    try:
        flooder = slow_dealer(ctx, run, "garbage")
        # Past the queue (DEFAULT_HWM 10000), its receive queue (10) and the kernel's buffers; not
        # waiting on a tokenizer that stalls (without the fix), so that the polite client finds it.
        sent, flood_deadline = 0, time.monotonic() + FLOOD_S
        while sent < FLOOD_FRAMES and time.monotonic() < flood_deadline:
            try:
                flooder.send(b"\xc1 not msgpack", zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                time.sleep(0.001)
        polite = tokenizer_dealer(ctx, run.run_dir)
        started = time.monotonic()
        for i in range(POLITE_REQUESTS):  # one after the other: each waits for the loop's turns
            polite.send(CLIENT_REQUEST.encode(m.Generate(f"polite-{i}", prompt="Hi", params=PARAMS_ONE)))
            reply = None
            while not isinstance(reply, m.Delta) or reply.finish_reason is None:
                left = POLITE_S - (time.monotonic() - started)
                assert left > 0 and polite.poll(int(left * 1000)), (
                    f"{i} of {POLITE_REQUESTS} requests answered in {POLITE_S:.0f}s beside another client's garbage"
                )
                reply = CLIENT_REPLY.decode(polite.recv())
                assert not isinstance(reply, m.ErrorReply), reply
        # The flooder's first errors did come (its queue took them).
        first = CLIENT_REPLY.decode(flooder.recv())
    finally:
        ctx.destroy(linger=0)
    assert isinstance(first, m.ErrorReply) and "malformed message" in first.message, first
