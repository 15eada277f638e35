"""The OpenAI-compatible HTTP API of one gateway replica (a Starlette app).

Each generation request becomes one Brigade request per choice, sent through the asyncio SDK
(`services/gateway/runner.py`); replies are OpenAI's JSON or server-sent events. A request that
the engine refuses before its first output gets its HTTP error status; a stream that fails later
ends with an error event.

The event loop serves every connection of the replica, so it runs no request's heavy CPU work:
/tokenize and /detokenize render and encode on a worker thread, under the tokenizer's budgets
(characters, messages, template time), and a body is measured for nesting before it is decoded.
A chat's http(s) images, where /tokenize needs their sizes, are fetched on the replica's own
small pool, side by side, under one deadline that the loop holds.
A chat is held to the tokenizer's budgets here too, before any work per message: its messages
are counted on the raw body before the nesting check and the full decode (102,400 messages cost
those about 65 ms of the loop), and its characters, tool-call arguments included, before it is
forwarded to the tokenizer.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import importlib.metadata
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.types import Send

from client.async_sdk import AsyncClient
from client.errors import BrigadeError, InvalidRequest
from client.sdk import EmbedResult, StreamDelta, chat_message, tools_text
from ipc import messages as m
from ipc.json_depth import check_json_depth
from ipc.structured_output import tool_functions
from ipc.validation import (
    InvalidParams,
    PromptTooLong,
    check_chat_budget,
    check_chat_messages,
    check_continuable,
    check_message_count,
    check_prompt_chars,
)
from services.audit import ApiKeyFailures
from services.common.harmony import speaks_harmony
from services.common.image_fetch import FETCH_THREADS, NOT_FETCHED, RemoteImages, fetch_outcome, is_remote
from services.common.images import ImageError, ImageRules, decode_data_url, image_size
from services.common.text import ReservedTemplateKwargs, TemplateTimeout, Tokenizer
from services.common.tools_prompt import (
    auto_tool_format,
    template_messages,
    template_renders_tools,
    tool_parser_for,
)
from services.gateway import protocol as p
from services.gateway.access_log import AccessLog, AccessRecord, access_record, key_id
from services.gateway.beam_search import beam_search_feed
from services.gateway.connection import client_cert_name
from services.gateway.errors import RETRY_AFTER_S, ApiError, from_decode_error, from_engine, invalid
from services.gateway.formats import ChatFormat, ChoiceOutput, CompletionFormat, Piece, TokenNames, usage_out
from services.gateway.jobs import SEED_HEADER, Plan, header_seed, plan_chat, plan_completion, sdk_message
from services.gateway.metrics import RequestTimer
from services.gateway.reasoning import ReasoningStyle, reasoning_style
from services.gateway.refusal_limits import SMALL_BODY_BYTES, RecentRefusals, is_costly_refusal
from services.gateway.runner import run_jobs
from services.gateway.sse import (
    DONE,
    SSE_HEADERS,
    ClientGone,
    Cursor,
    RecordedResponse,
    WatchedResponse,
    event,
    settle,
    unless_disconnected,
    wait_first,
    with_keepalive,
)
from services.gateway.stream_replay import (
    CONVERSATION_HEADER,
    MAX_BYTES,
    MAX_ID_CHARS,
    StreamReplay,
)
from services.gateway.timings import PromptReports, RequestTimings, progress_out
from services.metrics import ChoicesMetrics, HttpMetrics, registry_for_run, scrape_page
from services.stage import STREAMS_DIR
from services.stage_rows import read_status

JSON = "application/json"
ADAPTER_LIST_TIMEOUT_S = 5.0  # how long a model list waits for the engine's adapters
DRAIN_FACTOR = 4  # bodies up to this many times the limit are read to their end before the 413
CLIENT_CLOSED = 499  # the status nginx logs for a client that went away before the reply

log = logging.getLogger(__name__)


def installed_version() -> str:
    """Brigade's package version, or "unknown" where it runs from a source tree never installed."""
    try:
        return importlib.metadata.version("brigade")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


BRIGADE_VERSION = installed_version()


@dataclass
class GatewaySettings:
    model: str  # the served model name
    max_model_len: int
    api_keys: frozenset[str]
    max_concurrent_requests: int
    max_body_bytes: int
    run_dir: Path
    key_failures: ApiKeyFailures  # refused API keys are audited, aggregated (services/audit.py)
    # The tokenizer's per-request budgets (tokenizer.*), which /tokenize keeps too.
    max_prompt_chars: int
    max_messages: int
    template_timeout_s: float
    body_timeout_s: float  # the whole body must arrive within this (gateway.body_timeout_s)
    responses_max_stored: int = 1000  # gateway.responses_max_stored (services/gateway/response_store.py)
    responses_max_age_s: float = 7 * 86400.0
    sse_keepalive_s: float = 15.0  # gateway.sse_keepalive_s: a waiting stream's comment-line interval
    reasoning_parser: str = "auto"  # gateway.reasoning_parser (services/gateway/reasoning.py)
    # structured.max_costly_compiles, structured.costly_compile_window_s and
    # gateway.max_oversized_requests, gateway.oversized_window_s (refusal_limits.py)
    max_costly_compiles: int = 4
    costly_compile_window_s: float = 60.0
    max_oversized_requests: int = 4
    oversized_window_s: float = 60.0
    adapters: tuple[str, ...] = ()  # lora.adapters' names: each is a model name too (docs/lora.md)
    access_log: AccessLog | None = None  # gateway.access_log (services/gateway/access_log.py)
    cors_origins: tuple[str, ...] = ()  # gateway.cors_origins: browser pages that may call the API
    max_loras: int = 0  # lora.max_loras: 0 = adapters off, none can be loaded at run time
    accept_priority: bool = False  # gateway.accept_priority: clients may set vLLM's priority
    # How long a LoRA adapter command may take: an unload waits up to lora.unload_wait_s for its
    # requests, and the tokenizer gives the engine groups a margin beyond that.
    adapter_command_timeout_s: float = 300.0
    # encoder.max_image_bytes: /tokenize decodes a data URL image within the tokenizer stage's limit.
    max_image_bytes: int = 10 << 20
    # encoder.max_image_pixels: /tokenize sizes an image from its header, refused over this limit.
    max_image_pixels: int = 40_000_000
    # tokenizer.default_max_tokens (hot-reloadable: a Reconfigure updates it): how far a chat's beam
    # search without max_tokens goes, as far as the tokenizer lets a sampled chat reply go.
    default_max_tokens: int = 256


def json_response(
    body: msgspec.Struct | dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type=JSON)


def conversation_of(request: Request) -> str | None:
    """llama-server's X-Conversation-Id, as UTF-8 (HTTP hands headers over as Latin-1); none if
    absent or empty (llama-server records no stream for an empty one)."""
    value = request.headers.get(CONVERSATION_HEADER)
    if not value:
        return None
    with contextlib.suppress(UnicodeError):
        value = value.encode("latin-1").decode("utf-8")
    return checked_conversation_id(value, "X-Conversation-Id")


def conversation_param(request: Request) -> str:
    """The `conv_id` of `/v1/stream`: the X-Conversation-Id its stream was posted with."""
    conversation_id = request.query_params.get("conv_id", "")
    if not conversation_id:
        raise invalid("conv_id is required: the stream's X-Conversation-Id", "conv_id")
    return checked_conversation_id(conversation_id, "conv_id")


def checked_conversation_id(value: str, field: str) -> str:
    if len(value) > MAX_ID_CHARS:
        raise invalid(f"{field} must have at most {MAX_ID_CHARS} characters", field)
    return value


def error_response(error: ApiError) -> Response:
    return Response(error.body(), error.status, error.headers, media_type=JSON)


def to_piece(delta: StreamDelta) -> Piece:
    return Piece(
        delta.text,
        delta.token_ids,
        delta.logprobs or [],
        delta.top_logprobs or [],
        delta.finish_reason,
        delta.tools,
        delta.prompt_logprobs,
        delta.prompt_token_ids,
    )


