"""The tokenizer's logic, without sockets: validate, template, tokenize, journal, relay.

The journal holds every in-flight request with what its client has been sent so far, so that
late or duplicated deltas are trimmed by position before they reach the client (invariant 2 of
docs/architecture.md), and so that the tokenizer can re-drive a request whose delivery broke
(invariant 4): after a scheduler or detokenizer restart, and whenever its watchdog finds a quiet
request that the engine no longer runs, it resubmits the request with the outputs its client
already has. The journal forgets a request only once its client has the final delta. Light: no
torch.

A client's request id is scoped to its connection (its ROUTER identity): the engine knows each
request by an id derived from both (`engine_id`), so another client that reuses the id, or sends
an Abort for it, cannot touch it.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec
import numpy as np

from ipc import messages as m
from ipc.endpoints import shard_of
from ipc.json_depth import check_json_depth
from ipc.sampling_defaults import fill_defaults
from ipc.structured_output import for_tool_choice, tool_functions
from ipc.validation import (
    MAX_BAD_WORD_TOKENS,
    InvalidParams,
    PromptTooLong,
    check_chat_budget,
    check_chat_messages,
    check_continuable,
    check_prompt_chars,
    validate_params,
    validate_prompt_ids,
)
from services.common import harmony
from services.common.grammar_compiler import GrammarError, check_constraint
from services.common.image_fetch import NOT_FETCHED, RemoteImages, is_remote
from services.common.images import ImageError, ImageRules, decode_data_url, image_size
from services.common.pooling import Embedding
from services.common.text import ReservedTemplateKwargs, TemplateTimeout, Tokenizer
from services.common.tool_parsers import ToolParser, finish_reason
from services.common.tools_prompt import (
    auto_tool_format,
    template_messages,
    template_renders_tools,
    tool_parser_for,
)
from services.metrics import FinishedRequest, RequestMetrics
from services.request_sample import RequestSampler

MAX_REQUEST_ID_CHARS = 256
# Resubmissions of a quiet request that bring no progress before it is failed: one that the
# engine keeps losing is a bug to report, not something to retry forever.
MAX_REDRIVES = 3
# Constraints already checked (and the error of each bad one), by their text: a workload reuses a
# few schemas, and a check compiles the grammar (about a millisecond).
MAX_CHECKED_CONSTRAINTS = 256
# Encodings of a request's images, when their embeddings keep leaving the cache before its
# prefill (too many images in flight for encoder.cache_bytes), before it fails.
MAX_ENCODINGS = 3
# Client ids whose request ended lately, remembered so that a new request under the same id gets
# another engine id: the old one's drop, still on its way to the detokenizer beside the
# scheduler's outputs, must not hit the new request's state. Older ones are long settled.
MAX_FORGOTTEN_KEYS = 4096
# The image an encoder's or a fetcher's refusal is about, as they number a request's images.
IMAGE_NUMBERED = re.compile(r"^images\[(\d+)\]")


def named_image(error: str, fields: list[str]) -> str:
    """An encoder's or a fetcher's refusal of a request's image ("images[1]: ..."), naming the
    image where the request has it ("messages[2].content[0]: ..."), as the tokenizer's own
    refusals of images do; the gateway's param is then `messages`."""
    numbered = IMAGE_NUMBERED.match(error)
    if numbered is None or int(numbered[1]) >= len(fields):
        return error
    return fields[int(numbered[1])] + error[numbered.end() :]


def engine_id(tokenizer_id: int, identity: bytes, request_id: str, generation: int = 0) -> str:
    """The id the engine knows a client's request by: unique per (tokenizer, connection, client
    id, generation), fixed size whatever the client chose, and the same when that connection
    resubmits its request, so the scheduler replaces the running copy. A connection that reuses a
    client id after its request ended gets the next generation (`TokenizerCore.admit`)."""
    key = len(identity).to_bytes(2, "little") + identity + request_id.encode()
    if generation:
        key += b"\0" + str(generation).encode()
    return f"{tokenizer_id}-{hashlib.blake2b(key, digest_size=12).hexdigest()}"


