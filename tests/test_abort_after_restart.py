"""Aborts around a scheduler restart, with real processes on the tiny model: long streams whose
clients leave (an explicit Abort, or their connection closed and found gone by the tokenizer's
keepalive) as their scheduler is killed, while its replacement starts, right as it comes up, or
once their resubmissions generate again. None of them may be resubmitted behind its abort and compute for
nobody: the restarted scheduler ends up running none, the detokenizer holds none, and every one
is counted as aborted (none as finished).

A hostile run once suspected such a leak; the window it would need is closed (the journal
forgets an aborted request before anything else, so no later resubmission carries it, and the
abort follows on the same FIFO link any resubmission sent before it, a link that keeps what it is
given while its scheduler is down): this test guards it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST
from services.stage import read_run_info
from tests.harness import Run, assert_clean, brigade_run, free_port, tokenizer_dealer
from tests.test_chaos import SPECS, chaos_settings, running_pid, wait_for, wait_for_restarts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_MODEL_LEN = 16384
MAX_TOKENS = MAX_MODEL_LEN - 96  # long: a request resubmitted behind its abort would run on for long
MEASURED_TOKENS = 100  # each stream's tokens before the kill: enough to measure their rate
NUM_REQUESTS = 4  # the first half aborted by an Abort, the others by closing their connections
# How soon after the last abort the scheduler must run none of them: well under the time a
# leaked request would take to finish (checked against the measured rate), above the keepalive
# (1 s) and the heartbeats that carry the counts into status.json.
SETTLE_S = 8.0
QUIET_S = 2.0  # and then stay empty this long: a resubmission arriving late would show
WAIT_S = 120.0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("abort-restart")
    port = free_port()
    overrides = (
        *chaos_settings(tiny_model_dir),
        f"model.max_model_len={MAX_MODEL_LEN}",
        "engine.kv_cache_mib=128",
        f"supervisor.metrics_port={port}",
    )
    with brigade_run(run_dir, *overrides) as live:
        live.metrics_port = port
        run_id = read_run_info(run_dir).run_id
        yield live
    assert_clean(run_dir, run_id)


def metric(run: Run, name: str, label: str) -> float:
    """The sum of `name`'s samples whose labels include `label` (e.g. 'finished_reason="abort"')."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10).read().decode()
    samples = re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.MULTILINE)
    return sum(float(value) for labels, value in samples if label in labels.split(","))


def finished(run: Run, reason: str) -> float:
    return metric(run, "brigade:request_success_total", f'finished_reason="{reason}"')


def held(run: Run, kind: str) -> int:
    """Requests the stages of `kind` hold: a scheduler's running and waiting ones, a
    detokenizer's or a tokenizer's live ones."""
    return sum(r["running"] + r["queue_depth"] for r in run.read_status() if r["kind"] == kind)


class Stream:
    """One long streamed request on a bare connection of its own: the tokens it got, and when."""

    def __init__(self, ctx: zmq.Context, run: Run, index: int) -> None:
        self.request_id = f"leaver-{index}"
        self.sock = tokenizer_dealer(ctx, run.run_dir)
        spec = SPECS[index % len(SPECS)]
        request = msgspec.structs.replace(spec.generate(), request_id=self.request_id, stream=True)
        request.params.max_tokens = MAX_TOKENS
        self.sock.send(CLIENT_REQUEST.encode(request))
        self.num_tokens = 0
        self.first_at = 0.0  # when its first tokens came
        self.num_first = 0  # how many they were

    def pump(self) -> list[m.ClientReply]:
        """Read what has come (keepalives skipped); a finished stream is a failure here."""
        replies = []
        while self.sock.poll(0):
            reply = CLIENT_REPLY.decode(self.sock.recv())
            if isinstance(reply, m.HealthReply):
                continue  # the tokenizer's keepalive
            assert isinstance(reply, m.Delta) and reply.request_id == self.request_id, reply
            if reply.finish_reason != "abort":
                assert reply.finish_reason is None, f"{self.request_id} ended: {reply.finish_reason}"
                num_new = len(m.unpack_ids(reply.token_ids))
                if not self.num_tokens:
                    self.first_at, self.num_first = time.monotonic(), num_new
                self.num_tokens += num_new
            replies.append(reply)
        return replies

    def abort(self) -> None:
        self.sock.send(CLIENT_REQUEST.encode(m.Abort(self.request_id)))

    def close(self) -> None:
        self.sock.close(linger=0)


