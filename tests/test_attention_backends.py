"""The CUDA code path's wiring, without a GPU: the tiny model with the Triton backend (kernels in
the interpreter on CPU tensors) against the torch backend, on mixed, chunked and decode steps.
The kernels themselves are checked in test_kernels.py; this catches argument order, shapes and
strides in attention.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import posix_ipc
import pytest
import torch

from ipc.embedding_cache import EmbeddingCache
from ipc.endpoints import SHM_PREFIX
from ipc.shm import new_run_id
from services.common.images import ImageRules
from services.gpu_worker.attention import TorchOps, TritonOps
from services.gpu_worker.model_runner import ModelRunner
from tests.conftest import save_random_model
from tests.test_families import BLOCK, COMMON, check_against_hf, load_family
from tests.test_kernels import has_cpu_kernels
from tests.test_model import PlanBuilder, runner_logits

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"),
]

KV_BYTES = 4 << 20


def greedy_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a short greedy run: a mixed prefill (one prompt chunked), then all-decode steps
    that cross a block boundary (block size 16)."""
    builder = PlanBuilder(runner.block_size)
    a, b, c = list(range(100, 120)), [7, 8, 9], list(range(300, 313))
    plans = [[(0, a[:9], False), (1, b, True), (2, c, True)]]
    out = [runner_logits(runner, builder, plans[0])]
    last = out[0].argmax(-1).tolist()
    out.append(runner_logits(runner, builder, [(0, a[9:], True), (1, [last[0]], True), (2, [last[1]], True)]))
    for _ in range(4):
        last = out[-1].argmax(-1).tolist()
        out.append(runner_logits(runner, builder, [(i, [t], True) for i, t in enumerate(last)]))
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_triton_backend_matches_torch(tiny_model_dir: Path, dtype: str) -> None:
    torch_runner = ModelRunner(tiny_model_dir, dtype=dtype, kv_cache_bytes=KV_BYTES, backend="torch")
    triton_runner = ModelRunner(tiny_model_dir, dtype=dtype, kv_cache_bytes=KV_BYTES, backend="triton")
    assert isinstance(torch_runner.model.ops, TorchOps)
    assert isinstance(triton_runner.model.ops, TritonOps)
    tol = 1e-4 if dtype == "float32" else 2e-2
    want = greedy_logits(torch_runner)
    got = greedy_logits(triton_runner)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"step {step}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"greedy token differs at step {step}"
    # The cache each backend wrote is the same too (store_kv wiring: slots, heads, layout).
    for (k0, v0), (k1, v1) in zip(torch_runner.kv_cache, triton_runner.kv_cache, strict=True):
        torch.testing.assert_close(k1, k0, atol=tol, rtol=tol)
        torch.testing.assert_close(v1, v0, atol=tol, rtol=tol)


def test_unknown_backend_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="backend"):
        ModelRunner(tiny_model_dir, dtype="float32", kv_cache_bytes=KV_BYTES, backend="cuda-graphs")


def test_cpu_decode_kernel_matches_torch_ops(tiny_model_dir: Path) -> None:
    """The CPU backend's decode with the C++ kernel (float32) against its gather + SDPA path."""
    assert has_cpu_kernels()
    kernel_runner = ModelRunner(tiny_model_dir, dtype="float32", kv_cache_bytes=KV_BYTES, backend="torch")
    sdpa_runner = ModelRunner(tiny_model_dir, dtype="float32", kv_cache_bytes=KV_BYTES, backend="torch")
    assert kernel_runner.model.ops.has_decode_kernel
    sdpa_runner.model.ops.has_decode_kernel = False
    for step, (a, b) in enumerate(zip(greedy_logits(kernel_runner), greedy_logits(sdpa_runner), strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"step {step}")


# Gemma 2: alternating windows and soft caps; Gemma 3: windows, per-layer ropes and q/k norms.
@pytest.mark.timeout(600)  # the interpreter runs every kernel in Python: ~1-2 min each on a busy box
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_triton_backend_families_match_hf(family: str, tmp_path: Path) -> None:
    """Sliding windows, soft caps and q/k norms through the Triton kernels: HF's greedy tokens and
    logits over prefill, decode, a prefix hit and preemption."""
    hf, runner = load_family(family, tmp_path / family, backend="triton")
    assert all(isinstance(ops, TritonOps) for ops in runner.model.kind_ops)
    check_against_hf(hf, runner)


@pytest.mark.timeout(600)
def test_triton_backend_serves_head_sizes_no_power_of_two(tmp_path: Path) -> None:
    """A Phi-3 with 48-dimension heads (Phi-3-mini's are 96), a partial rotary over 36 of them:
    the Triton kernels pad each head to a power of two and mask the rest. HF's greedy tokens and
    logits over prefill, decode, a prefix hit and preemption."""
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(**{**COMMON, "hidden_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1,
                           "partial_rotary_factor": 0.75, "tie_word_embeddings": False})  # fmt: skip
    path = save_random_model(config, tmp_path / "phi3", seed=48, std=0.08, embed_std=0.15)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK, backend="triton")
    assert runner.model.config.head_dim == 48 and all(
        isinstance(ops, TritonOps) for ops in runner.model.kind_ops
    )
    check_against_hf(hf, runner)


