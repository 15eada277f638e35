"""Prefill: the prompts (or recomputes) of a step after its decodes. First the running sequences
whose prompt is under way, then waiting requests, best first, each from its prefix-cache hits on;
each chunked to what is left of the token budget and of the free blocks. A waiting request that
gets a chunk enters the running line. When every layer has a sliding window, each chunk first
gives back the blocks wholly behind the window of its first query (as decodes do). A request
with a LoRA adapter enters only with a slot for it (lora_residency.py)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.scheduler.request import Request, RequestStatus
from services.scheduler.state import SchedulerState


@dataclass(slots=True)
class Chunks:
    """The prefill chunks of one step, in plan order after its decodes."""

    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # computed tokens before the chunk
    num_new: list[int] = field(default_factory=list)


NO_CHUNKS = Chunks()  # never appended to: `plan` fills only a Chunks of its own
QUEUE_TIMES_KEPT = 4096


class Prefill:
    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        # Seconds from arrival (Request.arrival_time, monotonic) to first being scheduled, for the
        # process to drain into its metrics; bounded in case nobody does.
        self.queue_times: deque[float] = deque(maxlen=QUEUE_TIMES_KEPT)

    def plan(self, partial: list[Request], seqs: list[Request], budget: int) -> Chunks:
        """Chunks for `partial` (running, prompt under way), then for waiting requests, within
        `budget` tokens, appended to the step's `seqs` (its decodes so far). Making room for a
        chunk preempts from the back of the line, never a sequence already in `seqs`."""
        state = self.state
        if not partial and not state.waiting:  # steady decode: nothing to prefill
            return NO_CHUNKS
        bs = state.block_size
        blocks = state.blocks
        num_computed = state.table.num_computed
        is_windowed = state.config.sliding_window > 0
        is_whole = bool(state.config.pooling)  # an embedding run never chunks a prompt
        chunks = Chunks()

        # Prompts (or recomputes) already under way.
        for req in partial:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted for a decode
                continue
            done = int(num_computed[req.row])
            if is_windowed:
                # No query of this chunk (the first at `done`) or after it reads before its window:
                # those blocks go back before the chunk takes new ones.
                state.release_before_window(req, done)
            room = (len(req.block_ids) + blocks.num_available) * bs - done
            if room <= 0:
                if not state.make_room(req, seqs):
                    continue
                room = (len(req.block_ids) + blocks.num_available) * bs - done
            n = req.image_cut(done + min(req.num_tokens - done, budget, room)) - done
            if n <= 0:
                continue  # its next image needs more room than this step has left
            state.grow(req, done + n)
            self._add(chunks, seqs, req, done, n)
            num_computed[req.row] = done + n
            budget -= n

        # Waiting requests, best first; stop at the first that does not fit (no overtaking).
        waiting = state.waiting
        while waiting and budget > 0 and len(state.running) < state.config.engine.max_num_seqs:
            req = waiting[0]
            self.choose_rope(req)
            hits = self._prefix_hits(req)
            done = len(hits) * bs
            room = (len(hits) + blocks.num_available_besides(hits)) * bs - done
            n = req.image_cut(done + min(req.num_tokens - done, budget, room)) - done
            if n <= 0 or (is_whole and n < req.num_tokens):
                break  # an embedding input runs whole: it waits for a step with room for all of it
            if req.params.adapter:
                # Its adapter's slot, or one that a swap frees; none: it waits (no overtaking).
                req.lora_slot = state.lora.acquire(req.params.adapter)
                if req.lora_slot < 0:
                    break
            waiting.pop(0)
            # A request's wait is counted once: not again after a preemption, nor when it comes back
            # with output (resubmitted to a restarted scheduler, or resumed through another tokenizer).
            if req.num_preemptions == 0 and req.num_output_tokens == 0:
                req.scheduled_at = time.monotonic()
                self.queue_times.append(req.scheduled_at - req.arrival_time)
            blocks.acquire(hits)
            req.block_ids = hits
            req.num_registered_blocks = len(hits)
            # Usage's cached prompt tokens: a preempted or resubmitted request looks up its output
            # so far too, whose hits are no prompt tokens (vLLM's never exceed the prompt).
            req.num_cached_tokens = min(done, req.num_prompt_tokens)
            if req.params.report_prompt_progress and req.num_output_tokens == 0:
                state.prompt_progress.append((req, done))  # its prefill starts: the cache's part
            self.num_prefix_query_tokens += req.num_tokens
            self.num_prefix_hit_tokens += done
            state.grow(req, done + n)
            state.table.assign(req, done + n)
            state.start_running(req)
            if is_windowed:  # prefix hits wholly behind the first chunk's window
                state.release_before_window(req, done)
            self._add(chunks, seqs, req, done, n)
            budget -= n
        return chunks

    @staticmethod
    def _add(chunks: Chunks, seqs: list[Request], req: Request, done: int, n: int) -> None:
        seqs.append(req)
        chunks.rows.append(req.row)
        chunks.starts.append(done)
        chunks.num_new.append(n)

    def choose_rope(self, req: Request) -> None:
        """LongRoPE: a request longer than the original length rotates every position with the
        long factors, as HF's forward over its whole sequence does (docs/models.md); a change of
        regime drops its block hashes, which chain from it (Request.hash_root)."""
        long_from = self.state.config.long_rope_from
        is_long = 0 < long_from < req.num_tokens
        if is_long != req.is_long_rope:
            req.is_long_rope = is_long
            req.block_hashes = []

    def _prefix_hits(self, req: Request) -> list[int]:
        """Cached blocks covering a prefix of the request, always leaving its last token to compute
        (so there are logits to sample, and no write lands in a shared block). A request still
        collecting prompt logprobs takes none: the worker must compute every prompt position's
        logits, which cached blocks would skip (its own blocks still join the cache). Nor does an
        embedding input: its pooling reads every token's state, in one step."""
        blocks = self.state.blocks
        if not blocks.enable_prefix_caching or req.scores_from is not None or self.state.config.pooling:
            return []
        bs = self.state.block_size
        num_full = (req.num_tokens - 1) // bs
        if num_full > len(req.block_hashes):
            start = len(req.block_hashes) * bs
            blocks.extend_hashes(
                req.block_hashes,
                req.token_slice(start, num_full * bs),
                req.hash_root,
                req.block_salts(len(req.block_hashes), num_full, bs),
            )
        hits = blocks.match_prefix(req.block_hashes[:num_full])
        # The worker places an image's embeddings whole: a hit ending inside one stops before it.
        return hits[: req.image_cut(len(hits) * bs) // bs]
