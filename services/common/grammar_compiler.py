r"""Compiling structured-output constraints into grammars, off the hot path, cached by their text.

The engine is llguidance (docs/structured_output.md says why): it imports neither torch nor
transformers, so the scheduler stays as light as it is and the tokenizer can check a constraint
with the very compiler that will run it, answering a bad one before it enters the pipeline.

- `load_grammar_tokenizer(model_dir, vocab_size, eos_token_ids)`: the engine's view of the
  tokenizer (slow to build, so once per process). `vocab_size` is the model's (the lm_head width: the
  bitmask width), which may exceed the tokenizer's; tokens past the tokenizer's are never allowed.
- `GrammarCompiler.submit(spec) -> Future[CompiledGrammar]`: compiles on a worker thread (the
  engine releases the GIL while it builds), so a step never waits on a compile; the scheduler
  keeps a request waiting until its future is done. Results, failures too, are cached by
  `StructuredOutput.cache_key` in an LRU bounded in bytes (`GrammarBudgets.cache_bytes`), so a
  resubmitted request (after any fault) finds its grammar again at no cost.
- `check_constraint(spec)`: whether it compiles and can produce anything, over a byte-level
  tokenizer (about a millisecond): the gateway's and the tokenizer's check, so that a bad
  constraint gets its error before it enters the pipeline.

A constraint that cannot compile raises `GrammarError` (an `InvalidParams`: the request gets a clear
invalid_request error, and nothing else in the batch is touched). So does one that matches no
output at all (`[^\s\S]`, `start: start`): the engine's first mask would allow only eos, and the
request would "succeed" with an empty text that violates its own constraint.

Too costly is bounded by `GrammarBudgets` (docs/structured_output.md, "Budgets"): the request's
text by `ipc.structured_output.MAX_SPEC_BYTES`; the engine's work by its parser limits (a lower
lexer fuel than llguidance's default, which let `(a{600}){611}` take 0.2-1 s and 40-160 MB per
mask); and a compile (the matcher and its first mask) by its time and the memory it allocates,
measured around it. The first mask is computed at compile time on purpose: it is where the
engine builds most of a grammar's lexer, so that is where a pathological one shows its cost.
"""

from __future__ import annotations

import ctypes
import json
import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from ipc.structured_output import MAX_SPEC_BYTES, StructuredOutput
from ipc.validation import InvalidParams

# Long enough to say what is wrong and where; engine errors can quote the whole grammar.
MAX_ERROR_CHARS = 600

# JSON as OpenAI writes it (", " and ": ", no other whitespace): one layout for every output,
# which also stops a small model from padding its JSON with whitespace until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# A failed compile's cache entry: its message and the future (a few hundred bytes).
FAILED_ENTRY_BYTES = 1024
# Below this the allocations measured around a compile are noise (or freed memory reused).
MIN_GRAMMAR_BYTES = 16 * 1024

MIB = 1024 * 1024
# check_constraint's lexer fuel: enough to find that `[^\s\S]` or `start: start` match nothing,
# small enough that `(a{600}){611}` costs it under 20 ms and 2 MB.
CHECK_LEXER_FUEL = 10_000
MATCHES_NOTHING = "the constraint matches no output at all"
# The budgets a compile is refused by for what it cost (the scheduler spent it): named in the
# refusal's message, which is how the gateway tells them from other refusals (costly_constraints).
COMPILE_BUDGETS = ("structured.compile_timeout_ms", "structured.max_grammar_mib")


def parser_limits(lexer_fuel: int = 200_000) -> llguidance.LLParserLimits:
    """The engine's limits: llguidance's defaults but a fifth of its initial lexer fuel (1M by
    default), which refuses regexes like `(a{600}){611}` within milliseconds (they took 0.2-1 s
    and 40-160 MB per mask), while the 20-property bench schema, `[a-z]{1,1000}`, `a{5000}` and
    the tests' grammars do not come near it. Short errors: no parser state or grammar in them."""
    return llguidance.LLParserLimits(initial_lexer_fuel=lexer_fuel, verbose_errors=False)


