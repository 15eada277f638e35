"""llama.cpp's own server API (not its OpenAI one): `/completion`, `/infill`, `/tokenize` and
`/detokenize` in its shapes, `/apply-template` and `/props`, for clients written against
llama-server.

A `/completion` request is translated into a /v1/completions request (`CompletionRequest`) and
planned by `plan_completion`, so sampling, seeds, stop strings, the output constraint and the
engine's refusals are the completions path's own; `Gateway.run` runs it, and `LlamaWriter` writes
the reply in llama.cpp's shapes (its `stop_type`, `timings`, `completion_probabilities`, and
its events without `[DONE]`). An `/infill` (code editors' fill-in-the-middle) is a /completion
whose prompt is built from the code around the gap with the model's FIM tokens (`infill_prompt`).
Errors are llama.cpp's `{"error": {"code", "message", "type"}}`, `code` the HTTP status.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, ClassVar

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from client.errors import BrigadeError
from client.sdk import StreamDelta
from ipc import messages as m
from ipc.validation import PROMPT_TOO_LONG_COUNTS, check_prompt_chars
from services.gateway import protocol as p
from services.gateway.app import (
    BRIGADE_VERSION,
    JSON,
    Feed,
    Gateway,
    budget_errors,
    chat_to_render,
    embedding_inputs,
    internal_error,
)
from services.gateway.errors import ERROR_TYPES, ApiError, from_engine, invalid
from services.gateway.jobs import SEED_HEADER, Plan, header_seed, plan_completion
from services.gateway.metrics import RequestTimer
from services.gateway.timings import PromptReports, llama_timings, progress_out

# llama.cpp's sampling defaults (tools/server/README.md), used where a request leaves them out,
# so that a llama.cpp client samples as it would there and generation_settings says what was used.
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# llama.cpp bans a token with a bias of `false`; the engine's bias range ends at -100.
BANNED_BIAS = -100.0

_encoder = msgspec.json.Encoder()
_ABSENT = object()  # a response_fields path the reply does not have
_TOKEN_ID = re.compile(r"[+-]?[0-9]+")  # a logit_bias key that names a token by its id


class LlamaCompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """llama.cpp's POST /completion body (the fields Brigade acts on; others are ignored, as
    llama.cpp ignores fields it does not know)."""

    takes_adapter: ClassVar[bool] = True  # its model may name a LoRA adapter (Gateway.check_model)
    # A string, token ids, or one list mixing strings and token ids (its strings tokenized
    # without special tokens, in place); {"prompt_string": ...}; or a list of such prompts (a
    # list of replies). A top-level list holding a token id is one prompt.
    prompt: str | dict[str, Any] | list[str | int | list[str | int] | dict[str, Any]]
    model: str = ""
    # How many tokens to generate (-1, unset: until eos or the context's end); llama-server takes
    # OpenAI's max_tokens where n_predict is not given, as clients written for /v1 send it.
    n_predict: int | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int = -1  # -1: a random seed
    # Its empty strings are left out, as llama-server leaves them; one string is one stop string
    # (llama-server reads only a list, but a client that sends a string means that one).
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False
    n_probs: int = 0
    json_schema: Any = None
    grammar: str | None = None
    # [[id or text, bias or false], ...] or {"id or text": bias}
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    cache_prompt: bool = True  # accepted: Brigade's prefix cache is always on
    return_tokens: bool = False
    # Code completion's limits (llama.vim's): a line the output starts with less indentation ends
    # it, cut where the line's text starts; past this many ms of generating, a new line ends it.
    n_indent: int = 0
    t_max_predict_ms: int = 0
    # The last reply's fields to give, each a key or a path ("timings/prompt_n"), under its name.
    response_fields: list[str] | None = None
    timings_per_token: bool = False  # every streamed event carries its output's timings so far
    return_progress: bool = False  # a stream reports its prompt's progress before the first output
    # Completions of each prompt (llama-server's n_cmpl, which takes OpenAI's n where it is not
    # given); more than one reply in all is a list, each prompt's right after one another.
    n_cmpl: int | None = None
    n: int | None = None

    @property
    def num_to_predict(self) -> int:
        """n_predict, else OpenAI's max_completion_tokens, else its max_tokens, else -1 (the
        names llama-server reads it by, in its order)."""
        for given in (self.n_predict, self.max_completion_tokens, self.max_tokens):
            if given is not None:
                return given
        return -1

    @property
    def stop_words(self) -> list[str]:
        """`stop` as a list, without its empty strings: llama-server skips them (a client's `[""]`
        means no stop string), where the engine refuses one."""
        words = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [word for word in words if word]

    @property
    def num_completions(self) -> int:
        """n_cmpl, else n, else 1."""
        return next((given for given in (self.n_cmpl, self.n) if given is not None), 1)


class InfillChunk(msgspec.Struct, frozen=True):
    """A file of `input_extra`: context from elsewhere in the project."""

    text: str
    filename: str = "tmp"


class LlamaInfillRequest(LlamaCompletionRequest, frozen=True, kw_only=True):
    """llama.cpp's POST /infill body: /completion's fields, the code before and after the gap, and
    other files for context. `prompt` goes on from the prefix, before the suffix (where
    llama-server puts it)."""

    prompt: str = ""  # type: ignore[assignment]  # /completion's many forms: one text here
    input_prefix: str | list[str | int] | None = None
    input_suffix: str | list[str | int] | None = None
    input_extra: list[InfillChunk] = []


# The texts of the fill-in-the-middle tokens in the vocabularies llama.cpp recognises, by role:
# a model whose tokenizer has a prefix, a suffix and a middle token can fill a gap. With a repo
# and a file separator token too, other files are given in the repository-level pattern.
FIM_TOKENS = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
               "<|code_prefix|>", "<|prefix|>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
               "<|code_suffix|>", "<|suffix|>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
               "<|code_middle|>", "<|middle|>"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "file_sep": ("<|file_sep|>",),
}  # fmt: skip
# What llama-server's batch (its default n_batch) holds of the code around the gap: three
# quarters for the prefix, the rest for the prompt and the suffix; other files fill the context
# beyond it.
FIM_BATCH_TOKENS = 2048
# Between two files of input_extra for a model without a file separator token.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


def fim_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """Each FIM role's token id in this tokenizer (the first of its texts it has), or None."""
    return {
        role: next((i for text in texts if (i := tokenizer.token_to_id(text)) is not None), None)
        for role, texts in FIM_TOKENS.items()
    }


