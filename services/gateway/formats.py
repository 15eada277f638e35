"""Brigade output -> OpenAI response bodies: whole responses, stream chunks, logprobs, usage.

`ChatFormat` and `CompletionFormat` have the same methods, so the endpoint code is one for both.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from ipc import messages as m
from services.common.text import Tokenizer
from services.common.tool_parsers import ToolCallStream, ToolParser, finish_reason
from services.gateway import protocol as p
from services.gateway.reasoning import ReasoningStream, ReasoningStyle, split_reasoning


@dataclass
class Piece:
    """New output of one choice: text, token ids, their logprobs and top-N alternatives."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None = None
    tools: m.ParsedTools | None = None  # the last piece of a chat with tools: the tokenizer's parse
    prompt_logprobs: m.PromptLogprobs | None = None  # the first piece, when they were asked for
    prompt_ids: list[int] | None = None  # the first piece, when they were asked for (return_token_ids)


@dataclass
class ChoiceOutput:
    """A whole choice, for non-streamed replies."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    tools: m.ParsedTools | None = None
    prompt_logprobs: m.PromptLogprobs | None = None
    prompt_ids: list[int] | None = None

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.token_ids += piece.token_ids
        self.logprobs += piece.logprobs
        self.top_logprobs += piece.top_logprobs
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.tools = piece.tools or self.tools
        self.prompt_logprobs = piece.prompt_logprobs or self.prompt_logprobs
        self.prompt_ids = piece.prompt_ids or self.prompt_ids

    def piece(self) -> Piece:
        return Piece(
            "".join(self.text),
            self.token_ids,
            self.logprobs,
            self.top_logprobs,
            self.finish_reason,
            self.tools,
            self.prompt_logprobs,
            self.prompt_ids,
        )


def usage_out(usages: dict[int, m.Usage], prompt_of: dict[int, int]) -> p.UsageOut:
    """OpenAI counts each prompt once and every choice's completion tokens. A prompt's cached
    tokens count once too, as part of its prompt tokens: the most any of its choices found cached
    (a later choice finds the blocks its sibling just prefilled)."""
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for index, usage in usages.items():
        prompt = prompt_of[index]
        prompt_tokens[prompt] = usage.prompt_tokens
        cached[prompt] = max(cached.get(prompt, 0), usage.cached_tokens)
        completion += usage.completion_tokens
    prompt_total = sum(prompt_tokens.values())
    return p.UsageOut(
        prompt_total, completion, prompt_total + completion, p.PromptTokensDetails(sum(cached.values()))
    )


class TokenNames:
    """How logprob entries name tokens: their text, or vLLM's `token_id:N`."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)


def prompt_logprobs_out(
    prompt: m.PromptLogprobs | None, top_n: int, names: TokenNames
) -> p.PromptLogprobsOut | msgspec.UnsetType:
    """vLLM's prompt_logprobs: None for the first token, then each token's entry and its top-N."""
    if prompt is None:
        return msgspec.UNSET
    ids = m.unpack_ids(prompt.token_ids).tolist()
    ranks = np.frombuffer(prompt.ranks, "<i4").tolist()
    out: p.PromptLogprobsOut = [None]
    for j, logprob in enumerate(prompt.values()[1:], 1):
        assert logprob is not None
        entry = {str(ids[j]): p.PromptLogprob(logprob, ranks[j], names.name(ids[j]))}
        for rank, (token_id, lp) in enumerate(_best(prompt.top_logprobs[j], top_n), 1):
            entry.setdefault(str(token_id), p.PromptLogprob(lp, rank, names.name(token_id)))
        out.append(entry)
    return out


def text_offsets(tokenizer: Tokenizer, token_ids: list[int], start: int) -> list[int]:
    """Where each token's text starts in the decoded text of them all, from `start`. Decoded over
    a window, as the detokenizer does: a token that ends inside a character (one of several
    bytes) adds nothing until the token that completes it, where decoding each token alone
    would count a replacement character for each piece."""
    offsets, prefix, read = [], 0, 0
    for end in range(1, len(token_ids) + 1):
        offsets.append(start)
        text = tokenizer.decode(token_ids[prefix:end], skip_special_tokens=False)
        if text.endswith("\ufffd"):
            continue  # an unfinished character: the next tokens complete it
        start += len(text) - len(tokenizer.decode(token_ids[prefix:read], skip_special_tokens=False))
        prefix, read = read, end
    return offsets


