"""Where a checkpoint's safetensors weights are: the one listing the worker's loader and the
encoder's towers both read."""

from __future__ import annotations

import json
from pathlib import Path


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
