"""The text side of a model dir without torch: `tokenizers` for ids, sandboxed jinja2 for chat.

Behaves like transformers' AutoTokenizer on the same dir (encode, decode and apply_chat_template
give identical results) but loads in milliseconds and keeps the light processes free of torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# From this length on, encoding goes through encode_batch, which releases the GIL; shorter texts
# take encode's path, some 30 us faster.
GIL_FREE_ENCODE_CHARS = 8192


# tokenizer_config.json fields that /tokenizer_info leaves out: file paths, and the added-token
# table (its tokens are in the vocabulary, and it is large).
_NOT_INFO = frozenset({"vocab_file", "merges_file", "tokenizer_file", "added_tokens_decoder"})


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class TemplateTimeout(ValueError):
    """The chat template ran past its time budget (tokenizer.template_timeout_s)."""


class ReservedTemplateKwargs(ValueError):
    """chat_template_kwargs named a variable the server sets (messages, tools, ...)."""


def _compile_template(source: str) -> jinja2.Template:
    """The same environment transformers renders chat templates in (untrusted code: sandboxed)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def find_chat_template(model_dir: Path, config: dict[str, Any] | None = None) -> str | None:
    """The model's chat template: chat_template.jinja, else tokenizer_config.json's (`config`, read
    from the dir when not given; of named templates, "default"); None without one."""
    path = model_dir / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    if config is None:
        config = _read_json(model_dir / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


class Tokenizer:
    """Owns one model dir's tokenizer.json, special tokens and chat template."""

    def __init__(self, model_dir: Path | str) -> None:
        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        # A prompt is its own tokens: never padded to a fixed length or cut short, whatever the
        # file asks (sentence-transformers' tokenizer.json pads and truncates to 128).
        self._tok.no_padding()
        self._tok.no_truncation()
        config = _read_json(model_dir / "tokenizer_config.json")
        self.special_tokens_map: dict[str, str] = {
            name: content for name in _SPECIAL_TOKEN_NAMES if (content := _token_content(config.get(name)))
        }
        self.chat_template = find_chat_template(model_dir, config)
        self.eos_token_ids = self._find_eos_ids(model_dir)
        # The model's architectures (config.json): what the model is, for the chat format it speaks.
        self.architectures: list[str] = _read_json(model_dir / "config.json").get("architectures") or []
        self._config = config

    def info(self) -> dict[str, Any]:
        """What vLLM's GET /tokenizer_info answers: tokenizer_config.json's fields (special tokens
        as their text; no file paths, no added-token table), `tokenizer_class` and the chat
        template."""
        info = {
            name: _token_content(value) if name in _SPECIAL_TOKEN_NAMES else value
            for name, value in self._config.items()
            if name not in _NOT_INFO
        }
        info["tokenizer_class"] = self._config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        if self.chat_template:
            info["chat_template"] = self.chat_template
        return info

    def _find_eos_ids(self, model_dir: Path) -> list[int]:
        """eos from tokenizer_config plus generation_config / config (models often list several)."""
        ids: set[int] = set()
        eos = self.special_tokens_map.get("eos_token")
        if eos is not None and (eos_id := self._tok.token_to_id(eos)) is not None:
            ids.add(eos_id)
        for name in ("generation_config.json", "config.json"):
            value = _read_json(model_dir / name).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
        return sorted(ids)

    @cached_property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' len(tokenizer)). Once: the
        tokenizer stage reads it for every request, and tokenizers 0.23.1 (our floor) counts the
        vocabulary on each call, some 20 ms for SmolLM2's."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def special_token_ids(self) -> list[int]:
        return sorted(i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special)

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """`parse_special` False: a special token's text in `text` is encoded as plain text
        (llama.cpp's /tokenize option), not as that token."""
        tok = self._tok if parse_special else self._plain_tok
        if len(text) >= GIL_FREE_ENCODE_CHARS:
            # encode_batch lets go of the GIL while it works (encode holds it throughout), so a
            # gateway thread encoding a long prompt does not stall the replica's event loop.
            return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def _plain_tok(self) -> HFTokenizer:
        """A copy that reads special tokens' texts as text: a setting of the tokenizer object,
        which the threads encoding with the shared one must not see changed."""
        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        return _compile_template(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        timeout_s: float | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """Render a conversation (and the OpenAI `tools` it may call) to the prompt text (not
        tokenized: the template writes the special tokens as text and `encode` turns them back
        into their ids). `template_kwargs` are more variables for the template (a request's
        `chat_template_kwargs`: `enable_thinking`, say); they cannot replace the ones set here. Past `timeout_s` the rendering stops with TemplateTimeout: it is
        checked between the pieces the template writes, so a template that spends long on one
        conversation (a loop over every pair of messages, say) is stopped, not waited out.
        `continue_final_message` (an assistant's prefill: transformers' option of that name) ends
        the text where the last message's text ends, with no generation prompt, so that the model
        continues that message instead of starting a new one."""
        # Like transformers: keys set to None are absent for the template (`is defined` checks).
        messages = [{k: v for k, v in message.items() if v is not None} for message in messages]
        if continue_final_message:
            messages = _mark_final_message(messages)
        reserved = {"messages", "tools", "documents", "add_generation_prompt", *self.special_tokens_map}
        taken = sorted(reserved & set(template_kwargs or {}))
        if taken:
            raise ReservedTemplateKwargs(f"chat_template_kwargs: {taken} are set by the server")
        pieces = self._template.generate(
            **(template_kwargs or {}),
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            **self.special_tokens_map,
        )
        if timeout_s is None:
            text = "".join(pieces)
        else:
            deadline = time.monotonic() + timeout_s
            out = []
            for piece in pieces:
                out.append(piece)
                if time.monotonic() > deadline:
                    pieces.close()
                    raise TemplateTimeout(
                        f"the chat template took more than {timeout_s:g}s to render (tokenizer.template_timeout_s)"
                    )
            text = "".join(out)
        return _cut_at_mark(text) if continue_final_message else text


# Written after the text of a message to continue, so that the rendering can be cut where that
# text ends: searching for the text itself can find it in what the template writes after it (a
# short prefill such as "end" inside "<|im_end|>"). The space tells whether the template trimmed it.
CONTINUE_MARK = "BRIGADE_CONTINUE_HERE "


def _mark_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with CONTINUE_MARK after the last message's text (its last text part's)."""
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + CONTINUE_MARK
    elif isinstance(content, list) and any("text" in part for part in content):
        k = max(i for i, part in enumerate(content) if "text" in part)
        content = list(content)
        content[k] = {**content[k], "text": content[k]["text"] + CONTINUE_MARK}
        last["content"] = content
    else:
        raise ValueError("continue_final_message: the last message has no text to continue")
    return [*messages[:-1], last]


def _cut_at_mark(text: str) -> str:
    at = text.rfind(CONTINUE_MARK.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's text")
    return text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()
