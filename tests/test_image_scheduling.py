"""The scheduler's side of images (issue 36): an image's tokens attend to each other both ways, so
each image computes whole in one prefill chunk (and a prefix-cache hit never ends inside one);
its image tokens all have one id, so its KV blocks are keyed by the image's content key too; and
the step plan names each image's embeddings."""

from __future__ import annotations

import numpy as np

from ipc import messages as m
from ipc.step_plan import STEP_PLAN, Dim
from services.scheduler.core import Scheduler
from services.scheduler.plan import build_plan
from services.scheduler.request import Request
from tests.test_scheduler_core import FakeExecutor, drive, engine_params, small_config

IMAGE_TOKEN = 39


def image(start: int, num_tokens: int, key: bytes, slot: int = 0) -> m.PromptImage:
    return m.PromptImage(start, num_tokens, 0, m.SlotRef(slot, 2), key.ljust(16, b"."))


def image_request(rid: str, prompt: list[int], images: list[m.PromptImage]) -> Request:
    tokens = np.array(prompt, np.int32)
    for each in images:
        tokens[each.start : each.start + each.num_tokens] = IMAGE_TOKEN
    return Request(rid, 0, tokens, engine_params(seed=7, max_tokens=2, ignore_eos=True), images=images)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, IMAGE_TOKEN, length).tolist()


def test_chunks_never_split_an_image_and_the_plan_names_each_image() -> None:
    sched = Scheduler(small_config(max_num_batched_tokens=32))
    executor = FakeExecutor(sched)
    images = [image(20, 16, b"first"), image(70, 16, b"second", slot=5)]
    sched.add(image_request("r", prompt_of(100), images))
    chunks, planned = [], []
    while not (step := sched.schedule()).num_decodes:
        start, n = int(step.starts[0]), int(step.num_new_tokens[0])
        chunks.append((start, n))
        header, arrays = build_plan(step, 0, 16)
        STEP_PLAN.check(arrays, {Dim.TOKENS: header.num_tokens, Dim.ROWS: header.num_seqs, Dim.IMAGE_KEY: 16})
        for j, first in enumerate(arrays.get("image_starts", np.array([], np.int32)).tolist()):
            planned.append((start + first, int(arrays["image_slots"][j]), arrays["image_keys"][j].tobytes()))
            group = arrays["image_groups"][first : first + 16]
            assert (group == j).all() and (arrays["image_groups"] == j).sum() == 16
            assert (arrays["input_ids"][first : first + 16] == IMAGE_TOKEN).all()
        sched.update(step, *executor.run(step))
    sched.update(step, *executor.run(step))
    # Cut before each image where the 32-token budget would have ended inside it.
    assert chunks == [(0, 20), (20, 32), (52, 18), (70, 30)]
    assert planned == [(20, 0, images[0].key), (70, 5, images[1].key)]
    drive(sched, executor)


def test_prefix_cache_keys_image_blocks_by_the_image() -> None:
    sched = Scheduler(small_config(max_num_batched_tokens=512))
    executor = FakeExecutor(sched)
    prompt = prompt_of(80)
    # The image spans blocks 1 and 2 (positions 24..40, 16-token blocks).
    sched.add(image_request("a", prompt, [image(24, 16, b"cat")]))
    drive(sched, executor)

    def first_chunk(rid: str, key: bytes, prompt: list[int] = prompt) -> int:
        sched.add(image_request(rid, prompt, [image(24, 16, key)]))
        step = sched.schedule()
        assert step is not None
        start = int(step.starts[0])
        sched.update(step, *executor.run(step))
        drive(sched, executor)
        return start

    # Another image in the same place: only the block before it is shared.
    assert first_chunk("b", b"dog") == 16
    # The same image: every full block is shared but the last (its last token is computed).
    assert first_chunk("c", b"cat") == 64
    # The same image, then other text within the image's second block: the hit would end inside
    # the image (at 32), so it stops at the block before it.
    assert first_chunk("d", b"cat", prompt[:32] + prompt_of(48, seed=1)) == 16


