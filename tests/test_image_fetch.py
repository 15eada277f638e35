"""http(s) image URLs (issue 36): the tokenizer fetches them off its loop within the run's limits
(services/common/image_fetch.py), against a real local HTTP server (http.server in a thread)
that serves a PNG, redirects, a 404, a page, an oversized body (announced, and endless), a slow
trickle. Through a whole run, the real `openai` client's http URL gives exactly what the same
image as a data URL gives (test_image_chat.py checks those against HF), and each bad URL is a 400
naming its problem while the run keeps serving; the Responses API's `input_image` (a data or an
http URL) serves what the chat does, and the encoder's metrics count the images, in the same run.
A gateway replica in this process shows /tokenize fetching a chat's images side by side, each
URL once, within one deadline, and refusing what the tokenizer stage refuses."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import numpy as np
import pytest
import zmq
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from client.async_sdk import AsyncClient
from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST
from services.audit import ApiKeyFailures, AuditLog
from services.common.image_fetch import ImageFetcher, RemoteImages, fetch
from services.common.images import image_rules_of
from services.common.text import Tokenizer
from services.gateway.app import Gateway, GatewaySettings
from services.metrics import HttpMetrics
from services.tokenizer.core import JournalEntry, Reply, RequestError, TokenizerCore
from tests.harness import assert_clean, brigade_run, free_port, gateway_in_thread, tokenizer_dealer
from tests.test_e2e import gateway_url
from tests.test_image_chat import data_url, png, served_messages, tokenize_messages_count

pytestmark = pytest.mark.timeout(300)

MAX_BYTES = 64 << 10
IMAGE = png(50, 37, seed=0)
TRICKLE_S = 0.25  # /slow's pause between bytes: never one socket timeout, always past the deadline
LATE_S = 1.0  # /late/PATH's wait before it answers as PATH does


class ImageHandler(BaseHTTPRequestHandler):
    """Its server's files as PNGs, and one path per case; `/hop/N` redirects N times before the
    PNG; `/late/PATH` answers as PATH does, LATE_S later. It counts the requests for each path."""

    server: ImageHttpServer

    def do_GET(self) -> None:
        path = self.path
        with self.server.lock:
            self.server.hits[path] += 1
        if path.startswith("/late/"):
            time.sleep(LATE_S)
            path = path.removeprefix("/late")
        if path in self.server.files:
            self.reply(200, "image/png", self.server.files[path])
        elif path == "/untyped":
            self.reply(200, "application/octet-stream", IMAGE)
        elif path.startswith("/hop/"):
            hops = int(path.removeprefix("/hop/"))
            self.redirect("/cat.png" if hops <= 1 else f"/hop/{hops - 1}")
        elif path == "/away":
            self.redirect("ftp://127.0.0.1/cat.png")
        elif path == "/page.html":
            self.reply(200, "text/html; charset=utf-8", b"<html><body>not a picture</body></html>")
        elif path == "/big":
            self.reply(200, "image/png", b"\x89PNG" + b"\0" * MAX_BYTES)
        elif path == "/endless":  # no Content-Length: only the bytes read tell
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(10_000):  # 640 MB at most, should the client never stop reading
                    self.wfile.write(b"\0" * (64 << 10))
            except OSError:
                pass  # the client hung up, as it should
        elif path == "/slow":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            try:
                for byte in IMAGE:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(TRICKLE_S)
            except OSError:
                pass
        else:
            self.reply(404, "text/plain", b"no such picture")

    def reply(self, status: int, media: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: pytest shows a failed test's own output


class ImageHttpServer(ThreadingHTTPServer):
    daemon_threads = True
    files: dict[str, bytes]
    hits: Counter[str]  # requests by path, under `lock`: the handlers run on a thread each
    lock: threading.Lock


class ImageServer:
    """ImageHandler's server on a free loopback port, in a thread: `/cat.png` and `files`, by path."""

    def __init__(self, files: dict[str, bytes] | None = None) -> None:
        self.files = {"/cat.png": IMAGE, **(files or {})}
        self.server = ImageHttpServer(("127.0.0.1", 0), ImageHandler)
        self.server.files = self.files
        self.server.hits = self.hits = Counter()
        self.server.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ImageServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    with ImageServer() as server:
        yield server.url


