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
