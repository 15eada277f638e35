"""The model runner: owns the model, its paged KV cache and the sampler; runs one step plan."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ipc import messages as m
from ipc.config import LORA_OFF, MAX_SPECULATIVE_TOKENS
from ipc.embedding_cache import EmbeddingCache
from ipc.messages import DRAFT_TOKEN, PLACEHOLDER_TOKEN, SlotRef, StepHeader
from ipc.step_plan import (
    EMITTED_ARRAYS,
    IMAGE_KEY_BYTES,
    STEP_PLAN,
    STEP_RESULT,
    Dim,
    SlotMismatch,
    vocab_words,
)
from ipc.validation import MAX_LOGPROBS
from services.common.pooling import Embedding
from services.common.vision_language import images_see_each_other, language_model_config
from services.gpu_worker.adapter_files import load_adapter
from services.gpu_worker.architectures import BertConfig, ModelConfig, config_from_dir
from services.gpu_worker.attention import mrope_positions
from services.gpu_worker.bert import BertEncoder
from services.gpu_worker.cuda_graphs import DecodeGraphs, unsupported_reason
from services.gpu_worker.draft import DraftModel
from services.gpu_worker.grammar_mask import check_grammar_bitmask
from services.gpu_worker.loader import load_weights
from services.gpu_worker.lora import AdapterError, LoraAdapter, LoraBatch, LoraSlots
from services.gpu_worker.model import ImageRows, LlamaModel, kv_bytes_per_block, paged_kv_cache
from services.gpu_worker.parallel import Parallel
from services.gpu_worker.sampler import Sampler, logsumexp_argmax
from services.gpu_worker.speculation import emitted_tokens, proposal_mask, target_tokens

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_MAX_NUM_SEQS = 1024  # plan-table rows (the scheduler's max_num_seqs) a plan may name
# The plan arrays of a step's images (ipc/step_plan.py), which come together.
IMAGE_ARRAYS = (
    "image_groups",
    "image_starts",
    "image_encoders",
    "image_slots",
    "image_sequences",
    "image_keys",
)
PROMPT_SCORE_ROWS = 256  # prompt positions whose logits are computed at once (prompt logprobs)


class InvalidPlan(Exception):
    """A step plan that would index outside the cache or the vocabulary; the step fails, not the worker."""


class ModelRunner:
    """Loads the model (this rank's shard of it) once, allocates the KV cache from a memory budget,
    and executes step plans. Every rank runs every plan; only the driver (rank 0) samples."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str = "auto",
        device: str = "cpu",
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        block_size: int = 16,
        threads: int | None = None,
        parallel: Parallel = Parallel(),  # noqa: B008 (frozen, so one shared default is safe)
        backend: str | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        int8_activations: bool = False,
        max_loras: int = 0,
        max_lora_rank: int = 64,
        lora_adapters: dict[str, str] | None = None,
        lora_dtype: str = "auto",
        wide_step_dtype: str = "float32",
        kv_cache_dtype: str = "auto",
        embedding: Embedding | None = None,
        embedding_caches: Callable[[int], str] | None = None,
        draft_model: Path | None = None,
        max_model_len: int | None = None,
        cuda_graph_max_batch: int = 0,
        num_speculative_tokens: int = 0,
    ) -> None:
        model_dir = Path(model_dir)
        self.device = torch.device(device)
        if self.device.type == "cpu" and threads:
            torch.set_num_threads(threads)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: one of {sorted(DTYPES)} or 'auto'")
        self.dtype = DTYPES[dtype]
        self.block_size = block_size
        self.model_name = model_dir.name
        checkpoint = json.loads((model_dir / "config.json").read_text())
        raw = language_model_config(checkpoint)
        # Gemma 3's image tokens see each other both ways; other models' read causally.
        self.images_see_each_other = images_see_each_other(checkpoint)
        config = config_from_dir(model_dir)
        self.config = config
        # An embedding run (services/common/pooling.py): sampled rows return their pooled state.
        self.embedding = embedding
        if isinstance(config, BertConfig) and (embedding is None or parallel.is_parallel):
            raise ValueError(f"{self.model_name} is an encoder-only model: it embeds, on one rank")
        self.vocab_size = config.vocab_size
        # The longest sequence served: the engine's model.max_model_len, within the model's own.
        positions = config.max_position_embeddings
        self.max_model_len = min(positions, max_model_len or positions)
        self.eos_token_ids = _eos_token_ids(model_dir, raw)
        # LongRoPE: a sequence longer than this rotates with the long factors (the plan says which).
        self.parallel = parallel
        self.long_rope_from, self.sliding_window = 0, 0
        # M-RoPE (Qwen2.5-VL): the plan may give rope_deltas and image grids.
        self.has_mrope = not isinstance(config, BertConfig) and any(r.mrope_section for r in config.ropes)
        if isinstance(config, BertConfig):
            self.model: LlamaModel | BertEncoder = BertEncoder(config, self.dtype, self.device)
        else:
            self.long_rope_from = config.long_rope_from
            windows = config.layer_windows
            self.sliding_window = max(windows) if windows and min(windows) > 0 else 0
            self.model = LlamaModel(
                config,
                self.dtype,
                self.device,
                block_size,
                parallel,
                backend,
                int8_activations,
                wide_step_dtype,
                has_lm_head=embedding is None,
            )
        self.kv_dtype = self._kv_cache_dtype(kv_cache_dtype, config)  # refused before the weights load
        load_weights(self.model, model_dir)
        # The encoders' embedding caches by replica (Endpoints.embedding_cache), mapped when a
        # step first has an image of theirs; None: a run without encoders.
        self.embedding_cache_name = embedding_caches
        self.embedding_caches: dict[int, EmbeddingCache] = {}
        self.lora = self._load_adapters(max_loras, max_lora_rank, lora_adapters or {}, lora_dtype)
        self.num_lora_swaps = 0  # adapters copied from host memory into a slot, for a step
        # Copies into slots started ahead (a header's lora_prefetch), in flight while steps run:
        # slot -> its copy. On a GPU they run on their own stream.
        self.lora_copies: dict[int, Future[None]] = {}
        self.num_lora_prefetches = 0
        self._lora_copier = ThreadPoolExecutor(1, "lora-prefetch") if self.lora is not None else None
        # Adapters loaded at run time, read from disk and checked off the step loop (a large
        # adapter's read would stall every running request): name -> (source, load id, its read).
        self.lora_reads: dict[str, tuple[m.AdapterSource, int, Future[LoraAdapter | str]]] = {}
        self._lora_stream = (
            torch.cuda.Stream(self.device) if self.lora is not None and self.device.type == "cuda" else None
        )
        if int8_activations and not self.model.reads_gguf_blocks:
            log.warning(
                "engine.cpu_int8_activations: %s has no GGUF blocks the CPU kernels read; its activations stay float32",
                self.model_name,
            )
        # The draft model (speculative.method draft_model), loaded before the KV budget is read:
        # its weights count against it, and its cache takes the target's number of blocks.
        self.draft: DraftModel | None = None
        if draft_model is not None:
            if parallel.is_parallel:
                raise ValueError(
                    "speculative.method draft_model: the draft runs on one rank (engine.tensor_parallel 1)"
                )
            self.draft = DraftModel(
                draft_model, config, self.dtype, self.kv_dtype, self.device, block_size, backend
            )
            self.max_model_len = min(self.max_model_len, self.draft.config.max_position_embeddings)
        # An encoder keeps no KV cache, but the scheduler's blocks still bound what it admits: it
        # counts blocks as a decoder of its shape would.
        num_kv_heads = (
            config.num_key_value_heads if isinstance(config, BertConfig) else self.model.shapes.num_kv_heads
        )
        bytes_per_block = (
            config.num_hidden_layers
            * block_size
            * 2
            * num_kv_heads
            * config.head_dim
            * self.kv_dtype.itemsize
            if isinstance(config, BertConfig)
            else kv_bytes_per_block(config, num_kv_heads, block_size, self.kv_dtype)
        )
        if self.draft is not None:
            bytes_per_block += self.draft.bytes_per_block
        budget = self._kv_budget(kv_cache_bytes, gpu_memory_utilization)
        if self.draft is not None and budget < bytes_per_block:
            raise ValueError(
                f"speculative.model: the KV budget ({budget} bytes) holds no block of the target and "
                f"the draft ({bytes_per_block} bytes per block together)"
            )
        # Ranks share block ids, so every rank takes the smallest cache any of them can hold.
        self.num_kv_blocks = parallel.min_int(max(budget // bytes_per_block, 1))
        self.kv_cache = (
            []
            if isinstance(config, BertConfig)
            else paged_kv_cache(
                config, num_kv_heads, self.num_kv_blocks, block_size, self.kv_dtype, self.device
            )
        )
        if self.draft is not None:
            self.draft.allocate(self.num_kv_blocks)
        self.sampler = Sampler(self.vocab_size, self.device)
        # Placeholders: the token sampled last for each plan-table row (`rows` in the plan), kept
        # on the device so that filling one in never waits for it; only the driver samples.
        self.max_num_seqs = max_num_seqs
        # Proposals a decode may verify (speculative.num_speculative_tokens; 0 without
        # speculation): with the sequences, the most tokens of a step the CUDA graphs replay.
        self.num_speculative_tokens = num_speculative_tokens
        self._last_sampled = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        # Which step sampled each row last, at which position: known from the plans alone, on
        # every rank, so that every rank accepts or refuses a placeholder alike.
        self._sampled_step = np.full(max_num_seqs, -1, np.int64)
        self._sampled_position = np.full(max_num_seqs, -1, np.int64)
        self.decode_graphs = self._capture_decode_graphs(cuda_graph_max_batch)
        log.info(
            "model %s (%s on %s): %d KV blocks of %d tokens",
            self.model_name, dtype, self.device, self.num_kv_blocks, block_size,
        )  # fmt: skip

    def _capture_decode_graphs(self, max_batch: int) -> DecodeGraphs | None:
        """engine.cuda_graph_max_batch on a GPU: decode steps of up to that many sequences replay
        CUDA graphs (cuda_graphs.py). Where the model cannot, its steps run eagerly, with a warning
        that says why."""
        if max_batch == 0 or self.device.type != "cuda" or not isinstance(self.model, LlamaModel):
            return None
        if self.embedding is not None:
            return None  # its steps are prefills
        if self.draft is not None:
            reason = "the draft model runs in every step, beside the target's forward"
        else:
            reason = unsupported_reason(self.model)
        if reason is None:
            try:
                graphs = DecodeGraphs(
                    self.model, self.kv_cache,
                    # A row per token: a step of decodes and verifications holds at most 1 +
                    # num_speculative_tokens a sequence (1 without speculation: no graph that no
                    # step could fill, nor logits rows for them).
                    min(max_batch, self.max_num_seqs * (1 + self.num_speculative_tokens)),
                    -(-self.max_model_len // self.block_size), self.lora,
                )  # fmt: skip
            except RuntimeError as exc:  # a kernel that syncs with the host, say: eager it is
                reason = f"capture failed: {exc}"
            else:
                log.info(
                    "CUDA graphs of decode steps captured for batch sizes %s in %.1f s",
                    graphs.sizes, graphs.capture_s,
                )  # fmt: skip
                return graphs
        log.warning("engine.cuda_graph_max_batch=%d: decode steps run eagerly (%s)", max_batch, reason)
        return None

    def _load_adapters(
        self, max_loras: int, max_rank: int, adapters: dict[str, str], dtype: str
    ) -> LoraSlots | None:
        """The static adapters (lora.adapters), checked against the model before the worker serves
        anything and kept in host memory, the first `max_loras` also in slots in their order; None
        with max_loras 0 (adapters off)."""
        self.lora_host: dict[str, tuple[str, LoraAdapter]] = {}  # name -> (path, weights)
        if max_loras == 0:
            if adapters:
                raise ValueError("lora.adapters names adapters but lora.max_loras is 0 (adapters off)")
            return None
        slots = LoraSlots(self.model, max_loras, max_rank, self.dtype if dtype == "auto" else DTYPES[dtype])
        for name, path in adapters.items():
            self.lora_host[name] = (path, load_adapter(name, path, self.model, max_rank, slots.dtype))
        for slot, name in enumerate(list(self.lora_host)[:max_loras]):
            path, adapter = self.lora_host[name]
            slots.load(slot, adapter, path)
            log.info("LoRA adapter %s (%s) in slot %d", name, path, slot)
        return slots

    def load_lora(self, source: m.AdapterSource) -> str:
        """An adapter loaded at run time, read here and now (a worker's start, tests): see
        start_lora_load. The refusal's message, or "" when loaded."""
        if self.lora is None:
            return LORA_OFF
        return self._keep_lora(source, self._read_lora(source))

    def start_lora_load(self, source: m.AdapterSource, load_id: int = 0) -> None:
        """Start reading an adapter loaded at run time, on a thread of its own (a daemon: a read
        that hangs, a dead network mount, holds up neither later loads nor the worker's exit);
        finished_lora_loads answers it."""
        read: Future[LoraAdapter | str] = Future()
        if self.lora is None:
            read.set_result(LORA_OFF)
        else:
            threading.Thread(
                target=lambda: read.set_result(self._read_lora(source)), name="lora-read", daemon=True
            ).start()
        self.lora_reads[source.name] = (source, load_id, read)

    def finished_lora_loads(self) -> list[tuple[str, int, str]]:
        """(name, load id, refusal or "") of each started load whose read is over, the adapter
        now kept."""
        finished = []
        for name in [name for name, (*_, read) in self.lora_reads.items() if read.done()]:
            source, load_id, read = self.lora_reads.pop(name)
            finished.append((name, load_id, self._keep_lora(source, read.result())))
        return finished

    def _read_lora(self, source: m.AdapterSource) -> LoraAdapter | str:
        """The adapter from its files, checked against the model; or why it is refused."""
        assert self.lora is not None
        try:
            return load_adapter(source.name, source.path, self.model, self.lora.max_rank, self.lora.dtype)
        except AdapterError as exc:
            return str(exc)
        except Exception as exc:  # a file no check foresaw: this adapter is refused, the worker serves on
            log.exception("loading LoRA adapter %r failed", source.name)
            return f"adapter {source.name!r}: {type(exc).__name__}: {exc}"[:1000]

    def _keep_lora(self, source: m.AdapterSource, read: LoraAdapter | str) -> str:
        """Keep a read adapter in host memory until a step's header puts it in a slot."""
        if isinstance(read, str):
            return read
        assert self.lora is not None
        # An older adapter of this name (unloaded, no request uses it) must not pass for this one
        # in its slot: the slot is emptied, and the next header that names it copies this one in.
        self._finish_lora_copies(list(self.lora_copies))
        for slot, name in enumerate(self.lora.names):
            if name == source.name:
                self.lora.clear(slot)
        self.lora_host[source.name] = (source.path, read)
        log.info("LoRA adapter %s (%s) loaded", source.name, source.path)
        return ""

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`, and a load of it still being read (the scheduler gave up on it:
        it is not answered; its thread reads on, to no one). A slot that holds it keeps its
        weights until a header swaps another in: a step already published may still name it, for
        a row aborted since."""
        if self.lora_reads.pop(name, None) is not None:
            log.info("LoRA adapter %s: its load was dropped before it was answered", name)
        if self.lora_host.pop(name, None) is not None:
            log.info("LoRA adapter %s unloaded", name)

    def sync_loras(self, sources: list[m.AdapterSource]) -> None:
        """Hold exactly the adapters the scheduler lists (its hello echo): a restarted worker gets
        back the adapters loaded at run time. One that no longer loads (its files changed) is
        logged, and a step that needs it is refused (InvalidPlan)."""
        if self.lora is None:
            return
        wanted = {source.name: source for source in sources}
        for name in [name for name in self.lora_host if name not in wanted]:
            self.unload_lora(name)
        for source in sources:
            if self.lora_host.get(source.name, ("",))[0] != source.path:
                error = self.load_lora(source)
                if error:
                    log.error("LoRA adapter %s could not be loaded again: %s", source.name, error)

    def swap_loras(self, slot_names: list[str]) -> None:
        """Make each slot hold the adapter the step's header names for it, copied from host memory."""
        if not slot_names:
            return
        if self.lora is None or len(slot_names) != self.lora.max_loras:
            raise InvalidPlan(f"step header: lora_slots names {len(slot_names)} slots, the worker has "
                              f"{self.lora.max_loras if self.lora else 0}")  # fmt: skip
        self._finish_lora_copies([slot for slot, name in enumerate(slot_names) if name])
        for slot, name in enumerate(slot_names):
            if not name or self.lora.names[slot] == name:
                continue
            if name not in self.lora_host:
                raise InvalidPlan(f"step header: LoRA adapter {name!r} is not loaded in this worker")
            path, adapter = self.lora_host[name]
            self.lora.load(slot, adapter, path)
            self.num_lora_swaps += 1

    def prefetch_loras(self, slot_names: list[str]) -> None:
        """Start copying the adapters a header's lora_prefetch names into their slots, which no
        row of this step uses (validate checked): the copies run while the step does, and a later
        step whose lora_slots names such a slot waits for its copy only if it is still in flight.
        An adapter unloaded meanwhile is skipped: a header that needs it is refused as ever."""
        assert self.lora is not None and self._lora_copier is not None  # validate checked
        for slot, name in enumerate(slot_names):
            if not name or name not in self.lora_host:
                continue
            self._finish_lora_copies([slot])
            if self.lora.names[slot] == name:
                continue
            path, adapter = self.lora_host[name]
            if self._lora_stream is not None:  # the step's kernels before this header are done
                self._lora_stream.wait_stream(torch.cuda.current_stream(self.device))
            self.lora_copies[slot] = self._lora_copier.submit(self._copy_lora, slot, adapter, path)
            self.num_lora_prefetches += 1

    def _copy_lora(self, slot: int, adapter: LoraAdapter, path: str) -> None:
        """Put `adapter` into `slot`, on the copy thread (and its own stream on a GPU)."""
        assert self.lora is not None
        if self._lora_stream is None:
            self.lora.load(slot, adapter, path)
            return
        with torch.cuda.stream(self._lora_stream):
            self.lora.load(slot, adapter, path)
        self._lora_stream.synchronize()

    def _finish_lora_copies(self, slots: list[int]) -> None:
        """Wait for the copies in flight into `slots` (a failed copy raises here)."""
        for slot in slots:
            copy = self.lora_copies.pop(slot, None)
            if copy is not None:
                copy.result()

    def lora_batch(self, arrays: dict[str, np.ndarray], num_tokens: int, num_seqs: int) -> LoraBatch | None:
        """The step's adapters from the plan's lora_slots (one per row, -1 = none), or None."""
        if "lora_slots" not in arrays or self.lora is None:
            return None
        counts = np.diff(arrays["query_start_loc"][: num_seqs + 1])
        return self.lora.batch(np.repeat(arrays["lora_slots"][:num_seqs], counts)[:num_tokens])

    def _kv_cache_dtype(self, wanted: str, config: ModelConfig | BertConfig) -> torch.dtype:
        """engine.kv_cache_dtype: `auto` keeps the KV cache in the model's dtype; `bfloat16` under a
        float32 model on the CPU halves its bytes (twice the blocks in the same budget, half the
        bytes a decode step's attention reads), the keys and values rounded as they are stored."""
        if wanted == "auto" or DTYPES.get(wanted) == self.dtype:
            return self.dtype
        model_dtype = str(self.dtype).removeprefix("torch.")
        refused = f"engine.kv_cache_dtype {wanted!r} with a {model_dtype} model"
        if wanted != "bfloat16":
            raise ValueError(f"{refused}: expected auto or bfloat16")
        if self.dtype != torch.float32:
            raise ValueError(f"{refused}: only a float32 model's cache can be bfloat16; use auto")
        if isinstance(self.model, LlamaModel) and self.model.is_triton:
            raise ValueError(f"{refused}: the Triton backend keeps the cache in the model's dtype; use auto")
        if isinstance(config, ModelConfig) and config.mla is not None:
            raise ValueError(
                f"{refused}: latent attention (DeepSeek) keeps its caches in the model's dtype; use auto"
            )
        return torch.bfloat16

    def _kv_budget(self, kv_cache_bytes: int | None, gpu_memory_utilization: float) -> int:
        if kv_cache_bytes is not None:
            return kv_cache_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Whatever is in use now (weights, other processes) counts against the fraction.
            return max(int(total * gpu_memory_utilization) - (total - free), 0)
        return DEFAULT_CPU_KV_BYTES

    def validate(self, arrays: dict[str, np.ndarray], header: StepHeader) -> tuple[np.ndarray, np.ndarray]:
        """Raise InvalidPlan before anything runs if the plan would index out of bounds. Returns
        the plan's placeholders (`_placeholders`), checked, for execute to fill in."""
        t, s = header.num_tokens, header.num_seqs
        if t < 1 or s < 1:
            raise InvalidPlan(f"empty plan: {t} tokens, {s} sequences")
        try:
            STEP_PLAN.check(
                arrays,
                {
                    Dim.TOKENS: t,
                    Dim.ROWS: s,
                    Dim.VOCAB_WORDS: vocab_words(self.vocab_size),
                    Dim.IMAGE_KEY: IMAGE_KEY_BYTES,
                },
            )
        except SlotMismatch as exc:
            raise InvalidPlan(str(exc)) from None
        if "grammar_rows" in arrays or "grammar_bitmask" in arrays:
            _check_grammar(arrays, s, self.vocab_size)
        ids, positions, slots = arrays["input_ids"], arrays["positions"], arrays["slot_mapping"]
        qsl, seq_lens = arrays["query_start_loc"], arrays["seq_lens"]
        tables, rows = arrays["block_tables"], arrays["rows"]
        if rows.min() < 0 or rows.max() >= self.max_num_seqs:
            raise InvalidPlan(f"plan-table row out of range [0, {self.max_num_seqs})")
        is_drafted = ids == DRAFT_TOKEN
        if ids.max() >= self.vocab_size or ((ids < 0) & (ids != PLACEHOLDER_TOKEN) & ~is_drafted).any():
            raise InvalidPlan(f"token id out of range [0, {self.vocab_size})")
        if positions.min() < 0 or positions.max() >= self.max_model_len:
            raise InvalidPlan(f"position out of range [0, {self.max_model_len})")
        if slots.min() < -1 or slots.max() >= self.num_kv_blocks * self.block_size:
            raise InvalidPlan("slot_mapping refers to a KV slot outside the cache")
        if qsl[0] != 0 or qsl[-1] != t or (np.diff(qsl) < 1).any():
            raise InvalidPlan("query_start_loc is not increasing from 0 to num_tokens")
        needed = -(-seq_lens.astype(np.int64) // self.block_size)
        if (seq_lens < np.diff(qsl)).any() or needed.max() > tables.shape[1]:
            raise InvalidPlan("seq_lens do not fit the queries or the block tables")
        used = tables[np.arange(tables.shape[1])[None, :] < needed[:, None]]
        if used.min() < 0 or used.max() >= self.num_kv_blocks:
            raise InvalidPlan(f"block id out of range [0, {self.num_kv_blocks})")
        if "prompt_targets" in arrays or "num_prompt_logprobs" in arrays:
            _check_prompt_targets(arrays, self.vocab_size)
        if "lora_slots" in arrays:
            self._check_lora_slots(arrays["lora_slots"][:s])
        if header.lora_prefetch:
            self._check_lora_prefetch(header.lora_prefetch, arrays.get("lora_slots"), s)
        if any(name in arrays for name in IMAGE_ARRAYS):
            self._check_images(arrays, t, s)
        if "num_proposed" in arrays:
            _check_proposals(arrays, s)
        if is_drafted.any() or (self.draft is not None and "num_proposed" in arrays):
            self._check_drafted(arrays, is_drafted, t, s)
        if "rope_deltas" in arrays or "image_grid_widths" in arrays:
            self._check_mrope(arrays, t, s)
        if "long_rope" in arrays:
            if not self.long_rope_from:
                raise InvalidPlan("step plan: long_rope for a model without LongRoPE")
            if arrays["long_rope"].max() > 1:
                raise InvalidPlan("step plan: long_rope is not 0 or 1")
        history = arrays["history_ids"]
        if len(history) and (history.min() < 0 or history.max() >= self.vocab_size):
            # The scheduler never plans ahead a sequence that needs its history (no placeholder).
            raise InvalidPlan(f"penalty history id out of range [0, {self.vocab_size})")
        at, table_rows = _placeholders(arrays, t, s)
        # Its row sampled exactly this position in the step just before: nothing else fills it.
        is_known = (self._sampled_step[table_rows] == header.step_id - 1) & (
            self._sampled_position[table_rows] == positions[at]
        )
        if not is_known.all():
            raise InvalidPlan("placeholder token where this row sampled no token in the previous step")
        return at, table_rows

    def _check_drafted(self, arrays: dict[str, np.ndarray], is_drafted: np.ndarray, t: int, s: int) -> None:
        """A worker with a draft model drafts every proposal (DRAFT_TOKEN at each, and nowhere
        else); one without is never asked to."""
        if self.draft is None:
            raise InvalidPlan("step plan: a token to draft, for a worker without a draft model")
        if "num_proposed" not in arrays or not np.array_equal(
            is_drafted, proposal_mask(arrays["query_start_loc"][: s + 1], arrays["num_proposed"][:s], t)
        ):
            raise InvalidPlan("step plan: the tokens to draft are not exactly the rows' proposals")

    def execute(self, arrays: dict[str, np.ndarray], header: StepHeader) -> dict[str, np.ndarray]:
        """Run one step plan; returns the result arrays (ipc/step_plan.py STEP_RESULT)."""
        self.swap_loras(header.lora_slots)
        at, table_rows = self.validate(arrays, header)
        if header.lora_prefetch:
            self.prefetch_loras(header.lora_prefetch)
        t, s, k = header.num_tokens, header.num_seqs, header.max_top_logprobs
        if self.embedding is not None:
            return self._embed(arrays, t, s, k)
        rows = np.flatnonzero(arrays["is_sampled"][:s])
        num_proposed = arrays.get("num_proposed")
        if num_proposed is None:
            verifying = rows[:0]
        else:
            is_verifying = num_proposed[rows] > 0
            verifying, rows = rows[is_verifying], rows[~is_verifying]
        # Rows that sample nothing keep the neutral values: id -1, no top logprobs.
        result = STEP_RESULT.neutral({Dim.ROWS: s, Dim.TOP_K: k})
        lora = self.lora_batch(arrays, t, s)
        if self._replays_graph(arrays, t, s, lora, num_proposed):
            input_ids = self.decode_graphs.load(arrays, t, s, lora)
            if len(at):
                self._fill_placeholders(input_ids, at, table_rows)
            token_logits = self.decode_graphs.replay(t, with_lora=lora is not None)
            logits = token_logits[self._to_device(arrays["query_start_loc"][rows + 1] - 1)]

            def logits_at(tokens: torch.Tensor) -> torch.Tensor:
                return token_logits[tokens]

            if self.decode_graphs.num_replays == 1:
                log.info("the first decode step replayed from a CUDA graph (%d sequences)", s)
        else:
            logits, hidden, residual, arrays = self._eager_forward(arrays, t, s, at, table_rows, rows, lora)
            logits_at = partial(self.model.logits, hidden, residual)
            if "prompt_targets" in arrays:  # every rank: the LM head gathers over them
                result.update(self._score_prompt(hidden, residual, arrays, s))
        if num_proposed is not None:  # every rank: the LM head gathers over the verified positions
            result.update(self._verify(logits_at, arrays, verifying, k, header.step_id))
        sampled_table_rows = arrays["rows"][rows]
        self._sampled_step[sampled_table_rows] = header.step_id
        self._sampled_position[sampled_table_rows] = arrays["sample_positions"][rows]
        if len(rows) == 0 or not self.parallel.is_driver:
            return result
        sampled = self.sampler.sample(logits, arrays, rows)
        self._last_sampled[self._to_device(sampled_table_rows)] = sampled.sampled_ids.long()
        out = sampled.numpy()
        result["sampled_ids"][rows] = out["sampled_ids"]
        result["sampled_logprobs"][rows] = out["sampled_logprobs"]
        n = min(k, out["top_ids"].shape[1])
        result["top_ids"][rows, :n] = out["top_ids"][:, :n]
        result["top_logprobs"][rows, :n] = out["top_logprobs"][:, :n]
        if num_proposed is not None:  # an ordinary sampled row emits its one token
            result["emitted_ids"][rows, 0] = out["sampled_ids"]
            result["emitted_logprobs"][rows, 0] = out["sampled_logprobs"]
            result["num_emitted"][rows] = 1
        return result

    def _replays_graph(
        self,
        arrays: dict[str, np.ndarray],
        t: int,
        s: int,
        lora: LoraBatch | None,
        num_proposed: np.ndarray | None,
    ) -> bool:
        """A step of decodes and verifications that fits a captured CUDA graph, a row per token
        (cuda_graphs.py), with nothing the graphs leave out (adapters only where they were
        captured with them). A prefill chunk runs eagerly: as rows of one token each of its
        tokens would read the whole context once."""
        tokens_per_seq = 1 if num_proposed is None else 1 + num_proposed[:s].astype(np.int64)
        return (
            self.decode_graphs is not None
            and self.decode_graphs.fits(arrays, t)
            and np.array_equal(
                np.diff(arrays["query_start_loc"][: s + 1]), np.broadcast_to(tokens_per_seq, s)
            )
            and (lora is None or self.decode_graphs.lora is not None)
            and not self.has_mrope
            and "prompt_targets" not in arrays
            and "image_starts" not in arrays
        )

    def _eager_forward(
        self,
        arrays: dict[str, np.ndarray],
        t: int,
        s: int,
        at: np.ndarray,
        table_rows: np.ndarray,
        rows: np.ndarray,
        lora: LoraBatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, np.ndarray]]:
        """The step's forward launched op by op: the logits of its sampling rows, the last
        layer's hidden states and residual (prompt scoring and verification read them), and the
        plan's arrays with a draft's proposals in (verification reads them on the host)."""
        causal_images = "image_groups" in arrays and not self.images_see_each_other
        # M-RoPE's positions read the images' token groups, which causal images' attention drops.
        rope_positions = mrope_positions(arrays, t, s) if self.has_mrope else None
        metas = self.model.prepare(
            {k: v for k, v in arrays.items() if k != "image_groups"} if causal_images else arrays,
            t,
            s,
            rope_positions,
        )
        input_ids = torch.from_numpy(arrays["input_ids"][:t].astype(np.int64)).to(self.device)
        if len(at):
            self._fill_placeholders(input_ids, at, table_rows)
        if self.draft is not None:
            self.draft.draft(input_ids, arrays, t, s)
            # Verification reads the proposals on the host (acceptance, penalty histories).
            drafted = np.flatnonzero(arrays["input_ids"][:t] == DRAFT_TOKEN)
            if len(drafted):
                host_ids = arrays["input_ids"].copy()
                host_ids[drafted] = input_ids[self._to_device(drafted)].cpu().numpy()
                arrays = {**arrays, "input_ids": host_ids}
        sample_tokens = torch.from_numpy(arrays["query_start_loc"][rows + 1].astype(np.int64) - 1)
        images = self._image_rows(arrays, t) if "image_starts" in arrays else None
        hidden, residual = self.model.hidden_states(input_ids, metas, self.kv_cache, lora, images)
        logits = self.model.logits(hidden, residual, sample_tokens.to(self.device))
        return logits, hidden, residual, arrays

    def _check_images(self, arrays: dict[str, np.ndarray], num_tokens: int, num_seqs: int) -> None:
        """The image arrays come together, on a run with encoders, each image's tokens one run in
        one sequence of the step, from its start (the attention kernels' masks read them so)."""
        missing = [name for name in IMAGE_ARRAYS if name not in arrays]
        if missing:
            raise InvalidPlan(f"step plan: image arrays without {missing}")
        if self.embedding_cache_name is None:
            raise InvalidPlan("step plan: images for a worker that reads no encoders' caches")
        starts = arrays["image_starts"].astype(np.int64)
        if len(starts) and (starts.min() < 0 or starts.max() >= num_tokens):
            raise InvalidPlan(f"step plan: an image starts outside the step's {num_tokens} tokens")
        groups = arrays["image_groups"]  # [T]: its shape checked with the plan's
        tokens = np.flatnonzero(groups >= 0)
        images = groups[tokens].astype(np.int64)
        if len(images) and images.max() >= len(starts):
            raise InvalidPlan("step plan: an image group without its image_starts entry")
        sizes = np.bincount(images, minlength=len(starts))
        offsets = tokens - starts[images]
        if (offsets < 0).any() or (offsets >= sizes[images]).any():
            raise InvalidPlan("step plan: an image's tokens are not one run from its image_starts entry")
        query_start_loc = arrays["query_start_loc"][: num_seqs + 1]
        first_seq = np.searchsorted(query_start_loc, starts, side="right")
        last_seq = np.searchsorted(query_start_loc, starts + np.maximum(sizes, 1) - 1, side="right")
        if (first_seq != last_seq).any():
            raise InvalidPlan("step plan: an image's tokens span two sequences")
        if (arrays["image_encoders"] < 0).any() or (arrays["image_slots"] < 0).any():
            raise InvalidPlan("step plan: a negative image encoder or slot")

    def _check_mrope(self, arrays: dict[str, np.ndarray], num_tokens: int, num_seqs: int) -> None:
        """M-RoPE's arrays on a model with M-RoPE; each image grid's width divides its tokens, and
        every rotary position they give lies in [0, max_model_len)."""
        if not self.has_mrope:
            raise InvalidPlan("step plan: rope_deltas or image_grid_widths for a model without M-RoPE")
        widths = arrays.get("image_grid_widths")
        if widths is not None:
            if "image_groups" not in arrays:
                raise InvalidPlan("step plan: image_grid_widths without the image arrays")
            groups = arrays["image_groups"]
            sizes = np.bincount(groups[groups >= 0], minlength=len(widths))
            if (
                len(sizes) != len(widths)
                or (widths < 0).any()
                or (sizes % np.maximum(widths, 1))[widths > 0].any()
            ):
                raise InvalidPlan("step plan: an image grid width that does not divide its image's tokens")
        positions = mrope_positions(arrays, num_tokens, num_seqs)
        assert positions is not None  # one of its arrays is there
        if positions.min() < 0 or positions.max() >= self.max_model_len:
            raise InvalidPlan(f"step plan: an M-RoPE position out of range [0, {self.max_model_len})")

    def _image_rows(self, arrays: dict[str, np.ndarray], num_tokens: int) -> ImageRows:
        """The step's images' embeddings, read from their encoders' caches. One no longer there
        (evicted since it was planned) fails the step naming it (InvalidPlan): its request must
        ask its encoder again."""
        assert self.embedding_cache_name is not None  # _check_images
        tokens, rows = [], []
        for i, (start, encoder, slot, sequence, key) in enumerate(
            zip(
                arrays["image_starts"].tolist(), arrays["image_encoders"].tolist(), arrays["image_slots"].tolist(),
                arrays["image_sequences"].tolist(), arrays["image_keys"], strict=True,
            )
        ):  # fmt: skip
            cache = self.embedding_caches.get(encoder)
            if cache is None:
                try:
                    cache = EmbeddingCache.attach(self.embedding_cache_name(encoder))
                except (OSError, ValueError) as exc:
                    raise InvalidPlan(f"step plan: image {i}: encoder {encoder}'s cache: {exc}") from None
                self.embedding_caches[encoder] = cache
            if not 0 <= slot < cache.num_pages:
                raise InvalidPlan(f"step plan: image {i}: page {slot} is not in encoder {encoder}'s cache")
            embeddings = cache.read(SlotRef(slot, sequence), key.tobytes())
            if embeddings is None:
                raise InvalidPlan(
                    f"step plan: image {i}: its {m.EVICTED_EMBEDDINGS} encoder {encoder}'s cache"
                )
            if start + len(embeddings) > num_tokens:
                raise InvalidPlan(f"step plan: image {i}'s {len(embeddings)} tokens run past the step's end")
            tokens.append(np.arange(start, start + len(embeddings)))
            rows.append(embeddings)
        return ImageRows(
            torch.from_numpy(np.concatenate(tokens)).to(self.device),
            torch.from_numpy(np.concatenate(rows)),
        )

    def _embed(
        self, arrays: dict[str, np.ndarray], num_tokens: int, num_seqs: int, top_k: int
    ) -> dict[str, np.ndarray]:
        """An embedding step: each sampled row (an input whose last token is in this step) gets
        its pooled final token states in `pooled`, and samples nothing (id 0, the request ends).
        The scheduler plans each input whole in one step (never ahead, so no placeholders)."""
        assert self.embedding is not None
        qsl = arrays["query_start_loc"][: num_seqs + 1].astype(np.int64)
        rows = np.flatnonzero(arrays["is_sampled"][:num_seqs])
        starts = qsl[rows]
        if (arrays["positions"][starts] != 0).any():
            raise InvalidPlan(
                "step plan: an embedding row's input must come whole in one step (position 0 on)"
            )
        input_ids = torch.from_numpy(arrays["input_ids"][:num_tokens].astype(np.int64)).to(self.device)
        if isinstance(self.model, BertEncoder):
            positions = torch.from_numpy(arrays["positions"][:num_tokens].astype(np.int64)).to(self.device)
            states = self.model.forward(input_ids, positions, qsl)
        else:
            metas = self.model.prepare(arrays, num_tokens, num_seqs)
            hidden, residual = self.model.hidden_states(
                input_ids, metas, self.kv_cache, self.lora_batch(arrays, num_tokens, num_seqs)
            )
            states = self.model.final_states(hidden, residual)
        result = STEP_RESULT.neutral({Dim.ROWS: num_seqs, Dim.TOP_K: top_k})
        pooled = np.zeros((num_seqs, self.config.hidden_size), np.float32)
        pooling = self.embedding.pooling
        for i, start, end in zip(rows.tolist(), starts.tolist(), qsl[rows + 1].tolist(), strict=True):
            span = states[start:end]
            vector = span[-1] if pooling == "last" else span[0] if pooling == "cls" else span.mean(dim=0)
            pooled[i] = vector.float().cpu().numpy()
        result["pooled"] = pooled
        result["sampled_ids"][rows] = 0
        return result

    def _check_lora_slots(self, lora_slots: np.ndarray) -> None:
        """Each row's slot is -1 (no adapter) or a slot that holds one."""
        used = np.unique(lora_slots[lora_slots != -1]).tolist()
        if not used:
            return
        if self.lora is None:
            raise InvalidPlan("step plan: lora_slots for a worker without adapters (lora.max_loras 0)")
        empty = [
            slot
            for slot in used
            if not 0 <= slot < self.lora.max_loras
            or self.lora.names[slot] is None
            or slot in self.lora_copies
        ]
        if empty:
            raise InvalidPlan(f"step plan: lora_slots names slot {empty[0]}, which holds no adapter")

    def _check_lora_prefetch(self, prefetch: list[str], lora_slots: np.ndarray | None, num_seqs: int) -> None:
        """lora_prefetch names one adapter or "" per slot, and no slot a row of this step uses
        (its copy would change the adapter under the row)."""
        if self.lora is None or len(prefetch) != self.lora.max_loras:
            raise InvalidPlan(f"step header: lora_prefetch names {len(prefetch)} slots, the worker has "
                              f"{self.lora.max_loras if self.lora else 0}")  # fmt: skip
        used = set() if lora_slots is None else set(np.unique(lora_slots[:num_seqs]).tolist())
        clash = [slot for slot, name in enumerate(prefetch) if name and slot in used]
        if clash:
            raise InvalidPlan(
                f"step header: lora_prefetch copies into slot {clash[0]}, which a row of the step uses"
            )

    def _verify(
        self,
        logits_at: Callable[[torch.Tensor], torch.Tensor],
        arrays: dict[str, np.ndarray],
        verifying: np.ndarray,
        max_top_logprobs: int,
        step_id: int,
    ) -> dict[str, np.ndarray]:
        """Verification of the `verifying` rows' proposals (services/gpu_worker/speculation.py):
        the emitted_* result arrays, with each verifying row's last new token in sampled_ids.
        `logits_at(tokens)` gives the float32 logits at the step's token indices `tokens`.
        The logits are all-gathered and the sampler's draws depend only on them, the seed and the
        position, so every rank computes the same acceptance and knows where each row's last new
        token sits (what a placeholder in the next step is checked against)."""
        num_seqs = len(arrays["rows"])
        proposed = arrays["num_proposed"]
        width = 1 + int(proposed.max(initial=0))
        out = {
            "emitted_ids": np.full((num_seqs, width), -1, np.int32),
            "emitted_logprobs": np.zeros((num_seqs, width), np.float32),
            "num_emitted": np.zeros(num_seqs, np.int32),
            "emitted_top_ids": np.full((num_seqs, width, max_top_logprobs), -1, np.int32),
            "emitted_top_logprobs": np.full((num_seqs, width, max_top_logprobs), -np.inf, np.float32),
            "sampled_ids": np.full(num_seqs, -1, np.int32),
            "sampled_logprobs": np.zeros(num_seqs, np.float32),
        }
        if len(verifying) == 0:
            return {name: out[name] for name in EMITTED_ARRAYS}
        ends = arrays["query_start_loc"][verifying + 1].astype(np.int64)
        counts = proposed[verifying].astype(np.int64) + 1  # the last known token and each proposal
        firsts = ends - counts
        at = np.concatenate([np.arange(f, e) for f, e in zip(firsts.tolist(), ends.tolist(), strict=True)])
        logits = logits_at(self._to_device(at))
        targets = target_tokens(self.sampler, logits, arrays, verifying)
        target_logprobs = targets.sampled_logprobs.cpu().numpy()
        targets_host = targets.sampled_ids.cpu().numpy()
        top = targets.numpy() if max_top_logprobs else None
        k = min(max_top_logprobs, top["top_ids"].shape[1]) if top is not None else 0
        input_ids = arrays["input_ids"]
        lasts = np.empty(len(verifying), np.int64)
        offset = 0
        for j, (i, first, count) in enumerate(
            zip(verifying.tolist(), firsts.tolist(), counts.tolist(), strict=True)
        ):
            row_targets = targets_host[offset : offset + count]
            new = emitted_tokens(row_targets, input_ids[first + 1 : first + count])
            n = len(new)
            out["emitted_ids"][i, :n] = new
            out["emitted_logprobs"][i, :n] = target_logprobs[offset : offset + n]
            out["num_emitted"][i] = n
            if top is not None:
                out["emitted_top_ids"][i, :n, :k] = top["top_ids"][offset : offset + n, :k]
                out["emitted_top_logprobs"][i, :n, :k] = top["top_logprobs"][offset : offset + n, :k]
            out["sampled_ids"][i] = new[-1]
            out["sampled_logprobs"][i] = target_logprobs[offset + n - 1]
            lasts[j] = offset + n - 1
            offset += count
        table_rows = arrays["rows"][verifying]
        self._sampled_step[table_rows] = step_id
        # The last new token goes where the first rejected proposal (or the next token) went.
        self._sampled_position[table_rows] = (
            arrays["seq_lens"][verifying] - proposed[verifying] + out["num_emitted"][verifying] - 1
        )
        if self.parallel.is_driver:
            self._last_sampled[self._to_device(table_rows)] = targets.sampled_ids[
                self._to_device(lasts)
            ].long()
        return out

    def _score_prompt(
        self, hidden: torch.Tensor, residual: torch.Tensor, arrays: dict[str, np.ndarray], num_seqs: int
    ) -> dict[str, np.ndarray]:
        """Prompt logprobs (the result arrays of the same name): at each token with a prompt
        target, the target's logprob and rank and the top-N, N the largest its rows asked. Only
        these tokens' logits are computed, PROMPT_SCORE_ROWS at a time, so a long prompt chunk
        never holds [tokens, vocab] logits at once."""
        targets = arrays["prompt_targets"]
        at = np.flatnonzero(targets >= 0)
        seqs = np.searchsorted(arrays["query_start_loc"][: num_seqs + 1], at, side="right") - 1
        k = int(arrays["num_prompt_logprobs"][:num_seqs][seqs].max()) if len(at) else 0
        out = {
            "prompt_logprobs": np.zeros(len(at), np.float32),
            "prompt_ranks": np.zeros(len(at), np.int32),
            "prompt_top_ids": np.full((len(at), k), -1, np.int32),
            "prompt_top_logprobs": np.full((len(at), k), -np.inf, np.float32),
        }
        for lo in range(0, len(at), PROMPT_SCORE_ROWS):
            index = at[lo : lo + PROMPT_SCORE_ROWS]
            logits = self.model.logits(hidden, residual, self._to_device(index)).float()
            log_norms = logsumexp_argmax(logits)[0]
            target = self._to_device(targets[index])
            chosen = logits.gather(1, target[:, None])
            span = slice(lo, lo + len(index))
            out["prompt_logprobs"][span] = (chosen[:, 0] - log_norms).cpu().numpy()
            out["prompt_ranks"][span] = ((logits > chosen).sum(dim=-1) + 1).cpu().numpy()
            if k:
                top_logits, top_ids = torch.topk(logits, k, dim=-1)
                out["prompt_top_ids"][span] = top_ids.cpu().numpy()
                out["prompt_top_logprobs"][span] = (top_logits - log_norms[:, None]).cpu().numpy()
        return out

    def _fill_placeholders(self, input_ids: torch.Tensor, at: np.ndarray, table_rows: np.ndarray) -> None:
        """Put the token each plan-table row sampled in the previous step at the flat indices `at`
        (validated). The driver has them; it hands them to the other ranks, so every rank runs
        the same ids."""
        if self.parallel.is_driver:
            tokens = self._last_sampled[self._to_device(table_rows)]
        else:
            tokens = torch.empty(len(at), dtype=torch.int64, device=self.device)
        input_ids[self._to_device(at)] = self.parallel.broadcast_from_driver(tokens)

    def _to_device(self, index: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(index.astype(np.int64)).to(self.device, non_blocking=True)


def _check_grammar(arrays: dict[str, np.ndarray], num_seqs: int, vocab_size: int) -> None:
    """The grammar arrays come together, and name rows that sample, in order: each once, but a
    row that verifies proposals once per verified position (1 + num_proposed times in a row)."""
    if "grammar_rows" not in arrays or "grammar_bitmask" not in arrays:
        raise InvalidPlan("step plan: grammar_rows and grammar_bitmask must come together")
    grammar_rows = arrays["grammar_rows"]
    try:
        check_grammar_bitmask(arrays["grammar_bitmask"], grammar_rows, num_seqs, vocab_size, distinct=False)
    except ValueError as exc:
        raise InvalidPlan(f"step plan: {exc}") from None
    if not len(grammar_rows):
        return
    if not arrays["is_sampled"][grammar_rows].all():
        raise InvalidPlan("step plan: grammar_rows names a row that samples nothing")
    named, counts = np.unique(grammar_rows, return_counts=True)
    proposed = arrays.get("num_proposed")
    wanted = 1 + proposed[named] if proposed is not None else np.ones_like(counts)
    if (np.diff(grammar_rows) < 0).any() or (counts != wanted).any():
        raise InvalidPlan("step plan: grammar_rows must name each row in order, once per position it samples")


def _check_prompt_targets(arrays: dict[str, np.ndarray], vocab_size: int) -> None:
    """The prompt-logprob arrays come together, with token ids and top-N counts in range."""
    if "prompt_targets" not in arrays or "num_prompt_logprobs" not in arrays:
        raise InvalidPlan("step plan: prompt_targets and num_prompt_logprobs must come together")
    targets, top_n = arrays["prompt_targets"], arrays["num_prompt_logprobs"]
    if len(targets) and (targets.min() < -1 or targets.max() >= vocab_size):
        raise InvalidPlan(f"step plan: prompt_targets out of range [-1, {vocab_size})")
    if top_n.min() < 0 or top_n.max() > MAX_LOGPROBS:
        raise InvalidPlan(f"step plan: num_prompt_logprobs out of range [0, {MAX_LOGPROBS}]")


def _check_proposals(arrays: dict[str, np.ndarray], num_seqs: int) -> None:
    """Rows with proposals sample and hold their last known token before them."""
    proposed = arrays["num_proposed"][:num_seqs]
    if proposed.min() < 0 or proposed.max() > MAX_SPECULATIVE_TOKENS:
        raise InvalidPlan(f"step plan: num_proposed out of range [0, {MAX_SPECULATIVE_TOKENS}]")
    verifying = np.flatnonzero(proposed)
    if not len(verifying):
        return
    qsl = arrays["query_start_loc"]
    if (np.diff(qsl)[verifying] < proposed[verifying] + 1).any():
        raise InvalidPlan("step plan: a row's proposals leave no room for its last known token")
    if not arrays["is_sampled"][verifying].all():
        raise InvalidPlan("step plan: proposals on a row that samples nothing")
    ends = qsl[verifying + 1].astype(np.int64)
    proposals = np.concatenate(
        [
            arrays["input_ids"][e - d : e]
            for e, d in zip(ends.tolist(), proposed[verifying].tolist(), strict=True)
        ]
    )
    if (proposals == PLACEHOLDER_TOKEN).any():
        raise InvalidPlan("step plan: a proposed token is a placeholder")


def _placeholders(arrays: dict[str, np.ndarray], t: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of a plan's placeholder tokens, and the plan-table row of the sequence of each."""
    at = np.flatnonzero(arrays["input_ids"][:t] == PLACEHOLDER_TOKEN)
    seqs = np.searchsorted(arrays["query_start_loc"][: s + 1], at, side="right") - 1
    return at, arrays["rows"][:s][seqs]


def _eos_token_ids(model_dir: Path, config: dict) -> list[int]:
    """eos ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids: list[int] = []
    sources = [config]
    generation = model_dir / "generation_config.json"
    if generation.exists():
        sources.append(json.loads(generation.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids
