"""Decodes, and the steady-decode fast path: running sequences with only their last sampled token
to compute, found and advanced with numpy over their plan-table rows.

That token is known (the step that sampled it was applied) or still being sampled by the step in
flight: the decode's input is then a placeholder that the worker fills in. When the whole running
line decodes step after step (steady decode), what depends only on the line is gathered once and
kept: the line's rows, its block tables and KV slots (`SteadyLine`), its all-ones columns, the
per-row lists that `update()` reads, and the plan's per-row constants (`PlanTable.decode_constants`).
Each is valid for one version of the running line (`SchedulerState.line_version`), and
`invalidate()` drops them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.plan import SCHEDULE_COLUMNS, SteadyLine
from services.scheduler.request import Request, RequestStatus
from services.scheduler.state import SchedulerState

# Per-row lists that update() gathers: output lists, request ids, tokenizer ids, prompt lengths,
# prefix hits.
RowColumns = tuple[list[list[int]], list[str], list[int], list[int], list[int]]


@dataclass(slots=True)
class Decodes:
    """The decodes of one step, in line order, and the running sequences with prompt left."""

    seqs: list[Request]
    rows: np.ndarray  # [D] intp plan-table rows
    starts: np.ndarray  # [D] int32: computed tokens before the step
    is_placeholder: np.ndarray  # [D] bool: the input is the sample in flight
    partial: list[Request]  # running, with more than one token left to compute
    line_version: int  # the line's version when the decodes are all of it, in order; else -1
    steady: SteadyLine | None  # kept in step with the line while line_version >= 0


class SteadyDecode:
    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self._order: tuple[int, np.ndarray] | None = None  # (line version, rows of `running`)
        self._steady: SteadyLine | None = None
        self._line_columns: tuple[int, RowColumns] | None = None  # (line version, row_columns)
        self._all_decode: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # see all_decode_columns

    def invalidate(self) -> None:
        """Drop every cache of the fast path (they are rebuilt on the next steady step)."""
        self._order = None
        self._steady = None
        self._line_columns = None
        self.state.table.decode_constants = None

    def drop_steady_line(self) -> None:
        """The step just planned is not a steady one after all (some decodes verify proposals and
        advance by more than one position): the SteadyLine that plan() advanced for it goes."""
        self._steady = None

    def plan(self, budget: int) -> Decodes:
        """The decodes of the next step, up to `budget` of them, each given the block its token
        needs (which may preempt from the back of the line); their NUM_COMPUTED advances."""
        state = self.state
        if state.config.long_rope_from:
            self._recompute_past_short_rope()
        bs = state.block_size
        blocks = state.blocks
        table = state.table
        running = state.running
        version = state.line_version
        order = self.running_rows()
        computed, limits, known = table.ints[SCHEDULE_COLUMNS].take(order, axis=1)
        pending = known - computed
        in_flight = pending == 0
        # count_nonzero rather than any()/all(): cheaper on arrays this small, every step.
        num_in_flight = np.count_nonzero(in_flight)
        if num_in_flight == len(running):  # steady decode planned ahead: every sample is in flight
            is_decode = self._may_plan_ahead(order, known, limits)
        else:
            is_decode = pending == 1
            if num_in_flight:
                is_decode |= in_flight & self._may_plan_ahead(order, known, limits)
        is_whole_line = len(running) <= budget and np.count_nonzero(is_decode) == len(running)
        if is_whole_line:  # steady decode: the whole line
            partial = []
            seqs = running[:]
            rows, starts, is_placeholder = order, computed, in_flight
        else:
            decodes = is_decode.nonzero()[0][:budget]
            partial = [running[i] for i in (pending > 1).nonzero()[0].tolist()]
            seqs = [running[i] for i in decodes.tolist()]
            rows, starts, is_placeholder = order[decodes], computed[decodes], in_flight[decodes]
        # A running sequence holds exactly the blocks of its computed tokens, so a decode whose
        # context fills its last block needs a new one; that may preempt the back of the line.
        entering = (starts % bs == 0).nonzero()[0]
        columns = starts[entering] // bs
        new_blocks: list[int] = []
        if 0 < len(entering) <= blocks.num_available:  # the usual case: one batch, nobody preempted
            new_blocks = blocks.allocate(len(entering))
            table.block_tables[rows[entering], columns] = new_blocks
            for j, b in zip(entering.tolist(), new_blocks, strict=True):
                seqs[j].block_ids.append(b)
            if self.state.config.sliding_window:
                for j, start in zip(entering.tolist(), starts[entering].tolist(), strict=True):
                    self.state.release_before_window(seqs[j], start)
        elif len(entering):
            self._steady = None  # these block-table writes are not mirrored in it
            if self._grow_decodes(seqs, entering.tolist()):
                is_whole_line = False
                seqs = [req for req in seqs if req.status is RequestStatus.RUNNING]
                rows = np.array([req.row for req in seqs], np.intp)
                starts = table.num_computed.take(rows)
                is_placeholder = starts == table.num_tokens.take(rows)
        # The whole line decodes: keep its SteadyLine in step (any other step may write block
        # tables that it does not see, so it goes).
        if is_whole_line:
            steady = self._steady
            if steady is not None and steady.line_version == version:
                steady.advance(entering, columns, new_blocks, bs)
            else:
                steady = self._steady = SteadyLine(version, order, table.block_tables, starts, bs)
        else:
            steady = self._steady = None
        table.num_computed.put(rows, starts + 1)
        return Decodes(seqs, rows, starts, is_placeholder, partial, version if is_whole_line else -1, steady)

    def running_rows(self) -> np.ndarray:
        """Plan-table rows of the running sequences, in line order (kept while the line is)."""
        version = self.state.line_version
        if self._order is None or self._order[0] != version:
            self._order = (version, np.array([req.row for req in self.state.running], np.intp))
        return self._order[1]

    def all_decode_columns(self, num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
        """is_sampled and num_new_tokens of a step of `num_seqs` decodes: all ones, made once
        per size and read-only, since steady decode asks for the same ones every step."""
        columns = self._all_decode.get(num_seqs)
        if columns is None:
            columns = (np.ones(num_seqs, np.bool_), np.ones(num_seqs, np.int32))
            for column in columns:
                column.flags.writeable = False
            self._all_decode[num_seqs] = columns
        return columns

    def row_columns(self, rows: np.ndarray, line_version: int) -> RowColumns:
        """What update() reads of these rows as Python lists: their output lists, request ids,
        tokenizer ids, prompt lengths and prefix hits, none of which change while a row's request
        runs. A steady step that samples its whole line (`line_version` >= 0) reads the lists
        gathered for that line, not once per step. The lists are shared by the steps' outputs,
        which never change them.

        A cached line still fits a later step of the same version that samples all of its rows:
        a row changes request only when it is released, which changes the line and the row's
        epoch, so a step planned on the old line would not have sampled that row."""
        cached = self._line_columns
        if line_version >= 0 and cached is not None and cached[0] == line_version:
            return cached[1]
        table = self.state.table
        columns = (
            table.output_ids.take(rows).tolist(),
            table.request_ids.take(rows).tolist(),
            table.tokenizer.take(rows).tolist(),
            table.num_prompt.take(rows).tolist(),
            table.num_cached.take(rows).tolist(),
        )
        if line_version >= 0 and line_version == self.state.line_version:
            self._line_columns = (line_version, columns)
        return columns

    @property
    def can_plan_ahead(self) -> bool:
        """False while some running sequence applies penalties, is constrained by a grammar or
        has bad words of several tokens: planned ahead, it would sit out every other step, so the
        caller rather plans synchronously until it leaves. A row with allowed_token_ids alone is
        no reason: its mask is the same at every position."""
        table = self.state.table
        return not table.history and not table.num_grammar_rows and not table.num_bad_word_prefix_rows

    def _may_plan_ahead(self, rows: np.ndarray, known: np.ndarray, limits: np.ndarray) -> np.ndarray:
        """Which of these rows, each with a sample in flight, `known` tokens and its LENGTH_LIMIT,
        may decode that sample before it is known: not when it is the last one by length, nor
        when the row applies penalties (the worker would need the unknown token in its history),
        nor when it is constrained (its grammar bitmask depends on that token), nor when it has
        bad words of several tokens (which of their last tokens are banned depends on it).
        allowed_token_ids' mask does not depend on it: such a row decodes ahead."""
        allowed = known + 1 < limits
        table = self.state.table
        long_from = self.state.config.long_rope_from
        if long_from:
            # Position long_from of a short-regime row is not decoded but recomputed, from its token.
            allowed &= (known != long_from) | table.long_rope.take(rows)
        if table.history:
            allowed &= table.needs_history.take(rows) == 0
        if table.num_grammar_rows:
            allowed &= ~table.constrained.take(rows)
        if table.num_bad_word_prefix_rows:
            allowed &= ~table.bad_word_prefixes.take(rows)
        return allowed

    def _recompute_past_short_rope(self) -> None:
        """LongRoPE: a short-regime sequence whose next token is at position long_from (its
        length passes the original one) leaves the short regime: from there on HF rotates its
        whole context with the long factors (Phi-3's generate drops its KV cache at that step).
        So it is preempted by recompute; readmitted longer than the original length, it is long
        (Prefill.choose_rope), its cached short blocks never matching."""
        state = self.state
        table = state.table
        long_from = state.config.long_rope_from
        order = self.running_rows()
        crossing = table.num_computed.take(order) == long_from
        crossing &= table.num_tokens.take(order) > long_from
        crossing &= ~table.long_rope.take(order)
        for i in reversed(crossing.nonzero()[0].tolist()):
            req = state.running[i]
            state.stop_running(req)
            state.preempt(req)

    def _grow_decodes(self, seqs: list[Request], entering: list[int]) -> bool:
        """Give each decode `seqs[j]`, j in `entering`, its next block, preempting from the back
        of the line when none is left; True when some of `seqs` were preempted."""
        state = self.state
        blocks = state.blocks
        block_tables = state.table.block_tables
        num_preemptions = state.num_preemptions
        for j in entering:
            req = seqs[j]
            if req.status is not RequestStatus.RUNNING:  # preempted for an earlier decode
                continue
            if not blocks.num_available and not state.make_room(req, seqs[:j]):
                break  # req itself was preempted: it was the last in line, and so were those after it
            b = blocks.allocate(1)[0]
            block_tables[req.row, len(req.block_ids)] = b
            req.block_ids.append(b)
            if state.config.sliding_window:
                # The block just entered starts at the query's position: the window ends there.
                state.release_before_window(req, (len(req.block_ids) - 1) * state.block_size)
        return state.num_preemptions != num_preemptions
