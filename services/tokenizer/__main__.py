"""Tokenizer replica process: the client-facing ROUTER, the journal, and the relay of
text deltas back to clients. Light: no torch."""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST, TOKENIZER_INPUT, MalformedMessage
from ipc.config import ADAPTER_COMMAND_MARGIN_S
from ipc.endpoints import shard_of
from ipc.sampling_defaults import run_defaults
from ipc.sockets import MalformedFrame, PullQueue, RouterSocket, Sent
from ipc.topology import Topology
from services.common.harmony import speaks_harmony
from services.common.image_fetch import ImageFetcher, RemoteImages
from services.common.images import image_rules_of
from services.common.pooling import embedding_of
from services.common.text import Tokenizer
from services.metrics import RequestMetrics
from services.peers import Peers
from services.request_sample import RequestSampler
from services.stage import StageProcess
from services.tokenizer.backlog import Backlog
from services.tokenizer.core import JournalEntry, Reply, RequestError, TokenizerCore
from services.tokenizer.encoders import EncoderClient

POLL_MS = 100
# The poll's timeout while some client's replies are held: its queue is tried again this often.
HELD_POLL_MS = 10
# How often a client with requests in flight is sent a HealthReply. A send to a client that has
# gone fails (ROUTER_MANDATORY), so a dead client's requests stop computing within about this
# long even when nothing else is sent to it (a non-streamed request, or one still queued).
KEEPALIVE_S = 1.0
STOP_LINGER_MS = 1000  # lets the last errors out to the clients when the tokenizer stops


def internal_error(exc: Exception) -> str:
    """The message of a request that the tokenizer failed on (a bug, or input no check foresaw)."""
    return f"the tokenizer failed on this request: {type(exc).__name__}: {exc}"[:1000]


@dataclass
class PendingAdapterCommand:
    """A client's AdapterCommand sent on to every engine group, until each has answered."""

    identity: bytes
    request_id: str  # the client's
    num_waiting: int  # groups that have not answered
    deadline: float
    reply: m.AdapterReply  # the first error, else the last answer


