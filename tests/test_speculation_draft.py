"""The draft-model proposer (speculative.method draft_model, docs/speculative.md) on small random
Llamas that the tests build: a 4-layer target and a draft that is the same weights cut to its
first layer, so that it agrees often but not always.

In one process (the scheduler core and real ModelRunners, tests/in_process_engine.py): greedy
outputs with the draft equal those without speculation, through chunked prefill and preemption,
and a draft that is the target itself has every proposal accepted (its KV cache follows the
target's); sampled rows emit the target's distribution (chi-square against HF over a
four-token vocabulary). The refusals: no draft directory, a vocabulary of another size, a
sliding-window target, plans that ask a worker to draft what it cannot. Through real processes:
greedy requests (a chunked prefill and stop strings among them) give the same tokens and text
with the draft as without, and the spec_decode_* counters count its proposals."""

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

from client import Client
from client.errors import PromptTooLong
from ipc.config import ConfigError, load_config
from ipc.messages import DRAFT_TOKEN
from services.gpu_worker.architectures import UnsupportedModel
from services.gpu_worker.model_runner import InvalidPlan, ModelRunner
from services.scheduler.proposers import DraftModelProposer
from services.scheduler.speculation import Speculation
from tests import in_process_engine
from tests.conftest import REPO_ROOT, TINY_VOCAB_SIZE
from tests.harness import assert_clean, brigade_run, free_port, spec_decode_counters, stage_processes
from tests.test_model import PlanBuilder
from tests.test_sampler import chi_square

pytestmark = pytest.mark.timeout(600)

TARGET_LAYERS, DRAFT_LAYERS = 4, 1


