"""Results: a step's sampled tokens applied to its requests (`Results.update`), the finish checks
(eos, stop ids, length), and the per-step outputs for the detokenizers (`StepOutputs`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

import msgspec
import numpy as np

from ipc.messages import SamplingParams, StepTokens
from services.common.pooling import finish_vector
from services.scheduler.decode import SteadyDecode
from services.scheduler.grammar_matcher import GrammarViolation
from services.scheduler.plan import UPDATE_COLUMNS, ScheduledStep
from services.scheduler.request import Request, RequestStatus
from services.scheduler.speculation import Speculation
from services.scheduler.state import SchedulerState

# The autoscaler's TTFT signal: the first tokens of the last TTFT_WINDOW_S seconds (at most
# FIRST_TOKEN_TIMES_KEPT of them, the newest), so that a burst shows within one heartbeat and a
# quiet minute forgets it.
TTFT_WINDOW_S = 30.0
FIRST_TOKEN_TIMES_KEPT = 1024


class RequestOutput(msgspec.Struct, gc=False):
    """New tokens of one request from one step; `start_index` is the output index of the first."""

    request_id: str
    tokenizer_id: int
    start_index: int
    new_token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


class RequestFailure(msgspec.Struct, frozen=True, gc=False):
    """A request failed while it generated (its grammar went past a budget or a limit)."""

    request_id: str
    tokenizer_id: int
    code: str  # an ipc.messages.ErrorCode
    message: str


class PromptScoreArrays(NamedTuple):
    """A step result's prompt logprobs (ipc/step_plan.py STEP_RESULT), one entry per scored
    position of the step's `prompt_spans`, in order."""

    logprobs: np.ndarray  # [Q] float32
    ranks: np.ndarray  # [Q] int32
    top_ids: np.ndarray  # [Q, K] int32
    top_logprobs: np.ndarray  # [Q, K] float32


class EmittedArrays(NamedTuple):
    """A step result's new tokens of its verifying rows (ipc/step_plan.py STEP_RESULT)."""

    ids: np.ndarray  # [S, E] int32
    logprobs: np.ndarray  # [S, E] float32
    counts: np.ndarray  # [S] int32
    top_ids: np.ndarray | None = None  # [S, E, K] int32, K the step's most top logprobs
    top_logprobs: np.ndarray | None = None  # [S, E, K] float32


NO_TOP_LOGPROBS: list[dict[int, float]] = []  # shared by outputs without top logprobs: never mutated


