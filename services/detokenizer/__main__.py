"""Detokenizer shard process: token batches in, text deltas out to the owning tokenizers, stop-string
hits back to the schedulers as aborts. Light: no torch."""

from __future__ import annotations

from pathlib import Path

import zmq

from ipc import messages as m
from ipc.codec import DETOKENIZER_INPUT, MalformedMessage
from ipc.sockets import PullQueue, close_context
from services.common.text import Tokenizer
from services.detokenizer.core import DetokenizerCore
from services.peers import Peers
from services.stage import ControlChannel, install_stop_handler, parse_stage_args

POLL_MS = 100


def main() -> None:
    stage, _ = parse_stage_args("detokenizer")
    stopping = install_stop_handler()
    ctx = zmq.Context()
    inbox = PullQueue(ctx, stage.endpoints.detokenizer_in(stage.index), DETOKENIZER_INPUT, bind=True)
    peers = Peers(ctx, stage, tokenizers=True, schedulers=True)
    tokenizers, schedulers = peers.tokenizers, peers.schedulers  # resized in place by peers.apply
    control = ControlChannel(ctx, stage)
    control.watch(inbox)
    core = DetokenizerCore(Tokenizer(Path(stage.info.model_dir)))
    num_malformed = 0
    num_batches = 0
    control.ready(shard=str(stage.index))
    stage.log.info("serving")
    poller = zmq.Poller()
    poller.register(inbox.socket, zmq.POLLIN)
    while not stopping[0]:
        if poller.poll(POLL_MS):
            try:
                message = inbox.get(0)
            except MalformedMessage as exc:
                num_malformed += 1
                stage.log.warning("dropped a malformed message: %s", exc)
                continue
            if isinstance(message, m.TokenBatch | m.StepTokens):
                deltas_by_tokenizer, stopped = core.handle(message)
                for tokenizer_id, deltas in deltas_by_tokenizer.items():
                    if 0 <= tokenizer_id < len(tokenizers):
                        tokenizers[tokenizer_id].put(m.DeltaBatch(deltas))
                for request_id in stopped:
                    for scheduler in schedulers:  # unknown ids are ignored there, so broadcast
                        scheduler.put(m.AbortRequest(request_id, "stop"))
                for tokenizer_id, request_ids in core.take_untracked().items():
                    if 0 <= tokenizer_id < len(tokenizers):
                        tokenizers[tokenizer_id].put(m.UntrackedRequests(request_ids))
                num_batches += 1
            elif isinstance(message, m.DropRequests):
                core.drop(message.request_ids)
        command = control.command()
        if isinstance(command, m.TopologyChanged):
            peers.apply(command.topology)
        control.heartbeat(
            num_batches,
            has_work=False,
            load=m.StageLoad(num_in_flight=core.num_live, num_malformed=num_malformed),
        )
    stage.log.info("stopping")
    close_context(ctx, 0)


if __name__ == "__main__":
    main()
