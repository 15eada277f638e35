"""llama-server's `timings`: how long a request's prompt and its output took, and their rates; and
its `prompt_progress`, how much of a prompt is computed before the first output (return_progress).

llama.cpp's clients (its web UI, wllama, agent harnesses) read them to show a live tokens-per-second
figure: `/completion` replies carry them, and with `timings_per_token: true` every streamed chunk
does, on llama-server's OpenAI routes too. Brigade's prompt time runs from when the gateway starts
running the request (its body read and checked) to its first output, queueing included, as a
client sees it; the output's from that first output to now.
"""

from __future__ import annotations

import time

from client.sdk import StreamDelta
from ipc import messages as m
from services.gateway import protocol as p


def llama_timings(
    cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float
) -> p.Timings:
    """The timings, with llama-server's derived rates (0 where a count or a time is 0).
    `prompt_n` counts the prompt's tokens that were computed, not found in the prefix cache."""
    return p.Timings(
        cache_n=cache_n,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_ms / prompt_n if prompt_n else 0.0,
        prompt_per_second=prompt_n / prompt_ms * 1e3 if prompt_ms else 0.0,
        predicted_n=predicted_n,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_ms / predicted_n if predicted_n else 0.0,
        predicted_per_second=predicted_n / predicted_ms * 1e3 if predicted_ms else 0.0,
    )


class RequestTimings:
    """The timings of an OpenAI-route request's choices as their outputs come (`add`): each
    choice's own (a stream's chunks), or the whole request's (its reply, its usage chunk)."""

    def __init__(self, arrival: float, prompt_of: dict[int, int], *, is_prompt_only: bool = False) -> None:
        self.arrival = arrival
        self.prompt_of = prompt_of  # choice index -> prompt index (n choices share a prompt)
        self.is_prompt_only = is_prompt_only  # max_tokens 0: the one token the engine samples is not output
        self.first_output_at: dict[int, float] = {}
        self.num_tokens = dict.fromkeys(prompt_of, 0)
        self.usages: dict[int, m.Usage] = {}  # the prompt's counts come with a choice's first output

    def add(self, index: int, delta: StreamDelta, now: float) -> None:
        self.first_output_at.setdefault(index, now)
        if not self.is_prompt_only:
            self.num_tokens[index] += len(delta.token_ids)
        if delta.usage is not None:
            self.usages[index] = delta.usage

    def of_choice(self, index: int, now: float) -> p.Timings:
        usage = self.usages.get(index, m.Usage(0, 0))
        first = self.first_output_at.get(index, now)
        return llama_timings(
            usage.cached_tokens,
            usage.prompt_tokens - usage.cached_tokens,
            (first - self.arrival) * 1e3,
            self.num_tokens[index],
            (now - first) * 1e3,
        )

    def of_request(self, now: float) -> p.Timings:
        """Every prompt counted once, with what the cache held for it before the call (the
        fewest cached tokens any of its choices found: a later choice finds the blocks its
        sibling just computed), every choice's tokens; from the first output."""
        prompt_tokens: dict[int, int] = {}
        cached: dict[int, int] = {}
        for index, usage in self.usages.items():
            prompt = self.prompt_of[index]
            prompt_tokens[prompt] = usage.prompt_tokens
            cached[prompt] = min(cached.get(prompt, usage.cached_tokens), usage.cached_tokens)
        first = min(self.first_output_at.values(), default=now)
        return llama_timings(
            sum(cached.values()),
            sum(prompt_tokens.values()) - sum(cached.values()),
            (first - self.arrival) * 1e3,
            sum(self.num_tokens.values()),
            (now - first) * 1e3,
        )


def progress_out(progress: m.PromptProgress, arrival: float) -> p.PromptProgressOut:
    """llama-server's prompt_progress (return_progress) of the engine's report; its time from the
    request's arrival at the gateway, as `prompt_ms`'s."""
    elapsed_ms = int((time.monotonic() - arrival) * 1e3)
    return p.PromptProgressOut(progress.total, progress.cached, progress.processed, elapsed_ms)


class PromptReports:
    """A stream's prompt progress reports (return_progress), by choice: each passed on as it comes,
    and one of the whole prompt where the first output overtook the last (the reports come
    straight from the scheduler, the output through the detokenizer, and the tokenizer drops a
    report that comes after output), so that a client's last report says 100%."""

    def __init__(self) -> None:
        self.last: dict[int, m.PromptProgress] = {}

    def report(self, index: int, progress: m.PromptProgress) -> m.PromptProgress:
        self.last[index] = progress
        return progress

    def completing(self, index: int) -> m.PromptProgress | None:
        """At choice `index`'s first output: the whole prompt's report, if its last said less."""
        last = self.last.pop(index, None)
        if last is None or last.processed >= last.total:
            return None
        return m.PromptProgress(last.total, last.cached, last.total)