def reference_mrope(length: int, images: list[m.PromptImage]) -> np.ndarray:
    """[3, length] M-RoPE positions as Qwen2.5-VL's get_rope_index makes them, token by token:
    text one apart on all axes; an image's grid from the next position, its rows and columns on
    the height and width axes; the text after it from there + max(rows, columns)."""
    out, current, position = [], 0, 0
    starts = {each.start: each for each in images}
    while position < length:
        each = starts.get(position)
        if each is None:
            out.append((current, current, current))
            current, position = current + 1, position + 1
            continue
        rows = each.num_tokens // each.grid_width
        out += [
            (current, current + k // each.grid_width, current + k % each.grid_width)
            for k in range(each.num_tokens)
        ]
        current, position = current + max(rows, each.grid_width), position + each.num_tokens
    return np.array(out).T


def test_mrope_positions_survive_chunks_prefix_hits_preemption_and_resubmission() -> None:
    """The scheduler's rope deltas and image grids give the worker's M-RoPE positions
    (services/gpu_worker/attention.py mrope_positions) of every token it plans, prompt and
    outputs, as one whole pass gives them: across chunks cut between images, from a
    prefix-cache hit, after a preemption recomputes, and for a resubmission with outputs."""
    from services.gpu_worker.attention import mrope_positions

    sched = Scheduler(small_config(max_num_batched_tokens=32))
    executor = FakeExecutor(sched)
    # A 4x4 grid (16 tokens in 4 positions) and a 2x6 one (12 tokens in 6).
    images = [
        m.PromptImage(20, 16, 0, m.SlotRef(0, 2), b"first".ljust(16, b"."), 4),
        m.PromptImage(70, 12, 0, m.SlotRef(1, 2), b"second".ljust(16, b"."), 6),
    ]
    prompt = image_request("x", prompt_of(100), images).prompt_ids.tolist()
    expected = reference_mrope(100 + 8, images)
    seen: dict[str, dict[int, int]] = {}  # each request's planned positions, in the order first planned

    def run(steps: int = 10_000) -> None:
        for _ in range(steps):
            step = sched.schedule()
            if step is None:
                return
            header, arrays = build_plan(step, 0, 16)
            got = mrope_positions(arrays, header.num_tokens, header.num_seqs)
            if got is None:  # neither array: every axis the plain position
                got = np.repeat(arrays["positions"][None], 3, axis=0)
            qsl = arrays["query_start_loc"]
            for i, req in enumerate(step.seqs):
                for k in range(int(qsl[i]), int(qsl[i + 1])):
                    position = int(arrays["positions"][k])
                    assert tuple(got[:, k]) == tuple(expected[:, position]), (req.request_id, position)
                    seen.setdefault(req.request_id, {}).setdefault(
                        position, len(seen.get(req.request_id, {}))
                    )
            sched.update(step, *executor.run(step))

    def add(rid: str, output_ids: list[int] | None = None) -> None:
        params = engine_params(seed=7, max_tokens=8 - len(output_ids or []), ignore_eos=True)
        sched.add(Request(rid, 0, prompt, params, output_ids=output_ids, images=images))

    add("whole")
    run()
    add("hit")  # the same prompt and images: most of it from the prefix cache
    run(steps=2)
    sched.preempt_all()  # recomputes from scratch
    run()
    add("resubmitted", output_ids=[5, 6, 7])
    run()
    assert sched.num_preemptions > 0
    assert sorted(seen["whole"]) == list(range(107))  # every prompt token and output but the last
    hit_order = sorted(seen["hit"], key=seen["hit"].get)
    assert hit_order[0] == 96 and 0 in seen["hit"]  # a prefix hit, then recomputed from the start
    assert 102 in seen["resubmitted"]  # an output token recomputed in the prefill
