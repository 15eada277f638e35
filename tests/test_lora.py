"""LoRA adapters against HF transformers with PEFT: a small random Llama base, three random PEFT
adapters (different ranks and target sets, one rsLoRA) saved as PEFT saves them, and one step
plan after another that mixes rows of every adapter and a row of none, through the worker's
model runner. Each row's logits and greedy token must be PeftModel's on its whole history.
Adapters that do not fit the base model are refused, naming what does not fit."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from ipc import messages as m
from kernels import cpu_ops
from kernels.lora import lora_add_ref, lora_add_triton
from services.gpu_worker import model_runner
from services.gpu_worker.lora import AdapterError
from services.gpu_worker.model_runner import InvalidPlan, ModelRunner
from tests.test_families import BLOCK, VOCAB, save_random_family_model
from tests.test_kernels import has_cpu_kernels
from tests.test_model import PlanBuilder, runner_logits

pytestmark = pytest.mark.timeout(300)

peft = pytest.importorskip("peft")

BASE_FAMILY = "llama3-untied"
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> PEFT LoraConfig arguments
ADAPTERS = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r16-rslora": dict(r=16, lora_alpha=8, target_modules=ALL_MODULES, use_rslora=True),
    "ogd-r4": dict(r=4, lora_alpha=4, target_modules=["o_proj", "gate_proj", "down_proj"]),
}
NEW_TOKENS = 5


def hf_base(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def save_random_adapter(base_path: Path, out: Path, seed: int, **lora_args) -> Path:
    """A PEFT adapter of the model at base_path with random A and B (PEFT's own init leaves B zero,
    which would test nothing), saved by PeftModel.save_pretrained."""
    model = peft.get_peft_model(hf_base(base_path), peft.LoraConfig(**lora_args))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """(base dir, {adapter name: its dir}, {name or None: HF reference model})."""
    root = tmp_path_factory.mktemp("lora")
    base = save_random_family_model(BASE_FAMILY, root / "base")
    paths = {
        name: save_random_adapter(base, root / name, seed, **args)
        for seed, (name, args) in enumerate(ADAPTERS.items())
    }
    references = {None: hf_base(base)}
    for name, path in paths.items():
        references[name] = peft.PeftModel.from_pretrained(hf_base(base), path).eval()
    return base, paths, references


def make_runner(
    base: Path,
    adapters: dict[str, Path],
    max_loras: int = 4,
    max_rank: int = 64,
    backend: str | None = None,
    lora_dtype: str = "auto",
) -> ModelRunner:
    return ModelRunner(
        base, dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK, max_loras=max_loras,
        max_lora_rank=max_rank, lora_adapters={name: str(path) for name, path in adapters.items()},
        backend=backend, lora_dtype=lora_dtype,
    )  # fmt: skip


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def lora_plan(runner, builder, chunks, adapter_of, slots: list[str] | None = None) -> tuple[dict, object]:
    """builder's plan of chunks (seq, tokens, sample?) with each row's adapter slot; `slots`: the
    adapter the header names for each slot (the worker swaps them in before the step)."""
    arrays, header = builder.plan(chunks)
    if slots is not None:
        header = msgspec.structs.replace(header, lora_slots=slots)
        runner.swap_loras(slots)
    row_slots = [
        -1 if adapter_of[seq] is None else runner.lora.names.index(adapter_of[seq]) for seq, *_ in chunks
    ]
    arrays["lora_slots"] = np.array(row_slots, dtype=np.int32)
    return arrays, header


def step_logits(runner: ModelRunner, arrays: dict, header) -> torch.Tensor:
    """Logits of the sampled rows of one plan, the model called as `execute` calls it."""
    runner.validate(arrays, header)
    t, s = header.num_tokens, header.num_seqs
    metas = runner.model.prepare(arrays, t, s)
    rows = np.flatnonzero(arrays["is_sampled"])
    sample_tokens = torch.from_numpy(arrays["query_start_loc"][rows + 1].astype(np.int64) - 1)
    ids = torch.from_numpy(arrays["input_ids"].astype(np.int64))
    return runner.model.forward(ids, metas, runner.kv_cache, sample_tokens, runner.lora_batch(arrays, t, s))


def check_lora_step(runner, builder, references, chunks, adapter_of, histories) -> None:
    """One step whose rows each use their sequence's adapter (or none); every row's logits and
    greedy token checked against its reference model on the whole history, which then grows by
    that token."""
    plan = lora_plan(runner, builder, [(seq, tokens, True) for seq, tokens in chunks], adapter_of)
    logits = step_logits(runner, *plan)
    for row, (seq, _) in enumerate(chunks):
        expected = reference_logits(references[adapter_of[seq]], histories[seq])
        torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=2e-4, msg=f"seq {seq}")
        assert int(logits[row].argmax()) == int(expected.argmax()), f"seq {seq}: greedy token differs"
        histories[seq].append(int(expected.argmax()))


def test_adapters_change_the_output(lora_models):
    """The references differ from one another: a test of equal outputs would otherwise pass
    with adapters ignored."""
    _, _, references = lora_models
    ids = list(range(3, 40))
    logits = {name: reference_logits(model, ids) for name, model in references.items()}
    for name in ADAPTERS:
        assert (logits[name] - logits[None]).abs().max() > 0.05, name


def test_mixed_adapter_batch_matches_peft(lora_models):
    """Prefill, then decodes, of a batch with a row for each adapter and one for none; then a
    preempted sequence recomputed in chunks, a step where one adapter has two rows, and a
    prefix-cache hit within one adapter."""
    base, paths, references = lora_models
    runner = make_runner(base, paths)
    rng = np.random.default_rng(0)
    adapter_of = {0: "qv-r8", 1: None, 2: "all-r16-rslora", 3: "ogd-r4"}
    histories = {seq: rng.integers(3, VOCAB, 19 + 6 * seq).tolist() for seq in adapter_of}
    builder = PlanBuilder(BLOCK)
    check_lora_step(
        runner, builder, references, [(s, list(h)) for s, h in histories.items()], adapter_of, histories
    )
    for _ in range(NEW_TOKENS):
        check_lora_step(
            runner, builder, references, [(s, h[-1:]) for s, h in histories.items()], adapter_of, histories
        )

    # A fifth sequence on an adapter another row uses; sequence 2 preempted and recomputed in two
    # chunks (the first samples nothing) beside other rows; then all decode on.
    adapter_of[4] = "all-r16-rslora"
    histories[4] = rng.integers(3, VOCAB, 23).tolist()
    del builder.blocks[2]
    builder.num_cached[2] = 0
    half = len(histories[2]) // 2
    step_logits(runner, *lora_plan(runner, builder, [(2, histories[2][:half], False)], adapter_of))
    check_lora_step(
        runner, builder, references,
        [(2, histories[2][half:]), (4, list(histories[4])), (1, histories[1][-1:])], adapter_of, histories,
    )  # fmt: skip

    # A prefix-cache hit within one adapter: sequence 5 (ogd-r4, as sequence 3) reuses sequence
    # 3's first block, computed under that adapter, and prefills only the rest.
    adapter_of[5] = "ogd-r4"
    histories[5] = histories[3][:BLOCK] + rng.integers(3, VOCAB, 7).tolist()
    builder.blocks[5] = builder.blocks[3][:1]
    builder.num_cached[5] = BLOCK
    check_lora_step(
        runner,
        builder,
        references,
        [(5, histories[5][BLOCK:]), (0, histories[0][-1:])],
        adapter_of,
        histories,
    )
    for _ in range(2):
        check_lora_step(
            runner, builder, references, [(s, h[-1:]) for s, h in histories.items()], adapter_of, histories
        )


@pytest.mark.parametrize("kernel", ["cpp", "torch", "triton"])
def test_each_lora_kernel_matches_peft(lora_models, kernel, monkeypatch):
    """Each implementation of the batched LoRA kernel (kernels/lora.py) through the model: the CPU's
    C++ op, with the decode steps of up to four rows in the one-op decode layer and the adapters'
    deltas inside it; the torch reference; the Triton kernels in the interpreter (the GPU path's
    wiring). A prefill of three adapters and none, decodes of four rows, then of two: every row's
    logits and greedy token PeftModel's."""
    base, paths, references = lora_models
    if kernel == "cpp":
        assert has_cpu_kernels()
    runner = make_runner(base, paths, backend="triton" if kernel == "triton" else None)
    if kernel == "torch":  # what a CPU without the C++ kernels runs
        runner.lora.apply, runner.lora.tile_rows = lora_add_ref, None
    if kernel != "cpp":  # the one-op layer is the C++ path's: the decodes go through this kernel too
        runner.model.has_one_op_layers = False
    assert (
        runner.lora.apply
        is {"cpp": cpu_ops.lora_add, "torch": lora_add_ref, "triton": lora_add_triton}[kernel]
    )
    one_op_calls: list[bool] = []  # per call of the one-op decode layers: did it get adapter deltas
    one_op_layers = cpu_ops.few_rows_decode_layers

    def counted_one_op_layers(*args):
        one_op_calls.append(bool(args[-1]))
        return one_op_layers(*args)

    monkeypatch.setattr(cpu_ops, "few_rows_decode_layers", counted_one_op_layers)
    check_prefill_and_decodes(runner, references)
    if kernel == "cpp":
        assert one_op_calls == [True] * 4, "the decodes did not all take the one-op layers"
    else:
        assert one_op_calls == []