ADAPTER_ERROR_STATUS = {"invalid_request": 400, "model_not_found": 404, "adapter_in_use": 409}


def adapter_error(reply: m.AdapterReply, param: str | None) -> ApiError:
    """The engine refused a LoRA adapter command: 400 (a bad adapter or name), 404 (not loaded),
    409 (in use), else 503 (the engine could not do it now)."""
    status = ADAPTER_ERROR_STATUS.get(reply.code, 503)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return ApiError(
        status, reply.message, param=param if status == 400 else None, code=reply.code, headers=headers
    )


def engine_group_ready(run_dir: Path) -> bool:
    """An engine group can serve: its scheduler and every one of its workers are running."""
    try:
        rows = read_status(run_dir)
    except (OSError, msgspec.DecodeError):
        return False
    groups: dict[int, bool] = {}
    for row in rows:
        if row.kind in ("scheduler", "gpu_worker"):
            groups[row.engine] = groups.get(row.engine, True) and row.state == "running"
    return any(groups.values())


class _MessageList(msgspec.Struct):
    """Only a body's `messages`, each left undecoded: a cheap count (one scan, no objects built)."""

    messages: list[msgspec.Raw] | None = None


@dataclass
class ChatToRender:
    """A chat to render as a generation prompt: the tools offered (None under tool_choice none)
    and the template's variables (chat_template_kwargs)."""

    messages: list[p.ChatMessageIn]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None


def chat_to_render(body: p.ChatCompletionRequest) -> ChatToRender:
    """A chat completion request's prompt, as plan_chat sends it to the tokenizer stage."""
    effort = {"reasoning_effort": body.reasoning_effort} if body.reasoning_effort is not None else {}
    template_kwargs = {**effort, **(body.chat_template_kwargs or {})} or None
    tools = body.tools if body.tool_choice != "none" else None
    return ChatToRender(
        body.messages, body.add_generation_prompt, body.continue_final_message, tools, template_kwargs
    )


@dataclass
class RenderedChat:
    """A /tokenize chat rendered by its template, before its images' tokens: their files where
    their sizes count (b"" for an http(s) image until it is fetched), and the http(s) ones to
    fetch, by their index among the chat's images, in prompt order."""

    text: str
    num_images: int
    files: list[bytes]
    urls: dict[int, str]


@contextmanager
def budget_errors(field: str) -> Iterator[None]:
    """The tokenizer's budget refusals, as /tokenize's 400s naming `field`."""
    try:
        yield
    except PromptTooLong as exc:
        raise invalid(str(exc), field, "context_length_exceeded") from None
    except InvalidParams as exc:
        raise invalid(str(exc), field) from None


