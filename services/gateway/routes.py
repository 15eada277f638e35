"""The gateway's HTTP routes: OpenAI's API served by `Gateway` (app.py), Anthropic's Messages API
(anthropic.py) and the Responses API (responses.py), the last two built on the Gateway."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from services.gateway.access_log import AccessLogMiddleware
from services.gateway.anthropic import MessagesApi
from services.gateway.anthropic import error_body as anthropic_error_body
from services.gateway.app import JSON, Gateway, error_response
from services.gateway.errors import ApiError
from services.gateway.invocations import invocations
from services.gateway.jobs import SEED_HEADER
from services.gateway.llamacpp import LlamaCompletions, llama_error_response, with_llama_errors
from services.gateway.response_store import ResponseStore
from services.gateway.responses import ResponsesApi
from services.gateway.scoring import ScoringApi
from services.stage import RESPONSES_DIR


def at(
    endpoint: Callable[[Request], Awaitable[Response]], *paths: str, methods: list[str] | None = None
) -> list[Route]:
    """One endpoint served at several paths (POST unless `methods` says otherwise)."""
    return [Route(path, endpoint, methods=methods or ["POST"]) for path in paths]


def build_app(gateway: Gateway) -> ASGIApp:
    settings = gateway.settings
    store = ResponseStore(settings.run_dir / RESPONSES_DIR, settings.responses_max_stored,
                          settings.responses_max_age_s, 2 * settings.max_body_bytes)  # fmt: skip
    messages, responses, scoring = MessagesApi(gateway), ResponsesApi(gateway, store), ScoringApi(gateway)
    llama = LlamaCompletions(gateway)
    routes = [
        # llama.cpp serves the OpenAI routes without /v1 too, and its own names beside vLLM's
        *at(gateway.chat, "/v1/chat/completions", "/chat/completions"),
        *at(gateway.chat_input_tokens, "/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/embeddings", gateway.embeddings, methods=["POST"]),
        *at(scoring.score, "/score", "/v1/score"),
        *at(scoring.rerank, "/rerank", "/v1/rerank", "/v2/rerank", "/reranking", "/v1/reranking"),
        Route("/v1/messages", messages.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        *at(responses.create, "/v1/responses", "/responses"),
        *at(responses.input_tokens, "/v1/responses/input_tokens", "/responses/input_tokens"),
        Route("/v1/responses/{response_id}", responses.stored, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        *at(gateway.models, "/v1/models", "/models", methods=["GET"]),
        Route("/v1/load_lora_adapter", gateway.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", gateway.unload_lora_adapter, methods=["POST"]),
        Route("/v1/models/{model_id:path}", gateway.model, methods=["GET"]),
        *at(gateway.health, "/health", "/v1/health", methods=["GET"]),
        Route("/ping", gateway.health, methods=["GET", "POST"]),
        Route("/version", gateway.version, methods=["GET"]),
        Route("/load", gateway.load, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
        Route("/tokenize", llama.tokenize, methods=["POST"]),  # vLLM's body, or llama.cpp's
        Route("/detokenize", gateway.detokenize, methods=["POST"]),
        Route("/tokenizer_info", gateway.tokenizer_info, methods=["GET"]),
        # llama-server's resumable streams (stream_replay.py)
        Route("/v1/stream", gateway.replay_stream, methods=["GET"]),
        Route("/v1/stream", gateway.stop_stream, methods=["DELETE"]),
        Route("/v1/streams/lookup", gateway.lookup_streams, methods=["POST"]),
    ]
    llama_routes = [  # llama.cpp's own API (llamacpp.py), its refusals in its error shape
        *at(with_llama_errors(gateway, llama.completion), "/completion", "/completions"),
        Route("/infill", with_llama_errors(gateway, llama.infill), methods=["POST"]),
        Route("/apply-template", with_llama_errors(gateway, llama.apply_template), methods=["POST"]),
        Route("/props", with_llama_errors(gateway, llama.props), methods=["GET"]),
        *at(with_llama_errors(gateway, llama.embedding), "/embedding", "/embeddings"),
    ]
    routes += llama_routes
    endpoints = {"chat": gateway.chat, "completions": gateway.completions, "embeddings": gateway.embeddings,
                 "score": scoring.score, "rerank": scoring.rerank}  # fmt: skip
    routes.append(Route("/invocations", invocations(gateway, endpoints), methods=["POST"]))
    llama_paths = {route.path for route in llama_routes}

    async def on_http_exception(request: Request, exc: HTTPException) -> Response:
        """The router's refusals, in the shape of the API the path belongs to."""
        error = gateway.http_error(request, exc)
        path = request.url.path
        if path in llama_paths:
            response = llama_error_response(error)
        elif path.startswith("/v1/messages"):
            response = Response(anthropic_error_body(error), error.status, error.headers, media_type=JSON)
        else:
            response = error_response(error)
        return gateway.finish(request, response)

    handlers = {
        HTTPException: on_http_exception,
        ApiError: gateway.on_api_error,
        Exception: gateway.on_crash,
    }
    app: ASGIApp = Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
    if settings.access_log is not None:
        app = AccessLogMiddleware(app, settings.access_log)
    if settings.cors_origins:  # outermost: a preflight is answered here, before any key is asked for
        app = CORSMiddleware(app, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                             allow_headers=["*"], expose_headers=[SEED_HEADER, "Retry-After"])  # fmt: skip
    return app
