"""The OpenAI-compatible HTTP gateway, end to end: a real Brigade run (tiny model, two gateway
replicas on one port), driven by the real `openai` package, curl and raw HTTP connections."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import importlib.metadata
import itertools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import msgspec
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import services.gateway.app
from client import Client
from client.async_sdk import AsyncClient
from client.errors import Overloaded
from client.sdk import StreamDelta
from ipc import messages as m
from services.audit import ApiKeyFailures, AuditLog
from services.common.text import Tokenizer
from services.gateway.anthropic import AnthropicReply, MessagesRequest
from services.gateway.anthropic import chat_request as anthropic_chat_request
from services.gateway.app import Gateway as AppGateway
from services.gateway.app import GatewaySettings
from services.gateway.errors import ApiError
from services.gateway.jobs import SEED_HEADER, plan_chat
from services.gateway.refusal_limits import SMALL_BODY_BYTES
from services.gateway.responses import InputItem, ResponsesReply, listed_input_items
from services.metrics import HttpMetrics
from tests.harness import assert_clean, brigade_run, free_port, gateway_in_thread
from tests.test_tokenizer_core import vllm_bad_words_ids

pytestmark = pytest.mark.timeout(600)

CONFIG_KEY = "sk-config-key"
ENV_KEY = "sk-env-key"
MAX_MODEL_LEN = 1024
MAX_CONCURRENT = 8
MAX_PROMPT_CHARS = 100_000
MAX_BODY_BYTES = 6 * MAX_PROMPT_CHARS + (1 << 20)  # services/gateway/__main__.py: max_body_bytes
MAX_MESSAGES = 64
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 3.0
HTTP_TIMEOUT_S = 120.0
SSE_KEEPALIVE_S = 0.2  # short, so that a stream waiting a moment sends keep-alive comments
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
            f"tokenizer.max_messages={MAX_MESSAGES}",
            f"gateway.header_timeout_s={HEADER_TIMEOUT_S}",
            f"gateway.body_timeout_s={BODY_TIMEOUT_S}",
            f"gateway.write_timeout_s={WRITE_TIMEOUT_S}",
            f"gateway.sse_keepalive_s={SSE_KEEPALIVE_S}",
            # Forced: SmolLM2's tokenizer has no <think> token (auto would choose none); the regex
            # in test_reasoning_is_split_off_streamed_and_not makes the model write a think block.
            "gateway.reasoning_parser=qwen3",
            # Many tests here send oversized bodies from one address: none may be refused for the
            # ones before it (test_a_client_whose_requests_keep_being_too_large... turns it on).
            "gateway.max_oversized_requests=0",
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
    # vLLM's clients send top_k -1 for "no top-k": the same tokens as 0
    no_top_k = [
        api.completions.create(
            **base, temperature=0.8, seed=1234, extra_body={"top_k": k, "ignore_eos": True}
        )
        for k in (-1, 0)
    ]
    assert no_top_k[0].choices[0].text == no_top_k[1].choices[0].text

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


def test_cache_salt_keeps_prefix_cached_blocks_to_its_own_requests(gw: Gateway) -> None:
    """vLLM's cache_salt: a prompt computed under one salt is a prefix-cache hit again under that
    salt only; another salt, or none, computes it afresh (and the same greedy text either way)."""
    api = gw.openai()
    prompt = "Salted tenants keep their prefixes apart from one another. " * 6  # several full blocks

    def cached(salt: str | None) -> tuple[int, str]:
        extra = {"ignore_eos": True, **({"cache_salt": salt} if salt is not None else {})}
        reply = api.completions.create(
            model=gw.model, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra
        )
        details = reply.usage.prompt_tokens_details
        return (details.cached_tokens if details else 0), reply.choices[0].text

    first, text = cached("tenant-a")
    again, same = cached("tenant-a")
    assert again > first and same == text  # its own blocks again
    assert [cached(salt) for salt in ("tenant-b", None)] == [(first, text)] * 2  # nothing of tenant-a's
    status, error = gw.error("/v1/completions", {"prompt": "x", "max_tokens": 1, "cache_salt": "s" * 2000})
    assert status == 400 and error["param"] == "cache_salt", error
    # vLLM's priority only where the operator lets clients reorder each other's requests
    status, error = gw.error("/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": -1})
    assert status == 400 and error["param"] == "priority" and "gateway.accept_priority" in error["message"], (
        error
    )


def test_truncate_prompt_tokens_and_no_generation_prompt(gw: Gateway, hf_tokenizer) -> None:
    """vLLM's truncate_prompt_tokens keeps a prompt's last k tokens (-1: all that leave room for
    one output token), and a chat's add_generation_prompt false renders no generation prompt:
    each the same tokens and text as the prompt cut or rendered here and sent as token ids."""
    api = gw.openai()
    greedy = {"model": gw.model, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}

    def as_ids(ids: list[int]) -> tuple[int, str]:
        reply = api.completions.create(prompt=ids, **greedy)
        return reply.usage.prompt_tokens, reply.choices[0].text

    def with_extra(extra: dict, **kwargs) -> dict:
        return {**greedy, **kwargs, "extra_body": {**greedy["extra_body"], **extra}}

    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    ids = hf_tokenizer.encode(prompt)
    cut = api.completions.create(prompt=prompt, **with_extra({"truncate_prompt_tokens": 10}))
    assert (cut.usage.prompt_tokens, cut.choices[0].text) == as_ids(ids[-10:])
    longest = hf_tokenizer.encode("word " * (MAX_MODEL_LEN + 50))
    fitted = api.completions.create(
        prompt=longest, **with_extra({"truncate_prompt_tokens": -1}, max_tokens=1)
    )
    assert fitted.usage.prompt_tokens == MAX_MODEL_LEN - 1

    rendered = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    chat_ids = hf_tokenizer.encode(rendered, add_special_tokens=False)
    assert chat_ids != hf_tokenizer.encode(
        hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    bare = api.chat.completions.create(messages=CHAT, **with_extra({"add_generation_prompt": False}))
    assert (bare.usage.prompt_tokens, bare.choices[0].message.content) == as_ids(chat_ids)
    status, _, data = gw.request("POST", "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert status == 200 and json.loads(data)["tokens"] == chat_ids
    both = api.chat.completions.create(
        messages=CHAT, **with_extra({"add_generation_prompt": False, "truncate_prompt_tokens": 5})
    )
    assert (both.usage.prompt_tokens, both.choices[0].message.content) == as_ids(chat_ids[-5:])
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        for truncate in (-2, MAX_MODEL_LEN + 1):  # vLLM refuses a truncation past the model's length too
            status, error = gw.error(path, {**body, "max_tokens": 2, "truncate_prompt_tokens": truncate})
            assert status == 400 and error["param"] == "truncate_prompt_tokens", error


def test_return_token_ids_gives_the_prompt_and_output_ids_as_vllm_does(gw: Gateway, hf_tokenizer) -> None:
    """vLLM's return_token_ids: completions' choices carry `prompt_token_ids` and `token_ids`,
    chat's response `prompt_token_ids` and each choice `token_ids`; streamed, a choice's first
    chunk the prompt's and every chunk its new ids. The prompt ids are what HF's tokenizer and
    chat template make here; the output ids are those the logprobs name (`token_id:N`)."""
    api = gw.openai()
    prompt = "The quick brown fox"
    asked = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    reply = api.completions.create(model=gw.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                                   n=2, extra_body=asked)  # fmt: skip
    for choice in reply.choices:
        assert choice.prompt_token_ids == hf_tokenizer.encode(prompt)
        assert choice.token_ids == [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        assert hf_tokenizer.decode(choice.token_ids) == choice.text and len(choice.token_ids) == 6
    plain = api.completions.create(model=gw.model, prompt=prompt, max_tokens=2, temperature=0)
    assert (
        "token_ids" not in plain.choices[0].model_dump() or plain.choices[0].model_dump()["token_ids"] is None
    )

    chunks = list(api.completions.create(model=gw.model, prompt=prompt, max_tokens=6, temperature=0,
                                         stream=True, extra_body=asked))  # fmt: skip
    opened = [c.choices[0] for c in chunks if c.choices and getattr(c.choices[0], "prompt_token_ids", None)]
    assert len(opened) == 1 and opened[0].prompt_token_ids == hf_tokenizer.encode(prompt)
    streamed = [i for c in chunks for choice in c.choices for i in (getattr(choice, "token_ids", None) or [])]
    assert streamed == reply.choices[0].token_ids

    chat_prompt = hf_tokenizer.encode(
        hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    chat = api.chat.completions.create(
        model=gw.model, messages=CHAT, max_tokens=6, temperature=0, extra_body=asked
    )
    assert chat.prompt_token_ids == chat_prompt and len(chat.choices[0].token_ids) == 6
    chat_chunks = list(api.chat.completions.create(model=gw.model, messages=CHAT, max_tokens=6, temperature=0,
                                                   stream=True, extra_body=asked))  # fmt: skip
    assert (
        chat_chunks[0].prompt_token_ids == chat_prompt and chat_chunks[0].choices[0].delta.role == "assistant"
    )
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chat_chunks[1:])
    chat_streamed = [
        i for c in chat_chunks for ch in c.choices for i in (getattr(ch, "token_ids", None) or [])
    ]
    assert chat_streamed == chat.choices[0].token_ids


def test_continuous_usage_stats_count_every_chunk(gw: Gateway) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk of a choice
    carries its usage so far, output tokens counted by the ids the chunks brought; the last usage
    chunk is the whole request's, as without it."""
    api = gw.openai()
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, kwargs in (
        (api.completions.create, {"prompt": "Once upon a time"}),
        (api.chat.completions.create, {"messages": CHAT}),
    ):
        for return_token_ids in (True, False):  # without: the ids counted from the logprobs
            chunks = list(create(model=gw.model, max_tokens=8, temperature=0, stream=True, stream_options=options,
                                 logprobs=True if "messages" in kwargs else 0,
                                 extra_body={"ignore_eos": True, "return_token_ids": return_token_ids},
                                 **kwargs))  # fmt: skip
            total = chunks[-1].usage
            assert not chunks[-1].choices and total.completion_tokens == 8
            seen = 0
            for chunk in chunks[:-1]:
                logprobs = chunk.choices[0].logprobs
                seen += (
                    len((logprobs.content if "messages" in kwargs else logprobs.tokens) or [])
                    if logprobs
                    else 0
                )
                assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (
                    total.prompt_tokens,
                    seen,
                )
            if "messages" in kwargs:
                assert chunks[0].choices[0].delta.role == "assistant"
        plain = list(create(model=gw.model, max_tokens=4, stream=True, stream_options={"include_usage": True},
                            **kwargs))  # fmt: skip
        assert all(chunk.usage is None for chunk in plain[:-1]) and plain[-1].usage.completion_tokens == 4


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
    # Choices 1 and 2 reuse choice 0's blocks; the prompt, and so its cached part, counts once.
    assert 0 < first.usage.prompt_tokens_details.cached_tokens <= first.usage.prompt_tokens
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


def test_completion_logprobs_name_the_sampled_token_and_offsets_survive_split_characters(
    gw: Gateway, hf_tokenizer
) -> None:
    """top_logprobs holds the N most likely and the chosen token where it is not one of them (as
    OpenAI's and vLLM's do: lm-eval reads it there); text_offset points at each token's text in
    the text, also after a token that ends inside a character of several bytes."""
    api = gw.openai()
    sampled = api.completions.create(
        model=gw.model, prompt="Once upon a time", max_tokens=16, temperature=1.5, seed=7, logprobs=1,
        extra_body={"ignore_eos": True},
    ).choices[0].logprobs  # fmt: skip
    assert any(len(top) == 2 for top in sampled.top_logprobs), sampled  # a token off the top 1
    for token, logprob, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= 2
        assert max(top.values()) >= logprob
    text = "café 😀 naïve 日本語 ok"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in hf_tokenizer.decode([i]) for i in ids)  # some token splits a character
    echoed = api.completions.create(model=gw.model, prompt=text, echo=True, max_tokens=0, logprobs=0).choices[
        0
    ]
    assert echoed.text == text
    offsets = echoed.logprobs.text_offset
    assert offsets == sorted(offsets) and len(offsets) == len(ids)
    for token_id, offset in zip(ids, offsets, strict=True):
        piece = hf_tokenizer.decode([token_id])
        if "\ufffd" not in piece:
            assert text[offset : offset + len(piece)] == piece, (piece, offset)


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

    for _ in range(5):  # this test's own, so that it holds when it runs alone
        status, _, body = gw.request(
            "POST", "/v1/completions", {"model": gw.model, "prompt": "Hi", "max_tokens": 1}
        )
        assert status == 200, body
    status, headers, body = gw.request("GET", "/metrics")
    metrics = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    count = re.search(
        r'^brigade:http_requests_total\{path="/v1/completions",status="200"\} (\S+)$', metrics, re.M
    )
    assert count and float(count.group(1)) >= 5  # summed over both replicas' files
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert re.search(rf"^brigade:http_{name}_count (\S+)$", metrics, re.M), name


def metric_sums(gw: Gateway) -> dict[str, float]:
    """Each sample name's value on /metrics, summed over its labels (both replicas, every stage)."""
    status, _, body = gw.request("GET", "/metrics")
    assert status == 200
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def test_per_request_histograms_count_each_choice_and_each_prompt_once(gw: Gateway) -> None:
    """vLLM's per-request histograms from a real run: two prompts of known lengths, n=2 and a
    max_tokens that every choice reaches (ignore_eos) give four finished requests to the
    tokenizers, and two prompts of n=2 to the gateway."""
    wait_idle(gw.run)  # nothing of another test still finishing between the two scrapes
    prompts = [list(range(100, 140)), list(range(200, 209))]  # 40 and 9 tokens
    n, max_tokens = 2, 3
    before = metric_sums(gw)
    status, _, body = gw.request("POST", "/v1/completions", {
        "model": gw.model, "prompt": prompts, "n": n, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True,
    })  # fmt: skip
    assert status == 200, body
    choices = json.loads(body)["choices"]
    assert [c["finish_reason"] for c in choices] == ["length"] * 4
    after = metric_sums(gw)
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    per_choice = {  # name: (count, sum) over the 4 choices
        "brigade:request_prompt_tokens": (4, n * sum(map(len, prompts))),
        "brigade:request_generation_tokens": (4, 4 * max_tokens),
        "brigade:request_params_max_tokens": (4, 4 * max_tokens),
        "brigade:request_params_n": (2, 2 * n),
        "brigade:request_max_num_generation_tokens": (2, 2 * max_tokens),
    }
    for name, (count, total) in per_choice.items():
        assert (delta(f"{name}_count"), delta(f"{name}_sum")) == (count, total), name
    assert delta("brigade:request_decode_time_seconds_count") == 4
    assert delta("brigade:request_decode_time_seconds_sum") > 0
    # Each choice's decode time spread over its 2 tokens after the first.
    assert delta("brigade:request_time_per_output_token_seconds_count") == 4
    assert delta("brigade:request_time_per_output_token_seconds_sum") == pytest.approx(
        delta("brigade:request_decode_time_seconds_sum") / (max_tokens - 1)
    )
    # With no preemption, the prefix-cache hits of the scheduler's admissions are the cached
    # tokens the requests finished with (the scheduler's counter reaches /metrics a little later).
    deadline = time.monotonic() + 30
    while delta("brigade:prompt_tokens_cached_total") != delta("brigade:prefix_cache_hits_total"):
        assert time.monotonic() < deadline, (delta("brigade:prompt_tokens_cached_total"), before, after)
        time.sleep(0.5)
        after = metric_sums(gw)


# -- Anthropic's Messages API, OpenAI's Responses API -----------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SYSTEM = "You answer briefly."
NUMBER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}  # fmt: skip


def anthropic_client(gw: Gateway, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=CONFIG_KEY, timeout=HTTP_TIMEOUT_S, **kwargs)


def anthropic_prompt(usage: anthropic.types.Usage | anthropic.types.MessageDeltaUsage) -> int:
    """A Messages reply's prompt length: Anthropic's input_tokens leave out the cache's reads."""
    return (usage.input_tokens or 0) + (usage.cache_read_input_tokens or 0)


def chat_greedy(gw: Gateway, messages: list[dict], max_tokens: int, **kwargs):
    reply = gw.openai().chat.completions.create(
        model=gw.model, messages=messages, max_tokens=max_tokens, **{"temperature": 0} | kwargs
    )
    return reply.choices[0], reply.usage


def chat_sampled(gw: Gateway, messages: list[dict], max_tokens: int, **kwargs):
    """Temperature 1 with seed 7: varied text even from the tiny model (whose greedy chat is
    newlines), the same only for the same prompt tokens."""
    return chat_greedy(gw, messages, max_tokens, **kwargs | {"temperature": 1.0, "seed": 7})