class OversizedRequest(Exception):
    """A request refused for its size (`error`), which its client's oversized count records."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(str(error))
        self.error = error


class Gateway:
    """Routes, auth, body limits and the per-replica concurrency bound around one AsyncClient."""

    def __init__(
        self,
        settings: GatewaySettings,
        client: AsyncClient,
        tokenizer: Tokenizer,
        metrics: HttpMetrics | None = None,
        image_rules: ImageRules | None = None,
        remote_images: RemoteImages | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.tokenizer = tokenizer
        self.image_rules = image_rules  # a vision-language model's: /tokenize counts image tokens
        self.remote_images = remote_images  # what http(s) image URLs /tokenize fetches; None: none
        # /tokenize's fetches, off the default pool that renders and encodes; as many threads as a
        # tokenizer replica's, so what a request fetches in time there, it fetches in time here.
        self.image_pool = (
            ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="tokenize-image-fetch")
            if remote_images is not None and image_rules is not None and image_rules.needs_sizes
            else None
        )
        # The process's registry (one replica a process); a second Gateway in one process (a test
        # beside the run's replicas) brings its own, since metric names register once.
        self.metrics = metrics or HttpMetrics()
        self.choices_metrics = ChoicesMetrics(
            settings.model, max_model_len=settings.max_model_len, registry=self.metrics.registry
        )
        self.num_in_flight = 0
        # The run is stopping (the supervisor's Shutdown): new calls are refused, those in flight
        # finish, and num_in_flight, which the drain waits on, counts only them.
        self.is_draining = False
        self.cleanups: set[asyncio.Future[None]] = set()  # requests' feeds closing (Gateway.run)
        self.streams = StreamReplay(settings.run_dir / STREAMS_DIR)  # llama-server's resumable streams
        self.costly_constraints = RecentRefusals(
            settings.max_costly_compiles, settings.costly_compile_window_s
        )
        self.oversized = RecentRefusals(settings.max_oversized_requests, settings.oversized_window_s)
        self.num_responses = 0  # the heartbeat's progress counter
        # The LoRA adapters served, as the engine last said (each of its adapter replies lists
        # them): a model name not in it is looked up again before it is a 404, since another
        # replica may have loaded it.
        self.adapters: list[str] = list(settings.adapters)
        # refresh_adapters' question to the engine, and when it went out (None: not yet)
        self._adapter_listing: asyncio.Future[None] | None = None
        self._adapter_asked_at: float | None = None
        self.started = int(time.time())
        has_token = lambda tag: len(tokenizer.encode(tag)) == 1  # noqa: E731
        is_harmony = speaks_harmony(
            settings.reasoning_parser, tokenizer.architectures, tokenizer.chat_template, has_token
        )
        # The tokenizer decides these alike (services/tokenizer/core.py).
        self.is_harmony = is_harmony
        self.auto_tool_format = "harmony" if is_harmony else auto_tool_format(tokenizer.chat_template)
        self.renders_tools = tokenizer.chat_template is not None and template_renders_tools(
            tokenizer.chat_template
        )
        self.reasoning = reasoning_style(
            settings.reasoning_parser,
            lambda: tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], add_generation_prompt=True
            ),
            has_token,
            is_harmony,
        )

    def reasoning_for(self, plan: Plan) -> ReasoningStyle | None:
        """How to read a chat's output for reasoning. A constrained output (a schema, a regex, a
        forced call) is the grammar's from its first token, so it does not start inside the think
        block a deepseek_r1 template opens: read that way, a JSON reply or a forced call was all
        `reasoning_content` (content null, a stream's calls lost). It is content until a
        `<think>` it writes itself, as qwen3's reading has it."""
        if self.reasoning == "deepseek_r1" and is_constrained(plan):
            return "qwen3"
        return self.reasoning

    # -- plumbing ----------------------------------------------------------------------------

    @staticmethod
    def http_error(request: Request, exc: HTTPException) -> ApiError:
        """The router's refusal (no route, a method the route does not take: its Allow header)."""
        if exc.status_code == 404:
            return ApiError(404, f"no route {request.url.path}", code="not_found")
        code = "method_not_allowed" if exc.status_code == 405 else None
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code,
                        headers=dict(exc.headers or {}))  # fmt: skip

    async def on_api_error(self, request: Request, exc: ApiError) -> Response:
        return self.finish(request, error_response(exc))

    async def on_crash(self, request: Request, exc: Exception) -> Response:
        return self.finish(
            request, error_response(internal_error(f"{request.method} {request.url.path}", exc))
        )

    def finish(self, request: Request, response: Response) -> Response:
        self.count(request.url.path, response.status_code)
        return response

    def count(self, path: str, status: int) -> None:
        self.num_responses += 1
        self.metrics.on_response(path, status)

    def check_key(self, request: Request) -> None:
        if not self.settings.api_keys:
            return
        given = given_keys(request)
        key = next((k for k in given if k in self.settings.api_keys), None)
        record = access_record(request.scope)
        if key is not None and record is not None and record.caller is None:
            record.caller = f"key:{key_id(key)}"  # a certificate subject, where there is one, names it
        if key is None:
            peer = request.client.host if request.client else "unknown"
            reason = "unknown API key" if given else "no Authorization: Bearer or x-api-key header"
            self.settings.key_failures.record(peer, reason, given[0] if given else None)
            raise ApiError(
                401,
                "missing or invalid API key (send Authorization: Bearer KEY or x-api-key: KEY)",
                code="invalid_api_key",
            )

    async def read_body(self, request: Request, kind: type[msgspec.Struct]) -> Any:
        """The body decoded as `kind`, from a caller with a key, within the size and time limits."""
        return await self._admitted_read(request, lambda: self._read_body(request, kind))

    async def read_raw(self, request: Request) -> bytes:
        """The body's bytes, as read_body reads them, not decoded."""
        return await self._admitted_read(request, lambda: self.read_bytes(request))

    async def _admitted_read(self, request: Request, read: Callable[[], Awaitable[Any]]) -> Any:
        self.check_key(request)
        client = self.client_of(request)
        self.check_oversized(request, client)
        try:
            return await read()
        except OversizedRequest as exc:
            self.oversized.record(client)
            raise exc.error from None

    def check_oversized(self, request: Request, client: str) -> None:
        """A client past gateway.max_oversized_requests gets 429 for a large body (or one of
        unknown length) before the body is read; the connection is closed, so what it is still
        sending costs nothing more than the kernel's discarding it."""
        wait_s = self.oversized.retry_after_s(client)
        length = request.headers.get("content-length", "")
        if not wait_s or (length.isdigit() and int(length) <= SMALL_BODY_BYTES):
            return
        raise ApiError(
            429,
            f"{self.settings.max_oversized_requests} of this client's requests were refused for their "
            f"size within {self.settings.oversized_window_s:g}s (gateway.max_oversized_requests); its "
            f"requests over {SMALL_BODY_BYTES} bytes, or of unknown length (chunked), are refused for {wait_s}s",
            code="too_many_requests",
            headers={"Retry-After": str(wait_s), "connection": "close"},
        )

    async def read_bytes(self, request: Request) -> bytes:
        """The request's body, within gateway.max_body_bytes and gateway.body_timeout_s."""
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > DRAIN_FACTOR * limit:
            raise OversizedRequest(
                ApiError(
                    413,
                    f"request body of {int(length)} bytes exceeds the limit of {limit}",
                    code="request_too_large",
                )
            )
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > DRAIN_FACTOR * limit:
                        break
                    if size <= limit:
                        chunks.append(chunk)
        except TimeoutError:  # a client trickling its body (slowloris) holds the connection no longer
            raise ApiError(
                408,
                f"request body not received within {self.settings.body_timeout_s:g}s (gateway.body_timeout_s)",
                code="request_timeout",
                headers={"connection": "close"},
            ) from None
        except ClientDisconnect:  # gone before its body was whole: nobody reads a reply, no bug to log
            raise ApiError(
                CLIENT_CLOSED, "the client closed the connection before its body was whole"
            ) from None
        if size > limit:
            # A body somewhat over the limit is read to its end first, so that the client, still
            # sending, reads the 413 instead of a reset connection; a far larger one is cut off.
            raise OversizedRequest(
                ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            )
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # Read first, so that the connection stays usable; decompressing is not offered (a
            # small compressed body can expand past every limit before it is checked).
            raise ApiError(
                415,
                f"request bodies with Content-Encoding {encoding[:40]!r} are not supported: send it uncompressed",
                code="unsupported_media_type",
            )
        return b"".join(chunks)

    async def _read_body(self, request: Request, kind: type[msgspec.Struct]) -> Any:
        data = as_utf8(await self.read_bytes(request))
        # Every message is an object: a body with no more "{" than the limit needs no count.
        if "messages" in kind.__struct_fields__ and data.count(b"{") > self.settings.max_messages:
            self.check_message_count(data)
        try:
            check_json_depth(data, "request body")  # the decoder and all after it recurse per level
        except InvalidParams as exc:
            raise OversizedRequest(invalid(str(exc), None, "invalid_json")) from None
        try:
            body = msgspec.json.decode(data, type=kind)
        except msgspec.ValidationError as exc:
            try:
                body = p.nulls_as_defaults(data, kind)
            except (msgspec.DecodeError, msgspec.ValidationError) as again:
                raise from_decode_error(again, data) from None
            if body is None:
                raise from_decode_error(exc, data) from None
        except msgspec.DecodeError as exc:
            raise from_decode_error(exc, data) from None
        await self.check_model(getattr(body, "model", ""), getattr(kind, "takes_adapter", False))
        if isinstance(body, p.ChatCompletionRequest):
            self.check_chat_budget(body)
        return body

    def check_message_count(self, data: bytes) -> None:
        """Refuse a body with more messages than tokenizer.max_messages before it is measured for
        nesting and decoded, both linear in its messages. A body this cannot read (not JSON, too
        deep, messages not a list) passes: the full decode then says what is wrong with it."""
        try:
            messages = msgspec.json.decode(data, type=_MessageList).messages
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return
        try:
            check_message_count(len(messages or ()), self.settings.max_messages)
        except InvalidParams as exc:
            raise OversizedRequest(invalid(str(exc), "messages")) from None

    def check_translated_chat(self, request: Request, num_messages: int, field: str) -> None:
        """A chat built from another API's body (Responses' input items) with more messages than
        tokenizer.max_messages: refused here, and counted against its client as a body too large
        (gateway.max_oversized_requests), rather than after all the work of building its request."""
        try:
            check_message_count(num_messages, self.settings.max_messages)
        except InvalidParams as exc:
            self.oversized.record(self.client_of(request))
            raise invalid(str(exc), field) from None

    def check_chat_budget(self, body: p.ChatCompletionRequest) -> None:
        """A chat over the tokenizer's budget (tokenizer.max_prompt_chars, all the text that
        reaches the template) is refused here, with the tokenizer's own check and message, before
        any work on its text (planning it hashes the whole body) and rather than copied to the
        tokenizer to be refused there."""
        try:
            check_chat_budget(
                [chat_message(i, sdk_message(i, message)) for i, message in enumerate(body.messages)],
                tools_text(body.tools) if body.tools is not None else "",
                max_chars=self.settings.max_prompt_chars,
                max_messages=self.settings.max_messages,
            )
        except PromptTooLong as exc:
            raise OversizedRequest(invalid(str(exc), "messages", "context_length_exceeded")) from None
        except InvalidParams as exc:
            raise OversizedRequest(invalid(str(exc), "messages")) from None
        except InvalidRequest as exc:  # a message the SDK would refuse: the same reply as from it
            raise from_engine(exc, {"prompt": "messages"}) from None

    def model_not_found(self, model: str) -> ApiError:
        served = [self.settings.model, *self.adapters]
        return ApiError(404, f"the model {model!r} does not exist; this server serves {', '.join(map(repr, served))}",
                        param="model", code="model_not_found")  # fmt: skip

    async def check_model(self, model: str, takes_adapter: bool) -> None:
        """A request's model name ("" = the base model): the base model's, or a LoRA adapter's
        where the request generates (`takes_adapter`: a ClassVar of its body's type); else 404
        naming the served ones, or 400 for an adapter's name on an endpoint without adapters. A
        name not known yet is looked up in the engine first (another replica may have loaded it)."""
        if model and model != self.settings.model and model not in self.adapters:
            await self.refresh_adapters()
        if model in self.adapters and not takes_adapter:
            raise ApiError(400, f"the LoRA adapter {model!r} does not serve this endpoint; "
                           f"here, name the base model {self.settings.model!r}", param="model",
                           code="adapter_not_supported")  # fmt: skip
        if model and model != self.settings.model and model not in self.adapters:
            raise self.model_not_found(model)

    def with_adapter(self, model: str, plan: Plan) -> str:
        """The model name the reply gives, for a request naming `model` (checked: check_model):
        the LoRA adapter's name, which every job of `plan` then generates with, or the base
        model's. Every generating endpoint selects its adapter here. Not looked up again: an
        adapter unloaded since the check is refused by the scheduler, never run as the base."""
        if not model or model == self.settings.model:
            return self.settings.model
        for job in plan.jobs:
            job.sampling["adapter"] = model
        return model

    # -- generation --------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await self.read_body(request, p.ChatCompletionRequest)
        self.check_priority(body)
        plan = plan_chat(body, header_seed(request.headers.get(SEED_HEADER)))
        if plan.beam is not None and self.is_harmony:
            # A harmony reply is read from its channel tokens, which a sampled chat keeps and ends
            # at <|return|> or <|call|> (the tokenizer's own settings for it); beams are decoded here.
            raise invalid("use_beam_search is not supported for a harmony (gpt-oss) chat", "use_beam_search")
        model = self.with_adapter(body.model, plan)
        names = TokenNames(self.tokenizer, body.return_tokens_as_token_ids)
        parser = tool_parser_for(plan.tools, self.auto_tool_format) if plan.tools is not None else None
        fmt = ChatFormat(
            model, names, plan.logprobs, parser, plan.call_id_base,
            prompt_top_n=plan.prompt_logprobs, reasoning=self.reasoning_for(plan), prefill=plan.prefill,
            return_token_ids=body.return_token_ids, include_reasoning=body.include_reasoning,
        )  # fmt: skip
        return self.run(request, plan, body.stream, self.openai_writer(request, body, plan, fmt))

    async def completions(self, request: Request) -> Response:
        body = await self.read_body(request, p.CompletionRequest)
        self.check_priority(body)
        plan = plan_completion(body, header_seed(request.headers.get(SEED_HEADER)))
        model = self.with_adapter(body.model, plan)
        names = TokenNames(self.tokenizer, body.return_tokens_as_token_ids)
        echo_prompts = (
            {job.index: job.prompt for job in plan.jobs if job.prompt is not None} if plan.echo else None
        )
        fmt = CompletionFormat(
            model, names, plan.logprobs, echo_prompts, plan.prompt_logprobs, plan.is_prompt_only,
            return_token_ids=body.return_token_ids,
        )  # fmt: skip
        return self.run(request, plan, body.stream, self.openai_writer(request, body, plan, fmt))

    def check_priority(self, body: p.SamplingFields) -> None:
        """vLLM's priority only where the operator lets clients reorder each other's requests."""
        if body.priority and not self.settings.accept_priority:
            raise invalid(
                "priority scheduling is not enabled on this server (gateway.accept_priority)", "priority"
            )

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's /v1/embeddings: one vector per input, the inputs run together (client.embed)."""
        body = await self.read_body(request, p.EmbeddingRequest)
        if not body.add_special_tokens:
            # The engine tokenizes each text with its special tokens (CLS/SEP, BOS) and pools
            # over them: ignoring false answered a vector other than the one asked for.
            raise invalid(
                "add_special_tokens: false is not supported: a text is embedded with its special tokens",
                "add_special_tokens",
            )
        inputs = embedding_inputs(body.input)
        try:
            result = await self.embed(request, inputs, body.dimensions, body.truncate_prompt_tokens)
        except ApiError as error:
            # What a 400 here can be about: one input of several, the vector size, else the input.
            if error.status == 400:
                named = EMBEDDING_INPUT_NAMED.match(error.message)
                if named and len(inputs) > 1:
                    error.param = named[0]
                else:
                    error.param = next(
                        (
                            field
                            for field in ("dimensions", "truncate_prompt_tokens")
                            if field in error.message
                        ),
                        "input",
                    )
            raise
        data = [
            p.EmbeddingData(i, base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                            else v.tolist())
            for i, v in enumerate(result.embeddings)
        ]  # fmt: skip
        usage = p.EmbeddingUsage(result.prompt_tokens, result.prompt_tokens)
        return self.finish(request, json_response(p.EmbeddingResponse(data, self.settings.model, usage)))

    async def embed(
        self,
        request: Request,
        inputs: list[str] | list[list[int]],
        dimensions: int | None,
        truncate_prompt_tokens: int | None,
    ) -> EmbedResult:
        """The inputs' vectors (client.embed), counted in flight (429 at the replica's limit); the
        SDK's and the engine's refusals as ApiErrors without a param (the caller names it). A
        client that goes away first aborts the inputs still in the engine (a 499 for nobody)."""
        self.check_room()
        self.num_in_flight += 1
        try:
            return await unless_disconnected(
                request.receive,
                self.client.embed(
                    inputs, dimensions=dimensions, truncate_prompt_tokens=truncate_prompt_tokens
                ),
            )
        except ClientGone:
            raise ApiError(CLIENT_CLOSED, "the client closed the connection before its reply") from None
        except BrigadeError as exc:  # the SDK's checks (InvalidRequest) and the engine's refusals
            raise (
                from_engine(exc, {}) if not isinstance(exc, InvalidRequest) else invalid(str(exc), None)
            ) from None
        finally:
            self.num_in_flight -= 1

    def openai_writer(
        self, request: Request, body: p.SamplingFields, plan: Plan, fmt: ChatFormat | CompletionFormat
    ) -> OpenAIWriter:
        cursor = Cursor(len(plan.jobs), request.headers.get("last-event-id") if body.stream else None)
        if (
            cursor.is_resumed
            and plan.seed is not None
            and body.seed is None
            and SEED_HEADER not in request.headers
        ):
            # A new seed samples other tokens, and the client would be sent their tail.
            raise invalid(
                "a sampled stream resumes only with the seed it was sampled with: send back the "
                f"{SEED_HEADER} header of its first response (or give the body a seed)",
                "X-Brigade-Seed",
            )
        return OpenAIWriter(
            self, plan, fmt, cursor, body.stream_options or p.StreamOptions(), body.timings_per_token
        )

    def admit(self, request: Request, plan: Plan) -> str:
        """Refuse a request (429) when this replica is at its concurrency limit, or when it is
        constrained and its client is past its costly compiles; else count it in flight.
        Returns the client, for `on_refused`."""
        self.check_room()
        client = self.client_of(request)
        if is_constrained(plan):
            wait_s = self.costly_constraints.retry_after_s(client)
            if wait_s:
                raise ApiError(
                    429,
                    f"{self.settings.max_costly_compiles} of this client's constraints were refused as "
                    f"too costly to compile within {self.settings.costly_compile_window_s:g}s "
                    f"(structured.max_costly_compiles); constrained requests are refused for {wait_s}s",
                    code="too_many_requests",
                    headers={"Retry-After": str(wait_s)},
                )
        self.num_in_flight += 1  # here, not in work(): requests arriving together all see it
        return client

    def drain(self) -> None:
        """The run is stopping: refuse new calls, and let those admitted finish, every request
        they still send taken by the stopping tokenizers (the supervisor shuts those down once
        every gateway drains, so a call's first request sent before is taken as new)."""
        self.is_draining = True
        self.client.continues_calls = True

    def check_room(self) -> None:
        """Refuse a new call while the run stops (503, as a stopping tokenizer refuses one), or at
        this replica's concurrency limit (429)."""
        if self.is_draining:
            raise ApiError(503, "server is shutting down", code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        if self.num_in_flight >= self.settings.max_concurrent_requests:
            raise ApiError(
                429,
                f"this replica is serving {self.num_in_flight} requests, its limit; retry after {RETRY_AFTER_S}s",
                code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def client_of(self, request: Request) -> str:
        """Who sent a request, for per-client budgets: its client certificate's subject under
        mTLS, else its API key where the run has keys (the key was checked already), else its
        address."""
        subject = client_cert_name(request.scope)
        if subject:
            return "cert:" + subject
        if self.settings.api_keys:
            return "key:" + next((k for k in given_keys(request) if k in self.settings.api_keys), "")
        return "peer:" + (request.client.host if request.client else "unknown")

    def on_refused(self, client: str, exc: BrigadeError) -> None:
        """The engine refused a request of `client` before its first output."""
        if is_costly_refusal(str(exc)):
            self.costly_constraints.record(client)

    def run(self, request: Request, plan: Plan, stream: bool, writer: ReplyWriter) -> Response:
        """Run `plan` and answer with `writer`'s replies: admission (`admit`), metrics, keep-alive,
        and the disconnect watch that cancels the engine requests. An engine error before anything
        is sent gets its own status; a bug becomes a logged 500 (or, after a stream's 200, a logged
        error event that ends the stream), never a dropped connection. A stream with
        X-Conversation-Id is recorded for replay and outlives its connection (stream_replay.py)."""
        conversation_id = conversation_of(request) if stream else None
        client = self.admit(request, plan)
        headers = {SEED_HEADER: str(plan.seed)} if plan.seed is not None else {}
        path = request.url.path

        async def work(send: Send) -> None:
            timer = RequestTimer(self.metrics)
            feed = observed_choices(self.choices(plan), plan, self.choices_metrics)
            record = access_record(request.scope)
            if record is not None:
                feed = metered(feed, plan, record)
            first = asyncio.ensure_future(anext(feed, None))
            status = 200
            try:
                try:
                    if stream:
                        await wait_first(first, self.settings.sse_keepalive_s)
                    else:
                        item = await first
                        timer.on_output(item)
                        body = await writer.whole(item, feed, timer)
                        await send_all(send, Response(body, 200, headers, JSON))
                        timer.on_finish()
                        return
                except BrigadeError as exc:  # nothing sent yet: the error gets its own status
                    self.on_refused(client, exc)
                    error = from_engine(exc, plan.aliases)
                    status = error.status
                    await send_all(send, Response(writer.error_body(error), status, error.headers, JSON))
                    return
                except OSError:
                    raise
                except Exception as exc:  # a bug: this request fails with a 500, logged, not silently
                    status = 500
                    await send_all(
                        send, Response(writer.error_body(internal_error(path, exc)), 500, None, JSON)
                    )
                    return
                raw_headers = [(k.encode(), v.encode()) for k, v in {**headers, **SSE_HEADERS}.items()]
                await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
                try:
                    events = writer.events(first, feed, timer)
                    async with aclosing(with_keepalive(events, self.settings.sse_keepalive_s)) as chunks:
                        async for chunk in chunks:
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except OSError:
                    raise
                except Exception as exc:  # a bug after the 200: the stream ends with an error event
                    status = 500
                    data = writer.error_event(internal_error(path, exc))
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                if status == 200:
                    timer.on_finish()
            except (asyncio.CancelledError, OSError):
                status = CLIENT_CLOSED
                raise
            finally:
                # Once the whole reply is sent the client may close, and the disconnect watch then
                # cancels this task: the cleanup (which aborts what the engine still runs for a
                # reply its writer ended early) finishes regardless, and the request is counted.
                cleanup = asyncio.ensure_future(close_feed(first, feed))
                self.cleanups.add(cleanup)  # held: a shielded task must be referenced to finish
                cleanup.add_done_callback(self.cleanups.discard)
                try:
                    await asyncio.shield(cleanup)
                finally:
                    self.num_in_flight -= 1
                    self.count(path, status)

        if conversation_id is not None:
            return RecordedResponse(work, lambda: self.streams.start(conversation_id))
        return WatchedResponse(work)

    def choices(self, plan: Plan) -> Feed:
        """The plan's choices as they come: its jobs' samples, or the beams of its beam search."""
        if plan.beam is None:
            return run_jobs(self.client, plan.jobs)
        settings = self.settings
        return beam_search_feed(self.client, plan.jobs, plan.beam, self.tokenizer, settings.max_model_len,
                                settings.default_max_tokens)  # fmt: skip

    async def collect(self, first: tuple[int, StreamDelta] | None, feed: AsyncIterator[tuple[int, StreamDelta]],
                      plan: Plan, fmt: ChatFormat | CompletionFormat, timer: Any,
                      timings: RequestTimings | None = None,
                      read: Callable[[Piece], Piece] = lambda piece: piece) -> msgspec.Struct:  # fmt: skip
        """The whole reply; with `timings` (llama-server's timings_per_token), the request's. Each
        piece of output goes through `read` first, as a stream's would (a translated API's own
        reading: Anthropic's cut of a stop sequence)."""
        choices = [ChoiceOutput() for _ in plan.jobs]
        usages = {}
        item = first
        while item is not None:
            index, delta = item
            choices[index].add(read(to_piece(delta)))
            if delta.usage is not None:
                usages[index] = delta.usage
            if timings is not None:
                timings.add(index, delta, time.monotonic())
            item = await anext(feed, None)
            if item is not None:
                timer.on_output(item)
        reply = fmt.whole(choices, usage_out(usages, plan.prompt_of))
        if timings is not None:
            reply.timings = timings.of_request(time.monotonic())  # type: ignore[attr-defined]
        return reply

    async def stream_events(self, first: asyncio.Future[tuple[int, StreamDelta] | None],
                            feed: AsyncIterator[tuple[int, StreamDelta]], plan: Plan,
                            fmt: ChatFormat | CompletionFormat, cursor: Cursor, options: p.StreamOptions,
                            timer: Any, timings: RequestTimings | None = None) -> AsyncGenerator[bytes, None]:  # fmt: skip
        """The stream's events. With vLLM's continuous_usage_stats (and include_usage) every chunk
        of a choice carries that choice's usage so far: its prompt's tokens (which come with its
        first output) and its output tokens; a chat choice's opening chunk (its role) then waits
        for that first output. With `timings` (llama-server's timings_per_token) every chunk of a
        choice's output carries the choice's timings so far, and the usage chunk the request's."""
        usages = {}
        reports = PromptReports()
        continuous = options.include_usage and options.continuous_usage_stats
        so_far: dict[int, m.Usage] = {}
        unopened = set() if cursor.is_resumed else {job.index for job in plan.jobs}
        if not continuous:
            for index in sorted(unopened):
                chunk = fmt.first_chunk(index)
                if chunk is not None:
                    yield event(chunk, cursor.event_id())
            unopened.clear()
        try:
            item = await first
        except BrigadeError as exc:  # after the keep-alive wait: the 200 is already sent
            yield b"data: " + from_engine(exc, plan.aliases).body() + b"\n\n"
            yield DONE
            return
        timer.on_output(item)
        while item is not None:
            index, delta = item
            if delta.prompt_progress is not None:  # return_progress: the prompt, before any output
                if not cursor.resumes_after_output(index):  # else the client had the prompt done
                    progress = progress_out(reports.report(index, delta.prompt_progress), timer.arrival)
                    yield event(fmt.progress_chunk(index, progress))
            else:
                if (whole_prompt := reports.completing(index)) is not None:
                    yield event(fmt.progress_chunk(index, progress_out(whole_prompt, timer.arrival)))
                if delta.usage is not None:
                    usages[index] = delta.usage
                if timings is not None:
                    timings.add(index, delta, time.monotonic())
                if continuous:  # a choice's first and last outputs bring its usage, the others add theirs
                    known = so_far.get(index, m.Usage(0, 0))
                    so_far[index] = delta.usage or m.Usage(
                        known.prompt_tokens, known.completion_tokens + len(delta.token_ids)
                    )
                text_offset = cursor.chars(index)
                # A choice's opening chunk sent with its first output is at the position before it.
                opening_id = cursor.event_id() if index in unopened else None
                whole = to_piece(delta)
                piece = cursor.advance(index, whole)
                fmt.skip(
                    index,
                    whole.text[: len(whole.text) - len(piece.text)] if piece is not None else whole.text,
                )
                if piece is not None:
                    if index in unopened:  # continuous usage: the role's chunk counts the prompt
                        unopened.discard(index)
                        opening = fmt.first_chunk(index)
                        if opening is not None:
                            opening.usage = usage_out(
                                {index: m.Usage(so_far[index].prompt_tokens, 0)}, {index: 0}
                            )
                            yield event(opening, opening_id)
                    for chunk in fmt.chunks(index, piece, text_offset):
                        if continuous:
                            chunk.usage = usage_out({index: so_far[index]}, {index: 0})
                        if timings is not None:
                            chunk.timings = timings.of_choice(index, time.monotonic())
                        yield event(chunk, cursor.event_id())
            try:
                item = await anext(feed, None)
            except BrigadeError as exc:  # the stream ends with it: no usage follows a failure
                yield b"data: " + from_engine(exc, plan.aliases).body() + b"\n\n"
                yield DONE
                return
            if item is not None:
                timer.on_output(item)
        if (overrun := cursor.overrun()) is not None:
            yield b"data: " + invalid(overrun, "Last-Event-ID").body() + b"\n\n"
            yield DONE
            return
        if options.include_usage and usages:
            chunk = fmt.usage_chunk(usage_out(usages, plan.prompt_of))
            if timings is not None:
                chunk.timings = timings.of_request(time.monotonic())  # type: ignore[attr-defined]
            yield event(chunk)
        yield DONE

    # -- llama-server's resumable streams (stream_replay.py) ------------------------------------

    async def replay_stream(self, request: Request) -> Response:
        """GET /v1/stream?conv_id=ID&from=N: the stream's bytes from N, then live to its end."""
        self.check_key(request)
        conversation_id = conversation_param(request)
        offset_text = request.query_params.get("from", "0") or "0"
        if not offset_text.isascii() or not offset_text.isdigit() or len(offset_text) > 18:
            raise invalid(f"from must be a byte offset (0 or more), got {offset_text[:40]!r}", "from")
        # No stream's file reaches past MAX_BYTES + 1: a later offset reads as that one (a seek
        # past the file system's largest file fails).
        chunks = self.streams.open_replay(conversation_id, min(int(offset_text), MAX_BYTES + 1))
        if chunks is None:
            raise ApiError(
                404, f"no stream of conversation {conversation_id[:80]!r} (or it expired)", code="not_found"
            )
        return self.finish(request, StreamingResponse(chunks, headers=SSE_HEADERS))

    async def lookup_streams(self, request: Request) -> Response:
        """POST /v1/streams/lookup {"conversation_ids": [...]}: the streams of those ids."""
        try:
            body = msgspec.json.decode(await self.read_raw(request), type=p.StreamLookupRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise from_decode_error(exc) from None
        sessions = await asyncio.to_thread(self.streams.lookup, body.conversation_ids)
        return self.finish(request, Response(msgspec.json.encode(sessions), media_type=JSON))

    async def stop_stream(self, request: Request) -> Response:
        """DELETE /v1/stream?conv_id=ID: stop the stream and forget it (204, whether it was there)."""
        self.check_key(request)
        conversation_id = conversation_param(request)
        try:
            self.streams.stop(conversation_id)
        except OSError as exc:
            log.warning("stream %r could not be stopped: %s", conversation_id[:80], exc)
            raise ApiError(
                503, f"the stream could not be stopped: {exc.strerror}", code="stream_store"
            ) from None
        return self.finish(request, Response(status_code=204))

    # -- the rest of the API -----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        await self.refresh_adapters()
        return self.finish(request, json_response(p.ModelList(self.model_cards())))

    def model_cards(self) -> list[p.ModelCard]:
        """The base model, then each LoRA adapter, whose parent is the base model (as vLLM lists them)."""
        base = p.ModelCard(self.settings.model, self.started, max_model_len=self.settings.max_model_len)
        adapters = [
            p.ModelCard(
                name, self.started, max_model_len=self.settings.max_model_len, parent=self.settings.model
            )
            for name in self.adapters
        ]
        return [base, *adapters]

    async def model(self, request: Request) -> Response:
        self.check_key(request)
        await self.refresh_adapters()
        model_id = request.path_params["model_id"]
        card = next((card for card in self.model_cards() if card.id == model_id), None)
        if card is None:
            raise self.model_not_found(model_id)
        return self.finish(request, json_response(card))

    # -- LoRA adapters at run time (docs/lora.md) ---------------------------------------------

    async def adapter_command(
        self, op: str, name: str = "", path: str = "", wait: bool = True, inplace: bool = False,
        timeout: float | None = None,
    ) -> m.AdapterReply:  # fmt: skip
        """The engine's answer to a LoRA adapter command; the list of adapters it gives is kept."""
        try:
            reply = await self.client.adapter_command(
                op,
                name,
                path,
                wait=wait,
                inplace=inplace,
                timeout=timeout or self.settings.adapter_command_timeout_s,
            )
        except BrigadeError as exc:
            raise from_engine(exc, {}) from None
        self.adapters = list(reply.adapters)
        return reply

    async def refresh_adapters(self) -> None:
        """The adapters the engine serves now (another gateway replica may have loaded some).
        Callers share one question to the engine: each waits for one asked after it came, so a
        flood of requests naming unknown models costs the engine a list or two at a time, not one
        each, and no caller reads an answer older than itself."""
        if not self.settings.max_loras:
            return
        came = time.monotonic()
        while True:
            listing, asked_at = self._adapter_listing, self._adapter_asked_at
            if listing is not None and not listing.done() and (asked_at is None or asked_at >= came):
                await asyncio.shield(listing)  # its question goes, or went, out after this caller came
                return
            if listing is not None and not listing.done():  # asked before this caller came
                await asyncio.shield(listing)
                continue
            self._adapter_listing, self._adapter_asked_at = asyncio.ensure_future(self._list_adapters()), None

    async def _list_adapters(self) -> None:
        self._adapter_asked_at = time.monotonic()
        # The engine unreachable, or a scheduler not answering (restarting): what was known stands,
        # after a probe's wait rather than an unload's (/v1/models is what probes ask).
        with contextlib.suppress(ApiError):
            await self.adapter_command("list", timeout=ADAPTER_LIST_TIMEOUT_S)

    async def load_lora_adapter(self, request: Request) -> Response:
        body = await self.read_body(request, p.LoadLoraAdapterRequest)
        reply = await self.adapter_command("load", body.lora_name, body.lora_path, inplace=body.load_inplace)
        if reply.code:
            raise adapter_error(reply, reply.param or None)
        return self.finish(
            request, PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")
        )

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await self.read_body(request, p.UnloadLoraAdapterRequest)
        reply = await self.adapter_command("unload", body.lora_name, wait=body.wait)
        if reply.code:
            raise adapter_error(reply, "lora_name")
        return self.finish(
            request, PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
        )

    async def health(self, request: Request) -> Response:
        """200 only while an engine group can serve and a tokenizer answers (load balancers and
        Kubernetes probes route by it)."""
        if engine_group_ready(self.settings.run_dir):
            try:
                replies = await self.client.health(timeout=2.0)
            except BrigadeError:
                replies = []
            if any(r.is_ready for r in replies):
                return self.finish(request, json_response({"status": "ok"}))
        error = ApiError(503, "no engine is ready to serve", code="unavailable", headers={"Retry-After": "1"})
        return self.finish(request, error_response(error))

    async def version(self, request: Request) -> Response:
        """vLLM's: the server's version (Brigade's package version)."""
        return self.finish(request, json_response({"version": BRIGADE_VERSION}))

    async def load(self, request: Request) -> Response:
        """vLLM's: the requests this replica is serving now (`server_load`), for a load balancer
        that routes by it. Each replica counts its own, as each vLLM API server does."""
        return self.finish(request, json_response({"server_load": self.num_in_flight}))

    async def prometheus(self, request: Request) -> Response:
        body, headers = scrape_page(
            registry_for_run(self.settings.run_dir),
            request.url.query,
            request.headers.get("accept-encoding", ""),
        )
        return Response(body, headers=dict(headers))

    async def tokenize(self, request: Request) -> Response:
        return await self.tokenize_body(request, await self.read_body(request, p.TokenizeRequest))

    async def tokenize_body(self, request: Request, body: p.TokenizeRequest) -> Response:
        """vLLM's /tokenize of a body read already (llama.cpp's shares the path: llamacpp.py)."""
        if (body.prompt is None) == (body.messages is None):
            raise invalid("give exactly one of prompt and messages", "prompt")
        if body.messages is None:
            if body.tools is not None or body.chat_template_kwargs is not None:
                raise invalid("tools and chat_template_kwargs go with messages, not a prompt", "prompt")
            ids, token_strs = await asyncio.to_thread(self._tokenize_prompt, body)
        else:
            ids, token_strs = await self.chat_ids(
                ChatToRender(body.messages, body.add_generation_prompt, body.continue_final_message, body.tools,
                             body.chat_template_kwargs),
                body.return_token_strs,
            )  # fmt: skip
        reply = {"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids}
        reply["token_strs"] = token_strs
        return self.finish(request, json_response(reply))

    async def chat_input_tokens(self, request: Request) -> Response:
        """llama.cpp's /chat/completions/input_tokens: a chat completion request's prompt length,
        as the tokenizer stage renders it, without running the model."""
        body = await self.read_body(request, p.ChatCompletionRequest)
        return self.finish(request, json_response(await self.input_tokens(chat_to_render(body))))

    async def input_tokens(self, chat: ChatToRender) -> dict[str, Any]:
        """OpenAI's `response.input_tokens` object of a chat."""
        ids, _ = await self.chat_ids(chat, False)
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    async def chat_ids(
        self, chat: ChatToRender, return_token_strs: bool
    ) -> tuple[list[int], list[str | None] | None]:
        """A chat's prompt ids, rendered and encoded as the tokenizer stage does for generation."""
        rendered = await asyncio.to_thread(self._render_chat, chat)
        if rendered.urls:  # waited for here, on the loop: no worker thread is held while they come
            for index, data in (await self._fetch_images(rendered.urls)).items():
                rendered.files[index] = data
        return await asyncio.to_thread(self._encode_chat, rendered, return_token_strs)

    def _tokenize_prompt(self, body: p.TokenizeRequest) -> tuple[list[int], list[str | None] | None]:
        """Encode (on a worker thread) under the budget a completion request has."""
        prompt = body.prompt or ""
        with budget_errors("prompt"):
            check_prompt_chars(len(prompt), self.settings.max_prompt_chars)
        ids = self.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
        return ids, self._token_strs(ids, body.return_token_strs)

    def _render_chat(self, chat: ChatToRender) -> RenderedChat:
        """Check and render a chat (on a worker thread) under the budgets a generation request
        has, as the tokenizer stage renders it (services/tokenizer/core.py, `_prompt_ids`), its
        images checked as that stage admits them."""
        limit = self.settings.max_prompt_chars
        if chat.tools is not None:
            try:
                tool_functions(chat.tools)  # the shape the template and the instruction read
            except InvalidParams as exc:
                raise invalid(str(exc), "tools") from None
        with budget_errors("messages"):
            try:
                messages = [chat_message(i, sdk_message(i, x)) for i, x in enumerate(chat.messages)]
            except InvalidRequest as exc:
                raise invalid(str(exc), "messages") from None
            try:  # as the tokenizer stage refuses it for generation
                check_chat_messages(messages)
            except InvalidParams as exc:
                named = str(exc).split(" ", 1)[0]  # "messages[2].role must be one of ..."
                raise invalid(str(exc), named if named.startswith("messages[") else "messages") from None
            check_chat_budget(messages, "", max_chars=limit, max_messages=self.settings.max_messages)
            if chat.continue_final_message:  # as the tokenizer stage refuses it for generation
                try:
                    check_continuable(messages)
                except InvalidParams as exc:
                    raise invalid(str(exc), "continue_final_message") from None
            images = [
                part
                for x in messages
                if isinstance(x.content, list)
                for part in x.content
                if isinstance(part, m.ImagePart)
            ]
            if images and self.image_rules is None:
                raise invalid("this model reads no images", "messages")
            files, urls = self._image_files(images)
            rendered, template_tools = template_messages(messages, chat.tools, self.renders_tools)
            try:
                text = self.tokenizer.apply_chat_template(
                    rendered,
                    add_generation_prompt=chat.add_generation_prompt,
                    tools=template_tools,
                    timeout_s=self.settings.template_timeout_s,
                    template_kwargs=chat.template_kwargs,
                    continue_final_message=chat.continue_final_message,
                )
            except TemplateTimeout as exc:
                raise invalid(f"messages: {exc}", "messages") from None
            except ReservedTemplateKwargs as exc:
                raise invalid(str(exc), "chat_template_kwargs") from None
            except Exception as exc:  # a template may raise on unusual conversations
                raise invalid(f"chat template failed: {exc}", "messages") from None
            check_prompt_chars(len(text), limit, " once rendered by the chat template")
        return RenderedChat(text, len(images), files, urls)

    def _image_files(self, images: list[m.ImagePart]) -> tuple[list[bytes], dict[int, str]]:
        """Each image checked as the tokenizer stage admits it, all before any is fetched: a data
        URL decoded within encoder.max_image_bytes, an http(s) URL held to the run's policy.
        Where the model's image tokens depend on the images' sizes, their files in order (b"" for
        an http(s) image) and the http(s) URLs to fetch, by index; else none."""
        files: list[bytes] = []
        urls: dict[int, str] = {}
        for index, part in enumerate(images):
            try:
                if not is_remote(part.url):
                    files.append(decode_data_url(part.url, self.settings.max_image_bytes))
                    continue
                if self.remote_images is None:
                    raise ImageError(NOT_FETCHED)
                self.remote_images.check(part.url)
            except ImageError as exc:
                raise invalid(str(exc), "messages") from None
            urls[index] = part.url
            files.append(b"")
        if self.image_rules is None or not self.image_rules.needs_sizes:
            return [], {}  # the count is the same whatever the images hold: none is fetched
        return files, urls

    async def _fetch_images(self, urls: dict[int, str]) -> dict[int, bytes]:
        """A chat's http(s) images, by index: each distinct URL fetched once, side by side on the
        replica's pool, all within one deadline; the first refusal in prompt order is the 400."""
        assert self.remote_images is not None and self.image_pool is not None  # _image_files
        policy, loop = self.remote_images, asyncio.get_running_loop()
        outcomes = {
            url: loop.run_in_executor(self.image_pool, fetch_outcome, url, policy)
            for url in dict.fromkeys(urls.values())
        }
        try:
            async with asyncio.timeout(policy.request_deadline_s):
                files = {}
                for index, url in urls.items():
                    outcome = await outcomes[url]
                    if isinstance(outcome, ImageError):
                        raise invalid(str(outcome), "messages")
                    files[index] = outcome
                return files
        except TimeoutError:  # a fetch stuck where its socket timeouts do not reach (a DNS lookup)
            raise invalid(policy.overdue(), "messages") from None
        finally:
            # A fetch still waiting for a thread never starts; a running one's result is dropped.
            for outcome in outcomes.values():
                outcome.cancel()

    def _encode_chat(
        self, chat: RenderedChat, return_token_strs: bool
    ) -> tuple[list[int], list[str | None] | None]:
        """Each image as its tokens, as the tokenizer stage expands them (sized from its file's
        header where they depend on it), and the prompt encoded (on a worker thread)."""
        text = chat.text
        if chat.num_images:
            assert self.image_rules is not None  # _render_chat
            try:
                sizes = (
                    [image_size(data, self.settings.max_image_pixels) for data in chat.files]
                    if self.image_rules.needs_sizes
                    else [None] * chat.num_images
                )
                text = self.image_rules.expand(text, sizes)
            except ImageError as exc:
                raise invalid(str(exc), "messages") from None
        ids = self.tokenizer.encode(text)
        return ids, self._token_strs(ids, return_token_strs)

    def _token_strs(self, ids: list[int], wanted: bool) -> list[str | None] | None:
        return self.tokenizer.convert_ids_to_tokens(ids) if wanted else None

    def close(self) -> None:
        """Stop /tokenize's fetch threads without waiting: a fetch not started never starts, and
        one running ends within its own timeout, its result dropped."""
        if self.image_pool is not None:
            self.image_pool.shutdown(wait=False, cancel_futures=True)

    async def detokenize(self, request: Request) -> Response:
        body = await self.read_body(request, p.DetokenizeRequest)
        if len(body.tokens) > self.settings.max_prompt_chars:
            raise invalid(
                f"tokens: {len(body.tokens)} ids; the limit is {self.settings.max_prompt_chars} "
                "(tokenizer.max_prompt_chars)",
                "tokens",
            )
        text = await asyncio.to_thread(self._detokenize, body)
        # vLLM's clients read `prompt`, llama.cpp's `content`: both are answered.
        return self.finish(request, json_response({"prompt": text, "content": text}))

    def _detokenize(self, body: p.DetokenizeRequest) -> str:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"tokens: {bad} is not a token id in [0, {vocab})", "tokens")
        # Special tokens are kept, as both APIs give them (llama-server renders every token's
        # piece, vLLM decodes with HF's default): /tokenize then /detokenize gives the text back.
        return self.tokenizer.decode(body.tokens, skip_special_tokens=False)

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's: the tokenizer's configuration (tokenizer_config.json, special tokens as their
        text), its class and the chat template, for clients that tokenize on the server's behalf
        (lm-evaluation-harness' remote tokenizer)."""
        self.check_key(request)
        return self.finish(request, json_response(self.tokenizer.info()))


Feed = AsyncIterator[tuple[int, StreamDelta]]  # run_jobs: (choice index, delta), in arrival order


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs
# The input of several a refusal is about, as the SDK's embed names it ("input[1]: ...").
EMBEDDING_INPUT_NAMED = re.compile(r"input\[\d+\]")


def as_utf8(data: bytes) -> bytes:
    """A JSON body in UTF-8: one with a byte-order mark, or in UTF-16 or UTF-32, which Python's
    json (behind vLLM's server) reads, is re-encoded first. One that does not decode is left as
    it is, for the decoder to say what is wrong with it."""
    if data[:1] in (b"{", b"[") and data[1:2] != b"\0":  # UTF-8 without a mark, nearly every body
        return data
    encoding = json.detect_encoding(data)
    if encoding == "utf-8":
        return data
    try:
        return data.decode(encoding).encode()
    except UnicodeDecodeError:
        return data


def embedding_inputs(value: str | list[str | int | list[int]]) -> list[str] | list[list[int]]:
    """/v1/embeddings' input as a list of inputs, each a text or token ids, all of one kind."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise invalid("input must not be empty", "input")
    if all(isinstance(x, int) for x in value):
        return [value]  # type: ignore[list-item]
    if not (all(isinstance(x, str) for x in value) or all(isinstance(x, list) for x in value)):
        raise invalid(
            "input must be a string, a list of strings, token ids, or a list of token id lists", "input"
        )
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise invalid(f"input holds {len(value)} inputs, over the limit of {MAX_EMBEDDING_INPUTS}", "input")
    return value  # type: ignore[return-value]


async def close_feed(first: asyncio.Future[Any], feed: Feed) -> None:
    """End a request's feed: its first item's wait, then the feed (aborting its engine requests)."""
    await settle(first)
    await feed.aclose()


def internal_error(path: str, exc: Exception) -> ApiError:
    """A bug while serving one request: logged with its traceback, and that request's 500."""
    log.error("%s failed", path, exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}"[:1000], code="internal")


class ReplyWriter(Protocol):
    """One request's reply in its API's shapes (`Gateway.run` sends them)."""

    async def whole(self, first: tuple[int, StreamDelta] | None, feed: Feed, timer: RequestTimer) -> bytes:
        """The whole reply's body, from the first output (already awaited) and the rest of `feed`."""
        ...

    def events(
        self, first: asyncio.Future[tuple[int, StreamDelta] | None], feed: Feed, timer: RequestTimer
    ) -> AsyncGenerator[bytes, None]:
        """The stream's events; an engine error after the 200 becomes one of them."""
        ...

    def error_body(self, error: ApiError) -> bytes: ...

    def error_event(self, error: ApiError) -> bytes:
        """The event that ends a stream that failed after its 200."""
        ...


class OpenAIWriter:
    """Chat completions and completions: OpenAI's JSON, or its events with resumable ids."""

    def __init__(self, gateway: Gateway, plan: Plan, fmt: ChatFormat | CompletionFormat, cursor: Cursor,
                 stream_options: p.StreamOptions, timings_per_token: bool = False) -> None:  # fmt: skip
        self.gateway = gateway
        self.plan = plan
        self.fmt = fmt
        self.cursor = cursor
        self.stream_options = stream_options
        self.timings_per_token = timings_per_token

    async def whole(self, first: tuple[int, StreamDelta] | None, feed: Feed, timer: RequestTimer) -> bytes:
        reply = await self.gateway.collect(first, feed, self.plan, self.fmt, timer, self.timings(timer))
        return msgspec.json.encode(reply)

    def events(
        self, first: asyncio.Future[tuple[int, StreamDelta] | None], feed: Feed, timer: RequestTimer
    ) -> AsyncGenerator[bytes, None]:
        return self.gateway.stream_events(
            first, feed, self.plan, self.fmt, self.cursor, self.stream_options, timer, self.timings(timer)
        )

    def timings(self, timer: RequestTimer) -> RequestTimings | None:
        """llama-server's timings, where the request asks for them (timings_per_token)."""
        if not self.timings_per_token:
            return None
        return RequestTimings(timer.arrival, self.plan.prompt_of, is_prompt_only=self.plan.is_prompt_only)

    def error_body(self, error: ApiError) -> bytes:
        return error.body()

    def error_event(self, error: ApiError) -> bytes:
        return b"data: " + error.body() + b"\n\n" + DONE


async def metered(feed: Feed, plan: Plan, record: AccessRecord) -> Feed:
    """`feed`, counting its tokens (and with include_text keeping its text) into the request's
    access log record."""
    usages: dict[int, m.Usage] = {}
    prompt_of = plan.prompt_of
    if record.include_text:
        leaders = {job.prompt_index: job for job in reversed(plan.jobs)}
        record.prompt = [job.messages if job.messages is not None else job.prompt for job in leaders.values()]
    async with aclosing(feed):
        async for index, delta in feed:
            if delta.usage is not None:
                usages[index] = delta.usage
                usage = usage_out(usages, prompt_of)
                record.tokens_in, record.tokens_out = usage.prompt_tokens, usage.completion_tokens
            if record.include_text and delta.text:
                record.output[index] = record.output.get(index, "") + delta.text
            yield index, delta


async def observed_choices(feed: Feed, plan: Plan, metrics: ChoicesMetrics) -> Feed:
    """`feed`, observing each prompt's `n` and its longest choice once all its choices finished
    (vLLM observes a request with n choices once, when its last one ends). A request that fails
    or whose client goes away first is not observed: the tokenizers count its choices."""
    prompt_of = plan.prompt_of
    n_of = collections.Counter(prompt_of.values())
    left = dict(n_of)
    num_tokens = dict.fromkeys(prompt_of, 0)
    async with aclosing(feed):
        async for index, delta in feed:
            num_tokens[index] += len(delta.token_ids)
            if delta.finish_reason is not None:
                prompt = prompt_of[index]
                left[prompt] -= 1
                if not left[prompt]:
                    longest = max(num_tokens[i] for i, p in prompt_of.items() if p == prompt)
                    metrics.on_finish(n_of[prompt], longest)
            yield index, delta


def given_keys(request: Request) -> list[str]:
    """The API keys a request presents: Authorization: Bearer, and x-api-key (Anthropic's clients)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    bearer = key.strip() if scheme.lower() == "bearer" else ""
    return [k for k in (bearer, request.headers.get("x-api-key", "").strip()) if k]


def is_constrained(plan: Plan) -> bool:
    """Whether a request's output is constrained by a grammar the scheduler compiles: a
    structured output, or tools the model is forced to call."""
    forced_call = plan.tools is not None and plan.tools.choice in ("required", "function")
    return forced_call or any("structured" in job.sampling for job in plan.jobs)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


async def send_all(send: Send, response: Response) -> None:
    """Send a whole (small, in-memory) response through a raw ASGI `send`."""
    await response({"type": "http"}, _no_receive, send)
