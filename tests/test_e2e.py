"""End to end through real processes: client -> tokenizer -> scheduler -> worker -> detokenizer ->
client, on the embedded SmolLM2-135M in float32, checked against HF transformers `generate`."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq

from client import Client, InvalidRequest, PromptTooLong
from ipc import messages as m
from ipc.codec import CLIENT_REPLY, CLIENT_REQUEST, SCHEDULER_INPUT
from ipc.sampling_defaults import fill_defaults
from ipc.sockets import PushQueue
from services.stage import read_run_info, run_endpoints
from services.tokenizer.core import engine_id
from tests.harness import assert_clean, brigade_run, hostile_messages, tokenizer_dealer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NEW_TOKENS = 24
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "请用中文介绍一下你自己。",
    "Reply with three emoji that describe a happy birthday party 🎉",
    "List three prime numbers.",
    "Explain gravity to a child in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir: Path, smollm2_hf_dir: Path):
    """HF transformers' tokenizer and model on the same weights (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return tokenizer, AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2) -> dict[str, tuple[list[int], str]]:
    """Greedy completions of every chat prompt by HF transformers on the same weights (float32)."""
    import torch

    tokenizer, model = hf_smollm2
    reference = {}
    for prompt in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
        new_ids = out[0, ids.shape[1] :].tolist()
        reference[prompt] = (new_ids, tokenizer.decode(new_ids, skip_special_tokens=True))
    return reference


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    run_dir = tmp_path_factory.mktemp("e2e")
    with brigade_run(
        run_dir, "model.dtype=float32", "engine.max_num_seqs=32", "model.max_model_len=1024"
    ) as run:
        yield run
    assert_clean(run_dir)


def chat(client: Client, prompt: str, stream: bool) -> tuple[list[int], str]:
    messages = [{"role": "user", "content": prompt}]
    if stream:
        deltas = list(client.stream_chat(messages, max_tokens=NEW_TOKENS, temperature=0.0, timeout=300))
        return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)
    result = client.chat(messages, max_tokens=NEW_TOKENS, temperature=0.0, timeout=300)
    return result.token_ids, result.text


def test_greedy_matches_hf_with_16_in_flight(smol_run, hf_reference) -> None:
    jobs = [(p, stream) for p in CHAT_PROMPTS for stream in (True, False)]  # 16 requests at once

    def one(job: tuple[str, bool]) -> tuple[list[int], str]:
        with Client(smol_run.run_dir) as client:
            return chat(client, *job)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    for (prompt, stream), (ids, text) in zip(jobs, results, strict=True):
        want_ids, want_text = hf_reference[prompt]
        assert ids == want_ids, f"{prompt!r} (stream={stream})"
        assert text == want_text, f"{prompt!r} (stream={stream})"


def test_the_embedded_model_samples_with_its_model_cards_values(smol_run) -> None:
    """SmolLM2 declares no sampling values, so a request (the CLI chat's, say) that sets none
    takes its model card's temperature 0.2 and top_p 0.9, not the engine's 1.0; the supervisor
    says so before ready."""
    said = [line for line in smol_run.log if "a request that sets no sampling values takes" in line]
    assert said and "temperature=0.2, top_p=0.9, top_k=0," in said[0], smol_run.log[-20:]


def test_errors_are_typed_and_clear(smol_run) -> None:
    with Client(smol_run.run_dir) as client:
        with pytest.raises(InvalidRequest, match="temperature"):
            client.generate("hi", temperature=-1.0, max_tokens=4, timeout=60)
        with pytest.raises(PromptTooLong):
            client.generate("hello " * 2000, max_tokens=4, timeout=60)
        with pytest.raises(InvalidRequest):
            client.generate([10**9], max_tokens=4, timeout=60)
        assert client.generate("Hello", max_tokens=4, temperature=0.0, timeout=60).finish_reason == "length"


def scheduler_load(run, from_file: bool = False) -> tuple[int, int, float]:
    """(running, waiting, KV usage) of the schedulers: by `supervisor.py status`, or read
    straight from the supervisor's status.json (cheap enough to poll)."""
    rows = [r for r in (run.read_status() if from_file else run.status()) if r["kind"] == "scheduler"]
    return (
        sum(r["running"] for r in rows),
        sum(r["queue_depth"] for r in rows),
        max(r["kv_usage"] for r in rows),
    )


def wait_idle(run, timeout: float = 60.0) -> tuple[int, int, float]:
    deadline = time.monotonic() + timeout
    load = scheduler_load(run)
    while time.monotonic() < deadline and load != (0, 0, 0.0):
        time.sleep(0.5)
        load = scheduler_load(run)
    return load


