"""services/metrics.py: multiprocess request and engine metrics summed across real processes, the
stage gauges read from stages.json and /proc, and the /metrics server."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services import metrics
from services.metrics import (
    FinishedRequest,
    RequestMetrics,
    RingSample,
    StageSamples,
    accepts_gzip,
    process_usage,
    registry_for_run,
    write_stage_samples,
)
from services.stage_rows import StageRow
from tests.conftest import REPO_ROOT

MODEL = "tiny-model"


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of everything the registry exports."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def run_dir_with_metrics(tmp_path: Path) -> Path:
    metrics.metrics_dir(tmp_path).mkdir()
    return tmp_path


def observe_in_process(run_dir: Path, code: str) -> None:
    """Run `code` in a fresh interpreter whose prometheus_client writes multiprocess files."""
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(metrics.metrics_dir(run_dir)),
        "PYTHONPATH": str(REPO_ROOT),
    }
    prelude = "from collections import deque\nfrom services.metrics import FinishedRequest, RequestMetrics, EngineMetrics\n"
    subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        cwd=REPO_ROOT,
        check=True,
        timeout=60,
    )


def test_request_metrics_from_two_processes_sum(tmp_path: Path) -> None:
    run_dir = run_dir_with_metrics(tmp_path)
    # Each replica: one request of 10 prompt tokens, first token at 0.2 s, then 4 tokens 0.1 s later
    # (0.025 s per token), finished by length at 0.5 s; and one refused as overloaded.
    code = f"""
        r = RequestMetrics({MODEL!r}, max_model_len=128)
        r.on_tokens(10.0, None, 10.2, 1, 10)
        r.on_tokens(10.0, 10.2, 10.3, 4, 10)
        r.on_finish("length", 10.0, 10.5, FinishedRequest(10, 5, 5, 10.2, 10.3, num_cached_tokens=3))
        r.on_failure("overloaded")
    """
    observe_in_process(run_dir, code)
    observe_in_process(run_dir, code)
    got = scrape(registry_for_run(run_dir))
    model = (("model_name", MODEL),)
    assert got[("brigade:prompt_tokens_total", model)] == 20
    assert got[("brigade:generation_tokens_total", model)] == 10
    assert got[("brigade:request_success_total", (("finished_reason", "length"), *model))] == 2
    assert got[("brigade:request_failure_total", (("code", "overloaded"), *model))] == 2
    assert got[("brigade:time_to_first_token_seconds_count", model)] == 2
    assert got[("brigade:time_to_first_token_seconds_sum", model)] == pytest.approx(0.4)
    # 0.2 s lands in the 0.25 bucket, not the 0.1 one.
    assert got[("brigade:time_to_first_token_seconds_bucket", (("le", "0.1"), *model))] == 0
    assert got[("brigade:time_to_first_token_seconds_bucket", (("le", "0.25"), *model))] == 2
    assert got[("brigade:inter_token_latency_seconds_sum", model)] == pytest.approx(0.05)
    # A refusal is counted, but stays out of the latency histograms.
    assert got[("brigade:e2e_request_latency_seconds_count", model)] == 2
    assert got[("brigade:e2e_request_latency_seconds_sum", model)] == pytest.approx(2 * 0.5)
    # vLLM's per-request histograms, one observation per finished request; token counts in
    # 1-2-5 buckets up to max_model_len (128: the last is 100).
    assert got[("brigade:request_prompt_tokens_sum", model)] == 20
    assert got[("brigade:request_prompt_tokens_bucket", (("le", "5.0"), *model))] == 0
    assert got[("brigade:request_prompt_tokens_bucket", (("le", "10.0"), *model))] == 2
    assert ("brigade:request_prompt_tokens_bucket", (("le", "200.0"), *model)) not in got
    assert got[("brigade:request_generation_tokens_sum", model)] == 10
    assert got[("brigade:request_params_max_tokens_count", model)] == 2
    assert got[("brigade:request_decode_time_seconds_sum", model)] == pytest.approx(2 * 0.1)
    # 0.1 s over the 4 tokens after the first
    assert got[("brigade:request_time_per_output_token_seconds_sum", model)] == pytest.approx(2 * 0.025)
    assert got[("brigade:request_time_per_output_token_seconds_bucket", (("le", "0.01"), *model))] == 0
    assert got[("brigade:request_time_per_output_token_seconds_bucket", (("le", "0.05"), *model))] == 2
    assert got[("brigade:prompt_tokens_cached_total", model)] == 6


def test_engine_metrics_count_deltas_of_running_totals(tmp_path: Path) -> None:
    run_dir = run_dir_with_metrics(tmp_path)
    observe_in_process(
        run_dir,
        f"""
        from services.metrics import FinishedTimes
        e = EngineMetrics({MODEL!r}, 1)
        times = deque([0.003, 0.7])
        steps = deque([(True, 0.12, 300), (False, 0.013, 7), (False, 0.015, 8)])
        # Two requests run here from their first step; one that came back with output (None).
        finished = deque([FinishedTimes(0, 0.2, 1.4), FinishedTimes(2, 0.4, 0.9), FinishedTimes(1, None, None)])
        e.update(times, 100, 32, steps, 1, finished)
        assert not times and not steps and not finished
        e.update(times, 100, 32, steps, 1, finished)   # nothing new: nothing counted twice
        e.update(times, 164, 96, steps, 3, finished)
        """,
    )
    got = scrape(registry_for_run(run_dir))
    labels = (("engine", "1"), ("model_name", MODEL))
    assert got[("brigade:prefix_cache_queries_total", labels)] == 164
    assert got[("brigade:prefix_cache_hits_total", labels)] == 96
    assert got[("brigade:num_preemptions_total", labels)] == 3
    assert got[("brigade:request_queue_time_seconds_count", labels)] == 2
    assert got[("brigade:request_queue_time_seconds_sum", labels)] == pytest.approx(0.703)
    decode, prefill = ((*labels, ("phase", phase)) for phase in ("decode", "prefill"))
    assert got[("brigade:step_execute_time_seconds_count", decode)] == 2
    assert got[("brigade:step_execute_time_seconds_sum", decode)] == pytest.approx(0.028)
    assert got[("brigade:step_execute_time_seconds_count", prefill)] == 1
    assert got[("brigade:step_execute_time_seconds_sum", prefill)] == pytest.approx(0.12)
    # vLLM's per-request engine histograms and tokens per step.
    assert got[("brigade:request_prefill_time_seconds_count", labels)] == 2
    assert got[("brigade:request_prefill_time_seconds_sum", labels)] == pytest.approx(0.6)
    assert got[("brigade:request_inference_time_seconds_sum", labels)] == pytest.approx(2.3)
    assert (
        got[("brigade:request_inference_time_seconds_bucket", (*labels[:1], ("le", "1.0"), *labels[1:]))] == 1
    )
    assert got[("brigade:request_num_preemptions_count", labels)] == 3
    assert got[("brigade:request_num_preemptions_sum", labels)] == 3
    assert got[("brigade:request_num_preemptions_bucket", (*labels[:1], ("le", "0.0"), *labels[1:]))] == 1
    assert got[("brigade:iteration_tokens_total_sum", labels)] == 315
    assert got[("brigade:iteration_tokens_total_bucket", (*labels[:1], ("le", "8.0"), *labels[1:]))] == 2
    assert (
        got[
            (
                "brigade:request_queue_time_seconds_bucket",
                (("engine", "1"), ("le", "0.005"), ("model_name", MODEL)),
            )
        ]
        == 1
    )


def test_request_metrics_on_a_private_registry() -> None:
    registry = CollectorRegistry()
    r = RequestMetrics(MODEL, max_model_len=128, registry=registry)
    r.on_finish("stop", 0.0, 1.0, FinishedRequest(4, 1, 8, 0.5, 0.5))
    r.on_finish("abort", 0.0, 1.0, FinishedRequest(4, 0, 8, None, None))
    got = scrape(registry)
    assert got[("brigade:request_success_total", (("finished_reason", "stop"), ("model_name", MODEL)))] == 1
    assert got[("brigade:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))] == 1


def vm_rss_bytes(pid: int) -> int:
    """Resident memory as /proc/PID/status reports it (kB), a second source besides statm."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def samples(device: str = "cpu", pid: int | None = None) -> StageSamples:
    pid = os.getpid() if pid is None else pid
    return StageSamples(
        model_name=MODEL,
        device=device,
        stages=[
            StageRow("scheduler-0", "scheduler", pid, "running", restarts=2, engine=0, running=3,
                     waiting=5, kv_usage=0.25, malformed=1),
            StageRow("gpu_worker-0-0", "gpu_worker", pid, "restarting", engine=0,
                        gpu_memory_allocated=1 << 30, gpu_memory_reserved=2 << 30),
        ],
        rings=[RingSample("/brigade-x-step-0", 1)],
    )  # fmt: skip


