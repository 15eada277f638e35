"""Qwen2.5-VL (issue 36) without processes, against HF transformers on the same random weights:
the image rules give HF's processor output (smart resize, pixel values, image_grid_thw, the image
pad runs of the prompt), the encoder's tower and merger give HF's visual module output, the
worker's M-RoPE positions are HF's get_rope_index ones (whole and chunked, by the scheduler's
rope deltas), and the worker's prefill chunks and decodes give HF's generate tokens."""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc
import pytest
import torch
from PIL import Image

from ipc.embedding_cache import EmbeddingCache
from ipc.endpoints import SHM_PREFIX
from ipc.shm import new_run_id
from services.common.images import ImageError, ImageRules, open_image
from tests.test_image_chat import png

if TYPE_CHECKING:
    from services.encoder.core import EncoderCore

pytestmark = [pytest.mark.timeout(600)]

NEW_TOKENS = 8
# 150x100 is 8x10 patches (20 image tokens, 2x3 windows of 2x2 tokens); 50x37 is scaled up to
# the 4-token minimum (56x84); 300x40 is one row of tokens; 90x200 is taller than wide.
SIZES = ((150, 100), (50, 37), (300, 40), (90, 200))

Turns = list[tuple[str, list[str | bytes]]]


def hf_inputs(model_dir: Path, turns: Turns) -> dict[str, torch.Tensor]:
    """HF's inputs for a chat: the template's text with each <|image_pad|> repeated as
    Qwen2_5_VLProcessor.replace_image_token does it (that processor needs torchvision, which is
    not installed here), tokenized, and the image processor's pixel values and grids."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": role, "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]}
        for role, parts in turns
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [Image.open(io.BytesIO(p)) for _, parts in turns for p in parts if isinstance(p, bytes)]
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    inputs = dict(image_processor(images=images, return_tensors="pt")) if images else {}
    processor = SimpleNamespace(image_processor=image_processor, image_token="<|image_pad|>")
    pieces = text.split("<|image_pad|>")
    text = pieces[0] + "".join(
        Qwen2_5_VLProcessor.replace_image_token(processor, inputs, i) + piece for i, piece in enumerate(pieces[1:])
    )  # fmt: skip
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == image_token).int(),
        **inputs,
    }


def hf_generate(model_dir: Path, turns: Turns) -> tuple[int, list[int], np.ndarray]:
    """HF's prompt length, greedy tokens (its generate) and their logprobs."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    inputs = hf_inputs(model_dir, turns)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.inference_mode():
        out = hf.generate(
            **inputs, do_sample=False, max_new_tokens=NEW_TOKENS, output_scores=True, return_dict_in_generate=True
        )  # fmt: skip
    num_prompt = inputs["input_ids"].shape[1]
    logprobs = np.array([float(torch.log_softmax(s[0], -1).max()) for s in out.scores])
    return num_prompt, out.sequences[0, num_prompt:].tolist(), logprobs


