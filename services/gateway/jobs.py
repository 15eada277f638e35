"""OpenAI request -> the Brigade requests ("jobs") that answer it: one per choice.

A completions request with several prompts and `n` choices runs prompts x n jobs; choice
`index = prompt_index * n + j`, as OpenAI numbers them. Choice j of a prompt gets seed `seed + j`,
so seeded choices are reproducible one by one and a resumed request samples the same tokens.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec

from client.errors import InvalidRequest
from client.sdk import make_tools
from ipc import messages as m
from ipc.structured_output import (
    KINDS,
    StructuredOutput,
    for_tool_choice,
    from_response_format,
    from_structured_outputs,
    tool_functions,
)
from ipc.validation import MAX_LOGPROBS, InvalidParams
from services.common.grammar_compiler import GrammarError, check_constraint
from services.gateway.beam_search import BeamSearch, beam_search_of
from services.gateway.errors import ApiError, invalid
from services.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    SamplingFields,
    StreamOptions,
)

MAX_SEED = 2**63  # seeds travel as int64 (ipc.validation)
MAX_CHOICES = 64  # prompts x n per HTTP request
SEED_HEADER = "x-brigade-seed"
# ipc/structured_output.py's messages start with the field they are about: "tools[0].function.name: ..."
_FIELD = re.compile(r"^([\w.\[\]]+):")


@dataclass
class Job:
    """One choice: what to submit through the SDK."""

    index: int
    prompt_index: int  # choices of one prompt share its KV blocks (submitted after the first)
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    sampling: dict[str, Any]  # the SDK's keyword arguments: sampling, constraint, tools


@dataclass
class Plan:
    """Every job of a request, the seed they derive from (None: greedy) and the field aliases
    that map the engine's error messages back to this request's field names."""

    jobs: list[Job]
    seed: int | None
    aliases: dict[str, str]
    logprobs: int | None  # top-N per token wanted in the reply; None = no logprobs
    tools: m.Tools | None = None  # chat: the functions offered, for reading the stream's calls
    # Streamed calls are named from this and their index: a digest of the body and the seed, so a
    # stream resumed with Last-Event-ID (the same body) names its calls as before.
    call_id_base: str = ""
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top-N wanted in the reply
    echo: bool = False  # completions: the prompt's text (and logprobs) lead each choice's
    # completions with echo and max_tokens 0: the prompt alone is scored; the engine, which always
    # samples one token, samples one that the reply leaves out.
    is_prompt_only: bool = False
    # chat with continue_final_message: the assistant's text that the reply continues, which the
    # reasoning parser reads as already written
    prefill: str | None = None
    # vLLM's use_beam_search: the jobs' choices are the search's beams (beam_search.py), not samples
    beam: BeamSearch | None = None

    @property
    def prompt_of(self) -> dict[int, int]:
        """Each choice's prompt (choice index -> prompt index): the n choices of a prompt share it."""
        return {job.index: job.prompt_index for job in self.jobs}


def header_seed(value: str | None) -> int | None:
    """The seed a client sends back (X-Brigade-Seed) to resume a sampled request exactly."""
    if value is None:
        return None
    try:
        seed = int(value)
    except ValueError:
        raise invalid(f"X-Brigade-Seed must be an integer, got {value[:40]!r}", "X-Brigade-Seed") from None
    if not 0 <= seed < MAX_SEED:
        raise invalid(f"X-Brigade-Seed must be in [0, {MAX_SEED - 1}], got {seed}", "X-Brigade-Seed")
    return seed


# vLLM's request fields that Brigade does not serve, with the values that ask for nothing (unset,
# or vLLM's own default, which clients that send whole request models send): set to anything
# else, each would change what the request returns, so it is refused by name rather than ignored
# as unknown fields are.
UNSERVED_FIELDS: dict[str, tuple[Any, ...]] = {
    "logits_processors": (None, []),
    "prompt_embeds": (None,),
    "guided_whitespace_pattern": (None,),
}
UNSERVED_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    "add_special_tokens": (False,),
    "chat_template": (None,),  # vLLM too refuses one unless its server trusts them
    "echo": (False,),
    "documents": (None, []),  # a RAG template's variable
    # OpenAI's deprecated forms of tools and tool_choice, whose replies have their own shape
    "functions": (None, []),
    "function_call": (None, "none"),
}


