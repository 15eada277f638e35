"""Mixture-of-experts families against HF transformers on the same random weights, in float32:
Mixtral (top-2 of 8, renormalized), Qwen2-MoE (gated shared expert, a dense layer by
decoder_sparse_step), Qwen3-MoE (per-head q/k norms, norm_topk_prob, a dense layer by
mlp_only_layers) and OLMoE (q/k norms over all heads, clip_qkv). In process through the
ModelRunner (test_families.check_against_hf: batched prefill, decodes, a prefix-cache hit, a
preemption), and one family served end to end through real processes. Every family also
through a GGUF written as llama.cpp's converter writes it (write_moe_gguf, write_gpt_oss_gguf;
DeepSeek's in test_deepseek.py), and what such a file records that Brigade cannot run, refused by
name. DeepSeek-V2 / V3 are in test_deepseek.py."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import cpu_ops
from services.gpu_worker.architectures import ModelConfig, UnsupportedModel
from services.gpu_worker.model import moe_route
from services.gpu_worker.model_runner import ModelRunner
from tests.conftest import TINY_VOCAB_SIZE, save_random_model
from tests.test_families import BLOCK, COMMON, WINDOW, check_against_hf
from tests.test_family_serving import hf_greedy, served_greedy

pytestmark = pytest.mark.timeout(300)

MOE = dict(num_experts_per_tok=2, tie_word_embeddings=False)
# family -> (transformers config class name, its arguments beyond COMMON)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(MOE, num_local_experts=8, head_dim=16)),
    "qwen2-moe-shared-expert": ("Qwen2MoeConfig", dict(
        MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=3,
        decoder_sparse_step=2,  # layer 1 sparse, layers 0 and 2 dense (intermediate_size)
    )),
    "qwen3-moe-norm-topk": ("Qwen3MoeConfig", dict(
        MOE, num_experts=8, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True, num_hidden_layers=3,
        mlp_only_layers=[1],
    )),
    "olmoe-clip-qkv": ("OlmoeConfig", dict(MOE, num_experts=8, clip_qkv=2.5)),
    # Sinks, sliding (layer 0) and full (layer 1) attention, YaRN over an original length the
    # prompts pass, the biased router and experts, and a SwiGLU limit the gates and ups reach.
    "gpt-oss": ("GptOssConfig", dict(
        MOE, num_local_experts=8, head_dim=16, sliding_window=WINDOW, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
    )),
}  # fmt: skip


def random_moe_config(family: str, **overrides):
    import transformers

    class_name, extra = FAMILIES[family]
    return getattr(transformers, class_name)(**{**COMMON, **extra, **overrides})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    out = tmp_path_factory.mktemp(family)
    path = save_random_model(
        random_moe_config(family), out, seed=10 + sorted(FAMILIES).index(family), std=0.08, embed_std=0.15
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK)
    return family, hf, runner


def test_moe_family_matches_hf(moe_model, monkeypatch: pytest.MonkeyPatch):
    family, hf, runner = moe_model
    config = runner.model.config
    assert config.moe is not None and config.moe.num_experts == 8 and config.moe.top_k == 2
    if family.startswith(("qwen2", "qwen3")):  # the dense layers really are dense
        assert config.moe.sparse_layers == (
            (False, True, False) if family.startswith("qwen2") else (True, False, True)
        )
    if family == "gpt-oss":  # what the family brings is really in play
        assert config.attention_sinks and config.layer_windows == (WINDOW, 0)
        assert config.ropes[0].rope_type == "yarn" and config.moe.swiglu_limit == 1.0
    mixtures = CountingMixtures(monkeypatch)
    check_against_hf(hf, runner)
    if runner.model.has_few_rows_linear:  # the steps of few rows: float32 experts in the fused op
        assert mixtures.rows and max(mixtures.rows) <= cpu_ops.MOE_MAX_ROWS
        # every family here routes by softmax on one rank: router and experts in one call
        assert mixtures.one_call_rows


@pytest.mark.parametrize("family", ["qwen2-moe-shared-expert", "gpt-oss"])
def test_moe_triton_backend_matches_hf(family: str, tmp_path: Path) -> None:
    """The Triton backend (its attention kernels and the fused-MoE grouped GEMMs, in the
    interpreter on CPU tensors) on a Qwen2-MoE with a shared expert and a dense layer, and on a
    gpt-oss (sinks in the attention kernels, the experts' biases and clamped SwiGLU): HF's
    logits and greedy tokens through prefill, decodes, a prefix hit and a preemption."""
    from transformers import AutoModelForCausalLM

    from kernels.fused_moe import fused_moe_triton

    path = save_random_model(random_moe_config(family), tmp_path / family, seed=50, std=0.08, embed_std=0.15)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK, backend="triton")
    assert runner.model.fused_experts is fused_moe_triton
    check_against_hf(hf, runner)


# Configs beyond FAMILIES' that benchmarks/config_fuzz.py found run wrongly or refused: (family,
# overrides of its FAMILIES entry).
MOE_CONFIG_EDGES = {
    # Qwen2MoeSparseMoeBlock builds a zero-width shared expert and its gate anyway: in the checkpoint.
    "qwen2-moe-no-shared-expert": ("qwen2-moe-shared-expert", dict(shared_expert_intermediate_size=0)),
    # GptOssExperts never read hidden_act (their activation is the clamped SwiGLU).
    "gpt-oss-hidden-act-gelu": ("gpt-oss", dict(hidden_act="gelu")),
}


@pytest.mark.parametrize("edge", sorted(MOE_CONFIG_EDGES))
def test_moe_config_edges_match_hf(edge: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    family, overrides = MOE_CONFIG_EDGES[edge]
    config = random_moe_config(family, **overrides)
    path = save_random_model(config, tmp_path / edge, seed=70, std=0.08, embed_std=0.15)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK)
    check_against_hf(hf, runner)


def test_router_matches_hf_routing_on_ties_and_normalization():
    """Softmax in float32 then the top k, renormalized only with norm_topk_prob."""
    from services.gpu_worker.architectures import MoeConfig

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.0, 1.0]])
    weights, experts = moe_route(logits, MoeConfig(4, 2, 8, norm_topk_prob=False))
    probs = torch.softmax(logits, dim=-1)
    assert experts[0].tolist() == [0, 1]
    torch.testing.assert_close(weights[0], probs[0, :2])
    weights, _ = moe_route(logits, MoeConfig(4, 2, 8, norm_topk_prob=True))
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize(("rows", "num_experts", "top_k"), [(1, 8, 2), (5, 64, 4), (16, 128, 8)])
def test_cpu_router_matches_torch_routing(rows: int, num_experts: int, top_k: int) -> None:
    """cpu_ops.moe_route, the few-rows router in one call, against moe_route (HF's routing, above)
    on F.linear's logits: softmax with and without norm_topk_prob, a routed_scaling_factor, and
    gpt-oss's softmax over the top k logits with a router bias. The same experts in the same
    order, the weights within float32 rounding."""
    from services.gpu_worker.architectures import MoeConfig

    assert cpu_ops.has_kernels(torch.float32)
    generator = torch.Generator().manual_seed(rows)
    x, router = torch.randn(rows, 48, generator=generator), torch.randn(num_experts, 48, generator=generator)
    bias = torch.randn(num_experts, generator=generator)
    for moe, router_bias in (
        (MoeConfig(num_experts, top_k, 8, norm_topk_prob=False), None),
        (MoeConfig(num_experts, top_k, 8, norm_topk_prob=True, routed_scaling_factor=2.5), None),
        (MoeConfig(num_experts, top_k, 8, norm_topk_prob=False, softmax_after_topk=True), bias),
        # gpt-oss's router scales nothing, whatever the config says
        (MoeConfig(num_experts, top_k, 8, False, softmax_after_topk=True, routed_scaling_factor=2.0), bias),
    ):
        weights, experts, tied = cpu_ops.moe_route(
            x,
            router,
            router_bias,
            top_k,
            moe.norm_topk_prob,
            moe.softmax_after_topk,
            moe.routed_scaling_factor,
        )
        want_weights, want_experts = moe_route(torch.nn.functional.linear(x, router, router_bias), moe)
        assert not tied
        assert torch.equal(experts, want_experts)
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("cpu_isa")
def test_cpu_router_reports_ties_that_torch_breaks_its_own_way() -> None:
    """Where a row's k-th score equals an expert's left out, torch.topk picks among the equals in
    an order of its own (HF's choice): the op says so, and the layer routes with torch. A tie
    inside the top k changes no choice. Bad arguments are errors."""
    from services.gpu_worker.architectures import MoeConfig
    from services.gpu_worker.model import route_experts

    assert cpu_ops.has_kernels(torch.float32)
    eye = torch.eye(4)
    for logits, tied in (([0.0, 3.0, 3.0, 1.0], False), ([3.0, 1.0, 1.0, 0.0], True), ([0.0] * 4, True)):
        # x = the logits, router = the identity: x @ router^T is the logits themselves
        assert cpu_ops.moe_route(torch.tensor([logits]), eye, None, 2, True, False, 1.0)[2] is tied
    nan = torch.tensor([[1.0, float("nan"), 0.0, 2.0]])  # torch.topk takes NaN as the largest
    assert cpu_ops.moe_route(nan, eye, None, 2, True, False, 1.0)[2] is True
    moe = MoeConfig(64, 4, 8, norm_topk_prob=True)
    one_call, ties_seen = cpu_ops.moe_route, []

    def counted(*args):
        result = one_call(*args)
        ties_seen.append(result[2])
        return result

    layer = type(
        "Layer", (), {"router": torch.zeros(64, 16), "router_bias": None, "router_correction_bias": None}
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_ops, "moe_route", counted)
        weights, experts = route_experts(torch.randn(1, 16), layer, moe)  # every expert ties
        want_weights, want_experts = moe_route(torch.zeros(1, 64), moe)
        assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)
        layer.router = torch.randn(64, 16)  # no tie: the one call's answer is the layer's
        x = torch.randn(2, 16)
        weights, experts = route_experts(x, layer, moe)
    assert ties_seen == [True, False]
    assert torch.equal(experts, one_call(x, layer.router, None, 4, True, False, 1.0)[1])
    with pytest.raises(RuntimeError, match=r"top_k 0 outside 1\.\.4"):
        cpu_ops.moe_route(torch.ones(1, 4), eye, None, 0, True, False, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.moe_route(torch.ones(1, 4).double(), eye, None, 2, True, False, 1.0)


@pytest.mark.usefixtures("cpu_isa")
def test_a_sparse_layers_one_call_equals_its_two_and_falls_back_on_a_tie(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FewRowsMoe (router and experts in one C++ call) gives a sparse layer's moe_mlp exactly what
    the router call, then the experts' call gave; where the router ties, the step is routed by
    torch as before (HF's tie order). It is bound only where that one call computes the layer:
    not for sigmoid or group-limited routers, expert parallelism or without the C++ kernels; and
    with tensor parallelism only rank 0's binds gpt-oss's down biases."""
    from dataclasses import replace

    import torch.nn.functional as F

    from services.gpu_worker.architectures import MoeConfig
    from services.gpu_worker.model import FewRowsMoe, LlamaLayer, Shard, moe_mlp, routed_experts
    from services.gpu_worker.parallel import Parallel

    assert cpu_ops.has_kernels(torch.float32)
    config = ModelConfig(
        architecture="test", vocab_size=1, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=1,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        moe=MoeConfig(8, 2, 32, True, 0, (True,), router_bias=True, expert_bias=True, swiglu_alpha=1.7,
                      swiglu_limit=7.0),
    )  # fmt: skip
    layer = LlamaLayer(
        config, Shard.of(config, Parallel()), torch.float32, torch.device("cpu"), is_sparse=True
    )
    generator = torch.Generator().manual_seed(3)
    for weight in (layer.router, layer.router_bias, layer.experts_gate_up, layer.experts_down,
                   layer.experts_gate_up_bias, layer.experts_down_bias):  # fmt: skip
        weight.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
    layer.few_rows_moe = FewRowsMoe.of(layer, has_few_rows_linear=True, is_silu=True)
    assert layer.few_rows_moe is not None
    mixtures = CountingMixtures(monkeypatch)
    x = torch.randn(5, 64, generator=generator)
    want = routed_experts(x, layer, F.silu, True, None, adds_down_bias=True)
    assert torch.equal(moe_mlp(x, layer, F.silu, True), want)
    assert mixtures.one_call_rows == [5]
    layer.router.zero_()
    layer.router_bias.zero_()  # every expert scores alike: a tie at every row's k-th choice
    want = routed_experts(x, layer, F.silu, True, None, adds_down_bias=True)
    assert torch.equal(moe_mlp(x, layer, F.silu, True), want)
    assert mixtures.one_call_rows == [5]  # the tied call multiplied nothing
    # Only where the one call computes the layer.
    assert FewRowsMoe.of(layer, has_few_rows_linear=False, is_silu=True) is None
    for changes in ({"scoring": "sigmoid"}, {"num_groups": 2, "topk_groups": 1}):
        other = LlamaLayer(replace(config, moe=replace(config.moe, **changes)), Shard.of(config, Parallel()),
                           torch.float32, torch.device("cpu"), is_sparse=True)  # fmt: skip
        assert FewRowsMoe.of(other, has_few_rows_linear=True, is_silu=True) is None
    layer.num_local_experts = 4  # expert parallelism: this rank holds half of them
    assert FewRowsMoe.of(layer, has_few_rows_linear=True, is_silu=True) is None
    layer.num_local_experts = 8
    other_rank = FewRowsMoe.of(layer, has_few_rows_linear=True, is_silu=True, adds_down_bias=False)
    assert other_rank is not None
    assert all(argument is not layer.experts_down_bias for argument in other_rank.arguments)
    assert any(argument is layer.experts_down_bias for argument in layer.few_rows_moe.arguments)


def write_mxfp4_experts(model_dir: Path, seed: int) -> None:
    """Make a saved gpt-oss an MXFP4 checkpoint as OpenAI ships one: each experts' projection
    replaced by random MXFP4 blocks (every 4-bit code) and scales (exponents 2^-6 to 2^-4, so the
    weights are of the random model's size), every other weight in bfloat16, quantization_config
    quant_method mxfp4; in two shards, the scales in the second, apart from their blocks."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = {
        name: t.to(torch.bfloat16) for name, t in load_file(str(model_dir / "model.safetensors")).items()
    }
    (model_dir / "model.safetensors").unlink()
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, in_features, out_features = tensors.pop(name).shape
        groups = in_features // 32
        tensors[f"{name}_blocks"] = torch.randint(
            0, 256, (experts, out_features, groups, 16), dtype=torch.uint8, generator=generator
        )
        tensors[f"{name}_scales"] = torch.randint(
            121, 124, (experts, out_features, groups), dtype=torch.uint8, generator=generator
        )
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, tensor in tensors.items():
        shards[sorted(shards)[name.endswith("_scales")]][name] = tensor
    for file, shard in shards.items():
        save_file(shard, str(model_dir / file), metadata={"format": "pt"})
    weight_map = {name: file for file, shard in shards.items() for name in shard}
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (model_dir / "config.json").write_text(json.dumps(config))


def test_mxfp4_dequantization_is_hfs() -> None:
    """Every code in every nibble and scales from 2^-20 to 2^20: the same float32 weight as
    transformers' own MXFP4 dequantization, in the plain checkpoints' [E, in, out] layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from services.gpu_worker.loader import dequantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8, generator=generator)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # low and high nibble alike
    scales = torch.randint(107, 148, (3, 40, 2), dtype=torch.uint8, generator=generator)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 64, 40)
    assert torch.equal(got, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def hf_mxfp4_dequantized():
    """The from_pretrained option by which HF dequantizes an MXFP4 checkpoint to float32 (without
    it, on a CPU, to bfloat16)."""
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


@pytest.mark.parametrize("experts", ["mxfp4", "dequantized"])
def test_gpt_oss_mxfp4_checkpoint_matches_hf(
    experts: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gpt-oss whose experts are MXFP4 blocks and scales: HF's logits and greedy tokens (HF
    dequantizes the same checkpoint itself) through prefill, decodes, a prefix hit and a
    preemption. With the C++ kernels the experts stay MXFP4 blocks (no float32 copy): decode
    steps of up to three rows multiply them in the fused op, with the experts' biases and clamped
    SwiGLU, the wider steps dequantize the selected ones; without the kernels (the torch path)
    they are dequantized at load."""
    from transformers import AutoModelForCausalLM

    path = save_random_model(
        random_moe_config("gpt-oss"), tmp_path / "gpt-oss", seed=60, std=0.08, embed_std=0.15
    )
    write_mxfp4_experts(path, seed=61)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **hf_mxfp4_dequantized()
    ).eval()
    if experts == "dequantized":
        monkeypatch.setattr(cpu_ops, "has_kernels", lambda dtype: False)
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK)
    mixtures = CountingMixtures(monkeypatch)
    if experts == "mxfp4":
        check_experts_stay_blocks(runner, ("MXFP4",) * 3)
    else:
        assert all(layer.experts_quantized is None for layer in runner.model.layers)
        assert runner.model.layers[0].experts_gate_up.dtype == torch.float32
    check_against_hf(hf, runner)
    assert {2, 3} <= set(mixtures.rows) if experts == "mxfp4" else not mixtures.rows


def test_mxfp4_blocks_without_scales_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = save_random_model(random_moe_config("gpt-oss"), tmp_path / "gpt-oss", seed=0, std=0.08)
    write_mxfp4_experts(path, seed=0)
    scales_file = str(path / "model-00002-of-00002.safetensors")
    tensors = load_file(scales_file)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, scales_file, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"layers\.1\.mlp\.experts\.down_proj: MXFP4 blocks without its scales"
    ):
        ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK)


@pytest.mark.parametrize("kernels", [True, False])
def test_mxfp4_scales_of_the_wrong_shape_are_refused(
    kernels: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scales that do not match their blocks are refused by the weight's name, whether the
    experts stay MXFP4 (the C++ kernels) or are dequantized at load (the torch path)."""
    from safetensors.torch import load_file, save_file

    path = save_random_model(random_moe_config("gpt-oss"), tmp_path / "gpt-oss", seed=0, std=0.08)
    write_mxfp4_experts(path, seed=0)
    scales_file = str(path / "model-00002-of-00002.safetensors")
    tensors = load_file(scales_file)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :1].contiguous()
    save_file(tensors, scales_file, metadata={"format": "pt"})
    if not kernels:
        monkeypatch.setattr(cpu_ops, "has_kernels", lambda dtype: False)
    with pytest.raises(
        ValueError,
        match=r"layers\.1\.mlp\.experts\.down_proj: MXFP4 blocks \(8, 64, 3, 16\) and scales \(8, 64, 1\)",
    ):
        ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK)