def test_cancellation_frees_everything(smol_run) -> None:
    rng = random.Random(0)
    with Client(smol_run.run_dir) as client:
        streams = [
            client.stream(f"Count to {i}:", max_tokens=64, temperature=0.0, timeout=300) for i in range(200)
        ]
        for stream in streams:
            for _ in range(rng.randrange(0, 3)):
                if next(stream, None) is None:
                    break
            stream.close()  # closing a stream aborts its request server-side
    assert wait_idle(smol_run) == (0, 0, 0.0)


def test_a_request_id_reused_after_a_closed_stream_gets_its_own_output(smol_run) -> None:
    """Closing a stream aborts it, and the tokenizer's answer to that Abort (or the stream's own
    last delta, still on its way) comes after the next request under the same id is sent: the
    new request must finish with its own, whole output (it ended early with the old output and
    finish "abort" every time, or failed with unknown_request)."""
    sampling = dict(max_tokens=12, temperature=0.0, ignore_eos=True, timeout=120)
    with Client(smol_run.run_dir) as client:
        reference = client.generate("Name three colours:", **sampling)
        for i in range(12):
            stream = client.stream("Name three colours:", request_id="reused", **sampling)
            for _ in range(1 + i % 3):  # closed after one, two or three deltas
                next(stream)
            stream.close()
            again = client.generate("Name three colours:", request_id="reused", **sampling)
            assert (again.finish_reason, again.token_ids) == ("length", reference.token_ids), i
    assert wait_idle(smol_run) == (0, 0, 0.0)


def test_a_probe_is_answered_with_the_requests_its_connection_does_not_hold(smol_run) -> None:
    """The client's resubmission rule rests on this answer: a connection asking about its own
    request in flight hears nothing of it; about an id it never sent, or about another
    connection's request, it hears "missing"."""
    ctx = zmq.Context()
    try:
        owner = tokenizer_dealer(ctx, smol_run.run_dir)
        stranger = tokenizer_dealer(ctx, smol_run.run_dir)
        params = m.SamplingParams(max_tokens=2000)
        owner.send(
            CLIENT_REQUEST.encode(
                m.Generate("held", prompt="Count to a thousand:", params=params, stream=False)
            )
        )
        owner.send(CLIENT_REQUEST.encode(m.Health(["held", "never-sent"])))
        stranger.send(CLIENT_REQUEST.encode(m.Health(["held"])))
        for sock, want in ((owner, ["never-sent"]), (stranger, ["held"])):
            deadline = time.monotonic() + 30
            while True:
                assert sock.poll(max(0.0, deadline - time.monotonic()) * 1000), (
                    f"no probe answer naming {want}"
                )
                reply = CLIENT_REPLY.decode(sock.recv())
                assert isinstance(reply, m.HealthReply), reply
                # The owner has a request in flight, so the tokenizer's keep-alive (a HealthReply
                # naming nothing missing, every KEEPALIVE_S) may come before the probe's answer.
                if reply.missing or sock is stranger:
                    break
            assert reply.missing == want
        owner.send(CLIENT_REQUEST.encode(m.Abort("held")))
    finally:
        ctx.destroy(linger=0)
    assert wait_idle(smol_run) == (0, 0, 0.0)


ORPHAN_TOKENS = 1000  # with its 4 prompt tokens, within smol_run's 1024
# A scheduler's load reaches status.json within a heartbeat (0.5 s) and the file's refresh (1 s).
STATUS_LAG_S = 2.5


def test_a_running_copy_nobody_waits_for_is_aborted(smol_run) -> None:
    """A tokenizer that died left its requests running; their clients resubmit them on new
    connections (new engine ids), so the old copies compute for nobody. The restarted tokenizer,
    which gets their deltas, aborts them. Here the orphan is pushed straight to the scheduler,
    under an engine id no tokenizer journals: it must stop within a small fraction of the time
    its 1000 tokens take (timed on a real request, in this run), or within the time its load
    takes to reach status.json where that is longer; without the abort it runs on."""
    with Client(smol_run.run_dir) as client:
        started = time.monotonic()
        client.generate("Once upon a time", max_tokens=64, temperature=0.0, ignore_eos=True, timeout=120)
        per_token_s = (time.monotonic() - started) / 64
    info = read_run_info(smol_run.run_dir)
    ctx = zmq.Context()
    try:
        scheduler = PushQueue(ctx, run_endpoints(smol_run.run_dir, info).scheduler_in(0), SCHEDULER_INPUT)
        orphan = m.SubmitRequest(
            request_id=engine_id(0, b"a connection that died", "orphan"),
            tokenizer_id=0,
            prompt_ids=m.pack_ids([1, 2, 3, 4]),
            params=fill_defaults(
                m.SamplingParams(max_tokens=ORPHAN_TOKENS, temperature=0.0, ignore_eos=True)
            ),
        )
        assert scheduler.put(orphan)
        started = time.monotonic()
        full_s = ORPHAN_TOKENS * per_token_s
        seen_running_s = 0.0  # when the scheduler last reported a running request
        while time.monotonic() < started + full_s:
            if scheduler_load(smol_run, from_file=True)[0]:
                seen_running_s = time.monotonic() - started
            time.sleep(0.05)
    finally:
        ctx.destroy(linger=0)
    assert seen_running_s < max(0.15 * full_s, STATUS_LAG_S), (seen_running_s, full_s)
    assert wait_idle(smol_run) == (0, 0, 0.0)