def policy(**changes: object) -> RemoteImages:
    limits: dict = {"max_bytes": MAX_BYTES, "timeout_s": 1.0, "max_redirects": 3}
    return RemoteImages(**{**limits, **changes})


def test_a_fetch_gives_the_served_bytes(image_server: str) -> None:
    assert fetch(f"{image_server}/cat.png", policy()) == IMAGE
    assert fetch(f"{image_server}/untyped", policy()) == IMAGE  # the encoder checks what it is
    assert fetch(f"{image_server}/hop/3", policy()) == IMAGE
    assert fetch(f"{image_server}/cat.png", policy(domains=("127.0.0.1",))) == IMAGE


@pytest.mark.parametrize(
    ("path", "changes", "problem"),
    [
        ("/missing", {}, "/missing answered HTTP 404"),
        ("/page.html", {}, r"/page.html is not an image \(Content-Type text/html\)"),
        ("/big", {}, f"/big is {MAX_BYTES + 4} bytes, over the {MAX_BYTES}-byte limit"),
        ("/endless", {}, f"/endless is over the {MAX_BYTES}-byte limit"),
        ("/slow", {}, r"/slow took over 1s \(encoder.remote_image_timeout_s\)"),
        ("/hop/4", {}, "redirected more than 3 times"),
        ("/hop/1", {"max_redirects": 0}, "redirected more than 0 times"),
        ("/away", {}, "only http and https images are fetched, not ftp://"),
        ("/cat.png", {"domains": ("example.com",)}, "host 127.0.0.1 is not one this run fetches images from"),
    ],
)
def test_bad_remote_images_are_refused_by_name_and_in_time(
    image_server: str, path: str, changes: dict, problem: str
) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=problem):
        fetch(image_server + path, policy(**changes))
    assert time.monotonic() - started < 1.0 + 2 * TRICKLE_S


def test_an_unreachable_host_is_refused_by_name() -> None:
    url = f"http://127.0.0.1:{free_port()}/cat.png"  # nothing listens there
    with pytest.raises(ValueError, match=f"could not fetch {url}: ConnectionRefusedError"):
        fetch(url, policy())


def wait_for(fetcher: ImageFetcher, count: int, timeout_s: float = 10.0) -> list:
    """What the fetcher's loop side collects, polling its pipe as the tokenizer does."""
    poller = zmq.Poller()
    poller.register(fetcher.wake_fd, zmq.POLLIN)
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count:
        assert time.monotonic() < deadline, f"only {out} came"
        poller.poll(100)
        started = time.monotonic()
        out += fetcher.collect(time.monotonic())
        assert time.monotonic() - started < 0.05  # the loop never waits on the network
    return out


def test_the_fetcher_answers_each_request_without_blocking_its_loop(image_server: str) -> None:
    fetcher = ImageFetcher(policy(), num_threads=4)
    now = time.monotonic()
    fetcher.fetch("slow", {0: f"{image_server}/slow"}, now)
    fetcher.fetch("two", {0: f"{image_server}/cat.png", 2: f"{image_server}/hop/1"}, now)
    fetcher.fetch("missing", {1: f"{image_server}/cat.png", 3: f"{image_server}/missing"}, now)
    fetcher.fetch("aborted", {0: f"{image_server}/cat.png"}, now)
    fetcher.forget("aborted")
    # Resubmitted while its first fetch runs: only the second one's outcome counts.
    fetcher.fetch("again", {0: f"{image_server}/missing"}, now)
    fetcher.fetch("again", {0: f"{image_server}/cat.png"}, now)
    # The quick ones come first, while the slow one still trickles.
    quick = {f.request_id: f for f in wait_for(fetcher, 3)}
    assert quick["again"].files == {0: IMAGE} and not quick["again"].error
    assert quick["two"].files == {0: IMAGE, 2: IMAGE} and not quick["two"].error
    assert (
        quick["missing"].error.startswith("images[3]: image_url: ") and "HTTP 404" in quick["missing"].error
    )
    assert list(fetcher.pending) == ["slow"]
    [slow] = wait_for(fetcher, 1)
    assert slow.request_id == "slow" and "took over 1s" in slow.error
    assert not fetcher.pending and fetcher.collect(time.monotonic()) == []  # "aborted" never reported

    # A fetch stuck where its socket timeouts do not reach (a DNS lookup) fails on the loop's clock.
    fetcher.fetch("stuck", {0: f"{image_server}/slow"}, time.monotonic())
    [stuck] = fetcher.collect(time.monotonic() + 3600)
    assert stuck.request_id == "stuck" and "took over 1s" in stuck.error
    fetcher.close()


