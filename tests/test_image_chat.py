"""Chats with images through a whole run (issue 36): the real `openai` client sends data URLs to
the gateway, the tokenizer expands each image into its tokens and asks the encoder stage for its
embeddings, the scheduler plans each image whole and keys its KV blocks by the image, and the
worker puts the embeddings at the image tokens; the tokens are HF's greedy ones from
Gemma3ForConditionalGeneration on the same random weights. Bad images are 400s, and the run
keeps serving."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
import zmq
from PIL import Image

from client.errors import InvalidRequest
from client.sdk import chat_message
from ipc import messages as m
from ipc.codec import ENCODER_REPLY, ENCODER_REQUEST
from ipc.embedding_cache import EmbeddingCache
from ipc.sockets import DealerSocket
from services.common.images import ImageRules, image_rules_of, open_image, pixels_key
from services.common.text import Tokenizer
from services.stage import read_run_info, run_endpoints
from services.tokenizer.core import MAX_ENCODINGS, Reply, RequestError, TokenizerCore
from tests.harness import assert_clean, brigade_run
from tests.test_e2e import gateway_url

pytestmark = [pytest.mark.timeout(900)]

NEW_TOKENS = 8
MAX_IMAGE_BYTES = 64 << 10


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def openai_chat(turns: list[tuple[str, list[str | bytes]]]) -> list[dict]:
    """(role, parts) -> OpenAI's messages: a str part is text, a bytes part a PNG."""
    return [
        {
            "role": role,
            "content": [
                {"type": "text", "text": part}
                if isinstance(part, str)
                else {"type": "image_url", "image_url": {"url": data_url(part)}}
                for part in parts
            ],
        }
        for role, parts in turns
    ]


