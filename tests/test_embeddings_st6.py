"""A decoder embedding model as sentence-transformers 6 saves it (docs/embeddings.md): a tiny random
Qwen3 wrapped by sentence-transformers itself (Transformer, last-token Pooling, Normalize) and
`save()`d, so that config.json names the base model (`Qwen3Model`), the input length sits in
tokenizer_config.json and each text is rendered as a chat message. Served by a real run with task
auto, its vectors are sentence-transformers' own `encode` of the saved directory; a longer input
is refused as the length rule says; asked to generate, the run refuses to start."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ipc.config import ModelConfig
from services.common.pooling import BASE_MODEL_ARCHITECTURES, Embedding, embedding_of
from services.gpu_worker import architectures
from services.gpu_worker.architectures import (
    ARCHITECTURES,
    MODEL_TYPES,
    UnsupportedModel,
    check_draft_model,
    config_from_dir,
)
from tests.conftest import REPO_ROOT, TINY_VOCAB_SIZE, save_random_model
from tests.harness import Run, assert_clean, brigade_run, stage_processes
from tests.test_e2e import gateway_url
from tests.test_embeddings import MIN_COSINE, TEXTS, cosines, post

MAX_LENGTH = 64  # the model's max_seq_length, set before the save


@pytest.fixture(scope="module")
def st6_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sentence-transformers' own save of a tiny random Qwen3 (tied embeddings, as Qwen3-0.6B's),
    SmolLM2's tokenizer (with its chat template) beside it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("st6-qwen3")
    causal = save_random_model(config, root / "causal", seed=17, std=0.1, tokenizer_from=smollm2_dir)
    transformer = Transformer(str(causal))
    model = SentenceTransformer(
        modules=[transformer, Pooling(64, pooling_mode="lasttoken"), Normalize()], device="cpu"
    )
    model.max_seq_length = MAX_LENGTH
    out = root / "st6-qwen3"
    model.save(str(out))
    return out


def load_st(model_dir: Path):  # -> SentenceTransformer, imported lazily as the neighbours do
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)


def chat_token_counts(model_dir: Path, texts: list[str]) -> list[int]:
    """The tokens of each text rendered as one user message by transformers' own chat template
    code, untruncated: what sentence-transformers feeds the model up to its max_seq_length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [len(tokenizer.apply_chat_template([{"role": "user", "content": t}])["input_ids"]) for t in texts]


