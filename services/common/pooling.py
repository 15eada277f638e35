"""Embedding models: whether a run serves its model for embeddings, how it pools the token states
into one vector per input, and the vector's last touches (Matryoshka truncation, normalization).

Every stage reads the same answer from the config and the checkpoint: the worker pools, the
scheduler truncates and normalizes, the tokenizer refuses the requests of the other task. Light
(no torch): the supervisor, the tokenizer and the scheduler import it.

A sentence-transformers checkpoint says it all beside its weights: `modules.json` lists a Pooling
module (its `1_Pooling/config.json` names the mode) and, where the vectors are normalized, a
Normalize module. Qwen3-Embedding ships the same files (last-token pooling). sentence-transformers 6
saves a decoder it embeds with as its base model (`Qwen3Model` in config.json: no LM head), keeps
the input length in tokenizer_config.json, and may render each text as a chat message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ipc.config import ModelConfig
from services.common.text import find_chat_template

POOLINGS = ("last", "mean", "cls")
# Architectures with no LM head: they can only embed. Their forward reads every token of the
# input at once (bidirectional attention): services/gpu_worker/bert.py.
ENCODER_ARCHITECTURES = ("BertModel",)
# The base model (transformers' AutoModel class: the layers and the final norm, no LM head) of each
# decoder family Brigade runs, as sentence-transformers 6 names it in the config.json it saves ->
# that family's causal LM, whose layers it has (its weights are the causal LM's without their
# `model.` prefix: services/common/checkpoint_files.py). They, too, can only embed.
BASE_MODEL_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Gemma2Model": "Gemma2ForCausalLM",
    "Gemma3TextModel": "Gemma3ForCausalLM",  # Gemma3Model is the vision-language one's base
    "Phi3Model": "Phi3ForCausalLM",
    "MixtralModel": "MixtralForCausalLM",
    "Qwen2MoeModel": "Qwen2MoeForCausalLM",
    "Qwen3MoeModel": "Qwen3MoeForCausalLM",
    "OlmoeModel": "OlmoeForCausalLM",
    "GptOssModel": "GptOssForCausalLM",
    "DeepseekV2Model": "DeepseekV2ForCausalLM",
    "DeepseekV3Model": "DeepseekV3ForCausalLM",
}
# transformers' stand-in for "no limit" in a tokenizer's model_max_length (VERY_LARGE_INTEGER).
NO_LENGTH_LIMIT = int(1e30)
# sentence-transformers' Pooling config keys -> Brigade's pooling.
SENTENCE_POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


@dataclass(frozen=True)
class Embedding:
    """How an embedding model turns its final token states into one vector."""

    pooling: str  # one of POOLINGS
    normalize: bool
    width: int  # the vectors' values (the model's hidden size): the most `dimensions` may keep
    # The longest input the model reads: the length sentence-transformers truncates to
    # (`_sentence_max_length`); 0: no limit besides max_model_len. A longer input is refused
    # rather than embedded as sentence-transformers would not.
    max_input_tokens: int = 0
    max_input_from: str = ""  # where the checkpoint says so, for the refusal's message
    # Each text input is rendered as one user message through the chat template before it is
    # tokenized, as sentence-transformers 6 does for a model whose Transformer module lists the
    # `message` modality: "flat" (the text as the content) or "structured" (one text part); "" not.
    chat_message: str = ""


def embedding_of(model: ModelConfig, model_dir: Path) -> Embedding | None:
    """The run's embedding setup, or None when it generates. ValueError for a combination that
    cannot run (an encoder asked to generate, a sentence-transformers pooling Brigade lacks)."""
    model_dir = Path(model_dir)
    modules = _sentence_modules(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    architectures = raw.get("architectures") or []
    encoder = any(a in ENCODER_ARCHITECTURES for a in architectures)
    base_model = next((a for a in architectures if a in BASE_MODEL_ARCHITECTURES), None)
    if model.task == "generate":
        if encoder:
            raise ValueError(
                f"{model_dir.name} is an encoder-only model: it can only embed (model.task: embed)"
            )
        if base_model is not None:
            raise ValueError(
                f"{model_dir.name} is a base model ({base_model} in its config.json, as sentence-transformers "
                "saves a decoder it embeds with): it has no LM head, so it cannot generate; it can only "
                "embed (model.task: embed)"
            )
        return None
    if model.task == "auto" and modules is None and not encoder and base_model is None:
        return None
    pooling = model.pooling or ("cls" if encoder else "last")
    normalize = True
    limit, limit_from, chat_message = 0, "", ""
    if modules is not None:
        pooling = _sentence_pooling(model_dir, modules) or pooling
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        sentence = _sentence_config(model_dir)
        limit, limit_from = _sentence_max_length(model_dir, sentence, raw)
        chat_message = _chat_message(model_dir, sentence)
    if model.normalize is not None:
        normalize = model.normalize
    return Embedding(pooling, normalize, int(raw["hidden_size"]), limit, limit_from, chat_message)


def finish_vector(pooled: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """A pooled vector as the request gets it: its first `dimensions` values (0: all), then
    L2-normalized where the model normalizes (so a truncated vector is a unit vector again)."""
    vector = np.array(pooled[:dimensions] if dimensions else pooled, np.float32)
    if normalize:
        norm = float(np.linalg.norm(vector))
        if norm > 0:
            vector /= norm
    return vector


def _sentence_max_length(model_dir: Path, sentence: dict, raw: dict) -> tuple[int, str]:
    """The input length sentence-transformers truncates to (0: none), and where the checkpoint
    says it, read as its Transformer module reads it: a `model_max_length` among the tokenizer's
    arguments in sentence_bert_config.json, else its `max_seq_length` (the older saves', 256 for
    all-MiniLM-L6-v2), else the tokenizer's own `model_max_length` (tokenizer_config.json, where
    sentence-transformers 6 saves it) capped at config.json's `max_position_embeddings`."""
    for key in ("processor_kwargs", "tokenizer_args"):
        given = (sentence.get(key) or {}).get("model_max_length")
        if given:
            return int(given), f"{key}.model_max_length in sentence_bert_config.json"
    if sentence.get("max_seq_length"):
        return int(sentence["max_seq_length"]), "max_seq_length in sentence_bert_config.json"
    path = model_dir / "tokenizer_config.json"
    tokenizer = int((json.loads(path.read_text()) if path.exists() else {}).get("model_max_length") or 0)
    positions = int(raw.get("max_position_embeddings") or 0)
    if positions > 0 and not 0 < tokenizer <= positions:
        return positions, "max_position_embeddings in config.json"
    if 0 < tokenizer < NO_LENGTH_LIMIT:
        return tokenizer, "model_max_length in tokenizer_config.json"
    return 0, ""