def test_stage_gauges_from_stages_file(tmp_path: Path) -> None:
    run_dir = run_dir_with_metrics(tmp_path)
    write_stage_samples(run_dir, samples())
    sum(range(2_000_000))  # some CPU time of our own to read back
    got = scrape(registry_for_run(run_dir))
    engine = (("engine", "0"), ("model_name", MODEL))
    assert got[("brigade:num_requests_running", engine)] == 3
    assert got[("brigade:num_requests_waiting", engine)] == 5
    assert got[("brigade:kv_cache_usage_perc", engine)] == 0.25
    scheduler = (("kind", "scheduler"), ("stage", "scheduler-0"))
    worker = (("kind", "gpu_worker"), ("stage", "gpu_worker-0-0"))
    assert got[("brigade:stage_restarts_total", scheduler)] == 2
    assert got[("brigade:malformed_messages_total", scheduler)] == 1
    assert got[("brigade:stage_up", scheduler)] == 1
    assert got[("brigade:stage_up", worker)] == 0
    assert got[("brigade:shm_slots_in_use", (("ring", "/brigade-x-step-0"),))] == 1
    times = os.times()
    assert got[("brigade:stage_cpu_seconds_total", scheduler)] == pytest.approx(
        times.user + times.system, abs=0.5
    )
    assert got[("brigade:stage_resident_memory_bytes", scheduler)] == pytest.approx(
        vm_rss_bytes(os.getpid()), rel=0.1
    )
    # On the CPU there is no GPU memory to report.
    assert not any(name.startswith("brigade:gpu_memory") for name, _ in got)


