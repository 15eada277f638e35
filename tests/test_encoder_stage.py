"""The encoder stage in a real run: supervised like every stage (status, restarts), it answers a
tokenizer's request for images' embeddings with where they are in its shared-memory cache, and
they are HF's get_image_features of HF's processed pixels; a bad image is refused by name and the
stage goes on; killed, it is restarted and finds its cache still there."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from PIL import Image

from ipc import messages as m
from ipc.codec import ENCODER_REPLY, ENCODER_REQUEST
from ipc.embedding_cache import EmbeddingCache
from ipc.sockets import DealerSocket
from services.common.images import ImageRules
from services.stage import read_run_info, run_endpoints
from tests.conftest import REPO_ROOT
from tests.harness import assert_clean, brigade_run, stage_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def hf_image_features(model_dir: Path, files: list[bytes]) -> np.ndarray:
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    images = [Image.open(io.BytesIO(data)) for data in files]
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf.model.get_image_features(pixels).pooler_output.numpy()


def encoder_row(run) -> dict:
    return next(row for row in run.read_status() if row["name"] == "encoder-0")


def test_encoder_stage_serves_hfs_embeddings_through_shared_memory(
    tiny_gemma3_vlm_dir: Path, tmp_path: Path
) -> None:
    files = [png(50, 37, seed=0), png(64, 64, seed=1)]
    expected = hf_image_features(tiny_gemma3_vlm_dir, files)
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={tiny_gemma3_vlm_dir}", "model.dtype=float32", "model.max_model_len=256", "encoder.replicas=1",
    )  # fmt: skip
    ctx = zmq.Context()
    with brigade_run(run_dir, *overrides) as run:
        row = encoder_row(run)
        assert row["kind"] == "encoder" and row["state"] == "running"
        endpoints = run_endpoints(run_dir, read_run_info(run_dir))
        encoder = DealerSocket(ctx, endpoints.encoder(0), ENCODER_REPLY, ENCODER_REQUEST)
        cache = EmbeddingCache.attach(endpoints.embedding_cache(0))

        def ask(request_id: str, images: list[bytes]) -> m.ImagesEncoded:
            assert encoder.send(m.EncodeImages(request_id, images))
            reply = encoder.recv(timeout=60)
            assert reply is not None and reply.request_id == request_id
            return reply

        first = ask("r1", files)
        assert not first.error
        got = [cache.read(ref, key) for ref, key in zip(first.refs, first.keys, strict=True)]
        np.testing.assert_allclose(np.stack(got), expected, rtol=1e-4, atol=1e-4)

        truncated = ask("r2", [files[0], files[1][: len(files[1]) // 2]])
        assert "images[1]" in truncated.error and "truncated or corrupt" in truncated.error
        not_an_image = ask("r3", [b"GIF89a but not really"])
        assert "images[0]" in not_an_image.error

        os.kill(row["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while (now := encoder_row(run))["restarts"] < 1 or now["state"] != "running":
            assert time.monotonic() < deadline, f"encoder-0 not restarted: {now}"
            time.sleep(0.2)
        assert now["pid"] != row["pid"]
        # The restarted encoder kept the cache: the same images are where they were, not recomputed.
        again = ask("r4", files)
        assert again.refs == first.refs and again.keys == first.keys
        cache.close()
        encoder.close()
    ctx.term()
    assert_clean(run_dir)


def test_an_encoder_for_a_model_that_reads_no_images_is_refused_at_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir),
         "--set", f"model.path={tiny_model_dir}", "--set", "encoder.replicas=1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert "encoder.replicas is 1, but" in done.stderr and "reads no images" in done.stderr
    assert not stage_processes(run_dir)


def test_an_encoder_killed_mid_request_loses_nothing(tiny_gemma3_vlm_dir: Path, tmp_path: Path) -> None:
    """The tokenizer's encoder client against a real run whose encoder is killed holding the
    request (stopped first, so that it cannot answer before the kill): the client asks again, the
    restarted encoder answers, and the embeddings are HF's."""
    from services.tokenizer.encoders import EncoderClient

    files = [png(40, 30, seed=5), png(30, 40, seed=6)]
    expected = hf_image_features(tiny_gemma3_vlm_dir, files)
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={tiny_gemma3_vlm_dir}", "model.dtype=float32", "model.max_model_len=256", "encoder.replicas=1",
    )  # fmt: skip
    ctx = zmq.Context()
    with brigade_run(run_dir, *overrides) as run:
        endpoints = run_endpoints(run_dir, read_run_info(run_dir))
        client = EncoderClient(ctx, endpoints, 1, resend_after_s=1.0, deadline_s=120.0)
        pid = encoder_row(run)["pid"]
        os.kill(pid, signal.SIGSTOP)
        client.ask("r1", files, time.monotonic())
        time.sleep(0.5)  # the request is in the stopped encoder's socket
        os.kill(pid, signal.SIGKILL)
        poller = zmq.Poller()
        for socket in client.sockets:
            poller.register(socket, zmq.POLLIN)
        answers = []
        deadline = time.monotonic() + 150
        while not answers:
            assert time.monotonic() < deadline, "no answer"
            poller.poll(100)
            answers = client.receive() + client.tick(time.monotonic())
        assert [a.request_id for a in answers] == ["r1"] and not answers[0].error
        assert client.num_resent >= 1 and encoder_row(run)["restarts"] >= 1
        cache = EmbeddingCache.attach(endpoints.embedding_cache(answers[0].encoder))
        got = [cache.read(ref, key) for ref, key in zip(answers[0].refs, answers[0].keys, strict=True)]
        np.testing.assert_allclose(np.stack(got), expected, rtol=1e-4, atol=1e-4)
        # A late second answer to the same request (the resend's) is dropped, not delivered twice.
        assert client.receive() == [] and not client.pending
        cache.close()
        client.close()
    ctx.term()
    assert_clean(run_dir)