def prompt_of(model_dir: Path, turns: Turns) -> tuple[list[int], list[tuple[int, int]]]:
    """Brigade's prompt for a chat (the tokenizer stage's steps: template, expansion by the
    images' sizes, encoding) and the images' sizes."""
    from services.common.text import Tokenizer

    rules = ImageRules.from_dir(model_dir)
    sizes = [Image.open(io.BytesIO(p)).size for _, parts in turns for p in parts if isinstance(p, bytes)]
    messages = [
        {"role": role, "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]}
        for role, parts in turns
    ]  # fmt: skip
    tokenizer = Tokenizer(model_dir)
    return tokenizer.encode(rules.expand(tokenizer.apply_chat_template(messages), sizes)), sizes


def test_image_rules_and_tower_equal_hfs(tiny_qwen25vl_dir: Path) -> None:
    import transformers
    from transformers import AutoImageProcessor

    from services.encoder.qwen2_vl import Qwen2VLVisionEncoder
    from services.encoder.vision import load_vision_encoder

    rules = ImageRules.from_dir(tiny_qwen25vl_dir)
    encoder = load_vision_encoder(tiny_qwen25vl_dir)
    assert isinstance(encoder, Qwen2VLVisionEncoder)
    processor = AutoImageProcessor.from_pretrained(tiny_qwen25vl_dir)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_qwen25vl_dir, dtype=torch.float32
    )
    for size in SIZES:
        data = png(*size, seed=sum(size))
        (tile,) = rules.tiles(open_image(data, 1 << 20))
        want = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        t, height, width = want["image_grid_thw"][0].tolist()
        assert t == 1 and tile.shape == (3, height * 14, width * 14), size
        assert rules.tile_tokens(size) == [height * width // 4] and rules.tile_grid_width(size) == width // 2
        # The pixels are HF's (to float32 rounding), cut into its patches by the tower.
        got = encoder.patches(torch.from_numpy(tile[None]))[0]
        torch.testing.assert_close(got, want["pixel_values"], rtol=0, atol=1e-6)
        with torch.no_grad():
            expected = hf.model.visual(want["pixel_values"], grid_thw=want["image_grid_thw"]).pooler_output
        embeddings = encoder.encode(torch.from_numpy(tile[None]))[0]
        torch.testing.assert_close(embeddings, expected, rtol=0, atol=1e-4)
    # The windows matter: the tower without them (full attention in every block) is another.
    everywhere = Qwen2VLVisionEncoder(
        encoder.config.__class__(**{**vars(encoder.config), "full_attention_blocks": frozenset(range(4))}),
        {**encoder.w, "patch_embed.proj.weight": encoder.w["patch_embed.proj.weight"].view(32, 3, 2, 14, 14)},
        torch.float32,
    )
    tile = torch.from_numpy(rules.tiles(open_image(png(150, 100, seed=250), 1 << 20))[0][None])
    assert (everywhere.encode(tile) - encoder.encode(tile)).abs().max() > 1e-2

    with pytest.raises(ImageError, match="more than 200 times as long"):
        rules.tile_tokens((4000, 10))


def test_prompt_and_mrope_positions_equal_hfs(tiny_qwen25vl_dir: Path) -> None:
    """The prompt is HF's ids; the worker's 3-D positions, from the plan's image grids and the
    scheduler's per-row rope deltas, are HF's get_rope_index, whether the prompt is one chunk or
    cut between its images; and text alone has plain positions on every axis."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from ipc import messages as m
    from services.gpu_worker.attention import mrope_positions
    from services.scheduler.request import Request

    turns = [("user", [png(150, 100, seed=0), "Compare", png(50, 37, seed=1)]), ("assistant", ["Noise."]),
             ("user", [png(90, 200, seed=2), "And?"])]  # fmt: skip
    prompt, sizes = prompt_of(tiny_qwen25vl_dir, turns)
    inputs = hf_inputs(tiny_qwen25vl_dir, turns)
    assert inputs["input_ids"][0].tolist() == prompt
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen25vl_dir, dtype=torch.float32)
    expected, expected_delta = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    expected = expected[:, 0].numpy()

    rules = ImageRules.from_dir(tiny_qwen25vl_dir)
    image_token = np.array(prompt) == rules.image_token_id
    starts = np.flatnonzero(image_token & ~np.r_[False, image_token[:-1]])
    images = [
        m.PromptImage(int(start), rules.tile_tokens(size)[0], 0, m.SlotRef(0, 2), b"k" * 16, rules.tile_grid_width(size))
        for start, size in zip(starts, sizes, strict=True)
    ]  # fmt: skip
    request = Request("r", 0, prompt, m.SamplingParams(max_tokens=4), images=images)
    assert request.rope_delta(len(prompt)) == int(expected_delta)

    def positions(first: int, end: int) -> np.ndarray:
        """The worker's positions of the chunk [first, end) of the prompt, planned as the
        scheduler plans it (services/scheduler/plan.py)."""
        inside = [image for image in images if first <= image.start < end]
        groups = np.full(end - first, -1, np.int32)
        for g, image in enumerate(inside):
            groups[image.start - first : image.start - first + image.num_tokens] = g
        arrays = {
            "positions": np.arange(first, end, dtype=np.int32),
            "query_start_loc": np.array([0, end - first], np.int32),
            "rope_deltas": np.array([request.rope_delta(first)], np.int32),
            "image_groups": groups,
            "image_starts": np.array([image.start - first for image in inside], np.int32),
            "image_grid_widths": np.array([image.grid_width for image in inside], np.int32),
        }
        got = mrope_positions(arrays, end - first, 1)
        assert got is not None
        return got

    np.testing.assert_array_equal(positions(0, len(prompt)), expected)
    cut = images[1].start  # after the first image, before the second
    np.testing.assert_array_equal(
        np.concatenate([positions(0, cut), positions(cut, len(prompt))], 1), expected
    )
    # A decode continues from the last position + 1 on every axis, by the whole prompt's delta.
    decode = {"positions": np.array([len(prompt)], np.int32), "query_start_loc": np.array([0, 1], np.int32),
              "rope_deltas": np.array([request.rope_delta(len(prompt))], np.int32)}  # fmt: skip
    np.testing.assert_array_equal(mrope_positions(decode, 1, 1), np.full((3, 1), expected.max() + 1))
    assert mrope_positions({"positions": np.arange(5), "query_start_loc": np.array([0, 5])}, 5, 1) is None


@pytest.fixture
def embedding_cache_name() -> Iterator[str]:
    name = f"/{SHM_PREFIX}{new_run_id()}-embeds-0"
    yield name
    posix_ipc.unlink_shared_memory(name)


def serve_chat(
    model_dir: Path,
    cache: EmbeddingCache,
    turns: Turns,
    cut_after_image: int | None,
    mrope: bool = True,
    backend: str | None = None,
) -> tuple[list[int], np.ndarray]:
    """The worker's greedy tokens and logprobs for a chat, in process: the images' embeddings
    put in an encoder's `cache` and read from it by the plan; the prompt prefilled in one chunk,
    or in two cut where image `cut_after_image` starts (the images before it then in the KV
    cache), each row's rope delta as the scheduler gives it (without M-RoPE's arrays where not
    `mrope`), then decodes; on the attention `backend` (None: the device's)."""
    from ipc import messages as m
    from services.common.images import pixels_key
    from services.encoder.vision import load_vision_encoder
    from services.gpu_worker.model_runner import ModelRunner
    from services.scheduler.request import Request
    from tests.test_model import PlanBuilder

    rules = ImageRules.from_dir(model_dir)
    encoder = load_vision_encoder(model_dir)
    prompt, sizes = prompt_of(model_dir, turns)
    files = [p for _, parts in turns for p in parts if isinstance(p, bytes)]
    image_token = np.array(prompt) == rules.image_token_id
    starts = np.flatnonzero(image_token & ~np.r_[False, image_token[:-1]]).tolist()
    images = []
    for start, size, data in zip(starts, sizes, files, strict=True):
        (tile,) = rules.tiles(open_image(data, 1 << 20))
        key = pixels_key(tile)
        ref = cache.put(key, encoder.encode(torch.from_numpy(tile[None]))[0].numpy())
        images.append(
            m.PromptImage(start, rules.tile_tokens(size)[0], 0, ref, key, rules.tile_grid_width(size))
        )
    request = Request("r", 0, prompt, m.SamplingParams(max_tokens=4), images=images)
    runner = ModelRunner(
        model_dir, dtype="float32", kv_cache_bytes=2 << 20, block_size=16,
        embedding_caches=lambda encoder: cache.name, backend=backend,
    )  # fmt: skip
    builder = PlanBuilder(runner.block_size)
    cuts = [0, len(prompt)] if cut_after_image is None else [0, images[cut_after_image].start, len(prompt)]
    for first, end in itertools.pairwise(cuts):
        arrays, header = builder.plan([(0, prompt[first:end], end == len(prompt))])
        arrays.update(chunk_image_arrays(images, first, end, mrope))
        if mrope and request.rope_delta(first):
            arrays["rope_deltas"] = np.array([request.rope_delta(first)], np.int32)
        result = runner.execute(arrays, header)
    tokens, logprobs = [int(result["sampled_ids"][0])], [float(result["sampled_logprobs"][0])]
    for _ in range(NEW_TOKENS - 1):
        arrays, header = builder.plan([(0, tokens[-1:], True)])
        if mrope and request.rope_delta(len(prompt)):
            arrays["rope_deltas"] = np.array([request.rope_delta(len(prompt))], np.int32)
        result = runner.execute(arrays, header)
        tokens.append(int(result["sampled_ids"][0]))
        logprobs.append(float(result["sampled_logprobs"][0]))
    return tokens, np.array(logprobs)


def test_worker_chunks_and_decodes_give_hfs_tokens(
    tiny_qwen25vl_dir: Path, embedding_cache_name: str
) -> None:
    """The worker's Qwen2 with M-RoPE, the images' embeddings read from an encoder's cache by the
    plan: a prefill cut between two images, then decodes, each row's rope delta as the
    scheduler gives it, give HF's generate tokens and logprobs; a text-only prompt (no M-RoPE
    arrays: plain rope) gives HF's too. The plan's M-RoPE arrays on a model without it are refused."""
    from services.gpu_worker.model_runner import InvalidPlan, ModelRunner
    from tests.test_model import PlanBuilder

    rules = ImageRules.from_dir(tiny_qwen25vl_dir)
    cache = EmbeddingCache.create_or_attach(embedding_cache_name, 4, rules.tokens_per_tile, 64)

    def served(turns: Turns, cut_after_image: int | None, mrope: bool = True) -> tuple[list[int], np.ndarray]:
        return serve_chat(tiny_qwen25vl_dir, cache, turns, cut_after_image, mrope)

    chats = {
        "two images, cut between them": ([("user", [png(150, 100, seed=0), "Compare", png(50, 37, seed=1)]),
                                          ("assistant", ["Noise."]), ("user", ["And?"])], 1),
        "one image, one row": ([("user", [png(300, 40, seed=2), "What is it?"])], None),
        "text alone": ([("user", ["What is a picture?"])], None),
    }  # fmt: skip
    for name, (turns, cut) in chats.items():
        _, expected_tokens, expected_logprobs = hf_generate(tiny_qwen25vl_dir, turns)
        tokens, logprobs = served(turns, cut)
        assert tokens == expected_tokens, name
        np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-3, err_msg=name)
    # M-RoPE matters: the images' tokens at plain positions give other logprobs.
    turns, cut = chats["two images, cut between them"]
    assert np.abs(served(turns, cut, mrope=False)[1] - served(turns, cut)[1]).max() > 1e-2
    cache.close()

    # A worker whose model has no M-RoPE refuses its arrays by name.
    runner = ModelRunner(tiny_qwen25vl_dir, dtype="float32", kv_cache_bytes=2 << 20, block_size=16)
    runner.has_mrope = False
    arrays, header = PlanBuilder(runner.block_size).plan([(0, [1, 2, 3], True)])
    with pytest.raises(InvalidPlan, match="rope_deltas or image_grid_widths for a model without M-RoPE"):
        runner.execute({**arrays, "rope_deltas": np.array([-1], np.int32)}, header)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_triton_backend_mrope_gives_hfs_tokens(tiny_qwen25vl_dir: Path, embedding_cache_name: str) -> None:
    """M-RoPE through the Triton rotary kernel (in the interpreter): a prefill cut between two
    images (the first then in the KV cache), then decodes, give HF's generate tokens and logprobs."""
    rules = ImageRules.from_dir(tiny_qwen25vl_dir)
    cache = EmbeddingCache.create_or_attach(embedding_cache_name, 4, rules.tokens_per_tile, 64)
    turns: Turns = [("user", [png(150, 100, seed=0), "Compare", png(50, 37, seed=1)])]
    _, expected_tokens, expected_logprobs = hf_generate(tiny_qwen25vl_dir, turns)
    tokens, logprobs = serve_chat(tiny_qwen25vl_dir, cache, turns, cut_after_image=1, backend="triton")
    assert tokens == expected_tokens
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-3)
    cache.close()


