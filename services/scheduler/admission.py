"""Admission: requests into the waiting queue (new, or resubmitted after a fault) and out of the
scheduler by abort; the queue's bound (overload is a clear error, not unbounded memory). A
constrained request whose grammar is not compiled yet waits outside the queue until
`poll_compiling` lets it in (services/scheduler/grammars.py)."""

from __future__ import annotations

import bisect

from services.common.grammar_compiler import GrammarError
from services.scheduler.grammars import allowed_mask, matcher_for
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
            raise ValueError("the prompt is empty")
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
                    req.tokenizer_id,
                    req.num_output_tokens,
                    [],
                    [],
                    [],
                    reason,
                    req.num_prompt_tokens,
                    0,
                )
        budget = config.engine.max_num_batched_tokens
        if config.pooling and req.num_prompt_tokens > budget:
            # An embedding input runs whole in one step (mean pooling reads all of it at once).
            raise PromptTooLong(
                f"an embedding input of {req.num_prompt_tokens} tokens is over "
                f"the {budget} one step holds (engine.max_num_batched_tokens)"
            )
        end = 0
        for image in req.images:  # each computes whole in one step, its tokens in the prompt
            if (
                image.start < end
                or image.start + image.num_tokens > req.num_prompt_tokens
                or image.num_tokens < 1
                or image.grid_width < 0
                or (image.grid_width and image.num_tokens % image.grid_width)
            ):
                raise ValueError(
                    "the images overlap, lie outside the prompt, or have "
                    "a grid width that does not divide their tokens"
                )
            if image.num_tokens > budget:
                raise ValueError(
                    f"an image of {image.num_tokens} tokens is over the {budget} "
                    "one step holds (engine.max_num_batched_tokens)"
                )
            end = image.start + image.num_tokens
        generates = req.params.embed is None  # an embedding's input may fill the context: no output
        if req.num_tokens + generates > config.max_model_len:
            raise PromptTooLong(
                f"{req.num_prompt_tokens} prompt + {req.num_output_tokens} output "
                f"tokens leave no room under max_model_len={config.max_model_len}"
                if generates
                else f"an input of {req.num_prompt_tokens} tokens is over "
                f"max_model_len={config.max_model_len}"
            )
        if req.params.allowed_token_ids is not None and req.allowed_mask is None:
            self._check_allowed(req)
            req.allowed_mask = allowed_mask(req.params.allowed_token_ids, state.mask_words)
        spec = req.params.structured
        if spec is not None:
            if state.grammars is None:
                raise GrammarError("structured: this engine has no grammar compiler")
            req.grammar_future = state.grammars.submit(spec)
            if req.grammar_future.done():  # cached: ready now (raises GrammarError)
                req.grammar = matcher_for(req, req.grammar_future)
                req.grammar_future = None
        if old is not None:
            req.arrival_order = old.arrival_order  # a resubmission keeps its place in line
            state.drop(old, RequestStatus.ABORTED)
        else:
            # A request that the next step can give a free sequence slot is not waiting for room:
            # only the queue past the free slots counts against the bound, so a burst into an
            # idle engine fills its slots instead of being refused.
            free_slots = config.engine.max_num_seqs - len(state.running)
            num_waiting = len(state.waiting) + len(state.compiling)
            if num_waiting - free_slots >= config.engine.max_num_waiting:
                raise Overloaded(
                    f"scheduler overloaded: {num_waiting} requests already waiting for "
                    f"{free_slots} free sequence slots (max_num_waiting={config.engine.max_num_waiting}); retry later"
                )
            req.arrival_order = self.next_arrival
            self.next_arrival += 1
        state.requests[req.request_id] = req
        if req.grammar_future is not None:
            req.status = RequestStatus.COMPILING
            state.compiling.append(req)
            return None
        if req.grammar is not None and req.grammar.is_terminated:
            return self._finish_complete(req)
        req.status = RequestStatus.WAITING
        bisect.insort(state.waiting, req, key=sort_key)
        return None

    def _check_allowed(self, req: Request) -> None:
        """Refuse allowed_token_ids that leave nothing to sample at some position whatever the
        output: every allowed token a one-token bad word, or, under min_tokens, eos (unless
        ignore_eos) or a stop id. Conflicts that depend on the output (a grammar's, a longer bad
        word's) fail the request where they happen (grammars.py `GrammarPlan`)."""
        p = req.params
        assert p.allowed_token_ids is not None
        if not self.state.mask_words:
            raise ValueError("allowed_token_ids: this engine does not know its vocabulary's size")
        holds_back = p.min_tokens > req.num_output_tokens
        if not holds_back and (req.bad_words is None or not req.bad_words.always):
            return  # nothing bans a token at every position (a set of a vocabulary's ids is not free)
        left = set(p.allowed_token_ids)
        if req.bad_words is not None:
            left -= set(req.bad_words.always)
            if not left:
                raise ValueError("allowed_token_ids: bad_words ban every allowed token")
        if holds_back:
            held = set(p.stop_token_ids) | (set() if p.ignore_eos else self.state.eos_token_ids)
            if left <= held:
                raise ValueError(
                    "allowed_token_ids: every allowed token is eos or a stop token id, which min_tokens "
                    f"holds back for the first {p.min_tokens} tokens: nothing could be sampled"
                )

    def poll_compiling(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Queue the constrained requests whose compile is done, in arrival order. Returns those
        whose outputs already complete their grammar (a resubmission: finished, with no more
        output), and those that failed (their constraint does not compile), each with its error."""
        state = self.state
        if not state.compiling or not any(req.grammar_future.done() for req in state.compiling):  # type: ignore[union-attr]
            return [], []
        finished: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for req in [r for r in state.compiling if r.grammar_future.done()]:  # type: ignore[union-attr]
            state.compiling.remove(req)
            future, req.grammar_future = req.grammar_future, None
            try:
                req.grammar = matcher_for(req, future)  # type: ignore[arg-type]
            except GrammarError as exc:
                del state.requests[req.request_id]
                req.status = RequestStatus.ABORTED
                failed.append((req, str(exc)))
                continue
            if req.grammar.is_terminated:
                self._finish_complete(req)
                finished.append(req)
                continue
            req.status = RequestStatus.WAITING
            bisect.insort(state.waiting, req, key=sort_key)
        return finished, failed

    def _finish_complete(self, req: Request) -> RequestOutput:
        """A request whose outputs complete its grammar: nothing more can follow, so it is done."""
        self.state.requests.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = "stop"
        return RequestOutput(
            req.request_id,
            req.tokenizer_id,
            req.num_output_tokens,
            [],
            [],
            [],
            "stop",
            req.num_prompt_tokens,
            0,
        )

    def abort(self, request_id: str) -> bool:
        """Drop a live request without further output; False (and counted) when it is unknown."""
        req = self.state.requests.get(request_id)
        if req is None:
            self.num_unknown_aborts += 1
            return False
        self.state.drop(req, RequestStatus.ABORTED)
        req.finish_reason = "abort"
        return True