def _refuse_unserved(req: SamplingFields, fields: dict[str, tuple[Any, ...]]) -> None:
    for name, asks_nothing in fields.items():
        if getattr(req, name) not in asks_nothing:
            hint = " (use tools and tool_choice)" if name.startswith("function") else ""
            raise invalid(f"{name} is not supported by this server{hint}", name)


def _sampling(req: SamplingFields, max_tokens: int | None, logprobs: int) -> dict[str, Any]:
    _refuse_unserved(req, UNSERVED_FIELDS)
    # vLLM refuses any non-empty object without stream; one of the defaults asks for nothing here.
    if req.stream_options is not None and req.stream_options != StreamOptions() and not req.stream:
        raise invalid("stream_options can only be given with stream: true", "stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return {
        "max_tokens": max_tokens,
        # None where the request sets none: the tokenizer takes the model's default (generation_config).
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,  # vLLM's -1 ("no top-k") is the SDK's too (make_params)
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": req.repetition_penalty,
        "logit_bias": dict(req.logit_bias or {}),
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "stop": stop,
        "stop_token_ids": list(req.stop_token_ids or []),
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "logprobs": logprobs,
        "speculate": req.speculate,
        "priority": req.priority,
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "return_prompt_ids": req.return_token_ids,
        "cache_salt": req.cache_salt or "",
        # vLLM's; the tokenizer stage tokenizes bad_words and checks both (ipc/validation.py)
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": list(req.bad_words or []),
        # a stream's, as llama-server's (a whole reply has nothing to show it in); not beams'
        "report_prompt_progress": req.return_progress and req.stream and not req.use_beam_search,
    }


def _seed(req: SamplingFields, sampling: dict[str, Any], resumed_seed: int | None) -> int | None:
    if req.seed is not None:
        if not 0 <= req.seed < MAX_SEED:
            raise invalid(f"seed must be in [0, {MAX_SEED - 1}], got {req.seed}", "seed")
        return req.seed
    if sampling["temperature"] == 0:
        return None
    return resumed_seed if resumed_seed is not None else random.randrange(MAX_SEED)


def _named(exc: InvalidParams) -> ApiError:
    """ipc/structured_output.py's refusal as a 400 naming its field."""
    match = _FIELD.match(str(exc))
    return invalid(str(exc), match.group(1) if match else None)


@lru_cache(maxsize=256)
def _compile_error(spec: StructuredOutput) -> str | None:
    """Why the grammar engine cannot compile `spec` (None: it can); cached, since clients reuse a
    few schemas and a check compiles the grammar."""
    try:
        check_constraint(spec)
    except GrammarError as exc:
        return str(exc)
    return None


def _compiles(spec: StructuredOutput, field: str) -> StructuredOutput:
    error = _compile_error(spec)
    if error is not None:
        raise invalid(f"{field}: {error}", field)
    return spec


# The fields that each give one kind of structured_outputs: vLLM's older guided_* (which vLLM has
# since dropped, and clients still send), and llama-server's json_schema and grammar.
OPTION_FIELDS = {**{f"guided_{kind}": kind for kind in KINDS}, "json_schema": "json", "grammar": "grammar"}


def _constraint_options(req: SamplingFields) -> tuple[dict[str, Any] | None, str]:
    """vLLM's `structured_outputs`, or one of the fields that give one kind of it
    (OPTION_FIELDS) as the same options; and the field they came from."""
    # llama-server's `grammar` is "" unless set, and its clients send it so to /v1 too: no grammar.
    given = [
        field
        for field in OPTION_FIELDS
        if getattr(req, field) is not None and not (field == "grammar" and req.grammar == "")
    ]
    if not given:
        return req.structured_outputs, "structured_outputs"
    if req.structured_outputs is not None:
        raise invalid(f"give structured_outputs or {given[0]}, not both", given[0])
    if len(given) > 1:
        raise invalid(f"give one of {', '.join(OPTION_FIELDS)}, got {given}", given[1])
    return {OPTION_FIELDS[given[0]]: getattr(req, given[0])}, given[0]


