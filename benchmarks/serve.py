"""Serving benchmark: Brigade through the client SDK and/or its OpenAI HTTP API (`--backend
sdk,http`) against HF transformers, llama.cpp's server and vLLM's CPU build.

    python benchmarks/serve.py [--run DIR | --start] [--backend sdk|http|sdk,http] [--tls] [--config FILE] [--set key=value ...]
        [--engines brigade,hf,llamacpp,vllm] [--concurrency 1,16,64,256] [--request-rate R]
        [--dataset chat|random|shared-prefix] [--output-len 128] [--dtype float32]
        [--llama-server PATH | --build-llama-server] [--gguf FILE] [--vllm-venv DIR] [--vllm-dtype bfloat16]
        [--json FILE] [--plot FILE] [--smoke] [--mlflow TRACKING_URI [--mlflow-experiment NAME]]

Every engine gets the same prompts (token ids) and output lengths (ignore_eos, greedy), engines
run back to back in one invocation; with `--backend sdk,http` both backends drive the same
Brigade run one after the other (engines `brigade` and `brigade_http` in the report). Per concurrency it reports request throughput, output tokens/s,
TTFT / TPOT / ITL / end-to-end latency (mean, p50, p90, p99) and failures (overload vs other).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import queue
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import datasets, peers  # noqa: E402
from benchmarks.datasets import BenchRequest  # noqa: E402
from benchmarks.peers import RequestResult  # noqa: E402

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 600.0
ENGINES = ("brigade", "brigade_http", "hf", "llamacpp", "vllm")
# What --engines takes (brigade_http is Brigade through `--backend http`).
SELECTABLE_ENGINES = ("brigade", "hf", "llamacpp", "vllm")
# The report key of Brigade driven through each backend.
BACKEND_ENGINES = {"sdk": "brigade", "http": "brigade_http"}
SendFn = Callable[[BenchRequest], AsyncIterator[int]]

# -- stats ----------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize_ms(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 of seconds, in milliseconds."""
    ms = [v * 1000 for v in values]
    mean = sum(ms) / len(ms) if ms else math.nan
    return {"mean": mean, "p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def setting_stats(results: list[RequestResult], duration: float) -> dict:
    """The report of one engine at one setting."""
    ok = [r for r in results if r.error is None]
    overloads = [r for r in results if r.is_overload]
    others = [r for r in results if r.error is not None and not r.is_overload]
    num_output = sum(r.num_output for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.num_output - 1) for r in ok if r.num_output > 1]
    return {
        "num_requests": len(results),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tok_s": num_output / duration,
        "num_output_tokens": num_output,
        "ttft_ms": summarize_ms([r.ttft for r in ok]),
        "tpot_ms": summarize_ms(tpots),
        "itl_ms": summarize_ms([x for r in ok for x in r.itls]),
        "e2e_ms": summarize_ms([r.e2e for r in ok]),
        "failures": {
            "total": len(overloads) + len(others),
            "overload": len(overloads),
            "other": len(others),
            "examples": sorted({r.error for r in others})[:5],
        },
    }


# -- the load generator ---------------------------------------------------------------------------