def check_prefill_and_decodes(runner: ModelRunner, references: dict) -> None:
    """A prefill of three adapters and none, decodes of four rows, then of two, each row checked
    against its reference (check_lora_step)."""
    rng = np.random.default_rng(5)
    adapter_of = {0: "qv-r8", 1: None, 2: "all-r16-rslora", 3: "ogd-r4"}
    histories = {seq: rng.integers(3, VOCAB, 13 + 5 * seq).tolist() for seq in adapter_of}
    builder = PlanBuilder(BLOCK)
    check_lora_step(
        runner, builder, references, [(s, list(h)) for s, h in histories.items()], adapter_of, histories
    )
    for rows in ((0, 1, 2, 3), (0, 1, 2, 3), (3, 2), (2, 0)):
        check_lora_step(
            runner, builder, references, [(s, histories[s][-1:]) for s in rows], adapter_of, histories
        )


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_bfloat16_adapters_match_peft_with_bfloat16_weights(lora_models, kernel):
    """lora.dtype bfloat16 keeps the slots' A and B in bfloat16 under the float32 model (half the
    bytes a decode step reads for them). The kernels widen them exactly and compute in float32, so
    the steps are PeftModel's with its adapters' weights rounded to bfloat16 alike (the adapters'
    scalings, folded into B, are powers of two: rounding commutes with them). The C++ op with its
    one-op decode layers, and the torch reference of a CPU without them."""
    base, paths, peft_references = lora_models
    runner = make_runner(base, paths, lora_dtype="bfloat16")
    assert (
        {a.dtype for a in runner.lora.a.values()}
        == {b.dtype for b in runner.lora.b.values()}
        == {torch.bfloat16}
    )
    if kernel == "torch":
        runner.lora.apply, runner.lora.tile_rows = lora_add_ref, None
        runner.model.has_one_op_layers = False
    references = {None: peft_references[None]}
    for name, path in paths.items():
        references[name] = peft.PeftModel.from_pretrained(hf_base(base), path).eval()
        with torch.no_grad():
            for weight_name, weight in references[name].named_parameters():
                if "lora_" in weight_name:
                    weight.copy_(weight.bfloat16().float())
    # The rounding matters: the rounded adapters' logits are not the float32 ones.
    ids = list(range(3, 40))
    assert (
        reference_logits(references["all-r16-rslora"], ids)
        - reference_logits(peft_references["all-r16-rslora"], ids)
    ).abs().max() > 1e-4
    check_prefill_and_decodes(runner, references)


