"""Typed ZeroMQ sockets (mini-sglang style) that every stage talks through.

Each wrapper owns one ZeroMQ socket and the codecs of its directions. Queues and message sizes are
bounded, every wait has a timeout, sends never block forever (they return False when the peer is
gone or its queue is full; a ROUTER's `try_send` tells the two apart), and a bad frame raises
`MalformedMessage` (`MalformedFrame` on a ROUTER, with the sender's identity) so the caller counts
it and goes on. Every message is one
msgspec frame: a peer that sends more frames is answered as malformed.
Asyncio code (the gateway's `AsyncClient`) watches these sockets' descriptors with its loop's
`add_reader` instead of zmq.asyncio, whose per-message futures cost more than the message.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import socket as pysocket
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import zmq
from zmq.auth.thread import ThreadAuthenticator

from ipc.codec import Codec, MalformedMessage, request_id_of
from ipc.endpoints import Link, check_private, make_run_dir
from ipc.keys import CurveClient, CurveServer

T = TypeVar("T")
In = TypeVar("In")
Out = TypeVar("Out")
_S = TypeVar("_S", bound="_Base")

DEFAULT_HWM = 10_000
DEFAULT_MAX_MSG_BYTES = 64 << 20
DEFAULT_LINGER_MS = 1000
DEFAULT_SEND_TIMEOUT_MS = 100
_SNDMORE = int(zmq.SNDMORE)
_DONTWAIT = int(zmq.DONTWAIT)


class Sent(enum.Enum):
    """What became of one message a ROUTER sent to one peer."""

    OK = "ok"
    FULL = "full"  # the peer's queue is full (it reads slowly): nothing was sent
    GONE = "gone"  # no peer with that identity (it disconnected): nothing was sent


class AddressInUse(OSError):
    """Another live socket is bound to this endpoint."""


class MessageTooLarge(ValueError):
    """A frame larger than the socket's max_msg_bytes (the receiver would drop the connection)."""


class MalformedFrame(MalformedMessage):
    """A bad frame on a ROUTER socket; `identity` lets the caller answer the sender, and
    `request_id` (when the frame has a readable one) lets the error name the request."""

    def __init__(self, identity: bytes, reason: str, request_id: str = "") -> None:
        super().__init__(reason)
        self.identity = identity
        self.request_id = request_id


@dataclass(frozen=True)
class SocketOptions:
    """Limits applied to every socket by `configure_socket`."""

    hwm: int = DEFAULT_HWM
    max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES
    linger_ms: int = DEFAULT_LINGER_MS
    send_timeout_ms: int = DEFAULT_SEND_TIMEOUT_MS


DEFAULT_OPTIONS = SocketOptions()

# ---------------------------------------------------------------------------
# CURVE (tcp:// across hosts)
# ---------------------------------------------------------------------------


