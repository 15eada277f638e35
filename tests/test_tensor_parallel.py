"""Tensor-parallel ModelRunner (real processes over gloo) against the single-rank runner on the same
weights: logits of prefill, chunked-prefill and decode steps, greedy tokens, KV cache agreement,
and the shard-only weight reads; and the families of test_families.py whose layers differ from
Llama's, at two ranks, against HF transformers."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ipc.messages import PLACEHOLDER_TOKEN
from services.gpu_worker.architectures import ModelConfig
from services.gpu_worker.model import LlamaModel
from services.gpu_worker.model_runner import ModelRunner
from services.gpu_worker.parallel import Parallel
from tests.test_model import PlanBuilder, runner_logits

pytestmark = pytest.mark.timeout(300)

VOCAB_SIZE = 1001  # not divisible by 2 or 4: the last vocabulary shard is padded
PROMPTS = [[5, 17, 300, 42, 9, 77, 1000, 3, 8, 15, 16, 23, 42, 4, 4, 4, 99, 100, 101], [7, 8], [400] * 5]
NEW_TOKENS = 6
KV_MIB = 8
CHILD_TIMEOUT_S = 240
HEAD_DIM = 16


def make_model(out: Path, num_heads: int, num_kv_heads: int, biases: bool = False) -> Path:
    """A tiny random Llama with an untied LM head and an odd vocabulary (no tokenizer needed);
    with `biases`, every projection has a random one (HF's init makes them zero)."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    config = HFConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=num_heads * HEAD_DIM,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=2,
        attention_bias=biases,
        mlp_bias=biases,
    )
    torch.manual_seed(num_heads)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tp-llama"), 4, 2)


