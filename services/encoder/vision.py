"""The vision side of a vision-language model: pixels in, the embeddings its image tokens take out.

Both families run a SigLIP vision tower over square tiles of a fixed size (no pooling head), then
their own projector:
- Gemma 3 (`Gemma3ForConditionalGeneration`): average-pools the patch grid down to
  `mm_tokens_per_image` tokens, RMS-normalizes them (Gemma's `1 + w` scale) and projects them to the
  language model's width. Gemma scales its text embeddings by sqrt(hidden_size), never these.
- SmolVLM / Idefics3 (`SmolVLMForConditionalGeneration`, `Idefics3ForConditionalGeneration`): the
  connector's pixel shuffle folds each `scale_factor` x `scale_factor` block of patches into one
  token of `scale_factor`^2 times the width, then one linear map (no bias) to the language model's.
  Their tower's positions are bucketed fractional coordinates (for images of any aspect ratio); a
  whole tile's are computed the same way, so they are exactly HF's.
The embeddings are what the language model puts in place of its image tokens as they are.

Plain torch over the checkpoint's own safetensors, so the encoder stage needs neither
transformers nor the worker's loader (docs/architecture.md invariant 10).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import safe_open

from services.common.checkpoint_files import safetensors_files, take_weights

if TYPE_CHECKING:
    from services.encoder.qwen2_vl import Qwen2VLVisionEncoder

TOWER = "tower."
PROJECTOR = "projector."
# The checkpoint names of the tower's and projector's weights, by where they come from: the hub's
# Gemma 3 checkpoints, transformers' in-memory names, and what transformers 5 saves. The first
# matching prefix is replaced by TOWER or PROJECTOR.
CHECKPOINT_PREFIXES = (
    ("model.vision_tower.vision_model.", TOWER),
    ("vision_tower.vision_model.", TOWER),
    ("vision_tower.", TOWER),
    ("model.multi_modal_projector.", PROJECTOR),
    ("multi_modal_projector.", PROJECTOR),
    # SmolVLM / Idefics3
    ("model.vision_model.", TOWER),
    ("vision_model.", TOWER),
    ("model.connector.", PROJECTOR),
    ("connector.", PROJECTOR),
)
IDEFICS3 = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")


def _short_name(name: str) -> str | None:
    for prefix, short in CHECKPOINT_PREFIXES:
        if name.startswith(prefix):
            return short + name[len(prefix) :]
    return None


@dataclass(frozen=True)
class VisionConfig:
    """What the tower and projector need from config.json's `vision_config` and top level."""

    image_size: int
    patch_size: int
    hidden_size: int
    num_heads: int
    num_layers: int
    layer_norm_eps: float
    hidden_act: str
    tokens_per_tile: int
    text_hidden_size: int
    # SmolVLM / Idefics3's pixel-shuffle connector; 0 for Gemma 3's pooling projector.
    scale_factor: int = 0

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        architectures = d.get("architectures", [])
        if not ({"Gemma3ForConditionalGeneration", *IDEFICS3} & set(architectures)):
            raise ValueError(
                f"no vision encoder for architectures {architectures}: Gemma 3's, SmolVLM's, Idefics3's (Qwen2.5-VL's is services/encoder/qwen2_vl.py)"
            )
        v = d["vision_config"]
        tower = {
            "image_size": v["image_size"],
            "patch_size": v["patch_size"],
            "hidden_size": v["hidden_size"],
            "num_heads": v["num_attention_heads"],
            "num_layers": v["num_hidden_layers"],
            "layer_norm_eps": v.get("layer_norm_eps", 1e-6),
            "hidden_act": v.get("hidden_act", "gelu_pytorch_tanh"),
            "text_hidden_size": d["text_config"]["hidden_size"],
        }
        patches = v["image_size"] // v["patch_size"]
        if set(IDEFICS3) & set(architectures):  # the pixel-shuffle connector
            scale = d.get("scale_factor", 2)
            if scale < 1 or patches % scale:
                raise ValueError(f"scale_factor {scale} must divide the {patches} patches per side")
            return cls(**tower, tokens_per_tile=(patches // scale) ** 2, scale_factor=scale)
        tokens = d.get("mm_tokens_per_image", 256)  # Gemma 3's pooling to a square
        side = math.isqrt(tokens)
        if side * side != tokens or patches % side:
            raise ValueError(
                f"mm_tokens_per_image {tokens} must be a square whose side divides the "
                f"{patches} patches per side"
            )
        return cls(**tower, tokens_per_tile=tokens)

    @classmethod
    def from_dir(cls, model_dir: Path) -> VisionConfig:
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))


def load_vision_encoder(model_dir: Path) -> VisionEncoder | Qwen2VLVisionEncoder:
    """The vision side of a vision-language checkpoint: Qwen2.5-VL's own tower, or the SigLIP
    tower with Gemma 3's or SmolVLM / Idefics3's projector."""
    from services.encoder.qwen2_vl import ARCHITECTURE, Qwen2VLVisionEncoder

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("architectures") == [ARCHITECTURE]:
        return Qwen2VLVisionEncoder.load(model_dir)
    return VisionEncoder.load(model_dir)


def _activation(name: str):
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"vision tower activation {name!r} is not supported (gelu_pytorch_tanh, gelu)")


