"""The step plan (scheduler -> workers) and the step result (worker rank 0 -> scheduler), declared
once: every array a ring slot carries, its dtype, its shape in named dimensions, and whether it
is always there.

Everyone reads the same declaration: the scheduler writes plans through it
(services/scheduler/plan.py `write_plan`), the worker refuses a plan that does not match it before
anything runs (services/gpu_worker/model_runner.py `ModelRunner.validate`), the scheduler refuses
a result that does not match it (services/scheduler/pipeline.py `RingExecutor`), the supervisor
sizes the ring slots from it (`SlotSpec.slot_bytes`), and tests build plans from it
(`SlotSpec.neutral`). docs/internals.md explains what each array means.

A dimension's size comes from the slot header (tokens, rows, top-K), from another array's shape
(the block-table width), or from the last entry of an offsets array (the ragged spans). A new
array is one `ArraySpec` line; one that only some steps carry is declared `optional`: the grammar
bitmask of structured output (docs/structured_output.md) is there only when some sampled row is
constrained, and has a row only for those (`Dim.CONSTRAINED`), so other rows and steps pay nothing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ipc.config import MAX_SPECULATIVE_TOKENS
from ipc.shm import ALIGN
from ipc.validation import MAX_BAD_WORDS_IDS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

IMAGE_KEY_BYTES = 16  # ipc/embedding_cache.py KEY_BYTES (that module maps shared memory: not imported here)


class Dim(enum.Enum):
    """The dimensions that array shapes are given in."""

    TOKENS = "tokens"  # the step's flat batch of new tokens (header num_tokens)
    ROWS = "rows"  # the step's sequences (header num_seqs)
    ROW_OFFSETS = "rows+1"  # offsets: where each row's span starts, and where the last one ends
    BLOCKS = "blocks"  # the block-table width: blocks of the step's longest sequence
    HISTORY = "history"  # penalty-history ids of all rows together (history_offsets[-1])
    BIAS = "bias"  # logit-bias entries of all rows together (bias_offsets[-1])
    TOP_K = "top_k"  # top logprobs per row (header max_top_logprobs)
    VOCAB_WORDS = "vocab_words"  # 32-bit words of a bitmask over the vocabulary
    CONSTRAINED = "constrained"  # the step's sampled rows under a grammar (grammar_rows)
    SCORED = "scored"  # the step's prompt positions whose next prompt token is scored (prompt logprobs)
    PROMPT_TOP_K = "prompt_top_k"  # top logprobs per scored prompt position
    EMITTED = "emitted"  # new tokens per row of a step that verifies proposals (1 + the most proposed)
    HIDDEN = "hidden"  # an embedding model's pooled vector width (its hidden size)
    IMAGES = "images"  # the step's images (image_starts), each whole in its row's chunk
    IMAGE_KEY = "image_key"  # bytes of an image's content key (ipc/embedding_cache.py KEY_BYTES)


class SlotSink(Protocol):
    """Where `SlotSpec.write` puts arrays: a ring slot (ipc/shm.py `SlotWriter`) or a test's dict."""

    def put(self, name: str, array: np.ndarray) -> None: ...

    def alloc(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A writable array in the slot, to fill in place (the grammar bitmask)."""
        ...


class SlotMismatch(ValueError):
    """A slot's arrays do not match their declaration; the message names the array."""


@dataclass(frozen=True, slots=True)
class ArraySpec:
    name: str
    dtype: np.dtype
    shape: tuple[Dim, ...]
    fill: float = 0  # the neutral value (sampling option off), for `SlotSpec.neutral`
    optional: bool = False  # only the steps that need it carry it

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))


