"""What one engine group's scheduler is sized by: the engine's limits and what the workers'
model gives (block size, KV blocks, eos ids, sliding window, LongRoPE)."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.proposers import Proposer


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 2048
    max_num_waiting: int = 1024
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    # Every layer reads only a query's last `sliding_window` keys (0: some layer reads them all):
    # decodes and prefill chunks release the blocks wholly before that window
    # (SchedulerState.release_before_window).
    sliding_window: int = 0
    # LongRoPE (Phi-3): original_max_position_embeddings (0: no LongRoPE). A sequence longer than
    # this rotates with the long factors; one that grows past it recomputes (decode.py).
    long_rope_from: int = 0
    # Speculative decoding (docs/speculative.md): None, or what proposes tokens to verify.
    proposer: Proposer | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.long_rope_from < 0:
            raise ValueError(f"long_rope_from must be >= 0, got {self.long_rope_from}")
        if self.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0, got {self.max_num_waiting}")
        # One sequence alone must always fit, or it would preempt itself forever.
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"{self.num_blocks} KV blocks of {self.block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len}; lower max_model_len or give the KV cache more memory"
            )