async def drive(
    send: SendFn,
    requests: list[BenchRequest],
    concurrency: int,
    request_rate: float | None,
    seed: int,
    desc: str,
) -> tuple[list[RequestResult], float]:
    """Send `requests` (one task each) with at most `concurrency` in flight; with `request_rate`,
    arrivals are Poisson at that rate. Returns per-request results and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(seed)
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False, file=sys.stderr)
    begin = time.perf_counter()

    async def one(request: BenchRequest) -> RequestResult:
        async with gate:
            sent = time.perf_counter()
            result = RequestResult(start=sent - begin)
            last = sent
            try:
                async with contextlib.aclosing(send(request)) as chunks:
                    async for n in chunks:
                        if n == 0:
                            continue
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - sent
                        else:
                            result.itls.append(now - last)
                        last, result.num_output = now, result.num_output + n
                result.e2e = time.perf_counter() - sent
                if result.num_output != request.output_len:
                    result.error = f"got {result.num_output} of {request.output_len} tokens"
            except Exception as exc:  # every failure is counted, none stops the benchmark
                result.is_overload = getattr(exc, "code", None) == "overloaded" or isinstance(
                    exc, peers.PeerOverloaded
                )
                result.error = "overloaded" if result.is_overload else f"{type(exc).__name__}: {exc}"[:200]
            bar.update()
            return result

    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        if request_rate:
            await asyncio.sleep(rng.exponential(1 / request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - begin
    bar.close()
    return list(results), duration


# -- Brigade --------------------------------------------------------------------------------------


class BrigadeProcess:
    """A Brigade run this benchmark started: the supervisor process and its log lines."""

    def __init__(self, run_dir: Path, config: str, overrides: list[str], log_path: Path) -> None:
        argv = [sys.executable, "supervisor.py", "--config", config, "--run-dir", str(run_dir)]
        for override in overrides:
            argv += ["--set", override]
        self.run_dir = run_dir
        self.log_path = log_path
        self.process = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        with open(self.log_path, "a") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                self.lines.put(line)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if "Brigade ready" in self.lines.get(timeout=0.2):
                    return
            except queue.Empty:
                if self.process.poll() is not None:
                    break
        raise RuntimeError(f"Brigade not ready within {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> list[str]:
        """SIGTERM, then SIGKILL whatever is left; returns a list of leftovers found (should be empty)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_TIMEOUT_S)
        leftovers = [f"process {pid}" for pid in self._stage_pids()]
        for pid in [self.process.pid, *self._stage_pids()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        from ipc.endpoints import SHM_PREFIX
        from ipc.shm import sweep_stale_runs

        owned = f"{SHM_PREFIX}{self.process.pid}x"
        leftovers += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if owned in n]
        sweep_stale_runs()  # the supervisor is dead now: this removes anything of its run
        return leftovers

    def _stage_pids(self) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if str(self.run_dir).encode() in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0"):
                        pids.append(int(entry))
        return pids


@contextlib.contextmanager
def started_brigade(config: str, overrides: list[str], prefix: str) -> Iterator[BrigadeProcess]:
    """A Brigade started in a fresh run dir (its log beside it, `<run dir>.log`), ready; stopped and
    its run dir removed on the way out, with a warning if it left anything behind."""
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    run = BrigadeProcess(run_dir, config, overrides, run_dir.with_suffix(".log"))
    try:
        run.wait_ready(READY_TIMEOUT_S)
        yield run
    finally:
        leftovers = run.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        if leftovers:
            print(f"warning: Brigade left {leftovers} behind (removed)", file=sys.stderr)


@contextlib.contextmanager
def brigade(args: argparse.Namespace, log_dir: Path, info: dict) -> Iterator[Path]:
    """The run dir of the Brigade to benchmark: the attached one, or one started (and stopped) here.
    `info` gets the started run's supervisor pid, run dir and anything it left behind."""
    if args.run:
        yield Path(args.run)
        return
    run_dir = Path(tempfile.mkdtemp(prefix="brigade-bench-"))
    overrides = [f"model.dtype={args.dtype}", f"gateway.port={peers.free_port()}", *args.set]
    if args.tls:
        overrides += tls_overrides(run_dir, info)
    run = BrigadeProcess(run_dir, args.config, overrides, log_dir / "brigade.log")
    info.update(supervisor_pid=run.process.pid, run_dir=str(run_dir))
    try:
        run.wait_ready(READY_TIMEOUT_S)
        yield run_dir
    finally:
        info["leftovers"] = run.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        if info["leftovers"]:
            print(f"warning: Brigade left {info['leftovers']} behind (removed)", file=sys.stderr)


def tls_overrides(run_dir: Path, info: dict) -> list[str]:
    """--tls: a CA and a server certificate for 127.0.0.1 made for this run (kept in its run dir,
    removed with it); `info` gets the CA the HTTP backend trusts."""
    from tests.tls_certs import CertificateAuthority

    certs = run_dir / "tls"
    certs.mkdir()
    ca = CertificateAuthority(certs, "bench-ca")
    server = ca.issue("bench-server", server=True)
    info["tls_ca"] = str(ca.cert_path)
    return [f"gateway.tls.certfile={server.cert}", f"gateway.tls.keyfile={server.key}"]


