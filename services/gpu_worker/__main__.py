"""GPU worker process: join the group's tensor-parallel process group (tensor_parallel > 1), load
the model (this rank's shard), say hello to the scheduler, then execute step plans read from the
step ring (zero-copy views) and write results to the result ring (rank 0)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import zmq

from ipc import messages as m
from ipc.codec import RESULT_HEADER, STEP_HEADER, WORKER_HELLO, MalformedMessage
from ipc.endpoints import DIST_PORT_ENV
from ipc.shm import RingTimeout, ShmRing
from ipc.sockets import DealerSocket, close_context
from ipc.step_plan import STEP_RESULT
from services.cpu_cores import run_cores, worker_threads
from services.gpu_worker.memory import MemoryMonitor
from services.gpu_worker.model_runner import InvalidPlan, ModelRunner
from services.gpu_worker.parallel import init_parallel
from services.stage import ControlChannel, install_stop_handler, parse_stage_args

READ_TIMEOUT_S = 0.5
HELLO_RETRY_S = 2.0
# A collective waits this long for the slowest rank: loading skew at start, and rank 0 blocked on
# a full result ring for up to step_timeout_s while the others wait in the next step.
MIN_COLLECTIVE_TIMEOUT_S = 300.0


def main() -> None:
    stage, args = parse_stage_args("gpu_worker")
    stopping = install_stop_handler()
    config, group, rank = stage.config, stage.index, args.rank
    engine = config.engine
    parallel = init_parallel(
        rank,
        engine.tensor_parallel,
        stage.endpoints.dist_host(group),
        int(os.environ.get(DIST_PORT_ENV, "0")),
        torch.device(engine.device),
        max(MIN_COLLECTIVE_TIMEOUT_S, 2 * engine.step_timeout_s),
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
    )
    stage.log.info(
        "model %s loaded: dtype=%s device=%s kv_blocks=%d (block_size=%d)",
        runner.model_name,
        runner.dtype,
        runner.device,
        runner.num_kv_blocks,
        runner.block_size,
    )
    ctx = zmq.Context()
    control = ControlChannel(ctx, stage)
    memory = MemoryMonitor(runner.device, config.supervisor.heartbeat_interval_s)
    scheduler = DealerSocket(
        ctx,
        stage.endpoints.scheduler_workers(group),
        WORKER_HELLO,
        WORKER_HELLO,
        identity=f"rank-{rank}".encode(),
    )
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
    )
    control.ready(kv_blocks=str(runner.num_kv_blocks), device=str(runner.device), dtype=hello.dtype)
    # The scheduler echoes the hello once it has reset the rings for us; only then do we read.
    while not stopping[0]:
        scheduler.send(hello)
        try:
            if scheduler.recv(HELLO_RETRY_S) is not None:
                break
        except MalformedMessage:
            continue
        control.heartbeat(0, has_work=False)
    step_ring = ShmRing.attach(stage.endpoints.step_ring(group))
    result_ring = ShmRing.attach(stage.endpoints.result_ring(group)) if rank == 0 else None
    stage.log.info("serving steps")
    num_steps = 0
    while not stopping[0]:
        control.heartbeat(num_steps, has_work=False, load=memory.load())
        try:
            with step_ring.read(rank, READ_TIMEOUT_S) as view:
                header = STEP_HEADER.decode(view.header)
                started = time.perf_counter()
                try:
                    results, error = runner.execute(view.arrays, header), ""
                except InvalidPlan as exc:
                    results, error = {}, str(exc)
                    stage.log.error("step %d refused: %s", header.step_id, error)
                execute_s = time.perf_counter() - started
                if result_ring is not None:
                    with result_ring.reserve(engine.step_timeout_s) as slot:
                        if not error:
                            STEP_RESULT.write(slot, results)
                        result = m.ResultHeader(header.step_id, header.num_seqs, error, execute_s)
                        slot.publish(RESULT_HEADER.encode(result))
        except RingTimeout:
            continue
        num_steps += 1
    stage.log.info("stopping")
    close_context(ctx, 0)


if __name__ == "__main__":
    main()
