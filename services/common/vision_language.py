"""Vision-language checkpoints, as the stages that do not run their vision side see them: the
worker runs the language model, whose config is the checkpoint's `text_config`; the encoder stage
(services/encoder/) runs the vision tower and projector."""

from __future__ import annotations

# Each vision-language architecture Brigade serves, and the causal LM its language model is.
VISION_LANGUAGE = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def is_vision_language(config: dict) -> bool:
    """Whether a config.json dict is a vision-language checkpoint's."""
    names = config.get("architectures") or []
    return len(names) == 1 and names[0] in VISION_LANGUAGE


def language_model_config(config: dict) -> dict:
    """The config.json dict of the language model: a vision-language checkpoint's `text_config`
    under its causal LM's architecture, any other config as it is."""
    if not is_vision_language(config):
        return config
    return {**config["text_config"], "architectures": [VISION_LANGUAGE[config["architectures"][0]]]}