@pytest.fixture
def embedding_cache_name() -> Iterator[str]:
    name = f"/{SHM_PREFIX}{new_run_id()}-embeds-0"
    yield name
    posix_ipc.unlink_shared_memory(name)


def test_triton_backend_gemma3_images_give_hfs_tokens(
    tiny_gemma3_vlm_dir: Path, embedding_cache_name: str
) -> None:
    """Gemma 3's image tokens seeing their whole image through the Triton prefill kernel: a chat
    with two images, prefilled whole and cut where the second starts (the first then in the KV
    cache, the second at the chunk's first token), then decodes, gives HF's greedy tokens and
    logprobs (full forwards, pixel values in)."""
    from tests.test_image_chat import hf_greedy, png
    from tests.test_qwen25vl import serve_chat

    rules = ImageRules.from_dir(tiny_gemma3_vlm_dir)
    cache = EmbeddingCache.create_or_attach(embedding_cache_name, 4, rules.tokens_per_tile, 64)
    turns = [("user", [png(40, 50, seed=0), "What is this?"]), ("assistant", ["Noise."]),
             ("user", [png(60, 30, seed=1), "And this one?"])]  # fmt: skip
    _, expected_tokens, expected_logprobs = hf_greedy(tiny_gemma3_vlm_dir, turns)
    for cut_after_image in (None, 1):
        tokens, logprobs = serve_chat(
            tiny_gemma3_vlm_dir, cache, turns, cut_after_image, mrope=False, backend="triton"
        )
        assert tokens == expected_tokens, cut_after_image
        np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-3, err_msg=str(cut_after_image))
    cache.close()


@pytest.mark.parametrize(
    ("groups", "starts", "problem"),
    [
        ([-1, 0, -1, 0, -1, -1], [1], "not one run from its image_starts entry"),
        ([-1, 0, 0, -1, -1, -1], [2], "not one run from its image_starts entry"),
        ([-1, 1, 1, -1, -1, -1], [1], "image group without its image_starts entry"),
        ([-1, -1, 0, 0, -1, -1], [2], "span two sequences"),
    ],
)
def test_image_groups_the_kernels_cannot_read_are_refused(
    tiny_gemma3_vlm_dir: Path, groups: list[int], starts: list[int], problem: str
) -> None:
    """The prefill kernel's image tails (and the CPU path's mask) read each image as one run of
    tokens from its start, inside one sequence: a plan with other groups is refused by name."""
    from services.gpu_worker.model_runner import InvalidPlan

    runner = ModelRunner(
        tiny_gemma3_vlm_dir, dtype="float32", kv_cache_bytes=KV_BYTES, backend="triton",
        embedding_caches=lambda encoder: "/unused",
    )  # fmt: skip
    arrays, header = PlanBuilder(runner.block_size).plan([(0, [5, 6, 7], True), (1, [8, 9, 10], True)])
    arrays.update(
        image_groups=np.array(groups, np.int32),
        image_starts=np.array(starts, np.int32),
        image_encoders=np.zeros(len(starts), np.int32),
        image_slots=np.zeros(len(starts), np.int32),
        image_sequences=np.zeros(len(starts), np.int64),
        image_keys=np.zeros((len(starts), 16), np.uint8),
    )
    with pytest.raises(InvalidPlan, match=problem):
        runner.execute(arrays, header)
