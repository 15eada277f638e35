"""One LoRA adapter from disk, whichever its format: a PEFT directory (lora.py) or a llama.cpp
GGUF LoRA file (lora_gguf.py), checked against the model and cut to this rank's shard. It is not
in lora.py because lora_gguf.py builds on lora.py: lora.py importing it back would be a cycle."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.gpu_worker.lora import AdapterError, LoraAdapter, read_peft_adapter, shard_pair
from services.gpu_worker.lora_gguf import read_gguf_adapter

if TYPE_CHECKING:
    from services.gpu_worker.model import LlamaModel


def load_adapter(name: str, path: str | Path, model: LlamaModel, max_rank: int) -> LoraAdapter:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), or a llama.cpp
    GGUF LoRA file (a path ending in .gguf, lora_gguf.py), checked against `model` and cut to this
    rank's shard; AdapterError says why one does not fit."""
    if model.config.fused_weights:
        raise AdapterError(
            f"adapter {name!r}: {model.config.architecture} (fused qkv_proj) takes no adapters"
        )
    if model.config.mla is not None:
        raise AdapterError(
            f"adapter {name!r}: {model.config.architecture} (multi-head latent attention) takes no adapters"
        )
    if str(path).endswith(".gguf"):
        rank, weights = read_gguf_adapter(name, Path(path), model, max_rank)
    else:
        rank, weights = read_peft_adapter(name, Path(path), model, max_rank)
    return LoraAdapter(name, rank, {key: shard_pair(model, key, *pair) for key, pair in weights.items()})
