"""Start a real Brigade run (supervisor + every stage as OS processes) for a test, and tear it
down completely afterwards, even when the test fails."""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

from ipc import messages as m
from ipc.codec import CLIENT_REQUEST
from ipc.keys import load_secret_file
from services.stage import read_run_info
from tests.conftest import REPO_ROOT, TRANSPORT_ENV, brigade_shm_objects

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


class Run:
    """A live run: its directory, the supervisor process, and its log lines."""

    def __init__(self, run_dir: Path, process: subprocess.Popen, lines: queue.Queue[str]) -> None:
        self.run_dir = run_dir
        self.process = process
        self.lines = lines
        self.log: list[str] = []
        self.metrics_port = 0  # set by tests that turn /metrics on
        self.http_port = 0  # set by tests that talk to its gateway

    def wait_for_line(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            self.log.append(line)
            if needle in line:
                return line
        tail = "".join(self.log[-40:])
        raise AssertionError(f"no line containing {needle!r} within {timeout:.0f}s; log tail:\n{tail}")

    def status(self) -> list[dict]:
        done = subprocess.run(
            [sys.executable, "supervisor.py", "status", "--run", str(self.run_dir), "--json"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def read_status(self) -> list[dict]:
        """The same table read straight from the supervisor's status.json: cheap enough to poll."""
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):  # replaced while we read it
            return []

    def stage_pids(self, kind: str) -> list[int]:
        return [row["pid"] for row in self.status() if row["kind"] == kind and row["state"] == "running"]

    def wait_for_restart(self, old_pids: Sequence[int], timeout: float = 240) -> None:
        """Every stage runs again, and none of `old_pids` (stages killed by the test) is among them.

        Reads status.json: the `status` command starts a Python process, slow enough on a loaded
        host that a stream the test meant to break mid-way would finish first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.read_status()
            if rows and all(r["state"] == "running" and r["pid"] not in old_pids for r in rows):
                return
            time.sleep(0.2)
        raise AssertionError(f"stages not restarted within {timeout:.0f}s: {self.read_status()}")

    def wait_until_running(self, timeout: float) -> None:
        """Every stage reports running (after a restart, say)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.status()
            if rows and all(r["state"] == "running" for r in rows):
                return
            time.sleep(0.2)
        raise AssertionError(f"stages not all running after {timeout:.0f}s: {self.status()}")


def _pump(stream, lines: queue.Queue[str], log_path: Path) -> None:
    """Every line to the test's queue, and to a file beside the run directory that outlives the
    run (`<run dir>.log`), so a failed test's stage logs can be read after it."""
    with open(log_path, "a") if log_path.parent.is_dir() else open(os.devnull, "w") as log:
        for line in stream:
            lines.put(line)
            log.write(line)
            log.flush()


@contextmanager
def gateway_in_thread(make_gateway: Callable[[], Any]) -> Iterator[str]:
    """A gateway replica in this process: `make_gateway()` (a services.gateway.app.Gateway, made
    on the thread's own event loop) served by uvicorn on a thread; its base URL. Stopped, with its
    fetch pool and its client closed, on the way out."""
    import asyncio

    import uvicorn

    from services.gateway.routes import build_app

    port = free_port()
    servers: list[uvicorn.Server] = []

    async def serve() -> None:
        gateway = make_gateway()
        config = uvicorn.Config(
            build_app(gateway), host="127.0.0.1", port=port, lifespan="off", log_config=None
        )
        servers.append(uvicorn.Server(config))
        try:
            await servers[0].serve()
        finally:
            gateway.close()
            await gateway.client.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (servers and servers[0].started) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servers and servers[0].started, "the in-process gateway did not start within 60 s"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        servers[0].should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the in-process gateway did not stop within 30 s"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_supervisor(
    run_dir: Path,
    *overrides: str,
    config: str = "configs/default.yaml",
    command: Sequence[str] = (sys.executable, "supervisor.py"),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`python supervisor.py --config ... --set ...` (or another `command` taking the same
    arguments, such as `brigade serve`), its output (stdout and stderr) as text lines."""
    argv = [*command, "--config", config, "--run-dir", str(run_dir)]
    if not any(o.startswith("supervisor.metrics_port=") for o in overrides):
        # /metrics is on by default on a fixed port; tests that want it pass a free one.
        overrides = ("supervisor.metrics_port=0", *overrides)
    # Never the default port 8000: runs of other tests (or a user's Brigade) may hold it. A test's
    # own gateway.port override comes later and wins (a port in its config file would not).
    # `--transport` (tests/conftest.py) comes first too, so a test's own choice wins.
    transport = os.environ.get(TRANSPORT_ENV)
    first = [f"gateway.port={free_port()}", *([f"network.transport={transport}"] if transport else [])]
    for override in (*first, *overrides):
        argv += ["--set", override]
    return subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_stop_when_the_test_dies,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
    )


def _stop_when_the_test_dies() -> None:
    """A test process killed by a signal (a `timeout` around pytest) runs no fixture teardown, and
    its supervisor would serve on, orphaned, holding memory and /dev/shm. The kernel SIGTERMs it
    instead when the test process dies, and it stops as it does on Ctrl-C (Linux only)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@contextmanager
def brigade_run(
    run_dir: Path,
    *overrides: str,
    config: str = "configs/default.yaml",
    command: Sequence[str] = (sys.executable, "supervisor.py"),
    env: dict[str, str] | None = None,
) -> Iterator[Run]:
    """The supervisor until ready; SIGTERM and full cleanup after."""
    process = start_supervisor(run_dir, *overrides, config=config, command=command, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=_pump, args=(process.stdout, lines, run_dir.with_name(run_dir.name + ".log")), daemon=True
    ).start()
    run = Run(run_dir, process, lines)
    try:
        # The contract: the first line containing "ready" says that every stage is up. Not at the
        # line's start: under Ray a stage's forwarded log line may be cut by it (Ray's thread
        # writes a line's text and its newline apart).
        line = run.wait_for_line("ready", READY_TIMEOUT_S)
        assert "Brigade ready:" in line, f"a line said ready before every stage was up: {line!r}"
        yield run
    finally:
        stop(run)


def stop(run: Run) -> None:
    """SIGTERM the supervisor; SIGKILL its whole session if it does not finish in time."""
    if run.process.poll() is None:
        run.process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            run.process.wait(STOP_TIMEOUT_S)
    kill_leftovers(run)
    run.process.wait()


def kill_leftovers(run: Run) -> None:
    """Stages run in sessions of their own: find any still alive by their run dir and kill them."""
    for pid in [run.process.pid, *stage_processes(run.run_dir)]:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stage_processes(run_dir: Path) -> list[int]:
    """Pids of processes whose command line names this run directory."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(run_dir).encode() in cmdline and int(entry) != os.getpid():
            pids.append(int(entry))
    return pids


def assert_clean(run_dir: Path, run_id: str | None = None) -> None:
    """No stage process, socket file or shared-memory object of the run is left."""
    deadline = time.monotonic() + 10
    while stage_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stage_processes(run_dir), f"processes left: {stage_processes(run_dir)}"
    assert not list(run_dir.glob("*.sock")), f"socket files left: {list(run_dir.glob('*.sock'))}"
    if run_id is not None:
        leftovers = [n for n in brigade_shm_objects() if run_id in n]
        assert not leftovers, f"shared memory left: {leftovers}"


def tokenizer_dealer(
    ctx: zmq.Context, run_dir: Path, index: int = 0, identity: bytes | None = None, rcvhwm: int | None = None
) -> zmq.Socket:
    """A bare DEALER to tokenizer `index`, as a client that speaks the wire protocol itself: with
    the run's client CURVE keys when its links are tcp:// (run.json names them). `rcvhwm` (set
    before it connects, as ZeroMQ needs) makes a client that stops reading fill up sooner."""
    info = read_run_info(run_dir)
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if identity is not None:
        sock.identity = identity
    if rcvhwm is not None:
        sock.rcvhwm = rcvhwm
    if info.curve_server_key:
        keys = load_secret_file(info.curve_client_keys)
        sock.curve_serverkey = info.curve_server_key.encode()
        sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
    sock.connect(info.tokenizers[index])
    return sock


def hostile_messages(rng: random.Random) -> list[Callable[[], bytes]]:
    """Makers of messages a tokenizer must answer or drop without dying: random bytes, wrong
    types, unknown tags, truncations, bad values, lone surrogates, aborts of unknown ids."""
    encoder = msgspec.msgpack.Encoder()
    valid = CLIENT_REQUEST.encode(m.Generate("x", prompt="hi"))
    return [
        lambda: rng.randbytes(rng.randrange(0, 64)),
        lambda: encoder.encode({"type": "Generate", "request_id": rng.random()}),
        lambda: encoder.encode(["Generate", 1, 2, 3]),
        lambda: encoder.encode({"type": "Nope"}),
        lambda: valid[: rng.randrange(1, len(valid))],
        lambda: encoder.encode({"type": "Generate", "request_id": "", "prompt": "x"}),
        lambda: encoder.encode(
            {"type": "Generate", "request_id": "a", "prompt": "x", "params": {"top_p": -5}}
        ),
        lambda: encoder.encode({"type": "Generate", "request_id": "b", "prompt_token_ids": b"\x01\x02\x03"}),
        lambda: encoder.encode(
            {"type": "Generate", "request_id": "c", "prompt": "\ud800".encode("utf-8", "surrogatepass")}
        ),
        lambda: encoder.encode({"type": "Abort", "request_id": "never-seen"}),
    ]


def node_address() -> str | None:
    """This host's address on its default route (none: the test is skipped)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # sends nothing: it only picks the route's source address
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def hf_greedy(model_dir: Path, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """HF transformers' greedy continuation of `prompt_ids` (float32, no eos: exactly
    `num_tokens`), the independent reference for what a run serves."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def spec_decode_counters(port: int) -> dict[str, float]:
    """The spec_decode_* counters, and the acceptance length histogram's _count and _sum, summed
    over engines (the per-position counter as `NAME[position]`), read once the heartbeat brought them."""
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        counters: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("brigade:spec_decode_") and sample.name.endswith(
                    ("_total", "_count", "_sum")
                ):
                    position = sample.labels.get("position")
                    name = sample.name if position is None else f"{sample.name}[{position}]"
                    counters[name] = counters.get(name, 0.0) + sample.value
        if counters.get("brigade:spec_decode_num_drafts_total") or time.monotonic() > deadline:
            return counters
        time.sleep(0.5)
