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
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Send

from client.errors import BrigadeError
from client.sdk import StreamDelta
from services.common.tools_prompt import tool_parser_for
from services.gateway import protocol as p
from services.gateway.app import CLIENT_CLOSED, JSON, Gateway, send_all, to_piece
from services.gateway.errors import ApiError, from_engine
from services.gateway.formats import ChatFormat, Piece, TokenNames, usage_out
from services.gateway.jobs import SEED_HEADER, Plan
from services.gateway.metrics import RequestTimer
from services.gateway.runner import run_jobs
from services.gateway.sse import SSE_HEADERS, WatchedResponse, settle, wait_first, with_keepalive

_encoder = msgspec.json.Encoder()


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
        """The stream's first events; `usage` counts the prompt when the engine's first output
        came before the stream started (the usual case), else None."""
        ...

    def chunk(self, chunk: p.ChatCompletionChunk) -> list[bytes]: ...

    async def closing(self, usage: p.UsageOut) -> list[bytes]: ...

    def error_body(self, error: ApiError) -> bytes: ...

    def error_event(self, error: ApiError) -> bytes: ...


def chat_format(gateway: Gateway, plan: Plan) -> ChatFormat:
    names = TokenNames(gateway.tokenizer, False)
    parser = tool_parser_for(plan.tools, gateway.auto_tool_format) if plan.tools is not None else None
    return ChatFormat(
        gateway.settings.model, names, None, parser, plan.call_id_base, reasoning=gateway.reasoning
    )


def run_translated(
    gateway: Gateway, request: Request, plan: Plan, translation: Translation, stream: bool
) -> Response:
    """Gateway.generate's admission, metrics and disconnect watch, with `translation`'s replies."""
    client = gateway.admit(request, plan)
    fmt = chat_format(gateway, plan)
    headers = {SEED_HEADER: str(plan.seed)} if plan.seed is not None else {}
    path = request.url.path

    async def work(send: Send) -> None:
        timer = RequestTimer(gateway.metrics)
        feed = run_jobs(gateway.client, plan.jobs)
        first = asyncio.ensure_future(anext(feed, None))
        status = 200
        try:
            try:
                if stream:
                    await wait_first(first, gateway.settings.sse_keepalive_s)
                else:
                    item = await first
                    timer.on_output(item[1].token_ids if item else [])
                    completion = await gateway.collect(item, feed, plan, fmt, timer)
                    assert isinstance(completion, p.ChatCompletion)
                    body = await translation.whole(completion)
                    await send_all(send, Response(body, 200, headers, JSON))
                    timer.on_finish()
                    return
            except BrigadeError as exc:  # nothing sent yet: the error gets its own status
                gateway.on_refused(client, exc)
                error = from_engine(exc, plan.aliases)
                status = error.status
                await send_all(send, Response(translation.error_body(error), status, error.headers, JSON))
                return
            raw_headers = [(k.encode(), v.encode()) for k, v in {**headers, **SSE_HEADERS}.items()]
            await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
            events = stream_events(first, feed, plan, fmt, translation, timer)
            async with aclosing(with_keepalive(events, gateway.settings.sse_keepalive_s)) as chunks:
                async for data in chunks:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            timer.on_finish()
        except (asyncio.CancelledError, OSError):
            status = CLIENT_CLOSED
            raise
        finally:
            await settle(first)
            await feed.aclose()
            gateway.num_in_flight -= 1
            gateway.count(path, status)

    return WatchedResponse(work)


async def stream_events(first: asyncio.Future[tuple[int, StreamDelta] | None],
                        feed: AsyncIterator[tuple[int, StreamDelta]], plan: Plan, fmt: ChatFormat,
                        translation: Translation, timer: RequestTimer) -> AsyncGenerator[bytes, None]:  # fmt: skip
    prompt_of = {job.index: job.prompt_index for job in plan.jobs}
    early = first.result() if first.done() and first.exception() is None else None
    opening_usage = usage_out({early[0]: early[1].usage}, prompt_of) if early and early[1].usage else None
    for data in translation.opening(opening_usage):
        yield data
    usages = {}
    try:
        item = await first
    except BrigadeError as exc:  # after the keep-alive wait: the 200 is already sent
        yield translation.error_event(from_engine(exc, plan.aliases))
        return
    timer.on_output(item[1].token_ids if item else [])
    while item is not None:
        index, delta = item
        if delta.usage is not None:
            usages[index] = delta.usage
        for chunk in fmt.chunks(index, translation.piece(to_piece(delta)), 0):
            for data in translation.chunk(chunk):
                yield data
        try:
            item = await anext(feed, None)
        except BrigadeError as exc:
            yield translation.error_event(from_engine(exc, plan.aliases))
            return
        if item is not None:
            timer.on_output(item[1].token_ids)
    for data in await translation.closing(usage_out(usages, prompt_of)):
        yield data
