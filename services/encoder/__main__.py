"""Encoder replica process: the tokenizers' requests for images' embeddings in, where the
embeddings are in this replica's shared-memory cache out (services/encoder/core.py). Runs the
vision tower in torch: this is the one stage besides the workers that imports it."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from ipc import messages as m
from ipc.codec import ENCODER_REPLY, ENCODER_REQUEST
from ipc.embedding_cache import EmbeddingCache
from ipc.sockets import MalformedFrame, RouterSocket
from services.common.images import ImageRules
from services.encoder.core import EncoderCore
from services.encoder.vision import VisionEncoder
from services.metrics import EncoderMetrics
from services.stage import StageProcess

POLL_S = 0.1
# Requests taken off the socket ahead of the one being encoded, so that the queue can be counted
# (its heartbeat's queue depth); the rest wait in the socket, as they would anyway.
MAX_QUEUED = 64


class EncoderProcess(StageProcess):
    kind = "encoder"
    confines_writes = True  # it decodes clients' image files

    def __init__(self) -> None:
        super().__init__()
        stage, config = self.stage, self.stage.config.encoder
        model_dir = Path(stage.info.model_dir)
        vision = VisionEncoder.load(model_dir)
        rules = ImageRules.from_dir(model_dir)
        rows, width = vision.config.tokens_per_tile, vision.config.text_hidden_size
        slot_bytes = EmbeddingCache.segment_bytes(1, rows, width)
        cache = EmbeddingCache.create_or_attach(
            stage.endpoints.embedding_cache(stage.index),
            max(config.cache_bytes // slot_bytes, 1),
            rows,
            width,
        )
        self.core = EncoderCore(vision, rules, cache, config.max_image_pixels)
        self.requests = RouterSocket(
            self.ctx, stage.endpoints.encoder(stage.index), ENCODER_REQUEST, ENCODER_REPLY
        )
        self.control.watch(self.requests)
        self.queue: deque[tuple[bytes, m.EncodeImages]] = deque()
        self.metrics = EncoderMetrics(stage.info.model, stage.index)
        self.num_requests = 0

    def start(self) -> None:
        self.control.ready(cache_slots=str(self.core.cache.num_slots))
        self.log.info("serving (%d cached images at most)", self.core.cache.num_slots)

    def receive(self) -> None:
        """Take what has come off the socket into the queue (waiting up to POLL_S for the first
        when there is nothing to do)."""
        timeout = 0.0 if self.queue else POLL_S
        while len(self.queue) < MAX_QUEUED:
            try:
                received = self.requests.recv(timeout)
            except MalformedFrame as exc:
                self.num_malformed += 1
                self.log.warning("dropped a malformed request: %s", exc)
                timeout = 0.0
                continue
            if received is None:
                return
            self.queue.append(received)
            timeout = 0.0

    def step(self) -> None:
        self.receive()
        if not self.queue:
            return
        identity, request = self.queue.popleft()
        started, wall = time.monotonic(), time.time()
        encoded, cached = self.core.num_encoded, self.core.num_cached
        try:
            reply = self.core.encode(request)
            outcome = "refused" if reply.error else "answered"
        except Exception as exc:  # a bug must not take the stage down with every request after it
            self.log.exception("encoding %s failed", request.request_id)
            reply = m.ImagesEncoded(request.request_id, error=f"internal: {type(exc).__name__}")
            outcome = "failed"
        self.requests.send(identity, reply)
        self.num_requests += 1
        self.metrics.on_request(
            outcome,
            queue_s=wall - request.asked_at if request.asked_at else 0.0,
            encode_s=time.monotonic() - started,
            num_encoded=self.core.num_encoded - encoded,
            num_cached=self.core.num_cached - cached,
        )

    def heartbeat(self) -> None:
        # The request being encoded is answered within its step: the queue is what waits.
        load = m.StageLoad(num_waiting=len(self.queue), num_malformed=self.num_malformed)
        self.control.heartbeat(self.num_requests, has_work=False, load=load)

    def close(self) -> None:
        self.core.cache.close()
        super().close()


if __name__ == "__main__":
    EncoderProcess().run()
