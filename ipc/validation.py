"""The one place the request rules live: sampling parameters and prompt token ids.

Pure Python (no torch, no numpy import): the tokenizer checks a request before tokenizing it
further, and the scheduler checks it again on submission, with the same functions.

Decisions:
- `max_tokens` only has to be in [1, 1e6]; the scheduler clamps it to the room left in
  max_model_len, so a long prompt with a large max_tokens is not an error.
- A prompt must leave room for one output token: `num_prompt_tokens < max_model_len` (an
  embedding request's input, which has no output, may fill the context).
- The sampling fields a request may leave unset (None) must be set by the time these checks
  run: the tokenizer fills them from the model's defaults first (ipc/sampling_defaults.py).
- User logit bias values are finite, in [-100, 100] (OpenAI): -100 effectively bans a token.
  -inf is reserved for the scheduler (eos / stop ids under min_tokens) and never comes from a user.
- A prompt's work budget (tokenizer.max_prompt_chars, tokenizer.max_messages) counts every
  character that reaches the chat template: contents, roles, names, tool call ids, names and
  arguments, and the tools JSON. The tokenizer and the gateway's /tokenize render and encode on one
  thread, so a request past it is refused before any of that work (`check_chat_budget`).
- `allowed_token_ids` (vLLM's) is a non-empty list of vocabulary ids, at most the vocabulary's
  size of them (repeats are allowed, as vLLM allows them). `bad_words` (vLLM's) are at most
  MAX_BAD_WORDS texts of 1 to MAX_BAD_WORD_CHARS characters; the tokenizer tokenizes each (twice:
  as it is, and with a leading space) into `bad_words_ids`, which a client never sends: at most
  2 x MAX_BAD_WORDS sequences of 1 to MAX_BAD_WORD_TOKENS vocabulary ids. Whether an allowed token
  is left once eos and stop ids are held back (min_tokens) or bad words ban some is the
  scheduler's to say (it knows the model's eos ids; services/scheduler/admission.py).
- A `structured` constraint is checked for its form here (kind, text, size); whether it compiles is
  the grammar engine's to say (services/common/grammar_compiler.py `check_constraint`, which the
  tokenizer calls next). It cannot be combined with `min_tokens` or `ignore_eos`: the grammar decides
  where the output ends, and once it must end eos is the only token its mask allows, so holding eos
  back would leave a row with no token to sample.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ipc.config import MAX_ADAPTER_NAME_CHARS
from ipc.messages import ChatMessage, SamplingParams, StructuredOutput, content_text

MAX_MAX_TOKENS = 1_000_000
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1_000_000
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PRESENCE_FREQUENCY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
MAX_SEED = 2**63  # exclusive: seeds travel as int64
MAX_ABS_PRIORITY = 2**31
MAX_CACHE_SALT_CHARS = 1024  # hashed into the request's prefix-cache keys
# vLLM's bad_words: each word is matched token by token at every sampled position, so their number
# and length are bounded (vLLM bounds them after tokenization: 128 sequences, 1024 tokens).
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 256  # one tokenized bad word: a word of MAX_BAD_WORD_CHARS in byte tokens, say
MAX_BAD_WORDS_IDS = 2 * MAX_BAD_WORDS  # each word as it is and with a leading space
# The fields a request may leave None for the tokenizer to fill (ipc/sampling_defaults.py).
DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
# A constraint's text is bounded before anything compiles; the compiler has its own limits on top.
MAX_SPEC_BYTES = 64 * 1024


class InvalidParams(ValueError):
    """A request the engine refuses; `code` is the wire ErrorCode of the reply."""

    code = "invalid_request"


class PromptTooLong(InvalidParams):
    """The prompt leaves no room for an output token within max_model_len."""

    code = "prompt_too_long"


def validate_params(
    params: SamplingParams, *, vocab_size: int, max_model_len: int, num_prompt_tokens: int
) -> None:
    """Raise InvalidParams (naming the field) unless every parameter is in range."""
    _check_prompt_len(num_prompt_tokens, max_model_len, generates=params.embed is None)
    for name in DEFAULTED_FIELDS:
        if getattr(params, name) is None:
            raise InvalidParams(f"{name} is unset: the tokenizer fills in its default before the engine")
    _check_int("max_tokens", params.max_tokens, 1, MAX_MAX_TOKENS)
    _check_float("temperature", params.temperature, 0.0, MAX_TEMPERATURE)
    _check_int("top_k", params.top_k, 0, MAX_TOP_K - 1, hint=" (0 disables)")
    _check_float("top_p", params.top_p, 0.0, 1.0, low_open=True)
    _check_float("min_p", params.min_p, 0.0, 1.0)
    _check_float("repetition_penalty", params.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
    lim = MAX_ABS_PRESENCE_FREQUENCY
    _check_float("presence_penalty", params.presence_penalty, -lim, lim)
    _check_float("frequency_penalty", params.frequency_penalty, -lim, lim)
    _check_logit_bias(params.logit_bias, vocab_size)
    _check_int("min_tokens", params.min_tokens, 0, params.max_tokens, hint=" (max_tokens)")
    _check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size, MAX_STOP_TOKEN_IDS)
    _check_stop_strings(params.stop)
    _check_int("logprobs", params.logprobs, 0, MAX_LOGPROBS)
    if params.prompt_logprobs is not None:
        _check_int("prompt_logprobs", params.prompt_logprobs, 0, MAX_LOGPROBS)
    if params.seed is not None:
        _check_int("seed", params.seed, 0, MAX_SEED - 1)
    _check_int("priority", params.priority, -MAX_ABS_PRIORITY, MAX_ABS_PRIORITY - 1)
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculate"):
        if not isinstance(getattr(params, name), bool):
            raise InvalidParams(f"{name} must be a bool, got {getattr(params, name)!r}")
    if params.allowed_token_ids is not None:
        _check_allowed_token_ids(params.allowed_token_ids, vocab_size)
    _check_bad_words(params.bad_words)
    _check_bad_words_ids(params.bad_words_ids, vocab_size)
    if params.structured is not None:
        _check_structured(params)
    if not isinstance(params.adapter, str) or len(params.adapter) > MAX_ADAPTER_NAME_CHARS:
        raise InvalidParams(f"adapter must be a name of at most {MAX_ADAPTER_NAME_CHARS} characters")
    if not isinstance(params.cache_salt, str) or len(params.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidParams(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters")


def validate_prompt_ids(
    ids: Sequence[int], vocab_size: int, max_model_len: int, generates: bool = True
) -> None:
    """Raise unless the prompt is non-empty, leaves room for output (where it `generates`), and
    every id is in the vocab.

    Accepts a list or a numpy int array (checked with its own min/max, without importing numpy).
    """
    _check_prompt_len(len(ids), max_model_len, generates)
    lo, hi = (int(ids.min()), int(ids.max())) if hasattr(ids, "min") else (min(ids), max(ids))
    if lo >= 0 and hi < vocab_size:
        return
    # Failure path only: name the first bad id and where it is.
    index, bad = next((i, int(t)) for i, t in enumerate(ids) if not 0 <= int(t) < vocab_size)
    raise InvalidParams(
        f"{_prompt_word(generates)} token id {bad} at index {index} is out of the vocabulary [0, {vocab_size})"
    )


def chat_chars(messages: Sequence[ChatMessage]) -> int:
    """Every character of a conversation that reaches the chat template."""
    total = 0
    for message in messages:
        total += len(message.role) + len(content_text(message.content))
        total += len(message.name or "") + len(message.tool_call_id or "") + len(message.reasoning or "")
        for call in message.tool_calls or ():
            total += len(call.id) + len(call.name) + len(call.arguments)
    return total


# A chat template knows these roles (developer: as system).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def check_chat_messages(messages: Sequence[ChatMessage]) -> None:
    """A chat as every path that renders one takes it (generation, /tokenize, input_tokens): at
    least one message, each of a known role and with content."""
    if not messages:
        raise InvalidParams("messages must not be empty")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidParams(
                f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {message.role!r}"
            )
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise InvalidParams(
                f"messages[{i}].content is required (only an assistant's tool calls may go without)"
            )


def check_continuable(messages: Sequence[ChatMessage]) -> None:
    """continue_final_message: the last message is an assistant's text, which the reply goes on
    from (a turn that calls tools is finished: its calls would be cut off or written as text)."""
    last = messages[-1] if messages else None
    if last is None or last.role != "assistant":
        raise InvalidParams("continue_final_message: the last message must be the assistant's, to continue")
    if last.tool_calls:
        raise InvalidParams(
            "continue_final_message: the last message calls tools; a turn with calls is finished"
        )
    if not content_text(last.content).strip():
        raise InvalidParams("continue_final_message: the last message has no text to continue")


def check_prompt_chars(num_chars: int, max_chars: int, counted: str = "") -> None:
    """`counted` says what the characters are of, when not the prompt text itself."""
    if num_chars > max_chars:
        raise PromptTooLong(
            f"prompt: {num_chars} characters{counted}; the limit is {max_chars} (tokenizer.max_prompt_chars)"
        )


def check_message_count(num_messages: int, max_messages: int) -> None:
    if num_messages > max_messages:
        raise InvalidParams(
            f"messages: {num_messages} messages; the limit is {max_messages} (tokenizer.max_messages)"
        )


def check_chat_budget(
    messages: Sequence[ChatMessage], tools_json: str, *, max_chars: int, max_messages: int
) -> None:
    """Raise unless a chat is within the per-request budget: at most `max_messages` messages and
    `max_chars` characters in them and the tools JSON together."""
    check_message_count(len(messages), max_messages)
    num_chars = chat_chars(messages) + len(tools_json)
    check_prompt_chars(num_chars, max_chars, " in the messages, their tool calls and the tools")


def _prompt_word(generates: bool) -> str:
    """An embedding's text is its `input` (the API's field), a generation's its prompt."""
    return "prompt" if generates else "input"


