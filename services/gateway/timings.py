"""llama-server's `timings`: how long a request's prompt and its output took, and their rates.

llama.cpp's clients (its web UI, wllama, agent harnesses) read them to show a live tokens-per-second
figure: `/completion` replies carry them, and with `timings_per_token: true` every streamed chunk
does, on llama-server's OpenAI routes too. Brigade's prompt time runs from the request's arrival
at the gateway to its first output (queueing included, as a client sees it); the output's from
that first output to now.
"""

from __future__ import annotations

from client.sdk import StreamDelta
from ipc import messages as m
from services.gateway import protocol as p
from services.gateway.formats import usage_out


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

    def __init__(self, arrival: float, prompt_of: dict[int, int]) -> None:
        self.arrival = arrival
        self.prompt_of = prompt_of  # choice index -> prompt index (n choices share a prompt)
        self.first_output_at: dict[int, float] = {}
        self.num_tokens = dict.fromkeys(prompt_of, 0)
        self.usages: dict[int, m.Usage] = {}  # the prompt's counts come with a choice's first output

    def add(self, index: int, delta: StreamDelta, now: float) -> None:
        self.first_output_at.setdefault(index, now)
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
        """Every prompt counted once (as `usage`), every choice's tokens; from the first output."""
        usage = usage_out(self.usages, self.prompt_of)
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        first = min(self.first_output_at.values(), default=now)
        return llama_timings(
            cached,
            usage.prompt_tokens - cached,
            (first - self.arrival) * 1e3,
            sum(self.num_tokens.values()),
            (now - first) * 1e3,
        )
