"""The stage skeleton (services/stage.py `StageProcess`) in a real process: a detokenizer shard
started on its own, the test playing the supervisor on its control channel. It says Ready,
survives and counts a malformed message on its inbox and one on its control channel, and on
SIGTERM leaves its loop, closes its context and exits 0."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from ipc import messages as m
from ipc.codec import CONTROL_UP
from ipc.config import load_config
from ipc.endpoints import Endpoints
from ipc.shm import new_run_id
from services.stage import ControlChannel, RunInfo, Stage, write_run_info
from tests.conftest import REPO_ROOT
from tests.harness import brigade_run
from tests.harness import stop as harness_stop

pytestmark = pytest.mark.timeout(120)

WAIT_S = 60.0
LONG_HEARTBEAT_S = 120


def receive(supervisor: zmq.Socket, wanted: type, deadline: float) -> m.Ready | m.Heartbeat:
    """The stage's next message of type `wanted`, or fail at `deadline`."""
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        if supervisor.poll(left_ms):
            _, frame = supervisor.recv_multipart()
            message = CONTROL_UP.decode(frame)
            if isinstance(message, wanted):
                return message
    raise AssertionError(f"no {wanted.__name__} from the stage in time")


def test_stage_counts_malformed_input_and_stops_cleanly_on_sigterm(smollm2_dir: Path, tmp_path: Path) -> None:
    config = load_config(None, ("supervisor.heartbeat_interval_s=0.1",))
    endpoints = Endpoints(tmp_path, new_run_id())
    write_run_info(tmp_path, RunInfo(endpoints.run_id, os.getpid(), str(smollm2_dir), "smollm2", [], config))
    ctx = zmq.Context()
    supervisor = ctx.socket(zmq.ROUTER)
    supervisor.bind(endpoints.supervisor().bind)
    inbox = ctx.socket(zmq.PUSH)
    inbox.connect(str(endpoints.detokenizer_in(0)))
    log_path = tmp_path / "detokenizer.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.detokenizer", "--run-dir", str(tmp_path)],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        receive(supervisor, m.Ready, time.monotonic() + WAIT_S)
        inbox.send(b"\xff not a message")
        supervisor.send_multipart([b"detokenizer-0", b"\xff not a command"])
        deadline = time.monotonic() + WAIT_S
        while receive(supervisor, m.Heartbeat, deadline).load.num_malformed < 2:
            pass
        assert process.poll() is None, "the stage died of a malformed message"
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
        assert "stopping" in log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        ctx.destroy(linger=0)


def test_every_stage_stops_cleanly_whatever_its_poll_waits_for(tmp_path: Path) -> None:
    """SIGTERM wakes a stage blocked in its poll (services/stage.py install_stop_handler), and the
    drain before it needs no heartbeat to come (a tokenizer reports when it drains). An idle
    scheduler polls until its next heartbeat is due, and pyzmq resumes an interrupted poll: with a
    heartbeat interval longer than the supervisor's stop grace, a scheduler that noticed the signal
    only at the poll's timeout was SIGKILLed at every stop, never leaving its loop."""
    with brigade_run(tmp_path / "run", f"supervisor.heartbeat_interval_s={LONG_HEARTBEAT_S}") as run:
        time.sleep(1.0)  # the scheduler is in its idle poll
        harness_stop(run)
    assert run.process.returncode == 0
    log = (tmp_path / "run.log").read_text()
    # Nor does the drain wait for a heartbeat: a tokenizer reports its load when it takes the Shutdown.
    assert "drained: nothing in flight" in log, log[-3000:]
    for stage in ("tokenizer-0", "scheduler-0", "gpu_worker-0-0", "detokenizer-0"):
        assert re.search(rf"\[{stage} pid=\d+\] stopping", log), (
            f"{stage} did not leave its loop:\n{log[-3000:]}"
        )


def test_a_draining_stage_reports_each_change_of_its_load_at_once(tmp_path: Path) -> None:
    """Between heartbeats a draining stage still reports every change of what it has in flight (the
    supervisor's drain ends on it), and only a change: an unchanged count waits for the interval."""
    config = load_config(None, (f"supervisor.heartbeat_interval_s={LONG_HEARTBEAT_S}",))
    endpoints = Endpoints(tmp_path, new_run_id())
    info = RunInfo(endpoints.run_id, os.getpid(), "", "test", [], config)
    stage = Stage("tokenizer-0", 0, tmp_path, info, endpoints, logging.getLogger("test"), False, os.getpid())
    ctx = zmq.Context()
    try:
        supervisor = ctx.socket(zmq.ROUTER)
        supervisor.bind(endpoints.supervisor().bind)
        control = ControlChannel(ctx, stage)
        control.heartbeat(0, has_work=False, load=m.StageLoad(num_in_flight=3))  # the first one goes
        assert receive(supervisor, m.Heartbeat, time.monotonic() + WAIT_S).load.num_in_flight == 3
        sent = []
        for in_flight, is_draining in [(2, False), (2, True), (2, True), (1, True), (1, True), (0, True)]:
            control.heartbeat(
                0, has_work=False, load=m.StageLoad(num_in_flight=in_flight, is_draining=is_draining)
            )
            while supervisor.poll(200):
                sent.append(CONTROL_UP.decode(supervisor.recv_multipart()[1]).load.num_in_flight)
        assert sent == [2, 1, 0]
    finally:
        ctx.destroy(linger=0)
