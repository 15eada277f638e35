"""Frontend (tokenizer) replica process: the client-facing ROUTER, the journal, and the relay of
text deltas back to clients. Light: no torch."""

from __future__ import annotations

import random
import time
from pathlib import Path

import zmq

from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST, FRONTEND_INPUT, SCHEDULER_INPUT, MalformedMessage
from ipc.sockets import MalformedFrame, PullQueue, PushQueue, RouterSocket
from services.stage import ControlChannel, install_stop_handler, parse_stage_args
from services.tokenizer.frontend import FrontendCore, Reply, RequestError
from services.tokenizer.metrics import RequestMetrics
from services.tokenizer.text import Tokenizer

POLL_MS = 100


class Frontend:
    """Owns the sockets of one replica and moves messages between them and the core."""

    def __init__(self) -> None:
        self.stage, _ = parse_stage_args("tokenizer")
        stage, config = self.stage, self.stage.config
        self.ctx = zmq.Context()
        self.clients = RouterSocket(self.ctx, stage.endpoints.frontend(stage.index), CLIENT_REQUEST, CLIENT_REPLY)
        self.inbox = PullQueue(self.ctx, stage.endpoints.frontend_in(stage.index), FRONTEND_INPUT, bind=True)
        self.schedulers = [
            PushQueue(self.ctx, stage.endpoints.scheduler_in(g), SCHEDULER_INPUT)
            for g in range(config.engine.data_parallel)
        ]
        self.control = ControlChannel(self.ctx, stage)
        self.core = FrontendCore(
            Tokenizer(Path(stage.info.model_dir)),
            frontend_id=stage.index,
            num_groups=config.engine.data_parallel,
            max_model_len=config.model.max_model_len,
            max_prompt_chars=config.frontend.max_prompt_chars,
            default_max_tokens=config.frontend.default_max_tokens,
            metrics=RequestMetrics(),
            stall_timeout_s=config.frontend.stall_timeout_s,
        )
        self.next_stall_check = 0.0
        self.num_malformed = 0
        self.num_events = 0
        self.is_draining = False
        self.incarnation = random.getrandbits(63)  # tells clients that this process is new

    def send(self, reply: Reply) -> None:
        if not self.clients.send(reply.identity, reply.message):
            # The client is gone: stop spending compute on its request.
            request_id = getattr(reply.message, "request_id", "")
            if self.core.abort(request_id) is not None:
                self.stage.log.info("client of %s disconnected; aborting it", request_id)
                self._abort_upstream(request_id)

    def _abort_upstream(self, request_id: str) -> None:
        for scheduler in self.schedulers:
            scheduler.put(m.AbortRequest(request_id))

    def on_client(self) -> None:
        try:
            received = self.clients.recv(0)
        except MalformedFrame as exc:
            self.num_malformed += 1
            self.clients.send(exc.identity, m.ErrorReply("", "invalid_request", f"malformed message: {exc}"))
            return
        if received is None:
            return
        identity, request = received
        if isinstance(request, m.Generate):
            if self.is_draining:
                self.send(Reply(identity, m.ErrorReply(request.request_id, "unavailable", "server is shutting down")))
                return
            try:
                entry = self.core.admit(identity, request)
            except RequestError as exc:
                self.send(Reply(identity, m.ErrorReply(request.request_id, exc.code, str(exc))))
                return
            if not self.schedulers[entry.group].put(entry.submit):
                self.core.abort(request.request_id)
                self.send(Reply(identity, m.ErrorReply(request.request_id, "overloaded", "engine queue is full")))
        elif isinstance(request, m.Abort):
            entry = self.core.abort(request.request_id)
            self._abort_upstream(request.request_id)
            if entry is not None:
                final = m.Delta(request.request_id, len(entry.output_ids), entry.num_chars, "", b"", finish_reason="abort")
                self.send(Reply(identity, final))
        else:
            self.send(
                Reply(
                    identity,
                    m.HealthReply(
                        self.stage.index,
                        True,
                        self.stage.info.model,
                        len(self.core.journal),
                        self.stage.config.model.max_model_len,
                        self.incarnation,
                    ),
                )
            )

    def on_engine(self) -> None:
        try:
            message = self.inbox.get(0)
        except MalformedMessage as exc:
            self.num_malformed += 1
            self.stage.log.warning("dropped a malformed engine message: %s", exc)
            return
        if isinstance(message, m.DeltaBatch):
            for delta in message.deltas:
                reply = self.core.relay(delta)
                if reply is not None:
                    self.send(reply)
        elif isinstance(message, m.RequestFailed):
            reply = self.core.fail(message)
            if reply is not None:
                self.send(reply)
        elif isinstance(message, m.RequestProgress):
            redrive, failed = self.core.on_progress(message, time.monotonic())
            for entry in redrive:
                self.stage.log.warning(
                    "request %s lost upstream at %d tokens: resubmitting it",
                    entry.submit.request_id,
                    len(entry.output_ids),
                )
                self.schedulers[entry.group].put(self.core.resubmission(entry))
            for reply in failed:
                self.stage.log.error("request %s failed: %s", reply.message.request_id, reply.message.message)
                self.send(reply)

    def check_stalled(self) -> None:
        """Ask the schedulers about requests that got nothing new for a while (the watchdog)."""
        now = time.monotonic()
        if now < self.next_stall_check:
            return
        self.next_stall_check = now + self.core.stall_timeout_s / 4
        for group, request_ids in self.core.stalled(now).items():
            self.schedulers[group].put(m.QueryRequests(self.stage.index, request_ids))

    def on_command(self, command: m.ControlDown) -> None:
        if isinstance(command, m.GroupLoads) and len(command.loads) == self.core.num_groups:
            self.core.group_loads = command.loads
        elif isinstance(command, m.Reconfigure):
            self.core.default_max_tokens = command.default_max_tokens
        elif isinstance(command, m.Shutdown):
            self.is_draining = True  # finish what is in flight, refuse anything new
        elif isinstance(command, m.ResubmitAll):
            submissions = self.core.resubmissions(command.group)
            self.stage.log.info("scheduler %d restarted: resubmitting %d requests", command.group, len(submissions))
            for submit in submissions:
                self.schedulers[command.group].put(submit)
        elif isinstance(command, m.ResubmitShard):
            submissions = self.core.shard_resubmissions(command.shard, command.num_shards)
            self.stage.log.info("detokenizer %d restarted: resubmitting %d requests", command.shard, len(submissions))
            for group, submit in submissions:
                self.schedulers[group].put(submit)

    def run(self) -> None:
        stopping = install_stop_handler()
        poller = zmq.Poller()
        poller.register(self.clients.socket, zmq.POLLIN)
        poller.register(self.inbox.socket, zmq.POLLIN)
        poller.register(self.control.socket.socket, zmq.POLLIN)
        self.control.ready(endpoint=self.stage.endpoints.frontend(self.stage.index))
        self.stage.log.info("serving on %s", self.stage.endpoints.frontend(self.stage.index))
        while not stopping[0]:
            events = dict(poller.poll(POLL_MS))
            if self.inbox.socket in events:
                self.on_engine()
                self.num_events += 1
            if self.clients.socket in events:
                self.on_client()
                self.num_events += 1
            command = self.control.command()
            if command is not None:
                self.on_command(command)
            self.check_stalled()
            self.control.heartbeat(
                self.num_events,
                has_work=False,
                load=m.StageLoad(num_in_flight=len(self.core.journal), num_malformed=self.num_malformed),
            )
        self.stage.log.info("stopping")
        self.ctx.destroy(linger=0)


if __name__ == "__main__":
    Frontend().run()
