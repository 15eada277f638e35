"""Accuracy of engine.cpu_int8_activations, engine.cpu_wide_step_dtype and engine.kv_cache_dtype
against HF float32, on the embedded SmolLM2-135M.

    python benchmarks/int8_accuracy.py [--json FILE] [--new-tokens 32] [--threads N]

HF transformers in float32 (its own dequantization of the embedded GGUF) generates greedily from
each of the model tests' chat prompts (tests/test_model.py, CHATS). Brigade then teacher-forces
HF's tokens: the prompt as one prefill, then one decode step of one row per token, the steps the
8-bit option changes (the few-rows GEMVs from the GGUF blocks), once with float32 activations (the
control, which the model tests hold to HF) and once with 8-bit ones. Per mode it reports the top-1
agreement with HF's greedy token over all decode steps and the largest |logit difference| from HF's
logits at those steps, and writes them as JSON.

The wide-step modes teacher-force the steps a loaded server runs: each prompt prefilled alone, then
every prompt's next token in one decode step of all of them (8 rows), all wide steps; with float32
wide steps (the control) and with bfloat16 ones (a second runner: the dtype is chosen at load).
They count every token, the first (the prefill's) too, since both kinds of step change.

The bfloat16 KV cache modes (a third runner, engine.kv_cache_dtype=bfloat16) teacher-force both
ways, one row a step and batched, counted as above.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.model_bench import static_plan
from services.gpu_worker.loader import default_model_path, prepare_model
from services.gpu_worker.model_runner import ModelRunner
from tests.test_model import CHATS


def hf_float32() -> torch.nn.Module:
    """SmolLM2 in HF transformers, float32, from transformers' own reading of the GGUF."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = Path(default_model_path())
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=meta)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.eval()


