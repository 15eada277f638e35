"""LongRoPE (Phi-3's `longrope` / `su` scaling) served up to max_position_embeddings, exactly as
HF transformers generates, in float32 on a tiny random Phi-3 whose original length is 32.

HF's rule (its generate, checked here first): a forward over a sequence longer than
original_max_position_embeddings rotates every position with the long factors, else the short
ones, and Phi-3's generate drops its KV cache at the step where the sequence passes that length.
So each step's logits are those of a full forward over the whole history (`hf_logits`). Brigade
keeps a sequence's KV in one regime: long from admission when it is longer than the original
length, short otherwise, and a short one that grows past it is recomputed in the long regime.

The scheduler and the model runner run in this process (`RunnerExecutor`), through the real
step pipeline: chunked prefill, prefix-cache hits within and across regimes, and preemption."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from services.gpu_worker.architectures import ModelConfig, UnsupportedModel
from services.gpu_worker.model_runner import InvalidPlan, ModelRunner
from services.scheduler.core import Scheduler
from services.scheduler.pipeline import StepPipeline
from tests import in_process_engine
from tests.conftest import save_random_model
from tests.in_process_engine import RunnerExecutor, Served
from tests.test_families import COMMON, _longrope_factors
from tests.test_model import PlanBuilder, runner_logits
from tests.test_scheduler_core import assert_no_leaks, make_request, refuse_nothing, scheduler_config

pytestmark = pytest.mark.timeout(600)

ORIGINAL = 32  # original_max_position_embeddings
MAX_POSITIONS = 128
BLOCK = 8
VOCAB = COMMON["vocab_size"]
TOP = 5  # top logprobs compared per sampled token
# A token's logprobs against HF's log_softmax (float32 on both sides; the paths sum in other orders).
ATOL = 2e-4


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    config = transformers.Phi3Config(
        **{**COMMON, "max_position_embeddings": MAX_POSITIONS},
        tie_word_embeddings=False,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": _longrope_factors(1), "long_factor": _longrope_factors(2),
        },
    )  # fmt: skip
    return save_random_model(
        config, tmp_path_factory.mktemp("phi3-longrope-32"), seed=3, std=0.08, embed_std=0.15
    )


@pytest.fixture(scope="module")
def hf(phi3_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        phi3_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def runner(phi3_dir: Path) -> ModelRunner:
    return ModelRunner(phi3_dir, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """HF's next-token logits after `ids`: one forward over all of them (HF's regime rule)."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def prompt_of(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    rng = np.random.default_rng(seed)
    head = list(prefix or [])
    return head + rng.integers(3, VOCAB, length - len(head)).tolist()


# ---- HF's own rule, which everything below builds on --------------------------------------------