class TokenizerProcess(StageProcess):
    """Owns the sockets of one replica and moves messages between them and the core."""

    kind = "tokenizer"
    stop_linger_ms = STOP_LINGER_MS
    confines_writes = True  # it parses clients' JSON and renders their chats with templates

    def __init__(self) -> None:
        super().__init__()
        stage, config = self.stage, self.stage.config
        self.clients = RouterSocket(
            self.ctx, stage.endpoints.tokenizer(stage.index), CLIENT_REQUEST, CLIENT_REPLY
        )
        self.inbox = PullQueue(
            self.ctx, stage.endpoints.tokenizer_in(stage.index), TOKENIZER_INPUT, bind=True
        )
        self.peers = Peers(self.ctx, stage, schedulers=True, detokenizers=True)
        # one per engine group, and one per detokenizer shard, resized in place
        self.schedulers, self.detokenizers = self.peers.schedulers, self.peers.detokenizers
        self.control.watch(self.clients, self.inbox)
        self.metrics = RequestMetrics(stage.info.model, max_model_len=stage.info.served_max_model_len)
        tokenizer = Tokenizer(Path(stage.info.model_dir))
        self.core = TokenizerCore(
            tokenizer,
            tokenizer_id=stage.index,
            # Only the groups up and taking requests now: the config may already count groups a
            # hot reload is still starting, or leave out ones still draining.
            num_groups=stage.topology.num_routed_groups,
            max_model_len=stage.info.served_max_model_len,  # within the model's and its draft's
            max_prompt_chars=config.tokenizer.max_prompt_chars,
            max_messages=config.tokenizer.max_messages,
            template_timeout_s=config.tokenizer.template_timeout_s,
            default_max_tokens=config.tokenizer.default_max_tokens,
            metrics=self.metrics,
            stall_timeout_s=config.tokenizer.stall_timeout_s,
            start_timeout_s=config.supervisor.start_timeout_s,
            sampler=self._request_sampler(),
            sampling_defaults=run_defaults(
                stage.info.model_dir,
                config.model.generation_config,
                config.model.override_generation_config,
                is_embedded_model=not config.model.path,
            ),
            embedding=embedding_of(config.model, Path(stage.info.model_dir)),
            image_rules=image_rules_of(Path(stage.info.model_dir)),
            num_encoders=config.encoder.num_encoders,
            max_image_bytes=config.encoder.max_image_bytes,
            max_image_pixels=config.encoder.max_image_pixels,
            remote_images=RemoteImages.of(config.encoder),
            is_harmony=speaks_harmony(
                config.gateway.reasoning_parser,
                tokenizer.architectures,
                tokenizer.chat_template,
                lambda tag: len(tokenizer.encode(tag)) == 1,
            ),
        )
        # A request's images go to an encoder first (its http(s) ones fetched before that, on the
        # fetcher's threads); it reaches its scheduler once they are encoded.
        self.encoders = (
            EncoderClient(self.ctx, stage.endpoints, config.encoder.num_encoders)
            if config.encoder.num_encoders
            else None
        )
        self.fetcher = (
            ImageFetcher(self.core.remote_images)
            if self.encoders is not None and self.core.remote_images is not None
            else None
        )
        self.next_stall_check = 0.0
        self.adapter_commands: dict[str, PendingAdapterCommand] = {}  # by the id sent to the groups
        self.adapter_command_ids = itertools.count()
        self.num_events = 0
        self.is_draining = False
        self.last_keepalive = 0.0
        # Replies that slow clients' sockets refused (their queues are full), by client identity.
        self.held: dict[bytes, Backlog] = {}
        self.slow_client_timeout_s = config.tokenizer.slow_client_timeout_s
        self.poller = zmq.Poller()
        self.poller.register(self.clients.socket, zmq.POLLIN)
        self.poller.register(self.inbox.socket, zmq.POLLIN)
        self.poller.register(self.control.socket.socket, zmq.POLLIN)
        self.poller.register(self.stop_fd, zmq.POLLIN)
        for socket in self.encoders.sockets if self.encoders is not None else ():
            self.poller.register(socket, zmq.POLLIN)
        if self.fetcher is not None:
            self.poller.register(self.fetcher.wake_fd, zmq.POLLIN)

    def _request_sampler(self) -> RequestSampler | None:
        mlflow = self.stage.config.observability.mlflow
        if not (mlflow.tracking_uri and mlflow.sample_requests):
            return None
        return RequestSampler(self.stage.run_dir, self.stage.index, mlflow.sample_requests, mlflow.interval_s)

    def send(self, reply: Reply) -> None:
        """Send a reply to its client, or hold it, in order behind the others held for that client,
        while the client's queue is full: a slow client is not a gone one."""
        backlog = self.held.get(reply.identity) if self.held else None
        if backlog is not None:
            backlog.add(reply.message)
            return
        sent = self.clients.try_send(reply.identity, reply.message)
        if sent is Sent.GONE:
            self._client_gone(reply.identity, "disconnected")
        elif sent is Sent.FULL:
            self.log.info(
                "client %s is not reading: holding its replies (%d requests in flight)",
                reply.identity.hex(),
                sum(1 for who, _ in self.core.engine_ids if who == reply.identity),
            )
            self.held[reply.identity] = Backlog(reply.message, time.monotonic())

    def flush_held(self) -> None:
        """Send what slow clients' queues take now; a client whose queue has taken nothing for
        tokenizer.slow_client_timeout_s is treated as gone."""
        now = time.monotonic()
        for identity, backlog in list(self.held.items()):
            sent = backlog.flush(functools.partial(self.clients.try_send, identity), now)
            if sent is Sent.OK:
                del self.held[identity]
            elif sent is Sent.GONE:
                del self.held[identity]
                self._client_gone(identity, "disconnected")
            elif now - backlog.progress_at >= self.slow_client_timeout_s:
                del self.held[identity]
                self.metrics.on_slow_client_dropped()
                self.log.warning(
                    "client %s read none of its replies for %.0fs (tokenizer.slow_client_timeout_s): "
                    "dropping %d held replies",
                    identity.hex(),
                    now - backlog.progress_at,
                    len(backlog),
                )
                self._client_gone(identity, "read nothing in time")

    def _client_gone(self, identity: bytes, why: str) -> None:
        """Stop spending compute on the requests of a client that disconnected or stopped reading."""
        for entry in self.core.abort_connection(identity):
            self.log.info("client of %s %s; aborting it", entry.request_id, why)
            self._abort_upstream(entry.submit.request_id)
            self._forget_images(entry.submit.request_id)

    def _forget_images(self, engine_id: str) -> None:
        """An aborted request's images are no longer wanted: their fetches' and encoders'
        answers are dropped."""
        if self.fetcher is not None:
            self.fetcher.forget(engine_id)
        if self.encoders is not None:
            self.encoders.forget(engine_id)

    def _abort_orphan(self, engine_id: str) -> None:
        """Stop a copy that nobody here waits for: its admitter was a process at this index
        that died, and its client has resubmitted it on a new connection (a new engine id)."""
        if engine_id not in self.core.journal:
            self._abort_upstream(engine_id)

    def _abort_upstream(self, engine_id: str) -> None:
        """Stop the request in the engine, and have its detokenizer shard forget it: the
        scheduler does that too, but only for a request it runs, and one that died with the
        request in flight leaves the shard holding it for good (its successor never had it)."""
        for scheduler in self.schedulers:
            scheduler.put(m.AbortRequest(engine_id))
        if self.detokenizers:
            self.detokenizers[shard_of(engine_id, len(self.detokenizers))].put(m.DropRequests([engine_id]))

    def health(self, missing: list[str] | None = None) -> m.HealthReply:
        return m.HealthReply(
            self.stage.index,
            True,
            self.stage.info.model,
            len(self.core.journal),
            self.stage.info.served_max_model_len,
            missing or [],
        )

    def keep_alive(self) -> None:
        """A HealthReply to every client with requests in flight: finds the ones that are gone."""
        now = time.monotonic()
        if now - self.last_keepalive < KEEPALIVE_S:
            return
        self.last_keepalive = now
        health = self.health()
        # A client whose replies are held needs none: each try to send them finds it gone.
        for identity in {entry.identity for entry in self.core.journal.values()} - self.held.keys():
            self.send(Reply(identity, health))

    def on_client(self) -> None:
        try:
            received = self.clients.recv(0)
        except MalformedFrame as exc:
            self.num_malformed += 1
            error = m.ErrorReply(exc.request_id, "invalid_request", f"malformed message: {exc}")
            # Never waited for, nor held: a client that sends garbage and does not read would
            # otherwise hold up this loop (every client's) for the send timeout per frame, or
            # grow its backlog without bound. It goes without the error when its queue is full.
            self.clients.try_send(exc.identity, error)
            return
        if received is None:
            return
        identity, request = received
        if isinstance(request, m.Generate):
            # A call admitted before the drain takes its next requests (m.Generate.continues):
            # refused midway, it would fail although it was running.
            if self.is_draining and not request.continues:
                self.send(
                    Reply(
                        identity, m.ErrorReply(request.request_id, "unavailable", "server is shutting down")
                    )
                )
                return
            try:
                entry = self.core.admit(identity, request)
            except RequestError as exc:
                self.metrics.on_failure(exc.code)
                self.send(Reply(identity, m.ErrorReply(request.request_id, exc.code, str(exc))))
                return
            except Exception as exc:  # a bug, or input no check foresaw: this request fails, not the stage
                self.log.exception("admitting request %r failed", request.request_id)
                self.metrics.on_failure("internal")
                self.send(Reply(identity, m.ErrorReply(request.request_id, "internal", internal_error(exc))))
                return
            if entry.image_urls:
                assert self.fetcher is not None  # the core admits remote images only with a policy
                self.fetcher.fetch(entry.submit.request_id, entry.image_urls, time.monotonic())
            elif entry.is_encoding:
                assert self.encoders is not None  # the core admits images only with encoders
                self.encoders.ask(entry.submit.request_id, entry.image_files, time.monotonic())
            else:
                self.submit(entry)
        elif isinstance(request, m.AdapterCommand):
            self.on_adapter_command(identity, request)
        elif isinstance(request, m.Abort):
            # Only the connection that made a request may abort it.
            entry = self.core.abort(identity, request.request_id)
            if entry is None:
                message = f"no request {request.request_id!r} of this connection is in flight"
                self.send(Reply(identity, m.ErrorReply(request.request_id, "unknown_request", message)))
                return
            self.log.debug(
                "request %r (engine id %s) aborted by its client", request.request_id, entry.submit.request_id
            )
            self._abort_upstream(entry.submit.request_id)
            self._forget_images(entry.submit.request_id)
            final = m.Delta(
                request.request_id, len(entry.output_ids), entry.num_chars, "", b"", finish_reason="abort"
            )
            self.send(Reply(identity, final))
        else:
            self.send(Reply(identity, self.health(self.core.missing(identity, request.request_ids))))

    def submit(self, entry: JournalEntry) -> None:
        if not self.schedulers[entry.group].put(entry.submit):
            self.core.refuse(entry.identity, entry.request_id, "overloaded")
            self.send(
                Reply(entry.identity, m.ErrorReply(entry.request_id, "overloaded", "engine queue is full"))
            )
            return
        self.log.debug(
            "request %r (engine id %s): %d prompt tokens to engine group %d",
            entry.request_id,
            entry.submit.request_id,
            len(entry.submit.prompt_ids) // 4,
            entry.group,
        )

    def on_fetched(self) -> None:
        """Requests whose remote images came (each, tokenized now, goes on to an encoder), or
        could not be fetched in time or at all, or whose prompt is refused (its client hears why)."""
        assert self.fetcher is not None and self.encoders is not None
        for fetched in self.fetcher.collect(time.monotonic()):
            try:
                outcome = self.core.on_fetched(fetched.request_id, fetched.files, fetched.error)
            except Exception as exc:  # as in admission: this request fails, not the stage
                self.log.exception("tokenizing request %s after its fetch failed", fetched.request_id)
                outcome = self.core.fail(m.RequestFailed(fetched.request_id, "internal", internal_error(exc)))
            if isinstance(outcome, Reply):
                self.send(outcome)
            elif outcome is not None:
                self.encoders.ask(outcome.submit.request_id, outcome.image_files, time.monotonic())

    def on_encoders(self) -> None:
        """Encoders' answers (and requests past their deadline): each request goes on to its
        scheduler with its images' places, or its client hears why its images could not be used."""
        assert self.encoders is not None
        for answer in self.encoders.receive() + self.encoders.tick(time.monotonic()):
            outcome = self.core.on_encoded(
                answer.request_id, answer.encoder, list(answer.keys), list(answer.refs), answer.error
            )
            if isinstance(outcome, Reply):
                self.send(outcome)
            elif outcome is not None:
                self.submit(outcome)

    def on_adapter_command(self, identity: bytes, command: m.AdapterCommand) -> None:
        """Load, unload or list LoRA adapters: every engine group's scheduler does it, and the
        client hears once all have answered (the first error, if any)."""
        if self.is_draining:
            reply = m.AdapterReply(command.request_id, "unavailable", "server is shutting down")
            self.send(Reply(identity, reply))
            return
        own_id = f"adapter-{self.stage.index}-{next(self.adapter_command_ids)}"
        forwarded = m.AdapterRequest(self.stage.index, msgspec.structs.replace(command, request_id=own_id))
        if not all([scheduler.put(forwarded) for scheduler in self.schedulers]):
            reply = m.AdapterReply(command.request_id, "overloaded", "engine queue is full; try again")
            self.send(Reply(identity, reply))
            return
        wait_s = self.stage.config.lora.unload_wait_s + ADAPTER_COMMAND_MARGIN_S
        self.adapter_commands[own_id] = PendingAdapterCommand(
            identity, command.request_id, len(self.schedulers), time.monotonic() + wait_s, m.AdapterReply("")
        )

    def on_adapter_reply(self, reply: m.AdapterReply) -> None:
        pending = self.adapter_commands.get(reply.request_id)
        if pending is None:
            return
        pending.num_waiting -= 1
        if not pending.reply.code:
            pending.reply = reply
        if pending.num_waiting <= 0:
            del self.adapter_commands[reply.request_id]
            self.send(
                Reply(pending.identity, msgspec.structs.replace(pending.reply, request_id=pending.request_id))
            )

    def expire_adapter_commands(self) -> None:
        now = time.monotonic()
        for own_id, pending in list(self.adapter_commands.items()):
            if now >= pending.deadline:
                del self.adapter_commands[own_id]
                message = f"{pending.num_waiting} engine group(s) did not answer the adapter command in time"
                self.send(Reply(pending.identity, m.AdapterReply(pending.request_id, "unavailable", message)))

    def on_engine(self) -> None:
        try:
            message = self.inbox.get(0)
        except MalformedMessage as exc:
            self.num_malformed += 1
            self.log.warning("dropped a malformed engine message: %s", exc)
            return
        if isinstance(message, m.DeltaBatch):
            for delta in message.deltas:
                if delta.finish_reason is None:
                    self._abort_orphan(delta.request_id)
                reply = self.core.relay(delta)
                if reply is not None:
                    if delta.finish_reason is not None:
                        self.log.debug("request %s finished: %s", delta.request_id, delta.finish_reason)
                    self.send(reply)
        elif isinstance(message, m.UntrackedRequests):
            # The detokenizer restarted and gets tokens it cannot place: ours are being
            # resubmitted already (ResubmitShard); only an orphan's must be stopped here.
            for request_id in message.request_ids:
                self._abort_orphan(request_id)
        elif isinstance(message, m.AdapterReply):
            self.on_adapter_reply(message)
        elif isinstance(message, m.RequestFailed):
            entry = self.core.encode_again(message) if self.encoders is not None else None
            if entry is not None:
                self.encoders.ask(entry.submit.request_id, entry.image_files, time.monotonic())
                return
            reply = self.core.fail(message)
            if reply is not None:
                self.log.debug(
                    "request %s failed upstream (%s): %s", message.request_id, message.code, message.message
                )
                self.send(reply)
        elif isinstance(message, m.RequestProgress):
            redrive, failed = self.core.on_progress(message, time.monotonic())
            for entry in redrive:
                self.log.warning(
                    "request %s lost upstream at %d tokens: resubmitting it",
                    entry.submit.request_id,
                    len(entry.output_ids),
                )
                self.schedulers[entry.group].put(self.core.resubmission(entry))
            for reply in failed:
                self.log.error("request %s failed: %s", reply.message.request_id, reply.message.message)
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
        elif isinstance(command, m.TopologyChanged):
            self.on_topology(command.topology)
        elif isinstance(command, m.Shutdown) and not self.is_draining:
            self.is_draining = True  # finish what is in flight and the calls it belongs to, refuse new ones
            self.log.info(
                "draining: %d requests in flight finish, new calls are refused", len(self.core.journal)
            )
        elif isinstance(command, m.ResubmitAll) and command.group < len(self.schedulers):
            submissions = self.core.resubmissions(command.group)
            self.log.info("scheduler %d restarted: resubmitting %d requests", command.group, len(submissions))
            for submit in submissions:
                self.schedulers[command.group].put(submit)
        elif isinstance(command, m.ResubmitShard) and 0 <= command.shard < command.num_shards:
            submissions = self.core.shard_resubmissions(command.shard, command.num_shards)
            self.log.info(
                "detokenizer %d restarted: resubmitting %d requests", command.shard, len(submissions)
            )
            for group, submit in submissions:
                self.schedulers[group].put(submit)

    def on_topology(self, topology: Topology) -> None:
        """Route new requests to the groups that take them; once retired groups have stopped,
        move what was left on them to the others."""
        self.core.set_num_groups(topology.num_routed_groups)
        # The stage count: 0 with encoder.in_worker, whose one encoder never changes.
        if self.encoders is not None and topology.num_encoders not in (0, len(self.encoders.encoders)):
            self.resize_encoders(topology.num_encoders)
        old = self.peers.apply(topology)
        if topology.num_groups < old.num_groups:
            moved = self.core.move_retired()
            self.log.info(
                "engine groups from %d on retired: moving %d requests", topology.num_groups, len(moved)
            )
            for group, submit in moved:
                self.schedulers[group].put(submit)

    def resize_encoders(self, num_encoders: int) -> None:
        """Links to the encoder replicas a hot reload left (the supervisor keeps at least one while
        images are served), before the retired ones stop: what they held goes to the others."""
        assert self.encoders is not None
        before = set(self.encoders.sockets)
        self.encoders.resize(self.ctx, self.stage.endpoints, num_encoders, time.monotonic())
        after = set(self.encoders.sockets)
        for socket in before - after:
            self.poller.unregister(socket)
        for socket in after - before:
            self.poller.register(socket, zmq.POLLIN)
        self.log.info("encoder replicas now %d", num_encoders)

    def start(self) -> None:
        self.control.ready(endpoint=str(self.stage.endpoints.tokenizer(self.stage.index)))
        self.log.info("serving on %s", self.stage.endpoints.tokenizer(self.stage.index))

    def step(self) -> None:
        events = dict(self.poller.poll(HELD_POLL_MS if self.held else POLL_MS))
        if self.inbox.socket in events:
            self.on_engine()
            self.num_events += 1
        if self.clients.socket in events:
            self.on_client()
            self.num_events += 1
        if self.fetcher is not None and (self.fetcher.pending or self.fetcher.wake_fd in events):
            self.on_fetched()
            self.num_events += 1
        if self.encoders is not None and (
            self.encoders.pending or any(s in events for s in self.encoders.sockets)
        ):
            self.on_encoders()
            self.num_events += 1
        if self.held:
            self.flush_held()
        self.keep_alive()
        self.check_stalled()
        if self.adapter_commands:
            self.expire_adapter_commands()

    def heartbeat(self) -> None:
        load = m.StageLoad(
            num_in_flight=len(self.core.journal),
            num_malformed=self.num_malformed,
            is_draining=self.is_draining,
        )
        self.control.heartbeat(self.num_events, has_work=False, load=load)

    def drain(self) -> str:
        """The run is stopping or this replica is retired: every client hears it now instead of
        waiting for a reply that will never come (with other replicas, the SDK fails over)."""
        dropped = self.core.drop_all()
        if self.fetcher is not None:
            self.fetcher.close()  # fetches not started never start: the process's exit waits for those running
        for entry in dropped:
            error = m.ErrorReply(
                entry.request_id, "unavailable", "the tokenizer stopped (its Brigade run is ending)"
            )
            # Not waited for: a client whose queue is full would hold up the stop for the send
            # timeout per request (the SDK hears that the run ended anyway).
            self.clients.try_send(entry.identity, error)
            self._abort_upstream(entry.submit.request_id)
        return f"; failed the {len(dropped)} requests in flight"


if __name__ == "__main__":
    TokenizerProcess().run()
