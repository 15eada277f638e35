"""OpenAI request -> the Brigade requests ("jobs") that answer it: one per choice.

A completions request with several prompts and `n` choices runs prompts x n jobs; choice
`index = prompt_index * n + j`, as OpenAI numbers them. Choice j of a prompt gets seed `seed + j`,
so seeded choices are reproducible one by one and a resumed request samples the same tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import invalid
from services.gateway.protocol import ChatCompletionRequest, ChatMessageIn, CompletionRequest, SamplingFields

MAX_SEED = 2**63  # seeds travel as int64 (ipc.validation)
MAX_CHOICES = 64  # prompts x n per HTTP request
SEED_HEADER = "x-brigade-seed"


@dataclass
class Job:
    """One choice: what to submit through the SDK."""

    index: int
    prompt_index: int  # choices of one prompt share its KV blocks (submitted after the first)
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    sampling: dict[str, Any]


@dataclass
class Plan:
    """Every job of a request, the seed they derive from (None: greedy) and the field aliases
    that map the engine's error messages back to this request's field names."""

    jobs: list[Job]
    seed: int | None
    aliases: dict[str, str]
    logprobs: int | None  # top-N per token wanted in the reply; None = no logprobs


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


def _sampling(req: SamplingFields, max_tokens: int | None, logprobs: int) -> dict[str, Any]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return {
        "max_tokens": max_tokens,
        # None where the request sets none: the frontend takes the model's default (generation_config).
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": 0 if req.top_k == -1 else req.top_k,  # vLLM's -1 also disables
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
    }


def _seed(req: SamplingFields, sampling: dict[str, Any], resumed_seed: int | None) -> int | None:
    if req.seed is not None:
        if not 0 <= req.seed < MAX_SEED:
            raise invalid(f"seed must be in [0, {MAX_SEED - 1}], got {req.seed}", "seed")
        return req.seed
    if sampling["temperature"] == 0:
        return None
    return resumed_seed if resumed_seed is not None else random.randrange(MAX_SEED)


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


def _message_text(i: int, message: ChatMessageIn) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for k, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise invalid(
                f"messages[{i}].content[{k}]: only text parts are supported, got type {part.type!r}",
                f"messages[{i}].content[{k}].type",
            )
        parts.append(part.text)
    return "".join(parts)


def plan_chat(req: ChatCompletionRequest, resumed_seed: int | None) -> Plan:
    if not req.messages:
        raise invalid("messages must not be empty", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    _check_n(req.n, 1)
    messages = [{"role": m.role, "content": _message_text(i, m)} for i, m in enumerate(req.messages)]
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    sampling = _sampling(req, max_tokens, top_n)
    seed = _seed(req, sampling, resumed_seed)
    aliases = {"logprobs": "top_logprobs", "prompt": "messages"}
    if req.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    return Plan(
        _jobs([(None, messages)], req.n, sampling, seed), seed, aliases, top_n if req.logprobs else None
    )


def plan_completion(req: CompletionRequest, resumed_seed: int | None) -> Plan:
    if req.echo:
        raise invalid("echo is not supported", "echo")
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
    sampling = _sampling(req, req.max_tokens, top_n)
    seed = _seed(req, sampling, resumed_seed)
    jobs = _jobs([(p, None) for p in prompts], req.n, sampling, seed)
    return Plan(jobs, seed, {}, req.logprobs)