class _AllowedKeys:
    """ZAP credentials provider of one server socket (its own ZAP domain)."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class _Zap:
    """One ZAP authenticator per ZeroMQ context (libzmq allows one), shared by its server sockets,
    each in its own domain; stopped with the last of them."""

    _lock = threading.Lock()
    _by_context: dict[int, tuple[ThreadAuthenticator, set[str]]] = {}  # noqa: RUF012
    _num_domains = 0

    @classmethod
    def add(cls, ctx: zmq.Context, keys: Sequence[bytes]) -> str:
        with cls._lock:
            address = ctx.underlying
            if address not in cls._by_context:
                # The authenticator's thread needs a sync context, even for an asyncio socket.
                auth = ThreadAuthenticator(zmq.Context.shadow(address))
                auth.start()
                cls._by_context[address] = (auth, set())
            auth, domains = cls._by_context[address]
            cls._num_domains += 1
            domain = f"brigade-{os.getpid()}-{cls._num_domains}"
            auth.configure_curve_callback(domain, _AllowedKeys(keys))
            domains.add(domain)
            return domain

    @classmethod
    def remove(cls, ctx: zmq.Context, domain: str) -> None:
        with cls._lock:
            if ctx.underlying not in cls._by_context:
                return  # close_context stopped it already
            auth, domains = cls._by_context[ctx.underlying]
            domains.discard(domain)
            auth.credentials_providers.pop(domain, None)
            if not domains:
                auth.stop()
                del cls._by_context[ctx.underlying]

    @classmethod
    def stop(cls, ctx: zmq.Context) -> None:
        with cls._lock:
            entry = cls._by_context.pop(ctx.underlying, None)
        if entry is not None:
            entry[0].stop()


def close_context(ctx: zmq.Context, linger_ms: int) -> None:
    """Close every socket of `ctx`, and `ctx`. Stops its ZAP authenticator first: that thread's
    sockets would keep the context's term() waiting for good. A CURVE server socket refuses
    handshakes meanwhile (ZAP_ENFORCE_DOMAIN) rather than accepting anyone."""
    _Zap.stop(ctx)
    ctx.destroy(linger=linger_ms)


def _apply_curve(ctx: zmq.Context, sock: zmq.Socket, curve: CurveServer | CurveClient) -> str | None:
    """Set the CURVE options; returns the ZAP domain of a server socket."""
    sock.curve_publickey = curve.keys.public
    sock.curve_secretkey = curve.keys.secret
    if isinstance(curve, CurveClient):
        sock.curve_serverkey = curve.server_public_key
        return None
    # The authenticator must run before the socket binds: without a ZAP handler libzmq accepts anyone.
    domain = _Zap.add(ctx, curve.client_public_keys)
    sock.zap_domain = domain.encode()
    sock.zap_enforce_domain = True  # no ZAP handler (it stopped) = refuse, not accept
    sock.curve_server = True
    return domain


# ---------------------------------------------------------------------------
# Socket setup
# ---------------------------------------------------------------------------


def configure_socket(sock: zmq.Socket, options: SocketOptions = DEFAULT_OPTIONS) -> None:
    """Apply the safe defaults: bounded queues, message size, linger and send time."""
    sock.sndhwm = options.hwm
    sock.rcvhwm = options.hwm
    sock.maxmsgsize = options.max_msg_bytes
    sock.linger = options.linger_ms
    sock.sndtimeo = options.send_timeout_ms
    if sock.type == zmq.ROUTER:
        sock.router_mandatory = 1  # an unknown identity is an error (EHOSTUNREACH), not a silent drop


def _prepare_ipc_path(path: Path) -> None:
    """Private run dir, and never steal a socket file another process listens on."""
    if os.path.lexists(path.parent):
        check_private(path.parent, "the directory of an ipc socket")
    else:
        make_run_dir(path.parent)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AddressInUse(f"{path} exists and is not a socket")
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # stale: its process died without cleaning up
        return
    finally:
        probe.close()
    raise AddressInUse(f"ipc://{path} is in use by a live process")


def bind_endpoint(sock: zmq.Socket, endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        _prepare_ipc_path(Path(endpoint[len("ipc://") :]))
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            raise AddressInUse(f"{endpoint} is in use") from None
        raise


class _Base:
    """Owns one configured ZeroMQ socket: binding, CURVE, the receive-timeout cache and closing."""

    def __init__(
        self,
        ctx: zmq.Context,
        socket_type: int,
        endpoint: str | Link,
        bind: bool,
        options: SocketOptions,
        curve: CurveServer | CurveClient | None,
        identity: bytes | None = None,
    ) -> None:
        if isinstance(endpoint, Link):
            curve = curve or (endpoint.server_curve if bind else endpoint.client_curve)
            endpoint = endpoint.bind if bind else endpoint.connect
        self.socket = ctx.socket(socket_type)
        self.is_curve_server = isinstance(curve, CurveServer)
        self._ctx = ctx
        self._max_msg_bytes = options.max_msg_bytes
        self._timeout: float | None = None  # the socket's RCVTIMEO is -1 (none)
        self._zap_domain: str | None = None
        try:
            configure_socket(self.socket, options)
            if identity is not None:
                self.socket.identity = identity  # must precede connect
            if endpoint.startswith("tcp://["):
                self.socket.ipv6 = True
            if curve is not None:
                self._zap_domain = _apply_curve(ctx, self.socket, curve)
            if bind:
                bind_endpoint(self.socket, endpoint)
            else:
                self.socket.connect(endpoint)
        except BaseException:
            self.close()
            raise

    @property
    def endpoint(self) -> str:
        """The bound or connected endpoint (with the real port after binding tcp://host:*)."""
        return self.socket.last_endpoint.decode()

    def _set_timeout(self, timeout: float | None) -> None:
        # A socket option, set only when it changes, instead of a poller per call: the cheapest
        # way to bound one recv (the typed round trip must stay close to bare pyzmq).
        if timeout != self._timeout:
            self.socket.rcvtimeo = -1 if timeout is None else math.ceil(max(timeout, 0.0) * 1000)
            self._timeout = timeout

    def _too_large(self, data: bytes) -> MessageTooLarge:
        """The error for a message that the receiver would drop for its size (the callers compare
        inline: this is every send's path)."""
        return MessageTooLarge(f"a message of {len(data)} bytes; the limit is {self._max_msg_bytes}")

    # PUSH, PULL and DEALER move one message (one frame) with no identity in front: one
    # implementation each of sending and receiving.

    def _send_one(self, data: bytes) -> bool:
        """Send without blocking; False (nothing sent) when the peer's queue is full or there is no peer."""
        if len(data) > self._max_msg_bytes:
            raise self._too_large(data)
        try:
            self.socket.send(data)
        except zmq.Again:
            return False
        return True

    def _recv_one(self, codec: Codec[Any], timeout: float | None) -> Any:
        """The next message, or None after `timeout` seconds; raises MalformedMessage (sync)."""
        if timeout != self._timeout:
            self._set_timeout(timeout)
        try:
            frame = self.socket.recv(copy=False)
        except zmq.Again:
            return None
        if frame.more:
            raise _extra_frames(self.socket)
        return codec.decode(frame)

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close()
        if self._zap_domain is not None:
            _Zap.remove(self._ctx, self._zap_domain)
            self._zap_domain = None

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _extra_frames(sock: zmq.Socket, identity: bytes = b"", request_id: str = "") -> MalformedFrame:
    """Read and drop the rest of a message whose first frame had MORE set; the error to raise."""
    num_extra = 0
    more = True
    while more:
        more = sock.recv(copy=False).more
        num_extra += 1
    return MalformedFrame(identity, f"unexpected {num_extra} extra frame(s)", request_id)


def _decode(codec: Codec[T], frame: zmq.Frame, identity: bytes) -> T:
    try:
        return codec.decode(frame)
    except MalformedMessage as exc:
        raise MalformedFrame(identity, str(exc), request_id_of(frame)) from None


# ---------------------------------------------------------------------------
# Sync sockets. One send or recv per message, no lists: the typed round trip must stay close to
# bare pyzmq's (benchmarks/ipc_bench.py).
# ---------------------------------------------------------------------------


class PushQueue(_Base, Generic[T]):
    """The sending end of a one-way channel (PUSH)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str | Link,
        codec: Codec[T],
        bind: bool = False,
        options: SocketOptions = DEFAULT_OPTIONS,
        curve: CurveServer | CurveClient | None = None,
    ) -> None:
        super().__init__(ctx, zmq.PUSH, endpoint, bind, options, curve)
        self._codec = codec

    def put(self, msg: T) -> bool:
        """Send; False (nothing sent) when the peer's queue is full or there is no peer."""
        return self._send_one(self._codec.encode(msg))


class PullQueue(_Base, Generic[T]):
    """The receiving end of a one-way channel (PULL); `.socket` can go into a zmq.Poller."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str | Link,
        codec: Codec[T],
        bind: bool = True,
        options: SocketOptions = DEFAULT_OPTIONS,
        curve: CurveServer | CurveClient | None = None,
    ) -> None:
        super().__init__(ctx, zmq.PULL, endpoint, bind, options, curve)
        self._codec = codec

    def get(self, timeout: float | None) -> T | None:
        """The next message, or None after `timeout` seconds; raises MalformedMessage."""
        return self._recv_one(self._codec, timeout)


class RouterSocket(_Base, Generic[In, Out]):
    """The serving end of a request/reply channel with many peers (ROUTER)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str | Link,
        in_codec: Codec[In],
        out_codec: Codec[Out],
        bind: bool = True,
        options: SocketOptions = DEFAULT_OPTIONS,
        curve: CurveServer | CurveClient | None = None,
    ) -> None:
        super().__init__(ctx, zmq.ROUTER, endpoint, bind, options, curve)
        self._in = in_codec
        self._out = out_codec

    def recv(self, timeout: float | None) -> tuple[bytes, In] | None:
        """(identity, message), or None after `timeout` seconds; raises MalformedFrame."""
        if timeout != self._timeout:
            self._set_timeout(timeout)
        try:
            identity = self.socket.recv()
        except zmq.Again:
            return None
        frame = self.socket.recv(copy=False)  # the rest of a multipart message is already here
        if frame.more:
            raise _extra_frames(self.socket, identity, request_id_of(frame))
        return identity, _decode(self._in, frame, identity)

    def send(self, identity: bytes, msg: Out) -> bool:
        """False when the peer is gone or its queue stayed full for the send timeout."""
        return self._route(identity, msg, 0) is Sent.OK

    def try_send(self, identity: bytes, msg: Out) -> Sent:
        """Send without waiting, telling a peer whose queue is full (Sent.FULL: nothing was sent,
        try again later) from one that is gone (Sent.GONE)."""
        return self._route(identity, msg, _DONTWAIT)

    def _route(self, identity: bytes, msg: Out, flags: int) -> Sent:
        data = self._out.encode(msg)
        if len(data) > self._max_msg_bytes:
            raise self._too_large(data)
        try:
            # Under ROUTER_MANDATORY a full queue refuses the identity frame, so a refused
            # message is never half sent.
            self.socket.send(identity, _SNDMORE | flags)
            self.socket.send(data, flags)
        except zmq.Again:
            return Sent.FULL
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return Sent.GONE
            raise
        return Sent.OK


class DealerSocket(_Base, Generic[In, Out]):
    """The client end of a request/reply channel (DEALER)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str | Link,
        in_codec: Codec[In],
        out_codec: Codec[Out],
        bind: bool = False,
        options: SocketOptions = DEFAULT_OPTIONS,
        curve: CurveServer | CurveClient | None = None,
        identity: bytes | None = None,
    ) -> None:
        super().__init__(ctx, zmq.DEALER, endpoint, bind, options, curve, identity)
        self._in = in_codec
        self._out = out_codec

    def send(self, msg: Out) -> bool:
        """False (nothing sent) when the peer's queue is full or there is no peer."""
        return self._send_one(self._out.encode(msg))

    def recv(self, timeout: float | None) -> In | None:
        """The next reply, or None after `timeout` seconds; raises MalformedMessage."""
        return self._recv_one(self._in, timeout)
