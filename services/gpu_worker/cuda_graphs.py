"""Decode steps replayed from CUDA graphs.

A decode step of a few sequences launches a few hundred small kernels, and on a GPU launching
them one by one from Python takes longer than running them (docs/performance.md, "GPU check").
So at start the worker captures the whole decode forward (the layers, the final norm and the LM
head) once per padded number of rows, over fixed device buffers, each row one query token. A
step of n tokens then copies its plan into the buffers of the smallest captured size >= n, one
row per token, and replays that graph: the rows past n are padding, which store no KV (slot -1),
read one key, and whose logits are dropped.

A sequence of several tokens in the step (speculation's verification: its last token and its
proposals) is several rows with the same block table, each attending to the keys up to its own position:
every layer stores the whole step's keys before any row reads them, so a row sees the step's
earlier tokens of its sequence, as the eager path's causal mask lets it. Verification on a GPU
is then as cheap to launch as a decode step, which it must be to pay (docs/speculative.md).

On a run with LoRA adapters each size is captured twice, the second time with the adapters'
kernels over buffers of their own (the step's rows grouped by slot, and each group's tiles), so
that a step whose rows use adapters replays too: the kernels' grid is the most tiles a step of
that size can have, and the tiles past the step's are empty. The slots' weights are updated in
place, so a graph reads whichever adapters the slots hold when it replays.

Steps with a prefill chunk of several tokens (as rows, each of its tokens would read the whole
context), a draft model, prompt scoring, images or M-RoPE run eagerly, as do steps of more
tokens than the largest graph.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from services.gpu_worker.attention import StepMeta, TritonOps, rotary_rows
from services.gpu_worker.lora import LoraBatch, LoraSlots
from services.gpu_worker.model import LlamaModel


def capture_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, then every multiple of 8, up to max_batch (itself
    included), so a step pads at most 7 rows."""
    sizes = [size for size in (1, 2, 4) if size < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def unsupported_reason(model: LlamaModel) -> str | None:
    """Why this model's decode steps cannot replay graphs, or None if they can."""
    if not all(isinstance(ops, TritonOps) for ops in model.kind_ops):
        return "the attention is not the Triton backend's (latent attention, or engine backend torch)"
    if model.parallel.is_parallel:
        return "tensor parallelism's collectives are not captured"
    if model.config.moe is not None:
        return "the fused-MoE kernels size their grid from the step's routing, read back to the host"
    return None


class DecodeGraphs:
    """The one-token-a-row forward per padded size, over buffers it owns. `capture=False` runs the
    same padded forward over the same buffers eagerly: the tests use it to check the padding
    and the buffers on the CPU, with the Triton kernels in the interpreter."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_blocks_per_seq: int,
        lora: LoraSlots | None = None,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.lora = lora
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        n, device = self.max_batch, model.device

        def ints(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # The dtypes the eager path gives the kernels (the plan's int32; rotary rows int64).
        self.input_ids = ints(n, dtype=torch.int64)
        self.slot_mapping = ints(n)
        self.seq_lens = ints(n)
        self.block_tables = ints(n, max_blocks_per_seq)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rope_rows = [ints(n, dtype=torch.int64) for _ in model.kind_ops]
        self.long_rope_rows = [ops.s.long_rope_rows for ops in model.kind_ops]
        self.sample_tokens = torch.arange(n, device=device)
        if lora is not None:  # kernels/lora.py's rows and segments, zero-length tiles past the step's
            self.lora_rows = ints(n, dtype=torch.int64)
            self.lora_segments = ints(self._max_tiles(n), 3, dtype=torch.int64)
        self._pad(0, n)
        # Every graph writes its logits here, outside the graphs' memory pool: one buffer for all
        # sizes, where each graph's own output would stay allocated (sum of sizes x vocab floats).
        self.logits = torch.empty(n, model.config.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, with adapters)
        self.num_replays = 0  # steps served from these buffers
        self.capture_s = 0.0  # how long capturing every size took, at start
        if capture:
            start = time.perf_counter()
            self._capture()
            self.capture_s = time.perf_counter() - start

    def fits(self, arrays: dict[str, np.ndarray], num_tokens: int) -> bool:
        """Whether a step of this shape fits a graph: at most max_batch tokens, a block table no
        wider than the buffers'. (What the step carries is the caller's to check.)"""
        return num_tokens <= self.max_batch and arrays["block_tables"].shape[1] <= self.max_blocks_per_seq

    def load(
        self, arrays: dict[str, np.ndarray], num_tokens: int, num_seqs: int, lora: LoraBatch | None = None
    ) -> torch.Tensor:
        """Copy a step's plan (and its adapters' rows and tiles, where it has any) into the
        buffers, a row per token; returns the rows' input ids (a view of the buffer, for the
        caller to fill placeholders in)."""
        t, size = num_tokens, self._size(num_tokens)

        def put(buffer: torch.Tensor, values: np.ndarray) -> None:
            buffer.copy_(torch.from_numpy(np.ascontiguousarray(values)), non_blocking=True)

        query_start_loc = arrays["query_start_loc"][: num_seqs + 1].astype(np.int64)
        seq_of_token = np.repeat(np.arange(num_seqs), np.diff(query_start_loc))
        # A token's context: its sequence's after the step, less the tokens after it in the step.
        tokens_after = query_start_loc[seq_of_token + 1] - 1 - np.arange(t)
        put(self.input_ids[:t], arrays["input_ids"][:t].astype(np.int64))
        put(self.slot_mapping[:t], arrays["slot_mapping"][:t])
        put(self.seq_lens[:t], (arrays["seq_lens"][seq_of_token] - tokens_after).astype(np.int32))
        tables = arrays["block_tables"][:num_seqs]
        put(self.block_tables[:t, : tables.shape[1]], tables if t == num_seqs else tables[seq_of_token])
        for buffer, long_rows in zip(self.rope_rows, self.long_rope_rows, strict=True):
            put(buffer[:t], rotary_rows(arrays, t, num_seqs, long_rows))
        if lora is not None:
            num_rows, num_tiles = lora.rows.numel(), lora.segments.shape[0]
            self.lora_rows[:num_rows].copy_(lora.rows, non_blocking=True)
            self.lora_segments[:num_tiles].copy_(lora.segments, non_blocking=True)
            self.lora_segments[num_tiles : self._max_tiles(size)] = 0  # an earlier step's tiles
        self._pad(t, size)
        return self.input_ids[:t]

    def replay(self, num_tokens: int, with_lora: bool = False) -> torch.Tensor:
        """The loaded step's float32 logits [num_tokens, V], every token's: a view of the logits
        buffer, which the next replay of any size overwrites. `with_lora`: the step loaded
        adapters' rows (load's `lora`)."""
        size = self._size(num_tokens)
        self.num_replays += 1
        if (size, with_lora) in self.graphs:
            self.graphs[(size, with_lora)].replay()
        else:
            self._forward(size, with_lora)
        return self.logits[:num_tokens]

    def _size(self, num_tokens: int) -> int:
        return next(size for size in self.sizes if size >= num_tokens)

    def _max_tiles(self, size: int) -> int:
        """The most tiles `group_rows` makes of `size` rows: each slot's run cut into tiles of
        tile_rows, so at most one partial tile a slot beyond the full ones (one run a slot where
        the kernel takes runs whole)."""
        assert self.lora is not None
        slots = min(self.lora.max_loras, size)
        tile_rows = self.lora.tile_rows
        return slots if tile_rows is None else size // tile_rows + slots

    def _lora_batch(self, size: int) -> LoraBatch:
        assert self.lora is not None
        return LoraBatch(self.lora, self.lora_rows[:size], self.lora_segments[: self._max_tiles(size)])

    def _pad(self, start: int, end: int) -> None:
        """Padding rows: no KV stored, a context of one key (whatever block their table row
        holds: a real block id from an earlier step, or block 0)."""
        self.slot_mapping[start:end] = -1
        self.seq_lens[start:end] = 1

    def _metas(self, size: int) -> list[StepMeta]:
        return [
            StepMeta(
                rope_rows=rope_rows[:size],
                slot_mapping=self.slot_mapping[:size],
                is_all_decode=True,
                block_tables=self.block_tables[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
            )
            for rope_rows in self.rope_rows
        ]

    def _forward(self, size: int, with_lora: bool) -> None:
        lora = self._lora_batch(size) if with_lora else None
        logits = self.model.forward(
            self.input_ids[:size], self._metas(size), self.kv_cache, self.sample_tokens[:size], lora
        )
        self.logits[:size].copy_(logits)

    def _capture(self) -> None:
        """Capture every size, the largest first, into one memory pool (a smaller graph's
        activations fit in what the larger ones' freed). Each size runs once eagerly first, on
        a side stream, so that Triton compiles its kernels and the allocator has its blocks
        before capture. The buffers hold padding only here: nothing is stored in the cache.
        The caller's stream is current again afterwards even where a capture fails (a failing
        capture's own exit skips restoring it)."""
        device = self.model.device
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.current_stream(device)):
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device)
            variants = (False, True) if self.lora is not None else (False,)
            for size in reversed(self.sizes):
                for with_lora in variants:
                    side.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(side):
                        self._forward(size, with_lora)
                    torch.cuda.current_stream(device).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._forward(size, with_lora)
                    self.graphs[(size, with_lora)] = graph
            torch.cuda.synchronize(device)
