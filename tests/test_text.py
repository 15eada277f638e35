"""services.common.text.Tokenizer against transformers' AutoTokenizer on the same model dir."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from services.common.text import Tokenizer

from .conftest import REPO_ROOT

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "The quick brown fox jumps over the lazy dog.\nNew line\ttab",
    "中文分词测试，你好世界。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "mixed: naïve café Ünïcödé — “quotes” 日本語 한국어 العربية",
    "<|im_start|>user\nhi<|im_end|>\n",
    "code: def f(x):\n    return x ** 2  # comment",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_transformers(tokenizer: Tokenizer, hf_tokenizer, add_special_tokens: bool) -> None:
    for text in TEXTS:
        expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizer: Tokenizer, hf_tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    sequences = [hf_tokenizer.encode(t) for t in TEXTS]
    # Random ids hit special tokens and byte tokens that split UTF-8 characters.
    vocab = len(hf_tokenizer)  # once: tokenizers 0.23.1 (the floor) counts the vocabulary on each call
    sequences += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    for ids in sequences:
        expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, hf_tokenizer, add_generation_prompt: bool
) -> None:
    for messages in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == expected
        assert tokenizer.encode(text) == hf_tokenizer.encode(expected, add_special_tokens=False)


PREFILLS = [
    [{"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": "Red, green,"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Sure thing  "},
    ],  # trailing space kept
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write JSON."},
        {"role": "assistant", "content": '  {"name": '},
    ],
    # Prefills that the template's own end-of-turn text holds ("<|im_end|>"): the cut is where the
    # message's text ends, not where that text last appears.
    *(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": prefill}]
        for prefill in ("<", "end", "im")
    ),
]


def test_continue_final_message_matches_transformers(tokenizer: Tokenizer, hf_tokenizer) -> None:
    """An assistant's prefill is continued: the prompt ends where its text ends, as transformers'
    continue_final_message renders it (no end-of-turn, no new generation prompt)."""
    for messages in PREFILLS:
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        assert tokenizer.apply_chat_template(messages, continue_final_message=True) == expected
    with pytest.raises(ValueError, match="no text to continue"):
        tokenizer.apply_chat_template([{"role": "assistant", "tool_calls": []}], continue_final_message=True)


def test_vocab_and_special_tokens(tokenizer: Tokenizer, hf_tokenizer) -> None:
    assert tokenizer.vocab_size == len(hf_tokenizer)
    assert hf_tokenizer.eos_token_id in tokenizer.eos_token_ids
    assert set(tokenizer.special_token_ids) == set(hf_tokenizer.all_special_ids) | {
        i for i, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special
    }
    ids = hf_tokenizer.encode("Hello 中文 😀")
    assert tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.id_to_token(ids[0]) == hf_tokenizer.convert_ids_to_tokens(ids[0])


def test_template_raise_exception_is_a_template_error(tmp_path: Path, smollm2_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((smollm2_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    tok = Tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(jinja2.exceptions.TemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_template_is_sandboxed(tmp_path: Path, smollm2_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((smollm2_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_does_not_import_torch() -> None:
    code = "import services.common.text, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)


def test_a_long_encode_lets_other_threads_run_and_gives_the_same_ids(
    tokenizer: Tokenizer, hf_tokenizer
) -> None:
    """The gateway encodes /tokenize bodies on a worker thread; its event loop must keep running
    meanwhile. Measured as a ratio in one run: the longest pause of a ticking thread against the
    encode's own time (holding the GIL, the pause is the whole encode)."""
    import threading
    import time

    from services.common.text import GIL_FREE_ENCODE_CHARS

    text = "Buckets pass down the line, one hand to the next. " * 20000
    assert len(text) >= GIL_FREE_ENCODE_CHARS
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    ids = tokenizer.encode(text)
    took = time.perf_counter() - started
    done.set()
    ticker.join()
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert max(gaps) < 0.5 * took, f"a {took:.2f} s encode paused the other thread {max(gaps):.2f} s"