def bad_words_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words (its SamplingParams.update_from_tokenizer): each word, its
    leading whitespace stripped, as it encodes alone (at the start of a text), and with a leading
    space (in the middle of one) where that gives another first token and as many tokens (vLLM's
    rule: a variant of another length would ban a token other than the word's own last). Raises
    InvalidParams naming the word: one that encodes to no token, to more than
    MAX_BAD_WORD_TOKENS, or to an id outside the vocabulary."""
    sequences = []
    for i, word in enumerate(words):
        bare = word.lstrip()
        ids = tokenizer.encode(bare)
        if not ids:
            raise InvalidParams(f"bad_words[{i}] encodes to no token: it would ban nothing")
        if len(ids) > MAX_BAD_WORD_TOKENS:
            raise InvalidParams(
                f"bad_words[{i}] is {len(ids)} tokens long, at most {MAX_BAD_WORD_TOKENS} are allowed"
            )
        sequences.append(ids)
        spaced = tokenizer.encode(" " + bare)
        if spaced and spaced[0] != ids[0] and len(spaced) == len(ids):
            sequences.append(spaced)
    vocab_size = tokenizer.vocab_size
    outside = [t for ids in sequences for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise InvalidParams(f"bad_words: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
    return sequences


class RequestError(Exception):
    """A request the tokenizer refuses; `code` is one of ipc.messages.ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class JournalEntry:
    """One in-flight request: who asked, what was asked, and what the client has been sent.
    `request_id` is the client's id; `submit.request_id` the engine's."""

    identity: bytes
    request_id: str
    submit: m.SubmitRequest
    group: int
    is_stream: bool
    output_ids: list[int] = field(default_factory=list)
    num_chars: int = 0
    text: list[str] = field(default_factory=list)  # non-streaming: the whole text, sent at the end
    logprobs: list[bytes] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: m.PromptLogprobs | None = None  # non-streaming: kept for the whole reply
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # The watchdog (TokenizerCore.stalled / on_progress): when the client last got something new,
    # when the scheduler was last asked about this request and whether that question is still
    # open with nothing new since, how many answers in a row said the engine lost it, the
    # resubmissions since the last progress, and since when its scheduler has answered that it
    # is still starting (None: it last answered ready).
    progress_at: float = field(default_factory=time.monotonic)
    checked_at: float = 0.0
    is_asked: bool = False
    num_lost_checks: int = 0
    num_redrives: int = 0
    starting_since: float | None = None
    sample: list[str] | None = None  # the output text so far of a request in the MLflow sample
    prompt_processed: int = -1  # of the last prompt progress report sent (return_progress)
    # Cuts the finished output into content and tool calls (a request with tools, unless its
    # tool_choice is none); `text` then holds the whole output, streamed or not.
    tool_parser: ToolParser | None = None
    # Images (services/common/images.py): the request's image files, kept to encode them again
    # should their embeddings leave the encoder's cache before its prefill; each tile's first
    # prompt position, number of tokens and grid width (M-RoPE); the http(s) URLs of those not
    # fetched yet, by their index (b"" in `image_files` until they are), and meanwhile the request
    # and its parsed tools, which are tokenized once they are in (its prompt is empty until then).
    # While it waits for its images (fetched, then encoded) the request is the tokenizer's alone:
    # nothing upstream has it to resubmit or to ask about, so a resubmission always carries the
    # prompt tokenized once, here.
    image_files: list[bytes] = field(default_factory=list)
    # Where each image is in the request (messages[1].content[0]), which names it in a refusal:
    # the encoder and the fetcher number the images as they come (images[3]).
    image_fields: list[str] = field(default_factory=list)
    image_starts: list[int] = field(default_factory=list)
    image_tokens: list[int] = field(default_factory=list)
    image_grid_widths: list[int] = field(default_factory=list)
    image_urls: dict[int, str] = field(default_factory=dict)
    unfetched: tuple[m.Generate, list[dict] | None] | None = None
    is_encoding: bool = False
    num_encodings: int = 0
    # Output tokens the client already had when it resumed the request here, its tokenizer replica
    # having died (`Generate.resume_output_ids`): that replica observed the prompt and the first
    # token, so this one observes neither again, and times only the tokens it delivers itself.
    num_resumed_tokens: int = 0
    # How many earlier requests of this connection under the same client id this replica
    # remembers (`engine_id`'s generation).
    generation: int = 0
    returns_prompt_ids: bool = False  # Generate.return_prompt_ids


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
        # They belong to output token 0: a receiver past it has them.
        prompt_logprobs=delta.prompt_logprobs if num_tokens == 0 else None,
        token_index=delta.token_index + min(skip_tokens, len(ids)),
        char_offset=delta.char_offset + min(skip_chars, len(delta.text)),
        text=delta.text[skip_chars:],
        token_ids=ids[skip_tokens:].tobytes(),
        logprobs=delta.logprobs[4 * skip_tokens :],
        top_logprobs=delta.top_logprobs[skip_tokens:],
    )