def _sentence_config(model_dir: Path) -> dict:
    """The Transformer module's sentence_bert_config.json (saved beside the weights); {} if none.
    ValueError for processing settings Brigade does not apply (they change what is embedded)."""
    path = model_dir / "sentence_bert_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if config.get("processing_kwargs"):
        raise ValueError(
            f"{path}: unsupported processing_kwargs {sorted(config['processing_kwargs'])}; supported: none "
            "(the tokenizer's and chat template's own settings)"
        )
    return config


def _chat_message(model_dir: Path, sentence: dict) -> str:
    """How sentence-transformers 6 renders a text input (Embedding.chat_message): as a chat message
    where the Transformer module's modality_config lists `message` (it does when the tokenizer
    had a chat template as the model was put together), else as the text itself."""
    message = (sentence.get("modality_config") or {}).get("message")
    if message is None:
        return ""
    form = message.get("format")  # its saves write it; without it the format is guessed from the template
    if form not in ("flat", "structured"):
        raise ValueError(
            f"{model_dir / 'sentence_bert_config.json'}: unsupported message format {form!r}; supported: "
            "flat, structured"
        )
    if not find_chat_template(model_dir):
        raise ValueError(
            f"{model_dir / 'sentence_bert_config.json'} lists the message modality (each input rendered "
            "by the chat template), but the model has no chat template (chat_template.jinja or "
            "tokenizer_config.json's chat_template)"
        )
    return form


def _sentence_modules(model_dir: Path) -> list[dict] | None:
    """modules.json's modules where it lists a Pooling module, else None."""
    path = model_dir / "modules.json"
    if not path.exists():
        return None
    modules = json.loads(path.read_text())
    if not any(m.get("type", "").endswith(".Pooling") for m in modules):
        return None
    return modules


def _sentence_pooling(model_dir: Path, modules: list[dict]) -> str | None:
    """The pooling the Pooling module's config turns on; ValueError for one Brigade lacks."""
    module = next(m for m in modules if m.get("type", "").endswith(".Pooling"))
    path = model_dir / module.get("path", "") / "config.json"
    if not path.exists():
        return None
    config = json.loads(path.read_text())
    if config.get("pooling_mode"):  # newer sentence-transformers: one key
        mode = {"cls": "cls", "mean": "mean", "lasttoken": "last"}.get(config["pooling_mode"])
        if mode is None:
            raise ValueError(
                f"{path}: pooling_mode {config['pooling_mode']!r} is not one of cls, mean, lasttoken"
            )
        return mode
    on = [mode for key, mode in SENTENCE_POOLING_MODES.items() if config.get(key)]
    others = [
        k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in SENTENCE_POOLING_MODES
    ]
    if others or len(on) > 1:
        raise ValueError(
            f"{path}: unsupported pooling {others or on}; supported: one of cls, mean, lasttoken"
        )
    return on[0] if on else None
