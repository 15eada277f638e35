"""The tokenizer's side of the encoder stage: a request's images sent to an encoder replica, and
its answer (where the embeddings are in that replica's cache) or an error back, exactly once.

Delivery: an encoder that dies takes the requests in its socket with it, and an encoder's
answers are idempotent (its cache is keyed by the images' content). So a request not answered
within `resend_after_s` is sent again, to the next replica (the same one, restarted, when there
is only one), until `deadline_s` after it was first asked; the first answer wins and any later
one is dropped as unknown. A resubmission after any other stage's crash asks again the same way:
the cache answers at once, or the encoder recomputes.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import zmq

from ipc import messages as m
from ipc.codec import ENCODER_REPLY, ENCODER_REQUEST
from ipc.endpoints import Endpoints
from ipc.sockets import DealerSocket, MalformedMessage

RESEND_AFTER_S = 2.0
DEADLINE_S = 60.0
# How many more pending requests than the least loaded replica the replica that cached a
# request's images may have and still be chosen: a cache hit is much cheaper than an encode.
AFFINITY_SLACK = 4


def preferred_encoder(images: list[bytes], num_encoders: int) -> int:
    """The replica of `num_encoders` that a request's images go to when it is not too busy: a
    hash of the first image's bytes, so that a repeated image finds its embeddings cached."""
    digest = hashlib.blake2b(images[0] if images else b"", digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_encoders


@dataclass
class Pending:
    request: m.EncodeImages
    encoder: int  # the replica asked last
    asked_at: float  # when it was asked last
    deadline: float


@dataclass(frozen=True)
class Encoded:
    """A request's images' embeddings: in encoder `encoder`'s cache at `refs`, under `keys`; or
    `error` (a 400 when it names a bad image; `timeout` when no encoder answered in time)."""

    request_id: str
    encoder: int = -1
    keys: tuple[bytes, ...] = ()
    refs: tuple[m.SlotRef, ...] = ()
    error: str = ""


class EncoderClient:
    """One DEALER per encoder replica. `ask` sends, `receive` takes the answers that came (poll
    `sockets` for them), `tick` resends the late ones and fails those past their deadline."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoints: Endpoints,
        num_encoders: int,
        resend_after_s: float = RESEND_AFTER_S,
        deadline_s: float = DEADLINE_S,
    ) -> None:
        if num_encoders < 1:
            raise ValueError("no encoder to ask: this run has encoder.replicas 0")
        self.encoders = [
            DealerSocket(ctx, endpoints.encoder(i), ENCODER_REPLY, ENCODER_REQUEST)
            for i in range(num_encoders)
        ]
        self.resend_after_s = resend_after_s
        self.deadline_s = deadline_s
        self.pending: dict[str, Pending] = {}
        self.num_resent = 0
        self.num_malformed = 0

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [encoder.socket for encoder in self.encoders]

    def resize(self, ctx: zmq.Context, endpoints: Endpoints, num_encoders: int, now: float) -> None:
        """The run now has `num_encoders` replicas (a hot reload, at least one): links to the new
        ones; the retired ones' links closed, and what they held asked again of the others at
        once (an answer on its way from a retired replica is lost with its link)."""
        if num_encoders < 1:
            raise ValueError("no encoder to ask: a live run keeps at least one")
        for index in range(len(self.encoders), num_encoders):
            self.encoders.append(DealerSocket(ctx, endpoints.encoder(index), ENCODER_REPLY, ENCODER_REQUEST))
        for encoder in self.encoders[num_encoders:]:
            encoder.close()
        del self.encoders[num_encoders:]
        for pending in self.pending.values():
            if pending.encoder >= num_encoders:
                pending.encoder, pending.asked_at = self.choose(pending.request.images), now
                self.encoders[pending.encoder].send(pending.request)

    def ask(self, request_id: str, images: list[bytes], now: float) -> None:
        """Ask a replica (`choose`) for the embeddings of `images`."""
        request = m.EncodeImages(request_id, images, asked_at=time.time())
        pending = Pending(request, self.choose(images), now, now + self.deadline_s)
        self.pending[request_id] = pending
        self.encoders[pending.encoder].send(request)  # not sent (a full queue, no peer): `tick` resends

    def choose(self, images: list[bytes]) -> int:
        """The replica whose cache may hold these images already: each replica caches what it
        encoded, so the same first image always goes to the same one (by a hash of its bytes),
        unless that one has AFFINITY_SLACK more pending requests than the least loaded."""
        load = [0] * len(self.encoders)
        for pending in self.pending.values():
            if pending.encoder < len(load):  # not one a hot reload is taking away (`resize`)
                load[pending.encoder] += 1
        preferred = preferred_encoder(images, len(load))
        return preferred if load[preferred] < min(load) + AFFINITY_SLACK else load.index(min(load))

    def forget(self, request_id: str) -> None:
        """The request was aborted: its answer, if any comes, is dropped."""
        self.pending.pop(request_id, None)

    def receive(self) -> list[Encoded]:
        """The answers that have come, each to a pending request (duplicates dropped)."""
        out = []
        for index, encoder in enumerate(self.encoders):
            while True:
                try:
                    reply = encoder.recv(timeout=0)
                except MalformedMessage:
                    self.num_malformed += 1
                    continue
                if reply is None:
                    break
                if self.pending.pop(reply.request_id, None) is None:
                    continue  # answered already (a resend's second answer), or aborted
                out.append(
                    Encoded(reply.request_id, index, tuple(reply.keys), tuple(reply.refs), reply.error)
                )
        return out

    def tick(self, now: float) -> list[Encoded]:
        """Resend the requests unanswered for `resend_after_s` to the next replica; returns
        those past their deadline, failed with `timeout`."""
        failed = []
        for request_id, pending in list(self.pending.items()):
            if now >= pending.deadline:
                del self.pending[request_id]
                failed.append(
                    Encoded(request_id, error=f"timeout: no encoder answered in {self.deadline_s:.0f}s")
                )
            elif now - pending.asked_at >= self.resend_after_s:
                pending.encoder = (pending.encoder + 1) % len(self.encoders)
                pending.asked_at = now
                self.encoders[pending.encoder].send(pending.request)
                self.num_resent += 1
        return failed

    def close(self) -> None:
        for encoder in self.encoders:
            encoder.close()
