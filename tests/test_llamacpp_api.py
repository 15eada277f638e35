"""llama.cpp's own server API on the gateway (services/gateway/llamacpp.py), end to end: the run of
tests/test_gateway.py (its `gw` fixture: tiny model, two gateway replicas, API keys), driven over
raw HTTP. /completion is checked against /v1/completions (the same engine through the other API)
and the token endpoints against transformers' tokenizer of the model dir."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from pathlib import Path

import pytest

from tests import test_gateway
from tests.harness import assert_clean, brigade_run, free_port
from tests.test_gateway import MAX_MODEL_LEN, Gateway, abort_count, parse_sse, wait_idle

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
    """llama.cpp's error shape: {"error": {"code": status, "message", "type"}}, a prompt of more
    tokens than the context with their counts as well; the message."""
    assert status == want_status, reply
    error = reply["error"]
    shape = {"code", "message", "type"}
    counts = {"n_prompt_tokens", "n_ctx"} if want_type == "exceed_context_size_error" else set()
    assert set(error) - counts == shape and error["code"] == want_status, error
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
    # A token as its text, in either form: every token of the text gets the bias. An object's key
    # is an id only in ASCII digits, as llama.cpp's strtol reads it ("²" is text, once a 500).
    text = hf_tokenizer.decode([first])
    assert hf_tokenizer(text, add_special_tokens=False).input_ids == [first], text  # the test's premise
    for bias in ([[text, False]], {text: False}):
        reply = completion(gw, prompt=PROMPT, temperature=0, n_predict=1, return_tokens=True, logit_bias=bias)
        assert reply["tokens"][0] != first, (bias, reply)
    # A large bias makes the first token one of the key's text's tokens (the tokenizer's own
    # encoding of it), never the id its Unicode digits would read as (12 for "\u0661\u0662").
    assert 12 not in hf_tokenizer("\u0661\u0662", add_special_tokens=False).input_ids  # the premise
    for key in ("\u00b2", "\u0661\u0662", "-\u00b3"):
        text_ids = hf_tokenizer(key, add_special_tokens=False).input_ids
        reply = completion(gw, prompt=PROMPT, temperature=0, n_predict=1, return_tokens=True,
                           logit_bias={key: 100})  # fmt: skip
        assert reply["tokens"][0] in text_ids, (key, text_ids, reply["tokens"])

    # n_predict -1: until eos or the context's end (a bias on eos ends it at once); 0: the prompt alone.
    assert completion(gw, prompt=PROMPT, temperature=0, logit_bias=[[eos, 100]])["stop_type"] == "eos"
    nothing = completion(gw, prompt=PROMPT, n_predict=0)
    assert nothing["content"] == "" and nothing["tokens_predicted"] == 0 and nothing["stop_type"] == "limit"


def test_empty_stop_strings_are_left_out(gw: Gateway) -> None:
    """llama-server skips an empty stop string (some clients send `[""]` for none): it was a 400."""
    settings = {"prompt": PROMPT, "temperature": 0, "n_predict": STOP_WORD_SCAN}
    whole = completion(gw, **settings)["content"]
    reply = completion(gw, **settings, stop=[""])
    assert reply["content"] == whole and reply["stop_type"] == "limit", reply
    assert reply["generation_settings"]["stop"] == []
    word = next(w for w in whole.split()[1:] if len(w) >= 2)
    for reply in (completion(gw, **settings, stop=["", word]), stream(gw, **settings, stop=["", word])[-1]):
        assert reply["stop_type"] == "word" and reply["stopping_word"] == word, reply
        assert reply["generation_settings"]["stop"] == [word]


def test_a_stop_string_not_in_a_list_is_one_stop_string(gw: Gateway) -> None:
    """`stop: "word"` (OpenAI's form, which clients also send here) stops at that word; it was a
    400 (llama-server reads only a list)."""
    settings = {"prompt": PROMPT, "temperature": 0, "n_predict": STOP_WORD_SCAN}
    whole = completion(gw, **settings)["content"]
    word = next(w for w in whole.split()[1:] if len(w) >= 2)
    for reply in (completion(gw, **settings, stop=word), stream(gw, **settings, stop=word)[-1]):
        assert reply["stop_type"] == "word" and reply["stopping_word"] == word, reply
        assert reply["generation_settings"]["stop"] == [word]
    assert completion(gw, **settings, stop=word)["content"] == whole[: whole.index(word)]
    assert completion(gw, **settings, stop="")["content"] == whole


def test_n_predict_past_the_context_generates_to_its_end(gw: Gateway) -> None:
    """llama-server takes any n_predict and stops at the context's end, as for -1: a huge one was a
    400 naming the engine's range."""
    near_full = [284] * (MAX_MODEL_LEN - 8)  # " and"s: a few tokens of room left
    settings = {"prompt": near_full, "seed": 3, "ignore_eos": True}
    unlimited = completion(gw, **settings, n_predict=-1)
    for n_predict in (10**12, MAX_MODEL_LEN + 1):
        reply = completion(gw, **settings, n_predict=n_predict)
        assert reply["content"] == unlimited["content"] and reply["stop_type"] == "limit", reply
        assert reply["truncated"] is True and reply["generation_settings"]["n_predict"] == n_predict
        assert reply["tokens_predicted"] + reply["tokens_evaluated"] == MAX_MODEL_LEN


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


def test_n_cmpl_answers_each_prompts_completions_in_a_list(gw: Gateway) -> None:
    """llama-server's n_cmpl (or OpenAI's n): that many completions of each prompt, a list in
    prompt-major order whose j-th completion of a prompt samples with the seed plus j, as a single
    request with that seed does."""
    sampled = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "n_predict": 6}
    alone = {
        (prompt, seed): completion(gw, prompt=prompt, seed=seed, **sampled)["content"]
        for prompt in (PROMPT, "Hello") for seed in (5, 6, 7)
    }  # fmt: skip
    assert len({alone[PROMPT, seed] for seed in (5, 6, 7)}) > 1, alone  # the seeds sample differently
    for field in ("n_cmpl", "n"):
        status, replies = post(gw, "/completion", {"prompt": PROMPT, field: 3, "seed": 5, **sampled})
        assert status == 200 and [r["index"] for r in replies] == [0, 1, 2], replies
        assert [r["content"] for r in replies] == [alone[PROMPT, seed] for seed in (5, 6, 7)], field
        # Each says the seed it was sampled with, which reproduces it alone (as llama-server's).
        assert [r["generation_settings"]["seed"] for r in replies] == [5, 6, 7], replies
    body = {"prompt": [PROMPT, "Hello"], "n_cmpl": 2, "n": 3, "seed": 5, **sampled}  # n_cmpl wins
    status, replies = post(gw, "/completion", body)
    want = [alone[prompt, seed] for prompt in (PROMPT, "Hello") for seed in (5, 6)]
    assert status == 200 and [r["content"] for r in replies] == want, replies
    events = stream(gw, **body)
    assert ["".join(e["content"] for e in events if e["index"] == i) for i in range(4)] == want
    assert (
        completion(gw, prompt=PROMPT, n_cmpl=1, seed=5, **sampled)["content"] == alone[PROMPT, 5]
    )  # no list
    for field in ("n_cmpl", "n"):
        status, reply = post(gw, "/completion", {"prompt": PROMPT, field: 0})
        assert assert_llama_error(status, reply, 400).startswith(f"{field} must be >= 1"), reply


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

    # parse_special (llama.cpp's, default true): false reads a special token's text as text.
    special = f"{hf_tokenizer.eos_token}x"
    parsed = hf_tokenizer(special, add_special_tokens=False).input_ids
    plain = hf_tokenizer(special, add_special_tokens=False, split_special_tokens=True).input_ids
    assert parsed[0] == hf_tokenizer.eos_token_id and plain != parsed
    assert post(gw, "/tokenize", {"content": special}) == (200, {"tokens": parsed})
    assert post(gw, "/tokenize", {"content": special, "parse_special": False}) == (200, {"tokens": plain})

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


