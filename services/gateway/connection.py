"""Deadlines for slow HTTP clients, which uvicorn does not have.

uvicorn closes an idle kept-alive connection (timeout_keep_alive), but a connection that sends
part of a request line or of its headers and then stalls (slowloris) is held forever, and the
headers may grow without bound. The protocol here gives every request `header_timeout_s` from its
first byte (or from the connection's opening) to complete its headers, in at most
`max_header_bytes`; past either, the client gets 408 or 431 and the connection is closed. The body
has its own deadline where it is read (Gateway.read_body). A client that stops reading its response
while the connection stays open would hold its request forever (uvicorn has no write deadline):
one whose writes stay blocked while it takes no bytes for `write_timeout_s` is dropped.

Over HTTPS with client certificates (gateway.tls.client_ca), each request's scope carries the
verified certificate's subject as ASGI's TLS extension names it: `extensions.tls.client_cert_name`
(only that key of the extension is filled in).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import sys
import termios
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)
# RFC 4514's short names for the attributes Python's ssl spells out.
SHORT_NAMES = {
    "commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
    "stateOrProvinceName": "ST", "localityName": "L", "domainComponent": "DC", "userId": "UID",
    "streetAddress": "STREET",
}  # fmt: skip


def guarded_protocol(
    header_timeout_s: float, max_header_bytes: int, write_timeout_s: float = 30.0
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a header deadline, a header size limit and a write
    deadline."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.header_timer: asyncio.TimerHandle | None = None
            self.header_bytes: int | None = None  # received of the headers being read; None: not reading any
            self.trailer_bytes = 0  # of the request's trailer fields (after a chunked body)
            self.header_tail = b""  # their last bytes so far: an end of headers split between reads
            self.header_begun = False  # a byte other than CR / LF came (the parser skips empty lines)
            self.running_cycle: RequestResponseCycle | None = None  # the request whose app runs
            self.write_timer: asyncio.TimerHandle | None = None  # armed while writes are paused
            self.unsent_bytes = 0  # the transport's buffer when the write timer was armed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # The handshake is done by now: a verified client certificate is the caller.
            tls = transport.get_extra_info("ssl_object")
            subject = certificate_subject(tls.getpeercert()) if tls is not None else None
            self.tls_extension = {"client_cert_name": subject} if subject else None
            self._await_headers()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self.tls_extension is not None:
                self.scope["extensions"] = {"tls": self.tls_extension}  # type: ignore[typeddict-unknown-key]

        def _count_headers(self) -> None:
            """The next bytes are a request's headers: count them toward max_header_bytes."""
            if self.header_bytes is None:
                self.header_bytes, self.header_tail, self.header_begun = 0, b"", False

        def _await_headers(self) -> None:
            """Count them, and give the client header_timeout_s to send them all."""
            self._count_headers()
            if self.header_timer is None:
                self.header_timer = self.loop.call_later(header_timeout_s, self._refuse, REQUEST_TIMEOUT)

        def _headers_done(self) -> None:
            self.header_bytes = None
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _refuse(self, reply: bytes) -> None:
            self._headers_done()
            if not self.transport.is_closing():
                self.transport.write(reply)
                self.transport.close()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            # A pipelined request's headers may follow while this one's response runs: counted
            # from now, but with no deadline until that response ends (the client owes nothing
            # while it reads it). The rest of the read that ended this request is not counted.
            self._count_headers()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self._await_headers()  # a kept-alive connection's next request
            if self.header_bytes is not None:
                # Counted before the parser sees them, up to the end of the headers (the read that
                # completes them may carry body too): parsed whole, they would reach the app.
                start = 0
                if not self.header_begun:  # empty lines before a request line are no end of headers
                    start = len(data) - len(data.lstrip(b"\r\n"))
                    self.header_begun = start < len(data)
                seen = self.header_tail + data  # the tail is empty until the headers begin
                end = seen.find(b"\r\n\r\n", start) if self.header_begun else -1
                self.header_bytes += len(data) if end < 0 else end + 4 - len(self.header_tail)
                if self.header_bytes > max_header_bytes:
                    self._refuse(HEADERS_TOO_LARGE)
                    return
                self.header_tail = seen[-3:] if self.header_begun else b""
            super().data_received(data)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self.header_bytes is not None:
                super().on_header(name, value)
                return
            # A field after the headers: a chunked body's trailer. uvicorn appends each to the
            # request's headers, unbounded and outside every body limit (20 MB of "a:b" lines
            # grew a replica by 430 MB); nothing here reads them, so they are counted against
            # max_header_bytes and dropped.
            self.trailer_bytes += len(name) + len(value) + 4
            if self.trailer_bytes > max_header_bytes:
                self._refuse(HEADERS_TOO_LARGE)

        def on_headers_complete(self) -> None:
            self._headers_done()
            self.trailer_bytes = 0
            super().on_headers_complete()

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
            self.running_cycle = cycle
            super()._start_asgi_task(cycle, app)

        def pause_writing(self) -> None:
            super().pause_writing()
            # The transport's buffer is over its high-water mark (the kernel's send buffer full
            # before it): the response's next write waits until the client reads. One that reads
            # nothing for write_timeout_s would hold its request (a max_concurrent_requests slot,
            # and its output queued here) for as long as it keeps the connection open.
            self._arm_write_timer()

        def resume_writing(self) -> None:
            self._write_resumed()
            super().resume_writing()

        def _unsent(self) -> int:
            """Bytes not yet taken by the client: the transport's buffer and the kernel's send
            queue. The kernel's alone shows a slow reader's progress: it has room for the
            transport's bytes again only once a third of its buffer (megabytes) is free."""
            unsent = self.transport.get_write_buffer_size()
            sock = self.transport.get_extra_info("socket")
            with contextlib.suppress(OSError, ValueError, AttributeError):
                queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                unsent += int.from_bytes(queued, sys.byteorder, signed=True)
            return unsent

        def _arm_write_timer(self) -> None:
            self._write_resumed()
            self.unsent_bytes = self._unsent()
            self.write_timer = self.loop.call_later(write_timeout_s, self._check_reader)

        def _write_resumed(self) -> None:
            if self.write_timer is not None:
                self.write_timer.cancel()
                self.write_timer = None

        def _check_reader(self) -> None:
            """Writes have waited write_timeout_s: a client that took some bytes meanwhile reads
            slowly, and gets another write_timeout_s; one that took none is gone (the connection is
            dropped, unsent bytes and all, and its request aborted: a 499)."""
            self.write_timer = None
            # Not spared while closing: uvicorn closes a kept-alive connection gracefully, and a
            # graceful close waits for the buffer to be sent.
            if self._unsent() < self.unsent_bytes:
                self._arm_write_timer()
            else:
                self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            self._write_resumed()
            # uvicorn tells only `self.cycle` that the client is gone, and with a pipelined request
            # queued that is the queued one: the running request would never see its disconnect
            # (its engine work ran on) and would write to the closed transport (a logged 500).
            running = self.running_cycle
            if running is not None and running is not self.cycle and not running.response_complete:
                running.disconnected = True
                running.message_event.set()
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol


def _escape(value: str) -> str:
    """RFC 4514's escaping of an attribute value."""
    escaped = "".join("\\" + c if c in ',+"\\<>;' else c for c in value)
    if escaped[:1] in ("#", " "):
        escaped = "\\" + escaped
    if escaped.endswith(" "):
        escaped = escaped[:-1] + "\\ "
    return escaped


def certificate_subject(peercert: dict[str, Any] | None) -> str | None:
    """A verified peer certificate's subject as an RFC 4514 string (most specific first, as
    `openssl x509 -subject -nameopt RFC2253` and cryptography's rfc4514_string write it)."""
    if not peercert or not peercert.get("subject"):
        return None
    rdns = [
        "+".join(f"{SHORT_NAMES.get(key, key)}={_escape(value)}" for key, value in rdn)
        for rdn in peercert["subject"]
    ]
    return ",".join(reversed(rdns))


def client_cert_name(scope: Any) -> str | None:
    """The subject of the verified client certificate a request came with (mTLS), if any."""
    return scope.get("extensions", {}).get("tls", {}).get("client_cert_name")
