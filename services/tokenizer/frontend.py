"""The frontend's logic, without sockets: validate, template, tokenize, journal, relay.

The journal holds every in-flight request with what its client has been sent so far, so that
after a scheduler restart the request is resubmitted with its outputs (docs/architecture.md invariant 4), and
so that late or duplicated deltas are trimmed by position before they reach the client
(invariant 2). Light: no torch.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import msgspec

from ipc import messages as m
from ipc.validation import InvalidParams, PromptTooLong, validate_params, validate_prompt_ids
from services.tokenizer.metrics import RequestMetrics
from services.tokenizer.text import Tokenizer

MAX_REQUEST_ID_CHARS = 256
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class RequestError(Exception):
    """A request the frontend refuses; `code` is one of ipc.messages.ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class JournalEntry:
    """One in-flight request: who asked, what was asked, and what the client has been sent."""

    identity: bytes
    submit: m.SubmitRequest
    group: int
    is_stream: bool
    output_ids: list[int] = field(default_factory=list)
    num_chars: int = 0
    text: list[str] = field(default_factory=list)  # non-streaming: the whole text, sent at the end
    logprobs: list[bytes] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None


@dataclass
class Reply:
    identity: bytes
    message: m.ClientReply


def trim_delta(delta: m.Delta, num_tokens: int, num_chars: int) -> m.Delta | None:
    """The part of `delta` past what the receiver has (num_tokens ids, num_chars characters);
    None when nothing is new and the delta does not finish the request."""
    skip_tokens = max(0, num_tokens - delta.token_index)
    skip_chars = max(0, num_chars - delta.char_offset)
    ids = m.unpack_ids(delta.token_ids)
    if skip_tokens >= len(ids) and skip_chars >= len(delta.text) and delta.finish_reason is None:
        return None
    if skip_tokens == 0 and skip_chars == 0:
        return delta
    return msgspec.structs.replace(
        delta,
        token_index=delta.token_index + min(skip_tokens, len(ids)),
        char_offset=delta.char_offset + min(skip_chars, len(delta.text)),
        text=delta.text[skip_chars:],
        token_ids=ids[skip_tokens:].tobytes(),
        logprobs=delta.logprobs[4 * skip_tokens :],
        top_logprobs=delta.top_logprobs[skip_tokens:],
    )


