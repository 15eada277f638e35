"""The client SDK and CLI used as a demanding user uses them, against one real run of the tiny
random Llama (no gateway): output piped into a reader that goes away, a client closed from
another thread, streams and clients dropped without closing, a request too big to send. Each
request left behind must stop computing."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import AsyncClient, Client, ClientClosed, InvalidRequest
from tests.conftest import REPO_ROOT
from tests.harness import Run, assert_clean, brigade_run, free_port
from tests.test_client_process import metric, tiny_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WAIT_S = 120.0  # every wait in these tests has this deadline unless it says otherwise
# Long enough (about 1900 tokens of "time time ...") that it is still running when the test acts.
LONG = dict(max_tokens=1900, temperature=0.0, ignore_eos=True)
ABORTED = 'finished_reason="abort"'


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("hostile-run")
    port = free_port()
    with brigade_run(run_dir, *tiny_args(tiny_model_dir, port), "gateway.replicas=0") as run:
        run.metrics_port = port
        yield run
    assert_clean(run_dir)


def wait_for_aborts(run: Run, at_least: float) -> None:
    """The run has counted `at_least` aborted requests: what a client left did not run on."""
    deadline = time.monotonic() + WAIT_S
    while metric(run, "brigade:request_success_total", ABORTED) < at_least:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.2)


def test_cli_output_into_a_closed_pipe_stops_quietly_and_aborts(tiny_run: Run) -> None:
    """`python -m client generate ... | head -c 10`: once head exits, the next write fails. The
    CLI must end at once with the shell's SIGPIPE status and no traceback (it printed
    BrokenPipeError's, and another "Exception ignored" at exit), its request aborted."""
    aborted = metric(tiny_run, "brigade:request_success_total", ABORTED)
    argv = ["--run", str(tiny_run.run_dir), "generate", "Once upon a time", "--max-tokens", "1900"]
    cli = subprocess.Popen(
        [sys.executable, "-m", "client", *argv, "--temperature", "0"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert cli.stdout is not None
        assert len(cli.stdout.read(10)) == 10
        cli.stdout.close()  # the reader is gone, as `head -c 10` after its ten bytes
        _, stderr = cli.communicate(timeout=WAIT_S)
    finally:
        cli.kill()
        cli.wait(30)
    assert (cli.returncode, stderr.decode()) == (141, "")
    wait_for_aborts(tiny_run, aborted + 1)


def test_closing_a_client_from_another_thread_ends_its_stream_with_client_closed(tiny_run: Run) -> None:
    """A main thread shutting down closes the client a worker thread streams from: the worker
    gets ClientClosed (it got a bare zmq.ZMQError, "Socket operation on non-socket", from a
    socket closed under its poll), and the request is aborted."""
    aborted = metric(tiny_run, "brigade:request_success_total", ABORTED)
    outcomes: list[BaseException | str] = []
    client = Client(tiny_run.run_dir, timeout=WAIT_S)
    first_delta = threading.Event()

    def read() -> None:
        try:
            for _ in client.stream("Once upon a time", **LONG):
                first_delta.set()
            outcomes.append("finished")
        except BaseException as exc:  # whatever it is, the test names it
            outcomes.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert first_delta.wait(WAIT_S), "no delta came"
        time.sleep(0.2)  # well inside the stream, the reader in its poll
        client.close()
        reader.join(WAIT_S)
        assert not reader.is_alive(), "the stream hung after close()"
    finally:
        client.close()
    assert len(outcomes) == 1 and isinstance(outcomes[0], ClientClosed), outcomes
    wait_for_aborts(tiny_run, aborted + 1)
    with Client(tiny_run.run_dir) as fresh:  # the run serves on
        assert fresh.generate("Hello", max_tokens=2, timeout=WAIT_S).finish_reason == "length"


def test_a_request_too_big_for_the_tokenizer_is_refused_before_sending(tiny_run: Run) -> None:
    """A tokenizer drops, unread, the connection that sends a message over its 64 MiB limit: a
    72 MB prompt was resubmitted after every probe (a 72 MB send each time) until its timeout,
    RequestTimeout (or forever without one). The SDK refuses it at once, naming the size, and
    serves on."""
    with Client(tiny_run.run_dir) as client:
        start = time.monotonic()
        with pytest.raises(InvalidRequest, match="bytes encoded; a tokenizer reads at most"):
            client.generate("ab " * (24 << 20), max_tokens=2, timeout=20)
        assert time.monotonic() - start < 10
        assert client.session.requests == {} and client.session.num_failovers == 0
        assert client.generate("Hello", max_tokens=2, timeout=WAIT_S).finish_reason == "length"


LEFT_OPEN_AT_EXIT = """
import sys
from client import Client

run_dir = sys.argv[1]
client = Client(run_dir)
stream = client.stream("Once upon a time", max_tokens=1900, temperature=0.0, ignore_eos=True)
next(stream)


class Job:  # a client and its stream in a reference cycle: only the collector frees them
    pass


job = Job()
job.client, job.me = Client(run_dir), job
job.stream = job.client.stream("Once upon a time", max_tokens=1900, temperature=0.0, ignore_eos=True)
next(job.stream)
print("streaming", flush=True)
"""


def test_a_script_that_exits_with_streams_open_says_nothing_and_aborts_them(tiny_run: Run) -> None:
    """A script that ends with a stream still open (a global, or in a cycle with its client) is
    torn down by the collector, which closes the client's sockets before the stream: each
    stream printed "Exception ignored ... ClientClosed" with its traceback at exit. It must exit
    silently, and the tokenizer, seeing the connection go, aborts both requests."""
    aborted = metric(tiny_run, "brigade:request_success_total", ABORTED)
    script = subprocess.run(
        [sys.executable, "-c", LEFT_OPEN_AT_EXIT, str(tiny_run.run_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert (script.returncode, script.stdout, script.stderr) == (0, "streaming\n", "")
    wait_for_aborts(tiny_run, aborted + 2)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_async_clients_dropped_without_close_are_freed(tiny_run: Run) -> None:
    """An AsyncClient made per job and dropped without close() (as one drops an httpx client):
    its reader task held it, so each one kept its context, sockets and descriptors, and woke 20
    times a second, for as long as the event loop ran. Once idle, a dropped client is freed."""

    async def jobs() -> tuple[int, int, int]:
        before = open_descriptors()
        for _ in range(20):
            client = AsyncClient(tiny_run.run_dir)
            assert (await client.generate("Hello", max_tokens=2, timeout=WAIT_S)).finish_reason == "length"
            del client
        deadline = time.monotonic() + 10  # a reader notices it has nothing to do within a tick
        while len(asyncio.all_tasks()) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        gc.collect()
        return before, open_descriptors(), len(asyncio.all_tasks())

    before, after, tasks = asyncio.run(jobs())
    assert tasks == 1, "readers of dropped clients still run"
    assert after <= before + 2, (before, after)

    async def after_idle() -> list[str]:  # a kept client serves on once its reader stopped
        async with AsyncClient(tiny_run.run_dir) as client:
            first = await client.generate("Hello", max_tokens=2, timeout=WAIT_S)
            await asyncio.sleep(0.5)  # idle: its reader ends
            replies = await client.health(timeout=WAIT_S)
            second = await client.generate("Hello", max_tokens=2, timeout=WAIT_S)
            return [first.finish_reason, second.finish_reason, str(len(replies))]

    assert asyncio.run(after_idle()) == ["length", "length", "1"]
