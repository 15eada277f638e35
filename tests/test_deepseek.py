"""DeepSeek-V2 and V3 against HF transformers on the same random weights, in float32: multi-head
latent attention over a cache of latents and rope keys (decoded in the absorbed form and in the
up-projected one), V2's softmax routing with group-limited greedy top-k (and V2-Lite's q_proj),
V3's sigmoid scores with the correction bias and its group-limited top-k, shared experts,
routed_scaling_factor, the first dense layers, and YaRN with its mscale. Through the ModelRunner
(test_families.check_against_hf: batched prefill, decodes, a prefix-cache hit, a preemption), two
ranks over gloo, and served end to end through real processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.gpu_worker.architectures import ModelConfig, MoeConfig, UnsupportedModel
from services.gpu_worker.model import moe_route
from services.gpu_worker.model_runner import ModelRunner
from tests.conftest import TINY_VOCAB_SIZE, save_random_model
from tests.test_families import BLOCK, COMMON, check_against_hf
from tests.test_family_serving import hf_greedy, served_greedy

pytestmark = pytest.mark.timeout(300)

MLA = dict(
    num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
    num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=32, num_experts_per_tok=2,
    n_routed_experts=8, n_group=4, topk_group=2, tie_word_embeddings=False,
)  # fmt: skip
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8,
}  # fmt: skip
# variant -> (transformers config class name, its arguments beyond COMMON and MLA)
VARIANTS = {
    "v3": ("DeepseekV3Config", dict(q_lora_rank=24, routed_scaling_factor=2.5, n_shared_experts=1)),
    "v3-yarn-no-norm-topk": ("DeepseekV3Config", dict(
        q_lora_rank=24, routed_scaling_factor=1.5, norm_topk_prob=False, n_shared_experts=2,
        rope_parameters=YARN,
    )),
    # V2-Lite's shape: no q_lora_rank (q_proj), greedy top-k.
    "v2-lite": ("DeepseekV2Config", dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2)),
    # One group of two experts: V2's group score (its best expert) then binds the top 2.
    "v2-group-limited": ("DeepseekV2Config", dict(
        q_lora_rank=24, topk_method="group_limited_greedy", topk_group=1, routed_scaling_factor=2.0,
        n_shared_experts=1,
    )),
}  # fmt: skip


def random_deepseek_config(variant: str, **overrides):
    import transformers

    class_name, extra = VARIANTS[variant]
    return getattr(transformers, class_name)(**{**COMMON, **MLA, **extra, **overrides})


def save_deepseek(config, out: Path, seed: int, **kwargs) -> Path:
    """save_random_model, with V3's e_score_correction_bias (a buffer, saved as zeros) redrawn
    large enough to change which experts win."""
    from safetensors.torch import load_file, save_file

    path = save_random_model(config, out, seed=seed, std=0.08, embed_std=0.15, **kwargs)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=generator) * 0.3
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def deepseek_dir(request, tmp_path_factory) -> tuple[str, Path]:
    variant = request.param
    out = tmp_path_factory.mktemp(variant)
    return variant, save_deepseek(
        random_deepseek_config(variant), out, seed=70 + sorted(VARIANTS).index(variant)
    )


@pytest.mark.parametrize("absorbed_decode", [True, False], ids=["absorbed", "up-projected"])
def test_deepseek_matches_hf(deepseek_dir: tuple[str, Path], absorbed_decode: bool) -> None:
    variant, path = deepseek_dir
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK)
    runner.model.mla_absorbed_decode = absorbed_decode
    config = runner.model.config
    assert config.mla is not None and config.moe is not None
    assert config.moe.sparse_layers == (False, True, True)  # first_k_dense_replace
    assert (config.mla.q_lora_rank == 0) == (variant == "v2-lite")
    if variant.startswith("v3"):
        assert config.moe.scoring == "sigmoid" and config.moe.num_groups == 4
        assert runner.model.layers[1].router_correction_bias.abs().min() > 0  # really in play
    if variant == "v3-yarn-no-norm-topk":
        assert config.ropes[0].rope_type == "yarn"
        assert config.softmax_scale != pytest.approx(config.mla.qk_head_dim**-0.5)  # mscale_all_dim
    check_against_hf(load_hf(path), runner)


@pytest.mark.parametrize("variant", ["v3", "v2-lite"])
def test_deepseek_without_shared_experts_matches_hf(variant: str, tmp_path: Path) -> None:
    """n_shared_experts 0: HF still builds (and saves) a zero-width shared_experts MLP, which adds
    nothing; the checkpoint loads and runs as HF's."""
    path = save_deepseek(random_deepseek_config(variant, n_shared_experts=0), tmp_path / variant, seed=4)
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK)
    assert runner.model.config.moe.shared_expert_intermediate_size == 0
    check_against_hf(load_hf(path), runner)