def _structured(req: SamplingFields) -> tuple[StructuredOutput | None, str]:
    """The request's output constraint and the field it came from (checked: it compiles)."""
    options, options_field = _constraint_options(req)
    try:
        from_format = from_response_format(req.response_format)
    except InvalidParams as exc:
        raise _named(exc) from None
    try:
        from_options = from_structured_outputs(options)
    except InvalidParams as exc:
        if options_field == "structured_outputs":
            raise _named(exc) from None
        message = str(exc).replace(f"structured_outputs.{OPTION_FIELDS[options_field]}", options_field)
        raise invalid(message, options_field) from None
    if from_format is not None and from_options is not None:
        raise invalid(f"give response_format or {options_field}, not both", options_field)
    if from_format is not None:
        return _compiles(from_format, "response_format"), "response_format"
    if from_options is not None:
        field = (
            f"structured_outputs.{from_options.kind}"
            if options_field == "structured_outputs"
            else options_field
        )
        return _compiles(from_options, field), options_field
    return None, ""


def _tool_sampling(req: ChatCompletionRequest, constrained_by: str) -> dict[str, Any]:
    """Check `tools`, `tool_choice` and `parallel_tool_calls`; the SDK's keyword arguments for
    them. The tokenizer renders the tools and derives the forced call's constraint itself (for
    the SDK's requests too): here they are only checked, so that a bad one is a 400 naming it."""
    choice = req.tool_choice
    if req.tools is None:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return {}
    if isinstance(choice, dict):
        function = choice.get("function")
        if (
            choice.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise invalid(
                "tool_choice: a named function is {'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
    elif choice not in (None, "none", "auto", "required"):
        raise invalid(
            f"tool_choice: must be none, auto, required or a named function, got {choice!r}", "tool_choice"
        )
    try:
        tool_functions(req.tools)
        forced = for_tool_choice(req.tools, choice, parallel_tool_calls=req.parallel_tool_calls)
    except InvalidParams as exc:
        raise _named(exc) from None
    if forced is not None:
        if constrained_by:
            raise invalid(
                f"tool_choice {choice!r} forces a tool call, which cannot be combined with {constrained_by}",
                constrained_by,
            )
        _compiles(forced, "tools")
    return {"tools": req.tools, "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls}


def _call_id_base(req: ChatCompletionRequest, seed: int | None) -> str:
    return hashlib.blake2b(msgspec.json.encode(req) + str(seed).encode(), digest_size=12).hexdigest()


def _check_n(n: int, num_prompts: int) -> None:
    if n < 1:
        raise invalid(f"n must be >= 1, got {n}", "n")
    if n * num_prompts > MAX_CHOICES:
        raise invalid(f"n x prompts = {n * num_prompts} choices; at most {MAX_CHOICES} are allowed", "n")


def _jobs(prompts: list[tuple[Any, Any]], n: int, sampling: dict[str, Any], seed: int | None) -> list[Job]:
    jobs = []
    for p, (prompt, messages) in enumerate(prompts):
        for j in range(n):
            choice = dict(sampling, seed=None if seed is None else (seed + j) % MAX_SEED)
            jobs.append(Job(p * n + j, p, prompt, messages, choice))
    return jobs


def sdk_message(i: int, message: ChatMessageIn) -> dict[str, Any]:
    """One chat message as the SDK takes it; an assistant turn that only calls tools has no content."""
    out: dict[str, Any] = {"role": message.role}
    out["content"] = None if message.content is None and message.tool_calls else _message_content(i, message)
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if reasoning is not None:
        out["reasoning"] = reasoning
    return out


def _message_content(i: int, message: ChatMessageIn) -> str | list[dict[str, str]]:
    """Its text, or its parts in order when it has images (the tokenizer decodes their URLs)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for k, part in enumerate(message.content):
        where = f"messages[{i}].content[{k}]"
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url" and part.image_url is not None:
            parts.append({"type": "image_url", "url": part.image_url.url})
        elif part.type in ("text", "image_url"):  # a text part without its `text`, or the like
            raise invalid(f"{where}: a {part.type} part needs its {part.type} field", f"{where}.{part.type}")
        else:
            raise invalid(
                f"{where}: only text and image_url parts are supported, got type {part.type!r}",
                f"{where}.type",
            )
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _prompt_logprobs(req: SamplingFields, sampling: dict[str, Any], echo_top_n: int | None = None) -> None:
    """The engine's prompt_logprobs: the larger of vLLM's field and an echo's logprobs (whose
    range the engine checks as `logprobs`). A stream cannot carry them, as in vLLM."""
    n = req.prompt_logprobs
    if n is not None:
        if not 0 <= n <= MAX_LOGPROBS:
            raise invalid(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {n}", "prompt_logprobs")
        if req.stream:
            raise invalid("prompt_logprobs are not available with stream", "prompt_logprobs")
    wanted = [x for x in (n, echo_top_n) if x is not None]
    if wanted:
        sampling["prompt_logprobs"] = max(wanted)


def plan_chat(req: ChatCompletionRequest, resumed_seed: int | None) -> Plan:
    if not req.messages:
        raise invalid("messages must not be empty", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    _check_n(req.n, 1)
    _refuse_unserved(req, UNSERVED_CHAT_FIELDS)
    messages = [sdk_message(i, message) for i, message in enumerate(req.messages)]
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    sampling = _sampling(req, max_tokens, top_n)
    _prompt_logprobs(req, sampling)
    structured, constrained_by = _structured(req)
    tool_sampling = _tool_sampling(req, constrained_by)
    sampling.update(tool_sampling)
    if structured is not None:
        sampling["structured"] = structured
    effort = {"reasoning_effort": req.reasoning_effort} if req.reasoning_effort is not None else {}
    if req.chat_template_kwargs is not None or effort:
        sampling["chat_template_kwargs"] = {**effort, **(req.chat_template_kwargs or {})}
    if req.continue_final_message:
        sampling["continue_final_message"] = True
    if not req.add_generation_prompt:
        sampling["add_generation_prompt"] = False
    beam = beam_search_of(
        req,
        max_tokens=max_tokens,
        max_tokens_field="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
        top_n=top_n,
        constrained_by=constrained_by,
    )
    if beam is not None and any(isinstance(message["content"], list) for message in messages):
        # Every step after the first sends the prompt's token ids, which carry no image.
        raise invalid("images are not supported with use_beam_search", "messages")
    seed = _seed(req, sampling, resumed_seed)
    if beam is not None:
        seed = None  # a search samples nothing: no seed to send back
    aliases = {"logprobs": "top_logprobs", "prompt": "messages", "structured": constrained_by or "structured"}
    if req.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    try:
        tools = make_tools(req.tools, req.tool_choice, req.parallel_tool_calls) if tool_sampling else None
    except InvalidRequest as exc:
        raise invalid(str(exc), "tool_choice") from None
    return Plan(
        _jobs([(None, messages)], req.n, sampling, seed),
        seed,
        aliases,
        top_n if req.logprobs else None,
        tools,
        _call_id_base(req, seed),
        req.prompt_logprobs,
        prefill=_text_of(messages[-1]["content"]) if req.continue_final_message else None,
        beam=beam,
    )


def _text_of(content: str | list[dict[str, str]] | None) -> str:
    if content is None:  # a turn of tool calls: the tokenizer refuses to continue it
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")


def plan_completion(req: CompletionRequest, resumed_seed: int | None) -> Plan:
    if req.echo and req.stream:
        raise invalid("echo is not supported with stream", "echo")
    is_prompt_only = req.echo and req.max_tokens == 0
    if req.suffix is not None:
        raise invalid("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise invalid(f"best_of must equal n ({req.n}) when set, got {req.best_of}", "best_of")
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif not prompt:
        raise invalid("prompt must not be empty", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        prompts = list(prompt)
    else:
        raise invalid(
            "prompt must be a string, a list of strings, token ids or a list of token id lists", "prompt"
        )
    if any(not p for p in prompts):
        raise invalid("prompt must not be empty", "prompt")
    _check_n(req.n, len(prompts))
    top_n = req.logprobs or 0
    sampling = _sampling(req, 1 if is_prompt_only else req.max_tokens, top_n)
    aliases = {}
    # Echoed logprobs are the prompt's: the engine's prompt_logprobs, named `logprobs` here.
    _prompt_logprobs(req, sampling, req.logprobs if req.echo else None)
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        aliases["prompt_logprobs"] = "logprobs"
    structured, constrained_by = _structured(req)
    if structured is not None:
        sampling["structured"] = structured
    aliases["structured"] = constrained_by or "structured"
    beam = beam_search_of(
        req,
        max_tokens=req.max_tokens,
        max_tokens_field="max_tokens",
        top_n=top_n,
        constrained_by=constrained_by,
    )
    seed = _seed(req, sampling, resumed_seed)
    if beam is not None:
        seed = None  # a search samples nothing: no seed to send back
    jobs = _jobs([(p, None) for p in prompts], req.n, sampling, seed)
    return Plan(
        jobs,
        seed,
        aliases,
        req.logprobs,
        prompt_logprobs=req.prompt_logprobs,
        echo=req.echo,
        is_prompt_only=is_prompt_only,
        beam=beam,
    )