def smallest_cache_bytes(model_dir: Path, most_tokens: int) -> int:
    """The bytes of the encoder cache pages (64-byte header + rows x width float32s each, after
    the 64-byte control page) one image of `most_tokens` tokens needs, in pages of the fewest
    tokens a tile takes."""
    page_rows = ImageRules.from_dir(model_dir).fewest_tile_tokens
    width = 64  # the tiny models' language model width
    return 64 + -(-most_tokens // page_rows) * (64 + page_rows * width * 4)


def hf_most_image_tokens(model_dir: Path, family: str) -> int:
    """The image tokens HF's own processor gives a large square image (the most: a square one
    splits into the most tiles, a large one is resized down to the pixel bound)."""
    import transformers

    big = Image.new("RGB", (2000, 2000), (120, 40, 200))
    if family == "smolvlm":
        processor = transformers.SmolVLMImageProcessorPil.from_pretrained(model_dir)
        tiles = processor(images=[[big]], return_tensors="np")["pixel_values"].shape[1]
        config = transformers.AutoConfig.from_pretrained(model_dir)
        vision = config.vision_config
        return tiles * (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    grid = processor(images=[big], return_tensors="np")["image_grid_thw"][0]
    return int(np.prod(grid)) // processor.merge_size**2


@pytest.mark.parametrize("family", ["smolvlm", "qwen25vl"])
def test_an_encoder_cache_too_small_for_the_largest_image_is_refused_at_start(
    family: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """SmolVLM's split image (a grid of tiles and a global one) and Qwen2.5-VL's largest image
    take several pages: a cache of one is refused before any stage starts, naming the smallest
    encoder.cache_bytes, which HF's processor's token count for a large square image gives."""
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    smallest = smallest_cache_bytes(model_dir, hf_most_image_tokens(model_dir, family))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir),
         "--set", f"model.path={model_dir}", "--set", "encoder.replicas=1", "--set", "encoder.cache_bytes=1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert "encoder.cache_bytes=1 cannot hold one of" in done.stderr, done.stderr
    assert f"set encoder.cache_bytes >= {smallest}" in done.stderr, done.stderr
    assert " started " not in done.stderr and "Traceback" not in done.stderr
    assert not stage_processes(run_dir)


def test_the_cache_check_takes_the_smallest_cache_that_holds_the_largest_image(
    tiny_gemma3_vlm_dir: Path, tiny_smolvlm_dir: Path, tiny_idefics3_dir: Path
) -> None:
    """The bound is exact: the smallest cache_bytes passes, a byte less is refused; a Gemma 3
    image (one tile) and an unsplit Idefics3 one fit the one page any cache has."""
    from ipc.config import load_config
    from supervision.preflight import Refused, check_encoders

    def check(model_dir: Path, cache_bytes: int) -> None:
        check_encoders(
            load_config(None, ["encoder.replicas=1", f"encoder.cache_bytes={cache_bytes}"]), model_dir
        )

    smallest = smallest_cache_bytes(tiny_smolvlm_dir, hf_most_image_tokens(tiny_smolvlm_dir, "smolvlm"))
    check(tiny_smolvlm_dir, smallest)
    with pytest.raises(Refused, match=f"encoder.cache_bytes >= {smallest}"):
        check(tiny_smolvlm_dir, smallest - 1)
    check(tiny_gemma3_vlm_dir, 1)
    check(tiny_idefics3_dir, 1)
