"""LoRA adapters at tensor_parallel 2 against HF transformers with PEFT: test_lora.py's random Llama
base (4 query heads, 2 KV heads, an MLP of 96: each rank holds 2 query heads, 1 KV head and 48
MLP columns) and its three PEFT adapters (ranks 8, 16 with rsLoRA and 4; q/v, all seven, o/gate/
down) plus a GGUF file of a fourth (k/o/up/down), each rank holding its cut of every adapter's
A / B, in steps that mix the four and a row of none, run by two real processes over gloo
(test_tensor_parallel.py's groups). Rank 0's logits of every row, and so its greedy token, must
be PeftModel's on the row's whole history, through a chunked prefill and decodes."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

from services.gpu_worker.lora_gguf import write_gguf_adapter
from tests import test_lora
from tests.test_families import BLOCK, VOCAB
from tests.test_lora import hf_base, lora_plan, reference_logits, save_random_adapter, step_logits
from tests.test_model import PlanBuilder
from tests.test_tensor_parallel import spawn_group

pytestmark = pytest.mark.timeout(300)

peft = pytest.importorskip("peft")

lora_models = test_lora.lora_models  # the random base, PEFT adapters and references (a fixture)

ADAPTER_OF = {0: "qv-r8", 1: None, 2: "all-r16-rslora", 3: "ogd-r4", 4: "kou-gguf"}
GGUF_ADAPTER = dict(r=8, lora_alpha=32, target_modules=["k_proj", "o_proj", "up_proj", "down_proj"])
NEW_TOKENS = 5


def lora_rank_main(
    rank: int, world: int, port: int, out: mp.Queue, model_dir: str, plans: list, adapters: dict
) -> None:
    """One rank with the adapters in its slots: each plan's logits (rank 0's reported)."""
    import torch.distributed as dist

    from services.gpu_worker.model_runner import ModelRunner
    from services.gpu_worker.parallel import init_parallel

    torch.set_num_threads(1)
    parallel = init_parallel(rank, world, "127.0.0.1", port, torch.device("cpu"), 120)
    runner = ModelRunner(
        Path(model_dir), dtype="float32", kv_cache_bytes=2 << 20, block_size=BLOCK, parallel=parallel,
        max_loras=len(adapters), lora_adapters=adapters,
    )  # fmt: skip
    builder = PlanBuilder(BLOCK)
    logits = [
        step_logits(runner, *lora_plan(runner, builder, chunks, ADAPTER_OF)).numpy() for chunks in plans
    ]
    out.put((rank, runner.num_kv_blocks, logits if rank == 0 else None))
    dist.destroy_process_group()


def test_adapters_at_tensor_parallel_2_match_peft(lora_models, tmp_path: Path) -> None:
    base, paths, references = lora_models
    kou = save_random_adapter(base, tmp_path / "kou", 11, **GGUF_ADAPTER)
    base_config = json.loads((base / "config.json").read_text())
    adapters = {name: str(path) for name, path in paths.items()}
    adapters["kou-gguf"] = str(write_gguf_adapter(kou, base_config, tmp_path / "kou.gguf"))
    references = {**references, "kou-gguf": peft.PeftModel.from_pretrained(hf_base(base), kou).eval()}

    # Each sequence's prompt and PeftModel's greedy continuation of it.
    rng = np.random.default_rng(4)
    sequences = {}
    for seq, name in ADAPTER_OF.items():
        prompt = rng.integers(3, VOCAB, 13 + 4 * seq).tolist()
        ids = list(prompt)
        for _ in range(NEW_TOKENS):
            ids.append(int(reference_logits(references[name], ids).argmax()))
        sequences[seq] = (len(prompt), ids)
    # Sequence 0's prompt in two chunks (the first samples nothing) beside the others' prompts,
    # then a decode of each sequence a step, feeding PeftModel's tokens.
    fed = {seq: 0 for seq in sequences}

    def chunk(seq: int, length: int, is_sampled: bool = True) -> tuple[int, list[int], bool]:
        start = fed[seq]
        fed[seq] += length
        return seq, sequences[seq][1][start : fed[seq]], is_sampled

    others = [seq for seq in sequences if seq]
    prompt_len = {seq: length for seq, (length, _) in sequences.items()}
    plans = [[chunk(0, prompt_len[0] // 2, False)] + [chunk(seq, prompt_len[seq]) for seq in others]]
    plans.append([chunk(0, prompt_len[0] - fed[0])] + [chunk(seq, 1) for seq in others])
    plans += [[chunk(seq, 1) for seq in sequences] for _ in range(NEW_TOKENS - 2)]

    results = spawn_group(2, lora_rank_main, (str(base), plans, adapters))
    got = results[0][1]
    assert got is not None and len(got) == len(plans)
    lengths = {seq: 0 for seq in ADAPTER_OF}  # each row's history: its sequence so far
    for step, (plan, logits) in enumerate(zip(plans, got, strict=True)):
        rows = iter(torch.from_numpy(logits))
        for seq, tokens, is_sampled in plan:
            lengths[seq] += len(tokens)
            if not is_sampled:
                continue
            row, name = next(rows), ADAPTER_OF[seq]
            expected = reference_logits(references[name], sequences[seq][1][: lengths[seq]])
            where = f"step {step}, seq {seq} ({name})"
            torch.testing.assert_close(row, expected, atol=2e-4, rtol=2e-4, msg=where)
            assert int(row.argmax()) == int(expected.argmax()), f"{where}: greedy token differs"
