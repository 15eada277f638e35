"""LoRA adapters in llama.cpp's GGUF format: read into the same pairs as a PEFT adapter's (lora.py),
and written from a PEFT adapter (for the tests and benchmarks/lora_bench.py).

A GGUF LoRA file says `general.type` = "adapter", `adapter.type` = "lora", `general.architecture`
= llama.cpp's name of the base model's architecture and `adapter.lora.alpha`; its tensors are
`blk.<layer>.<attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down>.weight.lora_a` and
`.lora_b`, oriented as PEFT's (lora_a [r, in], lora_b [out, r] as row-major arrays; GGUF lists
the dimensions innermost first), in F32, F16, BF16 or Q8_0. llama.cpp scales each pair by
alpha / r, r being that pair's rank, or by 1 where alpha is 0 or absent; there is no rsLoRA flag,
so the writer stores an rsLoRA adapter's alpha as lora_alpha * sqrt(r) (the same scaling). For
llama.cpp's "llama" architecture (Llama, Mistral, Mixtral) its converter permutes the rows of
q and k for its interleaved rotary pairs, and so the rows of their lora_b: read back in HF order
as the base model's GGUF weights are (loader.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.gpu_worker.lora import (
    PEFT_WEIGHT_NAME,
    AdapterError,
    check_pair_shapes,
    module_shapes,
    scaled_pair,
)

if TYPE_CHECKING:
    from services.gpu_worker.model import LlamaModel

# llama.cpp's tensor names of the projections an adapter may target.
GGUF_MODULES = {
    "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
    "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
}  # fmt: skip
HF_TO_GGUF = {hf_name: gguf_name for gguf_name, hf_name in GGUF_MODULES.items()}
_TENSOR_NAME = re.compile(rf"blk\.(\d+)\.({'|'.join(GGUF_MODULES)})\.weight\.lora_([ab])")
# The HF architectures that take adapters -> the architecture llama.cpp converts them to.
LLAMA_CPP_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
    "OlmoeForCausalLM": "olmoe", "GptOssForCausalLM": "gpt-oss",
}  # fmt: skip
# llama.cpp's architectures whose q / k rows its converter permutes (see the module doc), as the
# writer permutes them; the reader unpermutes them as the base model's loader does (_hf_rows).
PERMUTED_QK_ARCHITECTURES = ("llama",)
# The tensor types llama.cpp's LoRA converter writes (--outtype f32, f16, bf16, q8_0).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0")


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_adapter(
    name: str, path: Path, model: LlamaModel, max_rank: int
) -> tuple[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]:
    """(rank, (layer, module) -> (A, B * scaling)) of a llama.cpp GGUF LoRA file, whole (not
    sharded), in float32 and HF's row order, every pair checked against the model's shapes. Pairs
    of smaller rank than the largest (PEFT's rank_pattern) are zero-padded to it: the slots hold
    one rank per adapter."""
    import gguf
    from gguf.quants import dequantize

    from services.gpu_worker.loader import GGUF_MODEL_TYPES, _hf_rows

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError, OSError, struct errors... for a bad file
        raise AdapterError(f"adapter {name!r}: cannot read {path} as GGUF: {exc}") from None
    kind = _field(reader, "general.type")
    if kind != "adapter":
        raise AdapterError(f"adapter {name!r}: {path.name} is not an adapter: its general.type is {kind!r}")
    adapter_type = _field(reader, "adapter.type")
    if adapter_type != "lora":
        raise AdapterError(f"adapter {name!r}: adapter.type {adapter_type!r}, only 'lora' is served")
    if _field(reader, "adapter.alora.invocation_tokens") is not None:
        raise AdapterError(
            f"adapter {name!r}: activated LoRA (adapter.alora.invocation_tokens) is not supported"
        )
    arch, base = _field(reader, "general.architecture"), model.config.architecture
    expected = LLAMA_CPP_ARCHITECTURES.get(base)
    if arch != expected:
        raise AdapterError(
            f"adapter {name!r}: general.architecture {arch!r}, the base model ({base}) needs {expected!r}"
        )
    alpha = _field(reader, "adapter.lora.alpha")
    alpha = 0.0 if alpha is None else alpha
    # llama.cpp reads it as a float32 and aborts on another type; an integer is taken here as
    # the number it is, but a string, an array or a bool would be a ValueError / TypeError
    # naming nothing, or read as a number it is not.
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {name!r}: adapter.lora.alpha must be a finite number, got {alpha!r}")
    shapes = module_shapes(model, whole=True)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        match = _TENSOR_NAME.fullmatch(tensor.name)
        if match is None:
            raise AdapterError(
                f"adapter {name!r}: tensor {tensor.name} is not a lora_a / lora_b of "
                f"blk.N.<{'|'.join(GGUF_MODULES)}>.weight"
            )
        if tensor.tensor_type.name not in TENSOR_TYPES:
            raise AdapterError(
                f"adapter {name!r}: tensor {tensor.name} is {tensor.tensor_type.name}: one of {list(TENSOR_TYPES)}"
            )
        layer, module = int(match[1]), GGUF_MODULES[match[2]]
        if (layer, module) not in shapes:
            raise AdapterError(f"adapter {name!r}: {tensor.name}: the base model has no such module")
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        pairs.setdefault((layer, module), {})[match[3]] = values.reshape(
            [int(d) for d in reversed(tensor.shape)]
        )
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {path.name} holds no LoRA tensors")
    # What the loader's unpermutation of q / k rows reads of the model (loader._hf_rows).
    rows_config = {
        "model_type": GGUF_MODEL_TYPES.get(arch, arch),
        "num_attention_heads": model.config.num_attention_heads,
        "num_key_value_heads": model.config.num_key_value_heads,
    }
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        where = f"blk.{layer}.{HF_TO_GGUF[module]}.weight"
        if set(pair) != {"a", "b"}:
            raise AdapterError(f"adapter {name!r}: {where} has lora_a or lora_b but not both")
        a, b = torch.from_numpy(pair["a"]), torch.from_numpy(pair["b"])
        rank = b.shape[-1]  # llama.cpp's: lora_b's columns
        check_pair_shapes(name, where, ("lora_a", "lora_b"), a.shape, b.shape, rank, shapes[(layer, module)])
        if rank < 1:  # alpha / rank below would divide by zero
            raise AdapterError(
                f"adapter {name!r}: {where}: rank 0 (lora_a {tuple(a.shape)}): no LoRA weights"
            )
        if rank > max_rank:
            raise AdapterError(f"adapter {name!r}: {where}: rank {rank} is over lora.max_rank ({max_rank})")
        b = torch.from_numpy(np.ascontiguousarray(_hf_rows(f"{where}.lora_b", b.numpy(), rows_config)))
        scaling = alpha / rank if alpha else 1.0
        weights[(layer, module)] = scaled_pair(name, where, ("lora_a", "lora_b"), a, b, scaling)
    rank = max(a.shape[0] for a, _ in weights.values())
    padded = {
        key: (
            torch.nn.functional.pad(a, (0, 0, 0, rank - a.shape[0])),
            torch.nn.functional.pad(b, (0, rank - b.shape[1])),
        )
        for key, (a, b) in weights.items()
    }
    return rank, padded


def _llama_cpp_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """q / k rows from HF's order (each head's two rotary halves) to llama.cpp's "llama" order
    (each head's interleaved pairs); loader._unpermute is the inverse."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_adapter(peft_dir: Path, base_config: dict, out: Path, tensor_type: str = "F32") -> Path:
    """A GGUF LoRA file at `out` holding the PEFT adapter in `peft_dir`, as llama.cpp's converter
    lays it out for the base model whose config.json is `base_config` (see the module doc), its
    tensors in `tensor_type` (one of TENSOR_TYPES; a Q8_0 tensor whose rows are not whole blocks
    is written F16, as that converter does)."""
    import gguf
    from safetensors.torch import load_file

    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r}: one of {list(TENSOR_TYPES)}")
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    if config.get("alpha_pattern") or (config.get("use_rslora") and config.get("rank_pattern")):
        # The file's one alpha cannot scale each pair as these ask.
        raise ValueError("alpha_pattern, or rsLoRA with a rank_pattern, has no GGUF LoRA equivalent")
    rank, alpha = config["r"], float(config.get("lora_alpha", 8))
    if config.get("use_rslora"):
        alpha *= math.sqrt(rank)  # alpha / r == lora_alpha / sqrt(r)
    arch = LLAMA_CPP_ARCHITECTURES[base_config["architectures"][0]]
    heads = {
        "q_proj": base_config["num_attention_heads"],
        "k_proj": base_config.get("num_key_value_heads", base_config["num_attention_heads"]),
    }
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, tensor in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        match = PEFT_WEIGHT_NAME.fullmatch(key)
        if match is None or match[2] not in GGUF_MODULES.values():
            raise ValueError(f"{key}: not a LoRA A/B of a q/k/v/o/gate/up/down")
        layer, module, kind = match[1], match[2], match[3].lower()
        values = tensor.float().numpy()
        if kind == "b" and arch in PERMUTED_QK_ARCHITECTURES and module in heads:
            values = _llama_cpp_rows(values, heads[module])
        _add_tensor(writer, f"blk.{layer}.{HF_TO_GGUF[module]}.weight.lora_{kind}", values, tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer, name: str, values: np.ndarray, tensor_type: str) -> None:
    import gguf
    from gguf.quants import quantize

    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    if values.shape[-1] % block_size:
        qtype = gguf.GGMLQuantizationType.F16
    data = quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)
    writer.add_tensor(name, data, raw_dtype=None if qtype in plain else qtype)
