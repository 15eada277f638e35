"""The test harness's own promise: a supervisor never outlives the test process that started it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


def test_a_supervisor_is_stopped_when_its_test_process_is_killed(tmp_path) -> None:
    """A test killed by a signal runs no teardown; the kernel must still SIGTERM its supervisor."""
    # The "supervisor" records the signal it gets, so the test sees SIGTERM and not some other end.
    marker = tmp_path / "got"
    stand_in = textwrap.dedent(f"""
        import signal, sys, time
        def stop(signum, frame):
            open({str(marker)!r}, "w").write(str(signum))
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        time.sleep(60)
    """)
    test_process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from tests.harness import start_supervisor
            proc = start_supervisor(Path({str(tmp_path)!r}), command=(sys.executable, "-c", {stand_in!r}))
            assert proc.stdout.readline().strip() == "ready"
            print(proc.pid, flush=True)
            proc.wait()
        """),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    supervisor_pid = None
    try:
        supervisor_pid = int(test_process.stdout.readline())
        test_process.send_signal(signal.SIGKILL)
        test_process.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not marker.exists():
            time.sleep(0.05)
        assert marker.exists() and marker.read_text() == str(int(signal.SIGTERM))
    finally:
        test_process.kill()
        test_process.wait(10)
        if supervisor_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(supervisor_pid, signal.SIGKILL)