def test_deepseek_triton_experts_match_hf(tmp_path: Path) -> None:
    """On the Triton backend (in the interpreter on CPU tensors) a V3's experts run as the fused
    grouped GEMMs, with the routed_scaling_factor in the routing weights; latent attention stays
    torch: HF's logits and greedy tokens through prefill, decodes, a prefix hit and a preemption."""
    from kernels.fused_moe import fused_moe_triton

    path = save_deepseek(random_deepseek_config("v3"), tmp_path / "v3", seed=3)
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK, backend="triton")
    assert runner.model.fused_experts is fused_moe_triton
    check_against_hf(load_hf(path), runner)


def test_latent_cache_holds_latents_and_rope_keys_and_the_budget_counts_them(tmp_path: Path) -> None:
    """Each layer's pages are the latent (kv_lora_rank) and the rope key (qk_rope_head_dim) of a
    token, not its heads; the worker's block count and preflight's budget use those bytes."""
    from ipc.config import load_config
    from supervision.preflight import Refused, check_model

    path = save_deepseek(random_deepseek_config("v3", max_position_embeddings=4096), tmp_path / "v3", seed=1)
    budget = 1 << 20
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=budget, block_size=BLOCK)
    bytes_per_block = 3 * BLOCK * (32 + 8) * 4  # layers * tokens * (latent + rope key) * float32
    assert runner.num_kv_blocks == budget // bytes_per_block == 136
    for latent, rope in runner.kv_cache:
        assert latent.shape == (136, BLOCK, 1, 32)
        assert rope.shape == (136, BLOCK, 1, 8)
    # Preflight: 1 MiB holds 136 blocks, 2176 tokens; 4 heads * head_dim (as config.json's
    # head_dim, the rope's 8) would count 3072 bytes a block and let 4096 tokens through.
    overrides = ["model.dtype=float32", "engine.kv_cache_mib=1", f"engine.block_size={BLOCK}"]
    check_model(load_config(None, [*overrides, "model.max_model_len=2048"]), path)
    with pytest.raises(Refused, match=r"holds 136 KV block\(s\) of 16 tokens .*\(7680 bytes each"):
        check_model(load_config(None, [*overrides, "model.max_model_len=4096"]), path)


def test_preflight_splits_latent_attention_by_heads(tmp_path: Path) -> None:
    """Whatever num_key_value_heads config.json says (V3's default is 128), the latent is one
    shared KV head: tensor_parallel must divide the attention heads (4) and nothing else of it."""
    from ipc.config import load_config
    from supervision.preflight import Refused, check_model

    path = save_deepseek(random_deepseek_config("v3", num_key_value_heads=128), tmp_path / "v3", seed=4)
    check_model(load_config(None, ["engine.tensor_parallel=2"]), path)
    with pytest.raises(Refused, match="its 4 attention heads do not divide evenly over 3 ranks"):
        check_model(load_config(None, ["engine.tensor_parallel=3"]), path)


