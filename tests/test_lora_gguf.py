"""GGUF LoRA files, as llama.cpp's convert_lora_to_gguf.py lays them out, against HF transformers
with PEFT: test_lora.py's random Llama base and PEFT adapters (plus one whose ranks differ by
module, PEFT's rank_pattern) written as GGUF files in F32, F16, BF16 and Q8_0 by
lora_gguf.write_gguf_adapter, served from those files in one batch with a row of no adapter.
Each row's logits and greedy token must be PeftModel's with the adapter's weights rounded as the
file holds them (gguf's own quantize / dequantize). GGUF files that are no LoRA of this base
model are refused, naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ipc import messages as m
from services.gpu_worker.lora import AdapterError
from services.gpu_worker.lora_gguf import write_gguf_adapter
from tests import test_lora
from tests.test_families import BLOCK, VOCAB
from tests.test_lora import (
    NEW_TOKENS,
    check_lora_step,
    hf_base,
    lora_plan,
    make_runner,
    reference_logits,
    save_random_adapter,
    step_logits,
)
from tests.test_model import PlanBuilder

pytestmark = pytest.mark.timeout(300)

peft = pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")

lora_models = test_lora.lora_models  # the random base, PEFT adapters and references (a fixture)

# adapter -> the type of its GGUF file's tensors (a Q8_0 tensor whose rows are not whole 32-value
# blocks, as every lora_b of rank under 32, is F16, as llama.cpp's converter writes it).
TENSOR_TYPES = {"qv-r8": "F32", "all-r16-rslora": "BF16", "ogd-r4": "Q8_0", "pattern-r4-r12": "F16"}
# PEFT's rank_pattern: up_proj at rank 12, the others at 4 (the slots pad them to 12).
PATTERN = dict(
    r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "up_proj"], rank_pattern={"up_proj": 12}
)


def rounded_adapter(source: Path, out: Path, tensor_type: str) -> Path:
    """The PEFT adapter at `source` with each weight rounded as a GGUF tensor of `tensor_type`
    holds it (gguf's quantize, then dequantize)."""
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    tensors = {}
    for key, tensor in load_file(str(source / "adapter_model.safetensors")).items():
        qtype = gguf.GGMLQuantizationType[tensor_type]
        if tensor.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = gguf.GGMLQuantizationType.F16
        tensors[key] = torch.from_numpy(dequantize(quantize(tensor.numpy(), qtype), qtype).copy())
    out.mkdir(parents=True)
    shutil.copy(source / "adapter_config.json", out / "adapter_config.json")
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


@pytest.fixture(scope="module")
def gguf_models(lora_models, tmp_path_factory):
    """(base dir, {adapter name: its .gguf file}, {name or None: PeftModel of the rounded adapter})."""
    base, paths, references = lora_models
    root = tmp_path_factory.mktemp("lora-gguf")
    paths = {**paths, "pattern-r4-r12": save_random_adapter(base, root / "pattern", 9, **PATTERN)}
    base_config = json.loads((base / "config.json").read_text())
    files, rounded = {}, {None: references[None]}
    for name, tensor_type in TENSOR_TYPES.items():
        files[name] = write_gguf_adapter(paths[name], base_config, root / f"{name}.gguf", tensor_type)
        adapter = rounded_adapter(paths[name], root / f"{name}-rounded", tensor_type)
        rounded[name] = peft.PeftModel.from_pretrained(hf_base(base), adapter).eval()
    return base, files, rounded


def test_gguf_files_hold_llama_cpp_tensors(gguf_models):
    """The header and tensors llama.cpp reads: an adapter of type lora on the llama architecture,
    lora_a [r, in] / lora_b [out, r] (GGUF lists dimensions innermost first), in the asked type."""
    _, files, _ = gguf_models
    reader = gguf.GGUFReader(str(files["ogd-r4"]))
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["adapter.type"].contents() == "lora"
    assert reader.fields["adapter.lora.alpha"].contents() == 4.0
    tensors = {t.name: (t.tensor_type.name, [int(d) for d in t.shape]) for t in reader.tensors}
    assert tensors["blk.1.ffn_down.weight.lora_a"] == ("Q8_0", [96, 4])
    assert tensors["blk.1.ffn_down.weight.lora_b"] == ("F16", [4, 64])
    assert tensors["blk.0.attn_output.weight.lora_a"] == ("Q8_0", [64, 4])
    assert len(tensors) == 2 * 2 * 3  # 2 layers x 3 modules x (a, b)
    # rsLoRA has no flag in the format: its scaling alpha / sqrt(r) is written as alpha' / r.
    rslora = gguf.GGUFReader(str(files["all-r16-rslora"]))
    assert rslora.fields["adapter.lora.alpha"].contents() == pytest.approx(8 * 16**0.5)


def test_gguf_adapters_match_peft_in_a_mixed_batch(gguf_models):
    """Four GGUF adapters (F32, BF16 with rsLoRA, Q8_0 / F16, F16 with two ranks) and a row of
    none in each step: prefill, then decodes."""
    base, files, references = gguf_models
    runner = make_runner(base, files)
    rng = np.random.default_rng(3)
    adapter_of = {0: "qv-r8", 1: None, 2: "all-r16-rslora", 3: "ogd-r4", 4: "pattern-r4-r12"}
    histories = {seq: rng.integers(3, VOCAB, 17 + 5 * seq).tolist() for seq in adapter_of}
    builder = PlanBuilder(BLOCK)
    check_lora_step(
        runner, builder, references, [(s, list(h)) for s, h in histories.items()], adapter_of, histories
    )
    for _ in range(NEW_TOKENS):
        check_lora_step(
            runner, builder, references, [(s, h[-1:]) for s, h in histories.items()], adapter_of, histories
        )


def test_gguf_adapter_loaded_at_run_time_beside_a_peft_one(lora_models, gguf_models):
    """A GGUF adapter loaded while the worker runs (what POST /v1/load_lora_adapter sends it) and
    swapped into a slot, in one step with a PEFT directory's adapter and the base model."""
    base, peft_paths, peft_references = lora_models
    _, files, references = gguf_models
    runner = make_runner(base, {"qv-r8": peft_paths["qv-r8"]}, max_loras=2)
    assert runner.load_lora(m.AdapterSource("ogd-gguf", str(files["ogd-r4"]))) == ""
    references = {"qv-r8": peft_references["qv-r8"], "ogd-gguf": references["ogd-r4"], None: references[None]}
    adapter_of = {0: "ogd-gguf", 1: "qv-r8", 2: None}
    histories = {seq: list(range(5 + seq, 30 + 2 * seq)) for seq in adapter_of}
    builder = PlanBuilder(BLOCK)
    chunks = [(seq, list(h), True) for seq, h in histories.items()]
    arrays, header = lora_plan(runner, builder, chunks, adapter_of, slots=["qv-r8", "ogd-gguf"])
    logits = step_logits(runner, arrays, header)
    for row, seq in enumerate(adapter_of):
        expected = reference_logits(references[adapter_of[seq]], histories[seq])
        torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=2e-4, msg=f"seq {seq}")
        assert int(logits[row].argmax()) == int(expected.argmax())