def test_anthropic_messages_equal_chat_streamed_and_not_with_stop_sequences(gw: Gateway) -> None:
    client = anthropic_client(gw)
    want, usage = chat_greedy(gw, [{"role": "system", "content": SYSTEM}, *CHAT], 24)
    greedy = {"extra_body": {"temperature": 0}}  # anthropic's client sends temperature only so
    kwargs = {"model": gw.model, "system": SYSTEM, "messages": CHAT, "max_tokens": 24, **greedy}
    reply = client.messages.create(**kwargs)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == want.message.content
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.finish_reason]
    assert (anthropic_prompt(reply.usage), reply.usage.output_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    counted = client.messages.count_tokens(model=gw.model, system=SYSTEM, messages=CHAT)
    assert counted.input_tokens == usage.prompt_tokens

    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want.message.content and final.content[0].text == streamed
    assert final.stop_reason == reply.stop_reason and final.usage.output_tokens == usage.completion_tokens
    assert anthropic_prompt(final.usage) == usage.prompt_tokens
    # message_start already counts the prompt, as Anthropic's does (agents track their context by it).
    with client.messages.stream(**kwargs) as stream:
        starts = [event for event in stream if event.type == "message_start"]
    assert [anthropic_prompt(s.message.usage) for s in starts] == [usage.prompt_tokens]

    # The tiny model's greedy chat is newlines; sampled with one seed (X-Brigade-Seed, as for
    # chat) it is varied text, the same only if the prompt's tokens are.
    seeded = kwargs | {"extra_body": {"temperature": 1.0}, "extra_headers": {"x-brigade-seed": "7"}}
    want_seeded = gw.openai().chat.completions.create(
        model=gw.model, messages=[{"role": "system", "content": SYSTEM}, *CHAT], max_tokens=24, temperature=1.0,
        seed=7,
    )  # fmt: skip
    full = want_seeded.choices[0].message.content
    assert len(set(full)) > 3 and client.messages.create(**seeded).content[0].text == full

    # A stop sequence cut out of the middle of that text: the reply ends before it and says so.
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    stopped = client.messages.create(**seeded | {"stop_sequences": ["\u2603", stop]})
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == full[: full.index(stop)]
    with client.messages.stream(**seeded | {"stop_sequences": [stop]}) as stream:
        assert "".join(stream.text_stream) == full[: full.index(stop)]
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    # With tools offered (tool_choice auto) the whole reply's text is the tokenizer's parse of the
    # output, stop sequence included: cut there too, as the stream cuts it (it once was not).
    tooled = seeded | {"tools": [{"name": "paint_wall", "input_schema": {"type": "object"}}]}
    text = client.messages.create(**tooled).content
    assert [b.type for b in text] == ["text"] and len(text[0].text) > 6, text  # the test's premise
    stop = text[0].text[len(text[0].text) // 2 :][:3]
    stopped = client.messages.create(**tooled | {"stop_sequences": [stop]})
    with client.messages.stream(**tooled | {"stop_sequences": [stop]}) as stream:
        final = stream.get_final_message()
    for message in (stopped, final):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop), message
        assert message.content[0].text == text[0].text[: text[0].text.index(stop)], message

    shaped = client.messages.create(
        **kwargs | {"max_tokens": 32}, output_config={"format": {"type": "json_schema", "schema": NUMBER}}
    )
    jsonschema.validate(json.loads(shaped.content[0].text), NUMBER)


def test_anthropic_names_the_stop_sequence_the_engine_stopped_at_when_one_ends_another(gw: Gateway) -> None:
    """Two stop sequences ending at the same place, one a suffix of the other: the engine stops at
    the one that starts first (the longer), whatever their order; the reply ends before it and
    names it, as chat's text ends there, not at the shorter one, leaking the longer's start."""
    client = anthropic_client(gw)
    seeded = {"model": gw.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
              "extra_body": {"temperature": 1.0}, "extra_headers": {"x-brigade-seed": "7"}}  # fmt: skip
    full = client.messages.create(**seeded).content[0].text
    # The first place where a 4-character sequence and its last 3 characters first occur (so
    # that the engine stops there, on either).
    at = next(
        i
        for i in range(1, len(full) - 4)
        if full.find(full[i : i + 4]) == i and full.find(full[i + 1 : i + 4]) == i + 1
    )
    longer, shorter = full[at : at + 4], full[at + 1 : at + 4]
    stops = {"stop_sequences": [shorter, longer]}
    whole = client.messages.create(**seeded | stops)
    with client.messages.stream(**seeded | stops) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    chat = gw.openai().chat.completions.create(model=gw.model, messages=seeded["messages"], max_tokens=12,
                                               temperature=1.0, seed=7, stop=[shorter, longer])  # fmt: skip
    assert chat.choices[0].message.content == full[:at]
    for message in (whole, final):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", longer), message
        assert message.content[0].text == full[:at], message
    assert streamed == full[:at]


def test_anthropic_input_tokens_leave_out_the_prompt_caches_reads(gw: Gateway, hf_tokenizer) -> None:
    """Anthropic's input_tokens count the prompt's tokens not read from the cache (the prompt is
    input_tokens + cache_read_input_tokens, which clients add up to track their context): a
    prompt sent again, its blocks cached, must not count them twice, whole or streamed."""
    client = anthropic_client(gw)
    messages = [{"role": "user", "content": "The cache test: " + "ten green bottles " * 8}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = len(hf_tokenizer(text, add_special_tokens=False).input_ids)
    kwargs = {"model": gw.model, "messages": messages, "max_tokens": 2}
    client.messages.create(**kwargs)  # its blocks are cached for the next
    reply = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        starts = [event.message.usage for event in stream if event.type == "message_start"]
        final = stream.get_final_message()
    for usage in (reply.usage, *starts, final.usage):
        assert usage.cache_read_input_tokens and usage.cache_read_input_tokens < prompt, usage  # the premise
        assert usage.input_tokens + usage.cache_read_input_tokens == prompt, usage


def test_an_assistant_prefill_is_continued_by_chat_anthropic_and_tokenize(gw: Gateway, hf_tokenizer) -> None:
    """A last message of the assistant's is continued, not answered: Anthropic's Messages API does
    it always, chat with vLLM's continue_final_message. The prompt is transformers' rendering with
    continue_final_message; a seeded sampled reply is the same only if the prompt's tokens are."""
    prefill = [*CHAT, {"role": "assistant", "content": "Buckets carry"}]
    prompt = hf_tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    status, _, data = gw.request("POST", "/tokenize", {"messages": prefill, "continue_final_message": True})
    assert status == 200 and json.loads(data)["tokens"] == ids
    status, _, data = gw.request("POST", "/tokenize", {"messages": prefill})
    assert status == 200 and json.loads(data)["tokens"] != ids  # a new turn after the prefill

    api = gw.openai()
    want = (
        api.completions.create(model=gw.model, prompt=ids, max_tokens=16, temperature=1.0, seed=7)
        .choices[0]
        .text
    )
    assert len(set(want)) > 3
    chat = api.chat.completions.create(
        model=gw.model, messages=prefill, max_tokens=16, temperature=1.0, seed=7,
        extra_body={"continue_final_message": True},
    )  # fmt: skip
    assert chat.choices[0].message.content == want
    reply = anthropic_client(gw).messages.create(
        model=gw.model, messages=prefill, max_tokens=16, extra_body={"temperature": 1.0},
        extra_headers={"x-brigade-seed": "7"},
    )  # fmt: skip
    assert reply.content[0].text == want
    counted = anthropic_client(gw).messages.count_tokens(model=gw.model, messages=prefill)
    assert counted.input_tokens == len(ids) == anthropic_prompt(reply.usage)

    # Nothing to continue: a user's last message, or an assistant's that calls tools.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    refused = [
        ("the last message must be the assistant's", CHAT),
        ("calls tools", [*CHAT, {"role": "assistant", "content": "Buckets", "tool_calls": [call]}]),
        ("calls tools", [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}]),  # no text
    ]
    for message, messages in refused:
        for path in ("/v1/chat/completions", "/tokenize"):
            status, error = gw.error(
                path, {"messages": messages, "max_tokens": 4, "continue_final_message": True}
            )
            assert status == 400 and message in error["message"], (path, error)
            assert error["param"] == "continue_final_message", (path, error)


def test_anthropic_tool_use_and_tool_result_round_trip(gw: Gateway) -> None:
    client = anthropic_client(gw)
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {
        "model": gw.model,
        "messages": ask,
        "max_tokens": 100,
        "tools": tools,
        "extra_body": {"temperature": 0},
    }
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        reply = client.messages.create(**forced, tool_choice=choice)
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and len(uses) >= 1 and uses[0].name == "get_weather", reply
        jsonschema.validate(uses[0].input, WEATHER)
        with client.messages.stream(**forced, tool_choice=choice) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
            (b.name, b.input) for b in uses
        ]
        assert final.stop_reason == "tool_use"

    call = uses[0]
    answer = [
        *ask,
        {"role": "assistant", "content": [call.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21C"}],
        },
    ]
    seeded = {"extra_body": {"temperature": 1.0}, "extra_headers": {"x-brigade-seed": "7"}}
    reply = client.messages.create(model=gw.model, messages=answer, max_tokens=16, tools=tools, **seeded)
    # The same conversation in chat's shapes (an independent check of the translation).
    chat_messages = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21C"},
    ]  # fmt: skip
    openai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                      "parameters": t["input_schema"]}} for t in tools]  # fmt: skip
    want, usage = chat_sampled(gw, chat_messages, 16, tools=openai_tools)
    counted = client.messages.count_tokens(model=gw.model, messages=answer, tools=tools)
    assert counted.input_tokens == anthropic_prompt(reply.usage)
    got_text = "".join(b.text for b in reply.content if b.type == "text")
    assert got_text == (want.message.content or "") and anthropic_prompt(reply.usage) == usage.prompt_tokens


ANTHROPIC_BAD_BODIES = {
    "missing max_tokens": ({"messages": CHAT}, "max_tokens"),
    "system role in messages": ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
    "image block": (
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].type",
    ),
    "tool_use from the user": (
        {
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ],
        },
        "tool_use blocks belong to assistant messages",
    ),
    "tool choice without its name": (
        {
            "max_tokens": 4,
            "messages": CHAT,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool"},
        },
        "tool_choice",
    ),
    "tool choice without tools": (
        {"max_tokens": 4, "messages": CHAT, "tool_choice": {"type": "any"}},
        "tools",
    ),
    "no messages": ({"max_tokens": 4, "messages": []}, "messages"),
    "negative temperature": ({"max_tokens": 4, "messages": CHAT, "temperature": -1}, "temperature"),
    "temperature past Anthropic's 1": (
        {"max_tokens": 4, "messages": CHAT, "temperature": 1.5},
        "temperature",
    ),
    "no content blocks": (
        {"max_tokens": 4, "messages": [{"role": "user", "content": []}]},
        "messages[0].content",
    ),
    # Anthropic refuses these too: an empty turn (but a last assistant one, a prefill of
    # nothing), a tool result that answers no earlier call, a user's thinking.
    "empty content": (
        {"max_tokens": 4, "messages": [{"role": "user", "content": ""}]},
        "messages[0].content: must not be empty",
    ),
    "an empty assistant turn before the last": (
        {"max_tokens": 4, "messages": [*CHAT, {"role": "assistant", "content": ""}, *CHAT]},
        "messages[1].content: must not be empty",
    ),
    "a tool_result answering no tool_use": (
        {
            "max_tokens": 4,
            "messages": [
                *CHAT,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "x"}]},
            ],
        },
        "messages[2].content[0]: tool_result's tool_use_id 't2' matches no tool_use block",
    ),
    "a tool_result before any tool_use": (
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}],
        },
        "messages[0].content[0]: tool_result's tool_use_id 't1' matches no tool_use block",
    ),
    "thinking from the user": (
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "hm"}]}],
        },
        "messages[0].content[0]: thinking blocks belong to assistant messages",
    ),
    "not JSON": (b"{", "JSON"),
    # Anthropic's structured outputs are strict: a keyword that cannot be enforced is refused.
    "schema keyword not enforced": (
        {
            "max_tokens": 4,
            "messages": CHAT,
            "output_config": {
                "format": {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}
            },
        },
        "output_config.format",
    ),
    "unknown thinking type": (
        {"max_tokens": 4, "messages": CHAT, "thinking": {"type": "sometimes"}},
        "thinking.type",
    ),
    # Refusals of what the request translates into name Anthropic's fields, not chat's.
    "too many stop sequences": (
        {"max_tokens": 4, "messages": CHAT, "stop_sequences": [f"s{i}" for i in range(100)]},
        "stop_sequences has 100 strings",
    ),
    "an empty stop sequence": ({"max_tokens": 4, "messages": CHAT, "stop_sequences": [""]}, "stop_sequences"),
    "a forced tool with an output format": (
        {
            "max_tokens": 4,
            "messages": CHAT,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "f"},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        },
        "tool_choice {'type': 'tool', 'name': 'f'} forces a tool call, which cannot be combined with "
        "output_config.format",
    ),
    "any tool with an output format": (
        {
            "max_tokens": 4,
            "messages": CHAT,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        },
        "tool_choice {'type': 'any'}",
    ),
}


@pytest.mark.parametrize("case", sorted(ANTHROPIC_BAD_BODIES))
def test_anthropic_bad_input_gets_400_in_anthropics_shape(gw: Gateway, case: str) -> None:
    body, named = ANTHROPIC_BAD_BODIES[case]
    status, _, data = gw.request("POST", "/v1/messages", body, {"authorization": "", "x-api-key": CONFIG_KEY})
    error = json.loads(data)
    assert status == 400 and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error" and named in error["error"]["message"], error


def test_anthropic_errors_through_the_anthropic_client(gw: Gateway) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0).messages.create(
            model=gw.model, messages=CHAT, max_tokens=4
        )
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        anthropic_client(gw, max_retries=0).messages.create(
            model=gw.model, messages=CHAT, max_tokens=4, extra_body={"top_p": 7}
        )
    assert (
        bad.value.body["error"]["type"] == "invalid_request_error"
        and "top_p" in bad.value.body["error"]["message"]
    )
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(gw, max_retries=0).messages.create(model="claude-9", messages=CHAT, max_tokens=4)


def response_events(gw: Gateway, **kwargs) -> list:
    return list(gw.openai().responses.create(model=gw.model, stream=True, **kwargs))


