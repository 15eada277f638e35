"""The ZeroMQ client SDK: a sans-IO session (replicas, exactly-once assembly, failover) and the
synchronous `Client` around it. `client.async_sdk.AsyncClient` drives the same session from asyncio.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from client.errors import (
    AuthenticationFailed,
    BrigadeError,
    ClientClosed,
    InvalidRequest,
    RequestTimeout,
    ServerUnavailable,
    UntrustedRunDir,
    error_for,
)
from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST, MalformedMessage
from ipc.endpoints import InsecureRunDir, check_private, check_run_file, default_run_dir, is_process_alive
from ipc.keys import BadKeyFile, CurveKeys, load_public_key, load_secret_file
from ipc.ports import is_loopback
from ipc.sockets import DEFAULT_MAX_MSG_BYTES, configure_socket
from ipc.structured_output import from_structured_outputs
from ipc.validation import InvalidParams

MAX_SEED = 2**63
# The widths integers travel in: msgpack's int64 for sampling parameters, packed int32 for token
# ids. A wider value is refused here, naming its field, instead of failing in the encoder.
INT64_RANGE = (-(2**63), 2**63 - 1)
INT32_RANGE = (-(2**31), 2**31 - 1)
MAX_STASHED_DELTAS = 1024  # out-of-order deltas kept per request while waiting for the gap to fill
RUN_CHECK_INTERVAL_S = 0.5  # how often a client with requests in flight checks that its run is alive
RUN_ENDED = "the Brigade run ended (its supervisor is gone)"
CLOSE_LINGER_MS = 100  # lets the aborts of a closing client out, and bounds how long closing takes

Prompt = str | Sequence[int]


@dataclass
class StreamDelta:
    """New output of one request, in order and never repeated."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # the sampled tokens' (with logprobs >= 0 asked: always)
    finish_reason: str | None = None
    usage: m.Usage | None = None
    top_logprobs: list[dict[int, float]] | None = None  # per token, the top `logprobs` ids -> logprob
    tools: m.ParsedTools | None = None  # the last delta of a chat with tools: content and calls
    prompt_logprobs: m.PromptLogprobs | None = None  # with prompt_logprobs asked: on the first delta
    embedding: bytes = b""  # an embedding request's vector (packed float32), on its final delta
    prompt_token_ids: list[int] | None = None  # with return_prompt_ids asked: on the first delta
    # with report_prompt_progress asked: a delta of no output, before the first, that says only how
    # much of the prompt is computed
    prompt_progress: m.PromptProgress | None = None


@dataclass
class GenerateResult:
    text: str  # the model's whole output, tool-call markup included
    token_ids: list[int]
    finish_reason: str  # "tool_calls" when a chat with tools ended in calls
    usage: m.Usage | None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    tools: m.ParsedTools | None = None  # with tools: the text cut into content and tool calls
    prompt_logprobs: m.PromptLogprobs | None = None  # with prompt_logprobs asked
    embedding: bytes = b""  # an embedding request's vector, packed float32
    prompt_token_ids: list[int] | None = None  # with return_prompt_ids asked: the prompt the engine ran

    @property
    def tool_calls(self) -> list[m.ToolCall]:
        return self.tools.calls if self.tools is not None else []

    @property
    def content(self) -> str | None:
        """The reply's text without its tool calls (OpenAI's message.content)."""
        return self.tools.content if self.tools is not None else self.text


ServerKey = bytes | str | Path  # 40 z85 characters, or a certificate file holding the key
ClientKeys = tuple[bytes | str, bytes | str] | str | Path  # (public, secret) z85, or a secret certificate


@dataclass
class ConnectInfo:
    """Where a Brigade run listens: tokenizer endpoints and, for tcp:// with CURVE, the server's
    public key and the client's key pair."""

    endpoints: list[str]
    curve_server_key: bytes | None = None
    curve_keys: CurveKeys | None = None
    curve_keys_file: Path | None = None  # named by run.json; read unless keys are given
    model: str = ""
    supervisor_pid: int | None = None  # from run.json: lets a client on this host see the run end


