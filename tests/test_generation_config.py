"""A model's generation_config.json sets the sampling defaults of requests that set none (as
vLLM's `--generation-config auto`), and its eos ids end generation. The file is written by
transformers' own GenerationConfig; the served tokens are checked against HF's greedy decode."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from client.sdk import make_params
from ipc import messages as m
from ipc.config import ConfigError, load_config
from ipc.sampling_defaults import (
    EMBEDDED_MODEL_DEFAULTS,
    ENGINE_DEFAULTS,
    check_generation_overrides,
    fill_defaults,
    model_defaults,
    run_defaults,
)
from services.common.text import Tokenizer
from services.gateway.jobs import plan_completion
from services.gateway.protocol import CompletionRequest
from services.tokenizer.core import TokenizerCore
from supervision.preflight import Refused, check_model
from tests.conftest import REPO_ROOT, TINY_VOCAB_SIZE
from tests.harness import assert_clean, brigade_run, hf_greedy

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


def write_generation_config(model_dir: Path, **fields: object) -> None:
    from transformers import GenerationConfig

    GenerationConfig(do_sample=True, **fields).save_pretrained(model_dir)


def test_model_defaults_are_read_from_what_transformers_writes(tmp_path: Path) -> None:
    write_generation_config(tmp_path, **MODEL_DEFAULTS, eos_token_id=[2, 7])
    assert model_defaults(tmp_path) == MODEL_DEFAULTS
    assert model_defaults(tmp_path, "none") == {}
    assert model_defaults(tmp_path / "missing") == {}


def test_transformers_own_defaults_are_not_the_models_choice(tmp_path: Path) -> None:
    """top_k 50 is GenerationConfig's default, not the model's (vLLM reads to_diff_dict); -1 is
    'off' as in vLLM; null is unset."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"top_k": 50, "temperature": 1.0, "top_p": None, "repetition_penalty": 1.0})
    )
    assert model_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": -1}))
    assert model_defaults(tmp_path) == {"top_k": 0}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"temperature": -0.5}', "temperature must be in"),
        ('{"top_p": 0}', "top_p must be in"),
        ('{"top_k": 1.5}', "top_k must be an integer"),
        ('{"repetition_penalty": "high"}', "repetition_penalty must be a number"),
        ('{"temperature": true}', "temperature must be a number"),
        ("[1, 2]", "must hold a JSON object"),
        ("{not json", "not readable JSON"),
    ],
)
def test_a_bad_generation_config_refuses_the_run(
    tmp_path: Path, tiny_model_dir: Path, text: str, match: str
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        model_defaults(model_dir)
    # Before any stage starts (the tokenizers would crash-loop on it), naming the way out.
    with pytest.raises(Refused, match=f"generation_config.json.*{match}.*generation_config=none"):
        check_model(load_config(None, ["model.max_model_len=256"]), model_dir)
    check_model(load_config(None, ["model.max_model_len=256", "model.generation_config=none"]), model_dir)


def test_the_config_overrides_the_models_values_as_vllm_does(tmp_path: Path) -> None:
    """model.override_generation_config goes on top of the model's values (vLLM's
    --override-generation-config); with mode none it is all there is. The embedded model, which
    declares nothing, takes its model card's values; a model of one's own never does."""
    assert run_defaults(tmp_path) == {}
    assert (
        run_defaults(tmp_path, is_embedded_model=True)
        == EMBEDDED_MODEL_DEFAULTS
        == {
            "temperature": 0.2,
            "top_p": 0.9,
        }
    )
    assert run_defaults(tmp_path, "auto", {"temperature": 0.7, "top_k": 40}, is_embedded_model=True) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
    }
    assert run_defaults(tmp_path, "none", {"min_p": 0.1}, is_embedded_model=True) == {"min_p": 0.1}
    write_generation_config(tmp_path, **MODEL_DEFAULTS)
    assert run_defaults(tmp_path, "auto", {"top_k": 5}, is_embedded_model=True) == {
        **MODEL_DEFAULTS,
        "top_k": 5,
    }
    config = load_config(None, ["model.override_generation_config.repetition_penalty=1.2"])
    assert config.model.override_generation_config == {"repetition_penalty": 1.2}


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("temprature=0.5", "unknown field 'temprature'; it may set temperature, top_p"),
        ("top_k=2.5", "top_k must be an integer"),
        ("top_k=abc", "top_k must be an integer, got 'abc'"),
        ("temperature=-1", "temperature must be in"),
        ("top_p=0", "top_p"),
    ],
)
def test_a_bad_override_is_a_config_error_naming_it(override: str, match: str) -> None:
    """Refused with the config's own errors (config error, exit 2), before any model is prepared."""
    config = load_config(None, ["model.max_model_len=256", f"model.override_generation_config.{override}"])
    with pytest.raises(ConfigError, match=f"^model.override_generation_config: {match}"):
        check_generation_overrides(config)