def chunk_image_arrays(images: list, first: int, end: int, mrope: bool = True) -> dict[str, np.ndarray]:
    """The plan's image arrays for the images inside the prompt chunk [first, end), as the
    scheduler writes them (services/scheduler/plan.py _image_arrays); without their grid widths
    where not `mrope`."""
    inside = [image for image in images if first <= image.start < end]
    if not inside:
        return {}
    groups = np.full(end - first, -1, np.int32)
    for g, image in enumerate(inside):
        groups[image.start - first : image.start - first + image.num_tokens] = g
    return {
        "image_groups": groups,
        "image_starts": np.array([image.start - first for image in inside], np.int32),
        "image_encoders": np.zeros(len(inside), np.int32),
        "image_slots": np.array([image.ref.slot for image in inside], np.int32),
        "image_sequences": np.array([image.ref.sequence for image in inside], np.int64),
        "image_keys": np.frombuffer(b"".join(image.key for image in inside), np.uint8).reshape(
            len(inside), -1
        ),
        **(
            {"image_grid_widths": np.array([image.grid_width for image in inside], np.int32)} if mrope else {}
        ),
    }


def test_older_configs_pixel_bounds_win_as_in_hf(tiny_qwen25vl_dir: Path, tmp_path: Path) -> None:
    """A preprocessor config with min_pixels / max_pixels beside its size (as older hub configs
    have them) resizes by those, as HF does; a processor whose patches are not the tower's is refused."""
    import json
    import shutil

    from transformers import AutoImageProcessor

    shutil.copytree(tiny_qwen25vl_dir, tmp_path / "m")
    path = tmp_path / "m" / "preprocessor_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "min_pixels": 28 * 28 * 9, "max_pixels": 28 * 28 * 16}))
    rules = ImageRules.from_dir(tmp_path / "m")
    for size in SIZES:
        grid = AutoImageProcessor.from_pretrained(tmp_path / "m")(
            images=[Image.open(io.BytesIO(png(*size, seed=0)))], return_tensors="pt"
        )["image_grid_thw"][0]
        assert rules.tile_tokens(size) == [int(grid.prod()) // 4], size
    path.write_text(json.dumps({**config, "patch_size": 16}))
    with pytest.raises(ValueError, match="are not the vision tower's"):
        ImageRules.from_dir(tmp_path / "m")


def test_tower_options_it_cannot_run_are_refused_by_name(tiny_qwen25vl_dir: Path) -> None:
    import json

    from services.encoder.qwen2_vl import Qwen2VLVisionConfig

    config = json.loads((tiny_qwen25vl_dir / "config.json").read_text())
    vision = config["vision_config"]
    refused = {
        "hidden_act 'gelu' is not supported": {"hidden_act": "gelu"},
        "in_channels 4 is not supported": {"in_channels": 4},
        "rope_type 'yarn' is not supported": {"rope_parameters": {"rope_type": "yarn"}},
        "window_size 50 is not a multiple": {"window_size": 50},
    }
    for message, change in refused.items():
        with pytest.raises(ValueError, match=message):
            Qwen2VLVisionConfig.from_dict({**config, "vision_config": {**vision, **change}})
    assert Qwen2VLVisionConfig.from_dict(config).full_attention_blocks == {1, 3}


def small_cache_encoder(
    model_dir: Path, cache_name: str
) -> tuple[EncoderCore, Callable[[bytes], np.ndarray]]:
    """An encoder of the model whose cache is 12 pages of its fewest image tokens (4), and an
    image's embeddings as its tower gives them for the image alone."""
    from services.encoder.core import EncoderCore
    from services.encoder.vision import load_vision_encoder

    rules = ImageRules.from_dir(model_dir)
    vision = load_vision_encoder(model_dir)
    cache = EmbeddingCache.create_or_attach(cache_name, 12, rules.fewest_tile_tokens, 64)

    def expected(image: bytes) -> np.ndarray:
        [pixels] = rules.tiles(open_image(image, 1 << 20))
        return vision.encode(torch.from_numpy(pixels[None]))[0].numpy()

    return EncoderCore(vision, rules, cache, 1 << 20), expected


def test_encoder_fits_images_of_different_sizes_in_a_small_cache(
    tiny_qwen25vl_dir: Path, embedding_cache_name: str
) -> None:
    """The encoder's cache in pages of the fewest image tokens: a request's images take the
    pages their sizes need, one whose images cannot all fit is refused naming
    encoder.cache_bytes, and one whose images fit only around each other's pages (a cached image
    of the request in the way of a long enough run) still gets all of them, each its own rows."""
    from ipc import messages as m
    from services.common.images import pixels_key

    core, expected = small_cache_encoder(tiny_qwen25vl_dir, embedding_cache_name)
    cache, rules = core.cache, core.rules
    small, large = png(56, 56, seed=0), png(196, 140, seed=1)  # 4 tokens (1 page), 35 (9 pages)

    refused = core.encode(m.EncodeImages("too many", [large, png(140, 140, seed=2)]))  # 9 + 7 pages
    assert (
        "take 16 pages of 4 image tokens; this encoder's cache holds 12 (encoder.cache_bytes)"
        in refused.error
    )
    # The small image's page between two others: pages 0-4, 5, 6-11.
    cache.put(b"a" * 16, np.zeros((20, 64), np.float32))
    first = core.encode(m.EncodeImages("small", [small]))
    assert first.refs[0].slot == 5
    cache.put(b"b" * 16, np.zeros((24, 64), np.float32))
    both = core.encode(m.EncodeImages("both", [small, large]))
    assert not both.error and core.num_encoded == 2
    for image, image_key, ref in zip((small, large), both.keys, both.refs, strict=True):
        [pixels] = rules.tiles(open_image(image, 1 << 20))
        assert image_key == pixels_key(pixels)
        np.testing.assert_allclose(cache.read(ref, image_key), expected(image), rtol=1e-5, atol=1e-5)
    assert set(cache.held()) == set(both.keys)  # the others were evicted to make the room
    cache.close()


def test_an_encoder_moves_a_requests_cached_image_rather_than_evict_another_requests(
    tiny_qwen25vl_dir: Path, embedding_cache_name: str
) -> None:
    """A request whose new image has no run of pages around its own cached one even with every
    other image evicted, but has one if that cached image moves: it moves (its old ref reads
    None), the least recently used others make the rest of the room, and another request's
    image, not needed for it, stays cached: asked for again, it is found, not encoded."""
    from ipc import messages as m

    core, expected = small_cache_encoder(tiny_qwen25vl_dir, embedding_cache_name)
    cache = core.cache
    small, large, other = png(56, 56, seed=0), png(196, 140, seed=1), png(56, 112, seed=3)  # 1, 9, 2 pages
    cache.put(b"x" * 16, np.zeros((20, 64), np.float32))  # pages 0-4
    first = core.encode(m.EncodeImages("a", [small]))
    cache.put(b"y" * 16, np.zeros((16, 64), np.float32))  # pages 6-9
    b = core.encode(m.EncodeImages("b", [other]))
    assert [first.refs[0].slot, b.refs[0].slot] == [5, 10]
    # The large image's 9 pages: runs of 5 and 6 around page 5 with x, y and b evicted; with the
    # small image moved, evicting x and y (the least recently used) frees pages 0-9.
    both = core.encode(m.EncodeImages("c", [small, large]))
    assert not both.error and core.num_encoded == 3  # small, other, large: small not again
    assert [ref.slot for ref in both.refs] == [9, 0]  # the largest put first
    for image, image_key, ref in zip((small, large), both.keys, both.refs, strict=True):
        np.testing.assert_allclose(cache.read(ref, image_key), expected(image), rtol=1e-5, atol=1e-5)
    assert cache.read(first.refs[0], first.keys[0]) is None
    assert set(cache.held()) == {*both.keys, *b.keys}
    again = core.encode(m.EncodeImages("b again", [other]))
    assert core.num_encoded == 3 and again.refs == b.refs  # a hit, on pages never rewritten
    np.testing.assert_allclose(cache.read(again.refs[0], b.keys[0]), expected(other), rtol=1e-5, atol=1e-5)
    cache.close()


def test_an_encoder_empties_its_cache_when_moving_its_requests_images_is_not_enough(
    tiny_qwen25vl_dir: Path, embedding_cache_name: str
) -> None:
    """A request of 8, 3 and 1 pages in a cache of 12, its 1-page image cached at page 9: around
    it there is no room for the others, and moving it is no better (the least recently used
    image out of the way of the 8-page one frees pages 2-9, which leaves two runs of 2 for the
    3-page one); then the cache holds this request's images alone, packed from page 0, each
    with its own rows, and the moved image's old ref reads None."""
    from ipc import messages as m

    core, expected = small_cache_encoder(tiny_qwen25vl_dir, embedding_cache_name)
    cache = core.cache
    small, eight, three = png(56, 56, seed=0), png(224, 112, seed=4), png(112, 84, seed=5)  # 1, 8, 3 pages
    cache.put(b"x" * 16, np.zeros((8, 64), np.float32))  # pages 0-1
    cache.put(b"q" * 16, np.zeros((28, 64), np.float32))  # pages 2-8
    first = core.encode(m.EncodeImages("a", [small]))
    cache.put(b"t" * 16, np.zeros((8, 64), np.float32))  # pages 10-11
    assert first.refs[0].slot == 9 and cache.find(b"x" * 16) is not None  # q now the least recently used
    request = core.encode(m.EncodeImages("c", [small, eight, three]))
    assert not request.error and core.num_encoded == 3  # small not again
    assert [ref.slot for ref in request.refs] == [11, 0, 8]
    for image, image_key, ref in zip((small, eight, three), request.keys, request.refs, strict=True):
        np.testing.assert_allclose(cache.read(ref, image_key), expected(image), rtol=1e-5, atol=1e-5)
    assert cache.read(first.refs[0], first.keys[0]) is None
    assert set(cache.held()) == set(request.keys)
    cache.close()