@dataclass(frozen=True, slots=True)
class GrammarBudgets:
    """What one constraint may cost (the `structured.*` config fields, docs/config.md)."""

    compile_timeout_s: float = 1.0  # the matcher and its first mask
    max_grammar_bytes: int = 16 * MIB  # allocated by the matcher and its first mask
    cache_bytes: int = 128 * MIB  # the compile cache, by the compiles' measured allocations
    limits: llguidance.LLParserLimits = field(default_factory=parser_limits)

    def __post_init__(self) -> None:
        if self.compile_timeout_s <= 0 or self.max_grammar_bytes < 1 or self.cache_bytes < 1:
            raise ValueError(f"grammar budgets must be positive, got {self}")


class GrammarError(InvalidParams):
    """A constraint that does not compile: a bad schema, regex or grammar, one that matches no
    output, or one over the limits."""


class CompiledGrammar:
    """A compiled constraint: a matcher at the start of its grammar, never advanced itself.

    Every request starts from a copy of it (`new_matcher`), so requests with the same constraint
    share one compile and any lexer state the engine built for it. `num_bytes` is what its compile
    allocated (at least MIN_GRAMMAR_BYTES): its weight in the cache.
    """

    __slots__ = ("_start", "key", "num_bytes")

    def __init__(self, key: str, start: llguidance.LLMatcher, num_bytes: int = MIN_GRAMMAR_BYTES) -> None:
        self.key = key
        self._start = start
        self.num_bytes = num_bytes

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


# A GBNF escape of a code point, or an escaped backslash (matched first, so that `\\u0041` stays
# a backslash and the text "u0041").
_GBNF_CODE_POINT = re.compile(r"\\(\\|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")


# llguidance's own Lark: a `%llguidance` header or a `start:` rule (GBNF's `start ::=` is not one).
_LARK_SYNTAX = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:(?!:=))")
# GBNF's pieces that hold no rule name (string literals, character classes, comments), a token
# reference (`<[id]>`, `<|name|>`: the second group), or a name (the first).
_GBNF_PIECE = re.compile(
    r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|(<\[[^\]>]*\]>|<\|[^|>]*\|>)|([A-Za-z0-9_-]+)'
)


def grammar_lark(grammar: str) -> str:
    """A `grammar` constraint as the engine's Lark: llguidance's Lark as given, else GBNF converted.
    The converter names GBNF's `root` rule `start`, so a GBNF rule of that name (a valid llama.cpp
    grammar) is renamed first, and its `\\u` escapes rewritten (`gbnf_code_points`)."""
    if _LARK_SYNTAX.search(grammar):
        return grammar
    pieces = list(_GBNF_PIECE.finditer(grammar))
    token = next((match.group(1) for match in pieces if match.group(1)), None)
    if token is not None:  # the converter's words were "Expected name"
        raise ValueError(
            f"token references such as {token[:40]} are not supported in GBNF here; the same grammar in "
            "Lark (a `start:` rule) takes them"
        )
    names = {match.group(2) for match in pieces if match.group(2)}
    if "start" in names:
        fresh = next(f"start-{i}" for i in range(len(names) + 1) if f"start-{i}" not in names)
        grammar = _GBNF_PIECE.sub(
            lambda match: fresh if match.group(2) == "start" else match.group(0), grammar
        )
    return gbnf_to_lark(gbnf_code_points(grammar))


def gbnf_code_points(grammar: str) -> str:
    r"""GBNF's `\uXXXX` and `\UXXXXXXXX` escapes rewritten as `\xHH` (below 0x100) or the character
    itself. llguidance's GBNF converter strips their leading zeros (`\u0042` -> `\u42`), which its
    own Lark parser then refuses ("invalid hexadecimal digit"), and `\u0000` loses its digits. A
    character at or above 0x100 is never GBNF syntax, so it can stand for itself; a surrogate or
    a code point past Unicode is left for the converter to refuse."""

    def plain(match: re.Match[str]) -> str:
        body = match.group(1)
        if body == "\\":
            return match.group(0)
        code = int(body[1:], 16)
        if code < 0x100:
            return f"\\x{code:02x}"
        if 0xD800 <= code < 0xE000 or code > 0x10FFFF:
            return match.group(0)
        return chr(code)

    return _GBNF_CODE_POINT.sub(plain, grammar)