def test_the_supervisor_refuses_a_bad_override_as_a_config_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--run-dir", str(tmp_path / "run"),
         "--set", "model.override_generation_config.temprature=0.5"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(
        "config error: model.override_generation_config: unknown field 'temprature'"
    )


def test_an_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="generation_config"):
        load_config(None, ["model.generation_config=vllm"])


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("generation-config")
    write_generation_config(model_dir, **MODEL_DEFAULTS)

    def make(mode: str = "auto") -> TokenizerCore:
        return TokenizerCore(
            Tokenizer(smollm2_dir),
            0,
            1,
            max_model_len=256,
            max_prompt_chars=1000,
            default_max_tokens=7,
            sampling_defaults=model_defaults(model_dir, mode),  # type: ignore[arg-type]
        )

    return make


def forwarded(core: TokenizerCore, params: m.SamplingParams) -> m.SamplingParams:
    """The params the tokenizer sends on to the scheduler for a request with `params`."""
    return core.admit(b"c", m.Generate("r", prompt="Hello", params=params)).submit.params


def test_unset_fields_take_the_models_values(tokenizer) -> None:
    params = forwarded(tokenizer(), m.SamplingParams())
    assert {name: getattr(params, name) for name in MODEL_DEFAULTS} == MODEL_DEFAULTS


def test_an_explicit_value_wins_over_the_models(tokenizer) -> None:
    params = forwarded(tokenizer(), m.SamplingParams(temperature=0.0, top_k=0, repetition_penalty=1.0))
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 0, 1.0)
    assert (params.top_p, params.min_p) == (MODEL_DEFAULTS["top_p"], MODEL_DEFAULTS["min_p"])


def test_mode_none_forwards_the_engine_defaults(tokenizer) -> None:
    params = forwarded(tokenizer("none"), m.SamplingParams())
    assert {name: getattr(params, name) for name in ENGINE_DEFAULTS} == ENGINE_DEFAULTS


PARAM_NAMES = {f.name for f in msgspec.structs.fields(m.SamplingParams)}


def params_of(sampling: dict) -> m.SamplingParams:
    """The SamplingParams of a plan's keyword arguments, which also carry the request's own
    (Generate's: truncation, prompt ids...)."""
    return make_params({k: v for k, v in sampling.items() if k in PARAM_NAMES})


def test_sdk_and_gateway_send_unset_fields_as_none() -> None:
    """The tokenizer can only apply the model's defaults to fields the client left unset."""
    params = make_params({"max_tokens": 4})
    assert all(getattr(params, name) is None for name in ENGINE_DEFAULTS)
    assert params.seed is not None  # the model's temperature may sample: a resubmission needs the seed
    plan = plan_completion(msgspec.convert({"model": "m", "prompt": "hi"}, CompletionRequest), None)
    sampling = plan.jobs[0].sampling
    assert all(sampling[name] is None for name in ENGINE_DEFAULTS)
    assert params_of(sampling).temperature is None
    explicit = plan_completion(
        msgspec.convert({"model": "m", "prompt": "hi", "temperature": 0.3, "top_k": -1}, CompletionRequest),
        None,
    )
    explicit_params = params_of(explicit.jobs[0].sampling)
    assert (explicit_params.temperature, explicit_params.top_k) == (0.3, 0)  # vLLM's -1: no top-k


def test_fill_defaults_keeps_every_set_field() -> None:
    params = m.SamplingParams(max_tokens=3, temperature=0.2, stop=["x"], seed=5)
    filled = fill_defaults(params, {"temperature": 0.9, "top_k": 4})
    assert (filled.temperature, filled.top_k, filled.top_p, filled.stop, filled.seed) == (
        0.2,
        4,
        1.0,
        ["x"],
        5,
    )


