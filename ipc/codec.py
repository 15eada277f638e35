"""One typed msgpack encoder/decoder per channel. Decoding is strict: anything that is not a
valid message of the channel raises `MalformedMessage`, never another exception."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from ipc import messages as m

T = TypeVar("T")


class MalformedMessage(ValueError):
    """A frame that is not a valid message of its channel."""


class Codec(Generic[T]):
    """Encoder and strict decoder for one channel's tagged union."""

    def __init__(self, message_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: T) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> T:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedMessage(str(exc)) from None
        except Exception as exc:  # e.g. recursion limits on hostile input
            raise MalformedMessage(f"{type(exc).__name__}: {exc}") from None


class _RequestIdOnly(msgspec.Struct):
    request_id: str = ""


_REQUEST_ID_DECODER = msgspec.msgpack.Decoder(_RequestIdOnly)


def request_id_of(data: bytes | memoryview) -> str:
    """The request id of a map-encoded message that failed to decode as a whole ("" when even that
    is unreadable), so that an error about a bad request can still name it."""
    try:
        return _REQUEST_ID_DECODER.decode(data).request_id
    except Exception:  # hostile input: nothing to attribute
        return ""


# One codec per channel, named after the receiving side.
CLIENT_REQUEST: Codec[m.ClientRequest] = Codec(m.ClientRequest)
CLIENT_REPLY: Codec[m.ClientReply] = Codec(m.ClientReply)
SCHEDULER_INPUT: Codec[m.SchedulerInput] = Codec(m.SchedulerInput)
DETOKENIZER_INPUT: Codec[m.DetokenizerInput] = Codec(m.DetokenizerInput)
TOKENIZER_INPUT: Codec[m.TokenizerInput] = Codec(m.TokenizerInput)
CONTROL_UP: Codec[m.ControlUp] = Codec(m.ControlUp)
CONTROL_DOWN: Codec[m.ControlDown] = Codec(m.ControlDown)
WORKER_INPUT: Codec[m.WorkerInput] = Codec(m.WorkerInput)
WORKER_OUTPUT: Codec[m.WorkerOutput] = Codec(m.WorkerOutput)
STEP_HEADER: Codec[m.StepHeader] = Codec(m.StepHeader)
RESULT_HEADER: Codec[m.ResultHeader] = Codec(m.ResultHeader)
ENCODER_REQUEST: Codec[m.EncodeImages] = Codec(m.EncodeImages)
ENCODER_REPLY: Codec[m.ImagesEncoded] = Codec(m.ImagesEncoded)
