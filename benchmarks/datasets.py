"""Benchmark prompts, as token ids so that every engine sees exactly the same input.

Three kinds: `chat` (built-in chat prompts through the model's chat template), `random` (random
token ids with input/output lengths drawn from ranges) and `shared-prefix` (one random prefix shared
by every request, then a random suffix each).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHAT_PROMPTS = (
    "Explain how a hash map works in two short paragraphs.",
    "Write a haiku about the first snow of winter.",
    "What is the difference between a process and a thread?",
    "Give me three ideas for a rainy Sunday afternoon with kids.",
    "Summarize the plot of Romeo and Juliet in five sentences.",
    "How do vaccines train the immune system?",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Why is the sky blue?",
    "List the planets of the solar system from the sun outward.",
    "What should I pack for a three-day hiking trip?",
    "Describe the water cycle to a ten-year-old.",
    "What are the pros and cons of remote work?",
    "Write a short thank-you note to a colleague who helped me move.",
    "How does compound interest work? Give an example.",
    "Suggest a name for a bakery that specializes in sourdough bread.",
    "What is photosynthesis?",
    "Give me a simple recipe for tomato soup.",
    "Explain recursion using an everyday analogy.",
    "What causes the seasons on Earth?",
    "Write a limerick about a cat who loves boxes.",
    "How can I improve my sleep?",
    "What is the capital of Australia, and why is it not Sydney?",
    "Compare electric cars and gasoline cars in a few bullet points.",
    "Explain what an API is to someone who does not program.",
    "Write the opening line of a mystery novel set in a lighthouse.",
    "What are three good habits for learning a new language?",
    "How do airplanes stay in the air?",
    "Describe a sunset over the ocean in vivid detail.",
    "What is the Pythagorean theorem and where is it used?",
    "Give me a short motivational message for a Monday morning.",
    "How does a refrigerator keep food cold?",
    "Write a SQL query that counts orders per customer.",
    "What is the difference between weather and climate?",
    "Plan a simple weekly workout for a beginner.",
    "Tell me a fun fact about octopuses.",
    "Why do we have leap years?",
    "Explain the rules of chess for the knight and the bishop.",
    "What are black holes?",
    "Write a two-sentence horror story.",
)


@dataclass
class BenchRequest:
    """One benchmark request: the prompt's token ids and how many tokens to generate."""

    prompt_ids: list[int]
    output_len: int


def parse_range(text: str) -> tuple[int, int]:
    """`"128"` -> (128, 128); `"32:96"` -> (32, 96), inclusive."""
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise ValueError(f"bad length range {text!r}: expected N or LOW:HIGH with 1 <= LOW <= HIGH")
    return lo, hi


def _draw(rng: np.random.Generator, bounds: tuple[int, int], n: int) -> np.ndarray:
    return rng.integers(bounds[0], bounds[1] + 1, size=n)


def _random_ids(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    # Skip the low ids: SmolLM2's special tokens (<|im_start|>, <|endoftext|>, ...) live there.
    return rng.integers(256, vocab_size, size=n).tolist()


def chat_requests(model_dir: Path, num: int, output_len: tuple[int, int], seed: int) -> list[BenchRequest]:
    """The built-in chat prompts (cycled) through the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = np.random.default_rng(seed)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in CHAT_PROMPTS
    ]
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    lens = _draw(rng, output_len, num)
    return [BenchRequest(list(encoded[i % len(encoded)]), int(lens[i])) for i in range(num)]


def random_requests(
    vocab_size: int, num: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    in_lens, out_lens = _draw(rng, input_len, num), _draw(rng, output_len, num)
    return [
        BenchRequest(_random_ids(rng, vocab_size, int(n)), int(o))
        for n, o in zip(in_lens, out_lens, strict=True)
    ]


def shared_prefix_requests(
    vocab_size: int,
    num: int,
    prefix_len: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[BenchRequest]:
    """Every prompt is the same `prefix_len` random tokens followed by its own random suffix."""
    rng = np.random.default_rng(seed)
    prefix = _random_ids(rng, vocab_size, prefix_len)
    in_lens, out_lens = _draw(rng, input_len, num), _draw(rng, output_len, num)
    return [
        BenchRequest(prefix + _random_ids(rng, vocab_size, int(n)), int(o))
        for n, o in zip(in_lens, out_lens, strict=True)
    ]