def test_tokenizer_survives_10000_hostile_messages(smol_run) -> None:
    ctx = zmq.Context()
    sock = tokenizer_dealer(ctx, smol_run.run_dir)
    sock.sndtimeo = 10_000  # the tokenizer reads as fast as it can; wait for it rather than drop
    hostile = hostile_messages(random.Random(1))
    try:
        for i in range(10_000):
            sock.send(hostile[i % len(hostile)]())
        num_replies = 0
        while sock.poll(2000):
            reply = CLIENT_REPLY.decode(sock.recv())
            if isinstance(reply, m.HealthReply):
                continue  # the tokenizer's keepalive to a client with requests in flight
            assert isinstance(reply, m.ErrorReply | m.Delta)
            num_replies += 1
        assert num_replies > 1000  # every answerable message got an error reply
    finally:
        ctx.destroy(linger=0)
    with Client(smol_run.run_dir) as client:
        assert client.generate("Hello", max_tokens=4, temperature=0.0, timeout=60).finish_reason == "length"
    assert all(r["restarts"] == 0 for r in smol_run.status() if r["kind"] == "tokenizer")


# -- scoring prompts over HTTP: lm-evaluation-harness' multiple choice ------------------------------

# A small multiple-choice task: (context, choices, index of the right one), each context after a
# few-shot preamble (the task's description) longer than a KV block, as lm-eval's few-shot prompts
# are: every request shares it, so the prefix cache holds it for all but the first.
FEW_SHOT = "Answer each question.\n\nQuestion: What is two plus two?\nAnswer: four\n\nQuestion: What do bees make?\nAnswer: honey\n\n"
MULTIPLE_CHOICE = [
    ("Question: What is the capital of France?\nAnswer:", [" Paris", " London", " Berlin", " a fish"], 0),
    ("Question: How many legs does a spider have?\nAnswer:", [" six", " eight", " two", " none"], 1),
    ("The opposite of hot is", [" warm", " blue", " cold", " loud"], 2),
    ("Question: Which animal says moo?\nAnswer:", [" a cat", " a dog", " a duck", " a cow"], 3),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " Fahrenheit", " north"], 0),
    ("Question: What color is the sky on a clear day?\nAnswer:", [" green", " blue", " red", " black"], 1),
]
LM_EVAL_TASK = "brigade_multiple_choice"


def gateway_url(run) -> str:
    ready = next(line for line in run.log if line.startswith("Brigade ready:"))
    match = re.search(r"http://[\d.]+:\d+/v1", ready)
    assert match, ready
    return match.group(0)