async def sweep(
    engine: str, send: SendFn, requests: list[BenchRequest], args: argparse.Namespace, concurrency: list[int]
) -> dict[str, dict]:
    """Warm up once, then each concurrency in turn against one running server: {concurrency: stats}."""
    per_setting = {}
    await drive(send, warmup_requests(requests), 1, None, args.seed, f"{engine} warmup")
    for c in concurrency:
        results, duration = await drive(
            send, requests[: num_prompts(args, c)], c, args.request_rate, args.seed, f"{engine} c={c}"
        )
        per_setting[str(c)] = setting_stats(results, duration)
        print_setting(engine, c, per_setting[str(c)])
    return per_setting


async def brigade_settings(
    run_dir: Path, requests: list[BenchRequest], args: argparse.Namespace, backend: str, tls_ca: str = ""
) -> dict[str, dict]:
    """The sweep through one AsyncClient (`--backend sdk`), or streamed over the gateway's OpenAI API
    (`--backend http`), as llama.cpp's and vLLM's servers are driven; over HTTPS with `tls_ca`."""
    from client.async_sdk import AsyncClient
    from services.stage import read_run_info

    engine = BACKEND_ENGINES[backend]
    if backend == "http":
        port = read_run_info(run_dir).config.gateway.port
        tls = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
        return await sweep(
            engine,
            lambda request: peers.openai_stream(port, request, tls=tls),
            requests,
            args,
            args.concurrency,
        )
    async with AsyncClient(run_dir, timeout=REQUEST_TIMEOUT_S) as client:

        async def send(request: BenchRequest) -> AsyncIterator[int]:
            stream = client.stream(
                request.prompt_ids, max_tokens=request.output_len, temperature=0.0, ignore_eos=True
            )
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    yield len(delta.token_ids)

        return await sweep(engine, send, requests, args, args.concurrency)


def warmup_requests(requests: list[BenchRequest]) -> list[BenchRequest]:
    return [BenchRequest(r.prompt_ids, min(r.output_len, 4)) for r in requests[:1]]


# -- the benchmark --------------------------------------------------------------------------------


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    """One full wave per setting (at least 4 requests): enough for the steady state on a small CPU."""
    return args.num_prompts or max(4, concurrency)


