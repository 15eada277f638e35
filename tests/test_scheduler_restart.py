"""An ordinary scheduler restart, with real processes on the tiny model: streamed requests in
flight when the scheduler is SIGKILLed are resubmitted once, by the `ResubmitAll` its restart
brings, and never by the tokenizer's watchdog. The replacement answers progress questions while
it waits for its workers, before it has the resubmissions; it once answered them "not running",
so every restart logged each quiet request as "lost upstream" and resubmitted it twice (a
second prefill for nothing). The streams must still end with every token exactly once."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST
from services.stage import read_run_info
from tests.harness import Run, assert_clean, brigade_run, tokenizer_dealer
from tests.test_chaos import SPECS, chaos_settings, running_pid, wait_for_restarts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_STREAMS = 4
MAX_TOKENS = 900  # long enough to be in flight through the restart, below max_model_len (1024)
WAIT_S = 180.0
LOST = "lost upstream"
# The replacement waits for its workers, which went down with it and load the model again: on a
# GPU that takes many times the default stall_timeout_s (10 s); the tiny model on a CPU takes a
# second or two, so the watchdog asks as often here as it would there.
STALL_TIMEOUT_S = 0.2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("scheduler-restart")
    with brigade_run(
        run_dir, *chaos_settings(tiny_model_dir), f"tokenizer.stall_timeout_s={STALL_TIMEOUT_S}"
    ) as live:
        run_id = read_run_info(run_dir).run_id
        yield live
    assert_clean(run_dir, run_id)


class Stream:
    """One long streamed request on a bare connection: its tokens so far, and how it ended."""

    def __init__(self, ctx: zmq.Context, run: Run, index: int) -> None:
        self.request_id = f"through-restart-{index}"
        self.sock = tokenizer_dealer(ctx, run.run_dir)
        request = msgspec.structs.replace(
            SPECS[2 * index].generate(), request_id=self.request_id, stream=True
        )
        request.params.max_tokens = MAX_TOKENS
        self.sock.send(CLIENT_REQUEST.encode(request))
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    def pump(self) -> None:
        """Read what has come; every delta must continue exactly where the last one ended."""
        while self.sock.poll(0):
            reply = CLIENT_REPLY.decode(self.sock.recv())
            if isinstance(reply, m.HealthReply):
                continue  # the tokenizer's keepalive
            assert isinstance(reply, m.Delta) and reply.request_id == self.request_id, reply
            assert reply.token_index == len(self.token_ids), (reply.token_index, len(self.token_ids))
            self.token_ids += m.unpack_ids(reply.token_ids).tolist()
            if reply.finish_reason is not None:
                self.finish_reason = reply.finish_reason


def new_lines(run: Run) -> list[str]:
    """The run's log lines that came since the last call (kept in `run.log` too)."""
    lines = []
    while True:
        try:
            line = run.lines.get_nowait()
        except queue.Empty:
            return lines
        run.log.append(line)
        lines.append(line)


def test_a_restart_resubmits_each_request_once(run: Run) -> None:
    ctx = zmq.Context()
    try:
        streams = [Stream(ctx, run, i) for i in range(NUM_STREAMS)]
        deadline = time.monotonic() + WAIT_S
        while not all(s.token_ids for s in streams):
            assert time.monotonic() < deadline, "the streams did not start"
            for stream in streams:
                stream.pump()
            time.sleep(0.02)
        new_lines(run)
        os.kill(running_pid(run, "scheduler"), signal.SIGKILL)
        # Wait out the restart: the workers go down with their scheduler and reload the model,
        # so the watchdog (every STALL_TIMEOUT_S) asks the replacement several times before it
        # is ready.
        while not all(s.finish_reason for s in streams):
            assert time.monotonic() < deadline, (
                f"the streams did not finish: {[len(s.token_ids) for s in streams]}"
            )
            for stream in streams:
                stream.pump()
            time.sleep(0.02)
        wait_for_restarts(run, {"scheduler": 1})
        for stream in streams:
            assert stream.finish_reason == "length" and len(stream.token_ids) == MAX_TOKENS
        time.sleep(2 * STALL_TIMEOUT_S)  # a late resubmission would be logged by now
        lines = new_lines(run)
        resubmitted = f"scheduler 0 restarted: resubmitting {NUM_STREAMS} requests"
        assert any(resubmitted in line for line in lines), "".join(lines[-40:])
        lost = [line for line in lines if LOST in line]
        assert not lost, f"the watchdog resubmitted during an ordinary restart:\n{''.join(lost)}"
    finally:
        ctx.destroy(linger=0)
