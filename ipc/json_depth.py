"""How deeply JSON text nests, measured before it is decoded.

JSON decoders (msgspec, the json module) and everything that walks the decoded value afterwards
(json.dumps, the grammar compiler, chat templates) recurse once per level, so a body nested
thousands of levels deep ends in RecursionError wherever the stack runs out first. Every JSON
text a client sends is measured here first and refused past MAX_JSON_DEPTH: the check is linear
in the text and runs in numpy over its brackets and quotes only, so that it costs no more than
decoding.
"""

from __future__ import annotations

import numpy as np

from ipc.validation import InvalidParams

# Levels of arrays and objects; a JSON schema costs two per level of its own nesting (the schema
# object and its `properties` or `items`), and a request body wraps it in three or four more.
MAX_JSON_DEPTH = 128

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_IS_MARK = np.zeros(256, bool)  # the bytes that matter: brackets and quotes
_IS_MARK[list(b'[]{}"')] = True
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(text: bytes | str) -> int:
    """The deepest nesting of arrays and objects in `text` (exact for valid JSON; for invalid
    text a bound the decoder's own error will follow). Only the brackets and quotes are looked
    at, with numpy: a bracket counts unless an odd number of real quotes precede it (it is in a
    string), and a quote is real unless an odd run of backslashes precedes it."""
    data = text.encode(errors="surrogatepass") if isinstance(text, str) else text
    chars = np.frombuffer(data, np.uint8)
    marks = np.flatnonzero(_IS_MARK[chars])
    if not len(marks):
        return 0
    kinds = chars[marks]
    is_quote = kinds == _QUOTE
    quotes = marks[is_quote]
    backslashes = np.zeros(len(quotes), np.int64)  # the run right before each quote
    running = np.ones(len(quotes), bool)
    back = 1
    while running.any():
        at = quotes - back
        running &= at >= 0
        running[running] = chars[at[running]] == _BACKSLASH
        backslashes += running
        back += 1
    is_real = np.zeros(len(marks), bool)
    is_real[np.flatnonzero(is_quote)[backslashes % 2 == 0]] = True
    in_string = (np.cumsum(is_real) - is_real) % 2 == 1
    steps = np.where(in_string, 0, _STEP[kinds]).astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


def check_json_depth(text: bytes | str, what: str) -> None:
    """Raise InvalidParams, naming `what`, when `text` nests deeper than MAX_JSON_DEPTH."""
    data = text.encode(errors="surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return  # nothing can nest deeper than it has openers: most texts stop here
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise InvalidParams(f"{what}: JSON nested {depth} levels deep; the limit is {MAX_JSON_DEPTH}")