def test_responses_equal_chat_streamed_and_not(gw: Gateway) -> None:
    api = gw.openai()
    want, usage = chat_greedy(gw, [{"role": "system", "content": SYSTEM}, *CHAT], 24)
    kwargs = {"instructions": SYSTEM, "input": CHAT, "max_output_tokens": 24, "temperature": 0}
    reply = api.responses.create(model=gw.model, **kwargs)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == want.message.content and [i.type for i in reply.output] == ["message"]
    assert reply.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert (
        reply.output[-1].status == reply.status
    )  # the message max_output_tokens cut is incomplete, as OpenAI's
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    # Sampled with one seed (X-Brigade-Seed), the text is varied and the same only if the prompt is.
    want_seeded = api.chat.completions.create(
        model=gw.model, messages=CHAT, max_tokens=24, temperature=1.0, seed=7
    )
    as_string = api.responses.create(
        model=gw.model, input=CHAT[0]["content"], max_output_tokens=24, temperature=1.0,
        extra_headers={"x-brigade-seed": "7"},
    )  # fmt: skip
    assert len(set(as_string.output_text)) > 3
    assert as_string.output_text == want_seeded.choices[0].message.content

    events = response_events(gw, **kwargs)
    kinds = [e.type for e in events]
    end = "response.incomplete" if reply.status == "incomplete" else "response.completed"
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", end,
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == want.message.content == events[-1].response.output_text
    assert events[-2].item.status == events[-1].response.output[-1].status == reply.status

    shaped = api.responses.create(
        model=gw.model, input=CHAT, max_output_tokens=32, temperature=0,
        text={"format": {"type": "json_schema", "name": "number", "schema": NUMBER, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(shaped.output_text), NUMBER)


def test_responses_tool_choice_auto_without_tools_is_the_default(gw: Gateway) -> None:
    """`auto` is the Responses API's default tool_choice, which every reply gives back: a client
    that sends it (or a reply's settings) without tools is served as one that leaves it out."""
    api = gw.openai()
    kwargs = {"input": CHAT, "max_output_tokens": 4, "temperature": 0}
    want = api.responses.create(model=gw.model, **kwargs)
    assert want.tool_choice == "auto"
    for tools in ({}, {"tools": []}):
        got = api.responses.create(model=gw.model, **kwargs, tool_choice="auto", **tools)
        assert (got.output_text, got.tool_choice) == (want.output_text, "auto")
        final = response_events(gw, **kwargs, tool_choice="auto", **tools)[-1].response
        assert (final.status, final.output_text) == (want.status, want.output_text), final


def test_responses_function_call_round_trip_and_the_store(gw: Gateway) -> None:
    api = gw.openai(max_retries=0)
    tools = [
        {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}
    ]
    ask = "What is the weather in Paris?"
    kwargs = {"model": gw.model, "input": ask, "max_output_tokens": 100, "temperature": 0, "tools": tools,
              "tool_choice": {"type": "function", "name": "get_weather"}}  # fmt: skip
    first = api.responses.create(**kwargs)
    calls = [i for i in first.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather", first.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)

    events = response_events(gw, **{k: v for k, v in kwargs.items() if k != "model"})
    done = [
        e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"
    ]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == calls[0].arguments and "response.function_call_arguments.done" in [
        e.type for e in events
    ]

    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21C"}
    seeded = {"temperature": 1.0, "extra_headers": {"x-brigade-seed": "7"}}
    second = api.responses.create(
        model=gw.model,
        previous_response_id=first.id,
        input=[result],
        max_output_tokens=16,
        tools=tools,
        **seeded,
    )
    chat_messages = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [{"id": c.call_id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments}} for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21C"},
    ]  # fmt: skip
    openai_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                    for t in tools]  # fmt: skip
    want, usage = chat_sampled(gw, chat_messages, 16, tools=openai_tools)
    assert len(set(second.output_text)) > 3
    assert (
        second.output_text == (want.message.content or "")
        and second.usage.input_tokens == usage.prompt_tokens
    )
    # The same turn sent whole, without previous_response_id, is the same request.
    whole = api.responses.create(
        model=gw.model, input=[{"role": "user", "content": ask}, *[c.model_dump() for c in first.output], result],
        max_output_tokens=16, tools=tools, **seeded,
    )  # fmt: skip
    assert whole.output_text == second.output_text

    assert api.responses.retrieve(second.id).output_text == second.output_text
    api.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(second.id)
    unstored = api.responses.create(model=gw.model, input=ask, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as unknown:
        api.responses.create(model=gw.model, input=ask, previous_response_id=unstored.id)
    assert unknown.value.body["param"] == "previous_response_id"


def test_stored_responses_are_shared_by_replicas_and_survive_sigkill(gw: Gateway) -> None:
    api = gw.openai(max_retries=5)
    # metadata at OpenAI's bounds (16 pairs, keys of 64 characters, values of 512) is kept whole
    metadata = {f"{i:064d}": "v" * 512 for i in range(16)}
    first = api.responses.create(
        model=gw.model, input=CHAT, max_output_tokens=8, temperature=0, metadata=metadata
    )
    # Whichever replica stored it, one of these reads is served by the other one, and one by a
    # replica restarted after SIGKILL.
    for replica in (0, 1):
        killed = kill_gateways(gw, [replica])
        stored = api.responses.retrieve(first.id)
        assert stored.output_text == first.output_text and stored.metadata == metadata
        gw.run.wait_for_restart(killed, 120)
    follow = api.responses.create(
        model=gw.model, previous_response_id=first.id, input="And another?", max_output_tokens=8,
        temperature=1.0, extra_headers={"x-brigade-seed": "7"},
    )  # fmt: skip
    said = {"role": "assistant", "content": first.output_text}
    want, _ = chat_sampled(gw, [*CHAT, said, {"role": "user", "content": "And another?"}], 8)
    assert follow.output_text == want.message.content


def test_a_stored_responses_input_items_are_listed_a_page_at_a_time_and_it_cannot_be_cancelled(
    gw: Gateway,
) -> None:
    api = gw.openai()
    said = [
        {"role": "user", "content": "Name a colour."},
        {"type": "message", "role": "assistant", "content": "Blue.", "id": "msg_mine"},
        {"role": "user", "content": [{"type": "input_text", "text": "And another?"}]},
    ]
    first = api.responses.create(model=gw.model, input=said, max_output_tokens=2)
    # Two pages of two (the client follows has_more with `after`), oldest first.
    listed = list(api.responses.input_items.list(first.id, order="asc", limit=2))
    assert [(item.type, item.role, item.content[0].text) for item in listed] == [
        ("message", "user", "Name a colour."), ("message", "assistant", "Blue."), ("message", "user", "And another?")
    ]  # fmt: skip
    assert listed[1].id == "msg_mine" and len({item.id for item in listed}) == 3
    assert [item.content[0].type for item in listed] == ["input_text", "output_text", "input_text"]
    newest_first = api.responses.input_items.list(first.id)  # OpenAI's default order: desc
    assert [item.id for item in newest_first.data] == [item.id for item in reversed(listed)]
    assert not newest_first.has_more and newest_first.first_id == listed[2].id
    before = api.responses.input_items.list(  # this client takes no `before` of its own
        first.id, order="asc", limit=1, extra_query={"before": listed[2].id}
    )
    assert [item.id for item in before.data] == [listed[1].id] and before.has_more
    # A string input is one user message; a follow-up lists its own input, not its chain's.
    follow = api.responses.create(
        model=gw.model, input="Why?", previous_response_id=first.id, max_output_tokens=2
    )
    [only] = api.responses.input_items.list(follow.id).data
    assert (only.type, only.role, only.content[0].text) == ("message", "user", "Why?")
    # Bad queries name their parameter; an id not stored is a 404, as GET of the response.
    for query, param in [
        ({"limit": 0}, "limit"),
        ({"order": "sideways"}, "order"),
        ({"after": "msg_x"}, "after"),
    ]:
        with pytest.raises(openai.BadRequestError) as bad:
            api.responses.input_items.list(first.id, **query)
        assert bad.value.body["param"] == param, bad.value.body
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list(f"resp_{'0' * 32}")
    unstored = api.responses.create(model=gw.model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list(unstored.id)
    # Every response here ends within its request: there is none in the background to cancel.
    with pytest.raises(openai.BadRequestError, match="background"):
        api.responses.cancel(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.cancel(unstored.id)


def test_input_items_are_listed_with_the_fields_each_was_sent_with() -> None:
    items = msgspec.convert(
        [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "ok"}],
            },
        ],
        list[InputItem],
    )
    call, result = listed_input_items(items)
    assert call["id"].startswith("fc_") and result["id"].startswith("fco_")
    assert {k: call[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "status": "completed"
    }  # fmt: skip
    assert "role" not in call and "content" not in call  # fields it was not sent with
    assert result["output"] == [{"type": "input_text", "text": "ok"}]


RESPONSES_BAD_BODIES = {
    "no input": ({}, "input", "missing_required_parameter"),
    "unknown item type": (
        {"input": [{"type": "web_search_call", "id": "ws_1"}]},
        "input[0].type",
        "invalid_value",
    ),
    "bad role": ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role", "invalid_value"),
    "image by file_id": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
        "input[0].content[0].image_url",
        "invalid_value",
    ),
    "file part": (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
        "input[0].content[0].type",
        "invalid_value",
    ),
    "function call without call_id": (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
        "missing_required_parameter",
    ),
    "web search tool": ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_value"),
    "bad tool choice": (
        {"input": "hi", "tool_choice": {"type": "file_search"}},
        "tool_choice",
        "invalid_value",
    ),
    "bad schema": (
        {
            "input": "hi",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wizard"}}},
        },
        "text.format",
        "invalid_value",
    ),
    "unknown previous response": (
        {"input": "hi", "previous_response_id": "resp_" + "0" * 32},
        "previous_response_id",
        "previous_response_not_found",
    ),
    "negative max_output_tokens": (
        {"input": "hi", "max_output_tokens": -3},
        "max_output_tokens",
        "invalid_value",
    ),
    # Stored with the response: OpenAI's bounds (a 6 MB value was once stored whole).
    "metadata of 17 pairs": (
        {"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}},
        "metadata",
        "invalid_value",
    ),
    "a metadata key of 65 characters": (
        {"input": "hi", "metadata": {"k" * 65: "v"}},
        "metadata",
        "invalid_value",
    ),
    "a metadata value of 513 characters": (
        {"input": "hi", "metadata": {"k": "v" * 513}},
        "metadata",
        "invalid_value",
    ),
    # OpenAI's ranges: temperature [0, 2] (chat takes vLLM's, up to 100), top_p (0, 1]
    "temperature past OpenAI's 2": ({"input": "hi", "temperature": 2.5}, "temperature", "invalid_value"),
    "a negative temperature": ({"input": "hi", "temperature": -0.5}, "temperature", "invalid_value"),
    "top_p of 0": ({"input": "hi", "top_p": 0}, "top_p", "invalid_value"),
    "top_p past 1": ({"input": "hi", "top_p": 1.5}, "top_p", "invalid_value"),
}


@pytest.mark.parametrize("case", sorted(RESPONSES_BAD_BODIES))
def test_responses_bad_input_gets_400_naming_the_field(gw: Gateway, case: str) -> None:
    body, param, code = RESPONSES_BAD_BODIES[case]
    status, error = gw.error("/v1/responses", body)
    assert status == 400, error
    assert (error["param"] or "").startswith(param) and error["code"] == code, error


def test_a_responses_refusal_names_the_input_item_not_the_chat_message(gw: Gateway) -> None:
    """Responses run as chats: instructions become the first chat message, and a refusal that
    the chat path words by its message index names the `input` item it came from."""
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    body = {
        "instructions": SYSTEM,
        "input": [{"role": "user", "content": "hi"}, {"role": "user", "content": [image]}],
        "max_output_tokens": 4,
    }
    for stream in (False, True):
        status, _, data = gw.request("POST", "/v1/responses", {**body, "stream": stream})
        error = (
            json.loads(data)["error"] if status != 200 else json.loads(parse_sse(data.decode())[-1]["data"])
        )
        message = error.get("message") or error.get("error", {}).get("message", "")
        assert message.startswith("input[1].content[0]"), (stream, error)


def test_unknown_response_ids_get_404(gw: Gateway) -> None:
    # Only ids the store makes name a file: "..", "run" or "status" reach nothing of the run dir.
    for method, path in (("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/run"),
                         ("GET", "/v1/responses/..")):  # fmt: skip
        status, _, data = gw.request(method, path)
        error = json.loads(data)["error"]
        assert status == 404 and error["message"].startswith("Response with id"), data
    assert (gw.run.run_dir / "run.json").exists()


THINK = r"<think>[a-z ]{1,20}</think>[a-z ]{1,20}"


def test_reasoning_is_split_off_streamed_and_not(gw: Gateway) -> None:
    """With a reasoning parser, <think>...</think> comes back as reasoning_content, the rest as
    content, the same whole and streamed (where SmolLM2's tokenizer splits the tags over several
    tokens, so the stream must hold a partial tag back); the tags reach neither."""
    sdk = gw.openai()
    for seed in (1, 2, 3):
        kwargs = dict(model=gw.model, messages=CHAT, max_tokens=80, temperature=1.0, seed=seed,
                      extra_body={"structured_outputs": {"regex": THINK}})  # fmt: skip
        message = sdk.chat.completions.create(**kwargs).choices[0].message
        chunks = list(sdk.chat.completions.create(stream=True, **kwargs))
        reasoning = "".join(
            getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
        )
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert re.fullmatch("[a-z ]{1,20}", message.reasoning_content), message
        assert re.fullmatch("[a-z ]{1,20}", message.content), message
        assert (reasoning, content) == (message.reasoning_content, message.content)
        # Under vLLM's newer name too, whole and streamed.
        assert message.reasoning == message.reasoning_content, message
        assert (
            "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices)
            == reasoning
        )
        # include_reasoning false (vLLM's): the same output, its thinking left out of the reply.
        hidden = {**kwargs, "extra_body": {**kwargs["extra_body"], "include_reasoning": False}}
        without = sdk.chat.completions.create(**hidden).choices[0].message
        assert (without.reasoning, without.reasoning_content, without.content) == (
            None,
            None,
            message.content,
        )
        hidden_chunks = list(sdk.chat.completions.create(stream=True, **hidden))
        deltas = [c.choices[0].delta for c in hidden_chunks if c.choices]
        assert not any(getattr(d, "reasoning", None) or getattr(d, "reasoning_content", None) for d in deltas)
        assert "".join(d.content or "" for d in deltas) == message.content
    plain = sdk.chat.completions.create(model=gw.model, messages=CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].message.reasoning_content is None  # no think block: all content
    # A prefill that opened the think block: the reply starts in the reasoning, and its </think>
    # ends it; a prefill after the block continues the content, tags and all.
    for prefill, want_reasoning in (("<think>I see", True), ("<think>ok</think>So", False)):
        kwargs = dict(model=gw.model, messages=[*CHAT, {"role": "assistant", "content": prefill}],
                      max_tokens=80, temperature=1.0, seed=4,
                      extra_body={"continue_final_message": True,
                                  "structured_outputs": {"regex": r"[a-z ]{1,20}</think>[a-z ]{1,20}"}})  # fmt: skip
        message = sdk.chat.completions.create(**kwargs).choices[0].message
        chunks = list(sdk.chat.completions.create(stream=True, **kwargs))
        reasoning = "".join(
            getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
        )
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert (reasoning or None, content) == (message.reasoning_content, message.content)
        if want_reasoning:
            assert re.fullmatch("[a-z ]{1,20}", message.reasoning_content), message
            assert re.fullmatch("[a-z ]{1,20}", message.content), message
        else:
            assert message.reasoning_content is None, message
            assert re.fullmatch("[a-z ]{1,20}</think>[a-z ]{1,20}", message.content), message
    # chat_template_kwargs reach the template (test_tokenizer_core shows one that reads them).
    off = sdk.chat.completions.create(model=gw.model, messages=CHAT, max_tokens=2, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert off.choices[0].message.content is not None
    status, error = gw.error(
        "/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}
    )
    assert status == 400 and error["message"].startswith("chat_template_kwargs: ['messages']"), error
    assert error["param"] == "chat_template_kwargs", error
    # Earlier thinking sent back (a Responses reasoning item, an Anthropic thinking block) is
    # accepted: a Responses item dropped (as vLLM does), a thinking block the turn's reasoning,
    # which SmolLM2's template does not render (test_tokenizer_core: one that does).
    thought = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "hm"}],
    }
    said = {"role": "assistant", "content": "Buckets."}
    with_thought = sdk.responses.create(
        model=gw.model, input=[*CHAT, thought, said], max_output_tokens=4, temperature=0
    )
    without = sdk.responses.create(model=gw.model, input=[*CHAT, said], max_output_tokens=4, temperature=0)
    assert with_thought.output_text == without.output_text
    thinking = [
        {"type": "thinking", "thinking": "hm", "signature": "sig"},
        {"type": "text", "text": "Buckets."},
    ]
    reply = anthropic_client(gw).messages.create(
        model=gw.model, max_tokens=4, messages=[*CHAT, {"role": "assistant", "content": thinking}, *CHAT]
    )
    assert (
        anthropic_prompt(reply.usage)
        == sdk.chat.completions.create(
            model=gw.model, max_tokens=1, messages=[*CHAT, said, *CHAT]
        ).usage.prompt_tokens
    )


# A JSON string that is a think block and an answer: Responses' text.format and Anthropic's
# output_config.format take JSON schemas only, and the grammar writes "<", ">" and "/" unescaped,
# so the output is '"<think>...</think>..."': the reasoning inside, the quotes around the answer.
THINK_STRING = {"type": "string", "pattern": "^<think>[a-z ]{1,20}</think>[a-z ]{1,20}$"}
ANSWER = r'"[a-z ]{1,20}"'


def test_reasoning_is_a_reasoning_item_in_responses_streamed_and_not(gw: Gateway) -> None:
    api = gw.openai()
    fmt = {"type": "json_schema", "name": "thought", "schema": THINK_STRING, "strict": True}
    for seed in ("1", "2"):
        kwargs = dict(model=gw.model, input=CHAT, max_output_tokens=80, temperature=1.0, text={"format": fmt},
                      extra_headers={"x-brigade-seed": seed})  # fmt: skip
        reply = api.responses.create(**kwargs)
        assert [item.type for item in reply.output] == ["reasoning", "message"], reply.output
        thought = reply.output[0].content[0]
        assert thought.type == "reasoning_text" and re.fullmatch("[a-z ]{1,20}", thought.text), thought
        assert re.fullmatch(ANSWER, reply.output_text), reply.output_text  # no tag, no thinking

        # Streamed, the items come in the output's order: the opening quote is a message before
        # the reasoning item, the rest a message after it.
        events = list(api.responses.create(stream=True, **kwargs))
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (reasoning, text) == (thought.text, reply.output_text)
        final = events[-1].response
        assert [item.content[0].text for item in final.output if item.type == "reasoning"] == [thought.text]
        assert final.output_text == reply.output_text


def test_reasoning_is_a_thinking_block_in_anthropic_messages_streamed_and_not(gw: Gateway) -> None:
    client = anthropic_client(gw)
    for seed in ("1", "2"):
        kwargs = dict(model=gw.model, messages=CHAT, max_tokens=80, extra_body={"temperature": 1.0},
                      output_config={"format": {"type": "json_schema", "schema": THINK_STRING}},
                      extra_headers={"x-brigade-seed": seed})  # fmt: skip
        reply = client.messages.create(**kwargs)
        assert [block.type for block in reply.content] == ["thinking", "text"], reply.content
        thinking, text = reply.content[0].thinking, reply.content[1].text
        assert re.fullmatch("[a-z ]{1,20}", thinking) and re.fullmatch(ANSWER, text), reply.content

        # Streamed, the blocks come in the output's order: the opening quote is a text block
        # before the thinking block, the rest a text block after it.
        with client.messages.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thinking
        assert "".join(d.text for d in deltas if d.type == "text_delta") == text
        assert [b.thinking for b in final.content if b.type == "thinking"] == [thinking]
        assert "".join(b.text for b in final.content if b.type == "text") == text


def test_anthropic_errors_name_the_anthropic_message_not_the_chat_one() -> None:
    """A chat-path error names `messages[i]` of the chat request, where `system` is a message
    of its own and each tool_result block one more: its index is put back in the request's terms."""
    body = {
        "max_tokens": 4,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}},
                                              {"type": "tool_use", "id": "t2", "name": "w", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sun"},
                                         {"type": "tool_result", "tool_use_id": "t2", "content": "rain"},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ],
    }  # fmt: skip
    chat, origins = anthropic_chat_request(msgspec.convert(body, MessagesRequest))
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    reply = AnthropicReply("m", [], origins)
    expected = {
        0: "system: bad",
        1: "messages[0]: bad",
        3: "messages[2].content[0]: bad",
        4: "messages[2].content[1]: bad",
        5: "messages[2]: bad",
        9: "messages[9]: bad",  # out of range: left as it is
    }
    for index, want in expected.items():
        error = ApiError(400, f"messages[{index}]: bad", param=f"messages[{index}]")
        assert msgspec.json.decode(reply.error_body(error))["error"]["message"] == want
        assert msgspec.json.decode(reply.error_event(error).split(b"data: ")[1])["error"]["message"] == want


def test_anthropic_empty_last_assistant_turn_is_still_accepted() -> None:
    """Anthropic's exception to its non-empty content: the last message, an assistant's prefill
    of nothing (test_anthropic_bad_input_gets_400_in_anthropics_shape: an empty turn before it)."""
    body = {"max_tokens": 4, "messages": [*CHAT, {"role": "assistant", "content": ""}]}
    chat, _ = anthropic_chat_request(msgspec.convert(body, MessagesRequest))
    assert [(x.role, x.content) for x in chat.messages][-1] == ("assistant", "")


def test_anthropic_thinking_sets_the_templates_enable_thinking() -> None:
    """Anthropic's `thinking` switch is Qwen3's template variable (chat_template_kwargs, which
    test_tokenizer_core.py shows reaching the template): what the chat path is planned with."""

    def kwargs_for(body: dict) -> dict | None:
        request = msgspec.convert({"max_tokens": 4, "messages": CHAT, **body}, MessagesRequest)
        (job,) = plan_chat(anthropic_chat_request(request)[0], None).jobs
        return job.sampling.get("chat_template_kwargs")

    assert kwargs_for({"thinking": {"type": "disabled"}}) == {"enable_thinking": False}
    assert kwargs_for({"thinking": {"type": "enabled", "budget_tokens": 1024}}) == {"enable_thinking": True}
    assert kwargs_for({}) is None  # the template's own default


@contextmanager
def in_process_gateway(gw: Gateway, state_dir: Path, **settings_overrides: Any) -> Iterator[str]:
    """A gateway replica in this process (on a thread with its own event loop), serving the run's
    engine: for tests that patch what a replica runs, or set it up otherwise. Its base URL."""

    def make_gateway() -> AppGateway:
        settings = GatewaySettings(
            model=gw.model, max_model_len=MAX_MODEL_LEN, api_keys=frozenset(), max_concurrent_requests=MAX_CONCURRENT,
            max_body_bytes=MAX_BODY_BYTES, run_dir=state_dir,
            key_failures=ApiKeyFailures(AuditLog(state_dir / "audit.jsonl", "test-gateway")),
            max_prompt_chars=MAX_PROMPT_CHARS, max_messages=MAX_MESSAGES, template_timeout_s=5.0,
            body_timeout_s=BODY_TIMEOUT_S, reasoning_parser="qwen3", **settings_overrides,
        )  # fmt: skip
        metrics = HttpMetrics(CollectorRegistry())  # one per in-process gateway: names register once
        return AppGateway(settings, AsyncClient(gw.run.run_dir), Tokenizer(Path(gw.model)), metrics)

    with gateway_in_thread(make_gateway) as url:
        yield url


