"""The scheduler gives back the KV blocks that fall wholly behind every layer's sliding window:
the block accounting as a decode moves on, with prefix caching and preemption, against the fake
worker of tests/test_scheduler_core.py (which checks every read within the window is the
sequence's own token) and the reference outputs computed there independently of the scheduler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.scheduler.core import Scheduler, SchedulerConfig
from services.scheduler.pipeline import StepPipeline
from tests.test_scheduler_core import (
    EOS,
    FakeExecutor,
    assert_no_leaks,
    make_request,
    reference_outputs,
    refuse_nothing,
    scheduler_config,
    tokens_of,
)

BS = 4
WINDOW = 6
MAX_MODEL_LEN = 96


def config(**overrides: object) -> SchedulerConfig:
    base = dict(
        max_num_seqs=4, max_num_batched_tokens=64, block_size=BS, num_blocks=MAX_MODEL_LEN // BS,
        max_model_len=MAX_MODEL_LEN, max_num_waiting=8, eos_token_ids=(EOS,), sliding_window=WINDOW,
    )  # fmt: skip
    base.update(overrides)
    return scheduler_config(**base)


def run(
    sched: Scheduler, requests: list, overlap: bool, on_step=None, executor: FakeExecutor | None = None
) -> dict[str, list[int]]:
    """Every request to its end; `executor` (the simulated KV cache) defaults to a fresh one."""
    for req in requests:
        assert sched.add(req) is None
    executor = executor or FakeExecutor(sched)
    pipeline = StepPipeline(sched, executor, on_failed=refuse_nothing, overlap=overlap)
    outputs: dict[str, list] = {}
    for _ in range(2000):
        if not pipeline.has_work:
            break
        for out in pipeline.advance() or []:
            outputs.setdefault(out.request_id, []).append(out)
        if on_step is not None:
            on_step()
    assert not pipeline.has_work
    return {rid: tokens_of(outs) for rid, outs in outputs.items()}


def held_blocks(sched: Scheduler, rid: str) -> int:
    req = sched.requests.get(rid)
    return 0 if req is None else len(req.block_ids) - req.num_released_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decode_holds_only_the_blocks_its_window_reads(overlap: bool) -> None:
    sched = Scheduler(config())
    prompt = list(range(1, 11))
    req = make_request("a", prompt, max_tokens=70, ignore_eos=True)
    most = [0]

    def check() -> None:
        if "a" in sched.requests and sched.requests["a"].status.name == "RUNNING":
            most[0] = max(most[0], held_blocks(sched, "a"))
            assert sched.blocks.num_used == held_blocks(sched, "a")

    got = run(sched, [req], overlap, check)
    assert got["a"] == reference_outputs(prompt, [], req.params, MAX_MODEL_LEN)
    # The window's keys span at most ceil((WINDOW - 1) / BS) + 1 blocks, plus the block being
    # entered; 80 tokens without the window would hold 20.
    assert most[0] <= -(-(WINDOW - 1) // BS) + 2
    assert_no_leaks(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_chunked_prefill_holds_only_the_blocks_its_window_reads(overlap: bool) -> None:
    """An 80-token prompt in chunks of 8: each chunk first gives back the blocks wholly behind
    its first query's window, so the pool stays nearly free all through the prefill."""
    chunk = 8
    sched = Scheduler(config(max_num_batched_tokens=chunk))
    prompt = [1 + (j * 7) % 30 for j in range(80)]
    req = make_request("a", prompt, max_tokens=4, ignore_eos=True)
    # A chunk's queries read back to WINDOW - 1 keys before its first: those blocks and the chunk's.
    bound = -(-(WINDOW - 1 + chunk) // BS) + 1
    most = [0]

    def check() -> None:
        if "a" in sched.requests and sched.requests["a"].status.name == "RUNNING":
            most[0] = max(most[0], held_blocks(sched, "a"))
            assert sched.blocks.num_used == held_blocks(sched, "a")
            assert sched.blocks.num_available >= sched.blocks.num_blocks - bound

    got = run(sched, [req], overlap, check)
    assert got["a"] == reference_outputs(prompt, [], req.params, MAX_MODEL_LEN)
    assert most[0] <= bound  # 80 tokens without the window would hold 20 blocks
    assert_no_leaks(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_long_prompt_prefills_beside_a_long_decode_only_windowed(overlap: bool) -> None:
    """A 90-token prompt chunked by 8 beside a decode that grows to 90, in a pool of 24 blocks
    (96 tokens): the prompt alone holds 23 blocks unless its prefill gives back the blocks behind
    the window, so only then is nobody preempted; outputs are the reference's either way."""
    decode_prompt = list(range(1, 11))
    long_prompt = [2 + (j * 5) % 30 for j in range(90)]
    for window in (0, WINDOW):
        sched = Scheduler(config(sliding_window=window, max_num_batched_tokens=8))
        reqs = [
            make_request("decode", decode_prompt, max_tokens=80, ignore_eos=True, seed=1),
            make_request("prompt", long_prompt, max_tokens=4, ignore_eos=True, seed=2),
        ]
        got = run(sched, reqs, overlap)
        assert got["decode"] == reference_outputs(decode_prompt, [], reqs[0].params, MAX_MODEL_LEN)
        assert got["prompt"] == reference_outputs(long_prompt, [], reqs[1].params, MAX_MODEL_LEN)
        assert (sched.num_preemptions > 0) == (window == 0)
        assert_no_leaks(sched)


def test_without_a_window_every_block_stays() -> None:
    sched = Scheduler(config(sliding_window=0))
    req = make_request("a", list(range(1, 11)), max_tokens=70, ignore_eos=True)
    most = [0]
    got = run(sched, [req], False, lambda: most.__setitem__(0, max(most[0], held_blocks(sched, "a"))))
    assert got["a"] == reference_outputs(list(range(1, 11)), [], req.params, MAX_MODEL_LEN)
    assert most[0] == -(-79 // BS)  # every token but the last one has KV: 79 tokens, 20 blocks
    assert_no_leaks(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_long_decodes_fit_together_once_blocks_behind_the_window_are_freed(overlap: bool) -> None:
    """Four sequences of 90 tokens in a pool of 24 blocks (one sequence's worth): without the
    window they preempt each other, with it none is preempted; outputs are the reference's."""
    prompts = [[1 + (i * 3 + j) % 30 for j in range(10)] for i in range(4)]
    outputs = {}
    for window in (0, WINDOW):
        sched = Scheduler(config(sliding_window=window))
        reqs = [
            make_request(f"r{i}", p, max_tokens=80, ignore_eos=True, seed=i) for i, p in enumerate(prompts)
        ]
        outputs[window] = run(sched, reqs, overlap)
        for i, p in enumerate(prompts):
            assert outputs[window][f"r{i}"] == reference_outputs(p, [], reqs[i].params, MAX_MODEL_LEN)
        assert (sched.num_preemptions > 0) == (window == 0)
        assert_no_leaks(sched)


def test_preempted_windowed_sequences_recompute_the_same_outputs() -> None:
    """A pool too small even with the window (4 sequences holding 2-4 blocks each, 8 blocks):
    preemptions happen, and every output is still the reference's."""
    sched = Scheduler(config(max_model_len=32, num_blocks=8))
    prompts = [[2 + (i * 5 + j) % 30 for j in range(9)] for i in range(4)]
    reqs = [
        make_request(f"p{i}", p, max_tokens=22, ignore_eos=True, seed=10 + i) for i, p in enumerate(prompts)
    ]
    got = run(sched, reqs, False)
    for i, p in enumerate(prompts):
        assert got[f"p{i}"] == reference_outputs(p, [], reqs[i].params, 32)
    assert sched.num_preemptions > 0
    assert_no_leaks(sched)


def test_blocks_released_behind_the_window_serve_a_later_prefix_hit() -> None:
    """A generated block released behind the window joins the prefix cache first: a request
    whose prompt is the first one's prompt + outputs reuses it, and computes the right tokens."""
    sched = Scheduler(config())
    executor = FakeExecutor(sched)  # one KV cache for both requests
    prompt = list(range(1, 11))
    first = make_request("first", prompt, max_tokens=30, ignore_eos=True)
    got = run(sched, [first], False, executor=executor)
    history = prompt + got["first"]
    second = make_request("second", history[:36], max_tokens=8, ignore_eos=True, seed=3)
    again = run(sched, [second], False, executor=executor)
    assert again["second"] == reference_outputs(history[:36], [], second.params, MAX_MODEL_LEN)
    # The 8 leading full blocks of its 36 tokens (the last token is always computed); the
    # generated ones among them were released behind the first request's window while it ran.
    assert sched.num_prefix_hit_tokens == 32
    assert_no_leaks(sched)


# ---- a served Mistral against HF ---------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_chunked_prefill_freeing_blocks_behind_the_window_still_generates_hf_tokens(tmp_path) -> None:
    """A random Mistral (window 12) served in this process with chunks of 8, in a pool of 25
    blocks of 4 (100 tokens): a 90-token prompt prefills beside a growing decode, holding only
    the blocks its chunks' windows read, nobody is preempted, and every token and logprob is HF's."""
    from transformers import AutoModelForCausalLM

    from services.gpu_worker.model_runner import ModelRunner
    from tests.in_process_engine import check_against_hf, serve
    from tests.test_families import WINDOW as MISTRAL_WINDOW
    from tests.test_families import save_random_family_model

    path = save_random_family_model("mistral-sliding", tmp_path / "mistral")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BS)
    assert runner.sliding_window == MISTRAL_WINDOW
    chunk = 8
    bound = -(-(MISTRAL_WINDOW - 1 + chunk) // BS) + 1
    rng = np.random.default_rng(5)
    prompts = {"decode": rng.integers(3, 320, 12).tolist(), "prompt": rng.integers(3, 320, 90).tolist()}
    most = [0]

    def check(sched: Scheduler) -> None:
        most[0] = max(most[0], held_blocks(sched, "prompt"))

    sched, _, served = serve(
        runner, prompts, max_tokens={"decode": 40, "prompt": 6}, num_logprobs=3, on_step=check,
        max_num_batched_tokens=chunk, num_blocks=25, max_model_len=100,
    )  # fmt: skip
    for rid, prompt in prompts.items():
        check_against_hf(hf, prompt, served[rid], 3, 2e-4)
    assert most[0] <= bound  # 23 blocks without freeing behind the window
    assert sched.num_preemptions == 0
