"""LoRA adapters served end to end: real processes (supervisor, tokenizer, scheduler, worker,
detokenizer, gateway) and the real `openai` client, a random Llama base with SmolLM2's tokenizer
and two random PEFT adapters in lora.adapters. A request picks its adapter by model name; greedy
tokens must be PeftModel's, with requests of both adapters and of the base model in flight
together, and the same prompt under each must not share KV blocks through the prefix cache."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client import Client, ModelNotFound
from tests.conftest import REPO_ROOT, TINY_VOCAB_SIZE, save_random_model
from tests.harness import assert_clean, brigade_run, free_port, spec_decode_counters, stage_processes
from tests.test_e2e import gateway_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

peft = pytest.importorskip("peft")

NEW_TOKENS = 8
ADAPTERS = {
    "sql-lora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    "chat-lora": dict(
        r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"], use_rslora=True
    ),
}


@pytest.fixture(scope="module")
def lora_serving(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """(base model dir, {adapter name: adapter dir})."""
    from transformers import LlamaConfig

    from tests.test_lora import save_random_adapter

    root = tmp_path_factory.mktemp("lora-serving")
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    base = save_random_model(config, root / "base", seed=11, std=0.1, tokenizer_from=smollm2_dir)
    adapters = {
        name: save_random_adapter(base, root / name, seed, **args)
        for seed, (name, args) in enumerate(ADAPTERS.items())
    }
    return base, adapters


def greedy(model, prompt: list[int], num_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy continuation by full forwards (no HF KV cache)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# With n-gram speculation too: a row under an adapter verifies proposals with its adapter's deltas
# at every position of the span, so its tokens stay PeftModel's.
@pytest.mark.parametrize("speculation", ["off", "ngram"])
def test_adapters_selected_by_model_name_match_peft(lora_serving, tmp_path: Path, speculation: str) -> None:
    import openai
    from transformers import AutoModelForCausalLM

    base, adapters = lora_serving

    def hf_base():
        return AutoModelForCausalLM.from_pretrained(
            base, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    references = {"base": hf_base()}
    for name, path in adapters.items():
        references[name] = peft.PeftModel.from_pretrained(hf_base(), path).eval()
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, TINY_VOCAB_SIZE, 40).tolist()  # over two KV blocks: cacheable
    other = rng.integers(3, TINY_VOCAB_SIZE, 23).tolist()
    expected = {name: greedy(model, prompt) for name, model in references.items()}
    expected_other = {name: greedy(model, other) for name, model in references.items()}
    assert len({tuple(tokens) for tokens in expected.values()}) == 3, "the adapters must change the output"

    listed = "{" + ", ".join(f"{name}: {path}" for name, path in adapters.items()) + "}"
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={base}",
        "model.dtype=float32",
        "model.max_model_len=256",
        "lora.max_loras=2",
        "gateway.served_model_name=base",
    )
    metrics_port = free_port()
    if speculation == "ngram":
        overrides += ("speculative.method=ngram", "speculative.num_speculative_tokens=4")
    overrides += (f"supervisor.metrics_port={metrics_port}",)
    with brigade_run(run_dir, *overrides, f"lora.adapters={listed}") as run:
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=300)
        models = {card.id: card.model_extra.get("parent") for card in api.models.list().data}
        assert models == {"base": None, "sql-lora": "base", "chat-lora": "base"}

        def complete(model: str, tokens: list[int]) -> list[int]:
            reply = api.completions.create(
                model=model, prompt=tokens, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=1,
            )  # fmt: skip
            assert reply.model == model
            return [int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens]

        # The same prompt under each model in turn: a shared prefix-cache block would give the
        # second and third the first one's keys and values.
        for name in ("base", "sql-lora", "chat-lora"):
            assert complete(name, prompt) == expected[name], name
        # All three at once, on another prompt, batched into the same steps.
        with ThreadPoolExecutor(3) as pool:
            got = dict(
                zip(expected_other, pool.map(lambda n: complete(n, other), expected_other), strict=True)
            )
        assert got == expected_other

        # A chat under an adapter: its template's tokens, then PeftModel's greedy ones.
        messages = [{"role": "user", "content": "Write a SQL query."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        chat_ids = tokenizer(text, add_special_tokens=False).input_ids
        reply = api.chat.completions.create(
            model="sql-lora", messages=messages, max_tokens=NEW_TOKENS, temperature=0, logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )  # fmt: skip
        assert reply.model == "sql-lora"
        got_chat = [int(entry.token.removeprefix("token_id:")) for entry in reply.choices[0].logprobs.content]
        assert got_chat == greedy(references["sql-lora"], chat_ids)

        with pytest.raises(
            openai.NotFoundError, match="'no-such-lora' does not exist; this server serves 'base'"
        ):
            complete("no-such-lora", prompt)

        # The Responses API under an adapter, then a chain that names no model: it goes on with
        # the previous response's adapter (PeftModel's text; the base model's would differ).
        def peft_text(model: str, conversation: list[dict[str, str]]) -> str:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            tokens = greedy(references[model], tokenizer(text, add_special_tokens=False).input_ids)
            ends = [i for i, token in enumerate(tokens) if token == tokenizer.eos_token_id]
            return tokenizer.decode(tokens[: ends[0] if ends else None], skip_special_tokens=True)

        first = api.responses.create(
            model="sql-lora", input=messages[0]["content"], max_output_tokens=NEW_TOKENS, temperature=0
        )
        assert first.model == "sql-lora"
        assert first.output_text == peft_text("sql-lora", messages)
        second = api.responses.create(
            previous_response_id=first.id,
            input="And another one.",
            max_output_tokens=NEW_TOKENS,
            temperature=0,
        )
        chain = [*messages, {"role": "assistant", "content": first.output_text},
                 {"role": "user", "content": "And another one."}]  # fmt: skip
        assert second.model == "sql-lora"
        assert second.output_text == peft_text("sql-lora", chain) != peft_text("base", chain)
        with pytest.raises(openai.NotFoundError, match="'no-such-lora' does not exist"):
            api.responses.create(model="no-such-lora", input="hi", max_output_tokens=4)

        # Anthropic's Messages API under the other adapter, over plain HTTP.
        def anthropic(body: dict) -> tuple[int, dict]:
            connection = http.client.HTTPConnection(*gateway_url(run).split("//")[1].split("/")[0].split(":"))
            connection.request("POST", "/v1/messages", json.dumps(body), {"content-type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read())

        status, reply_body = anthropic(
            {"model": "chat-lora", "max_tokens": NEW_TOKENS, "temperature": 0, "messages": messages}
        )
        assert status == 200, reply_body
        assert reply_body["model"] == "chat-lora"
        assert (
            reply_body["content"][0]["text"]
            == peft_text("chat-lora", messages)
            != peft_text("base", messages)
        )
        status, reply_body = anthropic({"model": "no-such-lora", "max_tokens": 4, "messages": messages})
        assert status == 404 and reply_body["type"] == "error", reply_body
        assert "'no-such-lora' does not exist" in reply_body["error"]["message"]
        # An endpoint that does not generate takes no adapter.
        with pytest.raises(openai.BadRequestError, match="'sql-lora' does not serve this endpoint"):
            api.embeddings.create(model="sql-lora", input="hi")

        # The SDK names the adapter directly; an unknown one is refused by the scheduler.
        with Client(run_dir) as client:
            result = client.generate(
                prompt,
                adapter="chat-lora",
                max_tokens=NEW_TOKENS,
                temperature=0.0,
                ignore_eos=True,
                timeout=300,
            )
            assert result.token_ids == expected["chat-lora"]
            with pytest.raises(ModelNotFound, match="unknown LoRA adapter 'no-such-lora'"):
                client.generate(prompt, adapter="no-such-lora", max_tokens=2, timeout=60)
        accepted = spec_decode_counters(metrics_port).get("brigade:spec_decode_num_accepted_tokens_total", 0)
        assert (accepted > 0) == (speculation == "ngram"), accepted
    assert_clean(run_dir)


def test_an_adapter_that_does_not_fit_fails_the_start(lora_serving, tmp_path: Path) -> None:
    """A bad adapter in lora.adapters: the worker refuses it before serving, the supervisor
    reports why and stops every stage, and no run is ever ready."""
    base, adapters = lora_serving
    bad = tmp_path / "bad"
    shutil.copytree(adapters["sql-lora"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir),
         "--set", f"model.path={base}", "--set", "model.dtype=float32", "--set", "lora.max_loras=1",
         "--set", f"lora.adapters={{bad: {bad}}}", "--set", f"gateway.port={free_port()}",
         "--set", "supervisor.metrics_port=0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert "adapter 'bad': modules_to_save (['lm_head']) is not supported" in done.stderr
    assert "ready" not in done.stdout
    assert not stage_processes(run_dir)


def peft_references(base: Path, adapters: dict[str, Path]) -> dict[str, object]:
    """HF's base model and PeftModel under each adapter, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    def hf_base():
        return AutoModelForCausalLM.from_pretrained(
            base, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    return {"base": hf_base()} | {
        name: peft.PeftModel.from_pretrained(hf_base(), path).eval() for name, path in adapters.items()
    }


def test_adapters_loaded_and_unloaded_at_run_time(lora_serving, tmp_path: Path) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter through the openai client, behind an
    API key: a loaded adapter is listed and gives PeftModel's tokens; loading one during a stream
    leaves the stream's tokens as they were; an unload refuses (wait false) or waits for (wait
    true) the requests that use its adapter, which keep it to their end; bad adapters and unknown
    names are clear errors and the run serves on; an adapter reloaded from a GGUF file serves
    PeftModel's tokens; a worker restart and a scheduler restart keep the adapters loaded at run
    time (that one too)."""
    import openai

    from services.gpu_worker.lora_gguf import write_gguf_adapter
    from tests.test_lora_gguf import write_raw_gguf

    base, adapters = lora_serving
    base_config = json.loads((base / "config.json").read_text())
    references = peft_references(base, adapters)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, TINY_VOCAB_SIZE, 24).tolist()
    expected = {name: greedy(model, prompt) for name, model in references.items()}
    bad = tmp_path / "bad"
    shutil.copytree(adapters["sql-lora"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    overrides = (
        f"model.path={base}", "model.dtype=float32", "model.max_model_len=2048", "lora.max_loras=2",
        "lora.unload_wait_s=120", "gateway.served_model_name=base", "gateway.api_keys=[secret]",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, *overrides) as run:
        api = openai.OpenAI(base_url=gateway_url(run), api_key="secret", timeout=300)

        def load(name: str, path: Path | str, **body) -> str:
            return api.post(
                "/load_lora_adapter", body={"lora_name": name, "lora_path": str(path), **body}, cast_to=str
            )

        def unload(name: str, **body) -> str:
            return api.post("/unload_lora_adapter", body={"lora_name": name, **body}, cast_to=str)

        def complete(model: str, max_tokens: int = NEW_TOKENS) -> list[int]:
            reply = api.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=1,
            )  # fmt: skip
            return [int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens]

        def served() -> dict[str, str | None]:
            return {card.id: card.model_extra.get("parent") for card in api.models.list().data}

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gateway_url(run), api_key="wrong").post(
                "/load_lora_adapter", body={"lora_name": "sql-lora", "lora_path": str(adapters["sql-lora"])},
                cast_to=str,
            )  # fmt: skip
        assert served() == {"base": None}
        assert (
            load("sql-lora", adapters["sql-lora"]) == "Success: LoRA adapter 'sql-lora' added successfully."
        )
        assert served() == {"base": None, "sql-lora": "base"}
        assert complete("sql-lora") == expected["sql-lora"]

        # Bad adapters and names: clear errors, and the run serves on.
        # `param` names the field each refusal is about: the adapter's files are its path's.
        refusals = [
            ("bad", bad, r"adapter 'bad': modules_to_save \(\['lm_head'\]\) is not supported", "lora_path"),
            (
                "gone",
                tmp_path / "no-such-dir",
                r"adapter 'gone': cannot read .*adapter_config\.json",
                "lora_path",
            ),
            (
                "relative",
                "adapters/sql",
                r"lora_path must be an absolute adapter directory or \.gguf file",
                "lora_path",
            ),
            (
                "sql-lora",
                adapters["sql-lora"],
                "lora_name 'sql-lora': that LoRA adapter is already loaded",
                "lora_name",
            ),
            # gateway.served_model_name, not the model's path: the name clients send for the base
            ("base", adapters["sql-lora"], "lora_name 'base' is the base model's name", "lora_name"),
        ]
        for name, path, message, param in refusals:
            with pytest.raises(openai.BadRequestError, match=message) as refused:
                load(name, path)
            assert refused.value.body["param"] == param, refused.value.body
        with pytest.raises(openai.NotFoundError, match="'no-such-lora' is not loaded"):
            unload("no-such-lora")
        with pytest.raises(openai.NotFoundError, match="'bad' does not exist"):
            complete("bad")
        assert complete("base") == expected["base"]

        # A stream under sql-lora, alone, then again with chat-lora loaded while it runs: the same
        # tokens. An unload with wait false while it runs is refused (it proves the stream was
        # still running after the load) and changes nothing.
        # Long enough to outlast an adapter load on a quiet host, where this tiny model is fast.
        long_tokens = 1000

        def stream(model: str, during=None) -> list[int]:
            chunks = api.completions.create(
                model=model, prompt=prompt, max_tokens=long_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=1,
            )  # fmt: skip
            tokens = []
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].logprobs:
                    tokens += [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens]
                if during is not None and tokens:
                    during()  # once, after the first tokens
                    during = None
            return tokens

        alone = stream("sql-lora")
        assert len(alone) == long_tokens and alone[:NEW_TOKENS] == expected["sql-lora"]

        def try_load_inplace() -> None:
            with pytest.raises(openai.ConflictError, match=r"load_inplace replaces it once none does"):
                load("sql-lora", adapters["chat-lora"], load_inplace=True)

        assert stream("sql-lora", during=try_load_inplace) == alone  # and its weights are kept

        def load_and_try_unload() -> None:
            load("chat-lora", adapters["chat-lora"])
            with pytest.raises(openai.ConflictError, match=r"'sql-lora' is used by 1 requests"):
                unload("sql-lora", wait=False)

        assert stream("sql-lora", during=load_and_try_unload) == alone
        assert served() == {"base": None, "sql-lora": "base", "chat-lora": "base"}
        assert complete("chat-lora") == expected["chat-lora"]
        with pytest.raises(
            openai.BadRequestError,
            match=r"2 LoRA adapters are loaded, as many as lora.max_cpu_loras \(or lora.max_loras\) allows",
        ):
            load("third", adapters["chat-lora"])

        # An unload that waits: the stream under chat-lora keeps its adapter to its end.
        chat_alone = stream("chat-lora")
        unloaded: list[str] = []
        waiter = threading.Thread(target=lambda: unloaded.append(unload("chat-lora")))
        assert stream("chat-lora", during=waiter.start) == chat_alone
        waiter.join(timeout=120)
        assert unloaded == ["Success: LoRA adapter 'chat-lora' removed successfully."]
        assert served() == {"base": None, "sql-lora": "base"}
        with pytest.raises(openai.NotFoundError, match="'chat-lora' does not exist"):
            complete("chat-lora")

        # vLLM's load_inplace, as an RL trainer pushes new weights under one name: sql-lora gets
        # chat-lora's weights, then its own back.
        load("sql-lora", adapters["chat-lora"], load_inplace=True)
        assert complete("sql-lora") == expected["chat-lora"]
        load("sql-lora", adapters["sql-lora"], load_inplace=True)
        assert complete("sql-lora") == expected["sql-lora"]

        # A GGUF file that is no LoRA is refused, naming why; then chat-lora is loaded again, under
        # the same name, from a GGUF file of it (llama.cpp's format).
        not_lora = write_raw_gguf(tmp_path / "model.gguf", {}, general_type="model")
        with pytest.raises(
            openai.BadRequestError,
            match=r"adapter 'model': model\.gguf is not an adapter: its general\.type is 'model'",
        ):
            load("model", not_lora)
        chat_gguf = write_gguf_adapter(adapters["chat-lora"], base_config, tmp_path / "chat-lora.gguf")
        load("chat-lora", chat_gguf)
        assert complete("chat-lora") == expected["chat-lora"]

        # A worker restart: the restarted worker loads the adapters of the scheduler's table.
        worker = run.stage_pids("gpu_worker")[0]
        os.kill(worker, signal.SIGKILL)
        run.wait_for_restart([worker])
        assert complete("sql-lora") == expected["sql-lora"]
        assert complete("chat-lora") == expected["chat-lora"]
        # The old worker died idle: the prompt's cached block went with it (no stale prefix hit).
        assert complete("base") == expected["base"]

        # A scheduler restart: the new scheduler reads the table its predecessor saved.
        scheduler = run.stage_pids("scheduler")[0]
        os.kill(scheduler, signal.SIGKILL)
        run.wait_for_restart([scheduler])
        assert served() == {"base": None, "sql-lora": "base", "chat-lora": "base"}
        assert complete("chat-lora") == expected["chat-lora"]
        assert complete("base") == expected["base"]

        # A scheduler that does not answer (stopped): the model list is what the gateway knew,
        # within the listing's few seconds rather than lora.unload_wait_s (minutes).
        scheduler = run.stage_pids("scheduler")[0]
        os.kill(scheduler, signal.SIGSTOP)
        try:
            probe = openai.OpenAI(base_url=gateway_url(run), api_key="secret", timeout=30, max_retries=0)
            assert {card.id for card in probe.models.list().data} == {"base", "sql-lora", "chat-lora"}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(scheduler, signal.SIGCONT)
    assert_clean(run_dir)


def greedy_token_ids(api: Any, job: tuple[str, list[int]]) -> list[int]:
    """The greedy token ids a completion of (model, prompt ids) gives, NEW_TOKENS of them."""
    model, prompt = job
    reply = api.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=1,
    )  # fmt: skip
    return [int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens]


def test_adapters_beyond_the_slots_take_turns_in_one_slot(lora_serving, tmp_path: Path) -> None:
    """lora.max_loras 1 and three adapters waiting in host memory (lora.max_cpu_loras 3), asked for
    all at once, interleaved with the base model: each request's greedy tokens are its adapter's
    PeftModel's. The scheduler never runs two adapters in one step and swaps the slots between
    them (one slot for running requests, and the spare: every adapter change is a swap)."""
    import openai

    from tests.test_lora import save_random_adapter

    base, adapters = lora_serving
    third = save_random_adapter(
        base, tmp_path / "third", 7, r=16, lora_alpha=16, target_modules=["v_proj", "up_proj"]
    )
    adapters = {**adapters, "third-lora": third}
    references = peft_references(base, adapters)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, 20 + i).tolist() for i in range(8)]
    models = ["sql-lora", "chat-lora", "third-lora", "base"] * 2
    expected = [greedy(references[model], prompt) for model, prompt in zip(models, prompts, strict=True)]
    listed = "{" + ", ".join(f"{name}: {path}" for name, path in adapters.items()) + "}"
    overrides = (
        f"model.path={base}", "model.dtype=float32", "model.max_model_len=256", "lora.max_loras=1",
        "lora.max_cpu_loras=3", f"lora.adapters={listed}", "gateway.served_model_name=base",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, *overrides) as run:
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=300)

        complete = partial(greedy_token_ids, api)

        with ThreadPoolExecutor(len(models)) as pool:
            got = list(pool.map(complete, zip(models, prompts, strict=True)))
        for model, tokens, want in zip(models, got, expected, strict=True):
            assert tokens == want, model

        # The swaps are counted (each of the three adapters went into the slot at least once), and
        # the scheduler's status row and lora_requests_info name the adapters.
        deadline = time.monotonic() + 30
        while counter(run, "lora_adapter_swaps") < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert counter(run, "lora_adapter_swaps") >= 3
        row = next(row for row in run.status() if row["kind"] == "scheduler")
        assert row["lora_adapters"] == ["chat-lora", "sql-lora", "third-lora"]

        # Every request has finished: the next heartbeat says so (the one before may still name one).
        idle = 'running_lora_adapters="",waiting_lora_adapters=""} 1.0'
        deadline = time.monotonic() + 30
        while not (len(info := lora_info(run)) == 1 and idle in info[0]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(info) == 1 and idle in info[0], info
    assert_clean(run_dir)


def scrape(run) -> str:
    connection = http.client.HTTPConnection(*gateway_url(run).split("//")[1].split("/")[0].split(":"))
    connection.request("GET", "/metrics")
    return connection.getresponse().read().decode()


def counter(run, name: str) -> float:
    """The scheduler's counter brigade:<name>_total (0 before it counts anything)."""
    found = re.search(rf"^brigade:{name}_total\{{[^}}]*\}} (\S+)$", scrape(run), re.M)
    return float(found[1]) if found else 0.0


