"""Every message that crosses a process boundary, as msgspec Structs.

One tagged union per channel; each channel has one `Codec` (see `ipc/codec.py`).
Hot messages are `array_like=True, omit_defaults=True, gc=False` (vLLM v1 style).
Token id lists travel as packed little-endian int32 `bytes` (see `pack_ids` / `unpack_ids`).
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec
import numpy as np

from ipc.topology import Topology

# ---------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------


def pack_ids(ids: list[int] | np.ndarray) -> bytes:
    """Token ids -> packed int32 bytes (what every message carries)."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    """Packed int32 bytes -> read-only int32 array (a view, no copy)."""
    if len(data) % 4:
        raise ValueError(f"packed token ids must be a multiple of 4 bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<i4")


StructuredKind = Literal["json", "regex", "choice", "grammar"]


class StructuredOutput(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """The constraint on one request's output.

    kind: json (spec = a JSON schema), regex (spec = the pattern), choice (spec = a JSON list of
    the allowed strings), grammar (spec = EBNF / GBNF or Lark).
    strict: for json only: every keyword of the schema must be enforced, and one the engine cannot
    enforce is an error; when false such a keyword is ignored (OpenAI's `strict` flag).
    """

    kind: StructuredKind
    spec: str
    strict: bool = True

    @property
    def cache_key(self) -> str:
        return f"{self.kind}:{int(self.strict)}:{self.spec}"


class EmbedOptions(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """An embedding request (SamplingParams.embed): the engine returns the prompt's pooled vector
    instead of generating. `dimensions` > 0 keeps the vector's first that many values (Matryoshka
    truncation), normalized again where the model normalizes. `truncate` > 0 embeds only the
    input's last that many tokens, -1 its last the model reads (vLLM's truncate_prompt_tokens);
    0 embeds it whole, or refuses it when it is too long."""

    dimensions: int = 0
    truncate: int = 0


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-request sampling parameters. Validated by `ipc.validation` (the tokenizer and the scheduler both call it)."""

    max_tokens: int | None = None  # None: the tokenizer's default (tokenizer.default_max_tokens)
    # None: unset; the tokenizer fills in the model's generation_config value, else the engine's
    # (ipc/sampling_defaults.py), so the scheduler and workers only see concrete values.
    temperature: float | None = None
    top_k: int | None = None  # 0 = disabled
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int = 0  # top-N logprobs per sampled token; 0 = only the sampled token's
    # The prompt's own logprobs (vLLM's prompt_logprobs): each prompt token's, with the top N at
    # its position; None = none. The engine then computes every prompt position (no prefix-cache
    # reuse for the request) and returns them once, with its first output token.
    prompt_logprobs: int | None = None
    seed: int | None = None  # None: the tokenizer assigns one at admission
    priority: int = 0  # lower runs first; ties are FCFS
    structured: StructuredOutput | None = None  # constrain the output (ipc/structured_output.py)
    adapter: str = ""  # the LoRA adapter to generate with (a name in lora.adapters); "" = the base model
    embed: EmbedOptions | None = None  # an embedding request: the pooled vector, no tokens
    # False: never verify proposals for this request (speculative decoding, docs/speculative.md),
    # e.g. one that measures its own decode speed; its output is the same either way.
    speculate: bool = True
    # vLLM's: requests share prefix-cached blocks only with requests of the same salt (a tenant
    # that must not learn, by timing, what others' prompts begin with); "" = the common cache.
    cache_salt: str = ""
    # vLLM's allowed_token_ids: every sampled token is one of these (None: any token). With a
    # grammar, a token must satisfy both (services/scheduler/grammars.py).
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: texts the output never contains, as vLLM bans them (token by token, see
    # services/scheduler/request.py `BadWords`). The tokenizer stage tokenizes them into
    # `bad_words_ids` (each word as it is and with a leading space), which is all the scheduler
    # reads; a client gives `bad_words` only.
    bad_words: list[str] = []
    bad_words_ids: list[list[int]] = []
    # llama-server's return_progress: until its first output the request's scheduler reports how
    # much of its prompt is computed (Delta.prompt_progress), when its prefill starts and after
    # each chunk, for a client's progress bar over a long prompt.
    report_prompt_progress: bool = False


class ToolCall(msgspec.Struct, frozen=True, gc=False):
    """One function call an assistant made: `arguments` is the JSON text the model wrote."""

    id: str
    name: str
    arguments: str


class TextPart(msgspec.Struct, tag="text", gc=False):
    """Text in a turn given as parts (OpenAI's `{"type": "text", "text": ...}`)."""

    text: str


class ImagePart(msgspec.Struct, tag="image_url", gc=False):
    """An image in a turn, by the URL its client gave (a base64 `data:image/...` URL so far): the
    tokenizer decodes it (services/common/images.py) and asks an encoder for its embeddings."""

    url: str


ContentPart = Union[TextPart, ImagePart]


def content_text(content: str | list[ContentPart] | None) -> str:
    """A turn's text: its parts' texts joined (its images are not text)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content if isinstance(part, TextPart))


class ChatMessage(msgspec.Struct, gc=False):
    """One turn. content may be None where OpenAI allows it (an assistant turn that only calls
    tools), or parts (text and images, in order); `tool_calls` are an assistant's calls,
    `tool_call_id` names the call a `tool` turn answers, `reasoning` is an assistant turn's
    thinking (the chat template reads it as `reasoning_content`, and decides whether to render
    it). Fields are appended with defaults, so older encodings still decode."""

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None


ToolChoice = Literal["none", "auto", "required", "function"]


class Tools(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """The functions a chat request offers the model (OpenAI `tools`, `tool_choice`,
    `parallel_tool_calls`). `tools` is their JSON text: the tokenizer renders it into the prompt
    and derives the forced-call constraint from it (ipc/structured_output.py, for_tool_choice).
    choice `function` forces the call of `function`."""

    tools: str
    choice: ToolChoice = "auto"
    function: str = ""
    parallel: bool = True


class ParsedTools(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A finished tools request's output, cut into content and calls by the model family's
    parser (services/common/tool_parsers.py); on its final Delta only."""

    content: str | None = None
    calls: list[ToolCall] = []


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """A prompt's logprobs (SamplingParams.prompt_logprobs): for each prompt token, its log
    probability given the tokens before it, NaN for the first (nothing predicts it), the top-N
    ids at its position and its rank among all tokens (0 for the first). They belong to output
    position 0: they travel on the Delta whose `token_index` is 0, and a receiver that already
    has output token 0 already has them (docs/architecture.md invariant 2)."""

    token_ids: bytes  # packed int32: the prompt as the engine ran it
    logprobs: bytes  # packed float32, one per prompt token
    ranks: bytes  # packed int32, one per prompt token: 1 = the likeliest
    top_logprobs: list[dict[int, float]]  # one per prompt token ({} for the first)

    def values(self) -> list[float | None]:
        """The logprobs as a list, None for the first token (as OpenAI and vLLM return it)."""
        out: list[float | None] = np.frombuffer(self.logprobs, "<f4").tolist()
        if out:
            out[0] = None
        return out


class Usage(msgspec.Struct, array_like=True, gc=False):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


# Finish reasons are strings on the wire: "stop", "length", "abort", "error", "tool_calls".

# Error codes, shared by every error reply.
ErrorCode = Literal[
    "invalid_request",  # malformed message or invalid parameter
    "prompt_too_long",
    "model_not_found",  # a LoRA adapter the scheduler does not serve (unloaded since the name was checked)
    "overloaded",
    "unknown_request",
    "unavailable",
    "internal",
]

# ---------------------------------------------------------------------------
# client <-> tokenizer (DEALER -> ROUTER)
# ---------------------------------------------------------------------------


class Generate(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Start (or resume) a request. Exactly one of prompt / messages / prompt_token_ids is set.

    A client resubmitting after a tokenizer died sends the same request_id with the output
    token ids and the number of characters it already received; the stream continues from there.
    """

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: bytes | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = True
    resume_output_ids: bytes = b""
    resume_num_chars: int = 0
    tools: Tools | None = None  # chat only: the functions the model may call
    # chat only: extra variables for the chat template, e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None
    # chat only: the model continues the last message, an assistant's prefill, rather than
    # starting a turn of its own (transformers' continue_final_message: no generation prompt).
    continue_final_message: bool = False
    # chat only: False renders the conversation without the template's generation prompt (vLLM's
    # add_generation_prompt), for a model or a test that writes the turn's opening itself.
    add_generation_prompt: bool = True
    # The prompt's last this many tokens only (vLLM's truncate_prompt_tokens for generation; -1:
    # as many as leave room for one output token); 0 = the whole prompt. An embedding input's is
    # EmbedOptions.truncate.
    truncate_prompt_tokens: int = 0
    # The prompt's token ids come back with the first output (Delta.prompt_ids; vLLM's
    # return_token_ids), as the engine ran them: rendered, tokenized, truncated.
    return_prompt_ids: bool = False
    # A later request of one call whose first request a tokenizer already admitted (a beam
    # search's next step, a choice sent after its prompt's first, an embedding call's inputs past
    # its first window). A draining tokenizer (the run is stopping) refuses new requests but
    # takes these, so that the call it admitted finishes rather than failing midway with a 503.
    # A client that sets it on a new call only keeps the drain going until its deadline
    # (supervisor.drain_timeout_s), which bounds every drain anyway.
    continues: bool = False


class Abort(msgspec.Struct, tag=True, gc=False):
    request_id: str


class Health(msgspec.Struct, tag=True, gc=False):
    """A liveness probe. `request_ids` are the connection's requests that the client believes
    this replica runs; the reply names those it does not hold."""

    request_ids: list[str] = []


class AdapterCommand(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Load, unload or list LoRA adapters (docs/lora.md "Loading at run time"): client ->
    tokenizer, which sends it on to every engine group's scheduler (as an AdapterRequest); the
    scheduler owns the list and has its workers load the adapter. `wait` (unload): wait up to
    lora.unload_wait_s for the requests using the adapter to finish, or refuse at once.
    `inplace` (load, vLLM's load_inplace): an adapter of that name already loaded is replaced,
    if no request uses it."""

    request_id: str
    op: Literal["load", "unload", "list"]
    name: str = ""
    path: str = ""
    wait: bool = True
    inplace: bool = False


ClientRequest = Union[Generate, Abort, Health, AdapterCommand]


class PromptProgress(msgspec.Struct, array_like=True, gc=False):
    """How much of a request's prompt its scheduler has computed, before its first output: of
    `total` tokens, `cached` were found in the prefix cache and `processed` are computed, those
    included (llama-server's prompt_progress)."""

    total: int
    cached: int
    processed: int


class Delta(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """A piece of one request's output. `token_index` and `char_offset` are absolute positions
    of the first token / character in this delta (docs/architecture.md invariant 2)."""

    request_id: str
    token_index: int
    char_offset: int
    text: str
    token_ids: bytes  # packed int32
    logprobs: bytes = b""  # packed float32, one per token
    top_logprobs: list[dict[int, float]] = []
    finish_reason: str | None = None
    usage: Usage | None = None
    tools: ParsedTools | None = None  # the final delta of a request with tools
    prompt_logprobs: PromptLogprobs | None = None  # on the delta of token_index 0, when asked
    # An embedding request's vector, packed float32, on its one (final) delta. It comes from the
    # scheduler straight to the tokenizer: the detokenizer has nothing to do for it.
    embedding: bytes = b""
    prompt_ids: bytes = b""  # packed int32: on the delta of token_index 0, when asked (return_prompt_ids)
    # SamplingParams.report_prompt_progress: a delta of no output that says only this, from the
    # scheduler straight to the tokenizer (as an embedding's), which forwards it until the first output
    prompt_progress: PromptProgress | None = None


class ErrorReply(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_id: str  # "" when the request could not even be parsed
    code: str
    message: str


class HealthReply(msgspec.Struct, tag=True, array_like=True, gc=False):
    """`missing`: the probe's request ids that this replica holds no request for, on this
    connection. The replica answers a connection's messages in order, so a request sent before
    the probe and missing here was lost (a restart, a request lost in a dropped connection) and
    the client resubmits it; a request that ended had its final reply delivered before this."""

    tokenizer_id: int
    is_ready: bool
    model: str
    num_in_flight: int
    max_model_len: int
    missing: list[str] = []


class AdapterReply(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """The outcome of an AdapterCommand (scheduler -> tokenizer, then tokenizer -> client): `code`
    "" when done, else an error code (invalid_request, model_not_found, adapter_in_use,
    unavailable) with its message, and `param` the command's field a refusal is about
    (lora_name, lora_path; "" for the engine's state); `adapters` is every adapter loaded after it,
    name -> path."""

    request_id: str
    code: str = ""
    message: str = ""
    adapters: dict[str, str] = {}
    param: str = ""


ClientReply = Union[Delta, ErrorReply, HealthReply, AdapterReply]

# ---------------------------------------------------------------------------
# tokenizer -> scheduler, detokenizer -> scheduler (PUSH -> PULL)
# ---------------------------------------------------------------------------


class SlotRef(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Where an image's embeddings are in its encoder's cache (ipc/embedding_cache.py): `slot`,
    the first of the pages they take, as of write `sequence` there. The embeddings themselves
    never cross a socket."""

    slot: int
    sequence: int


class PromptImage(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One image tile of a prompt (services/common/images.py; a Gemma 3 image is one): its
    `num_tokens` image tokens from prompt position `start`, whose
    embeddings are at `ref` in encoder `encoder`'s cache under content key `key`. The key also
    names the image in the prefix cache (its tokens' ids are all the same image token).
    `grid_width`: the columns of its tokens' grid, which Qwen2.5-VL's M-RoPE positions follow
    (services/common/mrope.py); 0 for the models whose image tokens take positions in order."""

    start: int
    num_tokens: int
    encoder: int
    ref: SlotRef
    key: bytes
    grid_width: int = 0


class SubmitRequest(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """A tokenized request. Re-sent with the outputs so far after a fault (resubmission):
    the scheduler replaces any live request with the same id."""

    request_id: str
    tokenizer_id: int
    prompt_ids: bytes  # packed int32
    params: SamplingParams
    output_ids: bytes = b""  # packed int32: tokens already generated (resubmission)
    arrival_time: float = 0.0
    images: list[PromptImage] = []  # in prompt order, none overlapping


class AbortRequest(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_id: str
    reason: str = "abort"  # "abort" (client) or "stop" (stop string hit)


class QueryRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Tokenizer -> scheduler: how far is each of these requests? Asked about journal entries with
    no progress for tokenizer.stall_timeout_s; answered with `RequestProgress`."""

    tokenizer_id: int
    request_ids: list[str]


class AdapterRequest(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Tokenizer -> scheduler: a client's AdapterCommand, under an id of the tokenizer's own; the
    scheduler answers with an AdapterReply of that id."""

    tokenizer_id: int
    command: AdapterCommand


SchedulerInput = Union[SubmitRequest, AbortRequest, QueryRequests, AdapterRequest]


# -- tokenizer <-> encoder (services/encoder/) ---------------------------------------------------


class EncodeImages(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The embeddings of a request's images, each given as its file's bytes: the encoder decodes
    them (off the tokenizer's thread) within `encoder.max_image_pixels`."""

    request_id: str
    images: list[bytes]
    asked_at: float = 0.0  # wall clock (time.time()) of the tokenizer's first ask: the queue time


class ImagesEncoded(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Each image tile's content key (`services/common/images.pixels_key`) and where its
    embeddings are, in prompt order (a Gemma 3 image is one tile, a SmolVLM one a grid and a
    global tile); or `error`, naming the first image that could not be used (a 400)."""

    request_id: str
    keys: list[bytes] = []
    refs: list[SlotRef] = []
    error: str = ""


# ---------------------------------------------------------------------------
# scheduler -> detokenizer (PUSH -> PULL, sharded by request id)
# ---------------------------------------------------------------------------


class TokenUpdate(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New output tokens of one request. `start_index` is the absolute output index of the
    first id; start_index == 0 carries the full history and resets the receiver's state."""

    request_id: str
    tokenizer_id: int
    start_index: int
    token_ids: bytes  # packed int32
    logprobs: bytes = b""  # packed float32
    top_logprobs: list[dict[int, float]] = []
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    params: SamplingParams | None = None  # sent with start_index == 0
    prompt_logprobs: PromptLogprobs | None = None  # with start_index == 0, when asked


class TokenBatch(msgspec.Struct, tag=True, array_like=True, gc=False):
    updates: list[TokenUpdate]

    def to_updates(self) -> list[TokenUpdate]:
        """The updates, as StepTokens.to_updates() gives them (so receivers treat both alike)."""
        return self.updates


class StepTokens(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One step's new tokens of several requests, one per entry, as columns: entry j says what a
    one-token TokenUpdate(request_ids[j], tokenizer_ids[j], ...) would. A request that verified
    proposals (docs/speculative.md) has several entries, consecutive, in order. A steady decode step
    sends one of these per detokenizer shard, not a struct per request: that would put a Python
    object per running request on the scheduler's every step."""

    request_ids: list[str]
    tokenizer_ids: list[int]
    start_indices: bytes  # packed int32, one per request
    token_ids: bytes  # packed int32, one per request
    logprobs: bytes  # packed float32, one per request
    top_logprobs: list[list[dict[int, float]]]  # per request: [] or one dict
    finish_reasons: list[str | None]
    prompt_tokens: list[int]
    cached_tokens: list[int]

    def __post_init__(self) -> None:
        # Runs on decode too: a ragged message is malformed, not a crash downstream.
        n = len(self.request_ids)
        columns = (
            self.tokenizer_ids,
            self.top_logprobs,
            self.finish_reasons,
            self.prompt_tokens,
            self.cached_tokens,
        )
        packed = (self.start_indices, self.token_ids, self.logprobs)
        if any(len(c) != n for c in columns) or any(len(p) != 4 * n for p in packed):
            raise ValueError(f"StepTokens columns must all hold {n} entries (4 bytes each when packed)")

    def to_updates(self) -> list[TokenUpdate]:
        """The same content as one TokenUpdate per request, in order."""
        return list(
            map(
                TokenUpdate,
                self.request_ids,
                self.tokenizer_ids,
                np.frombuffer(self.start_indices, "<i4").tolist(),
                np.frombuffer(self.token_ids, "V4").tolist(),
                np.frombuffer(self.logprobs, "V4").tolist(),
                self.top_logprobs,
                self.finish_reasons,
                self.prompt_tokens,
                self.cached_tokens,
            )
        )


class DropRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Forget these requests' detokenization state (aborted or replaced)."""

    request_ids: list[str]


DetokenizerInput = Union[TokenBatch, StepTokens, DropRequests]

# ---------------------------------------------------------------------------
# detokenizer -> tokenizer, scheduler -> tokenizer errors (PUSH -> PULL)
# ---------------------------------------------------------------------------


class DeltaBatch(msgspec.Struct, tag=True, array_like=True, gc=False):
    deltas: list[Delta]


# A step refused because an image's embeddings left their encoder's cache between encoding and
# the step (the worker's message says it); its requests with images are failed to their
# tokenizers with code IMAGES_EVICTED, which ask their encoders again and resubmit them.
EVICTED_EMBEDDINGS = "embeddings are no longer in"
IMAGES_EVICTED = "images_evicted"


class RequestFailed(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The engine refused or failed a request (overloaded, too long, internal; IMAGES_EVICTED,
    which the tokenizer handles itself)."""

    request_id: str
    code: str
    message: str


class RequestProgress(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Scheduler -> tokenizer, the answer to `QueryRequests`: the output tokens the scheduler holds
    for each request, -1 for one it does not run (finished, aborted or never admitted).
    `is_ready` is False while the scheduler still waits for its workers: a restarted one has not
    been sent its `ResubmitAll` then, so its -1 says nothing about a request."""

    request_ids: list[str]
    num_output_tokens: list[int]
    is_ready: bool = True

    def __post_init__(self) -> None:
        if len(self.request_ids) != len(self.num_output_tokens):
            raise ValueError("RequestProgress needs one output count per request id")


class UntrackedRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Detokenizer -> tokenizer: requests whose tokens came without the history they continue (the
    detokenizer restarted since they began). The tokenizer aborts those it does not journal:
    copies that a dead tokenizer had sent on, which nobody waits for and whose text no longer
    reaches anyone who could stop them."""

    request_ids: list[str]


class ResubmitAll(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Sent by the supervisor after a scheduler restart: resubmit every journaled request
    of that engine group with the outputs seen so far."""

    group: int


class ResubmitShard(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Sent by the supervisor after a detokenizer restart: resubmit every journaled request of
    detokenizer shard `shard` (of `num_shards`) with the outputs seen so far. The dead shard may
    have held the last text of requests that the scheduler had already finished and forgotten;
    only the journal still knows them."""

    shard: int
    num_shards: int


TokenizerInput = Union[
    DeltaBatch, RequestFailed, RequestProgress, UntrackedRequests, ResubmitAll, AdapterReply
]

# ---------------------------------------------------------------------------
# every stage <-> supervisor (DEALER -> ROUTER)
# ---------------------------------------------------------------------------


class StageLoad(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_in_flight: int = 0
    num_malformed: int = 0
    tokens_total: int = 0
    prefix_hit_rate: float = 0.0
    gpu_memory_allocated: int = 0  # bytes, CUDA workers only
    gpu_memory_reserved: int = 0
    num_auth_failures: int = 0  # CURVE handshakes this process's server sockets refused
    # A scheduler's LoRA adapters: loaded, and those of its running and of its waiting requests.
    lora_adapters: list[str] = []
    lora_running: list[str] = []
    lora_waiting: list[str] = []
    # A scheduler's p90 seconds from receiving a request to its first token, over the last 30 s
    # (0.0: none in that time); the autoscaler's TTFT signal.
    ttft_p90_s: float = 0.0
    # A tokenizer that took the run's Shutdown: its num_in_flight now holds every call it will
    # take, which is what the supervisor's drain waits on (an earlier load may miss one).
    is_draining: bool = False


class Ready(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """A stage finished starting. `info` is free-form (model, KV capacity, ...)."""

    name: str
    pid: int
    info: dict[str, str] = {}


class Heartbeat(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Liveness plus a progress counter: a stage with work whose progress stops is hung."""

    name: str
    pid: int
    progress: int
    has_work: bool
    load: StageLoad = msgspec.field(default_factory=StageLoad)


ControlUp = Union[Ready, Heartbeat]

# Supervisor -> stage commands reuse a stage input above (ResubmitAll) plus these.


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Stop taking new work and finish what is in flight; the supervisor times the drain."""


class Reconfigure(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Live settings pushed on hot reload (supervision/live_settings.py)."""

    log_level: str = "INFO"
    max_num_waiting: int = 0
    default_max_tokens: int = 256
    lora_adapters: dict[str, str] = {}  # lora.adapters: the schedulers load the added, unload the removed


class TopologyChanged(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Supervisor -> every stage, when replicas or engine groups are added or retired, when an
    engine group is placed on another node, and to each stage as it comes up: the run's
    topology now. A stage resizes its links to its peers from it (services/peers.py)."""

    topology: Topology


class GroupLoads(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Supervisor -> tokenizers, every heartbeat interval: the load each engine group reported
    (running + waiting sequences, plus KV usage as a tie-break), for choosing a group."""

    loads: list[float]


ControlDown = Union[Shutdown, Reconfigure, TopologyChanged, ResubmitAll, ResubmitShard, GroupLoads]

# ---------------------------------------------------------------------------
# scheduler <-> gpu worker: step plans and results travel through shared-memory rings
# (ipc/shm.py). The slot header is one of these; arrays follow in the slot.
# ---------------------------------------------------------------------------


class WorkerHello(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Worker -> scheduler handshake once the model is loaded."""

    rank: int
    world_size: int
    pid: int
    model: str
    dtype: str
    device: str
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = []
    # The window every layer's attention reads within (its largest); 0 when some layer reads the
    # whole context. KV blocks wholly before it are never read again (the scheduler frees them).
    sliding_window: int = 0
    # LongRoPE (Phi-3): original_max_position_embeddings, past which a sequence rotates every
    # position with the long factors (the scheduler recomputes it then); 0 without LongRoPE.
    long_rope_from: int = 0
    # An embedding model (services/common/pooling.py): how it pools ("" = it generates), and
    # whether it normalizes its vectors.
    pooling: str = ""
    normalize: bool = True
    # The scheduler's echo: every LoRA adapter loaded, which a (re)started worker loads into its
    # host memory before it reads a step (adapters loaded at run time survive a worker restart).
    adapters: list[AdapterSource] = []


class AdapterSource(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A loaded LoRA adapter: its name and the PEFT directory it was read from."""

    name: str
    path: str


class LoadAdapter(msgspec.Struct, tag=True, gc=False):  # beside WorkerHello: not array_like
    """Scheduler -> worker: check the adapter against the model and keep it in host memory, ready
    to be copied into a slot (the step header's lora_slots); the worker answers AdapterLoaded
    with the same `load_id` (the scheduler's count of its loads), so that a late answer to a load
    given up on is never taken for a later load of the same name."""

    adapter: AdapterSource
    load_id: int = 0


class UnloadAdapter(msgspec.Struct, tag=True, gc=False):  # beside WorkerHello: not array_like
    """Scheduler -> worker: forget adapter `name` (no request uses it any more)."""

    name: str


class AdapterLoaded(msgspec.Struct, tag=True, gc=False):  # beside WorkerHello: not array_like
    """Worker -> scheduler: the LoadAdapter of `name` done (`error` "") or refused, and why."""

    rank: int
    name: str
    error: str = ""
    load_id: int = 0  # the LoadAdapter's


WorkerInput = Union[WorkerHello, LoadAdapter, UnloadAdapter]
WorkerOutput = Union[WorkerHello, AdapterLoaded]


# In a step plan's `input_ids`: "the token this worker sampled for this sequence's plan-table row
# (`rows`) in the previous step". The scheduler plans step N+1 while step N executes, before it
# knows what N sampled (docs/internals.md, "Overlap").
PLACEHOLDER_TOKEN = -1
# In a step plan's `input_ids`, at a verifying row's proposals only: "a token the worker's draft
# model proposes here" (speculative.method draft_model, docs/speculative.md). The scheduler says
# how many tokens each row drafts; the worker drafts them in the same step, before verifying.
DRAFT_TOKEN = -2


class StepHeader(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Step plan header (scheduler -> workers). Arrays in the slot are listed in
    docs/internals.md; `num_tokens` flattened tokens over `num_seqs` sequences."""

    step_id: int
    num_tokens: int
    num_seqs: int
    max_top_logprobs: int
    # The LoRA adapter each slot must hold for this step ("" = whatever it holds), when a row has
    # one: the worker copies in, from host memory, those its slots do not hold yet (waiting for a
    # copy still in flight into that slot).
    lora_slots: list[str] = []
    # Adapters to copy into slots ahead, by slot ("" = none), when there are any: slots no row of
    # this step uses, copied while the step runs, for a later step's lora_slots (lora_residency.py).
    lora_prefetch: list[str] = []


class ResultHeader(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Step result header (worker rank 0 -> scheduler). error != "" means the step failed
    (e.g. a plan with invalid blocks); the arrays are then absent. `execute_s` is the worker's
    own time for the step (model and sampling), which the scheduler exports as a metric."""

    step_id: int
    num_seqs: int
    error: str = ""
    execute_s: float = 0.0