def test_the_fetcher_fetches_a_url_named_twice_once() -> None:
    """A chat that shows one image three times: one fetch fills the three places; a missing one
    named twice is refused naming its first place."""
    with ImageServer() as images:
        fetcher = ImageFetcher(policy(), num_threads=4)
        now = time.monotonic()
        fetcher.fetch("thrice", dict.fromkeys((1, 4, 5), f"{images.url}/cat.png"), now)
        fetcher.fetch("missing", dict.fromkeys((2, 3), f"{images.url}/gone"), now)
        done = {f.request_id: f for f in wait_for(fetcher, 2)}
        assert done["thrice"].files == {1: IMAGE, 4: IMAGE, 5: IMAGE} and not done["thrice"].error
        assert done["missing"].error.startswith("images[2]: ") and "HTTP 404" in done["missing"].error
        assert images.hits == {"/cat.png": 1, "/gone": 1}
        fetcher.close()


# -- the tokenizer's admission of remote images, without a run -----------------------------------


def vlm_core(model_dir: Path, remote: RemoteImages | None) -> TokenizerCore:
    return TokenizerCore(
        Tokenizer(model_dir), 0, 1, max_model_len=256, max_prompt_chars=1 << 20, default_max_tokens=4,
        image_rules=image_rules_of(model_dir), num_encoders=1, max_image_bytes=MAX_BYTES, remote_images=remote,
    )  # fmt: skip


def chat(*parts: m.TextPart | m.ImagePart) -> m.Generate:
    return m.Generate(
        "r", messages=[m.ChatMessage("user", list(parts))], params=m.SamplingParams(max_tokens=2)
    )


def test_admission_parks_a_chat_until_its_remote_images_are_fetched(tiny_gemma3_vlm_dir: Path) -> None:
    core = vlm_core(tiny_gemma3_vlm_dir, policy())
    url = "http://images.test/cat.png"
    inline = png(20, 20, seed=1)
    entry = core.admit(b"c", chat(m.ImagePart(data_url(inline)), m.TextPart("and"), m.ImagePart(url)))
    assert entry.is_encoding and entry.image_urls == {1: url} and entry.image_files == [inline, b""]
    # Tokenized once its images are in, as every model's chat is (Gemma 3's tokens need no size).
    assert entry.submit.prompt_ids == b"" and entry.image_starts == []
    assert core.resubmissions(0) == [] and core.stalled(time.monotonic() + 3600) == {}
    engine = entry.submit.request_id
    # An encoder's answer before the fetch ends answers what this replica's previous process
    # asked for the same request (a resubmission after a restart has the same engine id): it
    # is dropped, where it failed the request ("the encoder gave 1 tiles for 0").
    assert core.on_encoded(engine, 0, [b"a" * 16], [m.SlotRef(0, 2)], "") is None
    assert core.journal[engine] is entry and entry.is_encoding
    assert core.on_fetched(engine, {1: IMAGE}, "") is entry
    assert entry.image_files == [inline, IMAGE] and not entry.image_urls and entry.is_encoding
    assert len(entry.image_starts) == 2 and entry.submit.prompt_ids and entry.unfetched is None
    assert core.on_fetched(engine, {1: IMAGE}, "") is None  # fetched already: now the encoder's
    assert core.on_encoded(engine, 0, [b"a" * 16, b"b" * 16], [m.SlotRef(0, 2), m.SlotRef(1, 2)], "") is entry

    # A fetch that failed is the client's 400, and the request is gone.
    entry = core.admit(b"c", chat(m.ImagePart(url)))
    reply = core.on_fetched(entry.submit.request_id, {}, "images[0]: image_url: ... answered HTTP 404")
    assert isinstance(reply, Reply) and reply.message.code == "invalid_request"
    assert "HTTP 404" in reply.message.message and entry.submit.request_id not in core.journal