@pytest.mark.parametrize(("family", "method"), [("qwen3-moe-norm-topk", "mxfp4"), ("gpt-oss", "fp8")])
def test_other_quantizations_are_refused_by_name(family: str, method: str) -> None:
    """MXFP4 is read for gpt-oss's experts only; other quantization_configs stay refused."""
    config = random_moe_config(family).to_dict()
    config["architectures"] = [FAMILIES[family][0].replace("Config", "ForCausalLM")]
    config["quantization_config"] = {"quant_method": method}
    with pytest.raises(
        UnsupportedModel, match=f"unsupported quantization_config \\(quant_method '{method}'\\)"
    ):
        ModelConfig.from_dict(config)


def test_gpt_oss_router_takes_the_top_k_logits_then_softmaxes_them() -> None:
    """GptOssTopKRouter: top k of the logits, a softmax over those k only."""
    config = ModelConfig.from_dict(random_moe_config("gpt-oss").to_dict())
    assert config.moe is not None and config.moe.softmax_after_topk and config.moe.router_bias
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 0.2, 0.1, -3.0]])
    weights, experts = moe_route(logits, config.moe)
    assert experts[0].tolist() == [0, 1]
    torch.testing.assert_close(weights[0], torch.softmax(torch.tensor([2.0, 1.0]), dim=0))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scoring_func": "sigmoid"}, "unsupported MoE routing scoring_func='sigmoid'"),
        ({"topk_method": "noaux_tc"}, "unsupported MoE routing topk_method='noaux_tc'"),
        ({"n_group": 8}, "unsupported MoE routing n_group=8"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ],
)
def test_unknown_moe_routing_is_refused_by_name(changes: dict, message: str) -> None:
    config = {**random_moe_config("qwen3-moe-norm-topk").to_dict(), **changes}
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_dict(config)


