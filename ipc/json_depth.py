"""How deeply JSON text nests, measured before it is decoded.

JSON decoders (msgspec, the json module) and everything that walks the decoded value afterwards
(json.dumps, the grammar compiler, chat templates) recurse once per level, so a body nested
thousands of levels deep ends in RecursionError wherever the stack runs out first. Every JSON
text a client sends is measured here first and refused past MAX_JSON_DEPTH: the check is linear
in the text and runs at C speed (a regex and numpy), so that it costs no more than decoding.
"""

from __future__ import annotations

import re

import numpy as np

from ipc.validation import InvalidParams

# Levels of arrays and objects; a JSON schema costs two per level of its own nesting (the schema
# object and its `properties` or `items`), and a request body wraps it in three or four more.
MAX_JSON_DEPTH = 128

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # brackets inside strings do not nest
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(text: bytes | str) -> int:
    """The deepest nesting of arrays and objects in `text` (exact for valid JSON; for invalid
    text a bound the decoder's own error will follow)."""
    data = text.encode(errors="surrogatepass") if isinstance(text, str) else text
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = _STEP[np.frombuffer(brackets, np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max())


def check_json_depth(text: bytes | str, what: str) -> None:
    """Raise InvalidParams, naming `what`, when `text` nests deeper than MAX_JSON_DEPTH."""
    data = text.encode(errors="surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return  # nothing can nest deeper than it has openers: most texts stop here
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise InvalidParams(f"{what}: JSON nested {depth} levels deep; the limit is {MAX_JSON_DEPTH}")