def test_admission_refuses_remote_images_the_run_does_not_fetch(tiny_gemma3_vlm_dir: Path) -> None:
    refusals = [
        (None, "http://images.test/cat.png", r"fetches no http\(s\) images \(encoder.remote_images false\)"),
        (policy(domains=("example.com",)), "https://images.test/cat.png", "host images.test is not one"),
        (policy(), "file:///etc/passwd", "must be a data: URL"),
        (policy(), "http:///cat.png", "names no host"),
        (policy(), "http://images.test:99999/cat.png", "is not a valid URL"),
    ]
    for remote, url, problem in refusals:
        core = vlm_core(tiny_gemma3_vlm_dir, remote)
        with pytest.raises(
            RequestError, match=r"messages\[0\].content\[0\]: image_url: .*" + problem
        ) as caught:
            core.admit(b"c", chat(m.ImagePart(url)))
        assert caught.value.code == "invalid_request" and not core.journal
    # Allowed: the domain itself and its subdomains.
    core = vlm_core(tiny_gemma3_vlm_dir, policy(domains=("example.com",)))
    for url in ("https://example.com/a.png", "https://cdn.example.com/a.png"):
        assert core.admit(b"c", m.Generate(url, messages=chat(m.ImagePart(url)).messages)).image_urls == {
            0: url
        }


def test_a_chat_is_tokenized_once_its_remote_images_are_in(
    tiny_smolvlm_dir: Path, tiny_qwen25vl_dir: Path
) -> None:
    """Where an image's tokens depend on its size (SmolVLM splitting, Qwen2.5-VL), a chat with an
    http(s) image is checked at once and tokenized once it is fetched: the prompt is the one its
    data URL gives, and is what a resubmission carries; the prompt's refusals come after the
    fetch with admission's code and message; an abort while it fetches forgets it."""
    other = png(30, 45, seed=2)
    url = "http://images.test/cat.png"
    for model_dir in (tiny_smolvlm_dir, tiny_qwen25vl_dir):
        rules = image_rules_of(model_dir)
        assert rules is not None and rules.needs_sizes
        core = vlm_core(model_dir, policy())

        def admit(request_id: str, first: str, *text: str, core: TokenizerCore = core) -> JournalEntry:
            parts = [
                m.ImagePart(first),
                m.TextPart("and"),
                m.ImagePart(data_url(other)),
                *map(m.TextPart, text),
            ]
            return core.admit(
                b"c", m.Generate(request_id, messages=chat(*parts).messages, params=chat().params)
            )

        inline = admit("inline", data_url(IMAGE))
        remote = admit("remote", url)
        assert remote.submit.prompt_ids == b"" and remote.image_urls == {0: url} and remote.is_encoding
        assert core.resubmissions(0) == [] and core.stalled(time.monotonic() + 3600) == {}
        engine = remote.submit.request_id
        assert core.on_fetched(engine, {0: IMAGE}, "") is remote and not remote.image_urls
        assert core.on_fetched(engine, {0: IMAGE}, "") is None  # tokenized once
        assert remote.submit.prompt_ids == inline.submit.prompt_ids, model_dir.name
        assert remote.image_starts == inline.image_starts and remote.image_tokens == inline.image_tokens
        assert remote.image_grid_widths == inline.image_grid_widths
        refs = [m.SlotRef(i, n) for i, n in enumerate(remote.image_tokens)]
        assert core.on_encoded(engine, 0, [b"k" * 16] * len(refs), refs, "") is remote
        assert core.resubmissions(0)[0].prompt_ids == inline.submit.prompt_ids

        # What the request alone decides is refused before any fetch.
        too_hot = m.SamplingParams(max_tokens=2, temperature=-1.0)
        with pytest.raises(RequestError, match="temperature") as caught:
            core.admit(b"c", m.Generate("hot", messages=chat(m.ImagePart(url)).messages, params=too_hot))
        assert caught.value.code == "invalid_request" and core.missing(b"c", ["hot"]) == ["hot"]
        # What needs the prompt comes after the fetch, as admission words it for a data URL.
        for text in (rules.image_token, "many words " * 200):
            with pytest.raises(RequestError) as caught:
                admit("inline again", data_url(IMAGE), text)
            entry = admit("later", url, text)
            reply = core.on_fetched(entry.submit.request_id, {0: IMAGE}, "")
            assert isinstance(reply, Reply) and isinstance(reply.message, m.ErrorReply)
            assert (reply.message.code, reply.message.message) == (caught.value.code, str(caught.value))
            assert entry.submit.request_id not in core.journal
        assert caught.value.code == "prompt_too_long"
        # Aborted while its images are fetched: forgotten, and what its fetch brings is dropped.
        entry = admit("aborted", url)
        assert core.abort(b"c", "aborted") is entry and entry.submit.request_id not in core.journal
        assert core.on_fetched(entry.submit.request_id, {0: IMAGE}, "") is None