def save_llama(
    out: Path,
    vocab_size: int,
    num_layers: int,
    tokenizer_from: Path | None = None,
    late_layer_scale: float = 1.0,
    **config,
) -> Path:
    """A random Llama saved by HF (`config` overrides LlamaConfig's fields), with another model
    dir's tokenizer files when `tokenizer_from` is given. The output projections of every layer
    after the first are scaled by `late_layer_scale`: below 1, the first layer alone (the
    truncated draft) predicts the whole model's tokens more often."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**settings, **config}))
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(late_layer_scale)
            layer.mlp.down_proj.weight.mul_(late_layer_scale)
    model.save_pretrained(out)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, out / name)
    return out


def truncated_copy(src: Path, out: Path, num_layers: int) -> Path:
    """`src` cut to its first `num_layers` layers (the same embeddings, layers, norm and head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(src)
    config.num_hidden_layers = num_layers
    draft = LlamaForCausalLM(config)
    missing, _ = draft.load_state_dict(LlamaForCausalLM.from_pretrained(src).state_dict(), strict=False)
    assert not missing
    draft.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 4-layer target over a 256-token vocabulary and its first layer as the draft."""
    root = tmp_path_factory.mktemp("draft-pair")
    target = save_llama(root / "target", 256, TARGET_LAYERS)
    return target, truncated_copy(target, root / "draft", DRAFT_LAYERS)


def runner_of(target: Path, draft: Path | None = None, **kwargs) -> ModelRunner:
    settings = dict(dtype="float32", kv_cache_bytes=4 << 20, threads=2, block_size=8)
    return ModelRunner(target, draft_model=draft, **{**settings, **kwargs})


PROMPTS = {
    "short": [5, 17, 33, 5, 17],
    "long": [(7 * i + 3) % 250 + 3 for i in range(45)],  # chunked at 16 tokens a step
    "mid": [9, 200, 31, 77, 9, 200, 31, 4, 8, 15],
}


def serve_in_process(
    runner: ModelRunner, params: dict[str, dict] | None = None, **config
) -> tuple[object, dict[str, list[int]]]:
    sched, _, outputs = in_process_engine.serve(
        runner,
        PROMPTS,
        24,
        0,
        params=params,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        max_model_len=96,
        **config,
    )
    return sched, {rid: tokens for rid, (tokens, _, _) in outputs.items()}


def test_greedy_outputs_with_the_draft_equal_those_without(pair: tuple[Path, Path], monkeypatch) -> None:
    """Chunked prefill (a 45-token prompt, 16 tokens a step), and a pool
    small enough to preempt: the same tokens; proposals verified, some kept, some rejected.
    Every request keeps a high acceptance rate, so that the random draft, which the target
    rarely agrees with, is verified throughout rather than turned off by the adaptive rule."""
    monkeypatch.setattr(Speculation, "acceptance_rate", lambda self, req: 0.9)
    target, draft = pair
    _, plain = serve_in_process(runner_of(target))
    speculating = runner_of(target, draft)
    for num_blocks in (speculating.num_kv_blocks, 12):  # 12 blocks of 8: three sequences preempt
        sched, got = serve_in_process(speculating, num_blocks=num_blocks, proposer=DraftModelProposer(3))
        assert got == plain, num_blocks
        spec = sched.speculation
        assert spec is not None and spec.num_draft_tokens > spec.num_accepted_tokens > 0, num_blocks
        if num_blocks == 12:
            assert sched.num_preemptions > 0


def test_allowed_token_ids_and_bad_words_with_the_draft_equal_those_without(
    pair: tuple[Path, Path], monkeypatch
) -> None:
    """vLLM's allowed_token_ids (a mask the draft's places are verified under, position by
    position, in the real sampler) and bad words (one-token ones: a fixed bias, which drafted
    rows keep; longer ones: no drafting) give the same tokens with the draft as without, and
    those are HF's greedy tokens over the allowed ones (the target, step by step)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(Speculation, "acceptance_rate", lambda self, req: 0.9)
    target, draft = pair
    _, free = serve_in_process(runner_of(target))
    allowed = list(range(3, 256, 4))
    params = {
        "short": {"allowed_token_ids": allowed},
        "long": {"bad_words_ids": [[free["long"][3]], [free["long"][6], free["long"][7]]]},
        "mid": {"allowed_token_ids": allowed, "bad_words_ids": [[allowed[5]]]},
    }
    _, plain = serve_in_process(runner_of(target), params)
    sched, got = serve_in_process(runner_of(target, draft), params, proposer=DraftModelProposer(3))
    assert got == plain
    spec = sched.speculation
    assert spec is not None and spec.num_draft_tokens > 0
    assert set(got["short"]) <= set(allowed) and set(got["mid"]) <= set(allowed) - {allowed[5]}
    assert free["long"][3] not in got["long"] and got["long"] != free["long"]
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    history = list(PROMPTS["short"])
    for token in got["short"]:
        with torch.inference_mode():
            logits = hf(torch.tensor([history])).logits[0, -1].float()
        assert token == allowed[int(logits[allowed].argmax())]
        history.append(token)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_a_draft_that_is_the_target_has_every_proposal_accepted(
    pair: tuple[Path, Path], kv_cache_dtype
) -> None:
    """The draft's cache holds the draft's KV of exactly the tokens the target's holds (same
    blocks, same slots, written in the same steps, in the target's engine.kv_cache_dtype), so a
    draft with the target's weights proposes the target's greedy tokens: every one is kept,
    through chunked prefill and preemption."""
    target, _ = pair
    _, plain = serve_in_process(runner_of(target, kv_cache_dtype=kv_cache_dtype))
    speculating = runner_of(target, target, kv_cache_dtype=kv_cache_dtype)
    assert speculating.draft is not None
    assert {k.dtype for k, _ in speculating.draft.kv_cache} == {speculating.kv_dtype}
    sched, got = serve_in_process(speculating, num_blocks=12, proposer=DraftModelProposer(3))
    assert got == plain
    spec = sched.speculation
    assert spec is not None and spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    assert sched.num_preemptions > 0


# ---- sampled rows: the target's distribution ----------------------------------------------------

STAT_VOCAB, STAT_ROWS, STAT_TEMPERATURE = 4, 2_000, 1.3
STAT_PROMPT = [1]  # one token: the first step is a batched decode, not 2000 prefills


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("draft-stat")
    target = save_llama(
        root / "target", STAT_VOCAB, 2, hidden_size=32, intermediate_size=64, initializer_range=0.5
    )
    return target, truncated_copy(target, root / "draft", 1)


