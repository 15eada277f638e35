"""The peers Brigade is compared with: HF transformers `generate` on static batches (in process) and
llama.cpp's `llama-server` (a child process, driven over HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.datasets import BenchRequest

LLAMA_START_TIMEOUT_S = 120.0


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
    cache = Path(os.environ.get("BRIGADE_CACHE", Path.home() / ".cache" / "brigade"))
    built = cache / "llama.cpp" / "build" / "bin" / "llama-server"
    return built if built.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(
    binary: Path, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log_path: Path
) -> Iterator[int]:
    """Run `llama-server` with `slots` parallel slots on 127.0.0.1; yields its port; kills it after."""
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
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + LLAMA_START_TIMEOUT_S
        while not _is_healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start (exit {proc.poll()}); see {log_path}")
            time.sleep(0.2)
        yield port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _is_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


async def _post_events(
    port: int, path: str, body: dict, peer: str, overloaded_status: int
) -> AsyncIterator[dict]:
    """POST a streamed JSON request over one HTTP/1.1 connection; yield its SSE events' JSON until
    `data: [DONE]` or the end. `overloaded_status` (the peer's "no free slot") is PeerOverloaded."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
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
        async for event in events:
            if event.get("stop"):
                return
            # One event per sampled token (newer servers also list them under "tokens").
            yield len(event.get("tokens") or [None])


async def openai_stream(port: int, request: BenchRequest, model: str = "") -> AsyncIterator[int]:
    """POST /v1/completions to an OpenAI-compatible server (Brigade's gateway), streamed, greedy,
    ignore_eos; yields the number of tokens of each event (counted from its logprobs entries)."""
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
    async with contextlib.aclosing(_post_events(port, "/v1/completions", body, "gateway", 429)) as events:
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
