"""Which cores each process of a CPU run uses (engine.cpu_affinity).

A CPU worker runs each step on all of its threads, so a step is as slow as its slowest thread:
when a tokenizer, scheduler, detokenizer or gateway wakes up for a token and takes the core of
the worker's main thread (the one that also runs the step's Python), the whole step waits. So on
a CPU host where every worker has cores of its own, each worker's OpenMP threads are bound one per
core (OMP_PLACES, set before the worker starts: libgomp reads it at load), and the other stages
keep off the cores of the workers' main threads. They still share the workers' other cores, whose
threads only wait at a barrier while the main thread runs Python.
"""

from __future__ import annotations

import os

from ipc.config import Config, EngineConfig

# The run's cores (the supervisor's affinity mask), handed to a local worker: libgomp binds the
# worker's main thread to one core as it loads, so its own mask no longer tells.
RUN_CORES_ENV = "BRIGADE_RUN_CORES"
# Set by the user, these bind the workers' OpenMP threads their way, and engine.cpu_affinity yields.
OMP_BINDING_ENV = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY")


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, which the stages inherit)."""
    return sorted(os.sched_getaffinity(0))


def run_cores() -> list[int]:
    """The run's cores, as a worker sees them: RUN_CORES_ENV where the supervisor set it."""
    given = os.environ.get(RUN_CORES_ENV)
    return [int(core) for core in given.split(",")] if given else usable_cores()


def worker_threads(engine: EngineConfig, num_cores: int) -> int:
    """Threads per worker: engine.threads, or the cores shared out among the workers."""
    return engine.threads or max(1, num_cores // (engine.data_parallel * engine.tensor_parallel))


def worker_cores(engine: EngineConfig, cores: list[int]) -> list[list[int]] | None:
    """The cores of each worker (index group * tensor_parallel + rank), consecutive, one per
    thread; None where they are not pinned: a GPU run, engine.cpu_affinity off, or more threads
    than cores."""
    if engine.device != "cpu" or not engine.cpu_affinity:
        return None
    threads = worker_threads(engine, len(cores))
    num_workers = engine.data_parallel * engine.tensor_parallel
    if num_workers * threads > len(cores):
        return None
    return [cores[w * threads : (w + 1) * threads] for w in range(num_workers)]


def worker_env(engine: EngineConfig, group: int, rank: int, cores: list[int]) -> dict[str, str]:
    """What a local worker's environment adds: the run's cores, and the OpenMP binding of its
    threads where they are pinned and the user's environment binds none."""
    env = {RUN_CORES_ENV: ",".join(map(str, cores))}
    layout = worker_cores(engine, cores)
    if layout is None or any(name in os.environ for name in OMP_BINDING_ENV):
        return env
    places = ",".join(f"{{{core}}}" for core in layout[group * engine.tensor_parallel + rank])
    return env | {"OMP_PLACES": places, "OMP_PROC_BIND": "close"}


def light_stage_cores(config: Config, cores: list[int]) -> list[int] | None:
    """The cores of the stages other than the workers: all but the workers' main threads' cores;
    None (no pinning) on Ray, where stages run on other hosts, or where no core would be left."""
    if config.cluster.backend != "local":
        return None
    layout = worker_cores(config.engine, cores)
    if layout is None:
        return None
    main_cores = {worker[0] for worker in layout}
    rest = [core for core in cores if core not in main_cores]
    return rest or None


def pin_process(cores: list[int]) -> None:
    """Move every thread of this process onto `cores` (threads started later inherit it)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:  # a thread that just ended
            continue
