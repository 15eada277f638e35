"""gpt-oss's chat format, harmony: its output cut into channels. Pure Python (the light stages use it).

A harmony reply is a run of messages, each a header and a body:
`<|channel|>analysis<|message|>thinking...<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>`.
The prompt's generation prompt already wrote the first `<|start|>assistant`, so the output starts
at the first header. A header names the message's channel after `<|channel|>` and may name a
recipient (`to=functions.NAME`, in the role part or the channel part) and a content type
(`<|constrain|>json`, or a bare `json`); the body runs to `<|end|>`, to `<|return|>` (the end of
the reply), to `<|call|>` (the end of a tool call), or to the next `<|start|>`.

What each message becomes (`scan`):
- `analysis` -> reasoning (`reasoning_content`);
- a recipient (`functions.NAME` -> a call of NAME; a built-in tool's, such as `browser.search`, a
  call by that name) -> a tool call whose arguments are the body, as the model wrote them;
- `final`, and `commentary` without a recipient (a preamble the user may see) -> content;
- a header that cannot be one (no `<|channel|>`, an unknown role, a terminator inside it, longer
  than MAX_HEADER_CHARS, or text that does not start like a header) -> content: the header's text
  and its body, verbatim, up to the next terminator; the reply goes on after it.

The text is the detokenizer's with special tokens kept (the tokenizer asks for it for a harmony
chat), so the markers are text here whether the model wrote them as special tokens or not. A
stop token (`<|return|>`, `<|call|>`) may or may not end the text: the end of the output ends the
last message either way. With `final=False` (a stream), a header is held back until its
`<|message|>`, and a body's tail that may be the start of a marker until it is certain, so a
stream's pieces only grow and never change what they are: streamed and whole give the same split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TERMINATORS = (END, RETURN, CALL)  # end a body, and are consumed with it
BODY_ENDS = (*TERMINATORS, START)  # a <|start|> ends a body too, and opens the next header
# What a well-formed header starts with: the first one (the prompt wrote `<|start|>assistant`)
# starts with its channel or a role-part recipient (` to=functions.f<|channel|>...`), later ones
# with `<|start|>`.
HEADER_OPENINGS = (CHANNEL, START, " to=")
MAX_HEADER_CHARS = 512  # a header longer than this is no header: its text is content
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FUNCTIONS = "functions."
ARCHITECTURES = ("GptOssForCausalLM",)  # the models that speak harmony, by config.json's name

Kind = Literal["reasoning", "content", "call"]


@dataclass
class Message:
    """A message's body `text[start:end]` (so far, while `complete` is False), what it is, and
    for a call the function's name."""

    kind: Kind
    start: int
    end: int
    complete: bool
    name: str | None = None


def is_harmony_model(
    architectures: list[str], chat_template: str | None, has_token: Callable[[str], bool]
) -> bool:
    """gpt-oss by its architecture, or any model whose chat template writes harmony headers with
    a `<|channel|>` token of its own (a fine-tune under another architecture's name)."""
    if any(arch in ARCHITECTURES for arch in architectures):
        return True
    return bool(chat_template and CHANNEL in chat_template and has_token(CHANNEL))


def speaks_harmony(
    setting: str, architectures: list[str], chat_template: str | None, has_token: Callable[[str], bool]
) -> bool:
    """Whether chats are read as harmony under `gateway.reasoning_parser` = setting: `harmony`,
    or `auto` on a harmony model. The tokenizer (special tokens kept, the harmony tool parser for
    whole outputs) and the gateway (streams) decide it alike."""
    return setting == "harmony" or (
        setting == "auto" and is_harmony_model(architectures, chat_template, has_token)
    )


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of tags."""
    for n in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0


def _first(text: str, tags: tuple[str, ...], start: int) -> tuple[int, str]:
    """The first of tags in text from start: (where, which), or (-1, "")."""
    best, which = -1, ""
    for tag in tags:
        at = text.find(tag, start)
        if at >= 0 and (best < 0 or at < best):
            best, which = at, tag
    return best, which


def _could_open(header: str) -> bool:
    """Whether a header's text so far starts (or may yet start) as a header starts."""
    return any(header.startswith(o) or o.startswith(header) for o in HEADER_OPENINGS)


def classify(header: str) -> tuple[Kind, str | None] | None:
    """A complete header's text (without its `<|message|>`) -> what its body is, and a call's
    name; None when it is no header."""
    if header.startswith(START):
        header = header[len(START) :]
    if len(header) > MAX_HEADER_CHARS or CHANNEL not in header:
        return None
    role_part, channel_part = header.split(CHANNEL, 1)
    if any(marker in channel_part for marker in MARKERS if marker != CONSTRAIN):
        return None
    role_words = role_part.split()
    channel_words = channel_part.replace(CONSTRAIN, " ").split()
    if [w for w in role_words if not w.startswith("to=")] not in ([], ["assistant"]) or not channel_words:
        return None
    recipient = next((w[3:] for w in role_words + channel_words if w.startswith("to=")), None)
    if recipient is not None:
        name = recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else recipient
        return ("call", name) if name else None
    return ("reasoning", None) if channel_words[0] == "analysis" else ("content", None)


def scan(text: str, final: bool) -> list[Message]:
    """The messages of a harmony output, in order; with final=False the text is still growing:
    the last message may be partial, and a header or a marker not yet certain is held back."""
    out: list[Message] = []
    pos = 0
    while pos < len(text):
        message_at = text.find(MESSAGE, pos)
        # A header ends at its <|message|>; a terminator before that makes it no header.
        end_at, _ = _first(text, TERMINATORS, pos)
        header_end = message_at if message_at >= 0 and (end_at < 0 or message_at < end_at) else -1
        header = text[pos:] if header_end < 0 else text[pos:header_end]
        kind_name = None
        if header_end >= 0:
            kind_name = classify(header) if _could_open(header) else None
        elif not final and _could_open(header) and end_at < 0 and len(header) <= MAX_HEADER_CHARS:
            return out  # the header is still being written
        if kind_name is None:
            # No header here: its text, and what follows up to the next terminator, is content.
            body_start, kind, name = pos, "content", None
        else:
            body_start, (kind, name) = header_end + len(MESSAGE), kind_name
        # A body ends at a terminator, or at a <|start|> after its own first character (a broken
        # header's text may itself start with <|start|>).
        stop, tag = _first(text, BODY_ENDS, body_start + (kind_name is None))
        if stop < 0:
            end = len(text) if final else len(text) - _held(text[body_start:], BODY_ENDS)
            out.append(Message(kind, body_start, end, final, name))
            return out
        out.append(Message(kind, body_start, stop, True, name))
        pos = stop if tag == START else stop + len(tag)
    return out