@dataclass(frozen=True)
class SlotSpec:
    """The arrays of one kind of slot, in the order they are written."""

    kind: str  # "step plan" or "step result", for messages
    arrays: tuple[ArraySpec, ...]
    # Dimensions read from an array's shape: the dimension -> (array, axis).
    measured: Mapping[Dim, tuple[str, int]] = field(default_factory=dict)
    # Ragged dimensions: the dimension -> the offsets array whose last entry is its size.
    ragged: Mapping[Dim, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {spec.name: spec for spec in self.arrays})
        object.__setattr__(self, "names", tuple(spec.name for spec in self.arrays))
        object.__setattr__(self, "required", tuple(spec.name for spec in self.arrays if not spec.optional))
        object.__setattr__(self, "optional", tuple(spec.name for spec in self.arrays if spec.optional))

    def write(self, slot: SlotSink, arrays: Mapping[str, np.ndarray]) -> None:
        """Put `arrays` into a slot in declared order; SlotMismatch for a missing or unknown array.
        Dtypes and shapes are the reader's to check (`check`): this runs on every step."""
        required: tuple[str, ...] = self.required  # type: ignore[attr-defined]
        try:
            for name in required:
                slot.put(name, arrays[name])
        except KeyError as exc:
            raise SlotMismatch(f"{self.kind}: array {exc.args[0]!r} is missing") from None
        num_written = len(required)
        for name in self.optional:  # type: ignore[attr-defined]
            if name in arrays:
                slot.put(name, arrays[name])
                num_written += 1
        if num_written != len(arrays):
            unknown = sorted(set(arrays) - set(self.names))  # type: ignore[attr-defined]
            raise SlotMismatch(f"{self.kind}: unknown arrays {unknown}")

    def check(self, arrays: Mapping[str, np.ndarray], sizes: Mapping[Dim, int]) -> dict[Dim, int]:
        """Raise SlotMismatch unless `arrays` are exactly the declared ones, with their dtypes and
        shapes for the header's `sizes`; returns every dimension's size."""
        by_name: dict[str, ArraySpec] = self.by_name  # type: ignore[attr-defined]
        for spec in self.arrays:
            if spec.name not in arrays and not spec.optional:
                raise SlotMismatch(f"{self.kind}: array {spec.name!r} is missing")
        for name, array in arrays.items():
            spec = by_name.get(name)
            if spec is None:
                raise SlotMismatch(f"{self.kind}: unknown array {name!r}")
            if array.dtype != spec.dtype:
                raise SlotMismatch(f"{self.kind}: array {name!r} is {array.dtype}, expected {spec.dtype}")
        full = dict(sizes)
        if Dim.ROWS in full:
            full[Dim.ROW_OFFSETS] = full[Dim.ROWS] + 1
        for dim, (name, axis) in self.measured.items():
            if name in arrays:
                self._check_ndim(name, arrays[name])
                full[dim] = arrays[name].shape[axis]
        for dim, name in self.ragged.items():
            offsets = arrays[name]
            self._check_shape(name, offsets, full)
            full[dim] = int(offsets[-1]) if len(offsets) else 0
        for name, array in arrays.items():
            self._check_shape(name, array, full)
        return full

    def _check_ndim(self, name: str, array: np.ndarray) -> None:
        spec: ArraySpec = self.by_name[name]  # type: ignore[attr-defined]
        if array.ndim != len(spec.shape):
            raise SlotMismatch(
                f"{self.kind}: array {name!r} has {array.ndim} dimensions, expected {len(spec.shape)}"
            )

    def _check_shape(self, name: str, array: np.ndarray, sizes: Mapping[Dim, int]) -> None:
        spec: ArraySpec = self.by_name[name]  # type: ignore[attr-defined]
        expected = tuple(sizes[d] for d in spec.shape)
        if array.shape != expected:
            dims = ", ".join(d.value for d in spec.shape)
            raise SlotMismatch(
                f"{self.kind}: array {name!r} has shape {array.shape}, expected {expected} ({dims})"
            )

    def slot_bytes(self, limits: Mapping[Dim, int]) -> int:
        """Bytes of a slot that holds every array at the `limits` of its dimensions (every
        dimension any array uses must be given), each aligned, plus its directory and header."""
        full = dict(limits)
        if Dim.ROWS in full:
            full[Dim.ROW_OFFSETS] = full[Dim.ROWS] + 1
        total = HEADER_BYTES
        for spec in self.arrays:
            nbytes = spec.dtype.itemsize * math.prod(full[d] for d in spec.shape)
            total += -(-nbytes // ALIGN) * ALIGN + ALIGN + DIRECTORY_BYTES_PER_ARRAY
        return total

    def neutral(self, sizes: Mapping[Dim, int], **arrays: np.ndarray) -> dict[str, np.ndarray]:
        """A slot's arrays for these sizes: the given ones (cast to their dtype), and every other
        required array filled with its neutral value, in declared order. Measured and ragged
        dimensions not in `sizes` come from the given arrays (no offsets given: empty spans)."""
        by_name: dict[str, ArraySpec] = self.by_name  # type: ignore[attr-defined]
        unknown = sorted(set(arrays) - set(by_name))
        if unknown:
            raise SlotMismatch(f"{self.kind}: unknown arrays {unknown}")
        given = {name: np.asarray(array, by_name[name].dtype) for name, array in arrays.items()}
        full = dict(sizes)
        if Dim.ROWS in full:
            full[Dim.ROW_OFFSETS] = full[Dim.ROWS] + 1
        for dim, (name, axis) in self.measured.items():
            if dim not in full and name in given:
                full[dim] = given[name].shape[axis]
        for dim, name in self.ragged.items():
            if dim not in full:
                full[dim] = int(given[name][-1]) if name in given else 0
        out = {}
        for spec in self.arrays:
            if spec.name in given:
                out[spec.name] = given[spec.name]
            elif not spec.optional:
                out[spec.name] = np.full(tuple(full[d] for d in spec.shape), spec.fill, spec.dtype)
        return out


# A slot's directory entry (name, dtype, shape, offset) in msgpack, with room for long names.
DIRECTORY_BYTES_PER_ARRAY = 128
# The header (StepHeader; ResultHeader with an error message) and the slot's own bookkeeping.
HEADER_BYTES = 16384

T, S, S1, M = Dim.TOKENS, Dim.ROWS, Dim.ROW_OFFSETS, Dim.BLOCKS
I32, F32 = np.int32, np.float32

STEP_PLAN = SlotSpec(
    "step plan",
    (
        ArraySpec("rows", I32, (S,)),
        ArraySpec("input_ids", I32, (T,)),
        ArraySpec("positions", I32, (T,)),
        ArraySpec("slot_mapping", I32, (T,)),
        ArraySpec("query_start_loc", I32, (S1,)),
        ArraySpec("seq_lens", I32, (S,)),
        ArraySpec("block_tables", I32, (S, M)),
        ArraySpec("is_sampled", np.uint8, (S,), fill=1),
        ArraySpec("temperature", F32, (S,)),
        ArraySpec("top_k", I32, (S,)),
        ArraySpec("top_p", F32, (S,), fill=1.0),
        ArraySpec("min_p", F32, (S,)),
        ArraySpec("repetition_penalty", F32, (S,), fill=1.0),
        ArraySpec("presence_penalty", F32, (S,)),
        ArraySpec("frequency_penalty", F32, (S,)),
        ArraySpec("seeds", np.int64, (S,)),
        ArraySpec("sample_positions", I32, (S,)),
        ArraySpec("num_logprobs", I32, (S,)),
        ArraySpec("history_offsets", I32, (S1,)),
        ArraySpec("history_ids", I32, (Dim.HISTORY,)),
        ArraySpec("history_prompt_lens", I32, (S,)),
        ArraySpec("bias_offsets", I32, (S1,)),
        ArraySpec("bias_ids", I32, (Dim.BIAS,)),
        ArraySpec("bias_values", F32, (Dim.BIAS,)),
        # LongRoPE models (Phi-3): 1 where the row's tokens rotate with the long factors (the
        # sequence is longer than original_max_position_embeddings); absent: none do.
        ArraySpec("long_rope", np.uint8, (S,), optional=True),
        # LoRA: the adapter slot of each row's tokens (-1: the base model); absent: no adapters.
        ArraySpec("lora_slots", I32, (S,), optional=True),
        # Structured output: grammar_rows[i] is the plan index of a sampled row, and bit t % 32 of
        # grammar_bitmask[i, t // 32] is set when that row may sample token t. A row verifying
        # proposals is named 1 + num_proposed times in a row: the mask at each verified position.
        ArraySpec("grammar_rows", I32, (Dim.CONSTRAINED,), optional=True),
        ArraySpec("grammar_bitmask", I32, (Dim.CONSTRAINED, Dim.VOCAB_WORDS), optional=True),
        # Prompt logprobs: prompt_targets[i] is the prompt token that follows token i, whose
        # logprob token i's logits give (-1: not wanted); num_prompt_logprobs is each row's top-N.
        ArraySpec("prompt_targets", I32, (T,), optional=True),
        ArraySpec("num_prompt_logprobs", I32, (S,), optional=True),
        # Speculative decoding (docs/speculative.md): the last num_proposed[i] tokens of row i's
        # span are proposals to verify, after its last known token; 0: an ordinary row.
        ArraySpec("num_proposed", I32, (S,), optional=True),
        # Images (Gemma 3): each token's image within its row's chunk, whose tokens attend to each
        # other both ways in the prefill; -1 for a text token. An image lies within one chunk.
        ArraySpec("image_groups", I32, (T,), optional=True),
        # Where each image's embeddings are (ipc/embedding_cache.py): its first token in the
        # step, and its encoder replica, slot, write sequence and content key there.
        ArraySpec("image_starts", I32, (Dim.IMAGES,), optional=True),
        ArraySpec("image_encoders", I32, (Dim.IMAGES,), optional=True),
        ArraySpec("image_slots", I32, (Dim.IMAGES,), optional=True),
        ArraySpec("image_sequences", np.int64, (Dim.IMAGES,), optional=True),
        ArraySpec("image_keys", np.uint8, (Dim.IMAGES, Dim.IMAGE_KEY), optional=True),
        # M-RoPE (Qwen2.5-VL; services/gpu_worker/attention.py mrope_positions): each row's offset
        # of a text token's rotary position from its position at the row's first new token, and
        # the columns of each image's token grid (its tokens take rows x columns positions).
        # Absent: rotary positions are the token positions (M-RoPE's, for text alone).
        ArraySpec("rope_deltas", I32, (S,), optional=True),
        ArraySpec("image_grid_widths", I32, (Dim.IMAGES,), optional=True),
    ),
    measured={
        Dim.BLOCKS: ("block_tables", 1),
        Dim.CONSTRAINED: ("grammar_rows", 0),
        Dim.IMAGES: ("image_starts", 0),
    },
    ragged={Dim.HISTORY: "history_offsets", Dim.BIAS: "bias_offsets"},
)

STEP_RESULT = SlotSpec(
    "step result",
    (
        ArraySpec("sampled_ids", I32, (S,), fill=-1),
        ArraySpec("sampled_logprobs", F32, (S,)),
        ArraySpec("top_ids", I32, (S, Dim.TOP_K), fill=-1),
        ArraySpec("top_logprobs", F32, (S, Dim.TOP_K), fill=-np.inf),
        # Prompt logprobs, one entry per plan token with prompt_targets >= 0, in plan order: the
        # target's logprob and rank (1 = likeliest), and the top PROMPT_TOP_K at that position.
        ArraySpec("prompt_logprobs", F32, (Dim.SCORED,), optional=True),
        ArraySpec("prompt_ranks", I32, (Dim.SCORED,), optional=True),
        ArraySpec("prompt_top_ids", I32, (Dim.SCORED, Dim.PROMPT_TOP_K), fill=-1, optional=True),
        ArraySpec("prompt_top_logprobs", F32, (Dim.SCORED, Dim.PROMPT_TOP_K), fill=-np.inf, optional=True),
        # A step with num_proposed: each sampled row's new tokens (the accepted proposals, then the
        # target's own next token; padded with -1), their raw logprobs, and how many, then the top
        # logprobs at each new token as top_ids / top_logprobs hold them for one. sampled_ids
        # and sampled_logprobs then hold the row's last new token, the input of its next decode.
        ArraySpec("emitted_ids", I32, (S, Dim.EMITTED), fill=-1, optional=True),
        ArraySpec("emitted_logprobs", F32, (S, Dim.EMITTED), optional=True),
        ArraySpec("num_emitted", I32, (S,), optional=True),
        ArraySpec("emitted_top_ids", I32, (S, Dim.EMITTED, Dim.TOP_K), fill=-1, optional=True),
        ArraySpec("emitted_top_logprobs", F32, (S, Dim.EMITTED, Dim.TOP_K), fill=-np.inf, optional=True),
        # An embedding model (services/common/pooling.py): each sampled row's pooled final
        # token states, un-normalized (the scheduler truncates and normalizes); other rows zero.
        ArraySpec("pooled", F32, (S, Dim.HIDDEN), optional=True),
    ),
    measured={
        Dim.TOP_K: ("top_ids", 1),
        Dim.EMITTED: ("emitted_ids", 1),
        Dim.SCORED: ("prompt_logprobs", 0),
        Dim.PROMPT_TOP_K: ("prompt_top_ids", 1),
        Dim.HIDDEN: ("pooled", 1),
    },
)

# The result arrays of a step with proposals (in services/scheduler/results.py EmittedArrays' order).
EMITTED_ARRAYS = ("emitted_ids", "emitted_logprobs", "num_emitted", "emitted_top_ids", "emitted_top_logprobs")

# The most grammar-bitmask rows a step's constrained proposals add, one per proposal (a verified
# position's mask; services/scheduler/speculation.py keeps each step's within it).
MAX_CONSTRAINED_PROPOSALS = 4 * MAX_SPECULATIVE_TOKENS

# The most logit-bias entries one row's plan carries: the user's, plus -inf on eos and stop ids
# while min_tokens holds (eos ids: a handful per model) and on the tokens its bad words ban (one
# per tokenized word at most).
MAX_BIAS_ENTRIES_PER_ROW = MAX_LOGIT_BIAS_ENTRIES + MAX_STOP_TOKEN_IDS + 64 + MAX_BAD_WORDS_IDS


def plan_limits(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int, vocab_size: int
) -> dict[Dim, int]:
    """The largest size of each step-plan dimension under these engine settings and vocabulary."""
    return {
        Dim.TOKENS: max_num_batched_tokens,
        Dim.ROWS: max_num_seqs,
        Dim.BLOCKS: -(-max_model_len // block_size),
        Dim.HISTORY: max_num_seqs * max_model_len,
        Dim.BIAS: max_num_seqs * MAX_BIAS_ENTRIES_PER_ROW,
        Dim.CONSTRAINED: max_num_seqs + MAX_CONSTRAINED_PROPOSALS,
        Dim.VOCAB_WORDS: vocab_words(vocab_size),
        Dim.IMAGES: max_num_batched_tokens,
        Dim.IMAGE_KEY: IMAGE_KEY_BYTES,
    }


def vocab_words(vocab_size: int) -> int:
    """32-bit words of a bitmask with one bit per token."""
    return (vocab_size + 31) // 32


def result_limits(max_num_seqs: int, max_num_batched_tokens: int, hidden_size: int = 0) -> dict[Dim, int]:
    """The largest size of each step-result dimension (every token of a step may be scored;
    `hidden_size`: an embedding model's pooled vectors, 0 for a model that generates)."""
    return {
        Dim.HIDDEN: hidden_size,
        Dim.ROWS: max_num_seqs,
        Dim.EMITTED: MAX_SPECULATIVE_TOKENS + 1,
        Dim.TOP_K: MAX_LOGPROBS,
        Dim.SCORED: max_num_batched_tokens,
        Dim.PROMPT_TOP_K: MAX_LOGPROBS,
    }
