"""Model text -> OpenAI `tool_calls`, whole or as stream deltas. Pure Python (the light stages use it).

Formats (`ToolParser(format)`):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around
  them is content (Qwen2.5- and SmolLM-class templates, and tools_prompt.py's instruction);
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` calls joined by `;`,
  optionally after `<|python_tag|>` (Llama 3.1+ JSON tool calling); any other output is content;
- `named` / `required`: what ipc.structured_output.for_tool_choice forces: the arguments object
  of the named function, or a JSON array of `{"name", "parameters"}`;
- `harmony`: gpt-oss's channels (services/common/harmony.py): `commentary to=functions.NAME`
  messages are calls, `final` ones content, and `analysis` ones reasoning, a third kind of
  piece (`Reasoning`) that this format alone has. A harmony header declares its call, so a call
  is a call whatever its body (and one cut off by max_tokens keeps the arguments written so far).

One scanner serves both uses: `segments(text, final)` cuts the text into content and calls, where
a call knows its name once the name's string is complete, and its arguments as the raw text the
model wrote (a prefix of it while the call is still streaming). `ToolCallStream` turns the growth
of those segments into deltas, so the concatenated argument deltas are exactly the final
`arguments` string. Ids are derived from the request id and the call's index, so a stream
resumed after a fault names its calls as before.

A call whose JSON turns out invalid once complete, or that the output ends inside, is content
(and `parse` reports no call for it; a hermes block is content up to its closing tag, and parsing
goes on after it), except in the forced formats, where a call cut off by max_tokens is a call
with the arguments written so far (and finish_reason `length`), streamed or not. A stream cannot take back a call it has announced: it ends that call with the
arguments sent so far, and the call's text never becomes content.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from services.common import harmony

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
WHITESPACE = " \t\r\n"
FORMATS = ("hermes", "llama3_json", "named", "required", "harmony")
FORCED = ("named", "required")  # the formats a grammar forces: the whole output is calls


class Incomplete(Exception):
    """The text ends inside the JSON value being scanned."""


class Invalid(Exception):
    """The text cannot be what the format expects here."""


@dataclass
class Call:
    """A tool call in the text, from `start` (its tag or its '{'); `args_end` is None while its
    arguments are still being written."""

    start: int
    name: str | None
    args_start: int | None
    args_end: int | None
    complete: bool


@dataclass
class Content:
    start: int
    end: int


@dataclass
class Reasoning:
    """Reasoning in the text (harmony's analysis channel)."""

    start: int
    end: int


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None  # harmony's analysis channel; the other formats have none
    # A call the output ends inside (a forced call cut by max_tokens or by a stop string): it is
    # reported with the arguments written so far, but the output did not finish its calls.
    has_cut_call: bool = False


def call_id(request_id: str, index: int) -> str:
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def finish_reason(engine_reason: str, has_finished_calls: bool) -> str:
    """OpenAI's finish_reason: tool_calls when the output made calls, each one complete, and was
    not cut short. A stop string that cuts a forced call leaves the engine's `stop` and a call whose
    arguments are not valid JSON: `tool_calls` would tell the client to run it."""
    return "tool_calls" if has_finished_calls and engine_reason == "stop" else engine_reason


# ------------------------------------------------------------------ the JSON scanner


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int:
    """text[i] is '"': the index after the closing quote."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    raise Incomplete


def _value_end(text: str, i: int) -> int:
    """The index after the JSON value starting at text[i] (its syntax is checked once complete)."""
    if i >= len(text):
        raise Incomplete
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                i = _string_end(text, i)
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        raise Incomplete
    start = i
    while i < len(text) and text[i] not in ",}]" + WHITESPACE:
        i += 1
    if i == len(text):
        raise Incomplete  # a number or literal may still go on
    if i == start:
        raise Invalid
    return i


def _scan_call(text: str, i: int, args_key: str) -> tuple[Call, int | None]:
    """The call object at text[i] ('{'): its name and arguments so far, and where it ends."""
    call = Call(i, None, None, None, False)
    if i >= len(text):
        return call, None
    if text[i] != "{":
        raise Invalid
    i += 1
    try:
        while True:
            i = _skip_ws(text, i)
            if i >= len(text):
                raise Incomplete
            if text[i] == "}":
                call.complete = True
                return call, i + 1
            if text[i] == ",":
                i += 1
                continue
            if text[i] != '"':
                raise Invalid
            key_end = _string_end(text, i)
            key = json.loads(text[i:key_end])
            i = _skip_ws(text, key_end)
            if i >= len(text):
                raise Incomplete
            if text[i] != ":":
                raise Invalid
            start = _skip_ws(text, i + 1)
            if key == args_key:
                call.args_start = start
                if start < len(text) and text[start] != "{":
                    raise Invalid
            end = _value_end(text, start)
            if key == "name":
                name = json.loads(text[start:end])
                if not isinstance(name, str):
                    raise Invalid
                call.name = name
            elif key == args_key:
                call.args_end = end
            i = end
    except Incomplete:
        return call, None


def _valid(text: str, start: int, end: int, call: Call) -> bool:
    """A complete call is valid JSON with a string name and an object of arguments."""
    try:
        obj = json.loads(text[start:end])
    except ValueError:
        return False
    return call.name is not None and isinstance(obj, dict) and call.args_end is not None


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may be a tag yet)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ------------------------------------------------------------------ formats


def _hermes(text: str, final: bool) -> list[Call | Content]:
    out: list[Call | Content] = []
    pos = 0
    while True:
        k = text.find(HERMES_OPEN, pos)
        if k < 0:
            end = len(text) if final else len(text) - _held_prefix(text[pos:], HERMES_OPEN)
            out.append(Content(pos, end))
            return out
        out.append(Content(pos, k))
        body = _skip_ws(text, k + len(HERMES_OPEN))
        try:
            call, end = _scan_call(text, body, "arguments")
        except Invalid:
            call, end = None, None
        if call is not None:
            call.start = k
            if end is None:  # still being written; at the end of the output, cut off: content
                out.append(call if not final else Content(k, len(text)))
                return out
            close = _skip_ws(text, end)
            rest = text[close : close + len(HERMES_CLOSE)]
            if not final and len(rest) < len(HERMES_CLOSE) and HERMES_CLOSE.startswith(rest):
                call.complete = False  # complete only with its closing tag
                out.append(call)
                return out
            # Some models end at eos without the closing tag; the call is whole all the same.
            if _valid(text, body, end, call) and (rest == HERMES_CLOSE or close == len(text)):
                out.append(call)
                pos = close + len(rest)
                continue
        # Not a call: the block is content, up to its closing tag; parsing goes on after it.
        close_at = text.find(HERMES_CLOSE, k)
        if close_at < 0:
            out.append(Content(k, len(text)))
            return out
        out.append(Content(k, close_at + len(HERMES_CLOSE)))
        pos = close_at + len(HERMES_CLOSE)


def _json_calls(
    text: str,
    final: bool,
    args_key: str,
    start: int,
    separator: str,
    closer: str | None,
    forced: bool = False,
):
    """Calls one after another from text[start], joined by `separator`, up to `closer` if any.
    `forced`: the grammar made the text calls, so a call cut off is a call (see `_forced_cut`)."""
    out: list[Call | Content] = []
    i = start
    while True:
        i = _skip_ws(text, i)
        try:
            call, end = _scan_call(text, i, args_key)
        except Invalid:
            return [Content(0, len(text))] if not out else [*out, Content(i, len(text))]
        if end is None:
            if not final:
                return [*out, call]
            if forced:
                return [*out, *_forced_cut(call)]
            # Cut off: the call is content, and with no call before it so is the whole output.
            return [Content(0, len(text))] if not out else [*out, Content(i, len(text))]
        if not _valid(text, i, end, call):
            return [Content(0, len(text))] if not out else [*out, Content(i, len(text))]
        out.append(call)
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == separator:
            i += 1
            continue
        if closer is not None and i < len(text) and text[i] == closer:
            i += 1
        if i < len(text):
            out.append(Content(i, len(text)))
        return out


def _forced_cut(call: Call) -> list[Call | Content]:
    """A forced call (tool_choice required or named) that max_tokens cut off: a call with the
    arguments written so far, as a stream has announced it, once its name is known; before that,
    nothing. Its text is never content: the grammar made it a call, and a reply streamed or not
    reports the same calls."""
    return [call] if call.name is not None else []


def _llama3_json(text: str, final: bool) -> list[Call | Content]:
    i = _skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, i):
        i += len(PYTHON_TAG)
    elif not final and PYTHON_TAG.startswith(text[i:]):
        return []  # nothing yet, or the start of the tag
    i = _skip_ws(text, i)
    if i >= len(text):
        return [] if not final else [Content(0, len(text))]
    if text[i] != "{":
        return [Content(0, len(text))]
    return _json_calls(text, final, "parameters", i, ";", None)


def _required(text: str, final: bool) -> list[Call | Content]:
    i = _skip_ws(text, 0)
    if i >= len(text):
        return []
    if text[i] != "[":
        return [Content(0, len(text))]
    return _json_calls(text, final, "parameters", i + 1, ",", "]", forced=True)


def _named(text: str, final: bool, name: str) -> list[Call | Content]:
    start = _skip_ws(text, 0)
    if start >= len(text):
        return []
    if text[start] != "{":
        return [Content(0, len(text))]
    try:
        end = _value_end(text, start)
    except Incomplete:
        return (
            _forced_cut(Call(start, name, start, None, False))
            if final
            else [Call(start, name, start, None, False)]
        )
    try:
        valid = isinstance(json.loads(text[start:end]), dict)
    except ValueError:
        valid = False
    return [Call(start, name, start, end, True)] if valid else [Content(0, len(text))]


def _harmony(text: str, final: bool, state: harmony.ScanState | None) -> list[Call | Content | Reasoning]:
    out: list[Call | Content | Reasoning] = []
    for message in harmony.scan(text, final, state):
        if message.kind == "call":
            # The arguments end where the body is certain to (a marker's first characters are
            # held back): a stream sends no more than that.
            out.append(Call(message.header_start, message.name, message.start, message.end, message.complete))
        elif message.kind == "reasoning":
            out.append(Reasoning(message.start, message.end))
        else:
            out.append(Content(message.start, message.end))
    return out


class ToolParser:
    """Cuts a model's output into content and tool calls, in one format."""

    def __init__(
        self, fmt: str, *, function_name: str | None = None, parallel_tool_calls: bool = True
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool call format {fmt!r}; use one of {list(FORMATS)}")
        if (fmt == "named") != (function_name is not None):
            raise ValueError("the 'named' format, and only it, takes a function_name")
        self.format = fmt
        self.function_name = function_name
        self.max_calls = None if parallel_tool_calls else 1

    def segments(
        self, text: str, final: bool, state: harmony.ScanState | None = None
    ) -> list[Call | Content | Reasoning]:
        """Content and calls; with final=False, text still growing: the last piece may be partial,
        and content that may be the start of a tag is held back. `state`: a harmony stream's scan
        so far (the other formats rescan)."""
        if self.format == "hermes":
            out = _hermes(text, final)
        elif self.format == "llama3_json":
            out = _llama3_json(text, final)
        elif self.format == "required":
            out = _required(text, final)
        elif self.format == "harmony":
            out = _harmony(text, final, state)
        else:
            out = _named(text, final, self.function_name or "")
        if self.max_calls is not None:
            calls = 0
            kept = []
            for s in out:
                calls += isinstance(s, Call)
                if not isinstance(s, Call) or calls <= self.max_calls:
                    kept.append(s)
            out = kept
        return out

    def parse(self, text: str, request_id: str) -> ParsedOutput:
        """The whole output -> content and OpenAI `tool_calls`."""
        calls = []
        content = []
        reasoning = []
        has_cut_call = False
        for s in self.segments(text, final=True):
            if isinstance(s, Reasoning):
                reasoning.append(text[s.start : s.end])
            elif isinstance(s, Content):
                piece = text[s.start : s.end]
                # Whitespace between and after calls is layout, not content (as in a stream).
                if piece.strip() or not calls:
                    content.append(piece)
            elif s.complete or self.format in FORCED:
                end = s.args_end if s.args_end is not None else len(text)
                arguments = text[s.args_start : end] if s.args_start is not None else ""
                calls.append(_tool_call(call_id(request_id, len(calls)), s.name or "", arguments))
                has_cut_call = has_cut_call or not s.complete
        joined = "".join(content)
        thought = "".join(reasoning) or None
        if calls or self.format in FORCED:
            return ParsedOutput(joined.strip() or None, calls, thought, has_cut_call)
        return ParsedOutput(joined, [], thought)


def _tool_call(id_: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """Feeds text deltas, returns OpenAI chat-completion delta objects (`{"content": ...}`,
    `{"tool_calls": [...]}` and, from harmony, `{"reasoning_content": ...}`), in text order;
    `finish()` flushes what was held back.

    Pieces are tracked by where they start in the text, which only grows: a call keeps its index,
    and a call once announced keeps it even if its JSON later proves invalid (its text never
    becomes content). Whitespace between and after calls is layout, not content.
    """

    def __init__(self, parser: ToolParser, request_id: str) -> None:
        self.parser = parser
        self.request_id = request_id
        self.text = ""
        self._content_sent: dict[int, int] = {}  # content (or reasoning) piece start -> characters sent
        self._call_index: dict[int, int] = {}  # call start -> its index
        self._args_sent: list[int] = []  # per call index: characters of its arguments sent
        self._has_cut_call = False  # at finish: the output ended inside an announced call
        # A harmony stream's output is long (its reasoning): each step scans only the new text.
        self._scan = harmony.ScanState() if parser.format == "harmony" else None

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._call_index)

    @property
    def has_finished_calls(self) -> bool:
        """After `finish()`: the stream announced calls and the output ended none of them midway."""
        return self.has_tool_calls and not self._has_cut_call

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        return self._diff(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._diff(final=True)

    def _diff(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for s in self.parser.segments(self.text, final, self._scan):
            if isinstance(s, Reasoning):
                sent = self._content_sent.get(s.start, 0)
                if s.end - s.start > sent:
                    out.append({"reasoning_content": self.text[s.start + sent : s.end]})
                    self._content_sent[s.start] = s.end - s.start
                continue
            if isinstance(s, Content):
                end = min([s.end, *(p for p in self._call_index if s.start <= p < s.end)])
                if final and end < s.end:  # a call announced while streaming that the whole reads as text
                    self._has_cut_call = True
                sent = self._content_sent.get(s.start, 0)
                if sent == 0 and self.has_tool_calls and not self.text[s.start : end].strip():
                    continue
                if end - s.start > sent:  # only the new text is sliced: pieces can be long
                    out.append({"content": self.text[s.start + sent : end]})
                    self._content_sent[s.start] = end - s.start
                continue
            index = self._call_index.get(s.start)
            if final and not s.complete and (index is not None or s.name is not None):
                self._has_cut_call = True
            if index is None:
                if s.name is None:
                    break  # its header can only go out with the name
                index = self._call_index[s.start] = len(self._args_sent)
                self._args_sent.append(0)
                head = {"id": call_id(self.request_id, index), "type": "function"}
                out.append(_call_delta(index, {**head, "function": {"name": s.name, "arguments": ""}}))
            if s.args_start is not None:
                end = len(self.text) if s.args_end is None else s.args_end
                sent = self._args_sent[index]
                if end - s.args_start > sent:
                    out.append(
                        _call_delta(index, {"function": {"arguments": self.text[s.args_start + sent : end]}})
                    )
                    self._args_sent[index] = end - s.args_start
        return out


def _call_delta(index: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, **body}]}