def test_hf_generate_rotates_the_whole_context_long_once_past_the_original_length(hf) -> None:
    """HF generate's logits at every step are those of a full forward over the history, and not
    those of keeping the cached keys' short rotation past the original length."""
    for prompt_len in (25, 40):
        prompt = prompt_of(prompt_len, prompt_len)
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=14, do_sample=False, output_logits=True,
            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        ids = out.sequences[0].tolist()
        for i, logits in enumerate(out.logits):
            torch.testing.assert_close(
                logits[0].float(), hf_logits(hf, ids[: prompt_len + i]), atol=1e-5, rtol=1e-5
            )
    # The other reading (a cache that keeps each key's rotation) differs from the first long step on.
    prompt = prompt_of(25, 25)
    ids = hf.generate(
        torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    ids = ids[0].tolist()
    with torch.inference_mode():
        step = hf(torch.tensor([ids[:ORIGINAL]]), use_cache=True)
        kept = hf(
            torch.tensor([[ids[ORIGINAL]]]), cache=step.past_key_values, use_cache=True,
            position_ids=torch.tensor([[ORIGINAL]]),
        ).logits[0, -1]  # fmt: skip
    assert (kept - hf_logits(hf, ids[: ORIGINAL + 1])).abs().max() > 0.1


# ---- the worker: each row in its regime ---------------------------------------------------------


def test_the_worker_rotates_each_row_in_the_regime_its_plan_says(hf, runner: ModelRunner) -> None:
    assert runner.max_model_len == MAX_POSITIONS and runner.long_rope_from == ORIGINAL
    check_rows_in_regimes(hf, runner)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_the_triton_backend_rotates_each_row_in_its_regime(hf, phi3_dir: Path) -> None:
    """The CUDA path's wiring (rotary_triton over the two-regime table), kernels in the interpreter."""
    runner = ModelRunner(
        phi3_dir, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK, backend="triton"
    )
    check_rows_in_regimes(hf, runner)


def check_rows_in_regimes(hf, runner: ModelRunner) -> None:
    """A batched step with a short row and a long row, then decodes of both: every logit as HF's."""
    short, long = prompt_of(1, 20), prompt_of(2, 45)
    builder = PlanBuilder(BLOCK)
    histories = {0: short, 1: long}
    chunks = [(0, short), (1, long)]
    for _ in range(4):
        arrays, header = builder.plan([(seq, tokens, True) for seq, tokens in chunks])
        arrays["long_rope"] = np.array([0, 1], np.uint8)
        runner.validate(arrays, header)
        logits = runner.model.forward(
            torch.from_numpy(arrays["input_ids"].astype(np.int64)),
            runner.model.prepare(arrays, header.num_tokens, header.num_seqs),
            runner.kv_cache,
            torch.from_numpy(arrays["query_start_loc"][1:].astype(np.int64) - 1),
        )
        for row, seq in enumerate(histories):
            expected = hf_logits(hf, histories[seq])
            torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=ATOL, msg=f"seq {seq}")
            histories[seq] = histories[seq] + [int(expected.argmax())]
        chunks = [(seq, h[-1:]) for seq, h in histories.items()]


def test_a_long_sequence_in_the_short_regime_differs_from_hf(hf, runner: ModelRunner) -> None:
    """The regime matters at these sizes: the long prompt rotated short is not HF's."""
    prompt = prompt_of(3, 45)
    logits = runner_logits(runner, PlanBuilder(BLOCK), [(0, prompt, True)])[0]
    assert (logits - hf_logits(hf, prompt)).abs().max() > 0.05


def test_the_worker_refuses_a_bad_long_rope_array(runner: ModelRunner) -> None:
    plan, header = PlanBuilder(BLOCK).plan([(0, [5, 6, 7], True)])
    with pytest.raises(InvalidPlan, match="long_rope is not 0 or 1"):
        runner.validate({**plan, "long_rope": np.array([2], np.uint8)}, header)


def test_a_model_without_longrope_refuses_a_long_rope_array(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_model_dir, dtype="float32", kv_cache_bytes=1 << 20, block_size=BLOCK)
    plan, header = PlanBuilder(BLOCK).plan([(0, [5, 6, 7], True)])
    with pytest.raises(InvalidPlan, match="without LongRoPE"):
        runner.validate({**plan, "long_rope": np.array([1], np.uint8)}, header)


# ---- served: the scheduler and the runner together ------------------------------------------------


def serve(
    runner: ModelRunner, prompts: dict[str, list[int]], max_tokens: int, overlap: bool = True, **config: int
) -> tuple[Scheduler, RunnerExecutor, dict[str, Served]]:
    return in_process_engine.serve(runner, prompts, max_tokens, TOP, overlap, **config)


def check_against_hf(hf, prompt: list[int], served: Served) -> None:
    in_process_engine.check_against_hf(hf, prompt, served, TOP, ATOL)


@pytest.mark.parametrize("overlap", [False, True])
def test_served_greedy_matches_hf_across_the_original_length(hf, runner: ModelRunner, overlap: bool) -> None:
    """Prompts shorter than the original length whose generation passes it (one of exactly that
    length), and one longer than it, batched."""
    prompts = {
        "crosses": prompt_of(10, 24),
        "at-original": prompt_of(11, ORIGINAL),
        "long": prompt_of(12, 40),
    }
    sched, executor, outputs = serve(runner, prompts, max_tokens=14, overlap=overlap)
    for rid, prompt in prompts.items():
        check_against_hf(hf, prompt, outputs[rid])
    # Each short sequence recomputed once as it passed the original length; the long one never.
    assert sched.num_preemptions == 2
    assert executor.num_long_rope_steps > 0


