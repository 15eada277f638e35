"""Expert parallelism (`engine.expert_parallel`): with tensor_parallel ranks, a mixture of experts'
experts are divided among the ranks, whole, instead of each expert's columns split over all of
them (services/gpu_worker/model.py Shard, moe_mlp). Each rank's experts are exactly its share of
the whole model's, and two ranks over gloo give HF transformers' logits and greedy tokens through
chunked prefill and decodes; a model or layout it cannot divide is refused by name before any
stage starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from ipc.config import load_config
from services.gpu_worker.architectures import ModelConfig
from services.gpu_worker.model import LlamaModel, moe_mlp
from services.gpu_worker.parallel import Parallel
from supervision.preflight import Refused, check_model
from tests.conftest import save_random_model
from tests.test_families import BLOCK
from tests.test_moe import check_tensor_parallel_against_hf, full_and_rank_models, random_moe_config

pytestmark = pytest.mark.timeout(300)


# Qwen2-MoE: experts beside a dense layer and a shared expert (still split by columns); gpt-oss:
# stacked experts with biases (each down bias added by its expert's rank); Mixtral: per-expert names.
@pytest.mark.parametrize("family", ["qwen2-moe-shared-expert", "gpt-oss", "mixtral"])
def test_expert_parallel_matches_hf(tmp_path: Path, family: str) -> None:
    model_dir = save_random_model(
        random_moe_config(family), tmp_path / family, seed=32, std=0.08, embed_std=0.15
    )
    full, parts = full_and_rank_models(model_dir, expert_parallel=True)
    num_sparse = 0
    for rank, part in enumerate(parts):
        for layer, whole in zip(part.layers, full.layers, strict=True):
            if layer.moe is None:
                continue
            num_sparse += 1
            experts = slice(4 * rank, 4 * (rank + 1))  # 8 experts over 2 ranks
            assert torch.equal(layer.experts_gate_up, whole.experts_gate_up[experts])
            assert torch.equal(layer.experts_down, whole.experts_down[experts])
            assert torch.equal(layer.router, whole.router)
            if whole.experts_down_bias is not None:
                assert torch.equal(layer.experts_gate_up_bias, whole.experts_gate_up_bias[experts])
                assert torch.equal(layer.experts_down_bias, whole.experts_down_bias[experts])
            if whole.shared_down is not None:  # the shared expert stays split by columns
                assert layer.shared_down.shape[1] * 2 == whole.shared_down.shape[1]
    assert num_sparse > 0
    check_tensor_parallel_against_hf(model_dir, expert_parallel=True)


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("family", ["mixtral", "gpt-oss"])
def test_each_rank_sums_its_own_experts_share(family: str, fused: bool) -> None:
    """moe_mlp on each rank of two, through the torch grouping and the Triton fused kernel (in the
    interpreter): a rank's partial sum is the mixture over its own experts (gpt-oss: their biases
    too), and the two partial sums add up to the whole layer's output."""
    from kernels.fused_moe import fused_moe_triton

    fused_experts = fused_moe_triton if fused else None
    config = ModelConfig.from_dict(random_moe_config(family).to_dict())
    torch.manual_seed(0)
    whole = LlamaModel(config, torch.float32, torch.device("cpu"), BLOCK).layers[1]
    names = [
        "router",
        "experts_gate_up",
        "experts_down",
        "router_bias",
        "experts_gate_up_bias",
        "experts_down_bias",
    ]
    for name in names:
        if getattr(whole, name) is not None:
            getattr(whole, name).normal_(0, 0.1)
    x = torch.randn(5, config.hidden_size)
    want = moe_mlp(x, whole, torch.nn.functional.silu, fused_experts=fused_experts)
    total = torch.zeros_like(want)
    for rank in range(2):
        part = LlamaModel(config, torch.float32, torch.device("cpu"), BLOCK, Parallel(rank, 2, True)).layers[
            1
        ]
        for name in names:
            if getattr(whole, name) is not None:
                mine = getattr(whole, name)
                getattr(part, name).copy_(
                    mine if name.startswith("router") else mine[4 * rank : 4 * (rank + 1)]
                )
        partial = moe_mlp(x, part, torch.nn.functional.silu, fused_experts=fused_experts)
        assert not torch.allclose(partial, want, atol=1e-4)  # one rank's share is not the whole
        total += partial
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_expert_parallel_layouts_it_cannot_divide_are_refused(tmp_path: Path) -> None:
    qwen = random_moe_config("qwen2-moe-shared-expert", num_experts=6, moe_intermediate_size=30)
    qwen_dir = save_random_model(qwen, tmp_path / "qwen", seed=0, std=0.08)
    # Experts whole: moe_intermediate_size 30 need not divide over 2 ranks, but 6 experts over 4 do not.
    check_model(load_config(None, ["engine.tensor_parallel=2", "engine.expert_parallel=true"]), qwen_dir)
    with pytest.raises(Refused, match=r"cannot divide qwen.s 6 experts among engine\.tensor_parallel=4"):
        check_model(load_config(None, ["engine.tensor_parallel=4", "engine.expert_parallel=true"]), qwen_dir)
    dense = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    dense_dir = save_random_model(dense, tmp_path / "dense", seed=0, std=0.08)
    with pytest.raises(Refused, match=r"engine\.expert_parallel: dense is not a mixture of experts"):
        check_model(load_config(None, ["engine.expert_parallel=true"]), dense_dir)
