"""Encoder replica process: the tokenizers' requests for images' embeddings in, where the
embeddings are in this replica's shared-memory cache out (services/encoder/core.py). Runs the
vision tower in torch: this is the one stage besides the workers that imports it."""

from __future__ import annotations

from pathlib import Path

from ipc import messages as m
from ipc.codec import ENCODER_REPLY, ENCODER_REQUEST
from ipc.embedding_cache import EmbeddingCache
from ipc.sockets import MalformedFrame, RouterSocket
from services.common.images import ImageRules
from services.encoder.core import EncoderCore
from services.encoder.vision import VisionEncoder
from services.stage import StageProcess

POLL_S = 0.1


class EncoderProcess(StageProcess):
    kind = "encoder"
    confines_writes = True  # it decodes clients' image files

    def __init__(self) -> None:
        super().__init__()
        stage, config = self.stage, self.stage.config.encoder
        model_dir = Path(stage.info.model_dir)
        vision = VisionEncoder.load(model_dir)
        rules = ImageRules.from_dir(model_dir)
        rows, width = vision.config.tokens_per_image, vision.config.text_hidden_size
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
        self.num_requests = 0

    def start(self) -> None:
        self.control.ready(cache_slots=str(self.core.cache.num_slots))
        self.log.info("serving (%d cached images at most)", self.core.cache.num_slots)

    def step(self) -> None:
        try:
            received = self.requests.recv(POLL_S)
        except MalformedFrame as exc:
            self.num_malformed += 1
            self.log.warning("dropped a malformed request: %s", exc)
            return
        if received is None:
            return
        identity, request = received
        try:
            reply = self.core.encode(request)
        except Exception as exc:  # a bug must not take the stage down with every request after it
            self.log.exception("encoding %s failed", request.request_id)
            reply = m.ImagesEncoded(request.request_id, error=f"internal: {type(exc).__name__}")
        self.requests.send(identity, reply)
        self.num_requests += 1

    def heartbeat(self) -> None:
        load = m.StageLoad(num_in_flight=0, num_malformed=self.num_malformed)
        self.control.heartbeat(self.num_requests, has_work=False, load=load)

    def close(self) -> None:
        self.core.cache.close()
        super().close()


if __name__ == "__main__":
    EncoderProcess().run()
