"""Scheduler process of one engine group: admits tokenized requests, plans each step into the
step ring, reads results, and sends new tokens (StepTokens, TokenBatch) to the detokenizer shards.

Steps run through a `StepPipeline`, which plans step N+1 while the workers execute step N
(pipeline.py). Worker loss (its process dies or a step times out) drops the steps in flight and
puts every running sequence back for recompute; the group resumes when a worker says hello again
(docs/architecture.md invariant 4).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections import defaultdict

import msgspec
import numpy as np
import zmq

from ipc import messages as m
from ipc.codec import SCHEDULER_INPUT, WORKER_INPUT, WORKER_OUTPUT, MalformedMessage
from ipc.config import SpeculativeConfig
from ipc.endpoints import shard_of
from ipc.shm import ShmRing
from ipc.sockets import PullQueue, RouterSocket
from ipc.topology import Topology
from ipc.validation import InvalidParams, validate_params
from services.common.grammar_compiler import (
    MIB,
    GrammarBudgets,
    GrammarCompiler,
    load_grammar_tokenizer,
    parser_limits,
)
from services.metrics import EngineMetrics
from services.peers import Peers
from services.scheduler.adapters import Adapters
from services.scheduler.core import Overloaded, PromptTooLong, Scheduler, SchedulerConfig, StepOutputs
from services.scheduler.grammar_matcher import BitmaskFiller
from services.scheduler.grammars import Grammars
from services.scheduler.pipeline import RingExecutor, StepPipeline, StepTooLate, WorkerLost
from services.scheduler.proposers import DraftModelProposer, NgramProposer, Proposer
from services.scheduler.request import Request
from services.stage import StageProcess, lora_table_path

BLOCKED_POLL_MS = 50  # work that could not be planned now: look again soon
COMPILE_POLL_MS = 1  # while a grammar compiles: its request starts as soon as it is done
MAX_INPUTS_PER_STEP = 1024
# Workers replaced in a row for a step past engine.step_timeout_s, with no step finished between,
# before the group's requests fail. Each replacement recomputes every sequence, a bigger step than
# the one that was late: on a host short of CPU that can go on forever, and the requests would
# wait in silence instead of hearing that the engine cannot serve them.
MAX_LATE_STEPS = 3


class SchedulerProcess(StageProcess):
    """Owns the sockets and rings of one engine group and drives the pure `Scheduler` core."""

    kind = "scheduler"

    def __init__(self) -> None:
        super().__init__()
        stage, config = self.stage, self.stage.config
        self.group = stage.index
        self.inbox = PullQueue(self.ctx, stage.endpoints.scheduler_in(self.group), SCHEDULER_INPUT, bind=True)
        self.workers = RouterSocket(
            self.ctx, stage.endpoints.scheduler_workers(self.group), WORKER_OUTPUT, WORKER_INPUT
        )
        self.peers = Peers(self.ctx, stage, tokenizers=True, detokenizers=True)
        self.tokenizers, self.detokenizers = (
            self.peers.tokenizers,
            self.peers.detokenizers,
        )  # resized in place
        self.control.watch(self.inbox, self.workers)
        self.step_ring = ShmRing.attach(stage.endpoints.step_ring(self.group))
        self.result_ring = ShmRing.attach(stage.endpoints.result_ring(self.group))
        self.world_size = config.engine.tensor_parallel
        self.hellos: dict[int, m.WorkerHello] = {}
        self.worker_pids: list[int] = []
        self.vocab_size = 0  # from the workers' hello
        self.core: Scheduler | None = None
        self.pipeline: StepPipeline | None = None  # with the core, once the workers said hello
        self.early: list[m.SubmitRequest] = []  # requests that came before the first worker
        # Requests (re)admitted whose detokenizer state must be rebuilt from their whole history.
        self.needs_full_history: dict[str, Request] = {}
        self.num_steps = 0
        self.num_late_steps = 0  # workers replaced for a late step since the last step finished
        self.num_tokens = 0
        self.metrics = EngineMetrics(stage.info.model, self.group)
        lora = config.lora
        self.listed_adapters = dict(lora.adapters)  # lora.adapters as the config last said (hot reload)
        self.adapters = Adapters(
            max(lora.max_cpu_loras, lora.max_loras),
            lora.adapters,
            lora_table_path(stage.run_dir, self.group),
            lora.unload_wait_s,
            stage.info.model,
            users=self.num_adapter_users,
            reply=self.reply_to_tokenizer,
            to_workers=self.send_to_workers,
            on_unloaded=self.forget_adapter,
        )
        self.poller = zmq.Poller()
        for sock in (self.inbox.socket, self.workers.socket, self.control.socket.socket, self.stop_fd):
            self.poller.register(sock, zmq.POLLIN)

    # -- inputs --------------------------------------------------------------------------------

    def drain_inbox(self) -> None:
        for _ in range(MAX_INPUTS_PER_STEP):
            try:
                message = self.inbox.get(0)
            except MalformedMessage as exc:
                self.num_malformed += 1
                self.log.warning("dropped a malformed message: %s", exc)
                continue
            if message is None:
                return
            if isinstance(message, m.SubmitRequest):
                self.submit(message)
            elif isinstance(message, m.AbortRequest):
                self.abort(message.request_id)
            elif isinstance(message, m.AdapterRequest):
                self.adapters.command(message, self.world_size, workers_up=bool(self.worker_pids))
            else:
                self.report_progress(message)

    def submit(self, submit: m.SubmitRequest) -> None:
        if self.core is None:
            engine = self.stage.config.engine  # the same bound as Scheduler.add, with every slot free
            if len(self.early) >= engine.max_num_seqs + engine.max_num_waiting:
                self.refuse(submit, "overloaded", "engine is starting and its queue is full")
            else:
                self.early.append(submit)
            return
        try:  # the tokenizer validated it; a stray or corrupted submission must not crash us
            validate_params(
                submit.params,
                vocab_size=self.vocab_size,
                max_model_len=self.core.config.max_model_len,
                num_prompt_tokens=len(submit.prompt_ids) // 4,
            )
        except InvalidParams as exc:
            self.refuse(submit, exc.code, str(exc))
            return
        refusal = self.adapters.refusal(submit.params.adapter) if submit.params.adapter else ""
        if refusal:
            # A name the gateway found served may have been unloaded since (a hot reload, another
            # replica's unload): the same 404 as a name it never knew, not a bad parameter.
            self.refuse(submit, "model_not_found", refusal)
            return
        request = Request(
            request_id=submit.request_id,
            tokenizer_id=submit.tokenizer_id,
            prompt_ids=m.unpack_ids(submit.prompt_ids).tolist(),
            output_ids=m.unpack_ids(submit.output_ids).tolist(),
            params=submit.params,
            arrival_time=time.monotonic(),
            images=submit.images,
            adapter_load=self.adapters.load_count(submit.params.adapter) if submit.params.adapter else 0,
        )
        try:
            finished = self.core.add(request)
        except (Overloaded, PromptTooLong, ValueError) as exc:
            code = {Overloaded: "overloaded", PromptTooLong: "prompt_too_long"}.get(
                type(exc), "invalid_request"
            )
            self.refuse(submit, code, str(exc))
            return
        self.log.debug(
            "request %s queued: %d prompt tokens, %d output tokens already%s",
            submit.request_id,
            len(request.prompt_ids),
            len(request.output_ids),
            f", adapter {submit.params.adapter}" if submit.params.adapter else "",
        )
        if not self.core.config.pooling:  # an embedding's vector goes to its tokenizer, no detokenizer
            self.needs_full_history[submit.request_id] = request
        if finished is not None:  # a resubmission that had already met its end: its history, finished
            self.send_finished(request, finished.finish_reason)

    def send_finished(self, request: Request, finish_reason: str | None) -> None:
        """A request that ended without a step: its whole history, finished, to its detokenizer."""
        self.needs_full_history.pop(request.request_id, None)
        shard = shard_of(request.request_id, len(self.detokenizers))
        self.detokenizers[shard].put(m.TokenBatch([self.full_history(request, finish_reason)]))

    def poll_grammars(self) -> None:
        """Constrained requests whose grammar compiled join the queue; the others fail."""
        if self.core is None or not self.core.num_compiling:
            return
        finished, failed = self.core.poll_grammars()
        for request in finished:
            self.send_finished(request, request.finish_reason)
        for request, error in failed:
            self.needs_full_history.pop(request.request_id, None)
            submit = m.SubmitRequest(request.request_id, request.tokenizer_id, b"", request.params)
            self.refuse(submit, "invalid_request", error)

    def refuse(self, submit: m.SubmitRequest, code: str, message: str) -> None:
        self.log.debug("request %s refused (%s): %s", submit.request_id, code, message)
        self.send_failure(submit.tokenizer_id, submit.request_id, code, message)

    def send_failure(self, tokenizer_id: int, request_id: str, code: str, message: str) -> None:
        if 0 <= tokenizer_id < len(self.tokenizers):
            self.tokenizers[tokenizer_id].put(m.RequestFailed(request_id, code, message))

    def abort(self, request_id: str) -> None:
        self.early = [s for s in self.early if s.request_id != request_id]
        self.needs_full_history.pop(request_id, None)
        if self.core is not None and self.core.abort(request_id):
            self.log.debug("request %s aborted", request_id)
            self.detokenizers[shard_of(request_id, len(self.detokenizers))].put(m.DropRequests([request_id]))

    def report_progress(self, query: m.QueryRequests) -> None:
        """A tokenizer asks how far its quiet requests are (its watchdog): the outputs held for
        each, -1 for one this scheduler does not run, and whether it is ready: before its workers'
        hello a restarted scheduler has not had its resubmissions (the supervisor sends
        ResubmitAll once it is ready), so not running a request means nothing yet."""
        if not 0 <= query.tokenizer_id < len(self.tokenizers):
            return
        early = {s.request_id: len(s.output_ids) // 4 for s in self.early}
        live = self.core.requests if self.core is not None else {}
        counts = [
            live[rid].num_output_tokens if rid in live else early.get(rid, -1) for rid in query.request_ids
        ]
        progress = m.RequestProgress(query.request_ids, counts, is_ready=self.core is not None)
        self.tokenizers[query.tokenizer_id].put(progress)

    def reconfigure(self, command: m.Reconfigure) -> None:
        """The overload bound or lora.adapters changed (hot reload)."""
        if self.core is not None:
            self.core.config = self.core.config.with_max_num_waiting(command.max_num_waiting)
        if command.lora_adapters != self.listed_adapters:
            self.adapters.reload(
                self.listed_adapters,
                command.lora_adapters,
                self.world_size,
                workers_up=bool(self.worker_pids),
            )
            self.listed_adapters = dict(command.lora_adapters)

    def on_topology(self, topology: Topology) -> None:
        """Tokenizers or detokenizer shards were added or removed: requests whose shard changed
        move to the new one with their whole history, and the old shard forgets them."""
        old_shards = self.peers.apply(topology).num_detokenizers
        new_shards = topology.num_detokenizers
        if new_shards == old_shards or self.core is None:
            return
        moved: dict[int, list[m.TokenUpdate]] = defaultdict(list)
        dropped: dict[int, list[str]] = defaultdict(list)
        for request in self.core.requests.values():
            old = shard_of(request.request_id, old_shards)
            new = shard_of(request.request_id, new_shards)
            if old != new:
                moved[new].append(self.full_history(request))
                if old < new_shards:
                    dropped[old].append(request.request_id)
        for shard, ids in dropped.items():
            self.detokenizers[shard].put(m.DropRequests(ids))
        for shard, updates in moved.items():
            self.detokenizers[shard].put(m.TokenBatch(updates))
        self.log.info("detokenizer shards %d -> %d", old_shards, new_shards)

    @staticmethod
    def full_history(
        request: Request,
        finish_reason: str | None = None,
        newest: tuple[list[float], list[dict[int, float]]] | None = None,
    ) -> m.TokenUpdate:
        """The request's whole output so far. `newest` is the logprobs and top logprobs of its last
        tokens, those this step emitted (one, or several where it verified proposals); the
        scheduler keeps no logprobs of earlier tokens, which go as NaN and {}: every receiver
        already has them (they are what a resubmission or resync starts from)."""
        logprobs, top_logprobs = b"", []
        if newest is not None and request.output_ids:
            column = np.full(len(request.output_ids), np.nan, "<f4")
            column[len(column) - len(newest[0]) :] = newest[0]
            logprobs = column.tobytes()
            if newest[1]:
                top_logprobs = [{}] * (len(request.output_ids) - len(newest[0])) + newest[1]
        return m.TokenUpdate(
            request_id=request.request_id,
            tokenizer_id=request.tokenizer_id,
            start_index=0,
            token_ids=m.pack_ids(request.output_ids),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            finish_reason=finish_reason,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=request.num_cached_tokens,
            params=request.params,
            prompt_logprobs=prompt_logprobs(request),
        )

    # -- LoRA adapters ---------------------------------------------------------------------------

    def num_adapter_users(self, name: str) -> int:
        """The group's requests (queued, running, or waiting for the workers) that use adapter `name`."""
        live = self.core.requests.values() if self.core is not None else ()
        return sum(r.params.adapter == name for r in live) + sum(s.params.adapter == name for s in self.early)

    def reply_to_tokenizer(self, tokenizer_id: int, reply: m.AdapterReply) -> None:
        if 0 <= tokenizer_id < len(self.tokenizers):
            self.tokenizers[tokenizer_id].put(reply)
        elif reply.code:  # a hot reload's: nobody waits for it but the log
            self.log.error("%s: %s", reply.request_id, reply.message)
        else:
            self.log.info("%s: LoRA adapters now %s", reply.request_id, sorted(reply.adapters))

    def send_to_workers(self, command: m.LoadAdapter | m.UnloadAdapter) -> None:
        for rank in range(self.world_size):
            self.workers.send(f"rank-{rank}".encode(), command)

    def adapters_in_use(self) -> dict[str, list[str]]:
        """The heartbeat's adapter fields: loaded, and used by running and by waiting requests."""
        if not self.adapters.loaded:
            return {}
        running = self.core.state.running if self.core is not None else ()
        waiting = [*(self.core.state.waiting if self.core is not None else ()), *self.early]
        return {
            "lora_adapters": sorted(self.adapters.loaded),
            "lora_running": sorted({r.params.adapter for r in running} - {""}),
            "lora_waiting": sorted({r.params.adapter for r in waiting} - {""}),
        }

    def forget_adapter(self, name: str) -> None:
        """An adapter unloaded: the slot that held it is free (a new load of the name is copied in)."""
        if self.core is not None:
            self.core.state.lora.forget(name)

    # -- workers -------------------------------------------------------------------------------

    def accept_hellos(self) -> None:
        while True:
            try:
                received = self.workers.recv(0)
            except MalformedMessage:
                self.num_malformed += 1
                continue
            if received is None:
                return
            if isinstance(received[1], m.AdapterLoaded):
                self.adapters.on_loaded(received[1])
            else:
                self.on_hello(received[1])

    def on_hello(self, hello: m.WorkerHello) -> None:
        self.hellos[hello.rank] = hello
        if len(self.hellos) < self.world_size:
            return
        # Every rank is here: start from clean rings, then let the workers read.
        self.step_ring.reset()
        self.result_ring.reset()
        # The echo lists the adapters loaded: a restarted worker loads them before a step.
        adapters = self.adapters.sources()
        for rank in range(self.world_size):
            echo = msgspec.structs.replace(self.hellos[rank], adapters=adapters)
            self.workers.send(f"rank-{rank}".encode(), echo)
        if self.core is not None and self.pipeline is not None:
            # Workers started again, perhaps without a step noticing the old ones die (an idle
            # group): whatever the scheduler thinks their KV cache holds is gone, the prefix
            # cache's blocks too, and their LoRA slots hold only what the echo lists.
            self.pipeline.drop_in_flight()
            self.core.preempt_all()
        self.worker_pids = [h.pid for h in self.hellos.values()]
        first = self.hellos[0]
        self.vocab_size = first.vocab_size
        if self.core is None:
            self.core = Scheduler(
                SchedulerConfig.of(
                    self.stage.config.engine,
                    self.stage.config.model.max_model_len,
                    [self.hellos[rank] for rank in range(self.world_size)],
                    proposer(self.stage.config.speculative),
                    self.stage.config.lora.max_loras,
                    self.stage.config.lora.num_slots,
                ),
                self.load_grammars(first),
            )
            self.pipeline = StepPipeline(
                self.core,
                RingExecutor(
                    self.step_ring,
                    self.result_ring,
                    first.block_size,
                    self.stage.config.engine.step_timeout_s,
                    self.is_worker_alive,
                    on_wait=self.heartbeat,
                ),
                self.fail_requests,
            )
            for submit in self.early:
                self.submit(submit)
            self.early.clear()
            self.control.ready(kv_blocks=str(self.core.config.num_blocks))
        self.hellos.clear()
        self.log.info("workers up (pids %s)", self.worker_pids)

    def load_grammars(self, hello: m.WorkerHello) -> Grammars | None:
        """The grammar engine for structured output, over the model's tokenizer and vocabulary (the
        lm_head width, which is the bitmask's); None, and structured requests refused, when the
        model has no tokenizer.json or no eos token for a grammar to end on."""
        try:
            tokenizer = load_grammar_tokenizer(
                self.stage.info.model_dir, hello.vocab_size, hello.eos_token_ids
            )
        except (OSError, ValueError) as exc:
            self.log.warning("structured output is off: %s", exc)
            return None
        structured = self.stage.config.structured
        budgets = GrammarBudgets(
            compile_timeout_s=structured.compile_timeout_ms / 1000,
            max_grammar_bytes=structured.max_grammar_mib * MIB,
            cache_bytes=structured.grammar_cache_mib * MIB,
            limits=parser_limits(structured.lexer_fuel),
        )
        filler = BitmaskFiller(budget_s=structured.mask_timeout_ms / 1000)
        return Grammars(GrammarCompiler(tokenizer, budgets=budgets), hello.vocab_size, filler)

    def is_worker_alive(self) -> bool:
        for pid in self.worker_pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
        return bool(self.worker_pids)

    def on_worker_lost(self, reason: str, is_late: bool) -> None:
        self.num_late_steps += is_late
        if self.num_late_steps >= MAX_LATE_STEPS:
            self.fail_all_late()
        self.log.warning("worker lost (%s): recomputing running sequences", reason)
        # A worker that is alive but late (a step past step_timeout_s) would never say hello again
        # and the group would wait forever: kill it, and the supervisor starts a fresh one.
        for pid in self.worker_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.worker_pids = []
        self.adapters.fail_loads("the engine's workers restarted")
        if self.core is not None and self.pipeline is not None:
            self.pipeline.drop_in_flight()
            self.core.preempt_all()

    # -- steps ---------------------------------------------------------------------------------

    def fail_requests(self, requests: list[Request], error: str) -> None:
        """The worker refused a plan (a bug, not a fault): fail its requests rather than loop.
        An image evicted from its encoder's cache since it was encoded is no bug: the requests
        with images go back to their tokenizers to be encoded again, the others recompute."""
        if m.EVICTED_EMBEDDINGS in error:
            assert self.core is not None  # a step ran
            self.log.warning("a step's images left their encoders' caches: encoding them again (%s)", error)
            self.core.recompute([request for request in requests if not request.images])
            for request in requests:
                if request.images:
                    self.abort(request.request_id)
                    self.send_failure(request.tokenizer_id, request.request_id, m.IMAGES_EVICTED, error)
            return
        self.log.error("worker refused a step: %s", error)
        for request in requests:
            submit = m.SubmitRequest(request.request_id, request.tokenizer_id, b"", request.params)
            self.abort(request.request_id)
            self.refuse(submit, "internal", f"the worker could not run this request: {error}")

    def fail_all_late(self) -> None:
        """Fail every request of the group: MAX_LATE_STEPS workers in a row could not finish a
        step within the step timeout (see MAX_LATE_STEPS)."""
        assert self.core is not None  # a step ran, so the workers had said hello
        timeout = self.stage.config.engine.step_timeout_s
        message = (
            f"the engine could not finish a step within engine.step_timeout_s={timeout:g}s "
            f"{self.num_late_steps} times in a row (the host is too slow or too loaded for it)"
        )
        requests = list(self.core.requests.values())
        self.log.error("failing %d requests: %s", len(requests), message)
        for request in requests:
            self.abort(request.request_id)
            submit = m.SubmitRequest(request.request_id, request.tokenizer_id, b"", request.params)
            self.refuse(submit, "overloaded", message)
        self.num_late_steps = 0

    def emit(self, outputs: StepOutputs) -> None:
        if outputs.embeddings is not None:
            self.emit_embeddings(outputs)
            return
        self.num_tokens += len(outputs)  # one new token per output
        if self.log.isEnabledFor(logging.DEBUG):  # the per-step path: no loop unless asked
            for request_id, reason in zip(outputs.request_ids, outputs.finish_reasons, strict=True):
                if reason is not None:
                    self.log.debug("request %s finished: %s", request_id, reason)
        for shard, messages in detokenizer_messages(
            outputs, self.needs_full_history, len(self.detokenizers)
        ).items():
            for message in messages:
                self.detokenizers[shard].put(message)
        for failure in outputs.failures:
            # The detokenizer forgets it (after the tokens it already has), and its tokenizer
            # answers the client with the error, whatever text is still on its way.
            self.needs_full_history.pop(failure.request_id, None)
            shard = shard_of(failure.request_id, len(self.detokenizers))
            self.detokenizers[shard].put(m.DropRequests([failure.request_id]))
            self.send_failure(failure.tokenizer_id, failure.request_id, failure.code, failure.message)

    def emit_embeddings(self, outputs: StepOutputs) -> None:
        """An embedding step's vectors, each as its request's one and final delta, straight to the
        request's tokenizer: there is no text for a detokenizer to make. A vector delivered twice
        (a resubmission) is the same vector, and the tokenizer forwards only the first."""
        assert outputs.embeddings is not None
        batches: dict[int, list[m.Delta]] = defaultdict(list)
        for j, vector in enumerate(outputs.embeddings):
            usage = m.Usage(outputs.num_prompt_tokens[j], 0)
            delta = m.Delta(
                outputs.request_ids[j],
                0,
                0,
                "",
                b"",
                finish_reason="stop",
                usage=usage,
                embedding=vector.tobytes(),
            )
            batches[outputs.tokenizer_ids[j]].append(delta)
        for tokenizer_id, deltas in batches.items():
            if 0 <= tokenizer_id < len(self.tokenizers):
                self.tokenizers[tokenizer_id].put(m.DeltaBatch(deltas))

    def emit_prompt_progress(self) -> None:
        """The prompt progress of requests that asked for it (report_prompt_progress), each as a
        delta of no output straight to its tokenizer, which forwards it until the first output."""
        assert self.core is not None
        batches: dict[int, list[m.Delta]] = defaultdict(list)
        for req, processed in self.core.state.prompt_progress:
            progress = m.PromptProgress(req.num_prompt_tokens, req.num_cached_tokens, processed)
            delta = m.Delta(req.request_id, 0, 0, "", b"", prompt_progress=progress)
            batches[req.tokenizer_id].append(delta)
        self.core.state.prompt_progress.clear()
        for tokenizer_id, deltas in batches.items():
            if 0 <= tokenizer_id < len(self.tokenizers):
                self.tokenizers[tokenizer_id].put(m.DeltaBatch(deltas))

    # -- loop ----------------------------------------------------------------------------------

    def heartbeat(self) -> None:
        core = self.core
        # The load is made only when the heartbeat goes out, not at every step: its TTFT
        # percentile and the adapters read from the request lists were a sixth of the
        # scheduler's CPU a token at one stream.
        if self.control.seconds_until_due() == 0:
            has_work = self.pipeline is not None and bool(self.worker_pids) and self.pipeline.has_work
            load = m.StageLoad(
                num_running=core.num_running if core else 0,
                num_waiting=(core.num_waiting if core else 0) + len(self.early),
                kv_usage=core.kv_usage if core else 0.0,
                num_malformed=self.num_malformed,
                tokens_total=self.num_tokens,
                prefix_hit_rate=core.prefix_hit_rate if core else 0.0,
                ttft_p90_s=core.recent_ttft_p90() if core else 0.0,
                **self.adapters_in_use(),
            )
            self.control.heartbeat(self.num_steps, has_work=has_work, load=load, force=True)
        if core is not None and self.pipeline is not None:
            self.metrics.update(
                core.queue_times,
                core.num_prefix_query_tokens,
                core.num_prefix_hit_tokens,
                self.pipeline.executed_steps,
                core.num_preemptions,
                core.state.finished_times,
            )
            lora = core.state.lora
            self.metrics.update_lora(self.adapters.num_loads, lora.num_swaps, lora.num_prefetches)
            if core.speculation is not None:
                spec = core.speculation
                self.metrics.update_speculation(
                    spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.acceptance_lengths
                )

    def idle_poll_ms(self) -> int:
        """How long the loop may wait on its sockets when no step ran."""
        if self.core is not None and self.core.num_compiling:
            return COMPILE_POLL_MS
        if (self.pipeline is not None and self.pipeline.has_work) or self.adapters.has_pending:
            return BLOCKED_POLL_MS
        # Nothing to do: every input (requests, hellos, commands) wakes the poll, so only the next
        # heartbeat bounds it; waking 20 times a second for nothing took CPU from the workers.
        return max(1, math.ceil(self.control.seconds_until_due() * 1000))

    def start(self) -> None:
        self.log.info("waiting for %d worker(s)", self.world_size)

    def step(self) -> None:
        self.drain_inbox()
        self.poll_grammars()
        self.accept_hellos()
        if self.adapters.has_pending:
            self.adapters.poll()
        outputs = None
        if self.worker_pids and self.pipeline is not None and self.pipeline.has_work:
            try:
                outputs = self.pipeline.advance()
            except WorkerLost as exc:
                self.on_worker_lost(str(exc), is_late=isinstance(exc, StepTooLate))
        if self.core is not None and self.core.state.prompt_progress:
            self.emit_prompt_progress()
        if outputs is None:
            self.poller.poll(self.idle_poll_ms())
        else:
            self.num_steps += 1
            self.num_late_steps = 0
            self.emit(outputs)

    def on_command(self, command: m.ControlDown) -> None:
        if isinstance(command, m.Reconfigure):
            self.reconfigure(command)
        elif isinstance(command, m.TopologyChanged):
            self.on_topology(command.topology)

    def drain(self) -> str:
        planned_ahead = self.pipeline.num_planned_ahead if self.pipeline else 0
        return f" after {self.num_steps} steps, {planned_ahead} planned ahead"


