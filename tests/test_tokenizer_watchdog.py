"""The tokenizer as an OS process, with the test playing its scheduler and detokenizer on the real
sockets: the watchdog leaves a legitimately quiet request alone, re-drives one the engine lost
from exactly what the client has, and fails with a clear error one that keeps getting lost
(issue 14 item 2). The test writes run.json as the supervisor does; no other stage runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST, SCHEDULER_INPUT, TOKENIZER_INPUT
from ipc.config import load_config
from ipc.endpoints import Endpoints
from ipc.shm import new_run_id
from ipc.sockets import PullQueue, PushQueue
from services.stage import RunInfo, write_run_info
from services.tokenizer.core import MAX_REDRIVES
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STALL_TIMEOUT_S = 0.5
WAIT_S = 60.0


class FakeEngine:
    """A tokenizer process, and the test's ends of its sockets: the client's DEALER, the
    scheduler's inbox (PULL) and the tokenizer's engine inbox (PUSH)."""

    def __init__(self, run_dir: Path, model_dir: Path) -> None:
        config = load_config(None, [f"tokenizer.stall_timeout_s={STALL_TIMEOUT_S}"])
        self.endpoints = Endpoints(run_dir, new_run_id())
        write_run_info(
            run_dir, RunInfo(self.endpoints.run_id, os.getpid(), str(model_dir), "tiny", [], config)
        )
        self.ctx = zmq.Context()
        self.scheduler = PullQueue(self.ctx, self.endpoints.scheduler_in(0), SCHEDULER_INPUT, bind=True)
        self.log_path = run_dir / "tokenizer.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.tokenizer", "--run-dir", str(run_dir)],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.engine_out = PushQueue(self.ctx, self.endpoints.tokenizer_in(0), TOKENIZER_INPUT)
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.linger = 0
        self.client.connect(self.endpoints.tokenizer(0))

    def send(self, request: m.Generate) -> None:
        self.client.send(CLIENT_REQUEST.encode(request))

    def reply(self, answer: Callable[[str], int] = lambda rid: -1) -> m.ClientReply:
        """The client's next reply that is not a keepalive; meanwhile the scheduler's part is
        played with `answer` (and any submission must not come)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the tokenizer exited:\n{self.log_path.read_text()}"
            assert self.play_scheduler(answer) is None, "an unexpected submission"
            if self.client.poll(50):
                reply = CLIENT_REPLY.decode(self.client.recv())
                if not isinstance(reply, m.HealthReply):
                    return reply
        raise AssertionError(f"no reply in {WAIT_S:.0f}s")

    def play_scheduler(self, answer: Callable[[str], int]) -> m.SubmitRequest | None:
        """Answer a progress query with `answer(engine_id)` per request, or return a submission."""
        message = self.scheduler.get(0.05)
        if isinstance(message, m.QueryRequests):
            counts = [answer(rid) for rid in message.request_ids]
            assert self.engine_out.put(m.RequestProgress(message.request_ids, counts))
        return message if isinstance(message, m.SubmitRequest) else None

    def serve(
        self,
        answer: Callable[[str], int],
        until: Callable[[list[m.SubmitRequest]], bool],
        timeout: float = WAIT_S,
    ) -> list[m.SubmitRequest]:
        """Play the scheduler with `answer`, collecting the submissions, until `until(submissions)`
        or the timeout; returns the submissions."""
        submissions: list[m.SubmitRequest] = []
        deadline = time.monotonic() + timeout
        while not until(submissions) and time.monotonic() < deadline:
            assert self.process.poll() is None, f"the tokenizer exited:\n{self.log_path.read_text()}"
            submission = self.play_scheduler(answer)
            if submission is not None:
                submissions.append(submission)
        return submissions

    def deliver(self, *deltas: m.Delta) -> None:
        assert self.engine_out.put(m.DeltaBatch(list(deltas)))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self.ctx.destroy(linger=0)


