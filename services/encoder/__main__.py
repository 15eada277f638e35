"""Encoder replica process: the tokenizers' requests for images' embeddings in, where the
embeddings are in this replica's shared-memory cache out (services/encoder/server.py). Runs the
vision tower in torch: this is the one stage besides the workers that imports it."""

from __future__ import annotations

import torch

from ipc import messages as m
from services.cpu_cores import usable_cores
from services.encoder.server import EncoderServer
from services.stage import StageProcess

POLL_S = 0.1


class EncoderProcess(StageProcess):
    kind = "encoder"
    confines_writes = True  # it decodes clients' image files

    def __init__(self) -> None:
        super().__init__()
        # OpenMP sized torch's threads by this process's cores as torch loaded, before it moved off
        # the workers' cores (parse_stage_args): more threads than cores spin against each other
        # (ten times slower on a loaded 2-core host).
        torch.set_num_threads(len(usable_cores()))
        self.server = EncoderServer(self.ctx, self.stage, self.stage.index)
        self.control.watch(self.server.socket)

    def start(self) -> None:
        cache = self.server.core.cache
        self.control.ready(cache_pages=str(cache.num_pages), cache_page_rows=str(cache.page_rows))
        self.log.info("serving (a cache of %d pages of %d image tokens)", cache.num_pages, cache.page_rows)

    def step(self) -> None:
        # Waits for a request only when none is queued.
        self.server.receive(0.0 if self.server.queue else POLL_S)
        self.server.serve_one()

    def heartbeat(self) -> None:
        # The request being encoded is answered within its step: the queue is what waits.
        load = m.StageLoad(num_waiting=len(self.server.queue), num_malformed=self.server.num_malformed)
        self.control.heartbeat(self.server.num_requests, has_work=False, load=load)

    def close(self) -> None:
        self.server.close()
        super().close()


if __name__ == "__main__":
    EncoderProcess().run()
