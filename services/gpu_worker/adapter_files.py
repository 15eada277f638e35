"""One LoRA adapter from disk, whichever its format: a PEFT directory (lora.py) or a llama.cpp
GGUF LoRA file (lora_gguf.py), checked against the model and cut to this rank's shard. It is not
in lora.py because lora_gguf.py builds on lora.py: lora.py importing it back would be a cycle."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.gpu_worker.lora import AdapterError, LoraAdapter, read_peft_adapter, shard_pair
from services.gpu_worker.lora_gguf import read_gguf_adapter

if TYPE_CHECKING:
    from services.gpu_worker.model import LlamaModel


def load_adapter(
    name: str, path: str | Path, model: LlamaModel, max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), or a llama.cpp
    GGUF LoRA file (a file, or a path ending in .gguf in any case; lora_gguf.py), checked against `model`,
    and against the range of the slots' `dtype`, and cut to this rank's shard; AdapterError says
    why one does not fit."""
    if model.config.fused_weights:
        raise AdapterError(
            f"adapter {name!r}: {model.config.architecture} (fused qkv_proj) takes no adapters"
        )
    if model.config.mla is not None:
        raise AdapterError(
            f"adapter {name!r}: {model.config.architecture} (multi-head latent attention) takes no adapters"
        )
    path = Path(path)
    is_gguf = path.suffix.lower() == ".gguf" or path.is_file()  # a PEFT adapter is a directory
    for file in [path] if is_gguf else [path / "adapter_config.json", path / "adapter_model.safetensors"]:
        refuse_unless_regular_file(name, file)
    if is_gguf:
        rank, weights = read_gguf_adapter(name, path, model, max_rank)
    else:
        rank, weights = read_peft_adapter(name, path, model, max_rank)
    check_range(name, weights, dtype)
    return LoraAdapter(name, rank, {key: shard_pair(model, key, *pair) for key, pair in weights.items()})


def check_range(
    name: str, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> None:
    """Refuse an adapter finite in float32 whose A or scaled B is past what slots of `dtype` hold
    (float16: 65504): copied into a slot it would be an infinity, and its requests NaN."""
    largest = torch.finfo(dtype).max
    if largest >= torch.finfo(torch.float32).max:
        return
    for (layer, module), pair in weights.items():
        for kind, tensor in zip(("A", "B times the scaling"), pair, strict=True):
            if torch.isinf(tensor.to(dtype)).any():  # what the slot would hold (65519 rounds to 65504)
                raise AdapterError(
                    f"adapter {name!r}: model.layers.{layer}.{module}: {kind} holds values past "
                    f"{str(dtype).removeprefix('torch.')}'s range ({largest:g}), the adapter slots' dtype"
                )


def refuse_unless_regular_file(name: str, file: Path) -> None:
    """Refuse an adapter file that is a FIFO, a device or a socket: opening a FIFO no one writes
    (or reading /dev/zero, a tty...) never returns: at the worker's start it would hold the
    worker, at run time its load's reader thread. A file that cannot be stat'ed is left to the
    format's reader, whose message says why it cannot be read."""
    try:
        mode = os.stat(file).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, a device or a socket)"
        raise AdapterError(f"adapter {name!r}: {file} is {kind}")