def proposer(config: SpeculativeConfig) -> Proposer | None:
    """What proposes tokens for verification under the config's `speculative` section, if anything."""
    if config.method == "none":
        return None
    if config.method == "draft_model":
        return DraftModelProposer(config.num_speculative_tokens)
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)


def prompt_logprobs(request: Request) -> m.PromptLogprobs | None:
    """The request's prompt logprobs for the wire, once it has them all (its first token)."""
    scores = request.prompt_scores
    if scores is None or not scores.is_complete:
        return None
    return m.PromptLogprobs(
        token_ids=m.pack_ids(request.prompt_ids),
        logprobs=np.array([np.nan, *scores.logprobs], "<f4").tobytes(),
        ranks=np.array([0, *scores.ranks], "<i4").tobytes(),
        top_logprobs=[{}, *scores.top_logprobs],
    )


def detokenizer_messages(
    outputs: StepOutputs, needs_full_history: dict[str, Request], num_shards: int
) -> dict[int, list[m.TokenBatch | m.StepTokens]]:
    """A step's outputs as messages per detokenizer shard: its new tokens as one StepTokens
    each. A request in `needs_full_history` (taken out of it) gets its whole history and params
    in a TokenBatch instead."""
    if not len(outputs):
        return {}
    # Requests wait in needs_full_history until their first token, so it is rarely empty under
    # load; one set intersection finds the few that are in this step.
    resumed = needs_full_history.keys() & outputs.request_ids if needs_full_history else ()
    failed = {failure.request_id for failure in outputs.failures}
    if num_shards == 1 and not resumed and not failed:  # the hot path: no per-request Python
        return {0: [outputs.step_tokens()]}
    entries: dict[int, list[int]] = defaultdict(list)
    # A resumed request's entries of the step (a verification gives it several): its whole
    # history goes once, with what its last entry says (finish reason) and the logprobs of every
    # entry: the receivers have none of this step's tokens (on its first step, none at all).
    newest_entries: dict[str, list[int]] = {}
    for j, request_id in enumerate(outputs.request_ids):
        if request_id in failed:  # its token broke (or never got) its grammar's checks
            continue
        if request_id in resumed:
            newest_entries.setdefault(request_id, []).append(j)
        else:
            entries[shard_of(request_id, num_shards) if num_shards > 1 else 0].append(j)
    full: dict[int, list[m.TokenUpdate]] = defaultdict(list)
    for request_id, js in newest_entries.items():
        request = needs_full_history.pop(request_id)
        newest = (
            [float(outputs.logprobs[j]) for j in js],
            [top for j in js for top in outputs.top_logprobs[j]],
        )
        shard = shard_of(request_id, num_shards) if num_shards > 1 else 0
        full[shard].append(SchedulerProcess.full_history(request, outputs.finish_reasons[js[-1]], newest))
    messages: dict[int, list[m.TokenBatch | m.StepTokens]] = defaultdict(list)
    for shard, updates in full.items():
        messages[shard].append(m.TokenBatch(updates))
    for shard, picked in entries.items():
        messages[shard].append(outputs.step_tokens(picked))
    return messages


if __name__ == "__main__":
    SchedulerProcess().run()
