"""Brigade output -> OpenAI response bodies: whole responses, stream chunks, logprobs, usage.

`ChatFormat` and `CompletionFormat` have the same methods, so the endpoint code is one for both.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ipc import messages as m
from services.gateway import protocol as p
from services.gateway.reasoning import ReasoningStream, ReasoningStyle, split_reasoning
from services.tokenizer.text import Tokenizer
from services.tokenizer.tool_parsers import ToolCallStream, ToolParser, finish_reason


@dataclass
class Piece:
    """New output of one choice: text, token ids, their logprobs and top-N alternatives."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None = None
    tools: m.ParsedTools | None = None  # the last piece of a chat with tools: the tokenizer's parse


@dataclass
class ChoiceOutput:
    """A whole choice, for non-streamed replies."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    tools: m.ParsedTools | None = None

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.token_ids += piece.token_ids
        self.logprobs += piece.logprobs
        self.top_logprobs += piece.top_logprobs
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.tools = piece.tools or self.tools

    def piece(self) -> Piece:
        return Piece(
            "".join(self.text),
            self.token_ids,
            self.logprobs,
            self.top_logprobs,
            self.finish_reason,
            self.tools,
        )


def usage_out(usages: dict[int, m.Usage], prompt_of: dict[int, int]) -> p.UsageOut:
    """OpenAI counts each prompt once and every choice's completion tokens."""
    prompt_tokens: dict[int, int] = {}
    completion = cached = 0
    for index, usage in usages.items():
        prompt_tokens[prompt_of[index]] = usage.prompt_tokens
        completion += usage.completion_tokens
        cached += usage.cached_tokens
    prompt = sum(prompt_tokens.values())
    return p.UsageOut(prompt, completion, prompt + completion, p.PromptTokensDetails(cached))