def test_a_bug_in_a_reply_formatter_is_a_logged_500_not_a_dropped_connection(
    gw: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The Responses and Anthropic replies share chat's runner: a bug in their formatting fails
    that request alone, with its traceback logged: a 500 in the API's own error shape, or, once a
    stream's 200 is sent, an error event that ends the stream."""

    def broken(*args, **kwargs):
        raise RuntimeError("a formatter bug")

    for reply in (ResponsesReply, AnthropicReply):
        monkeypatch.setattr(reply, "whole", broken)
        monkeypatch.setattr(reply, "chunk", broken)
    with in_process_gateway(gw, tmp_path) as url, caplog.at_level(logging.ERROR, "services.gateway.app"):
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=HTTP_TIMEOUT_S, max_retries=0)
        with pytest.raises(openai.InternalServerError) as failed:
            api.responses.create(model=gw.model, input=CHAT, max_output_tokens=4)
        assert failed.value.body["code"] == "internal" and "a formatter bug" in failed.value.body["message"]
        events = list(api.responses.create(model=gw.model, input=CHAT, max_output_tokens=4, stream=True))
        assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "internal"
        assert "a formatter bug" in failed.error.message

        client = anthropic.Anthropic(base_url=url, api_key="none", timeout=HTTP_TIMEOUT_S, max_retries=0)
        with pytest.raises(anthropic.InternalServerError) as failed:
            client.messages.create(model=gw.model, messages=CHAT, max_tokens=4)
        assert failed.value.body["type"] == "error" and failed.value.body["error"]["type"] == "api_error"
        stream = client.messages.stream(model=gw.model, messages=CHAT, max_tokens=4)
        with pytest.raises(anthropic.APIStatusError) as failed, stream as events:
            list(events)
        assert failed.value.body["error"]["type"] == "api_error"
        assert "a formatter bug" in failed.value.body["error"]["message"]

        # The replica goes on serving.
        assert api.chat.completions.create(model=gw.model, messages=CHAT, max_tokens=2).choices
    failures = [r for r in caplog.records if r.exc_info and "a formatter bug" in str(r.exc_info[1])]
    assert [r.getMessage() for r in failures] == ["/v1/responses failed"] * 2 + ["/v1/messages failed"] * 2


