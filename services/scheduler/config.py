"""What one engine group's scheduler is sized by: the engine's settings as configured
(`EngineConfig`: sequence, token and waiting-queue limits, prefix caching) and what the workers'
model gives in their hellos (block size, KV blocks, context, eos ids, vocabulary, sliding window,
LongRoPE)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from ipc import messages as m
from ipc.config import EngineConfig
from services.scheduler.proposers import Proposer


@dataclass(frozen=True)
class SchedulerConfig:
    # The scheduler reads max_num_seqs, max_num_batched_tokens, max_num_waiting (a hot reload
    # replaces it: with_max_num_waiting) and enable_prefix_caching; its block size is the workers'.
    engine: EngineConfig = field(default_factory=EngineConfig)
    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 2048
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
    # An embedding model (services/common/pooling.py; "" = it generates): every request is one
    # whole-prompt step whose pooled vector the scheduler truncates and, where `normalize`,
    # normalizes (finish_vector).
    pooling: str = ""
    normalize: bool = True
    # LoRA adapters running at once (lora.max_loras; lora_residency.py): 0 = adapters off; and
    # the workers' slots for them (LoraConfig.num_slots: one spare where adapters outnumber them).
    max_loras: int = 0
    lora_slots: int = 0
    # The model's vocabulary (the lm_head's width, which bitmask rows cover): allowed_token_ids
    # become a static bitmask row of this width (0: unknown, and such requests are refused).
    vocab_size: int = 0

    def __post_init__(self) -> None:
        engine = self.engine
        for name, value in [
            ("max_num_seqs", engine.max_num_seqs),
            ("max_num_batched_tokens", engine.max_num_batched_tokens),
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_model_len", self.max_model_len),
        ]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.long_rope_from < 0:
            raise ValueError(f"long_rope_from must be >= 0, got {self.long_rope_from}")
        if engine.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0, got {engine.max_num_waiting}")
        # One sequence alone must always fit, or it would preempt itself forever.
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"{self.num_blocks} KV blocks of {self.block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len}; lower max_model_len or give the KV cache more memory"
            )

    @classmethod
    def of(
        cls,
        engine: EngineConfig,
        max_model_len: int,
        hellos: Sequence[m.WorkerHello],
        proposer: Proposer | None = None,
        max_loras: int = 0,
        lora_slots: int = 0,
    ) -> SchedulerConfig:
        """The config of a group whose workers all said hello (`hellos`, rank 0 first): the KV
        blocks of the rank with the fewest, and the model's context up to `max_model_len`
        (model.max_model_len)."""
        first = hellos[0]
        return cls(
            engine=engine,
            block_size=first.block_size,
            num_blocks=min(h.num_kv_blocks for h in hellos),
            max_model_len=min(first.max_model_len, max_model_len),
            eos_token_ids=tuple(first.eos_token_ids),
            sliding_window=first.sliding_window,
            long_rope_from=first.long_rope_from,
            proposer=proposer,
            pooling=first.pooling,
            normalize=first.normalize,
            max_loras=max_loras,
            lora_slots=max(lora_slots, max_loras),
            vocab_size=first.vocab_size,
        )

    def with_max_num_waiting(self, max_num_waiting: int) -> SchedulerConfig:
        """This config after a hot reload of engine.max_num_waiting."""
        engine = msgspec.structs.replace(self.engine, max_num_waiting=max_num_waiting)
        return dataclasses.replace(self, engine=engine)