def test_greedy_tokens_through_execute_match_peft(lora_models):
    """The runner's own step (execute, its sampler) on a batch of each adapter and none: greedy
    tokens equal PeftModel.generate's."""
    base, paths, references = lora_models
    runner = make_runner(base, paths)
    rng = np.random.default_rng(2)
    adapter_of = {0: "ogd-r4", 1: "qv-r8", 2: None, 3: "all-r16-rslora", 4: "qv-r8"}
    prompts = {seq: rng.integers(3, VOCAB, 11 + 3 * seq).tolist() for seq in adapter_of}
    builder = PlanBuilder(BLOCK)
    outputs: dict[int, list[int]] = {seq: [] for seq in adapter_of}
    chunks = [(seq, prompt, True) for seq, prompt in prompts.items()]
    for _ in range(NEW_TOKENS):
        result = runner.execute(*lora_plan(runner, builder, chunks, adapter_of))
        for row, (seq, *_) in enumerate(chunks):
            outputs[seq].append(int(result["sampled_ids"][row]))
        chunks = [(seq, [outputs[seq][-1]], True) for seq in adapter_of]
    for seq, prompt in prompts.items():
        with torch.inference_mode():
            expected = references[adapter_of[seq]].generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert outputs[seq] == expected, f"seq {seq} ({adapter_of[seq]})"