def test_a_stream_that_fails_midway_ends_with_its_error(
    gw: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine error after a stream's first output is its last event before [DONE]: no usage
    chunk (include_usage, timings_per_token) follows it as though the request had ended well."""

    async def fails_after_one_delta(client, jobs):
        yield 0, StreamDelta("Hi", [5], usage=m.Usage(3, 0))
        raise Overloaded("the engine gave up")

    monkeypatch.setattr(services.gateway.app, "run_jobs", fails_after_one_delta)
    body = {
        "model": gw.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "timings_per_token": True,
    }
    with in_process_gateway(gw, tmp_path) as url:
        for path, extra in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": CHAT}),
        ):
            request = urllib.request.Request(f"{url}{path}", json.dumps({**body, **extra}).encode(),
                                             {"content-type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
                assert reply.status == 200
                text = reply.read().decode()
            *datas, done = [e["data"] for e in parse_sse(text)]
            chunks = [json.loads(data) for data in datas]
            assert done == "[DONE]" and "the engine gave up" in chunks[-1]["error"]["message"], chunks
            assert not [chunk for chunk in chunks if chunk.get("choices") == []], chunks  # no usage chunk


def test_a_responses_stream_that_fails_midway_ends_with_response_failed(
    gw: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenAI's Responses stream ends with one terminal event: an engine error after the start is
    `response.failed`, its response `failed` with the `error` (code, message) and the output so far,
    not a bare `error` event that leaves a client waiting for the response's end."""

    async def fails_after_one_delta(client, jobs):
        yield 0, StreamDelta("Hi", [5], usage=m.Usage(3, 0))
        raise Overloaded("the engine gave up")

    monkeypatch.setattr(services.gateway.app, "run_jobs", fails_after_one_delta)
    with in_process_gateway(gw, tmp_path) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=HTTP_TIMEOUT_S, max_retries=0)
        events = list(api.responses.create(model=gw.model, input=CHAT, max_output_tokens=4, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.failed", events
    assert "error" not in [e.type for e in events]
    failed = events[-1].response
    assert failed.status == "failed" and failed.id == events[0].response.id
    assert failed.error.code == "overloaded" and "the engine gave up" in failed.error.message
    assert failed.output_text == "Hi"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_response_cut_inside_its_reasoning_has_no_message_item(
    gw: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_output_tokens reached inside the think block (the in-process replica reads qwen3's):
    the output is the reasoning item alone, `incomplete`, as OpenAI's, streamed and not; no empty
    message item follows it."""

    async def cut_while_thinking(client, jobs):
        yield 0, StreamDelta("<think>", [5], usage=m.Usage(3, 1))
        yield 0, StreamDelta("still going", [6], finish_reason="length", usage=m.Usage(3, 2))

    monkeypatch.setattr(services.gateway.app, "run_jobs", cut_while_thinking)
    with in_process_gateway(gw, tmp_path) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=HTTP_TIMEOUT_S, max_retries=0)
        reply = api.responses.create(model=gw.model, input=CHAT, max_output_tokens=2)
        events = list(api.responses.create(model=gw.model, input=CHAT, max_output_tokens=2, stream=True))
    for response in (reply, events[-1].response):
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert [(item.type, item.status) for item in response.output] == [("reasoning", "incomplete")]
        assert response.output[0].content[0].text == "still going" and response.output_text == ""


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [], "tools": [TOOL]}, "messages"),
        ("/v1/chat/completions/input_tokens", {"messages": [], "tools": [TOOL]}, "messages"),
        ("/v1/responses/input_tokens", {"input": [], "tools": [{"type": "function", "name": "f"}]}, "input"),
        ("/tokenize", {"messages": [{"role": "x", "content": "hi"}]}, "messages[0].role"),
        ("/apply-template", {"messages": [{"role": "user", "content": "hi"}, {"role": "x", "content": "hi"}]},
         "messages[1].role"),
    ],
)  # fmt: skip
def test_a_chat_rendered_without_generating_is_checked_as_generation_checks_it(
    gw: Gateway, path: str, body: dict, named: str
) -> None:
    """/tokenize, /apply-template and the input_tokens routes render a chat as generation does,
    and refuse what generation refuses, naming the field (an empty chat with tools was a 500)."""
    status, _, data = gw.request("POST", path, {"model": gw.model, **body})
    reply = json.loads(data)
    assert status == 400, reply
    error = reply["error"]
    assert error.get("param", named) == named and named.split(".")[-1].split("[")[0] in error["message"], (
        error
    )


def test_developer_role_is_the_system_role(gw: Gateway) -> None:
    as_system, _ = chat_sampled(gw, [{"role": "system", "content": SYSTEM}, *CHAT], 12)
    as_developer, _ = chat_sampled(gw, [{"role": "developer", "content": SYSTEM}, *CHAT], 12)
    without, _ = chat_sampled(gw, CHAT, 12)
    assert as_developer.message.content == as_system.message.content != without.message.content


def test_models_retrieve_by_id(gw: Gateway) -> None:
    api = gw.openai(max_retries=0)
    card = api.models.retrieve(gw.model)
    assert card.id == gw.model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as unknown:
        api.models.retrieve("gpt-17")
    assert unknown.value.body["code"] == "model_not_found"


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
    status, error = gw.error("/v1/audio/speech", {})
    assert status == 404 and error["code"] == "not_found"
    # A method the route does not take: 405 with its Allow header (RFC 9110), in the shape of the
    # API the path belongs to (llama.cpp's, Anthropic's, OpenAI's).
    for method, path, shape in (("PUT", "/v1/models", {"message", "type", "param", "code"}),
                                ("GET", "/completion", {"code", "message", "type"}),
                                ("GET", "/v1/messages", {"type", "message"}),
                                ("POST", "/v1/responses/resp_x", {"message", "type", "param", "code"})):  # fmt: skip
        status, headers, data = gw.request(method, path)
        body = json.loads(data)
        error = body["error"]
        assert status == 405 and set(error) == shape and headers["allow"], (path, headers, body)
        assert error["type"] == "invalid_request_error", body  # the client's error, not a server's
        allowed = {"PUT": {"GET"}, "GET": {"POST"}, "POST": {"GET", "DELETE"}}[method]
        assert set(headers["allow"].replace(" ", "").split(",")) >= allowed, headers
    status, _, data = gw.request("POST", "/v1/messages/batches", {})
    assert status == 404 and json.loads(data)["type"] == "error", data  # Anthropic's error shape
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
    "speculate not a bool": (b'{"prompt": "hi", "speculate": "no"}', "speculate", "invalid_type"),
    "stream_options without stream": (
        b'{"prompt": "hi", "stream_options": {"include_usage": true}}',
        "stream_options",
        "invalid_value",
    ),
    "chat stream_options without stream": (
        b'{"messages": [{"role": "user", "content": "hi"}], "stream": false, "stream_options": {"include_usage": false, "continuous_usage_stats": true}}',
        "stream_options",
        "invalid_value",
    ),
    "unknown content part": (
        b'{"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}',
        "messages[0].content[0].type",
        "invalid_value",
    ),
    "unknown role": (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages", "invalid_value"),
    "text part without its text": (
        b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        "messages[0].content[0].text",
        "invalid_value",
    ),
    "image_url part without its image_url": (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        "messages[0].content[0].image_url",
        "invalid_value",
    ),
    "too many choices": (b'{"prompt": "hi", "n": 1000}', "n", "invalid_value"),
    "top_logprobs without logprobs": (
        b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
        "top_logprobs",
        "invalid_value",
    ),
    "invalid utf-8": (b'{"prompt": "\xff\xfe"}', None, "invalid_json"),
    "number past float range": (b'{"prompt": "hi", "temperature": 1e999}', "temperature", "invalid_type"),
    "nested number past float range": (
        b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -1e400}}',
        "logit_bias",
        "invalid_type",
    ),
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
    "beam search prompt over max_model_len": (
        json.dumps({"prompt": [5] * MAX_MODEL_LEN, "use_beam_search": True}).encode(),
        "prompt",
        "context_length_exceeded",
    ),
    "prompt_logprobs with stream": (
        b'{"prompt": "hi", "prompt_logprobs": 1, "stream": true}',
        "prompt_logprobs",
        "invalid_value",
    ),
    # vLLM's fields that change the output and are not served: refused, not ignored
    **{
        f"unserved {name}": (json.dumps({"prompt": "hi", name: value}).encode(), name, "invalid_value")
        for name, value in (
            ("logits_processors", ["x"]),
            ("prompt_embeds", "AAAA"),
            ("guided_whitespace_pattern", " *"),
        )
    },
    # vLLM's beam search: a width past what the engine's logprobs can rank, a bad length_penalty,
    # and each field that beams cannot honour, refused by name rather than ignored
    **{
        f"beam search {case}": (json.dumps({"prompt": "hi", **body}).encode(), param, "invalid_value")
        for case, body, param in (
            ("wider than 2 x n logprobs allow", {"use_beam_search": True, "n": 11}, "n"),
            # "" is a 400 without beams too; a search would have dropped it unsaid
            ("with an empty stop string", {"use_beam_search": True, "stop": ""}, "stop"),
            ("length_penalty without it", {"length_penalty": 0.5}, "length_penalty"),
            (
                "length_penalty out of range",
                {"use_beam_search": True, "length_penalty": 1e3},
                "length_penalty",
            ),
            ("max_tokens 0", {"use_beam_search": True, "max_tokens": 0}, "max_tokens"),
            *(
                (f"with {name}", {"use_beam_search": True, name: value}, name)
                for name, value in (
                    ("stream", True),
                    ("stop", ["."]),
                    ("stop_token_ids", [5]),
                    ("min_tokens", 2),
                    ("logit_bias", {"5": 1.0}),
                    ("frequency_penalty", 0.5),
                    ("repetition_penalty", 1.2),
                    ("allowed_token_ids", [5, 6]),
                    ("bad_words", ["water"]),
                    ("response_format", {"type": "json_object"}),
                    ("echo", True),
                    ("prompt_logprobs", 1),
                    ("timings_per_token", True),
                )
            ),
        )
    },
    **{
        f"chat beam search {case}": (
            json.dumps({"messages": messages, "use_beam_search": True, **body}).encode(),
            param,
            "invalid_value",
        )
        for case, messages, body, param in (
            (
                "with tools",
                [{"role": "user", "content": "x"}],
                {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
                "tools",
            ),
            (
                "with max_completion_tokens 0",
                [{"role": "user", "content": "x"}],
                {"max_completion_tokens": 0},
                "max_completion_tokens",
            ),
            (
                "with an image",
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                        ],
                    }
                ],
                {},
                "messages",
            ),
        )
    },
    # vLLM's allowed_token_ids and bad_words, served: a bad one is refused naming it (the gateway's
    # decoding for a wrong type, the engine's checks for a bad value)
    **{
        f"{name} {case}": (json.dumps({"prompt": "hi", name: value}).encode(), param, code)
        for name, case, value, param, code in (
            ("allowed_token_ids", "empty", [], "allowed_token_ids", "invalid_value"),
            ("allowed_token_ids", "negative", [5, -1], "allowed_token_ids", "invalid_value"),
            ("allowed_token_ids", "out of the vocabulary", [49152], "allowed_token_ids", "invalid_value"),
            ("allowed_token_ids", "past the wire's int64", [2**63], "allowed_token_ids", "invalid_value"),
            (
                "allowed_token_ids",
                "more than the vocabulary",
                [7] * 49153,
                "allowed_token_ids",
                "invalid_value",
            ),
            ("allowed_token_ids", "of strings", ["a"], "allowed_token_ids[0]", "invalid_type"),
            ("allowed_token_ids", "not a list", 5, "allowed_token_ids", "invalid_type"),
            ("bad_words", "empty string", ["ok", ""], "bad_words", "invalid_value"),
            ("bad_words", "whitespace only", [" \t"], "bad_words", "invalid_value"),
            ("bad_words", "too long", ["x" * 257], "bad_words", "invalid_value"),
            ("bad_words", "too many tokens", ["\u2603" * 86], "bad_words", "invalid_value"),
            ("bad_words", "too many", ["w"] * 65, "bad_words", "invalid_value"),
            ("bad_words", "of numbers", [3], "bad_words[0]", "invalid_type"),
            ("bad_words", "a string", "word", "bad_words", "invalid_type"),
        )
    },
    "chat allowed_token_ids empty": (
        b'{"messages": [{"role": "user", "content": "x"}], "allowed_token_ids": []}',
        "allowed_token_ids",
        "invalid_value",
    ),
    "chat bad_words empty string": (
        b'{"messages": [{"role": "user", "content": "x"}], "bad_words": [""]}',
        "bad_words",
        "invalid_value",
    ),
    # the scheduler's refusals: nothing could ever be sampled before min_tokens (eos is 2), or at all
    "allowed_token_ids held back by min_tokens": (
        b'{"prompt": "hi", "allowed_token_ids": [2], "min_tokens": 3}',
        "allowed_token_ids",
        "invalid_value",
    ),
    "allowed_token_ids all bad words": (
        b'{"prompt": "hi", "allowed_token_ids": [913], "bad_words": [" water"]}',
        "allowed_token_ids",
        "invalid_value",
    ),
    **{
        f"unserved chat {name}": (
            json.dumps({"messages": [{"role": "user", "content": "x"}], name: value}).encode(),
            name,
            "invalid_value",
        )
        for name, value in (
            ("add_special_tokens", True),
            ("chat_template", "{{ messages }}"),
            ("echo", True),
            ("functions", [{"name": "f", "parameters": {}}]),
            ("function_call", "auto"),
            ("documents", [{"title": "t", "text": "x"}]),
        )
    },
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_input_gets_400_naming_the_field(gw: Gateway, case: str) -> None:
    body, param, code = BAD_BODIES[case]
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, error = gw.error(path, body)
    assert status == 400, error
    assert error["param"] == param and error["code"] == code, error


def test_a_compressed_body_is_refused_by_its_encoding_not_as_bad_json(gw: Gateway) -> None:
    """A gzip body was parsed as JSON and refused as `invalid_json`, which sends its sender
    looking for a fault in its JSON: 415, naming the encoding. Identity is the body as it is."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    status, _, data = gw.request("POST", "/v1/completions", gzip.compress(body), {"content-encoding": "gzip"})
    error = json.loads(data)["error"]
    assert status == 415 and error["code"] == "unsupported_media_type" and "'gzip'" in error["message"], error
    status, _, data = gw.request("POST", "/v1/completions", body, {"content-encoding": "identity"})
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 1, data


def test_a_lone_surrogate_escape_is_named_not_called_truncated(gw: Gateway) -> None:
    """JSON's `\\ud83d` without its low half is no character; the decoder calls such a body
    "truncated", which sends its sender looking for a cut connection. A whole pair is served. (A
    low half alone the decoder names itself.)"""
    for text, escape in (
        (r"hi \ud83d!", r"\ud83d at byte"),
        (r"\\\ud83d hi", r"\ud83d at byte"),
        (r"a \ude00", "surrogate pair"),
    ):
        status, error = gw.error("/v1/completions", b'{"prompt": "' + text.encode() + b'"}')
        assert status == 400 and error["code"] == "invalid_json", error
        assert escape in error["message"] and "surrogate" in error["message"], error
    body = rb'{"prompt": "hi \ud83d\ude00 \\ud800", "max_tokens": 1}'
    status, _, data = gw.request("POST", "/v1/completions", body)
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 1, data


def test_vllms_own_defaults_of_unserved_fields_are_served(gw: Gateway) -> None:
    """Clients that send whole vLLM request models send its defaults of the fields not served
    here: those ask for nothing and are served, only other values are refused."""
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "logits_processors": [],
                "guided_whitespace_pattern": None, "allowed_token_ids": None}  # fmt: skip
    chat_defaults = {"add_special_tokens": False, "echo": False, "documents": None, "include_reasoning": True,
                     "functions": [], "function_call": "none"}  # fmt: skip
    for path, body in (
        ("/v1/completions", {"prompt": "hi", **defaults}),
        ("/v1/chat/completions", {"messages": CHAT, **defaults, **chat_defaults}),
    ):
        status, _, data = gw.request("POST", path, {"model": gw.model, "max_tokens": 2, **body})
        assert status == 200, (path, data)


# -- vLLM's allowed_token_ids and bad_words ---------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    """The served tiny model in HF transformers (float32): the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_next_logprobs(hf_model, ids: list[int]) -> list[float]:
    """HF's log-softmax over the vocabulary of the token after `ids`."""
    import torch

    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, -1).tolist()


def hf_greedy_under(hf_model, prompt: list[int], num_tokens: int, score) -> list[int]:
    """Greedy decoding with HF where `score(logprobs, outputs)` gives each candidate's score
    (None: not allowed); asserts every pick wins by a margin float rounding cannot close."""
    outputs: list[int] = []
    for _ in range(num_tokens):
        logprobs = hf_next_logprobs(hf_model, prompt + outputs)
        scored = sorted(
            ((value, t) for t, lp in enumerate(logprobs) if (value := score(t, lp, outputs)) is not None),
            reverse=True,
        )
        assert scored[0][0] - scored[1][0] > 1e-3, (outputs, scored[:2])
        outputs.append(scored[0][1])
    return outputs


WORDS = [" water", " fire", " the", " and", ".", " bucket", " kin", " passed"]
PASSED_PROMPT = "The bucket brigade passed"


def test_allowed_token_ids_greedy_is_the_argmax_over_them_with_penalties_and_bias(
    gw: Gateway, hf_tokenizer, hf_model
) -> None:
    """Greedy output under allowed_token_ids is, step by step, the best allowed token of HF's
    logits with the same presence and frequency penalties and logit bias; every token is an
    allowed one, and its logprob is the raw distribution's (as under a grammar's mask: the
    engine reports logprobs before bias, penalties and masks)."""
    prompt = hf_tokenizer.encode(PASSED_PROMPT)
    allowed = [hf_tokenizer.encode(w)[0] for w in WORDS]
    assert all(len(hf_tokenizer.encode(w)) == 1 for w in WORDS)
    bias = {allowed[4]: 0.5}
    body = {"model": gw.model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 0,
            "presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {str(t): v for t, v in bias.items()},
            "allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    status, _, data = gw.request("POST", "/v1/completions", body)
    assert status == 200, data
    choice = json.loads(data)["choices"][0]
    got = choice["token_ids"]

    def score(t: int, lp: float, outputs: list[int]) -> float | None:
        if t not in allowed:
            return None
        count = outputs.count(t)
        return lp + bias.get(t, 0.0) - (1.0 * (count > 0) + 0.5 * count)

    expected = hf_greedy_under(hf_model, prompt, 10, score)
    assert got == expected and set(got) <= set(allowed)
    assert len(set(got)) >= 4  # the penalties move it along: not one token over and over
    free = {key: value for key, value in body.items() if key != "allowed_token_ids"}
    status, _, data = gw.request("POST", "/v1/completions", free)
    assert status == 200 and set(json.loads(data)["choices"][0]["token_ids"]) - set(
        allowed
    )  # the mask did choose
    for k, logprob in enumerate(choice["logprobs"]["token_logprobs"]):
        raw = hf_next_logprobs(hf_model, prompt + got[:k])[got[k]]
        assert abs(logprob - raw) < 1e-3, (k, logprob, raw)


def test_allowed_token_ids_sampled_with_seeds_on_chat(gw: Gateway, hf_tokenizer) -> None:
    """Sampled chat completions under allowed_token_ids give allowed tokens only, for every seed
    (which still tell the outputs apart), the same tokens streamed and again with a seed."""
    api = gw.openai()
    allowed = [hf_tokenizer.encode(w)[0] for w in WORDS]
    outputs = {}
    for seed in range(4):
        reply = api.chat.completions.create(
            model=gw.model, messages=CHAT, max_tokens=12, temperature=1.0, seed=seed,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
        )  # fmt: skip
        ids = reply.choices[0].token_ids
        assert ids and set(ids) <= set(allowed), (seed, ids)
        outputs[seed] = ids
    assert len({tuple(ids) for ids in outputs.values()}) > 1
    chunks = list(api.chat.completions.create(
        model=gw.model, messages=CHAT, max_tokens=12, temperature=1.0, seed=2, stream=True,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    ))  # fmt: skip
    streamed = [i for c in chunks for ch in c.choices for i in (getattr(ch, "token_ids", None) or [])]
    assert streamed == outputs[2]


def test_allowed_token_ids_with_a_json_schema_satisfy_both(gw: Gateway, hf_tokenizer) -> None:
    """A json_schema response under allowed_token_ids that leave "n" the digits 0, 1 and 2 only:
    valid JSON of the schema, written in allowed tokens; and a set that no token the schema
    starts with is in fails the request, naming allowed_token_ids."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    allowed = [t for t in range(len(hf_tokenizer)) if set(hf_tokenizer.decode([t])) <= set('{}":, 012n')]
    allowed += [hf_tokenizer.eos_token_id]
    assert 50 < len(allowed) < 2000
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    for temperature, seed in ((0.0, None), (1.0, 5)):
        reply = gw.openai().chat.completions.create(
            model=gw.model, messages=CHAT, max_tokens=40, temperature=temperature, seed=seed,
            response_format=response_format, extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)
        assert set(str(value["n"])) <= set("012") and set(choice.token_ids) <= set(allowed)
    digits = [hf_tokenizer.encode(d)[0] for d in "123"]
    status, error = gw.error(
        "/v1/chat/completions",
        {"model": gw.model, "messages": CHAT, "max_tokens": 10, "response_format": response_format,
         "allowed_token_ids": digits},
    )  # fmt: skip
    assert status == 400 and error["param"] == "allowed_token_ids", error
    assert "no token is left to sample at output position 0" in error["message"], error


def test_bad_words_are_never_generated(gw: Gateway, hf_tokenizer, hf_model) -> None:
    """Greedy output with bad_words is HF's greedy output where, at each step, the bad words'
    tokens are banned by vLLM's rule (a one-token word always; a longer word's last token where
    the output ends with its others), computed here from HF's tokenization. The words are taken
    from the output without them: a one-token word and a two-token one that it contains."""
    api = gw.openai()
    prompt = hf_tokenizer.encode(PASSED_PROMPT)
    free = api.completions.create(model=gw.model, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]  # fmt: skip
    assert free.token_ids == hf_greedy_under(hf_model, prompt, 12, lambda t, lp, out: lp)
    one = hf_tokenizer.decode(free.token_ids[2:3]).strip()  # the output's third token, as a word
    bad = vllm_bad_words_ids(hf_tokenizer, [one])
    assert [free.token_ids[2]] in bad
    # Two tokens the output has side by side, whose text tokenizes back to them (bare or spaced).
    two = next(
        text
        for k in range(len(free.token_ids) - 1)
        if free.token_ids[k + 1] != free.token_ids[2]
        and free.token_ids[k : k + 2]
        in vllm_bad_words_ids(hf_tokenizer, [text := hf_tokenizer.decode(free.token_ids[k : k + 2]).strip()])
    )
    for words in ([one], [two], [one, two]):
        sequences = vllm_bad_words_ids(hf_tokenizer, words)

        def score(t: int, lp: float, out: list[int], sequences=sequences) -> float | None:
            banned = {
                w[-1] for w in sequences if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1 :] == w[:-1]
            }
            return None if t in banned else lp

        reply = api.completions.create(model=gw.model, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"bad_words": words, "return_token_ids": True, "ignore_eos": True})  # fmt: skip
        got = reply.choices[0].token_ids
        assert got == hf_greedy_under(hf_model, prompt, 12, score), words
        assert got != free.token_ids
        for word in sequences:
            assert not any(got[k : k + len(word)] == word for k in range(len(got))), (words, word)
    # A chat's reply here starts with newlines: the assistant's turn is continued from some text.
    turns = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": PASSED_PROMPT}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
    chat_free = api.chat.completions.create(model=gw.model, messages=turns, max_tokens=12, temperature=0,
                                            extra_body=extra).choices[0]  # fmt: skip
    word = next(text for t in chat_free.token_ids if (text := hf_tokenizer.decode([t]).strip()))
    chat = api.chat.completions.create(model=gw.model, messages=turns, max_tokens=12, temperature=0,
                                       extra_body={**extra, "bad_words": [word]}).choices[0]  # fmt: skip
    banned = {w[0] for w in vllm_bad_words_ids(hf_tokenizer, [word]) if len(w) == 1}
    assert banned & set(chat_free.token_ids) and not banned & set(chat.token_ids), (word, banned)
    assert chat.token_ids != chat_free.token_ids


def test_bad_allowed_token_ids_and_bad_words_leave_the_engine_serving(gw: Gateway) -> None:
    """After every refusal above (and one that fails mid-stream), the engine serves as before."""
    for case in sorted(BAD_BODIES):
        if case.startswith(("allowed_token_ids", "bad_words", "chat allowed", "chat bad")):
            body, param, _ = BAD_BODIES[case]
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            status, error = gw.error(path, body)
            assert status == 400 and error["param"] == param, (case, error)
    status, _, data = gw.request(
        "POST", "/v1/completions", {"model": gw.model, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    )
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 3, data


def test_a_body_with_a_byte_order_mark_or_in_utf16_is_read(gw: Gateway) -> None:
    """JSON with a UTF-8 byte-order mark, or in UTF-16 or UTF-32 (what some Windows clients send;
    Python's json, behind vLLM's server, reads them): the same reply as the plain UTF-8 body."""
    body = {"model": gw.model, "prompt": "Buckets \u2603", "max_tokens": 3, "temperature": 0}
    text = json.dumps(body)
    want = gw.request("POST", "/v1/completions", text.encode())
    assert want[0] == 200
    for data in (b"\xef\xbb\xbf" + text.encode(), text.encode("utf-16"), text.encode("utf-16-le"),
                 text.encode("utf-32")):  # fmt: skip
        status, _, reply = gw.request("POST", "/v1/completions", data)
        assert status == 200, reply
        assert json.loads(reply)["choices"] == json.loads(want[2])["choices"]


def test_null_reads_as_the_default_as_vllms_server_reads_it(gw: Gateway) -> None:
    """Clients that forward optional parameters send null for those not set; vLLM's request models
    take it as the default, for fields that otherwise take no null too (`n`, `stream`, booleans,
    `min_tokens`). A null where a value is required, or a wrong type beside nulls, is still a 400."""
    nulls = dict.fromkeys(
        ("n", "stream", "ignore_eos", "min_tokens", "skip_special_tokens", "speculate", "echo")
    )
    for path, body in (
        (
            "/v1/completions",
            {"model": gw.model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
        ),
        ("/v1/chat/completions", {"model": gw.model, "messages": CHAT, "max_tokens": 8, "temperature": 0}),
    ):
        status, _, plain = gw.request("POST", path, body)
        assert status == 200, plain
        status, _, with_nulls = gw.request("POST", path, {**body, **nulls, "logprobs": None})
        assert status == 200, with_nulls
        choices = json.loads(with_nulls)["choices"]
        assert len(choices) == 1 and choices == json.loads(plain)["choices"]
    status, error = gw.error("/v1/completions", {"prompt": "hi", "n": None, "stream": "yes"})
    assert status == 400 and error["param"] == "stream", error
    status, error = gw.error("/v1/chat/completions", {"messages": None, "n": None})
    assert status == 400 and error["param"] == "messages", error


def test_a_renamed_parameter_is_named_as_sent_and_a_message_naming_none_gets_no_param(gw: Gateway) -> None:
    """The engine checks max_tokens and logprobs; a request that sent them as top_logprobs or
    max_output_tokens reads its own names in the message as well as in `param`."""
    status, error = gw.error("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21})
    assert status == 400 and error["param"] == "top_logprobs", error
    assert error["message"].startswith("top_logprobs must be in [0, 20]"), error
    status, error = gw.error("/v1/responses", {"input": "hi", "max_output_tokens": 0})
    assert status == 400 and error["param"] == "max_output_tokens", error
    assert error["message"].startswith("max_output_tokens must be"), error
    # LoRA adapters are off in this run: the refusal is about the engine, not a field of the request.
    status, error = gw.error("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    assert status == 400 and error["param"] is None and "lora.max_loras is 0" in error["message"], error


def server_loads(gw: Gateway, connections: int = 20) -> set[int]:
    """vLLM's /load as the replicas answer it, each on a fresh connection (the kernel spreads
    them over both replicas)."""
    loads = set()
    for _ in range(connections):
        status, _, body = gw.request("GET", "/load", headers={"authorization": ""})
        assert status == 200, body
        loads.add(json.loads(body)["server_load"])
    return loads


def settled_loads(gw: Gateway, timeout: float = 30.0) -> set[int]:
    """server_loads once every replica serves nothing, or as they are at the deadline."""
    deadline = time.monotonic() + timeout
    while (loads := server_loads(gw)) != {0} and time.monotonic() < deadline:
        time.sleep(0.2)
    return loads


def test_vllms_ping_version_and_load(gw: Gateway) -> None:
    """vLLM's small endpoints, without a key as vLLM's: /ping answers as /health does (GET and
    POST, for SageMaker), /version the installed package's version, /load the requests the
    answering replica is serving."""
    for method in ("GET", "POST"):
        status, _, body = gw.request(method, "/ping", headers={"authorization": ""})
        assert status == 200 and json.loads(body) == {"status": "ok"}, body
    status, _, body = gw.request("GET", "/version", headers={"authorization": ""})
    assert status == 200 and json.loads(body) == {"version": importlib.metadata.version("brigade")}
    assert settled_loads(gw) == {0}  # earlier tests' closed connections are noticed at a write
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT_S)
    try:
        body = {"model": gw.model, "prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        conn.request("POST", "/v1/completions", json.dumps(body), {"authorization": f"Bearer {CONFIG_KEY}"})
        reply = conn.getresponse()
        assert reply.status == 200
        while not reply.readline().startswith(b"data: "):  # the stream's first event is in
            pass
        assert server_loads(gw) == {0, 1}  # its replica counts it; the other serves nothing
    finally:
        conn.close()
    assert settled_loads(gw) == {0}


def test_sagemakers_invocations_serve_each_api_by_its_body(gw: Gateway) -> None:
    """vLLM's /invocations: the body's fields choose the API; each answer equals that API's own,
    streamed too; a body that names none is a 400 saying what to give; the key is still needed."""
    chat = {"model": gw.model, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    completion = {"model": gw.model, "prompt": "Buckets hold", "max_tokens": 8, "temperature": 0}
    for body, path in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        status, _, direct = gw.request("POST", path, body)
        status_via, _, via = gw.request("POST", "/invocations", body)
        assert status == status_via == 200, via
        direct_reply, via_reply = json.loads(direct), json.loads(via)
        assert via_reply["object"] == direct_reply["object"]
        assert via_reply["choices"][0] == direct_reply["choices"][0]
    # A null field names no API: a completion whose client sends `messages: null` is a completion.
    status, _, via = gw.request("POST", "/invocations", {**completion, "messages": None})
    assert status == 200 and json.loads(via)["object"] == "text_completion", via
    status, headers, streamed = gw.request("POST", "/invocations", {**chat, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(e["data"]) for e in parse_sse(streamed.decode()) if e["data"] != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert (
        text
        == json.loads(gw.request("POST", "/v1/chat/completions", chat)[2])["choices"][0]["message"]["content"]
    )
    status, _, body = gw.request("POST", "/invocations", {"input": "hi"})
    assert status == 400 and "embedding" in json.loads(body)["error"]["message"]  # a generating run
    for bad, message in (
        ({"temperature": 0}, "give messages"),
        (b"[1, 2]", "JSON object"),
        (b"{", "JSON object"),
    ):
        status, _, body = gw.request("POST", "/invocations", bad)
        assert status == 400 and message in json.loads(body)["error"]["message"], body
    assert gw.request("POST", "/invocations", chat, headers={"authorization": ""})[0] == 401


def test_metrics_page_filters_by_name_and_gzips(gw: Gateway) -> None:
    """As prometheus_client's own server: `name[]` picks families by sample name, and a scraper
    that accepts gzip gets it."""
    wanted = ["brigade:http_requests_total", "brigade:http_e2e_request_latency_seconds_count"]
    query = "&".join(f"name[]={name}" for name in wanted)
    status, headers, body = gw.request("GET", f"/metrics?{query}", headers={"accept-encoding": "gzip"})
    assert status == 200 and headers.get("content-encoding") == "gzip"
    names = {
        s.name for f in text_string_to_metric_families(gzip.decompress(body).decode()) for s in f.samples
    }
    assert names == set(wanted), names
    status, headers, body = gw.request("GET", "/metrics", headers={"accept-encoding": "gzip;q=0, identity"})
    assert "content-encoding" not in headers and b"brigade:http_time_to_first_token_seconds_count" in body


def test_metrics_label_each_route_by_its_path(gw: Gateway) -> None:
    """Every route counts under its own path label (a templated one under its template); only
    unknown paths share `other`."""
    calls = [
        ("POST", "/v1/messages", {"max_tokens": 1, "messages": CHAT}, 200),
        ("POST", "/v1/messages/count_tokens", {"messages": CHAT}, 200),
        ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1}, 200),
        ("GET", "/v1/responses/resp_nope", None, 404),
        ("GET", f"/v1/models/{gw.model}", None, 200),
        ("GET", "/tokenizer_info", None, 200),
        ("POST", "/v1/embeddings", {"input": "hi"}, 400),
        ("POST", "/score", {"text_1": "hi", "text_2": "ho"}, 400),  # a generating run: no vectors
        ("POST", "/v1/rerank", {"query": "hi", "documents": ["ho"]}, 400),
        ("POST", "/invocations", {"prompt": "hi", "max_tokens": 1}, 200),
        ("POST", "/completion", {"prompt": "hi", "n_predict": 1}, 200),  # llama.cpp's own API
        ("GET", "/props", None, 200),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}, 404),
        ("GET", "/no/such/route", None, 404),
    ]
    labels = {
        "/v1/responses/resp_nope": "/v1/responses/{response_id}",
        f"/v1/models/{gw.model}": "/v1/models/{model_id}",
        "/no/such/route": "other",
    }
    before = {path: http_requests_count(gw, labels.get(path, path), status) for _, path, _, status in calls}
    for method, path, body, status in calls:
        assert gw.request(method, path, body)[0] == status, path
    for _, path, _, status in calls:
        assert http_requests_count(gw, labels.get(path, path), status) >= before[path] + 1, path


def test_a_client_gone_before_its_body_is_whole_counts_as_499_not_a_500(gw: Gateway) -> None:
    before = {status: http_requests_count(gw, "/v1/chat/completions", status) for status in (499, 500)}
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CONFIG_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n"
    ).encode()
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", gw.port), timeout=HTTP_TIMEOUT_S) as sock:
            sock.sendall(head + b'{"model":')
            time.sleep(0.3)
    deadline = time.monotonic() + 30
    while (
        http_requests_count(gw, "/v1/chat/completions", 499) < before[499] + 2 and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert http_requests_count(gw, "/v1/chat/completions", 499) == before[499] + 2
    assert http_requests_count(gw, "/v1/chat/completions", 500) == before[500]
    assert gw.request("GET", "/health")[0] == 200


def test_a_client_gone_with_a_pipelined_request_queued_counts_as_499_and_is_aborted(gw: Gateway) -> None:
    """A request with another pipelined behind it on its connection: the client leaves (closes
    mid-stream, or sent garbage after it, which uvicorn answers with a 400 and a close) while the
    first one runs. It is aborted and counted as 499, not written to the closed connection (a
    logged 500) with its engine work left to run to its end."""
    path = "/v1/completions"
    before = {status: http_requests_count(gw, path, status) for status in (499, 500)}

    def post(body: dict) -> bytes:
        data = json.dumps({"model": gw.model, "ignore_eos": True, **body}).encode()
        return (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CONFIG_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode() + data

    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", gw.port), timeout=HTTP_TIMEOUT_S) as sock:
        sock.sendall(post({"prompt": "Once", "max_tokens": 1000, "stream": True}) + health)
        received = b""
        while b"data: " not in received:  # the stream runs; the health check waits behind it
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    with socket.create_connection(("127.0.0.1", gw.port), timeout=HTTP_TIMEOUT_S) as sock:
        sock.sendall(post({"prompt": "Once", "max_tokens": 500}) + b"GARBAGE\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")
    deadline = time.monotonic() + 60
    while http_requests_count(gw, path, 499) < before[499] + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert http_requests_count(gw, path, 499) == before[499] + 2
    assert http_requests_count(gw, path, 500) == before[500]
    assert wait_idle(gw.run, timeout=30) == (0, 0.0)


def stalled_stream(gw: Gateway) -> socket.socket:
    """A connection with a stream of megabytes requested on it, more than the kernel buffers of both
    ends hold (16 choices with 20 alternatives a token: about 0.7 kB an event each), its receive
    window small."""
    body = json.dumps(
        {"model": gw.model, "prompt": "Once", "max_tokens": MAX_MODEL_LEN - 8, "n": 16, "logprobs": 20,
         "ignore_eos": True, "stream": True}
    ).encode()  # fmt: skip
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CONFIG_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.settimeout(HTTP_TIMEOUT_S)
    sock.connect(("127.0.0.1", gw.port))
    sock.sendall(head + body)
    return sock


def test_a_client_that_stops_reading_its_stream_is_dropped_and_its_request_aborted(gw: Gateway) -> None:
    """A client that keeps its connection open but reads nothing of its stream: once the socket
    buffers are full its writes wait, and after gateway.write_timeout_s without a byte taken the
    connection is dropped and the request aborted (a 499), rather than holding its
    max_concurrent_requests slot and its output for as long as the connection stays open."""
    path = "/v1/completions"
    before = http_requests_count(gw, path, 499)
    with stalled_stream(gw) as sock:
        deadline = time.monotonic() + HTTP_TIMEOUT_S
        while http_requests_count(gw, path, 499) == before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert http_requests_count(gw, path, 499) == before + 1, "the stalled stream was not dropped"
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):  # what the kernel holds, then the end (or a reset)
                received += chunk
    assert received.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in received
    assert wait_idle(gw.run, timeout=30) == (0, 0.0)  # its choices were aborted


def test_a_slow_reader_that_keeps_taking_bytes_is_served_to_the_end(gw: Gateway) -> None:
    """A client reading a few kB a second, far slower than the stream comes: the kernel's send
    buffer stays full for many write_timeout_s (it takes bytes from the gateway again only once a
    third of it is free), but the client takes some in each, so it is not dropped."""
    path = "/v1/completions"
    before = http_requests_count(gw, path, 200)
    received = b""
    with stalled_stream(gw) as sock:
        slow_until = time.monotonic() + 4 * WRITE_TIMEOUT_S
        while time.monotonic() < slow_until:
            chunk = sock.recv(4096)
            assert chunk, f"dropped after {len(received)} bytes"
            received += chunk
            time.sleep(0.5)
        while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            chunk = sock.recv(1 << 20)
            assert chunk, f"dropped after {len(received)} bytes"
            received += chunk
    assert http_requests_count(gw, path, 200) == before + 1


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


# -- vLLM's beam search ----------------------------------------------------------------------

BEAM_TIE = 1e-3  # candidates' scores closer than this may be ordered differently by HF and the engine
EOS = 2  # the tiny model's (and SmolLM2's <|im_end|>)


def hf_beam_search(
    hf_model,
    prompt: list[int],
    width: int,
    max_tokens: int,
    length_penalty: float = 1.0,
    ignore_eos: bool = False,
) -> tuple[list[tuple[list[int], float, str]], bool]:
    """vLLM's beam search written out over HF's logits: each step, every live beam's top 2 x
    width tokens are its candidates; one ending in eos (unless ignore_eos) is complete, the rest
    keep the best `width` by cumulative logprob; at the end complete and live beams are ranked by
    cumulative / (prompt + output tokens, less a last eos) ** length_penalty. Returns the best
    `width` as (tokens, cumulative logprob, finish_reason), and whether some cut along the way
    fell between two candidates closer than BEAM_TIE (where the engine may choose otherwise)."""
    import torch

    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float, str]] = []
    is_near_tie = False
    for _ in range(max_tokens):
        candidates = []
        for tokens, cumulative in live:
            with torch.inference_mode():
                logits = hf_model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            values, ids = torch.log_softmax(logits, -1).topk(2 * width + 1)
            # Which tokens are candidates matters only where eos is about to be in or out of them:
            # no token past a beam's top 2 x width could make the live cut.
            if EOS in ids[-2:].tolist() and not ignore_eos:
                is_near_tie |= float(values[-2] - values[-1]) < BEAM_TIE
            for logprob, token in zip(values[: 2 * width].tolist(), ids[: 2 * width].tolist(), strict=True):
                if token == EOS and not ignore_eos:
                    done.append(([*tokens, token], cumulative + logprob, "stop"))
                else:
                    # vLLM ranks the live ones by score too: the same as by cumulative logprob
                    # unless ignore_eos keeps an eos among them, whose eos is not in its length
                    child = [*tokens, token]
                    score = beam_score(len(prompt), child, cumulative + logprob, length_penalty)
                    candidates.append((score, cumulative + logprob, child))
        candidates.sort(key=lambda c: -c[0])
        if len(candidates) > width:
            is_near_tie |= candidates[width - 1][0] - candidates[width][0] < BEAM_TIE
        live = [(tokens, cumulative) for _, cumulative, tokens in candidates[:width]]
        if not live:
            break
    ranked = sorted(
        done + [(tokens, cumulative, "length") for tokens, cumulative in live],
        key=lambda b: -beam_score(len(prompt), b[0], b[1], length_penalty),
    )
    scores = [beam_score(len(prompt), tokens, cumulative, length_penalty) for tokens, cumulative, _ in ranked]
    if len(ranked) > width:
        is_near_tie |= scores[width - 1] - scores[width] < BEAM_TIE
    return ranked[:width], is_near_tie


def beam_score(num_prompt: int, tokens: list[int], cumulative: float, length_penalty: float) -> float:
    seq_len = num_prompt + len(tokens) - (1 if tokens and tokens[-1] == EOS else 0)
    return cumulative / seq_len**length_penalty


def hf_cumulative(hf_model, prompt: list[int], tokens: list[int]) -> float:
    """The sum of HF's logprobs of `tokens` after `prompt` (teacher forcing)."""
    import torch

    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return float(logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


def check_beams(
    hf_model, hf_tokenizer, choices: list[dict], prompt: list[int], max_tokens: int, length_penalty: float = 1.0,
    ignore_eos: bool = False,
) -> list[list[int]]:  # fmt: skip
    """One prompt's beam search choices (token ids and logprobs asked) against HF's: the same
    beams, best first, where no near-tie could reorder them; else each beam's cumulative logprob
    is HF's for its tokens, the beams are ranked by their scores, and the best is as good as
    HF's best. The choices' token ids."""
    width = len(choices)
    want, is_near_tie = hf_beam_search(hf_model, prompt, width, max_tokens, length_penalty, ignore_eos)
    got = [choice["token_ids"] for choice in choices]
    cumulative = [sum(choice["logprobs"]["token_logprobs"]) for choice in choices]
    for choice, tokens, total in zip(choices, got, cumulative, strict=True):
        assert choice["text"] == hf_tokenizer.decode(tokens, skip_special_tokens=True)
        assert len(choice["logprobs"]["token_logprobs"]) == len(tokens) <= max_tokens
        assert abs(total - hf_cumulative(hf_model, prompt, tokens)) < 1e-3, (tokens, total)
        ends_in_eos = tokens[-1] == EOS and not ignore_eos
        assert choice["finish_reason"] == ("stop" if ends_in_eos else "length"), choice
    scores = [beam_score(len(prompt), t, c, length_penalty) for t, c in zip(got, cumulative, strict=True)]
    assert all(a >= b - 1e-4 for a, b in itertools.pairwise(scores)), scores
    if is_near_tie:
        assert scores[0] >= beam_score(len(prompt), want[0][0], want[0][1], length_penalty) - BEAM_TIE
    else:
        assert got == [tokens for tokens, _, _ in want]
        assert [c["finish_reason"] for c in choices] == [reason for _, _, reason in want]
        for total, (_, hf_total, _) in zip(cumulative, want, strict=True):
            assert abs(total - hf_total) < 1e-3
    return got


def beam_reply(api: openai.OpenAI, **kwargs) -> dict:
    extra = kwargs.pop("extra_body", {})
    reply = api.completions.create(
        logprobs=1, extra_body={"use_beam_search": True, "return_token_ids": True, **extra}, **kwargs
    )
    return reply.model_dump()


def test_beam_search_returns_hf_transformers_beams_best_first(gw: Gateway, hf_tokenizer, hf_model) -> None:
    """use_beam_search on /v1/completions: n beams per prompt, as vLLM's beam search finds them over
    the same weights in HF transformers (texts, token ids, cumulative logprobs, finish reasons);
    prompts counted once each and every returned beam's tokens in the usage."""
    api = gw.openai()
    prompts = [hf_tokenizer.encode(PASSED_PROMPT), hf_tokenizer.encode("Once upon a time")]
    reply = beam_reply(api, model=gw.model, prompt=prompts, n=3, max_tokens=4)
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert [choices[0]["prompt_token_ids"], choices[3]["prompt_token_ids"]] == prompts
    outputs = [check_beams(hf_model, hf_tokenizer, choices[3 * k : 3 * k + 3], prompts[k], 4) for k in (0, 1)]
    assert len({tuple(t) for t in outputs[0]}) == 3  # n distinct beams
    assert reply["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])
    assert reply["usage"]["completion_tokens"] == sum(len(t) for beams in outputs for t in beams)
    # One beam, no eos in reach: greedy decoding, as a temperature-0 request gives it.
    one = beam_reply(api, model=gw.model, prompt="Once upon a time", n=1, max_tokens=4)
    greedy = api.completions.create(
        model=gw.model,
        prompt="Once upon a time",
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert one["choices"][0]["token_ids"] == greedy.choices[0].token_ids
    check_beams(hf_model, hf_tokenizer, one["choices"], prompts[1], 4)


def test_beam_search_eos_ignore_eos_and_length_penalty(gw: Gateway, hf_tokenizer, hf_model) -> None:
    """A prompt ending in eos makes eos the likeliest next token of the tiny model: that beam is
    complete at once ("stop", its eos in token_ids, not in the text). length_penalty decides
    whether it outranks the longer beams (vLLM's score); with ignore_eos eos is a token as any."""
    api = gw.openai()
    prompt = [*hf_tokenizer.encode(PASSED_PROMPT), EOS]
    body = {"model": gw.model, "prompt": prompt, "n": 2, "max_tokens": 3}
    rankings = {}
    for penalty in (1.0, 3.0):
        reply = beam_reply(api, **body, extra_body={"length_penalty": penalty})
        rankings[penalty] = check_beams(hf_model, hf_tokenizer, reply["choices"], prompt, 3, penalty)
    assert rankings[1.0][0] == [EOS]  # the complete beam first: its score counts only the prompt's length
    assert [EOS] not in rankings[3.0]  # the longer beams win, their length raised to the third
    reply = beam_reply(api, **body, extra_body={"ignore_eos": True, "length_penalty": 0.0})
    ignored = check_beams(hf_model, hf_tokenizer, reply["choices"], prompt, 3, 0.0, ignore_eos=True)
    assert ignored[1] == [EOS] * 3 and reply["choices"][1]["text"] == ""  # eos after eos: "length"
    reply = beam_reply(api, **body, extra_body={"ignore_eos": True})  # live beams with eos ranked by score
    check_beams(hf_model, hf_tokenizer, reply["choices"], prompt, 3, 1.0, ignore_eos=True)


def test_beam_search_on_chat_and_at_max_model_len(gw: Gateway, hf_tokenizer, hf_model) -> None:
    """A chat's beams (its prompt rendered once, by the tokenizer stage); a beam that reaches
    max_model_len ends there with "length", before max_tokens."""
    api = gw.openai()
    reply = api.chat.completions.create(
        model=gw.model, messages=CHAT, n=2, max_tokens=3, logprobs=True, top_logprobs=2,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    ).model_dump()  # fmt: skip
    prompt = reply["prompt_token_ids"]
    assert all(len(x["top_logprobs"]) == 2 for c in reply["choices"] for x in c["logprobs"]["content"])
    as_completions = [
        {"token_ids": c["token_ids"], "text": c["message"]["content"], "finish_reason": c["finish_reason"],
         "logprobs": {"token_logprobs": [x["logprob"] for x in c["logprobs"]["content"]]}}
        for c in reply["choices"]
    ]  # fmt: skip
    outputs = check_beams(hf_model, hf_tokenizer, as_completions, prompt, 3)
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert reply["usage"]["completion_tokens"] == sum(map(len, outputs))

    long_prompt = hf_tokenizer.encode(" bucket" * (MAX_MODEL_LEN - 2))[: MAX_MODEL_LEN - 2]
    reply = beam_reply(api, model=gw.model, prompt=long_prompt, n=2, max_tokens=10)
    assert [c["finish_reason"] for c in reply["choices"]] == ["length", "length"]
    assert [len(c["token_ids"]) for c in reply["choices"]] == [2, 2]


# -- hostile input: every request gets an answer, and none can stall the others (issue #29) -------


def http_requests_count(gw: Gateway, path: str, status: int) -> float:
    metrics = gw.request("GET", "/metrics")[2].decode()
    pattern = rf'^brigade:http_requests_total\{{path="{re.escape(path)}",status="{status}"\}} (\S+)$'
    match = re.search(pattern, metrics, re.M)
    return float(match.group(1)) if match else 0.0


def test_integers_past_the_wire_get_400_naming_the_field(gw: Gateway) -> None:
    """Integers wider than the wire made the SDK's packer raise OverflowError, which killed the
    gateway's job task silently: the client waited forever and the slot stayed taken. Each is a
    400 naming its field, through the openai client and a raw connection."""
    api = gw.openai(max_retries=0).with_options(timeout=60.0)  # main hung here: fail, do not wait
    calls = [
        ("prompt", lambda: api.completions.create(model=gw.model, prompt=[2**31], max_tokens=2)),
        ("max_tokens", lambda: api.completions.create(model=gw.model, prompt="hi", max_tokens=2**64)),
        (
            "logit_bias",
            lambda: api.completions.create(
                model=gw.model, prompt="hi", max_tokens=2, logit_bias={str(2**70): 1}
            ),
        ),
        (
            "max_completion_tokens",
            lambda: api.chat.completions.create(model=gw.model, messages=CHAT, max_completion_tokens=2**64),
        ),
        (
            "stop_token_ids",
            lambda: api.chat.completions.create(
                model=gw.model, messages=CHAT, max_tokens=2, extra_body={"stop_token_ids": [2**64]}
            ),
        ),
        (
            "truncate_prompt_tokens",
            lambda: api.completions.create(
                model=gw.model, prompt="hi", max_tokens=2, extra_body={"truncate_prompt_tokens": 2**64}
            ),
        ),
        ("dimensions", lambda: api.embeddings.create(model=gw.model, input="hi", dimensions=2**64)),
    ]
    for param, call in calls:
        with pytest.raises(openai.BadRequestError) as bad:
            call()
        assert bad.value.body["param"] == param, bad.value.body
        assert "out of range" in bad.value.body["message"]
    status, error = gw.error("/v1/completions", b'{"prompt": [1, 2, 18446744073709551616], "stream": true}')
    assert status == 400 and error["param"] == "prompt" and "index 2" in error["message"]
    # Every request ended (none holds a slot): all of a replica's slots still serve.
    with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
        replies = list(
            pool.map(
                lambda _: gw.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                range(MAX_CONCURRENT),
            )
        )
    assert [r[0] for r in replies] == [200] * MAX_CONCURRENT


def test_deeply_nested_json_is_a_counted_400(gw: Gateway) -> None:
    """10k levels of JSON, or a 700-deep JSON schema, ran the decoder (or what came after it) out
    of stack: a 500 with a traceback per request, not counted in the HTTP metrics."""
    path = "/v1/chat/completions"
    before = http_requests_count(gw, path, 400)
    # Under a field that takes any JSON (response_format), where the decoder recurses per level.
    nested = b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"x": '
    nested += b"[" * 10_000 + b"]" * 10_000 + b"}}"
    status, error = gw.error(path, nested)
    assert status == 400 and error["code"] == "invalid_json", error
    assert "nested 10002 levels deep" in error["message"]
    schema: dict = {"type": "string"}
    for _ in range(700):
        schema = {"type": "array", "items": schema}
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as bad:
        gw.openai(max_retries=0).chat.completions.create(
            model=gw.model, messages=CHAT, max_tokens=2, response_format=response_format
        )
    assert "levels deep" in bad.value.body["message"]
    assert http_requests_count(gw, path, 400) >= before + 2


def test_requests_past_the_work_budget_get_400_naming_the_limit(gw: Gateway) -> None:
    """/tokenize rendered and encoded any prompt under the body limit on the gateway's event loop
    (7 MB stalled every stream for 15 s); a chat's messages and tool-call arguments were not
    counted. Each is refused by the budget, naming it."""
    status, error = gw.error("/tokenize", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)})
    assert status == 400 and error["param"] == "prompt" and "tokenizer.max_prompt_chars" in error["message"]
    assert error["code"] == "context_length_exceeded"
    many = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    status, error = gw.error("/tokenize", {"messages": many})
    assert status == 400 and error["param"] == "messages" and "tokenizer.max_messages" in error["message"]
    status, error = gw.error("/detokenize", {"tokens": [1] * (MAX_PROMPT_CHARS + 1)})
    assert status == 400 and error["param"] == "tokens"
    api = gw.openai(max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=gw.model, messages=many, max_tokens=2)
    assert bad.value.body["param"] == "messages" and "tokenizer.max_messages" in bad.value.body["message"]
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "f", "arguments": '{"x": "' + "a" * MAX_PROMPT_CHARS + '"}'},
    }
    history = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
    ]
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=gw.model, messages=history, max_tokens=2)
    assert bad.value.body["param"] == "messages" and "tokenizer.max_prompt_chars" in bad.value.body["message"]
    # Within the budget /tokenize still answers, from its worker thread.
    status, _, body = gw.request("POST", "/tokenize", {"messages": many[:MAX_MESSAGES]})
    assert status == 200 and json.loads(body)["count"] > MAX_MESSAGES