class VisionEncoder:
    """The tower and projector's weights, and `encode`: pixel batches to image-token embeddings."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.w = take_weights(self.weight_names(), weights, dtype)
        self.act = _activation(config.hidden_act)
        self.positions = self._positions()

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype = torch.float32) -> VisionEncoder:
        model_dir = Path(model_dir)
        config = VisionConfig.from_dir(model_dir)
        weights = {}
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors file is no dict)
                    short = _short_name(name)
                    if short is not None:
                        weights[short] = f.get_tensor(name)
        return cls(config, weights, dtype)

    def weight_names(self) -> list[str]:
        names = [
            TOWER + "embeddings.patch_embedding.weight",
            TOWER + "embeddings.patch_embedding.bias",
            TOWER + "embeddings.position_embedding.weight",
            TOWER + "post_layernorm.weight",
            TOWER + "post_layernorm.bias",
        ]
        if self.config.scale_factor:
            names.append(PROJECTOR + "modality_projection.proj.weight")
        else:
            names += [PROJECTOR + "mm_input_projection_weight", PROJECTOR + "mm_soft_emb_norm.weight"]
        for i in range(self.config.num_layers):
            layer = f"{TOWER}encoder.layers.{i}."
            for module in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj",
                           "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"):  # fmt: skip
                names += [layer + module + ".weight", layer + module + ".bias"]
        return names

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, image_size, image_size] normalized pixels -> [tiles, tokens_per_tile,
        text hidden size] embeddings, in float32."""
        c, w = self.config, self.w
        if pixels.shape[1:] != (3, c.image_size, c.image_size):
            raise ValueError(
                f"pixels of shape {tuple(pixels.shape)}, expected [n, 3, {c.image_size}, {c.image_size}]"
            )
        x = F.conv2d(
            pixels.to(self.dtype),
            w[TOWER + "embeddings.patch_embedding.weight"],
            w[TOWER + "embeddings.patch_embedding.bias"],
            stride=c.patch_size,
        )
        x = x.flatten(2).transpose(1, 2) + w[TOWER + "embeddings.position_embedding.weight"][self.positions]
        for i in range(c.num_layers):
            x = self._layer(x, f"{TOWER}encoder.layers.{i}.")
        x = self._layer_norm(x, TOWER + "post_layernorm")
        return (self._shuffle_and_project(x) if c.scale_factor else self._project(x)).float()

    def _positions(self) -> torch.Tensor:
        """Each patch's row of the position embeddings. Gemma 3's are in order; Idefics3's are
        bucketed fractional coordinates (HF's Idefics3VisionEmbeddings), for a whole tile
        computed in float32 exactly as HF does, whatever the rounding gives."""
        side = self.config.patches_per_side
        if not self.config.scale_factor:
            return torch.arange(side * side)
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        fractions = torch.arange(side, dtype=torch.float32) * (
            1.0 / torch.tensor([side], dtype=torch.float32)
        )
        buckets = torch.bucketize(torch.clamp(fractions, max=1.0 - 1e-6), boundaries, right=True)
        return (buckets[:, None] * side + buckets[None, :]).reshape(-1)

    def _layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(
            x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], self.config.layer_norm_eps
        )

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _layer(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        c = self.config
        n, length, width = x.shape
        h = self._layer_norm(x, prefix + "layer_norm1")
        heads = [
            self._linear(h, prefix + f"self_attn.{p}_proj").view(n, length, c.num_heads, -1).transpose(1, 2)
            for p in ("q", "k", "v")
        ]
        # Every patch sees every other: the tower has no mask.
        attn = F.scaled_dot_product_attention(*heads)
        x = x + self._linear(attn.transpose(1, 2).reshape(n, length, width), prefix + "self_attn.out_proj")
        h = self._layer_norm(x, prefix + "layer_norm2")
        return x + self._linear(self.act(self._linear(h, prefix + "mlp.fc1")), prefix + "mlp.fc2")

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        c, w = self.config, self.w
        n, _, width = x.shape
        grid = x.transpose(1, 2).reshape(n, width, c.patches_per_side, c.patches_per_side)
        kernel = c.patches_per_side // math.isqrt(c.tokens_per_tile)
        pooled = F.avg_pool2d(grid, kernel_size=kernel, stride=kernel).flatten(2).transpose(1, 2)
        # Gemma's RMSNorm: in float32, scaled by (1 + w).
        p = pooled.float()
        p = p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + c.layer_norm_eps)
        p = (p * (1.0 + w[PROJECTOR + "mm_soft_emb_norm.weight"].float())).to(self.dtype)
        return p @ w[PROJECTOR + "mm_input_projection_weight"]

    def _shuffle_and_project(self, x: torch.Tensor) -> torch.Tensor:
        """Idefics3's connector: each scale x scale block of patches becomes one token, its
        patches' features side by side in HF's order, then projected."""
        c = self.config
        n, _, width = x.shape
        side, scale = c.patches_per_side, c.scale_factor
        x = x.reshape(n, side, side // scale, width * scale).permute(0, 2, 1, 3)
        x = x.reshape(n, side // scale, side // scale, width * scale * scale).permute(0, 2, 1, 3)
        x = x.reshape(n, c.tokens_per_tile, width * scale * scale)
        return x @ self.w[PROJECTOR + "modality_projection.proj.weight"].T