# -- the gateway's /tokenize, in this process -----------------------------------------------------

TOKENIZE_TIMEOUT_S = 2.0  # the gateway's encoder.remote_image_timeout_s: twice LATE_S
FETCH_THREAD_PREFIX = "tokenize-image-fetch"


@pytest.fixture(scope="module")
def tokenize_url(tiny_qwen25vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway replica in this process (uvicorn on a thread with its own loop) of Qwen2.5-VL,
    whose image tokens depend on each image's size, so /tokenize reads every image; with
    encoder.max_image_bytes MAX_BYTES and remote_image_timeout_s TOKENIZE_TIMEOUT_S. No run is
    behind it: /tokenize never asks one. Its base URL; once it stops, its fetch threads end."""
    state_dir = tmp_path_factory.mktemp("tokenize-gateway")

    def make_gateway() -> Gateway:
        settings = GatewaySettings(
            model="tiny", max_model_len=4096, api_keys=frozenset(), max_concurrent_requests=8,
            max_body_bytes=4 << 20, run_dir=state_dir,
            key_failures=ApiKeyFailures(AuditLog(state_dir / "audit.jsonl", "test-gateway")),
            max_prompt_chars=1 << 20, max_messages=64, template_timeout_s=5.0, body_timeout_s=30.0,
            max_image_bytes=MAX_BYTES,
        )  # fmt: skip
        return Gateway(
            settings,
            AsyncClient(endpoints=[f"ipc://{state_dir}/no-tokenizer"]),
            Tokenizer(tiny_qwen25vl_dir),
            HttpMetrics(CollectorRegistry()),  # one per in-process gateway: names register once
            image_rules=image_rules_of(tiny_qwen25vl_dir),
            remote_images=policy(timeout_s=TOKENIZE_TIMEOUT_S),
        )

    with gateway_in_thread(make_gateway) as url:
        yield url
    deadline = time.monotonic() + 2 * TOKENIZE_TIMEOUT_S  # a running fetch ends within its timeout
    while fetchers := [t.name for t in threading.enumerate() if t.name.startswith(FETCH_THREAD_PREFIX)]:
        assert time.monotonic() < deadline, f"{fetchers} still run after the gateway closed"
        time.sleep(0.05)


def tokenize(url: str, urls: list[str]) -> tuple[int, dict]:
    """/tokenize of one user turn, each image of `urls` after a line of text: (status, reply)."""
    content: list[dict] = []
    for i, image in enumerate(urls):
        content += [{"type": "text", "text": f"Picture {i}:"}, image_part(image)]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        connection.request("POST", "/tokenize", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def tokenize_count(url: str, urls: list[str]) -> int:
    status, reply = tokenize(url, urls)
    assert status == 200, reply
    return reply["count"]


PICTURES = {f"/{i}.png": png(width, height, seed=i) for i, (width, height) in
            enumerate([(50, 37), (30, 45), (64, 20), (20, 64)])}  # fmt: skip


def test_tokenize_fetches_a_chats_images_side_by_side_and_each_once(tokenize_url: str) -> None:
    """Four images, each LATE_S in coming, are counted in about LATE_S (one after another they
    would take four times that), as their data URLs count; an image named twice is fetched once."""
    with ImageServer(PICTURES) as images:
        want = tokenize_count(tokenize_url, [data_url(data) for data in PICTURES.values()])
        started = time.monotonic()
        got = tokenize_count(tokenize_url, [f"{images.url}/late{path}" for path in PICTURES])
        took = time.monotonic() - started
        assert got == want
        assert took < 3 * LATE_S, f"/tokenize took {took:.2f}s for 4 images of {LATE_S}s each"
        assert images.hits == {f"/late{path}": 1 for path in PICTURES}

        images.hits.clear()
        first, second = PICTURES["/0.png"], PICTURES["/1.png"]
        twice = [f"{images.url}/late/0.png", f"{images.url}/late/1.png", f"{images.url}/late/0.png"]
        assert tokenize_count(tokenize_url, twice) == tokenize_count(
            tokenize_url, [data_url(first), data_url(second), data_url(first)]
        )
        assert images.hits == {"/late/0.png": 1, "/late/1.png": 1}


def test_tokenize_refuses_the_first_bad_image_in_prompt_order(tokenize_url: str) -> None:
    """The third of four images 404s, after the fourth (not an image) has failed: the 400 names
    the third. A URL the policy refuses, or a data URL over encoder.max_image_bytes, is refused
    before any image is fetched."""
    with ImageServer(PICTURES) as images:
        urls = [f"{images.url}/late/0.png", f"{images.url}/late/1.png", f"{images.url}/late/missing.png",
                f"{images.url}/page.html"]  # fmt: skip
        status, reply = tokenize(tokenize_url, urls)
        assert status == 400, reply
        error = reply["error"]
        assert error["message"] == f"image_url: {images.url}/late/missing.png answered HTTP 404"
        assert error["param"] == "messages"
        assert images.hits["/page.html"] == 1  # it was fetched, and failed first

        images.hits.clear()
        refused = {
            f"http://127.0.0.1:{10**6}/0.png": "is not a valid URL",
            "ftp://127.0.0.1/0.png": "must be a data: URL",
            data_url(png(200, 200, seed=9)): f"over the {MAX_BYTES}-byte limit",
        }
        for bad, problem in refused.items():
            status, reply = tokenize(tokenize_url, [f"{images.url}/late/0.png", bad])
            assert status == 400 and problem in reply["error"]["message"], reply
        assert not images.hits


# -- through a whole run --------------------------------------------------------------------------


def image_message(url: str) -> list[dict]:
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in this picture?"},
    ]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def vlm_run(tiny_gemma3_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    run_dir = tmp_path_factory.mktemp("remote-images") / "run"
    overrides = (
        f"model.path={tiny_gemma3_vlm_dir}", "model.dtype=float32", "model.max_model_len=256",
        "encoder.replicas=1", f"encoder.max_image_bytes={MAX_BYTES}", "encoder.remote_image_timeout_s=1",
        "gateway.served_model_name=tiny",
    )  # fmt: skip
    with brigade_run(run_dir, *overrides) as run:
        yield run
    assert_clean(run_dir)


@pytest.mark.slow
def test_an_http_image_serves_what_its_data_url_does(vlm_run, image_server: str) -> None:
    import openai

    api = openai.OpenAI(base_url=gateway_url(vlm_run), api_key="none", timeout=120, max_retries=0)
    inline = served_messages(api, image_message(data_url(IMAGE)))
    remote = served_messages(api, image_message(f"{image_server}/hop/1"))
    assert remote[0] == inline[0]
    # The second is a prefix cache hit (the same prompt, its image keyed by its pixels): its
    # logprobs come from another order of float32 sums, about 1e-6 off.
    np.testing.assert_allclose(remote[1], inline[1], rtol=0, atol=1e-5)

    bad = {
        "/missing": "answered HTTP 404",
        "/big": f"over the {MAX_BYTES}-byte limit",
        "/endless": f"over the {MAX_BYTES}-byte limit",
        "/page.html": "is not an image",
        "/slow": "took over 1s",
    }
    for path, problem in bad.items():
        with pytest.raises(openai.BadRequestError, match=problem):
            api.chat.completions.create(
                model="tiny", messages=image_message(image_server + path), max_tokens=2
            )
    with pytest.raises(openai.BadRequestError, match="ConnectionRefusedError"):
        unreachable = f"http://127.0.0.1:{free_port()}/cat.png"
        api.chat.completions.create(model="tiny", messages=image_message(unreachable), max_tokens=2)
    # ... and the run goes on serving, remote images too.
    assert served_messages(api, image_message(f"{image_server}/cat.png"))[0] == inline[0]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def assert_http_images_serve_as_data_urls(run, image_token: str) -> None:
    """In a run (`encoder.max_image_bytes` MAX_BYTES) of a model whose image tokens depend on each
    image's size: an http image, alone and beside a data URL image, serves and counts (/tokenize)
    what the same images as data URLs do; an unreachable, too large or untyped one is a 400, and
    so is text that spells the image token beside an http image (refused after its fetch, by the
    prompt); a request aborted while its image is fetched is forgotten; the run keeps serving."""
    import openai

    base_url = gateway_url(run)
    api = openai.OpenAI(base_url=base_url, api_key="none", timeout=120, max_retries=0)
    first, second = png(50, 37, seed=0), png(30, 45, seed=2)
    with ImageServer({"/first.png": first}) as images:
        remote = f"{images.url}/first.png"

        def chats(url: str) -> list[list[dict]]:  # the image alone, and beside a data URL image
            text = [{"type": "text", "text": t} for t in ("What is it?", "Compare", "with")]
            return [
                [{"role": "user", "content": [image_part(url), text[0]]}],
                [
                    {
                        "role": "user",
                        "content": [text[1], image_part(url), text[2], image_part(data_url(second))],
                    }
                ],
            ]

        for inline, fetched in zip(chats(data_url(first)), chats(remote), strict=True):
            want, got = served_messages(api, inline), served_messages(api, fetched)
            assert got[0] == want[0]
            np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-5)  # a prefix cache hit
            assert tokenize_messages_count(base_url, fetched) == tokenize_messages_count(base_url, inline)
        bad = {
            f"http://127.0.0.1:{free_port()}/cat.png": "ConnectionRefusedError",
            f"{images.url}/big": f"over the {MAX_BYTES}-byte limit",
            f"{images.url}/page.html": "is not an image",
            f"{images.url}/missing": "answered HTTP 404",
        }
        for url, problem in bad.items():
            with pytest.raises(openai.BadRequestError, match=problem):
                api.chat.completions.create(model="tiny", messages=image_message(url), max_tokens=2)
        # Both models' placeholder is their image token: spelled in text, it is one placeholder too many.
        spelled = [{"role": "user", "content": [image_part(remote), {"type": "text", "text": image_token}]}]
        with pytest.raises(openai.BadRequestError, match="rendered 2 image placeholders for 1 images"):
            api.chat.completions.create(model="tiny", messages=spelled, max_tokens=2)
        assert_an_abort_while_fetching_forgets_the_request(run.run_dir, f"{images.url}/slow")
        assert served_messages(api, chats(remote)[0])[0] == served_messages(api, chats(data_url(first))[0])[0]


def assert_an_abort_while_fetching_forgets_the_request(run_dir: Path, slow_url: str) -> None:
    """A client's request, held by the tokenizer while its image trickles in, then aborted: the
    abort is answered and the tokenizer holds no request any more."""
    ctx = zmq.Context()
    try:
        sock = tokenizer_dealer(ctx, run_dir)

        def answer(kind: type) -> m.ClientReply:  # skipping the keepalives
            while True:
                assert sock.poll(30_000), f"no {kind.__name__}"
                reply = CLIENT_REPLY.decode(sock.recv())
                if isinstance(reply, kind):
                    return reply

        parts = [m.ImagePart(slow_url), m.TextPart("Hi")]
        chat = m.Generate(
            "slow", messages=[m.ChatMessage("user", parts)], params=m.SamplingParams(max_tokens=2)
        )
        sock.send(CLIENT_REQUEST.encode(chat))
        sock.send(CLIENT_REQUEST.encode(m.Health(["slow"])))
        held = answer(m.HealthReply)
        assert held.missing == [] and held.num_in_flight == 1
        sock.send(CLIENT_REQUEST.encode(m.Abort("slow")))
        final = answer(m.Delta)
        assert final.request_id == "slow" and final.finish_reason == "abort"
        sock.send(CLIENT_REQUEST.encode(m.Health(["slow"])))
        gone = answer(m.HealthReply)
        assert gone.missing == ["slow"] and gone.num_in_flight == 0
    finally:
        ctx.destroy(linger=0)


# -- the Responses API's input_image --------------------------------------------------------------


def test_input_image_parts_become_the_chats_image_parts() -> None:
    from services.gateway.errors import ApiError
    from services.gateway.responses import InputItem, input_messages

    url = data_url(IMAGE)
    items = msgspec.convert(
        [{"role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                      {"type": "input_image", "image_url": url, "detail": "auto"}]},
         {"role": "assistant", "content": [{"type": "output_text", "text": "Noise."}]}],
        list[InputItem],
    )  # fmt: skip
    assert input_messages(items) == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": url}}],
        },
        {"role": "assistant", "content": "Noise."},
    ]
    bad = msgspec.convert(
        [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}], list[InputItem]
    )
    with pytest.raises(ApiError, match=r"input_image needs an image_url .* got a file_id") as caught:
        input_messages(bad)
    assert caught.value.param == "input[0].content[0].image_url"


def responses_input(url: str, text: str = "What is in this picture?") -> list[dict]:
    content = [
        {"type": "input_image", "image_url": url, "detail": "auto"},
        {"type": "input_text", "text": text},
    ]
    return [{"role": "user", "content": content}]


@pytest.mark.slow
def test_responses_input_image_serves_what_chat_does(vlm_run, image_server: str) -> None:
    import openai

    api = openai.OpenAI(base_url=gateway_url(vlm_run), api_key="none", timeout=120, max_retries=0)

    def chat_text(messages: list[dict]) -> str:
        reply = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        return reply.choices[0].message.content

    want = chat_text(image_message(data_url(IMAGE)))
    assert want  # something to compare
    for url in (data_url(IMAGE), f"{image_server}/cat.png"):
        response = api.responses.create(
            model="tiny", input=responses_input(url), max_output_tokens=8, temperature=0
        )
        assert response.output_text == want, url

    # The stored conversation keeps the image: a follow-up reads it again.
    first = api.responses.create(
        model="tiny", input=responses_input(f"{image_server}/cat.png"), max_output_tokens=8, temperature=0
    )
    follow = api.responses.create(
        model="tiny", previous_response_id=first.id, input="And now?", max_output_tokens=8, temperature=0
    )
    history = [*image_message(data_url(IMAGE)), {"role": "assistant", "content": want},
               {"role": "user", "content": "And now?"}]  # fmt: skip
    assert follow.output_text == chat_text(history)

    with pytest.raises(openai.BadRequestError, match="answered HTTP 404"):
        api.responses.create(
            model="tiny", input=responses_input(f"{image_server}/missing"), max_output_tokens=2
        )


# -- the encoder's metrics ------------------------------------------------------------------------


def encoder_samples(base_url: str) -> dict[str, float]:
    """The run's brigade:encoder_* samples from the gateway's /metrics (histograms by their
    _count and _sum), each named with its outcome or stage label where it has one."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("brigade:encoder_") or sample.name.endswith("_bucket"):
                continue
            label = sample.labels.get("outcome") or sample.labels.get("stage")
            name = f"{sample.name}{{{label}}}" if label else sample.name
            out[name] = out.get(name, 0.0) + sample.value
    return out


@pytest.mark.slow
def test_the_encoder_reports_its_images_cache_and_times(vlm_run) -> None:
    import openai

    url = gateway_url(vlm_run)
    api = openai.OpenAI(base_url=url, api_key="none", timeout=120, max_retries=0)
    before = encoder_samples(url.removesuffix("/v1"))
    fresh = png(33, 21, seed=7)  # no other test sends it
    for _ in range(2):
        served_messages(api, image_message(data_url(fresh)))
    with pytest.raises(openai.BadRequestError, match="truncated or corrupt"):
        truncated = data_url(fresh[: len(fresh) // 2])
        api.chat.completions.create(model="tiny", messages=image_message(truncated), max_tokens=2)
    after = encoder_samples(url.removesuffix("/v1"))

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("brigade:encoder_images_encoded_total") == 1  # once; then the cache has it
    assert grew("brigade:encoder_cache_hits_total") >= 1
    assert grew("brigade:encoder_requests_total{answered}") >= 2
    assert grew("brigade:encoder_requests_total{refused}") >= 1
    assert grew("brigade:encoder_requests_total{failed}") == 0
    for histogram in ("brigade:encoder_encode_time_seconds", "brigade:encoder_queue_time_seconds"):
        assert grew(f"{histogram}_count") >= 3 and grew(f"{histogram}_sum") > 0
    # The queue, from the encoder's heartbeats: empty once the requests are answered.
    deadline = time.monotonic() + 30
    while encoder_samples(url.removesuffix("/v1")).get("brigade:encoder_queue_depth{encoder-0}") != 0:
        assert time.monotonic() < deadline, "no encoder_queue_depth of 0 for encoder-0"
        time.sleep(0.5)
