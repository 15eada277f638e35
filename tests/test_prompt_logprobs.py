"""Prompt logprobs (SamplingParams.prompt_logprobs) from the scheduler and a real ModelRunner on
the embedded SmolLM2, through the real step pipeline, against HF transformers float32 on the same
weights: a short prompt, a prompt over several prefill chunks, and a prompt whose prefix is in
the prefix cache (which a request asking for prompt logprobs does not reuse)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from client.sdk import RequestState
from ipc import messages as m
from services.gpu_worker.model_runner import ModelRunner
from services.scheduler.core import Scheduler
from services.scheduler.pipeline import StepPipeline
from services.scheduler.request import PromptScores, Request
from services.tokenizer.core import trim_delta
from tests.in_process_engine import RunnerExecutor
from tests.test_scheduler_core import assert_no_leaks, make_request, refuse_nothing, scheduler_config

pytestmark = pytest.mark.timeout(600)

ATOL = 1e-3
TOP_N = 3
BLOCK_SIZE = 16
CHUNK = 24  # max_num_batched_tokens: a longer prompt is prefilled over several steps
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def engine(smollm2_dir, smollm2_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runner = ModelRunner(
        smollm2_dir, dtype="float32", kv_cache_bytes=32 << 20, block_size=BLOCK_SIZE, threads=2
    )
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    return runner, hf, AutoTokenizer.from_pretrained(smollm2_dir)


def scheduler(runner: ModelRunner) -> tuple[Scheduler, StepPipeline]:
    sched = Scheduler(
        scheduler_config(
            max_num_seqs=4,
            max_num_batched_tokens=CHUNK,
            block_size=BLOCK_SIZE,
            num_blocks=runner.num_kv_blocks,
            max_model_len=MAX_MODEL_LEN,
        )
    )
    return sched, StepPipeline(sched, RunnerExecutor(runner, BLOCK_SIZE), on_failed=refuse_nothing)


def run(sched: Scheduler, pipeline: StepPipeline, requests: list[Request]) -> None:
    """The requests, added at once, to their end."""
    for req in requests:
        assert sched.add(req) is None
    for _ in range(1000):
        if not pipeline.has_work:
            break
        pipeline.advance()
    assert not pipeline.has_work


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """HF's log-softmax at every prompt position but the last: row i predicts prompt token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def check_against_hf(hf, req: Request) -> None:
    prompt = req.prompt_ids.tolist()
    scores = req.prompt_scores
    assert scores is not None and scores.is_complete, f"{req.request_id}: prompt logprobs incomplete"
    expected = hf_prompt_logprobs(hf, prompt)
    targets = torch.tensor(prompt[1:])
    want = expected[torch.arange(len(targets)), targets]
    np.testing.assert_allclose(scores.logprobs, want.numpy(), atol=ATOL, err_msg=req.request_id)
    want_ranks = (expected > want[:, None]).sum(dim=-1) + 1
    # A rank may differ only where another token's logprob ties the target's within the tolerance.
    for j, (rank, want_rank) in enumerate(zip(scores.ranks, want_ranks.tolist(), strict=True)):
        if rank != want_rank:
            near = (expected[j] - want[j]).abs() < ATOL
            assert abs(rank - want_rank) <= int(near.sum()), f"{req.request_id}: rank of token {j + 1}"
    top = expected.topk(TOP_N, dim=-1)
    for j, tops in enumerate(scores.top_logprobs):
        assert sorted(tops) == sorted(top.indices[j].tolist()), f"{req.request_id}: top ids of token {j + 1}"
        for t, lp in tops.items():
            assert abs(lp - float(expected[j, t])) < ATOL


def test_prompt_logprobs_match_hf_short_chunked_and_past_the_prefix_cache(engine) -> None:
    runner, hf, tokenizer = engine
    short = tokenizer("The capital of France is").input_ids
    text = "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 3
    long = tokenizer(text).input_ids
    assert len(long) > 2 * CHUNK
    reqs = [
        make_request("short", short, temperature=0.0, max_tokens=2, prompt_logprobs=TOP_N),
        make_request("long", long, temperature=0.0, max_tokens=2, prompt_logprobs=TOP_N),
    ]
    sched, pipeline = scheduler(runner)
    run(sched, pipeline, reqs)
    for req in reqs:
        check_against_hf(hf, req)

    # The same prefix twice: the second request's prompt blocks are in the prefix cache, which a
    # request without prompt logprobs reuses and one with them does not.
    warm = make_request("warm", long, temperature=0.0, max_tokens=1)
    again = make_request("again", long + short, temperature=0.0, max_tokens=1, prompt_logprobs=TOP_N)
    reused = make_request("reused", long + short, temperature=0.0, max_tokens=1)
    for req in (warm, again, reused):  # one after the other: each finds the one before cached
        run(sched, pipeline, [req])
    assert again.num_cached_tokens == 0
    assert reused.num_cached_tokens >= BLOCK_SIZE, "the cache held the prefix"
    check_against_hf(hf, again)
    assert_no_leaks(sched)


def test_prompt_logprobs_reach_a_receiver_once() -> None:
    """Invariant 2 for prompt logprobs: the scheduler keeps each position once however often a
    chunk is computed, and they travel with output token 0, so a receiver that has it (a
    resubmission's whole-history delta, a delta delivered twice) does not take them again."""
    scores = PromptScores(num_prompt_tokens=5)
    scores.add(1, [-1.0, -2.0], [1, 2], [{7: -1.0}, {8: -0.5}])
    scores.add(1, [-9.0, -9.0, -3.0], [9, 9, 3], [{}, {}, {9: -0.1}])  # the chunk again, and more
    assert (scores.logprobs, scores.ranks, scores.is_complete) == ([-1.0, -2.0, -3.0], [1, 2, 3], False)
    with pytest.raises(ValueError, match="from token 6"):
        scores.add(6, [-1.0], [1], [{}])

    prompt = m.PromptLogprobs(
        m.pack_ids([3, 4]), np.array([np.nan, -0.5], "<f4").tobytes(), m.pack_ids([0, 2]), [{}, {4: -0.5}]
    )
    first = m.Delta("r", 0, 0, "ab", m.pack_ids([5, 6]), prompt_logprobs=prompt)
    assert trim_delta(first, 0, 0) is first
    again = trim_delta(first, 1, 1)  # the client has token 0: the rest, without them
    assert again is not None and again.token_index == 1 and again.prompt_logprobs is None

    state = RequestState(m.Generate("r", prompt="x"), None, 0.0)
    state.apply(first)
    state.apply(first)
    resent = msgspec.structs.replace(first, text="abc", token_ids=m.pack_ids([5, 6, 7]), finish_reason="stop")
    state.apply(resent)  # a resubmission's whole history, past what the client has
    deltas = list(state.ready)
    assert [d.prompt_logprobs is not None for d in deltas] == [True, False]
    assert state.result().prompt_logprobs.values() == [None, -0.5]