def grammar_text(spec: StructuredOutput) -> str:
    """The engine's grammar for a constraint (no compile yet); raises GrammarError on bad text."""
    # Checked here too: a constraint may arrive straight off the wire, not through the API forms.
    size = len(spec.spec.encode())
    if size > MAX_SPEC_BYTES:
        raise GrammarError(f"{spec.kind}: {size} bytes, larger than the limit of {MAX_SPEC_BYTES}")
    try:
        if spec.kind == "json":
            options = {**JSON_LAYOUT, "lenient": not spec.strict}
            # The schema `true` allows any value, as `{}` does; the engine applies its options to
            # an object schema only, and would refuse it with words about those options.
            schema = "{}" if spec.spec.strip() == "true" else spec.spec
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            # A JSON string literal is a valid Lark string literal, escapes included.
            choices = json.loads(spec.spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        if spec.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(grammar_lark(spec.spec))
    except Exception as e:  # the engine's parsers raise ValueError or their own error types
        raise GrammarError(f"{spec.kind}: {short_error(str(e))}") from None
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


def check_constraint(spec: StructuredOutput, budgets: GrammarBudgets | None = None) -> None:
    """Raise GrammarError unless the constraint compiles within `budgets` and matches some output.

    Needs no model tokenizer: a byte-level one stands in (what no byte string satisfies, no token
    string does), on a small lexer fuel (`CHECK_LEXER_FUEL`), since the gateway and the tokenizer
    run it on their event loops: a few milliseconds for any constraint. Running out of that fuel
    proves nothing, so only "matches nothing" is refused here; the time and memory budgets are the
    scheduler's compile's to enforce, over the real tokenizer."""
    budgets = budgets or GrammarBudgets()
    if spec.kind == "json" and spec.spec == "false":  # the engine's own words would be about its options
        raise GrammarError(f"json: {MATCHES_NOTHING}")
    grammar = grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=budgets.limits
    )
    if is_error:
        raise GrammarError(f"{spec.kind}: {short_error(messages[0])}")
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=_check_limits())
    _first_mask(matcher, _byte_tokenizer())
    if _matches_nothing(matcher):
        raise GrammarError(f"{spec.kind}: {MATCHES_NOTHING}")


class _ByteTokens:
    """A tokenizer whose tokens are the 256 bytes and eos (llguidance's TokenizerWrapper protocol)."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
        self.special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))


@cache
def _check_limits() -> llguidance.LLParserLimits:
    return parser_limits(CHECK_LEXER_FUEL)


def _first_mask(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer) -> None:
    if not matcher.is_error():
        mask = np.zeros((tokenizer.vocab_size + 31) // 32, np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)


def _matches_nothing(matcher: llguidance.LLMatcher) -> bool:
    """At the start, the engine stopped where no byte can begin an output ("NoExtension"): the
    constraint matches nothing, and its request would "succeed" with an empty text."""
    return matcher.is_error() and "NoExtension" in matcher.get_error() and not matcher.is_accepting()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@cache
def _mallinfo2():  # glibc >= 2.33; None elsewhere (then a compile's memory is not measured)
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def allocated_bytes() -> int:
    """Bytes the process holds from malloc (the engine allocates through it), 0 where unknown.
    Unlike RSS it does not hide an allocation that reuses memory freed earlier."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return 0
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def _start_matcher(
    spec: StructuredOutput, grammar: str, tokenizer: llguidance.LLTokenizer, budgets: GrammarBudgets
) -> tuple[llguidance.LLMatcher, int]:
    """The matcher at the start of `grammar`, its first mask computed; and the bytes that took.
    Raises GrammarError when the grammar is refused, matches nothing, or is over `budgets`.

    Measured on the compiling thread: another thread's allocations at the same time count too,
    which errs on the side of a heavier estimate."""
    started, before = time.perf_counter(), allocated_bytes()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=budgets.limits)
    _first_mask(matcher, tokenizer)
    elapsed, grown = time.perf_counter() - started, allocated_bytes() - before
    error = _start_error(matcher, elapsed, grown, budgets)
    if error is not None:
        # Gone before the error is raised: a cached failure keeps its traceback, and the frames in
        # it their locals; a refused matcher can hold tens of MB of lexer states.
        del matcher
        raise GrammarError(f"{spec.kind}: {error}")
    return matcher, max(grown, MIN_GRAMMAR_BYTES)


