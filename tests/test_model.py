"""ModelRunner against HF transformers on the same weights: greedy tokens, logprobs, logits of
mixed / chunked / block-boundary batches, and plan validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipc.messages import DRAFT_TOKEN, PLACEHOLDER_TOKEN, StepHeader
from ipc.step_plan import STEP_PLAN, Dim
from kernels import cpu_ops
from services.gpu_worker.model import CAN_PREPACK, onednn_linear, prepack
from services.gpu_worker.model_runner import InvalidPlan, ModelRunner

BLOCK_SIZE = 16


class PlanBuilder:
    """A minimal scheduler for tests: sequences keep their blocks from a trivial counter."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.next_block = 0
        self.blocks: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}
        self.next_step_id = 0  # consecutive, as the scheduler numbers them (placeholders rely on it)

    def plan(
        self, chunks: list[tuple[int, list[int], bool]], max_blocks: int = 64
    ) -> tuple[dict[str, np.ndarray], StepHeader]:
        """chunks: (seq id, new token ids, sample?) per sequence, in plan order."""
        bs = self.block_size
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        tables = np.zeros((len(chunks), max_blocks), dtype=np.int32)
        for row, (seq, tokens, _) in enumerate(chunks):
            blocks = self.blocks.setdefault(seq, [])
            start = self.num_cached.get(seq, 0)
            end = start + len(tokens)
            while len(blocks) * bs < end:
                blocks.append(self.next_block)
                self.next_block += 1
            for pos, tok in enumerate(tokens, start):
                ids.append(tok)
                positions.append(pos)
                slots.append(blocks[pos // bs] * bs + pos % bs)
            self.num_cached[seq] = end
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            tables[row, : len(blocks)] = blocks
        s = len(chunks)
        arrays = STEP_PLAN.neutral(
            {Dim.TOKENS: len(ids), Dim.ROWS: s},
            rows=np.array([c[0] for c in chunks]),  # the sequence id is its row
            input_ids=np.array(ids),
            positions=np.array(positions),
            slot_mapping=np.array(slots),
            query_start_loc=np.array(qsl),
            seq_lens=np.array(seq_lens),
            block_tables=tables,
            is_sampled=np.array([c[2] for c in chunks]),
            sample_positions=np.array(seq_lens),
        )
        self.next_step_id += 1
        return arrays, StepHeader(
            step_id=self.next_step_id - 1, num_tokens=len(ids), num_seqs=s, max_top_logprobs=0
        )


def generate(
    runner: ModelRunner, prompts: list[list[int]], max_new: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy generation of all prompts batched: one prefill step, then decode steps."""
    builder = PlanBuilder(runner.block_size)
    out: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    chunks = [(i, p, True) for i, p in enumerate(prompts)]
    for _ in range(max_new):
        result = runner.execute(*builder.plan(chunks))
        for i in range(len(prompts)):
            out[i].append(int(result["sampled_ids"][i]))
            logprobs[i].append(float(result["sampled_logprobs"][i]))
        chunks = [(i, [out[i][-1]], True) for i in range(len(prompts))]
    return out, logprobs


def runner_logits(
    runner: ModelRunner, builder: PlanBuilder, chunks: list[tuple[int, list[int], bool]]
) -> torch.Tensor:
    """Logits of the sampled rows of one step (the model called the way `execute` calls it)."""
    arrays, header = builder.plan(chunks)
    runner.validate(arrays, header)
    metas = runner.model.prepare(arrays, header.num_tokens, header.num_seqs)
    rows = np.flatnonzero(arrays["is_sampled"])
    # On the runner's device, as `execute` puts them: the check runs on a GPU too (gpu_check).
    sample_tokens = torch.from_numpy(arrays["query_start_loc"][rows + 1].astype(np.int64) - 1).to(
        runner.device
    )
    ids = torch.from_numpy(arrays["input_ids"].astype(np.int64)).to(runner.device)
    return runner.model.forward(ids, metas, runner.kv_cache, sample_tokens)


# ---- SmolLM2 vs HF generate ------------------------------------------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three prime numbers.",
    "hi",
    "Translate 'good morning' into Spanish and German, then explain the difference in tone.",
    "What is 12 times 7?",
    "Give me a short tip for writing clean Python code, with a tiny example of a function.",
]


@pytest.mark.slow
@pytest.mark.timeout(900)  # SmolLM2 on the CPU, with headroom for a loaded machine
def test_smollm2_greedy_matches_hf(smollm2_dir, smollm2_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c in CHATS
    ]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len({len(p) for p in prompts}) > 4  # mixed prompt lengths
    max_new = 32
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        gen = hf.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new, do_sample=False,
            output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=pad,
        )  # fmt: skip
    hf_ids = gen.sequences[:, width:].tolist()
    hf_logprobs = torch.stack(gen.scores, dim=1).log_softmax(-1)  # [B, new, V] (raw: greedy, no warpers)

    runner = ModelRunner(smollm2_dir, dtype="float32", kv_cache_bytes=64 << 20, threads=2)
    # Steps of 1-4 rows (each prompt alone below, and every decode step here) multiply from the
    # GGUF blocks; the rest from the float32 copy.
    assert all(q is not None for layer in runner.model.layers for q in layer.quantized)
    assert runner.model.lm_head_quantized is not None
    batched, batched_lp = generate(runner, prompts, max_new)
    for i, prompt in enumerate(prompts):
        assert batched[i] == hf_ids[i], f"prompt {i} batched"
        chosen = hf_logprobs[i, torch.arange(max_new), torch.tensor(hf_ids[i])]
        np.testing.assert_allclose(batched_lp[i], chosen.numpy(), atol=1e-3)
        alone, _ = generate(runner, [prompt], max_new)
        assert alone[0] == hf_ids[i], f"prompt {i} alone"


# ---- tiny model vs HF forward ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(tiny_model_dir, dtype="float32", kv_cache_bytes=4 << 20, block_size=BLOCK_SIZE)
    return runner, hf


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def test_tiny_mixed_batch_matches_hf(tiny):
    runner, hf = tiny
    rng = np.random.default_rng(0)
    builder = PlanBuilder()
    histories = {i: random_ids(rng, n, runner.vocab_size) for i, n in enumerate([5, 17, 33, 2])}
    runner_logits(runner, builder, [(i, h, True) for i, h in histories.items()])
    for _ in range(3):  # decodes of the old sequences mixed with fresh prefills
        new_seq = len(histories)
        histories[new_seq] = random_ids(rng, int(rng.integers(2, 40)), runner.vocab_size)
        chunks = [(new_seq, histories[new_seq], True)]
        for i in list(histories)[:-1]:
            token = int(rng.integers(0, runner.vocab_size))
            histories[i].append(token)
            chunks.append((i, [token], True))
        logits = runner_logits(runner, builder, chunks)
        for row, (seq, _, _) in enumerate(chunks):
            torch.testing.assert_close(logits[row], hf_last_logits(hf, histories[seq]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length", [1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE])
def test_tiny_block_boundaries(tiny, length):
    runner, hf = tiny
    rng = np.random.default_rng(length)
    builder = PlanBuilder()
    ids = random_ids(rng, length, runner.vocab_size)
    logits = runner_logits(runner, builder, [(0, ids, True)])
    torch.testing.assert_close(logits[0], hf_last_logits(hf, ids), atol=1e-4, rtol=1e-4)
    for _ in range(2):  # decode across the boundary
        ids.append(int(rng.integers(0, runner.vocab_size)))
        logits = runner_logits(runner, builder, [(0, ids[-1:], True)])
        torch.testing.assert_close(logits[0], hf_last_logits(hf, ids), atol=1e-4, rtol=1e-4)


def few_row_steps_match_hf(runner: ModelRunner, hf, max_rows: int) -> None:
    """Decode steps of 1..max_rows rows after one prefill give HF's logits."""
    rng = np.random.default_rng(4)
    builder = PlanBuilder()
    histories = {i: random_ids(rng, 12 + i, runner.vocab_size) for i in range(max_rows)}
    runner_logits(runner, builder, [(i, h, True) for i, h in histories.items()])
    for num_seqs in range(1, max_rows + 1):
        chunks = []
        for i in range(num_seqs):
            histories[i].append(int(rng.integers(0, runner.vocab_size)))
            chunks.append((i, histories[i][-1:], True))
        logits = runner_logits(runner, builder, chunks)
        for row in range(num_seqs):
            torch.testing.assert_close(logits[row], hf_last_logits(hf, histories[row]), atol=1e-4, rtol=1e-4)


def test_tiny_few_rows_use_the_few_rows_kernel(tiny):
    """Steps of 1-4 rows multiply through cpu_ops.few_rows_linear (float32 on the CPU) and must give
    HF's logits, as the 5-row step through oneDNN (or, without it, F.linear) does. A float32
    checkpoint keeps one float32 copy of each weight: the plain [out, in] one, which both read."""
    runner, hf = tiny
    model = runner.model
    assert model.has_few_rows_linear and model.lm_head_t is None
    assert [model._layout(n) for n in (1, 4)] == ["few_rows", "few_rows"]
    assert model._layout(5) == ("onednn" if CAN_PREPACK else "plain")
    if CAN_PREPACK:
        assert model.lm_head_onednn is model.lm_head
        for layer in model.layers:
            assert all(w is p for w, p in zip(layer.onednn, layer.plain, strict=True))
    few_row_steps_match_hf(runner, hf, 5)


def test_one_op_layers_match_the_per_op_path(tiny_model_dir):
    """Decode steps of 1-4 rows run each layer as one C++ op; the same steps through the per-op
    path (rms_norm, rotary, KV store, attention, MLP as separate ops) give the same logits and
    write the same KV cache."""
    runners = [
        ModelRunner(tiny_model_dir, dtype="float32", kv_cache_bytes=4 << 20, block_size=BLOCK_SIZE)
        for _ in range(2)
    ]
    assert runners[0].model.has_one_op_layers
    runners[1].model.has_one_op_layers = False
    rng = np.random.default_rng(7)
    histories = {i: random_ids(rng, 15 + i, runners[0].vocab_size) for i in range(4)}  # decodes cross a block
    builders = [PlanBuilder(), PlanBuilder()]
    for runner, builder in zip(runners, builders, strict=True):
        runner_logits(runner, builder, [(i, h, True) for i, h in histories.items()])
    for num_seqs in (1, 4, 2, 3):
        chunks = [(i, [int(rng.integers(0, runners[0].vocab_size))], True) for i in range(num_seqs)]
        one_op, per_op = (runner_logits(r, b, chunks) for r, b in zip(runners, builders, strict=True))
        torch.testing.assert_close(one_op, per_op, atol=1e-5, rtol=1e-5)
    for (k0, v0), (k1, v1) in zip(runners[0].kv_cache, runners[1].kv_cache, strict=True):
        torch.testing.assert_close(k0, k1, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v0, v1, atol=1e-6, rtol=1e-6)


def test_gguf_blocks_that_differ_from_the_weights_are_refused(tiny, caplog):
    """Blocks that do not hold the loaded weights (here: a fresh Q8_0 quantization of them, off by
    its rounding) are not used: the weight stays float32, with a warning, and logits stay HF's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    runner, hf = tiny
    model = runner.model
    blocks, formats = {}, {}
    for i in range(len(model.layers)):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        blocks[name] = torch.from_numpy(quantize(model.layers[i].down.numpy(), GGMLQuantizationType.Q8_0))
        formats[name] = "Q8_0"
    try:
        with caplog.at_level("WARNING"):
            model.load_quantized(blocks, formats)
        assert all(layer.quantized == (None, None, None, None) for layer in model.layers)
        assert "do not match" in caplog.text
        few_row_steps_match_hf(runner, hf, 2)
    finally:
        for layer in model.layers:
            layer.quantized = (None, None, None, None)


def test_tiny_without_the_kernel_uses_transposed_weights(tiny, tiny_model_dir, monkeypatch):
    """Without the few-rows kernel (no compiler), 1-3 rows multiply by [in, out] weight copies."""
    monkeypatch.setattr(cpu_ops, "has_kernels", lambda dtype: False)
    runner = ModelRunner(tiny_model_dir, dtype="float32", kv_cache_bytes=4 << 20, block_size=BLOCK_SIZE)
    model = runner.model
    assert model.lm_head_t is not None and all(layer.transposed is not None for layer in model.layers)
    assert model._layout(3) == "transposed"
    torch.testing.assert_close(model.layers[0].transposed[2], model.layers[0].gate_up.t())
    few_row_steps_match_hf(runner, tiny[1], 4)


@pytest.mark.skipif(not CAN_PREPACK, reason="torch built without oneDNN")
def test_onednn_linear_matches_f_linear():
    # Prepacked and plain weights, with and without bias, on a non-contiguous input, for the row
    # counts the model uses.
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen)
    bias = torch.randn(48, generator=gen)
    packed = prepack(weight)
    for num_rows in (0, 1, 4, 64, 300):
        x = torch.randn(40, num_rows, generator=gen).t()  # [num_rows, 40], transposed strides
        for b in (None, bias):
            expected = torch.nn.functional.linear(x, weight, b)
            for w in (packed, weight):
                torch.testing.assert_close(onednn_linear(x, w, b), expected, atol=1e-5, rtol=1e-5)


def test_spans_of_few_tokens_take_the_one_op_layers_and_match_hf(tiny, monkeypatch):
    """Steps of at most 4 tokens with spans of several (a speculative verification's 1 + K, a
    short prompt chunk) attend token by token as decode rows and run the one-op decode layers;
    every token's logits equal HF's at its position, across a block boundary, spans mixed with
    single decodes, and the KV the span stored serves the next steps."""
    runner, hf = tiny
    one_op_calls = []
    original = cpu_ops.few_rows_decode_layers
    monkeypatch.setattr(
        cpu_ops, "few_rows_decode_layers", lambda *a, **k: one_op_calls.append(1) or original(*a, **k)
    )
    rng = np.random.default_rng(11)
    builder = PlanBuilder()
    histories = {
        0: random_ids(rng, BLOCK_SIZE - 2, runner.vocab_size),
        1: random_ids(rng, 7, runner.vocab_size),
    }
    runner_logits(runner, builder, [(i, h, True) for i, h in histories.items()])
    for spans in ([(0, 3), (1, 1)], [(0, 2)], [(1, 2), (0, 2)], [(0, 4)], [(1, 1), (0, 1)], [(1, 3)]):
        chunks = []
        for seq, count in spans:
            tokens = random_ids(rng, count, runner.vocab_size)
            histories[seq] += tokens
            chunks.append((seq, tokens, True))
        arrays, header = builder.plan(chunks)
        runner.validate(arrays, header)
        metas = runner.model.prepare(arrays, header.num_tokens, header.num_seqs)
        assert metas[0].is_all_decode and metas[0].prefills == ()
        calls_before = len(one_op_calls)
        ids = torch.from_numpy(arrays["input_ids"].astype(np.int64))
        logits = runner.model.forward(ids, metas, runner.kv_cache, torch.arange(header.num_tokens))
        assert len(one_op_calls) == calls_before + 1
        with torch.inference_mode():
            expected = {seq: hf(torch.tensor([histories[seq]])).logits[0].float() for seq, _ in spans}
        token = 0
        for seq, count in spans:
            for offset in range(count):
                position = len(histories[seq]) - count + offset
                torch.testing.assert_close(logits[token], expected[seq][position], atol=1e-4, rtol=1e-4)
                token += 1


def test_tiny_chunked_prefill_equals_one_step(tiny):
    runner, _ = tiny
    rng = np.random.default_rng(1)
    ids = random_ids(rng, 50, runner.vocab_size)
    whole = runner_logits(runner, PlanBuilder(), [(0, ids, True)])
    builder = PlanBuilder()
    other = random_ids(rng, 9, runner.vocab_size)
    runner_logits(runner, builder, [(1, other, False), (0, ids[:7], False)])
    runner_logits(runner, builder, [(0, ids[7:23], False), (1, [5], False)])
    chunked = runner_logits(runner, builder, [(1, [6], False), (0, ids[23:], True)])
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-5, rtol=1e-5)


def test_tiny_execute_results(tiny):
    runner, hf = tiny
    rng = np.random.default_rng(2)
    prompts = [random_ids(rng, n, runner.vocab_size) for n in (3, 20)]
    builder = PlanBuilder()
    arrays, header = builder.plan([(0, prompts[0], True), (1, prompts[1][:10], False)])
    arrays["num_logprobs"][:] = 3
    header = StepHeader(step_id=1, num_tokens=header.num_tokens, num_seqs=2, max_top_logprobs=3)
    result = runner.execute(arrays, header)
    expected = hf_last_logits(hf, prompts[0]).log_softmax(-1)
    assert result["sampled_ids"][0] == int(expected.argmax())
    assert result["sampled_ids"][1] == -1
    assert result["top_ids"].shape == (2, 3)
    np.testing.assert_allclose(result["sampled_logprobs"][0], float(expected.max()), atol=1e-4)
    np.testing.assert_array_equal(result["top_ids"][0], expected.topk(3).indices.numpy())


def test_invalid_plans_raise(tiny):
    runner, _ = tiny
    arrays, header = PlanBuilder().plan([(0, [1, 2, 3], True)])
    bad_block = {k: v.copy() for k, v in arrays.items()}
    bad_block["block_tables"][0, 0] = runner.num_kv_blocks
    with pytest.raises(InvalidPlan, match="block"):
        runner.execute(bad_block, header)
    bad_token = {k: v.copy() for k, v in arrays.items()}
    bad_token["input_ids"][1] = runner.vocab_size
    with pytest.raises(InvalidPlan, match="token"):
        runner.execute(bad_token, header)
    assert runner.execute(arrays, header)["sampled_ids"][0] >= 0  # still serves after a bad plan


def test_tiny_placeholders_decode_the_previous_samples(tiny):
    """Decodes planned ahead (placeholder inputs) give the tokens of decodes with explicit ids,
    with the rows out of plan order and a chunked prompt that samples late."""
    runner, _ = tiny
    rng = np.random.default_rng(4)
    prompts = {5: random_ids(rng, 9, runner.vocab_size), 0: random_ids(rng, 20, runner.vocab_size)}
    late = random_ids(rng, 30, runner.vocab_size)  # row 2: prefilled in two chunks

    def run(explicit: bool) -> list[list[int]]:
        builder = PlanBuilder()
        sampled: list[list[int]] = []
        last: dict[int, int] = {}
        chunks = [(row, p, True) for row, p in prompts.items()] + [(2, late[:16], False)]
        for step in range(6):
            result = runner.execute(*builder.plan(chunks))["sampled_ids"]
            sampled.append(result.tolist())
            for (row, _, is_sampled), token in zip(chunks, result.tolist(), strict=True):
                if is_sampled:
                    last[row] = token
            rows = [row for row, _, _ in chunks]
            chunks = [
                (row, [last[row] if explicit else PLACEHOLDER_TOKEN], True) for row in rows if row in last
            ]
            if step == 0:
                chunks.append((2, late[16:], True))
        return sampled

    assert run(explicit=False) == run(explicit=True)


def test_invalid_placeholders_are_refused(tiny):
    runner, _ = tiny
    builder = PlanBuilder()
    runner.execute(*builder.plan([(3, [10, 11, 12], True), (4, [13, 14], False)]))
    refused = {
        "no sample of its row": [(4, [PLACEHOLDER_TOKEN], True)],  # row 4 computed but did not sample
        "a row never seen": [(9, [PLACEHOLDER_TOKEN], True)],
        "not the sampled position": [(3, [15, PLACEHOLDER_TOKEN], True)],
    }
    for what, chunks in refused.items():
        arrays, header = PlanBuilder().plan(chunks)
        try:
            runner.execute(arrays, StepHeader(1, header.num_tokens, header.num_seqs, 0))
        except InvalidPlan as exc:
            assert "placeholder" in str(exc), what
        else:
            pytest.fail(f"a placeholder with {what} was accepted")
    arrays, header = builder.plan([(3, [PLACEHOLDER_TOKEN], True)])
    with pytest.raises(InvalidPlan, match="placeholder"):  # one step too late
        runner.execute(arrays, StepHeader(2, header.num_tokens, header.num_seqs, 0))
    bad = {k: v.copy() for k, v in arrays.items()}
    bad["rows"][0] = runner.max_num_seqs
    with pytest.raises(InvalidPlan, match="row"):
        runner.execute(bad, header)
    bad = {k: v.copy() for k, v in arrays.items()}
    bad["input_ids"][0] = -3
    with pytest.raises(InvalidPlan, match="token id"):
        runner.execute(bad, header)
    bad["input_ids"][0] = DRAFT_TOKEN
    with pytest.raises(InvalidPlan, match="a token to draft, for a worker without a draft model"):
        runner.execute(bad, header)
    bad = {k: v.copy() for k, v in arrays.items()}
    bad["history_offsets"][1], bad["history_ids"] = 1, np.array([PLACEHOLDER_TOKEN], np.int32)
    bad["repetition_penalty"][0] = 1.5
    with pytest.raises(InvalidPlan, match="history"):
        runner.execute(bad, header)
    # Still serving, and the placeholder of the right step is filled in.
    assert runner.execute(arrays, header)["sampled_ids"][0] >= 0


def test_plans_that_do_not_match_the_spec_are_refused(tiny):
    """A slot lacking an array, or with one of the wrong dtype or shape, fails the step (naming
    the array) before anything runs; the runner keeps serving."""
    runner, _ = tiny
    arrays, header = PlanBuilder().plan([(0, [10, 11, 12], True)])
    cases = {
        "'seq_lens' is missing": {k: v for k, v in arrays.items() if k != "seq_lens"},
        "'seeds' is int32, expected int64": {**arrays, "seeds": arrays["seeds"].astype(np.int32)},
        "'positions' has shape": {**arrays, "positions": arrays["positions"][:2]},
        "'bias_ids' has shape": {**arrays, "bias_offsets": np.array([0, 2], np.int32)},
    }
    for message, bad in cases.items():
        with pytest.raises(InvalidPlan, match=message):
            runner.execute(bad, header)
    assert runner.execute(arrays, header)["sampled_ids"][0] >= 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tiny_half_precision_close_to_hf(tiny_model_dir, tiny, dtype):
    """Half precision, both the GEMV path (1 row) and the upcast GEMM path (many rows)."""
    _, hf = tiny
    runner = ModelRunner(tiny_model_dir, dtype=dtype, kv_cache_bytes=1 << 20)
    rng = np.random.default_rng(3)
    ids = random_ids(rng, 24, runner.vocab_size)
    builder = PlanBuilder()
    prefill = runner_logits(runner, builder, [(0, ids, True)])
    ids.append(7)
    decode = runner_logits(runner, builder, [(0, [7], True)])
    for logits, history in ((prefill[0], ids[:-1]), (decode[0], ids)):
        expected = hf_last_logits(hf, history)
        assert torch.nn.functional.cosine_similarity(logits, expected, dim=0) > 0.999
        torch.testing.assert_close(logits, expected, atol=0.05, rtol=0.05)


def bitmask_allowing(allowed: list[list[int]], vocab_size: int) -> np.ndarray:
    """Packed int32 bitmask rows (bit t % 32 of word t // 32), one per list of allowed tokens."""
    bits = np.zeros((len(allowed), -(-vocab_size // 32) * 32), np.uint8)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_grammar_bitmask_restricts_only_its_rows(tiny):
    """Plan row 1 of 3 may only sample the tokens its bitmask row allows (none of them the token
    it samples unconstrained); the other rows sample exactly what they do without a mask."""
    runner, _ = tiny
    chunks = [(0, [10, 11, 12], True), (1, [13, 14], True), (2, [15, 16, 17, 18], True)]
    arrays, header = PlanBuilder().plan(chunks)
    free = runner.execute(arrays, header)["sampled_ids"]
    allowed = [t for t in (3, 77, 501) if t != free[1]]
    grammar = {
        "grammar_rows": np.array([1], np.int32),
        "grammar_bitmask": bitmask_allowing([allowed], runner.vocab_size),
    }
    arrays, header = PlanBuilder().plan(chunks)
    masked = runner.execute({**arrays, **grammar}, header)["sampled_ids"]
    assert masked[1] in allowed
    assert masked[0] == free[0] and masked[2] == free[2]


def test_bad_grammar_arrays_are_refused_naming_them(tiny):
    runner, _ = tiny
    arrays, header = PlanBuilder().plan([(0, [10, 11], True), (1, [12, 13, 14], False)])
    mask = bitmask_allowing([[5]], runner.vocab_size)
    cases = {
        "must come together": {**arrays, "grammar_rows": np.array([0], np.int32)},
        "'grammar_bitmask' has shape": {
            **arrays,
            "grammar_rows": np.array([0], np.int32),
            "grammar_bitmask": mask[:, :-1],
        },
        "grammar_rows must be indices below 2": {
            **arrays,
            "grammar_rows": np.array([2], np.int32),
            "grammar_bitmask": mask,
        },
        "once per position it samples": {  # twice, but it verifies no proposals
            **arrays,
            "grammar_rows": np.array([0, 0], np.int32),
            "grammar_bitmask": np.concatenate((mask, mask)),
        },
        "grammar_rows names a row that samples nothing": {
            **arrays,
            "grammar_rows": np.array([1], np.int32),
            "grammar_bitmask": mask,
        },
    }
    for message, bad in cases.items():
        with pytest.raises(InvalidPlan, match=message):
            runner.execute(bad, header)
    good = {**arrays, "grammar_rows": np.array([0], np.int32), "grammar_bitmask": mask}
    assert runner.execute(good, header)["sampled_ids"][0] == 5