@pytest.mark.slow
def test_sampled_rows_emit_the_target_distribution(small_vocab_pair: tuple[Path, Path]) -> None:
    """Seeded sampled rows (one seed each, temperature 1.3) prefill a prompt and sample t1, then
    verify two drafted tokens after it, then (where only one token came out) decode once more:
    their first three tokens (t1, t2, t3) have the distribution HF's target gives,
    p(t1) p(t2 | t1) p(t3 | t1, t2) (chi-square over the 64 outcomes)."""
    from transformers import LlamaForCausalLM

    target, draft = small_vocab_pair
    runner = runner_of(target, draft, kv_cache_bytes=64 << 20, max_num_seqs=STAT_ROWS)
    rows = range(STAT_ROWS)
    builder = PlanBuilder(runner.block_size)

    def run(chunks: list[tuple[int, list[int], bool]], num_proposed: int = 0) -> dict[str, np.ndarray]:
        arrays, header = builder.plan(chunks, max_blocks=1)
        arrays["temperature"][:] = STAT_TEMPERATURE
        arrays["seeds"][:] = [seq for seq, _, _ in chunks]
        if num_proposed:
            arrays["num_proposed"] = np.full(len(chunks), num_proposed, np.int32)
        return runner.execute(arrays, header)

    first = run([(i, STAT_PROMPT, True) for i in rows])["sampled_ids"]
    verified = run([(i, [int(first[i]), DRAFT_TOKEN, DRAFT_TOKEN], True) for i in rows], num_proposed=2)
    counts = verified["num_emitted"]
    assert (counts >= 1).all() and (counts == 1).any() and (counts == 3).any()
    outcomes = np.stack([first, verified["emitted_ids"][:, 0], verified["emitted_ids"][:, 1]], axis=1)
    short = np.flatnonzero(counts == 1)
    for i in rows:  # the rejected proposals' KV is not kept
        builder.num_cached[i] -= 2 - (int(counts[i]) - 1)
    # Only the rows that emitted one token decode again; the others have what they need.
    third = run([(int(i), [int(outcomes[i, 1])], True) for i in short])["sampled_ids"]
    outcomes[short, 2] = third

    hf = LlamaForCausalLM.from_pretrained(target).eval()
    contexts = [
        STAT_PROMPT + [a, b][:n] for n in range(3) for a in range(STAT_VOCAB) for b in range(STAT_VOCAB)
    ]
    with torch.inference_mode():
        probs = {
            tuple(c): torch.softmax(
                hf(torch.tensor([c])).logits[0, -1].double() / STAT_TEMPERATURE, -1
            ).numpy()
            for c in map(tuple, contexts)
        }
    p = np.array(
        [
            probs[tuple(STAT_PROMPT)][a] * probs[(*STAT_PROMPT, a)][b] * probs[(*STAT_PROMPT, a, b)][c]
            for a in range(STAT_VOCAB)
            for b in range(STAT_VOCAB)
            for c in range(STAT_VOCAB)
        ]
    )
    observed = np.bincount(outcomes @ np.array([STAT_VOCAB**2, STAT_VOCAB, 1]), minlength=STAT_VOCAB**3)
    # Outcomes expected fewer than 5 times are pooled into one cell, as chi-square needs.
    rare = p * STAT_ROWS < 5
    observed = np.append(observed[~rare], observed[rare].sum())
    expected = np.append(p[~rare], p[rare].sum())
    from scipy.stats import chi2

    statistic = chi_square(observed, list(expected))
    assert statistic < chi2.ppf(0.9999, len(expected) - 1), statistic


# ---- refusals -----------------------------------------------------------------------------------


def test_a_draft_model_config_needs_an_absolute_directory_and_one_rank() -> None:
    with pytest.raises(
        ConfigError, match=r"speculative\.model: .*draft_model needs the draft model.s directory"
    ):
        load_config(None, ["speculative.method=draft_model"])
    with pytest.raises(ConfigError, match="an absolute path; got 'draft'"):
        load_config(None, ["speculative.method=draft_model", "speculative.model=draft"])
    with pytest.raises(ConfigError, match=r"engine\.tensor_parallel must be 1, got 2"):
        load_config(
            None, ["speculative.method=draft_model", "speculative.model=/d", "engine.tensor_parallel=2"]
        )
    assert (
        load_config(None, ["speculative.method=draft_model", "speculative.model=/d"]).speculative.model
        == "/d"
    )


