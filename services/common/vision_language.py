"""Vision-language checkpoints, as the stages that do not run their vision side see them: the
worker runs the language model, whose config is the checkpoint's `text_config`; the encoder stage
(services/encoder/) runs the vision tower and projector."""

from __future__ import annotations

# Each vision-language architecture Brigade serves, and the causal LM its language model is.
VISION_LANGUAGE = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Idefics3ForConditionalGeneration": "LlamaForCausalLM",
    "SmolVLMForConditionalGeneration": "LlamaForCausalLM",
    # With M-RoPE (text_config's rope_parameters.mrope_section): the plan's rope_deltas and
    # image_grid_widths give each token its three positions.
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
}
# Those whose image tokens see each other both ways (HF's Gemma 3 mask); the others' image tokens
# read causally, as text does.
IMAGES_SEE_EACH_OTHER = {"Gemma3ForConditionalGeneration"}


def is_vision_language(config: dict) -> bool:
    """Whether a config.json dict is a vision-language checkpoint's."""
    names = config.get("architectures") or []
    return len(names) == 1 and names[0] in VISION_LANGUAGE


def images_see_each_other(config: dict) -> bool:
    """Whether a vision-language checkpoint's image tokens attend both ways within each image."""
    return is_vision_language(config) and config["architectures"][0] in IMAGES_SEE_EACH_OTHER


def language_model_config(config: dict) -> dict:
    """The config.json dict of the language model: a vision-language checkpoint's `text_config`
    under its causal LM's architecture, any other config as it is."""
    if not is_vision_language(config):
        return config
    text = {**config["text_config"], "architectures": [VISION_LANGUAGE[config["architectures"][0]]]}
    # HF ties the LM head to the embeddings by the whole model's flag, whatever text_config says.
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text
