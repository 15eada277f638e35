"""An encoder-only BERT forward (HF `BertModel`: all-MiniLM-L6-v2 and the sentence-transformers
models built on it), for embedding runs.

It differs from the decoders of model.py in everything that matters to a step: attention is
bidirectional (every token of an input sees every other, so an input must come whole in one
step and there is no KV cache to keep), positions are learned absolute embeddings added to the
token embeddings with a token-type embedding (type 0: one segment), each sublayer adds its
residual and then normalizes (post-norm LayerNorm), and the MLP is a plain GELU one. The output is
the last layer's token states, which the runner pools (services/common/pooling.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from services.gpu_worker.architectures import BertConfig

# Checkpoints saved from BertForMaskedLM and friends prefix the encoder's weights with this.
PREFIX = "bert."
# Weights the forward does not use: the pooler (a tanh head over [CLS] that sentence-transformers
# skips), the buffer of position ids, and the pretraining heads.
UNUSED = ("pooler.", "embeddings.position_ids", "cls.")


class BertEncoder:
    """The weights of a BertModel and its forward over a step's flat batch of whole inputs."""

    takes_quantized = False
    reads_gguf_blocks = False

    def __init__(self, config: BertConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.weights: dict[str, torch.Tensor] = {}

    def shard_spec(self, name: str) -> None:
        """Every weight whole: an encoder runs on one rank (tensor_parallel 1)."""
        return None

    def expected_weights(self) -> set[str]:
        c = self.config
        names = {
            "embeddings.word_embeddings.weight",
            "embeddings.position_embeddings.weight",
            "embeddings.token_type_embeddings.weight",
            "embeddings.LayerNorm.weight",
            "embeddings.LayerNorm.bias",
        }
        per_layer = [
            f"{module}.{kind}"
            for module in (
                "attention.self.query",
                "attention.self.key",
                "attention.self.value",
                "attention.output.dense",
                "attention.output.LayerNorm",
                "intermediate.dense",
                "output.dense",
                "output.LayerNorm",
            )
            for kind in ("weight", "bias")
        ]
        for i in range(c.num_hidden_layers):
            names.update(f"encoder.layer.{i}.{n}" for n in per_layer)
        return names

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> None:
        name = name.removeprefix(PREFIX)
        if name.startswith(UNUSED):
            return
        if name not in self.expected_weights():
            raise ValueError(f"unexpected BERT weight {name!r}")
        self.weights[name] = torch.as_tensor(tensor).to(self.device, self.dtype).contiguous()

    def finish_loading(self) -> None:
        missing = sorted(self.expected_weights() - set(self.weights))
        if missing:
            raise ValueError(f"BERT checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: np.ndarray
    ) -> torch.Tensor:
        """The last layer's states [T, hidden] (float32) of a step's tokens, the inputs laid out
        by `query_start_loc` (each whole: attention reads within it, in both directions)."""
        c, w = self.config, self.weights
        x = (
            w["embeddings.word_embeddings.weight"][input_ids]
            + w["embeddings.position_embeddings.weight"][positions]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = self._layer_norm(x, "embeddings.LayerNorm")
        lengths = np.diff(query_start_loc).tolist()
        width = max(lengths)
        # Padded to [inputs, width] for one batched attention; the mask hides each input's padding.
        index = torch.cat([torch.arange(n) + i * width for i, n in enumerate(lengths)]).to(self.device)
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(self.device)
        mask = mask[:, None, None, :]  # [inputs, 1, 1 (queries), width (keys)]
        heads, head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        for i in range(c.num_hidden_layers):
            p = f"encoder.layer.{i}."
            qkv = [self._linear(x, p + f"attention.self.{n}") for n in ("query", "key", "value")]
            padded = [
                x.new_zeros(len(lengths) * width, c.hidden_size).index_copy_(0, index, t)
                .view(len(lengths), width, heads, head_dim).transpose(1, 2)
                for t in qkv
            ]  # fmt: skip
            attended = F.scaled_dot_product_attention(*padded, attn_mask=mask)
            attended = attended.transpose(1, 2).reshape(len(lengths) * width, c.hidden_size)[index]
            x = self._layer_norm(
                self._linear(attended, p + "attention.output.dense") + x, p + "attention.output.LayerNorm"
            )
            inner = F.gelu(self._linear(x, p + "intermediate.dense"))
            x = self._layer_norm(self._linear(inner, p + "output.dense") + x, p + "output.LayerNorm")
        return x.float()

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.weights[name + ".weight"], self.weights[name + ".bias"])

    def _layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.weights
        return F.layer_norm(
            x, (x.shape[-1],), w[name + ".weight"], w[name + ".bias"], self.config.layer_norm_eps
        )
