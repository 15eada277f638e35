"""engine.cpu_affinity: on a CPU host each worker's OpenMP threads are bound one per core, and the
other stages keep off the cores of the workers' main threads (services/cpu_cores.py). The layout
is checked as a function, then on a real run through each process's threads' affinity masks."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from client import Client
from ipc.config import ClusterConfig, Config, EngineConfig
from services import cpu_cores
from tests.harness import assert_clean, brigade_run


def engine(**fields: object) -> EngineConfig:
    return EngineConfig(**fields)  # type: ignore[arg-type]


def test_workers_get_consecutive_cores_one_per_thread() -> None:
    cores = [2, 3, 5, 7, 8, 9]
    assert cpu_cores.worker_cores(engine(), cores) == [cores]
    assert cpu_cores.worker_cores(engine(data_parallel=2), cores) == [[2, 3, 5], [7, 8, 9]]
    assert cpu_cores.worker_cores(engine(data_parallel=2, tensor_parallel=2, threads=1), cores) == [
        [2], [3], [5], [7]
    ]  # fmt: skip
    assert cpu_cores.worker_cores(engine(threads=4), cores) == [[2, 3, 5, 7]]


def test_no_pinning_on_a_gpu_when_turned_off_or_with_more_threads_than_cores() -> None:
    cores = [0, 1]
    assert cpu_cores.worker_cores(engine(device="cuda"), cores) is None
    assert cpu_cores.worker_cores(engine(cpu_affinity=False), cores) is None
    assert cpu_cores.worker_cores(engine(threads=3), cores) is None
    assert cpu_cores.worker_cores(engine(data_parallel=3), cores) is None  # 3 workers of 1 thread
    assert cpu_cores.worker_env(engine(cpu_affinity=False), 0, 0, cores) == {cpu_cores.RUN_CORES_ENV: "0,1"}


def test_light_stages_avoid_the_workers_main_cores() -> None:
    cores = [0, 1, 2, 3]
    assert cpu_cores.light_stage_cores(Config(), cores) == [1, 2, 3]
    assert cpu_cores.light_stage_cores(Config(engine=engine(data_parallel=2)), cores) == [1, 3]
    # Every core runs a worker's main thread: nothing is left to keep the others on.
    assert cpu_cores.light_stage_cores(Config(engine=engine(data_parallel=4)), cores) is None
    assert cpu_cores.light_stage_cores(Config(cluster=ClusterConfig(backend="ray")), cores) is None
    assert cpu_cores.light_stage_cores(Config(engine=engine(cpu_affinity=False)), cores) is None


def test_worker_env_binds_its_own_cores_unless_the_user_binds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in cpu_cores.OMP_BINDING_ENV:
        monkeypatch.delenv(name, raising=False)
    env = cpu_cores.worker_env(engine(data_parallel=2, tensor_parallel=1), 1, 0, [4, 5, 6, 7])
    assert env == {cpu_cores.RUN_CORES_ENV: "4,5,6,7", "OMP_PLACES": "{6},{7}", "OMP_PROC_BIND": "close"}
    monkeypatch.setenv("OMP_PROC_BIND", "spread")
    assert cpu_cores.worker_env(engine(), 0, 0, [4, 5]) == {cpu_cores.RUN_CORES_ENV: "4,5"}
    monkeypatch.setenv(cpu_cores.RUN_CORES_ENV, "4,5")
    assert cpu_cores.run_cores() == [4, 5]


def thread_masks(pid: int) -> dict[int, set[int]]:
    """Each thread of `pid` and the cores it may run on."""
    masks = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            masks[int(task)] = os.sched_getaffinity(int(task))
    return masks


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("affinity", [True, False])
def test_a_run_pins_the_worker_threads_and_keeps_the_other_stages_off_its_main_core(
    tmp_path: Path, tiny_model_dir: Path, affinity: bool
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    overrides = (
        f"model.path={tiny_model_dir}", "model.dtype=float32", "model.max_model_len=256",
        "engine.kv_cache_mib=64", "engine.threads=2", f"engine.cpu_affinity={str(affinity).lower()}",
        "supervisor.metrics_port=0",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, *overrides) as run:
        with Client(run_dir) as client:  # a step, so that the worker's OpenMP threads exist
            assert client.generate("hello", max_tokens=4, temperature=0.0, ignore_eos=True, timeout=120).text
        rows = {row["name"]: row for row in run.status()}
        worker = thread_masks(rows["gpu_worker-0-0"]["pid"])
        others = {name: thread_masks(row["pid"]) for name, row in rows.items() if row["kind"] != "gpu_worker"}
    assert run.process.returncode == 0
    assert_clean(run_dir)
    main_pid = rows["gpu_worker-0-0"]["pid"]
    if affinity:
        assert worker[main_pid] == {cores[0]}, worker
        assert {cores[1]} in worker.values(), worker  # the second OpenMP thread, on the next core
        for name, masks in others.items():
            assert all(mask == set(cores[1:]) for mask in masks.values()), (name, masks)
    else:
        assert all(mask == set(cores) for mask in worker.values()), worker
        for name, masks in others.items():
            assert all(mask == set(cores) for mask in masks.values()), (name, masks)
