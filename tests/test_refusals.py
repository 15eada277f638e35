"""Models Brigade would run wrongly are refused at load, naming the feature and what is supported:
one test per class (architecture, rope scaling, activation, quantization config, layer types,
partial rotary, GGUF architecture / tensor type / tensor / rope scaling), and the supervisor
reporting a refusal before `ready` with a non-zero exit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.gpu_worker.architectures import UnsupportedModel
from services.gpu_worker.loader import check_gguf, default_model_path, prepare_model
from services.gpu_worker.model_runner import ModelRunner
from tests.conftest import REPO_ROOT
from tests.harness import stage_processes

pytestmark = pytest.mark.timeout(300)


def with_config(src: Path, out: Path, **changes) -> Path:
    """A copy of the model dir `src` whose config.json has `changes` (None deletes a key)."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


REFUSED = {
    # name: (config changes, what the message must say)
    "architecture": (
        {"architectures": ["GPTNeoXForCausalLM"]},
        r"unsupported architecture \['GPTNeoXForCausalLM'\]",
    ),
    "multimodal architecture": (  # Gemma 3's, SmolVLM's, Qwen2.5-VL's are served, not this one
        {"architectures": ["LlavaForConditionalGeneration"]},
        "unsupported architecture",
    ),
    "M-RoPE with rope scaling": (
        {
            "rope_parameters": {
                "rope_type": "linear",
                "factor": 2.0,
                "rope_theta": 1e4,
                "mrope_section": [8, 12, 12],
            }
        },
        "unsupported M-RoPE of rope type 'linear'",
    ),
    "M-RoPE sections": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 4]}},
        r"unsupported mrope_section \[2, 3, 4\]",
    ),
    "unknown model_type": ({"architectures": None, "model_type": "falcon"}, "model_type 'falcon'"),
    "rope scaling": (
        {"rope_parameters": {"rope_type": "ntk-by-parts", "factor": 4.0, "rope_theta": 10000.0}},
        "unsupported rope scaling type 'ntk-by-parts'",
    ),
    "rope scaling (old rope_scaling key)": (
        {"rope_parameters": None, "rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}},
        "unsupported rope scaling type 'ntk-by-parts'",
    ),
    "activation": ({"hidden_act": "relu"}, "unsupported activation 'relu'"),
    "quantization config": (
        {"quantization_config": {"quant_method": "gptq", "bits": 4}},
        "unsupported quantization_config \\(quant_method 'gptq'\\)",
    ),
    "layer type": ({"layer_types": ["full_attention", "chunked_attention"]}, "unsupported layer_types"),
    "partial rotary": ({"partial_rotary_factor": 0.5}, "unsupported partial_rotary_factor"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_config_is_refused_at_preparation(
    tiny_model_dir: Path, tmp_path: Path, case: str
) -> None:
    changes, message = REFUSED[case]
    model_dir = with_config(tiny_model_dir, tmp_path / "model", **changes)
    with pytest.raises(UnsupportedModel, match=message) as refused:
        prepare_model(str(model_dir))
    assert "supported" in str(refused.value).split(";")[-1]  # ... and lists what is
    # The worker refuses it the same way (no weight is read first).
    with pytest.raises(UnsupportedModel, match=message):
        ModelRunner(model_dir, dtype="float32", kv_cache_bytes=1 << 20)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str]], **fields) -> Path:
    """A minimal GGUF: `tensors` name -> (data, GGML type name); raw bytes for block types."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for key, value in fields.items():
        writer.add_string(key, value)
    for name, (data, type_name) in tensors.items():
        kind = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, data, raw_dtype=None if type_name == "F32" else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_reader(path: Path):
    import gguf

    return gguf.GGUFReader(str(path))


def test_embedded_gguf_passes_the_check() -> None:
    check_gguf(gguf_reader(Path(default_model_path())))


GGUF_REFUSED = {
    "architecture": ("falcon", {"token_embd.weight": (np.zeros((4, 32), np.float32), "F32")}, {},
                     "unsupported GGUF architecture 'falcon'"),
    # IQ2_XXS: 66-byte blocks of 256 weights, which Brigade does not read.
    "tensor type": ("llama", {"blk.0.ffn_down.weight": (np.zeros((2, 66), np.uint8), "IQ2_XXS")}, {},
                    r"unsupported GGUF tensor type\(s\) \['IQ2_XXS'\]"),
    # A mixture-of-experts router, which no supported family has.
    "tensor": ("llama", {"blk.0.ffn_gate_inp.weight": (np.ones((4, 32), np.float32), "F32")}, {},
               r"unsupported GGUF tensor\(s\) \['blk.0.ffn_gate_inp.weight'\]"),
    "rope scaling": ("llama", {"token_embd.weight": (np.zeros((4, 32), np.float32), "F32")},
                     {"llama.rope.scaling.type": "yarn"}, "unsupported GGUF rope scaling type 'yarn'"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(GGUF_REFUSED))
def test_unsupported_gguf_is_refused(tmp_path: Path, case: str) -> None:
    arch, tensors, fields, message = GGUF_REFUSED[case]
    path = write_gguf(tmp_path / "model.gguf", arch, tensors, **fields)
    with pytest.raises(UnsupportedModel, match=message):
        check_gguf(gguf_reader(path))
    with pytest.raises(UnsupportedModel, match=message):  # conversion checks first, caches nothing
        prepare_model(str(path), cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").glob("*") if not p.name.startswith(".")]


def test_supervisor_reports_the_refusal_before_ready(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = with_config(tiny_model_dir, tmp_path / "model", architectures=["GPTNeoXForCausalLM"])
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir),
         "--set", f"model.path={model_dir}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert "unsupported architecture ['GPTNeoXForCausalLM']" in done.stderr
    assert "LlamaForCausalLM" in done.stderr  # the supported list
    assert "ready" not in done.stdout
    assert not stage_processes(run_dir)
