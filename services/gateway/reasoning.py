"""Reasoning models' output -> `reasoning_content` and `content`, whole or as stream deltas.

Reasoning models write their thinking between `<think>` and `</think>` before the answer. Two
styles (`gateway.reasoning_parser`, or `auto`: chosen from the model's chat template):

- `qwen3`: the model writes both tags (Qwen3, QwQ); the output is content until `<think>`, and
  reasoning from there to `</think>`. With `chat_template_kwargs: {"enable_thinking": false}` the
  template closes an empty think block in the prompt and the output is all content.
- `deepseek_r1`: the chat template opens `<think>` in the prompt (DeepSeek-R1 and its distills),
  so the output starts inside the reasoning and only `</think>` ends it; a `<think>` the model
  writes again at the start is dropped.

- `harmony`: gpt-oss's channels (services/common/harmony.py), chosen by `auto` for a harmony
  model (`is_harmony_model`): the `analysis` channel is the reasoning. Its output is read by the
  harmony tool-call parser (services/common/tool_parsers.py), which gives reasoning, content and
  calls in one pass, so no `ReasoningStream` reads it.

Only the first think block counts: after `</think>` the rest is content, verbatim. An output cut
off inside the reasoning (max_tokens) is all reasoning so far. A reply that continues an
assistant prefill (`continue_final_message`, Anthropic's prefill) starts where the prefill left
off: in the reasoning if the prefill opened a think block it did not close, else in the content
(no generation prompt opened one), whatever the style. A stream holds back a suffix that
may be the start of a tag, so a tag split over deltas (token by token) is still found, and the
concatenated deltas are exactly the whole split: streamed and not give the same two texts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

START, END = "<think>", "</think>"
ReasoningStyle = Literal["qwen3", "deepseek_r1", "harmony"]
STYLES = ("qwen3", "deepseek_r1", "harmony")


def reasoning_style(
    setting: str,
    render_prompt: Callable[[], str],
    vocab: Callable[[str], bool],
    is_harmony: bool = False,
) -> ReasoningStyle | None:
    """The parser for `gateway.reasoning_parser`: `none`, a style, or `auto`: harmony for a
    harmony model (`is_harmony`), deepseek_r1 when the rendered generation prompt ends inside an
    opened think block, qwen3 when the tokenizer has a `<think>` token, else none.
    `render_prompt` renders a one-message chat for generation."""
    if setting == "none":
        return None
    if setting in STYLES:
        return setting  # type: ignore[return-value]
    if is_harmony:
        return "harmony"
    if not (vocab(START) and vocab(END)):
        return None
    try:
        prompt = render_prompt()
    except Exception:  # a template that cannot render a plain chat: no reasoning to read
        return "qwen3"
    return "deepseek_r1" if prompt.rstrip().endswith(START) else "qwen3"


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may be the tag yet)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Feeds output text, returns (reasoning, content) of what is certain so far; `finish()`
    flushes what was held back."""

    def __init__(self, style: ReasoningStyle, prefill: str | None = None) -> None:
        self.style = style
        # "start": before any text (deepseek_r1 drops a leading <think>); "content" (qwen3, before
        # <think>); "reasoning"; "done": after </think>, all content.
        self.state = "start" if style == "deepseek_r1" and prefill is None else "content"
        self.pending = ""
        if prefill is not None:  # the prompt's text: read for its tags, never given out
            self._scan(prefill, final=False)
            self.pending = ""  # a tag split between the prefill and the reply is not one

    def feed(self, text: str) -> tuple[str, str]:
        return self._scan(self.pending + text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._scan(self.pending, final=True)

    def _scan(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        self.pending = ""
        while text:
            if self.state == "done":
                content.append(text)
                break
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    text = stripped[len(START) :]
                elif not final and START.startswith(stripped):
                    self.pending = text  # whitespace, or the start of <think>, so far
                    break
                self.state = "reasoning"
                continue
            tag = START if self.state == "content" else END
            out = content if self.state == "content" else reasoning
            at = text.find(tag)
            if at >= 0:
                out.append(text[:at])
                text = text[at + len(tag) :]
                self.state = "reasoning" if self.state == "content" else "done"
                continue
            keep = 0 if final else _held(text, tag)
            out.append(text[: len(text) - keep])
            self.pending = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(content)


def split_reasoning(style: ReasoningStyle, text: str, prefill: str | None = None) -> tuple[str | None, str]:
    """The whole output (of a reply continuing `prefill`, if not None) -> (reasoning_content, or
    None when there was none, content)."""
    stream = ReasoningStream(style, prefill)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning) or None, content + more_content
