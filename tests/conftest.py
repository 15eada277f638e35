"""Suite-wide fixtures and the leak check: after the whole suite, /dev/shm holds nothing of ours."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

# Triton kernels run in the interpreter on machines without CUDA; this must be set before any
# module that defines a kernel is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from ipc.endpoints import SHM_PREFIX

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's, so the tiny model can serve real text


TRANSPORT_ENV = "BRIGADE_TEST_TRANSPORT"  # tests/harness.py starts every run with this network.transport


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--transport",
        choices=("ipc", "tcp"),
        default=None,
        help="network.transport of every run tests/harness.py starts (tcp: every link over loopback "
        "tcp:// with CURVE); a test's own override wins",
    )
    parser.addoption(
        "--chaos-seed",
        type=int,
        default=None,
        help="seed of tests/test_chaos.py's fault plan (default: a new one each run, printed on failure)",
    )


def pytest_configure(config: pytest.Config) -> None:
    transport = config.getoption("--transport")
    if transport is not None:
        os.environ[TRANSPORT_ENV] = transport  # inherited by the test processes' children too


@pytest.fixture
def chaos_seed(request: pytest.FixtureRequest) -> int:
    """The seed of a chaos test's fault plan: --chaos-seed, or a fresh one. A failing test
    names it (pytest_runtest_makereport below), so that the same plan can be run again."""
    seed = request.config.getoption("--chaos-seed")
    return random.randrange(2**32) if seed is None else seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    seed = getattr(item, "funcargs", {}).get("chaos_seed")
    if report.failed and seed is not None:
        report.sections.append(("chaos seed", f"run this fault plan again with: --chaos-seed {seed}"))
    return report


def brigade_shm_objects() -> list[str]:
    """Brigade shared-memory segments and semaphores currently in /dev/shm."""
    return sorted(n for n in os.listdir("/dev/shm") if SHM_PREFIX in n)


def owner_pid(name: str) -> int | None:
    """Run ids are `{owner pid}x{hex}` (ipc.shm.new_run_id); None for other names."""
    run_id = name.split(SHM_PREFIX, 1)[1].split("-", 1)[0]
    pid, sep, _ = run_id.partition("x")
    return int(pid) if sep and pid.isdigit() else None


def is_orphan(name: str) -> bool:
    """Left behind: its owner is dead, or it is this test process itself. A live owner that is
    someone else (another run on this machine) is not the suite's leak."""
    pid = owner_pid(name)
    if pid is None or pid == os.getpid():
        return True
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory():
    before = set(brigade_shm_objects())
    yield
    leaked = sorted(n for n in set(brigade_shm_objects()) - before if is_orphan(n))
    assert not leaked, f"shared memory left in /dev/shm by the suite: {leaked}"


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """Compile the CPU kernels (kernels/cpu_ops.py) once, up front, so that
    no worker process a test starts spends its start-up time limit waiting for the compiler."""
    from kernels import cpu_ops

    cpu_ops.load()


@pytest.fixture(params=["avx2", "avx512"])
def cpu_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a C++-kernel test once per build of cpu_ops (kernels/cpu_ops.py, ISAS) that this CPU
    can run, with the module's ops pointed at that build; a build the CPU lacks is skipped."""
    from kernels import cpu_ops

    name = request.param
    assert list(cpu_ops.ISAS) == ["avx2", "avx512"], "the fixture's params must name every build"
    if name not in cpu_ops.available_isas():
        pytest.skip(f"this CPU cannot run the {name} build of the CPU kernels")
    monkeypatch.setenv("BRIGADE_CPU_ISA", name)
    cpu_ops.isa.cache_clear()
    request.addfinalizer(cpu_ops.isa.cache_clear)
    assert cpu_ops.load(), f"the {name} build of the CPU kernels failed"
    return name


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once to an HF-format dir (cached)."""
    from services.gpu_worker.loader import prepare_model

    return prepare_model(None)


@pytest.fixture(scope="session")
def gguf_reference_weights() -> dict:
    """The embedded GGUF's weights as transformers' own GGUF reader dequantizes them (float32,
    HF names, the tied lm_head alias left out): the independent reference for Brigade's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from services.gpu_worker.loader import default_model_path

    # from_pretrained(gguf_file=) minus its accelerate requirement.
    gguf = Path(default_model_path())
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=meta)["tensors"]
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return {"config": config, "tensors": tensors}