def run_lm_eval(url: str, model: str, work: Path) -> tuple[dict, list[dict]]:
    """lm-evaluation-harness' own CLI, `local-completions` against the gateway, on a task defined
    here (a local JSON data set, no network): its results and its logged samples."""
    data = work / "data.jsonl"
    data.write_text("".join(
        json.dumps({"question": context, "choices": choices, "gold": gold}) + "\n"
        for context, choices, gold in MULTIPLE_CHOICE
    ))  # fmt: skip
    task = {
        "task": LM_EVAL_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "description": FEW_SHOT,
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{gold}}",
        "target_delimiter": "",  # the choices carry their leading space
        "metric_list": [{"metric": "acc"}],
    }
    (work / "tasks").mkdir()
    (work / "tasks" / f"{LM_EVAL_TASK}.yaml").write_text(json.dumps(task))  # JSON is YAML
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf")}
    argv = [
        sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
        "--model_args", f"base_url={url}/completions", f"model={model}", "max_retries=1",
        "--tasks", LM_EVAL_TASK, "--include_path", str(work / "tasks"),
        "--output_path", str(work / "out"), "--log_samples",
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (results_file,) = (work / "out").rglob("results_*.json")
    (samples_file,) = (work / "out").rglob(f"samples_{LM_EVAL_TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    return json.loads(results_file.read_text())["results"][LM_EVAL_TASK], samples


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([context + continuation])).logits[0, len(context) - 1 : -1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(continuation)
    chosen = log_probs[torch.arange(len(continuation)), target]
    return float(chosen.sum()), bool((log_probs.argmax(dim=-1) == target).all())


def test_lm_eval_multiple_choice_scores_as_hf_does(smol_run, hf_smollm2, tmp_path: Path) -> None:
    """The real lm-evaluation-harness (its remote tokenizer through /tokenizer_info and /tokenize,
    echoed prompt logprobs through /v1/completions): every choice's loglikelihood equals HF
    float32's, and the accuracy is the one HF's loglikelihoods give. Every request shares the
    few-shot preamble, and each context with its other choices: without the rule that prompt
    logprobs skip the prefix cache, all but the first would lack the logprobs of cached positions."""
    tokenizer, model = hf_smollm2
    url = gateway_url(smol_run)
    model_name = json.loads(urllib.request.urlopen(f"{url}/models", timeout=60).read())["data"][0]["id"]
    results, samples = run_lm_eval(url, model_name, tmp_path)
    assert len(samples) == len(MULTIPLE_CHOICE)
    hits = 0
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        context, choices, gold = MULTIPLE_CHOICE[sample["doc_id"]]
        want = []
        for choice in choices:
            # lm-eval's _encode_pair: the whole string's tokens, split where the context's end.
            whole = tokenizer(FEW_SHOT + context + choice, add_special_tokens=False).input_ids
            num_context = len(tokenizer(FEW_SHOT + context, add_special_tokens=False).input_ids)
            want.append(hf_loglikelihood(model, whole[:num_context], whole[num_context:]))
        # The log writes each request's arguments and each reply's (loglikelihood, is_greedy) as text.
        arguments = [sample["arguments"][f"gen_args_{i}"] for i in range(len(choices))]
        assert [(a["arg_0"], a["arg_1"]) for a in arguments] == [(FEW_SHOT + context, c) for c in choices]
        served = [(float(ll), is_greedy == "True") for ((ll, is_greedy),) in sample["resps"]]
        for (ll, is_greedy), (want_ll, want_greedy) in zip(served, want, strict=True):
            assert abs(ll - want_ll) < 1e-3 and is_greedy == want_greedy, (sample["doc_id"], served, want)
        scores = [ll for ll, _ in want]
        hits += scores.index(max(scores)) == gold
    assert results["acc,none"] == hits / len(MULTIPLE_CHOICE)


def test_prompt_logprobs_over_http_echo_alone_and_vllm_fields(smol_run, hf_smollm2) -> None:
    import openai
    import torch

    tokenizer, model = hf_smollm2
    api = openai.OpenAI(base_url=gateway_url(smol_run), api_key="none", timeout=300)
    name = api.models.list().data[0].id
    prompt = "The bucket brigade passed water along the line"
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()

    # echo with max_tokens 0: the prompt alone, scored, OpenAI's shape (the first token's None).
    alone = api.completions.create(
        model=name, prompt=prompt, echo=True, max_tokens=0, logprobs=2, temperature=0
    )
    choice = alone.choices[0]
    assert choice.text == prompt and alone.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [tokenizer.decode([i]) for i in ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.text_offset[0] == 0
    assert all(abs(a - b) < 1e-3 for a, b in zip(choice.logprobs.token_logprobs[1:], want, strict=True))
    # The two most likely, and the prompt's own token where it is not one of them (vLLM's).
    for token, logprob, top in zip(
        choice.logprobs.tokens[1:],
        choice.logprobs.token_logprobs[1:],
        choice.logprobs.top_logprobs[1:],
        strict=True,
    ):
        assert top[token] == pytest.approx(logprob) and len(top) == (
            2 if sorted(top.values())[-2] <= logprob else 3
        )

    # vLLM's prompt_logprobs, on a completion's choice and on a chat response.
    reply = api.completions.create(
        model=name, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for j, entry in enumerate(entries[1:]):
        token = entry[str(ids[j + 1])]
        assert abs(token["logprob"] - want[j]) < 1e-3 and token["rank"] >= 1
        assert token["decoded_token"] == tokenizer.decode([ids[j + 1]])
        best = str(int(expected[j].argmax()))
        assert entry[best]["rank"] == 1
    chat = api.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    chat_ids = tokenizer(text, add_special_tokens=False).input_ids
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert len(chat_entries) == len(chat_ids) and chat_entries[0] is None
    assert all(list(entry) == [str(i)] for entry, i in zip(chat_entries[1:], chat_ids[1:], strict=True))