def pump_until(streams: list[Stream], what: str, condition: Callable[[], bool]) -> None:
    """Keep reading the open streams (so none blocks the tokenizer) until `condition()`."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S:.0f}s"
        for stream in streams:
            if not stream.sock.closed:
                stream.pump()
        time.sleep(0.02)


def scheduler_replaced(run: Run, old_pid: int, *, up: bool) -> bool:
    """Whether status.json shows a new scheduler process: starting (its inbox bound or being
    bound, before it is ready and the tokenizer resubmits its journal), or with `up` running."""
    rows = [r for r in run.read_status() if r["kind"] == "scheduler"]
    if not rows:
        return False  # status.json replaced as we read it
    (row,) = rows
    return row["pid"] != old_pid and row["state"] in (("running",) if up else ("starting", "running"))


@pytest.mark.parametrize("moment", ["dead", "starting", "coming_up", "resumed"])
def test_streams_left_around_a_scheduler_restart_stop_computing(run: Run, moment: str) -> None:
    """The clients leave: `dead`, the moment the scheduler is killed (an abort may go into the
    dead process's link before the tokenizer sees it gone); `starting`, once status shows its
    replacement's process, before it is ready (the aborts wait in the link for it, and reach it
    before the tokenizer resubmits its journal); `coming_up`, the moment status shows the
    replacement running, as the tokenizer resubmits its journal (the aborts follow the
    resubmissions); `resumed`, once each stream has tokens again from its resubmission."""
    wait_for("every stage running", lambda: all(r["state"] == "running" for r in run.read_status()))
    wait_for("an idle engine", lambda: held(run, "scheduler") + held(run, "detokenizer") == 0, timeout=60)
    aborted_before, length_before = finished(run, "abort"), finished(run, "length")
    ctx = zmq.Context()
    try:
        streams = [Stream(ctx, run, i) for i in range(NUM_REQUESTS)]
        pump_until(
            streams, "every stream generating", lambda: all(s.num_tokens >= MEASURED_TOKENS for s in streams)
        )
        restarts = sum(r["restarts"] for r in run.read_status() if r["kind"] == "scheduler")
        old_pid = running_pid(run, "scheduler")
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # The rate the streams had: a leaked request needs at least this long to finish.
        rate = max((s.num_tokens - s.num_first) / (killed_at - s.first_at) for s in streams)
        assert (MAX_TOKENS - max(s.num_tokens for s in streams)) / rate > 2 * (SETTLE_S + QUIET_S), (
            f"too fast to tell ({rate:.0f}/s)"
        )

        if moment == "starting":
            pump_until(streams, "a new scheduler", lambda: scheduler_replaced(run, old_pid, up=False))
        elif moment == "coming_up":
            pump_until(streams, "the new scheduler up", lambda: scheduler_replaced(run, old_pid, up=True))
        elif moment == "resumed":
            # Tokens sent before the kill may still be on their way: count only those after
            # the replacement is up.
            pump_until(streams, "the new scheduler up", lambda: scheduler_replaced(run, old_pid, up=True))
            at_restart = [s.num_tokens for s in streams]
            pump_until(
                streams,
                "every stream generating again",
                lambda: all(s.num_tokens > k for s, k in zip(streams, at_restart, strict=True)),
            )
        half = NUM_REQUESTS // 2
        for stream in streams[:half]:
            stream.abort()
        for stream in streams[half:]:
            stream.close()

        # Each explicit Abort is answered with the final delta at once.
        answered: set[str] = set()

        def all_answered() -> bool:
            for stream in streams[:half]:
                if any(getattr(r, "finish_reason", None) == "abort" for r in stream.pump()):
                    answered.add(stream.request_id)
            return len(answered) == half

        wait_for("the aborts answered", all_answered, timeout=30)
        wait_for_restarts(run, {"scheduler": restarts + 1})

        # The restarted scheduler runs none of them, and goes on running none.
        deadline = time.monotonic() + SETTLE_S
        quiet_since: float | None = None
        while quiet_since is None or time.monotonic() - quiet_since < QUIET_S:
            now, count = time.monotonic(), held(run, "scheduler")
            assert now < deadline + QUIET_S, (
                f"the scheduler still holds {count} of the aborted requests {now - killed_at:.1f}s after the kill"
            )
            if count:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            time.sleep(0.1)
        wait_for("the detokenizer holding none", lambda: held(run, "detokenizer") == 0, timeout=SETTLE_S)
        wait_for("the tokenizer holding none", lambda: held(run, "tokenizer") == 0, timeout=SETTLE_S)
        wait_for(
            "every request counted as aborted",
            lambda: finished(run, "abort") >= aborted_before + NUM_REQUESTS,
            timeout=SETTLE_S,
        )
        assert finished(run, "abort") == aborted_before + NUM_REQUESTS
        assert finished(run, "length") == length_before, "an aborted request was counted as finished"
    finally:
        with contextlib.suppress(Exception):
            ctx.destroy(linger=0)