@pytest.fixture(scope="session")
def smollm2_hf_dir(
    smollm2_dir: Path, gguf_reference_weights: dict, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """SmolLM2 as an HF float32 checkpoint of transformers' dequantization of the GGUF, with the
    converted dir's config and tokenizer: what HF references load (the conversion cache keeps
    the quantized weights as blocks, and only a bfloat16 rounding of them for HF)."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("smollm2-hf-float32")
    tensors = {name: t.contiguous() for name, t in gguf_reference_weights["tensors"].items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_random_model(
    config,
    out: Path,
    seed: int,
    std: float,
    embed_std: float | None = None,
    tokenizer_from: Path | None = None,
) -> Path:
    """A random HF model of `config` saved under `out` as safetensors. The weights are redrawn
    wider than HF's init (normal with `std`, `embed_std` for the embedding and the head) and every
    norm away from 1 (uniform in [0.5, 1.5]), so greedy tokens have clear margins and each norm
    matters. With `tokenizer_from`, that model's tokenizer files are copied beside it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                is_embedding = "embed" in name or "lm_head" in name
                p.normal_(0.0, embed_std if is_embedding and embed_std is not None else std)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES if tokenizer_from is not None else ():
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, GQA) with SmolLM2's tokenizer, for fast real-process tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_gemma3_vlm_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random `Gemma3ForConditionalGeneration` (SigLIP tower on 64x64 images in 16x16
    patches, pooled to 4 image tokens) with SmolLM2's tokenizer plus Gemma 3's three image tokens,
    and a Gemma3Processor saved beside it, as HF's own save_pretrained writes them."""
    from tests.vlm_models import write_gemma3_vlm

    return write_gemma3_vlm(tmp_path_factory.mktemp("tiny-gemma3-vlm"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen25vl_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random `Qwen2_5_VLForConditionalGeneration` (a 4-block tower in 14-pixel patches,
    2x2 windows of image tokens in two of its blocks, a 2-layer Qwen2 with M-RoPE) with SmolLM2's
    tokenizer plus Qwen's vision tokens, and its image processor (4 to 64 image tokens an image)."""
    from tests.vlm_models import write_qwen25vl

    return write_qwen25vl(tmp_path_factory.mktemp("tiny-qwen25vl"), smollm2_dir)


# SmolVLM's chat template, as its checkpoints ship it: an image part renders as "<image>".
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOLVLM_IMAGE_TOKENS = (
    "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)  # fmt: skip


def save_tiny_idefics3(out: Path, smollm2_dir: Path, architecture: str, split: bool) -> Path:
    """A tiny random SmolVLM or Idefics3 (`architecture`: SigLIP-style tower on 32x32 tiles in
    8x8 patches, pixel shuffle by 2 to 4 image tokens a tile, a 2-layer Llama) with SmolLM2's
    tokenizer plus the image tokens, and its processor (images resized to 64 on their longest
    side, split into 32x32 tiles where `split`) saved beside it, as HF's save_pretrained writes."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SMOLVLM_IMAGE_TOKENS)})
    tokenizer.save_pretrained(out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    family = "SmolVLM" if architecture.startswith("SmolVLM") else "Idefics3"
    image_processor = getattr(transformers, f"{family}ImageProcessorPil")(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=split
    )
    if family == "SmolVLM":
        # SmolVLMProcessor needs torchvision (its video processor) and num2words, which this
        # environment lacks: the image processor and the chat template are saved alone, and the
        # tests build the prompt with the processor module's own image prompt function.
        image_processor.save_pretrained(out)
        tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
        tokenizer.save_pretrained(out)
    else:
        transformers.Idefics3Processor(
            image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
            chat_template=SMOLVLM_CHAT_TEMPLATE,
        ).save_pretrained(out)  # fmt: skip
    config = getattr(transformers, f"{family}Config")(
        text_config=dict(
            model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2,
        ),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        # Idefics3's head tied to its embeddings by the top-level flag alone, as HF ties it.
        tie_word_embeddings=family == "Idefics3",
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # wider than HF's init and every norm away from its identity, so each one matters
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_smolvlm_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random `SmolVLMForConditionalGeneration` whose processor splits images into tiles."""
    out = tmp_path_factory.mktemp("tiny-smolvlm")
    return save_tiny_idefics3(out, smollm2_dir, "SmolVLMForConditionalGeneration", split=True)


@pytest.fixture(scope="session")
def tiny_idefics3_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random `Idefics3ForConditionalGeneration` whose processor does not split images."""
    out = tmp_path_factory.mktemp("tiny-idefics3")
    return save_tiny_idefics3(out, smollm2_dir, "Idefics3ForConditionalGeneration", split=False)


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """`pip install` of a wheel built from this tree, into a directory of its own: the `brigade`
    script exactly as pip writes it, and the env (PYTHONPATH) that makes it import that copy."""
    root = tmp_path_factory.mktemp("install")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "supervisor.py", "brigade_cli.py"):
        shutil.copy(REPO_ROOT / name, source / name)
    for package in ("ipc", "services", "kernels", "client", "supervision"):
        if (REPO_ROOT / package).exists():
            shutil.copytree(
                REPO_ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
            )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(root / "dist")],
                   check=True, timeout=300, cwd=root)  # fmt: skip
    (wheel,) = (root / "dist").glob("brigade-*.whl")
    site = root / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    script = site / "bin" / "brigade"
    assert script.exists() and os.access(script, os.X_OK)
    return script, {"PYTHONPATH": str(site)}