def test_mla_attention_matches_hfs_attention_module(tmp_path: Path) -> None:
    """One layer's attention against DeepseekV3Attention on the same input: a prompt of 21 tokens
    in two chunks (the second over the cached latents of the first), then a decode row in both
    forms; V3's YaRN rotary table and mscale."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_module

    from services.gpu_worker.mla import mla_attention
    from services.gpu_worker.model import LlamaModel
    from tests.test_model import PlanBuilder

    hf_config = random_deepseek_config("v3-yarn-no-norm-topk")
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = hf_module.DeepseekV3Attention(hf_config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attention.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    rotary = hf_module.DeepseekV3RotaryEmbedding(hf_config)
    hidden = torch.randn(1, 22, hf_config.hidden_size)
    positions = torch.arange(22).unsqueeze(0)
    causal = torch.full((22, 22), float("-inf")).triu(1).view(1, 1, 22, 22)
    with torch.no_grad():
        expected = attention(hidden, rotary(hidden, positions), causal)[0][0]

    config = ModelConfig.from_dict(hf_config.to_dict())
    model = LlamaModel(config, torch.float32, torch.device("cpu"), BLOCK)
    layer = model.layers[0]
    for key, dst in layer.mla.slots().items():
        dst.copy_(attention.get_submodule(key.removesuffix(".weight")).weight.detach())
    caches = (torch.zeros(4, BLOCK, 1, 32), torch.zeros(4, BLOCK, 1, 8))
    builder = PlanBuilder(BLOCK)
    ids = list(range(3, 25))

    def run(tokens: list[int], absorbed_decode: bool = True) -> torch.Tensor:
        arrays, header = builder.plan([(0, tokens, True)])
        meta = model.prepare(arrays, header.num_tokens, header.num_seqs)[0]
        start = builder.num_cached[0] - len(tokens)
        x = hidden[0, start : start + len(tokens)]
        with torch.no_grad():
            return mla_attention(
                x, layer.mla, *caches, meta, config.softmax_scale, absorbed_decode=absorbed_decode
            )

    got = torch.cat((run(ids[:13]), run(ids[13:21])))
    heads_out = expected.new_zeros(0)
    with torch.no_grad():  # HF's output is after o_proj: compare ours through the same o_proj
        heads_out = torch.nn.functional.linear(got, attention.o_proj.weight)
    torch.testing.assert_close(heads_out, expected[:21], atol=1e-5, rtol=1e-4)
    for absorbed_decode in (True, False):
        decoded = run(ids[21:], absorbed_decode)
        builder.num_cached[0] -= 1  # the same token again, in the other form
        torch.testing.assert_close(
            torch.nn.functional.linear(decoded, attention.o_proj.weight), expected[21:], atol=1e-5, rtol=1e-4
        )


@pytest.mark.parametrize("variant", ["v2-group-limited", "v3"])
def test_group_limited_routing_matches_hfs_router(variant: str) -> None:
    """Our routing against HF's own router module on the same logits: the same experts chosen
    (as sets) and the same weights, with the V3 correction bias steering the choice."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    hf_config = random_deepseek_config(variant, topk_group=1)
    module = modeling_deepseek_v3 if variant == "v3" else modeling_deepseek_v2
    router_class = module.DeepseekV3TopkRouter if variant == "v3" else module.DeepseekV2TopkRouter
    router = router_class(hf_config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5, generator=generator)
        if variant == "v3":
            router.e_score_correction_bias.normal_(0.0, 0.5, generator=generator)
    x = torch.randn(64, hf_config.hidden_size, generator=generator)
    _, hf_weights, hf_experts = router(x)
    moe = ModelConfig.from_dict(hf_config.to_dict()).moe
    bias = router.e_score_correction_bias if variant == "v3" else None
    weights, experts = moe_route(torch.nn.functional.linear(x, router.weight), moe, bias)
    hf_order, order = hf_experts.argsort(dim=-1), experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), hf_experts.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    # The group limit really binds: some token's best experts by score alone lie outside its groups.
    logits = x @ router.weight.T
    unlimited = torch.topk(logits if bias is None else torch.sigmoid(logits) + bias, 2)[1]
    assert not torch.equal(unlimited.sort(dim=-1)[0], experts.sort(dim=-1)[0])
    if variant == "v3":
        # Biases so negative that every choice value is below 0 (HF's choice is the same, it only
        # shifts them): the dropped groups' experts must be -inf to it, not 0, or they win.
        with torch.no_grad():
            router.e_score_correction_bias.sub_(3.0)
        _, hf_weights, hf_experts = router(x)
        weights, experts = moe_route(torch.nn.functional.linear(x, router.weight), moe, bias)
        hf_order, order = hf_experts.argsort(dim=-1), experts.argsort(dim=-1)
        assert torch.equal(experts.gather(1, order), hf_experts.gather(1, hf_order))
        torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


