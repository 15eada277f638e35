"""`supervisor.log_level: DEBUG` follows each request through the stages: where the tokenizer
sends it, when its scheduler queues, finishes or aborts it, and how it ended for its client."""

from __future__ import annotations

import contextlib
import queue
import re
import time
from pathlib import Path

import pytest

from client import Client
from tests.harness import Run, assert_clean, brigade_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def wait_for_lines(run: Run, patterns: list[str], timeout: float = 30.0) -> list[str]:
    """The first log line matching each pattern, waiting for the ones not logged yet."""
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(patterns) and time.monotonic() < deadline:
        for pattern in patterns:
            if pattern not in found:
                match = next((line for line in run.log if re.search(pattern, line)), None)
                if match is not None:
                    found[pattern] = match
        if len(found) < len(patterns):
            with contextlib.suppress(queue.Empty):  # the next line logged, into run.log
                run.log.append(run.lines.get(timeout=0.2))
    missing = [p for p in patterns if p not in found]
    assert not missing, f"no log line matches {missing}; log tail:\n{''.join(run.log[-60:])}"
    return [found[p] for p in patterns]


def test_debug_logs_follow_a_request_through_the_stages(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    with brigade_run(
        run_dir, f"model.path={tiny_model_dir}", "gateway.replicas=0", "supervisor.log_level=DEBUG"
    ) as run:
        with Client(run.run_dir, timeout=120) as client:
            done = client.generate("Tell me a story", max_tokens=4, ignore_eos=True, request_id="dbg-done")
            stream = client.stream("Tell me a story", max_tokens=400, ignore_eos=True, request_id="dbg-gone")
            next(stream)
            stream.close()
            # Waited for with the client still connected: once it disconnects, the tokenizer may
            # find it gone (sending it a token) before it reads the Abort, and log that instead.
            admitted, aborted = wait_for_lines(
                run,
                [
                    r"request 'dbg-done' \(engine id (\S+)\): \d+ prompt tokens to engine group 0",
                    r"request 'dbg-gone' \(engine id (\S+)\) aborted by its client",
                ],
            )
        assert done.finish_reason == "length"
        done_id = re.search(r"engine id (\S+)\)", admitted).group(1)
        gone_id = re.search(r"engine id (\S+)\)", aborted).group(1)
        wait_for_lines(
            run,
            [
                rf"scheduler-0.*request {done_id} queued: \d+ prompt tokens, 0 output tokens already",
                rf"scheduler-0.*request {done_id} finished: length",
                rf"tokenizer-0.*request {done_id} finished: length",
                rf"scheduler-0.*request {gone_id} aborted",
            ],
        )
    assert_clean(run_dir)
