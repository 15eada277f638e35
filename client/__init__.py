"""Brigade client SDK: `Client` (sync) and `AsyncClient` (asyncio) over ZeroMQ, and `python -m client`."""

from client.async_sdk import AsyncClient
from client.errors import (
    AuthenticationFailed,
    BrigadeError,
    ClientClosed,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PromptTooLong,
    RequestTimeout,
    ServerUnavailable,
    UntrustedRunDir,
)
from client.sdk import Client, EmbedResult, GenerateResult, StreamDelta

__all__ = [
    "AsyncClient",
    "AuthenticationFailed",
    "BrigadeError",
    "Client",
    "ClientClosed",
    "EmbedResult",
    "GenerateResult",
    "InvalidRequest",
    "ModelNotFound",
    "Overloaded",
    "PromptTooLong",
    "RequestTimeout",
    "ServerUnavailable",
    "StreamDelta",
    "UntrustedRunDir",
]