def hf_greedy(
    model_dir: Path, turns: list[tuple[str, list[str | bytes]]]
) -> tuple[int, list[int], np.ndarray]:
    """HF's prompt length, greedy tokens and their logprobs (full forwards, pixel values in
    each) for the chat."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    messages = [
        {
            "role": role,
            "content": [
                {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
            ],
        }
        for role, parts in turns
    ]
    images = [Image.open(io.BytesIO(p)) for _, parts in turns for p in parts if isinstance(p, bytes)]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=images, return_tensors="pt")
    hf = Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = inputs["input_ids"]
    num_prompt = ids.shape[1]
    logprobs = []
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            # token_type_ids mark the image tokens, which attend to each other both ways.
            types = torch.zeros_like(ids)
            types[:, :num_prompt] = inputs["token_type_ids"]
            logits = hf(input_ids=ids, pixel_values=inputs["pixel_values"], token_type_ids=types).logits[
                0, -1
            ]
            ids = torch.cat([ids, logits.argmax().reshape(1, 1)], dim=1)
            logprobs.append(float(torch.log_softmax(logits, -1).max()))
    return num_prompt, ids[0, num_prompt:].tolist(), np.array(logprobs)


def served(api, turns: list[tuple[str, list[str | bytes]]]) -> tuple[list[int], np.ndarray]:
    return served_messages(api, openai_chat(turns))


def served_messages(api, messages: list[dict]) -> tuple[list[int], np.ndarray]:
    """The greedy tokens and their logprobs the run serves for OpenAI chat `messages`."""
    reply = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    content = reply.choices[0].logprobs.content
    return [int(entry.token.removeprefix("token_id:")) for entry in content], np.array(
        [e.logprob for e in content]
    )


def assert_hfs(got: tuple[list[int], np.ndarray], expected: tuple[int, list[int], np.ndarray]) -> None:
    assert got[0] == expected[1]
    np.testing.assert_allclose(got[1], expected[2], atol=2e-3)


def tokenize_count(url: str, turns: list[tuple[str, list[str | bytes]]]) -> int:
    return tokenize_messages_count(url, openai_chat(turns))


def tokenize_messages_count(url: str, messages: list[dict]) -> int:
    """The gateway's /tokenize count of OpenAI chat `messages`."""
    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    connection.request(
        "POST", "/tokenize", json.dumps({"model": "tiny", "messages": messages}),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    assert response.status == 200, body
    return body["count"]


@pytest.mark.slow
def test_image_chats_through_the_openai_client_give_hfs_tokens(
    tiny_gemma3_vlm_dir: Path, tmp_path: Path
) -> None:
    import openai

    image_a, image_b, image_c = png(50, 37, seed=0), png(64, 64, seed=1), png(30, 45, seed=2)
    # The image first: its tokens fill the prompt's first KV blocks, which a later prompt with
    # another image would share if the prefix cache keyed them by token ids alone.
    one_image = [("user", [image_a, "What is in this picture?"])]
    other_image = [("user", [image_b, "What is in this picture?"])]
    two_turns = [
        ("user", ["Look:", image_a]),
        ("assistant", ["Noise."]),
        ("user", [image_c, "And this one?"]),
    ]
    expected = {name: hf_greedy(tiny_gemma3_vlm_dir, turns) for name, turns in
                (("one", one_image), ("other", other_image), ("two", two_turns))}  # fmt: skip
    # The image matters to the output (a tiny random model's greedy tokens may not show it).
    assert np.abs(expected["one"][2] - expected["other"][2]).max() > 2e-2

    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={tiny_gemma3_vlm_dir}", "model.dtype=float32", "model.max_model_len=256",
        "encoder.replicas=1", f"encoder.max_image_bytes={MAX_IMAGE_BYTES}", "gateway.served_model_name=tiny",
    )  # fmt: skip
    with brigade_run(run_dir, *overrides) as run:
        url = gateway_url(run)
        api = openai.OpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)
        assert_hfs(served(api, one_image), expected["one"])
        assert_hfs(served(api, other_image), expected["other"])
        assert_hfs(served(api, two_turns), expected["two"])

        # A repeated image: the encoder finds it in its cache (same slot, same write), and the
        # answer is the same.
        rules = ImageRules.from_dir(tiny_gemma3_vlm_dir)
        cache = EmbeddingCache.attach(run_endpoints(run_dir, read_run_info(run_dir)).embedding_cache(0))
        key_a = pixels_key(rules.pixels(open_image(image_a, 1 << 20)))
        where_a = cache.held().get(key_a)
        assert where_a is not None
        assert_hfs(served(api, one_image), expected["one"])
        assert cache.held()[key_a] == where_a
        cache.close()

        # /tokenize counts each image as its tokens.
        assert tokenize_count(url, one_image) == expected["one"][0]
        assert tokenize_count(url, two_turns) == expected["two"][0]

        # Bad images: each a 400 naming what is wrong.
        bmp = io.BytesIO()
        Image.new("RGB", (8, 8)).save(bmp, format="BMP")
        bad = {
            "truncated or corrupt": data_url(image_a[: len(image_a) // 2]),
            "not an image": data_url(b"hello", "text/plain"),
            "type BMP is not supported": data_url(bmp.getvalue(), "image/bmp"),
            f"over the {MAX_IMAGE_BYTES}-byte limit": data_url(png(200, 200, seed=3)),
            "must be a data: URL": "ftp://example.com/cat.png",
        }
        for message, image_url in bad.items():
            content = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": image_url}}]
            with pytest.raises(openai.BadRequestError, match=message) as refused:
                api.chat.completions.create(
                    model="tiny",
                    messages=[
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": content},
                    ],
                    max_tokens=2,
                )
            # Named where the request has it, whichever stage refused it (the encoder numbers
            # a request's images as they come: it said images[0]).
            error = refused.value.body
            assert error["message"].startswith("messages[1].content[1]: ") and error["param"] == "messages", (
                error
            )
        # ... and the run goes on serving.
        assert_hfs(served(api, other_image), expected["other"])
    assert_clean(run_dir)


# -- the tokenizer's admission of images, without a run ----------------------------------------


def vlm_core(model_dir: Path, num_encoders: int = 1) -> TokenizerCore:
    return TokenizerCore(
        Tokenizer(model_dir), 0, 1, max_model_len=256, max_prompt_chars=1 << 20, default_max_tokens=4,
        image_rules=image_rules_of(model_dir), num_encoders=num_encoders, max_image_bytes=MAX_IMAGE_BYTES,
    )  # fmt: skip


def chat(*messages: m.ChatMessage) -> m.Generate:
    return m.Generate("r", messages=list(messages), params=m.SamplingParams(max_tokens=2))


def test_admission_parks_a_chat_with_images_until_its_encoder_answers(tiny_gemma3_vlm_dir: Path) -> None:
    core = vlm_core(tiny_gemma3_vlm_dir)
    picture = m.ImagePart(data_url(png(20, 20, seed=0)))
    entry = core.admit(b"c", chat(m.ChatMessage("user", [m.TextPart("Look: "), picture])))
    # Parked: its files wait for the encoder, and no resubmission or watchdog question sends it
    # to a scheduler before that.
    assert entry.is_encoding and entry.image_files == [png(20, 20, seed=0)]
    prompt = m.unpack_ids(entry.submit.prompt_ids)
    rules = core.image_rules
    assert (prompt[entry.image_starts[0] : entry.image_starts[0] + 4] == rules.image_token_id).all()
    assert core.resubmissions(0) == [] and core.stalled(time.monotonic() + 3600) == {}
    engine = entry.submit.request_id
    ref = m.SlotRef(3, 4)
    ready = core.on_encoded(engine, 0, [b"k" * 16], [ref], "")
    assert ready is entry and not entry.is_encoding
    assert entry.submit.images == [m.PromptImage(entry.image_starts[0], 4, 0, ref, b"k" * 16)]
    assert core.resubmissions(0) == [core.resubmission(entry)]
    assert core.on_encoded(engine, 0, [b"k" * 16], [ref], "") is None  # a late second answer

    # Its embeddings evicted before its prefill: encoded again (the same files), up to a bound.
    evicted = m.RequestFailed(
        engine, m.IMAGES_EVICTED, "step plan: image 0: its embeddings are no longer in ..."
    )
    for _ in range(MAX_ENCODINGS - 1):
        assert core.encode_again(evicted) is entry and entry.is_encoding and entry.submit.images == []
        assert entry.image_files == [png(20, 20, seed=0)] and core.resubmissions(0) == []
        assert core.on_encoded(engine, 0, [b"k" * 16], [ref], "") is entry
    assert core.encode_again(evicted) is None
    reply = core.fail(evicted)
    assert (
        reply is not None
        and reply.message.code == "unavailable"
        and "encoder.cache_bytes" in reply.message.message
    )

    # An encoder's refusal is the client's 400, naming the image where the request has it (the
    # encoder numbers the request's images: images[1] is the second); no encoder in time, a 503.
    two_pictures = chat(
        m.ChatMessage("user", [picture]), m.ChatMessage("assistant", "Noise."),
        m.ChatMessage("user", [m.TextPart("And this?"), picture]),
    )  # fmt: skip
    for error, code, said in (
        ("images[1]: the image/png data is truncated", "invalid_request",
         "messages[2].content[1]: the image/png data is truncated"),
        ("timeout: no encoder answered in 60s", "unavailable", "timeout: no encoder answered in 60s"),
    ):  # fmt: skip
        entry = core.admit(b"c", two_pictures)
        reply = core.on_encoded(entry.submit.request_id, -1, [], [], error)
        assert isinstance(reply, Reply) and reply.message.code == code and reply.message.message == said
        assert entry.submit.request_id not in core.journal


def test_admission_refuses_images_it_cannot_serve(
    tiny_gemma3_vlm_dir: Path, tiny_qwen25vl_dir: Path, tiny_model_dir: Path
) -> None:
    picture = m.ImagePart(data_url(png(20, 20, seed=0)))
    bmp = io.BytesIO()
    Image.new("RGB", (8, 8)).save(bmp, format="BMP")
    refusals = [
        (vlm_core(tiny_gemma3_vlm_dir), chat(m.ChatMessage("assistant", [picture])), "user turns only"),
        (vlm_core(tiny_gemma3_vlm_dir, num_encoders=0), chat(m.ChatMessage("user", [picture])),
         "encoder.replicas 0"),
        (vlm_core(tiny_model_dir), chat(m.ChatMessage("user", [picture])), "this model reads no images"),
        (vlm_core(tiny_gemma3_vlm_dir), chat(m.ChatMessage("user", [m.TextPart("<image_soft_token>"), picture])),
         "spells the image token"),
        (vlm_core(tiny_gemma3_vlm_dir), chat(m.ChatMessage("user", [m.ImagePart("data:image/png;base64,@@")])),
         r"messages\[0\].content\[0\]: image_url: the data URL is not valid base64"),
        # Qwen2.5-VL's image tokens take the image's size, read from its header here: a type the
        # encoder would refuse is refused with it, naming the image.
        (vlm_core(tiny_qwen25vl_dir),
         chat(m.ChatMessage("user", [picture, m.ImagePart(data_url(bmp.getvalue(), "image/bmp"))])),
         r"^messages\[0\].content\[1\]: image: type BMP is not supported"),
    ]  # fmt: skip
    for core, request, message in refusals:
        with pytest.raises(RequestError, match=message) as caught:
            core.admit(b"c", request)
        assert caught.value.code == "invalid_request" and not core.journal


def test_the_sdk_takes_image_parts_in_openais_shape_and_flat() -> None:
    url = data_url(png(4, 4, seed=0))
    want = m.ChatMessage("user", [m.ImagePart(url), m.TextPart("hi")])
    for image in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image_url", "url": url}):
        assert chat_message(0, {"role": "user", "content": [image, {"type": "text", "text": "hi"}]}) == want
    with pytest.raises(InvalidRequest, match="messages"):
        chat_message(0, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]})


