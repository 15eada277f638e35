"""Typed client errors, one per ErrorReply code a caller may want to handle differently."""

from __future__ import annotations


class BrigadeError(Exception):
    """Base of every error the client raises; `code` is the server's ErrorReply code."""

    code = "internal"


class InvalidRequest(BrigadeError):
    code = "invalid_request"


class PromptTooLong(InvalidRequest):
    code = "prompt_too_long"


class ModelNotFound(InvalidRequest):
    """A LoRA adapter (`adapter=`) the engine does not serve, or one being unloaded."""

    code = "model_not_found"


class Overloaded(BrigadeError):
    code = "overloaded"


class RequestTimeout(BrigadeError):
    code = "timeout"


class ServerUnavailable(BrigadeError):
    code = "unavailable"


class AuthenticationFailed(ServerUnavailable):
    """The CURVE handshake with the run failed (a wrong or missing server key or client key), or
    a tcp:// endpoint beyond this host was given no keys. Raised by the client itself."""


class ClientClosed(BrigadeError):
    """A request on a client after its close(). Raised by the client itself."""

    code = "client_closed"


class UntrustedRunDir(BrigadeError):
    """The run dir or its run.json could be swapped by another user: connecting could send the
    prompts to their socket. Raised by the client itself; no server sends it."""

    code = "untrusted_run_dir"


_BY_CODE: dict[str, type[BrigadeError]] = {
    cls.code: cls for cls in (InvalidRequest, PromptTooLong, ModelNotFound, Overloaded, ServerUnavailable)
}


def error_for(code: str, message: str) -> BrigadeError:
    """The exception for an ErrorReply (unknown codes map to the base class)."""
    error = _BY_CODE.get(code, BrigadeError)(message)
    error.code = code
    return error
