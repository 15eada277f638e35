"""Autoscaling a real run on the local backend (supervision/group_scaler.py): a burst of requests
adds an engine group, which serves, and idling gives it back; every request's greedy text equals
a fixed single-group run's, and each decision is in the audit log and in /metrics."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import Client
from tests.harness import assert_clean, brigade_run, free_port
from tests.test_reload import wait_for_stages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Long enough that a burst's requests are still waiting when the policy next samples the load on a
# loaded host (at 64 a CI run once saw the whole burst served before any sample showed it waiting).
NEW_TOKENS = 192
BURST = range(8)  # at two running sequences per group, six wait: three groups' worth at two each
AFTER = range(8, 16)  # sent once the second group is up
# Two sequences per batch so that a burst waits; one thread per worker so that the host holds two.
COMMON = ("model.dtype=float32", "model.max_model_len=512", "engine.kv_cache_mib=64", "engine.threads=1",
          "engine.max_num_seqs=2", "supervisor.heartbeat_interval_s=0.2", "supervisor.drain_timeout_s=1")  # fmt: skip
# Removing waits 30 s after the change: the requests sent once the new group is up reach it first.
AUTOSCALE = ("autoscale.enabled=true", "autoscale.max_groups=2", "autoscale.target_waiting=2",
             "autoscale.scale_up_cooldown_s=0", "autoscale.scale_down_window_s=2",
             "autoscale.scale_down_cooldown_s=30")  # fmt: skip


class Streams:
    """Greedy streams of the prompts `request {i}:` running in threads; `texts()` waits for them."""

    def __init__(self, run_dir: Path, indices: range) -> None:
        self.results: dict[int, str] = {}
        self.threads = [threading.Thread(target=self.one, args=(run_dir, i), daemon=True) for i in indices]
        for thread in self.threads:
            thread.start()

    def one(self, run_dir: Path, i: int) -> None:
        with Client(run_dir, failover_after=3.0, unavailable_after=120.0) as client:
            deltas = client.stream(
                f"request {i}:", max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=300
            )
            self.results[i] = "".join(delta.text for delta in deltas)

    def texts(self) -> dict[int, str]:
        for thread in self.threads:
            thread.join(300)
        assert len(self.results) == len(self.threads), "a request did not complete"
        return self.results


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def autoscale_events(run_dir: Path) -> list[dict]:
    lines = (run_dir / "audit.log").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["event"] == "autoscale"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two engine groups of one thread need two cores")
def test_a_burst_adds_an_engine_group_and_idling_gives_it_back(tmp_path: Path, tiny_model_dir: Path) -> None:
    common = (f"model.path={tiny_model_dir}", *COMMON)
    with brigade_run(tmp_path / "fixed", *common):
        reference = Streams(tmp_path / "fixed", range(16)).texts()
    run_dir = tmp_path / "run"
    port = free_port()
    with brigade_run(run_dir, *common, *AUTOSCALE, f"supervisor.metrics_port={port}") as run:
        burst = Streams(run_dir, BURST)
        wait_for_stages(run, tokenizers=1, detokenizers=1, schedulers=2, timeout=180)
        after = Streams(run_dir, AFTER)
        assert {**burst.texts(), **after.texts()} == reference
        samples = scrape(port)
        assert metric(samples, "brigade:request_queue_time_seconds_count", engine="1") > 0  # group 1 served
        assert metric(samples, "brigade:autoscale_decisions_total", direction="up") == 1
        assert metric(samples, "brigade:engine_groups") == 2

        wait_for_stages(run, tokenizers=1, detokenizers=1, schedulers=1, timeout=180)  # idle: back to one
        up, down = autoscale_events(run_dir)
        assert (up["direction"], up["current"], up["target"], up["groups"], up["error"]) == (
            "up",
            1,
            2,
            2,
            "",
        )
        assert up["loads"][0]["waiting"] > 2 and up["needed"]["waiting"] > 1, up  # the burst's queue
        assert (down["direction"], down["current"], down["target"], down["groups"]) == ("down", 2, 1, 1)
        assert all(load["waiting"] == 0 for load in down["loads"]), down
        deadline = time.monotonic() + 30
        while metric(samples := scrape(port), "brigade:engine_groups") != 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert metric(samples, "brigade:autoscale_decisions_total", direction="down") == 1
        assert metric(samples, "brigade:engine_groups_target") == 1
        assert Streams(run_dir, range(4)).texts() == {
            i: reference[i] for i in range(4)
        }  # one group serves on
    assert run.process.returncode == 0
    assert_clean(run_dir)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two engine groups of one thread need two cores")
def test_slow_first_tokens_alone_add_an_engine_group(tmp_path: Path, tiny_model_dir: Path) -> None:
    """autoscale.target_ttft_s: the schedulers' heartbeats carry their recent TTFT p90, and a
    target no request can meet adds a group when nothing else asks for one (nothing waits)."""
    run_dir = tmp_path / "run"
    ttft_only = ("autoscale.enabled=true", "autoscale.max_groups=2", "autoscale.target_waiting=1000",
                 "autoscale.target_ttft_s=0.0001", "autoscale.scale_up_cooldown_s=0",
                 "autoscale.scale_down_cooldown_s=600")  # fmt: skip
    with brigade_run(run_dir, f"model.path={tiny_model_dir}", *COMMON, *ttft_only) as run:
        assert len(Streams(run_dir, range(1)).texts()) == 1
        wait_for_stages(run, tokenizers=1, detokenizers=1, schedulers=2, timeout=180)
        deadline = time.monotonic() + 30  # the audit line follows the change it records
        while not (events := autoscale_events(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        (up,) = events
        assert (up["direction"], up["current"], up["target"], up["error"]) == ("up", 1, 2, ""), up
        assert up["reason"].startswith("ttft needs"), up
        assert up["loads"][0]["waiting"] == 0 and up["loads"][0]["ttft_s"] > 0.0001, up
        assert up["needed"]["ttft"] > 1 > up["needed"]["waiting"], up
    assert run.process.returncode == 0
    assert_clean(run_dir)