@pytest.fixture(scope="module")
def uneven_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 KV groups of 2 query heads (SmolLM2's shape): 2 ranks hold 2 and 1 groups."""
    return make_model(tmp_path_factory.mktemp("tp-llama-uneven"), 6, 3)


@pytest.fixture(scope="module")
def biased_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """attention_bias and mlp_bias: the row-parallel projections' biases are added once, not per rank."""
    return make_model(tmp_path_factory.mktemp("tp-llama-biased"), 4, 2, biases=True)


def steps(
    tokens: list[list[int]], prompts: list[list[int]] = PROMPTS
) -> list[list[tuple[int, list[int], bool]]]:
    """The plans of a greedy run that produced `tokens`: a prefill whose first prompt is split in
    two chunks (mixed with the other prompts), then one decode step per generated token."""
    first, rest = prompts[0][:11], prompts[0][11:]
    plans = [
        [(0, first, False), (1, prompts[1], True), (2, prompts[2], True)],
        [(0, rest, True), (1, [tokens[1][0]], True), (2, [tokens[2][0]], True)],
    ]
    for n in range(1, NEW_TOKENS - 1):
        plans.append([(0, [tokens[0][n - 1]], True), (1, [tokens[1][n]], True), (2, [tokens[2][n]], True)])
    return plans


def placeholder_steps() -> list[list[tuple[int, list[int], bool]]]:
    """The plans of `steps`, planned ahead as the scheduler does: every decode runs the token its
    sequence sampled in the step before as a placeholder, which the ranks fill in."""
    first, rest = PROMPTS[0][:11], PROMPTS[0][11:]
    plans = [
        [(0, first, False), (1, PROMPTS[1], True), (2, PROMPTS[2], True)],
        [(0, rest, True), (1, [PLACEHOLDER_TOKEN], True), (2, [PLACEHOLDER_TOKEN], True)],
    ]
    plans += [[(i, [PLACEHOLDER_TOKEN], True) for i in range(3)]] * (NEW_TOKENS - 2)
    return plans


def execute_plans(runner: ModelRunner, plans: list) -> list[np.ndarray]:
    """The sampled ids of each plan run through `execute` (greedy: the plans' temperature is 0)."""
    builder = PlanBuilder(runner.block_size)
    return [runner.execute(*builder.plan(chunks))["sampled_ids"] for chunks in plans]


def run_plans(runner: ModelRunner, plans: list) -> list[torch.Tensor]:
    builder = PlanBuilder(runner.block_size)
    return [runner_logits(runner, builder, chunks) for chunks in plans]


def reference(model_dir: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and per-step logits of the single-rank runner (rows in plan order)."""
    runner = ModelRunner(model_dir, dtype="float32", kv_cache_bytes=KV_MIB << 20)
    builder = PlanBuilder(runner.block_size)
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    plan = [(0, PROMPTS[0][:11], False), (1, PROMPTS[1], True), (2, PROMPTS[2], True)]
    logits = [runner_logits(runner, builder, plan)]
    tokens[1].append(int(logits[0][0].argmax()))
    tokens[2].append(int(logits[0][1].argmax()))
    plan = [(0, PROMPTS[0][11:], True), (1, [tokens[1][0]], True), (2, [tokens[2][0]], True)]
    for _ in range(NEW_TOKENS - 1):
        logits.append(runner_logits(runner, builder, plan))
        for i, row in enumerate(logits[-1]):
            tokens[i].append(int(row.argmax()))
        plan = [(i, [tokens[i][-1]], True) for i in range(3)]
    return tokens, logits


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(
    rank: int,
    world: int,
    port: int,
    out: mp.Queue,
    model_dir: str,
    plans: list,
    execute: bool = False,
    expert_parallel: bool = False,
) -> None:
    """One tensor-parallel rank: join the group, load its shard, run the plans, report (the logits,
    or with `execute` the sampled ids of rank 0)."""
    import torch.distributed as dist

    from services.gpu_worker.parallel import init_parallel

    torch.set_num_threads(1)
    parallel = init_parallel(rank, world, "127.0.0.1", port, torch.device("cpu"), 120, expert_parallel)
    # Different budgets per rank: the group must agree on the smallest.
    budget = (KV_MIB << 20) // (rank + 1)
    runner = ModelRunner(Path(model_dir), dtype="float32", kv_cache_bytes=budget, parallel=parallel)
    results = execute_plans(runner, plans) if execute else run_plans(runner, plans)
    # As numpy arrays: a torch tensor crosses a Queue as a file descriptor that the parent fetches
    # from this process, which races with its exit ("Connection reset by peer").
    arrays = [r.numpy() if isinstance(r, torch.Tensor) else r for r in results]
    out.put((rank, runner.num_kv_blocks, arrays if rank == 0 else None))
    dist.destroy_process_group()


def run_group(
    world: int, model_dir: Path, plans: list, execute: bool = False, expert_parallel: bool = False
) -> dict[int, tuple[int, list | None]]:
    return spawn_group(world, rank_main, (str(model_dir), plans, execute, expert_parallel))


def spawn_group(world: int, target: Callable, args: tuple) -> dict[int, tuple[int, list | None]]:
    """`world` ranks, each a spawned process running target(rank, world, port, out, *args), and
    what each put on `out`: (rank, its number of KV blocks, its results or None)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, out, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[int, list | None]] = {}
    try:
        for _ in range(world):
            rank, num_blocks, logits = out.get(timeout=CHILD_TIMEOUT_S)
            results[rank] = (num_blocks, logits)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    except queue.Empty:
        raise AssertionError(
            f"ranks did not report within {CHILD_TIMEOUT_S}s: {[p.exitcode for p in procs]}"
        ) from None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    return results


# world 4 > 2 KV heads: each KV head is replicated on two ranks; "uneven": 3 KV groups on 2 ranks.
@pytest.mark.parametrize(("model", "world"), [("untied", 2), ("untied", 4), ("uneven", 2), ("biased", 2)])
def test_tensor_parallel_matches_single_rank(request: pytest.FixtureRequest, model: str, world: int) -> None:
    model_dir = request.getfixturevalue(f"{model}_model_dir")
    num_kv = 3 if model == "uneven" else 2
    tokens, want = reference(model_dir)
    results = run_group(world, model_dir, steps(tokens))
    got = results[0][1]
    assert got is not None and len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape == (b.shape[0], VOCAB_SIZE), step
        a = torch.from_numpy(a)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"greedy token differs at step {step}"

    # Every rank holds the smallest cache any rank can: rank r has budget / (r + 1) and its own
    # number of KV heads (2 layers x K and V x 16 tokens x heads x head_dim x 4 bytes per block).
    def kv_heads(r: int) -> int:
        return num_kv // world + (r < num_kv % world) if num_kv >= world else 1

    expected = min(
        ((KV_MIB << 20) // (r + 1)) // (2 * 2 * 16 * kv_heads(r) * HEAD_DIM * 4) for r in range(world)
    )
    assert {num_blocks for num_blocks, _ in results.values()} == {expected}


def test_tensor_parallel_ranks_fill_placeholders_alike(untied_model_dir: Path) -> None:
    """Only rank 0 samples; the other ranks get each placeholder's token from it. A rank that ran
    another token would change the all-reduced activations, and so rank 0's greedy tokens."""
    tokens, _ = reference(untied_model_dir)
    results = run_group(2, untied_model_dir, placeholder_steps(), execute=True)
    sampled = results[0][1]
    assert sampled is not None and len(sampled) == NEW_TOKENS
    assert sampled[0].tolist() == [-1, tokens[1][0], tokens[2][0]]
    for n in range(1, NEW_TOKENS):
        assert sampled[n].tolist() == [tokens[0][n - 1], tokens[1][n], tokens[2][n]], f"step {n}"


def test_shard_weights_are_slices_of_the_full_model(untied_model_dir: Path) -> None:
    """Each rank's tensors, read with get_slice, are exactly its rows / columns of the full weights."""
    from services.gpu_worker.loader import load_weights

    config = ModelConfig.from_dict(__import__("json").loads((untied_model_dir / "config.json").read_text()))
    full = LlamaModel(config, torch.float32, torch.device("cpu"), 16)
    load_weights(full, untied_model_dir)
    for rank in range(2):
        part = LlamaModel(config, torch.float32, torch.device("cpu"), 16, Parallel(rank, 2))
        load_weights(part, untied_model_dir)
        sh, d = part.shard, config.head_dim
        layer, whole = part.layers[1], full.layers[1]
        assert sh.num_heads == 2 and sh.num_kv_heads == 1
        q = whole.qkv[: 4 * d][sh.head_start * d : (sh.head_start + sh.num_heads) * d]
        k = whole.qkv[4 * d : 6 * d][sh.kv_head_start * d : (sh.kv_head_start + sh.num_kv_heads) * d]
        assert torch.equal(layer.qkv[: sh.num_heads * d], q)
        assert torch.equal(layer.qkv[sh.num_heads * d : (sh.num_heads + sh.num_kv_heads) * d], k)
        cols = slice(sh.intermediate_start, sh.intermediate_start + sh.intermediate_size)
        assert torch.equal(layer.down, whole.down[:, cols])
        assert torch.equal(
            layer.o_proj, whole.o_proj[:, sh.head_start * d : (sh.head_start + sh.num_heads) * d]
        )
        rows = sh.num_vocab_rows
        assert torch.equal(part.lm_head[:rows], full.lm_head[sh.vocab_start : sh.vocab_start + rows])
        assert not part.lm_head[rows:].any(), "padding rows must be zero"
    assert np.isclose(sh.vocab_shard_size, -(-VOCAB_SIZE // 2))


# Within test_families.VOCAB; the first prompt is longer than its sliding window (12 tokens).
FAMILY_PROMPTS = [
    [5, 17, 300, 42, 9, 77, 310, 3, 8, 15, 16, 23, 42, 4, 4, 4, 99, 100, 101],
    [7, 8],
    [200] * 5,
]


def step_histories(prompts: list[list[int]], tokens: list[list[int]]) -> list[list[list[int]]]:
    """Each sampled row's whole history in the plans of `steps(tokens, prompts)`, step by step."""
    histories = [[prompts[1], prompts[2]]]
    for m in range(1, NEW_TOKENS):
        histories.append([prompts[i] + tokens[i][: m - (i == 0)] for i in range(3)])
    return histories


# Qwen3: q/k norms; Gemma 2: soft caps, alternating windows, sandwich norms, GeGLU; Phi-3: fused
# qkv and gate_up, longrope; Mistral: a sliding window. All with 4 query and 2 KV heads: a KV head
# (and its 2 query heads) per rank.
@pytest.mark.parametrize("family", ["qwen3-qk-norm", "gemma2", "phi3-longrope", "mistral-sliding"])
def test_tensor_parallel_families_match_hf(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    from tests.test_families import hf_logits, save_random_family_model

    model_dir = save_random_family_model(family, tmp_path / family)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    tokens = []
    for prompt in FAMILY_PROMPTS:  # HF's greedy continuation of each prompt
        ids = list(prompt)
        for _ in range(NEW_TOKENS):
            ids.append(int(hf_logits(hf, ids).argmax()))
        tokens.append(ids[len(prompt) :])
    results = run_group(2, model_dir, steps(tokens, FAMILY_PROMPTS))
    got = results[0][1]
    histories = step_histories(FAMILY_PROMPTS, tokens)
    assert got is not None and len(got) == len(histories)
    for step, (rows, row_histories) in enumerate(zip(got, histories, strict=True)):
        assert rows.shape[0] == len(row_histories), step
        for row, history in zip(rows, row_histories, strict=True):
            expected = hf_logits(hf, history)
            got_row = torch.from_numpy(row)
            torch.testing.assert_close(got_row, expected, atol=2e-4, rtol=2e-4, msg=f"step {step}")
            assert int(row.argmax()) == int(expected.argmax()), f"greedy token differs at step {step}"