def chat_prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c in CHATS
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and its logits [new_tokens, V] before each."""
    with torch.inference_mode():
        out = hf.generate(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_scores=True,
            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.scores).float()


def teacher_forced_logits(runner: ModelRunner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Brigade's logits [len(tokens), V] before each of `tokens`: the prompt's prefill, then one
    single-row decode step per token (all but the last fed back)."""
    bs = runner.block_size
    length = len(prompt) + len(tokens)
    table = np.arange(-(-length // bs), dtype=np.int32)[None, :]
    model = runner.model

    def step(ids: list[int], start: int) -> torch.Tensor:
        positions = np.arange(start, start + len(ids))[None, :]
        arrays, header = static_plan(np.array([ids]), positions, np.array([start + len(ids)]), table, bs)
        runner.validate(arrays, header)
        metas = model.prepare(arrays, header.num_tokens, header.num_seqs)
        ids_t = torch.from_numpy(arrays["input_ids"].astype(np.int64))
        return model.forward(ids_t, metas, runner.kv_cache, torch.tensor([len(ids) - 1]))[0]

    logits = [step(prompt, 0)]
    for i, token in enumerate(tokens[:-1]):
        logits.append(step([token], len(prompt) + i))
    return torch.stack(logits)


def batched_teacher_forced_logits(
    runner: ModelRunner, prompts: list[list[int]], tokens: list[list[int]]
) -> list[torch.Tensor]:
    """Brigade's logits [len(tokens[i]), V] before each of prompt i's tokens: each prompt's prefill
    alone, then one decode step of all the prompts per token (every prompt as many tokens)."""
    bs = runner.block_size
    widths = [-(-(len(p) + len(t)) // bs) for p, t in zip(prompts, tokens, strict=True)]
    tables = np.zeros((len(prompts), max(widths)), dtype=np.int32)
    starts = np.cumsum([0, *widths])
    for i, width in enumerate(widths):
        tables[i, :width] = np.arange(starts[i], starts[i] + width)
    model = runner.model

    def step(ids: np.ndarray, positions: np.ndarray, seqs: list[int]) -> torch.Tensor:
        arrays, header = static_plan(ids, positions, positions[:, -1] + 1, tables[seqs], bs)
        runner.validate(arrays, header)
        metas = model.prepare(arrays, header.num_tokens, header.num_seqs)
        ids_t = torch.from_numpy(arrays["input_ids"].astype(np.int64))
        rows = torch.arange(len(seqs)) * ids.shape[1] + ids.shape[1] - 1
        return model.forward(ids_t, metas, runner.kv_cache, rows)

    logits = [[step(np.array([p]), np.arange(len(p))[None, :], [i])[0]] for i, p in enumerate(prompts)]
    everyone = list(range(len(prompts)))
    for j in range(len(tokens[0]) - 1):
        ids = np.array([[t[j]] for t in tokens])
        positions = np.array([[len(p) + j] for p in prompts])
        for i, row in enumerate(step(ids, positions, everyone)):
            logits[i].append(row)
    return [torch.stack(rows) for rows in logits]


def compare_batched(
    runner: ModelRunner, prompts: list[list[int]], references: list[tuple[list[int], torch.Tensor]]
) -> dict:
    """`compare` over `batched_teacher_forced_logits`, every token counted."""
    tokens = [t for t, _ in references]
    ours = batched_teacher_forced_logits(runner, prompts, tokens)
    agree = sum(int((o.argmax(-1) == torch.tensor(t)).sum()) for o, t in zip(ours, tokens, strict=True))
    steps = sum(len(t) for t in tokens)
    max_diff = max(float((o - hf).abs().max()) for o, (_, hf) in zip(ours, references, strict=True))
    return {
        "top1_agreement": agree / steps,
        "agreeing_steps": agree,
        "steps": steps,
        "max_abs_logit_diff": max_diff,
    }


def compare(
    runner: ModelRunner, prompts: list[list[int]], references: list[tuple[list[int], torch.Tensor]]
) -> dict:
    """Top-1 agreement with HF's greedy tokens and the largest |logit difference| from HF's logits
    (`hf_greedy` of each prompt), over the decode steps: the first token comes from the prefill,
    a float32 step either way."""
    agree = steps = 0
    max_diff = 0.0
    for prompt, (tokens, hf_logits) in zip(prompts, references, strict=True):
        ours = teacher_forced_logits(runner, prompt, tokens)[1:]
        agree += int((ours.argmax(-1) == torch.tensor(tokens[1:])).sum())
        steps += len(tokens) - 1
        max_diff = max(max_diff, float((ours - hf_logits[1:]).abs().max()))
    return {
        "top1_agreement": agree / steps,
        "agreeing_steps": agree,
        "steps": steps,
        "max_abs_logit_diff": max_diff,
    }


def show(mode: str, report: dict) -> None:
    print(
        f"{mode}: top-1 agreement {report['agreeing_steps']}/{report['steps']} "
        f"({100 * report['top1_agreement']:.1f} %), max |logit diff| {report['max_abs_logit_diff']:.4f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    model_dir = prepare_model(None)
    runner = ModelRunner(model_dir, dtype="float32", kv_cache_bytes=64 << 20, threads=args.threads)
    if runner.model.lm_head_quantized is None:
        sys.exit("the model's GEMVs do not read GGUF blocks here (no C++ kernels?): nothing to compare")
    hf = hf_float32()
    prompts = chat_prompts(model_dir)
    references = [hf_greedy(hf, prompt, args.new_tokens) for prompt in prompts]
    result: dict = {"new_tokens": args.new_tokens, "prompts": len(prompts), "modes": {}}
    for mode, int8 in (("float32 activations", False), ("int8 activations", True)):
        runner.model.int8_activations = int8
        result["modes"][mode] = compare(runner, prompts, references)
        show(mode, result["modes"][mode])
    runner.model.int8_activations = False
    result["modes"]["float32 wide steps (batched)"] = compare_batched(runner, prompts, references)
    show("float32 wide steps (batched)", result["modes"]["float32 wide steps (batched)"])
    del runner
    bf16 = ModelRunner(
        model_dir, dtype="float32", kv_cache_bytes=64 << 20, threads=args.threads, wide_step_dtype="bfloat16"
    )
    if bf16.model.wide_step_dtype != torch.bfloat16:
        sys.exit("this CPU has no native bf16 matmul: the bf16 wide steps fall back to float32")
    result["modes"]["bfloat16 wide steps (batched)"] = compare_batched(bf16, prompts, references)
    show("bfloat16 wide steps (batched)", result["modes"]["bfloat16 wide steps (batched)"])
    del bf16
    kv_bf16 = ModelRunner(
        model_dir, dtype="float32", kv_cache_bytes=64 << 20, threads=args.threads, kv_cache_dtype="bfloat16"
    )
    for mode, measure in (("bfloat16 KV cache", compare), ("bfloat16 KV cache (batched)", compare_batched)):
        result["modes"][mode] = measure(kv_bf16, prompts, references)
        show(mode, result["modes"][mode])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
