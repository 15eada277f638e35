"""Step plans: the arrays that one step-ring slot carries to the workers (declared in
ipc/step_plan.py, explained in docs/internals.md).

Per-sequence values that do not change while a request runs (sampling parameters, block table,
last token) live in a `PlanTable` row, written once when the request starts running or when it
gains a block; `build_plan` then gathers a whole step with numpy fancy indexing instead of a
Python loop per sequence. Only prefill chunks, penalty histories and logit biases (rare) are
copied per sequence, as slices.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ipc.messages import PLACEHOLDER_TOKEN, PromptImage, StepHeader
from ipc.step_plan import STEP_PLAN, SlotSink
from services.scheduler.request import Request

if TYPE_CHECKING:
    from services.scheduler.grammars import GrammarPlan

# Rows of PlanTable.floats: the float32 sampling columns, named as in the plan.
FLOAT_COLUMNS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


class IntColumn(enum.IntEnum):
    """Rows of `PlanTable.ints`, each an int32 column over the plan-table rows (see PlanTable)."""

    TOP_K = 0
    NUM_LOGPROBS = 1
    LAST_TOKEN = 2
    NEEDS_HISTORY = 3
    NEEDS_BIAS = 4
    EOS_FROM = 5
    NUM_COMPUTED = 6
    LENGTH_LIMIT = 7
    NUM_TOKENS = 8
    CHECK_FROM = 9
    NUM_PROMPT = 10
    NUM_CACHED = 11
    TOKENIZER = 12


# The columns a step gathers together, with one take() each: so they sit side by side.
# schedule(): NUM_COMPUTED, LENGTH_LIMIT, NUM_TOKENS; update(): NUM_TOKENS, CHECK_FROM, NUM_PROMPT.
SCHEDULE_COLUMNS = slice(IntColumn.NUM_COMPUTED.value, IntColumn.NUM_TOKENS.value + 1)
UPDATE_COLUMNS = slice(IntColumn.NUM_TOKENS.value, IntColumn.NUM_PROMPT.value + 1)
NEVER = np.iinfo(np.int32).max


class PlanTable:
    """Owns the per-row columns of the running requests (a row is a running request's slot).

    Columns are grouped by dtype (`floats[column, row]`); each column is contiguous, so a step
    gathers it with one 1-d fancy index.
    """

    def __init__(self, num_rows: int, max_blocks_per_seq: int, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.epoch = np.zeros(num_rows, np.int64)  # bumped when a row is released: stale results
        self.num_releases = 0  # unchanged since a step was planned: none of its rows went stale
        self.block_tables = np.zeros((num_rows, max_blocks_per_seq), np.int32)
        self.floats = np.zeros((len(FLOAT_COLUMNS), num_rows), np.float32)
        self.seeds = np.zeros(num_rows, np.int64)
        # IntColumn: TOP_K, NUM_LOGPROBS, LAST_TOKEN (the next decode input); NEEDS_HISTORY
        # (penalties), NEEDS_BIAS (logit_bias or min_tokens); and update()'s finish checks, by
        # context length after appending the sampled token: from CHECK_FROM on, the sequence gets
        # the per-sequence check (the "length" limit, or 0 when it has stop ids), and an eos counts
        # past EOS_FROM (min_tokens); LENGTH_LIMIT is the "length" limit itself, which tells
        # schedule() that a sample in flight will be the last. The running request's counters:
        # NUM_COMPUTED (tokens whose KV is, or is being, written: it advances when a step is
        # planned), NUM_TOKENS (prompt + outputs, advances with each sample), NUM_PROMPT and
        # NUM_CACHED (prefix-cache hits at admission); the scheduler keeps them here, not on the
        # request, so that one numpy operation advances every decode of a step. TOKENIZER is the
        # request's tokenizer id.
        self.ints = np.zeros((len(IntColumn), num_rows), np.int32)
        # Each column as a view, in IntColumn order: the per-step code reads a column without
        # an enum member lookup.
        (
            self.top_k,
            self.num_logprobs,
            self.last_token,
            self.needs_history,
            self.needs_bias,
            self.eos_from,
            self.num_computed,
            self.length_limit,
            self.num_tokens,
            self.check_from,
            self.num_prompt,
            self.num_cached,
            self.tokenizer,
        ) = self.ints
        # The request's id and its output_ids list (the same object), so that a step's outputs
        # are gathered in C rather than read request by request.
        self.request_ids = np.full(num_rows, None, object)
        self.output_ids = np.full(num_rows, None, object)
        # Token history (prompt + outputs) of rows that apply penalties, so plans copy slices.
        self.history: dict[int, np.ndarray] = {}
        # params.logit_bias of rows that have one, as (ids, values) arrays.
        self.bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # Rows under a grammar (structured output): their matcher is the request's `grammar`.
        self.constrained = np.zeros(num_rows, np.bool_)
        # Rows with allowed_token_ids: their static bitmask row is the request's `allowed_mask`.
        self.allowed = np.zeros(num_rows, np.bool_)
        # Rows with bad words of several tokens, whose bans depend on the last sampled tokens
        # (Request.bad_words): like penalty and grammar rows, never planned ahead.
        self.bad_word_prefixes = np.zeros(num_rows, np.bool_)
        # Rows whose tokens rotate with LongRoPE's long factors (Request.is_long_rope).
        self.long_rope = np.zeros(num_rows, np.bool_)
        # Each row's LoRA adapter slot (Request.lora_slot), -1 for none.
        self.lora_slots = np.full(num_rows, -1, np.int32)
        # M-RoPE: each row's rotary offset after its whole prompt (Request.rope_delta), that of
        # its decodes; rows without one are 0.
        self.rope_deltas = np.zeros(num_rows, np.int32)
        # Speculative decoding (services/scheduler/speculation.py): rows whose every position of a
        # span the worker samples exactly as plain decoding would (services/gpu_worker/speculation.py).
        self.may_speculate = np.zeros(num_rows, np.bool_)
        self.num_may_speculate_rows = 0
        # Rows that ask for top logprobs / need a bias / are constrained: a step skips the columns
        # and arrays nobody uses.
        self.num_logprob_rows = 0
        self.num_bias_rows = 0
        self.num_grammar_rows = 0
        self.num_allowed_rows = 0
        self.num_bad_word_prefix_rows = 0
        self.num_long_rope_rows = 0
        self.num_lora_rows = 0
        self.num_rope_delta_rows = 0
        self._free_rows = list(range(num_rows - 1, -1, -1))
        # The plan arrays of a whole-line decode step that depend only on its rows (read-only),
        # with the running line's version they hold for: steady decode gathers them once (see
        # build_plan). services/scheduler/decode.py `SteadyDecode.invalidate` drops them.
        self.decode_constants: tuple[int, dict[str, np.ndarray]] | None = None

    def assign(self, req: Request, num_computed: int) -> None:
        """Give a request that starts running a row and fill the row from it."""
        row = self._free_rows.pop()
        req.row = row
        p = req.params
        self.block_tables[row, : len(req.block_ids)] = req.block_ids
        self.floats[:, row] = [getattr(p, name) for name in FLOAT_COLUMNS]
        self.seeds[row] = req.seed
        needs_history = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        bias = static_bias(req)
        has_bad_words = req.bad_words is not None and bool(req.bad_words.prefixes)
        needs_bias = bool(bias) or p.min_tokens > 0 or has_bad_words
        self.ints[:, row] = (
            p.top_k,
            p.logprobs,
            req.last_token_id,
            needs_history,
            needs_bias,
            NEVER if p.ignore_eos else req.num_prompt_tokens + p.min_tokens,
            num_computed,
            self._length_limit(req),
            req.num_tokens,
            0 if p.stop_token_ids else self._length_limit(req),
            req.num_prompt_tokens,
            req.num_cached_tokens,
            req.tokenizer_id,
        )
        self.request_ids[row] = req.request_id
        self.output_ids[row] = req.output_ids
        self.num_logprob_rows += p.logprobs > 0
        self.num_bias_rows += needs_bias
        if req.grammar is not None:
            self.constrained[row] = True
            self.num_grammar_rows += 1
        if req.allowed_mask is not None:
            self.allowed[row] = True
            self.num_allowed_rows += 1
        if has_bad_words:
            self.bad_word_prefixes[row] = True
            self.num_bad_word_prefix_rows += 1
        if req.is_long_rope:
            self.long_rope[row] = True
            self.num_long_rope_rows += 1
        if req.lora_slot >= 0:
            self.lora_slots[row] = req.lora_slot
            self.num_lora_rows += 1
        rope_delta = req.rope_delta(req.num_prompt_tokens)
        if rope_delta:
            self.rope_deltas[row] = rope_delta
            self.num_rope_delta_rows += 1
        self.may_speculate[row] = p.speculate
        self.num_may_speculate_rows += self.may_speculate[row]
        if needs_history:
            buf = np.empty(self.max_model_len, np.int32)
            buf[: req.num_tokens] = req.all_token_ids
            self.history[row] = buf
        if bias:
            self.bias[row] = (np.array(list(bias), np.int32), np.array(list(bias.values()), np.float32))

    def _length_limit(self, req: Request) -> int:
        """Context length at which the request stops for "length" (max_tokens None: the model's)."""
        max_tokens = req.params.max_tokens
        if max_tokens is None:
            return self.max_model_len
        return min(req.num_prompt_tokens + max_tokens, self.max_model_len)

    def release(self, req: Request) -> None:
        """Free a request's row; its block table row goes back to all zeros (the padding)."""
        self.block_tables[req.row, : len(req.block_ids)] = 0
        self.epoch[req.row] += 1
        self.num_releases += 1
        self.num_logprob_rows -= self.num_logprobs[req.row] > 0
        self.num_bias_rows -= self.needs_bias[req.row] != 0
        self.num_grammar_rows -= self.constrained[req.row]
        self.constrained[req.row] = False
        self.num_allowed_rows -= self.allowed[req.row]
        self.allowed[req.row] = False
        self.num_bad_word_prefix_rows -= self.bad_word_prefixes[req.row]
        self.bad_word_prefixes[req.row] = False
        self.num_long_rope_rows -= self.long_rope[req.row]
        self.long_rope[req.row] = False
        self.num_lora_rows -= self.lora_slots[req.row] >= 0
        self.lora_slots[req.row] = -1
        self.num_rope_delta_rows -= self.rope_deltas[req.row] != 0
        self.rope_deltas[req.row] = 0
        self.num_may_speculate_rows -= self.may_speculate[req.row]
        self.may_speculate[req.row] = False
        self.request_ids[req.row] = None
        self.output_ids[req.row] = None
        self.history.pop(req.row, None)
        self.bias.pop(req.row, None)
        self._free_rows.append(req.row)
        req.row = -1


class SteadyLine:
    """The block tables and KV slots of the running line's rows while the whole line decodes step
    after step (steady decode). Gathered from the plan table once per line, then kept in step
    with it: each steady step every row writes the slot after its last one, or the first slot of
    the new block it enters. So a steady step's plan gathers nothing per row.

    The arrays change in place when the next step is planned: a plan copies them into its slot
    before that (write_plan)."""

    def __init__(
        self,
        line_version: int,
        rows: np.ndarray,
        block_tables: np.ndarray,
        starts: np.ndarray,
        block_size: int,
    ) -> None:
        self.line_version = line_version  # the running line these rows are
        self.block_tables = block_tables.take(rows, axis=0)
        self.slot_mapping = self.block_tables[np.arange(len(rows)), starts // block_size] * block_size
        self.slot_mapping += starts % block_size

    def advance(
        self, entering: np.ndarray, columns: np.ndarray, new_blocks: list[int], block_size: int
    ) -> None:
        """One more steady step: rows `entering` got `new_blocks` at block `columns`."""
        self.slot_mapping += 1
        if len(entering):
            blocks = np.array(new_blocks, np.int32)
            self.block_tables[entering, columns] = blocks
            self.slot_mapping[entering] = blocks * block_size


@dataclass(slots=True)
class ScheduledStep:
    """One planned step: sequences in plan order (single-token decodes first, then verifications), how many new
    tokens each computes from which position, and whether its last token is sampled.

    A decode planned while the step before it is still in flight runs the token that step
    samples, unknown yet: its input is PLACEHOLDER_TOKEN, which the worker fills in.

    `build_plan` reads the live plan table (and `steady`): build the plan right after
    `schedule()`, before the scheduler changes again (abort, add, update, schedule)."""

    seqs: list[Request]
    rows: np.ndarray  # [S] intp: each sequence's plan-table row
    row_epochs: np.ndarray  # [S] the rows' epochs when planned (a changed epoch = stale entry)
    num_releases: int  # the table's release count when planned: unchanged = no stale entry
    starts: np.ndarray  # [S] int32: computed tokens before the step = first new position
    num_new_tokens: np.ndarray  # [S] int32
    is_sampled: np.ndarray  # [S] bool: the final chunk (or a decode) samples
    num_decodes: int  # seqs[:num_decodes] compute exactly one token, their last one, and sample
    is_placeholder: np.ndarray  # [num_decodes] bool: the decode's input is still being sampled
    table: PlanTable
    eos_token_ids: tuple[int, ...]
    lora_slots: tuple[str, ...] = ()  # the adapter of each slot, when a row has one (StepHeader.lora_slots)
    lora_prefetch: tuple[str, ...] = ()  # adapters to copy into slots ahead (StepHeader.lora_prefetch)
    # The running line's version when this step is all of it, in line order, all decodes (steady
    # decode; its SteadyLine then); -1 otherwise. Caches of such steps hold for that version.
    line_version: int = -1
    steady: SteadyLine | None = None
    grammar: GrammarPlan | None = None  # the masked sampled rows (grammar, allowed_token_ids), if any
    # Prompt logprobs: (plan index, first position, count) of each prefill chunk's positions whose
    # logits score the next prompt token (Request.scores_from), in plan order.
    prompt_spans: tuple[tuple[int, int, int], ...] = ()
    # Speculative decoding: seqs[num_decodes : num_decodes + len(proposals)] verify, each its last
    # token followed by its proposals (num_new_tokens = 1 + len of them); the prefill chunks follow.
    proposals: tuple[np.ndarray, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_verifying(self) -> int:
        return len(self.proposals)

    @property
    def num_tokens(self) -> int:
        return int(self.num_new_tokens.sum())

    @property
    def seq_lens(self) -> np.ndarray:
        return self.starts + self.num_new_tokens

    def live_seqs(self) -> list[Request]:
        """The sequences whose rows were not released (finished, aborted, preempted) since planning."""
        live = self.table.epoch.take(self.rows) == self.row_epochs
        return [req for req, is_live in zip(self.seqs, live.tolist(), strict=True) if is_live]


def build_plan(
    step: ScheduledStep, step_id: int, block_size: int
) -> tuple[StepHeader, dict[str, np.ndarray]]:
    """The step header and every step-plan array (ipc/step_plan.py STEP_PLAN) for this step."""
    header, arrays = _build(step, step_id, block_size)
    if step.grammar is not None:
        arrays.update(step.grammar.arrays())
    return header, arrays


def write_plan(step: ScheduledStep, step_id: int, block_size: int, slot: SlotSink) -> StepHeader:
    """Copy the plan's arrays into a step-ring slot; the caller publishes the returned header.
    The grammar bitmask is filled in the slot itself: it is the largest array a plan can carry."""
    header, arrays = _build(step, step_id, block_size)
    STEP_PLAN.write(slot, arrays)
    if step.grammar is not None:
        step.grammar.write(slot)
    return header


def _build(step: ScheduledStep, step_id: int, block_size: int) -> tuple[StepHeader, dict[str, np.ndarray]]:
    table = step.table
    seqs = step.seqs
    num_seqs = len(seqs)
    num_decodes = step.num_decodes
    rows = step.rows
    starts = step.starts
    num_new = step.num_new_tokens
    seq_lens = starts + num_new
    images: list[tuple[int, PromptImage]] = []  # (first step token, image) of the chunks' images
    if num_decodes == num_seqs:
        positions = starts
        token_rows = rows
        if np.count_nonzero(step.is_placeholder) == num_seqs:  # steady decode planned ahead
            input_ids = np.full(num_seqs, PLACEHOLDER_TOKEN, np.int32)
        else:
            input_ids = table.last_token.take(rows)
            input_ids[step.is_placeholder] = PLACEHOLDER_TOKEN
        constants = _decode_constants(step)
    else:
        constants = _row_constants(step)
        query_start_loc = constants["query_start_loc"]
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        positions = np.arange(num_tokens, dtype=np.int32)
        positions += np.repeat(starts - query_start_loc[:-1], num_new)
        token_rows = np.repeat(rows, num_new)
        input_ids = np.empty(num_tokens, np.int32)
        input_ids[:num_decodes] = table.last_token.take(rows[:num_decodes])
        input_ids[:num_decodes][step.is_placeholder] = PLACEHOLDER_TOKEN
        first_chunk = num_decodes + step.num_verifying
        for i, proposal in enumerate(step.proposals, num_decodes):
            q = int(query_start_loc[i])
            input_ids[q] = table.last_token[rows[i]]
            input_ids[q + 1 : q + 1 + len(proposal)] = proposal
        for i in range(first_chunk, num_seqs):
            s, e, q = int(starts[i]), int(seq_lens[i]), int(query_start_loc[i])
            input_ids[q : q + e - s] = seqs[i].token_slice(s, e)
            images += [(q + image.start - s, image) for image in seqs[i].images if s <= image.start < e]
            if "rope_deltas" in constants and seqs[i].images:  # the offset where its chunk starts
                constants["rope_deltas"][i] = seqs[i].rope_delta(s)
    max_blocks = (int(seq_lens.max()) + block_size - 1) // block_size if num_seqs else 0
    if step.steady is not None:
        slot_mapping = step.steady.slot_mapping
        block_tables = step.steady.block_tables[:, :max_blocks]
    else:
        block_index, offset = np.divmod(positions, block_size)
        slot_mapping = table.block_tables[token_rows, block_index] * block_size
        slot_mapping += offset
        block_tables = table.block_tables[rows, :max_blocks]
    arrays = {
        **constants,
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "seq_lens": seq_lens,
        "block_tables": block_tables,
        "sample_positions": seq_lens,  # the sampled token's position is the context length
    }
    # Ragged spans change every step only where some row applies penalties or a bias.
    if table.history:
        arrays.update(_history(step))
    if table.num_bias_rows:
        arrays.update(_logit_bias(step, seq_lens))
    if step.prompt_spans:
        arrays.update(_prompt_targets(step, constants["query_start_loc"], len(input_ids)))
    if images:
        arrays.update(_image_arrays(images, len(input_ids)))
    if step.proposals:
        num_proposed = np.zeros(num_seqs, np.int32)
        num_proposed[num_decodes : num_decodes + step.num_verifying] = [len(p) for p in step.proposals]
        arrays["num_proposed"] = num_proposed
    num_logprobs = constants["num_logprobs"]
    header = StepHeader(
        step_id=step_id,
        num_tokens=len(input_ids),
        num_seqs=num_seqs,
        max_top_logprobs=int(num_logprobs.max()) if table.num_logprob_rows and num_seqs else 0,
        lora_slots=list(step.lora_slots),
        lora_prefetch=list(step.lora_prefetch),
    )
    return header, arrays


def _image_arrays(images: list[tuple[int, PromptImage]], num_tokens: int) -> dict[str, np.ndarray]:
    """Where each image of the step's chunks is (each whole in its chunk: Request.image_cut) and
    where its embeddings are; its tokens form a group that attends both ways."""
    groups = np.full(num_tokens, -1, np.int32)
    for g, (start, image) in enumerate(images):
        groups[start : start + image.num_tokens] = g
    return {
        "image_groups": groups,
        "image_starts": np.array([start for start, _ in images], np.int32),
        "image_encoders": np.array([image.encoder for _, image in images], np.int32),
        "image_slots": np.array([image.ref.slot for _, image in images], np.int32),
        "image_sequences": np.array([image.ref.sequence for _, image in images], np.int64),
        "image_keys": np.frombuffer(b"".join(image.key for _, image in images), np.uint8).reshape(
            len(images), -1
        ),
        # M-RoPE's grids (0: none); where no image has one, the plan goes without.
        **(
            {"image_grid_widths": np.array([image.grid_width for _, image in images], np.int32)}
            if any(image.grid_width for _, image in images)
            else {}
        ),
    }


def _decode_constants(step: ScheduledStep) -> dict[str, np.ndarray]:
    """`_row_constants` of an all-decode step, reused by the steps of one version of the running
    line: its rows are the same, and a row's sampling columns change only when it is assigned
    (which changes the line)."""
    table = step.table
    if step.line_version < 0:
        return _row_constants(step)
    cached = table.decode_constants
    if cached is not None and cached[0] == step.line_version:
        return cached[1]
    constants = _row_constants(step)
    for array in constants.values():
        array.flags.writeable = False  # shared by the plans of later steps
    table.decode_constants = (step.line_version, constants)
    return constants


def _row_constants(step: ScheduledStep) -> dict[str, np.ndarray]:
    """The plan arrays that depend only on the step's rows (query_start_loc: a decode's)."""
    table, rows = step.table, step.rows
    num_seqs = len(rows)
    constants = {
        "rows": rows.astype(np.int32),
        "query_start_loc": np.arange(num_seqs + 1, dtype=np.int32),
        "is_sampled": step.is_sampled.view(np.uint8),
        "top_k": table.top_k.take(rows),
        "seeds": table.seeds.take(rows),
        "num_logprobs": (
            table.num_logprobs.take(rows) if table.num_logprob_rows else np.zeros(num_seqs, np.int32)
        ),
    }
    # 1-d take() per int column; the float columns in one take() along the rows.
    constants.update(zip(FLOAT_COLUMNS, table.floats.take(rows, axis=1), strict=True))
    if table.num_long_rope_rows:
        constants["long_rope"] = table.long_rope.take(rows).view(np.uint8)
    if table.num_lora_rows:
        constants["lora_slots"] = table.lora_slots.take(rows)
    if table.num_rope_delta_rows:
        constants["rope_deltas"] = table.rope_deltas.take(rows)
    if not table.history:
        constants.update(_history(step))
    if not table.num_bias_rows:
        constants.update(_logit_bias(step, step.starts + step.num_new_tokens))
    return constants


def _prompt_targets(
    step: ScheduledStep, query_start_loc: np.ndarray, num_tokens: int
) -> dict[str, np.ndarray]:
    """For each token of the plan, the prompt token whose logprob its logits give (-1: none),
    and each row's top-N of them."""
    targets = np.full(num_tokens, -1, np.int32)
    top_n = np.zeros(len(step.seqs), np.int32)
    for i, first, count in step.prompt_spans:
        req = step.seqs[i]
        q = int(query_start_loc[i]) + first - int(step.starts[i])
        targets[q : q + count] = req.prompt_ids[first + 1 : first + 1 + count]
        top_n[i] = req.params.prompt_logprobs
    return {"prompt_targets": targets, "num_prompt_logprobs": top_n}


def _history(step: ScheduledStep) -> dict[str, np.ndarray]:
    """Ragged prompt + output ids of the sequences that apply penalties (empty spans otherwise).
    Their history is always known: schedule() never plans them ahead with a placeholder."""
    num_seqs = len(step.seqs)
    lens = np.zeros(num_seqs, np.int32)
    prompt_lens = np.zeros(num_seqs, np.int32)
    table = step.table
    # Only rows that apply penalties have a history buffer: none, no gather.
    users = np.flatnonzero(table.needs_history.take(step.rows)).tolist() if table.history else []
    parts = []
    for i in users:
        req = step.seqs[i]
        parts.append(table.history[req.row][: req.num_tokens])
        lens[i] = req.num_tokens
        prompt_lens[i] = req.num_prompt_tokens
    offsets = np.zeros(num_seqs + 1, np.int32)
    if parts:
        np.cumsum(lens, out=offsets[1:])
    history = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return {"history_offsets": offsets, "history_ids": history, "history_prompt_lens": prompt_lens}


def static_bias(req: Request) -> dict[int, float]:
    """The logit bias a request has at every position: params.logit_bias, and -inf on the tokens
    of its one-token bad words."""
    bias = req.params.logit_bias
    if req.bad_words is not None and req.bad_words.always:
        bias = {**bias, **dict.fromkeys(req.bad_words.always, -np.inf)}
    return bias


def _logit_bias(step: ScheduledStep, sample_positions: np.ndarray) -> dict[str, np.ndarray]:
    """Ragged logit bias: the static one (`static_bias`), plus -inf on the tokens banned at the
    row's sample position (`Request.bans`: eos and stop ids below min_tokens, bad words).

    The outputs before the sampled one are counted from its position, not from the request:
    a decode planned ahead samples one past the output still in flight (a row whose bans depend
    on its outputs, a multi-token bad word's, is never planned ahead)."""
    num_seqs = len(step.seqs)
    lens = np.zeros(num_seqs, np.int32)
    ids: list[np.ndarray] = []
    values: list[np.ndarray] = []
    table = step.table
    static = table.bias
    users = np.flatnonzero(table.needs_bias.take(step.rows)).tolist() if table.num_bias_rows else []
    for i in users:
        req = step.seqs[i]
        bans = req.bans(int(sample_positions[i]), step.eos_token_ids)
        if bans:
            bias = {**static_bias(req), **dict.fromkeys(bans, -np.inf)}
            ids.append(np.array(list(bias), np.int32))
            values.append(np.array(list(bias.values()), np.float32))
        elif req.row in static:
            ids.append(static[req.row][0])
            values.append(static[req.row][1])
        else:
            continue
        lens[i] = len(ids[-1])
    offsets = np.zeros(num_seqs + 1, np.int32)
    if ids:
        np.cumsum(lens, out=offsets[1:])
    return {
        "bias_offsets": offsets,
        "bias_ids": np.concatenate(ids) if ids else np.zeros(0, np.int32),
        "bias_values": np.concatenate(values) if values else np.zeros(0, np.float32),
    }