def _best(tops: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(tops.items(), key=lambda x: -x[1])[:n]


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
        *,
        prompt_top_n: int | None = None,
        reasoning: ReasoningStyle | None = None,
        prefill: str | None = None,
        return_token_ids: bool = False,
        include_reasoning: bool = True,
    ) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.names = names
        self.top_n = top_n  # None: no logprobs in the reply
        self.prompt_top_n = prompt_top_n  # None: no prompt_logprobs in the reply
        # Harmony's channels are read by its tool parser, tools or not: it alone finds the final
        # channel's content (and the analysis channel's reasoning) among the headers.
        if reasoning == "harmony" and tool_parser is None:
            tool_parser = ToolParser("harmony")
        self.tool_parser = tool_parser
        self.call_id_base = call_id_base
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.reasoning = reasoning  # splits reasoning_content off before the tool parser reads
        self.reasoning_streams: dict[int, ReasoningStream] = {}
        self.include_reasoning = include_reasoning  # false: split off all the same, and dropped
        self.prefill = prefill  # the assistant's text the reply continues, if it continues one
        # vLLM's: the prompt's ids on the response (a stream's chunk that opens a choice: the
        # role then comes with the choice's first output, once the prompt is known), each
        # choice's or chunk's output ids on it
        self.return_token_ids = return_token_ids

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
        if self.reasoning is None or self.reasoning == "harmony":
            return None, text
        stream = self.reasoning_streams.get(index)
        if stream is None:
            stream = self.reasoning_streams[index] = ReasoningStream(self.reasoning, self.prefill)
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
        if self.return_token_ids:
            return None  # it opens with the first output, which brings the prompt's ids
        return self._chunk([p.ChatChunkChoice(index, p.ChatDelta(role="assistant", content=""))])

    def chunks(self, index: int, piece: Piece, text_offset: int) -> list[msgspec.Struct]:
        """The piece's chunk, and for a last piece, as OpenAI sends it, a chunk of its own with the
        finish_reason and an empty delta."""
        reason = piece.finish_reason
        reasoning, text = self._split(index, piece.text, final=reason is not None)
        if self.tool_parser is None:
            content, tool_calls = text, None
        else:
            stream = self._tool_stream(index)
            items = stream.feed(text)
            if reason is not None:
                items += stream.finish()
                # What was streamed decides: a call once announced stays a call.
                reason = finish_reason(
                    "stop" if reason == "tool_calls" else reason, stream.has_finished_calls
                )
            content, tool_calls = merge_tool_deltas(items)
            reasoning = (reasoning or "") + "".join(item.get("reasoning_content", "") for item in items)
        # Thinking left out (include_reasoning false): a delta of nothing else is not sent, unless
        # it carries what was asked of its tokens (logprobs, ids).
        left_out = bool(reasoning) and not self.include_reasoning
        reasoning = (reasoning or None) if self.include_reasoning else None
        if self.tool_parser is None:
            content = text if text or (reason is None and not reasoning) else None
        out: list[msgspec.Struct] = []
        opens = self.return_token_ids and piece.prompt_ids is not None
        has_news = bool(content or tool_calls or reasoning or piece.token_ids)
        says_nothing = left_out and not (
            text or tool_calls or self.top_n is not None or self.return_token_ids
        )
        if not says_nothing and (has_news or reason is None or opens):
            delta = p.ChatDelta(
                content=content, tool_calls=tool_calls, reasoning=reasoning, reasoning_content=reasoning
            )
            choice = p.ChatChunkChoice(index, delta, self._logprobs(piece))
            chunk = self._chunk([choice])
            if self.return_token_ids:
                choice.token_ids = piece.token_ids
            if opens:
                delta.role, chunk.prompt_token_ids = "assistant", piece.prompt_ids
            out.append(chunk)
        if reason is not None:
            out.append(self._chunk([p.ChatChunkChoice(index, p.ChatDelta(), None, reason)]))
        return out

    def usage_chunk(self, usage: p.UsageOut) -> msgspec.Struct:
        return self._chunk([], usage)

    def progress_chunk(self, index: int, progress: p.PromptProgressOut) -> msgspec.Struct:
        """Choice `index`'s prompt progress (return_progress), on a role-only delta, as llama-server's."""
        chunk = self._chunk([p.ChatChunkChoice(index, p.ChatDelta(role="assistant"))])
        chunk.prompt_progress = progress
        return chunk

    def _harmony_message(self, index: int, piece: Piece) -> tuple[p.ChatMessageOut, str | None]:
        """A harmony chat whose output no tokenizer parse came with (no tools, or tool_choice
        none): its content and any calls, and the finish_reason they make."""
        assert self.tool_parser is not None
        parsed = self.tool_parser.parse(piece.text, f"{self.call_id_base}.{index}")
        calls = [
            p.ToolCallOut(c["id"], p.FunctionCallOut(c["function"]["name"], c["function"]["arguments"]))
            for c in parsed.tool_calls
        ]
        reason = piece.finish_reason and finish_reason(
            piece.finish_reason, bool(calls) and not parsed.has_cut_call
        )
        return p.ChatMessageOut("assistant", parsed.content, tool_calls=calls or msgspec.UNSET), reason

    def _chunk(
        self, choices: list[p.ChatChunkChoice], usage: p.UsageOut | None = None
    ) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(self.id, self.created, self.model, choices, usage)

    def whole(self, choices: list[ChoiceOutput], usage: p.UsageOut) -> msgspec.Struct:
        out = []
        for index, choice in enumerate(choices):
            piece = choice.piece()
            if self.reasoning == "harmony" and piece.tools is None:
                assert self.tool_parser is not None
                message, piece.finish_reason = self._harmony_message(index, piece)
            elif piece.tools is None:
                message = p.ChatMessageOut("assistant", piece.text)
            else:
                message = p.ChatMessageOut(
                    "assistant", piece.tools.content, tool_calls=tool_calls_out(piece.tools)
                )
            reasoning: str | msgspec.UnsetType | None = msgspec.UNSET
            if self.reasoning == "harmony":
                # The tokenizer's parse (of a chat with tools) has the content and the calls,
                # the same parser's reading of the same text the reasoning.
                assert self.tool_parser is not None
                reasoning = self.tool_parser.parse(piece.text, "").reasoning
            elif self.reasoning is not None:
                reasoning, content = split_reasoning(self.reasoning, message.content or "", self.prefill)
                message.content = content if content or message.content is not None else None
            if reasoning is not msgspec.UNSET:
                message.reasoning = message.reasoning_content = reasoning if self.include_reasoning else None
            out.append(p.ChatChoice(index, message, self._logprobs(piece), piece.finish_reason))
            if self.return_token_ids:
                out[-1].token_ids = piece.token_ids
        reply = p.ChatCompletion(self.id, self.created, self.model, out, usage)
        if self.return_token_ids and choices:  # one prompt: vLLM gives it once
            reply.prompt_token_ids = choices[0].prompt_ids or []
        if self.prompt_top_n is not None and choices:  # one prompt: vLLM gives it once
            reply.prompt_logprobs = prompt_logprobs_out(
                choices[0].prompt_logprobs, self.prompt_top_n, self.names
            )
        return reply


