"""Step plans: the arrays that one step-ring slot carries to the workers (declared in
ipc/step_plan.py, explained in docs/internals.md).

Per-sequence values that do not change while a request runs (sampling parameters, block table,
last token) live in a `PlanTable` row, written once when the request starts running or when it
gains a block; `build_plan` then gathers a whole step with numpy fancy indexing instead of a
Python loop per sequence. Only prefill chunks, penalty histories and logit biases (rare) are
copied per sequence, as slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ipc.messages import PLACEHOLDER_TOKEN, StepHeader
from ipc.step_plan import STEP_PLAN, SlotSink
from services.scheduler.request import Request

# Rows of PlanTable.floats: the float32 sampling columns, named as in the plan.
FLOAT_COLUMNS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
# Rows of PlanTable.ints. Ordered so that each step gathers what it reads with one take():
# schedule() NUM_COMPUTED..NUM_TOKENS, update() NUM_TOKENS..NUM_PROMPT.
(
    TOP_K,
    NUM_LOGPROBS,
    LAST_TOKEN,
    NEEDS_HISTORY,
    NEEDS_BIAS,
    EOS_FROM,
    NUM_COMPUTED,
    LENGTH_LIMIT,
    NUM_TOKENS,
    CHECK_FROM,
    NUM_PROMPT,
    NUM_CACHED,
    FRONTEND,
) = range(13)
NUM_INT_COLUMNS = 13
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
        self.num_assigns = 0
        self.block_tables = np.zeros((num_rows, max_blocks_per_seq), np.int32)
        self.floats = np.zeros((len(FLOAT_COLUMNS), num_rows), np.float32)
        self.seeds = np.zeros(num_rows, np.int64)
        # TOP_K, NUM_LOGPROBS, LAST_TOKEN (the next decode input); NEEDS_HISTORY (penalties),
        # NEEDS_BIAS (logit_bias or min_tokens); and update()'s finish checks, by context length
        # after appending the sampled token: from CHECK_FROM on, the sequence gets the
        # per-sequence check (the "length" limit, or 0 when it has stop ids), and an eos counts
        # past EOS_FROM (min_tokens); LENGTH_LIMIT is the "length" limit itself, which tells
        # schedule() that a sample in flight will be the last. The running
        # request's counters: NUM_COMPUTED (tokens whose KV is, or is being, written: it advances
        # when a step is planned), NUM_TOKENS (prompt + outputs, advances with each sample),
        # NUM_PROMPT and NUM_CACHED (prefix-cache hits at admission); the scheduler keeps them
        # here, not on the request, so that one numpy operation advances every decode of a step.
        # FRONTEND is the request's frontend id.
        self.ints = np.zeros((NUM_INT_COLUMNS, num_rows), np.int32)
        # The request's id and its output_ids list (the same object), so that a step's outputs
        # are gathered in C rather than read request by request.
        self.request_ids = np.full(num_rows, None, object)
        self.output_ids = np.full(num_rows, None, object)
        # Token history (prompt + outputs) of rows that apply penalties, so plans copy slices.
        self.history: dict[int, np.ndarray] = {}
        # params.logit_bias of rows that have one, as (ids, values) arrays.
        self.bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # Rows that ask for top logprobs / need a bias: a step skips the columns nobody uses.
        self.num_logprob_rows = 0
        self.num_bias_rows = 0
        self._free_rows = list(range(num_rows - 1, -1, -1))
        # The plan arrays of the last all-decode step that depend only on its rows (read-only),
        # valid while that rows array is planned again and no row was assigned or released since:
        # steady decode gathers them once (see build_plan).
        self.decode_constants: tuple[np.ndarray, int, int, dict[str, np.ndarray]] | None = None

    def assign(self, req: Request, num_computed: int) -> None:
        """Give a request that starts running a row and fill the row from it."""
        row = self._free_rows.pop()
        req.row = row
        self.num_assigns += 1
        p = req.params
        self.block_tables[row, : len(req.block_ids)] = req.block_ids
        self.floats[:, row] = [getattr(p, name) for name in FLOAT_COLUMNS]
        self.seeds[row] = req.seed
        needs_history = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        self.ints[:, row] = (
            p.top_k,
            p.logprobs,
            req.last_token_id,
            needs_history,
            bool(p.logit_bias) or p.min_tokens > 0,
            NEVER if p.ignore_eos else req.num_prompt_tokens + p.min_tokens,
            num_computed,
            self._length_limit(req),
            req.num_tokens,
            0 if p.stop_token_ids else self._length_limit(req),
            req.num_prompt_tokens,
            req.num_cached_tokens,
            req.frontend_id,
        )
        self.request_ids[row] = req.request_id
        self.output_ids[row] = req.output_ids
        self.num_logprob_rows += p.logprobs > 0
        self.num_bias_rows += bool(p.logit_bias) or p.min_tokens > 0
        if needs_history:
            buf = np.empty(self.max_model_len, np.int32)
            buf[: req.num_tokens] = req.all_token_ids
            self.history[row] = buf
        if p.logit_bias:
            self.bias[row] = (
                np.array(list(p.logit_bias), np.int32),
                np.array(list(p.logit_bias.values()), np.float32),
            )

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
        self.num_logprob_rows -= self.ints[NUM_LOGPROBS, req.row] > 0
        self.num_bias_rows -= self.ints[NEEDS_BIAS, req.row] != 0
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

    def __init__(self, rows: np.ndarray, block_tables: np.ndarray, starts: np.ndarray, block_size: int) -> None:
        self.rows = rows  # the line's rows array: the line is the same while this object is
        self.block_tables = block_tables.take(rows, axis=0)
        self.slot_mapping = self.block_tables[np.arange(len(rows)), starts // block_size] * block_size
        self.slot_mapping += starts % block_size

    def advance(self, entering: np.ndarray, columns: np.ndarray, new_blocks: list[int], block_size: int) -> None:
        """One more steady step: rows `entering` got `new_blocks` at block `columns`."""
        self.slot_mapping += 1
        if len(entering):
            blocks = np.array(new_blocks, np.int32)
            self.block_tables[entering, columns] = blocks
            self.slot_mapping[entering] = blocks * block_size


@dataclass(slots=True)
class ScheduledStep:
    """One planned step: sequences in plan order (single-token decodes first), how many new
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
    steady: SteadyLine | None = None  # a step of the whole running line, all decodes

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

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
    table = step.table
    seqs = step.seqs
    num_seqs = len(seqs)
    num_decodes = step.num_decodes
    rows = step.rows
    starts = step.starts
    num_new = step.num_new_tokens
    ints = table.ints
    seq_lens = starts + num_new
    if num_decodes == num_seqs:
        positions = starts
        token_rows = rows
        if np.count_nonzero(step.is_placeholder) == num_seqs:  # steady decode planned ahead
            input_ids = np.full(num_seqs, PLACEHOLDER_TOKEN, np.int32)
        else:
            input_ids = ints[LAST_TOKEN].take(rows)
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
        input_ids[:num_decodes] = ints[LAST_TOKEN].take(rows[:num_decodes])
        input_ids[:num_decodes][step.is_placeholder] = PLACEHOLDER_TOKEN
        for i in range(num_decodes, num_seqs):
            s, e, q = int(starts[i]), int(seq_lens[i]), int(query_start_loc[i])
            input_ids[q : q + e - s] = seqs[i].token_slice(s, e)
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
    num_logprobs = constants["num_logprobs"]
    header = StepHeader(
        step_id=step_id,
        num_tokens=len(input_ids),
        num_seqs=num_seqs,
        max_top_logprobs=int(num_logprobs.max()) if table.num_logprob_rows and num_seqs else 0,
    )
    return header, arrays