def test_verification_under_an_adapter_emits_its_greedy_tokens(lora_models):
    """Speculative verification on a row with an adapter: the adapter's deltas apply at every
    position of the verified span, so proposals that are always right and always wrong both give
    PeftModel's greedy tokens (and right ones are kept)."""
    from tests.test_speculation import MAX_NEW, speculative_decode

    base, paths, references = lora_models
    runner = make_runner(base, paths)
    name = "all-r16-rslora"
    adapter = {"lora_slots": [runner.lora.names.index(name)]}
    prompt = np.random.default_rng(9).integers(3, VOCAB, 13).tolist()
    with torch.inference_mode():
        expected = (
            references[name]
            .generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :]
            .tolist()
        )
    base_model = references[None]
    with torch.inference_mode():
        base_tokens = base_model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert base_tokens != expected  # the adapter matters on this prompt

    def oracle(tokens, limit):
        done = len(tokens) - len(prompt)
        return expected[done : done + min(limit, 4)]

    def wrong(tokens, limit):
        done = len(tokens) - len(prompt)
        return [(t + 1) % VOCAB for t in expected[done : done + min(limit, 3)]]

    for proposals in (oracle, wrong):
        out, _, made, kept = speculative_decode(runner, prompt, proposals, adapter)
        assert out == expected, proposals.__name__
        assert made > 0 and (kept > 0 if proposals is oracle else kept == 0)


def test_step_without_lora_slots_is_the_base_model(lora_models):
    base, paths, references = lora_models
    runner = make_runner(base, paths)
    ids = np.random.default_rng(1).integers(3, VOCAB, 30).tolist()
    logits = runner_logits(runner, PlanBuilder(BLOCK), [(0, ids, True)])
    torch.testing.assert_close(logits[0], reference_logits(references[None], ids), atol=2e-4, rtol=2e-4)


def test_plan_naming_an_empty_slot_is_refused(lora_models):
    base, paths, _ = lora_models
    runner = make_runner(base, {"qv-r8": paths["qv-r8"]}, max_loras=2)
    arrays, header = PlanBuilder(BLOCK).plan([(0, [5, 6, 7], True)])
    arrays["lora_slots"] = np.array([1], dtype=np.int32)
    with pytest.raises(InvalidPlan, match="slot 1, which holds no adapter"):
        runner.execute(arrays, header)


# ---- adapters that do not fit ---------------------------------------------------------------------


