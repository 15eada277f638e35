"""What a run owns, and what an operator's mistake or a full disk must not take from it, on one
real run of the tiny model whose run dir is a small tmpfs: a second supervisor on the same run
dir, or another run on the same gateway port, is refused and leaves the live run alone; /metrics
listens where the gateway does; unauthenticated requests are audited in aggregate; a full run-dir
filesystem and a config replaced by a FIFO do not stop the supervisor watching and restarting.
Mounting the tmpfs needs root (the suite runs as root)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

from client import Client
from tests.conftest import REPO_ROOT
from tests.harness import Run, assert_clean, brigade_run, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

API_KEY = "sk-ownership-test"
RUN_DIR_BYTES = 16 << 20
REFUSAL_TIMEOUT_S = 120  # a refused supervisor exits before preparing any model


@pytest.fixture(scope="module")
def owned(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting the run dir's tmpfs needs root")
    root = tmp_path_factory.mktemp("ownership")
    config = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    config["model"].update(path=str(tiny_model_dir), dtype="float32", max_model_len=256)
    config.setdefault("gateway", {})["api_keys"] = [API_KEY]
    config_path = root / "brigade.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port, metrics_port = free_port(), free_port()
    run_dir = root / "run"
    run_dir.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={RUN_DIR_BYTES},mode=0700", "tmpfs", str(run_dir)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with brigade_run(
            run_dir,
            f"gateway.port={port}",
            f"supervisor.metrics_port={metrics_port}",
            "supervisor.backoff_initial_s=0.1",
            config=str(config_path),
        ) as run:
            run.http_port, run.metrics_port = port, metrics_port
            run.config_path = config_path  # type: ignore[attr-defined]
            yield run
        assert_clean(run_dir)
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], check=False)


def ask(run: Run) -> str:
    """One chat completion through the HTTP API, with the real openai client."""
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{run.http_port}/v1", api_key=API_KEY, max_retries=0)
    reply = api.chat.completions.create(
        model=api.models.list().data[0].id,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0,
        timeout=120,
    )
    return reply.choices[0].finish_reason


def run_files(run_dir: Path) -> set[str]:
    return {p.name for p in run_dir.iterdir()}


def second_supervisor(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir)]
    for override in ("supervisor.metrics_port=0", *overrides):
        argv += ["--set", override]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S)


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the IPv4 sockets listening on `port` (/proc/net/tcp, state 0A)."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, _, hex_port = local.partition(":")
        if state == "0A" and int(hex_port, 16) == port:
            addresses.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return addresses


def test_metrics_listen_where_the_gateway_does(owned: Run) -> None:
    """gateway.host is 127.0.0.1 (configs/default.yaml), so /metrics is not on 0.0.0.0."""
    assert listening_addresses(owned.metrics_port) == {"127.0.0.1"}


def test_a_second_supervisor_on_a_live_run_dir_is_refused_and_touches_nothing(owned: Run) -> None:
    before = run_files(owned.run_dir)
    assert {"run.json", "status.json", "metrics"} <= before and any(n.endswith(".sock") for n in before)
    done = second_supervisor(owned.run_dir)
    assert done.returncode == 1, done.stderr
    assert (
        f"a Brigade run is already live in {owned.run_dir} (supervisor pid {owned.process.pid})"
        in done.stderr
    )
    assert "stopped" in done.stderr and "removed" not in done.stderr  # it removed nothing, and says so
    assert run_files(owned.run_dir) >= before
    assert ask(owned) in ("stop", "length")
    assert owned.process.poll() is None


def test_another_run_on_the_gateway_port_is_refused(owned: Run, tmp_path: Path) -> None:
    other_dir = tmp_path / "other"
    done = second_supervisor(other_dir, f"gateway.port={owned.http_port}")
    assert done.returncode == 1, done.stderr
    assert f"gateway.port {owned.http_port} is already served by another Brigade run" in done.stderr
    assert not {"run.json", "status.json"} & run_files(other_dir)
    # Every request reaches this run: none is split off to a second run's gateway.
    assert [ask(owned) for _ in range(3)]


def test_unauthenticated_requests_are_audited_in_aggregate(owned: Run) -> None:
    num_requests = 300
    connection = http.client.HTTPConnection("127.0.0.1", owned.http_port, timeout=60)
    for _ in range(num_requests):
        connection.request("GET", "/v1/models")
        response = connection.getresponse()
        response.read()
        assert response.status == 401
    connection.close()
    audit = owned.run_dir / "audit.log"

    def refused() -> list[dict]:
        lines = [json.loads(line) for line in audit.read_text().splitlines()]
        return [e for e in lines if e["event"] == "auth_failure" and e["mechanism"] == "api_key"]

    deadline = time.monotonic() + 30  # the last interval's line follows within a second or two
    while sum(e.get("count", 1) for e in refused()) < num_requests and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = refused()
    assert sum(e["count"] for e in lines) == num_requests
    assert len(lines) <= 2 * 30, f"{len(lines)} audit lines for {num_requests} refusals"
    assert {e["peer"] for e in lines} == {"127.0.0.1"}
    assert {e["reason"] for e in lines} == {"no Authorization: Bearer or x-api-key header"}


def saw(run: Run, needle: str, timeout: float) -> str:
    """A line containing `needle`, among those already read or the next ones."""
    return next((line for line in run.log if needle in line), None) or run.wait_for_line(needle, timeout)


def replace_text(path: Path, text: str) -> None:
    """Atomically, as an editor or a ConfigMap update does: a reload never reads half a file."""
    new = path.with_name(path.name + ".new")
    new.write_text(text)
    new.replace(path)


def fill(path: Path) -> None:
    """Write zeros to `path` until its filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, bytes(64 << 10)):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def test_a_full_run_dir_filesystem_does_not_end_the_run(owned: Run) -> None:
    filler = owned.run_dir / "filler"
    fill(filler)
    try:
        for kind in ("detokenizer", "tokenizer"):  # status, audit and metrics files get written
            (pid,) = owned.stage_pids(kind)
            os.kill(pid, signal.SIGKILL)
            owned.wait_for_line(f"{kind}-0 up (pid", 120)
        saw(owned, "could not write status.json (No space left on device)", 30)
        assert ask(owned) in ("stop", "length")
        with Client(owned.run_dir) as client:
            assert client.generate("Hi", max_tokens=3, temperature=0, timeout=120).token_ids
        # A rescale that cannot publish run.json (new stages read it) is refused, not half done.
        config_path: Path = owned.config_path  # type: ignore[attr-defined]
        original = config_path.read_text()
        config = yaml.safe_load(original)
        config.setdefault("tokenizer", {})["replicas"] = 2
        replace_text(config_path, yaml.safe_dump(config))  # the supervisor sees the change
        line = owned.wait_for_line("reload: replica and engine group counts stay as they were", 60)
        assert "run.json: No space left on device" in line
        replace_text(config_path, original)
        assert owned.process.poll() is None
    finally:
        filler.unlink()
    saw(owned, "status.json written again", 30)
    restarts = {r["name"]: r["restarts"] for r in owned.read_status()}
    assert restarts == {**restarts, "detokenizer-0": 1, "tokenizer-0": 1}
    assert "tokenizer-1" not in restarts


def test_a_fifo_in_place_of_the_config_never_blocks_the_supervisor(owned: Run) -> None:
    """Last: it stops the run."""
    config_path: Path = owned.config_path  # type: ignore[attr-defined]
    config_path.unlink()
    os.mkfifo(config_path)
    owned.process.send_signal(signal.SIGHUP)
    line = owned.wait_for_line("reload refused, config unchanged", 60)
    assert "is not a regular file" in line
    (pid,) = owned.stage_pids("detokenizer")
    os.kill(pid, signal.SIGKILL)
    owned.wait_for_line("detokenizer-0 up (pid", 120)
    assert ask(owned) in ("stop", "length")
    owned.process.send_signal(signal.SIGTERM)
    assert owned.process.wait(60) == 0