def _start_error(
    matcher: llguidance.LLMatcher, elapsed: float, grown: int, budgets: GrammarBudgets
) -> str | None:
    """Why a compiled matcher at its start is refused (None: it is not)."""
    if _matches_nothing(matcher):
        return MATCHES_NOTHING
    if matcher.is_error():  # past the engine's limits already (its lexer, its parser)
        return short_error(matcher.get_error())
    if elapsed > budgets.compile_timeout_s:
        return (
            f"too complex: compiling it took {elapsed * 1000:.0f} ms, over the budget of "
            f"{budgets.compile_timeout_s * 1000:.0f} ms ({COMPILE_BUDGETS[0]})"
        )
    if grown > budgets.max_grammar_bytes:
        return (
            f"too complex: compiling it took {grown / MIB:.1f} MiB, over the budget of "
            f"{budgets.max_grammar_bytes / MIB:.1f} MiB ({COMPILE_BUDGETS[1]})"
        )
    return None


class GrammarCompiler:
    """Compiles constraints on `threads` worker threads and caches the results by constraint text,
    evicting the least recently used while the cache weighs more than `budgets.cache_bytes`.

    `submit`, `num_bytes` and `close` belong to one thread (the scheduler's loop); the workers only
    compile. A compile still running weighs nothing until it is done.
    """

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, *, budgets: GrammarBudgets | None = None, threads: int = 1
    ) -> None:
        self.tokenizer = tokenizer
        self.budgets = budgets or GrammarBudgets()
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._weights: dict[str, int] = {}  # of the done entries
        self._compiling: dict[str, Future[CompiledGrammar]] = {}  # not weighed yet
        self._num_bytes = 0
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
        self._compiling[key] = future
        self._evict()
        return future

    @property
    def num_bytes(self) -> int:
        """The cache's weight: the allocations of its compiled grammars, as measured."""
        self._evict()
        return self._num_bytes

    def _evict(self) -> None:
        # Evicting only forgets the entry: requests holding its future or matchers keep working,
        # and the memory goes when the last of them does.
        for key, future in [(k, f) for k, f in self._compiling.items() if f.done()]:
            del self._compiling[key]
            failed = future.cancelled() or future.exception() is not None
            weight = FAILED_ENTRY_BYTES if failed else future.result().num_bytes
            self._weights[key] = weight
            self._num_bytes += weight
        while self._num_bytes > self.budgets.cache_bytes and self._weights:
            key = next(k for k in self._cache if k in self._weights)
            del self._cache[key]
            self._num_bytes -= self._weights.pop(key)

    def compile_now(self, spec: StructuredOutput) -> CompiledGrammar:
        """Compile inline; raises GrammarError."""
        start, num_bytes = _start_matcher(spec, grammar_text(spec), self.tokenizer, self.budgets)
        return CompiledGrammar(spec.cache_key, start, num_bytes)

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# Engine messages that name the engine's own options or types, in the request's words instead.
_ENGINE_WORDS = (
    (
        re.compile(r"oneOf constraints are not supported\..*"),
        "oneOf cannot be enforced exactly (its branches are not proven to exclude each other): "
        "use anyOf, or strict: false to take oneOf as anyOf",
    ),
    (
        re.compile(r"Failed to generate regex for integer range: .*"),
        "an integer's minimum or maximum beyond 64-bit integers (+-9223372036854775807) cannot be enforced",
    ),
)


def short_error(message: str) -> str:
    """An engine message on one line, without the marker where a verbose one would put the
    parser state, in the request's words where the engine's name its internals, and within
    MAX_ERROR_CHARS."""
    message = " ".join(message.replace("<non-verbose/>", "").split())
    for pattern, words in _ENGINE_WORDS:
        message = pattern.sub(words, message)
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."