def edited_adapter(source: Path, out: Path, **config_changes) -> Path:
    out.mkdir(parents=True)
    (out / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    config = json.loads((source / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    return out


def test_rank_over_max_rank_is_refused(lora_models):
    base, paths, _ = lora_models
    with pytest.raises(AdapterError, match=r"'all-r16-rslora': rank 16 is over lora.max_rank \(8\)"):
        make_runner(base, {"all-r16-rslora": paths["all-r16-rslora"]}, max_rank=8)


def test_modules_to_save_is_refused_by_name(lora_models, tmp_path):
    base, paths, _ = lora_models
    bad = edited_adapter(paths["qv-r8"], tmp_path / "bad", modules_to_save=["lm_head"])
    with pytest.raises(AdapterError, match=r"modules_to_save \(\['lm_head'\]\) is not supported"):
        make_runner(base, {"bad": bad})


def test_unsupported_target_module_is_refused_by_name(lora_models, tmp_path):
    base, _, _ = lora_models
    bad = save_random_adapter(base, tmp_path / "embed", 7, r=4, target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(AdapterError, match="target module embed_tokens is not supported"):
        make_runner(base, {"embed": bad})


def test_adapter_of_another_base_is_refused_naming_the_module(lora_models, tmp_path):
    """An adapter made for a wider model: the first module whose shapes differ is named."""
    import transformers

    from tests.conftest import save_random_model
    from tests.test_families import COMMON, FAMILIES

    base, _, _ = lora_models
    _, extra = FAMILIES[BASE_FAMILY]
    wider = transformers.LlamaConfig(**{**COMMON, **extra, "intermediate_size": 128})
    other = save_random_model(wider, tmp_path / "other-base", seed=3, std=0.08)
    adapter = save_random_adapter(other, tmp_path / "other", 3, r=4, target_modules=["q_proj", "down_proj"])
    with pytest.raises(AdapterError, match=r"model\.layers\.0\.down_proj: lora_A \(4, 128\)"):
        make_runner(base, {"other": adapter})


def test_adapter_for_more_layers_is_refused_naming_the_module(lora_models, tmp_path):
    import transformers

    from tests.conftest import save_random_model
    from tests.test_families import COMMON, FAMILIES

    base, _, _ = lora_models
    _, extra = FAMILIES[BASE_FAMILY]
    deeper = transformers.LlamaConfig(**{**COMMON, **extra, "num_hidden_layers": 3})
    other = save_random_model(deeper, tmp_path / "deeper-base", seed=4, std=0.08)
    adapter = save_random_adapter(other, tmp_path / "deeper", 4, r=4, target_modules=["v_proj"])
    with pytest.raises(
        AdapterError, match=r"layers\.2\.self_attn\.v_proj\.lora_A\.weight: the base model has no such module"
    ):
        make_runner(base, {"deeper": adapter})


def test_activated_lora_is_refused_by_name(lora_models, tmp_path):
    """PEFT's activated LoRA applies its deltas only from the invocation tokens on; its tensors are
    ordinary lora_A / lora_B, so only its config tells it from a LoRA served on every token."""
    base, _, _ = lora_models
    alora = save_random_adapter(
        base, tmp_path / "alora", 8, task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"],
        alora_invocation_tokens=[5, 6],
    )  # fmt: skip
    with pytest.raises(AdapterError, match=r"'alora': alora_invocation_tokens \(\[5, 6\]\) is not supported"):
        make_runner(base, {"alora": alora})


@pytest.mark.parametrize(
    "option, value",
    [
        ("arrow_config", {"top_k": 2, "router_temperature": 1.0}),
        ("kasa_config", {"init_diag": 1.0}),
        ("use_bdlora", {"target_modules_bd_a": ["q_proj"], "nblocks": 2}),
        ("use_qalora", True),
        ("layer_replication", [[0, 2], [1, 2]]),
        ("trainable_token_indices", [3, 4]),
        ("lora_bias", True),
        ("use_dora", True),
        ("bias", "lora_only"),
        ("rank_pattern", {"q_proj": 2}),
        ("alpha_pattern", {"q_proj": 2}),
        ("fan_in_fan_out", True),
    ],
)
def test_options_that_change_the_forward_are_refused_by_name(lora_models, tmp_path, option, value):
    """Each PEFT option that makes an adapter compute other than scaling * B @ A on its modules,
    set in an otherwise plain adapter's config (its tensors unchanged, as such adapters' are)."""
    base, paths, _ = lora_models
    bad = edited_adapter(paths["qv-r8"], tmp_path / "bad", **{option: value})
    with pytest.raises(AdapterError, match=rf"'bad': {option} \(.*\) is not supported: "):
        make_runner(base, {"bad": bad})


@pytest.mark.parametrize(
    "family, target_modules, targeted",
    [
        ("qwen3-moe-norm-topk", ["q_proj", "down_proj"], r"\['down_proj'\]"),
        # all-linear: PEFT adds a rank_pattern / alpha_pattern of its own for the fused gate_up_proj;
        # the experts, not those, are what the adapter asks for.
        ("mixtral", "all-linear", r"\[.*'gate_up_proj'.*\]"),
    ],
)
def test_adapter_on_mixture_of_experts_is_refused_naming_the_experts(
    tmp_path, family, target_modules, targeted
):
    """PEFT targets a mixture of experts' stacked experts for down_proj / gate_up_proj as
    parameters (target_parameters): those are not served."""
    from tests.conftest import save_random_model
    from tests.test_moe import random_moe_config

    base = save_random_model(random_moe_config(family), tmp_path / "moe", seed=5, std=0.08)
    adapter = save_random_adapter(
        base, tmp_path / "moe-lora", 5, r=2, lora_alpha=4, target_modules=target_modules
    )
    with pytest.raises(AdapterError, match=rf"'moe-lora': target_parameters \({targeted}\) is not supported"):
        make_runner(base, {"moe-lora": adapter})


def test_missing_or_corrupt_files_are_refused(lora_models, tmp_path):
    base, paths, _ = lora_models
    with pytest.raises(AdapterError, match=r"'gone': cannot read .*adapter_config\.json"):
        make_runner(base, {"gone": tmp_path / "nowhere"})
    corrupt = edited_adapter(paths["qv-r8"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match=r"'corrupt': cannot read adapter_model\.safetensors"):
        make_runner(base, {"corrupt": corrupt})


@pytest.mark.parametrize(
    "config, message",
    [
        (b'{"r": 8, "lora_alpha": "\xff"}', r"'utf-8' codec can't decode byte 0xff"),
        (b"[" * 100_000 + b"]" * 100_000, r"maximum recursion depth exceeded"),
        (b'{"r": 8, "lora_alpha": ' + b"9" * 5000 + b"}", r"Exceeds the limit \(4300 digits\)"),
    ],
    ids=["not-utf-8", "nested-too-deep", "integer-of-5000-digits"],
)
def test_unreadable_adapter_configs_are_refused_naming_the_file(lora_models, tmp_path, config, message):
    """JSON's decoder raises other than JSONDecodeError for these: refused as unreadable, not a
    UnicodeDecodeError / RecursionError that takes down a worker loading it at its start."""
    base, paths, _ = lora_models
    bad = edited_adapter(paths["qv-r8"], tmp_path / "bad")
    (bad / "adapter_config.json").write_bytes(config)
    with pytest.raises(
        AdapterError, match=rf"^adapter 'bad': cannot read .*adapter_config\.json: .*{message}"
    ):
        make_runner(base, {"bad": bad})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"r": True}, r"r must be an integer >= 1, got True"),  # JSON's true is a Python int
        ({"lora_alpha": "16"}, r"lora_alpha must be a number, got '16'"),
        ({"lora_alpha": None}, r"lora_alpha must be a number, got None"),
        ({"target_modules": [["q_proj"]]}, r"target_modules must be .* got \[\['q_proj'\]\]"),
        ({"target_modules": [1, "v_proj"]}, r"target_modules must be .* got \[1, 'v_proj'\]"),
    ],
)
def test_config_values_of_the_wrong_type_are_refused_by_name(lora_models, tmp_path, changes, message):
    """Named, not a TypeError from the scaling's arithmetic, nor a rank of True taken as 1."""
    base, paths, _ = lora_models
    bad = edited_adapter(paths["qv-r8"], tmp_path / "bad", **changes)
    with pytest.raises(AdapterError, match=rf"'bad': {message}"):
        make_runner(base, {"bad": bad})


@pytest.mark.parametrize(
    "value, config, message",
    [
        (float("nan"), {}, r"lora_A holds NaN or infinite values"),
        (float("inf"), {}, r"lora_A holds NaN or infinite values"),
        (1e300, {}, r"lora_A holds NaN or infinite values \(in float32\)"),  # float64, past float32's range
        (None, {"lora_alpha": 1e308}, r"lora_B times the scaling 1\.25e\+307 is past float32's range"),
    ],
    ids=["nan", "inf", "float64-past-float32", "alpha-past-float32"],
)
def test_adapters_of_non_finite_weights_are_refused_naming_the_module(
    lora_models, tmp_path, value, config, message
):
    """Served, they made every token of the adapter's requests NaN, and the sampler's argmax
    picked a token of NaN logits all the same: garbage output, no error."""
    from safetensors.torch import load_file, save_file

    base, paths, _ = lora_models
    bad = edited_adapter(paths["qv-r8"], tmp_path / "bad", **config)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    if value is not None:
        key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
        tensors[key] = tensors[key].double()
        tensors[key][2, 3] = value
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    where = "model.layers.1.v_proj" if value is not None else "model.layers.0.q_proj"
    with pytest.raises(AdapterError, match=rf"^adapter 'bad': {where}: {message}"):
        make_runner(base, {"bad": bad})


def test_adapters_past_the_slots_dtype_range_are_refused_naming_the_module(lora_models, tmp_path):
    """Finite in float32 but past float16's 65504, an A copied into a float16 model's slots was an
    infinity, and its requests' tokens NaN; bfloat16 slots hold float32's range and take it."""
    from safetensors.torch import load_file, save_file

    base, paths, _ = lora_models
    big = edited_adapter(paths["qv-r8"], tmp_path / "big")
    tensors = load_file(str(big / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    tensors[key][2, 3] = 1e5
    save_file(tensors, str(big / "adapter_model.safetensors"))
    with pytest.raises(
        AdapterError,
        match=r"^adapter 'big': model.layers.1.v_proj: A holds values past float16's range \(65504\)",
    ):
        ModelRunner(
            base, dtype="float16", kv_cache_bytes=2 << 20, block_size=BLOCK, max_loras=1, max_lora_rank=64,
            lora_adapters={"big": str(big)},
        )  # fmt: skip
    assert make_runner(base, {"big": big}, lora_dtype="bfloat16").lora.names[0] == "big"


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_adapters_of_integer_or_bool_weights_are_refused_naming_the_tensor(lora_models, tmp_path, dtype):
    """Not cast to float32 and served: an integer or bool tensor is no LoRA weight (GGUF's I8 /
    I32 are refused alike). Float16, bfloat16, float64 and float8 weights are cast and served."""
    from safetensors.torch import load_file, save_file

    base, paths, _ = lora_models
    bad = edited_adapter(paths["qv-r8"], tmp_path / "bad")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    tensors[key] = (tensors[key] * 100).to(dtype)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        AdapterError, match=rf"^adapter 'bad': {re.escape(key)} is {name}: LoRA weights are floating point"
    ):
        make_runner(base, {"bad": bad})


def test_an_adapter_copied_in_ahead_serves_a_later_step_without_a_swap(lora_models):
    """Two slots, three adapters in host memory. A step whose row uses slot 0 names a third
    adapter for slot 1 in its header's lora_prefetch: the worker starts that copy with the step,
    and the next step, whose row uses slot 1, waits for the copy instead of swapping on its path;
    every row's greedy token and logits are its adapter's PeftModel's. Refused: a lora_prefetch into
    a slot a row of its step uses, one of the wrong length, a row on a slot still being copied
    into that the header does not name."""
    base, paths, references = lora_models
    runner = make_runner(base, paths, max_loras=2)
    assert runner.lora.names == ["qv-r8", "all-r16-rslora"]
    builder = PlanBuilder(BLOCK)
    first, second = list(range(3, 20)), list(range(7, 30))
    arrays, header = lora_plan(runner, builder, [(0, first, True)], {0: "qv-r8"})
    for prefetch, refusal in [
        (["ogd-r4", ""], "lora_prefetch copies into slot 0, which a row of the step uses"),
        (["ogd-r4"], "lora_prefetch names 1 slots, the worker has 2"),
    ]:
        with pytest.raises(InvalidPlan, match=refusal):
            runner.execute(arrays, msgspec.structs.replace(header, lora_prefetch=prefetch))
    header = msgspec.structs.replace(header, lora_slots=["qv-r8", ""], lora_prefetch=["", "ogd-r4"])
    swaps = runner.num_lora_swaps
    result = runner.execute(arrays, header)
    assert int(result["sampled_ids"][0]) == int(reference_logits(references["qv-r8"], first).argmax())
    assert runner.num_lora_prefetches == 1 and set(runner.lora_copies) == {1}
    arrays, header = builder.plan([(1, second, True)])
    arrays["lora_slots"] = np.array([1], np.int32)
    with pytest.raises(InvalidPlan, match="lora_slots names slot 1, which holds no adapter"):
        runner.validate(arrays, header)  # the header does not name the slot: its copy is not waited for
    header = msgspec.structs.replace(header, lora_slots=["", "ogd-r4"])
    runner.swap_loras(header.lora_slots)  # as execute does first: waits for the copy in flight
    assert runner.lora.names == ["qv-r8", "ogd-r4"] and not runner.lora_copies
    assert runner.num_lora_swaps == swaps  # nothing was copied on this step's path
    expected = reference_logits(references["ogd-r4"], second)
    torch.testing.assert_close(step_logits(runner, arrays, header)[0], expected, atol=2e-4, rtol=2e-4)


def test_adapters_beyond_the_slots_swap_in_from_host_memory(lora_models):
    """Three adapters in host memory, one slot: each step's header names the slot's adapter and
    the worker copies it in; every row's logits are its adapter's PeftModel's. A header that
    names an adapter the worker does not hold is refused."""
    base, paths, references = lora_models
    runner = make_runner(base, paths, max_loras=1)
    assert runner.lora.names == ["qv-r8"] and set(runner.lora_host) == set(ADAPTERS)
    builder = PlanBuilder(BLOCK)
    names = list(ADAPTERS) * 2  # interleaved: every step swaps
    histories = {seq: list(range(3 + seq, 20 + seq)) for seq in range(len(names))}
    swaps = runner.num_lora_swaps
    for seq, name in enumerate(names):
        arrays, header = lora_plan(runner, builder, [(seq, histories[seq], True)], {seq: name}, slots=[name])
        logits = step_logits(runner, arrays, header)
        expected = reference_logits(references[name], histories[seq])
        torch.testing.assert_close(logits[0], expected, atol=2e-4, rtol=2e-4, msg=f"seq {seq} ({name})")
    assert runner.num_lora_swaps - swaps == len(names) - 1  # the first one was in the slot already
    # A name loaded again from other files (after an unload) replaces its old weights in the slot.
    runner.swap_loras(["qv-r8"])
    assert runner.load_lora(m.AdapterSource("qv-r8", str(paths["ogd-r4"]))) == ""
    assert runner.lora.names == [None]
    seq = len(names)
    arrays, header = lora_plan(runner, builder, [(seq, histories[0], True)], {seq: "qv-r8"}, slots=["qv-r8"])
    expected = reference_logits(references["ogd-r4"], histories[0])
    torch.testing.assert_close(step_logits(runner, arrays, header)[0], expected, atol=2e-4, rtol=2e-4)
    arrays, header = lora_plan(runner, builder, [(seq + 1, [5, 6, 7], True)], {seq + 1: "qv-r8"})
    with pytest.raises(InvalidPlan, match="LoRA adapter 'nope' is not loaded in this worker"):
        runner.execute(arrays, msgspec.structs.replace(header, lora_slots=["nope"]))


def finished_loads(runner: ModelRunner, timeout_s: float = 60.0) -> list[tuple[str, int, str]]:
    """The runner's loads whose read is over, once there is one (or none after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while not (finished := runner.finished_lora_loads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return finished


def test_an_adapter_loaded_at_run_time_is_read_while_steps_run(lora_models, monkeypatch):
    """A load (POST /v1/load_lora_adapter) reads and checks the adapter's files on the runner's
    own thread: steps run, with their adapters, while a read is in flight (here held on an
    event, as a large adapter's read would be), and the load is answered, with its load id, and
    serves once it is over. An unload of a name still being read drops that read, unanswered."""
    base, paths, references = lora_models
    runner = make_runner(base, {"qv-r8": paths["qv-r8"]}, max_loras=2)
    go_on = threading.Event()
    real_load_adapter = model_runner.load_adapter

    def held_load_adapter(*args, **kwargs):
        assert go_on.wait(60), "the test never let the read finish"
        return real_load_adapter(*args, **kwargs)

    monkeypatch.setattr(model_runner, "load_adapter", held_load_adapter)
    runner.start_lora_load(m.AdapterSource("ogd-r4", str(paths["ogd-r4"])), load_id=7)
    runner.start_lora_load(m.AdapterSource("dropped", str(paths["ogd-r4"])))
    runner.unload_lora("dropped")
    builder = PlanBuilder(BLOCK)
    histories = {0: list(range(3, 20))}
    check_lora_step(runner, builder, references, [(0, histories[0])], {0: "qv-r8"}, histories)
    for _ in range(2):  # steps of an adapter already loaded go on while the read waits
        check_lora_step(runner, builder, references, [(0, histories[0][-1:])], {0: "qv-r8"}, histories)
        assert runner.finished_lora_loads() == [] and "ogd-r4" not in runner.lora_host
    go_on.set()
    assert finished_loads(runner) == [("ogd-r4", 7, "")] and not runner.lora_reads
    assert set(runner.lora_host) == {"qv-r8", "ogd-r4"}  # "dropped" never joined
    arrays, header = lora_plan(
        runner, builder, [(1, [5, 6, 7, 8], True)], {1: "ogd-r4"}, slots=["qv-r8", "ogd-r4"]
    )
    expected = reference_logits(references["ogd-r4"], [5, 6, 7, 8])
    torch.testing.assert_close(step_logits(runner, arrays, header)[0], expected, atol=2e-4, rtol=2e-4)
    runner.start_lora_load(m.AdapterSource("bad", str(paths["ogd-r4"].parent / "nowhere")))
    [(name, _, refusal)] = finished_loads(runner)
    assert name == "bad" and "nowhere" in refusal  # refused, with the reader's reason