@pytest.mark.slow
def test_an_image_evicted_before_its_prefill_is_encoded_again(
    tiny_gemma3_vlm_dir: Path, tmp_path: Path
) -> None:
    """One cache slot. While the scheduler is stopped, another image takes the slot of a request's
    image after it was encoded: its prefill step fails, and its tokenizer encodes it again and
    resubmits it, which gives HF's tokens."""
    import openai

    image_a, image_b = png(50, 37, seed=0), png(64, 64, seed=1)
    turns = [("user", [image_a, "What is in this picture?"])]
    expected = hf_greedy(tiny_gemma3_vlm_dir, turns)
    rules = ImageRules.from_dir(tiny_gemma3_vlm_dir)
    key_a = pixels_key(rules.pixels(open_image(image_a, 1 << 20)))
    key_b = pixels_key(rules.pixels(open_image(image_b, 1 << 20)))
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={tiny_gemma3_vlm_dir}", "model.dtype=float32", "model.max_model_len=256",
        "encoder.replicas=1", "encoder.cache_bytes=1", "gateway.served_model_name=tiny",
    )  # fmt: skip
    ctx = zmq.Context()
    with brigade_run(run_dir, *overrides) as run, ThreadPoolExecutor(1) as pool:
        endpoints = run_endpoints(run_dir, read_run_info(run_dir))
        cache = EmbeddingCache.attach(endpoints.embedding_cache(0))
        assert cache.num_pages == 1
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=300, max_retries=0)
        scheduler = next(row["pid"] for row in run.read_status() if row["kind"] == "scheduler")
        os.kill(scheduler, signal.SIGSTOP)
        try:
            reply = pool.submit(served, api, turns)
            wait_until(lambda: key_a in cache.held())
            first = cache.held()[key_a]
            encoder = DealerSocket(ctx, endpoints.encoder(0), ENCODER_REPLY, ENCODER_REQUEST)
            assert encoder.send(m.EncodeImages("another", [image_b]))
            answer = encoder.recv(timeout=60)
            assert answer is not None and not answer.error and list(cache.held()) == [key_b]
            encoder.close()
        finally:
            os.kill(scheduler, signal.SIGCONT)
        assert_hfs(reply.result(timeout=300), expected)
        again = cache.held()[key_a]
        assert again.slot == first.slot and again.sequence > first.sequence  # encoded again
        cache.close()
    ctx.term()
    assert_clean(run_dir)


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