def read_run(run: Path | str | None = None) -> ConnectInfo:
    """Read a run's run.json (written by the supervisor): RUN_DIR/run.json, or the file itself
    (a copy on another host, say); the default run dir when None. A run dir must be private to
    this user and run.json writable only by it: whoever can swap run.json would receive our
    prompts. The client key file it names is looked for beside run.json too."""
    path = Path(run) if run is not None else default_run_dir()
    is_file = path.is_file()
    run_file = path if is_file else path / "run.json"
    if not os.path.lexists(run_file):
        raise ServerUnavailable(f"no Brigade running at {path} (no run.json)")
    try:
        if not is_file:
            check_private(path)
        check_run_file(run_file)
        info = json.loads(run_file.read_text())
    except InsecureRunDir as exc:
        raise UntrustedRunDir(f"refusing to trust {run_file}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ServerUnavailable(f"cannot read {run_file}: {exc}") from None
    if not isinstance(info, dict):  # `null`, a list: damaged, or no run's file
        raise ServerUnavailable(f"cannot read {run_file}: not a Brigade run file")
    endpoints = info.get("tokenizers") or []
    if not endpoints:
        raise ServerUnavailable(f"{run_file} lists no tokenizers")
    key = info.get("curve_server_key")
    keys_file = info.get("curve_client_keys")
    keys_path = _beside(run_file, Path(keys_file)) if keys_file else None
    pid = info.get("supervisor_pid")
    return ConnectInfo(
        list(endpoints), key.encode() if key else None, None, keys_path, info.get("model", ""), pid
    )


def _beside(run_file: Path, keys_file: Path) -> Path:
    """The client key file run.json names; on another host (a copy of run.json), the file of
    that name beside the copy."""
    named = run_file.parent / keys_file
    return named if named.exists() else run_file.parent / keys_file.name


def _client_keys(keys: ClientKeys) -> CurveKeys:
    try:
        if isinstance(keys, tuple):
            public, secret = (k.encode() if isinstance(k, str) else k for k in keys)
            if len(public) != 40 or len(secret) != 40:
                raise BadKeyFile("keys must be a (public, secret) pair of 40-character z85 keys")
            return CurveKeys(public, secret)
        return load_secret_file(keys)
    except BadKeyFile as exc:
        raise AuthenticationFailed(str(exc)) from None


def _server_key(key: ServerKey) -> bytes:
    try:
        return load_public_key(key)
    except BadKeyFile as exc:
        raise AuthenticationFailed(str(exc)) from None


def connect_info(
    target: Path | str | None,
    endpoints: Sequence[str] | None,
    server_key: ServerKey | None,
    keys: ClientKeys | None,
) -> ConnectInfo:
    """Where to connect and with which keys: tokenizer endpoints (`target` "tcp://..." or
    "ipc://...", or `endpoints`), or a run dir / run.json file; explicit keys win over the run's.
    A tcp:// endpoint beyond loopback without keys is refused here: a Brigade run there only
    talks CURVE, and failing now is clearer than a handshake that never succeeds."""
    if isinstance(target, str) and target.startswith(("tcp://", "ipc://")):
        endpoints = [target, *(endpoints or [])]
    info = ConnectInfo(list(endpoints)) if endpoints else read_run(target)
    if server_key is not None:
        info.curve_server_key = _server_key(server_key)
    if keys is not None:
        info.curve_keys = _client_keys(keys)
    elif info.curve_keys_file is not None:
        info.curve_keys = _client_keys(info.curve_keys_file)
    if (info.curve_server_key is None) != (info.curve_keys is None):
        raise AuthenticationFailed(
            "CURVE needs both server_key= (the run's server public key) and keys= (the run's client "
            "key pair, e.g. <run-dir>/curve/client.key_secret); got only "
            + ("server_key" if info.curve_server_key is not None else "keys")
        )
    if info.curve_server_key is None:
        for endpoint in info.endpoints:
            host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
            if endpoint.startswith("tcp://") and not is_loopback(host):
                raise AuthenticationFailed(
                    f"{endpoint} is beyond this host: pass server_key= and keys= (a Brigade run "
                    "accepts tcp:// clients only with its CURVE keys), or a run file that names them"
                )
    return info


# What the tokenizer fills in from other fields (bad_words_ids from bad_words): a client sends none.
_TOKENIZER_FIELDS = frozenset({"bad_words_ids"})
_PARAM_TYPES = {
    f.name: f.type for f in msgspec.structs.fields(m.SamplingParams) if f.name not in _TOKENIZER_FIELDS
}


def _convert(name: str, value: Any, type_: Any) -> Any:
    """`value` as `type_`, strictly (16.0 is not an int, "16" is not a number), or InvalidRequest;
    an integer past the wire's 64 bits is refused naming `name` (not by the encoder, later)."""
    try:
        converted = msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{name}={value!r:.80} has the wrong type: {exc}") from None
    if isinstance(converted, int):  # a list's are checked by its own field (token ids by index)
        _check_int_range(name, converted)
    return converted


def _check_int_range(name: str, value: Any) -> None:
    """Refuse an integer (or a list's item, or a dict's key) wider than int64."""
    if isinstance(value, dict):
        candidates: Any = value.keys()
    elif isinstance(value, list):
        candidates = value
    else:
        candidates = [value]
    lo, hi = INT64_RANGE
    for x in candidates:
        if isinstance(x, int) and not lo <= x <= hi:
            raise InvalidRequest(f"{name}: {x} is out of range (integers travel as 64-bit, [{lo}, {hi}])")


def check_seconds(name: str, value: Any, *, optional: bool = False, positive: bool = False) -> None:
    """A duration in seconds: a finite number >= 0, or > 0 where `positive` (None too where
    `optional`: no limit)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise InvalidRequest(f"{name} must be a finite number of seconds >= 0, got {value!r:.80}")
    if positive and value == 0:
        raise InvalidRequest(f"{name} must be more than 0 seconds")


def _check_text(name: str, text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate cannot be sent as UTF-8)."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{name} is not valid text: {exc.reason} at position {exc.start}") from None


# The output constraint's shorthands, each one kind of `structured` (ipc/structured_output.py).
_CONSTRAINT_KWARGS = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _structured(sampling: dict[str, Any]) -> None:
    """Replace a constraint shorthand in `sampling` (json_schema= a schema as a dict or its JSON
    text, regex=, choice= a list of strings, grammar= EBNF or Lark) by the `structured` it means;
    at most one of them and `structured` may be given."""
    given = [name for name in ("structured", *_CONSTRAINT_KWARGS) if sampling.get(name) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"give at most one output constraint, got {', '.join(given)}")
    for name, kind in _CONSTRAINT_KWARGS.items():
        value = sampling.pop(name, None)
        if value is None:
            continue
        if kind == "json" and not isinstance(value, (dict, str)):
            raise InvalidRequest(f"json_schema must be a dict or its JSON text, got {type(value).__name__}")
        try:
            sampling["structured"] = from_structured_outputs({kind: value})
        except InvalidParams as exc:  # its message names the API form's field: name ours instead
            raise InvalidRequest(f"{name}: {str(exc).split(': ', 1)[-1]}") from None


def make_params(sampling: dict[str, Any]) -> m.SamplingParams:
    """SamplingParams from keyword arguments, type-checked here so that a wrong type is a clear
    error naming the field, with a client-chosen seed when sampling is random so that a request
    resubmitted after a failover samples exactly the same tokens; a keyword given as None is left
    at its default. An output constraint is
    `structured=StructuredOutput(...)` or one of its shorthands (`_structured`)."""
    # None is the field's default, as JSON null is to the gateway (adapter=None: the base model).
    sampling = {name: value for name, value in sampling.items() if value is not None}
    _structured(sampling)
    # A whole SamplingParams' fields (asdict of one) carry the tokenizer's at their default: empty.
    for name in _TOKENIZER_FIELDS & sampling.keys():
        if sampling.pop(name):
            raise InvalidRequest(f"{name} are the tokenizer's to make from bad_words: give bad_words")
    unknown = sorted(set(sampling) - _PARAM_TYPES.keys())
    if unknown:
        raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    values = {name: _convert(name, value, _PARAM_TYPES[name]) for name, value in sampling.items()}
    if values.get("top_k") == -1:  # vLLM's and SGLang's "no top-k", as the gateway takes it too
        values["top_k"] = 0
    for name, value in values.items():
        _check_int_range(name, value)
    for i, stop in enumerate(values.get("stop", [])):
        _check_text(f"stop[{i}]", stop)
    for i, word in enumerate(values.get("bad_words", [])):
        _check_text(f"bad_words[{i}]", word)
    params = m.SamplingParams(**values)
    # An unset temperature may turn out random (the model's default): it gets a seed too.
    if params.seed is None and (params.temperature is None or params.temperature > 0):
        params = msgspec.structs.replace(params, seed=random.randrange(MAX_SEED))
    return params


def _prompt_ids(prompt: Sequence[int]) -> bytes:
    """Token ids packed as int32; an id outside that range is refused (packing would raise, or
    wrap a numpy array's id silently into another token)."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):  # a sequence of ints, but surely not token ids
        raise InvalidRequest("bytes are neither text nor token ids: decode them to a str first")
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise InvalidRequest(
                f"token ids must be a 1-D integer array, got {prompt.dtype} of shape {prompt.shape}"
            )
        ids: Any = prompt
    else:
        ids = _convert("prompt (token ids)", list(prompt), list[int])
    lo, hi = INT32_RANGE
    if len(ids) == 0:
        return b""
    smallest, largest = (ids.min(), ids.max()) if isinstance(ids, np.ndarray) else (min(ids), max(ids))
    if not lo <= int(smallest) <= int(largest) <= hi:
        index, bad = next((i, int(x)) for i, x in enumerate(ids) if not lo <= int(x) <= hi)
        raise InvalidRequest(
            f"prompt: token id {bad} at index {index} is out of range (ids travel as 32-bit)"
        )
    return m.pack_ids(ids)


def make_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> m.Tools | None:
    """OpenAI `tools`, `tool_choice` ("none", "auto", "required" or {"type": "function",
    "function": {"name"}}) and `parallel_tool_calls` -> what the tokenizer reads; the tokenizer
    checks the tools themselves."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise InvalidRequest(f"tool_choice={tool_choice!r} needs tools")
        return None
    text = tools_text(tools)
    parallel = _convert(
        "parallel_tool_calls", True if parallel_tool_calls is None else parallel_tool_calls, bool
    )
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return m.Tools(text, tool_choice or "auto", parallel=parallel)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise InvalidRequest(
            f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
            f"{{'name': ...}}}}, got {tool_choice!r}"
        )
    return m.Tools(text, "function", name, parallel)


def tools_text(tools: Any) -> str:
    """The tools' JSON text, as the tokenizer renders it and counts it in a chat's budget."""
    try:
        return json.dumps(tools, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"tools must be JSON (OpenAI's tools list): {exc}") from None


def chat_message(i: int, message: Any) -> m.ChatMessage:
    """One chat message (a dict) -> the wire form. Assistant `tool_calls` may come in OpenAI's
    shape, `{"id", "type", "function": {"name", "arguments"}}`, or flat (`{"id", "name", "arguments"}`);
    so may image parts: `{"type": "image_url", "image_url": {"url"}}` or `{"type": "image_url", "url"}`.
    An assistant turn's thinking is `reasoning` (vLLM's name) or `reasoning_content`."""
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        parts = [
            {"type": "image_url", "url": part["image_url"].get("url")}
            if isinstance(part, dict) and isinstance(part.get("image_url"), dict)
            else part
            for part in message["content"]
        ]
        message = {**message, "content": parts}
    if isinstance(message, dict) and message.get("reasoning") is None and "reasoning_content" in message:
        message = {**message, "reasoning": message["reasoning_content"]}  # DeepSeek's, llama.cpp's name
    if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
        calls = [
            {"id": c.get("id"), **c["function"]}
            if isinstance(c, dict) and isinstance(c.get("function"), dict)
            else c
            for c in message["tool_calls"]
        ]
        message = {**message, "tool_calls": calls}
    converted = _convert(f"messages[{i}]", message, m.ChatMessage)
    _check_text(f"messages[{i}].role", converted.role)
    if converted.content is not None:
        _check_text(f"messages[{i}].content", m.content_text(converted.content))
    elif not (converted.role == "assistant" and converted.tool_calls):
        raise InvalidRequest(
            f"messages[{i}].content is required (only an assistant's tool calls may go without)"
        )
    if converted.reasoning is not None:
        _check_text(f"messages[{i}].reasoning", converted.reasoning)
    return converted


def make_generate(
    request_id: str | None,
    prompt: Prompt | None,
    messages: Sequence[dict[str, Any]] | None,
    sampling: dict[str, Any],
) -> m.Generate:
    """A Generate whose every field has its declared type: the tokenizer can parse it."""
    if (prompt is None) == (messages is None):
        raise InvalidRequest("give exactly one of a prompt (text or token ids) and chat messages")
    if request_id is not None:
        _check_text("request_id", _convert("request_id", request_id, str))
    tools = make_tools(
        sampling.pop("tools", None),
        sampling.pop("tool_choice", None),
        sampling.pop("parallel_tool_calls", None),
    )
    if tools is not None and messages is None:
        raise InvalidRequest("tools can only be offered to a chat (messages)")
    template_kwargs = sampling.pop("chat_template_kwargs", None)
    if template_kwargs is not None and (
        messages is None
        or not isinstance(template_kwargs, dict)
        or not all(isinstance(k, str) for k in template_kwargs)
    ):
        raise InvalidRequest("chat_template_kwargs: an object of template variables, for a chat (messages)")
    continue_final = sampling.pop("continue_final_message", False)
    if continue_final is not False and (messages is None or continue_final is not True):
        raise InvalidRequest("continue_final_message: true or false, for a chat (messages)")
    generation_prompt = sampling.pop("add_generation_prompt", True)
    if generation_prompt is not True and (messages is None or generation_prompt is not False):
        raise InvalidRequest("add_generation_prompt: true or false, for a chat (messages)")
    return_prompt_ids = _convert("return_prompt_ids", sampling.pop("return_prompt_ids", False), bool)
    # A later request of a call the run admitted (m.Generate.continues): a stopping run finishes it.
    continues = _convert("continues", sampling.pop("continues", False), bool)
    truncate = _convert("truncate_prompt_tokens", sampling.pop("truncate_prompt_tokens", None) or 0, int)
    if truncate < -1:
        raise InvalidRequest(f"truncate_prompt_tokens must be -1 (as many as leave room for one output token) "
                             f"or >= 1, got {truncate}")  # fmt: skip
    request = m.Generate(request_id=request_id or uuid.uuid4().hex, params=make_params(sampling), tools=tools,
                         chat_template_kwargs=template_kwargs, continue_final_message=continue_final,
                         add_generation_prompt=generation_prompt, truncate_prompt_tokens=truncate,
                         return_prompt_ids=return_prompt_ids, continues=continues)  # fmt: skip
    if messages is not None:
        request.messages = [chat_message(i, message) for i, message in enumerate(messages)]
    elif isinstance(prompt, str):
        _check_text("prompt", prompt)
        request.prompt = prompt
    elif isinstance(prompt, (Sequence, np.ndarray)):
        request.prompt_token_ids = _prompt_ids(prompt)
    else:
        raise InvalidRequest(f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
    return request


def open_dealer(
    ctx: zmq.Context, endpoint: str, curve_server_key: bytes | None, curve_keys: CurveKeys | None
) -> zmq.Socket:
    """A DEALER to one tokenizer. IMMEDIATE: a send to a replica that is down fails at once (and the
    session tries another) instead of queueing for a peer that may never come back."""
    sock = ctx.socket(zmq.DEALER)
    configure_socket(sock)
    sock.immediate = 1
    sock.linger = 0
    if endpoint.startswith("tcp://["):
        sock.ipv6 = True
    if curve_server_key is not None and curve_keys is not None:
        sock.curve_serverkey = curve_server_key
        sock.curve_publickey = curve_keys.public
        sock.curve_secretkey = curve_keys.secret
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:  # not an address zmq takes ("tcp://host" without a port, say)
        sock.close(linger=0)
        raise InvalidRequest(
            f"endpoint {endpoint!r}: {exc} (expected tcp://HOST:PORT or ipc://PATH)"
        ) from None
    return sock


# A dropped CURVE handshake is the server's answer only when drops go on this long (see
# Session.on_handshake); the socket reconnects every 100 ms (libzmq's default), so a wrong server
# key is reported about this soon.
HANDSHAKE_DROPS_FOR_S = 2.0

HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def handshake_failure(event: dict[str, Any], has_keys: bool) -> str | None:
    """Why a monitor event says the handshake failed; None for a success."""
    kind, value = event["event"], event["value"]
    if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the server refused this client's key (status {value}): is `keys` the run's client key?"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "the server and this client disagree on CURVE: a CURVE server needs server_key and keys"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"handshake protocol error {value:#x}"
    if not has_keys:
        return "the server dropped the handshake: a Brigade run over tcp:// needs server_key and keys"
    return "the server dropped the handshake: is `server_key` the run's server public key?"


@dataclass
class EmbedResult:
    """`Client.embed`'s answer: one vector per input, in input order."""

    embeddings: np.ndarray  # [inputs, dimensions] float32
    prompt_tokens: int  # of all the inputs together


EmbedInput = str | Sequence[int] | Sequence[str | Sequence[int]]
# At most this many of one embed call's inputs are in the engine at once; the others are sent as
# those finish. Each input is a request of its own, and an OpenAI call may hold 2048: sent all at
# once they overflowed the scheduler's queue (engine.max_num_waiting, 1024 by default), and the
# call was refused as overloaded on an idle engine, every retry alike. 256 keeps four steps of the
# default max_num_seqs (64) waiting, which is all the batching the engine can do with them.
MAX_EMBEDS_IN_FLIGHT = 256


def seconds_left(deadline: float | None) -> float | None:
    """A call's time left before `deadline` (time.monotonic), for the next request it sends;
    0 once it has passed (that request then times out at once)."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def make_embeds(
    inputs: EmbedInput, dimensions: int | None, truncate_prompt_tokens: int | None = None
) -> list[m.Generate]:
    """One embedding request per input: a text, a list of texts, a list of token ids, or a list
    of token-id lists (OpenAI's four forms). `dimensions` keeps the vectors' first that many
    values; `truncate_prompt_tokens` (vLLM's) embeds each input's last that many tokens, -1 its
    last the model reads."""
    if isinstance(inputs, str) or (
        isinstance(inputs, (Sequence, np.ndarray))
        and len(inputs)
        and isinstance(inputs[0], (int, np.integer))
    ):
        inputs = [inputs]  # type: ignore[list-item]
    if not isinstance(inputs, (Sequence, np.ndarray)) or not len(inputs):
        raise InvalidRequest("input must be a text, token ids, or a non-empty list of them")
    if dimensions is not None:
        dimensions = _convert("dimensions", dimensions, int)
        if dimensions < 1:
            raise InvalidRequest(f"dimensions must be >= 1, got {dimensions}")
    truncate = 0
    if truncate_prompt_tokens is not None:
        truncate = _convert("truncate_prompt_tokens", truncate_prompt_tokens, int)
        if truncate == 0 or truncate < -1:
            raise InvalidRequest(
                f"truncate_prompt_tokens must be -1 (the model's limit) or >= 1, got {truncate}"
            )
    params = m.SamplingParams(embed=m.EmbedOptions(dimensions or 0, truncate))
    requests = []
    for i, one in enumerate(inputs):
        if isinstance(one, str):
            _check_text(f"input[{i}]", one)
            request = m.Generate(request_id=uuid.uuid4().hex, prompt=one, params=params)
        elif isinstance(one, (Sequence, np.ndarray)):
            request = m.Generate(
                request_id=uuid.uuid4().hex, prompt_token_ids=_prompt_ids(one), params=params
            )
        else:
            raise InvalidRequest(
                f"input[{i}] must be a text or a list of token ids, got {type(one).__name__}"
            )
        if not (request.prompt or request.prompt_token_ids):
            raise InvalidRequest(f"input[{i}] is empty")
        requests.append(request)
    return requests


def embed_error(errors: Sequence[BrigadeError | None]) -> BrigadeError | None:
    """What `embed` raises for the outcomes of the inputs it sent, in order (None where one
    succeeded; after a refusal the others are not sent): the first input's error. Each input is a
    request of its own, whose refusal knows nothing of the others, so where some inputs of several
    are refused, it names the input (`input[1]: input token id ...`); one refusal of every input
    sent, alike, is the request's own (its dimensions) and is kept as it is."""
    failed = [(i, error) for i, error in enumerate(errors) if error is not None]
    if not failed:
        return None
    index, error = failed[0]
    alike = len(failed) == len(errors) and len({str(e) for _, e in failed}) == 1
    if not isinstance(error, InvalidRequest) or alike:
        return error
    return error_for(error.code, f"input[{index}]: {error}")


def embed_result(results: Sequence[GenerateResult]) -> EmbedResult:
    """The vectors of finished embedding requests, in their order."""
    vectors = np.stack([np.frombuffer(r.embedding, "<f4") for r in results])
    return EmbedResult(vectors, sum(r.usage.prompt_tokens for r in results if r.usage is not None))


def collect_result(deltas: Sequence[StreamDelta]) -> GenerateResult:
    """One result from a whole stream's deltas."""
    last = deltas[-1]
    assert last.finish_reason is not None
    logprobs = [x for d in deltas for x in d.logprobs or []]
    top_logprobs = [x for d in deltas for x in d.top_logprobs or []]
    return GenerateResult(
        "".join(d.text for d in deltas),
        [t for d in deltas for t in d.token_ids],
        last.finish_reason,
        last.usage,
        logprobs or None,
        top_logprobs or None,
        last.tools,
        next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
        last.embedding,
        next((d.prompt_token_ids for d in deltas if d.prompt_token_ids is not None), None),
    )


class HealthCheck:
    """One health check of every replica, without IO (both clients run it): `next_wait` probes the
    replicas not asked yet and says how long to wait for replies (None when done); the caller waits
    while receiving and asks again; `replies` is the outcome."""

    def __init__(self, session: Session, timeout: float, tick_s: float) -> None:
        check_seconds("timeout", timeout)
        self.session = session
        self.timeout = timeout
        self.tick_s = tick_s
        self.start = time.monotonic()
        # A replica not connected yet refuses the probe: it is retried.
        self.unsent = set(range(len(session.replicas)))

    def next_wait(self) -> float | None:
        replicas = self.session.replicas
        if time.monotonic() - self.start >= self.timeout or all(r.health_at >= self.start for r in replicas):
            return None
        if self.session.run_has_ended():  # no replica will answer: say so now, not at the timeout
            return None
        self.unsent = {i for i in self.unsent if not self.session.probe(i)}
        return 0.005 if self.unsent else self.tick_s

    def replies(self) -> list[m.HealthReply]:
        """The replies that came back during the check; ServerUnavailable when none did."""
        start = self.start
        replies = [r.health for r in self.session.replicas if r.health is not None and r.health_at >= start]
        if not replies and self.session.run_has_ended():
            raise ServerUnavailable(RUN_ENDED)
        if not replies:
            raise ServerUnavailable(f"no tokenizer answered a health check within {self.timeout:.0f}s")
        return replies


class RequestState:
    """Owns one request's received output: assembles deltas exactly once, by absolute position."""

    def __init__(self, generate: m.Generate, deadline: float | None, now: float) -> None:
        self.generate = generate
        self.deadline = deadline
        self.replica: int | None = None  # the tokenizer it runs on; None = not sent yet
        self.sent_at = now
        self.heard_at = now  # last sign of life from the replica running it
        self.is_acked = False  # the replica running it has answered for it by id
        self.is_admitted = False  # a replica has streamed output of it (a refusal admits nothing)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.text_parts: list[str] = []
        self.num_chars = 0
        self.finish_reason: str | None = None
        self.usage: m.Usage | None = None
        self.tools: m.ParsedTools | None = None
        self.prompt_logprobs: m.PromptLogprobs | None = None
        self.prompt_token_ids: list[int] | None = None
        self.embedding = b""
        self.error: BrigadeError | None = None
        self.ready: deque[StreamDelta] = deque()
        self._stash: list[m.Delta] = []

    @property
    def request_id(self) -> str:
        return self.generate.request_id

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def resubmission(self) -> m.Generate:
        """The same request, continuing after what was already received. Once the run has admitted
        it, it continues an admitted call (m.Generate.continues): a stopping run finishes it on
        whichever replica it fails over to."""
        return msgspec.structs.replace(
            self.generate,
            resume_output_ids=m.pack_ids(self.token_ids),
            resume_num_chars=self.num_chars,
            continues=self.generate.continues or self.is_admitted,
        )

    def apply(self, delta: m.Delta) -> None:
        """Take the part of `delta` not yet received; hold it back while an earlier part is missing."""
        if self.finish_reason is not None:
            return
        self._stash.append(delta)
        is_progress = True
        while is_progress and self.finish_reason is None:
            is_progress = False
            for d in list(self._stash):
                if d.token_index <= len(self.token_ids) and d.char_offset <= self.num_chars:
                    self._stash.remove(d)
                    self._take(d)
                    is_progress = True
        del self._stash[:-MAX_STASHED_DELTAS]

    def _take(self, delta: m.Delta) -> None:
        if delta.prompt_progress is not None:  # a report of no output, which means nothing after some
            if not self.token_ids and not self.num_chars:
                self.ready.append(StreamDelta("", [], prompt_progress=delta.prompt_progress))
            return
        skip = len(self.token_ids) - delta.token_index
        ids = m.unpack_ids(delta.token_ids)[skip:].tolist()
        logprobs = np.frombuffer(delta.logprobs, "<f4")[skip:].tolist()
        top_logprobs = delta.top_logprobs[skip:]
        text = delta.text[self.num_chars - delta.char_offset :]
        # They belong to output token 0: taken with it, once.
        is_first = skip == 0 and delta.token_index == 0
        prompt_logprobs = delta.prompt_logprobs if is_first else None
        self.prompt_logprobs = self.prompt_logprobs or prompt_logprobs
        prompt_ids = m.unpack_ids(delta.prompt_ids).tolist() if is_first and delta.prompt_ids else None
        self.prompt_token_ids = self.prompt_token_ids or prompt_ids
        self.token_ids += ids
        self.logprobs += logprobs
        self.top_logprobs += top_logprobs
        self.text_parts.append(text)
        self.num_chars += len(text)
        if delta.finish_reason is not None:
            self.finish_reason, self.usage, self.tools = delta.finish_reason, delta.usage, delta.tools
            self.embedding = delta.embedding
        if ids or text or delta.finish_reason is not None:
            self.ready.append(
                StreamDelta(
                    text,
                    ids,
                    logprobs or None,
                    delta.finish_reason,
                    delta.usage,
                    top_logprobs or None,
                    delta.tools,
                    prompt_logprobs,
                    delta.embedding,
                    prompt_ids,
                )
            )

    def result(self) -> GenerateResult:
        assert self.finish_reason is not None
        return GenerateResult(
            "".join(self.text_parts),
            self.token_ids,
            self.finish_reason,
            self.usage,
            self.logprobs or None,
            self.top_logprobs or None,
            self.tools,
            self.prompt_logprobs,
            self.embedding,
            self.prompt_token_ids,
        )


@dataclass
class _Replica:
    endpoint: str
    last_seen: float = -math.inf
    last_probe: float = -math.inf
    is_suspect: bool = False  # a request failed over away from it and it has not answered since
    health: m.HealthReply | None = None
    health_at: float = -math.inf
    handshake_error: str | None = None  # the last CURVE handshake failed, and none succeeded since
    dropped_since: float | None = None  # the first dropped handshake since the last success


def is_abort_answer(reply: m.ClientReply) -> bool:
    """Whether `reply` is a tokenizer's answer to an Abort (services/tokenizer/__main__.py): the
    request's final "abort" delta (with the output held for a slow client joined into it), or
    unknown_request for one that had ended."""
    if isinstance(reply, m.Delta):
        return reply.finish_reason == "abort"
    return isinstance(reply, m.ErrorReply) and reply.code == "unknown_request"


class Session:
    """Sans-IO core of both clients: owns the replicas' liveness and every in-flight request.

    The caller feeds it received frames (`receive`) and calls `tick` a few times a second; the
    session sends through `send(replica_index, frame) -> bool`, which must never block.
    Failover: a replica that sends nothing (no delta, no health reply) for `failover_after`
    seconds while running a request loses it to another replica, which resumes it from what the
    client already has; a request that hears nothing for `unavailable_after` fails, and every
    request fails at once when `is_run_alive` (a check of the run's supervisor) says it ended.
    Every `failover_after / 4` seconds a replica running our requests is probed with their ids;
    those it answers it does not hold are resubmitted (`_resubmit_missing`).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        send: Callable[[int, bytes], bool],
        failover_after: float = 5.0,
        unavailable_after: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        is_run_alive: Callable[[], bool] | None = None,
    ) -> None:
        self.replicas = [_Replica(ep) for ep in endpoints]
        self.requests: dict[str, RequestState] = {}
        self.failover_after = failover_after
        self.unavailable_after = unavailable_after
        self.probe_interval = failover_after / 4
        self._send = send
        self._clock = clock
        self._is_run_alive = is_run_alive
        self._run_checked_at = -math.inf
        # Round-robin start among equally loaded replicas; a random first one, or every client that
        # sends one request (the CLI, a script) would land on replica 0 and never spread.
        self._next = random.randrange(len(endpoints)) if endpoints else 0
        self.num_malformed = 0
        self.num_failovers = 0
        self.adapter_replies: dict[str, m.AdapterReply] = {}  # answers to send_adapter_command
        # When each Abort sent, by (replica, request id), went out, until the replica answers it.
        # A replica answers every Abort once (an "abort" delta, or unknown_request when the
        # request had ended), after every earlier reply of that request: until that answer, a
        # reply under the id is the aborted request's, not that of a new one reusing the id.
        self.unanswered_aborts: dict[tuple[int, str], list[float]] = {}

    # -- requests ------------------------------------------------------------------------------

    def submit(self, generate: m.Generate, timeout: float | None) -> RequestState:
        check_seconds("timeout", timeout, optional=True)
        now = self._clock()
        if generate.request_id in self.requests:
            raise InvalidRequest(f"request {generate.request_id} is already in flight")
        try:
            frame = CLIENT_REQUEST.encode(generate)  # a request that cannot be sent is never registered
        except Exception as exc:  # whatever the encoder refuses is this request's fault alone
            raise InvalidRequest(
                f"request {generate.request_id} cannot be encoded: {type(exc).__name__}: {exc}"
            ) from None
        # A tokenizer drops the connection of a bigger message unread: the request would be
        # resubmitted after every probe, unanswered, until its timeout (forever without one).
        if len(frame) > DEFAULT_MAX_MSG_BYTES:
            raise InvalidRequest(
                f"request {generate.request_id:.80} is {len(frame)} bytes encoded; a tokenizer reads "
                f"at most {DEFAULT_MAX_MSG_BYTES} (its prompt, messages, tools or id are too long)"
            )
        state = RequestState(generate, None if timeout is None else now + timeout, now)
        self.requests[state.request_id] = state
        try:
            self._dispatch(state, now, avoid=None)
        except BaseException:
            del self.requests[state.request_id]
            raise
        return state

    def cancel(self, request_id: str) -> None:
        """Forget a request; tell its replica to abort it unless it already finished."""
        state = self.requests.pop(request_id, None)
        if state is not None and state.finish_reason is None and state.replica is not None:
            self._abort(state.replica, request_id)

    def _abort(self, replica: int, request_id: str) -> None:
        if self._send(replica, CLIENT_REQUEST.encode(m.Abort(request_id))):
            self.unanswered_aborts.setdefault((replica, request_id), []).append(self._clock())

    def add_replicas(self, endpoints: Sequence[str]) -> None:
        """Replicas the run added (a hot reload of tokenizer.replicas): they take requests from now."""
        self.replicas += [_Replica(ep) for ep in endpoints]

    def in_flight(self, replica: int) -> int:
        return sum(1 for s in self.requests.values() if s.replica == replica and not s.is_done)

    def _dispatch(self, state: RequestState, now: float, avoid: int | None) -> None:
        """Send (or resend) a request to the best replica: live ones first, least loaded, round robin."""
        n = len(self.replicas)
        order = sorted(
            range(n),
            key=lambda i: (
                i == avoid and n > 1,
                self.replicas[i].is_suspect,
                self.in_flight(i),
                (i - self._next) % n,
            ),
        )
        frame = CLIENT_REQUEST.encode(state.resubmission())
        state.replica = None
        for i in order:
            if self._send(i, frame):
                state.replica, state.sent_at = i, now
                self._next = (i + 1) % n
                return

    # -- input ---------------------------------------------------------------------------------

    def receive(self, replica: int, frame: bytes) -> None:
        try:
            reply = CLIENT_REPLY.decode(frame)
        except MalformedMessage:
            self.num_malformed += 1
            return
        now = self._clock()
        rep = self.replicas[replica]
        rep.last_seen, rep.is_suspect = now, False
        if isinstance(reply, m.HealthReply):
            rep.health, rep.health_at = reply, now
            self._resubmit_missing(replica, reply.missing, now)
            return
        if isinstance(reply, m.AdapterReply):
            self.adapter_replies[reply.request_id] = reply
            return
        if isinstance(reply, m.ErrorReply) and not reply.request_id:
            self._fail_unattributed(replica, reply)
            return
        if (replica, reply.request_id) in self.unanswered_aborts:
            if is_abort_answer(reply):
                self._answered_abort(replica, reply.request_id)
            return
        state = self.requests.get(reply.request_id)
        # Only the replica now running a request speaks for it: one we failed over from may
        # still answer and must not end the request.
        if state is None or state.replica != replica or state.is_done:
            return
        state.heard_at, state.is_acked = now, True
        if isinstance(reply, m.Delta):
            state.is_admitted = True
            state.apply(reply)
        elif reply.code == "unavailable" and self._has_other_live_replica(replica):
            rep.is_suspect = True  # draining or shutting down: another replica takes it
            self.num_failovers += 1
            self._dispatch(state, now, avoid=replica)
        else:
            if reply.code == "unavailable":
                rep.is_suspect = True
            state.error = error_for(reply.code, reply.message)

    def _has_other_live_replica(self, replica: int) -> bool:
        """Whether another replica may take a request: when the whole run is stopping, every one
        says "unavailable" in turn and sending the request round them would only delay the error."""
        return any(not rep.is_suspect for i, rep in enumerate(self.replicas) if i != replica)

    def _fail_unattributed(self, replica: int, reply: m.ErrorReply) -> None:
        """An error about a message the replica could not even read an id from. It answers each
        connection's messages in order, and this session sends only well-formed requests, so the
        culprits can only be requests it has not answered for yet: fail those rather than let
        them wait for a reply that will never come."""
        for state in self.requests.values():
            if state.replica == replica and not state.is_acked and not state.is_done:
                state.error = error_for(
                    reply.code, f"the tokenizer could not read request {state.request_id}: {reply.message}"
                )

    def on_handshake(self, replica: int, error: str | None, is_dropped: bool = False) -> None:
        """A CURVE handshake with `replica` succeeded (None) or failed (why). A dropped one (the
        server closed it without a reason) is what a wrong server key gives, on every retry, but
        also a tokenizer killed mid-handshake, once, before its restart answers: it counts only
        once drops have gone on for HANDSHAKE_DROPS_FOR_S with no success between."""
        rep = self.replicas[replica]
        if error is None:
            rep.handshake_error, rep.dropped_since = None, None
            return
        if not is_dropped:
            rep.handshake_error = error
            return
        now = self._clock()
        if rep.dropped_since is None:
            rep.dropped_since = now
        if now - rep.dropped_since >= HANDSHAKE_DROPS_FOR_S:
            rep.handshake_error = error

    def _check_handshakes(self) -> None:
        """Fail everything in flight when every replica refused our handshake: no request can
        get through, and waiting out `unavailable_after` would only delay a clear error."""
        errors = [rep.handshake_error for rep in self.replicas]
        if not all(errors):
            return
        why = "; ".join(sorted({f"{rep.endpoint}: {rep.handshake_error}" for rep in self.replicas}))
        for state in self.requests.values():
            if not state.is_done:
                state.error = AuthenticationFailed(f"CURVE handshake failed with every tokenizer: {why}")

    def _answered_abort(self, replica: int, request_id: str) -> None:
        sent = self.unanswered_aborts[(replica, request_id)]
        sent.pop(0)
        if not sent:
            del self.unanswered_aborts[(replica, request_id)]

    def _forget_unanswered_aborts(self, now: float) -> None:
        """A replica that died with an Abort unanswered never answers it; after failover_after its
        id is free again (a reply dropped meanwhile only makes the new request fail over)."""
        for (replica, request_id), sent in list(self.unanswered_aborts.items()):
            while sent and now - sent[0] > self.failover_after:
                self._answered_abort(replica, request_id)

    def tick(self) -> None:
        """Timeouts, failover, unsent requests and health probes of replicas running our requests."""
        now = self._clock()
        self._check_run(now)
        self._forget_unanswered_aborts(now)
        self._check_handshakes()
        for state in self.requests.values():
            if state.is_done:
                continue
            if state.deadline is not None and now >= state.deadline:
                state.error = RequestTimeout(f"request {state.request_id} timed out")  # cancel() aborts it
                continue
            if state.replica is not None:
                state.heard_at = max(state.heard_at, self.replicas[state.replica].last_seen)
            if now - state.heard_at > self.unavailable_after:
                state.error = ServerUnavailable(f"no tokenizer answered for {self.unavailable_after:.0f}s")
            elif state.replica is None:
                self._dispatch(state, now, avoid=None)
            elif now - max(state.sent_at, self.replicas[state.replica].last_seen) > self.failover_after:
                self._failover(state, now)
        for i, rep in enumerate(self.replicas):
            if now - rep.last_probe > self.probe_interval and self.in_flight(i):
                self.probe(i)

    def _check_run(self, now: float) -> None:
        """Fail everything in flight once the run itself is gone (its supervisor was killed and
        took every stage with it): no replica will ever answer, so waiting out
        `unavailable_after` would only delay the error."""
        if self._is_run_alive is None or now - self._run_checked_at < RUN_CHECK_INTERVAL_S:
            return
        pending = [s for s in self.requests.values() if not s.is_done]
        if not pending:
            return
        self._run_checked_at = now
        if self.run_has_ended():
            for state in pending:
                state.error = ServerUnavailable(RUN_ENDED)

    def run_has_ended(self) -> bool:
        """Whether the run's supervisor is known to be gone (False when the client cannot tell)."""
        return self._is_run_alive is not None and not self._is_run_alive()

    def _resubmit_missing(self, replica: int, request_ids: list[str], now: float) -> None:
        """The replica answered a probe without these requests: a restart lost them, or they were
        lost on the way (a connection that dropped under them). Each goes again, with what was
        received so far; one that has ended or moved since the probe is left alone."""
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is not None and state.replica == replica and not state.is_done:
                self.num_failovers += 1
                self._dispatch(state, now, avoid=None)

    def _failover(self, state: RequestState, now: float) -> None:
        old = state.replica
        assert old is not None
        self.replicas[old].is_suspect = True
        self.num_failovers += 1
        if len(self.replicas) > 1:
            # If it was only slow, stop it; on the same replica the resubmission replaces it.
            self._abort(old, state.request_id)
        self._dispatch(state, now, avoid=old)

    def send_adapter_command(self, command: m.AdapterCommand) -> bool:
        """Send a LoRA adapter command to one replica, live ones first (any replica reaches every
        engine group); its answer lands in `adapter_replies`. False when none is connected."""
        order = sorted(range(len(self.replicas)), key=lambda i: self.replicas[i].is_suspect)
        frame = CLIENT_REQUEST.encode(command)
        return any(self._send(i, frame) for i in order)

    def probe(self, replica: int) -> bool:
        """Ask the replica whether it is alive and which of our requests on it it holds; False
        when it is not connected."""
        self.replicas[replica].last_probe = self._clock()
        running = [s.request_id for s in self.requests.values() if s.replica == replica and not s.is_done]
        return self._send(replica, CLIENT_REQUEST.encode(m.Health(running)))


def _close_sockets(ctx: zmq.Context, sockets: list[zmq.Socket], monitors: dict[int, zmq.Socket]) -> None:
    for sock in sockets:
        sock.close(linger=CLOSE_LINGER_MS)
    for monitor in monitors.values():
        monitor.close(linger=0)
    ctx.term()


class ClientBase:
    """What both clients share: where the run listens, one DEALER per tokenizer replica, the
    session, and closing. A client that is dropped without `close()` closes its sockets when it
    is collected, before its context: zmq's Context.term waits for every socket of the context,
    so a context collected first (garbage cycles are finalized in any order) would hang the
    process for good.
    """

    def __init__(
        self,
        target: Path | str | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        timeout: float | None = None,
        failover_after: float = 5.0,
        unavailable_after: float = 30.0,
        server_key: ServerKey | None = None,
        keys: ClientKeys | None = None,
    ) -> None:
        check_seconds("timeout", timeout, optional=True)
        # 0 would fail over at every tick, or fail a request at its first check
        check_seconds("failover_after", failover_after, positive=True)
        check_seconds("unavailable_after", unavailable_after, positive=True)
        info = connect_info(target, endpoints, server_key, keys)
        self.model = info.model
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._monitors: dict[int, zmq.Socket] = {}  # replica -> sync PAIR, also for an asyncio client
        self._has_keys = info.curve_keys is not None
        self._closer = weakref.finalize(self, _close_sockets, self._ctx, self._sockets, self._monitors)
        self._curve = (info.curve_server_key, info.curve_keys)
        try:
            self._open_dealers(info.endpoints)
        except BaseException:
            self._closer()  # the context's term would otherwise wait for these sockets at exit
            raise
        pid = info.supervisor_pid
        self.session = Session(
            info.endpoints,
            self._send,
            failover_after,
            unavailable_after,
            is_run_alive=None if pid is None else lambda: is_process_alive(pid),
        )
        self._tick_s = min(0.05, failover_after / 10)

    def _open_dealers(self, endpoints: Sequence[str]) -> None:
        """A DEALER to each of `endpoints`, the replicas after those the client has."""
        monitor_ctx = zmq.Context.shadow(self._ctx.underlying)
        for replica, endpoint in enumerate(endpoints, start=len(self._sockets)):
            sock = open_dealer(self._ctx, endpoint, *self._curve)
            self._sockets.append(sock)
            if endpoint.startswith("tcp://"):  # where a handshake can fail: tell why, at once
                address = f"inproc://brigade-client-{id(self)}-{replica}"
                sock.monitor(address, HANDSHAKE_EVENTS)
                monitor = monitor_ctx.socket(zmq.PAIR)
                monitor.connect(address)
                self._monitors[replica] = monitor

    def add_replicas(self, endpoints: Sequence[str]) -> None:
        """Connect to the replicas in `endpoints` (the run's whole list, as run.json has it) past
        those the client knows: a long-lived client (a gateway's) learns of replicas a hot reload
        added. Replicas that went stay: sends to them fail at once and go to another."""
        self._check_open()
        new = list(endpoints[len(self._sockets) :])
        self._open_dealers(new)
        self.session.add_replicas(new)

    def _send(self, replica: int, frame: bytes) -> bool:
        raise NotImplementedError

    def _check_open(self) -> None:
        if not self._closer.alive:
            raise ClientClosed("this client is closed: make a new one")

    def _read_handshakes(self) -> None:
        """Tell the session how the CURVE handshakes went (non-blocking)."""
        for replica, monitor in self._monitors.items():
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())
                is_dropped = event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                self.session.on_handshake(replica, handshake_failure(event, self._has_keys), is_dropped)

    def _end(self, request_id: str) -> None:
        """Forget a request nobody reads any more, aborting it unless it finished. When the
        collector has closed the sockets first (a stream left open at exit, or in a reference
        cycle with its client), there is nothing to send the Abort through, and no need: the
        tokenizer aborts the requests of a connection that went away. Sending raised
        ClientClosed there, printed as "Exception ignored" for every such stream."""
        if self._closer.alive:
            self.session.cancel(request_id)
        else:
            self.session.requests.pop(request_id, None)

    def _close(self) -> None:
        """Abort what is in flight (a stream still read raises ClientClosed), then close the
        sockets (bounded by CLOSE_LINGER_MS)."""
        for request_id, state in list(self.session.requests.items()):
            state.error = state.error or ClientClosed("the client was closed while this request ran")
            self.session.cancel(request_id)
        self._closer()


class Client(ClientBase):
    """Synchronous client of a running Brigade: one DEALER per tokenizer replica.

    Not thread-safe: use one Client per thread. Streams may be interleaved in one thread. The
    exception is `close()`, which may come from any thread (a main thread shutting down its
    workers): a stream open in another thread then raises ClientClosed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Held while the sockets are used, so that close() from another thread waits for the
        # stream's thread to leave them (at most one poll, `_tick_s`) instead of closing a socket
        # under its poll or send: that failed the stream with a bare ZMQError, or worse.
        self._io_lock = threading.RLock()
        self._poller = zmq.Poller()
        for sock in self._sockets:
            self._poller.register(sock, zmq.POLLIN)
        self._index = {sock: i for i, sock in enumerate(self._sockets)}

    def add_replicas(self, endpoints: Sequence[str]) -> None:
        known = len(self._sockets)
        super().add_replicas(endpoints)
        for i, sock in enumerate(self._sockets[known:], start=known):
            self._poller.register(sock, zmq.POLLIN)
            self._index[sock] = i

    def _send(self, replica: int, frame: bytes) -> bool:
        with self._io_lock:
            self._check_open()
            try:
                self._sockets[replica].send(frame, zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True

    def _pump(self, timeout: float) -> None:
        with self._io_lock:
            self._check_open()
            for sock, _ in self._poller.poll(max(0, int(timeout * 1000))):
                i = self._index[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.session.receive(i, frames[0])
            self._read_handshakes()
            self.session.tick()

    def stream(
        self,
        prompt: Prompt | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> Iterator[StreamDelta]:
        """Yield the output as it comes; closing the iterator early aborts the request."""
        generate = make_generate(request_id, prompt, messages, sampling)
        return self._stream(generate, timeout if timeout is not None else self.timeout)

    def _stream(self, generate: m.Generate, timeout: float | None) -> Iterator[StreamDelta]:
        state = self.session.submit(generate, timeout)
        try:
            while True:
                while state.ready:
                    delta = state.ready.popleft()
                    yield delta
                    if delta.finish_reason is not None:
                        return
                if state.error is not None:
                    raise state.error
                # Not sent yet (no replica connected so far): retry soon rather than at the next tick.
                self._pump(self._tick_s if state.replica is not None else 0.005)
        finally:
            self._end(state.request_id)

    def generate(
        self, prompt: Prompt, *, timeout: float | None = None, request_id: str | None = None, **sampling: Any
    ) -> GenerateResult:
        return self._collect(self.stream(prompt, timeout=timeout, request_id=request_id, **sampling))

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> GenerateResult:
        """One assistant reply; the tokenizer applies the model's chat template. `tools=`,
        `tool_choice=` and `parallel_tool_calls=` take OpenAI's forms; the result's `tool_calls`
        and `content` are the reply cut into calls and text (finish_reason "tool_calls")."""
        return self._collect(
            self.stream(messages=messages, timeout=timeout, request_id=request_id, **sampling)
        )

    def stream_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> Iterator[StreamDelta]:
        return self.stream(messages=messages, timeout=timeout, request_id=request_id, **sampling)

    def embed(
        self,
        inputs: EmbedInput,
        *,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
    ) -> EmbedResult:
        """One vector per input from a model served for embeddings (model.task: embed). The
        inputs go out together, so the engine batches them; `dimensions` keeps each vector's
        first that many values (normalized again where the model normalizes);
        `truncate_prompt_tokens` (vLLM's) embeds each input's last that many tokens, -1 its last
        the model reads (else an input that is too long is refused)."""
        timeout = timeout if timeout is not None else self.timeout
        check_seconds("timeout", timeout, optional=True)
        deadline = None if timeout is None else time.monotonic() + timeout  # the whole call's
        requests = make_embeds(inputs, dimensions, truncate_prompt_tokens)
        states: list[RequestState] = []
        try:
            while True:
                # Sent MAX_EMBEDS_IN_FLIGHT at a time, each as soon as there is room, before any
                # is waited for (the engine batches those in flight). Once one is refused the
                # call fails: the inputs not sent yet are not (`embed_error` reads those sent).
                refused = any(state.error is not None for state in states)
                num_in_flight = sum(not state.is_done for state in states)
                room = 0 if refused else MAX_EMBEDS_IN_FLIGHT - num_in_flight
                # Past the first window an input goes once an earlier one was served: the run
                # admitted the call, and a stopping run lets it finish (m.Generate.continues).
                continues = any(state.finish_reason is not None for state in states)
                for request in requests[len(states) : len(states) + room]:
                    request.continues = continues
                    states.append(self.session.submit(request, seconds_left(deadline)))
                if (refused or len(states) == len(requests)) and all(state.is_done for state in states):
                    break
                # Not sent yet (no replica connected so far): retry soon rather than at the next tick.
                unsent = any(state.replica is None for state in states)
                self._pump(0.005 if unsent else self._tick_s)
            error = embed_error([state.error for state in states])
            if error is not None:
                raise error
            return embed_result([state.result() for state in states])
        finally:
            for state in states:
                self._end(state.request_id)

    @staticmethod
    def _collect(deltas: Iterator[StreamDelta]) -> GenerateResult:
        return collect_result(list(deltas))

    def health(self, timeout: float = 5.0) -> list[m.HealthReply]:
        """Ask every replica; the replies that came back within `timeout` (ServerUnavailable if none)."""
        check = HealthCheck(self.session, timeout, self._tick_s)
        while (wait := check.next_wait()) is not None:
            self._pump(wait)
        return check.replies()

    def close(self) -> None:
        with self._io_lock:
            self._close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
