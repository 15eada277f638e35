"""SageMaker's `POST /invocations`, as vLLM serves it: one path for every API, the body's fields
choosing which (SageMaker sends every call to it, and probes `/ping`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive

from ipc.json_depth import check_json_depth
from ipc.validation import InvalidParams
from services.gateway.app import Gateway
from services.gateway.errors import invalid

Endpoint = Callable[[Request], Awaitable[Response]]

# The fields that name an API, in the order they are tried (a rerank body has no `input`, a score
# body no `prompt`), and its handler's name in `endpoints`.
APIS = (
    (frozenset({"messages"}), "chat"),
    (frozenset({"prompt"}), "completions"),
    (frozenset({"input"}), "embeddings"),
    (frozenset({"text_1", "text_2"}), "score"),
    (frozenset({"query", "documents"}), "rerank"),
)
NAMED = "messages (chat), prompt (completions), input (embeddings), text_1 and text_2 (score), or query and documents (rerank)"


def replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` with the body, already read, first: the chosen API reads it again, and later
    messages (a client's disconnect, which a stream watches for) come from the connection."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def invocations(gateway: Gateway, endpoints: dict[str, Endpoint]) -> Endpoint:
    async def invoke(request: Request) -> Response:
        body = await gateway.read_raw(request)
        try:
            check_json_depth(body, "request body")
            fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except InvalidParams as exc:
            raise invalid(str(exc), None, "invalid_json") from None
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise invalid("the body must be a JSON object", None, "invalid_json") from None
        # A field given as null is not given (each API takes null as its default).
        given = {key for key, value in fields.items() if bytes(value) != b"null"}
        name = next((name for keys, name in APIS if keys <= given), None)
        if name is None:
            raise invalid(f"/invocations takes the body of one API: give {NAMED}", None)
        return await endpoints[name](Request(request.scope, replaying(body, request.receive)))

    return invoke
