"""Endpoints that are chat completions underneath.

Anthropic's Messages API (`anthropic.py`) and OpenAI's Responses API (`responses.py`) translate
their request into a `ChatCompletionRequest` and run it the way /v1/chat/completions does
(`plan_chat`: sampling, the output constraint, tools; the tool parser; `ChatFormat`), so the
chat template, the tools prompt, the parsing of calls and the forcing of a named tool are the
chat path's own. Their `Translation` then turns the chat reply, whole or chunk by chunk, into
their own JSON and server-sent events. One choice per request (neither API has `n`), and no
Last-Event-ID resumption (neither API has event ids); a sampled request's seed is returned and
taken back in the X-Brigade-Seed header, as for chat.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from client.errors import BrigadeError
from client.sdk import StreamDelta
from services.common.tools_prompt import tool_parser_for
from services.gateway import protocol as p
from services.gateway.app import Feed, Gateway, to_piece
from services.gateway.errors import ApiError, from_engine
from services.gateway.formats import ChatFormat, Piece, TokenNames, usage_out
from services.gateway.jobs import Plan
from services.gateway.metrics import RequestTimer
from services.gateway.timings import RequestTimings

_encoder = msgspec.json.Encoder()


_CHAT_MESSAGE = re.compile(r"^messages\[(\d+)\]")


def at_origin(text: str, origins: Sequence[str]) -> str:
    """A chat-path error's message or param with its leading `messages[i]` named as the field of
    the translated request that chat message came from (`origins[i]`): a system prompt or a tool
    result is a chat message of its own, so the chat path's index is not the request's."""
    match = _CHAT_MESSAGE.match(text)
    if match is None or int(match[1]) >= len(origins):
        return text
    return origins[int(match[1])] + text[match.end() :]


def named_event(name: str, body: object) -> bytes:
    """An SSE event with an `event:` line, as Anthropic and the Responses API send them."""
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode(body) + b"\n\n"


class Translation(Protocol):
    """One request's reply in its API's shapes, from the chat reply."""

    def piece(self, piece: Piece) -> Piece:
        """The engine's output before the chat format reads it (Anthropic cuts stop sequences)."""
        ...

    async def whole(self, completion: p.ChatCompletion) -> bytes: ...

    def opening(self, usage: p.UsageOut | None) -> list[bytes]:
        """The stream's first events, sent once the engine's first output is in; `usage` counts
        the prompt (None only for a request that ended with no output)."""
        ...

    def chunk(self, chunk: p.ChatCompletionChunk) -> list[bytes]:
        """A chat chunk's events; with llama-server's timings_per_token the chunk carries its
        choice's `timings` so far, which an API that has them gives (the Responses API's do)."""
        ...

    async def closing(self, usage: p.UsageOut, timings: p.Timings | None = None) -> list[bytes]:
        """The stream's last events; `timings` the request's (timings_per_token), or None."""
        ...

    def error_body(self, error: ApiError) -> bytes: ...

    def error_event(self, error: ApiError) -> bytes: ...


def chat_format(gateway: Gateway, plan: Plan, model: str) -> ChatFormat:
    names = TokenNames(gateway.tokenizer, False)
    parser = tool_parser_for(plan.tools, gateway.auto_tool_format) if plan.tools is not None else None
    return ChatFormat(
        model,
        names,
        None,
        parser,
        plan.call_id_base,
        reasoning=gateway.reasoning_for(plan),
        prefill=plan.prefill,
    )


class TranslatedWriter:
    """The ReplyWriter (app.py) of a translated request: the chat reply, through `translation`."""

    def __init__(self, plan: Plan, fmt: ChatFormat, translation: Translation, gateway: Gateway,
                 timings_per_token: bool) -> None:  # fmt: skip
        self.plan = plan
        self.fmt = fmt
        self.translation = translation
        self.gateway = gateway
        self.timings_per_token = timings_per_token  # llama-server's field: a stream's timings

    async def whole(self, first: tuple[int, StreamDelta] | None, feed: Feed, timer: RequestTimer) -> bytes:
        completion = await self.gateway.collect(
            first, feed, self.plan, self.fmt, timer, read=self.translation.piece
        )
        assert isinstance(completion, p.ChatCompletion)
        return await self.translation.whole(completion)

    def events(
        self, first: asyncio.Future[tuple[int, StreamDelta] | None], feed: Feed, timer: RequestTimer
    ) -> AsyncGenerator[bytes, None]:
        plan = self.plan
        timings = RequestTimings(timer.arrival, plan.prompt_of) if self.timings_per_token else None
        return stream_events(first, feed, plan, self.fmt, self.translation, timer, timings)

    def error_body(self, error: ApiError) -> bytes:
        return self.translation.error_body(error)

    def error_event(self, error: ApiError) -> bytes:
        return self.translation.error_event(error)


def run_translated(gateway: Gateway, request: Request, plan: Plan, model: str, translation: Translation,
                   stream: bool, timings_per_token: bool = False) -> Response:  # fmt: skip
    """Run `plan` as Gateway.run does chat, with `translation`'s replies; `model` is the name the
    reply gives (Gateway.with_adapter's); `timings_per_token` (llama-server's) times a stream."""
    writer = TranslatedWriter(
        plan, chat_format(gateway, plan, model), translation, gateway, timings_per_token
    )
    return gateway.run(request, plan, stream, writer)


async def stream_events(first: asyncio.Future[tuple[int, StreamDelta] | None], feed: Feed, plan: Plan,
                        fmt: ChatFormat, translation: Translation, timer: RequestTimer,
                        timings: RequestTimings | None) -> AsyncGenerator[bytes, None]:  # fmt: skip
    prompt_of = plan.prompt_of
    # The opening waits for the first output, which carries the prompt's length (Anthropic's
    # message_start counts it); keep-alive comments cover a long wait.
    try:
        item = await first
    except BrigadeError as exc:  # after the keep-alive wait: the 200 is already sent
        yield translation.error_event(from_engine(exc, plan.aliases))
        return
    opening_usage = usage_out({item[0]: item[1].usage}, prompt_of) if item and item[1].usage else None
    for data in translation.opening(opening_usage):
        yield data
    usages = {}
    timer.on_output(item)
    while item is not None:
        index, delta = item
        if delta.usage is not None:
            usages[index] = delta.usage
        if timings is not None:
            timings.add(index, delta, time.monotonic())
        for chunk in fmt.chunks(index, translation.piece(to_piece(delta)), 0):
            if timings is not None:
                chunk.timings = timings.of_choice(index, time.monotonic())
            for data in translation.chunk(chunk):
                yield data
        try:
            item = await anext(feed, None)
        except BrigadeError as exc:
            yield translation.error_event(from_engine(exc, plan.aliases))
            return
        if item is not None:
            timer.on_output(item)
    request_timings = None if timings is None else timings.of_request(time.monotonic())
    for data in await translation.closing(usage_out(usages, prompt_of), request_timings):
        yield data
