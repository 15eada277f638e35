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
from services.gateway.app import Gateway, json_response
from services.gateway.errors import ApiError, invalid

# The index of the input an engine refusal names (client.embed: "input[3] ...").
INPUT_NAMED = re.compile(r"input\[(\d+)\]")


def texts_of(value: str | list[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise invalid(f"{field} must not be empty", field)
    return texts


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity; 0.0 where a vector is all zeros (no direction to compare)."""
    norms = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)) / norms) if norms else 0.0


class ScoringApi:
    """The two endpoints, on the gateway's embedding path."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def vectors(
        self, texts: list[str], truncate_prompt_tokens: int | None, fields: list[str]
    ) -> tuple[np.ndarray, int]:
        """The texts' vectors and prompt tokens; an engine refusal of one text names its field
        (`fields[i]` for text i)."""
        try:
            result = await self.gateway.embed(texts, None, truncate_prompt_tokens)
        except ApiError as error:
            if error.status == 400:
                named = INPUT_NAMED.search(error.message)
                error.param = fields[int(named[1])] if named and int(named[1]) < len(fields) else fields[0]
                if "truncate_prompt_tokens" in error.message:
                    error.param = "truncate_prompt_tokens"
            raise
        return result.embeddings, result.prompt_tokens

    async def score(self, request: Request) -> Response:
        body = await self.gateway.read_body(request, p.ScoreRequest)
        firsts, seconds = texts_of(body.text_1, "text_1"), texts_of(body.text_2, "text_2")
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise invalid(
                f"text_1 must be one text, or as many texts as text_2 (got {len(firsts)} and {len(seconds)})",
                "text_1",
            )
        vectors, prompt_tokens = await self.vectors(
            firsts + seconds,
            body.truncate_prompt_tokens,
            ["text_1"] * len(firsts) + ["text_2"] * len(seconds),
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
        documents = texts_of(body.documents, "documents")
        if body.top_n is not None and body.top_n < 0:
            raise invalid(f"top_n must be 0 (all) or more, got {body.top_n}", "top_n")
        vectors, prompt_tokens = await self.vectors(
            [body.query, *documents], body.truncate_prompt_tokens, ["query"] + ["documents"] * len(documents)
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
