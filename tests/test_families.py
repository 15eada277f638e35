"""Each supported family against HF transformers on the same random weights, in float32: a tiny
config made here, saved as an HF safetensors dir, then greedy tokens and logits of batched
prefill, decode, a prefix-cache hit and a preempted-and-recomputed sequence.

HF's side is a full forward over each whole history (no HF KV cache), so its sliding-window and
soft-cap masks are the reference for ours over the paged cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.gpu_worker.model_runner import ModelRunner
from tests.conftest import save_random_model
from tests.test_model import PlanBuilder, runner_logits

pytestmark = pytest.mark.timeout(300)

VOCAB = 320
BLOCK = 16
WINDOW = 12  # shorter than the prompts and not a multiple of the block size
HEAD_DIM = 16
NEW_TOKENS = 6
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip


def _longrope_factors(seed: int) -> list[float]:
    return (1.0 + np.random.default_rng(seed).random(HEAD_DIM // 2) * 3).tolist()


# family -> (transformers config class name, its arguments beyond COMMON)
FAMILIES = {
    "llama3-untied": ("LlamaConfig", dict(
        head_dim=HEAD_DIM, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )),
    "llama-tied": ("LlamaConfig", dict(head_dim=HEAD_DIM, tie_word_embeddings=True)),
    # attention_bias puts biases on q, k, v and o_proj, mlp_bias on gate, up and down; one KV head.
    "llama-biases-mqa": ("LlamaConfig", dict(
        head_dim=HEAD_DIM, num_key_value_heads=1, attention_bias=True, mlp_bias=True,
    )),
    "mistral-sliding": ("MistralConfig", dict(head_dim=HEAD_DIM, sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # head_dim 32 with hidden 64 and 4 heads: taken from the config, not hidden / heads.
    "qwen3-qk-norm": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(
        head_dim=HEAD_DIM, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
    )),
    # attn_logit_softcapping: a field Gemma 3's config keeps and its HF class ignores.
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=HEAD_DIM, num_hidden_layers=3, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
        attn_logit_softcapping=2.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    )),
    "phi3-longrope": ("Phi3Config", dict(
        tie_word_embeddings=False, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": _longrope_factors(1), "long_factor": _longrope_factors(2)},
    )),
}  # fmt: skip


# Configs beyond FAMILIES' that benchmarks/config_fuzz.py found run wrongly or refused: name ->
# (transformers config class name, its arguments beyond COMMON).
CONFIG_EDGES = {
    # Dynamic NTK scales only past max_position_embeddings (256): the default rope up to there.
    "llama-dynamic-rope": ("LlamaConfig", dict(
        head_dim=HEAD_DIM, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    )),
    # HF's NewGELUActivation: the tanh approximation of GELU, written out.
    "mistral-gelu-new": ("MistralConfig", dict(head_dim=HEAD_DIM, sliding_window=None, hidden_act="gelu_new")),
    # HF's GELUActivation: exact GELU (erf), refused before.
    "llama-gelu": ("LlamaConfig", dict(head_dim=HEAD_DIM, hidden_act="gelu")),
    # Phi-4-mini's partial rotary: 12 of each head's 16 dimensions rotate (refused before), with
    # the default rope and with LongRoPE (its factors then of the 12 dimensions' 6 frequencies).
    "phi3-partial-rotary": ("Phi3Config", dict(tie_word_embeddings=False, partial_rotary_factor=0.75)),
    "phi3-partial-rotary-longrope": ("Phi3Config", dict(
        tie_word_embeddings=True, original_max_position_embeddings=64, partial_rotary_factor=0.75,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": _longrope_factors(3)[:6], "long_factor": _longrope_factors(4)[:6]},
    )),
}  # fmt: skip


@pytest.mark.parametrize("edge", sorted(CONFIG_EDGES))
def test_config_edges_match_hf(edge: str, tmp_path: Path) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    class_name, extra = CONFIG_EDGES[edge]
    config = getattr(transformers, class_name)(**{**COMMON, **extra})
    path = save_random_model(config, tmp_path / edge, seed=40, std=0.08, embed_std=0.15)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    check_against_hf(hf, ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK))


def save_random_family_model(family: str, out: Path) -> Path:
    """A random model of `family` saved as HF safetensors (see save_random_model)."""
    import transformers

    class_name, extra = FAMILIES[family]
    config = getattr(transformers, class_name)(**{**COMMON, **extra})
    return save_random_model(config, out, seed=sorted(FAMILIES).index(family), std=0.08, embed_std=0.15)


def load_family(family: str, out: Path, backend: str | None = None) -> tuple:
    """(HF model, our runner) of a fresh random `family` model saved under `out`."""
    from transformers import AutoModelForCausalLM

    path = save_random_family_model(family, out)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = ModelRunner(path, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK, backend=backend)
    return hf, runner


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    return request.param, *load_family(request.param, tmp_path_factory.mktemp(request.param))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def check_step(
    hf, runner: ModelRunner, builder: PlanBuilder, chunks: list[tuple[int, list[int]]], histories: dict
) -> None:
    """Run one step (every chunk sampled), check each row's logits against HF on its whole history,
    and append HF's greedy token to the history: ours must be the same."""
    logits = runner_logits(runner, builder, [(seq, tokens, True) for seq, tokens in chunks])
    for row, (seq, _) in enumerate(chunks):
        expected = hf_logits(hf, histories[seq])
        torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=2e-4, msg=f"seq {seq}")
        assert int(logits[row].argmax()) == int(expected.argmax()), f"seq {seq}: greedy token differs"
        histories[seq].append(int(expected.argmax()))


def test_family_matches_hf(family_model):
    _, hf, runner = family_model
    check_against_hf(hf, runner)


