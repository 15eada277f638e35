"""llama.cpp's own server API on the gateway (services/gateway/llamacpp.py), end to end: the run of
tests/test_gateway.py (its `gw` fixture: tiny model, two gateway replicas, API keys), driven over
raw HTTP. /completion is checked against /v1/completions (the same engine through the other API)
and the token endpoints against transformers' tokenizer of the model dir."""

from __future__ import annotations

import json

import pytest

from tests import test_gateway
from tests.test_gateway import MAX_MODEL_LEN, Gateway, parse_sse

pytestmark = pytest.mark.timeout(600)

# test_gateway.py's fixtures: its run, started once for this module, and the model's tokenizer.
gw = test_gateway.gw
hf_tokenizer = test_gateway.hf_tokenizer

PROMPT = "The little robot opened the door and"
STOP_WORD_SCAN = 24  # greedy tokens generated to find a stop word in


def post(
    gw: Gateway, path: str, body: dict | bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    status, _, data = gw.request("POST", path, body, headers)
    return status, json.loads(data)


def completion(gw: Gateway, **body) -> dict:
    status, reply = post(gw, "/completion", body)
    assert status == 200, reply
    return reply


def stream(gw: Gateway, **body) -> list[dict]:
    """A streamed /completion's events, each `data:` JSON (llama.cpp sends no [DONE])."""
    status, _, data = gw.request("POST", "/completion", {**body, "stream": True})
    assert status == 200, data
    events = [json.loads(e["data"]) for e in parse_sse(data.decode()) if "data" in e]
    assert events and events[-1]["stop"], events
    return events


def v1_completion(gw: Gateway, **body) -> dict:
    status, reply = post(gw, "/v1/completions", {"model": gw.model, **body})
    assert status == 200, reply
    return reply["choices"][0]


def assert_llama_error(
    status: int, reply: dict, want_status: int, want_type: str = "invalid_request_error"
) -> str:
    """llama.cpp's error shape: {"error": {"code": status, "message", "type"}}; the message."""
    assert status == want_status, reply
    error = reply["error"]
    assert set(error) == {"code", "message", "type"} and error["code"] == want_status, error
    assert error["type"] == want_type, error
    return error["message"]


def test_completion_greedy_equals_v1_completions_streamed_and_not(gw: Gateway, hf_tokenizer) -> None:
    settings = {"temperature": 0, "n_predict": 12}
    reply = completion(gw, prompt=PROMPT, return_tokens=True, **settings)
    want = v1_completion(gw, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    assert reply["content"] == want["text"]
    assert reply["stop"] is True and reply["stop_type"] == "limit" and reply["stopping_word"] == ""
    assert reply["tokens_predicted"] == 12 and len(reply["tokens"]) == 12
    assert hf_tokenizer.decode(reply["tokens"]) == reply["content"]
    assert reply["tokens_evaluated"] == len(hf_tokenizer(PROMPT, add_special_tokens=False).input_ids)
    assert reply["truncated"] is False and reply["model"] == gw.model
    used = reply["generation_settings"]
    assert used["temperature"] == 0 and used["n_predict"] == 12 and used["n_ctx"] == MAX_MODEL_LEN
    timings = reply["timings"]
    assert (
        timings["predicted_n"] == 12 and timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
    )
    assert (
        timings["prompt_n"] + reply["tokens_cached"] == reply["tokens_evaluated"] and timings["prompt_ms"] > 0
    )

    events = stream(gw, prompt=PROMPT, **settings)
    assert all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == reply["content"]
    assert [t for e in events for t in e["tokens"]] == reply["tokens"]  # a stream always has them
    last = events[-1]
    assert last["content"] == "" and last["stop_type"] == "limit" and last["tokens_predicted"] == 12
    assert last["timings"]["predicted_n"] == 12

    without_tokens = completion(gw, prompt=PROMPT, **settings)
    assert without_tokens["tokens"] == [] and without_tokens["content"] == reply["content"]


def test_stop_type_eos_limit_and_word(gw: Gateway, hf_tokenizer) -> None:
    whole = completion(gw, prompt=PROMPT, temperature=0, n_predict=STOP_WORD_SCAN)["content"]
    word = next(w for w in whole.split()[1:] if len(w) >= 2)  # a word after the first: text comes first
    want = whole[: whole.index(word)]
    for reply in (
        completion(gw, prompt=PROMPT, temperature=0, n_predict=STOP_WORD_SCAN, stop=["\u2603", word]),
        stream(gw, prompt=PROMPT, temperature=0, n_predict=STOP_WORD_SCAN, stop=["\u2603", word])[-1],
    ):
        assert reply["stop_type"] == "word" and reply["stopping_word"] == word, reply
    events = stream(gw, prompt=PROMPT, temperature=0, n_predict=STOP_WORD_SCAN, stop=[word])
    assert "".join(e["content"] for e in events) == want
    assert (
        completion(gw, prompt=PROMPT, temperature=0, n_predict=STOP_WORD_SCAN, stop=[word])["content"] == want
    )

    # The eos token made certain by a bias (the tiny model's weights are random).
    eos = hf_tokenizer.eos_token_id
    for bias in ([[eos, 100]], {str(eos): 100}):
        reply = completion(gw, prompt=PROMPT, temperature=0, n_predict=8, logit_bias=bias, stop=["x"])
        assert reply["stop_type"] == "eos" and reply["stopping_word"] == "" and reply["content"] == "", reply
        assert (
            stream(gw, prompt=PROMPT, temperature=0, n_predict=8, logit_bias=bias)[-1]["stop_type"] == "eos"
        )
    ignored = completion(
        gw, prompt=PROMPT, temperature=0, n_predict=3, logit_bias=[[eos, 100]], ignore_eos=True
    )
    assert ignored["stop_type"] == "limit" and ignored["tokens_predicted"] == 3
    # `false` bans a token: the greedy first token never comes.
    first = completion(gw, prompt=PROMPT, temperature=0, n_predict=1, return_tokens=True)["tokens"][0]
    banned = completion(gw, prompt=PROMPT, temperature=0, n_predict=1, return_tokens=True,
                        logit_bias=[[first, False]])  # fmt: skip
    assert banned["tokens"][0] != first

    # n_predict -1: until eos or the context's end (a bias on eos ends it at once); 0: the prompt alone.
    assert completion(gw, prompt=PROMPT, temperature=0, logit_bias=[[eos, 100]])["stop_type"] == "eos"
    nothing = completion(gw, prompt=PROMPT, n_predict=0)
    assert nothing["content"] == "" and nothing["tokens_predicted"] == 0 and nothing["stop_type"] == "limit"


def test_token_id_and_mixed_prompts(gw: Gateway, hf_tokenizer) -> None:
    ids = hf_tokenizer(PROMPT, add_special_tokens=False).input_ids
    by_text = completion(gw, prompt=PROMPT, temperature=0, n_predict=8)
    by_ids = completion(gw, prompt=ids, temperature=0, n_predict=8)
    assert by_ids["content"] == by_text["content"] and by_ids["tokens_evaluated"] == len(ids)
    head, tail = "Once upon a time,", " the little robot"
    head_ids = hf_tokenizer(head, add_special_tokens=False).input_ids
    tail_ids = hf_tokenizer(tail, add_special_tokens=False).input_ids
    mixed = completion(gw, prompt=[head, *tail_ids], temperature=0, n_predict=8)
    assert mixed["tokens_evaluated"] == len(head_ids) + len(tail_ids)
    assert (
        mixed["content"] == completion(gw, prompt=head_ids + tail_ids, temperature=0, n_predict=8)["content"]
    )


def test_a_batch_of_prompts_answers_a_list(gw: Gateway, hf_tokenizer) -> None:
    ids = hf_tokenizer(PROMPT, add_special_tokens=False).input_ids
    want = completion(gw, prompt=PROMPT, temperature=0, n_predict=6)["content"]
    for prompts in ([ids, ids], [ids, PROMPT], [PROMPT, {"prompt_string": PROMPT}], [PROMPT, "Hello"]):
        status, replies = post(gw, "/completion", {"prompt": prompts, "temperature": 0, "n_predict": 6})
        assert status == 200 and isinstance(replies, list) and [r["index"] for r in replies] == [0, 1], (
            replies
        )
        assert replies[0]["content"] == want and all(r["stop_type"] == "limit" for r in replies)
    assert replies[1]["content"] == completion(gw, prompt="Hello", temperature=0, n_predict=6)["content"]
    assert completion(gw, prompt={"prompt_string": PROMPT}, temperature=0, n_predict=6)["content"] == want
    assert completion(gw, prompt=[PROMPT], temperature=0, n_predict=6)["content"] == want  # one: no list
    events = stream(gw, prompt=[PROMPT, ids], temperature=0, n_predict=6)
    lasts = [e for e in events if e["stop"]]
    assert sorted(e["index"] for e in lasts) == [0, 1] and events[-1] in lasts
    for index in (0, 1):
        assert "".join(e["content"] for e in events if e["index"] == index) == want


def test_n_probs_are_the_top_logprobs_of_v1_completions(gw: Gateway) -> None:
    reply = completion(gw, prompt=PROMPT, temperature=0, n_predict=4, n_probs=3, return_tokens=True)
    want = v1_completion(gw, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)["logprobs"]
    probs = reply["completion_probabilities"]
    assert [p["id"] for p in probs] == reply["tokens"]
    for k, entry in enumerate(probs):
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and tops[0]["id"] == entry["id"]  # greedy: the most likely one
        assert entry["logprob"] == pytest.approx(tops[0]["logprob"], abs=1e-5)
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert entry["token"] == want["tokens"][k] and bytes(entry["bytes"]).decode() == entry["token"]
        assert {t["token"]: pytest.approx(t["logprob"], abs=1e-4) for t in tops} == want["top_logprobs"][k]
    events = stream(gw, prompt=PROMPT, temperature=0, n_predict=4, n_probs=3)
    assert [p for e in events for p in e.get("completion_probabilities", [])] == probs


def test_json_schema_and_grammar_constrain_the_output(gw: Gateway) -> None:
    reply = completion(gw, prompt=PROMPT, temperature=0, n_predict=16, json_schema={"enum": ["yes", "no"]})
    assert json.loads(reply["content"]) in ("yes", "no") and reply["stop_type"] == "eos"
    reply = completion(gw, prompt=PROMPT, temperature=0, n_predict=16, grammar='root ::= "yes" | "no"')
    assert reply["content"] in ("yes", "no")
    # llama-server's `grammar` is "" unless set, and its clients send it so: no grammar (it was
    # a 400, "grammar: must be a non-empty string"), on /completion and /v1 alike.
    plain = completion(gw, prompt=PROMPT, temperature=0, n_predict=8)
    assert (
        completion(gw, prompt=PROMPT, temperature=0, n_predict=8, grammar="")["content"] == plain["content"]
    )
    reply = completion(
        gw, prompt=PROMPT, temperature=0, n_predict=16, json_schema={"enum": ["yes"]}, grammar=""
    )
    assert reply["content"] == '"yes"'
    v1 = v1_completion(gw, prompt=PROMPT, temperature=0, max_tokens=8, grammar="")
    assert v1["text"] == plain["content"]


def test_tokenize_detokenize_in_both_apis_shapes(gw: Gateway, hf_tokenizer) -> None:
    text = "Hello world: caf\u00e9 \u2603!"
    want = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert post(gw, "/tokenize", {"content": text}) == (200, {"tokens": want})
    with_special = hf_tokenizer(text, add_special_tokens=True).input_ids
    assert post(gw, "/tokenize", {"content": text, "add_special": True}) == (200, {"tokens": with_special})
    status, reply = post(gw, "/tokenize", {"content": text, "with_pieces": True})
    assert status == 200 and [t["id"] for t in reply["tokens"]] == want
    # Each piece is its text, or its bytes where it holds part of a character; together, the text.
    pieces = [
        t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in reply["tokens"]
    ]
    assert b"".join(pieces) == text.encode()
    assert any(isinstance(t["piece"], list) for t in reply["tokens"])  # the snowman is split in bytes

    assert_llama_error(*post(gw, "/tokenize", {"content": 5}), 400)
    status, vllm = post(gw, "/tokenize", {"prompt": text})  # vLLM's, as before
    assert (
        status == 200
        and vllm["tokens"] == hf_tokenizer(text).input_ids
        and vllm["count"] == len(vllm["tokens"])
    )

    status, reply = post(gw, "/detokenize", {"tokens": want})
    assert status == 200 and reply == {
        "prompt": hf_tokenizer.decode(want),
        "content": hf_tokenizer.decode(want),
    }


def test_apply_template_and_props(gw: Gateway, hf_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    status, reply = post(gw, "/apply-template", {"messages": messages})
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert status == 200 and reply == {"prompt": want}

    status, _, data = gw.request("GET", "/props")
    props = json.loads(data)
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == MAX_MODEL_LEN
    assert props["total_slots"] >= 1 and props["model_path"] == gw.model
    assert props["chat_template"] == hf_tokenizer.chat_template and "brigade" in props["build_info"].lower()


def test_bad_requests_are_llama_cpp_errors_and_the_gateway_serves_on(gw: Gateway) -> None:
    cases = {
        "a wrong type": {"prompt": PROMPT, "n_predict": "ten"},
        "n_predict below -1": {"prompt": PROMPT, "n_predict": -2},
        "no prompt": {"n_predict": 2},
        "an empty prompt": {"prompt": []},
        "token ids beside a list": {"prompt": [1, [2, 3]]},
        "an image": {"prompt": {"prompt_string": "hi <__media__>", "multimodal_data": ["iVBORw0KGgo="]}},
        "a grammar that does not parse": {"prompt": PROMPT, "grammar": "root ::= ((("},
        "n_probs past the limit": {"prompt": PROMPT, "n_probs": 1000},
        "a bad logit bias": {"prompt": PROMPT, "logit_bias": [[1, "much"]]},
        "a token id past the vocabulary": {"prompt": [10**9]},
    }
    for name, body in cases.items():
        for path in ("/completion", "/completions"):
            status, reply = post(gw, path, body)
            assert_llama_error(status, reply, 400), name
    status, reply = post(gw, "/completion", {"prompt": PROMPT, "grammar": "root ::= ((("})
    assert assert_llama_error(status, reply, 400).startswith("grammar: Expected")
    status, reply = post(gw, "/completion", {"prompt": [1] * (MAX_MODEL_LEN + 8)})
    assert_llama_error(status, reply, 400, "exceed_context_size_error")
    status, _, data = gw.request("POST", "/completion", {"prompt": PROMPT, "stream": True, "n_predict": -2})
    assert_llama_error(status, json.loads(data), 400)
    # The API keys hold here as on every generating endpoint.
    for path in ("/completion", "/apply-template"):
        status, reply = post(gw, path, {"prompt": PROMPT, "messages": []}, {"authorization": "Bearer wrong"})
        assert_llama_error(status, reply, 401, "authentication_error")
    status, _, _ = gw.request("GET", "/props", headers={"authorization": "Bearer wrong"})
    assert status == 401
    # Unknown fields are ignored, as llama.cpp ignores them; the gateway still serves.
    reply = completion(gw, prompt=PROMPT, n_predict=2, cache_prompt=False, samplers=["top_k"], mirostat=0)
    assert reply["tokens_predicted"] == 2
    # llama.cpp turns top-k off for any top_k <= 0, not only vLLM's -1: the same tokens as 0.
    sampled = [completion(gw, prompt=PROMPT, n_predict=8, seed=7, top_k=k)["content"] for k in (-5, 0)]
    assert sampled[0] == sampled[1]
