"""Remote images: a chat's http(s) image URLs fetched for the tokenizer (and the gateway's
/tokenize), off its loop, within limits.

The policy (`RemoteImages`, from `encoder.remote_images*` and `encoder.max_image_bytes`): only
http and https; hosts in `domains` when it names any (a server that fetches what its clients name
reaches whatever its host reaches, so a run open to the internet should list its image hosts);
every redirect checked as the first URL was, at most `max_redirects` of them; the body read at
most `max_bytes` into it, a larger one refused as soon as it is known (its Content-Length, or the
byte past the limit); a type other than an image's (or a bare octet stream's) refused before the
body is read; the whole fetch, redirects included, within `timeout_s`. Each refusal is an
`ImageError` naming the URL and the problem: a 400.

Why threads: the tokenizer's loop polls ZeroMQ and must never wait on the network. Each image
is fetched on a small thread pool (`ImageFetcher`); a finished fetch writes a byte to a pipe
that the loop polls, and the loop takes the results. The loop holds each request's deadline
itself, so a fetch stuck where no socket timeout reaches (a DNS lookup) still fails its request
on time; its thread finishes later and its result is dropped.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import os
import queue
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import SplitResult, urljoin, urlsplit

from ipc.config import EncoderConfig
from services.common.images import ImageError

FETCH_THREADS = 8  # concurrent fetches per tokenizer replica; more wait their turn
CHUNK_BYTES = 64 << 10
# The loop's deadline for a request's fetches is their own plus this: the fetch's socket timeouts
# fire first whenever they can, with the more precise message.
DEADLINE_MARGIN_S = 1.0
REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Object stores often serve files without a type of their own; the encoder decodes and checks them.
UNTYPED = frozenset({"application/octet-stream", "binary/octet-stream"})
MAX_URL_CHARS_SHOWN = 200
NOT_FETCHED = "image_url: this run fetches no http(s) images (encoder.remote_images false): send a data: URL"


def shown(url: str) -> str:
    return url if len(url) <= MAX_URL_CHARS_SHOWN else url[:MAX_URL_CHARS_SHOWN] + "..."


def is_remote(url: str) -> bool:
    return urlsplit(url).scheme.lower() in ("http", "https")


@dataclass(frozen=True)
class RemoteImages:
    """What a run fetches for its clients (docs/config.md, `encoder.remote_image*`)."""

    max_bytes: int
    timeout_s: float
    max_redirects: int
    domains: tuple[str, ...] = ()  # allowed hosts and their subdomains; () = any host

    @classmethod
    def of(cls, config: EncoderConfig) -> RemoteImages | None:
        """The run's policy; None when it fetches nothing (`encoder.remote_images` false)."""
        if not config.remote_images:
            return None
        return cls(
            max_bytes=config.max_image_bytes,
            timeout_s=config.remote_image_timeout_s,
            max_redirects=config.remote_image_max_redirects,
            domains=tuple(d.lower().strip(".") for d in config.remote_image_domains),
        )

    def check(self, url: str) -> SplitResult:
        """The parts of `url` if this policy lets it be fetched; raises ImageError naming why not."""
        try:
            parts = urlsplit(url)
            _ = parts.port  # raises ValueError on a port out of range or not a number
        except ValueError as exc:
            raise ImageError(f"image_url: {shown(url)} is not a valid URL ({exc})") from None
        if parts.scheme.lower() not in ("http", "https"):
            raise ImageError(f"image_url: only http and https images are fetched, not {shown(url)}")
        host = (parts.hostname or "").lower()
        if not host:
            raise ImageError(f"image_url: {shown(url)} names no host")
        if self.domains and not any(host == d or host.endswith("." + d) for d in self.domains):
            raise ImageError(
                f"image_url: host {host} is not one this run fetches images from (encoder.remote_image_domains)"
            )
        return parts

    @property
    def request_deadline_s(self) -> float:
        """How long one request's fetches may take, all together: they run side by side, each
        within `timeout_s`."""
        return self.timeout_s + DEADLINE_MARGIN_S

    def overdue(self) -> str:
        """The refusal of a request whose fetches are past `request_deadline_s`."""
        return (
            f"image_url: fetching this request's images took over {self.timeout_s:g}s "
            "(encoder.remote_image_timeout_s)"
        )


def fetch_outcome(url: str, policy: RemoteImages) -> bytes | ImageError:
    """`fetch`'s body, or its refusal; never raises, for a thread pool's caller that reports
    the first failure of several: no input may take a fetch down unanswered."""
    try:
        return fetch(url, policy)
    except ImageError as exc:
        return exc
    except Exception as exc:
        return ImageError(f"image_url: fetching {shown(url)} failed: {type(exc).__name__}: {exc}")


