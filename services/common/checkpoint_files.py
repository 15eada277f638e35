"""Where a checkpoint's safetensors weights are (the one listing the worker's loader and the
encoder's towers both read), the names the worker loads them under, and the check that a tower
has all the weights it names. Light (no torch): the supervisor's preflight reads the names too."""

from __future__ import annotations

import json
import struct
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the light stages import this module without torch
    import torch


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: its index's shards, else model.safetensors, else every
    *.safetensors in the directory. FileNotFoundError when there are none."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


# A vision-language checkpoint's language model weights, under the names of its causal LM's
# (services/common/vision_language.py): as the hub's Gemma 3 and SmolVLM checkpoints name them, and as
# transformers names them in memory. Its vision weights are the encoder stage's.
LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."),  # SmolVLM / Idefics3
)
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.vision_model.",
    "model.connector.",
    "visual.",  # Qwen2.5-VL: the hub's and transformers 5's saves
    "model.visual.",
)
# A base model's own save (transformers' Qwen3Model, not its Qwen3ForCausalLM: the hub's
# Qwen3-Embedding checkpoints) names its weights without the causal LM's `model.` prefix
# (`embed_tokens.weight`, `layers.0.…`, `norm.weight`) and has no lm_head. The worker loads them
# under the prefixed names, as vLLM and SGLang do.
BASE_MODEL_EMBEDDING = "embed_tokens.weight"


def is_bare_base_model(stored: Collection[str]) -> bool:
    """Whether the checkpoint's weight names (`stored_weight_names`) are a base model's own save."""
    return BASE_MODEL_EMBEDDING in stored and not any(name.startswith("model.") for name in stored)


def text_weight_name(name: str, bare_base: bool = False) -> str | None:
    """The name the worker loads a checkpoint weight under; None for a vision weight. `bare_base`:
    the checkpoint is a base model's own save (`is_bare_base_model`), whose names all take `model.`."""
    if name.startswith(VISION_PREFIXES):
        return None
    if bare_base:
        return "model." + name
    for prefix, renamed in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return renamed + name[len(prefix) :]
    return name


def stored_weight_names(model_dir: Path) -> set[str]:
    """Every weight name in the checkpoint's safetensors, as stored, read from the files' headers
    (an 8-byte little-endian length, then that much JSON) without loading a tensor."""
    names: set[str] = set()
    for file in safetensors_files(model_dir):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names.update(json.loads(f.read(size)))
    names.discard("__metadata__")
    return names


def text_weight_names(model_dir: Path) -> set[str]:
    """The names the worker loads the checkpoint's weights under (`text_weight_name`), its vision
    weights left out."""
    stored = stored_weight_names(model_dir)
    bare_base = is_bare_base_model(stored)
    return {name for s in stored if (name := text_weight_name(s, bare_base)) is not None}


def take_weights(
    names: list[str], weights: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The named weights in `dtype`; a ValueError naming the first few the checkpoint lacks."""
    missing = [name for name in names if name not in weights]
    if missing:
        raise ValueError(f"the checkpoint lacks vision weights: {', '.join(missing[:4])}")
    return {name: weights[name].to(dtype) for name in names}
