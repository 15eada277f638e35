"""GPU worker process: join the group's tensor-parallel process group (tensor_parallel > 1), load
the model (this rank's shard), say hello to the scheduler, then execute step plans read from the
step ring (zero-copy views) and write results to the result ring (rank 0)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ipc import messages as m
from ipc.codec import RESULT_HEADER, STEP_HEADER, WORKER_INPUT, WORKER_OUTPUT, MalformedMessage
from ipc.endpoints import DIST_PORT_ENV
from ipc.shm import RingTimeout, ShmRing
from ipc.sockets import DealerSocket
from ipc.step_plan import STEP_RESULT
from services.common.pooling import embedding_of
from services.cpu_cores import run_cores, worker_threads
from services.encoder.server import EncoderServer
from services.gpu_worker.memory import MemoryMonitor
from services.gpu_worker.model_runner import InvalidPlan, ModelRunner
from services.gpu_worker.parallel import init_parallel
from services.stage import Stage, StageProcess

READ_TIMEOUT_S = 0.5
# With the encoder in this process, or an adapter being read, how long the loop waits for a step
# before it looks again: what an image may wait for an idle worker to start on it, or a load to
# be answered.
POLL_S = 0.005
HELLO_RETRY_S = 2.0
# A collective waits this long for the slowest rank: loading skew at start, and rank 0 blocked on
# a full result ring for up to step_timeout_s while the others wait in the next step.
MIN_COLLECTIVE_TIMEOUT_S = 300.0


class WorkerProcess(StageProcess):
    """One tensor-parallel rank of an engine group. Its loop is the step ring's, not a poll: it
    heartbeats, and reads its scheduler's adapter commands, between steps. With
    `encoder.in_worker`, rank 0 of engine group 0 also serves encoder 0 between its steps."""

    kind = "gpu_worker"
    encoder: EncoderServer | None = None

    def serve(self) -> None:
        runner = load_runner(self.stage, self.args.rank)
        if self.stage.config.encoder.in_worker and self.stage.index == 0 and self.args.rank == 0:
            self.encoder = EncoderServer(self.ctx, self.stage, 0)
            self.control.watch(self.encoder.socket)
            cache = self.encoder.core.cache
            self.log.info(
                "serving encoder 0 (a cache of %d pages of %d image tokens)", cache.num_pages, cache.page_rows
            )
        scheduler = DealerSocket(
            self.ctx,
            self.stage.endpoints.scheduler_workers(self.stage.index),
            WORKER_INPUT,
            WORKER_OUTPUT,
            identity=f"rank-{self.args.rank}".encode(),
        )
        if self.say_hello(runner, scheduler):
            self.serve_steps(runner, scheduler)

    def say_hello(self, runner: ModelRunner, scheduler: DealerSocket) -> bool:
        """Ready, then the hello to the scheduler until it echoes it: it has reset the rings for
        us, and only then do we read, with the LoRA adapters the echo lists in our slots. False if
        stopped first."""
        rank, engine = self.args.rank, self.stage.config.engine
        hello = m.WorkerHello(
            rank=rank,
            world_size=engine.tensor_parallel,
            pid=os.getpid(),
            model=runner.model_name,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
            num_kv_blocks=runner.num_kv_blocks,
            block_size=runner.block_size,
            vocab_size=runner.vocab_size,
            max_model_len=runner.max_model_len,
            eos_token_ids=list(runner.eos_token_ids),
            sliding_window=runner.sliding_window,
            long_rope_from=runner.long_rope_from,
            pooling=runner.embedding.pooling if runner.embedding else "",
            normalize=runner.embedding.normalize if runner.embedding else True,
        )
        encoder = (
            {
                "cache_pages": str(self.encoder.core.cache.num_pages),
                "cache_page_rows": str(self.encoder.core.cache.page_rows),
            }
            if self.encoder
            else {}
        )
        self.control.ready(
            kv_blocks=str(runner.num_kv_blocks), device=str(runner.device), dtype=hello.dtype, **encoder
        )
        while not self.stopping[0]:
            scheduler.send(hello)
            try:
                echo = scheduler.recv(HELLO_RETRY_S)
            except MalformedMessage:
                continue
            if isinstance(echo, m.WorkerHello):
                runner.sync_loras(echo.adapters)
                return True
            self.control.heartbeat(0, has_work=False)
        return False

    def on_scheduler(self, runner: ModelRunner, scheduler: DealerSocket) -> None:
        """The scheduler's adapter commands, between steps: they change the adapters in host
        memory, never a slot (only a step's header does). A load is read on a thread of its own
        while steps go on, and answered here once it is over, after the commands that came
        meanwhile (an unload of its name drops it unanswered)."""
        while True:
            try:
                command = scheduler.recv(0)
            except MalformedMessage as exc:
                self.num_malformed += 1
                self.log.warning("dropped a malformed scheduler message: %s", exc)
                continue
            if command is None:
                break
            if isinstance(command, m.LoadAdapter):
                runner.start_lora_load(command.adapter, command.load_id)
            elif isinstance(command, m.UnloadAdapter):
                runner.unload_lora(command.name)
        for name, load_id, error in runner.finished_lora_loads():
            scheduler.send(m.AdapterLoaded(self.args.rank, name, error, load_id))

    def serve_steps(self, runner: ModelRunner, scheduler: DealerSocket) -> None:
        stage, group, rank = self.stage, self.stage.index, self.args.rank
        step_timeout_s = stage.config.engine.step_timeout_s
        step_ring = ShmRing.attach(stage.endpoints.step_ring(group))
        result_ring = ShmRing.attach(stage.endpoints.result_ring(group)) if rank == 0 else None
        memory = MemoryMonitor(runner.device, stage.config.supervisor.heartbeat_interval_s)
        stopping, control, encoder = self.stopping, self.control, self.encoder
        self.log.info("serving steps")
        num_steps = 0
        while not stopping[0]:
            control.heartbeat(num_steps, has_work=False, load=memory.load())
            self.on_scheduler(runner, scheduler)
            if encoder is not None:
                # Every request that came, before the next step: their encodes delay it, as a
                # vision tower run in the model's step on the images scheduled into it would.
                encoder.receive(0.0)
                while encoder.queue:
                    encoder.serve_one()
            try:
                polls = encoder is not None or runner.lora_reads
                with step_ring.read(rank, POLL_S if polls else READ_TIMEOUT_S) as view:
                    header = STEP_HEADER.decode(view.header)
                    started = time.perf_counter()
                    try:
                        results, error = runner.execute(view.arrays, header), ""
                    except InvalidPlan as exc:
                        results, error = {}, str(exc)
                        self.log.error("step %d refused: %s", header.step_id, error)
                    execute_s = time.perf_counter() - started
                    if result_ring is not None:
                        with result_ring.reserve(step_timeout_s) as slot:
                            if not error:
                                STEP_RESULT.write(slot, results)
                            result = m.ResultHeader(header.step_id, header.num_seqs, error, execute_s)
                            slot.publish(RESULT_HEADER.encode(result))
            except RingTimeout:
                continue
            num_steps += 1

    def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
        super().close()


def load_runner(stage: Stage, rank: int) -> ModelRunner:
    """Join the group's tensor-parallel process group, and load this rank's shard of the model."""
    config, engine = stage.config, stage.config.engine
    parallel = init_parallel(
        rank,
        engine.tensor_parallel,
        stage.endpoints.dist_host(stage.index),
        int(os.environ.get(DIST_PORT_ENV, "0")),
        torch.device(engine.device),
        max(MIN_COLLECTIVE_TIMEOUT_S, 2 * engine.step_timeout_s),
        engine.expert_parallel,
    )
    runner = ModelRunner(
        Path(stage.info.model_dir),
        dtype=config.model.dtype,
        device=engine.device,
        kv_cache_bytes=engine.kv_cache_mib << 20,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        block_size=engine.block_size,
        # Workers on one CPU host share its cores rather than each spinning on all of them.
        threads=worker_threads(engine, len(run_cores())),
        parallel=parallel,
        max_num_seqs=engine.max_num_seqs,  # plan-table rows, for placeholders
        int8_activations=engine.cpu_int8_activations,
        max_loras=config.lora.num_slots,  # lora.max_loras, and the spare slot where adapters outnumber them
        max_lora_rank=config.lora.max_rank,
        lora_dtype=config.lora.dtype,
        lora_adapters=config.lora.adapters,
        wide_step_dtype=engine.cpu_wide_step_dtype,
        kv_cache_dtype=engine.kv_cache_dtype,
        embedding=embedding_of(config.model, Path(stage.info.model_dir)),
        embedding_caches=stage.endpoints.embedding_cache if config.encoder.num_encoders else None,
        draft_model=Path(config.speculative.model) if config.speculative.method == "draft_model" else None,
        max_model_len=config.model.max_model_len,
        cuda_graph_max_batch=engine.cuda_graph_max_batch,
        num_speculative_tokens=(
            0 if config.speculative.method == "none" else config.speculative.num_speculative_tokens
        ),
    )
    stage.log.info(
        "model %s loaded: dtype=%s device=%s kv_blocks=%d (block_size=%d, %s)",
        runner.model_name,
        runner.dtype,
        runner.device,
        runner.num_kv_blocks,
        runner.block_size,
        runner.kv_dtype,
    )
    return runner


if __name__ == "__main__":
    WorkerProcess().run()
