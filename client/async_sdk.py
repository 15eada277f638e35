"""`AsyncClient`: the client SDK for asyncio code, driving the same `Session` as the sync client."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import zmq

from client.errors import BrigadeError, ServerUnavailable
from client.sdk import (
    MAX_EMBEDS_IN_FLIGHT,
    ClientBase,
    EmbedInput,
    EmbedResult,
    GenerateResult,
    HealthCheck,
    Prompt,
    StreamDelta,
    check_seconds,
    collect_result,
    embed_error,
    embed_result,
    make_embeds,
    make_generate,
    seconds_left,
)
from ipc import messages as m


class AsyncClient(ClientBase):
    """Asyncio client of a running Brigade: one DEALER per tokenizer replica and one reader task.

    Cancelling the task that consumes a stream (or closing the stream) aborts the request.

    The sockets are plain zmq sockets whose file descriptors the event loop watches (add_reader):
    zmq.asyncio makes futures and poller registrations for every message, several times the cost
    of the message itself, and a gateway streams every token through here.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wakeups: dict[str, asyncio.Event] = {}
        self._reader: asyncio.Task | None = None
        self._readable: asyncio.Event | None = None  # the reader task's (bound to its loop)
        self._num_polling = 0  # health checks and adapter commands waiting for replies
        # Every request sent from now on continues a call its sender admitted before (a draining
        # gateway's, which admits no new call): a stopping run takes it (m.Generate.continues).
        self.continues_calls = False

    def _send(self, replica: int, frame: bytes) -> bool:
        self._check_open()
        try:
            self._sockets[replica].send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        # A zmq file descriptor signals only changes it has not been asked about: a send can take
        # in a reply without it firing again, so the reader looks for itself.
        if self._readable is not None:
            self._readable.set()
        return True

    def _receive_all(self) -> None:
        """Every message waiting on any socket, into the session (never blocks)."""
        for i, sock in enumerate(self._sockets):
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.session.receive(i, sock.recv_multipart(zmq.NOBLOCK)[0])

    async def _read_forever(self) -> None:
        loop = asyncio.get_running_loop()
        readable = self._readable = asyncio.Event()
        descriptors: list[int] = []
        try:
            while True:
                for sock in self._sockets[len(descriptors) :]:  # all at first, then those add_replicas made
                    descriptors.append(sock.getsockopt(zmq.FD))
                    loop.add_reader(descriptors[-1], readable.set)
                readable.clear()
                self._receive_all()
                self._read_handshakes()
                self.session.tick()
                for request_id, event in self._wakeups.items():
                    state = self.session.requests.get(request_id)
                    if state is None or state.ready or state.is_done:
                        event.set()
                if not self.session.requests and not self._num_polling:
                    # Nothing waits for a reply: the next request starts another reader. A running
                    # reader holds its client, so an idle client dropped without close() was kept
                    # alive, sockets and all, ticking forever.
                    return
                is_unsent = any(s.replica is None and not s.is_done for s in self.session.requests.values())
                # Not sent yet (no replica connected so far): retry soon rather than at the next tick.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.005 if is_unsent else self._tick_s):
                        await readable.wait()
        finally:
            for fd in descriptors:
                loop.remove_reader(fd)

    def add_replicas(self, endpoints: Sequence[str]) -> None:
        super().add_replicas(endpoints)
        if self._readable is not None:
            self._readable.set()  # the reader watches the new sockets from its next turn

    def _ensure_reader(self) -> None:
        self._check_open()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    async def stream(
        self,
        prompt: Prompt | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[StreamDelta]:
        """Yield the output as it comes (use contextlib.aclosing to abort promptly on break)."""
        generate = make_generate(request_id, prompt, messages, sampling)
        async with contextlib.aclosing(self._stream(generate, timeout)) as deltas:
            async for delta in deltas:
                yield delta

    async def _stream(self, generate: m.Generate, timeout: float | None) -> AsyncIterator[StreamDelta]:
        self._ensure_reader()
        if self.continues_calls:
            generate.continues = True
        state = self.session.submit(generate, timeout if timeout is not None else self.timeout)
        wakeup = self._wakeups[state.request_id] = asyncio.Event()
        try:
            while True:
                while state.ready:
                    delta = state.ready.popleft()
                    yield delta
                    if delta.finish_reason is not None:
                        return
                if state.error is not None:
                    raise state.error
                wakeup.clear()
                await wakeup.wait()
        finally:
            self._wakeups.pop(state.request_id, None)
            self._end(state.request_id)

    async def generate(
        self, prompt: Prompt, *, timeout: float | None = None, request_id: str | None = None, **sampling: Any
    ) -> GenerateResult:
        return await self._collect(self.stream(prompt, timeout=timeout, request_id=request_id, **sampling))

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> GenerateResult:
        return await self._collect(
            self.stream(messages=messages, timeout=timeout, request_id=request_id, **sampling)
        )

    def stream_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[StreamDelta]:
        return self.stream(messages=messages, timeout=timeout, request_id=request_id, **sampling)

    async def embed(
        self,
        inputs: EmbedInput,
        *,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
    ) -> EmbedResult:
        """One vector per input (see `Client.embed`), the inputs sent together."""
        timeout = timeout if timeout is not None else self.timeout
        check_seconds("timeout", timeout, optional=True)
        deadline = None if timeout is None else time.monotonic() + timeout  # the whole call's
        requests = make_embeds(inputs, dimensions, truncate_prompt_tokens)
        room = asyncio.Semaphore(MAX_EMBEDS_IN_FLIGHT)  # sent that many at a time (see there)
        refused = False
        num_served = 0

        async def embed_one(request: m.Generate) -> GenerateResult | None:
            nonlocal refused, num_served
            async with room:  # taken in the inputs' order (the semaphore's waiters are FIFO)
                if refused:  # the call fails: what is not sent yet is not (None)
                    return None
                # Past the first window (see there): the run admitted the call.
                request.continues = num_served > 0
                try:
                    result = await self._collect(self._stream(request, seconds_left(deadline)))
                except BrigadeError:
                    refused = True
                    raise
                num_served += 1
                return result

        # The outcome of every input sent (a prefix of them), so that a refusal names the input
        # it is about (embed_error).
        outcomes = [
            o
            for o in await asyncio.gather(*map(embed_one, requests), return_exceptions=True)
            if o is not None
        ]
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, BrigadeError):
                raise outcome
        error = embed_error([o if isinstance(o, BrigadeError) else None for o in outcomes])
        if error is not None:
            raise error
        return embed_result(outcomes)  # type: ignore[arg-type]  # none is an exception here

    @staticmethod
    async def _collect(deltas: AsyncIterator[StreamDelta]) -> GenerateResult:
        async with contextlib.aclosing(deltas):
            return collect_result([delta async for delta in deltas])

    async def health(self, timeout: float = 5.0) -> list[m.HealthReply]:
        """Ask every replica; the replies that came back within `timeout` (ServerUnavailable if none)."""
        check = HealthCheck(self.session, timeout, self._tick_s)
        async with self._polling():
            while (wait := check.next_wait()) is not None:
                await asyncio.sleep(wait)
        return check.replies()

    @contextlib.asynccontextmanager
    async def _polling(self) -> AsyncIterator[None]:
        """Keeps the reader running while the caller polls the session for replies."""
        self._num_polling += 1
        try:
            self._ensure_reader()
            yield
        finally:
            self._num_polling -= 1

    async def adapter_command(
        self,
        op: str,
        name: str = "",
        path: str = "",
        *,
        wait: bool = True,
        inplace: bool = False,
        timeout: float = 300.0,
    ) -> m.AdapterReply:
        """Load, unload or list LoRA adapters (docs/lora.md "Loading at run time"): the engine's
        answer, whose `code` is "" when done; ServerUnavailable when none comes within `timeout`.
        `inplace` loads over an adapter of that name that no request uses."""
        command = m.AdapterCommand(uuid.uuid4().hex, op, name, path, wait, inplace)  # type: ignore[arg-type]
        deadline = time.monotonic() + timeout
        is_sent = False
        try:
            async with self._polling():
                while time.monotonic() < deadline:
                    is_sent = is_sent or self.session.send_adapter_command(command)
                    reply = self.session.adapter_replies.pop(command.request_id, None)
                    if reply is not None:
                        return reply
                    await asyncio.sleep(0.005 if not is_sent else 0.02)
        finally:
            self.session.adapter_replies.pop(command.request_id, None)
        raise ServerUnavailable(f"no answer to the LoRA adapter command ({op}) within {timeout:.0f}s")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._close()
        for wakeup in self._wakeups.values():  # streams still read find their ClientClosed
            wakeup.set()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
