"""Admission: requests into the waiting queue (new, or resubmitted after a fault) and out of the
scheduler by abort; the queue's bound (overload is a clear error, not unbounded memory)."""

from __future__ import annotations

import bisect

from services.scheduler.request import Request, RequestStatus
from services.scheduler.results import RequestOutput, finish_reason
from services.scheduler.state import SchedulerState, sort_key


class Overloaded(RuntimeError):
    """The waiting queue is full: the request is refused rather than queued without bound."""


class PromptTooLong(ValueError):
    """Prompt plus outputs leave no room to generate under max_model_len."""


class Admission:
    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.next_arrival = 0
        self.num_unknown_aborts = 0

    def add(self, req: Request) -> RequestOutput | None:
        """Queue a request; a live request with the same id is replaced (resubmission).

        A resubmitted request whose outputs already meet a finish condition is not queued: its
        final (empty) output is returned instead. Raises `PromptTooLong`, `Overloaded`, or
        ValueError for an empty prompt.
        """
        state = self.state
        config = state.config
        if not req.num_prompt_tokens:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        old = state.requests.get(req.request_id)
        if req.output_ids:
            reason = finish_reason(
                req.params,
                req.output_ids[-1],
                req.num_output_tokens,
                req.num_tokens,
                state.eos_token_ids,
                config.max_model_len,
            )
            if reason is not None:
                if old is not None:
                    state.drop(old, RequestStatus.ABORTED)
                req.status = RequestStatus.FINISHED
                req.finish_reason = reason
                return RequestOutput(
                    req.request_id,
                    req.frontend_id,
                    req.num_output_tokens,
                    [],
                    [],
                    [],
                    reason,
                    req.num_prompt_tokens,
                    0,
                )
        if req.num_tokens >= config.max_model_len:
            raise PromptTooLong(
                f"request {req.request_id!r}: {req.num_prompt_tokens} prompt + {req.num_output_tokens} output "
                f"tokens leave no room under max_model_len={config.max_model_len}"
            )
        if old is not None:
            req.arrival_order = old.arrival_order  # a resubmission keeps its place in line
            state.drop(old, RequestStatus.ABORTED)
        else:
            # A request that the next step can give a free sequence slot is not waiting for room:
            # only the queue past the free slots counts against the bound, so a burst into an
            # idle engine fills its slots instead of being refused.
            free_slots = config.max_num_seqs - len(state.running)
            if len(state.waiting) - free_slots >= config.max_num_waiting:
                raise Overloaded(
                    f"scheduler overloaded: {len(state.waiting)} requests already waiting for "
                    f"{free_slots} free sequence slots (max_num_waiting={config.max_num_waiting}); retry later"
                )
            req.arrival_order = self.next_arrival
            self.next_arrival += 1
        req.status = RequestStatus.WAITING
        state.requests[req.request_id] = req
        bisect.insort(state.waiting, req, key=sort_key)
        return None

    def abort(self, request_id: str) -> bool:
        """Drop a live request without further output; False (and counted) when it is unknown."""
        req = self.state.requests.get(request_id)
        if req is None:
            self.num_unknown_aborts += 1
            return False
        self.state.drop(req, RequestStatus.ABORTED)
        req.finish_reason = "abort"
        return True