# ---- files that are no LoRA of this base model --------------------------------------------------

V_PAIR = {  # a valid rank-4 pair for the base model's v_proj (64 -> 2 KV heads x 16)
    "blk.0.attn_v.weight.lora_a": np.full((4, 64), 0.01, np.float32),
    "blk.0.attn_v.weight.lora_b": np.full((32, 4), 0.01, np.float32),
}


def write_raw_gguf(
    path: Path,
    tensors: dict[str, np.ndarray],
    arch: str = "llama",
    general_type: str = "adapter",
    fields: dict | None = None,
    quantized: str = "",
) -> Path:
    """A GGUF file written with gguf's writer as given: `general_type`, adapter.type lora and
    alpha 8 unless `fields` says otherwise (None: the key left out); tensors in F32, or those
    named in `quantized` as Q4_0."""
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    for key, value in {"adapter.type": "lora", "adapter.lora.alpha": 8.0, **(fields or {})}.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
    for name, values in tensors.items():
        if name == quantized:
            q4 = gguf.GGMLQuantizationType.Q4_0
            writer.add_tensor(name, quantize(values, q4), raw_dtype=q4)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BAD_FILES = {
    "model-file": (dict(tensors=V_PAIR, general_type="model"), r"is not an adapter: its general\.type is 'model'"),
    "control-vector": (
        dict(tensors=V_PAIR, fields={"adapter.type": "control_vector"}),
        r"adapter\.type 'control_vector', only 'lora' is served",
    ),
    "wrong-arch": (
        dict(tensors=V_PAIR, arch="qwen2"),
        r"general\.architecture 'qwen2', the base model \(LlamaForCausalLM\) needs 'llama'",
    ),
    "norm-tensor": (
        dict(tensors={**V_PAIR, "blk.0.attn_norm.weight": np.ones(64, np.float32)}),
        r"tensor blk\.0\.attn_norm\.weight is not a lora_a / lora_b of blk\.N\.<attn_q\|",
    ),
    "embedding-lora": (
        dict(tensors={**V_PAIR, "token_embd.weight.lora_a": np.zeros((4, VOCAB), np.float32)}),
        r"tensor token_embd\.weight\.lora_a is not a lora_a / lora_b",
    ),
    "shape-mismatch": (
        dict(
            tensors={
                "blk.0.ffn_down.weight.lora_a": np.zeros((4, 128), np.float32),
                "blk.0.ffn_down.weight.lora_b": np.zeros((64, 4), np.float32),
            }
        ),
        r"blk\.0\.ffn_down\.weight: lora_a \(4, 128\) / lora_b \(64, 4\), the base model needs \(4, 96\) / \(64, 4\)",
    ),
    "not-transposed": (
        dict(
            tensors={
                "blk.0.attn_v.weight.lora_a": np.zeros((64, 4), np.float32),
                "blk.0.attn_v.weight.lora_b": np.zeros((32, 4), np.float32),
            }
        ),
        r"blk\.0\.attn_v\.weight: lora_a \(64, 4\) / lora_b \(32, 4\), the base model needs \(4, 64\) / \(32, 4\)",
    ),
    "layer-past-the-last": (
        dict(tensors={k.replace("blk.0", "blk.2"): v for k, v in V_PAIR.items()}),
        r"blk\.2\.attn_v\.weight\.lora_a: the base model has no such module",
    ),
    "lora_a-alone": (
        dict(tensors={"blk.0.attn_v.weight.lora_a": V_PAIR["blk.0.attn_v.weight.lora_a"]}),
        r"blk\.0\.attn_v\.weight has lora_a or lora_b but not both",
    ),
    "rank-over-max": (
        dict(
            tensors={
                "blk.0.attn_v.weight.lora_a": np.zeros((16, 64), np.float32),
                "blk.0.attn_v.weight.lora_b": np.zeros((32, 16), np.float32),
            }
        ),
        r"blk\.0\.attn_v\.weight: rank 16 is over lora\.max_rank \(8\)",
    ),
    "q4_0-tensor": (
        dict(tensors=V_PAIR, quantized="blk.0.attn_v.weight.lora_a"),
        r"tensor blk\.0\.attn_v\.weight\.lora_a is Q4_0: one of \['F32', 'F16', 'BF16', 'Q8_0'\]",
    ),
    "activated-lora": (
        dict(tensors=V_PAIR, fields={"adapter.alora.invocation_tokens": [5, 6]}),
        r"activated LoRA \(adapter\.alora\.invocation_tokens\) is not supported",
    ),
    "nan-values": (
        dict(tensors={**V_PAIR, "blk.0.attn_v.weight.lora_b": np.full((32, 4), np.nan, np.float32)}),
        r"blk\.0\.attn_v\.weight: lora_b holds NaN or infinite values",
    ),
    "inf-values": (
        dict(tensors={**V_PAIR, "blk.0.attn_v.weight.lora_a": np.full((4, 64), -np.inf, np.float32)}),
        r"blk\.0\.attn_v\.weight: lora_a holds NaN or infinite values",
    ),
    "alpha-string": (
        dict(tensors=V_PAIR, fields={"adapter.lora.alpha": "sixteen"}),
        r"adapter\.lora\.alpha must be a finite number, got 'sixteen'",
    ),
    "alpha-array": (
        dict(tensors=V_PAIR, fields={"adapter.lora.alpha": [8.0, 16.0]}),
        r"adapter\.lora\.alpha must be a finite number, got \[8\.0, 16\.0\]",
    ),
    "alpha-nan": (
        dict(tensors=V_PAIR, fields={"adapter.lora.alpha": float("nan")}),
        r"adapter\.lora\.alpha must be a finite number, got nan",
    ),
    "rank-0": (
        dict(
            tensors={
                "blk.0.attn_v.weight.lora_a": np.zeros((0, 64), np.float32),
                "blk.0.attn_v.weight.lora_b": np.zeros((32, 0), np.float32),
            }
        ),
        r"blk\.0\.attn_v\.weight: rank 0 \(lora_a \(0, 64\)\): no LoRA weights",
    ),
    "no-tensors": (dict(tensors={}), r"holds no LoRA tensors"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_gguf_files_are_refused_naming_the_problem(lora_models, tmp_path, case):
    base, _, _ = lora_models
    arguments, message = BAD_FILES[case]
    path = write_raw_gguf(tmp_path / f"{case}.gguf", **arguments)
    with pytest.raises(AdapterError, match=rf"^adapter '{case}': .*{message}"):
        make_runner(base, {case: path}, max_rank=8)


def test_unreadable_gguf_files_are_refused(lora_models, tmp_path):
    """Not GGUF at all, or missing: refused at start and at a run-time load, the worker serving on."""
    base, paths, _ = lora_models
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a GGUF file at all")
    with pytest.raises(AdapterError, match=r"^adapter 'garbage': cannot read .*garbage\.gguf as GGUF"):
        make_runner(base, {"garbage": garbage})
    runner = make_runner(base, {"qv-r8": paths["qv-r8"]})
    error = runner.load_lora(m.AdapterSource("gone", str(tmp_path / "gone.gguf")))
    assert error.startswith("adapter 'gone': cannot read") and "gone.gguf as GGUF" in error
    assert set(runner.lora_host) == {"qv-r8"}
    # A GGUF file is read as one whatever its name says (llama.cpp's files come as .GGUF too).
    for renamed in ("upper.GGUF", "no-extension"):
        (tmp_path / renamed).write_bytes(garbage.read_bytes())
        error = runner.load_lora(m.AdapterSource(renamed, str(tmp_path / renamed)))
        assert "as GGUF" in error, error