def mixed_ids(tokenizer: Any, prompt: str | list[str | int]) -> list[int]:
    """A text's ids, or a list's: its token ids as they are, its texts encoded in place."""
    parts = [prompt] if isinstance(prompt, str) else prompt
    return [i for part in parts for i in (tokenizer.encode(part) if isinstance(part, str) else [part])]


def bos_ids(tokenizer: Any) -> list[int]:
    """[BOS] for a tokenizer that starts a text with it (as llama-server's prompts start), else []."""
    bos = tokenizer.special_tokens_map.get("bos_token")
    bos_id = tokenizer.token_to_id(bos) if bos else None
    return (
        [bos_id]
        if bos_id is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos_id]
        else []
    )


def infill_prompt(
    tokenizer: Any, fim: dict[str, int | None], body: LlamaInfillRequest, context_tokens: int
) -> list[int]:
    """The token ids llama-server builds for an /infill: other files (repository-level with the
    repo and file separator tokens, else separated by SNIPPET_SEPARATOR) then
    `<PRE>prefix prompt<SUF>suffix<MID>`, the prefix cut to its last tokens and the suffix to its
    first as FIM_BATCH_TOKENS allows, the files to their last tokens as the context allows. Where
    llama-server would overflow a short context, the prefix (then the suffix) is cut further so
    that the prompt leaves room for n_predict tokens (at least one, at most half the context)."""
    assert body.input_prefix is not None and body.input_suffix is not None
    ids = partial(mixed_ids, tokenizer)
    prefix, suffix, prompt = ids(body.input_prefix), ids(body.input_suffix), ids(body.prompt)
    extra: list[int] = []
    if fim["repo"] is not None:
        extra += [fim["repo"], *ids("myproject\n")]
    for chunk in body.input_extra:
        if fim["file_sep"] is not None:
            extra += [fim["file_sep"], *ids(chunk.filename + "\n")]
        else:
            extra += ids(SNIPPET_SEPARATOR)
        extra += ids(chunk.text)
    if fim["file_sep"] is not None:
        extra += [fim["file_sep"], *ids("filename\n")]
    batch = min(FIM_BATCH_TOKENS, context_tokens)
    prefix = prefix[max(0, len(prefix) - 3 * (batch // 4)) :]
    suffix = suffix[: max(0, batch // 4 - (2 + len(prompt)))]
    start = bos_ids(tokenizer)
    reserve = min(max(body.num_to_predict, 1), context_tokens // 2)
    over = len(start) + 3 + len(prefix) + len(prompt) + len(suffix) + reserve - context_tokens
    if over > 0:
        cut = min(over, len(prefix))
        prefix, suffix = prefix[cut:], suffix[: max(0, len(suffix) - (over - cut))]
    gap = [*start, fim["prefix"], *prefix, *prompt, fim["suffix"], *suffix, fim["middle"]]
    # The files fill what the context has left after the gap and the reply.
    room = min(context_tokens - batch - 2 * max(body.num_to_predict, 0), context_tokens - reserve - len(gap))
    return [*(extra[max(0, len(extra) - room) :] if room > 0 else []), *gap]


class AnyTokenizeRequest(p.TokenizeRequest, frozen=True, kw_only=True):
    """A POST /tokenize body of either API: llama.cpp's has `content` (and these options),
    vLLM's `prompt` or `messages`."""

    content: str | None = None
    add_special: bool = False  # llama.cpp's default: no BOS
    parse_special: bool = True  # false: special tokens' texts in `content` are plain text
    with_pieces: bool = False


LLAMA_TOKENIZE_FIELDS = frozenset({"content", "add_special", "parse_special", "with_pieces"})


class LlamaEmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """llama.cpp's /embedding body: `input` (OpenAI's forms) or `content`, and how to normalize."""

    model: str = ""
    input: str | list[str | int | list[int]] | None = None
    content: str | list[str | int | list[int]] | None = None
    # llama.cpp's: -1 none, 0 max absolute scaled to int16's range, 2 euclidean, else that p-norm
    embd_normalize: int = 2


def llama_error_body(error: ApiError) -> bytes:
    kind = "exceed_context_size_error" if error.code == "context_length_exceeded" else None
    body: dict[str, Any] = {
        "code": error.status,
        "message": error.message,
        "type": kind or ERROR_TYPES.get(error.status, "server_error"),
    }
    if kind and (counts := PROMPT_TOO_LONG_COUNTS.search(error.message)):
        # llama-server's: the web UI shows them for a prompt past the context
        body["n_prompt_tokens"], body["n_ctx"] = int(counts[1]), int(counts[2])
    return _encoder.encode({"error": body})


def llama_error_response(error: ApiError) -> Response:
    return Response(llama_error_body(error), error.status, error.headers, media_type=JSON)


def with_llama_errors(
    gateway: Gateway, handler: Callable[[Request], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    """`handler`, its refusals (the API key, the body, the plan) and its failures (a bug's 500) in
    llama.cpp's error shape."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as error:
            return gateway.finish(request, llama_error_response(error))
        except Exception as exc:
            error = internal_error(f"{request.method} {request.url.path}", exc)
            return gateway.finish(request, llama_error_response(error))

    return guarded


@dataclass
class Generated:
    """One /completion's output so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    probabilities: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    lines_checked: int = 0  # where the last line n_indent has checked starts in `text` (0: none yet)
    first_output_at: float | None = None  # its prompt's time ends here, its generation's starts


class LlamaCompletions:
    """llama.cpp's endpoints, on a `Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    # -- /completion ---------------------------------------------------------------------------

    async def completion(self, request: Request) -> Response:
        body = await self.gateway.read_body(request, LlamaCompletionRequest)
        prompts, is_batch = await self.prompts_of(body.prompt)
        return await self.complete(request, body, prompts, is_batch)

    async def infill(self, request: Request) -> Response:
        """Fill the gap between `input_prefix` and `input_suffix` (llama.vim's and llama.vscode's
        completions): a /completion of `infill_prompt`."""
        gw = self.gateway
        body = await gw.read_body(request, LlamaInfillRequest)
        fim = self.fim
        missing = [
            f"{role} token is missing." for role in ("prefix", "suffix", "middle") if fim[role] is None
        ]
        if missing:
            raise ApiError(501, f"Infill is not supported by this model: {' '.join(missing)}")
        for name in ("input_prefix", "input_suffix"):
            if getattr(body, name) is None:
                raise invalid(f'"{name}" is required', name, "missing_required_parameter")
        texts = [body.input_prefix, body.input_suffix, body.prompt]
        texts += [text for chunk in body.input_extra for text in (chunk.filename, chunk.text)]
        num_chars = sum(len(part) for text in texts for part in ([text] if isinstance(text, str) else text)
                        if isinstance(part, str))  # fmt: skip
        with budget_errors("input_prefix"):  # the budget of every text the gateway encodes
            check_prompt_chars(
                num_chars, gw.settings.max_prompt_chars, " in the code and the files around the gap"
            )
        context = gw.settings.max_model_len
        ids = await asyncio.to_thread(infill_prompt, gw.tokenizer, fim, body, context)
        return await self.complete(request, body, [ids], False)

    @cached_property
    def fim(self) -> dict[str, int | None]:
        return fim_token_ids(self.gateway.tokenizer)

    async def complete(
        self,
        request: Request,
        body: LlamaCompletionRequest,
        prompts: list[str] | list[list[int]],
        is_batch: bool,
    ) -> Response:
        gw = self.gateway
        settings = self.generation_settings(body)
        bias = await self.logit_bias(body.logit_bias)
        plan = self.plan(body, prompts, settings, bias, header_seed(request.headers.get(SEED_HEADER)))
        model = gw.with_adapter(body.model, plan)
        if plan.seed is not None:
            settings["seed"] = plan.seed
        prompt_only = body.num_to_predict == 0
        is_batch = is_batch or len(plan.jobs) > 1
        writer = LlamaWriter(gw, body, model, settings, plan, is_batch=is_batch, prompt_only=prompt_only)
        return gw.run(request, plan, body.stream, writer)

    async def prompts_of(self, prompt: Any) -> tuple[list[str] | list[list[int]], bool]:
        """The request's prompts, all texts or all token ids (then a text among them is encoded,
        on a worker thread, as the tokenizer encodes a completion's), and whether they are several
        (answered with a list, as llama.cpp answers a list of one prompt with that prompt's reply)."""
        if isinstance(prompt, list) and not prompt:
            raise invalid("prompt must not be empty", "prompt")
        is_list = isinstance(prompt, list) and not any(isinstance(x, int) for x in prompt)
        if isinstance(prompt, list) and not is_list and not all(isinstance(x, (int, str)) for x in prompt):
            raise invalid("prompt: a list with token ids is one prompt, of token ids and texts", "prompt")
        entries = [prompt_entry(x) for x in prompt] if is_list else [prompt_entry(prompt)]
        if all(isinstance(x, str) for x in entries):
            return entries, len(entries) > 1  # type: ignore[return-value]
        tokenizer = self.gateway.tokenizer
        return await asyncio.to_thread(lambda: [mixed_ids(tokenizer, x) for x in entries]), len(entries) > 1

    def generation_settings(self, body: LlamaCompletionRequest) -> dict[str, Any]:
        """What the request samples with: its fields, llama.cpp's defaults for those it leaves out."""
        given = {name: getattr(body, name) for name in LLAMA_DEFAULTS if getattr(body, name) is not None}
        settings: dict[str, Any] = {**LLAMA_DEFAULTS, **given}
        settings.update(
            n_ctx=self.gateway.settings.max_model_len,
            n_predict=body.num_to_predict,
            model=body.model or self.gateway.settings.model,
            seed=body.seed,
            stop=body.stop_words,
            stream=body.stream,
            ignore_eos=body.ignore_eos,
            n_probs=body.n_probs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repeat_penalty=body.repeat_penalty if body.repeat_penalty is not None else 1.0,
            n_indent=body.n_indent,
            t_max_predict_ms=body.t_max_predict_ms,
        )
        return settings

    def plan(
        self,
        body: LlamaCompletionRequest,
        prompts: list[str] | list[list[int]],
        settings: dict[str, Any],
        logit_bias: dict[int, float] | None,
        resumed_seed: int | None,
    ) -> Plan:
        """The /v1/completions plan of the same request (plan_completion), its field names mapped
        back to llama.cpp's in its refusals; `logit_bias` is the body's, read (`logit_bias`)."""
        if body.num_to_predict < -1:
            raise invalid(f"n_predict must be -1 (no limit) or >= 0, got {body.num_to_predict}", "n_predict")
        if body.n_probs < 0:
            raise invalid(f"n_probs must be >= 0, got {body.n_probs}", "n_probs")
        if body.seed < -1:
            raise invalid(f"seed must be -1 (random) or >= 0, got {body.seed}", "seed")
        if body.n_indent < 0:
            raise invalid(f"n_indent must be >= 0 (0: no limit), got {body.n_indent}", "n_indent")
        if body.t_max_predict_ms < -1:
            raise invalid(f"t_max_predict_ms must be >= -1 (0 or -1: no limit), got {body.t_max_predict_ms}",
                          "t_max_predict_ms")  # fmt: skip
        # llama-server's `grammar` is "" unless set, and its clients send it so: no grammar.
        grammar = body.grammar or None
        if body.json_schema is not None and grammar is not None:
            raise invalid("give json_schema or grammar, not both", "grammar")
        temperature = max(settings["temperature"], 0.0)  # llama.cpp: below 0 samples greedily
        # n_predict 0 evaluates the prompt alone: the engine always samples a token, which the
        # reply leaves out (LlamaWriter.prompt_only). llama-server takes any n_predict and stops
        # at the context's end, so one past the context is -1's limit (not the engine's range's 400).
        context = self.gateway.settings.max_model_len
        max_tokens = {-1: context, 0: 1}.get(body.num_to_predict, min(body.num_to_predict, context))
        request = p.CompletionRequest(
            prompt=prompts[0] if len(prompts) == 1 else prompts,
            n=body.num_completions,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=max(settings["top_k"], 0),  # llama.cpp: 0 or below is no top-k
            top_p=settings["top_p"],
            min_p=settings["min_p"],
            seed=None if body.seed == -1 else body.seed,
            stop=body.stop_words or None,
            stream=body.stream,
            return_progress=body.return_progress,
            ignore_eos=body.ignore_eos,
            logprobs=body.n_probs or None,
            logit_bias=logit_bias,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repeat_penalty,
            guided_json=body.json_schema,
            guided_grammar=grammar,
        )
        try:
            plan = plan_completion(request, resumed_seed)
        except ApiError as error:
            if error.param == "n" and body.n_cmpl is not None:
                error.param, error.message = "n_cmpl", re.sub(r"^n\b", "n_cmpl", error.message)
            raise renamed(error) from None
        plan.aliases.update(max_tokens="n_predict", logprobs="n_probs", repetition_penalty="repeat_penalty")
        return plan

    async def logit_bias(self, value: list[list[Any]] | dict[str, Any] | None) -> dict[int, float] | None:
        """llama.cpp's biases ([[token, bias], ...] or {token: bias}; a token as its id or a text,
        whose every token gets the bias; `false` bans it) as the engine's {id: bias}. A key of the
        object form is an id where it is a whole number in ASCII digits, as llama.cpp's strtol reads
        it, else a text. The texts count against tokenizer.max_prompt_chars and are encoded on a
        worker thread, as a prompt's are: the event loop serves every other connection meanwhile."""
        if value is None:
            return None
        pairs = list(value.items()) if isinstance(value, dict) else value
        biases: list[tuple[str | int, float]] = []
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise invalid("logit_bias: each entry is [token, bias]", "logit_bias")
            token, bias = pair
            if bias is False:
                bias = BANNED_BIAS
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise invalid(f"logit_bias: a bias is a number or false, got {bias!r}", "logit_bias")
            if isinstance(token, str) and isinstance(value, dict) and _TOKEN_ID.fullmatch(token):
                token = int(token)
            elif isinstance(token, bool) or not isinstance(token, (str, int)):
                raise invalid(f"logit_bias: a token is an id or a text, got {token!r}", "logit_bias")
            biases.append((token, float(bias)))
        texts = [token for token, _ in biases if isinstance(token, str)]
        max_chars = self.gateway.settings.max_prompt_chars
        if (num_chars := sum(map(len, texts))) > max_chars:
            raise invalid(f"logit_bias: {num_chars} characters of token texts; the limit is {max_chars} "
                          "(tokenizer.max_prompt_chars)", "logit_bias")  # fmt: skip
        encode = self.gateway.tokenizer.encode
        encoded = iter(await asyncio.to_thread(lambda: [encode(text) for text in texts]) if texts else [])
        out: dict[int, float] = {}
        for token, bias in biases:
            for token_id in next(encoded) if isinstance(token, str) else [token]:
                out[token_id] = bias
        return out

    # -- /embedding ----------------------------------------------------------------------------

    async def embedding(self, request: Request) -> Response:
        """llama.cpp's /embedding and /embeddings: `[{"index", "embedding": [vector]}]`, each
        vector the run's (/v1/embeddings'), normalized as `embd_normalize` says. Every norm is
        scale-free, so it is the same whether or not the model normalized the vector first;
        only -1 (none) returns a model-normalized vector as the model left it."""
        gw = self.gateway
        body = await gw.read_body(request, LlamaEmbeddingRequest)
        prompt = body.input if body.input is not None else body.content
        if prompt is None:
            raise invalid('"input" or "content" must be provided', "input")
        if body.embd_normalize < -1:
            raise invalid(f"embd_normalize must be -1 (none), 0 (int16 range) or a p-norm's p >= 1, got "
                          f"{body.embd_normalize}", "embd_normalize")  # fmt: skip
        try:
            result = await gw.embed(request, embedding_inputs(prompt), None, None)
        except ApiError as error:
            error.param = error.param or "input"
            raise
        reply = [
            {"index": i, "embedding": [embd_normalized(vector, body.embd_normalize).tolist()]}
            for i, vector in enumerate(result.embeddings)
        ]
        return gw.finish(request, Response(_encoder.encode(reply), media_type=JSON))

    # -- tokens and templates ------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        """llama.cpp's /tokenize where the body has `content`, else vLLM's (Gateway.tokenize)."""
        gw = self.gateway
        try:
            body = await gw.read_body(request, AnyTokenizeRequest)
        except ApiError as error:  # a refusal of llama.cpp's fields is in its shape
            if error.param in LLAMA_TOKENIZE_FIELDS:
                return gw.finish(request, llama_error_response(error))
            raise
        if body.content is None:
            return await gw.tokenize_body(request, body)
        try:
            ids = await asyncio.to_thread(self._tokenize, body.content, body.add_special, body.parse_special)
        except ApiError as error:
            return gw.finish(request, llama_error_response(error))
        if body.with_pieces:
            reply: dict[str, Any] = {"tokens": [{"id": i, "piece": self._piece(i)} for i in ids]}
        else:
            reply = {"tokens": ids}
        return gw.finish(request, Response(_encoder.encode(reply), media_type=JSON))

    def _tokenize(self, content: str, add_special: bool, parse_special: bool) -> list[int]:
        """Encode (on a worker thread) under the budget a completion request has."""
        limit = self.gateway.settings.max_prompt_chars
        if len(content) > limit:
            raise invalid(f"content: {len(content)} characters; the limit is {limit} (tokenizer.max_prompt_chars)",
                          "content", "context_length_exceeded")  # fmt: skip
        return self.gateway.tokenizer.encode(
            content, add_special_tokens=add_special, parse_special=parse_special
        )

    def _piece(self, token_id: int) -> str | list[int]:
        """A token's text, or its bytes where they are not whole UTF-8 (as llama.cpp gives it)."""
        token = self.gateway.tokenizer.id_to_token(token_id) or ""
        data = token_bytes(self.gateway.tokenizer.decode([token_id], skip_special_tokens=False), token)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return list(data)

    async def apply_template(self, request: Request) -> Response:
        gw = self.gateway
        # A chat request's body, as llama-server reads it: its tools, chat_template_kwargs and
        # add_generation_prompt render as they would for generation.
        body = await gw.read_body(request, p.ChatCompletionRequest)
        if not body.messages:
            raise invalid("messages must not be empty", "messages")
        chat = await asyncio.to_thread(gw._render_chat, chat_to_render(body))
        return gw.finish(request, Response(_encoder.encode({"prompt": chat.text}), media_type=JSON))

    async def props(self, request: Request) -> Response:
        gw = self.gateway
        gw.check_key(request)
        settings = gw.settings
        body = {
            "default_generation_settings": {
                "n_ctx": settings.max_model_len,
                "params": {**LLAMA_DEFAULTS, "n_predict": -1, "seed": -1},
            },
            "total_slots": settings.max_concurrent_requests,
            "model_alias": settings.model,
            "model_path": settings.model,
            "chat_template": gw.tokenizer.chat_template or "",
            "build_info": f"brigade {BRIGADE_VERSION}",
        }
        return gw.finish(request, Response(_encoder.encode(body), media_type=JSON))


def embd_normalized(vector: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's `common_embd_normalize`: -1 none, 0 the largest absolute value scaled to
    32760 (int16's range), else divided by its p-norm (2: euclidean)."""
    values = vector.astype(np.float64)
    if norm == -1:
        scale = 1.0
    elif norm == 0:
        scale = float(np.abs(values).max(initial=0.0)) / 32760.0
    else:
        scale = float(np.sum(np.abs(values) ** norm) ** (1.0 / norm))
    return (values / scale if scale > 0 else np.zeros_like(values)).astype(np.float32)


def token_bytes(text: str, token: str) -> bytes:
    """A token's bytes: its decoded text's, except a byte-level token that is part of a UTF-8
    character (its text decodes to U+FFFD): then the bytes its symbols stand for (GPT-2's byte
    alphabet), or `<0xNN>` of SentencePiece's byte fallback."""
    if "\ufffd" not in text:
        return text.encode()
    if token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:-1], 16)])
    alphabet = _byte_alphabet()
    if all(c in alphabet for c in token):
        return bytes(alphabet[c] for c in token)
    return text.encode()


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE: the character that stands for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def prompt_entry(entry: Any) -> str | list[str | int]:
    """One prompt of a request: a text, or token ids and texts to encode in place."""
    if isinstance(entry, dict):
        if entry.get("multimodal_data"):
            raise invalid("prompt: multimodal_data: this endpoint reads no images or audio", "prompt")
        text = entry.get("prompt_string")
        if not isinstance(text, str):
            raise invalid('prompt: a JSON prompt is {"prompt_string": TEXT}', "prompt")
        entry = text
    if isinstance(entry, (str, list)) and not entry:
        raise invalid("prompt must not be empty", "prompt")
    return entry


def renamed(error: ApiError) -> ApiError:
    """A completions refusal with llama.cpp's names for the fields it translated."""
    for ours, theirs in (("guided_json", "json_schema"), ("guided_grammar", "grammar"), ("logprobs", "n_probs"),
                         ("max_tokens", "n_predict")):  # fmt: skip
        if error.param == ours:
            error.param = theirs
            # "guided_grammar: grammar: ..." (the field, then the compiler's kind) names it once
            error.message = error.message.replace(f"{ours}: {theirs}: ", f"{theirs}: ").replace(ours, theirs)
    return error


class LlamaWriter:
    """The ReplyWriter (app.py) of a /completion: llama.cpp's JSON (a list of them for a batch of
    prompts), or its events (each with its prompt's `index`; each prompt's last one on its own)."""

    def __init__(self, gateway: Gateway, body: LlamaCompletionRequest, model: str, settings: dict[str, Any],
                 plan: Plan, *, is_batch: bool, prompt_only: bool) -> None:  # fmt: skip
        self.gateway = gateway
        self.aliases = plan.aliases
        self.num_prompts = len(plan.jobs)
        self.body = body
        self.model = model
        self.settings = settings
        self.is_batch = is_batch
        self.prompt_only = prompt_only  # n_predict 0: the one token the engine samples is left out
        self.prompts = [job.prompt for job in plan.jobs]
        self.seeds = [job.sampling.get("seed") for job in plan.jobs]  # n_cmpl's j-th: the seed + j
        self.started = time.monotonic()

    def add(self, out: Generated, delta: StreamDelta) -> tuple[str, list[int], list[dict[str, Any]]]:
        """Take one delta into `out`; the text, ids and probabilities it adds. An output this
        writer ended (n_indent, t_max_predict_ms) takes no more."""
        if out.first_output_at is None:
            out.first_output_at = time.monotonic()
        if out.finish_reason is not None:
            return "", [], []
        if delta.usage is not None:
            out.prompt_tokens, out.cached_tokens = delta.usage.prompt_tokens, delta.usage.cached_tokens
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
        if self.prompt_only:
            return "", [], []
        probabilities = self.probabilities(delta) if self.body.n_probs else []
        start = len(out.text)
        out.text += delta.text
        out.token_ids += delta.token_ids
        out.probabilities += probabilities
        self.apply_limits(out, "\n" in delta.text)
        return out.text[start:], list(delta.token_ids), probabilities

    def apply_limits(self, out: Generated, wrote_new_line: bool) -> None:
        """llama-server's code completion limits: a line that starts (its first character after
        the indentation) with fewer than n_indent spaces or tabs ends the output, cut where that
        character is; past t_max_predict_ms of generating, a delta with a new line ends it. The
        engine's request is aborted once every output has ended (the feed is closed)."""
        if self.body.n_indent > 0:
            while (line_end := out.text.find("\n", out.lines_checked)) >= 0:
                start = line_end + 1
                text_at = start + len(out.text[start:]) - len(out.text[start:].lstrip(" \t"))
                if text_at == len(out.text):  # the line's text has not started yet
                    break
                out.lines_checked = start
                if text_at - start < self.body.n_indent:
                    out.text, out.finish_reason = out.text[:text_at], "length"
                    return
        generating_ms = (time.monotonic() - (out.first_output_at or time.monotonic())) * 1e3
        if self.body.t_max_predict_ms > 0 and wrote_new_line and generating_ms > self.body.t_max_predict_ms:
            out.finish_reason = "length"

    def probabilities(self, delta: StreamDelta) -> list[dict[str, Any]]:
        """llama.cpp's completion_probabilities of the delta's tokens: each token and its top n_probs."""
        tokenizer = self.gateway.tokenizer
        out = []
        for k, token_id in enumerate(delta.token_ids):
            tops = delta.top_logprobs[k] if delta.top_logprobs else {}
            best = sorted(tops.items(), key=lambda x: -x[1])[: self.body.n_probs]
            logprob = delta.logprobs[k] if delta.logprobs else tops.get(token_id, -math.inf)
            out.append({**self.token_entry(tokenizer, token_id, logprob),
                        "top_logprobs": [self.token_entry(tokenizer, i, lp) for i, lp in best]})  # fmt: skip
        return out

    @staticmethod
    def token_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        data = token_bytes(text, tokenizer.id_to_token(token_id) or "")
        return {"id": token_id, "token": text, "bytes": list(data), "logprob": logprob}

    def fields(self, reply: dict[str, Any]) -> dict[str, Any]:
        """The last reply as `response_fields` asks: each path's value under the path, where the
        reply has it (llama-server leaves out the others, without an error)."""
        if not self.body.response_fields:
            return reply
        picked = {}
        for path in self.body.response_fields:
            value: Any = reply
            for key in path.split("/"):
                value = value.get(key, _ABSENT) if isinstance(value, dict) else _ABSENT
            if value is not _ABSENT:
                picked[path] = value
        return picked

    async def final(self, index: int, out: Generated) -> dict[str, Any]:
        """The last reply's fields: the prompt, how generation stopped, the counts, the timings."""
        stop_type, stopping_word = await self.stop_of(out)
        prompt = self.prompts[index]
        if not isinstance(prompt, str):  # token ids (llama-server gives their text, special tokens too)
            prompt = await asyncio.to_thread(self.gateway.tokenizer.decode, prompt, False)
        predicted_n = len(out.token_ids)
        n_ctx = self.gateway.settings.max_model_len
        return {
            "model": self.model,
            "prompt": prompt,
            "tokens_predicted": predicted_n,
            "tokens_evaluated": out.prompt_tokens,
            "tokens_cached": out.cached_tokens,
            "generation_settings": self.settings
            if self.seeds[index] is None
            else {**self.settings, "seed": self.seeds[index]},
            "has_new_line": "\n" in out.text,
            "truncated": stop_type == "limit" and out.prompt_tokens + predicted_n >= n_ctx,
            "stop_type": stop_type,
            "stopping_word": stopping_word,
            "timings": self.timings(out),
        }

    def timings(self, out: Generated) -> dict[str, Any]:
        """An output's timings so far (a dict: response_fields picks its paths)."""
        now = time.monotonic()
        first = out.first_output_at if out.first_output_at is not None else now
        timings = llama_timings(out.cached_tokens, out.prompt_tokens - out.cached_tokens,
                                (first - self.started) * 1e3, len(out.token_ids), (now - first) * 1e3)  # fmt: skip
        return msgspec.structs.asdict(timings)

    async def stop_of(self, out: Generated) -> tuple[str, str]:
        """llama.cpp's stop_type and stopping_word. The engine says `stop` both for eos and for a
        stop string; the string is the one the text of every token continues the content with
        (the content is cut where it starts)."""
        if out.finish_reason == "length" or self.prompt_only:
            return "limit", ""
        if out.finish_reason != "stop":
            return "none", ""
        if self.body.stop_words:
            whole = await asyncio.to_thread(self.gateway.tokenizer.decode, out.token_ids)
            rest = whole[len(out.text) :] if whole.startswith(out.text) else ""
            word = next((s for s in self.body.stop_words if rest.startswith(s)), None)
            if word is not None:
                return "word", word
        return "eos", ""

    def progress_event(self, index: int, progress: m.PromptProgress, timer: RequestTimer) -> dict[str, Any]:
        """llama-server's event of a prompt's progress (return_progress): no output, the counts."""
        return {**self.reply(index, "", [], [], False), "tokens_predicted": 0, "tokens_evaluated": progress.total,
                "prompt_progress": msgspec.structs.asdict(progress_out(progress, timer.arrival))}  # fmt: skip

    def reply(self, index: int, content: str, token_ids: list[int], probabilities: list[dict[str, Any]],
              stop: bool) -> dict[str, Any]:  # fmt: skip
        body: dict[str, Any] = {
            "index": index,
            "content": content,
            "tokens": token_ids,
            "stop": stop,
            "id_slot": -1,
        }
        if self.body.n_probs:
            body["completion_probabilities"] = probabilities
        return body

    async def whole(self, first: tuple[int, StreamDelta] | None, feed: Feed, timer: RequestTimer) -> bytes:
        outs = [Generated() for _ in range(self.num_prompts)]
        item = first
        while item is not None:
            self.add(outs[item[0]], item[1])
            if all(out.finish_reason is not None for out in outs):
                break  # the feed's end, or every output ended here: its close aborts the rest
            item = await anext(feed, None)
            if item is not None:
                timer.on_output(item)
        replies = []
        for index, out in enumerate(outs):
            tokens = out.token_ids if self.body.return_tokens else []
            body = self.reply(index, out.text, tokens, out.probabilities, True)
            replies.append(self.fields({**body, **await self.final(index, out)}))
        return _encoder.encode(replies if self.is_batch else replies[0])

    async def events(
        self, first: asyncio.Future[tuple[int, StreamDelta] | None], feed: Feed, timer: RequestTimer
    ) -> AsyncGenerator[bytes, None]:
        outs = [Generated() for _ in range(self.num_prompts)]
        reports = PromptReports()
        try:
            item = await first
        except BrigadeError as exc:  # after the keep-alive wait: the 200 is already sent
            yield self.error_event(from_engine(exc, self.aliases))
            return
        timer.on_output(item)
        while item is not None:
            index, delta = item
            if delta.prompt_progress is not None:  # return_progress: the prompt, before any output
                yield data_event(
                    self.progress_event(index, reports.report(index, delta.prompt_progress), timer)
                )
            else:
                if (whole_prompt := reports.completing(index)) is not None:
                    yield data_event(self.progress_event(index, whole_prompt, timer))
                out = outs[index]
                was_over = out.finish_reason is not None
                text, ids, probabilities = self.add(out, delta)
                if text or ids:
                    reply = self.reply(index, text, ids, probabilities, False)
                    if self.body.timings_per_token:
                        reply["timings"] = self.timings(out)
                    yield data_event(reply)
                if out.finish_reason is not None and not was_over:
                    last = {**self.reply(index, "", [], [], True), **await self.final(index, out)}
                    yield data_event(self.fields(last))
                if all(out.finish_reason is not None for out in outs):
                    return  # every output ended (here or by the engine): the feed's close aborts the rest
            try:
                item = await anext(feed, None)
            except BrigadeError as exc:
                yield self.error_event(from_engine(exc, self.aliases))
                return
            if item is not None:
                timer.on_output(item)

    def error_body(self, error: ApiError) -> bytes:
        return llama_error_body(renamed(error))

    def error_event(self, error: ApiError) -> bytes:
        return b"data: " + llama_error_body(renamed(error)) + b"\n\n"


def data_event(body: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"
