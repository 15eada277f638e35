"""Random model configs of every decoder family against HF transformers, in process, float32 on the
CPU: each case draws a config (head sizes in and outside the C++ kernels' compiled set, MQA / GQA /
MHA, odd widths and vocabularies, 1 to 5 layers, tied or untied embeddings, biases, rope types and
their options, sliding windows and layer types, soft caps, MoE routing shapes, DeepSeek's latent
attention and groups, gpt-oss's sinks and SwiGLU limits), saves random weights, and runs three
prompts through a batched prefill and 6 decodes in a ModelRunner (the C++ kernels, and with
--torch-fallback also without them), checking each step's logits against HF's forward over the
whole history.

    python benchmarks/config_fuzz.py [--seed 0] [--cases 28] [--families llama,gemma3,...]
        [--torch-fallback] [--json FILE]

Prints one row per case and backend: its status (ok; WRONG: a relative logit difference over
1e-3 or a greedy token that differs where HF's top two are apart; CRASH; refused, with
UnsupportedModel's message; hf-invalid: a config HF itself rejects) and its worst relative
logit difference. The JSON holds every case's config and result. Exits 1 if any case is WRONG
or CRASH. A defect found here belongs as a case in tests/test_families.py CONFIG_EDGES or
tests/test_moe.py MOE_CONFIG_EDGES.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from kernels import cpu_ops
from services.gpu_worker.architectures import UnsupportedModel
from services.gpu_worker.model_runner import ModelRunner
from tests.conftest import save_random_model
from tests.test_model import PlanBuilder, runner_logits

BLOCK = 16
PROMPT_LENGTHS = (37, 21, 3)  # across blocks; the last one stays short of every LongRoPE original length
NEW_TOKENS = 6
TOLERANCE = 1e-3  # relative to the largest |logit|


class Draw:
    """Seeded choices."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def pick(self, choices: list | tuple):
        return choices[int(self.rng.integers(len(choices)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def floats(self, n: int, low: float, high: float) -> list[float]:
        return (low + (high - low) * self.rng.random(n)).tolist()


def attention_shape(draw: Draw, explicit_head_dim: bool = True) -> dict:
    heads = draw.pick([1, 2, 3, 4, 6])
    shape = dict(
        num_attention_heads=heads,
        num_key_value_heads=draw.pick([n for n in range(1, heads + 1) if heads % n == 0]),
        hidden_size=heads * draw.pick([k for k in (8, 12, 16, 20, 24, 32, 40) if heads * k <= 128]),
    )
    if explicit_head_dim and draw.chance(0.7):
        shape["head_dim"] = draw.pick([8, 16, 32, 48, 64, 80, 112, 160])
    return shape


def common(draw: Draw, explicit_head_dim: bool = True) -> dict:
    config = dict(
        vocab_size=draw.pick([97, 250, 320, 333, 1000]),
        intermediate_size=draw.pick([40, 72, 96, 200]),
        num_hidden_layers=draw.pick([1, 2, 3, 5]),
        max_position_embeddings=256,
        rms_norm_eps=draw.pick([1e-6, 1e-5, 1e-2]),
        tie_word_embeddings=draw.chance(0.5),
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **attention_shape(draw, explicit_head_dim),
    )  # fmt: skip
    if draw.chance(0.2):
        config["hidden_act"] = draw.pick(["gelu_pytorch_tanh", "silu", "gelu", "gelu_new"])
    return config


def rope(draw: Draw, kinds: list[str]) -> dict:
    kind = draw.pick(kinds)
    params: dict = {"rope_type": kind, "rope_theta": draw.pick([100.0, 10000.0, 500000.0, 1e6])}
    if kind in ("linear", "dynamic"):
        params["factor"] = draw.pick([0.5, 2.0, 4.0])
    elif kind == "llama3":
        params.update(factor=draw.pick([2.0, 8.0]), low_freq_factor=1.0, high_freq_factor=draw.pick([2.0, 4.0]),
                      original_max_position_embeddings=draw.pick([16, 32, 64]))  # fmt: skip
    elif kind == "yarn":
        params.update(
            factor=draw.pick([2.0, 4.0, 16.0]), original_max_position_embeddings=draw.pick([16, 32, 64])
        )
        if draw.chance(0.5):
            params["beta_fast"] = draw.pick([8.0, 32.0])
        if draw.chance(0.3):
            params["truncate"] = False
        if draw.chance(0.3):
            params["attention_factor"] = 1.2
        elif draw.chance(0.3):
            params.update(mscale=1.0, mscale_all_dim=0.5)
    return params


def sliding_layers(draw: Draw, config: dict, p: float = 0.3) -> None:
    """An explicit layer_types with a window, sometimes."""
    if draw.chance(p):
        config["sliding_window"] = draw.pick([5, 12])
        types = ["sliding_attention", "full_attention"]
        config["layer_types"] = [draw.pick(types) for _ in range(config["num_hidden_layers"])]


def head_dim_of(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def llama(draw: Draw) -> dict:
    kinds = ["default", "linear", "dynamic", "llama3", "yarn"]
    return dict(
        common(draw),
        attention_bias=draw.chance(0.4),
        mlp_bias=draw.chance(0.4),
        rope_parameters=rope(draw, kinds),
    )


def mistral(draw: Draw) -> dict:
    config = dict(common(draw), rope_parameters=rope(draw, ["default", "linear", "yarn", "llama3"]))
    config["sliding_window"] = draw.pick([None, 5, 12, 20, 64])
    return config


def qwen(draw: Draw, qwen3: bool) -> dict:
    config = dict(common(draw), rope_parameters=rope(draw, ["default", "linear", "yarn", "dynamic"]))
    if qwen3:
        config["attention_bias"] = draw.chance(0.4)
    if draw.chance(0.3):
        config.update(use_sliding_window=True, sliding_window=draw.pick([5, 12]),
                      max_window_layers=int(draw.rng.integers(0, config["num_hidden_layers"] + 1)))  # fmt: skip
    else:
        sliding_layers(draw, config)
    return config


def gemma(draw: Draw, gemma3: bool) -> dict:
    config = common(draw)
    config.setdefault("head_dim", head_dim_of(config))
    config.update(query_pre_attn_scalar=draw.pick([16, 24, 64, 100]), sliding_window=draw.pick([5, 12, 300]),
                  final_logit_softcapping=draw.pick([None, 3.0, 30.0]), attention_bias=draw.chance(0.3))  # fmt: skip
    if not gemma3:
        config.update(
            attn_logit_softcapping=draw.pick([None, 2.0, 50.0]),
            rope_parameters=rope(draw, ["default", "linear"]),
        )
        return config
    if draw.chance(0.5):
        types = ["sliding_attention", "full_attention"]
        config["layer_types"] = [draw.pick(types) for _ in range(config["num_hidden_layers"])]
    else:
        config["sliding_window_pattern"] = draw.pick([1, 2, 3, 6])
    config["rope_parameters"] = {
        "full_attention": rope(draw, ["default", "linear", "yarn"]),
        "sliding_attention": {"rope_type": "default", "rope_theta": draw.pick([100.0, 10000.0])},
    }
    return config


def phi3(draw: Draw) -> dict:
    config = common(draw, explicit_head_dim=False)
    head_dim = head_dim_of(config)
    if draw.chance(0.3):  # Phi-4-mini's partial rotary: LongRoPE's factors are then the rotary part's
        config["partial_rotary_factor"] = draw.pick([0.5, 0.75])
    half = int(head_dim * config.get("partial_rotary_factor", 1.0)) // 2
    if draw.chance(0.7):
        original = draw.pick([16, 32, 64])
        config["original_max_position_embeddings"] = original
        config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                                     "short_factor": draw.floats(half, 1, 2), "long_factor": draw.floats(half, 1, 4)}  # fmt: skip
    if draw.chance(0.3):
        config["sliding_window"] = draw.pick([5, 12])
    return config


def moe_routing(draw: Draw, experts_key: str) -> dict:
    experts = draw.pick([1, 2, 4, 8, 16])
    return {
        experts_key: experts,
        "num_experts_per_tok": draw.pick(sorted({1, min(2, experts), min(3, experts), experts})),
    }


def mixtral(draw: Draw) -> dict:
    config = dict(
        common(draw),
        **moe_routing(draw, "num_local_experts"),
        rope_parameters=rope(draw, ["default", "yarn"]),
    )
    if draw.chance(0.3):
        config["sliding_window"] = draw.pick([5, 12])
    return config


def qwen_moe(draw: Draw, qwen3: bool) -> dict:
    config = dict(common(draw), **moe_routing(draw, "num_experts"))
    config.update(moe_intermediate_size=draw.pick([24, 40, 72]), norm_topk_prob=draw.chance(0.5),
                  decoder_sparse_step=draw.pick([1, 2, 3]))  # fmt: skip
    if qwen3:
        config.update(
            attention_bias=draw.chance(0.3), rope_parameters=rope(draw, ["default", "linear", "yarn"])
        )
    else:
        config.update(shared_expert_intermediate_size=draw.pick([0, 48, 88]), qkv_bias=draw.chance(0.7))
    if draw.chance(0.4):
        config["mlp_only_layers"] = [i for i in range(config["num_hidden_layers"]) if draw.chance(0.4)]
    if draw.chance(0.2):
        config.update(use_sliding_window=True, sliding_window=draw.pick([5, 12]))
    return config


def olmoe(draw: Draw) -> dict:
    config = dict(common(draw, explicit_head_dim=False), **moe_routing(draw, "num_experts"))
    config.update(norm_topk_prob=draw.chance(0.5), clip_qkv=draw.pick([None, 1.0, 8.0]),
                  attention_bias=draw.chance(0.3), rope_parameters=rope(draw, ["default", "linear"]))  # fmt: skip
    return config


def gpt_oss(draw: Draw) -> dict:
    config = dict(common(draw), **moe_routing(draw, "num_local_experts"))
    config.setdefault("head_dim", head_dim_of(config))
    config.update(sliding_window=draw.pick([5, 12, 64]), swiglu_limit=draw.pick([0.5, 1.0, 7.0]),
                  attention_bias=draw.chance(0.7), rope_parameters=rope(draw, ["yarn", "default"]))  # fmt: skip
    sliding_layers(draw, config, p=0.5)
    return config


def deepseek(draw: Draw, v3: bool) -> dict:
    config = common(draw)
    heads = draw.pick([1, 2, 3, 4])
    experts = draw.pick([2, 4, 8, 12])
    # V3 scores a group by its best two experts (HF fails on a group of one).
    groups = draw.pick([g for g in (1, 2, 4) if experts % g == 0 and (not v3 or experts // g >= 2)])
    top_k = draw.pick([1, 2, min(3, experts)])
    config.update(
        num_attention_heads=heads, num_key_value_heads=heads, hidden_size=draw.pick([48, 64, 72, 96]),
        kv_lora_rank=draw.pick([16, 24, 32]), qk_nope_head_dim=draw.pick([8, 16, 24]),
        qk_rope_head_dim=draw.pick([4, 8, 16]), v_head_dim=draw.pick([8, 16, 24, 40]),
        q_lora_rank=draw.pick([None, 16, 24]), first_k_dense_replace=int(draw.rng.integers(0, 3)),
        moe_intermediate_size=draw.pick([24, 40]), n_routed_experts=experts, num_experts_per_tok=top_k,
        n_group=groups, n_shared_experts=draw.pick([0, 1, 2]), routed_scaling_factor=draw.pick([1.0, 2.5]),
        # HF's group-limited top-k needs at least top_k experts in the kept groups.
        topk_group=max(int(draw.rng.integers(1, groups + 1)), -(-top_k // (experts // groups))),
        rope_parameters=rope(draw, ["default", "yarn"]),
    )  # fmt: skip
    config.pop("head_dim", None)
    if v3:
        config["norm_topk_prob"] = draw.chance(0.5)
        if draw.chance(0.3):
            config["rope_interleave"] = False
    else:
        config["topk_method"] = draw.pick(["greedy", "group_limited_greedy"])
    return config


# family -> (transformers config class, its config generator)
FAMILIES: dict[str, tuple[str, Callable[[Draw], dict]]] = {
    "llama": ("LlamaConfig", llama),
    "mistral": ("MistralConfig", mistral),
    "qwen2": ("Qwen2Config", lambda draw: qwen(draw, qwen3=False)),
    "qwen3": ("Qwen3Config", lambda draw: qwen(draw, qwen3=True)),
    "gemma2": ("Gemma2Config", lambda draw: gemma(draw, gemma3=False)),
    "gemma3": ("Gemma3TextConfig", lambda draw: gemma(draw, gemma3=True)),
    "phi3": ("Phi3Config", phi3),
    "mixtral": ("MixtralConfig", mixtral),
    "qwen2_moe": ("Qwen2MoeConfig", lambda draw: qwen_moe(draw, qwen3=False)),
    "qwen3_moe": ("Qwen3MoeConfig", lambda draw: qwen_moe(draw, qwen3=True)),
    "olmoe": ("OlmoeConfig", olmoe),
    "gpt_oss": ("GptOssConfig", gpt_oss),
    "deepseek_v2": ("DeepseekV2Config", lambda draw: deepseek(draw, v3=False)),
    "deepseek_v3": ("DeepseekV3Config", lambda draw: deepseek(draw, v3=True)),
}


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def step_logits(runner: ModelRunner, builder: PlanBuilder, chunks: list, histories: dict) -> torch.Tensor:
    """runner_logits, with the plan's long_rope flag (the scheduler's) for a LongRoPE sequence
    longer than the original length; no sequence here crosses it."""
    plan = builder.plan

    def plan_with_long_rope(step_chunks, *args):
        arrays, header = plan(step_chunks, *args)
        if runner.long_rope_from:
            longs = [len(histories[seq]) > runner.long_rope_from for seq, _, _ in step_chunks]
            arrays["long_rope"] = np.array(longs, dtype=np.uint8)
        return arrays, header

    builder.plan = plan_with_long_rope
    try:
        return runner_logits(runner, builder, chunks)
    finally:
        builder.plan = plan


def compare(hf, runner: ModelRunner, vocab: int, seed: int) -> tuple[float, int]:
    """(worst relative logit difference, greedy tokens that differ with a clear HF margin) over a
    batched prefill of the prompts and NEW_TOKENS decodes; each step against HF's forward over
    the whole history, which then takes HF's token."""
    rng = np.random.default_rng(seed)
    histories = {seq: rng.integers(3, vocab, n).tolist() for seq, n in enumerate(PROMPT_LENGTHS)}
    builder = PlanBuilder(BLOCK)
    chunks = [(seq, list(h)) for seq, h in histories.items()]
    worst, differing = 0.0, 0
    for _ in range(NEW_TOKENS + 1):
        logits = step_logits(runner, builder, [(seq, tokens, True) for seq, tokens in chunks], histories)
        for row, (seq, _) in enumerate(chunks):
            expected = hf_last_logits(hf, histories[seq])
            if not torch.isfinite(logits[row]).all():
                worst = float("inf")
            scale = expected.abs().max().clamp_min(1e-6)
            worst = max(worst, float((logits[row] - expected).abs().max() / scale))
            top2 = expected.topk(2).values
            if int(logits[row].argmax()) != int(expected.argmax()) and float(top2[0] - top2[1]) > 1e-3:
                differing += 1
            histories[seq].append(int(expected.argmax()))
        chunks = [(seq, h[-1:]) for seq, h in histories.items()]
    return worst, differing


def without_cpp_kernels() -> Callable[[], None]:
    """Point the model at the torch fallbacks; returns the undo."""
    saved = cpu_ops.has_kernels, cpu_ops.has_paged_decode
    cpu_ops.has_kernels = lambda dtype: False
    cpu_ops.has_paged_decode = lambda head_dim, dtype: False

    def restore() -> None:
        cpu_ops.has_kernels, cpu_ops.has_paged_decode = saved

    return restore


def run_case(class_name: str, config_args: dict, seed: int, out: Path, backends: list[str]) -> dict:
    """{"hf-invalid": why} or {backend: {"status", "diff" / "detail"}}."""
    import transformers
    from transformers import AutoModelForCausalLM

    try:
        config = getattr(transformers, class_name)(**config_args)
        path = save_random_model(config, out, seed=seed, std=0.08, embed_std=0.15)
        hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        hf_last_logits(hf, [3, 4, 5])
    except Exception as error:  # a config HF rejects is not ours to judge
        return {"hf-invalid": f"{type(error).__name__}: {error}"[:300]}
    results = {}
    for backend in backends:
        restore = without_cpp_kernels() if backend == "torch" else (lambda: None)
        try:
            runner = ModelRunner(path, dtype="float32", kv_cache_bytes=4 << 20, block_size=BLOCK)
            worst, differing = compare(hf, runner, config_args["vocab_size"], seed)
            wrong = not worst <= TOLERANCE or differing > 0
            results[backend] = {
                "status": "WRONG" if wrong else "ok",
                "diff": worst,
                "differing_tokens": differing,
            }
        except UnsupportedModel as refusal:
            results[backend] = {"status": "refused", "detail": str(refusal)}
        except Exception as error:  # the crash is the finding
            results[backend] = {"status": "CRASH", "detail": f"{type(error).__name__}: {error}",
                                "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
        finally:
            restore()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=len(FAMILIES) * 2, help="families taken in turn")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--torch-fallback", action="store_true", help="each case without the C++ kernels too")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    families = args.families.split(",")
    draw = Draw(args.seed)
    backends = ["cpp", "torch"] if args.torch_fallback else ["cpp"]
    report, failed = [], False
    print(f"{'case':>4} {'family':12} {'backend':7} {'status':10} {'max rel diff':>12}  detail")
    for index in range(args.cases):
        family = families[index % len(families)]
        class_name, generate = FAMILIES[family]
        config_args = generate(draw)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            results = run_case(class_name, config_args, args.seed * 100_000 + index, Path(out), backends)
        report.append({"case": index, "family": family, "config_class": class_name, "config": config_args,
                       "results": results, "seconds": round(time.perf_counter() - started, 2)})  # fmt: skip
        for backend, result in results.items():
            if backend == "hf-invalid":
                print(f"{index:4} {family:12} {'-':7} {'hf-invalid':10} {'':>12}  {result[:100]}")
                continue
            failed |= result["status"] in ("WRONG", "CRASH")
            diff = f"{result['diff']:.2e}" if "diff" in result else ""
            print(
                f"{index:4} {family:12} {backend:7} {result['status']:10} {diff:>12}  {result.get('detail', '')[:100]}"
            )
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