def fetch(url: str, policy: RemoteImages) -> bytes:
    """The body of the image at `url`, within `policy`. Raises ImageError."""
    deadline = time.monotonic() + policy.timeout_s
    original = url
    for _ in range(policy.max_redirects + 1):
        parts = policy.check(url)
        try:
            status, location, body = _get(parts, policy, deadline)
        except TimeoutError:
            raise ImageError(
                f"image_url: fetching {shown(original)} took over {policy.timeout_s:g}s "
                "(encoder.remote_image_timeout_s)"
            ) from None
        except (OSError, http.client.HTTPException) as exc:  # refused, unreachable, TLS, bad reply
            raise ImageError(
                f"image_url: could not fetch {shown(url)}: {type(exc).__name__}: {exc}"
            ) from None
        if body is not None:
            return body
        if status not in REDIRECTS:
            raise ImageError(f"image_url: {shown(url)} answered HTTP {status}")
        if not location:
            raise ImageError(f"image_url: {shown(url)} answered HTTP {status} without a Location")
        url = urljoin(url, location)
    raise ImageError(
        f"image_url: {shown(original)} redirected more than {policy.max_redirects} times "
        "(encoder.remote_image_max_redirects)"
    )


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _get(parts: SplitResult, policy: RemoteImages, deadline: float) -> tuple[int, str | None, bytes | None]:
    """One GET: (status, Location, None) for anything but a 200, (200, None, body) for an image."""
    url = parts.geturl()
    if parts.scheme.lower() == "https":
        connection: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=_remaining(deadline), context=ssl.create_default_context()
        )
    else:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=_remaining(deadline))
    try:
        connection.connect()
    except BaseException:
        connection.close()  # a TLS handshake that failed leaves the plain socket behind
        raise
    # Ours: the connection lets go of it once a response says it closes (HTTP/1.0), though the
    # response still reads from it.
    sock = connection.sock
    response = None
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request(
            "GET",
            target,
            headers={"Accept": "image/*", "Accept-Encoding": "identity", "User-Agent": "brigade"},
        )
        sock.settimeout(_remaining(deadline))
        response = connection.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location"), None
        media = (response.getheader("Content-Type") or "").split(";")[0].strip().lower()
        if media and not media.startswith("image/") and media not in UNTYPED:
            raise ImageError(f"image_url: {shown(url)} is not an image (Content-Type {media})")
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > policy.max_bytes:
            raise ImageError(
                f"image_url: {shown(url)} is {length} bytes, over the {policy.max_bytes}-byte limit "
                "(encoder.max_image_bytes)"
            )
        body = bytearray()
        while True:
            sock.settimeout(_remaining(deadline))  # a slow trickle ends at the deadline too
            chunk = response.read1(CHUNK_BYTES)
            if not chunk:
                return 200, None, bytes(body)
            body += chunk
            if len(body) > policy.max_bytes:
                raise ImageError(
                    f"image_url: {shown(url)} is over the {policy.max_bytes}-byte limit (encoder.max_image_bytes)"
                )
            _remaining(deadline)
    finally:
        if response is not None:
            response.close()
        connection.close()
        sock.close()


@dataclass
class _Pending:
    ticket: int  # which `fetch` of the request: a resubmission's replaces an earlier one's
    num_left: int
    deadline: float
    files: dict[int, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Fetched:
    """A request's remote images, by their index among its images; or `error`, naming the first
    that could not be fetched (a 400)."""

    request_id: str
    files: dict[int, bytes]
    error: str = ""


class ImageFetcher:
    """Fetches requests' remote images on a thread pool. `fetch` starts a request's; poll
    `wake_fd` and call `collect`, which returns the requests whose images are all in, or failed,
    or past their deadline. `forget` drops a request (aborted): what its threads bring is dropped.
    A URL a request names more than once is fetched once, for all of its places."""

    def __init__(self, policy: RemoteImages, num_threads: int = FETCH_THREADS) -> None:
        self.policy = policy
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="image-fetch")
        self._outcomes: queue.SimpleQueue[tuple[str, int, tuple[int, ...], bytes | ImageError]] = (
            queue.SimpleQueue()
        )
        self._tickets = itertools.count()
        self.wake_fd, self._wake_writer = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_writer, False)
        # Read by the pool's threads (is the request still wanted?), written by the loop's only.
        self.pending: dict[str, _Pending] = {}

    def fetch(self, request_id: str, urls: dict[int, str], now: float) -> None:
        ticket = next(self._tickets)
        places: dict[str, list[int]] = {}  # each distinct URL, and the image indices it fills
        for index, url in urls.items():
            places.setdefault(url, []).append(index)
        self.pending[request_id] = _Pending(ticket, len(places), now + self.policy.request_deadline_s)
        for url, indices in places.items():
            self._pool.submit(self._fetch_one, request_id, ticket, tuple(indices), url)

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def _wanted(self, request_id: str, ticket: int) -> _Pending | None:
        pending = self.pending.get(request_id)
        return pending if pending is not None and pending.ticket == ticket else None

    def _fetch_one(self, request_id: str, ticket: int, indices: tuple[int, ...], url: str) -> None:
        if self._wanted(request_id, ticket) is None:
            return  # aborted, failed by another image or resubmitted, while this one waited for a thread
        self._outcomes.put((request_id, ticket, indices, fetch_outcome(url, self.policy)))
        with contextlib.suppress(BlockingIOError):  # a full pipe holds wakes enough: the loop is coming
            os.write(self._wake_writer, b"\0")

    def collect(self, now: float) -> list[Fetched]:
        """The requests done since the last call: all their images in, one failed, or their
        deadline passed."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_fd, 4096):
                pass
        done = []
        while True:
            try:
                request_id, ticket, indices, outcome = self._outcomes.get_nowait()
            except queue.Empty:
                break
            pending = self._wanted(request_id, ticket)
            if pending is None:
                continue  # forgotten, failed already, or fetched again for a resubmission
            if isinstance(outcome, ImageError):
                del self.pending[request_id]
                done.append(Fetched(request_id, {}, f"images[{indices[0]}]: {outcome}"))
                continue
            pending.files |= dict.fromkeys(indices, outcome)
            pending.num_left -= 1
            if pending.num_left == 0:
                del self.pending[request_id]
                done.append(Fetched(request_id, pending.files))
        for request_id, pending in list(self.pending.items()):
            if now >= pending.deadline:
                del self.pending[request_id]
                done.append(Fetched(request_id, {}, self.policy.overdue()))
        return done

    def close(self) -> None:
        """Drop what waits for a thread. The pipe stays open until the process ends: a fetch
        still running may yet write its wake, and a closed descriptor's number may be reused."""
        self.pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
