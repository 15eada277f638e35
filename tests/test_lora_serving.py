"""LoRA adapters served end to end: real processes (supervisor, tokenizer, scheduler, worker,
detokenizer, gateway) and the real `openai` client, a random Llama base with SmolLM2's tokenizer
and two random PEFT adapters in lora.adapters. A request picks its adapter by model name; greedy
tokens must be PeftModel's, with requests of both adapters and of the base model in flight
together, and the same prompt under each must not share KV blocks through the prefix cache."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from client import Client, InvalidRequest
from tests.conftest import REPO_ROOT, TINY_VOCAB_SIZE, save_random_model
from tests.harness import assert_clean, brigade_run, free_port, stage_processes
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
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    base = save_random_model(config, root / "base", seed=11, std=0.1, tokenizer_from=smollm2_dir)
    adapters = {
        name: save_random_adapter(base, root / name, seed, **args)
        for seed, (name, args) in enumerate(ADAPTERS.items())
    }
    return base, adapters


def greedy(model, prompt: list[int]) -> list[int]:
    """Greedy continuation by full forwards (no HF KV cache)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_adapters_selected_by_model_name_match_peft(lora_serving, tmp_path: Path) -> None:
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
        with pytest.raises(
            openai.BadRequestError, match="served on /v1/chat/completions and /v1/completions only"
        ):
            api.responses.create(model="sql-lora", input="hi", max_output_tokens=4)

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
            with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'no-such-lora'"):
                client.generate(prompt, adapter="no-such-lora", max_tokens=2, timeout=60)
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