class StepOutputs:
    """One step's results, packed: one new token for each request that sampled, in plan order,
    as columns (lists and arrays) gathered from the plan table; a request that verified
    proposals has one entry per new token, consecutive and in order, after the others.

    `step_tokens()` is the wire message, made of the columns as they are (the per-step hot path);
    indexing or iterating gives a `RequestOutput` per request (for tests and tools)."""

    __slots__ = (
        "embeddings",
        "failures",
        "finish_reasons",
        "logprobs",
        "num_cached_tokens",
        "num_prompt_tokens",
        "request_ids",
        "start_indices",
        "token_ids",
        "tokenizer_ids",
        "top_logprobs",
    )

    def __init__(
        self,
        request_ids: list[str],
        tokenizer_ids: list[int],
        start_indices: np.ndarray,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        top_logprobs: list[list[dict[int, float]]],
        finish_reasons: list[str | None],
        num_prompt_tokens: list[int],
        num_cached_tokens: list[int],
    ) -> None:
        self.request_ids = request_ids
        self.tokenizer_ids = tokenizer_ids
        self.start_indices = start_indices  # [N] int32: output index of each new token
        self.token_ids = token_ids  # [N] int32
        self.logprobs = logprobs  # [N] float32
        self.top_logprobs = top_logprobs
        self.finish_reasons = finish_reasons
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        # Requests this step failed, gone from the scheduler: their error goes to their tokenizer
        # (an error reply with its reason), and their token of this step nowhere.
        self.failures: list[RequestFailure] = []
        # An embedding step's vectors, one per entry, as each request gets it (finish_vector);
        # None in a run that generates.
        self.embeddings: list[np.ndarray] | None = None

    @classmethod
    def empty(cls) -> StepOutputs:
        return cls(
            [], [], np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32), [], [], [], []
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    def extend(self, more: StepOutputs) -> StepOutputs:
        """These outputs followed by `more`'s, as new columns (the lists may be shared)."""
        joined = StepOutputs(
            self.request_ids + more.request_ids,
            self.tokenizer_ids + more.tokenizer_ids,
            np.concatenate((self.start_indices, more.start_indices)),
            np.concatenate((self.token_ids, more.token_ids)),
            np.concatenate((self.logprobs, more.logprobs)),
            self.top_logprobs + more.top_logprobs,
            self.finish_reasons + more.finish_reasons,
            self.num_prompt_tokens + more.num_prompt_tokens,
            self.num_cached_tokens + more.num_cached_tokens,
        )
        joined.failures = self.failures + more.failures
        if self.embeddings is not None or more.embeddings is not None:
            joined.embeddings = (self.embeddings or []) + (more.embeddings or [])
        return joined

    def __getitem__(self, j: int) -> RequestOutput:
        return RequestOutput(
            self.request_ids[j],
            self.tokenizer_ids[j],
            int(self.start_indices[j]),
            [int(self.token_ids[j])],
            [float(self.logprobs[j])],
            list(self.top_logprobs[j]),
            self.finish_reasons[j],
            self.num_prompt_tokens[j],
            self.num_cached_tokens[j],
        )

    def __iter__(self) -> Iterator[RequestOutput]:
        return (self[j] for j in range(len(self)))

    def step_tokens(self, entries: list[int] | None = None) -> StepTokens:
        """The wire message of these outputs (of `entries` only, when given), columns as they are."""

        def listed(column: list) -> list:
            return column if entries is None else [column[e] for e in entries]

        def packed(column: np.ndarray, dtype: str) -> bytes:
            return (column if entries is None else column[entries]).astype(dtype, copy=False).tobytes()

        return StepTokens(
            listed(self.request_ids),
            listed(self.tokenizer_ids),
            packed(self.start_indices, "<i4"),
            packed(self.token_ids, "<i4"),
            packed(self.logprobs, "<f4"),
            listed(self.top_logprobs),
            listed(self.finish_reasons),
            listed(self.num_prompt_tokens),
            listed(self.num_cached_tokens),
        )


def advance_grammar(req: Request, token: int, reason: str | None) -> tuple[str | None, RequestFailure | None]:
    """A constrained request's matcher advanced by its new `token`, whose finish reason so far
    is `reason`: the reason then ("stop" once nothing but eos could follow, so that no step is
    spent on it; complete on the last token max_tokens allowed is complete, not cut off), or,
    with None, the failure: its mask went over its time budget (`GrammarMatcher.failure`), or
    the grammar refused the token, past the engine's limits (the constraint's fault) or by a bug
    (the worker samples under the mask); either way the request must not drift on
    unconstrained."""
    matcher = req.grammar
    assert matcher is not None
    kind = req.params.structured.kind if req.params.structured else "grammar"
    if matcher.failure is not None:
        return None, RequestFailure(
            req.request_id, req.tokenizer_id, "invalid_request", f"structured.{kind}: {matcher.failure}"
        )
    try:
        matcher.advance((token,))
    except GrammarViolation as exc:
        code = "invalid_request" if exc.over_limits else "internal"
        message = f"structured.{kind}: while generating: {exc}"[:600]
        return None, RequestFailure(req.request_id, req.tokenizer_id, code, message)
    if reason in (None, "length") and matcher.is_terminated:
        return "stop", None
    return reason, None