def test_gpt_oss_swiglu_limit_of_zero_is_refused() -> None:
    """HF clamps the gate and up at any swiglu_limit (0: up is 0); a limit of 0 is Brigade's "no
    clamp", so a limit that is not positive is refused by name rather than run unclamped."""
    config = random_moe_config("gpt-oss", swiglu_limit=0.0).to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    with pytest.raises(UnsupportedModel, match=r"swiglu_limit=0\.0"):
        ModelConfig.from_dict(config)


@pytest.fixture(scope="module", params=["qwen2-moe-shared-expert", "gpt-oss"])
def served_moe_dir(request, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2-MoE (shared expert, a dense layer), and a random gpt-oss (sinks, a sliding
    layer shorter than the prompts, YaRN), with SmolLM2's tokenizer."""
    out = tmp_path_factory.mktemp(f"{request.param}-serving")
    config = random_moe_config(
        request.param, vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return save_random_model(config, out, seed=20, std=0.1, tokenizer_from=smollm2_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_served_greedy_matches_hf(served_moe_dir: Path, tmp_path: Path) -> None:
    """Three prompts at once in chunks of 16 (chunked prefill, mixed prefill and decode steps with
    rows routed to different experts), and a repeat of the first (a prefix-cache hit): greedy
    tokens must be HF's."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (40, 17, 29)]
    prompts.append(list(prompts[0]))
    new_tokens = 10
    expected = [hf_greedy(served_moe_dir, p, new_tokens) for p in prompts[:3]]
    expected.append(expected[0])
    overrides = (
        f"model.path={served_moe_dir}", "model.dtype=float32", "model.max_model_len=256",
        "engine.max_num_batched_tokens=16",
    )  # fmt: skip
    got = served_greedy(tmp_path / "run", overrides, prompts[:3], new_tokens, then=(prompts[3],))
    assert got == expected


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpt_oss_mxfp4_served_greedy_matches_hf(smollm2_dir: Path, tmp_path: Path) -> None:
    """A random gpt-oss MXFP4 checkpoint (write_mxfp4_experts) served through real processes,
    its experts kept MXFP4 in the worker (test_gpt_oss_mxfp4_checkpoint_matches_hf asserts the
    same load on the loaded model): three prompts at once in chunks of 16 (chunked prefill
    dequantizing the selected experts, decodes of up to three rows in the fused op) and a repeat
    of the first (a prefix hit) give the greedy tokens of HF, which dequantizes the checkpoint
    itself."""
    config = random_moe_config(
        "gpt-oss", vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model_dir = save_random_model(config, tmp_path / "hf", seed=22, std=0.1, tokenizer_from=smollm2_dir)
    write_mxfp4_experts(model_dir, seed=23)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (40, 17, 29)]
    new_tokens = 10
    expected = [hf_greedy(model_dir, p, new_tokens, **hf_mxfp4_dequantized()) for p in prompts]
    overrides = (
        f"model.path={model_dir}", "model.dtype=float32", "model.max_model_len=256",
        "engine.max_num_batched_tokens=16",
    )  # fmt: skip
    got = served_greedy(tmp_path / "run", overrides, prompts, new_tokens, then=(prompts[0],))
    assert got == [*expected, expected[0]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mixtral_gguf_served_greedy_matches_hf(tmp_path: Path) -> None:
    """A random Mixtral as a `llama` GGUF (Q8_0 experts, SmolLM2's vocabulary from the embedded
    GGUF) served through real processes, converted as the supervisor converts it: three prompts
    at once in chunks of 16 and a repeat of the first (a prefix hit) give HF's greedy tokens on
    the dequantized weights."""
    from services.gpu_worker.loader import default_model_path

    config = random_moe_config(
        "mixtral", vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    hf_dir = save_random_model(config, tmp_path / "hf", seed=21, std=0.1)
    path = write_moe_gguf(
        hf_dir, tmp_path / "mixtral.gguf", "llama", tokenizer_from=Path(default_model_path())
    )
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (40, 17, 29)]
    new_tokens = 10
    expected = [hf_greedy(hf_dir, p, new_tokens) for p in prompts]
    overrides = (
        f"model.path={path}", f"model.cache_dir={tmp_path / 'cache'}", "model.dtype=float32",
        "model.max_model_len=256", "engine.max_num_batched_tokens=16",
    )  # fmt: skip
    got = served_greedy(tmp_path / "run", overrides, prompts, new_tokens, then=(prompts[0],))
    assert got == [*expected, expected[0]]


def full_and_rank_models(model_dir: Path, expert_parallel: bool = False) -> tuple:
    """(the whole model, [rank 0's, rank 1's] of two), loaded from `model_dir`."""
    import json

    from services.gpu_worker.loader import load_weights
    from services.gpu_worker.model import LlamaModel
    from services.gpu_worker.parallel import Parallel

    config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    full = LlamaModel(config, torch.float32, torch.device("cpu"), BLOCK)
    load_weights(full, model_dir)
    parts = []
    for rank in range(2):
        parallel = Parallel(rank, 2, expert_parallel)
        parts.append(LlamaModel(config, torch.float32, torch.device("cpu"), BLOCK, parallel))
        load_weights(parts[-1], model_dir)
    return full, parts


def test_moe_tensor_parallel_matches_hf(tmp_path: Path) -> None:
    """Two ranks over gloo, each holding half of every expert's (and the shared expert's and the
    dense layers') intermediate columns, with the router whole: HF's logits and greedy tokens
    through chunked prefill and decodes; and each rank's expert weights are exactly its columns."""
    family = "qwen2-moe-shared-expert"
    model_dir = save_random_model(
        random_moe_config(family), tmp_path / family, seed=30, std=0.08, embed_std=0.15
    )
    full, parts = full_and_rank_models(model_dir)
    for rank, part in enumerate(parts):
        layer, whole = part.layers[1], full.layers[1]
        cols = slice(16 * rank, 16 * (rank + 1))  # moe_intermediate_size 32 over 2 ranks
        assert torch.equal(layer.experts_down, whole.experts_down[:, :, cols])
        assert torch.equal(layer.experts_gate_up[:, :16], whole.experts_gate_up[:, :32][:, cols])
        assert torch.equal(layer.router, whole.router)
        assert layer.shared_down.shape == (64, 24)  # shared_expert_intermediate_size 48 over 2 ranks
    check_tensor_parallel_against_hf(model_dir)


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe-norm-topk"])
def test_moe_families_tensor_parallel_match_hf(family: str, tmp_path: Path) -> None:
    """Mixtral and Qwen3-MoE (renormalized top k, per-head q/k norms, a dense layer) over two
    ranks: HF's logits and greedy tokens through chunked prefill and decodes."""
    model_dir = save_random_model(
        random_moe_config(family), tmp_path / family, seed=33, std=0.08, embed_std=0.15
    )
    check_tensor_parallel_against_hf(model_dir)


def test_gpt_oss_tensor_parallel_matches_hf(tmp_path: Path) -> None:
    """gpt-oss over two ranks: each rank's columns of the interleaved gate/up (one run of the
    checkpoint's columns) and their biases, its heads' sinks, the down biases whole (added by
    rank 0 only); HF's logits and greedy tokens through chunked prefill and decodes."""
    model_dir = save_random_model(
        random_moe_config("gpt-oss"), tmp_path / "gpt-oss", seed=31, std=0.08, embed_std=0.15
    )
    full, parts = full_and_rank_models(model_dir)
    for rank, part in enumerate(parts):
        for layer, whole in zip(part.layers, full.layers, strict=True):
            cols = slice(48 * rank, 48 * (rank + 1))  # intermediate_size 96 over 2 ranks
            assert torch.equal(layer.experts_gate_up[:, :48], whole.experts_gate_up[:, :96][:, cols])
            assert torch.equal(layer.experts_gate_up[:, 48:], whole.experts_gate_up[:, 96:][:, cols])
            assert torch.equal(
                layer.experts_gate_up_bias[:, :48], whole.experts_gate_up_bias[:, :96][:, cols]
            )
            assert torch.equal(layer.experts_down, whole.experts_down[:, :, cols])
            assert torch.equal(layer.experts_down_bias, whole.experts_down_bias)
            assert torch.equal(layer.sinks, whole.sinks[2 * rank : 2 * rank + 2])  # 4 heads over 2 ranks
    check_tensor_parallel_against_hf(model_dir)


def check_tensor_parallel_against_hf(model_dir: Path, expert_parallel: bool = False) -> None:
    """Two ranks over gloo against HF's logits and greedy tokens (chunked prefill, decodes)."""
    from transformers import AutoModelForCausalLM

    from tests.test_families import hf_logits
    from tests.test_tensor_parallel import FAMILY_PROMPTS, NEW_TOKENS, run_group, step_histories, steps

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = []
    for prompt in FAMILY_PROMPTS:
        ids = list(prompt)
        for _ in range(NEW_TOKENS):
            ids.append(int(hf_logits(hf, ids).argmax()))
        tokens.append(ids[len(prompt) :])
    got = run_group(2, model_dir, steps(tokens, FAMILY_PROMPTS), expert_parallel=expert_parallel)[0][1]
    histories = step_histories(FAMILY_PROMPTS, tokens)
    assert got is not None and len(got) == len(histories)
    for step, (rows, row_histories) in enumerate(zip(got, histories, strict=True)):
        for row, history in zip(rows, row_histories, strict=True):
            expected = hf_logits(hf, history)
            torch.testing.assert_close(
                torch.from_numpy(row), expected, atol=2e-4, rtol=2e-4, msg=f"step {step}"
            )
            assert int(row.argmax()) == int(expected.argmax()), f"greedy token differs at step {step}"


def test_olmoe_tensor_parallel_matches_hf(tmp_path: Path) -> None:
    """OLMoE over two ranks: its q and k norms span all heads, so each rank holds its heads' slice
    of the norms' weights and the ranks add up their sums of squares; with clip_qkv after the
    norms. HF's logits and greedy tokens through chunked prefill and decodes. More ranks than KV
    heads (a replicated KV head would count twice in the k norm) are refused by name."""
    from services.gpu_worker.model import Shard
    from services.gpu_worker.parallel import Parallel

    model_dir = save_random_model(
        random_moe_config("olmoe-clip-qkv"), tmp_path / "olmoe", seed=32, std=0.08, embed_std=0.15
    )
    full, parts = full_and_rank_models(model_dir)
    for rank, part in enumerate(parts):
        for layer, whole in zip(part.layers, full.layers, strict=True):
            # 4 heads of 16 (2 KV heads) over 2 ranks: 2 heads and 1 KV head each
            assert torch.equal(layer.q_norm, whole.q_norm[32 * rank : 32 * (rank + 1)])
            assert torch.equal(layer.k_norm, whole.k_norm[16 * rank : 16 * (rank + 1)])
    check_tensor_parallel_against_hf(model_dir)
    config = ModelConfig.from_dict(random_moe_config("olmoe-clip-qkv").to_dict())
    with pytest.raises(
        ValueError, match=r"q/k norms span all heads.*must not exceed num_key_value_heads \(2\)"
    ):
        Shard.of(config, Parallel(0, 4))


def test_preflight_refuses_tensor_parallel_that_cannot_split_the_experts(tmp_path: Path) -> None:
    """Checked before any stage starts: each expert's columns must divide over the ranks, and
    OLMoE's all-head q/k norms refuse more ranks than KV heads."""
    from ipc.config import load_config
    from supervision.preflight import Refused, check_model

    qwen = random_moe_config("qwen2-moe-shared-expert", moe_intermediate_size=30, intermediate_size=96)
    qwen_dir = save_random_model(qwen, tmp_path / "qwen", seed=0, std=0.08)
    check_model(load_config(None, ["engine.tensor_parallel=1"]), qwen_dir)
    with pytest.raises(Refused, match="moe_intermediate_size 30 is not divisible by 4"):
        check_model(load_config(None, ["engine.tensor_parallel=4"]), qwen_dir)
    olmoe_dir = save_random_model(random_moe_config("olmoe-clip-qkv"), tmp_path / "olmoe", seed=0, std=0.08)
    check_model(load_config(None, ["engine.tensor_parallel=2"]), olmoe_dir)  # 2 KV heads: one a rank
    with pytest.raises(Refused, match=r"OLMoE's q/k norms span all heads.*num_key_value_heads \(2\)"):
        check_model(load_config(None, ["engine.tensor_parallel=4"]), olmoe_dir)


def write_moe_metadata(writer, config, arch: str, older_converter: bool = False) -> None:
    """The metadata llama.cpp's converter writes for a MoE of `arch` (its base class's keys, then
    the architecture's own), from the HF config; `older_converter`: DeepSeek's head sizes as
    converters before the split kv_b wrote them (key_length, value_length, no *_mla keys)."""
    import gguf

    c, deepseek = config, arch == "deepseek2"
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(1 if deepseek else c.num_key_value_heads)  # MLA as one KV head
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    writer.add_expert_count(
        getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or c.n_routed_experts
    )
    writer.add_expert_used_count(c.num_experts_per_tok)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if not deepseek:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "gpt-oss":
        writer.add_sliding_window(c.sliding_window)
        writer.add_expert_feed_forward_length(c.intermediate_size)
        write_yarn(writer, c.rope_parameters)
    if not deepseek:
        return
    # DeepSeek's released config.json files name their scoring (transformers' classes leave it unset).
    scoring = getattr(c, "scoring_func", None) or ("sigmoid" if c.model_type == "deepseek_v3" else "softmax")
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType[scoring.upper()])
    if getattr(c, "n_group", None) is not None:
        writer.add_expert_group_count(c.n_group)
        writer.add_expert_group_used_count(c.topk_group)
    writer.add_leading_dense_block_count(c.first_k_dense_replace)
    if c.q_lora_rank:
        writer.add_q_lora_rank(c.q_lora_rank)
    writer.add_kv_lora_rank(c.kv_lora_rank)
    if older_converter:
        writer.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length(c.v_head_dim)
    else:
        writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        writer.add_value_length(c.kv_lora_rank)
        writer.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length_mla(c.v_head_dim)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_count(c.n_shared_experts)
    writer.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(c.qk_rope_head_dim)
    write_yarn(writer, c.rope_parameters)
    if "mscale_all_dim" in c.rope_parameters:
        writer.add_rope_scaling_yarn_log_mul(0.1 * c.rope_parameters["mscale_all_dim"])


def write_yarn(writer, rope: dict) -> None:
    """YaRN's keys, as the converter's base class writes them (no truncate, no mscale)."""
    import gguf

    if rope.get("rope_type") != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


# The largest super-scale of each K-quant's random experts: weights about the random models' size.
K_QUANT_SCALES = {"Q4_K": 5e-4, "Q5_K": 2.5e-4, "Q6_K": 5e-5}
# An expert's weight in an HF checkpoint: (the stacked name without the index, index, projection).
EXPERT_NAME = re.compile(r"(.*\.experts)\.(\d+)\.(.*)")
SHARED_EXPERT_NAME = re.compile(r".*\.shared_experts?\.(gate|up|down)_proj\.weight")


def write_moe_gguf(
    hf_dir: Path,
    path: Path,
    arch: str,
    k_quants: dict[str, str] | None = None,
    split_kv_b: bool = True,
    tokenizer_from: Path | None = None,
) -> Path:
    """A GGUF of an HF MoE dir as llama.cpp's converter writes one: every tensor named by the
    gguf package's tensor map for `arch`; each projection's experts stacked into one 3-D tensor
    of Q8_0 blocks quantized from the weights, or of the type `k_quants` names for its GGUF kind
    (ffn_gate_exps, ...): MXFP4 quantized from the weights (as llama.cpp's MXFP4_MOE files), a
    K-quant as random super-blocks of small scales; llama's (Mixtral's) Q and
    K rows permuted; the shared experts' gate, up and down (Qwen2-MoE's, DeepSeek's) Q8_0, as a
    Q8_0 file has them; Qwen2-MoE's shared expert gate as a vector; DeepSeek's kv_b_proj split into
    per-head attn_k_b (transposed) and attn_v_b (or whole, with the head sizes, as older
    converters wrote them) and its e_score_correction_bias as exp_probs_b.bias; everything else
    float32; with `tokenizer_from`, that GGUF's tokenizer metadata. The experts in `hf_dir` are
    replaced by their dequantization, so HF on that dir is the exact reference."""
    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.numpy import load_file, save_file
    from transformers import AutoConfig

    from tests.test_gguf_files import _permute
    from tests.test_kernels import random_k_quant_blocks

    config = AutoConfig.from_pretrained(hf_dir)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    # llama.cpp's Qwen2-MoE has no dense layers, so its map lacks ffn_gate / up / down: named here
    # as every other architecture names them.
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)

    def gguf_name(hf_name: str) -> str:
        suffixes = (".weight", ".bias")
        return names.get_name(hf_name, try_suffixes=suffixes) or dense_names.get_name(
            hf_name, try_suffixes=suffixes
        )

    writer = gguf.GGUFWriter(str(path), arch)
    write_moe_metadata(writer, config, arch, older_converter=not split_kv_b)
    for key, field in gguf.GGUFReader(str(tokenizer_from)).fields.items() if tokenizer_from else ():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    experts: dict[str, dict[int, str]] = {}
    for name, data in sorted(tensors.items()):
        expert = EXPERT_NAME.match(name)
        if expert:
            experts.setdefault(f"{expert[1]}.{expert[3]}", {})[int(expert[2])] = name
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = _permute(data, heads)
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            nope = config.qk_nope_head_dim
            per_head = data.reshape(config.num_attention_heads, nope + config.v_head_dim, -1)
            writer.add_tensor(
                gguf_name(name.replace("kv_b", "k_b")),
                np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)),
            )
            writer.add_tensor(
                gguf_name(name.replace("kv_b", "v_b")), np.ascontiguousarray(per_head[:, nope:])
            )
            continue
        if name.endswith("e_score_correction_bias"):  # the converter's rename before its map
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)
        if SHARED_EXPERT_NAME.fullmatch(name):
            blocks = quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            tensors[name] = np.ascontiguousarray(dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))
            continue
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    for seed, (stacked, by_expert) in enumerate(sorted(experts.items())):
        weights = np.stack([tensors[by_expert[e]] for e in sorted(by_expert)])
        kind = gguf_name(stacked).split(".")[2]
        quant = gguf.GGMLQuantizationType[(k_quants or {}).get(kind, "Q8_0")]
        if quant in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4):
            blocks = quantize(weights, quant)
        else:
            num_experts, rows, in_features = weights.shape
            scale = K_QUANT_SCALES[quant.name]
            blocks = random_k_quant_blocks(quant.name, num_experts * rows, in_features, seed, scale)
            blocks = blocks.reshape(num_experts, rows, -1)
        writer.add_tensor(gguf_name(stacked), blocks, raw_dtype=quant)
        exact = dequantize(blocks, quant)
        for e, name in by_expert.items():
            tensors[name] = np.ascontiguousarray(exact[e])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_gpt_oss_gguf(hf_dir: Path, path: Path) -> Path:
    """A GGUF of an HF gpt-oss dir with MXFP4 experts (write_mxfp4_experts) as llama.cpp's
    converter writes one: the interleaved gate/up rows (and biases) split into ffn_gate_exps and
    ffn_up_exps, each MXFP4 block repacked as ggml's (its E8M0 scale, then 16 bytes holding values
    j and j + 16), sinks as attn_sinks.weight, the router as ffn_gate_inp with its bias,
    everything else as the checkpoint has it (in float32)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config.num_hidden_layers)

    def gguf_name(hf_name: str) -> str:
        return names.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
        codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # each value's code, in order
        packed = codes[..., :16] | (codes[..., 16:] << 4)
        return torch.cat((scales.unsqueeze(-1), packed), dim=-1).flatten(-2).numpy()

    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    write_moe_metadata(writer, config, "gpt-oss")
    for name, data in sorted(tensors.items()):
        base = name.removesuffix("_blocks").removesuffix("_scales")
        experts = base.replace("gate_up_proj", "{}_proj").replace("down_proj", "{}_proj")
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):  # [E, out, G, 16], gate and up rows interleaved
            both = ggml_mxfp4(data, tensors[f"{base}_scales"])
            parts = {"gate": both[:, ::2], "up": both[:, 1::2]} if "gate_up" in name else {"down": both}
            for kind, rows in parts.items():
                writer.add_tensor(gguf_name(experts.format(kind) + ".weight"), np.ascontiguousarray(rows),
                                  raw_dtype=gguf.GGMLQuantizationType.MXFP4)  # fmt: skip
            continue
        data = data.float().numpy()
        if name.endswith("gate_up_proj_bias"):
            writer.add_tensor(
                gguf_name(experts.format("gate").removesuffix("_bias") + ".bias"), data[..., ::2].copy()
            )
            writer.add_tensor(
                gguf_name(experts.format("up").removesuffix("_bias") + ".bias"), data[..., 1::2].copy()
            )
            continue
        if name.endswith("down_proj_bias"):
            name = name.removesuffix("_bias") + ".bias"
        if name.endswith("sinks"):
            name += ".weight"
        writer.add_tensor(gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gpt_oss_gguf_with_mxfp4_experts_gives_hfs_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gpt-oss GGUF with MXFP4 experts (every 4-bit code) as the converter writes it: the
    experts stay MXFP4 in the conversion, as OpenAI's blocks and scales, and in the worker's
    memory, the decodes multiplying them in the fused op; sinks, alternating sliding and full layers, YaRN (no truncation, as every
    gpt-oss), the biased router and experts: logits of a prefill and decodes against HF on the
    MXFP4 checkpoint the GGUF was written from (HF dequantizing it itself)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tests.test_gguf_files import VOCAB, check_against_hf, gguf_runner

    # llama.cpp fixes the SwiGLU limit at gpt-oss's 7 (a GGUF records none).
    config = random_moe_config("gpt-oss", vocab_size=VOCAB, swiglu_limit=7.0)
    hf_dir = save_random_model(config, tmp_path / "hf", seed=42, std=0.08, embed_std=0.15)
    write_mxfp4_experts(hf_dir, seed=43)
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "gpt-oss.gguf")
    runner = gguf_runner(path, tmp_path, monkeypatch)
    parsed = runner.model.config
    assert parsed.attention_sinks and parsed.layer_windows == (WINDOW, 0)
    assert parsed.ropes[0].rope_type == "yarn" and not parsed.ropes[0].truncate
    assert parsed.moe is not None and parsed.moe.expert_bias and parsed.moe.swiglu_limit == 7.0
    (converted,) = (tmp_path / "cache").glob("gpt-oss-*")
    with safe_open(str(converted / "model.safetensors"), framework="pt") as weights:
        assert weights.get_slice("model.layers.1.mlp.experts.down_proj_blocks").get_dtype() == "U8"
    check_experts_stay_blocks(runner, ("MXFP4",) * 3)
    hf = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", **hf_mxfp4_dequantized()
    ).eval()
    mixtures = CountingMixtures(monkeypatch)
    check_against_hf(runner, hf)
    assert mixtures.rows == [1] * 3 * config.num_hidden_layers  # three decodes, every layer sparse


def check_experts_stay_blocks(runner: ModelRunner, formats: tuple[str, str, str]) -> None:
    """Every sparse layer holds its experts as GGUF blocks (gate, up, down in `formats`), the
    file's bytes packed by cpu_ops.to_lanes, and no float32 copy of them."""

    config = runner.model.config
    moe = config.moe
    sparse = [layer for layer in runner.model.layers if layer.moe is not None]
    assert sparse and len(sparse) == sum(moe.sparse_layers)
    hidden, inter = config.hidden_size, moe.intermediate_size
    for layer in sparse:
        experts = layer.experts_quantized
        assert experts is not None and experts.formats == formats
        assert layer.experts_gate_up.numel() == layer.experts_down.numel() == 0
        expected = 0
        for blocks, fmt, rows, columns in zip(
            (experts.gate, experts.up, experts.down),
            formats,
            (inter, inter, hidden),
            (hidden, hidden, inter),
            strict=True,
        ):
            assert blocks.dtype == torch.uint8 and blocks.shape[:2] == (moe.num_experts, rows)
            per_block = cpu_ops.SUPER_BLOCK_WEIGHTS if fmt in cpu_ops.K_QUANTS else cpu_ops.BLOCK_WEIGHTS
            expected += moe.num_experts * rows * columns // per_block * cpu_ops.PACKED_BLOCK_BYTES[fmt]
        assert experts.nbytes == expected < moe.num_experts * 3 * inter * hidden * 4 / 3


