"""vLLM's /score and /rerank (Jina's and Cohere's shape) for an embedding run: a pair's score is
the cosine similarity of its two texts' vectors, as vLLM scores with an embedding model. Every
text of a call is embedded in one batch (Gateway.embed), so the engine runs them together."""

from __future__ import annotations

import re
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from services.gateway import protocol as p
from services.gateway.app import MAX_EMBEDDING_INPUTS, Gateway, json_response
from services.gateway.errors import ApiError, invalid

# The index of the input an engine refusal names (client.embed: "input[3] ...").
INPUT_NAMED = re.compile(r"input\[(\d+)\]")


def texts_of(value: str | list[str], field: str) -> tuple[list[str], list[str]]:
    """A field's texts, and the name of each as a refusal names it: `field` for a lone text,
    `field[i]` for one of a list (as /v1/embeddings names `input[i]`)."""
    if isinstance(value, str):
        return [value], [field]
    if not value:
        raise invalid(f"{field} must not be empty", field)
    # /v1/embeddings' cap on one call's inputs: without it here, /score and /rerank were a way
    # round it (20,000 documents held the engine for minutes on one call).
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise invalid(f"{field} holds {len(value)} texts, over the limit of {MAX_EMBEDDING_INPUTS}", field)
    return value, [f"{field}[{i}]" for i in range(len(value))]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity; 0.0 where a vector is all zeros (no direction to compare)."""
    norms = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)) / norms) if norms else 0.0


class ScoringApi:
    """The two endpoints, on the gateway's embedding path."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def vectors(
        self, request: Request, texts: list[str], truncate_prompt_tokens: int | None, fields: list[str]
    ) -> tuple[np.ndarray, int]:
        """The texts' vectors and prompt tokens; a refusal of one text names it by its field
        (`fields[i]` for text i) in its message and param: the SDK's `input[i]` counts the texts
        of all fields together, which the caller never sent as such."""
        try:
            result = await self.gateway.embed(request, texts, None, truncate_prompt_tokens)
        except ApiError as error:
            if error.status == 400:
                named = INPUT_NAMED.search(error.message)
                if named and int(named[1]) < len(fields):
                    error.param = fields[int(named[1])]
                    error.message = INPUT_NAMED.sub(error.param, error.message, count=1)
                else:  # every text refused alike (too long, say): the request's first field
                    error.param = fields[0].split("[")[0]
                if "truncate_prompt_tokens" in error.message:
                    error.param = "truncate_prompt_tokens"
            raise
        return result.embeddings, result.prompt_tokens

    async def score(self, request: Request) -> Response:
        body = await self.gateway.read_body(request, p.ScoreRequest)
        firsts, first_fields = texts_of(body.text_1, "text_1")
        seconds, second_fields = texts_of(body.text_2, "text_2")
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise invalid(
                f"text_1 must be one text, or as many texts as text_2 (got {len(firsts)} and {len(seconds)})",
                "text_1",
            )
        vectors, prompt_tokens = await self.vectors(
            request, firsts + seconds, body.truncate_prompt_tokens, first_fields + second_fields
        )
        first_of = (lambda i: vectors[0]) if len(firsts) == 1 else (lambda i: vectors[i])
        data = [p.ScoreData(i, cosine(first_of(i), vectors[len(firsts) + i])) for i in range(len(seconds))]
        usage = p.EmbeddingUsage(prompt_tokens, prompt_tokens)
        reply = p.ScoreResponse(
            f"score-{uuid.uuid4().hex}", int(time.time()), self.gateway.settings.model, data, usage
        )
        return self.gateway.finish(request, json_response(reply))

    async def rerank(self, request: Request) -> Response:
        body = await self.gateway.read_body(request, p.RerankRequest)
        documents, document_fields = texts_of(body.documents, "documents")
        if body.top_n is not None and body.top_n < 0:
            raise invalid(f"top_n must be 0 (all) or more, got {body.top_n}", "top_n")
        vectors, prompt_tokens = await self.vectors(
            request, [body.query, *documents], body.truncate_prompt_tokens, ["query", *document_fields]
        )
        scores = [cosine(vectors[0], vector) for vector in vectors[1:]]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties keep their order
        results = [
            p.RerankResult(i, scores[i], p.RerankDocument(documents[i]) if body.return_documents else None)
            for i in order[: body.top_n or None]
        ]
        reply = p.RerankResponse(
            f"rerank-{uuid.uuid4().hex}", self.gateway.settings.model, p.RerankUsage(prompt_tokens), results
        )
        return self.gateway.finish(request, json_response(reply))