# The counts of _check_prompt_len's refusal, read back from its message (which is what crosses
# the stages) where an API reports them apart (llama.cpp's exceed_context_size_error).
PROMPT_TOO_LONG_COUNTS = re.compile(r"\b(?:prompt|input) has (\d+) tokens but max_model_len is (\d+)\b")


def _check_prompt_len(num_prompt_tokens: int, max_model_len: int, generates: bool) -> None:
    what = _prompt_word(generates)
    if num_prompt_tokens < 1:
        raise InvalidParams(f"{what} is empty: at least one {what} token is required")
    if not generates and num_prompt_tokens > max_model_len:
        raise PromptTooLong(
            f"input has {num_prompt_tokens} tokens but max_model_len is {max_model_len}: an input may "
            f"have at most {max_model_len}"
        )
    if generates and num_prompt_tokens >= max_model_len:
        raise PromptTooLong(
            f"prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}: "
            f"at most {max_model_len - 1} prompt tokens leave room for one output token"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, lo: int, hi: int, hint: str = "") -> None:
    if not _is_int(value):
        raise InvalidParams(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidParams(f"{name} must be in [{lo}, {hi}]{hint}, got {value}")


def _check_float(name: str, value: Any, lo: float, hi: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParams(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidParams(f"{name} must be finite, got {value}")
    if value > hi or value < lo or (low_open and value == lo):
        interval = f"({lo:g}, {hi:g}]" if low_open else f"[{lo:g}, {hi:g}]"
        raise InvalidParams(f"{name} must be in {interval}, got {value:g}")


def _check_token_ids(name: str, ids: Any, vocab_size: int, max_count: int) -> None:
    if not isinstance(ids, (list, tuple)):
        raise InvalidParams(f"{name} must be a list of token ids, got {type(ids).__name__}")
    if len(ids) > max_count:
        raise InvalidParams(f"{name} has {len(ids)} entries, at most {max_count} are allowed")
    # Whole lists at C speed (a vocabulary's worth of allowed_token_ids is checked on the
    # scheduler's loop too); the loop below only finds what is wrong.
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return
    for token_id in ids:
        if not _is_int(token_id) or not 0 <= token_id < vocab_size:
            raise InvalidParams(f"{name} entry {token_id!r} is not a token id in [0, {vocab_size})")


def _check_allowed_token_ids(ids: Any, vocab_size: int) -> None:
    """At least one id (vLLM refuses an empty list too: nothing could be sampled), each in the
    vocabulary, and no more of them than the vocabulary has tokens."""
    _check_token_ids("allowed_token_ids", ids, vocab_size, vocab_size)
    if not ids:
        raise InvalidParams("allowed_token_ids must not be empty: it would leave no token to sample")


def _check_bad_words(words: Any) -> None:
    if not isinstance(words, (list, tuple)):
        raise InvalidParams(f"bad_words must be a list of strings, got {type(words).__name__}")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidParams(f"bad_words has {len(words)} entries, at most {MAX_BAD_WORDS} are allowed")
    for i, word in enumerate(words):
        if not isinstance(word, str):
            raise InvalidParams(f"bad_words[{i}] must be a string, got {type(word).__name__}")
        if not word.strip():
            raise InvalidParams(f"bad_words[{i}] is empty or only whitespace: it would ban nothing")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise InvalidParams(
                f"bad_words[{i}] has {len(word)} characters, at most {MAX_BAD_WORD_CHARS} are allowed"
            )


def _check_bad_words_ids(sequences: Any, vocab_size: int) -> None:
    if not isinstance(sequences, (list, tuple)):
        raise InvalidParams(f"bad_words_ids must be a list of token id lists, got {type(sequences).__name__}")
    if len(sequences) > MAX_BAD_WORDS_IDS:
        raise InvalidParams(
            f"bad_words_ids has {len(sequences)} entries, at most {MAX_BAD_WORDS_IDS} are allowed"
        )
    for i, ids in enumerate(sequences):
        _check_token_ids(f"bad_words_ids[{i}]", ids, vocab_size, MAX_BAD_WORD_TOKENS)
        if not ids:
            raise InvalidParams(f"bad_words_ids[{i}] is empty: a bad word has at least one token")


def _check_logit_bias(bias: dict[int, float], vocab_size: int) -> None:
    _check_token_ids("logit_bias", list(bias), vocab_size, MAX_LOGIT_BIAS_ENTRIES)
    for token_id, value in bias.items():
        _check_float(f"logit_bias[{token_id}]", value, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)


def _check_structured(params: SamplingParams) -> None:
    spec = params.structured
    if not isinstance(spec, StructuredOutput):
        raise InvalidParams(f"structured must be a StructuredOutput, got {type(spec).__name__}")
    if spec.kind not in STRUCTURED_KINDS:
        raise InvalidParams(f"structured.kind must be one of {list(STRUCTURED_KINDS)}, got {spec.kind!r}")
    if not isinstance(spec.spec, str) or not spec.spec:
        raise InvalidParams(f"structured.spec must be a non-empty string, got {spec.spec!r:.80}")
    size = len(spec.spec.encode())
    if size > MAX_SPEC_BYTES:
        raise InvalidParams(f"structured.spec: {size} bytes, larger than the limit of {MAX_SPEC_BYTES}")
    if not isinstance(spec.strict, bool):
        raise InvalidParams(f"structured.strict must be a bool, got {spec.strict!r}")
    for name, conflicts in (("min_tokens", params.min_tokens > 0), ("ignore_eos", params.ignore_eos)):
        if conflicts:
            raise InvalidParams(
                f"{name} cannot be combined with structured output: the grammar decides where the "
                "output ends (eos is the only token it allows once complete)"
            )


def _check_stop_strings(stop: Any) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidParams(f"stop has {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed")
    for text in stop:
        if not isinstance(text, str) or not 1 <= len(text) <= MAX_STOP_STRING_CHARS:
            raise InvalidParams(
                f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters, got {text!r:.80}"
            )
