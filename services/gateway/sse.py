"""Server-sent events with resumable ids, and a response that notices a client going away.

The `id:` of every event that carries a choice is the absolute position of the output after it:
`tokens.chars` of each choice, comma-separated (docs/architecture.md invariant 2: outputs carry
absolute positions); the usage chunk, an error and `[DONE]` have none. A client that lost the
stream re-POSTs the same body with `Last-Event-ID`; the request runs again (greedy or with the
same seed, so with the same tokens) and `Cursor` passes on only what lies past that position, the
way the tokenizer trims a resubmitted request's deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from services.gateway.errors import invalid
from services.gateway.formats import Piece
from services.gateway.stream_replay import STOP_CHECK_S, Recorder

T = TypeVar("T")
log = logging.getLogger(__name__)

SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}
DONE = b"data: [DONE]\n\n"
# A recorded stream stopped (DELETE /v1/stream, or another stream of its id) before its 200.
STOPPED_BODY = msgspec.json.encode(
    {"error": {"message": "this stream was stopped (DELETE /v1/stream) or replaced by another of its "
               "X-Conversation-Id before it began", "type": "invalid_request_error", "param": None,
               "code": "stream_stopped"}}
)  # fmt: skip
# An SSE comment line: clients skip it, proxies see traffic. No blank line after it: a blank line
# ends an event, and the openai client, once it has seen an `id:`, reads an event of no data
# there and fails to decode it as JSON.
KEEPALIVE = b": keep-alive\n"
_encoder = msgspec.json.Encoder()


def event(body: msgspec.Struct, event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    return head + b"data: " + _encoder.encode(body) + b"\n\n"


class Cursor:
    """Absolute output positions of each choice, and the position a resumed stream starts after."""

    def __init__(self, num_choices: int, last_event_id: str | None) -> None:
        self.positions = [(0, 0)] * num_choices
        self.is_resumed = last_event_id is not None
        self.resume_after = (
            self._parse(last_event_id, num_choices) if last_event_id is not None else [(0, 0)] * num_choices
        )

    @staticmethod
    def _parse(text: str, num_choices: int) -> list[tuple[int, int]]:
        try:
            positions = [tuple(int(x) for x in part.split(".")) for part in text.strip().split(",")]
        except ValueError:
            positions = []
        if len(positions) != num_choices or any(len(x) != 2 or min(x) < 0 for x in positions):
            raise invalid(
                f"Last-Event-ID must be the id of an event of this request ({num_choices} x tokens.chars), "
                f"got {text[:80]!r}",
                "Last-Event-ID",
            )
        return positions  # type: ignore[return-value]

    def advance(self, index: int, piece: Piece) -> Piece | None:
        """The part of `piece` past what the client has; None when there is nothing new."""
        tokens, chars = self.positions[index]
        self.positions[index] = (tokens + len(piece.token_ids), chars + len(piece.text))
        skip_tokens = max(0, self.resume_after[index][0] - tokens)
        skip_chars = max(0, self.resume_after[index][1] - chars)
        if skip_tokens == 0 and skip_chars == 0:
            return piece
        fresh = dataclasses.replace(
            piece,
            text=piece.text[skip_chars:],
            token_ids=piece.token_ids[skip_tokens:],
            logprobs=piece.logprobs[skip_tokens:],
            top_logprobs=piece.top_logprobs[skip_tokens:],
            prompt_ids=None,  # the client had the piece's start, which brought them
            prompt_logprobs=None,
        )
        if not fresh.text and not fresh.token_ids and fresh.finish_reason is None:
            return None
        return fresh

    def resumes_after_output(self, index: int) -> bool:
        """The client had some of choice `index`'s output before it resumed."""
        return self.resume_after[index] != (0, 0)

    def overrun(self) -> str | None:
        """Once the output has ended: what the Last-Event-ID claimed past it (an id of another
        request, or a rerun that did not reproduce the first), or None."""
        past = [
            f"choice {index} ended at {tokens}.{chars}, not after {resume_tokens}.{resume_chars}"
            for index, ((tokens, chars), (resume_tokens, resume_chars)) in enumerate(
                zip(self.positions, self.resume_after, strict=True)
            )
            if tokens < resume_tokens or chars < resume_chars
        ]
        if not past:
            return None
        return "Last-Event-ID lies past this request's output (" + "; ".join(past) + "): nothing to resume"

    def chars(self, index: int) -> int:
        """Characters of choice `index` before the piece just advanced past (for text offsets)."""
        return self.positions[index][1]

    def event_id(self) -> str:
        return ",".join(
            f"{max(t, rt)}.{max(c, rc)}"
            for (t, c), (rt, rc) in zip(self.positions, self.resume_after, strict=True)
        )