@pytest.mark.parametrize(
    ("variant", "changes", "message"),
    [
        ("v3", {"scoring_func": "softmax"}, r"scoring_func='softmax'.*supported: scoring_func='sigmoid'"),
        ("v3", {"topk_method": "greedy"}, r"topk_method='greedy'.*'noaux_tc'"),
        ("v2-group-limited", {"topk_method": "noaux_tc"}, r"topk_method='noaux_tc'"),
        ("v2-group-limited", {"norm_topk_prob": True}, r"norm_topk_prob=True \(deepseek_v2\)"),
        ("v3", {"n_group": 3}, r"n_group=3"),
        ("v3", {"attention_bias": True}, r"attention_bias in deepseek_v3's latent attention"),
        ("v3", {"quantization_config": {"quant_method": "fp8"}}, r"quant_method 'fp8'"),
    ],
)
def test_what_deepseek_brigade_cannot_run_is_refused_by_name(
    variant: str, changes: dict, message: str
) -> None:
    config = {**random_deepseek_config(variant).to_dict(), **changes}
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_dict(config)


def test_a_bfloat16_cache_for_latent_attention_is_refused_by_name(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """engine.kv_cache_dtype=bfloat16 is the C++ and torch paths' over K and V heads; the latent
    caches stay in the model's dtype, refused at preflight and by the worker."""
    from ipc.config import load_config
    from services.gpu_worker.architectures import config_from_dir
    from services.gpu_worker.draft import DraftModel
    from supervision.preflight import Refused, check_model

    path = save_deepseek(random_deepseek_config("v3"), tmp_path / "v3", seed=5)
    with pytest.raises(Refused, match=r"kv_cache_dtype=bfloat16 cannot serve .*latent attention"):
        check_model(load_config(None, ["engine.kv_cache_dtype=bfloat16"]), path)
    with pytest.raises(
        ValueError, match=r"latent attention \(DeepSeek\) keeps its caches in the model's dtype"
    ):
        ModelRunner(
            path, dtype="float32", kv_cache_bytes=1 << 20, block_size=BLOCK, kv_cache_dtype="bfloat16"
        )
    # Its own dtype is no rounding: a bfloat16 model's latent caches are bfloat16 anyway.
    check_model(load_config(None, ["engine.kv_cache_dtype=bfloat16", "model.dtype=bfloat16"]), path)
    # As a draft model, under a target without latent attention: refused the same way.
    draft = ["speculative.method=draft_model", f"speculative.model={path}", "engine.kv_cache_dtype=bfloat16"]
    with pytest.raises(Refused, match=r"cannot serve the draft model .*latent attention"):
        check_model(load_config(None, draft), tiny_model_dir)
    with pytest.raises(ValueError, match=r"the draft model .* has latent attention"):
        DraftModel(
            path, config_from_dir(path), torch.float32, torch.bfloat16, torch.device("cpu"), BLOCK, None
        )


def test_a_lora_adapter_on_latent_attention_is_refused_by_name(tmp_path: Path) -> None:
    """The adapter slots add deltas to q/k/v/o heads, which latent attention does not have."""
    from services.gpu_worker.lora import AdapterError

    path = save_deepseek(random_deepseek_config("v3"), tmp_path / "v3", seed=2)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"]}'
    )
    with pytest.raises(
        AdapterError, match=r"'a': DeepseekV3ForCausalLM \(multi-head latent attention\) takes no"
    ):
        ModelRunner(
            path, dtype="float32", kv_cache_bytes=1 << 20, block_size=BLOCK, max_loras=1,
            lora_adapters={"a": str(adapter)},
        )  # fmt: skip


