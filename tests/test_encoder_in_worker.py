"""`encoder.in_worker`: no encoder stage, the worker of engine group 0 serves encoder 0 between
its steps (the baseline of benchmarks/encoder_bench.py). Through a whole run, chats with images
give HF's greedy tokens as they do through the encoder stage (tests/test_image_chat.py), the
embeddings are in the same shared-memory cache, and no encoder stage runs; a run that cannot
have it is refused at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ipc.embedding_cache import EmbeddingCache
from services.common.images import ImageRules, open_image, pixels_key
from services.stage import read_run_info, run_endpoints
from tests.conftest import REPO_ROOT
from tests.harness import assert_clean, brigade_run, stage_processes
from tests.test_e2e import gateway_url
from tests.test_image_chat import assert_hfs, hf_greedy, png, served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_worker_serves_the_encoder_and_image_chats_give_hfs_tokens(
    tiny_gemma3_vlm_dir: Path, tmp_path: Path
) -> None:
    import openai

    image_a, image_c = png(50, 37, seed=0), png(30, 45, seed=2)
    one_image = [("user", [image_a, "What is in this picture?"])]
    two_turns = [
        ("user", ["Look:", image_a]),
        ("assistant", ["Noise."]),
        ("user", [image_c, "And this one?"]),
    ]
    expected = {
        "one": hf_greedy(tiny_gemma3_vlm_dir, one_image),
        "two": hf_greedy(tiny_gemma3_vlm_dir, two_turns),
    }
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={tiny_gemma3_vlm_dir}", "model.dtype=float32", "model.max_model_len=256",
        "encoder.in_worker=true", "gateway.served_model_name=tiny",
    )  # fmt: skip
    with brigade_run(run_dir, *overrides) as run:
        run_id = read_run_info(run_dir).run_id
        kinds = {row["kind"] for row in run.read_status()}
        assert "encoder" not in kinds and "gpu_worker" in kinds, kinds
        api = openai.OpenAI(base_url=gateway_url(run), api_key="none", timeout=300, max_retries=0)
        assert_hfs(served(api, one_image), expected["one"])
        assert_hfs(served(api, two_turns), expected["two"])

        # Encoder 0's cache, made by the worker: it holds the image, and a repeat finds it there.
        cache = EmbeddingCache.attach(run_endpoints(run_dir, read_run_info(run_dir)).embedding_cache(0))
        key_a = pixels_key(ImageRules.from_dir(tiny_gemma3_vlm_dir).pixels(open_image(image_a, 1 << 20)))
        where_a = cache.held().get(key_a)
        assert where_a is not None
        assert_hfs(served(api, one_image), expected["one"])
        assert cache.held()[key_a] == where_a
        cache.close()
    # The worker's cache is unlinked with the run, as an encoder stage's is.
    assert_clean(run_dir, run_id)


def test_the_encoder_in_the_worker_for_a_model_that_reads_no_images_is_refused_at_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "supervisor.py", "--config", "configs/default.yaml", "--run-dir", str(run_dir),
         "--set", f"model.path={tiny_model_dir}", "--set", "encoder.in_worker=true"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert "encoder.in_worker is true, but" in done.stderr and "reads no images" in done.stderr
    assert "set it to false" in done.stderr
    assert not stage_processes(run_dir)
