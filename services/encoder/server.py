"""An encoder's endpoint: the tokenizers' requests for images' embeddings taken off its socket,
each answered by `EncoderCore` with where the embeddings are in its shared-memory cache. The
encoder stage serves it in its loop (services/encoder/__main__.py); with `encoder.in_worker`, the
worker of engine group 0 serves encoder 0's between its steps (services/gpu_worker/__main__.py)."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import zmq

from ipc import messages as m
from ipc.codec import ENCODER_REPLY, ENCODER_REQUEST
from ipc.embedding_cache import EmbeddingCache
from ipc.sockets import MalformedFrame, RouterSocket
from services.common.images import ImageRules
from services.encoder.core import EncoderCore
from services.encoder.vision import load_vision_encoder
from services.metrics import EncoderMetrics
from services.stage import Stage

# Requests taken off the socket ahead of the one being encoded, so that the queue can be counted
# (its heartbeat's queue depth); the rest wait in the socket, as they would anyway.
MAX_QUEUED = 64


class EncoderServer:
    """Encoder `index` of the run: its vision tower, its cache (made, or found after a restart),
    its ROUTER and the requests taken off it. `receive` queues what came, `serve_one` answers the
    oldest."""

    def __init__(self, ctx: zmq.Context, stage: Stage, index: int) -> None:
        config = stage.config.encoder
        model_dir = Path(stage.info.model_dir)
        vision = load_vision_encoder(model_dir)
        rules = ImageRules.from_dir(model_dir)
        # A page holds the fewest image tokens a tile can take: one tile of the families whose
        # tiles are all one size, and Qwen2.5-VL's images take as many pages as their sizes need.
        # The supervisor has checked that the pages hold the largest image (preflight.check_encoders).
        page_rows, width = rules.fewest_tile_tokens, vision.config.text_hidden_size
        cache = EmbeddingCache.create_or_attach(
            stage.endpoints.embedding_cache(index),
            EmbeddingCache.pages_in(config.cache_bytes, page_rows, width),
            page_rows,
            width,
        )
        self.core = EncoderCore(vision, rules, cache, config.max_image_pixels)
        self.socket = RouterSocket(ctx, stage.endpoints.encoder(index), ENCODER_REQUEST, ENCODER_REPLY)
        self.queue: deque[tuple[bytes, m.EncodeImages]] = deque()
        self.metrics = EncoderMetrics(stage.info.model, index)
        self.log = stage.log
        self.num_requests = 0
        self.num_malformed = 0

    def receive(self, timeout: float) -> None:
        """Take what has come off the socket into the queue, waiting up to `timeout` for the
        first."""
        while len(self.queue) < MAX_QUEUED:
            try:
                received = self.socket.recv(timeout)
            except MalformedFrame as exc:
                self.num_malformed += 1
                self.log.warning("dropped a malformed encoder request: %s", exc)
                timeout = 0.0
                continue
            if received is None:
                return
            self.queue.append(received)
            timeout = 0.0

    def serve_one(self) -> None:
        """Answer the oldest queued request, if any."""
        if not self.queue:
            return
        identity, request = self.queue.popleft()
        started, wall = time.monotonic(), time.time()
        encoded, cached = self.core.num_encoded, self.core.num_cached
        try:
            reply = self.core.encode(request)
            outcome = "refused" if reply.error else "answered"
        except Exception as exc:  # a bug must not take the process down with every request after it
            self.log.exception("encoding %s failed", request.request_id)
            reply = m.ImagesEncoded(request.request_id, error=f"internal: {type(exc).__name__}")
            outcome = "failed"
        # Counted before the reply goes: a client that reads /metrics once it has the reply finds
        # this request there.
        self.num_requests += 1
        self.metrics.on_request(
            outcome,
            queue_s=wall - request.asked_at if request.asked_at else 0.0,
            encode_s=time.monotonic() - started,
            num_encoded=self.core.num_encoded - encoded,
            num_cached=self.core.num_cached - cached,
        )
        self.socket.send(identity, reply)

    def close(self) -> None:
        """Detach from the cache (it outlives this process); the socket goes with its context."""
        self.core.cache.close()