class TokenizerCore:
    """Validation, templating, tokenization and the journal of one tokenizer replica."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tokenizer_id: int,
        num_groups: int,
        max_model_len: int,
        max_prompt_chars: int,
        default_max_tokens: int,
        metrics: RequestMetrics | None = None,
        stall_timeout_s: float = 10.0,
        start_timeout_s: float = 600.0,
        sampler: RequestSampler | None = None,
        sampling_defaults: dict[str, float | int] | None = None,
        max_messages: int = 4096,
        template_timeout_s: float = 1.0,
        embedding: Embedding | None = None,
        image_rules: ImageRules | None = None,
        num_encoders: int = 0,
        max_image_bytes: int = 10 << 20,
        max_image_pixels: int = 40_000_000,
        remote_images: RemoteImages | None = None,
        is_harmony: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # Chats speak harmony (services/common/harmony.py; gateway.reasoning_parser decides, for
        # the gateway alike): their output keeps its special tokens, which mark the channels, and
        # a chat with tools is parsed by the harmony tool parser.
        self.is_harmony = is_harmony
        # A vision-language model's image rules (None: the model reads no images), and the run's
        # encoder replicas (services/encoder/), which turn a request's images into embeddings.
        self.image_rules = image_rules
        self.num_encoders = num_encoders
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels  # refused from the header, as the encoder would
        self.remote_images = remote_images  # what http(s) image URLs it fetches; None: none
        self.embedding = embedding  # the run serves embeddings (services/common/pooling.py), not text
        self.tokenizer_id = tokenizer_id
        self.num_groups = num_groups
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self.max_messages = max_messages
        self.template_timeout_s = template_timeout_s
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        self.stall_timeout_s = stall_timeout_s
        # How long a request may wait for its scheduler to come up (supervisor.start_timeout_s,
        # what a stage is given to start) before it fails instead of waiting on.
        self.start_timeout_s = start_timeout_s
        self.sampler = sampler
        self.sampling_defaults = sampling_defaults or {}  # the model's (ipc/sampling_defaults.py)
        self.group_loads = [0.0] * num_groups  # reported by the supervisor (GroupLoads)
        self.journal: dict[str, JournalEntry] = {}  # by engine id
        self.engine_ids: dict[tuple[bytes, str], str] = {}  # (identity, client's request id) -> engine id
        # (identity, client's request id) -> the generation of its last request, which ended
        self.forgotten_keys: OrderedDict[tuple[bytes, str], int] = OrderedDict()
        self.num_unknown_deltas = 0
        self.num_gaps = 0
        self.num_finished = 0
        self._rng = random.Random()
        self._checked: dict[str, str] = {}  # constraint cache_key -> "" or its error, oldest first

    # -- client side ---------------------------------------------------------------------------

    def admit(self, identity: bytes, request: m.Generate) -> JournalEntry:
        """Validate a Generate and journal it; tokenized now unless it names http(s) images
        (`image_urls`), which are fetched first. Raises RequestError.

        Admission is one path: check what the request alone decides (its budget, parameters and
        each image URL against the run's policy: a 400 at once), fetch its http(s) images, then
        tokenize (`_tokenize`) with every image's real size. SmolVLM's splitting and Qwen2.5-VL
        need those sizes for their image tokens. Gemma 3's (and Idefics3's without splitting) do
        not, but they take the same path rather than an order of their own: one place where a
        prompt is made and checked, for a cost of failing a bad prompt after its fetch instead of
        before. A request without http(s) images (every text one) has nothing to wait for and is
        tokenized here. What needs the prompt
        (its length, an image token spelled in text) fails a fetched request from `on_fetched`,
        with the same code and message."""
        if not request.request_id or len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise RequestError("invalid_request", f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")
        self._check_budget(request)
        self._check_task(request)
        self._check_inputs(request)
        tools = self._tools(request)
        image_files, image_urls, image_fields = self._image_files(request)
        params = request.params
        if params.embed is not None:  # one step, which "samples" the end of the request
            params = msgspec.structs.replace(params, max_tokens=1)
        if tools is not None:
            params = self._forced_call(request.tools, tools, params)
        if self.is_harmony and request.messages is not None:
            params = self._harmony_params(params)
        if params.max_tokens is None:
            params = msgspec.structs.replace(params, max_tokens=self.default_max_tokens)
        # Filled once, here, so every later stage (and a resubmission) sees the same values.
        params = fill_defaults(params, self.sampling_defaults)
        try:
            # The prompt's own length is checked once it is tokenized (`_tokenize`).
            validate_params(
                params,
                vocab_size=self.tokenizer.vocab_size,
                max_model_len=self.max_model_len,
                num_prompt_tokens=1,
            )
            if params.structured is not None:
                self._check_constraint(params.structured)
            if params.bad_words_ids:
                raise InvalidParams(
                    "bad_words_ids are the tokenizer's to make from bad_words: give bad_words"
                )
            if params.bad_words:
                params = msgspec.structs.replace(
                    params, bad_words_ids=bad_words_ids(self.tokenizer, params.bad_words)
                )
            resume_ids = m.unpack_ids(request.resume_output_ids)
            validate_prompt_ids(
                resume_ids.tolist() or [0],
                vocab_size=self.tokenizer.vocab_size,
                max_model_len=self.max_model_len,
            )
        except PromptTooLong as exc:
            raise RequestError("prompt_too_long", str(exc)) from None
        except (InvalidParams, ValueError) as exc:
            raise RequestError("invalid_request", str(exc)) from None
        if request.resume_num_chars < 0:
            raise RequestError("invalid_request", "resume_num_chars must be >= 0")
        resumed_text = ""
        if request.resume_num_chars:
            # A client has at most the text its tokens decode to; claiming more would put every
            # delta of the request behind a gap that never closes.
            resumed_text = self.tokenizer.decode(resume_ids.tolist(), params.skip_special_tokens)
            resumed_chars = len(resumed_text)
            if request.resume_num_chars > resumed_chars:
                raise RequestError(
                    "invalid_request",
                    f"resume_num_chars={request.resume_num_chars} exceeds the {resumed_chars} characters "
                    f"that the {len(resume_ids)} resume_output_ids decode to",
                )
        if params.seed is None:
            # Seeds are fixed here, once, so a resubmitted request samples the same tokens.
            params = msgspec.structs.replace(params, seed=self._rng.getrandbits(63))
        key = (identity, request.request_id)
        old = self.journal.get(self.engine_ids.get(key, ""))
        generation = old.generation if old else self.forgotten_keys.get(key, -1) + 1
        engine = engine_id(self.tokenizer_id, identity, request.request_id, generation)
        group = old.group if old else self._least_loaded_group()
        submit = m.SubmitRequest(
            request_id=engine,
            tokenizer_id=self.tokenizer_id,
            prompt_ids=b"",  # `_tokenize` sets it: below, or once the http(s) images are in
            params=params,
            output_ids=resume_ids.tobytes(),
            arrival_time=time.time(),
        )
        entry = JournalEntry(
            identity,
            request.request_id,
            submit,
            group,
            request.stream,
            output_ids=resume_ids.tolist(),
            num_chars=request.resume_num_chars,
            image_files=image_files,
            image_fields=image_fields,
            image_urls=image_urls,
            is_encoding=bool(image_files),
            num_encodings=int(bool(image_files)),
            num_resumed_tokens=len(resume_ids),
            generation=generation,
            returns_prompt_ids=request.return_prompt_ids,
        )
        if image_urls:
            entry.unfetched = (request, tools)
        else:
            self._tokenize(entry, request, tools)
        if request.tools is not None:
            entry.tool_parser = tool_parser_for(request.tools, self.auto_tool_format)
        if entry.tool_parser is not None and request.resume_num_chars:
            entry.text.append(resumed_text[: request.resume_num_chars])  # the parse needs the whole output
        if self.sampler is not None and self.sampler.wants(time.monotonic()):
            entry.sample = []
        self.journal[engine] = entry
        self.forgotten_keys.pop(key, None)  # only now: a refused request leaves the generation known
        self.engine_ids[key] = engine
        return entry

    def _tokenize(self, entry: JournalEntry, request: m.Generate, tools: list[dict] | None) -> None:
        """Give `entry` its prompt, and each image tile's place in it, from its request and
        its image files (every one in). Raises RequestError."""
        image_sizes = self._image_sizes(entry.image_files, entry.image_fields)
        prompt_ids = self._prompt_ids(request, tools, image_sizes)
        entry.image_starts, entry.image_tokens, entry.image_grid_widths = self._image_tiles(
            prompt_ids, image_sizes
        )
        if request.params.embed is not None:
            limit = self.embedding.max_input_tokens if self.embedding is not None else 0
            whole = min(limit or self.max_model_len, self.max_model_len)
            prompt_ids = self._truncated(
                prompt_ids, request.params.embed.truncate, whole, request.prompt is not None
            )
            self._check_input_length(len(prompt_ids))
        elif request.truncate_prompt_tokens:
            if entry.image_starts:
                raise RequestError(
                    "invalid_request", "truncate_prompt_tokens cannot cut a prompt with images"
                )
            # Generation encodes no special tokens of its own: the prompt is cut as it is.
            prompt_ids = self._truncated(
                prompt_ids, request.truncate_prompt_tokens, self.max_model_len - 1, False
            )
        try:
            validate_prompt_ids(
                prompt_ids,
                vocab_size=self.tokenizer.vocab_size,
                max_model_len=self.max_model_len,
                generates=request.params.embed is None,
            )
        except PromptTooLong as exc:
            raise RequestError("prompt_too_long", str(exc)) from None
        except (InvalidParams, ValueError) as exc:
            raise RequestError("invalid_request", str(exc)) from None
        entry.submit = msgspec.structs.replace(entry.submit, prompt_ids=m.pack_ids(prompt_ids))

    def _check_constraint(self, spec: m.StructuredOutput) -> None:
        """Raise InvalidParams unless the constraint compiles: the scheduler would refuse it too,
        but only after the request crossed the pipeline (the SDK and the CLI skip the gateway)."""
        key = spec.cache_key
        error = self._checked.pop(key, None)
        if error is None:
            try:
                check_constraint(spec)
                error = ""
            except GrammarError as exc:
                error = f"structured.{exc}"
            except Exception as exc:  # whatever else the grammar engine raises: the request's fault
                error = f"structured.{spec.kind}: {type(exc).__name__}: {exc}"[:600]
        self._checked[key] = error  # most recent last
        if len(self._checked) > MAX_CHECKED_CONSTRAINTS:
            del self._checked[next(iter(self._checked))]
        if error:
            raise InvalidParams(error)

    def _check_budget(self, request: m.Generate) -> None:
        """Refuse a request whose text is past the work budget before any work on it: this stage
        renders and encodes every request on one thread, which all streams share."""
        try:
            if request.prompt is not None:
                check_prompt_chars(len(request.prompt), self.max_prompt_chars)
            if request.messages is not None:
                check_chat_budget(
                    request.messages,
                    request.tools.tools if request.tools is not None else "",
                    max_chars=self.max_prompt_chars,
                    max_messages=self.max_messages,
                )
        except InvalidParams as exc:
            raise RequestError(exc.code, str(exc)) from None

    @staticmethod
    def _tools(request: m.Generate) -> list[dict] | None:
        """The request's OpenAI `tools`, parsed; None when it offers none."""
        if request.tools is None:
            return None
        if request.messages is None:
            raise RequestError("invalid_request", "tools: only a chat request (messages) can offer tools")
        try:
            check_json_depth(request.tools.tools, "tools")
        except InvalidParams as exc:
            raise RequestError("invalid_request", str(exc)) from None
        try:
            tools = json.loads(request.tools.tools)
        except ValueError as exc:
            raise RequestError("invalid_request", f"tools: not valid JSON: {exc}") from None
        try:
            tool_functions(tools)  # the shape the template and the instruction read
        except InvalidParams as exc:
            raise RequestError("invalid_request", str(exc)) from None
        if request.tools.choice == "function" and not request.tools.function:
            raise RequestError("invalid_request", "tool_choice: a forced function needs its name")
        return tools

    @staticmethod
    def _forced_call(spec: m.Tools, tools: list[dict], params: m.SamplingParams) -> m.SamplingParams:
        """Under tool_choice required or a named function the output is generated under the
        call's schema, so its arguments always parse (ipc/structured_output.py, for_tool_choice)."""
        choice: Any = spec.choice
        if spec.choice == "function":
            choice = {"type": "function", "function": {"name": spec.function}}
        try:
            forced = for_tool_choice(tools, choice, parallel_tool_calls=spec.parallel)
        except InvalidParams as exc:
            raise RequestError("invalid_request", str(exc)) from None
        if forced is None:
            return params
        if params.structured is not None:
            raise RequestError(
                "invalid_request",
                f"tool_choice: {spec.choice!r} forces a tool call, which cannot be combined with another "
                "output constraint (response_format or structured_outputs)",
            )
        return msgspec.structs.replace(params, structured=forced)

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the model's chat template renders `tools` (else the tokenizer instructs)."""
        template = self.tokenizer.chat_template
        return template is not None and template_renders_tools(template)

    @cached_property
    def auto_tool_format(self) -> str:
        return "harmony" if self.is_harmony else auto_tool_format(self.tokenizer.chat_template)

    @cached_property
    def _harmony_stop_ids(self) -> list[int]:
        """`<|return|>` and `<|call|>`: each ends the assistant's turn, whether or not the model's
        generation config lists it as eos (a GGUF's often names only one)."""
        ids = (self.tokenizer.encode(tag) for tag in (harmony.RETURN, harmony.CALL))
        return [found[0] for found in ids if len(found) == 1]

    def _harmony_params(self, params: m.SamplingParams) -> m.SamplingParams:
        stops = params.stop_token_ids + [i for i in self._harmony_stop_ids if i not in params.stop_token_ids]
        return msgspec.structs.replace(params, skip_special_tokens=False, stop_token_ids=stops)

    def _check_task(self, request: m.Generate) -> None:
        """An embedding request to a run that embeds, any other to a run that generates."""
        embed = request.params.embed
        if embed is None:
            if self.embedding is not None:
                raise RequestError(
                    "invalid_request",
                    "this model serves embeddings only (model.task: embed): use /v1/embeddings",
                )
            return
        if self.embedding is None:
            raise RequestError(
                "invalid_request", "this model generates text: it serves no embeddings (model.task: embed)"
            )
        if request.messages is not None:
            raise RequestError("invalid_request", "an embedding input is a prompt or token ids, not messages")
        if not 0 <= embed.dimensions <= self.embedding.width:
            raise RequestError(
                "invalid_request",
                f"dimensions must be 1..{self.embedding.width} (the model's vector size), got {embed.dimensions}",
            )

    def _truncated(self, prompt_ids: list[int], truncate: int, whole: int, is_text: bool) -> list[int]:
        """A prompt's last `truncate` tokens (-1: the last `whole`), as vLLM's
        truncate_prompt_tokens; the whole prompt for 0. A text keeps the special tokens its
        tokenizer put around it ([CLS] ... [SEP]: CLS pooling reads the first; a BOS), and loses
        content from the left; token ids and a rendered chat are cut as they are."""
        if truncate == 0:
            return prompt_ids
        if truncate < -1:
            raise RequestError(
                "invalid_request", f"truncate_prompt_tokens must be -1 or >= 1, got {truncate}"
            )
        if truncate > self.max_model_len:
            raise RequestError(
                "invalid_request",
                f"truncate_prompt_tokens {truncate} is over the model's length, max_model_len {self.max_model_len}",
            )
        keep = truncate if truncate > 0 else whole
        if len(prompt_ids) <= keep:
            return prompt_ids
        head = tail = 0
        if is_text:
            special = set(self.tokenizer.special_token_ids)
            while head < len(prompt_ids) and prompt_ids[head] in special:
                head += 1
            while tail < len(prompt_ids) - head and prompt_ids[len(prompt_ids) - 1 - tail] in special:
                tail += 1
        room = keep - head - tail
        if room < 1:
            raise RequestError(
                "invalid_request",
                f"truncate_prompt_tokens {truncate} leaves no room for the input beside its {head + tail} "
                "special tokens",
            )
        end = len(prompt_ids) - tail
        return [*prompt_ids[:head], *prompt_ids[end - room : end], *prompt_ids[end:]]

    def _check_input_length(self, num_tokens: int) -> None:
        embedding = self.embedding
        if embedding is not None and 0 < embedding.max_input_tokens < num_tokens:
            raise RequestError(
                "prompt_too_long",
                f"input of {num_tokens} tokens is over the {embedding.max_input_tokens} this embedding model "
                f"reads ({embedding.max_input_from})",
            )

    def _image_files(self, request: m.Generate) -> tuple[list[bytes], dict[int, str], list[str]]:
        """The files of a chat's images, in order, each decoded from its data URL within
        encoder.max_image_bytes (the encoder decodes the image itself); the http(s) URLs to
        fetch, by index (b"" in the files until then), each checked against the run's policy;
        and each image's place in the request (`messages[i].content[k]`). Raises RequestError."""
        files: list[bytes] = []
        urls: dict[int, str] = {}
        fields: list[str] = []
        for i, message in enumerate(request.messages or ()):
            if not isinstance(message.content, list):
                continue
            for k, part in enumerate(message.content):
                if not isinstance(part, m.ImagePart):
                    continue
                field = f"messages[{i}].content[{k}]"
                fields.append(field)
                if message.role != "user":
                    raise RequestError("invalid_request", f"{field}: images are read in user turns only")
                if self.image_rules is None:
                    raise RequestError("invalid_request", f"{field}: this model reads no images")
                if self.num_encoders == 0:
                    raise RequestError(
                        "invalid_request",
                        f"{field}: this run reads no images (it runs no encoder: encoder.replicas 0)",
                    )
                try:
                    if not is_remote(part.url):
                        files.append(decode_data_url(part.url, self.max_image_bytes))
                        continue
                    if self.remote_images is None:
                        raise ImageError(NOT_FETCHED)
                    self.remote_images.check(part.url)
                except ImageError as exc:
                    raise RequestError("invalid_request", f"{field}: {exc}") from None
                urls[len(files)] = part.url
                files.append(b"")
        return files, urls, fields

    def _image_sizes(self, files: list[bytes], fields: list[str]) -> list[tuple[int, int] | None]:
        """Each image's (width, height), read from its header where the model's image tokens
        depend on it; None where they do not. A refusal names the image (`fields`)."""
        if self.image_rules is None or not self.image_rules.needs_sizes:
            return [None] * len(files)
        sizes: list[tuple[int, int] | None] = []
        for data, field_name in zip(files, fields, strict=True):
            try:
                sizes.append(image_size(data, self.max_image_pixels))
            except ImageError as exc:
                raise RequestError("invalid_request", f"{field_name}: {exc}") from None
        return sizes

    def _image_tiles(
        self, prompt_ids: list[int], sizes: list[tuple[int, int] | None]
    ) -> tuple[list[int], list[int], list[int]]:
        """Each image tile's first prompt position, number of image tokens and grid width (M-RoPE;
        0 for other models). Its image tokens must be exactly the tiles' own: text that spells
        the image token would take embeddings no image gave."""
        if not sizes:
            return [], [], []  # a text-only request: any image token in it is text, read as such
        rules = self.image_rules
        assert rules is not None  # _image_files
        tokens = [n for size in sizes for n in rules.tile_tokens(size)]
        widths = [rules.tile_grid_width(size) for size in sizes for _ in rules.tile_tokens(size)]
        positions = np.flatnonzero(np.asarray(prompt_ids) == rules.image_token_id)
        firsts = np.cumsum([0, *tokens[:-1]])
        # Positions ascend, so each tile's last token in its place makes its run contiguous.
        if (
            len(positions) != sum(tokens)
            or (
                positions[firsts + np.asarray(tokens) - 1] != positions[firsts] + np.asarray(tokens) - 1
            ).any()
        ):
            raise RequestError(
                "invalid_request", f"messages: the text spells the image token {rules.image_token!r}"
            )
        return positions[firsts].tolist(), tokens, widths

    @staticmethod
    def _check_inputs(request: m.Generate) -> None:
        """Exactly one input, and a chat's messages each of a known role and with content."""
        given = [x is not None for x in (request.prompt, request.messages, request.prompt_token_ids)]
        if sum(given) != 1:
            raise RequestError("invalid_request", "set exactly one of prompt, messages, prompt_token_ids")
        if request.messages is None:
            return
        try:
            check_chat_messages(request.messages)
            if request.continue_final_message:
                check_continuable(request.messages)
        except InvalidParams as exc:
            raise RequestError("invalid_request", str(exc)) from None

    def _prompt_ids(
        self, request: m.Generate, tools: list[dict] | None, image_sizes: list[tuple[int, int] | None]
    ) -> list[int]:
        if request.prompt is not None and self.embedding is not None and self.embedding.chat_message:
            return self._chat_message_ids(request.prompt, self.embedding.chat_message)
        if request.prompt is not None:
            # An embedding model reads its input with the special tokens its tokenizer adds
            # ([CLS] ... [SEP] for BERT), as sentence-transformers encodes it.
            return self.tokenizer.encode(request.prompt, add_special_tokens=request.params.embed is not None)
        if request.messages is not None:
            # tool_choice none: the model is not offered the tools, so it answers in text.
            offered = tools if request.tools is not None and request.tools.choice != "none" else None
            messages, template_tools = template_messages(request.messages, offered, self.renders_tools)
            try:
                text = self.tokenizer.apply_chat_template(
                    messages,
                    tools=template_tools,
                    timeout_s=self.template_timeout_s,
                    template_kwargs=request.chat_template_kwargs,
                    continue_final_message=request.continue_final_message,
                    add_generation_prompt=request.add_generation_prompt,
                )
            except TemplateTimeout as exc:
                raise RequestError("invalid_request", f"messages: {exc}") from None
            except ReservedTemplateKwargs as exc:  # names the field: the gateway's `param`
                raise RequestError("invalid_request", str(exc)) from None
            except Exception as exc:  # a template may raise on unusual conversations
                raise RequestError("invalid_request", f"chat template failed: {exc}") from None
            try:  # what encoding costs is bounded by the rendered text
                check_prompt_chars(len(text), self.max_prompt_chars, " once rendered by the chat template")
            except PromptTooLong as exc:
                raise RequestError(exc.code, str(exc)) from None
            if image_sizes:
                assert self.image_rules is not None  # _image_files
                try:
                    text = self.image_rules.expand(text, image_sizes)
                except ImageError as exc:
                    raise RequestError("invalid_request", f"messages: {exc}") from None
            return self.tokenizer.encode(text)
        try:
            return m.unpack_ids(request.prompt_token_ids or b"").tolist()
        except ValueError as exc:
            raise RequestError("invalid_request", f"prompt_token_ids: {exc}") from None

    def _chat_message_ids(self, text: str, form: str) -> list[int]:
        """An embedding input as sentence-transformers 6 encodes it for a model that reads messages
        (Embedding.chat_message): one user message rendered by the chat template, no generation
        prompt, tokenized with no special tokens added (the template writes them), as
        transformers' apply_chat_template does."""
        content = text if form == "flat" else [{"type": "text", "text": text}]
        try:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}],
                add_generation_prompt=False,
                timeout_s=self.template_timeout_s,
            )
        except TemplateTimeout as exc:
            raise RequestError("invalid_request", f"input: {exc}") from None
        except Exception as exc:  # a template may raise on any input, or be missing
            raise RequestError("invalid_request", f"chat template failed: {exc}") from None
        try:  # what encoding costs is bounded by the rendered text
            check_prompt_chars(len(rendered), self.max_prompt_chars, " once rendered by the chat template")
        except PromptTooLong as exc:
            raise RequestError(exc.code, str(exc)) from None
        return self.tokenizer.encode(rendered)

    def _least_loaded_group(self) -> int:
        """The group with the least reported load, counting our own in-flight requests on top
        (they cover a burst that arrives between two load reports)."""
        load = list(self.group_loads)
        for entry in self.journal.values():
            if entry.group < self.num_groups:  # not one of a retiring group (set_num_groups)
                load[entry.group] += 1
        return min(range(self.num_groups), key=load.__getitem__)

    def set_num_groups(self, num_groups: int) -> None:
        """Engine groups were added or are retiring (hot reload of engine.data_parallel): new
        requests go to groups below `num_groups` only. Those in flight on a retiring group stay
        there until it drains, or `move_retired` moves what is left."""
        if num_groups != self.num_groups:
            self.num_groups = num_groups
            self.group_loads = [0.0] * num_groups  # until the next report

    def move_retired(self) -> list[tuple[int, m.SubmitRequest]]:
        """(group, resubmission) of every journaled request still on a retired group (one at or
        above num_groups, now stopped), each moved to the least loaded remaining group."""
        moved = []
        for entry in self.journal.values():
            if entry.group >= self.num_groups:
                entry.group = self._least_loaded_group()
                if not entry.is_encoding:  # it goes to its new group once encoded
                    moved.append((entry.group, self.resubmission(entry)))
        return moved

    def missing(self, identity: bytes, request_ids: list[str]) -> list[str]:
        """Those of a connection's `request_ids` that this replica holds no request for."""
        return [rid for rid in request_ids if (identity, rid) not in self.engine_ids]

    def abort(self, identity: bytes, request_id: str) -> JournalEntry | None:
        """Forget the request `request_id` of the client at `identity` (None if it has none such);
        the caller aborts `entry.submit.request_id` upstream."""
        engine_id = self.engine_ids.get((identity, request_id))
        if engine_id is None:
            return None
        entry = self._forget(engine_id)
        if self.metrics is not None:
            self.metrics.on_finish("abort", entry.arrival, time.monotonic(), self._finished(entry))
        return entry

    def refuse(self, identity: bytes, request_id: str, code: str) -> None:
        """Forget a request just admitted that could not be sent on (the engine queue is full):
        a failure with `code`, not an abort."""
        engine_id = self.engine_ids.get((identity, request_id))
        if engine_id is not None:
            self._forget(engine_id)
            if self.metrics is not None:
                self.metrics.on_failure(code)

    def abort_connection(self, identity: bytes) -> list[JournalEntry]:
        """Forget every request of a client that is gone."""
        ids = [rid for who, rid in self.engine_ids if who == identity]
        return [entry for rid in ids if (entry := self.abort(identity, rid)) is not None]

    def drop_all(self) -> list[JournalEntry]:
        """Forget every request in flight (the tokenizer is stopping and fails them all)."""
        entries = list(self.journal.values())
        self.journal.clear()
        self.engine_ids.clear()
        return entries

    @staticmethod
    def _finished(entry: JournalEntry, num_cached_tokens: int = 0) -> FinishedRequest:
        # output_ids holds each position once, so a resubmitted request is not counted twice
        return FinishedRequest(
            num_prompt_tokens=len(entry.submit.prompt_ids) // 4,
            num_generation_tokens=len(entry.output_ids),
            max_tokens=entry.submit.params.max_tokens,
            first_token_time=entry.first_token_time,
            last_token_time=entry.last_token_time,
            num_cached_tokens=num_cached_tokens,
            num_resumed_tokens=entry.num_resumed_tokens,
        )

    def _forget(self, engine_id: str) -> JournalEntry:
        entry = self.journal.pop(engine_id)
        key = (entry.identity, entry.request_id)
        del self.engine_ids[key]
        self.forgotten_keys[key] = entry.generation
        if len(self.forgotten_keys) > MAX_FORGOTTEN_KEYS:
            self.forgotten_keys.popitem(last=False)
        return entry

    # -- engine side ---------------------------------------------------------------------------

    @staticmethod
    def _relay_prompt_progress(entry: JournalEntry, progress: m.PromptProgress) -> Reply | None:
        """A stream's prompt progress goes to its client until its first output (the output comes
        through the detokenizer, the progress straight from the scheduler: either may come first).
        It shows the scheduler runs the request: the watchdog need not ask. A report that says
        no more than one sent before (a prefill again after a preemption or a restart) is not
        news: the client's progress never steps back."""
        if not entry.is_stream or entry.output_ids or entry.num_chars:
            return None
        entry.progress_at = time.monotonic()
        if progress.processed <= entry.prompt_processed:
            return None
        entry.prompt_processed = progress.processed
        return Reply(entry.identity, m.Delta(entry.request_id, 0, 0, "", b"", prompt_progress=progress))

    def relay(self, delta: m.Delta) -> Reply | None:
        """Trim a delta to what the client lacks; journal it; the reply to send (if any)."""
        entry = self.journal.get(delta.request_id)
        if entry is None:
            self.num_unknown_deltas += 1
            return None
        if delta.prompt_progress is not None:
            return self._relay_prompt_progress(entry, delta.prompt_progress)
        fresh = trim_delta(delta, len(entry.output_ids), entry.num_chars)
        if fresh is None:
            return None
        if fresh.token_index != len(entry.output_ids) or fresh.char_offset != entry.num_chars:
            # A gap: something upstream was lost. Never forward out-of-order text; the request
            # is re-driven from what the client has (a restart notice, or the watchdog).
            self.num_gaps += 1
            return None
        new_ids = m.unpack_ids(fresh.token_ids)
        if fresh.token_index == 0 and fresh.usage is None:
            # The prompt's size comes with the first output, for APIs that announce it when a
            # stream starts (Anthropic's message_start); the last delta's usage is the final count.
            usage = m.Usage(len(entry.submit.prompt_ids) // 4, len(new_ids))
            fresh = msgspec.structs.replace(fresh, usage=usage)
        if fresh.token_index == 0 and entry.returns_prompt_ids:
            fresh = msgspec.structs.replace(fresh, prompt_ids=entry.submit.prompt_ids)
        entry.output_ids.extend(new_ids.tolist())
        entry.num_chars += len(fresh.text)
        now = time.monotonic()
        entry.progress_at, entry.is_asked, entry.num_lost_checks, entry.num_redrives = now, False, 0, 0
        if len(new_ids):
            if self.metrics is not None and entry.num_resumed_tokens and entry.last_token_time is None:
                self.metrics.on_resumed_tokens(len(new_ids))
            elif self.metrics is not None:
                self.metrics.on_tokens(
                    entry.arrival, entry.last_token_time, now, len(new_ids), len(entry.submit.prompt_ids) // 4
                )
            if entry.first_token_time is None:
                entry.first_token_time = now
            entry.last_token_time = now
        if entry.sample is not None:
            entry.sample.append(fresh.text)
        if entry.tool_parser is not None or not entry.is_stream:
            entry.text.append(fresh.text)
        if fresh.finish_reason is not None:
            self._forget(delta.request_id)
            self.num_finished += 1
            if entry.sample is not None and self.sampler is not None:
                prompt = self.tokenizer.decode(
                    m.unpack_ids(entry.submit.prompt_ids).tolist(), skip_special_tokens=False
                )
                self.sampler.record(entry.request_id, prompt, "".join(entry.sample), fresh.finish_reason)
            if self.metrics is not None:
                cached = fresh.usage.cached_tokens if fresh.usage is not None else 0
                self.metrics.on_finish(fresh.finish_reason, entry.arrival, now, self._finished(entry, cached))
            if entry.tool_parser is not None:
                fresh = self._with_tool_calls(entry, fresh)
        if entry.is_stream:
            return Reply(entry.identity, msgspec.structs.replace(fresh, request_id=entry.request_id))
        entry.logprobs.append(fresh.logprobs)
        entry.top_logprobs += fresh.top_logprobs
        entry.prompt_logprobs = fresh.prompt_logprobs or entry.prompt_logprobs
        if fresh.finish_reason is None:
            return None
        whole = m.Delta(
            request_id=entry.request_id,
            token_index=0,
            char_offset=0,
            text="".join(entry.text),
            token_ids=m.pack_ids(entry.output_ids),
            logprobs=b"".join(entry.logprobs),
            top_logprobs=entry.top_logprobs,
            finish_reason=fresh.finish_reason,
            usage=fresh.usage,
            tools=fresh.tools,
            prompt_logprobs=entry.prompt_logprobs,
            embedding=fresh.embedding,
            prompt_ids=entry.submit.prompt_ids if entry.returns_prompt_ids else b"",
        )
        return Reply(entry.identity, whole)

    @staticmethod
    def _with_tool_calls(entry: JournalEntry, final: m.Delta) -> m.Delta:
        """The final delta of a tools request, with its whole output cut into content and calls.
        Parsed here, once, so that every client (SDK, CLI, gateway) gets the same calls; call ids
        derive from the client's request id, so a resubmitted request names them alike."""
        assert entry.tool_parser is not None
        parsed = entry.tool_parser.parse("".join(entry.text), entry.request_id)
        calls = [
            m.ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls
        ]
        reason = finish_reason(final.finish_reason or "stop", bool(calls) and not parsed.has_cut_call)
        return msgspec.structs.replace(
            final, finish_reason=reason, tools=m.ParsedTools(parsed.content, calls)
        )

    def on_encoded(
        self, request_id: str, encoder: int, keys: list[bytes], refs: list[m.SlotRef], error: str
    ) -> JournalEntry | Reply | None:
        """An encoder's answer for a request's images: the entry, its submission now naming where
        each image's embeddings are, to send on; or the failure to send its client (a bad image
        is a 400: invalid_request); None when the request is gone (aborted)."""
        entry = self.journal.get(request_id)
        if entry is None or not entry.is_encoding or entry.unfetched is not None:
            # Still fetching its images, it has asked no encoder yet: this answers the same
            # request as this replica's previous process asked it (an engine id outlives a
            # restart), and the one it asks for once they are in comes after.
            return None
        if error:
            code = "unavailable" if error.startswith("timeout") else "invalid_request"
            return self.fail(m.RequestFailed(request_id, code, named_image(error, entry.image_fields)))
        if len(refs) != len(entry.image_starts):
            return self.fail(
                m.RequestFailed(
                    request_id,
                    "internal",
                    f"the encoder gave {len(refs)} tiles for {len(entry.image_starts)}",
                )
            )
        images = [
            m.PromptImage(start, num_tokens, encoder, ref, key, grid_width)
            for start, num_tokens, grid_width, ref, key in zip(
                entry.image_starts, entry.image_tokens, entry.image_grid_widths, refs, keys, strict=True
            )
        ]
        entry.submit = msgspec.structs.replace(entry.submit, images=images)
        entry.is_encoding = False
        entry.progress_at = time.monotonic()  # its engine time starts now, for the watchdog
        return entry

    def on_fetched(self, request_id: str, files: dict[int, bytes], error: str) -> JournalEntry | Reply | None:
        """A request's remote images fetched (`files`, by index): the entry, its files whole and
        its prompt tokenized, to send to an encoder; or the failure to send its client (a 400 for
        an image that could not be fetched; admission's code and message for a prompt it refuses);
        None when it is gone."""
        entry = self.journal.get(request_id)
        if entry is None or entry.unfetched is None:
            return None
        if error:
            return self.fail(
                m.RequestFailed(request_id, "invalid_request", named_image(error, entry.image_fields))
            )
        for index, data in files.items():
            entry.image_files[index] = data
        (request, tools), entry.unfetched, entry.image_urls = entry.unfetched, None, {}
        try:
            self._tokenize(entry, request, tools)
        except RequestError as exc:
            return self.fail(m.RequestFailed(request_id, exc.code, str(exc)))
        return entry

    def encode_again(self, failure: m.RequestFailed) -> JournalEntry | None:
        """The entry to send to its encoder again, its images' embeddings having left the cache
        before its prefill (IMAGES_EVICTED); None when that is not this failure, or when it has
        been encoded MAX_ENCODINGS times already (`fail` then fails it)."""
        entry = self.journal.get(failure.request_id)
        if failure.code != m.IMAGES_EVICTED or entry is None or entry.num_encodings >= MAX_ENCODINGS:
            return None
        entry.is_encoding = True
        entry.num_encodings += 1
        entry.submit = msgspec.structs.replace(entry.submit, images=[])
        return entry

    def fail(self, failure: m.RequestFailed) -> Reply | None:
        if failure.request_id not in self.journal:
            return None
        entry = self._forget(failure.request_id)
        code, message = failure.code, failure.message
        if code == m.IMAGES_EVICTED:
            code = "unavailable"
            message = (
                f"this request's images left the encoders' caches {entry.num_encodings} times before its "
                f"prefill (encoder.cache_bytes is too small for the images in flight): {message}"
            )
        if self.metrics is not None:
            self.metrics.on_failure(code)
        return Reply(entry.identity, m.ErrorReply(entry.request_id, code, message))

    # -- re-driving delivery ------------------------------------------------------------------

    @staticmethod
    def resubmission(entry: JournalEntry) -> m.SubmitRequest:
        """The request again, with the outputs its client already has: the scheduler replaces a
        live copy, or finishes at once one whose outputs already meet its end, and the
        detokenizer rebuilds its text from the whole history."""
        return msgspec.structs.replace(entry.submit, output_ids=m.pack_ids(entry.output_ids))

    def resubmissions(self, group: int) -> list[m.SubmitRequest]:
        """Every journaled request of engine group `group` (its scheduler restarted and is ready).

        The watchdog starts over for them: an answer to a question asked before this
        resubmission was given before the scheduler had it (questions and resubmissions share one
        FIFO link), so its -1 would be taken for a loss, and the request resubmitted again."""
        entries = [e for e in self.journal.values() if e.group == group and not e.is_encoding]
        for entry in entries:
            entry.is_asked, entry.num_lost_checks, entry.starting_since = False, 0, None
        return [self.resubmission(e) for e in entries]

    def shard_resubmissions(self, shard: int, num_shards: int) -> list[tuple[int, m.SubmitRequest]]:
        """(group, resubmission) of every journaled request of detokenizer shard `shard` (it
        restarted, and with it went the text it had not yet delivered)."""
        return [
            (e.group, self.resubmission(e))
            for request_id, e in self.journal.items()
            if shard_of(request_id, num_shards) == shard and not e.is_encoding
        ]

    def stalled(self, now: float) -> dict[int, list[str]]:
        """Ids, by engine group, of the requests that got nothing new for stall_timeout_s and
        were not asked about within it: the tokenizer asks their scheduler (QueryRequests)."""
        quiet: dict[int, list[str]] = defaultdict(list)
        for request_id, entry in self.journal.items():
            if entry.is_encoding:
                continue  # its encoder client has its own deadline
            if now - max(entry.progress_at, entry.checked_at) >= self.stall_timeout_s:
                entry.checked_at, entry.is_asked = now, True
                quiet[entry.group].append(request_id)
        return quiet

    def on_progress(self, report: m.RequestProgress, now: float) -> tuple[list[JournalEntry], list[Reply]]:
        """The scheduler's answer about quiet requests: the entries to resubmit, and the failures
        to send.

        Quiet is often legitimate (a long queue, a long prefill): the scheduler then holds exactly
        the outputs the client has, and nothing is done. The engine has lost a request when the
        scheduler no longer runs it, or holds tokens the client never got; that is acted on only
        when two answers in a row, with nothing new between, say so, because the last text of a
        request the scheduler just finished may still be on its way through the detokenizer.

        A scheduler still starting (`report.is_ready` False) lost nothing: a restarted one gets
        its requests back from `resubmissions` once it is ready. Its requests wait, and those it
        keeps waiting for start_timeout_s fail (`unavailable`) rather than hang.
        """
        redrive: list[JournalEntry] = []
        failed: list[Reply] = []
        for request_id, num_tokens in zip(report.request_ids, report.num_output_tokens, strict=True):
            entry = self.journal.get(request_id)
            if entry is None or not entry.is_asked:
                continue  # finished, or moved on since the question
            entry.is_asked = False
            if not report.is_ready:
                entry.num_lost_checks = 0
                if entry.starting_since is None:
                    entry.starting_since = now
                elif now - entry.starting_since >= self.start_timeout_s:
                    message = f"engine group {entry.group} did not come up within {self.start_timeout_s:g}s"
                    reply = self.fail(m.RequestFailed(request_id, "unavailable", message))
                    if reply is not None:
                        failed.append(reply)
                continue
            entry.starting_since = None
            if 0 <= num_tokens <= len(entry.output_ids):
                entry.num_lost_checks = 0
                continue
            entry.num_lost_checks += 1
            if entry.num_lost_checks < 2:
                continue
            entry.num_lost_checks = 0
            entry.num_redrives += 1
            if entry.num_redrives <= MAX_REDRIVES:
                entry.checked_at = now
                redrive.append(entry)
                continue
            reply = self.fail(
                m.RequestFailed(
                    request_id,
                    "internal",
                    f"request lost: no output after {MAX_REDRIVES} resubmissions (the engine holds "
                    f"{num_tokens} output tokens, the client {len(entry.output_ids)})",
                )
            )
            if reply is not None:
                failed.append(reply)
        return redrive, failed