def check_shared_experts_stay_blocks(runner: ModelRunner) -> None:
    """Every sparse layer holds its shared expert (Qwen2-MoE's, DeepSeek's) as the file's Q8_0
    blocks, one expert of them packed by cpu_ops.to_lanes, and no float32 copy of them."""

    config = runner.model.config
    moe = config.moe
    sparse = [layer for layer in runner.model.layers if layer.moe is not None]
    assert sparse and len(sparse) == sum(moe.sparse_layers)
    hidden, inter = config.hidden_size, moe.shared_expert_intermediate_size
    for layer in sparse:
        shared = layer.shared_quantized
        assert shared is not None and shared.formats == ("Q8_0",) * 3
        assert layer.shared_gate_up.numel() == layer.shared_down.numel() == 0
        assert [w.shape[:2] for w in (shared.gate, shared.up, shared.down)] == [
            (1, inter),
            (1, inter),
            (1, hidden),
        ]
        assert all(w.dtype == torch.uint8 for w in (shared.gate, shared.up, shared.down))
        blocks = 3 * inter * hidden // cpu_ops.BLOCK_WEIGHTS
        assert shared.nbytes == blocks * cpu_ops.PACKED_BLOCK_BYTES["Q8_0"] < 3 * inter * hidden * 4 / 3