def test_gpu_memory_gauges_on_cuda(tmp_path: Path) -> None:
    run_dir = run_dir_with_metrics(tmp_path)
    write_stage_samples(run_dir, samples(device="cuda"))
    got = scrape(registry_for_run(run_dir))
    worker = (("kind", "gpu_worker"), ("stage", "gpu_worker-0-0"))
    assert got[("brigade:gpu_memory_allocated_bytes", worker)] == 1 << 30
    assert got[("brigade:gpu_memory_reserved_bytes", worker)] == 2 << 30
    assert {name for name, _ in got if name.startswith("brigade:gpu_memory")} == set(metrics.CUDA_ONLY)


def test_gone_process_and_missing_or_corrupt_stages_file(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_usage(child.pid) is None
    run_dir = run_dir_with_metrics(tmp_path)
    assert not [n for n, _ in scrape(registry_for_run(run_dir)) if n.startswith("brigade:")]
    (metrics.metrics_dir(run_dir) / metrics.STAGES_FILE).write_text("{not json")
    assert not [n for n, _ in scrape(registry_for_run(run_dir)) if n.startswith("brigade:")]
    write_stage_samples(run_dir, samples(pid=child.pid))
    got = scrape(registry_for_run(run_dir))
    assert got[("brigade:stage_restarts_total", (("kind", "scheduler"), ("stage", "scheduler-0")))] == 2
    assert not [n for n, _ in got if n == "brigade:stage_cpu_seconds_total"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_and_a_taken_port(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = run_dir_with_metrics(tmp_path)
    write_stage_samples(run_dir, samples())
    port = free_port()
    assert metrics.serve(run_dir, port, host="127.0.0.1")
    deadline = time.monotonic() + 30
    while True:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            break
        except OSError:
            assert time.monotonic() < deadline, "metrics server never answered"
            time.sleep(0.1)
    assert 'brigade:num_requests_running{engine="0",model_name="tiny-model"} 3.0' in text
    with caplog.at_level(logging.WARNING, logger="metrics"):
        assert not metrics.serve(run_dir, port, host="127.0.0.1")
    assert f"metrics port {port} unavailable" in caplog.text


# What Prometheus 2 sends by default (its scrapeAcceptHeader), and Prometheus 3 with UTF-8 names.
PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def test_metrics_port_keeps_the_brigade_names_whatever_the_scraper_accepts(tmp_path: Path) -> None:
    """A scraper that prefers OpenMetrics gets the text format, with the documented `brigade:` names:
    prometheus_client's OpenMetrics page for Prometheus 2's header escapes every `:` to `_`."""
    run_dir = run_dir_with_metrics(tmp_path)
    write_stage_samples(run_dir, samples())
    observe_in_process(
        run_dir, "RequestMetrics('tiny-model', max_model_len=64).success.labels('tiny-model', 'stop').inc()"
    )
    port = free_port()
    assert metrics.serve(run_dir, port, host="127.0.0.1")
    for accept in (PROMETHEUS_2_ACCEPT, PROMETHEUS_3_ACCEPT, None):
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept} if accept else {}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.headers["Content-Type"] == CONTENT_TYPE_LATEST, accept  # as the gateway's /metrics
            text = reply.read().decode()
        assert 'brigade:num_requests_running{engine="0",model_name="tiny-model"} 3.0' in text, accept
        assert 'brigade:request_success_total{finished_reason="stop",model_name="tiny-model"} 1.0' in text, (
            accept
        )
        assert "brigade_" not in text, accept


@pytest.mark.timeout(60)
def test_metrics_port_closes_idle_connections_and_keeps_client_resets_out_of_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every connection to the metrics port holds a thread of the supervisor: one that sends no
    request is closed after the timeout. A client that resets its connection mid-request is no
    traceback on the supervisor's stderr, and the port serves on."""
    import struct

    monkeypatch.setattr(metrics._ScrapeHandler, "timeout", 0.5)
    run_dir = run_dir_with_metrics(tmp_path)
    write_stage_samples(run_dir, samples())
    port = free_port()
    assert metrics.serve(run_dir, port, host="127.0.0.1")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as idle:
        started = time.monotonic()
        assert idle.recv(1) == b""  # closed by the server, not by this 30 s timeout
        assert time.monotonic() - started < 10
    for partial in (b"GET /metrics HTTP/1.1\r\n", b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"):
        reset = socket.create_connection(("127.0.0.1", port), timeout=30)
        reset.sendall(partial)
        time.sleep(0.1)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()
    time.sleep(1.0)  # past the timeout of the connection whose headers never ended
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "brigade:num_requests_running" in text
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


def test_tokenizer_counts_outcomes_once(smollm2_dir: Path) -> None:
    """Through the tokenizer's core: a finished request, an abort and a refusal each land in
    their own counter, and a refusal is neither an abort nor in the latency histograms."""
    from ipc import messages as m
    from services.common.text import Tokenizer
    from services.tokenizer.core import TokenizerCore

    registry = CollectorRegistry()
    core = TokenizerCore(
        Tokenizer(smollm2_dir), 0, 1, max_model_len=256, max_prompt_chars=1000, default_max_tokens=4,
        metrics=RequestMetrics(MODEL, max_model_len=256, registry=registry),
    )  # fmt: skip
    done = core.admit(b"c", m.Generate("done", prompt="Hello"))
    core.relay(m.Delta(done.submit.request_id, 0, 0, "Hi", m.pack_ids([42, 43]), finish_reason="length"))
    core.admit(b"c", m.Generate("gone", prompt="Hello"))
    assert core.abort(b"c", "gone") is not None
    core.admit(b"c", m.Generate("full", prompt="Hello"))
    core.refuse(b"c", "full", "overloaded")
    assert not core.journal
    got = scrape(registry)
    model = ("model_name", MODEL)
    assert got[("brigade:request_success_total", (("finished_reason", "length"), model))] == 1
    assert got[("brigade:request_success_total", (("finished_reason", "abort"), model))] == 1
    assert got[("brigade:request_failure_total", (("code", "overloaded"), model))] == 1
    assert got[("brigade:e2e_request_latency_seconds_count", (model,))] == 2
    assert got[("brigade:generation_tokens_total", (model,))] == 2
    assert got[("brigade:prompt_tokens_total", (model,))] == len(core.tokenizer.encode("Hello"))
    # The per-request histograms observe what request_success counts (the abort too), not the
    # refusal: vLLM observes every finished request, an aborted one with what it had.
    assert got[("brigade:request_prompt_tokens_count", (model,))] == 2
    assert got[("brigade:request_prompt_tokens_sum", (model,))] == 2 * len(core.tokenizer.encode("Hello"))
    assert got[("brigade:request_generation_tokens_sum", (model,))] == 2
    assert got[("brigade:request_params_max_tokens_sum", (model,))] == 2 * 4  # default_max_tokens


def test_a_request_resumed_from_another_tokenizer_observes_no_second_first_token(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose tokenizer replica died resumes its request on another with the tokens it has
    (`resume_output_ids`): the dead replica counted its prompt and its time to first token, so the
    new one counts only the new output tokens (and the gaps after its first new delta), and its time
    per output token divides its own decode time by the tokens delivered in it."""
    from ipc import messages as m
    from services.common.text import Tokenizer
    from services.tokenizer import core as tokenizer_core
    from services.tokenizer.core import TokenizerCore

    clock = [100.0]
    monkeypatch.setattr(tokenizer_core.time, "monotonic", lambda: clock[0])
    registry = CollectorRegistry()
    core = TokenizerCore(
        Tokenizer(smollm2_dir), 0, 1, max_model_len=256, max_prompt_chars=1000, default_max_tokens=8,
        metrics=RequestMetrics(MODEL, max_model_len=256, registry=registry),
    )  # fmt: skip
    resumed = core.admit(b"c", m.Generate("r", prompt="Hello", resume_output_ids=m.pack_ids([40, 41, 42])))
    request_id = resumed.submit.request_id
    clock[0] = 101.0
    core.relay(m.Delta(request_id, 0, 0, "", m.pack_ids([40, 41, 42, 43, 44])))  # a resubmission repeats
    clock[0] = 101.4
    core.relay(m.Delta(request_id, 5, 0, "", m.pack_ids([45]), finish_reason="length"))
    got = scrape(registry)
    model = ("model_name", MODEL)
    # 0.4 s from its first delta here (43, 44) to its last (45): two tokens after the first, of six.
    assert got[("brigade:request_decode_time_seconds_sum", (model,))] == pytest.approx(0.4)
    assert got[("brigade:request_time_per_output_token_seconds_sum", (model,))] == pytest.approx(0.2)
    assert got[("brigade:request_generation_tokens_sum", (model,))] == 6
    assert got[("brigade:generation_tokens_total", (model,))] == 3
    assert got[("brigade:prompt_tokens_total", (model,))] == 0
    assert got[("brigade:time_to_first_token_seconds_count", (model,))] == 0
    assert got[("brigade:inter_token_latency_seconds_count", (model,))] == 1
    assert got[("brigade:request_success_total", (("finished_reason", "length"), model))] == 1
    # A fresh request on the same replica still observes its first token and its prompt.
    fresh = core.admit(b"c", m.Generate("f", prompt="Hello"))
    core.relay(m.Delta(fresh.submit.request_id, 0, 0, "Hi", m.pack_ids([42]), finish_reason="length"))
    got = scrape(registry)
    assert got[("brigade:time_to_first_token_seconds_count", (model,))] == 1
    assert got[("brigade:prompt_tokens_total", (model,))] == len(core.tokenizer.encode("Hello"))


def test_http_inter_token_latency_is_timed_per_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """With n > 1 a request's choices output in the same steps and their deltas interleave: the
    gateway times the gap between two outputs of one choice, never between two choices' outputs."""
    from client.sdk import StreamDelta
    from services.gateway import metrics as gateway_metrics
    from services.metrics import HttpMetrics

    clock = [100.0]
    monkeypatch.setattr(gateway_metrics.time, "monotonic", lambda: clock[0])
    registry = CollectorRegistry()
    timer = gateway_metrics.RequestTimer(HttpMetrics(registry))
    for step in range(3):  # three steps 0.05 s apart, each one token for each of three choices
        clock[0] = 100.5 + 0.05 * step
        for choice in range(3):
            timer.on_output((choice, StreamDelta("x", [7])))
    timer.on_output(None)  # the feed's end
    timer.on_finish()
    got = scrape(registry)
    assert got[("brigade:http_time_to_first_token_seconds_count", ())] == 1
    assert got[("brigade:http_time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    # Two gaps per choice, each 0.05 s: none from a sibling's token of the same step.
    assert got[("brigade:http_inter_token_latency_seconds_count", ())] == 6
    assert got[("brigade:http_inter_token_latency_seconds_sum", ())] == pytest.approx(6 * 0.05)
    assert got[("brigade:http_e2e_request_latency_seconds_count", ())] == 1


OBSERVE_ON_A_FULL_DISK = """
from services.metrics import RequestMetrics
request = RequestMetrics("m", max_model_len=2048)
request.success.labels("m", "stop").inc()
for i in range(2000):  # new series: pages of the metrics file the first ones did not touch
    request.success.labels(f"model-{i}", "length").inc()
print("observed", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_stage_observing_metrics_on_a_full_disk_lives(tmp_path: Path) -> None:
    """prometheus_client maps sparse files: the first write to a page of one on a full tmpfs
    faulted with SIGBUS, and a stage restarted on a full run dir died at once, every time."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    directory = tmp_path / "metrics"
    directory.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(directory)], check=False
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        observe = [sys.executable, "-c", OBSERVE_ON_A_FULL_DISK]
        env = {**os.environ, metrics.METRICS_DIR_ENV: str(directory)}
        roomy = subprocess.run(observe, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert roomy.returncode == 0 and not roomy.stderr, roomy.stderr
        filler = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with pytest.raises(OSError):
            while True:
                os.write(filler, bytes(64 << 10))
        os.close(filler)
        full = subprocess.run(observe, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert full.returncode == 0, f"exit {full.returncode}: {full.stderr}"
        assert full.stdout == "observed\n"
        assert "no room for this process's metrics files" in full.stderr
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def test_engine_groups_and_autoscale_decisions_from_stages_file(tmp_path: Path) -> None:
    run_dir = run_dir_with_metrics(tmp_path)
    write_stage_samples(run_dir, samples())
    got = scrape(registry_for_run(run_dir))
    assert not any(name.startswith(("brigade:engine_groups", "brigade:autoscale")) for name, _ in got)
    groups = metrics.EngineGroupsSample(current=2, target=3, decisions_up=2, decisions_down=1)
    write_stage_samples(run_dir, msgspec.structs.replace(samples(), groups=groups))
    got = scrape(registry_for_run(run_dir))
    model = (("model_name", MODEL),)
    assert got[("brigade:engine_groups", model)] == 2
    assert got[("brigade:engine_groups_target", model)] == 3
    assert got[("brigade:autoscale_decisions_total", (("direction", "up"), *model))] == 2
    assert got[("brigade:autoscale_decisions_total", (("direction", "down"), *model))] == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pool_too_small_for_its_sequences_preempts_counts_it_and_keeps_hfs_tokens(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """A random Llama with wide KV heads: 1 MiB holds 8 blocks of 16 tokens, and three sequences
    of 30 + 50 tokens need 5 blocks each, so the scheduler must preempt while they run together.
    Every greedy output is still HF's, and /metrics counts the preemptions."""
    import numpy as np
    from transformers import LlamaConfig

    from client import Client
    from tests.conftest import TINY_VOCAB_SIZE, save_random_model
    from tests.harness import assert_clean, brigade_run, hf_greedy

    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=512, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model_dir = save_random_model(config, tmp_path / "model", seed=4, std=0.05, tokenizer_from=smollm2_dir)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, 30).tolist() for _ in range(3)]
    new_tokens = 50
    expected = [hf_greedy(model_dir, prompt, new_tokens) for prompt in prompts]
    port = free_port()
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={model_dir}", "model.dtype=float32", "model.max_model_len=128",
        "engine.kv_cache_mib=1", "engine.block_size=16", f"supervisor.metrics_port={port}",
        "gateway.served_model_name=tiny-served",
    )  # fmt: skip
    with brigade_run(run_dir, *overrides):

        def greedy(prompt: list[int]) -> list[int]:
            with Client(run_dir) as client:
                return client.generate(
                    prompt, max_tokens=new_tokens, temperature=0.0, ignore_eos=True, timeout=300
                ).token_ids

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(greedy, prompts)) == expected
        deadline = time.monotonic() + 30
        while True:  # the counter reaches /metrics with the scheduler's next update
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            samples = [
                sample
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "brigade:num_preemptions_total"
            ]
            preemptions = sum(sample.value for sample in samples)
            if preemptions or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert preemptions >= 1, text
        # Every metric names the model as clients do (gateway.served_model_name), as vLLM's.
        assert {sample.labels["model_name"] for sample in samples} == {"tiny-served"}, samples
    assert_clean(run_dir)


@pytest.mark.parametrize(
    ("header", "gzipped"),
    [
        ("gzip", True),
        ("br, GZIP;q=0.5", True),
        ("*", True),
        ("gzip;q=0, identity", False),
        ("identity", False),
        ("", False),
        ("gzip;q=nonsense", False),
    ],
)
def test_a_scrape_is_gzipped_only_where_the_scraper_takes_gzip(header: str, gzipped: bool) -> None:
    assert accepts_gzip(header) is gzipped