# -- served end to end -------------------------------------------------------------------------

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def llama_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama whose greedy outputs vary (larger weights than HF's init, which repeats one
    token), with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama-generation-config")
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(5)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_served_requests_take_the_models_defaults_and_eos(llama_dir: Path, tmp_path: Path) -> None:
    """generation_config says top_k=1 (greedy whatever the temperature and seed) and adds an eos:
    a request setting neither decodes HF's greedy tokens and stops at that eos; one that sets
    top_k=0 and a high temperature samples (its own values win); ignore_eos runs past it."""
    from client import Client

    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    rng = np.random.default_rng(1)
    for _ in range(8):  # a prompt whose greedy output has a token that is new after the first
        prompt = rng.integers(3, TINY_VOCAB_SIZE, 12).tolist()
        greedy = hf_greedy(model_dir, prompt, NEW_TOKENS)
        new_at = [i for i in range(1, NEW_TOKENS) if greedy[i] not in greedy[:i] and greedy[i] != 2]
        if new_at:
            break
    assert new_at, "no prompt gives a greedy output with a second distinct token"
    eos_at = new_at[0]  # generation_config's extra eos: HF's greedy token at this output index
    eos = greedy[eos_at]
    write_generation_config(model_dir, top_k=1, temperature=0.8, eos_token_id=[2, eos])
    run_dir = tmp_path / "run"
    overrides = (f"model.path={model_dir}", "model.dtype=float32", "model.max_model_len=256")
    with brigade_run(run_dir, *overrides), Client(run_dir) as client:
        stopped = client.generate(prompt, max_tokens=NEW_TOKENS, seed=7, timeout=300)
        full = client.generate(prompt, max_tokens=NEW_TOKENS, seed=8, ignore_eos=True, timeout=300)
        sampled = [
            client.generate(
                prompt,
                max_tokens=NEW_TOKENS,
                top_k=0,
                temperature=100.0,
                ignore_eos=True,
                seed=s,
                timeout=300,
            ).token_ids
            for s in range(3)
        ]
    assert stopped.token_ids == greedy[: eos_at + 1] and stopped.finish_reason == "stop"
    assert full.token_ids == greedy
    # At temperature 100 over the whole vocabulary, 30 tokens that all equal greedy's would mean
    # the request's own top_k and temperature were ignored (the seeds fix the draw: no flakiness).
    assert any(tokens != greedy for tokens in sampled)
    assert_clean(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_served_requests_take_the_configs_overrides(llama_dir: Path, tmp_path: Path) -> None:
    """With the model's file ignored (mode none), override_generation_config alone sets the
    defaults: top_k=1 makes a request that sets nothing greedy even at temperature 100."""
    from client import Client

    prompt = np.random.default_rng(2).integers(3, TINY_VOCAB_SIZE, 12).tolist()
    greedy = hf_greedy(llama_dir, prompt, NEW_TOKENS)
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={llama_dir}",
        "model.dtype=float32",
        "model.max_model_len=256",
        "model.generation_config=none",
        "model.override_generation_config.top_k=1",
        "model.override_generation_config.temperature=100",
    )
    with brigade_run(run_dir, *overrides) as run, Client(run_dir) as client:
        result = client.generate(prompt, max_tokens=NEW_TOKENS, seed=3, ignore_eos=True, timeout=300)
        said = [line for line in run.log if "a request that sets no sampling values takes" in line]
    assert result.token_ids == greedy
    assert "temperature=100, top_p=1.0, top_k=1," in said[0]
    assert_clean(run_dir)


def test_a_ggufs_sampling_keys_become_its_generation_config(tmp_path: Path) -> None:
    import gguf

    from services.gpu_worker.loader import gguf_generation_config

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32(gguf.Keys.General.SAMPLING_TEMP, 0.5)
    writer.add_int32(gguf.Keys.General.SAMPLING_TOP_K, 30)
    writer.add_float32(gguf.Keys.General.SAMPLING_PENALTY_REPEAT, 1.25)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    generation = gguf_generation_config(gguf.GGUFReader(str(path)))
    assert generation == {"temperature": 0.5, "top_k": 30, "repetition_penalty": 1.25}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert model_defaults(tmp_path) == generation


def test_the_embedded_smollm2_has_no_sampling_defaults(smollm2_dir: Path) -> None:
    """Neither its GGUF nor its HF release records any (docs/models.md): it samples at the
    engine's defaults unless a request says otherwise."""
    import gguf

    from services.gpu_worker.loader import default_model_path, gguf_generation_config

    assert gguf_generation_config(gguf.GGUFReader(default_model_path())) == {}
    assert model_defaults(smollm2_dir) == {}
