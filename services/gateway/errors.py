"""HTTP errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the
mapping from decode failures and the engine's error codes to them."""

from __future__ import annotations

import itertools
import re

import msgspec

from client.errors import BrigadeError
from ipc.messages import Generate, SamplingParams
from services.gateway.protocol import ErrorBody, ErrorResponse

# msgspec says "Expected `float | null`, got `str` - at `$.temperature`"
_PATH_IN_ERROR = re.compile(r" - at (?:`key` in )?`\$(.*?)`")
# A `\uXXXX` escape of a high surrogate not followed by another escape: msgspec calls a body
# with one "truncated" (a low half alone it names itself).
_UNPAIRED_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u)")
MAX_SURROGATE_CANDIDATES = 64  # escaped backslashes before such text: past these, not said
# The engine's messages about a field start with its name (ipc/validation.py); others ("this model
# serves embeddings only") name none.
_LEADING_FIELD = re.compile(r"^([A-Za-z_]+)\b")
ENGINE_FIELDS = (
    frozenset(Generate.__struct_fields__)
    | frozenset(SamplingParams.__struct_fields__)
    | {"adapter", "tool_choice"}
)
RETRY_AFTER_S = 1

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_supported_error",
    503: "server_error",
    504: "server_error",
}


class ApiError(Exception):
    """An HTTP error reply; `param` names the offending request field where there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        error = ErrorBody(self.message, ERROR_TYPES.get(self.status, "server_error"), self.param, self.code)
        return msgspec.json.encode(ErrorResponse(error))


def invalid(message: str, param: str | None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def check_range(name: str, value: float | None, low: float, high: float) -> None:
    """A 400 naming `name` unless `value` (when given) is in [low, high]: an API's own range for a
    sampling parameter, tighter than the engine's (ipc/validation.py takes vLLM's temperature up
    to 100, which chat keeps; Anthropic's is [0, 1], the Responses API's [0, 2])."""
    if value is not None and not low <= value <= high:
        raise invalid(f"{name} must be in [{low:g}, {high:g}], got {value:g}", name)


def _lone_surrogate(data: bytes) -> tuple[int, str] | None:
    """The first escape of a high surrogate with no other half, and where: an escape is a
    backslash after an even run of them (after an odd run it is an escaped backslash, then text)."""
    for escape in itertools.islice(_UNPAIRED_HIGH.finditer(data), MAX_SURROGATE_CANDIDATES):
        start = escape.start()
        run = 0
        while start - run > 0 and data[start - run - 1] == 0x5C:  # backslashes before it
            run += 1
        if run % 2 == 0:
            return start, escape[0].decode()
    return None


def from_decode_error(exc: msgspec.DecodeError | msgspec.ValidationError, data: bytes = b"") -> ApiError:
    """A body that is not JSON, or not the request's shape: 400 naming the field."""
    if not isinstance(exc, msgspec.ValidationError):
        lone = _lone_surrogate(data) if "truncated" in str(exc) else None
        if lone is not None:
            return invalid(
                f"request body is not valid JSON: {lone[1]} at byte {lone[0]} is half of a UTF-16 "
                "surrogate pair without its other half, which is no character",
                None,
                "invalid_json",
            )
        return invalid(f"request body is not valid JSON: {exc}", None, "invalid_json")
    text = str(exc)
    match = _PATH_IN_ERROR.search(text)
    path = match.group(1).lstrip(".") if match else ""
    # msgspec writes a mapping's key as `[...]` (`logit_bias[...]`): the field is the mapping.
    path = path.partition("[...]")[0]
    problem = _PATH_IN_ERROR.sub("", text).replace("`", "")
    missing = re.match(r"Object missing required field (\w+)", problem)
    if missing:
        field = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return invalid(f"{field}: required field is missing", field, "missing_required_parameter")
    return invalid(f"{path or 'body'}: {problem[:1].lower()}{problem[1:]}", path or None, "invalid_type")


def from_engine(exc: BrigadeError, aliases: dict[str, str]) -> ApiError:
    """The engine refused or could not run a request. `aliases` maps the engine's field names to
    the ones this request used (max_tokens -> max_completion_tokens, logprobs -> top_logprobs)."""
    code = exc.code
    message = str(exc)
    if code in ("invalid_request", "prompt_too_long"):
        match = _LEADING_FIELD.match(message)
        field = match.group(1) if match and match.group(1) in ENGINE_FIELDS else None
        param = aliases.get(field, field) if field else None
        if field not in (None, "prompt", "structured") and param != field:
            message = f"{param}{message[len(field) :]}"  # a renamed parameter, as this request named it
        return ApiError(
            400,
            message,
            param=param,
            code="context_length_exceeded" if code == "prompt_too_long" else "invalid_value",
        )
    if code == "model_not_found":  # a LoRA adapter unloaded since the gateway checked the name
        return ApiError(404, message, param="model", code="model_not_found")
    if code == "overloaded":
        return ApiError(429, message, code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if code == "timeout":
        return ApiError(504, message, code="timeout")
    if code == "unavailable":
        return ApiError(503, message, code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
    return ApiError(500, message, code=code)