def lora_info(run) -> list[str]:
    return [line for line in scrape(run).splitlines() if line.startswith("brigade:lora_requests_info{")]


@pytest.mark.parametrize("max_loras", [2, 1])
def test_adapters_of_waiting_requests_are_copied_in_ahead(
    lora_serving, tmp_path: Path, max_loras: int
) -> None:
    """lora.max_loras 2 or 1, three adapters in host memory (so the workers keep a spare slot
    beside those), one request running at a time (engine.max_num_seqs 1). A long base-model
    stream runs while six adapter requests queue behind it: the scheduler copies their adapters
    into the free slots ahead of the steps that admit them (the step header's lora_prefetch), one
    a step, never over the adapter of a request ahead, so every swap is a prefetch, and no copy is
    made on an admitting step's path. With one slot for running requests that takes the spare:
    the next adapter is copied in while the slot before it is still in use. Each request's tokens
    are its adapter's PeftModel's."""
    import openai

    from tests.test_lora import save_random_adapter

    base, adapters = lora_serving
    third = save_random_adapter(
        base, tmp_path / "third", 7, r=16, lora_alpha=16, target_modules=["v_proj", "up_proj"]
    )
    adapters = {**adapters, "third-lora": third}
    references = peft_references(base, adapters)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, 20 + i).tolist() for i in range(6)]
    models = ["sql-lora", "chat-lora", "third-lora"] * 2
    expected = [greedy(references[model], prompt) for model, prompt in zip(models, prompts, strict=True)]
    listed = "{" + ", ".join(f"{name}: {path}" for name, path in adapters.items()) + "}"
    overrides = (
        f"model.path={base}", "model.dtype=float32", "model.max_model_len=1024", "engine.max_num_seqs=1",
        f"lora.max_loras={max_loras}", "lora.max_cpu_loras=3", f"lora.adapters={listed}",
        "gateway.served_model_name=base",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, *overrides) as run:
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=300)
        long_stream = api.completions.create(
            model="base", prompt=prompts[0], max_tokens=900, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(long_stream))  # it runs: the adapter requests queue behind it

        complete = partial(greedy_token_ids, api)

        with ThreadPoolExecutor(len(models)) as pool:
            jobs = pool.map(complete, zip(models, prompts, strict=True))
            queued = 'running_lora_adapters="",waiting_lora_adapters="chat-lora,sql-lora,third-lora"'
            deadline = time.monotonic() + 60
            while not any(queued in line for line in lora_info(run)) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert any(queued in line for line in lora_info(run)), "the adapter requests never all queued"
            assert sum(1 for _ in long_stream) > 0  # the base stream ends, and the queue runs
            got = list(jobs)
        for model, tokens, want in zip(models, got, expected, strict=True):
            assert tokens == want, model
        deadline = time.monotonic() + 30
        while counter(run, "lora_adapter_swaps") < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        swaps, prefetches = counter(run, "lora_adapter_swaps"), counter(run, "lora_adapter_prefetches")
        assert swaps >= 3 and prefetches == swaps, (swaps, prefetches)
    assert_clean(run_dir)