def finish_reason(
    params: SamplingParams,
    token: int,
    num_outputs: int,
    num_tokens: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> str | None:
    """Why a request stops once `token` is its latest output (with these counts), or None."""
    if num_outputs > params.min_tokens and (
        (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
    ):
        return "stop"
    # max_tokens None (the tokenizer fills in its default): only max_model_len bounds it.
    if (params.max_tokens is not None and num_outputs >= params.max_tokens) or num_tokens >= max_model_len:
        return "length"
    return None


class Results:
    def __init__(self, state: SchedulerState, decode: SteadyDecode, speculation: Speculation | None) -> None:
        self.state = state
        self.decode = decode  # keeps the running line's per-row lists
        self.speculation = speculation  # counts what verifications accepted
        # (when, seconds from arrival) of each first output token, for the autoscaler's TTFT.
        self.first_token_times: deque[tuple[float, float]] = deque(maxlen=FIRST_TOKEN_TIMES_KEPT)

    def _on_first_token(self, req: Request, now: float) -> None:
        self.first_token_times.append((now, now - req.arrival_time))
        if req.scheduled_at is not None:
            req.first_token_at = now

    def recent_ttft_p90(self, window_s: float = TTFT_WINDOW_S) -> float:
        """The 90th percentile of the times to first token of the last `window_s` seconds (from
        the scheduler's receipt of each request), or 0.0 when no request got one in it."""
        since = time.monotonic() - window_s
        times = self.first_token_times
        while times and times[0][0] < since:
            times.popleft()
        return float(np.percentile([seconds for _, seconds in times], 90)) if times else 0.0

    def update(
        self,
        step: ScheduledStep,
        sampled_ids: np.ndarray,
        sampled_logprobs: np.ndarray,
        top_ids: np.ndarray | None = None,
        top_logprobs: np.ndarray | None = None,
        prompt_scores: PromptScoreArrays | None = None,
        emitted: EmittedArrays | None = None,
        pooled: np.ndarray | None = None,
    ) -> StepOutputs:
        """Apply one step's result: append sampled tokens (a verifying row's: all it emitted),
        finish sequences, cache full blocks, keep the prompt logprobs of the step's `prompt_spans`,
        and an embedding step's `pooled` vectors (one per sampled entry of StepOutputs).

        Entries of requests preempted, aborted or replaced since the step was planned are ignored.
        The result arrays may be views into a ring slot: nothing returned refers to them.
        """
        state = self.state
        table = state.table
        bs = state.block_size
        seqs = step.seqs
        rows = step.rows
        # A row's epoch moves when it is released (finish, abort, preemption, replacement);
        # when no row was released since planning, every entry is live.
        is_all_live = table.num_releases == step.num_releases
        live = None if is_all_live else table.epoch.take(rows) == step.row_epochs
        # Prompt blocks filled by this step join the prefix cache at once, for requests that
        # arrive while this one runs; blocks of generated tokens join when the sequence leaves.
        # Not a verifying row's: its blocks may hold rejected proposals. A chunk of a request
        # that asked for its prompt's progress, before its first output, is reported.
        first_chunk = step.num_decodes + step.num_verifying
        if first_chunk < len(seqs):
            ends = (step.starts + step.num_new_tokens).tolist()
            is_caching = state.blocks.enable_prefix_caching
            for i in range(first_chunk, len(seqs)):
                req = seqs[i]
                if live is not None and not live[i]:
                    continue
                if is_caching and ends[i] // bs > req.num_registered_blocks:
                    state.register_blocks(req, ends[i] // bs)
                if req.params.report_prompt_progress and req.num_output_tokens == 0:
                    state.prompt_progress.append((req, ends[i]))
        if step.prompt_spans and prompt_scores is not None:
            self._keep_prompt_scores(step, live, prompt_scores)
        if live is None and step.num_decodes == len(seqs):  # steady decode: all of them
            sampled = np.arange(len(seqs))
        else:
            sampled = np.flatnonzero(step.is_sampled if live is None else live & step.is_sampled)
        if step.proposals:
            is_verifying = (sampled >= step.num_decodes) & (sampled < first_chunk)
            verified = self._apply_verifications(step, sampled[is_verifying], emitted)
            sampled = sampled[~is_verifying]
            return self._apply_samples(
                step, sampled, live, sampled_ids, sampled_logprobs, top_ids, top_logprobs
            ).extend(verified)
        outputs = self._apply_samples(
            step, sampled, live, sampled_ids, sampled_logprobs, top_ids, top_logprobs
        )
        if pooled is not None:
            normalize = state.config.normalize
            outputs.embeddings = [
                finish_vector(pooled[i], self._dimensions(seqs[i].params), normalize)
                for i in sampled.tolist()
            ]
        return outputs

    @staticmethod
    def _dimensions(params: SamplingParams) -> int:
        return params.embed.dimensions if params.embed is not None else 0

    def _apply_samples(
        self,
        step: ScheduledStep,
        sampled: np.ndarray,
        live: np.ndarray | None,
        sampled_ids: np.ndarray,
        sampled_logprobs: np.ndarray,
        top_ids: np.ndarray | None,
        top_logprobs: np.ndarray | None,
    ) -> StepOutputs:
        """Append the one token each of the step's entries `sampled` sampled (see `update`)."""
        state = self.state
        table = state.table
        seqs = step.seqs
        rows = step.rows
        num_sampled = len(sampled)
        if num_sampled == 0:
            return StepOutputs.empty()
        all_sampled = num_sampled == len(seqs)
        sampled_rows = rows if all_sampled else rows[sampled]
        # Copies, never views of the result slot.
        tokens = np.array(sampled_ids if all_sampled else sampled_ids[sampled], np.int32)
        logprobs = np.array(sampled_logprobs if all_sampled else sampled_logprobs[sampled], np.float32)
        table.last_token.put(sampled_rows, tokens)
        known, check_from, num_prompt = table.ints[UPDATE_COLUMNS].take(sampled_rows, axis=1)
        num_tokens = known + 1
        table.num_tokens.put(sampled_rows, num_tokens)
        is_first = known == num_prompt
        if np.count_nonzero(is_first):
            now = time.monotonic()
            for j in np.flatnonzero(is_first).tolist():
                self._on_first_token(seqs[int(sampled[j])], now)
        # Finish checks, vectorized over the batch; only candidates get a look in Python.
        candidates = num_tokens >= check_from
        eos_token_ids = state.eos_token_ids
        for e in eos_token_ids:
            is_eos = tokens == e
            if np.count_nonzero(is_eos):
                candidates |= is_eos & (num_tokens > table.eos_from.take(sampled_rows))
        num_logprobs = table.num_logprobs.take(sampled_rows) if table.num_logprob_rows else None
        output_lists, request_ids, tokenizer_ids, prompt_lens, cached_lens = self.decode.row_columns(
            sampled_rows, step.line_version if all_sampled else -1
        )

        token_list = tokens.tolist()
        # list.append over the rows' output lists, run by map() in C (append returns None).
        any(map(list.append, output_lists, token_list))
        reasons: list[str | None] = [None] * num_sampled
        finishing = np.flatnonzero(candidates).tolist() if np.count_nonzero(candidates) else []
        max_model_len = state.config.max_model_len
        for j in finishing:
            req = seqs[int(sampled[j])]
            reasons[j] = finish_reason(
                req.params, token_list[j], req.num_output_tokens, req.num_tokens, eos_token_ids, max_model_len
            )
        failures: list[RequestFailure] = []
        unmasked: set[int] = set()  # entries whose row had nothing to sample: failed, not advanced
        empty = step.grammar.empty if step.grammar is not None else None
        if empty:
            finishing = self._fail_empty(seqs, sampled, empty, reasons, finishing, failures, unmasked)
        if table.num_grammar_rows:
            finishing = self._advance_grammars(
                seqs, sampled, sampled_rows, token_list, reasons, finishing, failures, unmasked
            )
        tops: list[list[dict[int, float]]] = [NO_TOP_LOGPROBS] * num_sampled
        if top_ids is not None and top_logprobs is not None and num_logprobs is not None:
            for j in np.flatnonzero(num_logprobs).tolist():
                k = int(num_logprobs[j])
                i = int(sampled[j])
                tops[j] = [dict(zip(top_ids[i, :k].tolist(), top_logprobs[i, :k].tolist(), strict=True))]
        if table.history:  # only rows that apply penalties have one
            for j in np.flatnonzero(table.needs_history.take(sampled_rows)).tolist():
                req = seqs[int(sampled[j])]
                table.history[req.row][req.num_tokens - 1] = token_list[j]
        outputs = StepOutputs(
            request_ids,
            tokenizer_ids,
            known - num_prompt,  # the new token's output index
            tokens,
            logprobs,
            tops,
            reasons,
            prompt_lens,
            cached_lens,
        )
        for j in finishing:
            if reasons[j] is not None:
                req = seqs[int(sampled[j])]
                state.drop(req, RequestStatus.FINISHED)
                req.finish_reason = reasons[j]
        if failures:
            outputs.failures = failures
            for failure in failures:
                req = state.requests[failure.request_id]
                state.drop(req, RequestStatus.ABORTED)
                req.finish_reason = "error"
        return outputs

    def _apply_verifications(
        self, step: ScheduledStep, verifying: np.ndarray, emitted: EmittedArrays | None
    ) -> StepOutputs:
        """Append what each live verifying entry emitted, token by token with the finish checks
        of each (a token that finishes the request drops those after it), then roll its compute
        back to its kept tokens: it holds the blocks of those alone, and the next step writes over
        the KV slots of the rejected proposals."""
        if not len(verifying):
            return StepOutputs.empty()
        if emitted is None:
            raise ValueError("a step with proposals needs its emitted tokens")
        state = self.state
        table = state.table
        bs = state.block_size
        columns: tuple[list, ...] = ([], [], [], [], [], [], [], [], [])
        (
            request_ids,
            tokenizer_ids,
            start_indices,
            token_ids,
            logprobs,
            tops,
            reasons,
            prompt_lens,
            cached_lens,
        ) = columns
        max_model_len = state.config.max_model_len
        failures: list[RequestFailure] = []
        empty = step.grammar.empty if step.grammar is not None else {}
        for i in verifying.tolist():
            req = step.seqs[i]
            failure = None
            # The first position of its span whose row had nothing to sample (none: past the span)
            empty_at, empty_message = empty.get(i, (len(step.proposals[i - step.num_decodes]) + 1, ""))
            row = req.row
            num_emitted = int(emitted.counts[i])
            proposal = step.proposals[i - step.num_decodes]
            assert self.speculation is not None  # only it proposes
            self.speculation.applied(req, len(proposal), num_emitted)
            if req.num_output_tokens == 0 and num_emitted:  # its first step verified proposals
                self._on_first_token(req, time.monotonic())
            reason = None
            history = table.history.get(row)  # only rows that apply penalties have one
            k = req.params.logprobs or 0
            for j, (token, logprob) in enumerate(
                zip(
                    emitted.ids[i, :num_emitted].tolist(),
                    emitted.logprobs[i, :num_emitted].tolist(),
                    strict=True,
                )
            ):
                if j == empty_at:  # its draw here was under no mask: the request fails before it
                    failure = RequestFailure(
                        req.request_id, req.tokenizer_id, "invalid_request", empty_message
                    )
                    break
                req.output_ids.append(token)
                if history is not None:
                    history[req.num_tokens - 1] = token
                reason = finish_reason(
                    req.params,
                    token,
                    req.num_output_tokens,
                    req.num_tokens,
                    state.eos_token_ids,
                    max_model_len,
                )
                if req.grammar is not None:
                    reason, failure = advance_grammar(req, token, reason)
                request_ids.append(req.request_id)
                tokenizer_ids.append(req.tokenizer_id)
                start_indices.append(req.num_output_tokens - 1)
                token_ids.append(token)
                logprobs.append(logprob)
                if k and emitted.top_ids is not None and emitted.top_logprobs is not None:
                    top = zip(
                        emitted.top_ids[i, j, :k].tolist(),
                        emitted.top_logprobs[i, j, :k].tolist(),
                        strict=True,
                    )
                    tops.append([dict(top)])
                else:
                    tops.append(NO_TOP_LOGPROBS)
                reasons.append(reason)
                prompt_lens.append(req.num_prompt_tokens)
                cached_lens.append(req.num_cached_tokens)
                if reason is not None or failure is not None:
                    break
            table.last_token[row] = req.last_token_id
            table.num_tokens[row] = req.num_tokens
            # The KV of every kept token but the last is computed (the last is the next input).
            num_computed = req.num_tokens - 1
            table.num_computed[row] = num_computed
            num_kept = -(-num_computed // bs)
            if len(req.block_ids) > num_kept:
                table.block_tables[row, num_kept : len(req.block_ids)] = 0
                state.blocks.release(req.block_ids[num_kept:])
                del req.block_ids[num_kept:]
            if failure is not None:  # the step's entries of a failed request go nowhere
                failures.append(failure)
                state.drop(req, RequestStatus.ABORTED)
                req.finish_reason = "error"
            elif reason is not None:
                state.drop(req, RequestStatus.FINISHED)
                req.finish_reason = reason
        outputs = StepOutputs(
            request_ids,
            tokenizer_ids,
            np.array(start_indices, np.int32),
            np.array(token_ids, np.int32),
            np.array(logprobs, np.float32),
            tops,
            reasons,
            prompt_lens,
            cached_lens,
        )
        outputs.failures = failures
        return outputs

    @staticmethod
    def _keep_prompt_scores(step: ScheduledStep, live: np.ndarray | None, scores: PromptScoreArrays) -> None:
        """Each live span's entries to its request (copied out of the result slot)."""
        at = 0
        for i, first, count in step.prompt_spans:
            if live is None or live[i]:
                req = step.seqs[i]
                k = req.params.prompt_logprobs or 0
                tops = [
                    dict(zip(ids, lps, strict=True))
                    for ids, lps in zip(
                        scores.top_ids[at : at + count, :k].tolist(),
                        scores.top_logprobs[at : at + count, :k].tolist(),
                        strict=True,
                    )
                ]
                assert req.prompt_scores is not None  # only such requests have spans
                req.prompt_scores.add(
                    first + 1,
                    scores.logprobs[at : at + count].tolist(),
                    scores.ranks[at : at + count].tolist(),
                    tops,
                )
            at += count

    @staticmethod
    def _fail_empty(
        seqs: list[Request],
        sampled: np.ndarray,
        empty: dict[int, tuple[int, str]],
        reasons: list[str | None],
        finishing: list[int],
        failures: list[RequestFailure],
        unmasked: set[int],
    ) -> list[int]:
        """Fail the entries whose mask row had no token left (grammars.py `GrammarPlan.empty`):
        their token was drawn under no mask and goes nowhere. Returns `finishing` without them;
        adds them to `unmasked`."""
        for j, i in enumerate(sampled.tolist()):
            if i in empty:
                req = seqs[i]
                failures.append(
                    RequestFailure(req.request_id, req.tokenizer_id, "invalid_request", empty[i][1])
                )
                reasons[j] = None
                unmasked.add(j)
        return [j for j in finishing if j not in unmasked]

    def _advance_grammars(
        self,
        seqs: list[Request],
        sampled: np.ndarray,
        sampled_rows: np.ndarray,
        tokens: list[int],
        reasons: list[str | None],
        finishing: list[int],
        failures: list[RequestFailure],
        unmasked: set[int],
    ) -> list[int]:
        """Advance the matchers of the constrained rows by their new token (`advance_grammar`);
        returns `finishing` with the rows whose grammar is now complete. Appends their failures
        to `failures`; the reasons of those stay None. The `unmasked` entries (failed already)
        are left alone."""
        constrained = np.flatnonzero(self.state.table.constrained.take(sampled_rows)).tolist()
        if not constrained:
            return finishing
        ending = set(finishing)
        for j in constrained:
            if j in unmasked:
                continue
            reasons[j], failure = advance_grammar(seqs[int(sampled[j])], tokens[j], reasons[j])
            if failure is not None:
                failures.append(failure)
                ending.discard(j)
            elif reasons[j] is not None:
                ending.add(j)
        return sorted(ending)