class TokenNames:
    """How logprob entries name tokens: their text, or vLLM's `token_id:N`."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)


def merge_tool_deltas(items: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]] | None]:
    """ToolCallStream's deltas of one piece -> one chunk's content and tool_calls (a call's
    argument pieces joined), so that every chunk carries the event id of its position."""
    content = "".join(item["content"] for item in items if "content" in item) or None
    calls: dict[int, dict[str, Any]] = {}
    for item in items:
        for call in item.get("tool_calls", []):
            have = calls.get(call["index"])
            if have is None:
                calls[call["index"]] = {**call, "function": dict(call["function"])}
            else:
                function = have["function"]
                function["arguments"] = function.get("arguments", "") + call["function"]["arguments"]
    return content, list(calls.values()) or None


def tool_calls_out(tools: m.ParsedTools) -> list[p.ToolCallOut] | msgspec.UnsetType:
    calls = [p.ToolCallOut(c.id, p.FunctionCallOut(c.name, c.arguments)) for c in tools.calls]
    return calls or msgspec.UNSET


class ChatFormat:
    """Chat bodies. With a tool parser, a stream's text is read into content and tool-call deltas
    here (the tokenizer's parse of the whole output comes only with the last delta), one
    `ToolCallStream` per choice, fed everything before a resumed stream's position silently."""

    def __init__(
        self,
        model: str,
        names: TokenNames,
        top_n: int | None,
        tool_parser: ToolParser | None = None,
        call_id_base: str = "",
        reasoning: ReasoningStyle | None = None,
    ) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.names = names
        self.top_n = top_n  # None: no logprobs in the reply
        self.tool_parser = tool_parser
        self.call_id_base = call_id_base
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.reasoning = reasoning  # splits reasoning_content off before the tool parser reads
        self.reasoning_streams: dict[int, ReasoningStream] = {}

    def _tool_stream(self, index: int) -> ToolCallStream:
        assert self.tool_parser is not None
        stream = self.tool_streams.get(index)
        if stream is None:
            stream = self.tool_streams[index] = ToolCallStream(
                self.tool_parser, f"{self.call_id_base}.{index}"
            )
        return stream

    def _split(self, index: int, text: str, final: bool) -> tuple[str | None, str]:
        """New output of choice `index` -> (its reasoning, its content), as far as certain."""
        if self.reasoning is None:
            return None, text
        stream = self.reasoning_streams.get(index)
        if stream is None:
            stream = self.reasoning_streams[index] = ReasoningStream(self.reasoning)
        reasoning, content = stream.feed(text)
        if final:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def skip(self, index: int, text: str) -> None:
        """Text of choice `index` that a resumed client already has: read, not sent."""
        _, content = self._split(index, text, final=False)
        if self.tool_parser is not None and content:
            self._tool_stream(index).feed(content)

    def _logprobs(self, piece: Piece) -> p.ChatLogprobs | None:
        if self.top_n is None:
            return None
        content = []
        for k, (token_id, logprob) in enumerate(zip(piece.token_ids, piece.logprobs, strict=True)):
            tops = piece.top_logprobs[k] if k < len(piece.top_logprobs) else {}
            top = [
                p.TopLogprob(name, lp, list(name.encode()))
                for name, lp in (
                    (self.names.name(i), lp) for i, lp in sorted(tops.items(), key=lambda x: -x[1])
                )
            ][: self.top_n]
            name = self.names.name(token_id)
            content.append(p.TokenLogprob(name, logprob, list(name.encode()), top))
        return p.ChatLogprobs(content)

    def first_chunk(self, index: int) -> msgspec.Struct | None:
        return self._chunk([p.ChatChunkChoice(index, p.ChatDelta(role="assistant", content=""))])

    def chunk(self, index: int, piece: Piece, text_offset: int) -> msgspec.Struct:
        reason = piece.finish_reason
        reasoning, text = self._split(index, piece.text, final=reason is not None)
        if self.tool_parser is None:
            delta = p.ChatDelta(content=text) if text or (reason is None and not reasoning) else p.ChatDelta()
        else:
            stream = self._tool_stream(index)
            items = stream.feed(text)
            if reason is not None:
                items += stream.finish()
                # What was streamed decides: a call once announced stays a call.
                reason = finish_reason("stop" if reason == "tool_calls" else reason, stream.has_tool_calls)
            content, tool_calls = merge_tool_deltas(items)
            delta = p.ChatDelta(content=content, tool_calls=tool_calls)
        delta.reasoning_content = reasoning or None
        return self._chunk([p.ChatChunkChoice(index, delta, self._logprobs(piece), reason)])

    def usage_chunk(self, usage: p.UsageOut) -> msgspec.Struct:
        return self._chunk([], usage)

    def _chunk(
        self, choices: list[p.ChatChunkChoice], usage: p.UsageOut | None = None
    ) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(self.id, self.created, self.model, choices, usage)

    def whole(self, choices: list[ChoiceOutput], usage: p.UsageOut) -> msgspec.Struct:
        out = []
        for index, choice in enumerate(choices):
            piece = choice.piece()
            if piece.tools is None:
                message = p.ChatMessageOut("assistant", piece.text)
            else:
                message = p.ChatMessageOut(
                    "assistant", piece.tools.content, tool_calls=tool_calls_out(piece.tools)
                )
            if self.reasoning is not None:
                message.reasoning_content, content = split_reasoning(self.reasoning, message.content or "")
                message.content = content if content or message.content is not None else None
            out.append(p.ChatChoice(index, message, self._logprobs(piece), piece.finish_reason))
        return p.ChatCompletion(self.id, self.created, self.model, out, usage)


class CompletionFormat:
    def __init__(self, model: str, names: TokenNames, top_n: int | None) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.names = names
        self.top_n = top_n

    def _logprobs(self, piece: Piece, text_offset: int) -> p.CompletionLogprobs | None:
        if self.top_n is None:
            return None
        tokens = [self.names.name(i) for i in piece.token_ids]
        offsets = []
        for token_id in piece.token_ids:
            offsets.append(text_offset)
            text_offset += len(self.names.text(token_id))
        tops = None
        if self.top_n:
            tops = [
                {self.names.name(i): lp for i, lp in sorted(t.items(), key=lambda x: -x[1])[: self.top_n]}
                for t in piece.top_logprobs
            ]
        return p.CompletionLogprobs(tokens, piece.logprobs, tops, offsets)

    def first_chunk(self, index: int) -> msgspec.Struct | None:
        return None

    def skip(self, index: int, text: str) -> None:
        pass

    def chunk(self, index: int, piece: Piece, text_offset: int) -> msgspec.Struct:
        choice = p.CompletionChoice(
            index, piece.text, self._logprobs(piece, text_offset), piece.finish_reason
        )
        return p.Completion(self.id, self.created, self.model, [choice], None)

    def usage_chunk(self, usage: p.UsageOut) -> msgspec.Struct:
        return p.Completion(self.id, self.created, self.model, [], usage)

    def whole(self, choices: list[ChoiceOutput], usage: p.UsageOut) -> msgspec.Struct:
        out = []
        for index, choice in enumerate(choices):
            piece = choice.piece()
            out.append(p.CompletionChoice(index, piece.text, self._logprobs(piece, 0), piece.finish_reason))
        return p.Completion(self.id, self.created, self.model, out, usage)