def test_a_hot_reload_of_lora_adapters_loads_and_unloads(lora_serving, tmp_path: Path) -> None:
    """lora.adapters edited in the run's config file, then SIGHUP: the adapter added is loaded
    (PeftModel's tokens), the one removed is unloaded; an adapter loaded through the endpoint and
    never listed stays."""
    import openai

    base, adapters = lora_serving
    references = peft_references(base, adapters)
    prompt = np.random.default_rng(3).integers(3, TINY_VOCAB_SIZE, 21).tolist()
    expected = greedy(references["chat-lora"], prompt)
    config = tmp_path / "brigade.yaml"
    config.write_text(f"lora:\n  max_loras: 2\n  adapters:\n    sql-lora: {adapters['sql-lora']}\n")
    overrides = (
        f"model.path={base}",
        "model.dtype=float32",
        "model.max_model_len=256",
        "gateway.served_model_name=base",
    )
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, *overrides, config=str(config)) as run:
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=300)

        def served() -> set[str]:
            return {card.id for card in api.models.list().data}

        assert served() == {"base", "sql-lora"}
        body = {"lora_name": "extra-lora", "lora_path": str(adapters["sql-lora"])}
        api.post("/load_lora_adapter", body=body, cast_to=str)
        config.write_text(f"lora:\n  max_loras: 2\n  adapters:\n    chat-lora: {adapters['chat-lora']}\n")
        run.process.send_signal(signal.SIGHUP)
        # The gateway's list still names sql-lora (nothing asked the engine since): a request for
        # it passes the gateway's check, and once the reload has unloaded it the scheduler
        # refuses it, with the 404 of a name never served, not a 400 naming no parameter.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                greedy_token_ids(api, ("sql-lora", prompt))
            except openai.NotFoundError as refused:
                assert refused.body["code"] == "model_not_found", refused.body
                assert refused.body["param"] == "model", refused.body
                assert "unknown LoRA adapter 'sql-lora'" in refused.body["message"], refused.body
                break
            time.sleep(0.2)
        else:
            pytest.fail("sql-lora still served after the reload")
        while served() != {"base", "chat-lora", "extra-lora"} and time.monotonic() < deadline:
            time.sleep(0.5)
        assert served() == {"base", "chat-lora", "extra-lora"}
        reply = api.completions.create(
            model="chat-lora", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=1,
        )  # fmt: skip
        assert [
            int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens
        ] == expected
    assert_clean(run_dir)


