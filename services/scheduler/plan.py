"""Step plans: the arrays of docs/internals.md that one step-ring slot carries to the workers.

Per-sequence values that do not change while a request runs (sampling parameters, block table,
last token) live in a `PlanTable` row, written once when the request starts running or when it
gains a block; `build_plan` then gathers a whole step with numpy fancy indexing instead of a
Python loop per sequence. Only prefill chunks, penalty histories and logit biases (rare) are
copied per sequence, as slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ipc.messages import StepHeader
from services.scheduler.request import Request


class PlanTable:
    """Owns the per-row columns of the running requests (a row is a running request's slot)."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.epoch = np.zeros(num_rows, np.int64)  # bumped when a row is released: stale results
        self.block_tables = np.zeros((num_rows, max_blocks_per_seq), np.int32)
        self.last_token = np.zeros(num_rows, np.int32)
        self.temperature = np.zeros(num_rows, np.float32)
        self.top_k = np.zeros(num_rows, np.int32)
        self.top_p = np.ones(num_rows, np.float32)
        self.min_p = np.zeros(num_rows, np.float32)
        self.repetition_penalty = np.ones(num_rows, np.float32)
        self.presence_penalty = np.zeros(num_rows, np.float32)
        self.frequency_penalty = np.zeros(num_rows, np.float32)
        self.seeds = np.zeros(num_rows, np.int64)
        self.num_logprobs = np.zeros(num_rows, np.int32)
        self.min_tokens = np.zeros(num_rows, np.int32)
        self.needs_history = np.zeros(num_rows, np.bool_)
        self.has_bias = np.zeros(num_rows, np.bool_)
        # Finish checks of update(), by context length after appending the sampled token.
        self.stop_len = np.zeros(num_rows, np.int32)  # "length" at or past this
        self.eos_from = np.zeros(num_rows, np.int32)  # eos counts past this (min_tokens)
        self.has_stop_ids = np.zeros(num_rows, np.bool_)
        # Token history (prompt + outputs) of rows that apply penalties, so plans copy slices.
        self.history: dict[int, np.ndarray] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def assign(self, req: Request) -> None:
        """Give a request that starts running a row and fill the row from it."""
        row = self._free_rows.pop()
        req.row = row
        p = req.params
        self.block_tables[row, : len(req.block_ids)] = req.block_ids
        self.last_token[row] = req.last_token_id
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.seeds[row] = req.seed
        self.num_logprobs[row] = p.logprobs
        self.min_tokens[row] = p.min_tokens
        self.needs_history[row] = (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )
        if self.needs_history[row]:
            buf = np.empty(self.max_model_len, np.int32)
            buf[: req.num_tokens] = req.all_token_ids
            self.history[row] = buf
        self.has_bias[row] = bool(p.logit_bias)
        self.stop_len[row] = min(req.num_prompt_tokens + p.max_tokens, self.max_model_len)
        self.eos_from[row] = np.iinfo(np.int32).max if p.ignore_eos else req.num_prompt_tokens + p.min_tokens
        self.has_stop_ids[row] = bool(p.stop_token_ids)

    def release(self, req: Request) -> None:
        """Free a request's row; its block table row goes back to all zeros (the padding)."""
        self.block_tables[req.row, : len(req.block_ids)] = 0
        self.epoch[req.row] += 1
        self.history.pop(req.row, None)
        self._free_rows.append(req.row)
        req.row = -1


@dataclass(slots=True)
class ScheduledStep:
    """One planned step: sequences in plan order (single-token decodes first), how many new
    tokens each computes from which position, and whether its last token is sampled."""

    seqs: list[Request]
    rows: np.ndarray  # [S] intp: each sequence's plan-table row
    row_epochs: np.ndarray  # [S] the rows' epochs when planned (a changed epoch = stale entry)
    starts: np.ndarray  # [S] int32: num_computed_tokens before the step = first new position
    num_new_tokens: np.ndarray  # [S] int32
    is_sampled: np.ndarray  # [S] bool: the final chunk (or a decode) samples
    num_decodes: int  # seqs[:num_decodes] compute exactly one token, their last one, and sample
    table: PlanTable
    eos_token_ids: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return int(self.num_new_tokens.sum())

    @property
    def seq_lens(self) -> np.ndarray:
        return self.starts + self.num_new_tokens


class PlanSlot(Protocol):
    def put(self, name: str, array: np.ndarray) -> None: ...


def build_plan(
    step: ScheduledStep, step_id: int, block_size: int
) -> tuple[StepHeader, dict[str, np.ndarray]]:
    """The step header and every step-plan array of docs/internals.md for this step."""
    table = step.table
    seqs = step.seqs
    num_seqs = len(seqs)
    num_decodes = step.num_decodes
    rows = step.rows
    starts = step.starts
    num_new = step.num_new_tokens
    seq_lens = starts + num_new
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    if num_decodes == num_seqs:
        query_start_loc[1:] = np.arange(1, num_seqs + 1, dtype=np.int32)
        positions = starts
        token_rows = rows
        input_ids = table.last_token[rows]
    else:
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        positions = np.arange(num_tokens, dtype=np.int32)
        positions += np.repeat(starts - query_start_loc[:-1], num_new)
        token_rows = np.repeat(rows, num_new)
        input_ids = np.empty(num_tokens, np.int32)
        input_ids[:num_decodes] = table.last_token[rows[:num_decodes]]
        for i in range(num_decodes, num_seqs):
            s, e, q = int(starts[i]), int(seq_lens[i]), int(query_start_loc[i])
            input_ids[q : q + e - s] = seqs[i].token_slice(s, e)
    slot_mapping = table.block_tables[token_rows, positions // block_size] * block_size
    slot_mapping += positions % block_size
    max_blocks = (int(seq_lens.max()) + block_size - 1) // block_size if num_seqs else 0
    num_logprobs = table.num_logprobs[rows]

    arrays = {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "block_tables": table.block_tables[rows, :max_blocks],
        "is_sampled": step.is_sampled.view(np.uint8),
        "temperature": table.temperature[rows],
        "top_k": table.top_k[rows],
        "top_p": table.top_p[rows],
        "min_p": table.min_p[rows],
        "repetition_penalty": table.repetition_penalty[rows],
        "presence_penalty": table.presence_penalty[rows],
        "frequency_penalty": table.frequency_penalty[rows],
        "seeds": table.seeds[rows],
        "sample_positions": seq_lens.copy(),
        "num_logprobs": num_logprobs,
    }
    arrays.update(_history(step, table.needs_history[rows], table.history))
    arrays.update(_logit_bias(step, table.has_bias[rows], table.min_tokens[rows]))
    header = StepHeader(
        step_id=step_id,
        num_tokens=len(input_ids),
        num_seqs=num_seqs,
        max_top_logprobs=int(num_logprobs.max()) if num_seqs else 0,
    )
    return header, arrays


def write_plan(step: ScheduledStep, step_id: int, block_size: int, slot: PlanSlot) -> StepHeader:
    """Copy the plan's arrays into a step-ring slot; the caller publishes the returned header."""
    header, arrays = build_plan(step, step_id, block_size)
    for name, array in arrays.items():
        slot.put(name, array)
    return header


def _history(
    step: ScheduledStep, needs_history: np.ndarray, buffers: dict[int, np.ndarray]
) -> dict[str, np.ndarray]:
    """Ragged prompt + output ids of the sequences that apply penalties (empty spans otherwise)."""
    num_seqs = len(step.seqs)
    offsets = np.zeros(num_seqs + 1, np.int32)
    prompt_lens = np.zeros(num_seqs, np.int32)
    users = np.flatnonzero(needs_history).tolist()
    if users:
        for i in users:
            offsets[i + 1] = step.seqs[i].num_tokens
            prompt_lens[i] = step.seqs[i].num_prompt_tokens
        np.cumsum(offsets, out=offsets)
    history = np.empty(int(offsets[-1]), np.int32)
    for i in users:
        history[offsets[i] : offsets[i + 1]] = buffers[int(step.rows[i])][: offsets[i + 1] - offsets[i]]
    return {"history_offsets": offsets, "history_ids": history, "history_prompt_lens": prompt_lens}


def _logit_bias(step: ScheduledStep, has_bias: np.ndarray, min_tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Ragged logit bias: params.logit_bias, plus -inf on eos and stop ids below min_tokens."""
    num_seqs = len(step.seqs)
    offsets = np.zeros(num_seqs + 1, np.int32)
    candidates = np.flatnonzero(has_bias | (min_tokens > 0)).tolist()
    per_seq: list[tuple[int, dict[int, float]]] = []
    for i in candidates:
        req = step.seqs[i]
        bias = dict(req.params.logit_bias)
        if len(req.output_ids) < req.params.min_tokens:
            suppressed = list(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                suppressed.extend(step.eos_token_ids)
            bias.update(dict.fromkeys(suppressed, -np.inf))
        if bias:
            per_seq.append((i, bias))
            offsets[i + 1] = len(bias)
    np.cumsum(offsets, out=offsets)
    ids = np.empty(int(offsets[-1]), np.int32)
    values = np.empty(int(offsets[-1]), np.float32)
    for i, bias in per_seq:
        ids[offsets[i] : offsets[i + 1]] = list(bias)
        values[offsets[i] : offsets[i + 1]] = list(bias.values())
    return {"bias_offsets": offsets, "bias_ids": ids, "bias_values": values}
