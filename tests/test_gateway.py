"""The OpenAI-compatible HTTP gateway, end to end: a real Brigade run (tiny model, two gateway
replicas on one port), driven by the real `openai` package, curl and raw HTTP connections."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from client import Client
from tests.harness import assert_clean, brigade_run, free_port

pytestmark = pytest.mark.timeout(600)

CONFIG_KEY = "sk-config-key"
ENV_KEY = "sk-env-key"
MAX_MODEL_LEN = 1024
MAX_CONCURRENT = 8
MAX_PROMPT_CHARS = 100_000
MAX_BODY_BYTES = 6 * MAX_PROMPT_CHARS + (1 << 20)  # services/gateway/__main__.py: max_body_bytes
HTTP_TIMEOUT_S = 120.0
CHAT = [{"role": "user", "content": "Write a haiku about buckets."}]


class Gateway:
    """The run under test and how to reach its HTTP API."""

    def __init__(self, run, port: int, model: str) -> None:
        self.run = run
        self.port = port
        self.model = model
        self.url = f"http://127.0.0.1:{port}"

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=CONFIG_KEY, timeout=HTTP_TIMEOUT_S, **kwargs)

    def request(
        self, method: str, path: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """One raw HTTP request (a fresh connection); status, headers (lower-case) and body."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT_S)
        try:
            conn.request(method, path, data, {"authorization": f"Bearer {CONFIG_KEY}", **(headers or {})})
            reply = conn.getresponse()
            return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
        finally:
            conn.close()

    def error(self, path: str, body: bytes | dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
        status, _, data = self.request("POST", path, body, headers)
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return status, error

    def curl_stream(
        self, body: dict, headers: dict[str, str] | None = None
    ) -> tuple[dict[str, str], list[dict]]:
        """POST a streamed request with curl; the response headers and every SSE event."""
        argv = ["curl", "-sS", "-N", "-D", "-", "--max-time", str(int(HTTP_TIMEOUT_S))]
        for key, value in {
            "authorization": f"Bearer {CONFIG_KEY}",
            "content-type": "application/json",
            **(headers or {}),
        }.items():
            argv += ["-H", f"{key}: {value}"]
        argv += [
            "--data-binary",
            json.dumps(body),
            f"{self.url}/v1/completions" if "prompt" in body else f"{self.url}/v1/chat/completions",
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=HTTP_TIMEOUT_S + 30, check=True)
        head, _, stream = done.stdout.replace("\r\n", "\n").partition("\n\n")
        reply_headers = dict(line.lower().split(": ", 1) for line in head.splitlines()[1:])
        return reply_headers, parse_sse(stream)


def parse_sse(stream: str) -> list[dict]:
    """Events as {"id": str | None, "data": str}."""
    events = []
    for block in stream.split("\n\n"):
        if not block.strip():
            continue
        event = {"id": None, "data": ""}
        for line in block.splitlines():
            field, _, value = line.partition(": ")
            event[field] = value
        events.append(event)
    return events


def scheduler_load(run) -> tuple[int, float]:
    rows = [r for r in run.status() if r["kind"] == "scheduler"]
    return sum(r["running"] + r["queue_depth"] for r in rows), max(r["kv_usage"] for r in rows)


def wait_idle(run, timeout: float = 60.0) -> tuple[int, float]:
    deadline = time.monotonic() + timeout
    load = scheduler_load(run)
    while time.monotonic() < deadline and load != (0, 0.0):
        time.sleep(0.2)
        load = scheduler_load(run)
    return load


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    run_dir = tmp_path_factory.mktemp("gw")
    port = free_port()
    os.environ["BRIGADE_API_KEYS"] = f" {ENV_KEY} ,"
    try:
        with brigade_run(
            run_dir,
            f"model.path={tiny_model_dir}",
            f"model.max_model_len={MAX_MODEL_LEN}",
            f"gateway.port={port}",
            "gateway.replicas=2",
            f"gateway.api_keys=[{CONFIG_KEY}]",
            f"gateway.max_concurrent_requests={MAX_CONCURRENT}",
            f"tokenizer.max_prompt_chars={MAX_PROMPT_CHARS}",
        ) as run:
            os.environ.pop("BRIGADE_API_KEYS")  # the supervisor has its copy; no other run may see it
            ready = next(line for line in run.log if line.startswith("Brigade ready:"))
            assert f"http://127.0.0.1:{port}/v1" in ready
            yield Gateway(run, port, str(tiny_model_dir))
    finally:
        os.environ.pop("BRIGADE_API_KEYS", None)
    assert_clean(run_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# -- chat and completions ---------------------------------------------------------------------


def test_chat_greedy_equals_the_sdk_streamed_and_not(gw: Gateway, hf_tokenizer) -> None:
    api = gw.openai()
    reply = api.chat.completions.create(model=gw.model, messages=CHAT, max_tokens=24, temperature=0)
    with Client(gw.run.run_dir) as sdk:
        want = sdk.chat(CHAT, max_tokens=24, temperature=0.0, timeout=HTTP_TIMEOUT_S)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    prompt = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    num_prompt = len(hf_tokenizer(prompt, add_special_tokens=False).input_ids)
    assert reply.usage.prompt_tokens == num_prompt
    assert reply.usage.completion_tokens == len(want.token_ids)
    assert reply.usage.total_tokens == num_prompt + len(want.token_ids)

    chunks = list(
        api.chat.completions.create(
            model=gw.model, messages=CHAT, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    # As OpenAI's: every piece of text comes before the finish, which has a chunk of its own.
    text_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == want.text
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert last.finish_reason == want.finish_reason
    assert last.delta.content is None and last.delta.role is None and last.logprobs is None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == num_prompt
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_completions_prompt_forms_streamed_and_not(gw: Gateway, hf_tokenizer) -> None:
    api = gw.openai()
    prompts = ["Once upon a time", "The bucket brigade"]
    with Client(gw.run.run_dir) as sdk:
        want = [
            sdk.generate(p, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=HTTP_TIMEOUT_S)
            for p in prompts
        ]
    extra = {"ignore_eos": True}
    one = api.completions.create(
        model=gw.model, prompt=prompts[0], max_tokens=12, temperature=0, extra_body=extra
    )
    assert one.object == "text_completion" and one.choices[0].text == want[0].text
    assert one.usage.prompt_tokens == len(hf_tokenizer(prompts[0], add_special_tokens=False).input_ids)
    assert one.usage.completion_tokens == 12 and one.choices[0].finish_reason == "length"

    many = api.completions.create(
        model=gw.model, prompt=prompts, max_tokens=12, temperature=0, extra_body=extra
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert [c.text for c in many.choices] == [w.text for w in want]
    ids = hf_tokenizer(prompts[1], add_special_tokens=False).input_ids
    by_ids = api.completions.create(
        model=gw.model, prompt=ids, max_tokens=12, temperature=0, extra_body=extra
    )
    assert by_ids.choices[0].text == want[1].text
    both_ids = [hf_tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    by_id_lists = api.completions.create(
        model=gw.model, prompt=both_ids, max_tokens=12, temperature=0, extra_body=extra
    )
    assert [c.text for c in by_id_lists.choices] == [w.text for w in want]

    stream = api.completions.create(
        model=gw.model, prompt=prompts[0], max_tokens=12, temperature=0, stream=True, extra_body=extra,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert "".join(c.choices[0].text for c in text_chunks) == want[0].text
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert (last.text, last.logprobs, last.finish_reason) == ("", None, "length")
    assert chunks[-1].usage.completion_tokens == 12


def test_sampling_parameters_take_effect(gw: Gateway) -> None:
    api = gw.openai()
    base = {"model": gw.model, "prompt": "Once upon a time", "max_tokens": 16}
    with Client(gw.run.run_dir) as sdk:
        sampled = sdk.generate("Once upon a time", max_tokens=16, temperature=0.8, top_p=0.9, top_k=40, min_p=0.05,
                               seed=1234, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                               ignore_eos=True, timeout=HTTP_TIMEOUT_S)  # fmt: skip
    reply = api.completions.create(
        **base, temperature=0.8, top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=0.3, user="tester",
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].text == sampled.text

    greedy = api.completions.create(**base, temperature=0, extra_body={"ignore_eos": True})
    word = greedy.choices[0].text.strip().split()[1] if len(greedy.choices[0].text.split()) > 1 else None
    if word:
        for stop in (word, [word, "\u2603"]):
            stopped = api.completions.create(
                **base, temperature=0, stop=stop, extra_body={"ignore_eos": True}
            )
            assert word not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    # A logit bias of +100 on one token makes greedy decoding pick it every time.
    biased = api.completions.create(
        **base, temperature=0, logit_bias={"1000": 100}, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        logprobs=0,
    )  # fmt: skip
    assert biased.choices[0].logprobs.tokens == ["token_id:1000"] * 16


def test_unseeded_sampled_requests_get_a_seed_that_reproduces_them(gw: Gateway) -> None:
    body = {
        "model": gw.model,
        "prompt": "Once upon a time",
        "max_tokens": 16,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    status, headers, data = gw.request("POST", "/v1/completions", body)
    assert status == 200
    seed = int(headers["x-brigade-seed"])
    again = gw.request("POST", "/v1/completions", body, {"x-brigade-seed": str(seed)})
    assert json.loads(again[2])["choices"][0]["text"] == json.loads(data)["choices"][0]["text"]
    as_body = gw.request("POST", "/v1/completions", {**body, "seed": seed})
    assert json.loads(as_body[2])["choices"][0]["text"] == json.loads(data)["choices"][0]["text"]
    status, headers, _ = gw.request("POST", "/v1/completions", {**body, "temperature": 0})
    assert status == 200 and "x-brigade-seed" not in headers  # greedy needs no seed


def test_n_choices_share_the_prompt_and_seeded_ones_reproduce(gw: Gateway) -> None:
    api = gw.openai()
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several full KV blocks
    kwargs = {"model": gw.model, "prompt": prompt, "max_tokens": 16, "temperature": 1.0, "n": 3, "seed": 77}
    first = api.completions.create(**kwargs, extra_body={"ignore_eos": True})
    again = api.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # different seeds per choice
    assert first.usage.completion_tokens == 3 * 16
    assert first.usage.prompt_tokens_details.cached_tokens > 0  # choices 1, 2 reuse choice 0's blocks
    with Client(gw.run.run_dir) as sdk:
        second = sdk.generate(
            prompt, max_tokens=16, temperature=1.0, seed=78, ignore_eos=True, timeout=HTTP_TIMEOUT_S
        )
    assert first.choices[1].text == second.text  # choice j is seed + j

    chunks = list(
        api.chat.completions.create(
            model=gw.model, messages=CHAT, max_tokens=8, n=2, temperature=0, stream=True
        )
    )
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] != ""  # greedy: both choices alike


def test_logprobs_end_to_end(gw: Gateway) -> None:
    api = gw.openai()
    reply = api.chat.completions.create(
        model=gw.model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        # Greedy picks the most likely token: it is the top alternative.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())
    with Client(gw.run.run_dir) as sdk:
        want = sdk.chat(CHAT, max_tokens=8, temperature=0.0, logprobs=3, timeout=HTTP_TIMEOUT_S)
    assert [e.logprob for e in content] == pytest.approx(want.logprobs, abs=1e-6)
    assert len(want.top_logprobs) == 8 and all(len(t) == 3 for t in want.top_logprobs)

    streamed = api.chat.completions.create(
        model=gw.model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    entries = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [e.token for e in content]

    completion = api.completions.create(
        model=gw.model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(re.fullmatch(r"token_id:\d+", t) for t in logprobs.tokens)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(
        len(top) == 2 and t in top for t, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True)
    )


# -- the rest of the API ----------------------------------------------------------------------


def test_models_health_tokenize_detokenize_metrics(gw: Gateway, hf_tokenizer) -> None:
    models = gw.openai().models.list()
    assert [m.id for m in models.data] == [gw.model]
    status, _, body = gw.request("GET", "/health", headers={"authorization": ""})
    assert status == 200, body
    text = "Brigade serves models. 🪣"
    status, _, body = gw.request("POST", "/tokenize", {"model": gw.model, "prompt": text})
    reply = json.loads(body)
    assert (
        status == 200
        and reply["tokens"] == hf_tokenizer(text).input_ids
        and reply["count"] == len(reply["tokens"])
    )
    assert reply["max_model_len"] == MAX_MODEL_LEN
    status, _, body = gw.request("POST", "/tokenize", {"messages": CHAT})
    prompt = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert json.loads(body)["tokens"] == hf_tokenizer(prompt, add_special_tokens=False).input_ids
    status, _, body = gw.request("POST", "/detokenize", {"tokens": reply["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == hf_tokenizer.decode(
        reply["tokens"], skip_special_tokens=True
    )
    # vLLM's /tokenizer_info, as lm-evaluation-harness' remote tokenizer reads it.
    status, _, body = gw.request("GET", "/tokenizer_info")
    info = json.loads(body)
    assert status == 200 and info["eos_token"] == hf_tokenizer.eos_token
    assert info["bos_token"] == hf_tokenizer.bos_token
    assert info["chat_template"] == hf_tokenizer.chat_template
    assert info["model_max_length"] == hf_tokenizer.model_max_length
    assert info["tokenizer_class"] in (
        type(hf_tokenizer).__name__,
        type(hf_tokenizer).__name__.removesuffix("Fast"),
    )
    assert "added_tokens_decoder" not in info
    status, _, _ = gw.request("GET", "/tokenizer_info", headers={"authorization": ""})
    assert status == 401

    status, headers, body = gw.request("GET", "/metrics")
    metrics = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    count = re.search(
        r'^brigade:http_requests_total\{path="/v1/completions",status="200"\} (\S+)$', metrics, re.M
    )
    assert count and float(count.group(1)) >= 5  # summed over both replicas' files
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert re.search(rf"^brigade:http_{name}_count (\S+)$", metrics, re.M), name


def test_echo_leads_each_choice_with_its_prompt(gw: Gateway, hf_tokenizer) -> None:
    """Scores are checked against HF on SmolLM2 in tests/test_e2e.py; here the forms: echo with
    n > 1 and token-id prompts, max_tokens 0 (the prompt alone), and what echo refuses."""
    api = gw.openai()
    prompt = "Once upon a time"
    ids = hf_tokenizer(prompt, add_special_tokens=False).input_ids
    prompts = [prompt, "The bucket brigade"]
    reply = api.completions.create(
        model=gw.model, prompt=prompts, echo=True, max_tokens=3, n=2, temperature=0
    )
    assert [c.text[: len(prompts[c.index // 2])] for c in reply.choices] == [prompt, prompt, *prompts[1:] * 2]
    assert reply.choices[0].text == reply.choices[1].text and len(reply.choices[0].text) > len(prompt)
    alone = api.completions.create(model=gw.model, prompt=ids, echo=True, max_tokens=0, logprobs=0)
    choice = alone.choices[0]
    assert choice.text == prompt and alone.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.top_logprobs is None  # logprobs 0: OpenAI's null
    for body, param in (
        ({"prompt": prompt, "echo": True, "stream": True}, "echo"),  # positions resume by output only
        ({"prompt": prompt, "max_tokens": 0}, "max_tokens"),  # the engine always samples
    ):
        status, error = gw.error("/v1/completions", body)
        assert status == 400 and error["param"] == param, error


# -- errors -----------------------------------------------------------------------------------


def test_every_error_status_through_the_openai_client(gw: Gateway, hf_tokenizer) -> None:
    api = gw.openai(max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=gw.model, messages=CHAT, temperature=-1)
    assert bad.value.body["param"] == "temperature" and bad.value.body["type"] == "invalid_request_error"
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError) as too_long:
        api.completions.create(model=gw.model, prompt=long_prompt, max_tokens=4)
    message = too_long.value.body["message"]
    num_tokens = len(hf_tokenizer(long_prompt, add_special_tokens=False).input_ids)
    assert f"{num_tokens} tokens" in message and f"max_model_len is {MAX_MODEL_LEN}" in message
    assert too_long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gw.url}/v1", api_key="wrong", max_retries=0).models.list()
    audited = [json.loads(line) for line in (gw.run.run_dir / "audit.log").read_text().splitlines()]
    refused = [a for a in audited if a["event"] == "auth_failure" and a["mechanism"] == "api_key"]
    assert refused and refused[-1]["reason"] == "unknown API key" and "wrong" not in json.dumps(refused)
    env_keyed = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=ENV_KEY, max_retries=0)
    assert env_keyed.models.list().data[0].id == gw.model  # BRIGADE_API_KEYS adds keys
    with pytest.raises(openai.NotFoundError) as unknown:
        api.chat.completions.create(model="gpt-17", messages=CHAT)
    assert unknown.value.body["param"] == "model" and unknown.value.body["code"] == "model_not_found"
    status, error = gw.error("/v1/embeddings", {})
    assert status == 404 and error["code"] == "not_found"
    with pytest.raises(openai.APIStatusError) as huge:
        api.completions.create(model=gw.model, prompt="x" * (MAX_BODY_BYTES + 10), max_tokens=1)
    assert huge.value.status_code == 413


def test_too_many_requests_gets_429_with_retry_after(gw: Gateway) -> None:
    """Streams that the client does not read stay in flight (the server waits on the socket), so
    3 x the two replicas' limit of concurrent requests must overflow both."""
    body = json.dumps(
        {"model": gw.model, "prompt": "Count: 1 2 3", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True,
         "temperature": 0, "stream": True}
    ).encode()  # fmt: skip
    conns, statuses, retry_after = [], [], []
    try:
        for _ in range(3 * 2 * MAX_CONCURRENT):
            conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT_S)
            conn.request("POST", "/v1/completions", body, {"authorization": f"Bearer {CONFIG_KEY}"})
            conns.append(conn)
        for conn in conns:
            reply = conn.getresponse()
            statuses.append(reply.status)
            if reply.status == 429:
                retry_after.append(reply.getheader("retry-after"))
                assert json.loads(reply.read())["error"]["type"] == "rate_limit_error"
    finally:
        for conn in conns:
            conn.close()
    assert set(statuses) <= {200, 429} and statuses.count(429) >= MAX_CONCURRENT, statuses
    assert statuses.count(200) <= 2 * MAX_CONCURRENT
    assert retry_after and all(r == "1" for r in retry_after)
    assert wait_idle(gw.run) == (0, 0.0)  # the dropped streams were aborted


BAD_BODIES = {
    "malformed JSON": (b'{"model": ', None, "invalid_json"),
    "not an object": (b"[1, 2, 3]", None, "invalid_type"),
    "wrong type": (b'{"prompt": "hi", "max_tokens": "many"}', "max_tokens", "invalid_type"),
    "wrong nested type": (
        b'{"messages": [{"role": 3, "content": "hi"}]}',
        "messages[0].role",
        "invalid_type",
    ),
    "missing field": (b'{"max_tokens": 3}', "prompt", "missing_required_parameter"),
    "out of range": (b'{"prompt": "hi", "top_p": 7}', "top_p", "invalid_value"),
    "empty prompt": (b'{"prompt": []}', "prompt", "invalid_value"),
    "mixed prompt list": (b'{"prompt": ["a", 1]}', "prompt", "invalid_value"),
    "token id out of vocab": (b'{"prompt": [99999999]}', "prompt", "invalid_value"),
    "bad logit bias key": (b'{"prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias", "invalid_type"),
    "non-text content part": (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        "messages[0].content[0].type",
        "invalid_value",
    ),
    "unknown role": (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages", "invalid_value"),
    "too many choices": (b'{"prompt": "hi", "n": 1000}', "n", "invalid_value"),
    "top_logprobs without logprobs": (
        b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
        "top_logprobs",
        "invalid_value",
    ),
    "invalid utf-8": (b'{"prompt": "\xff\xfe"}', None, "invalid_json"),
    "echoed logprobs over the limit": (
        b'{"prompt": "hi", "echo": true, "logprobs": 21}',
        "logprobs",
        "invalid_value",
    ),
    "negative prompt_logprobs": (
        b'{"prompt": "hi", "prompt_logprobs": -1}',
        "prompt_logprobs",
        "invalid_value",
    ),
    "prompt_logprobs over the limit": (
        b'{"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21}',
        "prompt_logprobs",
        "invalid_value",
    ),
    "prompt_logprobs with stream": (
        b'{"prompt": "hi", "prompt_logprobs": 1, "stream": true}',
        "prompt_logprobs",
        "invalid_value",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_input_gets_400_naming_the_field(gw: Gateway, case: str) -> None:
    body, param, code = BAD_BODIES[case]
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, error = gw.error(path, body)
    assert status == 400, error
    assert error["param"] == param and error["code"] == code, error


def test_bad_headers_and_oversized_bodies_never_crash_a_replica(gw: Gateway) -> None:
    pids = sorted(gw.run.stage_pids("gateway"))
    body = {"model": gw.model, "prompt": "hi", "max_tokens": 2, "stream": True}
    status, error = gw.error("/v1/completions", body, {"last-event-id": "banana"})
    assert status == 400 and error["param"] == "Last-Event-ID"
    status, error = gw.error("/v1/completions", body, {"x-brigade-seed": "-5"})
    assert status == 400 and error["param"] == "X-Brigade-Seed"
    status, error = gw.error("/v1/completions", {"prompt": "hi"}, {"authorization": "Basic abc"})
    assert status == 401 and error["code"] == "invalid_api_key"
    # A chunked body (no Content-Length) that grows past the limit gets 413 too.
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT_S)
    try:
        chunks = (b"x" * (1 << 16) for _ in range(2 * MAX_BODY_BYTES // (1 << 16)))
        conn.request(
            "POST", "/v1/completions", chunks, {"authorization": f"Bearer {CONFIG_KEY}"}, encode_chunked=True
        )
        reply = conn.getresponse()
        assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()
    # Content-Length far past the limit is refused before the body is read.
    status, error = gw.error("/v1/completions", b"{}", {"content-length": str(100 * MAX_BODY_BYTES)})
    assert status == 413
    for garbage in (
        b"GET / HTTP/9.9\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: -4\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", gw.port), timeout=HTTP_TIMEOUT_S) as sock:
            sock.sendall(garbage)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(4096)
    assert sorted(gw.run.stage_pids("gateway")) == pids
    assert gw.request("GET", "/health")[0] == 200


# -- disconnects ------------------------------------------------------------------------------


def abort_count(gw: Gateway) -> float:
    metrics = gw.request("GET", "/metrics")[2].decode()
    pattern = r'^brigade:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, metrics, re.M))


def wait_running(gw: Gateway, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while scheduler_load(gw.run)[0] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "before-the-reply"])
def test_a_client_that_drops_is_aborted_and_its_kv_freed(gw: Gateway, stream: bool) -> None:
    assert wait_idle(gw.run) == (0, 0.0)
    aborts = abort_count(gw)
    body = json.dumps(
        {"model": gw.model, "prompt": "Count: 1 2 3", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True,
         "temperature": 0, "stream": stream}
    ).encode()  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT_S)
    conn.request("POST", "/v1/completions", body, {"authorization": f"Bearer {CONFIG_KEY}"})
    if stream:
        reply = conn.getresponse()
        assert reply.status == 200
        assert reply.readline().startswith(b"id: ")
    else:
        wait_running(gw)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    dropped = time.monotonic()
    assert wait_idle(gw.run) == (0, 0.0)
    freed_after = time.monotonic() - dropped
    deadline = time.monotonic() + 30
    while abort_count(gw) < aborts + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert abort_count(gw) >= aborts + 1, f"not aborted (KV freed {freed_after:.1f}s after the drop)"


# -- gateway crashes --------------------------------------------------------------------------


def test_last_event_id_resumes_exactly_greedy_and_sampled(gw: Gateway) -> None:
    for body in (
        {"model": gw.model, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True,
         "ignore_eos": True},
        {"model": gw.model, "messages": CHAT, "max_tokens": 24, "temperature": 1.0, "stream": True,
         "ignore_eos": True, "logprobs": True},
    ):  # fmt: skip
        headers, events = gw.curl_stream(body)
        assert events[-1]["data"] == "[DONE]"
        seed = headers.get("x-brigade-seed")
        texts = [text_of(e) for e in events[:-1]]
        full = "".join(texts)
        for cut in (1, len(events) // 2, len(events) - 2):
            resume_headers = {"last-event-id": events[cut - 1]["id"]}
            if seed is not None:
                resume_headers["x-brigade-seed"] = seed
            _, rest = gw.curl_stream(body, resume_headers)
            assert rest[-1]["data"] == "[DONE]"
            assert "".join(texts[:cut]) + "".join(text_of(e) for e in rest[:-1]) == full, cut
            ids = [e["id"] for e in events[:cut]] + [e["id"] for e in rest[:-1]]
            assert ids == sorted(ids, key=lambda i: tuple(int(x) for x in i.split("."))), ids


def text_of(event: dict) -> str:
    if event["data"] == "[DONE]":
        return ""
    choices = json.loads(event["data"])["choices"]
    if not choices:
        return ""
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


def kill_gateways(gw: Gateway, replicas: list[int]) -> None:
    rows = {r["name"]: r for r in gw.run.status()}
    for i in replicas:
        os.kill(rows[f"gateway-{i}"]["pid"], signal.SIGKILL)


def test_gateway_sigkill_under_load_loses_nothing(gw: Gateway) -> None:
    prompts = [f"Story number {i}:" for i in range(MAX_CONCURRENT + 4)]
    with Client(gw.run.run_dir) as sdk:
        want = [
            sdk.generate(p, max_tokens=48, temperature=0.0, ignore_eos=True, timeout=HTTP_TIMEOUT_S).text
            for p in prompts
        ]
    api = gw.openai(max_retries=10)

    def one(prompt: str) -> str:
        reply = api.completions.create(
            model=gw.model, prompt=prompt, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        wait_running(gw)
        kill_gateways(gw, [0])
        got = [f.result(timeout=HTTP_TIMEOUT_S * 2) for f in futures]
    assert got == want
    gw.run.wait_until_running(120)

    # Streams: kill every replica, so that every stream breaks; each resumes with Last-Event-ID.
    body = {"model": gw.model, "prompt": "Once upon a time", "max_tokens": 120, "temperature": 0.7, "seed": 5,
            "stream": True, "ignore_eos": True}  # fmt: skip
    _, whole = gw.curl_stream(body)
    want_text = "".join(text_of(e) for e in whole)
    streams = [stream_lines(gw, body) for _ in range(2)]
    heard = [[next(s) for _ in range(3)] for s in streams]  # every stream has begun
    kill_gateways(gw, [0, 1])
    texts = []
    for stream, lines in zip(streams, heard, strict=True):
        lines += list(stream)  # until the connection breaks
        events = parse_sse("".join(lines))
        complete = [e for e in events if e["data"] and e["data"] != "[DONE]" and e["data"].endswith("}")]
        assert events[-1]["data"] != "[DONE]"  # the stream broke
        texts.append(
            ("".join(text_of(e) for e in complete), next(e["id"] for e in reversed(complete) if e["id"]))
        )
    gw.run.wait_until_running(120)
    for text, last_id in texts:
        _, rest = gw.curl_stream(body, {"last-event-id": last_id})
        assert text + "".join(text_of(e) for e in rest) == want_text


def stream_lines(gw: Gateway, body: dict):
    """A streamed request on its own connection, read line by line until it ends or breaks."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT_S)
    conn.request(
        "POST", "/v1/completions", json.dumps(body).encode(), {"authorization": f"Bearer {CONFIG_KEY}"}
    )
    reply = conn.getresponse()
    assert reply.status == 200
    try:
        while True:
            try:
                line = reply.readline()
            except (ConnectionError, http.client.HTTPException, OSError):
                return
            if not line:
                return
            yield line.decode(errors="replace")
    finally:
        conn.close()


def test_health_is_503_while_no_engine_can_serve(gw: Gateway) -> None:
    worker = gw.run.stage_pids("gpu_worker")[0]
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 60
    statuses = []
    while time.monotonic() < deadline and 503 not in statuses:
        statuses.append(gw.request("GET", "/health")[0])
    assert 503 in statuses
    gw.run.wait_until_running(180)
    assert gw.request("GET", "/health")[0] == 200


def test_the_gateway_never_imports_torch() -> None:
    code = "import sys, services.gateway.__main__; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False"


def gateway_rows(run) -> list[str]:
    return sorted(r["name"] for r in run.status() if r["kind"] == "gateway" and r["state"] == "running")


def wait_for_gateways(run, names: list[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while gateway_rows(run) != names:
        assert time.monotonic() < deadline, f"gateways {gateway_rows(run)}, expected {names}"
        time.sleep(0.2)


def test_gateway_replicas_change_on_hot_reload(tmp_path: Path, tiny_model_dir: Path) -> None:
    config, port = tmp_path / "brigade.yaml", free_port()

    def write_config(replicas: int) -> None:
        config.write_text(
            f"model: {{path: '{tiny_model_dir}', max_model_len: 256}}\ngateway: {{replicas: {replicas}}}\n"
        )

    write_config(1)
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, f"gateway.port={port}", config=str(config)) as run:
        assert gateway_rows(run) == ["gateway-0"]
        write_config(2)
        run.process.send_signal(signal.SIGHUP)
        wait_for_gateways(run, ["gateway-0", "gateway-1"])
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="open", timeout=HTTP_TIMEOUT_S)
        for _ in range(4):  # new connections, spread over both replicas by the kernel
            reply = api.completions.create(
                model=str(tiny_model_dir), prompt="Hi", max_tokens=2, temperature=0
            )
            assert reply.choices[0].finish_reason in ("length", "stop")
        write_config(0)
        run.process.send_signal(signal.SIGHUP)
        wait_for_gateways(run, [])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
    assert_clean(run_dir)