class CountingMixtures:
    """Counts the rows of each call of the fused few-rows ops that multiplied experts: `rows`,
    cpu_ops.moe_experts' and cpu_ops.moe_layer's (router and experts in one call; not where it
    reported a tie, whose step then goes through moe_experts); `one_call_rows`, moe_layer's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        self.one_call_rows: list[int] = []
        experts, layer = cpu_ops.moe_experts, cpu_ops.moe_layer

        def counted_experts(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self.rows.append(x.shape[0])
            return experts(x, *args, **kwargs)

        def counted_layer(x: torch.Tensor, *args) -> tuple[torch.Tensor, bool]:
            out, tied = layer(x, *args)
            if not tied:
                self.rows.append(x.shape[0])
                self.one_call_rows.append(x.shape[0])
            return out, tied

        monkeypatch.setattr(cpu_ops, "moe_experts", counted_experts)
        monkeypatch.setattr(cpu_ops, "moe_layer", counted_layer)


# family -> (GGUF architecture, config changes to fit what llama.cpp's converter can write)
GGUF_FAMILIES = {
    "mixtral": ("llama", {}),
    # A shared expert of whole Q8_0 blocks (down's 64 inputs), as a Q8_0 file holds it.
    "qwen2-moe-shared-expert": ("qwen2moe", {"shared_expert_intermediate_size": 64}),
    "qwen3-moe-norm-topk": ("qwen3moe", {"mlp_only_layers": []}),  # llama.cpp's: a router in every layer
    "olmoe-clip-qkv": ("olmoe", {"clip_qkv": None}),  # its converter writes no clip_qkv
}


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_moe_gguf_gives_hfs_logits(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each MoE family through its GGUF, experts from Q8_0 blocks: logits of a prefill and decodes
    against HF on the dequantized weights. Mixtral as a `llama` file (Q and K rows permuted),
    Qwen2-MoE with its shared expert and a dense layer (no ffn_gate_inp there), Qwen3-MoE with
    renormalized top-k, OLMoE with its q/k norms over all heads. The experts stay Q8_0 blocks in
    memory: the decodes multiply them in the fused op, the prefill dequantizes the selected ones."""
    from transformers import AutoModelForCausalLM

    from tests.test_gguf_files import VOCAB, check_against_hf, gguf_runner

    arch, changes = GGUF_FAMILIES[family]
    config = random_moe_config(family, vocab_size=VOCAB, tie_word_embeddings=False, **changes)
    hf_dir = save_random_model(config, tmp_path / "hf", seed=40, std=0.08, embed_std=0.15)
    path = write_moe_gguf(hf_dir, tmp_path / f"{arch}.gguf", arch)
    runner = gguf_runner(path, tmp_path, monkeypatch)
    parsed = runner.model.config
    assert parsed.architecture == FAMILIES[family][0].replace("Config", "ForCausalLM")
    assert parsed.moe is not None and (parsed.moe.num_experts, parsed.moe.top_k) == (8, 2)
    assert parsed.moe.norm_topk_prob == (family in ("mixtral", "qwen3-moe-norm-topk"))
    if arch == "qwen2moe":
        assert parsed.moe.sparse_layers == (False, True, False)
        assert parsed.moe.shared_expert_intermediate_size == 64
    if arch == "olmoe":
        assert parsed.qk_norm_whole
    check_experts_stay_blocks(runner, ("Q8_0",) * 3)
    if arch == "qwen2moe":
        check_shared_experts_stay_blocks(runner)
    mixtures = CountingMixtures(monkeypatch)
    check_against_hf(runner, AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())
    # Three decodes, each sparse layer: its routed experts, and its shared expert in its own call.
    calls_per_layer = 2 if arch == "qwen2moe" else 1
    assert mixtures.rows == [1] * 3 * sum(parsed.moe.sparse_layers) * calls_per_layer
    assert mixtures.one_call_rows == [1] * 3 * sum(parsed.moe.sparse_layers)  # the routed experts


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe-shared-expert"])
def test_moe_gguf_batched_steps_from_expert_blocks_match_hf(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Mixtral GGUF, and a Qwen2-MoE one with its shared expert, with Q8_0 experts through the
    families' check (batched prefill, decodes of two and three sequences, a prefix-cache hit of
    10 rows, a preemption recomputed in chunks): the decode steps' rows share experts in the
    fused op (the shared expert's blocks too), the wider steps dequantize the selected experts
    (and the shared one)."""
    from transformers import AutoModelForCausalLM

    from tests.test_gguf_files import gguf_runner

    arch, changes = GGUF_FAMILIES[family]
    config = random_moe_config(family, tie_word_embeddings=False, **changes)
    hf_dir = save_random_model(config, tmp_path / "hf", seed=44, std=0.08, embed_std=0.15)
    runner = gguf_runner(write_moe_gguf(hf_dir, tmp_path / f"{arch}.gguf", arch), tmp_path, monkeypatch)
    check_experts_stay_blocks(runner, ("Q8_0",) * 3)
    if arch == "qwen2moe":
        check_shared_experts_stay_blocks(runner)
    mixtures = CountingMixtures(monkeypatch)
    check_against_hf(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), runner)
    assert {2, 3} <= set(mixtures.rows) and max(mixtures.rows) <= 16


def test_mixtral_gguf_with_k_quant_experts_gives_hfs_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Mixtral whose experts are K-quants as in a Q4_K_M file (gate and up Q4_K, down Q6_K;
    hidden and expert sizes of 256, whole super-blocks): each expert's own super-blocks dequantize
    to HF's reference weights, and stay those super-blocks in memory."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tests.test_gguf_files import VOCAB, check_against_hf, gguf_runner

    config = random_moe_config(
        "mixtral", vocab_size=VOCAB, hidden_size=256, intermediate_size=256, head_dim=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    hf_dir = save_random_model(config, tmp_path / "hf", seed=41, std=0.05, embed_std=0.15)
    k_quants = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"}
    path = write_moe_gguf(hf_dir, tmp_path / "mixtral.gguf", "llama", k_quants=k_quants)
    runner = gguf_runner(path, tmp_path, monkeypatch)
    (converted,) = (tmp_path / "cache").glob("mixtral-*")
    with safe_open(str(converted / "quantized.safetensors"), framework="numpy") as blocks:
        formats = json.loads(blocks.metadata()["formats"])
    assert formats["model.layers.1.block_sparse_moe.experts.7.w1.weight"] == "Q4_K"
    assert formats["model.layers.1.block_sparse_moe.experts.7.w2.weight"] == "Q6_K"
    check_experts_stay_blocks(runner, ("Q4_K", "Q4_K", "Q6_K"))
    mixtures = CountingMixtures(monkeypatch)
    check_against_hf(runner, AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())
    assert mixtures.rows == [1] * 3 * config.num_hidden_layers


def test_qwen3_moe_gguf_with_mxfp4_experts_gives_hfs_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Qwen3-MoE GGUF whose experts are MXFP4 (llama.cpp's MXFP4_MOE files, any family's
    experts; gguf's quantizer): logits of a prefill and decodes against HF on their
    dequantization; the experts stay MXFP4 blocks, the decodes multiplying them in the fused op."""
    from transformers import AutoModelForCausalLM

    from tests.test_gguf_files import VOCAB, check_against_hf, gguf_runner

    arch, changes = GGUF_FAMILIES["qwen3-moe-norm-topk"]
    config = random_moe_config("qwen3-moe-norm-topk", vocab_size=VOCAB, **changes)
    hf_dir = save_random_model(config, tmp_path / "hf", seed=45, std=0.08, embed_std=0.15)
    mxfp4 = dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), "MXFP4")
    runner = gguf_runner(
        write_moe_gguf(hf_dir, tmp_path / "qwen3moe.gguf", arch, k_quants=mxfp4), tmp_path, monkeypatch
    )
    check_experts_stay_blocks(runner, ("MXFP4",) * 3)
    mixtures = CountingMixtures(monkeypatch)
    check_against_hf(runner, AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())
    assert mixtures.rows == [1] * 3 * config.num_hidden_layers


