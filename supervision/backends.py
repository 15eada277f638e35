"""The stage set of a run's `cluster.backend`: processes on this host (supervision/stages.py) or on
a Ray cluster (supervision/ray_stages.py, the only module that imports Ray)."""

from __future__ import annotations

import os
from pathlib import Path

from ipc.config import Config
from supervision.stages import StageSet


def make_stage_set(config: Config, run_dir: Path, log_format: str, run_id: str) -> StageSet:
    """The stage set of `cluster.backend`; Ray is imported only when it is the backend."""
    if config.cluster.backend == "ray":
        # Ray merges log lines that differ only in words with digits, across processes, and
        # prints the later ones up to 5 s late as "[repeated Nx]": two stages' lines that differ
        # only in their names ("tokenizer-0", "detokenizer-0") would hide one. Read at import.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        from supervision.ray_stages import RayStageSet

        return RayStageSet(config, run_dir, log_format, run_id)
    return StageSet(config, run_dir, log_format)
