"""The scheduler core and a real ModelRunner in one process, through the real step pipeline: for
tests that check served tokens against HF where the scheduler's choices (chunks, prefix hits,
preemption, freed blocks) matter, without the processes and rings around them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ipc.messages import ResultHeader
from services.gpu_worker.model_runner import ModelRunner
from services.scheduler.core import Scheduler
from services.scheduler.pipeline import StepPipeline
from services.scheduler.plan import ScheduledStep, build_plan
from tests.test_scheduler_core import assert_no_leaks, make_request, refuse_nothing, scheduler_config

# Per request: its tokens, their logprobs and their top logprobs.
Served = tuple[list[int], list[float], list[dict[int, float]]]


class RunnerExecutor:
    """The step pipeline's executor over a ModelRunner: each published step runs at once (the
    worker runs steps in publication order, so this is exact)."""

    def __init__(self, runner: ModelRunner, block_size: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self.results: deque[tuple[ResultHeader, dict[str, np.ndarray]]] = deque()
        self.num_long_rope_steps = 0  # steps whose plan marked some row long (LongRoPE)

    def publish(self, step_id: int, step: ScheduledStep) -> None:
        header, arrays = build_plan(step, step_id, self.block_size)
        self.num_long_rope_steps += "long_rope" in arrays and bool(arrays["long_rope"].any())
        self.results.append((ResultHeader(step_id, step.num_seqs), self.runner.execute(arrays, header)))

    @contextmanager
    def result(self) -> Iterator[tuple[ResultHeader, dict[str, np.ndarray]]]:
        yield self.results.popleft()


def serve(
    runner: ModelRunner,
    prompts: dict[str, list[int]],
    max_tokens: int | dict[str, int],
    num_logprobs: int,
    overlap: bool = True,
    on_step: Callable[[Scheduler], None] | None = None,
    params: dict[str, dict[str, object]] | None = None,
    **config: int,
) -> tuple[Scheduler, RunnerExecutor, dict[str, Served]]:
    """Every prompt greedily to max_tokens (one for all, or by id), added at once, with more
    sampling parameters by id where `params` has some; `config` overrides the SchedulerConfig (by
    default: the runner's block size, pool, max_model_len, window, LongRoPE length, vocabulary)."""
    settings = dict(
        max_num_seqs=4, max_num_batched_tokens=256, block_size=runner.block_size,
        num_blocks=runner.num_kv_blocks, max_model_len=runner.max_model_len,
        sliding_window=runner.sliding_window, long_rope_from=runner.long_rope_from,
        vocab_size=runner.vocab_size,
    )  # fmt: skip
    sched = Scheduler(scheduler_config(**{**settings, **config}))
    for rid, prompt in prompts.items():
        limit = max_tokens if isinstance(max_tokens, int) else max_tokens[rid]
        more = (params or {}).get(rid, {})
        req = make_request(rid, prompt, temperature=0.0, max_tokens=limit, logprobs=num_logprobs, **more)
        assert sched.add(req) is None
    executor = RunnerExecutor(runner, runner.block_size)
    pipeline = StepPipeline(sched, executor, on_failed=refuse_nothing, overlap=overlap)
    outputs: dict[str, Served] = {}
    for _ in range(5000):
        if not pipeline.has_work:
            break
        for out in pipeline.advance() or []:
            tokens, logprobs, tops = outputs.setdefault(out.request_id, ([], [], []))
            assert out.start_index == len(tokens)
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs)
            tops.extend(out.top_logprobs)
        if on_step is not None:
            on_step(sched)
    assert not pipeline.has_work
    assert_no_leaks(sched)
    return sched, executor, outputs


def check_against_hf(hf, prompt: list[int], served: Served, num_logprobs: int, atol: float) -> None:
    """Each served token is HF's greedy one after the history so far (one HF forward over all of
    it, no HF cache), with HF's logprob and top `num_logprobs` logprobs within `atol`."""
    tokens, logprobs, tops = served
    history = list(prompt)
    for i, token in enumerate(tokens):
        with torch.inference_mode():
            expected = torch.log_softmax(hf(torch.tensor([history])).logits[0, -1].float(), dim=-1)
        assert token == int(expected.argmax()), f"token {i} (position {len(history)}) differs from HF"
        assert abs(logprobs[i] - float(expected[token])) < atol, f"token {i}: logprob"
        top_ids = expected.topk(num_logprobs).indices.tolist()
        assert sorted(tops[i]) == sorted(top_ids), f"token {i}: top ids"
        for t in top_ids:
            assert abs(tops[i][t] - float(expected[t])) < atol, f"token {i}: top logprob of {t}"
        history.append(token)