def test_the_save_is_sentence_transformers_6_layout(st6_dir: Path) -> None:
    """What the loader must read, as sentence-transformers 6.3 wrote it (not as this test did)."""
    import sentence_transformers
    from safetensors import safe_open

    assert sentence_transformers.__version__.startswith("6.")
    assert json.loads((st6_dir / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    with safe_open(str(st6_dir / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head")) for n in names)
    sentence = json.loads((st6_dir / "sentence_bert_config.json").read_text())
    assert "max_seq_length" not in sentence
    assert sentence["modality_config"]["message"]["format"] == "flat"
    assert json.loads((st6_dir / "tokenizer_config.json").read_text())["model_max_length"] == MAX_LENGTH


def test_st6_save_embeds_by_its_files(st6_dir: Path) -> None:
    assert embedding_of(ModelConfig(), st6_dir) == Embedding(
        "last", True, 64, MAX_LENGTH, "model_max_length in tokenizer_config.json", "flat"
    )
    config = config_from_dir(st6_dir)
    assert config.architecture == "Qwen3Model" and config.qk_norm  # Qwen3's layers
    with pytest.raises(ValueError, match=r"base model \(Qwen3Model.*no LM head, so it cannot generate"):
        embedding_of(ModelConfig(task="generate"), st6_dir)
    # Nor does it propose tokens for its causal sibling as a speculative draft.
    with pytest.raises(UnsupportedModel, match=r"is a base model \(Qwen3Model\) with no LM head"):
        check_draft_model(config_from_dir(st6_dir.parent / "causal"), st6_dir)


def test_base_model_classes_are_each_familys_own() -> None:
    """Every family's base model, as transformers names it (its AutoModel), maps to that family's
    causal LM; an unsupported base model is refused naming it."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    want = {MODEL_MAPPING_NAMES[t]: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] for t in MODEL_TYPES}
    assert want == BASE_MODEL_ARCHITECTURES
    assert set(BASE_MODEL_ARCHITECTURES.values()) == set(ARCHITECTURES)
    llama = {
        "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "model_type": "llama",
    }  # fmt: skip
    base = architectures.ModelConfig.from_dict({**llama, "architectures": ["LlamaModel"]})
    causal = architectures.ModelConfig.from_dict({**llama, "architectures": ["LlamaForCausalLM"]})
    assert base == architectures.ModelConfig(**{**causal.__dict__, "architecture": "LlamaModel"})
    with pytest.raises(UnsupportedModel, match=r"unsupported architecture \['Starcoder2Model'\]"):
        architectures.ModelConfig.from_dict({**llama, "architectures": ["Starcoder2Model"]})


@pytest.mark.parametrize("variant", ["as saved", "max_seq_length", "tokenizer_args", "no tokenizer limit"])
def test_input_limit_is_the_length_sentence_transformers_truncates_to(
    st6_dir: Path, tmp_path: Path, variant: str
) -> None:
    """The limit Brigade reads is sentence-transformers' own max_seq_length of the same directory,
    wherever the checkpoint keeps it (the older saves' sentence_bert_config.json keys included)."""
    model_dir = tmp_path / "model"
    shutil.copytree(st6_dir, model_dir)
    sentence_path, tokenizer_path = (
        model_dir / "sentence_bert_config.json",
        model_dir / "tokenizer_config.json",
    )
    sentence, tokenizer = json.loads(sentence_path.read_text()), json.loads(tokenizer_path.read_text())
    if variant == "max_seq_length":
        sentence["max_seq_length"] = 40
    elif variant == "tokenizer_args":
        sentence.update(max_seq_length=40, tokenizer_args={"model_max_length": 48})
    elif variant == "no tokenizer limit":
        del tokenizer["model_max_length"]
    sentence_path.write_text(json.dumps(sentence))
    tokenizer_path.write_text(json.dumps(tokenizer))
    embedding = embedding_of(ModelConfig(), model_dir)
    assert embedding is not None
    assert embedding.max_input_tokens == load_st(model_dir).max_seq_length


# Writes a message's text parts in brackets, so that a structured message (one text part) and a
# flat one (the text as the content) render differently.
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
)


@pytest.mark.parametrize("form", ["flat", "structured"])
def test_tokenizer_renders_each_text_as_sentence_transformers_does(
    st6_dir: Path, tmp_path: Path, form: str
) -> None:
    """The prompt the tokenizer stage admits is the token ids sentence-transformers' own
    `preprocess` feeds the model, in each message format."""
    from ipc import messages as m
    from ipc.messages import EmbedOptions, SamplingParams
    from services.common.text import Tokenizer
    from services.tokenizer.core import TokenizerCore

    model_dir = tmp_path / "model"
    shutil.copytree(st6_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    sentence_path = model_dir / "sentence_bert_config.json"
    sentence = json.loads(sentence_path.read_text())
    sentence["modality_config"]["message"]["format"] = form
    sentence_path.write_text(json.dumps(sentence))
    embedding = embedding_of(ModelConfig(), model_dir)
    assert embedding is not None and embedding.chat_message == form
    core = TokenizerCore(
        Tokenizer(model_dir), 0, 1, max_model_len=256, max_prompt_chars=10_000, default_max_tokens=1,
        embedding=embedding,
    )  # fmt: skip
    st = load_st(model_dir)
    for i, text in enumerate(TEXTS):
        request = m.Generate(f"r{i}", prompt=text, params=SamplingParams(embed=EmbedOptions()))
        got = m.unpack_ids(core.admit(b"c", request).submit.prompt_ids).tolist()
        want = st.preprocess([text])["input_ids"][0].tolist()
        assert got == want, text
    assert ("[" in Tokenizer(model_dir).decode(got)) == (form == "structured")


@pytest.fixture(scope="module")
def st6_run(st6_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("st6-run") / "run"
    overrides = ("gateway.served_model_name=st6", "model.dtype=float32", "model.max_model_len=256")
    with brigade_run(run_dir, f"model.path={st6_dir}", *overrides) as run:
        yield run
    assert_clean(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_st6_save_served_with_task_auto_matches_sentence_transformers(st6_dir: Path, st6_run: Run) -> None:
    import openai

    want = load_st(st6_dir).encode(TEXTS)
    api = openai.OpenAI(base_url=gateway_url(st6_run), api_key="none", timeout=120)
    reply = api.embeddings.create(model="st6", input=TEXTS)
    got = np.array([d.embedding for d in reply.data])
    assert cosines(got, want).min() >= MIN_COSINE
    np.testing.assert_allclose(got, want, atol=1e-4)
    # The tokens each text took are those sentence-transformers feeds (its chat rendering).
    assert reply.usage.prompt_tokens == sum(chat_token_counts(st6_dir, TEXTS))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_input_over_the_saved_length_is_refused(st6_dir: Path, st6_run: Run) -> None:
    """sentence-transformers would cut it at the saved 64 tokens; Brigade refuses it (400), naming
    the limit and where the checkpoint sets it; an input of exactly 64 tokens is embedded."""
    texts = [" ".join(["word"] * n) for n in range(1, MAX_LENGTH)]
    counts = chat_token_counts(st6_dir, texts)
    longest = texts[counts.index(MAX_LENGTH)]
    assert counts[counts.index(MAX_LENGTH) + 1] > MAX_LENGTH  # one word more is over
    st = load_st(st6_dir)
    # sentence-transformers feeds all of it: it fits.
    assert int(st.preprocess([longest])["attention_mask"].sum()) == MAX_LENGTH
    status, reply = post(gateway_url(st6_run), "/v1/embeddings", {"model": "st6", "input": [longest]})
    assert status == 200, reply
    np.testing.assert_allclose(reply["data"][0]["embedding"], st.encode(longest), atol=1e-4)
    status, reply = post(gateway_url(st6_run), "/v1/embeddings", {"model": "st6", "input": longest + " word"})
    assert status == 400, reply
    assert reply["error"]["message"].endswith(
        f"over the {MAX_LENGTH} this embedding model reads (model_max_length in tokenizer_config.json)"
    ), reply


def test_base_model_asked_to_generate_is_refused_at_start(st6_dir: Path, tmp_path: Path) -> None:
    """Its embeddings are tied, so an LM head could be made of them: the base model is refused
    for what it is, before any stage starts."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir),
         "--set", f"model.path={st6_dir}", "--set", "model.task=generate"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert "is a base model (Qwen3Model" in done.stderr and "no LM head" in done.stderr, done.stderr
    assert "model.task: embed" in done.stderr, done.stderr
    assert " started " not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not stage_processes(run_dir)


def test_message_modality_without_a_chat_template_is_refused_at_start(st6_dir: Path, tmp_path: Path) -> None:
    """A save that renders each input through the chat template but has none would fail every
    request; it is refused before any stage starts, naming what is missing."""
    model_dir = tmp_path / "model"
    shutil.copytree(st6_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir),
         "--set", f"model.path={model_dir}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert "lists the message modality" in done.stderr and "has no chat template" in done.stderr, done.stderr
    assert " started " not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not stage_processes(run_dir)
