"""Compiling structured-output constraints into grammars, off the hot path, cached by their text.

The engine is llguidance (docs/structured_output.md says why): it imports neither torch nor
transformers, so the scheduler stays as light as it is and the tokenizer can check a constraint
with the very compiler that will run it, answering a bad one before it enters the pipeline.

- `load_grammar_tokenizer(model_dir, vocab_size, eos_token_ids)`: the engine's view of the
  tokenizer (slow to build, so once per process). `vocab_size` is the model's (the lm_head width: the
  bitmask width), which may exceed the tokenizer's; tokens past the tokenizer's are never allowed.
- `GrammarCompiler.submit(spec) -> Future[CompiledGrammar]`: compiles on a worker thread (the
  engine releases the GIL while it builds), so a step never waits on a compile; the scheduler
  keeps a request waiting until its future is done. Results, failures too, are cached by
  `StructuredOutput.cache_key` in an LRU of bounded size, so a resubmitted request (after any
  fault) finds its grammar again at no cost.
- `check_constraint(spec)`: whether it compiles, without a tokenizer (about a millisecond): the
  tokenizer's check, so that a bad constraint gets its error before it enters the pipeline.

A constraint that cannot compile raises `GrammarError` (an `InvalidParams`: the request gets a clear
invalid_request error, and nothing else in the batch is touched). Too large is bounded twice: the
request's text by `ipc.structured_output.MAX_SPEC_BYTES`, and the compiled grammar by the engine's
parser limits (`limits`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from ipc.structured_output import MAX_SPEC_BYTES, StructuredOutput
from ipc.validation import InvalidParams

# Long enough to say what is wrong and where; engine errors can quote the whole grammar.
MAX_ERROR_CHARS = 600

# JSON as OpenAI writes it (", " and ": ", no other whitespace): one layout for every output,
# which also stops a small model from padding its JSON with whitespace until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(InvalidParams):
    """A constraint that does not compile: a bad schema, regex or grammar, or one over the limits."""


class CompiledGrammar:
    """A compiled constraint: a matcher at the start of its grammar, never advanced itself.

    Every request starts from a copy of it (`new_matcher`), so requests with the same constraint
    share one compile and any lexer state the engine built for it.
    """

    __slots__ = ("_start", "key")

    def __init__(self, key: str, start: llguidance.LLMatcher) -> None:
        self.key = key
        self._start = start

    def new_matcher(self) -> llguidance.LLMatcher:
        return self._start.deep_copy()


def load_grammar_tokenizer(
    model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """The grammar engine's tokenizer, from the model dir's tokenizer.json (no transformers).

    eos_token_ids are the tokens a finished grammar allows (and the only ones it allows once
    nothing more can follow). The JSON slices speed up masks inside JSON strings and stay correct
    for every other kind.
    """
    if not eos_token_ids:
        raise ValueError("a grammar tokenizer needs at least one eos token id")
    text = (Path(model_dir) / "tokenizer.json").read_text()
    return llguidance.LLTokenizer(
        text, n_vocab=vocab_size, eos_token=list(eos_token_ids), slices=llguidance.LLTokenizer.json_slices()
    )


def grammar_text(spec: StructuredOutput) -> str:
    """The engine's grammar for a constraint (no compile yet); raises GrammarError on bad text."""
    # Checked here too: a constraint may arrive straight off the wire, not through the API forms.
    size = len(spec.spec.encode())
    if size > MAX_SPEC_BYTES:
        raise GrammarError(f"{spec.kind}: {size} bytes, larger than the limit of {MAX_SPEC_BYTES}")
    try:
        if spec.kind == "json":
            options = {**JSON_LAYOUT, "lenient": not spec.strict}
            return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, overrides=options)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            # A JSON string literal is a valid Lark string literal, escapes included.
            choices = json.loads(spec.spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        if spec.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.spec))
    except Exception as e:  # the engine's parsers raise ValueError or their own error types
        raise GrammarError(f"{spec.kind}: {_short(str(e))}") from None
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


def check_constraint(spec: StructuredOutput, limits: llguidance.LLParserLimits | None = None) -> None:
    """Raise GrammarError unless the constraint compiles (within `limits`); needs no tokenizer."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar_text(spec), None, limits=limits
    )
    if is_error:
        raise GrammarError(f"{spec.kind}: {_short(messages[0])}")


class GrammarCompiler:
    """Compiles constraints on `threads` worker threads and caches the results by constraint text.

    `submit` and `close` belong to one thread (the scheduler's loop); the workers only compile.
    """

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        *,
        max_entries: int = 256,
        threads: int = 1,
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.limits = limits
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")

    def submit(self, spec: StructuredOutput) -> Future[CompiledGrammar]:
        """The compiled grammar, as a future: a cached one (done or still compiling) or a new compile."""
        key = spec.cache_key
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self.compile_now, spec)
        self._cache[key] = future
        # Evicting only forgets the entry: requests holding its future or matchers keep working.
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return future

    def compile_now(self, spec: StructuredOutput) -> CompiledGrammar:
        """Compile inline; raises GrammarError."""
        grammar = grammar_text(spec)
        start = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if start.is_error():
            raise GrammarError(f"{spec.kind}: {_short(start.get_error())}")
        return CompiledGrammar(spec.cache_key, start)

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."
