"""Incremental detokenization and stop strings: token updates in, text deltas with absolute positions out.

Pure logic (no sockets, no torch): the detokenizer process feeds it `TokenBatch`es and ships what it
returns (deltas to the tokenizers, stop-string hits to the scheduler as aborts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ipc.messages import (
    Delta,
    PromptLogprobs,
    SamplingParams,
    StepTokens,
    TokenBatch,
    TokenUpdate,
    Usage,
    pack_ids,
    unpack_ids,
)

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class DetokOutput:
    """What one `add` produced: `text` starts at absolute character `char_offset`; `num_tokens` of
    the given ids were consumed (fewer when a stop string hit first)."""

    text: str
    char_offset: int
    num_tokens: int
    finish_reason: str | None = None
    is_stop_hit: bool = False


class IncrementalDetokenizer:
    """Owns one request's output text: decodes only a short window of recent tokens per step and
    holds back what is not final yet (an incomplete UTF-8 character, a possible stop-string prefix).

    The concatenation of all emitted text equals `decode(all ids)`, truncated at the first stop
    string. Window technique: `[prefix_offset, read_offset)` are tokens whose text was already
    emitted and that start at a character boundary; the new text is `decode(ids[prefix:])` minus
    `decode(ids[prefix:read])`. The window restarts wherever a decode ends on a whole character.
    """

    def __init__(self, tokenizer: Decoder, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = [s for s in params.stop if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        # As vLLM: stop strings count only once more than min_tokens tokens are out; one that
        # ends in the text of the first min_tokens is never a stop (as eos and stop ids are not).
        self._min_tokens = params.min_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # all decoded text (truncated at a stop string)
        self.num_emitted_chars = 0
        self.is_finished = False

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def text(self) -> str:
        return self._text

    def add(self, token_ids: Sequence[int], finish_reason: str | None = None) -> DetokOutput:
        """Append tokens; `finish_reason` (the scheduler finished the request) flushes everything."""
        offset = self.num_emitted_chars
        if self.is_finished:
            return DetokOutput("", offset, 0)
        num_tokens = 0
        for token_id in token_ids:
            self.ids.append(int(token_id))
            num_tokens += 1
            if self._append_text(self._decode_window(is_final=False)):
                return self._emit(offset, num_tokens, "stop", is_stop_hit=True)
        if finish_reason is not None:
            if self._append_text(self._decode_window(is_final=True)):
                return self._emit(offset, num_tokens, "stop", is_stop_hit=True)
            return self._emit(offset, num_tokens, finish_reason)
        return self._emit(offset, num_tokens, None)

    def _decode_window(self, is_final: bool) -> str:
        """The text the tokens after `read_offset` add, or "" while it may still change."""
        ids, decode = self.ids, self._tokenizer.decode
        prefix = decode(ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        full = decode(ids[self._prefix_offset :], self._skip_special_tokens)
        # A trailing U+FFFD is usually a character whose remaining bytes come with the next token.
        if full.endswith(REPLACEMENT_CHAR) and not is_final:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix) :]

    def _append_text(self, new_text: str) -> bool:
        """Append decoded text; True when it completes a stop string (text is then truncated)."""
        if not new_text:
            return False
        num_checked = len(self._text)
        self._text += new_text
        if not self._stops or len(self.ids) <= self._min_tokens:
            return False
        # Only matches that end inside the new text are new; pick the one that ends first
        # (generation would have stopped there), the longest one on a tie.
        best: tuple[int, int] | None = None
        for stop in self._stops:
            start = self._text.find(stop, max(0, num_checked - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        if best is None:
            return False
        end, start = best
        self._text = self._text[: end if self._include_stop else start]
        return True

    def _num_held_back(self) -> int:
        """Length of the longest unemitted tail that could still grow into a stop string."""
        pending = len(self._text) - self.num_emitted_chars
        for k in range(min(self._max_stop_len - 1, pending), 0, -1):
            tail = self._text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0

    def _emit(
        self, offset: int, num_tokens: int, finish_reason: str | None, is_stop_hit: bool = False
    ) -> DetokOutput:
        if finish_reason is not None:
            self.is_finished = True
            end = len(self._text)
        else:
            end = len(self._text) - self._num_held_back()
        text = self._text[offset:end]
        self.num_emitted_chars = end
        return DetokOutput(text, offset, num_tokens, finish_reason, is_stop_hit)


@dataclass
class _Request:
    detok: IncrementalDetokenizer
    params: SamplingParams
    tokenizer_id: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Until the delta of output token 0 carries them on (they belong to its position).
    prompt_logprobs: PromptLogprobs | None = None


class DetokenizerCore:
    """Owns the detokenization state of every live request of this shard, keyed by request id.

    Positions make delivery idempotent (docs/architecture.md invariant 2): every delta says where its first
    token and character sit in the request's output, so receivers drop what they already have.
    """

    def __init__(self, tokenizer: Decoder, num_remembered_finished: int = 4096) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        # Updates already in flight when a request finished (a stop string hit, a drop) still
        # arrive; these are expected and not counted as unknown.
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._num_remembered_finished = num_remembered_finished
        self.num_unknown = 0  # updates for requests never seen (start_index > 0)
        self._untracked: dict[int, list[str]] = {}  # those requests by tokenizer id, until taken
        self.num_late = 0  # updates for requests that already finished
        self.num_gaps = 0  # updates that skip tokens we never got (dropped)
        self.num_duplicate_tokens = 0  # tokens received twice and trimmed

    @property
    def num_live(self) -> int:
        return len(self._requests)

    def handle(self, batch: TokenBatch | StepTokens) -> tuple[dict[int, list[Delta]], list[str]]:
        """Deltas grouped by tokenizer id, and the requests whose stop string hit (to abort)."""
        deltas: dict[int, list[Delta]] = {}
        stopped: list[str] = []
        for update in batch.to_updates():
            request = self._request_for(update)
            if request is None:
                continue
            delta, is_stop_hit = self._apply(request, update)
            if delta is not None:
                deltas.setdefault(request.tokenizer_id, []).append(delta)
            if is_stop_hit:
                stopped.append(update.request_id)
        return deltas, stopped

    def take_untracked(self) -> dict[int, list[str]]:
        """Ids, by tokenizer id, of the requests whose updates since the last call continued a
        history this detokenizer never got (it restarted since they began). Their tokenizer is
        told (m.UntrackedRequests): one it journals is being resubmitted (ResubmitShard) and
        comes back with its whole history; one it does not is a copy that a dead tokenizer sent
        on, which only that notice can stop, since none of its text reaches a tokenizer now."""
        untracked, self._untracked = self._untracked, {}
        return untracked

    def drop(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            if self._requests.pop(request_id, None) is not None:
                self._remember_finished(request_id)

    def _request_for(self, update: TokenUpdate) -> _Request | None:
        request_id = update.request_id
        if update.start_index == 0:  # full history: start over (a resync or a resubmission)
            old = self._requests.get(request_id)
            params = update.params or (old.params if old else SamplingParams())
            request = _Request(IncrementalDetokenizer(self._tokenizer, params), params, update.tokenizer_id)
            request.prompt_logprobs = update.prompt_logprobs
            self._requests[request_id] = request
            self._finished.pop(request_id, None)
            return request
        request = self._requests.get(request_id)
        if request is None:
            if request_id in self._finished:
                self.num_late += 1
            else:
                self.num_unknown += 1
                self._untracked.setdefault(update.tokenizer_id, []).append(request_id)
            return None
        if update.start_index > request.detok.num_tokens:
            self.num_gaps += 1
            return None
        return request

    def _apply(self, request: _Request, update: TokenUpdate) -> tuple[Delta | None, bool]:
        detok = request.detok
        request.tokenizer_id = update.tokenizer_id
        request.prompt_tokens = max(request.prompt_tokens, update.prompt_tokens)
        request.cached_tokens = max(request.cached_tokens, update.cached_tokens)
        skip = detok.num_tokens - update.start_index  # tokens we already have
        all_ids = unpack_ids(update.token_ids)
        self.num_duplicate_tokens += min(skip, len(all_ids))
        ids = all_ids[skip:]
        if not len(ids) and update.finish_reason is None:
            return None, False
        token_index = detok.num_tokens
        out = detok.add(ids.tolist(), update.finish_reason)
        n = out.num_tokens
        logprobs = update.logprobs[4 * skip : 4 * (skip + n)] if update.logprobs else b""
        delta = Delta(
            request_id=update.request_id,
            token_index=token_index,
            char_offset=out.char_offset,
            text=out.text,
            token_ids=pack_ids(ids[:n]),
            logprobs=logprobs,
            top_logprobs=update.top_logprobs[skip : skip + n],
            finish_reason=out.finish_reason,
        )
        if out.finish_reason is not None or token_index == 0:
            # The first output's usage says the prompt's size and its prefix-cache hits (what a
            # reply cut short by the gateway, or a stream's start, has of them); the last's is final.
            delta.usage = Usage(request.prompt_tokens, detok.num_tokens, request.cached_tokens)
        if out.finish_reason is not None:
            del self._requests[update.request_id]
            self._remember_finished(update.request_id)
        if not n and not out.text and out.finish_reason is None:
            return None, False
        if token_index == 0 and request.prompt_logprobs is not None:
            delta.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        # A stop hit on the scheduler's own final update needs no abort: it already finished.
        return delta, out.is_stop_hit and update.finish_reason is None

    def _remember_finished(self, request_id: str) -> None:
        self._finished[request_id] = None
        if len(self._finished) > self._num_remembered_finished:
            self._finished.popitem(last=False)
