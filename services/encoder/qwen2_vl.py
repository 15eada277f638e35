"""Qwen2.5-VL's vision side (`Qwen2_5_VLForConditionalGeneration`): a resized image in, the
embeddings of its image tokens out, one per merge_size x merge_size block of patches.

- Patches: the image is cut into patch_size squares, in block-major order (each merge block's
  patches together, as HF's processor lays them out); a still image is its own second frame, so
  each patch is embedded by the tower's [temporal_patch_size, patch, patch] convolution over two
  copies of itself.
- Blocks: RMSNorm, attention with a 2-D rotary (a patch's row on the first half of each rotated
  half-head's frequencies, its column on the second), RMSNorm, a SwiGLU MLP (with biases).
  Attention stays inside square windows of `window_size` pixels, except in the blocks of
  `fullatt_block_indexes`, where it spans the whole image. Images never see each other.
- The patch merger: RMSNorm over each patch, each merge block's patches side by side, two linear
  maps with GELU between, to the language model's width.

Attention within a window does not depend on the order of its patches, so the windowed blocks
gather each window's patches into one padded row of a batch (`Windows`), attend within each row
(the padding masked out) and put the results back: no [patches, patches] mask, whose size would
grow with the square of the image's. Plain torch
over the checkpoint's own safetensors, as services/encoder/vision.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from services.common.checkpoint_files import safetensors_files, take_weights

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
# Where the checkpoints keep the tower: the hub's and transformers 5's saves, then transformers'
# in-memory names.
CHECKPOINT_PREFIXES = ("visual.", "model.visual.")
RMS_NORM_EPS = 1e-6  # HF's, fixed for the tower and the merger


@dataclass(frozen=True)
class Qwen2VLVisionConfig:
    """What the tower and merger need from config.json's `vision_config`."""

    hidden_size: int
    num_heads: int
    intermediate_size: int
    depth: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    window_size: int  # in pixels
    full_attention_blocks: frozenset[int]
    rope_theta: float
    text_hidden_size: int  # out_hidden_size: the language model's width

    @classmethod
    def from_dict(cls, d: dict) -> Qwen2VLVisionConfig:
        if d.get("architectures") != [ARCHITECTURE]:
            raise ValueError(f"no Qwen2.5-VL vision tower for architectures {d.get('architectures')}")
        v = d["vision_config"]
        if v.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision_config.hidden_act {v['hidden_act']!r} is not supported (silu)")
        if v.get("in_channels", 3) != 3:
            raise ValueError(f"vision_config.in_channels {v['in_channels']} is not supported (3: RGB)")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(
                f"vision_config.rope_parameters.rope_type {rope['rope_type']!r} is not supported (axial)"
            )
        config = cls(
            hidden_size=v["hidden_size"],
            num_heads=v["num_heads"],
            intermediate_size=v["intermediate_size"],
            depth=v["depth"],
            patch_size=v.get("patch_size", 14),
            temporal_patch_size=v.get("temporal_patch_size", 2),
            merge_size=v.get("spatial_merge_size", 2),
            window_size=v.get("window_size", 112),
            full_attention_blocks=frozenset(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
            rope_theta=rope.get("rope_theta", 10000.0),
            text_hidden_size=v["out_hidden_size"],
        )
        if config.window_size % (config.patch_size * config.merge_size):
            raise ValueError(
                f"vision_config.window_size {config.window_size} is not a multiple of patch_size x "
                f"spatial_merge_size ({config.patch_size * config.merge_size})"
            )
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class Qwen2VLVisionEncoder:
    """The tower and merger's weights, and `encode`: images to image-token embeddings."""

    def __init__(
        self, config: Qwen2VLVisionConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.w = take_weights(self.weight_names(), weights, dtype)
        # The convolution over [3, temporal, patch, patch] as one matrix over flattened patches.
        self.w["patch_embed.proj.weight"] = self.w["patch_embed.proj.weight"].reshape(config.hidden_size, -1)
        spatial = config.head_dim // 2
        self.inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)
        )

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype = torch.float32) -> Qwen2VLVisionEncoder:
        model_dir = Path(model_dir)
        config = Qwen2VLVisionConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
        weights = {}
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors file is no dict)
                    prefix = next((p for p in CHECKPOINT_PREFIXES if name.startswith(p)), None)
                    if prefix is not None:
                        weights[name[len(prefix) :]] = f.get_tensor(name)
        return cls(config, weights, dtype)

    def weight_names(self) -> list[str]:
        names = [
            "patch_embed.proj.weight",
            "merger.ln_q.weight",
            "merger.mlp.0.weight",
            "merger.mlp.0.bias",
            "merger.mlp.2.weight",
            "merger.mlp.2.bias",
        ]
        for i in range(self.config.depth):
            names += [f"blocks.{i}.norm1.weight", f"blocks.{i}.norm2.weight"]
            for module in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                names += [f"blocks.{i}.{module}.weight", f"blocks.{i}.{module}.bias"]
        return names

    def patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, patches, 3 * temporal * patch * patch]: each image's patches in
        block-major order, each patch repeated over the temporal axis (HF's pixel_values rows)."""
        c = self.config
        n, channels, height, width = pixels.shape
        p, m = c.patch_size, c.merge_size
        if height % (p * m) or width % (p * m):
            raise ValueError(f"images of {width}x{height} pixels: both sides must be multiples of {p * m}")
        x = pixels.reshape(n, channels, height // (p * m), m, p, width // (p * m), m, p)
        x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # [n, block row, block col, row, col, channel, p, p]
        x = x.reshape(n, -1, channels, 1, p, p).expand(-1, -1, -1, c.temporal_patch_size, -1, -1)
        return x.reshape(n, x.shape[1], -1)

    def _patch_coordinates(self, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) in patches, in the block-major order of `patches`."""
        m = self.config.merge_size
        rows = torch.arange(height).view(height // m, 1, m, 1).expand(-1, width // m, -1, m)
        cols = torch.arange(width).view(1, width // m, 1, m).expand(height // m, -1, m, -1)
        return rows.reshape(-1), cols.reshape(-1)

    def _windows(self, rows: torch.Tensor, cols: torch.Tensor, width: int) -> Windows:
        """Which patches each attention window holds: square windows of `window_size` pixels from
        the image's top left (those on the right and bottom edges cut short)."""
        side = self.config.window_size // self.config.patch_size  # in patches
        windows_per_row = -(-width // side)
        window = (rows // side) * windows_per_row + cols // side
        num_windows = int(window.max()) + 1
        order = torch.argsort(window, stable=True)
        counts = torch.bincount(window, minlength=num_windows)
        place = torch.arange(len(window)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        # Each window's patches, padded with the index one past the last patch.
        index = torch.full((num_windows, side * side), len(window))
        index[window[order], place] = order
        return Windows(index, index < len(window))

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] normalized pixels of n images of one size (H and W multiples of
        patch_size x merge_size) -> [n, tokens, text hidden size] embeddings in float32, where
        tokens = H * W / (patch_size x merge_size)^2, in the order of the image's tokens."""
        c, w = self.config, self.w
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"pixels of shape {tuple(pixels.shape)}, expected [n, 3, height, width]")
        height, width = pixels.shape[2] // c.patch_size, pixels.shape[3] // c.patch_size
        x = self.patches(pixels.to(self.dtype)) @ w["patch_embed.proj.weight"].T
        rows, cols = self._patch_coordinates(height, width)
        angles = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)  # [patches, head_dim], float32
        rotary = (angles.cos(), angles.sin())
        windows = self._windows(rows, cols, width)
        for i in range(c.depth):
            x = self._block(x, f"blocks.{i}.", rotary, None if i in c.full_attention_blocks else windows)
        x = self._rms_norm(x, "merger.ln_q.weight")
        x = x.reshape(x.shape[0], -1, c.hidden_size * c.merge_size**2)
        x = F.gelu(F.linear(x, w["merger.mlp.0.weight"], w["merger.mlp.0.bias"]))
        return F.linear(x, w["merger.mlp.2.weight"], w["merger.mlp.2.bias"]).float()

    def _rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS)
        return self.w[name] * h.to(x.dtype)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _block(
        self,
        x: torch.Tensor,
        prefix: str,
        rotary: tuple[torch.Tensor, torch.Tensor],
        windows: Windows | None,
    ) -> torch.Tensor:
        c = self.config
        n, length, width = x.shape
        qkv = self._linear(self._rms_norm(x, prefix + "norm1.weight"), prefix + "attn.qkv")
        q, k, v = qkv.view(n, length, 3, c.num_heads, c.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = rotary
        # The rotation in float32, as HF's.
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        attn = F.scaled_dot_product_attention(q, k, v) if windows is None else windows.attention(q, k, v)
        x = x + self._linear(attn.transpose(1, 2).reshape(n, length, width), prefix + "attn.proj")
        h = self._rms_norm(x, prefix + "norm2.weight")
        gate = F.silu(self._linear(h, prefix + "mlp.gate_proj"))
        return x + self._linear(gate * self._linear(h, prefix + "mlp.up_proj"), prefix + "mlp.down_proj")


@dataclass(frozen=True)
class Windows:
    """The patches of each attention window: `index` [windows, window patches] of patch
    indices, padded past a window's last patch with the number of patches; `valid` where not."""

    index: torch.Tensor
    valid: torch.Tensor

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of q, k, v [n, heads, patches, head_dim] within each window."""
        n, heads, length, head_dim = q.shape
        padding = q.new_zeros(n, heads, 1, head_dim)
        gathered = [torch.cat((t, padding), dim=2)[:, :, self.index] for t in (q, k, v)]
        # Padding keys masked out; padding queries attend to their window's patches and are dropped.
        out = F.scaled_dot_product_attention(*gathered, attn_mask=self.valid[:, None, :])
        result = q.new_empty(n, heads, length + 1, head_dim)
        result[:, :, self.index] = out
        return result[:, :, :length]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