async def wait_first(first: asyncio.Future[Any], wait_s: float) -> None:
    """Wait for a feed's first item (`first`, a task) for at most `wait_s`.
    A stream whose first output takes longer starts its 200 response and keep-alives
    (`with_keepalive`) instead of waiting on: an engine error up to then still gets its own HTTP
    status, a later one becomes an error event in the stream."""
    await asyncio.wait({first}, timeout=wait_s)
    if first.done():
        first.result()  # raises the engine's error


async def with_keepalive(events: AsyncGenerator[bytes, None], interval_s: float) -> AsyncIterator[bytes]:
    """`events`, with a comment line (`KEEPALIVE`) whenever `interval_s` pass without one."""
    upcoming = asyncio.ensure_future(anext(events, None))
    try:
        while True:
            done, _ = await asyncio.wait({upcoming}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            data = upcoming.result()
            if data is None:
                return
            yield data
            upcoming = asyncio.ensure_future(anext(events, None))
    finally:
        await settle(upcoming)
        await events.aclose()


async def settle(pending: asyncio.Future[Any]) -> None:
    """Cancel `pending` (if not done) and wait for it, so that the generator it reads can be closed."""
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await pending


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client closed the connection before its reply (`unless_disconnected`)."""


async def unless_disconnected(receive: Receive, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, awaited while watching the connection (its body read already): a
    client that goes away first cancels it, and with it the engine requests it made (the SDK
    aborts the requests of a cancelled call), and ClientGone is raised. A whole reply that takes
    long (the vectors of many inputs) would otherwise be computed for nobody."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Whatever ended the wait (the client gone, or this task cancelled at shutdown), the
        # work is cancelled and waited for, so that its engine requests are aborted now.
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    if watch.done() and not watch.cancelled() and work.cancelled():
        raise ClientGone
    return work.result()


class RecordedResponse(Response):
    """Runs `work(send)` for a stream recorded for replay (stream_replay.py): the Recorder that
    `record()` makes claims the stream's id at once, records the bytes of its 200, and the work
    runs to its end whether or not the client stays (sent what it sends while it is there). It
    stops, its engine requests aborted as a closed stream's, when the stream is deleted or
    replaced, or once nobody can read the rest (its client gone and its recording over)."""

    def __init__(self, work: Callable[[Send], Awaitable[None]], record: Callable[[], Recorder]) -> None:
        self.work = work
        self.record = record
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        recorder = await asyncio.to_thread(self.record)
        gone = asyncio.ensure_future(_disconnected(receive))
        was_streamed = is_complete = False

        async def send_and_record(message: Message) -> None:
            nonlocal was_streamed, is_complete
            if message["type"] == "http.response.start":
                was_streamed = message["status"] == 200
            elif was_streamed:
                recorder.write(message.get("body", b""))
                is_complete = not message.get("more_body", False)
            if not gone.done():
                with contextlib.suppress(OSError):
                    await send(message)

        async def stopped() -> None:
            while not recorder.is_stopped() and not (gone.done() and not recorder.is_recording):
                await asyncio.sleep(STOP_CHECK_S)

        work = asyncio.ensure_future(self.work(send_and_record))
        stop = asyncio.ensure_future(stopped())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            is_connected = not gone.done()
            for task in (work, stop, gone):  # the work cancelled aborts its engine requests
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if work.done() and not work.cancelled() and work.exception() is not None:
                log.error("a recorded stream's request failed", exc_info=work.exception())
            if is_connected and not is_complete:  # stopped: the client is told so, or that its stream ends
                with contextlib.suppress(Exception):
                    if was_streamed:
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    else:
                        await Response(STOPPED_BODY, 409, media_type="application/json")(scope, receive, send)
            recorder.finish(was_streamed=was_streamed, is_interrupted=not is_complete)


class WatchedResponse(Response):
    """Runs `work(send)` (which sends the whole response) while watching the connection: a client
    that goes away, before the reply or during a stream, cancels the work, and with it the
    engine requests (the SDK aborts a stream that is closed)."""

    def __init__(self, work: Callable[[Send], Awaitable[None]]) -> None:
        self.work = work
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(ClientGone, OSError):  # OSError: the socket went while sending
            await unless_disconnected(receive, self.work(send))
