"""Hot reload of `encoder.replicas` (issue 36): encoder replicas are added and retired in a live run
like the other stages' replicas, image chats give the same tokens before, between and after, each
replica serves the images whose bytes hash to it, a retired replica's embedding cache stays until
the run ends (then nothing is left), and a reload to or from 0 replicas is refused, not applied."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from client import Client
from services.stage import read_run_info
from services.tokenizer.encoders import preferred_encoder
from tests.conftest import REPO_ROOT
from tests.harness import assert_clean, brigade_run, free_port
from tests.test_autoscale_run import metric, scrape
from tests.test_image_chat import data_url, png

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_TOKENS = 6
# Images whose first-image hashes reach both replicas of two (checked below, so that a change of
# the hash cannot turn the test into one that never uses the second replica).
IMAGES = [png(48 + 4 * i, 40, seed=100 + i) for i in range(6)]


def write_config(path: Path, model_dir: Path, encoders: int) -> None:
    config = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    config["model"].update(path=str(model_dir), dtype="float32", max_model_len=256)
    config["gateway"] = {"replicas": 0}
    config["encoder"] = {"replicas": encoders}
    path.write_text(yaml.safe_dump(config))


def chats(run_dir: Path) -> list[str]:
    """Every image's greedy reply, the chats sent together."""

    def one(image: bytes) -> str:
        with Client(run_dir) as client:
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": "What is in the picture?"},
            ]}]  # fmt: skip
            return client.chat(
                messages, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=120
            ).text

    with ThreadPoolExecutor(len(IMAGES)) as pool:
        return list(pool.map(one, IMAGES))


def answered(port: int, encoder: int) -> float:
    return metric(scrape(port), "brigade:encoder_requests_total", encoder=str(encoder), outcome="answered")


def wait_for_encoders(run, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rows = run.read_status()
        names = sorted(r["name"] for r in rows if r["kind"] == "encoder" and r["state"] == "running")
        if names == [f"encoder-{i}" for i in range(count)] and all(r["state"] == "running" for r in rows):
            return
        assert time.monotonic() < deadline, f"not {count} encoders running: {rows}"
        time.sleep(0.2)


def test_encoder_replicas_change_live_and_images_keep_their_tokens(
    tiny_gemma3_vlm_dir: Path, tmp_path: Path
) -> None:
    assert {preferred_encoder([image], 2) for image in IMAGES} == {0, 1}, "the images should reach both"
    config = tmp_path / "brigade.yaml"
    write_config(config, tiny_gemma3_vlm_dir, encoders=1)
    run_dir = tmp_path / "run"
    port = free_port()
    with brigade_run(run_dir, f"supervisor.metrics_port={port}", config=str(config)) as run:
        run_id = read_run_info(run_dir).run_id
        reference = chats(run_dir)
        assert answered(port, 0) >= len(IMAGES)  # more where a slow answer was asked for again

        write_config(config, tiny_gemma3_vlm_dir, encoders=2)
        wait_for_encoders(run, 2)
        assert chats(run_dir) == reference
        # Each image went to its hash's replica: encoder-1 encoded its share anew (its own cache).
        assert answered(port, 1) >= sum(preferred_encoder([image], 2) for image in IMAGES)

        write_config(config, tiny_gemma3_vlm_dir, encoders=1)
        wait_for_encoders(run, 1)
        assert chats(run_dir) == reference

        write_config(config, tiny_gemma3_vlm_dir, encoders=0)  # images off: needs a restart
        run.wait_for_line("encoder.replicas from 1 to 0 turns images on or off", 60)
        wait_for_encoders(run, 1)
        assert chats(run_dir) == reference
    assert run.process.returncode == 0
    assert_clean(run_dir, run_id)  # encoder-1's cache too, kept past its retirement