class FrontendCore:
    """Validation, templating, tokenization and the journal of one frontend replica."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        frontend_id: int,
        num_groups: int,
        max_model_len: int,
        max_prompt_chars: int,
        default_max_tokens: int,
        metrics: RequestMetrics | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.frontend_id = frontend_id
        self.num_groups = num_groups
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        self.group_loads = [0.0] * num_groups  # reported by the supervisor (GroupLoads)
        self.journal: dict[str, JournalEntry] = {}
        self.num_unknown_deltas = 0
        self.num_finished = 0
        self._rng = random.Random()

    # -- client side ---------------------------------------------------------------------------

    def admit(self, identity: bytes, request: m.Generate) -> JournalEntry:
        """Validate and tokenize a Generate; journal it. Raises RequestError."""
        if not request.request_id or len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise RequestError("invalid_request", f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")
        prompt_ids = self._prompt_ids(request)
        params = request.params
        if params.max_tokens is None:
            params = msgspec.structs.replace(params, max_tokens=self.default_max_tokens)
        try:
            validate_prompt_ids(prompt_ids, vocab_size=self.tokenizer.vocab_size, max_model_len=self.max_model_len)
            validate_params(
                params,
                vocab_size=self.tokenizer.vocab_size,
                max_model_len=self.max_model_len,
                num_prompt_tokens=len(prompt_ids),
            )
            resume_ids = m.unpack_ids(request.resume_output_ids)
            validate_prompt_ids(
                resume_ids.tolist() or [0], vocab_size=self.tokenizer.vocab_size, max_model_len=self.max_model_len
            )
        except PromptTooLong as exc:
            raise RequestError("prompt_too_long", str(exc)) from None
        except (InvalidParams, ValueError) as exc:
            raise RequestError("invalid_request", str(exc)) from None
        if request.resume_num_chars < 0:
            raise RequestError("invalid_request", "resume_num_chars must be >= 0")
        if params.seed is None:
            # Seeds are fixed here, once, so a resubmitted request samples the same tokens.
            params = msgspec.structs.replace(params, seed=self._rng.getrandbits(63))
        old = self.journal.get(request.request_id)
        group = old.group if old else self._least_loaded_group()
        submit = m.SubmitRequest(
            request_id=request.request_id,
            frontend_id=self.frontend_id,
            prompt_ids=m.pack_ids(prompt_ids),
            params=params,
            output_ids=resume_ids.tobytes(),
            arrival_time=time.time(),
        )
        entry = JournalEntry(
            identity,
            submit,
            group,
            request.stream,
            output_ids=resume_ids.tolist(),
            num_chars=request.resume_num_chars,
        )
        self.journal[request.request_id] = entry
        return entry

    def _prompt_ids(self, request: m.Generate) -> list[int]:
        given = [x is not None for x in (request.prompt, request.messages, request.prompt_token_ids)]
        if sum(given) != 1:
            raise RequestError("invalid_request", "set exactly one of prompt, messages, prompt_token_ids")
        if request.prompt is not None:
            self._check_chars(len(request.prompt))
            return self.tokenizer.encode(request.prompt)
        if request.messages is not None:
            if not request.messages:
                raise RequestError("invalid_request", "messages must not be empty")
            for i, message in enumerate(request.messages):
                if message.role not in CHAT_ROLES:
                    raise RequestError(
                        "invalid_request", f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {message.role!r}"
                    )
            self._check_chars(sum(len(x.content) for x in request.messages))
            try:
                text = self.tokenizer.apply_chat_template(
                    [{"role": x.role, "content": x.content} for x in request.messages], add_generation_prompt=True
                )
            except Exception as exc:  # a template may raise on unusual conversations
                raise RequestError("invalid_request", f"chat template failed: {exc}") from None
            return self.tokenizer.encode(text)
        try:
            return m.unpack_ids(request.prompt_token_ids or b"").tolist()
        except ValueError as exc:
            raise RequestError("invalid_request", f"prompt_token_ids: {exc}") from None

    def _check_chars(self, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise RequestError(
                "prompt_too_long", f"prompt has {num_chars} characters; the limit is {self.max_prompt_chars}"
            )

    def _least_loaded_group(self) -> int:
        """The group with the least reported load, counting our own in-flight requests on top
        (they cover a burst that arrives between two load reports)."""
        load = list(self.group_loads)
        for entry in self.journal.values():
            load[entry.group] += 1
        return min(range(self.num_groups), key=load.__getitem__)

    def abort(self, request_id: str) -> JournalEntry | None:
        entry = self.journal.pop(request_id, None)
        if entry is not None and self.metrics is not None:
            self.metrics.on_finish("abort", entry.arrival, time.monotonic())
        return entry

    # -- engine side ---------------------------------------------------------------------------

    def relay(self, delta: m.Delta) -> Reply | None:
        """Trim a delta to what the client lacks; journal it; the reply to send (if any)."""
        entry = self.journal.get(delta.request_id)
        if entry is None:
            self.num_unknown_deltas += 1
            return None
        fresh = trim_delta(delta, len(entry.output_ids), entry.num_chars)
        if fresh is None:
            return None
        if fresh.token_index != len(entry.output_ids) or fresh.char_offset != entry.num_chars:
            # A gap: something upstream was lost. The scheduler resends full history on resync,
            # so wait for that rather than forward out-of-order text.
            self.num_unknown_deltas += 1
            return None
        new_ids = m.unpack_ids(fresh.token_ids)
        entry.output_ids.extend(new_ids.tolist())
        entry.num_chars += len(fresh.text)
        now = time.monotonic()
        if len(new_ids):
            if self.metrics is not None:
                self.metrics.on_tokens(entry.arrival, entry.last_token_time, now, len(new_ids))
            entry.last_token_time = now
        if fresh.finish_reason is not None:
            self.journal.pop(delta.request_id, None)
            self.num_finished += 1
            if self.metrics is not None:
                self.metrics.on_finish(fresh.finish_reason, entry.arrival, now)
        if entry.is_stream:
            return Reply(entry.identity, fresh)
        entry.text.append(fresh.text)
        entry.logprobs.append(fresh.logprobs)
        if fresh.finish_reason is None:
            return None
        whole = m.Delta(
            request_id=delta.request_id,
            token_index=0,
            char_offset=0,
            text="".join(entry.text),
            token_ids=m.pack_ids(entry.output_ids),
            logprobs=b"".join(entry.logprobs),
            finish_reason=fresh.finish_reason,
            usage=fresh.usage,
        )
        return Reply(entry.identity, whole)

    def fail(self, failure: m.RequestFailed) -> Reply | None:
        entry = self.journal.pop(failure.request_id, None)
        if entry is None:
            return None
        if self.metrics is not None:
            self.metrics.on_finish(failure.code, entry.arrival, time.monotonic())
        return Reply(entry.identity, m.ErrorReply(failure.request_id, failure.code, failure.message))

    def resubmissions(self, group: int) -> list[m.SubmitRequest]:
        """Every journaled request of `group`, with the outputs its client already has."""
        return [
            msgspec.structs.replace(e.submit, output_ids=m.pack_ids(e.output_ids))
            for e in self.journal.values()
            if e.group == group
        ]
