"""Incremental detokenizer and DetokenizerCore against the real SmolLM2 tokenizer's full decode."""

from __future__ import annotations

import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ipc.messages import Delta, SamplingParams, StepTokens, TokenBatch, TokenUpdate, pack_ids, unpack_ids
from services.common.text import Tokenizer
from services.detokenizer.core import DetokenizerCore, IncrementalDetokenizer

from .conftest import REPO_ROOT

FFFD = "\ufffd"
TEXTS = [
    "Hello world, this is a test. The answer is 42.",
    "  leading spaces\nand new lines\n\n  indented",
    "中文分词测试，你好世界。今天天气很好！",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done",
    "mixed: naïve café — “quotes” 日本語 한국어 العربية 😀 end",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def token_sequences(tokenizer: Tokenizer) -> list[list[int]]:
    rng = random.Random(1)
    seqs = [tokenizer.encode(t) for t in TEXTS]
    # Random ids: special tokens, lone byte tokens, invalid UTF-8 that must decode to U+FFFD.
    seqs += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))] for _ in range(60)]
    # Raw byte tokens of multi-byte characters, so characters split across several tokens.
    byte_ids = [i for i in range(tokenizer.vocab_size) if len(tokenizer.id_to_token(i)) == 1]
    seqs += [[rng.choice(byte_ids) for _ in range(30)] for _ in range(20)]
    return seqs