def test_an_adapter_file_that_is_no_regular_file_is_refused_and_the_run_serves_on(
    lora_serving, tmp_path: Path
) -> None:
    """lora_path at a FIFO (a .gguf, or a PEFT directory whose adapter_config.json or safetensors
    is one) or at a device: the worker reads adapters on its step loop, and opening a FIFO that no
    one writes would block it, and every request of the run with it, for good. Each is a 400
    naming the file, within a deadline, and the base model and a loaded adapter serve on."""
    import openai

    base, adapters = lora_serving
    references = peft_references(base, {"sql-lora": adapters["sql-lora"]})
    prompt = np.random.default_rng(5).integers(3, TINY_VOCAB_SIZE, 19).tolist()
    expected = {name: greedy(model, prompt) for name, model in references.items()}
    fifo_gguf = tmp_path / "pipe.gguf"
    os.mkfifo(fifo_gguf)
    fifo_config = tmp_path / "fifo-config"
    fifo_config.mkdir()
    shutil.copy(adapters["sql-lora"] / "adapter_model.safetensors", fifo_config)
    os.mkfifo(fifo_config / "adapter_config.json")
    fifo_weights = tmp_path / "fifo-weights"
    fifo_weights.mkdir()
    shutil.copy(adapters["sql-lora"] / "adapter_config.json", fifo_weights)
    os.mkfifo(fifo_weights / "adapter_model.safetensors")
    device = tmp_path / "zero.gguf"
    device.symlink_to("/dev/zero")
    overrides = (
        f"model.path={base}", "model.dtype=float32", "model.max_model_len=256", "lora.max_loras=2",
        f"lora.adapters={{sql-lora: {adapters['sql-lora']}}}", "gateway.served_model_name=base",
    )  # fmt: skip
    run_dir = tmp_path / "run"

    def release_fifos() -> None:
        """A worker blocked opening a FIFO (the check missing) is released, so that the run stops."""
        for fifo in (
            fifo_gguf,
            fifo_config / "adapter_config.json",
            fifo_weights / "adapter_model.safetensors",
        ):
            with contextlib.suppress(OSError):  # no reader: nothing blocked on it
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    with brigade_run(run_dir, *overrides) as run:
        # A deadline on every call: without the check the load never answers, nor does the run.
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=60, max_retries=0)
        refusals = [
            ("pipe", fifo_gguf, r"/pipe\.gguf is not a regular file \(a FIFO, a device or a socket\)"),
            ("config", fifo_config, r"/fifo-config/adapter_config\.json is not a regular file"),
            ("weights", fifo_weights, r"/fifo-weights/adapter_model\.safetensors is not a regular file"),
            ("zero", device, r"/zero\.gguf is not a regular file"),
        ]
        try:
            for name, path, message in refusals:
                with pytest.raises(
                    openai.BadRequestError, match=rf"adapter '{name}': \S*{message}"
                ) as refused:
                    api.post(
                        "/load_lora_adapter", body={"lora_name": name, "lora_path": str(path)}, cast_to=str
                    )
                assert refused.value.body["param"] == "lora_path", refused.value.body
        finally:
            release_fifos()
        assert {card.id for card in api.models.list().data} == {"base", "sql-lora"}
        for model in ("base", "sql-lora"):
            assert greedy_token_ids(api, (model, prompt)) == expected[model], model
    assert_clean(run_dir)


