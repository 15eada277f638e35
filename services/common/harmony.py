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
from dataclasses import dataclass, field, replace
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
    """A message's body `text[start:end]` (so far, while `complete` is False), what it is, for a
    call the function's name, and where its header starts (a call's place: an empty body starts
    where the next message does)."""

    kind: Kind
    start: int
    end: int
    complete: bool
    name: str | None = None
    header_start: int = 0


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


def _first(text: str, tags: tuple[str, ...], start: int, end: int | None = None) -> tuple[int, str]:
    """The first of tags in text[start:end]: (where, which), or (-1, "")."""
    best, which = -1, ""
    for tag in tags:
        at = text.find(tag, start, end)
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
    if CHANNEL not in header:
        return None
    role_part, channel_part = header.split(CHANNEL, 1)
    if any(marker in channel_part for marker in MARKERS if marker != CONSTRAIN):
        return None
    role_words = role_part.replace(CONSTRAIN, " ").split()  # a content type has no place here
    channel_words = channel_part.replace(CONSTRAIN, " ").split()
    if [w for w in role_words if not w.startswith("to=")] not in ([], ["assistant"]) or not channel_words:
        return None
    recipient = next((w[3:] for w in role_words + channel_words if w.startswith("to=")), None)
    if recipient is not None:
        name = recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else recipient
        return ("call", name) if name else None
    return ("reasoning", None) if channel_words[0] == "analysis" else ("content", None)


@dataclass
class ScanState:
    """Where the scan of a growing text (a stream's) resumes: the messages complete so far, which
    more text cannot change, the position after them, and the open message's body and how far it
    is known to hold no end marker. It makes each step's scan cost the new text, not the whole."""

    done: list[Message] = field(default_factory=list)
    pos: int = 0
    open: Message | None = None  # the last message, its body still growing
    search_from: int = 0  # no body end before this position in the open message


def scan(text: str, final: bool, state: ScanState | None = None) -> list[Message]:
    """The messages of a harmony output, in order; with final=False the text is still growing:
    the last message may be partial, and a header or a marker not yet certain is held back.
    `state` (one per growing text) carries what earlier scans of its prefixes found."""
    state = state or ScanState()
    out, pos = list(state.done), state.pos
    while pos < len(text):
        if state.open is not None:  # the message at pos, opened by an earlier scan
            message, search_from = state.open, state.search_from
        else:
            opened = _open_message(text, pos, final)
            if opened is None:
                return out  # the header is still being written
            message, search_from = opened
        # A body ends at a terminator, or at a <|start|> after its own first character (a broken
        # header's text may itself start with <|start|>).
        stop, tag = _first(text, BODY_ENDS, search_from)
        if stop < 0:
            held = 0 if final else _held(text[max(search_from, len(text) - len(RETURN)) :], BODY_ENDS)
            message = replace(message, end=len(text) - held, complete=final)
            state.open, state.search_from = message, max(search_from, len(text) - len(RETURN))
            return [*out, message]
        out.append(replace(message, end=stop, complete=True))
        pos = stop if tag == START else stop + len(tag)
        state.done, state.pos, state.open = list(out), pos, None
    return out


def _open_message(text: str, pos: int, final: bool) -> tuple[Message, int] | None:
    """The message whose header starts at pos, with its body empty so far, and where to look for
    its body's end; None while the header is still being written."""
    # Past MAX_HEADER_CHARS there is no header to find: the window bounds the search.
    window = pos + MAX_HEADER_CHARS + len(MESSAGE)
    message_at = text.find(MESSAGE, pos, window)
    # A header ends at its <|message|>; a terminator before that makes it no header.
    end_at, _ = _first(text, TERMINATORS, pos, window)
    header_end = message_at if message_at >= 0 and (end_at < 0 or message_at < end_at) else -1
    header = text[pos:window] if header_end < 0 else text[pos:header_end]
    kind_name = None
    if header_end >= 0:
        if len(header) <= MAX_HEADER_CHARS and _could_open(header):
            kind_name = classify(header)
    elif not final and _could_open(header) and end_at < 0 and len(text) < window:
        return None  # a <|message|> may still end the header within its window
    if kind_name is None:
        # No header here: its text, and what follows up to the next terminator, is content.
        return Message("content", pos, pos, False, None, pos), pos + 1
    body_start = header_end + len(MESSAGE)
    kind, name = kind_name
    return Message(kind, body_start, body_start, False, name, pos), body_start