def tokenizer_failures(gw: Gateway, code: str) -> float:
    """Requests the tokenizer stage refused with `code` (its brigade:request_failure counter)."""
    metrics = gw.request("GET", "/metrics")[2].decode()
    pattern = rf'^brigade:request_failure_total\{{[^}}]*code="{code}"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, metrics, re.M))


def test_a_chat_past_the_character_budget_is_refused_before_the_tokenizer(gw: Gateway) -> None:
    """6M characters of past tool-call arguments were decoded, copied to the tokenizer and refused
    there. The gateway refuses a chat past tokenizer.max_prompt_chars itself, counting what the
    tokenizer counts (roles, contents, call ids, names and arguments), and forwards one at the limit."""

    def history(num_chars: int) -> list[dict]:
        fixed = len("user") + len(CHAT[0]["content"]) + len("assistant") + len("call_0") + len("f")
        fixed += len("tool") + len("call_0") + len("ok")
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "f", "arguments": "a" * (num_chars - fixed)},
        }
        return [
            *CHAT,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
        ]

    api = gw.openai(max_retries=0)
    refused_by_tokenizer = tokenizer_failures(gw, "prompt_too_long")
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=gw.model, messages=history(MAX_PROMPT_CHARS + 1), max_tokens=2)
    assert bad.value.body["param"] == "messages" and bad.value.body["code"] == "context_length_exceeded"
    assert f"{MAX_PROMPT_CHARS + 1} characters" in bad.value.body["message"]
    assert "tokenizer.max_prompt_chars" in bad.value.body["message"]
    assert tokenizer_failures(gw, "prompt_too_long") == refused_by_tokenizer  # never reached it
    # At the limit the chat goes on to the tokenizer, whose next check is of the rendered prompt
    # (the template adds its own text), and well within it to the model's length.
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=gw.model, messages=history(MAX_PROMPT_CHARS), max_tokens=2)
    assert "once rendered by the chat template" in bad.value.body["message"], bad.value.body
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=gw.model, messages=history(MAX_PROMPT_CHARS // 2), max_tokens=2)
    assert "max_model_len" in bad.value.body["message"], bad.value.body
    assert tokenizer_failures(gw, "prompt_too_long") == refused_by_tokenizer + 2


FAULTS_SCRIPT = """
import sys
from services.gateway.__main__ import keep_body_memory

def minor_faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])

size = 6 << 20
if sys.argv[1] == "keep":
    keep_body_memory(7 << 20)  # the default max_body_bytes, about
for i in range(12):
    if i == 2:  # after a warm-up, as in a gateway that served a body before
        before = minor_faults()
    blocks = [b"a" * size for _ in range(3)]  # a body, its joined copy, its decoded text
    del blocks
print(minor_faults() - before)
"""


def test_large_bodies_reuse_the_gateways_memory() -> None:
    """glibc maps each block past its threshold afresh and unmaps it on free, so a 6 MB chat (its
    bytes, their joined copy, its decoded strings) paged in about 4,000 pages on every request,
    10 ms of the gateway's system time, as much as reading and decoding it. The gateway keeps
    body-sized blocks in malloc's heap (keep_body_memory): ten such bodies fault in next to nothing.
    """

    def faults(mode: str) -> int:
        argv = [sys.executable, "-c", FAULTS_SCRIPT, mode]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
        return int(done.stdout)

    assert faults("default") > 10 * 3000  # glibc's default: three 6 MB blocks paged in each time
    assert faults("keep") < 10 * 100


def test_too_many_messages_are_refused_before_the_body_is_decoded(gw: Gateway) -> None:
    """A chat of 25x tokenizer.max_messages messages was measured for nesting and decoded whole
    (about 65 ms of the gateway's loop for 102,400) before its messages were counted. They are
    counted first: the count is the refusal even where the full decode would fail (here on a
    mistyped field after them). A chat at the limit is served."""
    many = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    status, error = gw.error("/v1/chat/completions", {"messages": many, "max_tokens": "two"})
    assert status == 400 and error["param"] == "messages", error
    assert (
        f"{MAX_MESSAGES + 1} messages; the limit is {MAX_MESSAGES} (tokenizer.max_messages)"
        in error["message"]
    )
    reply = gw.openai(max_retries=0).chat.completions.create(
        model=gw.model, messages=many[:MAX_MESSAGES], max_tokens=2, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"


def test_a_stream_keeps_its_tokens_coming_beside_huge_requests(gw: Gateway) -> None:
    """Huge /tokenize and chat requests, sent back to back for as long as a normal stream runs:
    each over the budget fails alone, naming its limit, and the stream receives its tokens while
    they are in flight."""
    many = [{"role": "user", "content": "a"}] * 20_000
    attack_bodies = [  # path, body, the limit it is refused by (None: within every budget)
        ("/tokenize", {"prompt": "x " * MAX_PROMPT_CHARS}, "tokenizer.max_prompt_chars"),
        ("/tokenize", {"messages": many}, "tokenizer.max_messages"),
        ("/v1/chat/completions", {"messages": many, "max_tokens": 2}, "tokenizer.max_messages"),
        ("/tokenize", {"prompt": "hello " * (MAX_PROMPT_CHARS // 6)}, None),
    ]
    stream_done = threading.Event()
    attacks: list[tuple[float, float]] = []
    wrong: list[tuple[str, str | None, int, bytes]] = []

    def attack() -> None:
        while not stream_done.is_set():
            for path, body, limit in attack_bodies:
                start = time.monotonic()
                status, _, reply = gw.request("POST", path, body)
                attacks.append((start, time.monotonic()))
                if status != (400 if limit else 200) or (limit and limit.encode() not in reply):
                    wrong.append((path, limit, status, reply[:300]))

    stream_body = {"model": gw.model, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0,
                   "stream": True, "ignore_eos": True}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        attackers = [pool.submit(attack) for _ in range(2)]
        while len(attacks) < 2:  # the attack is under way before the stream starts
            time.sleep(0.01)
        arrivals = []
        try:
            for line in stream_lines(gw, stream_body):
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
        finally:
            stream_done.set()
        for attacker in attackers:
            attacker.result(timeout=HTTP_TIMEOUT_S)
    assert not wrong, wrong
    assert len(arrivals) >= 64  # one event per token, at least
    during = [t for t in arrivals if any(start <= t <= end for start, end in attacks)]
    assert during, "no token arrived while an attack request was in flight"


def test_streams_waiting_for_the_engine_send_keep_alive_comments(gw: Gateway) -> None:
    """With the scheduler stopped (SIGSTOP) for a moment, every kind of stream sends `: keep-alive`
    comment lines while it waits, then completes once the scheduler runs on; the openai client
    reads such a stream as usual."""
    streams = {
        "/v1/chat/completions": ({"messages": CHAT, "max_tokens": 8}, rb"data: \[DONE\]\n\n$"),
        "/v1/completions": ({"prompt": "Once upon a time", "max_tokens": 8}, rb"data: \[DONE\]\n\n$"),
        "/v1/responses": (
            {"input": "Hello", "max_output_tokens": 8},
            rb"event: response\.(completed|incomplete)\n",
        ),
        "/v1/messages": ({"messages": CHAT, "max_tokens": 8}, rb"event: message_stop\n"),
    }
    [scheduler] = gw.run.stage_pids("scheduler")
    with ThreadPoolExecutor(len(streams) + 1) as pool:
        os.kill(scheduler, signal.SIGSTOP)
        try:
            raw = {
                path: pool.submit(gw.request, "POST", path,
                                  {"model": gw.model, "temperature": 0, "stream": True, **body})
                for path, (body, _) in streams.items()
            }  # fmt: skip
            parsed = pool.submit(
                lambda: list(gw.openai().chat.completions.create(model=gw.model, messages=CHAT, max_tokens=8,
                                                                 temperature=0, stream=True))
            )  # fmt: skip
            time.sleep(20 * SSE_KEEPALIVE_S)
        finally:
            os.kill(scheduler, signal.SIGCONT)
    for path, (_, end) in streams.items():
        status, headers, data = raw[path].result()
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), (path, data[:300])
        assert re.match(rb"(: keep-alive\n)+(id|event|data): ", data) or b"\n\n: keep-alive\n" in data, (
            path,
            data[:300],
        )
        assert re.search(end, data), (path, data[-300:])
    # message_start waited for the first output under keep-alives, so it counts the prompt.
    start = re.search(rb"event: message_start\ndata: (.*)\n", raw["/v1/messages"].result()[2])
    assert start and json.loads(start.group(1))["message"]["usage"]["input_tokens"] > 0, start
    chunks = parsed.result()
    assert chunks[-1].choices[-1].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_stalled_header_is_closed_within_the_header_timeout(gw: Gateway) -> None:
    """Slowloris: half a request line and headers, then nothing. uvicorn held such connections
    forever; now the header deadline (gateway.header_timeout_s, 2 s here) answers 408 and closes
    them: not before the deadline, and within a few seconds of it (a loaded host's slack)."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=HEADER_TIMEOUT_S + 10) as sock:
        sent = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        reply = read_to_close(sock)  # socket.timeout here: the server never closed it
        elapsed = time.monotonic() - sent
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert HEADER_TIMEOUT_S - 0.5 <= elapsed < HEADER_TIMEOUT_S + 3, f"closed after {elapsed:.2f}s"


def read_to_close(sock: socket.socket) -> bytes:
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


def test_headers_over_the_limit_get_431_however_they_arrive(gw: Gateway) -> None:
    """gateway.max_header_bytes (64 KiB here) was counted only after the parser had read a chunk,
    and a chunk that completed the headers had already ended the count: headers sent in one write
    got 200 at any size. Now whole, in pieces, followed by a body, after empty lines (which the
    parser skips), or pipelined behind another request: 431 and closed; just under the limit,
    served."""
    limit = 64 * 1024
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: "
    over = head + b"a" * (limit - len(head)) + b"\r\n\r\n"
    first = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    cases = [
        ([over], [431]),
        ([over[: limit // 2], over[limit // 2 :]], [431]),
        ([over + b"GET /health HTTP/1.1\r\n\r\n"], [431]),
        ([b"\r\n\r\n" + over], [431]),
        # A second request's headers behind the first's (counted from the next read on).
        ([first + head, b"a" * limit + b"\r\n\r\n"], [200, 431]),
    ]
    for pieces, statuses in cases:
        with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
            for piece in pieces:
                sock.sendall(piece)
                time.sleep(0.2)
            got = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", read_to_close(sock))]
            assert got == statuses, [len(p) for p in pieces]
    under = head + b"a" * (limit - len(head) - 100) + b"\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
        sock.sendall(under)
        assert read_to_close(sock).startswith(b"HTTP/1.1 200"), len(under)


def test_a_chunked_bodys_trailers_count_against_the_header_limit(gw: Gateway) -> None:
    """A chunked body may end with trailer fields, which uvicorn kept, each one, however many
    (megabytes of tiny fields grew a replica by hundreds of MB): past max_header_bytes (64 KiB
    here) 431 and closed; a few are served as without them."""
    body = json.dumps({"model": gw.model, "prompt": "Hi", "max_tokens": 2}).encode()
    head = (
        (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CONFIG_KEY}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            f"{len(body):x}\r\n"
        ).encode()
        + body
        + b"\r\n0\r\n"
    )
    for trailers, status in ((b"a:b\r\n" * 20000, 431), (b"X-Checksum: abc\r\n", 200)):
        with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
            sock.sendall(head)
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                sock.sendall(trailers + b"\r\n")
            got = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", read_to_close(sock))]
            assert got == [status], (len(trailers), got)


@pytest.mark.parametrize(
    ("path", "error_type"),
    [("/v1/completions", b'"type":"invalid_request_error"'), ("/v1/messages", b'"type":"timeout_error"')],
)
def test_a_trickled_body_is_cut_off_with_408(gw: Gateway, path: str, error_type: bytes) -> None:
    body = json.dumps({"prompt": "x" * 200, "max_tokens": 1}).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CONFIG_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=0.5) as sock:
        sock.sendall(head)
        reply = b""
        deadline = time.monotonic() + BODY_TIMEOUT_S + 30
        for byte in body:
            assert time.monotonic() < deadline, "the trickled body was never cut off"
            try:
                sock.sendall(bytes([byte]))
                reply += sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # reset: the server closed the connection
                break
            if reply:
                break
        # The 408's body may come in a later packet than its head: read to the close.
        while reply and time.monotonic() < deadline:
            try:
                more = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not more:
                break
            reply += more
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"gateway.body_timeout_s" in reply and error_type in reply.replace(b" ", b""), reply


def stream_texts(gw: Gateway, prompts: list[str], max_tokens: int) -> list[tuple[str, int]]:
    """Greedy streams, all at once, through the openai client: each one's text and token count."""

    def one(prompt: str) -> tuple[str, int]:
        stream = gw.openai(max_retries=0).completions.create(
            model=gw.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(stream)
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_a_client_whose_constraints_keep_costing_too_much_gets_429(gw: Gateway) -> None:
    """Each distinct `(a{700}){700}b{k}` is a compile the scheduler refuses only after paying for
    it (38 MiB, about 0.2 s of CPU), and a client could send one after another (16 streams beside
    it ran 2.6x slower). Past structured.max_costly_compiles such refusals within the window, its
    constrained requests get a 429 with Retry-After instead of a compile; its other requests, and
    other clients' constrained ones, are served."""
    api = gw.openai(max_retries=0).with_options(api_key=ENV_KEY)
    limit, replicas = 4, 2  # structured.max_costly_compiles's default; the fixture's gateway.replicas
    costly = 0
    for k in range(1, limit * replicas + 2):
        try:
            api.completions.create(
                model=gw.model, prompt="a", max_tokens=8,
                extra_body={"structured_outputs": {"regex": f"(a{{700}}){{700}}b{{{k}}}"}},
            )  # fmt: skip
        except openai.BadRequestError as exc:
            assert (
                "(structured.max_grammar_mib)" in exc.message
                or "(structured.compile_timeout_ms)" in exc.message
            )
            costly += 1
        except openai.RateLimitError as exc:
            limited = exc
            break
    else:
        raise AssertionError(f"no 429 after {costly} costly compiles")
    assert costly >= limit  # each replica counts its own
    assert "structured.max_costly_compiles" in limited.message
    assert 1 <= int(limited.response.headers["retry-after"]) <= 60
    reply = api.completions.create(model=gw.model, prompt="a", max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    reply = gw.openai(max_retries=0).completions.create(
        model=gw.model, prompt="Year:", max_tokens=4, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}
    )
    assert re.fullmatch("[0-9]{4}", reply.choices[0].text)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_client_whose_requests_keep_being_too_large_gets_429_before_its_body_is_read(
    gw: Gateway, tmp_path: Path, path: str
) -> None:
    """Each chat over a size budget (here 25x tokenizer.max_messages) is read and measured whole
    before its 400; sent in a loop, megabytes at a time, that slowed 16 normal streams 1.6x. Past
    gateway.max_oversized_requests such refusals within the window, the client's large bodies get
    a 429 with Retry-After, answered before the body is read; its small requests are served. The
    Responses API's input items count as the chat's messages they become."""
    turns = [{"role": "user", "content": "a" * 64}] * (25 * MAX_MESSAGES)
    field = "messages" if path == "/v1/chat/completions" else "input"
    oversized = json.dumps({"model": gw.model, field: turns}).encode()
    assert len(oversized) > SMALL_BODY_BYTES
    small = json.dumps({"model": gw.model, "messages": CHAT, "max_tokens": 2, "temperature": 0}).encode()
    with in_process_gateway(gw, tmp_path, max_oversized_requests=2, oversized_window_s=60.0) as url:
        port = int(url.rsplit(":", 1)[1])

        def post(body: bytes, route: str = path) -> tuple[int, dict[str, str], str]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
            try:
                conn.request("POST", route, body, {"content-type": "application/json"})
                reply = conn.getresponse()
                return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read().decode()
            finally:
                conn.close()

        for _ in range(2):
            status, _, text = post(oversized)
            assert status == 400 and "tokenizer.max_messages" in text, text
            assert json.loads(text)["error"]["param"] == field, text
        status, headers, text = post(oversized)
        assert status == 429 and "gateway.max_oversized_requests" in text, text
        assert 1 <= int(headers["retry-after"]) <= 60
        assert headers["connection"] == "close"
        status, _, text = post(small, "/v1/chat/completions")
        assert status == 200, text
        assert json.loads(text)["choices"][0]["finish_reason"] == "length"


# What the grammar budgets let the scheduler keep: the compiled-grammar cache (grammar_cache_mib,
# 128 by default) plus the compiles in flight (max_grammar_mib, 16, each), with room for the
# allocator keeping what it freed. Before issue 29's fixes each distinct `(a{700}){700}b{k}`
# kept ~160 MB in the scheduler (tests/test_gateway_structured.py), two of them past this bound.
SCHEDULER_RSS_GROWTH_MIB = 300


def test_normal_streams_beside_every_attack(gw: Gateway) -> None:
    """Issue 29's attacks (benchmarks/attack_bench.py: huge /tokenize, 25x the message budget,
    6x the character budget in tool-call arguments, integers past the wire, 10k-deep JSON,
    pathological and distinct regexes, constraints matching nothing, non-object tool parameters,
    stalled headers, trickled bodies, wrong API keys), each looping beside four normal streams:
    every attack gets its refusal, the streams their exact greedy text, no stage restarts and the
    scheduler's memory stays bounded. The timings are the benchmark's (docs/performance.md)."""
    from benchmarks.attack_bench import ATTACKS, Target, attacking, scheduler_rss_mib, stage_table

    gw.run.wait_until_running(180)  # earlier tests kill stages
    prompts = ["Once upon a time", "The capital of France", "def fibonacci(n):", "Buckets are"]
    alone = stream_texts(gw, prompts, 24)
    assert [n for _, n in alone] == [24] * len(prompts)
    stages, rss = stage_table(gw.run.run_dir), scheduler_rss_mib(gw.run.run_dir)
    target = Target.of_run(gw.run.run_dir, CONFIG_KEY, costly_api_key=ENV_KEY)
    with attacking(target, list(ATTACKS), workers=1, max_shots=20, max_seconds=120) as outcomes:
        beside = stream_texts(gw, prompts, 24)
    assert beside == alone
    wrong = {name: o.wrong for name, o in outcomes.items() if o.wrong or not o.done}
    assert not wrong, wrong
    assert stage_table(gw.run.run_dir) == stages  # same pids, no restarts
    growth = scheduler_rss_mib(gw.run.run_dir) - rss
    assert growth < SCHEDULER_RSS_GROWTH_MIB, f"the scheduler grew {growth:.0f} MiB beside the attacks"


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


def finished_count(gw: Gateway) -> float:
    """The requests the tokenizers saw finish, for any reason."""
    metrics = gw.request("GET", "/metrics")[2].decode()
    return sum(float(v) for v in re.findall(r"^brigade:request_success_total\{[^}]*\} (\S+)$", metrics, re.M))


def test_a_beam_search_whose_client_drops_sends_no_more_steps(gw: Gateway) -> None:
    """A beam search is many one-token requests, one per beam a step: a client that goes away
    mid-search stops it (a 499), and no step is sent after (an orphan search would go on to
    max_tokens with nobody to answer)."""
    assert wait_idle(gw.run) == (0, 0.0)
    path = "/v1/completions"
    gone = http_requests_count(gw, path, 499)
    started = finished_count(gw)
    body = json.dumps(
        {"model": gw.model, "prompt": "Count: 1 2 3", "max_tokens": MAX_MODEL_LEN - 16, "n": 4,
         "use_beam_search": True, "ignore_eos": True}
    ).encode()  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=HTTP_TIMEOUT_S)
    conn.request("POST", path, body, {"authorization": f"Bearer {CONFIG_KEY}"})
    deadline = time.monotonic() + 60
    while finished_count(gw) < started + 12:  # a few steps of 4 beams are done
        assert time.monotonic() < deadline, "the search never stepped"
        time.sleep(0.05)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    # Steps come back to back (each a few ms here): a search going on would finish more every
    # half second, for many seconds (max_tokens of them).
    stop_by = time.monotonic() + 3.0
    last = finished_count(gw)
    while True:
        time.sleep(0.5)
        now = finished_count(gw)
        if now == last:
            break
        assert time.monotonic() < stop_by, "steps were still sent seconds after the client left"
        last = now
    deadline = time.monotonic() + 10
    while http_requests_count(gw, path, 499) == gone:
        assert time.monotonic() < deadline, "the drop was not noticed"
        time.sleep(0.05)
    assert wait_idle(gw.run) == (0, 0.0)


# -- gateway crashes --------------------------------------------------------------------------


def test_last_event_id_resumes_exactly_greedy_and_sampled(gw: Gateway) -> None:
    for body in (
        {"model": gw.model, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True,
         "ignore_eos": True},
        {"model": gw.model, "messages": CHAT, "max_tokens": 24, "temperature": 1.0, "stream": True,
         "ignore_eos": True, "logprobs": True},
        # the role's chunk comes with the first output here: its id is the position before it
        {"model": gw.model, "messages": CHAT, "max_tokens": 24, "temperature": 0, "stream": True,
         "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ):  # fmt: skip
        headers, events = gw.curl_stream(body)
        assert events[-1]["data"] == "[DONE]"
        seed = headers.get("x-brigade-seed")
        texts = [text_of(e) for e in events[:-1]]
        full = "".join(texts)
        with_ids = [k + 1 for k, e in enumerate(events) if e["id"]]  # cuts after an event with an id
        for cut in (with_ids[0], with_ids[len(with_ids) // 2], with_ids[-1]):
            resume_headers = {"last-event-id": events[cut - 1]["id"]}
            if seed is not None:
                resume_headers["x-brigade-seed"] = seed
            _, rest = gw.curl_stream(body, resume_headers)
            assert rest[-1]["data"] == "[DONE]"
            assert "".join(texts[:cut]) + "".join(text_of(e) for e in rest[:-1]) == full, cut
            ids = [e["id"] for e in events[:cut] + rest[:-1] if e["id"]]
            assert ids == sorted(ids, key=lambda i: tuple(int(x) for x in i.split("."))), ids


def test_a_resumption_that_cannot_continue_the_stream_is_refused(gw: Gateway) -> None:
    """A sampled stream resumed without its seed would sample other tokens and send their tail: a
    400 naming X-Brigade-Seed (a seed in the body is its seed). An id past the whole output (of
    another request) resumes nothing: an error event, not a silent empty stream."""
    sampled = {"model": gw.model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0,
               "stream": True, "ignore_eos": True}  # fmt: skip
    status, error = gw.error("/v1/completions", sampled, {"last-event-id": "1.3"})
    assert status == 400 and error["param"] == "X-Brigade-Seed", error
    _, events = gw.curl_stream({**sampled, "seed": 7}, {"last-event-id": "1.3"})
    assert events[-1]["data"] == "[DONE]" and "error" not in events[-2]["data"], events
    greedy = {**sampled, "temperature": 0}
    _, events = gw.curl_stream(greedy)
    last_id = [e["id"] for e in events if e["id"]][-1]
    tokens, chars = (int(x) for x in last_id.split("."))
    _, events = gw.curl_stream(greedy, {"last-event-id": last_id})  # at the end: only the finish
    assert events[-1]["data"] == "[DONE]" and "error" not in events[-2]["data"], events
    for past in (f"{tokens + 1}.{chars}", f"{tokens}.{chars + 1}"):
        _, events = gw.curl_stream(greedy, {"last-event-id": past})
        assert events[-1]["data"] == "[DONE]", events
        error = json.loads(events[-2]["data"])["error"]
        assert error["param"] == "Last-Event-ID" and f"ended at {tokens}.{chars}" in error["message"], error
        assert "".join(text_of(e) for e in events[:-2]) == "", events


def text_of(event: dict) -> str:
    if event["data"] == "[DONE]":
        return ""
    choices = json.loads(event["data"])["choices"]
    if not choices:
        return ""
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


def kill_gateways(gw: Gateway, replicas: list[int]) -> list[int]:
    """SIGKILL these gateway replicas at once (their pids read from status.json); the pids killed."""
    rows = {r["name"]: r for r in gw.run.read_status()}
    pids = [rows[f"gateway-{i}"]["pid"] for i in replicas]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


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
        killed = kill_gateways(gw, [0])
        got = [f.result(timeout=HTTP_TIMEOUT_S * 2) for f in futures]
    assert got == want
    gw.run.wait_for_restart(killed, 120)

    # Streams: kill every replica, so that every stream breaks; each resumes with Last-Event-ID.
    body = {"model": gw.model, "prompt": "Once upon a time", "max_tokens": 120, "temperature": 0.7, "seed": 5,
            "stream": True, "ignore_eos": True}  # fmt: skip
    _, whole = gw.curl_stream(body)
    want_text = "".join(text_of(e) for e in whole)
    streams = [stream_lines(gw, body) for _ in range(2)]
    heard = [[next(s) for _ in range(3)] for s in streams]  # every stream has begun
    killed = kill_gateways(gw, [0, 1])
    texts = []
    for stream, lines in zip(streams, heard, strict=True):
        lines += list(stream)  # until the connection breaks
        events = parse_sse("".join(lines))
        complete = [e for e in events if e["data"] and e["data"] != "[DONE]" and e["data"].endswith("}")]
        assert events[-1]["data"] != "[DONE]"  # the stream broke
        texts.append(
            ("".join(text_of(e) for e in complete), next(e["id"] for e in reversed(complete) if e["id"]))
        )
    gw.run.wait_for_restart(killed, 120)
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
    gw.run.wait_until_running(120)  # the tests before may have killed stages
    worker = gw.run.stage_pids("gpu_worker")[0]
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 60
    statuses = []
    while time.monotonic() < deadline and 503 not in statuses:
        statuses.append(gw.request("GET", "/health")[0])
    assert 503 in statuses
    gw.run.wait_for_restart([worker], 180)
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


def test_an_image_for_a_model_that_reads_none_is_a_400(gw: Gateway) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    status, _, body = gw.request("POST", "/tokenize", {"model": gw.model, "messages": messages})
    assert status == 400 and "this model reads no images" in json.loads(body)["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="this model reads no images"):
        gw.openai().chat.completions.create(model=gw.model, messages=messages, max_tokens=2)
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    with pytest.raises(openai.BadRequestError, match="only text and image_url parts"):
        gw.openai().chat.completions.create(
            model=gw.model, messages=[{"role": "user", "content": [audio]}], max_tokens=2
        )


def test_every_token_count_of_a_chat_is_the_prompt_the_engine_runs(gw: Gateway) -> None:
    """vLLM's /tokenize (with tools and chat_template_kwargs), llama.cpp's and OpenAI's
    input_tokens count a chat as the tokenizer stage renders it for generation: a developer
    message (the system role to the template), a past tool call and its result, the tools
    offered (not under tool_choice none), template variables. The engine's prompt_tokens is the
    independent side: another process renders it."""
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21C"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    cases = [
        {"messages": messages},
        {"messages": messages, "tools": tools},
        {"messages": messages, "tools": tools, "tool_choice": "none"},
        {"messages": messages, "chat_template_kwargs": {"custom_flag": True}},
    ]
    counts = set()
    for body in cases:
        reply = gw.openai().chat.completions.create(
            model=gw.model, max_tokens=1, temperature=0, **{k: v for k, v in body.items() if k != "chat_template_kwargs"},
            extra_body={"chat_template_kwargs": body["chat_template_kwargs"]} if "chat_template_kwargs" in body else None,
        )  # fmt: skip
        engine = reply.usage.prompt_tokens
        counts.add(engine)
        if body.get("tool_choice") != "none":  # vLLM's /tokenize offers every tool it is given
            status, _, data = gw.request(
                "POST", "/tokenize", {k: v for k, v in body.items() if k != "tool_choice"}
            )
            assert status == 200 and json.loads(data)["count"] == engine, (body, data)
        for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
            status, _, data = gw.request("POST", path, {"model": gw.model, **body})
            assert status == 200, data
            assert json.loads(data) == {"object": "response.input_tokens", "input_tokens": engine}, (
                path,
                body,
            )
    assert len(counts) >= 2  # the tools change the prompt: the cases are not all one count

    # OpenAI's /v1/responses/input_tokens through its client, a chained response's turns included
    api = gw.openai()
    kwargs = {"instructions": SYSTEM, "input": CHAT}
    first = api.responses.create(model=gw.model, max_output_tokens=16, temperature=0, **kwargs)
    assert api.responses.input_tokens.count(**kwargs).input_tokens == first.usage.input_tokens
    follow = {"input": "And one about rain.", "previous_response_id": first.id}
    second = api.responses.create(model=gw.model, max_output_tokens=16, temperature=0, **follow)
    counted = api.responses.input_tokens.count(**follow)
    assert counted.object == "response.input_tokens" and counted.input_tokens == second.usage.input_tokens
    # OpenAI's takes a previous response alone: its conversation, as /tokenize renders it
    alone = api.responses.input_tokens.count(previous_response_id=first.id).input_tokens
    history = [*CHAT, {"role": "assistant", "content": first.output_text}]
    assert alone == json.loads(gw.request("POST", "/tokenize", {"messages": history})[2])["count"]
    assert second.usage.input_tokens > first.usage.input_tokens
    # llama.cpp serves the OpenAI routes without /v1 too
    for path, body in (("/chat/completions", {"messages": CHAT}), ("/responses", {"input": "Hi"})):
        status, _, data = gw.request("POST", path, {"model": gw.model, "max_tokens": 2, **body})
        assert status == 200 and json.loads(data)["model"] == gw.model, (path, data)
    status, _, data = gw.request("GET", "/models")  # each replica has its own `created`
    assert status == 200 and [m["id"] for m in json.loads(data)["data"]] == [gw.model]
    assert gw.request("GET", "/v1/health")[::2] == gw.request("GET", "/health")[::2]


@pytest.mark.timeout(300)
def test_priority_orders_the_waiting_requests(tmp_path: Path, tiny_model_dir: Path) -> None:
    """vLLM's `priority`, where gateway.accept_priority lets clients set it: with one sequence
    running at a time, of two requests waiting behind it the lower priority runs first, though
    it came second. (Off by default: the gw fixture's run refuses it, below.)"""
    port = free_port()
    with brigade_run(
        tmp_path / "run", f"model.path={tiny_model_dir}", f"gateway.port={port}", "engine.max_num_seqs=1",
        "model.max_model_len=8192", "gateway.accept_priority=true",
    ) as run:  # fmt: skip
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        finished: list[str] = []

        def complete(name: str, priority: int) -> None:
            api.completions.create(model=str(tiny_model_dir), prompt=name, max_tokens=4,
                                   extra_body={"priority": priority, "ignore_eos": True})  # fmt: skip
            finished.append(name)

        def wait_for_waiting(count: int) -> None:
            deadline = time.monotonic() + 60
            while sum(r["queue_depth"] for r in run.read_status() if r["kind"] == "scheduler") < count:
                assert time.monotonic() < deadline, f"{count} requests never waited"
                time.sleep(0.05)

        blocker = api.completions.create(
            model=str(tiny_model_dir), prompt="hold", max_tokens=8000, stream=True, extra_body={"ignore_eos": True}
        )  # fmt: skip
        next(iter(blocker))  # it runs: the one slot is taken, for the 8000 tokens it may take
        with ThreadPoolExecutor(2) as pool:
            later = pool.submit(complete, "later", 5)
            wait_for_waiting(1)
            sooner = pool.submit(complete, "sooner", -5)
            wait_for_waiting(2)
            blocker.close()  # the slot frees with both waiting
            later.result(timeout=60), sooner.result(timeout=60)
        assert finished == ["sooner", "later"]


def test_requests_naming_unknown_models_share_the_engines_adapter_lists(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A model name the gateway does not know is looked up in the engine (another replica may
    have loaded it): 50 such requests at once ask the engine at most twice, not 50 times, and
    each reads a list asked for after it came (one loaded meanwhile is found)."""
    import asyncio

    from ipc import messages as m

    class Engine:
        """The adapter commands of an AsyncClient, answered after 50 ms."""

        def __init__(self) -> None:
            self.lists = 0
            self.adapters: list[str] = []

        async def adapter_command(self, op: str, *args: Any, **kwargs: Any) -> m.AdapterReply:
            self.lists += 1
            answer = {name: f"/adapters/{name}" for name in self.adapters}  # as it has them when asked
            await asyncio.sleep(0.05)
            return m.AdapterReply("", adapters=answer)

    settings = GatewaySettings(
        model="base", max_model_len=MAX_MODEL_LEN, api_keys=frozenset(), max_concurrent_requests=4,
        max_body_bytes=MAX_BODY_BYTES, run_dir=tmp_path, key_failures=ApiKeyFailures(AuditLog(tmp_path / "a", "t")),
        max_prompt_chars=MAX_PROMPT_CHARS, max_messages=MAX_MESSAGES, template_timeout_s=5.0,
        body_timeout_s=BODY_TIMEOUT_S, max_loras=2,
    )  # fmt: skip
    engine = Engine()
    gateway = AppGateway(settings, engine, Tokenizer(tiny_model_dir), HttpMetrics(CollectorRegistry()))  # type: ignore[arg-type]

    async def flood() -> None:
        await asyncio.gather(*(gateway.refresh_adapters() for _ in range(50)))
        assert engine.lists == 1
        first = asyncio.ensure_future(gateway.refresh_adapters())
        await asyncio.sleep(0.01)  # its list is asked; an adapter is loaded elsewhere; then more come
        engine.adapters.append("sql-lora")
        await asyncio.gather(first, *(gateway.refresh_adapters() for _ in range(49)))
        assert engine.lists == 3 and gateway.adapters == ["sql-lora"]

    asyncio.run(flood())


def test_cors_is_off_by_default_and_serves_the_configured_origins(gw: Gateway, tmp_path: Path) -> None:
    """gateway.cors_origins: a browser page of a listed origin may call the API (its preflight is
    answered before any API key is asked for, and replies name the origin and expose the seed
    header); another origin's preflight is refused. Off by default: no page may."""

    def call(url: str, method: str, path: str, headers: dict[str, str], body: dict | None = None):
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=HTTP_TIMEOUT_S)
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data

    page = "http://ui.example"
    preflight = {"origin": page, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    status, headers, _ = call(gw.url, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 405 and "access-control-allow-origin" not in headers  # off by default
    with in_process_gateway(gw, tmp_path, cors_origins=(page,)) as url:
        status, headers, _ = call(url, "OPTIONS", "/v1/chat/completions", preflight)
        assert status == 200 and headers["access-control-allow-origin"] == page, headers
        assert "authorization" in headers["access-control-allow-headers"].lower()
        body = {"model": gw.model, "prompt": "hi", "max_tokens": 2, "temperature": 1.0}
        status, headers, data = call(url, "POST", "/v1/completions", {"origin": page}, body)
        assert status == 200 and headers["access-control-allow-origin"] == page, data
        assert SEED_HEADER.lower() in headers["access-control-expose-headers"].lower()
        status, headers, _ = call(
            url, "OPTIONS", "/v1/chat/completions", {**preflight, "origin": "http://evil.example"}
        )
        assert status == 400 and "access-control-allow-origin" not in headers


def test_a_first_output_that_overtakes_the_last_prompt_report_completes_it(
    gw: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """return_progress: the engine's reports come straight from the scheduler, the output through
    the detokenizer, and the tokenizer drops a report that comes after output; a stream whose first
    output overtook the last report still hears that the whole prompt is done, before the output."""

    async def output_first(client, jobs):
        yield 0, StreamDelta("", [], prompt_progress=m.PromptProgress(30, 0, 10))
        yield 0, StreamDelta("Hi", [5], usage=m.Usage(30, 1))
        yield 0, StreamDelta("!", [6], finish_reason="length", usage=m.Usage(30, 2))

    monkeypatch.setattr(services.gateway.app, "run_jobs", output_first)
    body = {"model": gw.model, "stream": True, "return_progress": True, "max_tokens": 2}
    with in_process_gateway(gw, tmp_path) as url:
        for path, extra in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": CHAT}),
            ("/completion", {"prompt": "x"}),
        ):
            request = urllib.request.Request(f"{url}{path}", json.dumps({**body, **extra}).encode(),
                                             {"content-type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
                events = [
                    json.loads(e["data"]) for e in parse_sse(reply.read().decode()) if e["data"] != "[DONE]"
                ]
            reports = [
                (i, e["prompt_progress"]["processed"]) for i, e in enumerate(events) if "prompt_progress" in e
            ]
            first_text = next(i for i, e in enumerate(events) if "Hi" in json.dumps(e))
            assert [processed for _, processed in reports] == [10, 30], (path, events)
            assert reports[-1][0] < first_text, (path, events)