def _decode_constants(step: ScheduledStep) -> dict[str, np.ndarray]:
    """`_row_constants` of an all-decode step, reused while the step's rows are the last ones and
    unchanged: a row's sampling columns change only when it is assigned."""
    table = step.table
    cached = table.decode_constants
    if cached is not None and cached[0] is step.rows and cached[1:3] == (table.num_assigns, table.num_releases):
        return cached[3]
    constants = _row_constants(step)
    for array in constants.values():
        array.flags.writeable = False  # shared by the plans of later steps
    table.decode_constants = (step.rows, table.num_assigns, table.num_releases, constants)
    return constants


def _row_constants(step: ScheduledStep) -> dict[str, np.ndarray]:
    """The plan arrays that depend only on the step's rows (query_start_loc: a decode's)."""
    table, rows = step.table, step.rows
    num_seqs = len(rows)
    ints = table.ints
    constants = {
        "rows": rows.astype(np.int32),
        "query_start_loc": np.arange(num_seqs + 1, dtype=np.int32),
        "is_sampled": step.is_sampled.view(np.uint8),
        "top_k": ints[TOP_K].take(rows),
        "seeds": table.seeds.take(rows),
        "num_logprobs": (
            ints[NUM_LOGPROBS].take(rows) if table.num_logprob_rows else np.zeros(num_seqs, np.int32)
        ),
    }
    # 1-d take() per int column; the float columns in one take() along the rows.
    constants.update(zip(FLOAT_COLUMNS, table.floats.take(rows, axis=1), strict=True))
    if not table.history:
        constants.update(_history(step))
    if not table.num_bias_rows:
        constants.update(_logit_bias(step, step.starts + step.num_new_tokens))
    return constants


def write_plan(step: ScheduledStep, step_id: int, block_size: int, slot: SlotSink) -> StepHeader:
    """Copy the plan's arrays into a step-ring slot; the caller publishes the returned header."""
    header, arrays = build_plan(step, step_id, block_size)
    STEP_PLAN.write(slot, arrays)
    return header


def _history(step: ScheduledStep) -> dict[str, np.ndarray]:
    """Ragged prompt + output ids of the sequences that apply penalties (empty spans otherwise).
    Their history is always known: schedule() never plans them ahead with a placeholder."""
    num_seqs = len(step.seqs)
    lens = np.zeros(num_seqs, np.int32)
    prompt_lens = np.zeros(num_seqs, np.int32)
    table = step.table
    # Only rows that apply penalties have a history buffer: none, no gather.
    users = np.flatnonzero(table.ints[NEEDS_HISTORY].take(step.rows)).tolist() if table.history else []
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


def _logit_bias(step: ScheduledStep, sample_positions: np.ndarray) -> dict[str, np.ndarray]:
    """Ragged logit bias: params.logit_bias, plus -inf on eos and stop ids below min_tokens.

    The outputs before the sampled one are counted from its position, not from the request:
    a decode planned ahead samples one past the output still in flight."""
    num_seqs = len(step.seqs)
    lens = np.zeros(num_seqs, np.int32)
    ids: list[np.ndarray] = []
    values: list[np.ndarray] = []
    table = step.table
    static = table.bias
    users = np.flatnonzero(table.ints[NEEDS_BIAS].take(step.rows)).tolist() if table.num_bias_rows else []
    for i in users:
        req = step.seqs[i]
        p = req.params
        if int(sample_positions[i]) - req.num_prompt_tokens < p.min_tokens:
            suppressed = list(p.stop_token_ids)
            if not p.ignore_eos:
                suppressed.extend(step.eos_token_ids)
            bias = {**p.logit_bias, **dict.fromkeys(suppressed, -np.inf)}
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
