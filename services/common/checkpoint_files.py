"""Where a checkpoint's safetensors weights are (the one listing the worker's loader and the
encoder's towers both read), and the check that a tower has all the weights it names."""

from __future__ import annotations

import json
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


def take_weights(
    names: list[str], weights: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The named weights in `dtype`; a ValueError naming the first few the checkpoint lacks."""
    missing = [name for name in names if name not in weights]
    if missing:
        raise ValueError(f"the checkpoint lacks vision weights: {', '.join(missing[:4])}")
    return {name: weights[name].to(dtype) for name in names}
