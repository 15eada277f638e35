"""Scaling with real processes on the CPU (gloo): data parallel groups with tokenizer and detokenizer
replicas, and tensor parallel ranks, give the same greedy outputs as one worker; a SIGKILLed rank
restarts its whole group and no request is lost or changed."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from client import Client
from tests.harness import Run, assert_clean, brigade_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_PROMPTS = 8
SHORT_TOKENS = 16
FAULT_TOKENS = 96  # long enough that every stream is still running when a rank is killed
COMMON = ("model.dtype=float32", "model.max_model_len=512", "engine.kv_cache_mib=64", "engine.threads=1",
          "supervisor.backoff_initial_s=0.1")  # fmt: skip
DATA_PARALLEL = ("engine.data_parallel=2", "tokenizer.replicas=2", "detokenizer.replicas=2")
TENSOR_PARALLEL = ("engine.tensor_parallel=2",)

Output = tuple[str, list[int]]


def outputs(run_dir: Path, max_tokens: int, during: Callable[[], None] | None = None) -> list[Output]:
    """NUM_PROMPTS greedy streams at once, each assembled as (text, ids); `during()` runs once
    every stream has produced its first output, and must run while all are still in flight."""
    results: list[Output | None] = [None] * NUM_PROMPTS
    finished_before_during: list[int] = []
    started = threading.Barrier(NUM_PROMPTS + 1)

    def one(i: int) -> None:
        with Client(run_dir, failover_after=3.0, unavailable_after=120.0) as client:
            text, ids, is_first = [], [], True
            prompt = f"Item {i}: the quick brown fox"
            for delta in client.stream(
                prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=600
            ):
                text.append(delta.text)
                ids += delta.token_ids
                if is_first:
                    is_first = False
                    started.wait(300)
            results[i] = ("".join(text), ids)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(NUM_PROMPTS)]
    for t in threads:
        t.start()
    started.wait(300)
    if during is not None:
        during()
        finished_before_during.append(sum(r is not None for r in results))
    for t in threads:
        t.join(600)
    assert all(r is not None for r in results), "a request did not complete"
    assert all(len(r[1]) == max_tokens for r in results)  # type: ignore[index]
    assert finished_before_during in ([], [0]), f"{finished_before_during} streams had finished already"
    return results  # type: ignore[return-value]


def worker_names(run: Run) -> set[str]:
    return {row["name"] for row in run.status() if row["kind"] == "gpu_worker"}


@pytest.fixture(scope="module")
def tiny_args(tiny_model_dir: Path) -> tuple[str, ...]:
    return (f"model.path={tiny_model_dir}", *COMMON)


@pytest.fixture(scope="module")
def tiny_single(
    tmp_path_factory: pytest.TempPathFactory, tiny_args: tuple[str, ...]
) -> dict[int, list[Output]]:
    """The reference: one group, one worker."""
    run_dir = tmp_path_factory.mktemp("tiny-single")
    with brigade_run(run_dir, *tiny_args) as run:
        want = {n: outputs(run.run_dir, n) for n in (SHORT_TOKENS, FAULT_TOKENS)}
    assert_clean(run_dir)
    return want


@pytest.fixture(scope="module")
def smollm2_single(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> list[Output]:
    run_dir = tmp_path_factory.mktemp("smollm2-single")
    with brigade_run(run_dir, *COMMON) as run:
        want = outputs(run.run_dir, SHORT_TOKENS)
    assert_clean(run_dir)
    return want


def test_tiny_data_parallel(tmp_path: Path, tiny_args, tiny_single) -> None:
    with brigade_run(tmp_path, *tiny_args, *DATA_PARALLEL) as run:
        assert worker_names(run) == {"gpu_worker-0-0", "gpu_worker-1-0"}
        assert outputs(run.run_dir, SHORT_TOKENS) == tiny_single[SHORT_TOKENS]
    assert_clean(tmp_path)


@pytest.fixture(scope="module")
def tiny_tp_run(tmp_path_factory: pytest.TempPathFactory, tiny_args, tiny_single):
    run_dir = tmp_path_factory.mktemp("tiny-tp")
    with brigade_run(run_dir, *tiny_args, *TENSOR_PARALLEL) as run:
        yield run
    assert_clean(run_dir)


def test_tiny_tensor_parallel(tiny_tp_run: Run, tiny_single) -> None:
    assert worker_names(tiny_tp_run) == {"gpu_worker-0-0", "gpu_worker-0-1"}
    assert outputs(tiny_tp_run.run_dir, SHORT_TOKENS) == tiny_single[SHORT_TOKENS]


@pytest.mark.parametrize("rank", [1, 0])
def test_sigkill_one_rank_restarts_the_group(tiny_tp_run: Run, tiny_single, rank: int) -> None:
    run = tiny_tp_run
    before = {row["name"]: row for row in run.status()}
    victim = before[f"gpu_worker-0-{rank}"]["pid"]
    got = outputs(run.run_dir, FAULT_TOKENS, during=lambda: os.kill(victim, signal.SIGKILL))
    assert got == tiny_single[FAULT_TOKENS]
    run.wait_until_running(120)
    after = {row["name"]: row for row in run.status()}
    for r in range(2):
        name = f"gpu_worker-0-{r}"
        assert after[name]["restarts"] > before[name]["restarts"], f"{name} was not restarted with its group"
        assert after[name]["pid"] != before[name]["pid"]
    # The restarted group serves again, unchanged.
    assert outputs(run.run_dir, SHORT_TOKENS) == tiny_single[SHORT_TOKENS]


def test_smollm2_data_parallel(tmp_path: Path, smollm2_single) -> None:
    with brigade_run(tmp_path, *COMMON, *DATA_PARALLEL) as run:
        assert outputs(run.run_dir, SHORT_TOKENS) == smollm2_single
    assert_clean(tmp_path)


def test_smollm2_tensor_parallel(tmp_path: Path, smollm2_single) -> None:
    """SmolLM2's 3 KV heads split 2 + 1 over the two ranks."""
    with brigade_run(tmp_path, *COMMON, *TENSOR_PARALLEL) as run:
        assert worker_names(run) == {"gpu_worker-0-0", "gpu_worker-0-1"}
        assert outputs(run.run_dir, SHORT_TOKENS) == smollm2_single
    assert_clean(tmp_path)