def test_chunked_prefill_keeps_one_regime_for_the_whole_prompt(hf, runner: ModelRunner) -> None:
    """Chunks of 8 tokens: a long prompt's first chunks (all before the original length) are long
    too, and a short prompt's recompute past it is chunked as well."""
    prompts = {"long": prompt_of(20, 45), "crosses": prompt_of(21, 27)}
    _, _, outputs = serve(runner, prompts, max_tokens=10, max_num_batched_tokens=8)
    for rid, prompt in prompts.items():
        check_against_hf(hf, prompt, outputs[rid])


def test_prefix_cache_hits_only_within_a_regime(hf, runner: ModelRunner) -> None:
    """A short sequence's cached blocks never serve a long prompt with the same prefix; a long
    one's serve the next long prompt."""
    shared = prompt_of(30, 24)
    settings = dict(max_num_batched_tokens=256)
    sched = Scheduler(scheduler_config(
        max_num_seqs=4, block_size=BLOCK, num_blocks=runner.num_kv_blocks, max_model_len=runner.max_model_len,
        long_rope_from=ORIGINAL, **settings,
    ))  # fmt: skip
    executor = RunnerExecutor(runner, BLOCK)
    pipeline = StepPipeline(sched, executor, on_failed=refuse_nothing, overlap=False)

    def one(rid: str, prompt: list[int], max_tokens: int) -> Served:
        assert (
            sched.add(make_request(rid, prompt, temperature=0.0, max_tokens=max_tokens, logprobs=TOP)) is None
        )
        tokens: list[int] = []
        logprobs: list[float] = []
        tops: list[dict[int, float]] = []
        while pipeline.has_work:
            for out in pipeline.advance() or []:
                tokens.extend(out.new_token_ids)
                logprobs.extend(out.logprobs)
                tops.extend(out.top_logprobs)
        return tokens, logprobs, tops

    short = shared + prompt_of(31, 4)  # 28 tokens + 4 generated: short all the way
    check_against_hf(hf, short, one("short", short, 4))
    long_a = shared + prompt_of(32, 16)  # 40 tokens: long; its first 3 blocks are the short one's tokens
    hits_before = sched.num_prefix_hit_tokens
    check_against_hf(hf, long_a, one("long-a", long_a, 4))
    assert sched.num_prefix_hit_tokens == hits_before  # the short blocks did not serve it
    long_b = long_a[:40] + prompt_of(33, 4)
    check_against_hf(hf, long_b, one("long-b", long_b, 4))
    assert sched.num_prefix_hit_tokens - hits_before == 5 * BLOCK  # long-a's 5 full blocks did
    short_again = shared + prompt_of(34, 6)
    hits_before = sched.num_prefix_hit_tokens
    check_against_hf(hf, short_again, one("short-again", short_again, 2))
    assert sched.num_prefix_hit_tokens - hits_before == 3 * BLOCK  # the short blocks serve a short prompt
    assert_no_leaks(sched)


def test_preempted_sequences_recompute_in_their_regime(hf, runner: ModelRunner) -> None:
    """A pool of 12 blocks (96 tokens) for sequences that grow to 50 and 46: they preempt each other,
    before and after passing the original length, and still generate HF's tokens."""
    prompts = {"a": prompt_of(40, 30), "b": prompt_of(41, 36)}
    sched, _, outputs = serve(runner, prompts, max_tokens=20, num_blocks=12, max_model_len=96)
    for rid, prompt in prompts.items():
        check_against_hf(hf, prompt, outputs[rid])
    assert sched.num_preemptions > 1  # "a" passing the original length is one; the pool forces more


def test_longrope_ropes_with_different_original_lengths_are_refused() -> None:
    """One original length decides a sequence's regime; two would need two regimes per sequence."""
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
    }
    config = {
        **COMMON, "architectures": ["Phi3ForCausalLM"], "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {**longrope, "original_max_position_embeddings": 32},
            "sliding_attention": {**longrope, "original_max_position_embeddings": 16},
        },
    }  # fmt: skip
    with pytest.raises(UnsupportedModel, match="different original lengths"):
        ModelConfig.from_dict(config)
