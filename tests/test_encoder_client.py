"""The tokenizer's encoder client (services/tokenizer/encoders.py) against ROUTER sockets standing in
for encoder replicas (real ZeroMQ over ipc://): which replica a request goes to, and what a hot
reload of `encoder.replicas` does to the requests a retired replica holds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from ipc import messages as m
from ipc.codec import ENCODER_REPLY, ENCODER_REQUEST
from ipc.endpoints import Endpoints
from ipc.sockets import RouterSocket
from services.tokenizer.encoders import AFFINITY_SLACK, EncoderClient, preferred_encoder

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def replicas(ctx: zmq.Context, endpoints: Endpoints, count: int) -> list[RouterSocket]:
    return [RouterSocket(ctx, endpoints.encoder(i), ENCODER_REQUEST, ENCODER_REPLY) for i in range(count)]


def received(replica: RouterSocket) -> list[str]:
    """The ids of the requests that came to `replica` (its client's identity kept for replies)."""
    ids = []
    while (got := replica.recv(timeout=0.5)) is not None:
        identities[replica] = got[0]
        ids.append(got[1].request_id)
    return ids


identities: dict[RouterSocket, bytes] = {}


def images_for(replica: int, of: int) -> list[bytes]:
    """A one-image request whose image hashes to `replica` of `of`."""
    return next([bytes([i])] for i in range(256) if preferred_encoder([bytes([i])], of) == replica)


def test_the_same_first_image_goes_to_the_same_replica_unless_it_is_much_busier(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    endpoints = Endpoints(tmp_path, "encclient")
    servers = replicas(ctx, endpoints, 2)
    client = EncoderClient(ctx, endpoints, 2)
    time.sleep(0.2)  # the DEALERs connect
    to_zero = images_for(0, 2)
    for k in range(AFFINITY_SLACK):
        client.ask(f"r{k}", to_zero, time.monotonic())
    # Replica 0 now holds AFFINITY_SLACK more than replica 1: the next goes to the idle one.
    client.ask("spill", to_zero, time.monotonic())
    client.ask("other", images_for(1, 2), time.monotonic())
    assert received(servers[0]) == [f"r{k}" for k in range(AFFINITY_SLACK)]
    assert received(servers[1]) == ["spill", "other"]
    client.close()
    for server in servers:
        server.close()


def test_a_retired_replicas_requests_are_asked_again_of_the_others_and_answered_once(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    endpoints = Endpoints(tmp_path, "encclient")
    servers = replicas(ctx, endpoints, 3)
    client = EncoderClient(ctx, endpoints, 2, resend_after_s=60.0)
    time.sleep(0.2)
    client.ask("a", images_for(0, 2), time.monotonic())
    client.ask("b", images_for(1, 2), time.monotonic())
    assert received(servers[1]) == ["b"]

    client.resize(ctx, endpoints, 3, time.monotonic())  # replica 2 added: nothing moves
    assert len(client.sockets) == 3 and received(servers[0]) == ["a"] and received(servers[2]) == []

    client.resize(ctx, endpoints, 1, time.monotonic())  # replicas 1 and 2 retired: "b" moves to 0
    assert len(client.sockets) == 1 and received(servers[0]) == ["b"]
    assert client.pending["b"].encoder == 0
    for request_id in ("a", "b"):
        assert servers[0].send(identities[servers[0]], m.ImagesEncoded(request_id))
    deadline = time.monotonic() + 10
    answers = []
    while len(answers) < 2 and time.monotonic() < deadline:
        answers += client.receive()
    assert sorted(a.request_id for a in answers) == ["a", "b"] and not client.pending
    with pytest.raises(ValueError, match="at least one"):
        client.resize(ctx, endpoints, 0, time.monotonic())
    client.close()
    for server in servers:
        server.close()