@pytest.fixture
def engine(tiny_model_dir: Path) -> Iterator[FakeEngine]:
    run_dir = Path(tempfile.mkdtemp(prefix="brigade-test-"))  # short: ipc:// paths are limited
    fake = None
    try:
        fake = FakeEngine(run_dir, tiny_model_dir)
        yield fake
    finally:
        if fake is not None:
            fake.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def generate(request_id: str) -> m.Generate:
    return m.Generate(
        request_id, prompt="Hello there", params=m.SamplingParams(max_tokens=4, temperature=0.0)
    )


def test_watchdog_redrives_a_lost_request_from_what_the_client_has(engine: FakeEngine) -> None:
    engine.send(generate("job"))
    (first,) = engine.serve(answer=lambda rid: -1, until=lambda subs: len(subs) == 1)
    engine_id = first.request_id
    engine.deliver(m.Delta(engine_id, 0, 0, "ab", m.pack_ids([5, 6])))
    reply = engine.reply(answer=lambda rid: 2)
    assert isinstance(reply, m.Delta) and (reply.request_id, reply.text) == ("job", "ab")

    # Queued or prefilling: the scheduler holds exactly the client's 2 tokens. Asked again and
    # again, the tokenizer must not resubmit (that would restart a long prefill forever).
    quiet = engine.serve(answer=lambda rid: 2, until=lambda subs: bool(subs), timeout=8 * STALL_TIMEOUT_S)
    assert quiet == [], "a legitimately quiet request was resubmitted"

    # Lost: the scheduler no longer runs it. Two such answers in a row, then a resubmission
    # that carries what the client has, and the same seed.
    (again,) = engine.serve(answer=lambda rid: -1, until=lambda subs: bool(subs))
    assert again.request_id == engine_id
    assert m.unpack_ids(again.output_ids).tolist() == [5, 6]
    assert again.params.seed == first.params.seed and again.prompt_ids == first.prompt_ids

    # The engine rebuilds from the whole history; the client gets only what it lacks, once.
    engine.deliver(m.Delta(engine_id, 0, 0, "abcd", m.pack_ids([5, 6, 7, 8]), finish_reason="length"))
    reply = engine.reply(answer=lambda rid: 4)
    assert isinstance(reply, m.Delta), reply
    assert (reply.request_id, reply.token_index, reply.char_offset, reply.text) == ("job", 2, 2, "cd")
    assert m.unpack_ids(reply.token_ids).tolist() == [7, 8] and reply.finish_reason == "length"


def test_a_request_that_stays_lost_fails_with_a_clear_error(engine: FakeEngine) -> None:
    engine.send(generate("doomed"))
    submissions = engine.serve(answer=lambda rid: -1, until=lambda subs: len(subs) == 1 + MAX_REDRIVES)
    assert len(submissions) == 1 + MAX_REDRIVES, f"{len(submissions)} submissions"
    reply = engine.reply()
    assert isinstance(reply, m.ErrorReply), reply
    assert (reply.request_id, reply.code) == ("doomed", "internal")
    assert "lost" in reply.message
    # Nothing is left to re-drive: no more submissions.
    assert (
        engine.serve(answer=lambda rid: -1, until=lambda subs: bool(subs), timeout=6 * STALL_TIMEOUT_S) == []
    )


def test_untracked_requests_it_never_journaled_are_aborted(engine: FakeEngine) -> None:
    """A restarted detokenizer names requests whose tokens it cannot place (UntrackedRequests):
    copies that a dead tokenizer at this index had sent on are aborted at the scheduler, and the
    request this tokenizer journals is left running (it is being resubmitted already)."""
    engine.send(generate("served"))
    (served,) = engine.serve(answer=lambda rid: 0, until=lambda subs: len(subs) == 1)
    assert engine.engine_out.put(m.UntrackedRequests([served.request_id, "0-orphan"]))
    aborted: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while "0-orphan" not in aborted and time.monotonic() < deadline:
        message = engine.scheduler.get(0.05)
        if isinstance(message, m.AbortRequest):
            aborted.append(message.request_id)
    assert aborted == ["0-orphan"]