def chunked(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    if rng is None:
        return [[i] for i in ids]
    chunks, pos = [], 0
    while pos < len(ids):
        n = rng.randint(1, 7)
        chunks.append(ids[pos : pos + n])
        pos += n
    return chunks


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("random_chunks", [False, True])
def test_deltas_concatenate_to_full_decode(
    tokenizer: Tokenizer, skip_special_tokens: bool, random_chunks: bool
) -> None:
    rng = random.Random(2) if random_chunks else None
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for ids in token_sequences(tokenizer):
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(tokenizer, params)
        emitted, seen = "", []
        chunks = chunked(ids, rng)
        for i, chunk in enumerate(chunks):
            is_last = i == len(chunks) - 1
            out = detok.add(chunk, "length" if is_last else None)
            assert out.char_offset == len(emitted)
            assert out.num_tokens == len(chunk)
            emitted += out.text
            seen += chunk
            # Never anything that is not final: whatever was emitted is a prefix of the final text.
            assert expected.startswith(emitted), (ids, emitted)
            partial = tokenizer.decode(seen, skip_special_tokens=skip_special_tokens)
            if not partial.endswith(FFFD):  # everything decodable so far is out, nothing held back
                assert emitted == partial
        assert emitted == expected
        assert out.finish_reason == "length"


def test_no_replacement_char_mid_stream_for_valid_text(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        detok = IncrementalDetokenizer(tokenizer, SamplingParams())
        for token_id in tokenizer.encode(text):
            assert FFFD not in detok.add([token_id]).text


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """Scan the full text: the first position where some stop string ends (longest on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end if include else end - len(stop)], True
    return text, False


STOP_CASES = [
    (TEXTS[0], ["answer is"]),
    (TEXTS[0], ["s a t", "zzz"]),  # spans tokens
    (TEXTS[0], ["42.", "answer"]),  # the earlier one wins
    (TEXTS[2], ["天气很"]),
    (TEXTS[3], ["😀👍"]),
    (TEXTS[4], ["本語 한"]),
    ("abcdef", ["abcd", "bc"]),  # "bc" ends first
    ("xx abc abc", ["c a", "b"]),
    (TEXTS[0], ["42.!", "test!"]),  # prefixes seen but never completed: flushed at the end
    (TEXTS[1], ["\n\n"]),
]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("case", range(len(STOP_CASES)))
def test_stop_strings_match_reference(tokenizer: Tokenizer, include: bool, case: int) -> None:
    text, stops = STOP_CASES[case]
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    expected, is_hit = reference_stop(full, stops, include)
    for rng in (None, random.Random(case)):
        detok = IncrementalDetokenizer(
            tokenizer, SamplingParams(stop=stops, include_stop_str_in_output=include)
        )
        emitted, consumed, finish = "", 0, None
        chunks = chunked(ids, rng)
        for i, chunk in enumerate(chunks):
            out = detok.add(chunk, "length" if i == len(chunks) - 1 else None)
            emitted += out.text
            consumed += out.num_tokens
            # Held-back text is only ever a possible stop prefix: nothing past a stop leaks out.
            assert expected.startswith(emitted)
            if out.finish_reason is not None:
                finish = out.finish_reason
                break
        assert emitted == expected
        assert finish == ("stop" if is_hit else "length")
        assert out.is_stop_hit == is_hit
        if is_hit:  # the stop completes exactly with the last consumed token
            assert reference_stop(tokenizer.decode(ids[:consumed]), stops, include)[1]
            assert not reference_stop(tokenizer.decode(ids[: consumed - 1]), stops, include)[1]
        assert detok.add(ids[:2]).num_tokens == 0  # finished: nothing more is taken


@pytest.mark.parametrize("min_tokens", [0, 1, 3, 6, 100])
def test_stop_strings_count_only_after_min_tokens(tokenizer: Tokenizer, min_tokens: int) -> None:
    """vLLM's rule: a stop string ending in the text of the first min_tokens tokens is not one;
    the first that ends after it is."""
    text, stops = "the cat saw the dog and the bird", ["the"]
    ids = tokenizer.encode(text)
    protected = len(tokenizer.decode(ids[:min_tokens]))
    full = tokenizer.decode(ids)
    ends = [i + len("the") for i in range(len(full)) if full.startswith("the", i)]
    end = next((e for e in ends if e > protected), None)
    for rng in (None, random.Random(min_tokens)):
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stops, min_tokens=min_tokens))
        emitted, finish = "", None
        chunks = chunked(ids, rng)
        for i, chunk in enumerate(chunks):
            out = detok.add(chunk, "length" if i == len(chunks) - 1 else None)
            emitted += out.text
            if out.finish_reason is not None:
                finish = out.finish_reason
                break
        assert (emitted, finish) == ((full, "length") if end is None else (full[: end - 3], "stop"))


class Receiver:
    """What a tokenizer or client does with deltas: keep each position once, in order."""

    def __init__(self) -> None:
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None

    def apply(self, delta: Delta) -> None:
        assert delta.char_offset <= len(self.text) and delta.token_index <= len(self.ids), "gap"
        self.text += delta.text[len(self.text) - delta.char_offset :]
        ids = unpack_ids(delta.token_ids).tolist()
        lps = np.frombuffer(delta.logprobs, "<f4").tolist()
        skip = len(self.ids) - delta.token_index
        self.ids += ids[skip:]
        self.logprobs += lps[skip:]
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def update(request_id: str, start: int, ids: list[int], finish: str | None = None, **kw) -> TokenUpdate:
    logprobs = struct.pack(f"<{len(ids)}f", *(-0.5 * (start + i) for i in range(len(ids))))
    return TokenUpdate(
        request_id, kw.pop("tokenizer_id", 0), start, pack_ids(ids), logprobs, finish_reason=finish, **kw
    )


def test_core_groups_by_tokenizer_and_finishes(tokenizer: Tokenizer) -> None:
    core = DetokenizerCore(tokenizer)
    a, b = tokenizer.encode(TEXTS[2]), tokenizer.encode(TEXTS[3])
    receivers = {"a": Receiver(), "b": Receiver()}
    params = SamplingParams()
    for i in range(max(len(a), len(b))):
        updates = []
        for rid, ids, fid in (("a", a, 0), ("b", b, 1)):
            if i < len(ids):
                finish = "length" if i == len(ids) - 1 else None
                extra = {"params": params, "prompt_tokens": 7, "cached_tokens": 3} if i == 0 else {}
                updates.append(update(rid, i, [ids[i]], finish, tokenizer_id=fid, **extra))
        deltas, stopped = core.handle(TokenBatch(updates))
        assert not stopped
        assert set(deltas) <= {0, 1}
        for fid, items in deltas.items():
            for delta in items:
                assert {"a": 0, "b": 1}[delta.request_id] == fid
                receivers[delta.request_id].apply(delta)
                if delta.finish_reason:
                    assert delta.usage.prompt_tokens == 7 and delta.usage.cached_tokens == 3
                    assert delta.usage.completion_tokens == len(a if delta.request_id == "a" else b)
    assert receivers["a"].text == tokenizer.decode(a) and receivers["a"].ids == a
    assert receivers["b"].text == tokenizer.decode(b) and receivers["b"].ids == b
    assert receivers["a"].logprobs == [-0.5 * i for i in range(len(a))]
    assert core.num_live == 0  # forgotten after the final delta


def test_step_tokens_give_the_deltas_of_the_same_token_batch(tokenizer: Tokenizer) -> None:
    # The scheduler's columnar message must mean exactly what one TokenUpdate per request says.
    ids = {rid: tokenizer.encode(text) for rid, text in (("a", TEXTS[2]), ("b", TEXTS[3]))}
    by_batch, by_columns = DetokenizerCore(tokenizer), DetokenizerCore(tokenizer)
    for i in range(max(map(len, ids.values()))):
        updates = [
            update(
                rid, i, [seq[i]], "length" if i == len(seq) - 1 else None, tokenizer_id=fid, prompt_tokens=7
            )
            for fid, (rid, seq) in enumerate(ids.items())
            if i < len(seq)
        ]
        columns = StepTokens(
            [u.request_id for u in updates],
            [u.tokenizer_id for u in updates],
            pack_ids([u.start_index for u in updates]),
            b"".join(u.token_ids for u in updates),
            b"".join(u.logprobs for u in updates),
            [u.top_logprobs for u in updates],
            [u.finish_reason for u in updates],
            [u.prompt_tokens for u in updates],
            [u.cached_tokens for u in updates],
        )
        expected = by_batch.handle(TokenBatch(updates))
        assert by_columns.handle(columns) == expected
        assert expected[0]  # the test compares real deltas
    assert by_batch.num_live == by_columns.num_live == 0


def test_core_stop_hit_reports_abort_and_drops_late_updates(tokenizer: Tokenizer) -> None:
    core = DetokenizerCore(tokenizer)
    ids = tokenizer.encode(TEXTS[0])
    params = SamplingParams(stop=["answer"])
    receiver, stopped_at = Receiver(), None
    for i, token_id in enumerate(ids):
        deltas, stopped = core.handle(
            TokenBatch([update("r", i, [token_id], params=params if i == 0 else None)])
        )
        for delta in deltas.get(0, []):
            receiver.apply(delta)
        if stopped:
            assert stopped == ["r"] and stopped_at is None
            stopped_at = i
    assert stopped_at is not None
    assert receiver.text == reference_stop(tokenizer.decode(ids), ["answer"], False)[0]
    assert receiver.finish_reason == "stop" and receiver.ids == ids[: stopped_at + 1]
    late = len(ids) - stopped_at - 1
    assert core.num_late == late and core.num_unknown == 0 and core.num_live == 0


def test_core_resync_and_duplicates_reconstruct_exact_text(tokenizer: Tokenizer) -> None:
    rng = random.Random(3)
    ids = tokenizer.encode(TEXTS[4]) + tokenizer.encode(TEXTS[3])
    core, receiver = DetokenizerCore(tokenizer), Receiver()
    params = SamplingParams(stop=["never matches 😀!"])
    pos, num_dups = 0, 0
    while pos < len(ids):
        n = rng.randint(1, 4)
        roll = rng.random()
        if roll < 0.15 and pos > 0:  # a resync: the whole history again from 0
            batch = [update("r", 0, ids[: pos + n], params=params)]
        elif roll < 0.4 and pos > 1:  # a duplicate delivery overlapping what was already sent
            start = rng.randrange(1, pos)  # (from 0 it would be a resync)
            num_dups += pos - start
            batch = [update("r", start, ids[start : pos + n])]
        else:
            batch = [update("r", pos, ids[pos : pos + n], params=params if pos == 0 else None)]
        pos = min(pos + n, len(ids))
        finish = "length" if pos == len(ids) else None
        batch[0].finish_reason = finish
        deltas, _ = core.handle(TokenBatch(batch))
        for delta in deltas.get(0, []):
            receiver.apply(delta)
    assert receiver.text == tokenizer.decode(ids)
    assert receiver.ids == ids
    assert receiver.logprobs == [-0.5 * i for i in range(len(ids))]
    assert receiver.finish_reason == "length"
    assert core.num_duplicate_tokens == num_dups


def test_core_resync_restarts_offsets_from_zero(tokenizer: Tokenizer) -> None:
    core = DetokenizerCore(tokenizer)
    ids = tokenizer.encode("one two three four")
    core.handle(TokenBatch([update("r", 0, ids[:2], params=SamplingParams())]))
    deltas, _ = core.handle(TokenBatch([update("r", 0, ids)]))
    (delta,) = deltas[0]
    assert (delta.token_index, delta.char_offset) == (0, 0)
    assert delta.text == tokenizer.decode(ids) and unpack_ids(delta.token_ids).tolist() == ids


def test_core_counts_unknown_and_gaps(tokenizer: Tokenizer) -> None:
    core = DetokenizerCore(tokenizer)
    deltas, _ = core.handle(TokenBatch([update("ghost", 5, [10, 11])]))
    assert deltas == {} and core.num_unknown == 1
    core.handle(TokenBatch([update("r", 0, [10], params=SamplingParams())]))
    deltas, _ = core.handle(TokenBatch([update("r", 3, [11])]))
    assert deltas == {} and core.num_gaps == 1
    core.drop(["r"])
    assert core.num_live == 0
    core.handle(TokenBatch([update("r", 1, [11])]))
    assert core.num_late == 1 and core.num_unknown == 1


def test_core_names_the_requests_it_has_no_history_of_to_their_tokenizers(tokenizer: Tokenizer) -> None:
    """A restarted detokenizer gets tokens of requests begun before it: each is named once per
    update to its tokenizer (which stops the copies nobody waits for); a request it finished or
    dropped, or one whose history it got, is not."""
    core = DetokenizerCore(tokenizer)
    core.handle(TokenBatch([update("known", 0, [10], params=SamplingParams()), update("dropped", 0, [10])]))
    core.drop(["dropped"])
    assert core.take_untracked() == {}
    for start in (5, 6):
        core.handle(
            TokenBatch(
                [
                    update("orphan", start, [11]),
                    update("known", 1, [11]),
                    update("dropped", 1, [11]),
                    update("other", start, [11], tokenizer_id=1),
                ]
            )
        )
    assert core.take_untracked() == {0: ["orphan", "orphan"], 1: ["other", "other"]}
    assert core.take_untracked() == {}


def test_does_not_import_torch() -> None:
    code = "import services.detokenizer.core, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)