class CompletionFormat:
    """Completions bodies. With `echo_prompts` (choice index -> its prompt, echo: true) each choice
    starts with its prompt's text and, with logprobs, the prompt's logprobs (the first token's
    None, as OpenAI gives it); `is_prompt_only` (echo with max_tokens 0) leaves out the one token
    the engine sampled, so the choice is the prompt alone."""

    def __init__(
        self,
        model: str,
        names: TokenNames,
        top_n: int | None,
        echo_prompts: dict[int, str | list[int]] | None = None,
        prompt_top_n: int | None = None,
        is_prompt_only: bool = False,
        *,
        return_token_ids: bool = False,
    ) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.names = names
        self.top_n = top_n
        self.echo_prompts = echo_prompts
        self.prompt_top_n = prompt_top_n  # None: no prompt_logprobs in the reply
        self.is_prompt_only = is_prompt_only
        self.return_token_ids = return_token_ids  # vLLM's: the prompt's and the output's ids per choice

    def _logprobs(self, piece: Piece, text_offset: int) -> p.CompletionLogprobs | None:
        if self.top_n is None:
            return None
        return self._token_logprobs(piece.token_ids, piece.logprobs, piece.top_logprobs, text_offset)

    def _token_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float | None],
        top_logprobs: list[dict[int, float] | None],
        text_offset: int,
    ) -> p.CompletionLogprobs:
        tokens = [self.names.name(i) for i in token_ids]
        offsets = text_offsets(self.names.tokenizer, token_ids, text_offset)
        tops = None
        if self.top_n:
            # As OpenAI's and vLLM's: the N most likely, and the token itself where it is not one.
            tops = []
            for k, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
                top = top_logprobs[k] if k < len(top_logprobs) else None  # as chat's: may run short
                if top is None:
                    tops.append(None)
                    continue
                entry = {self.names.name(i): lp for i, lp in _best(top, self.top_n)}
                if logprob is not None:
                    entry.setdefault(token, logprob)
                tops.append(entry)
        return p.CompletionLogprobs(tokens, logprobs, tops, offsets)

    def _echo(self, index: int, piece: Piece) -> tuple[str, p.CompletionLogprobs | None]:
        """The prompt's text and, with logprobs, its logprobs, then the completion's."""
        assert self.echo_prompts is not None
        prompt = self.echo_prompts[index]
        text = (
            prompt
            if isinstance(prompt, str)
            else self.names.tokenizer.decode(prompt, skip_special_tokens=False)
        )
        if self.top_n is None:
            return text + piece.text, None
        scores = piece.prompt_logprobs
        if scores is None:  # the engine computes them whenever logprobs come with echo
            raise ValueError("echo with logprobs: the engine returned no prompt logprobs")
        tops: list[dict[int, float] | None] = [None, *scores.top_logprobs[1:]]
        echoed = self._token_logprobs(m.unpack_ids(scores.token_ids).tolist(), scores.values(), tops, 0)
        completion = self._logprobs(piece, len(text))
        assert completion is not None
        return text + piece.text, p.CompletionLogprobs(
            echoed.tokens + completion.tokens,
            echoed.token_logprobs + completion.token_logprobs,
            None if echoed.top_logprobs is None else echoed.top_logprobs + (completion.top_logprobs or []),
            echoed.text_offset + completion.text_offset,
        )

    def first_chunk(self, index: int) -> msgspec.Struct | None:
        return None

    def skip(self, index: int, text: str) -> None:
        pass

    def chunks(self, index: int, piece: Piece, text_offset: int) -> list[msgspec.Struct]:
        """The piece's chunk, and for a last piece, as OpenAI sends it, a chunk of its own with the
        finish_reason and no text."""
        reason = piece.finish_reason
        choices = []
        if piece.text or piece.token_ids or reason is None or (self.return_token_ids and piece.prompt_ids):
            choice = p.CompletionChoice(index, piece.text, self._logprobs(piece, text_offset), None)
            if self.return_token_ids:
                choice.token_ids = piece.token_ids
                if piece.prompt_ids is not None:
                    choice.prompt_token_ids = piece.prompt_ids
            choices.append(choice)
        if reason is not None:
            choices.append(p.CompletionChoice(index, "", None, reason))
        return [p.Completion(self.id, self.created, self.model, [choice], None) for choice in choices]

    def usage_chunk(self, usage: p.UsageOut) -> msgspec.Struct:
        return p.Completion(self.id, self.created, self.model, [], usage)

    def progress_chunk(self, index: int, progress: p.PromptProgressOut) -> msgspec.Struct:
        """Choice `index`'s prompt progress (return_progress), on a choice of no text."""
        choice = p.CompletionChoice(index, "", None, None)
        return p.Completion(self.id, self.created, self.model, [choice], None, prompt_progress=progress)

    def whole(self, choices: list[ChoiceOutput], usage: p.UsageOut) -> msgspec.Struct:
        out = []
        for index, choice in enumerate(choices):
            piece = choice.piece()
            if self.is_prompt_only:
                piece = Piece("", [], [], [], piece.finish_reason, prompt_logprobs=piece.prompt_logprobs,
                              prompt_ids=piece.prompt_ids)  # fmt: skip
            if self.echo_prompts is None:
                text, logprobs = piece.text, self._logprobs(piece, 0)
            else:
                text, logprobs = self._echo(index, piece)
            finished = p.CompletionChoice(index, text, logprobs, piece.finish_reason)
            if self.return_token_ids:
                finished.prompt_token_ids, finished.token_ids = piece.prompt_ids or [], piece.token_ids
            if self.prompt_top_n is not None:
                finished.prompt_logprobs = prompt_logprobs_out(
                    piece.prompt_logprobs, self.prompt_top_n, self.names
                )
            out.append(finished)
        if self.is_prompt_only:  # the token sampled and left out is no completion token
            usage = msgspec.structs.replace(usage, completion_tokens=0, total_tokens=usage.prompt_tokens)
        return p.Completion(self.id, self.created, self.model, out, usage)