@pytest.mark.parametrize("variant", ["v3", "v2-lite"])
def test_moe_layer_freq_other_than_one_is_refused(variant: str) -> None:
    """transformers reads only first_k_dense_replace (every later layer a mixture), DeepSeek's
    own code makes the layers off moe_layer_freq's stride dense: a checkpoint with another
    moe_layer_freq than 1 (every DeepSeek checkpoint's) runs one way or the other, so it is
    refused by name; 1 is the same under both rules."""
    config = {**random_deepseek_config(variant, num_hidden_layers=6).to_dict(), "moe_layer_freq": 2}
    with pytest.raises(UnsupportedModel, match=r"moe_layer_freq=2"):
        ModelConfig.from_dict(config)
    moe = ModelConfig.from_dict({**config, "moe_layer_freq": 1}).moe
    assert isinstance(moe, MoeConfig)
    assert moe.sparse_layers == (False, True, True, True, True, True)


# variant -> (config changes, whether kv_b_proj is split into attn_k_b / attn_v_b as today's
# converter writes it, or whole as older converters wrote it)
GGUF_VARIANTS = {
    "v3-yarn-no-norm-topk": ({}, True),
    "v2-group-limited": ({}, True),
    # V2-Lite's own single group: a GGUF does not record topk_method, so its groups route
    # group-limited (as llama.cpp runs them), and HF's greedy V2 has none.
    "v2-lite": ({"n_group": 1, "topk_group": 1}, False),
}