def write_gguf_stub(path: Path, arch: str, tensors: list[str], **fields) -> Path:
    """A GGUF of two layers with only metadata (`fields`, as {arch}.key) and zero tensors of the
    given names: what check_gguf reads."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    adders = {
        bool: writer.add_bool,
        int: writer.add_uint32,
        float: writer.add_float32,
        str: writer.add_string,
    }
    for key, value in fields.items():
        adders[type(value)](f"{arch}.{key}", value)
    for name in tensors:
        writer.add_tensor(name, np.zeros((4, 8) if name.endswith(".weight") else 8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


ROUTERS = ["blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight"]
BIASES = ["blk.0.exp_probs_b.bias", "blk.1.exp_probs_b.bias"]
EXPERT_WEIGHTS = [f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down")]
# case -> (architecture, tensors, metadata, the refusal)
GGUF_MOE_REFUSED = {
    "experts in another architecture": ("qwen2", [], dict(expert_count=8),
        "unsupported GGUF mixture of experts of architecture 'qwen2'"),
    "sigmoid scores outside deepseek2": ("olmoe", ROUTERS, dict(expert_count=8, expert_gating_func=2),
        r"unsupported GGUF olmoe.expert_gating_func 2 \(sigmoid\) for olmoe; supported: 1 \(softmax\)"),
    "unknown gating function": ("deepseek2", ROUTERS, dict(expert_count=8, expert_gating_func=4),
        r"unsupported GGUF deepseek2.expert_gating_func 4 \(unknown\)"),
    "expert groups outside deepseek2": ("qwen3moe", ROUTERS, dict(expert_count=8, expert_group_count=4),
        "unsupported GGUF qwen3moe.expert_group_count 4 for qwen3moe"),
    "weight scale outside deepseek2": ("llama", ROUTERS, dict(expert_count=8, expert_weights_scale=2.5),
        "unsupported GGUF llama.expert_weights_scale 2.5 for mixtral"),
    "a mixtral layer without a router": ("llama", ROUTERS[:1], dict(expert_count=8),
        r"unsupported GGUF mixtral with routers \(ffn_gate_inp\) in layers \[0\]"),
    "deepseek2 routers in the leading dense layers": ("deepseek2", ROUTERS, dict(
        expert_count=8, leading_dense_block_count=1), r"deepseek2 with routers \(ffn_gate_inp\) in layers \[0, 1\]"),
    "deepseek2 sigmoid without the correction bias": ("deepseek2", ROUTERS, dict(expert_count=8, expert_gating_func=2),
        r"deepseek2 with sigmoid expert scores and a correction bias \(exp_probs_b\) in layers \[\]"),
    "deepseek2 softmax with a correction bias": ("deepseek2", ROUTERS + BIASES, dict(expert_count=8),
        r"deepseek2 with softmax expert scores and a correction bias \(exp_probs_b\) in layers \[0, 1\]"),
    "half of a split kv_b": ("deepseek2", [*ROUTERS, "blk.1.attn_k_b.weight"], dict(expert_count=8),
        "unsupported GGUF blk.1.attn_k_b without its other half"),
    "gpt-oss experts without their biases": ("gpt-oss", ROUTERS + EXPERT_WEIGHTS, dict(expert_count=8),
        r"unsupported GGUF gpt-oss without \['blk.0.ffn_gate_exps.bias', 'blk.0.ffn_up_exps.bias'"),
    "yarn outside deepseek2": ("llama", ROUTERS, dict(expert_count=8, **{"rope.scaling.type": "yarn"}),
        r"unsupported GGUF rope scaling type 'yarn' \(llama\); supported: none, linear"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(GGUF_MOE_REFUSED))
def test_moe_gguf_routing_brigade_cannot_run_is_refused_by_name(case: str, tmp_path: Path) -> None:
    """What a MoE GGUF records that its family's HF class does not compute is refused before any
    conversion (so before ready), naming the key or tensor and what is supported."""
    import gguf

    from services.gpu_worker.loader import check_gguf, prepare_model

    arch, tensors, fields, message = GGUF_MOE_REFUSED[case]
    path = write_gguf_stub(tmp_path / "model.gguf", arch, tensors, **fields)
    with pytest.raises(UnsupportedModel, match=message):
        check_gguf(gguf.GGUFReader(str(path)))
    with pytest.raises(UnsupportedModel, match=message):
        prepare_model(str(path), cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").glob("*") if not p.name.startswith(".")]


def test_moe_bench_reads_each_selected_expert_once_per_step(tmp_path: Path) -> None:
    """benchmarks/moe_bench.py at a tiny shape: its counted weight bytes per step are the floor
    (the router and each distinct selected expert once), below reading every (token, expert)
    pair's expert once many rows share experts; both stacks are timed; the Q8_0 stacks compare the
    fused op's MoE with the dense stack from the same blocks (the few-rows op, which takes one row
    but not 16) and count the experts' blocks each step reads against the floor; the targets
    (MoE / dense at one row against 1.3x, bytes per token against the floor at 16 rows) are
    reported per stack; its quantized-experts table times a layer from Q8_0 blocks (the fused op,
    then dequantize + GEMM past MOE_MAX_ROWS); MXFP4 (gpt-oss's experts' format) runs the same
    stacks and table; and a missing llama-server skips that comparison, saying why."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    out = tmp_path / "moe.json"
    args = [
        "--experts",
        "8",
        "--top-k",
        "2",
        "--hidden",
        "64",
        "--expert-intermediate",
        "32",
        "--layers",
        "2",
        "--quantized",
        "Q8_0,MXFP4",
        "--quantized-batch",
        "1,8,32",
        "--llama-server",
        str(tmp_path / "no-llama-server"),
    ]
    proc = subprocess.run(
        [sys.executable, "benchmarks/moe_bench.py", "--json", str(out), "--repeats", "2", "--batch", "1,16", *args],
        cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, sixteen = json.loads(out.read_text())["results"]
    assert one["read_over_floor"] == sixteen["read_over_floor"] == 1.0
    assert (
        one["weight_bytes_read_per_token"] == one["per_pair_bytes_per_token"]
    )  # one row: every expert distinct
    assert sixteen["weight_bytes_read_per_token"] < sixteen["per_pair_bytes_per_token"] / 4
    assert one["moe_step_ms"] > 0 and one["dense_step_ms"] > 0
    quantized = json.loads(out.read_text())["quantized"]
    assert [(row["format"], row["rows"], row["blocks_path"]) for row in quantized] == [
        (fmt, rows, path) for fmt in ("Q8_0", "MXFP4")
        for rows, path in ((1, "fused op"), (8, "fused op"), (32, "dequantize + GEMM"))
    ]  # fmt: skip
    # Packed, a block of 32 weights takes 36 bytes in Q8_0 and 20 in MXFP4, against float32's 128.
    packed_bytes = {"Q8_0": 36, "MXFP4": 20}
    assert all(
        row["blocks_expert_bytes"] * 128 == row["float32_expert_bytes"] * packed_bytes[row["format"]]
        for row in quantized
    )
    assert all(row["float32_ms"] > 0 and row["blocks_ms"] > 0 for row in quantized)
    report = json.loads(out.read_text())
    q_one, q_sixteen = report["quantized_stacks"]["Q8_0"]
    assert q_one["moe_step_ms"] > 0 and q_one["dense_step_ms"] > 0 and q_one["moe_over_dense"] > 0
    assert q_sixteen["dense_step_ms"] is None  # 16 rows: past the dense few-rows op
    # Each selected expert's blocks once: 2 layers of (float32 router 8 x 64, and per pair an
    # expert's gate, up [32, 64] and down [64, 32] at 36 bytes a Q8_0 block of 32).
    expert_blocks = (2 * 32 * 64 + 64 * 32) // 32 * 36
    assert q_one["weight_bytes_read_per_token"] == 2 * (8 * 64 * 4 + 2 * expert_blocks)
    assert q_one["read_over_floor"] == q_sixteen["read_over_floor"] == 1.0
    assert q_sixteen["weight_bytes_read_per_token"] < q_sixteen["per_pair_bytes_per_token"] / 4
    targets = report["targets"]
    assert set(targets) == {"float32", "Q8_0", "MXFP4"}
    assert report["quantized_stacks"]["MXFP4"][0]["read_over_floor"] == 1.0
    assert targets["Q8_0"]["moe_over_dense_1_row"] == q_one["moe_over_dense"]
    assert targets["Q8_0"]["ratio_target"] == 1.3
    assert targets["Q8_0"]["ratio_met"] == (q_one["moe_over_dense"] <= 1.3)
    assert (targets["Q8_0"]["widest_rows"], targets["Q8_0"]["read_over_floor"]) == (16, 1.0)
    assert "no llama-server" in report["llamacpp"]["skipped"]


@pytest.mark.parametrize(
    ("family", "config_bias", "want"),
    [
        # (qkv, o_proj, mlp) biases, as each family's HF attention builds its projections.
        ("qwen3-moe-norm-topk", dict(attention_bias=True), (True, True, False)),
        ("olmoe-clip-qkv", dict(attention_bias=True), (True, True, False)),
        ("qwen2-moe-shared-expert", dict(), (True, False, False)),  # qkv_bias defaults to true
        ("qwen2-moe-shared-expert", dict(qkv_bias=False), (False, False, False)),
        ("mixtral", dict(attention_bias=True), (False, False, False)),  # MixtralAttention has none
        ("gpt-oss", dict(), (True, True, False)),  # attention_bias defaults to true
        ("gpt-oss", dict(attention_bias=False), (False, False, False)),
    ],
)
def test_moe_bias_flags_follow_each_familys_hf_class(family: str, config_bias: dict, want: tuple) -> None:
    config = random_moe_config(family, **config_bias).to_dict()
    config["architectures"] = [FAMILIES[family][0].replace("Config", "ForCausalLM")]
    parsed = ModelConfig.from_dict(config)
    assert (parsed.attention_bias, parsed.o_proj_bias, parsed.mlp_bias) == want