def with_config(src: Path, out: Path, **changes: object) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_draft_models_that_cannot_propose_are_refused_at_load(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """No model in the directory, a vocabulary of another size (both sizes named), a target with a
    sliding window on every layer: the worker refuses before it serves, saying why."""
    target, draft = pair
    with pytest.raises(
        UnsupportedModel, match=f"speculative.model: {tmp_path / 'none'} is not a model directory"
    ):
        runner_of(target, tmp_path / "none")
    other_vocab = save_llama(tmp_path / "other-vocab", 300, 1)
    with pytest.raises(UnsupportedModel, match="the draft's vocabulary has 300 tokens, the target's 256"):
        runner_of(target, other_vocab)
    windowed = with_config(
        target,
        tmp_path / "windowed",
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        sliding_window=32,
    )
    with pytest.raises(UnsupportedModel, match="sliding window \\(32 tokens\\) on every layer"):
        runner_of(windowed, draft)


def test_the_supervisor_refuses_a_draft_with_another_vocabulary(
    tiny_model_dir: Path, pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """The check runs before any stage starts (supervision/run.py `prepare_model`): a non-zero
    exit with the message, nothing left running."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir),
         "--set", f"model.path={tiny_model_dir}", "--set", "speculative.method=draft_model",
         "--set", f"speculative.model={pair[1]}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"the draft's vocabulary has 256 tokens, the target's {TINY_VOCAB_SIZE}" in done.stderr
    assert "ready" not in done.stdout
    assert not stage_processes(run_dir)


def test_a_kv_budget_that_fits_the_target_but_not_with_its_draft_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The supervisor's check of the CPU KV budget counts the draft's cache (as many blocks as the
    target's, from the same budget): 1 MiB holds 2048 tokens of the tiny 2-layer model alone,
    and too few beside its 1-layer draft."""
    from supervision.preflight import Refused, check_model

    settings = [
        "engine.device=cpu",
        "engine.kv_cache_mib=1",
        "engine.block_size=16",
        "model.max_model_len=2048",
    ]
    check_model(load_config(None, settings), tiny_model_dir)
    draft = truncated_copy(tiny_model_dir, tmp_path / "draft", 1)
    with_draft = [*settings, "speculative.method=draft_model", f"speculative.model={draft}"]
    with pytest.raises(
        Refused, match=r"KV block\(s\) of 16 tokens of .* and its draft model .*kv_cache_mib >= 2"
    ):
        check_model(load_config(None, with_draft), tiny_model_dir)


def test_plans_that_ask_for_what_cannot_be_drafted_are_refused(pair: tuple[Path, Path]) -> None:
    """A token to draft for a worker without a draft, one outside a row's proposals, and given
    proposals for a worker that drafts: each step is refused (InvalidPlan), the worker serves on."""
    target, draft = pair
    builder = PlanBuilder(8)
    arrays, header = builder.plan([(0, [5, 6, DRAFT_TOKEN], True)])
    arrays["num_proposed"] = np.array([1], np.int32)
    with pytest.raises(InvalidPlan, match="a token to draft, for a worker without a draft model"):
        runner_of(target).execute(arrays, header)
    drafting = runner_of(target, draft)
    builder = PlanBuilder(8)
    arrays, header = builder.plan([(0, [5, DRAFT_TOKEN, 7], True)])
    arrays["num_proposed"] = np.array([1], np.int32)
    with pytest.raises(InvalidPlan, match="not exactly the rows' proposals"):
        drafting.execute(arrays, header)
    arrays["input_ids"][:] = [5, 6, 7]
    with pytest.raises(InvalidPlan, match="not exactly the rows' proposals"):
        drafting.execute(arrays, header)
    arrays["input_ids"][:] = [5, 6, DRAFT_TOKEN]
    result = drafting.execute(arrays, header)
    assert 1 <= result["num_emitted"][0] <= 2


# ---- through real processes ---------------------------------------------------------------------

NEW_TOKENS = 24
TEXT = "The lighthouse keeper climbed the spiral stairs every evening at dusk and lit the lamp."
GREEDY_PROMPTS = [
    "Hello there, how are you?",
    f"Repeat: {TEXT}",
    f"{TEXT} {TEXT} {TEXT}",  # over max_num_batched_tokens (32): prefilled in chunks
]


@pytest.fixture(scope="module")
def served_pair(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 4-layer target with SmolLM2's tokenizer (so the run serves text) and its first layer."""
    root = tmp_path_factory.mktemp("draft-served")
    # Over a vocabulary this large, one random layer's guesses agree with four's only when the
    # later three change little (here about 7 times in 8).
    target = save_llama(
        root / "target", TINY_VOCAB_SIZE, TARGET_LAYERS, tokenizer_from=smollm2_dir, late_layer_scale=0.1
    )
    return target, truncated_copy(target, root / "draft", DRAFT_LAYERS)


def serve_all(run_dir: Path, target: Path, *overrides: str) -> tuple[list[tuple], dict[str, float]]:
    """Each prompt greedily, streamed and not, all at once; then the first prompt again with a
    stop string taken from the middle of its text (a random model's text has no word to count
    on), so that the stop ends it mid-output. Their (token ids, text, finish reason), and the
    run's spec_decode_* counters."""
    metrics_port = free_port()
    settings = (
        f"model.path={target}", "model.dtype=float32", "model.max_model_len=512",
        "engine.max_num_batched_tokens=32", f"supervisor.metrics_port={metrics_port}",
    )  # fmt: skip
    with brigade_run(run_dir, *settings, *overrides) as run:

        def one(job: tuple[str, dict, bool]) -> tuple:
            prompt, sampling, stream = job
            messages = [{"role": "user", "content": prompt}]
            args = dict(max_tokens=NEW_TOKENS, timeout=300, temperature=0.0) | sampling
            with Client(run.run_dir) as client:
                if stream:
                    deltas = list(client.stream_chat(messages, **args))
                    return (
                        [t for d in deltas for t in d.token_ids],
                        "".join(d.text for d in deltas),
                        deltas[-1].finish_reason,
                    )
                result = client.chat(messages, **args)
                return result.token_ids, result.text, result.finish_reason

        jobs = [(prompt, {}, stream) for prompt in GREEDY_PROMPTS for stream in (False, True)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(one, jobs))
            text = results[0][1]
            stop = text[2 * len(text) // 3 :][:3]
            assert stop.strip(), text
            results += pool.map(
                one, [(GREEDY_PROMPTS[0], {"stop": [stop]}, stream) for stream in (False, True)]
            )
        counters = spec_decode_counters(metrics_port)
    assert_clean(run_dir)
    return results, counters


@pytest.mark.slow
def test_draft_model_speculation_never_changes_a_greedy_output_end_to_end(
    served_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = served_pair
    plain, _ = serve_all(tmp_path / "plain", target)
    speculated, counters = serve_all(
        tmp_path / "spec", target, "speculative.method=draft_model", f"speculative.model={draft}",
        "speculative.num_speculative_tokens=3",
    )  # fmt: skip
    assert speculated == plain
    assert [finish for _, _, finish in plain[-2:]] == ["stop", "stop"]  # the stop string ended them
    assert counters["brigade:spec_decode_num_drafts_total"] > 0
    accepted = counters["brigade:spec_decode_num_accepted_tokens_total"]
    assert counters["brigade:spec_decode_num_draft_tokens_total"] >= accepted > 0


def test_a_run_reports_the_length_its_draft_model_bounds(
    served_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """A draft with fewer positions than model.max_model_len lowers the run's length to its own
    (the worker's rule): /v1/models, /tokenize and the SDK's health say so, and the tokenizer
    refuses a prompt past it with that number, as the scheduler would."""
    import urllib.request

    target, draft = served_pair
    short = tmp_path / "short-draft"
    shutil.copytree(draft, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    port = free_port()
    settings = (
        f"model.path={target}", "model.dtype=float32", "model.max_model_len=512", f"gateway.port={port}",
        "speculative.method=draft_model", f"speculative.model={short}",
    )  # fmt: skip
    with brigade_run(tmp_path / "run", *settings) as run:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as reply:
            assert [card["max_model_len"] for card in json.load(reply)["data"]] == [128]
        request = urllib.request.Request(
            f"{base}/tokenize", json.dumps({"prompt": "hi"}).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert json.load(reply)["max_model_len"] == 128
        with Client(run.run_dir) as client:
            assert [h.max_model_len for h in client.health()] == [128]
            with pytest.raises(PromptTooLong, match="max_model_len is 128"):
                client.generate(list(range(3, 203)), max_tokens=4, timeout=120)
    assert_clean(tmp_path / "run")