@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
def test_deepseek_gguf_gives_hfs_logits(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V3 and V2 through `deepseek2` GGUFs as llama.cpp's converter writes them, experts
    from Q8_0 blocks: the latent attention (q_a / q_b or V2-Lite's q, kv_a_mqa, kv_b whole or
    split per head), V3's sigmoid scores with exp_probs_b, group-limited routing from the expert
    group counts, the weight scale, the leading dense layer, shared experts, YaRN with its mscale
    from yarn_log_multiplier; logits of a prefill and decodes against HF on the dequantized
    weights. The routed experts stay Q8_0 blocks in memory (the fused op's in the decodes)."""
    from tests.test_gguf_files import VOCAB, check_against_hf, gguf_runner
    from tests.test_moe import (
        CountingMixtures,
        check_experts_stay_blocks,
        check_shared_experts_stay_blocks,
        write_moe_gguf,
    )

    changes, split_kv_b = GGUF_VARIANTS[variant]
    config = random_deepseek_config(variant, vocab_size=VOCAB, **changes)
    hf_dir = save_deepseek(config, tmp_path / "hf", seed=80)
    path = write_moe_gguf(hf_dir, tmp_path / "deepseek2.gguf", "deepseek2", split_kv_b=split_kv_b)
    runner = gguf_runner(path, tmp_path, monkeypatch)
    parsed = runner.model.config
    assert parsed.architecture == VARIANTS[variant][0].replace("Config", "ForCausalLM")
    assert parsed.mla is not None and (parsed.mla.q_lora_rank == 0) == (variant == "v2-lite")
    assert parsed.moe is not None and parsed.moe.sparse_layers == (False, True, True)
    assert parsed.moe.num_groups == (1 if variant == "v2-lite" else 4)
    assert parsed.moe.routed_scaling_factor == config.routed_scaling_factor
    if variant.startswith("v3"):
        assert (
            parsed.ropes[0].rope_type == "yarn"
            and runner.model.layers[1].router_correction_bias.abs().min() > 0
        )
    check_experts_stay_blocks(runner, ("Q8_0",) * 3)
    check_shared_experts_stay_blocks(runner)
    mixtures = CountingMixtures(monkeypatch)
    check_against_hf(runner, load_hf(hf_dir))
    # Three decodes, two sparse layers, each its routed experts and its shared ones in two calls.
    assert mixtures.rows == [1] * 3 * 2 * 2


def test_a_deepseek2_gguf_hf_would_route_otherwise_is_refused_before_conversion(tmp_path: Path) -> None:
    """A `deepseek2` GGUF with softmax scores (V2) and expert_weights_norm: DeepSeek's own code
    renormalizes then, transformers' V2 does not; refused by the converted config's name before
    any weight is converted, leaving no cache."""
    from services.gpu_worker.loader import prepare_model
    from tests.test_moe import write_moe_gguf

    config = random_deepseek_config("v2-lite", n_group=1, topk_group=1, norm_topk_prob=True)
    hf_dir = save_deepseek(config, tmp_path / "hf", seed=81)
    path = write_moe_gguf(hf_dir, tmp_path / "deepseek2.gguf", "deepseek2")
    with pytest.raises(UnsupportedModel, match=r"norm_topk_prob=True \(deepseek_v2\)"):
        prepare_model(str(path), cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").glob("*") if not p.name.startswith(".")]


def test_deepseek_tensor_parallel_matches_hf(tmp_path: Path) -> None:
    """Two ranks over gloo: each holds its heads' rows of q_b and kv_b and its heads' columns of
    o_proj, the latent projection, its norm and cache whole; HF's logits and greedy tokens through
    chunked prefill and decodes."""
    from tests.test_moe import check_tensor_parallel_against_hf, full_and_rank_models

    model_dir = save_deepseek(random_deepseek_config("v3"), tmp_path / "v3", seed=32)
    full, parts = full_and_rank_models(model_dir)
    for rank, part in enumerate(parts):
        layer, whole = part.layers[1].mla, full.layers[1].mla
        assert torch.equal(layer.q_b, whole.q_b[48 * rank : 48 * (rank + 1)])  # 2 heads of 16 + 8
        assert torch.equal(layer.kv_b, whole.kv_b[80 * rank : 80 * (rank + 1)])  # 2 heads of 16 + 24
        assert torch.equal(layer.kv_a, whole.kv_a)
    check_tensor_parallel_against_hf(model_dir)


@pytest.fixture(scope="module")
def served_deepseek_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random DeepSeek-V3 with SmolLM2's tokenizer."""
    config = random_deepseek_config(
        "v3", vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    return save_deepseek(
        config, tmp_path_factory.mktemp("deepseek-serving"), seed=20, tokenizer_from=smollm2_dir
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepseek_served_greedy_matches_hf(served_deepseek_dir: Path, tmp_path: Path) -> None:
    """Three prompts at once in chunks of 16 (chunked prefill, mixed prefill and decode steps),
    and a repeat of the first (a prefix-cache hit): greedy tokens must be HF's."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (40, 17, 29)]
    prompts.append(list(prompts[0]))
    new_tokens = 10
    expected = [hf_greedy(served_deepseek_dir, p, new_tokens) for p in prompts[:3]]
    expected.append(expected[0])
    overrides = (
        f"model.path={served_deepseek_dir}", "model.dtype=float32", "model.max_model_len=256",
        "engine.max_num_batched_tokens=16",
    )  # fmt: skip
    got = served_greedy(tmp_path / "run", overrides, prompts[:3], new_tokens, then=(prompts[3],))
    assert got == expected