def test_a_new_run_in_the_same_run_dir_serves_its_own_lora_adapters(lora_serving, tmp_path: Path) -> None:
    """The scheduler's table of adapters (lora-adapters-<group>.json) carries adapters across a
    scheduler restart within one run, not into the next run of that run dir: a run stopped after
    loading one adapter and unloading another, then started again with another lora.adapters,
    serves the adapters its config lists, from the paths it gives."""
    import openai

    base, adapters = lora_serving
    references = peft_references(base, adapters)
    prompt = np.random.default_rng(6).integers(3, TINY_VOCAB_SIZE, 22).tolist()
    expected = {name: greedy(model, prompt) for name, model in references.items()}
    overrides = (
        f"model.path={base}", "model.dtype=float32", "model.max_model_len=256", "lora.max_loras=2",
        "gateway.served_model_name=base",
    )  # fmt: skip
    run_dir = tmp_path / "run"

    def served(api: openai.OpenAI) -> set[str]:
        return {card.id for card in api.models.list().data}

    with brigade_run(run_dir, *overrides, f"lora.adapters={{sql-lora: {adapters['sql-lora']}}}") as run:
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=120, max_retries=0)
        body = {"lora_name": "extra-lora", "lora_path": str(adapters["chat-lora"])}
        api.post("/load_lora_adapter", body=body, cast_to=str)
        api.post("/unload_lora_adapter", body={"lora_name": "sql-lora"}, cast_to=str)
        assert served(api) == {"base", "extra-lora"}
    assert_clean(run_dir)

    # The next run lists sql-lora again, under chat-lora's weights this time.
    with brigade_run(run_dir, *overrides, f"lora.adapters={{sql-lora: {adapters['chat-lora']}}}") as run:
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=120, max_retries=0)
        assert served(api) == {"base", "sql-lora"}
        assert greedy_token_ids(api, ("sql-lora", prompt)) == expected["chat-lora"]
    assert_clean(run_dir)
    assert not list(run_dir.glob("lora-adapters-*")), "a stopped run leaves no table of adapters"
