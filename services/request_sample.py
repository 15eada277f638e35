"""A bounded sample of requests and their outputs, for the MLflow sink
(`observability.mlflow.sample_requests`; off by default: prompts and outputs are user data).

A tokenizer picks at most `per_interval` requests per interval at admission, keeps their output
text while they run, and appends each finished one as a JSON line to its own file,
`<run-dir>/metrics/samples-<tokenizer>.jsonl`; the sink takes the files over (`take_samples`).
Light (no torch): the tokenizer imports it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import msgspec

from services.metrics import metrics_dir

SAMPLES_PREFIX = "samples-"
MAX_TEXT_CHARS = 8192  # of a prompt or an output, per sample
MAX_FILE_BYTES = 16 << 20  # a tokenizer stops adding while no sink takes its file

log = logging.getLogger("request_sample")


class RequestSampler:
    """A tokenizer's side of the request sample: at most `per_interval` finished requests per
    `interval_s`, appended as JSON lines to the tokenizer's own samples file for the sink to take."""

    def __init__(self, run_dir: Path, tokenizer: int, per_interval: int, interval_s: float) -> None:
        self.path = metrics_dir(run_dir) / f"{SAMPLES_PREFIX}{tokenizer}.jsonl"
        self.per_interval = per_interval
        self.interval_s = interval_s
        self.window_start = -math.inf
        self.taken = 0

    def wants(self, now: float) -> bool:
        """Whether a request admitted now joins the sample."""
        if not self.per_interval:
            return False
        if now - self.window_start >= self.interval_s:
            self.window_start, self.taken = now, 0
        if self.taken >= self.per_interval:
            return False
        self.taken += 1
        return True

    def record(self, request_id: str, prompt: str, output: str, finish_reason: str) -> None:
        line = msgspec.json.encode(
            {
                "request_id": request_id,
                "prompt": prompt[:MAX_TEXT_CHARS],
                "output": output[:MAX_TEXT_CHARS],
                "finish_reason": finish_reason,
            }
        )
        try:
            if self.path.exists() and self.path.stat().st_size > MAX_FILE_BYTES:
                return
            with self.path.open("ab") as f:
                f.write(line + b"\n")
        except OSError as exc:
            log.warning("could not record a request sample: %s", exc.strerror)


def take_samples(run_dir: Path, limit: int) -> list[dict[str, Any]]:
    """The tokenizers' samples since the last call (at most `limit`); their files start over."""
    taken: list[dict[str, Any]] = []
    for path in sorted(metrics_dir(run_dir).glob(f"{SAMPLES_PREFIX}*.jsonl")):
        claimed = path.with_suffix(".taking")
        try:
            path.replace(claimed)  # the tokenizer's next append starts a new file
            text = claimed.read_text(errors="replace")
            claimed.unlink()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                taken.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a tokenizer that died mid-write
    return taken[:limit]