def test_detokenize_keeps_special_tokens(gw: Gateway, hf_tokenizer) -> None:
    """llama-server's /detokenize renders every token, special ones too (as vLLM's does): a text
    with special tokens comes back from /tokenize then /detokenize as it was (they were dropped)."""
    text = "<|im_start|>user\nHi there<|im_end|>"
    status, reply = post(gw, "/tokenize", {"content": text})
    assert status == 200 and hf_tokenizer.eos_token_id in reply["tokens"], reply
    status, reply = post(gw, "/detokenize", {"tokens": reply["tokens"]})
    assert status == 200 and reply == {"prompt": text, "content": text}, reply


def test_apply_template_and_props(gw: Gateway, hf_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    status, reply = post(gw, "/apply-template", {"messages": messages})
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert status == 200 and reply == {"prompt": want}
    # The rest of a chat request's body renders as it would for generation (it was once ignored).
    status, reply = post(gw, "/apply-template", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and reply["prompt"] == hf_tokenizer.apply_chat_template(messages, tokenize=False)
    tool = {"type": "function", "function": {"name": "paint_wall", "description": "Paints a wall.",
                                              "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
    status, reply = post(gw, "/apply-template", {"messages": messages, "tools": [tool]})
    assert status == 200 and "paint_wall" in reply["prompt"] and reply["prompt"] != want, reply
    status, reply = post(
        gw, "/apply-template", {"messages": messages, "tools": [tool], "tool_choice": "none"}
    )
    assert status == 200 and reply == {"prompt": want}

    status, _, data = gw.request("GET", "/props")
    props = json.loads(data)
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == MAX_MODEL_LEN
    assert props["total_slots"] >= 1 and props["model_path"] == gw.model
    assert props["chat_template"] == hf_tokenizer.chat_template and "brigade" in props["build_info"].lower()


def test_bad_requests_are_llama_cpp_errors_and_the_gateway_serves_on(gw: Gateway) -> None:
    """Each refusal is llama.cpp's 400 invalid_request_error whose message starts with the field
    it refuses, by llama.cpp's name (n_probs, not the engine's logprobs), on both paths."""
    cases = {  # name: (the field the message starts with, the body)
        "a wrong type": ("n_predict", {"prompt": PROMPT, "n_predict": "ten"}),
        "n_predict below -1": ("n_predict", {"prompt": PROMPT, "n_predict": -2}),
        "no prompt": ("prompt", {"n_predict": 2}),
        "an empty prompt": ("prompt", {"prompt": []}),
        "token ids beside a list": ("prompt", {"prompt": [1, [2, 3]]}),
        "an image": (
            "prompt",
            {"prompt": {"prompt_string": "hi <__media__>", "multimodal_data": ["iVBORw0KGgo="]}},
        ),
        "a grammar that does not parse": ("grammar", {"prompt": PROMPT, "grammar": "root ::= ((("}),
        "n_probs past the limit": ("n_probs", {"prompt": PROMPT, "n_probs": 1000}),
        "a bad logit bias": ("logit_bias", {"prompt": PROMPT, "logit_bias": [[1, "much"]]}),
        "logit bias texts over the prompt's budget": (
            "logit_bias",
            {
                "prompt": PROMPT,
                "logit_bias": [["hello world ", 0.5]] * (test_gateway.MAX_PROMPT_CHARS // 12 + 1),
            },
        ),
        "a token id past the vocabulary": ("prompt", {"prompt": [10**9]}),
        "a negative n_indent": ("n_indent", {"prompt": PROMPT, "n_indent": -5}),
        "t_max_predict_ms below -1": ("t_max_predict_ms", {"prompt": PROMPT, "t_max_predict_ms": -5}),
    }
    for name, (field, body) in cases.items():
        for path in ("/completion", "/completions"):
            status, reply = post(gw, path, body)
            message = assert_llama_error(status, reply, 400)
            assert re.match(rf"{field}\b", message), (name, path, field, message)
    status, reply = post(gw, "/completion", cases["logit bias texts over the prompt's budget"][1])
    assert "characters of token texts" in assert_llama_error(status, reply, 400)
    status, reply = post(gw, "/completion", {"prompt": PROMPT, "grammar": "root ::= ((("})
    assert assert_llama_error(status, reply, 400).startswith("grammar: Expected")
    status, reply = post(gw, "/completion", {"prompt": [1] * (MAX_MODEL_LEN + 8)})
    assert_llama_error(status, reply, 400, "exceed_context_size_error")
    assert (reply["error"]["n_prompt_tokens"], reply["error"]["n_ctx"]) == (MAX_MODEL_LEN + 8, MAX_MODEL_LEN)
    status, _, data = gw.request("POST", "/completion", {"prompt": PROMPT, "stream": True, "n_predict": -2})
    assert assert_llama_error(status, json.loads(data), 400).startswith("n_predict ")
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


# -- /infill ------------------------------------------------------------------------------------

FIM = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<|file_sep|>"]  # SmolLM2 has <reponame>
FIM_CONTEXT = 4096  # over llama-server's batch of 2048: room for other files beside the gap
FIM_MAX_CHARS = 100_000  # tokenizer.max_prompt_chars: the text an /infill may bring


@pytest.fixture(scope="module")
def fim_gw(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    """A run of a tiny random Llama whose tokenizer is SmolLM2's plus FIM tokens (a code model's)."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("fim-llama")
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in FIM])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    shutil.copy(smollm2_dir / "tokenizer_config.json", model_dir / "tokenizer_config.json")
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=FIM_CONTEXT,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    run_dir, port = tmp_path_factory.mktemp("fim-run"), free_port()
    with brigade_run(
        run_dir,
        f"model.path={model_dir}",
        f"model.max_model_len={FIM_CONTEXT}",
        f"gateway.port={port}",
        f"tokenizer.max_prompt_chars={FIM_MAX_CHARS}",
    ) as run:
        yield Gateway(run, port, str(model_dir))
    assert_clean(run_dir)


def expected_infill(
    tokenizer, prefix: str, suffix: str, prompt: str = "", files=(), n_predict: int = -1
) -> list[int]:
    """The prompt llama-server builds (tools/server/README.md, "POST /infill"), written out from
    its description: the repository-level pattern of other files, then <PRE>prefix prompt
    <SUF>suffix<MID>; the prefix cut to its last 1536 tokens (3/4 of the batch of 2048), the
    suffix to its first 512 - 2 - len(prompt), the files to their last tokens as the context allows."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    token = tokenizer.convert_tokens_to_ids
    extra = [token("<reponame>"), *ids("myproject\n")]
    for filename, text in files:
        extra += [token("<|file_sep|>"), *ids(filename + "\n"), *ids(text)]
    extra += [token("<|file_sep|>"), *ids("filename\n")]
    prompt_ids = ids(prompt)
    gap = [token("<fim_prefix>"), *ids(prefix)[-1536:], *prompt_ids, token("<fim_suffix>"),
           *ids(suffix)[: 512 - 2 - len(prompt_ids)], token("<fim_middle>")]  # fmt: skip
    room = min(FIM_CONTEXT - 2048 - 2 * max(n_predict, 0), FIM_CONTEXT - max(n_predict, 1) - len(gap))
    return [*extra[max(0, len(extra) - room) :], *gap]


def test_infill_fills_the_gap_as_a_completion_of_llama_servers_prompt(fim_gw: Gateway) -> None:
    """An /infill is the /completion of the prompt llama-server builds from the code around the
    gap (built here independently with transformers' tokenizer): the same greedy tokens, the
    same prompt length, streamed and not; a long prefix and suffix are cut, other files given
    in the repository-level pattern and cut to the context's room."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fim_gw.model)
    cases = {
        "short": dict(prefix="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n"),
        "with a prompt and files": dict(
            prefix="import math\n\ndef area(r):\n", suffix="\n", prompt="    return",
            files=[("geometry.py", "PI = 3.14159\n"), ("util.py", "def square(x):\n    return x * x\n")],
        ),
        "cut": dict(
            prefix="x = 1\n" * 700, suffix="y = 2\n" * 300, n_predict=8,
            files=[(f"f{k}.py", "z = 3\n" * 300) for k in range(4)],
        ),
        # Files under the room but over half of it: all of them (a negative cut kept only a tail).
        "files in the room": dict(prefix="a = 1\n", suffix="", files=[("big.py", "z = 3\n" * 375)]),
    }  # fmt: skip
    for name, case in cases.items():
        case.setdefault("n_predict", 8)
        want_prompt = expected_infill(tokenizer, **case)
        body = {
            "input_prefix": case["prefix"], "input_suffix": case["suffix"], "prompt": case.get("prompt", ""),
            "input_extra": [{"filename": f, "text": t} for f, t in case.get("files", [])],
            "n_predict": case["n_predict"], "temperature": 0, "return_tokens": True,
        }  # fmt: skip
        status, reply = post(fim_gw, "/infill", body)
        assert status == 200, (name, reply)
        want = completion(
            fim_gw, prompt=want_prompt, n_predict=body["n_predict"], temperature=0, return_tokens=True
        )
        assert reply["tokens_evaluated"] == len(want_prompt), name
        assert (reply["content"], reply["tokens"]) == (want["content"], want["tokens"]), name
        status, _, data = fim_gw.request("POST", "/infill", {**body, "stream": True})
        events = [json.loads(e["data"]) for e in parse_sse(data.decode()) if "data" in e]
        assert status == 200 and events[-1]["stop"], (name, events[-1:])
        assert "".join(e["content"] for e in events) == want["content"], name
    assert len(expected_infill(tokenizer, **cases["cut"])) < FIM_CONTEXT  # the cut case was cut


def test_infill_in_a_short_context_leaves_room_to_generate(fim_gw: Gateway) -> None:
    """Where llama-server's batch of 2048 would overflow the context (a prefix of 3/4 of it and a
    suffix of 1/4, plus the FIM tokens), the prefix is cut further from its start, then the suffix
    from its end, so that the prompt leaves room for n_predict tokens (at least one, at most half
    the context); the prefix kept is the code nearest the gap."""
    from services.common.text import Tokenizer
    from services.gateway.llamacpp import LlamaInfillRequest, fim_token_ids, infill_prompt

    tokenizer = Tokenizer(fim_gw.model)
    fim = fim_token_ids(tokenizer)
    prefix, suffix = "x = 1\n" * 800, "y = 2\n" * 800
    prefix_ids, suffix_ids = tokenizer.encode(prefix), tokenizer.encode(suffix)
    for context, n_predict, reserve in ((512, 16, 16), (2048, -1, 1), (2050, 4000, 1025), (4096, 8, 8)):
        body = LlamaInfillRequest(input_prefix=prefix, input_suffix=suffix, n_predict=n_predict)
        ids = infill_prompt(tokenizer, fim, body, context)
        assert len(ids) <= context - reserve, (context, len(ids))
        at_prefix, at_suffix, at_middle = (ids.index(fim[role]) for role in ("prefix", "suffix", "middle"))
        assert at_middle == len(ids) - 1 and (at_prefix == 0) == (
            context < 4096
        )  # other files: room only there
        kept_prefix, kept_suffix = ids[at_prefix + 1 : at_suffix], ids[at_suffix + 1 : at_middle]
        assert kept_prefix == prefix_ids[len(prefix_ids) - len(kept_prefix) :] and kept_prefix
        assert kept_suffix == suffix_ids[: len(kept_suffix)]
        if context == 4096:  # no overflow: llama-server's own cut, 1536 and 510 tokens
            assert (len(kept_prefix), len(kept_suffix)) == (1536, 510)


def test_infill_refusals_are_llama_cpp_errors(gw: Gateway, fim_gw: Gateway) -> None:
    """A model without FIM tokens (SmolLM2's tokenizer) cannot fill a gap: 501, naming the missing
    tokens, as llama-server answers. Bad bodies: 400 naming the field; the run serves on."""
    status, reply = post(gw, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    message = assert_llama_error(status, reply, 501, "not_supported_error")
    assert message == (
        "Infill is not supported by this model: prefix token is missing. suffix token is missing. "
        "middle token is missing."
    )
    for body, field in [
        ({"input_suffix": "b"}, "input_prefix"),
        ({"input_prefix": "a"}, "input_suffix"),
        ({"input_prefix": "a", "input_suffix": "b", "prompt": [1, 2]}, "prompt"),
        ({"input_prefix": "a", "input_suffix": "b", "input_extra": {"text": "x"}}, "input_extra"),
        ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "a.py"}]}, "text"),
        (
            {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "x", "filename": 3}]},
            "filename",
        ),
        ({"input_prefix": ["a", 10**9], "input_suffix": "b"}, "prompt"),
        ({"input_prefix": "a", "input_suffix": "b", "n_predict": -2}, "n_predict"),
    ]:
        status, reply = post(fim_gw, "/infill", body)
        assert field in assert_llama_error(status, reply, 400), (body, reply)
    # Text past tokenizer.max_prompt_chars, counted over the prefix, suffix, prompt and files.
    files = [{"filename": "a.py", "text": "y" * (FIM_MAX_CHARS // 2)}]
    status, reply = post(
        fim_gw,
        "/infill",
        {"input_prefix": "x" * (FIM_MAX_CHARS // 2), "input_suffix": "", "input_extra": files},
    )
    message = assert_llama_error(status, reply, 400, "exceed_context_size_error")
    assert message.startswith(f"prompt: {FIM_MAX_CHARS + 4} characters in the code and the files"), message
    status, reply = post(
        fim_gw, "/infill", {"input_prefix": "def f():\n", "input_suffix": "", "n_predict": 2}
    )
    assert status == 200 and reply["tokens_predicted"] == 2, reply


# Code as a grammar makes the tiny model write it: lines indented 0, 4, 2 and 0 spaces.
CODE = "if x:\n    y = 1\n  z = 2\nw = 3\n"
CODE_GRAMMAR = "root ::= " + json.dumps(CODE)


def test_n_indent_ends_the_output_at_a_line_indented_less(gw: Gateway) -> None:
    """llama.vim's n_indent (its cursor line's indentation): the first line after a new line
    whose text starts with fewer spaces ends the output, cut where its text starts (llama-server
    keeps the indentation); streamed and not; without it the whole text comes back. A cut reply's
    engine request is aborted as a disconnected client's is."""
    body = {"prompt": PROMPT, "grammar": CODE_GRAMMAR, "temperature": 0, "n_predict": 64}
    whole = completion(gw, **body)
    assert whole["content"] == CODE
    for n_indent, want in (
        (4, "if x:\n    y = 1\n  "),
        (2, "if x:\n    y = 1\n  z = 2\n"),
        (1, "if x:\n    y = 1\n  z = 2\n"),
    ):
        reply = completion(gw, **body, n_indent=n_indent)
        assert (reply["content"], reply["stop_type"]) == (want, "limit"), (n_indent, reply)
        assert reply["generation_settings"]["n_indent"] == n_indent
        # Cut before the engine's last output: the prompt's counts come from its first.
        assert reply["tokens_evaluated"] == whole["tokens_evaluated"] > 0
        assert reply["timings"]["prompt_n"] == reply["tokens_evaluated"] - reply["tokens_cached"]
        events = stream(gw, **body, n_indent=n_indent)
        assert "".join(e["content"] for e in events) == want and events[-1]["stop_type"] == "limit"
    assert completion(gw, **body, n_indent=0)["content"] == CODE  # 0: no limit
    assert_every_replica_idle(gw)  # a reply cut short here gave its slot back (it once never did)
    # The cut reply's engine request is aborted (one more abort each), not generated to its end: a
    # grammar whose text goes on far past the cut (30 more lines), so the engine cannot finish first.
    tail = {**body, "grammar": "root ::= " + json.dumps("if x:\n    y = 1\n" + "z = 2\n" * 30), "n_indent": 4}
    for send in (completion, stream):
        assert wait_idle(gw.run) == (0, 0.0)
        aborts = abort_count(gw)
        reply = send(gw, **tail)
        text = "".join(e["content"] for e in reply) if isinstance(reply, list) else reply["content"]
        assert text == "if x:\n    y = 1\n", (send.__name__, text)
        assert aborts_after(gw, aborts) == aborts + 1, f"{send.__name__}: the engine request was not aborted"


def aborts_after(gw: Gateway, aborts: float, timeout: float = 30.0) -> float:
    """The engine's aborted requests (request_success_total{finished_reason="abort"}) once there
    are more than `aborts`, or at the deadline."""
    deadline = time.monotonic() + timeout
    while (count := abort_count(gw)) <= aborts and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


def assert_every_replica_idle(gw: Gateway, timeout: float = 10.0) -> None:
    """Every gateway replica's /load comes back to 0: none keeps a finished request's slot (the
    connections spread over the replicas, so twenty in a row reach each of them)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = [json.loads(gw.request("GET", "/load")[2])["server_load"] for _ in range(20)]
        if not any(loads):
            return
        assert time.monotonic() < deadline, f"a replica still counts requests in flight: {loads}"
        time.sleep(0.2)


def test_t_max_predict_ms_ends_the_output_at_a_new_line_past_it(gw: Gateway) -> None:
    """llama.vim's t_max_predict_ms: once generating has taken longer, the next delta with a new
    line ends the output (a prefix of what it would have been, ending with that line); its
    engine request is aborted as a disconnected client's is (one more abort each, streamed and not)."""
    body = {"prompt": PROMPT, "grammar": 'root ::= ("line\\n")+', "temperature": 0, "n_predict": 200}
    whole = completion(gw, **body)["content"]
    for send in (completion, stream):
        assert wait_idle(gw.run) == (0, 0.0)
        aborts = abort_count(gw)
        reply = send(gw, **body, t_max_predict_ms=1)
        last = reply[-1] if isinstance(reply, list) else reply
        text = "".join(e["content"] for e in reply) if isinstance(reply, list) else reply["content"]
        assert text.endswith("\n") and whole.startswith(text) and len(text) < len(whole), text
        assert last["stop_type"] == "limit" and last["tokens_predicted"] < 200, last
        assert aborts_after(gw, aborts) == aborts + 1, f"{send.__name__}: the engine request was not aborted"


def test_response_fields_pick_the_last_replys_fields(gw: Gateway, hf_tokenizer) -> None:
    """llama-server's response_fields: the last reply holds exactly the paths it has, each under
    its path (a nested one unnested); one it has not is left out. `prompt` is the prompt's text
    (token ids decoded, special tokens kept)."""
    fields = [
        "content",
        "generation_settings/n_predict",
        "prompt",
        "timings/predicted_n",
        "nope",
        "timings/nope",
    ]
    reply = completion(gw, prompt=PROMPT, n_predict=4, temperature=0, response_fields=fields)
    assert set(reply) == {"content", "generation_settings/n_predict", "prompt", "timings/predicted_n"}
    assert reply["generation_settings/n_predict"] == 4 and reply["timings/predicted_n"] == 4
    assert reply["prompt"] == PROMPT and reply["content"]
    ids = hf_tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert completion(gw, prompt=[2, *ids], n_predict=1)["prompt"] == hf_tokenizer.decode([2, *ids])
    last = stream(gw, prompt=PROMPT, n_predict=4, response_fields=["stop", "stop_type", "tokens_predicted"])[
        -1
    ]
    assert last == {"stop": True, "stop_type": "limit", "tokens_predicted": 4}  # a stream's last event too


def assert_rates(timings: dict) -> None:
    """llama-server's derived rates agree with the counts and times they come from."""
    for kind in ("prompt", "predicted"):
        n, ms = timings[f"{kind}_n"], timings[f"{kind}_ms"]
        assert ms >= 0 and n >= 0, timings
        assert timings[f"{kind}_per_second"] == pytest.approx(n / ms * 1e3 if ms else 0.0), timings
        assert timings[f"{kind}_per_token_ms"] == pytest.approx(ms / n if n else 0.0), timings


def test_timings_per_token_on_a_chat_stream_through_the_openai_client(gw: Gateway) -> None:
    """llama-server's timings_per_token (what its web UI sends, for a live tokens-per-second
    figure): every chunk of output carries the choice's timings so far, counting the tokens sent
    until then; the usage chunk the request's, agreeing with its usage. The opening chunk has none."""
    api = gw.openai()
    chunks = list(
        api.chat.completions.create(
            model=gw.model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=8,
            temperature=0,
            logprobs=True,  # each chunk's tokens, counted
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"timings_per_token": True, "ignore_eos": True},
        )
    )
    opening, *outputs, usage_chunk = chunks
    assert opening.choices[0].delta.role == "assistant" and "timings" not in (opening.model_extra or {})
    sent, last_ms = 0, -1.0
    for chunk in outputs:
        timings = chunk.model_extra["timings"]
        sent += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        assert timings["predicted_n"] == sent, (timings, chunk)
        assert timings["predicted_ms"] >= last_ms and timings["prompt_ms"] > 0
        last_ms = timings["predicted_ms"]
        assert_rates(timings)
    assert sent == 8
    usage, timings = usage_chunk.usage, usage_chunk.model_extra["timings"]
    assert timings["predicted_n"] == usage.completion_tokens == 8
    assert timings["cache_n"] == usage.prompt_tokens_details.cached_tokens
    assert timings["prompt_n"] + timings["cache_n"] == usage.prompt_tokens
    assert_rates(timings)

    plain = list(
        api.chat.completions.create(
            model=gw.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=3, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert all("timings" not in (chunk.model_extra or {}) for chunk in plain)  # OpenAI's shapes otherwise


def test_timings_per_token_on_a_responses_stream(gw: Gateway) -> None:
    """The Responses API's stream with timings_per_token, as llama-server's: each chunk's last event
    carries its timings so far, and `response.completed` (or `.incomplete`) the request's, agreeing
    with its usage;
    without the field, no timings."""
    api = gw.openai()
    body = {"model": gw.model, "input": PROMPT, "max_output_tokens": 8, "temperature": 0, "stream": True}
    events = list(api.responses.create(**body, extra_body={"timings_per_token": True}))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    completed = events[-1]  # response.incomplete where max_output_tokens cut it
    assert completed.type in ("response.completed", "response.incomplete") and deltas, events
    last_n, last_ms = 0, -1.0
    for event in deltas:  # one chunk each, whose last event it is
        timings = event.model_extra["timings"]
        assert timings["predicted_n"] > last_n and timings["predicted_ms"] >= last_ms, timings
        last_n, last_ms = timings["predicted_n"], timings["predicted_ms"]
        assert timings["prompt_ms"] > 0
        assert_rates(timings)
    usage, timings = completed.response.usage, completed.model_extra["timings"]
    assert timings["predicted_n"] == last_n == usage.output_tokens, (timings, usage)
    assert timings["cache_n"] == usage.input_tokens_details.cached_tokens
    assert timings["prompt_n"] + timings["cache_n"] == usage.input_tokens
    assert_rates(timings)
    assert "".join(e.delta for e in deltas) == completed.response.output_text
    plain = list(api.responses.create(**body))
    assert plain and all("timings" not in (e.model_extra or {}) for e in plain)  # OpenAI's shapes otherwise


def test_timings_of_a_whole_reply_count_every_choice(gw: Gateway) -> None:
    """A reply (not streamed) with timings_per_token carries the request's timings: its prompt
    counted once (with what the cache held before the call: a later choice finds the blocks its
    sibling just computed, which `usage` counts), the tokens of all its choices. A new prompt's
    cache_n is 0; the same prompt again finds its whole blocks cached, cache_n as `usage` says."""
    prompt = "Timings: " + " ".join([PROMPT] * 6)  # new to this run; over two blocks of 16 tokens
    body = {"model": gw.model, "prompt": prompt, "max_tokens": 5, "n": 2, "ignore_eos": True,
            "timings_per_token": True}  # fmt: skip
    for again in (False, True):
        status, reply = post(gw, "/v1/completions", body)
        assert status == 200, reply
        usage, timings = reply["usage"], reply["timings"]
        assert timings["predicted_n"] == usage["completion_tokens"] == 10
        assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if again:
            assert timings["cache_n"] == cached >= 16, (usage, timings)
        else:
            assert timings["cache_n"] == 0 and timings["prompt_n"] == usage["prompt_tokens"], (usage, timings)
        assert_rates(timings)
    status, echoed = post(gw, "/v1/completions", {"model": gw.model, "prompt": PROMPT, "max_tokens": 0,
                                                  "echo": True, "timings_per_token": True})  # fmt: skip
    assert status == 200 and echoed["usage"]["completion_tokens"] == echoed["timings"]["predicted_n"] == 0
    status, plain = post(gw, "/v1/completions", {"model": gw.model, "prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and "timings" not in plain


def test_completion_stream_with_timings_per_token(gw: Gateway) -> None:
    """/completion's events with timings_per_token each carry the output's timings so far (the
    tokens sent until then); without it only the last event has them, as llama-server sends."""
    events = stream(gw, prompt=PROMPT, n_predict=6, temperature=0, ignore_eos=True, timings_per_token=True)
    sent = 0
    for partial in events[:-1]:
        sent += len(partial["tokens"])
        assert partial["timings"]["predicted_n"] == sent, partial
        assert_rates(partial["timings"])
    assert sent == 6 and events[-1]["timings"]["predicted_n"] == 6
    plain = stream(gw, prompt=PROMPT, n_predict=3, temperature=0)
    assert all("timings" not in partial for partial in plain[:-1]) and "timings" in plain[-1]


def test_max_tokens_limits_a_completion_that_gives_no_n_predict(gw: Gateway) -> None:
    """llama-server reads OpenAI's max_tokens where n_predict is not given (clients written for
    /v1 send it); n_predict wins where both are."""
    reply = completion(gw, prompt=PROMPT, temperature=0, ignore_eos=True, max_tokens=3)
    assert reply["tokens_predicted"] == 3 and reply["stop_type"] == "limit"
    assert reply["generation_settings"]["n_predict"] == 3
    both = completion(gw, prompt=PROMPT, temperature=0, ignore_eos=True, max_tokens=3, n_predict=5)
    assert both["tokens_predicted"] == 5
    # OpenAI's newer name too (once ignored: the output ran to the context's end), before max_tokens.
    newer = completion(
        gw, prompt=PROMPT, temperature=0, ignore_eos=True, max_completion_tokens=2, max_tokens=4
    )
    assert newer["tokens_predicted"] == 2 and newer["generation_settings"]["n_predict"] == 2


def test_a_bug_in_a_llama_cpp_route_is_a_500_in_llama_cpps_shape() -> None:
    """A handler that fails (a bug) answers llama.cpp's error shape, as its refusals do, not the
    OpenAI routes' (llama.cpp's clients read `error.code` and `error.type`)."""
    from starlette.requests import Request

    from services.gateway.llamacpp import with_llama_errors

    class Counter:  # the Gateway's one method the wrapper uses (it counts responses)
        def __init__(self) -> None:
            self.statuses: list[int] = []

        def finish(self, request, response):
            self.statuses.append(response.status_code)
            return response

    async def broken(request: Request):
        raise ValueError("a bug")

    gateway = Counter()
    guarded = with_llama_errors(gateway, broken)
    request = Request({"type": "http", "method": "POST", "path": "/completion", "headers": []})
    response = asyncio.run(guarded(request))
    reply = json.loads(response.body)
    assert response.status_code == 500 and gateway.statuses == [500]
    assert reply == {
        "error": {"code": 500, "message": "internal error: ValueError: a bug", "type": "server_error"}
    }
