"""OpenAI's request and response bodies as msgspec Structs (plus vLLM's sampling extensions).

Requests decode strictly by type (a wrong type is a 400 naming the field) and ignore unknown
fields, as vLLM's server does (OpenAI's refuses them). Responses encode every field, nulls
included, in OpenAI's shapes.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec
import msgspec.inspect

# -- requests ---------------------------------------------------------------------------------


def _takes_null(field_type: msgspec.inspect.Type) -> bool:
    if isinstance(field_type, (msgspec.inspect.NoneType, msgspec.inspect.AnyType)):
        return True
    return isinstance(field_type, msgspec.inspect.UnionType) and any(
        isinstance(t, msgspec.inspect.NoneType) for t in field_type.types
    )


def nulls_as_defaults(data: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct | None:
    """`data` as `kind` with each top-level null of an optional field that takes no null (`n`,
    `stream`, `logprobs`, `min_tokens`, ...) read as the field's default, as vLLM's request models
    read it; None when the body has no such null (its first decode's error stands). Raises
    msgspec's errors for what is wrong besides."""
    try:
        body = msgspec.json.decode(data)
    except msgspec.ValidationError:
        # A number past float64's range (1e999): untyped, its path reads `$[...]`, where the first,
        # typed decode named the field (`temperature: number out of range`).
        return None
    if not isinstance(body, dict):
        return None
    fields = msgspec.inspect.type_info(kind).fields  # type: ignore[union-attr]
    defaulted = {f.encode_name for f in fields if not f.required and not _takes_null(f.type)}
    nulls = [key for key, value in body.items() if value is None and key in defaulted]
    if not nulls:
        return None
    for key in nulls:
        del body[key]
    return msgspec.convert(body, kind, str_keys=True)


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has the usage so far


class ImageUrl(msgspec.Struct, frozen=True):
    url: str
    detail: str | None = None  # OpenAI's low/high/auto: a model's processor fixes the resolution


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class FunctionCallIn(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(msgspec.Struct, frozen=True):
    id: str
    function: FunctionCallIn
    type: str = "function"


class ChatMessageIn(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer names the call it answers
    # An assistant turn's thinking, which the chat template may render (interleaved thinking):
    # `reasoning` is vLLM's name since 0.11, `reasoning_content` DeepSeek's and llama.cpp's.
    reasoning: str | None = None
    reasoning_content: str | None = None


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    """What chat and completions requests share: OpenAI's sampling fields and vLLM's extras."""

    model: str = ""
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    user: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt's own logprobs, top-N at each position
    speculate: bool = True  # Brigade's: false opts the request out of speculative decoding
    priority: int = 0  # vLLM's: lower is scheduled first (ties first come, first served)
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last k tokens (-1: all that fit)
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids in the reply
    # llama-server's: every streamed chunk (and the reply) carries `timings` (services/gateway/timings.py)
    timings_per_token: bool = False
    # llama-server's: a stream reports its prompt's progress before the first output (prompt_progress)
    return_progress: bool = False
    # vLLM's fields that Brigade does not serve, each of which changes what a request returns:
    # refused by name (jobs.UNSERVED_FIELDS) where set, not ignored as unknown fields are.
    use_beam_search: bool = False
    length_penalty: float | None = None
    logits_processors: Any = None
    prompt_embeds: Any = None
    guided_whitespace_pattern: str | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cached blocks are shared only under the same salt
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    bad_words: list[str] | None = None  # vLLM's: texts the output never contains
    # Output constraints (ipc/structured_output.py translates and checks them, naming the field).
    response_format: dict[str, Any] | None = None  # OpenAI: json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM: json, regex, choice, grammar
    # vLLM's older spelling of structured_outputs, one field per kind (taken as the same)
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # llama-server's top-level fields for the same, which its clients send to /v1 too
    json_schema: Any = None  # a JSON schema (guided_json)
    grammar: str | None = None  # a grammar, GBNF or lark (guided_grammar)


class ChatCompletionRequest(SamplingFields, frozen=True, kw_only=True):
    takes_adapter: ClassVar[bool] = True  # its model may name a LoRA adapter (Gateway.check_model)
    messages: list[ChatMessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | a named function
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more chat template variables
    # vLLM's: the reply continues the last (assistant) message instead of starting a new turn.
    continue_final_message: bool = False
    add_generation_prompt: bool = True  # vLLM's: false renders no generation prompt
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's thinking out of the reply
    # vLLM's, not served (refused where they differ from these, jobs.UNSERVED_CHAT_FIELDS)
    add_special_tokens: bool = False
    chat_template: str | None = None
    echo: bool = False
    functions: Any = None
    function_call: Any = None
    documents: Any = None
    # OpenAI's: how long a reasoning model thinks; the chat template reads it as `reasoning_effort`
    # (gpt-oss's writes it into the system message), an entry of chat_template_kwargs overrides it.
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class CompletionRequest(SamplingFields, frozen=True, kw_only=True):
    takes_adapter: ClassVar[bool] = True  # its model may name a LoRA adapter (Gateway.check_model)
    # A string, a list of strings, token ids, or a list of token id lists. msgspec decodes one
    # array type per union, so the list's items are checked for one kind in services/gateway/jobs.py.
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    # A string, a list of strings, token ids, or a list of token id lists (one kind: checked in
    # services/gateway/app.py `embedding_inputs`).
    input: str | list[str | int | list[int]]
    model: str = ""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: embed the last k tokens (-1: the model's limit)
    # vLLM's: false embeds a text without its special tokens, which the engine always adds
    # (services/gateway/app.py refuses false rather than answer with the other vector).
    add_special_tokens: bool = True


class ScoreRequest(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's /score: text_1 against each text_2 (one text_1), or pairwise (equal lists)."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str = ""
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankRequest(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's /rerank (Jina's and Cohere's shape): the documents by their score against the query."""

    query: str
    documents: list[str]
    model: str = ""
    top_n: int | None = None  # the best top_n; none, or 0, for all
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    # vLLM's, for messages: the tools offered (rendered as a chat completion offers them) and
    # more chat template variables
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str = ""
    tokens: list[int]


# -- responses --------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageOut(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: Literal["function"] = "function"


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET  # absent when there are none
    # A reasoning model's thinking (services/gateway/reasoning.py), under both names clients read
    # (vLLM's `reasoning`, DeepSeek's and llama.cpp's `reasoning_content`); absent without a
    # reasoning parser.
    reasoning: str | msgspec.UnsetType | None = msgspec.UNSET
    reasoning_content: str | msgspec.UnsetType | None = msgspec.UNSET


class PromptLogprob(msgspec.Struct):
    """vLLM's entry of a prompt_logprobs dict (keyed by the token id as a string)."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None for the first, else the token and the top-N.
PromptLogprobsOut = list[dict[str, PromptLogprob] | None]


class Timings(msgspec.Struct):
    """llama-server's `timings` (services/gateway/timings.py): the prompt's tokens computed (not
    found cached) and its time to the first output, the output's tokens and their time since."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # vLLM's return_token_ids: asked for only


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut | None
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET  # asked for only
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # vLLM's return_token_ids
    timings: Timings | msgspec.UnsetType = msgspec.UNSET  # llama-server's timings_per_token


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """Stream deltas carry only what is new (OpenAI omits role after the first chunk)."""

    role: str | None = None
    reasoning: str | None = None  # both names, as ChatMessageOut's
    reasoning_content: str | None = None
    content: str | None = None
    # {"index", "id", "type", "function": {"name", "arguments"}}: a call's first delta has its
    # id and name, later ones add to its arguments (services/common/tool_parsers.py)
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # vLLM's return_token_ids


class PromptProgressOut(msgspec.Struct):
    """llama-server's prompt_progress: of `total` prompt tokens, `cache` were found in the prefix
    cache and `processed` are computed, those included; `time_ms` since the request arrived."""

    total: int
    cache: int
    processed: int
    time_ms: int


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # a choice's first chunk, when asked
    timings: Timings | msgspec.UnsetType = msgspec.UNSET  # llama-server's timings_per_token
    prompt_progress: PromptProgressOut | msgspec.UnsetType = msgspec.UNSET  # llama-server's return_progress


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET  # asked for only
    # vLLM's return_token_ids: the prompt as the engine ran it (a stream's first chunk of the
    # choice), and the output's ids
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None
    timings: Timings | msgspec.UnsetType = msgspec.UNSET  # llama-server's timings_per_token
    prompt_progress: PromptProgressOut | msgspec.UnsetType = msgspec.UNSET  # llama-server's return_progress


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # base64 of the little-endian float32 values, where asked
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: Literal["score"] = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "brigade"
    max_model_len: int | None = None
    object: Literal["model"] = "model"
    parent: str | None = None  # a LoRA adapter's base model; None for the base model itself


class LoadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/load_lora_adapter (vLLM's body; `load_inplace` replaces a loaded adapter of that
    name, as an RL trainer pushes new weights, once no request uses it)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/unload_lora_adapter (vLLM's body, and `wait`: wait for the requests that use the
    adapter up to lora.unload_wait_s, or refuse with 409 while any does)."""

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; adapters are named here, so it is accepted and unused
    wait: bool = True


class StreamLookupRequest(msgspec.Struct):
    """llama-server's POST /v1/streams/lookup: the conversations whose streams a client asks about."""

    conversation_ids: list[str] = []


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody
