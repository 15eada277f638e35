"""One request as the scheduler sees it: its tokens, its blocks and where its compute stands."""

from __future__ import annotations

import enum
import hashlib
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ipc.messages import PromptImage, SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    from services.common.grammar_compiler import CompiledGrammar
    from services.scheduler.grammar_matcher import GrammarMatcher


LONG_ROPE_HASH_ROOT = b"long rope"


class RequestStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    ABORTED = 3
    COMPILING = 4  # constrained, waiting for its grammar outside the waiting queue (grammars.py)


class PromptScores:
    """The prompt logprobs a request collected so far (params.prompt_logprobs), in order: entry j
    is prompt token j + 1's (token 0 has none). A chunk computed again (a preemption, a step
    retried) brings entries it already has: they are skipped by position, so each is kept once."""

    __slots__ = ("logprobs", "num_prompt_tokens", "ranks", "top_logprobs")

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top_logprobs: list[dict[int, float]] = []

    @property
    def num_scored(self) -> int:
        return len(self.logprobs)

    @property
    def is_complete(self) -> bool:
        return self.num_scored == self.num_prompt_tokens - 1

    def add(
        self, first_token: int, logprobs: list[float], ranks: list[int], tops: list[dict[int, float]]
    ) -> None:
        """Entries for prompt tokens `first_token`, `first_token + 1`, ...; those held are skipped."""
        skip = self.num_scored + 1 - first_token
        if skip < 0:  # a gap: never planned (scores start where the held ones end)
            raise ValueError(
                f"prompt scores from token {first_token}, holding {self.num_scored} from token 1"
            )
        self.logprobs += logprobs[skip:]
        self.ranks += ranks[skip:]
        self.top_logprobs += tops[skip:]


class BadWords:
    """A request's tokenized bad words (params.bad_words_ids), banned as vLLM bans them: at each
    sampled position, a word's last token is banned where the output so far ends with the word's
    other tokens; a one-token word is banned everywhere (`always`). Only the output counts, never
    the prompt: a word whose first tokens end the prompt is not banned at the first output token.

    `always` goes into the request's static logit bias (-inf); the multi-token words depend on
    the last sampled tokens, so a request that has one is never planned ahead of its sample
    (services/scheduler/decode.py) and each step asks `banned` afresh."""

    __slots__ = ("always", "longest", "prefixes")

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.always = sorted({int(ids[0]) for ids in sequences if len(ids) == 1})
        # (the word's tokens but its last, its last), once each
        words = {tuple(int(t) for t in ids) for ids in sequences if len(ids) > 1}
        self.prefixes = [(list(word[:-1]), word[-1]) for word in sorted(words)]
        self.longest = max((len(prefix) for prefix, _ in self.prefixes), default=0)

    def banned(self, output_ids: Sequence[int], extra: Sequence[int] = ()) -> list[int]:
        """The last tokens of the multi-token words whose other tokens end `output_ids` followed
        by `extra` (a verifying span's proposals before a position), in the words' order."""
        if not self.prefixes:
            return []
        tail = list(output_ids[-self.longest :]) + [int(t) for t in extra] if len(extra) else output_ids
        n = len(tail)
        return [
            last
            for prefix, last in self.prefixes
            if len(prefix) <= n and tail[n - 1] == prefix[-1] and list(tail[n - len(prefix) :]) == prefix
        ]


class Request:
    """Owns a request's token history (prompt + outputs so far), its KV blocks and its progress.

    While the request runs, how far its compute stands (tokens whose KV is, or is being, written)
    lives in its plan-table row with the other per-step counters (plan.py), so that a step
    advances every decode at once; a waiting request has computed nothing.
    """

    __slots__ = (
        "adapter_load",
        "allowed_mask",
        "arrival_order",
        "arrival_time",
        "bad_words",
        "block_hashes",
        "block_ids",
        "finish_reason",
        "first_token_at",
        "grammar",
        "grammar_future",
        "images",
        "is_long_rope",
        "lora_slot",
        "num_cached_tokens",
        "num_preemptions",
        "num_registered_blocks",
        "num_released_blocks",
        "output_ids",
        "params",
        "priority",
        "prompt_ids",
        "prompt_scores",
        "request_id",
        "row",
        "scheduled_at",
        "seed",
        "speculation_kept",
        "speculation_steps_off",
        "speculation_tried",
        "status",
        "tokenizer_id",
    )

    def __init__(
        self,
        request_id: str,
        tokenizer_id: int,
        prompt_ids: list[int] | np.ndarray,
        params: SamplingParams,
        output_ids: list[int] | np.ndarray | None = None,
        arrival_time: float = 0.0,
        images: Sequence[PromptImage] = (),
        adapter_load: int = 0,
    ) -> None:
        self.request_id = request_id
        self.tokenizer_id = tokenizer_id
        self.prompt_ids = np.ascontiguousarray(prompt_ids, dtype=np.int32)
        self.output_ids: list[int] = [] if output_ids is None else [int(t) for t in output_ids]
        self.params = params
        # Which load of its LoRA adapter's name it runs with (Adapters.load_count): a name unloaded
        # and loaded again may hold other weights, whose keys and values its blocks must not share.
        self.adapter_load = adapter_load
        # Its prompt's images (ipc/messages.py PromptImage), in order: each computes whole, in
        # one chunk, since its tokens attend to each other both ways.
        self.images = tuple(images)
        self.priority = params.priority
        self.arrival_time = arrival_time
        self.arrival_order = 0  # set by the scheduler at admission
        # The tokenizer assigns seeds; a stable fallback keeps a seedless request reproducible.
        self.seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode())
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0  # prefix-cache hits at the last admission
        self.num_preemptions = 0
        # When this scheduler first scheduled it and when its first output token came, for the
        # per-request prefill and inference times; None for a request that came back with output
        # (resubmitted, or resumed through another tokenizer): its start was elsewhere.
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of the tokens
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        # Leading blocks already given back because no layer's window reaches them any more
        # (SchedulerState.release_before_window); block_ids keeps their ids, which nothing reads.
        self.num_released_blocks = 0
        self.row = -1  # row in the plan table while running
        # Its own verifications' decaying counts of proposals kept and judged (the adaptive
        # speculation rule's, services/scheduler/speculation.py).
        self.speculation_kept = 0.0
        self.speculation_tried = 0.0
        self.speculation_steps_off = 0  # consecutive planned steps its depth was 0 (its probes')
        # LongRoPE: whether its KV is rotated with the long factors, chosen at each admission
        # (Prefill.choose_rope): a sequence longer than the original length is, as in HF.
        self.is_long_rope = False
        # The worker slot of its LoRA adapter (params.adapter) while it runs, -1 otherwise: taken
        # when it enters the running line (lora_residency.py), given back when it leaves it.
        self.lora_slot = -1
        # Structured output (params.structured): the compile while it runs, then the matcher,
        # which stays in step with output_ids (services/scheduler/grammars.py).
        self.grammar_future: Future[CompiledGrammar] | None = None
        self.grammar: GrammarMatcher | None = None
        # params.allowed_token_ids as a packed bitmask row (the grammar's layout), made once at
        # admission (services/scheduler/grammars.py `allowed_mask`); None: any token.
        self.allowed_mask: np.ndarray | None = None
        self.bad_words = BadWords(params.bad_words_ids) if params.bad_words_ids else None
        # Prompt logprobs, collected as its prompt chunks compute. A resubmission that carries
        # outputs asks for none: its client got them with its first output token.
        self.prompt_scores = (
            PromptScores(len(self.prompt_ids))
            if params.prompt_logprobs is not None and not self.output_ids
            else None
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def all_token_ids(self) -> np.ndarray:
        return self.token_slice(0, self.num_tokens)

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else int(self.prompt_ids[-1])

    def bans(self, sample_position: int, eos_token_ids: Sequence[int]) -> list[int]:
        """The tokens that may not be sampled at `sample_position` (a context length) besides
        the static ones (logit_bias, one-token bad words): while the output is shorter than
        min_tokens, its stop ids and (unless ignore_eos) eos; and the last tokens of the bad words
        whose other tokens end the output so far (`BadWords.banned`)."""
        p = self.params
        bans = []
        if sample_position - len(self.prompt_ids) < p.min_tokens:
            bans.extend(p.stop_token_ids)
            if not p.ignore_eos:
                bans.extend(eos_token_ids)
        if self.bad_words is not None and self.bad_words.prefixes:
            bans.extend(self.bad_words.banned(self.output_ids))
        return bans

    @property
    def scores_from(self) -> int | None:
        """The first prompt position whose logits are still to be scored (they give the next
        prompt token's logprob); None when it wants none, or has them all."""
        scores = self.prompt_scores
        return None if scores is None or scores.is_complete else scores.num_scored

    @property
    def hash_root(self) -> bytes:
        """Where its block-hash chain starts: the long regime's blocks hold other keys than the
        short one's for the same tokens, and a LoRA adapter's other keys and values than the base
        model's or another adapter's, so none of them share cached blocks; nor do requests of
        different cache salts."""
        root = LONG_ROPE_HASH_ROOT if self.is_long_rope else b""
        if self.params.adapter:
            adapter = f"lora adapter {self.params.adapter} load {self.adapter_load}".encode()
            root = hashlib.blake2b(root + adapter, digest_size=16).digest()
        if self.params.cache_salt:
            root = hashlib.blake2b(
                root + b"cache salt " + self.params.cache_salt.encode(), digest_size=16
            ).digest()
        return root

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival_order)

    def block_salts(self, first_block: int, end_block: int, block_size: int) -> list[bytes]:
        """For each block in [first_block, end_block), the keys of the images its tokens show:
        every image token has the same id, so without them two requests that differ only in
        their images would share KV blocks. Empty for a request without images."""
        if not self.images:
            return []
        return [
            b"".join(
                image.key
                for image in self.images
                if image.start < (j + 1) * block_size and image.start + image.num_tokens > j * block_size
            )
            for j in range(first_block, end_block)
        ]

    def image_cut(self, position: int) -> int:
        """The latest position at or before `position` that no image straddles: where a chunk
        may end, or a prefix hit (an image's tokens compute in one step)."""
        for image in self.images:
            if image.start < position < image.start + image.num_tokens:
                return image.start
        return position

    def rope_delta(self, position: int) -> int:
        """M-RoPE (an image's `grid_width`): what to add to the token position `position` for the
        rotary position of a text token there. An image's tokens take a rows x columns grid
        of positions from its first one, and the text after it continues from that position +
        max(rows, columns), not + rows x columns: each image before `position` shifts it by the
        difference (services/gpu_worker/attention.py mrope_positions)."""
        delta = 0
        for image in self.images:
            if image.grid_width and image.start + image.num_tokens <= position:
                rows = image.num_tokens // image.grid_width
                delta += max(rows, image.grid_width) - image.num_tokens
        return delta

    def token_slice(self, start: int, end: int) -> np.ndarray:
        """Token ids [start, end) of prompt + outputs as int32, without copying the whole history."""
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        outputs = np.array(self.output_ids[max(start - num_prompt, 0) : end - num_prompt], dtype=np.int32)
        if start >= num_prompt:
            return outputs
        return np.concatenate((self.prompt_ids[start:], outputs))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"row={self.row}, blocks={len(self.block_ids)})"
        )
