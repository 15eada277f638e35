"""The values of the sampling fields a request leaves unset (None), as vLLM's default
`--generation-config auto` chooses them: the model's generation_config.json where it sets one,
else the engine's neutral value.

The tokenizer fills them in (`fill_defaults`) before a request goes on, so the scheduler and the
workers only ever see concrete values (ipc/validation.py refuses an unset one). Light: no torch.

Like vLLM, only the values that differ from transformers' own GenerationConfig defaults count as
the model's choice (vLLM reads `GenerationConfig.to_diff_dict()`): a file that spells out
`top_k: 50` repeats transformers' default and does not turn top-k on. `do_sample` is ignored, as
vLLM ignores it. The eos ids of generation_config.json are read by the worker and the tokenizer
whatever this mode says (an eos always ends a request).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

from ipc.config import Config, ConfigError
from ipc.messages import SamplingParams
from ipc.validation import DEFAULTED_FIELDS, InvalidParams, validate_params

GenerationConfigMode = Literal["auto", "none"]
# The engine's values for fields that neither the request nor the model sets: sampling is neutral.
ENGINE_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,  # disabled
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# transformers' GenerationConfig defaults (min_p has none): a file's value equal to one of these
# is not the model's choice.
HF_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "repetition_penalty": 1.0,
}
GENERATION_CONFIG = "generation_config.json"
# The embedded SmolLM2-135M-Instruct declares no sampling values (neither its GGUF nor its HF
# release's generation_config.json); its model card samples with these, so the embedded model
# uses them unless the run's config overrides them (model.override_generation_config).
EMBEDDED_MODEL_DEFAULTS: dict[str, float | int] = {"temperature": 0.2, "top_p": 0.9}


def model_defaults(model_dir: str | Path, mode: GenerationConfigMode = "auto") -> dict[str, float | int]:
    """The sampling defaults a model's generation_config.json sets (only those fields), or {} for
    mode "none" or a model without the file. ValueError, naming the file and the field, for a
    value the engine could not sample with."""
    if mode == "none":
        return {}
    if mode != "auto":
        raise ValueError(f"generation_config mode must be 'auto' or 'none', got {mode!r}")
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    defaults: dict[str, float | int] = {}
    for name in DEFAULTED_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        if name == "top_k" and value == -1:
            value = 0  # vLLM's and some configs' spelling of "disabled"
        value = _checked(path, name, value)
        if value != HF_DEFAULTS.get(name):
            defaults[name] = value
    return defaults


def run_defaults(
    model_dir: str | Path,
    mode: GenerationConfigMode = "auto",
    overrides: dict[str, float | int] | None = None,
    is_embedded_model: bool = False,
) -> dict[str, float | int]:
    """What a run fills unset fields with: the model's values (`model_defaults`; the model card's
    for the embedded model, which declares none), with the config's `overrides` on top, as vLLM's
    `--override-generation-config` (with mode "none", only the overrides). ValueError, naming
    the field, for a value the engine could not sample with."""
    try:
        defaults = model_defaults(model_dir, mode)
    except ValueError as exc:
        raise ValueError(f"{exc} (or set model.generation_config=none)") from None
    if is_embedded_model and mode == "auto" and not defaults:
        defaults = dict(EMBEDDED_MODEL_DEFAULTS)
    return {**defaults, **checked_overrides(overrides or {})}


def check_generation_overrides(config: Config) -> None:
    """model.override_generation_config, refused as a config error (exit 2, before the model
    is prepared) for an unknown field or a value a request could not have."""
    try:
        checked_overrides(config.model.override_generation_config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def checked_overrides(overrides: dict[str, object]) -> dict[str, float | int]:
    """model.override_generation_config, each value checked as a request's would be; ValueError
    naming the field for an unknown one or a value the engine could not sample with."""
    for name in overrides:
        if name not in DEFAULTED_FIELDS:
            raise ValueError(
                f"model.override_generation_config: unknown field {name!r}; it may set {', '.join(DEFAULTED_FIELDS)}"
            )
    return {
        name: _checked("model.override_generation_config", name, value) for name, value in overrides.items()
    }


def describe_defaults(defaults: dict[str, float | int]) -> str:
    """One line for the log: every defaulted field's value, and which came from the engine."""
    values = {name: defaults.get(name, ENGINE_DEFAULTS[name]) for name in DEFAULTED_FIELDS}
    engine = [name for name in DEFAULTED_FIELDS if name not in defaults]
    text = ", ".join(f"{name}={value}" for name, value in values.items())
    return f"{text} ({'the engine defaults: ' + ', '.join(engine) if engine else 'none from the engine'})"


def _checked(where: str | Path, name: str, value: object) -> float | int:
    params = SamplingParams(max_tokens=1, **{**ENGINE_DEFAULTS, name: value})
    try:
        validate_params(params, vocab_size=1, max_model_len=2, num_prompt_tokens=1)
    except InvalidParams as exc:
        raise ValueError(f"{where}: {exc}") from None
    return value  # type: ignore[return-value]  (validate_params checked its type)


def fill_defaults(params: SamplingParams, defaults: dict[str, float | int] | None = None) -> SamplingParams:
    """`params` with every unset defaulted field taken from `defaults` (a model's, from
    `model_defaults`), else from ENGINE_DEFAULTS; the fields a request set are kept."""
    defaults = defaults or {}
    unset = {
        name: defaults.get(name, ENGINE_DEFAULTS[name])
        for name in DEFAULTED_FIELDS
        if getattr(params, name) is None
    }
    return msgspec.structs.replace(params, **unset) if unset else params
