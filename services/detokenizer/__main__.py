"""Detokenizer shard process: token batches in, text deltas out to the owning tokenizers, stop-string
hits back to the schedulers as aborts. Light: no torch."""

from __future__ import annotations

from pathlib import Path

import zmq

from ipc import messages as m
from ipc.codec import DETOKENIZER_INPUT, MalformedMessage
from ipc.sockets import PullQueue
from services.common.text import Tokenizer
from services.detokenizer.core import DetokenizerCore
from services.peers import Peers
from services.stage import StageProcess

POLL_MS = 100


class DetokenizerProcess(StageProcess):
    kind = "detokenizer"

    def __init__(self) -> None:
        super().__init__()
        stage = self.stage
        self.inbox = PullQueue(
            self.ctx, stage.endpoints.detokenizer_in(stage.index), DETOKENIZER_INPUT, bind=True
        )
        self.peers = Peers(self.ctx, stage, tokenizers=True, schedulers=True)
        self.tokenizers, self.schedulers = self.peers.tokenizers, self.peers.schedulers  # resized in place
        self.control.watch(self.inbox)
        self.core = DetokenizerCore(Tokenizer(Path(stage.info.model_dir)))
        self.num_batches = 0
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.socket, zmq.POLLIN)
        self.poller.register(self.stop_fd, zmq.POLLIN)

    def start(self) -> None:
        self.control.ready(shard=str(self.stage.index))
        self.log.info("serving")

    def step(self) -> None:
        if not self.poller.poll(POLL_MS):
            return
        try:
            message = self.inbox.get(0)
        except MalformedMessage as exc:
            self.num_malformed += 1
            self.log.warning("dropped a malformed message: %s", exc)
            return
        if isinstance(message, m.TokenBatch | m.StepTokens):
            self.on_tokens(message)
        elif isinstance(message, m.DropRequests):
            self.core.drop(message.request_ids)

    def on_tokens(self, message: m.TokenBatch | m.StepTokens) -> None:
        tokenizers = self.tokenizers
        deltas_by_tokenizer, stopped = self.core.handle(message)
        for tokenizer_id, deltas in deltas_by_tokenizer.items():
            if 0 <= tokenizer_id < len(tokenizers):
                tokenizers[tokenizer_id].put(m.DeltaBatch(deltas))
        for request_id in stopped:
            for scheduler in self.schedulers:  # unknown ids are ignored there, so broadcast
                scheduler.put(m.AbortRequest(request_id, "stop"))
        for tokenizer_id, request_ids in self.core.take_untracked().items():
            if 0 <= tokenizer_id < len(tokenizers):
                tokenizers[tokenizer_id].put(m.UntrackedRequests(request_ids))
        self.num_batches += 1

    def on_command(self, command: m.ControlDown) -> None:
        if isinstance(command, m.TopologyChanged):
            self.peers.apply(command.topology)

    def heartbeat(self) -> None:
        load = m.StageLoad(num_in_flight=self.core.num_live, num_malformed=self.num_malformed)
        self.control.heartbeat(self.num_batches, has_work=False, load=load)


if __name__ == "__main__":
    DetokenizerProcess().run()