def check_against_hf(hf, runner: ModelRunner) -> None:
    """Batched prefill, decodes across a block and the window, a prefix-cache hit, a preemption."""
    rng = np.random.default_rng(0)
    histories = {0: rng.integers(3, VOCAB, 37).tolist(), 1: rng.integers(3, VOCAB, 21).tolist()}
    builder = PlanBuilder(BLOCK)
    # Batched prefill of both prompts, then decodes (crossing a block boundary and the window).
    check_step(hf, runner, builder, [(s, list(h)) for s, h in histories.items()], histories)
    for _ in range(NEW_TOKENS):
        check_step(hf, runner, builder, [(s, h[-1:]) for s, h in histories.items()], histories)

    # Blocks wholly outside the window are never read: poisoned in the sliding layers, they must
    # change nothing (a NaN read even under a -inf mask would reach the logits).
    windows = runner.model.config.layer_windows
    if any(windows):
        assert len(histories[0]) - max(windows) >= BLOCK + 1  # block 0 is outside every window now
        for (k_cache, v_cache), window in zip(runner.kv_cache, windows, strict=True):
            if window:
                k_cache[builder.blocks[0][0]] = v_cache[builder.blocks[0][0]] = float("nan")

    # A prefix-cache hit: sequence 2 shares sequence 0's first two blocks and prefills only the rest.
    shared = 2 * BLOCK
    histories[2] = histories[0][:shared] + rng.integers(3, VOCAB, 9).tolist()
    builder.blocks[2] = builder.blocks[0][:2]
    builder.num_cached[2] = shared
    check_step(hf, runner, builder, [(2, histories[2][shared:]), (0, histories[0][-1:])], histories)

    # Preemption: sequence 1 loses its blocks and is recomputed (prompt + generated) in new ones,
    # in two chunks; then all three decode on.
    del builder.blocks[1]
    builder.num_cached[1] = 0
    runner_logits(runner, builder, [(1, histories[1][:20], False)])
    check_step(hf, runner, builder, [(1, histories[1][20:]), (2, histories[2][-1:])], histories)
    for _ in range(2):
        check_step(hf, runner, builder, [(s, h[-1:]) for s, h in histories.items()], histories)


@pytest.mark.parametrize(
    "params",
    [
        dict(
            factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096
        ),
        dict(factor=4.0, original_max_position_embeddings=64),  # truncate by default, HF's betas
        dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=4096),
        dict(factor=8.0, attention_factor=1.3, beta_fast=16.0, original_max_position_embeddings=32),
        dict(original_max_position_embeddings=64),  # factor: max_position_embeddings / original
    ],
)
def test_yarn_rope_matches_hfs(params: dict) -> None:
    """YaRN's frequencies and cos / sin scale against HF's own _compute_yarn_parameters."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from services.gpu_worker.architectures import ModelConfig
    from services.gpu_worker.model import rope_cos_sin

    rope_parameters = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": None, **params}
    config = LlamaConfig(**{**COMMON, "head_dim": 64, "rope_parameters": rope_parameters})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    rope = ModelConfig.from_dict(config.to_dict()).ropes[0]
    assert rope.rope_type == "yarn" and rope.attention_factor == pytest.approx(attention_factor)
    positions = torch.arange(256, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    expected = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
    torch.testing.assert_close(rope_cos_sin(rope, 64, 256, torch.float32, torch.device("cpu")), expected)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_rope_by_layer_type_matches_hfs(truncate: bool) -> None:
    """Gemma 3's rope_parameters nested by layer type, YaRN on the full layers: HF reads
    `truncate` from the top level of rope_parameters only, so a layer type's own is ignored."""
    from transformers import Gemma3TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from services.gpu_worker.architectures import ModelConfig
    from services.gpu_worker.model import rope_cos_sin

    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 64}
    rope_parameters = {
        "full_attention": {**yarn, "truncate": truncate},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }
    config = Gemma3TextConfig(**{**COMMON, "head_dim": 32, "rope_parameters": rope_parameters})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, layer_type="full_attention")
    config_dict = {
        **config.to_dict(),
        "architectures": ["Gemma3ForCausalLM"],
        "layer_types": ["full_attention"],
    }
    parsed = ModelConfig.from_dict({**config_dict, "num_hidden_layers": 1})
    freqs = torch.outer(torch.arange(256, dtype=torch.float32), inv_freq)
    expected = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
    torch.testing.assert_close(
        rope_cos_sin(parsed.ropes[0], 32, 256, torch.float32, torch.device("cpu")), expected
    )


@pytest.mark.parametrize(
    ("class_name", "config_bias", "want"),
    [
        # (qkv, o_proj, mlp) biases, as each family's HF class builds its projections.
        ("LlamaConfig", dict(attention_bias=True, mlp_bias=True), (True, True, True)),
        ("LlamaConfig", dict(), (False, False, False)),
        ("Qwen2Config", dict(), (True, False, False)),
        ("Qwen3Config", dict(attention_bias=True), (True, True, False)),
        ("Gemma2Config", dict(attention_bias=True), (True, True, False)),
        ("MistralConfig", dict(attention_bias=True), (False, False, False)),  # MistralAttention has none
        ("Phi3Config", dict(attention_bias=True, mlp_bias=True), (False, False, False)),
    ],
)
def test_bias_flags_follow_each_familys_hf_class(class_name: str, config_bias: dict, want: tuple) -> None:
    import transformers

    from services.gpu_worker.architectures import ModelConfig

    config = getattr(transformers, class_name)(**{**COMMON, **config_bias}).to_dict()
    config["architectures"] = [class_name.replace("Config", "ForCausalLM")]
    parsed = ModelConfig.from_dict(config)
    assert (parsed.attention_bias, parsed.o_proj_bias, parsed.mlp_bias) == want
