"""The draft-model proposer (speculative.method draft_model, docs/speculative.md): a smaller model
with the target's vocabulary, run by the same worker, drafts the proposals a step verifies.

The scheduler decides how many tokens each row drafts and gives them KV slots as for any
proposal; the plan carries DRAFT_TOKEN in their places (ipc/messages.py). In the step, before the
target runs, the draft fills them in greedily:

1. **Catch-up**: one forward pass over every token of the step except the places to draft: the
   prefill chunks, the single-token decodes and each verifying row's last known token. The
   logits after that last token give its first draft token.
2. **Drafting**: for m = 1, 2, ...: one forward pass over the m-th draft token of every row that
   drafts at least m, whose logits give its next one (the argmax; the last pass only writes KV).

The draft's KV cache has the target's block count and is addressed by the same block tables and
slot mapping, so the scheduler keeps one block manager: every slot the target writes in a step,
the draft writes too, with the same token (the catch-up writes the step's known tokens, the
drafting passes each row's last known token and its proposals, as the target's verification
does). So wherever the target's cache holds a token's KV, the draft's holds the draft's KV of the
same token: after a prefix-cache hit (the blocks were written by both), after a rejected proposal
(the next step writes over both), after a preemption or a restarted worker (a fresh worker's
caches are both empty, and the scheduler recomputes every sequence from its whole token history,
which the draft runs over like any prefill). The draft runs every step, proposals or not, to
keep that so.

A greedy draft is a point mass on its argmax, so verification's rule for point-mass proposals
(services/gpu_worker/speculation.py) is exact rejection sampling for it as for n-gram
proposals. The draft applies no sampling parameter, adapter or image: it only guesses.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from services.gpu_worker.architectures import BertConfig, ModelConfig, check_draft_model
from services.gpu_worker.loader import load_weights
from services.gpu_worker.model import LlamaModel, kv_bytes_per_block, paged_kv_cache
from services.gpu_worker.speculation import proposal_mask

log = logging.getLogger(__name__)


class DraftModel:
    """The draft model's weights and paged KV cache (`allocate`, with the target's block count)."""

    def __init__(
        self,
        model_dir: Path,
        target: ModelConfig | BertConfig,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        backend: str | None,
    ) -> None:
        self.config = check_draft_model(target, Path(model_dir))
        self.dtype, self.device, self.block_size = dtype, device, block_size
        if kv_dtype != dtype and self.config.mla is not None:
            raise ValueError(
                f"engine.kv_cache_dtype {str(kv_dtype).removeprefix('torch.')}: the draft model "
                f"{Path(model_dir).name} has latent attention (DeepSeek), which keeps its caches in the "
                "model's dtype; use auto"
            )
        self.kv_dtype = kv_dtype  # the target's (engine.kv_cache_dtype)
        self.model = LlamaModel(self.config, dtype, device, block_size, backend=backend)
        load_weights(self.model, Path(model_dir))
        self.num_kv_heads = self.model.shapes.num_kv_heads
        self.bytes_per_block = kv_bytes_per_block(self.config, self.num_kv_heads, block_size, kv_dtype)
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        log.info("draft model %s: %d layers", Path(model_dir).name, self.config.num_hidden_layers)

    def allocate(self, num_blocks: int) -> None:
        self.kv_cache = paged_kv_cache(
            self.config, self.num_kv_heads, num_blocks, self.block_size, self.kv_dtype, self.device
        )

    @torch.inference_mode()
    def draft(
        self, input_ids: torch.Tensor, arrays: dict[str, np.ndarray], num_tokens: int, num_seqs: int
    ) -> None:
        """Run the step's tokens through the draft (its KV cache), and put its greedy tokens in
        the DRAFT_TOKEN places of `input_ids` [num_tokens] (on the device, placeholders filled
        in): the last `num_proposed` tokens of each verifying row's span."""
        qsl = arrays["query_start_loc"][: num_seqs + 1].astype(np.int64)
        seq_lens = arrays["seq_lens"][:num_seqs].astype(np.int64)
        tables = arrays["block_tables"][:num_seqs]
        positions, slots = arrays["positions"][:num_tokens], arrays["slot_mapping"][:num_tokens]
        if "num_proposed" in arrays:
            proposed = arrays["num_proposed"][:num_seqs].astype(np.int64)
        else:
            proposed = np.zeros(num_seqs, np.int64)
        verifying = np.flatnonzero(proposed)
        depths = proposed[verifying]
        # Each verifying row's last known token (flat index): its span's end minus its proposals.
        lasts = qsl[verifying + 1] - depths - 1
        known = np.flatnonzero(~proposal_mask(qsl, proposed, num_tokens))
        catch_up_qsl = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(np.diff(qsl) - proposed, out=catch_up_qsl[1:])
        drafted = self._forward(
            input_ids[self._to_device(known)],
            {
                "query_start_loc": catch_up_qsl.astype(np.int32),
                "seq_lens": (seq_lens - proposed).astype(np.int32),
                "block_tables": tables,
                "positions": positions[known],
                "slot_mapping": slots[known],
            },
            catch_up_qsl[verifying + 1] - 1,
        )
        # drafted[j]: verifying row j's latest draft token, at flat index lasts[j] + m in pass m.
        for m in range(1, int(depths.max(initial=0)) + 1):
            rows = np.flatnonzero(depths >= m)
            at = lasts[rows] + m
            input_ids[self._to_device(at)] = drafted[self._to_device(rows)]
            wants_next = depths[rows] > m  # the last draft token's pass only writes its KV
            next_tokens = self._forward(
                input_ids[self._to_device(at)],
                {
                    "query_start_loc": np.arange(len(rows) + 1, dtype=np.int32),
                    "seq_lens": positions[at] + 1,
                    "block_tables": tables[verifying[rows]],
                    "positions": positions[at],
                    "slot_mapping": slots[at],
                },
                np.flatnonzero(wants_next),
            )
            drafted[self._to_device(rows[wants_next])] = next_tokens

    def _forward(
        self, input_ids: torch.Tensor, arrays: dict[str, np.ndarray], sampled: np.ndarray
    ) -> torch.Tensor:
        """One draft pass over `input_ids` with the plan-like `arrays` (the step plan's dtypes),
        writing their KV; the argmax token after each of the flat indices `sampled`."""
        metas = self.model.prepare(arrays, len(input_ids), len(arrays["seq_lens"]))
        hidden, residual = self.model.hidden_states(input_ids, metas, self.kv_cache)
        if not len(sampled):
            return input_ids[:0]
        return self.model.logits(hidden, residual, self._to_device(sampled)).argmax(dim=-1)

    def _to_device(self, index: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(index.astype(np.int64)).to(self.device, non_blocking=True)