def build_requests(args: argparse.Namespace, model_dir: Path, total: int) -> list[BenchRequest]:
    out_len = datasets.parse_range(args.output_len)
    if args.dataset == "chat":
        return datasets.chat_requests(model_dir, total, out_len, args.seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    in_len = datasets.parse_range(args.input_len)
    if args.dataset == "random":
        return datasets.random_requests(vocab, total, in_len, out_len, args.seed)
    return datasets.shared_prefix_requests(vocab, total, args.prefix_len, in_len, out_len, args.seed)


def engine_report(per_setting: dict[str, dict], note: str = "") -> dict:
    report: dict = {
        "output_tok_s": {c: s["output_tok_s"] for c, s in per_setting.items()},
        "request_throughput": {c: s["request_throughput"] for c, s in per_setting.items()},
        "failures": {c: s["failures"]["total"] for c, s in per_setting.items()},
        "settings": per_setting,
        "loadavg_1m": os.getloadavg()[0],
    }
    if note:
        report["note"] = note
    return report


def run_brigade(args: argparse.Namespace, requests: list[BenchRequest], log_dir: Path) -> dict[str, dict]:
    """One Brigade run, swept through each backend in turn: {engine key: its report}."""
    info: dict = {}
    per_backend = {}
    with brigade(args, log_dir, info) as run_dir:
        for backend in args.backends:
            per_backend[backend] = asyncio.run(
                brigade_settings(run_dir, requests, args, backend, info.get("tls_ca", ""))
            )
    # `info` (leftovers above all) is complete only once the run has stopped.
    return {
        BACKEND_ENGINES[backend]: {
            **engine_report(
                per_setting,
                f"driven through the {backend} backend"
                + (" over HTTPS" if args.tls and backend == "http" else ""),
            ),
            **info,
        }
        for backend, per_setting in per_backend.items()
    }


def run_hf(args: argparse.Namespace, model_dir: Path, requests: list[BenchRequest]) -> dict:
    per_setting = {}
    model = peers.load_hf_model(model_dir, args.dtype, args.threads)
    peers.hf_static_batches(model, warmup_requests(requests), 1)
    for c in args.peer_concurrency:
        results, duration = peers.hf_static_batches(model, requests[: num_prompts(args, c)], c)
        per_setting[str(c)] = setting_stats(results, duration)
        print_setting("hf", c, per_setting[str(c)])
    return engine_report(per_setting, f"transformers generate, static batches, {args.dtype}, left padding")


def run_llamacpp(args: argparse.Namespace, requests: list[BenchRequest], log_dir: Path) -> dict:
    binary = Path(args.llama_server) if args.llama_server else peers.default_llama_server()
    if binary is None and args.build_llama_server:
        built = subprocess.run(
            [str(REPO / "benchmarks" / "build_llama_server.sh")], check=True, capture_output=True, text=True
        )
        binary = Path(built.stdout.strip().splitlines()[-1])
    if binary is None or not binary.exists():
        note = "skipped: no llama-server (give --llama-server PATH or --build-llama-server)"
        print(f"llama.cpp {note}")
        return {"skipped": note}
    from services.gpu_worker.loader import default_model_path

    gguf = args.gguf or Path(default_model_path())
    ctx_per_slot = max(len(r.prompt_ids) + r.output_len for r in requests) + 16
    per_setting = {}
    for c in args.peer_concurrency:
        with peers.llama_server(
            binary, gguf, c, ctx_per_slot, args.threads, log_dir / "llama-server.log"
        ) as port:

            def send(request: BenchRequest, port: int = port) -> AsyncIterator[int]:
                return peers.llama_stream(port, request)

            async def setting(c: int = c, send: SendFn = send) -> tuple[list[RequestResult], float]:
                await drive(send, warmup_requests(requests), 1, None, args.seed, "llama.cpp warmup")
                return await drive(
                    send,
                    requests[: num_prompts(args, c)],
                    c,
                    args.request_rate,
                    args.seed,
                    f"llama.cpp c={c}",
                )

            results, duration = asyncio.run(setting())
        per_setting[str(c)] = setting_stats(results, duration)
        print_setting("llamacpp", c, per_setting[str(c)])
    note = f"llama-server {binary}, {gguf.name}, --parallel = concurrency{peers.llama_server_note(binary)}"
    return engine_report(per_setting, note)


def run_vllm(args: argparse.Namespace, model_dir: Path, requests: list[BenchRequest], log_dir: Path) -> dict:
    """vLLM's CPU build from the venv `--vllm-venv` names, on Brigade's prepared model dir (the same
    GGUF, converted once), started once for the whole sweep with room for its largest concurrency,
    driven like Brigade's gateway. Without a usable venv it is skipped, saying why."""
    venv, reason = Path(args.vllm_venv or "."), ""
    if not args.vllm_venv:
        reason = "no vLLM venv (give --vllm-venv DIR or set BRIGADE_VLLM_VENV)"
    elif not args.peer_concurrency:
        reason = f"no concurrency <= --peer-max-concurrency {args.peer_max_concurrency}"
    else:
        try:
            python = peers.vllm_python(venv)
        except FileNotFoundError as exc:
            reason = str(exc)
    if reason:
        print(f"vLLM skipped: {reason}")
        return {"skipped": f"skipped: {reason}"}
    env, settings = peers.vllm_env(venv, args.threads)
    if "missing" in settings:
        print(f"warning: vLLM runs without {settings['missing']} preloaded (see docs/performance.md)")
    max_model_len = max(len(r.prompt_ids) + r.output_len for r in requests) + 16
    max_num_seqs = max(args.peer_concurrency)
    served_dir = peers.vllm_model_dir(model_dir)
    with peers.vllm_server(
        python, served_dir, max_num_seqs, max_model_len, args.vllm_dtype, env, log_dir / "vllm.log"
    ) as port:

        def send(request: BenchRequest) -> AsyncIterator[int]:
            return peers.openai_stream(port, request, peers.VLLM_MODEL_NAME, "vLLM")

        per_setting = asyncio.run(sweep("vllm", send, requests, args, args.peer_concurrency))
    note = (
        f"{peers.vllm_version(venv)} from {venv}, OpenAI /v1/completions streamed, {args.vllm_dtype}, "
        f"max_num_seqs {max_num_seqs}, max_model_len {max_model_len}"
    )
    return {**engine_report(per_setting, note), "dtype": args.vllm_dtype, "cpu_settings": settings}


def print_setting(engine: str, concurrency: int, s: dict) -> None:
    f = s["failures"]
    print(
        f"{engine:>9} c={concurrency:<4} {s['output_tok_s']:8.1f} out tok/s  {s['request_throughput']:6.2f} req/s  "
        f"TTFT p50 {s['ttft_ms']['p50']:8.1f} ms  TPOT p50 {s['tpot_ms']['p50']:7.1f} ms  "
        f"ITL p50 {s['itl_ms']['p50']:7.1f} ms  E2E p50 {s['e2e_ms']['p50']:8.1f} ms  "
        f"failures {f['total']} (overload {f['overload']}, other {f['other']})",
        flush=True,
    )


def _stat(report: dict, engine: str, concurrency: str, *path: str) -> float | None:
    value = report.get(engine, {}).get("settings", {}).get(concurrency)
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def evaluate_targets(report: dict) -> list[dict]:
    """The open targets; `met` is None when a number it needs was not measured. Brigade meets
    llama.cpp and vLLM over the same protocol (HTTP) when the gateway was measured, else through the
    SDK."""

    def ratio(
        engine: str,
        c: str,
        path: tuple[str, ...],
        peer: str,
        bound: float,
        is_higher_better: bool,
        name: str,
        slack: float = 0.0,
    ) -> dict:
        ours, theirs = _stat(report, engine, c, *path), _stat(report, peer, c, *path)
        if ours is None or theirs is None or not theirs:
            return {"target": name, "value": None, "met": None}
        value = ours / theirs
        met = value >= bound if is_higher_better else ours <= bound * theirs + slack
        return {"target": name, "value": value, "met": met}

    ours = "brigade_http" if "brigade_http" in report else "brigade"
    failures_256 = _stat(report, ours, "256", "failures", "total")
    return [
        ratio(
            "brigade_http",
            "64",
            ("output_tok_s",),
            "brigade",
            0.95,
            True,
            "c=64 output tok/s over HTTP >= 0.95x the SDK's",
        ),
        ratio(
            "brigade_http",
            "1",
            ("ttft_ms", "p50"),
            "brigade",
            1.05,
            False,
            "c=1 TTFT p50 over HTTP <= 1.05x the SDK's + 2 ms",
            slack=2.0,
        ),
        ratio(
            ours, "1", ("tpot_ms", "p50"), "llamacpp", 0.9, False, f"c=1 TPOT p50 ({ours}) <= 0.9x llama.cpp"
        ),
        ratio(
            ours, "1", ("ttft_ms", "p50"), "llamacpp", 1.0, False, f"c=1 TTFT p50 ({ours}) <= 1.0x llama.cpp"
        ),
        ratio(
            ours,
            "16",
            ("output_tok_s",),
            "llamacpp",
            1.5,
            True,
            f"c=16 output tok/s ({ours}) >= 1.5x llama.cpp",
        ),
        ratio(
            ours,
            "64",
            ("output_tok_s",),
            "llamacpp",
            2.5,
            True,
            f"c=64 output tok/s ({ours}) >= 2.5x llama.cpp",
        ),
        ratio(ours, "16", ("output_tok_s",), "vllm", 1.2, True, f"c=16 output tok/s ({ours}) >= 1.2x vLLM"),
        ratio(ours, "64", ("output_tok_s",), "vllm", 1.2, True, f"c=64 output tok/s ({ours}) >= 1.2x vLLM"),
        ratio(ours, "1", ("ttft_ms", "p50"), "vllm", 0.9, False, f"c=1 TTFT p50 ({ours}) <= 0.9x vLLM"),
        {
            "target": f"c=256 zero failed requests ({ours})",
            "value": failures_256,
            "met": None if failures_256 is None else failures_256 == 0,
        },
    ]


def print_targets(targets: list[dict]) -> None:
    print("targets (SmolLM2-135M, one run):")
    for t in targets:
        verdict = {True: "met", False: "NOT met", None: "n/a (not measured)"}[t["met"]]
        value = "" if t["value"] is None else f" ({t['value']:.2f})"
        print(f"  {t['target']}: {verdict}{value}")


def plot(report: dict, path: Path) -> None:
    """Output tokens/s, TTFT p50 and TPOT p50 against concurrency, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("output tokens/s", ("output_tok_s",)),
        ("TTFT p50 (ms)", ("ttft_ms", "p50")),
        ("TPOT p50 (ms)", ("tpot_ms", "p50")),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (label, key) in zip(axes, panels, strict=True):
        for engine in ENGINES:
            settings = report.get(engine, {}).get("settings", {})
            xs = sorted(settings, key=int)
            if xs:
                ax.plot(
                    [int(x) for x in xs],
                    [_stat(report, engine, x, *key) for x in xs],
                    marker="o",
                    # A peer in another dtype than the title's (vLLM's bfloat16) says so.
                    label=f"{engine} ({report[engine]['dtype']})" if "dtype" in report[engine] else engine,
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(
        f"{report['model']} on {report['machine']['cpu']} ({report['config']['dtype']}, "
        f"{report['config']['output_len']} output tokens)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine_info() -> dict:
    cpu = platform.processor() or "unknown cpu"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "loadavg_1m_at_start": os.getloadavg()[0],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--run", help="attach to the Brigade running in this run dir")
    where.add_argument("--start", action="store_true", help="start a Brigade here (the default)")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)"
    )
    p.add_argument("--concurrency", default="1,16,64,256", help="comma-separated concurrency sweep")
    p.add_argument(
        "--peer-max-concurrency",
        type=int,
        default=64,
        help="peers skip concurrencies above this (256 is only Brigade's failure check)",
    )
    p.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per second (capped by concurrency)"
    )
    p.add_argument(
        "--num-prompts", type=int, default=0, help="requests per setting (0 = max(4, concurrency))"
    )
    p.add_argument("--dataset", choices=("chat", "random", "shared-prefix"), default="chat")
    p.add_argument("--input-len", default="64:256", help="random / suffix prompt length N or LOW:HIGH")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens every prompt shares")
    p.add_argument("--output-len", default="128", help="output tokens N or LOW:HIGH (ignore_eos)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--engines",
        default="brigade,hf,llamacpp",
        help=f"comma-separated, from {','.join(SELECTABLE_ENGINES)} (vllm needs --vllm-venv)",
    )
    p.add_argument(
        "--backend",
        default="sdk",
        help="drive Brigade through the client SDK (sdk), its OpenAI HTTP API (http: the gateway), "
        "or both against the same run (sdk,http)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="serve the started Brigade's gateway over HTTPS (a CA and certificate made for the run): "
        "the http backend then pays for TLS",
    )
    p.add_argument("--llama-server", help="path of a llama-server binary")
    p.add_argument(
        "--gguf",
        type=Path,
        help="the GGUF llama-server serves (default: the embedded SmolLM2's; give Brigade the same "
        "with --set model.path=GGUF); prompts are drawn from SmolLM2's vocabulary, so it needs that tokenizer",
    )
    p.add_argument("--build-llama-server", action="store_true", help="build llama-server if none is found")
    p.add_argument(
        "--vllm-venv",
        default=os.environ.get("BRIGADE_VLLM_VENV"),
        help="the venv with vLLM's CPU build (default: $BRIGADE_VLLM_VENV; docs/performance.md makes it)",
    )
    p.add_argument(
        "--vllm-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="vLLM's dtype (bfloat16: its CPU default)",
    )
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="peer threads (default: every core)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--log-dir", type=Path, help="where engine logs go (default: a temp dir)")
    p.add_argument(
        "--smoke", action="store_true", help="CI: tiny concurrency, few tokens, no llama.cpp (< 1 min)"
    )
    p.add_argument(
        "--mlflow",
        metavar="TRACKING_URI",
        help="log the run to MLflow: parameters, per-concurrency metrics, the JSON report, the plot",
    )
    p.add_argument("--mlflow-experiment", default="brigade-benchmarks")
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.output_len, args.num_prompts = "1,2", "4", 2
        args.engines = args.engines.replace("llamacpp", "").strip(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.peer_concurrency = [c for c in args.concurrency if c <= args.peer_max_concurrency]
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = set(args.engines) - set(SELECTABLE_ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(SELECTABLE_ENGINES)}")
    if args.tls and args.run:
        p.error("--tls makes its own certificates for a Brigade it starts: not with --run")
    args.backends = [b for b in args.backend.split(",") if b]
    if not args.backends or set(args.backends) - set(BACKEND_ENGINES):
        p.error(f"--backend takes sdk, http or sdk,http; got {args.backend!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (and SIGINT, which a background shell ignores) unwind through the `finally`s that
    # stop the Brigade, llama-server and vLLM this benchmark started.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    from services.gpu_worker.loader import prepare_model

    model_dir = prepare_model(None)
    requests = build_requests(args, model_dir, max(num_prompts(args, c) for c in args.concurrency))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="brigade-bench-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "command": " ".join(["python", "benchmarks/serve.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": args.gguf.name if args.gguf else "SmolLM2-135M-Instruct",
        "machine": machine_info(),
        "config": {
            "dataset": args.dataset,
            "output_len": args.output_len,
            "dtype": args.dtype,
            "concurrency": args.concurrency,
            "request_rate": args.request_rate,
            "mean_prompt_len": float(np.mean([len(r.prompt_ids) for r in requests])),
            "brigade_config": args.run or args.config,
            "brigade_overrides": args.set,
        },
    }
    print(
        f"{len(requests)} prompts ({args.dataset}, mean {report['config']['mean_prompt_len']:.0f} tokens), "
        f"logs in {log_dir}",
        flush=True,
    )
    if "brigade" in args.engines:
        report.update(run_brigade(args, requests, log_dir))
    if "hf" in args.engines:
        report["hf"] = run_hf(args, model_dir, requests)
    report["llamacpp"] = (
        run_llamacpp(args, requests, log_dir) if "llamacpp" in args.engines else {"skipped": "not selected"}
    )
    report["vllm"] = (
        run_vllm(args, model_dir, requests, log_dir)
        if "vllm" in args.engines
        else {"skipped": "not selected"}
    )
    if args.gguf is None:  # the targets are SmolLM2's
        report["targets"] = evaluate_targets(report)
        print_targets(report["targets"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    if args.mlflow:
        plot_path = args.plot or log_dir / "serve.png"
        if not args.plot:
            plot(report, plot_path)
        run_id = log_to_mlflow(report, plot_path, args.mlflow, args.mlflow_experiment)
        print(f"MLflow run {run_id} in experiment {args.mlflow_experiment!r} at {args.mlflow}", flush=True)
    return 0


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def log_to_mlflow(report: dict, plot_path: Path, tracking_uri: str, experiment: str) -> str:
    """One MLflow run per benchmark: the command, config and machine as parameters; each
    engine's numbers per concurrency as metrics (the concurrency is the step); the report and the
    plot as artifacts. Returns the MLflow run id."""
    from mlflow import MlflowClient  # the optional extra: pip install '.[mlflow]'
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    run_id = client.create_run(experiment_id, run_name="serve-benchmark").info.run_id
    params = {
        "command": report["command"],
        "model": report["model"],
        **flatten(report["config"], "config."),
        **flatten(report["machine"], "machine."),
    }
    client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())][:100])
    now_ms = int(time.time() * 1000)
    metrics = []
    for engine in ENGINES:
        for concurrency, stats in report.get(engine, {}).get("settings", {}).items():
            for key, value in flatten(stats).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    metrics.append(Metric(f"{engine}.{key}", float(value), now_ms, int(concurrency)))
    for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
        client.log_batch(run_id, metrics=metrics[i : i + 1000])
    client.log_dict(run_id, report, "serve.json")
    client.log_artifact(run_id, str(plot_path))
    client.set_terminated(run_id)
    return run_id


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
