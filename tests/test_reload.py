"""Hot reload: replica counts of tokenizers and detokenizers change live (SIGHUP or a config file
edit) without dropping or changing a single request; unsafe changes are logged, not applied."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import openai
import pytest
import yaml

from client import Client
from services.stage import read_run_info
from tests.conftest import REPO_ROOT, brigade_shm_objects
from tests.harness import Run, assert_clean, brigade_run, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_REQUESTS = 8
T = TypeVar("T")
NEW_TOKENS = 48
GROUP_TOKENS = 1000  # long enough that a group retired mid-stream still runs some
LONG_TOKENS = 400  # long enough that a tokenizer replica removed mid-stream still holds some


def write_config(
    path: Path, model_dir: Path, tokenizers: int, detokenizers: int, max_model_len: int = 512, **engine: int
) -> None:
    config = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    config["model"].update(path=str(model_dir), dtype="float32", max_model_len=max_model_len)
    config["tokenizer"]["replicas"] = tokenizers
    config["detokenizer"]["replicas"] = detokenizers
    config["engine"].update(engine)
    path.write_text(yaml.safe_dump(config))


def concurrently(one: Callable[[int, Callable[[], None]], T], during=None) -> list[T]:
    """NUM_REQUESTS calls `one(i, has_output)` at once, each in a thread; `during()` runs once every
    call has called `has_output()` (its first output came)."""
    results: list[T | None] = [None] * NUM_REQUESTS
    barrier = threading.Barrier(NUM_REQUESTS + 1)

    def run(i: int) -> None:
        try:
            results[i] = one(i, lambda: barrier.wait(120))
        except BaseException:
            barrier.abort()  # the test fails on the missing result, not on the barrier's wait
            raise

    threads = [threading.Thread(target=run, args=(i,)) for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    barrier.wait(120)
    if during is not None:
        during()
    for t in threads:
        t.join(300)
    assert all(r is not None for r in results), "a request did not complete"
    return results  # type: ignore[return-value]


def streams(
    run_dir: Path, during=None, new_tokens: int = NEW_TOKENS, may_fail_over: bool = True
) -> list[str]:
    """NUM_REQUESTS greedy streams; `during()` runs once every stream has produced output. With
    `may_fail_over` False, a stream its tokenizer replica went silent on (the client resubmitted
    it to another) fails the test: the client's failover would hide a lost reply."""

    def one(i: int, has_output: Callable[[], None]) -> str:
        # A replica that must not lose a stream gets longer before the client gives up on it: a
        # tokenizer starved of CPU for 3 s on a busy host is not one that dropped a reply.
        failover_after = 3.0 if may_fail_over else 15.0
        with Client(run_dir, failover_after=failover_after, unavailable_after=120.0) as client:
            text = []
            for delta in client.stream(
                f"request {i}:", max_tokens=new_tokens, temperature=0.0, ignore_eos=True, timeout=300
            ):
                text.append(delta.text)
                if len(text) == 1:
                    has_output()
            assert may_fail_over or client.session.num_failovers == 0, f"request {i} failed over"
            return "".join(text)

    return concurrently(one, during)


def wait_for_stages(
    run: Run, tokenizers: int, detokenizers: int, timeout: float = 120, schedulers: int | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = run.status()
        kinds = [r["kind"] for r in rows if r["state"] == "running"]
        counts = (kinds.count("tokenizer"), kinds.count("detokenizer"), kinds.count("scheduler"))
        wanted = (tokenizers, detokenizers, counts[2] if schedulers is None else schedulers)
        if counts == wanted and len(kinds) == len(rows):
            return
        time.sleep(0.2)
    raise AssertionError(
        f"expected {tokenizers} tokenizers, {detokenizers} detokenizers, {schedulers} schedulers: {run.status()}"
    )


def test_replicas_change_live_without_losing_requests(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = tmp_path / "brigade.yaml"
    write_config(config, tiny_model_dir, tokenizers=1, detokenizers=1)
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, config=str(config)) as run:
        reference = streams(run_dir)

        def scale_up() -> None:
            write_config(config, tiny_model_dir, tokenizers=2, detokenizers=2)
            run.process.send_signal(signal.SIGHUP)

        assert streams(run_dir, during=scale_up) == reference
        wait_for_stages(run, tokenizers=2, detokenizers=2)
        assert streams(run_dir) == reference  # requests now spread over both replicas

        def scale_down() -> None:
            write_config(config, tiny_model_dir, tokenizers=1, detokenizers=1)  # the file watch sees it

        # Long enough to outlast the reload: the removed tokenizer replica finishes the streams it
        # holds, so every stage keeps its link to it until then (no stream fails over).
        long_reference = streams(run_dir, new_tokens=LONG_TOKENS)
        assert (
            streams(run_dir, during=scale_down, new_tokens=LONG_TOKENS, may_fail_over=False) == long_reference
        )
        wait_for_stages(run, tokenizers=1, detokenizers=1)
        drained = run.wait_for_line("draining:", 60)  # tokenizer-1's: the one replica removed
        assert "tokenizer-1" in drained and int(drained.split("draining: ")[1].split()[0]) > 0, drained

        write_config(config, tiny_model_dir, tokenizers=1, detokenizers=1, max_model_len=256)
        run.process.send_signal(signal.SIGHUP)
        run.wait_for_line("model.max_model_len changed but needs a restart", 60)
    assert_clean(run_dir)


def test_engine_groups_are_added_and_retired_live_without_losing_requests(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """engine.data_parallel 1 -> 2 -> 1 by hot reload, each while requests stream: the new group
    takes requests once it is up; the retired one stops taking them, and what it still ran when
    supervisor.drain_timeout_s ended is moved to the other group. Greedy text is unchanged."""
    config = tmp_path / "brigade.yaml"

    def write_groups(data_parallel: int) -> None:
        write_config(config, tiny_model_dir, 1, 1, GROUP_TOKENS + 64, data_parallel=data_parallel, threads=1)

    write_groups(1)
    run_dir = tmp_path / "run"
    # A short drain and heartbeat (the retirement reads loads for two beats first), so that the
    # retired group still runs requests when it stops (the move) even on a fast CPU.
    drain = ("supervisor.drain_timeout_s=0.05", "supervisor.heartbeat_interval_s=0.1")
    with brigade_run(run_dir, *drain, config=str(config)) as run:
        reference = streams(run_dir, new_tokens=GROUP_TOKENS)

        def grow() -> None:
            write_groups(2)
            run.process.send_signal(signal.SIGHUP)

        assert streams(run_dir, during=grow, new_tokens=GROUP_TOKENS) == reference
        wait_for_stages(run, tokenizers=1, detokenizers=1, schedulers=2)
        assert {r["name"] for r in run.status()} >= {"scheduler-1", "gpu_worker-1-0"}

        def shrink() -> None:
            write_groups(1)
            run.process.send_signal(signal.SIGHUP)

        assert streams(run_dir, during=shrink, new_tokens=GROUP_TOKENS) == reference
        wait_for_stages(run, tokenizers=1, detokenizers=1, schedulers=1)
        names = {r["name"] for r in run.status()}
        assert "scheduler-1" not in names and "gpu_worker-1-0" not in names, names
        moved = run.wait_for_line("engine groups from 1 on retired: moving", 60)
        assert int(moved.split("moving ")[1].split()[0]) > 0, moved  # group 1 had requests
        assert streams(run_dir, new_tokens=GROUP_TOKENS) == reference  # group 0 serves on alone
    assert run.process.returncode == 0
    assert_clean(run_dir)


def test_a_stop_during_a_scale_up_drains_the_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    """SIGTERM while a hot reload's new stages come up: the supervisor stopped at once, without a
    drain ("interrupted before the stages were up"), and every stream in flight failed. Now the
    run drains first, as at any other stop."""
    config = tmp_path / "brigade.yaml"
    write_config(config, tiny_model_dir, tokenizers=1, detokenizers=1)
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, "supervisor.drain_timeout_s=120", config=str(config)) as run:

        def scale_up_then_stop() -> None:
            write_config(config, tiny_model_dir, tokenizers=2, detokenizers=1)
            run.process.send_signal(signal.SIGHUP)
            run.wait_for_line("started tokenizer-1", 60)
            run.process.send_signal(signal.SIGTERM)

        texts = streams(run_dir, during=scale_up_then_stop, new_tokens=200)
        assert all(texts), texts  # every stream whole: none failed
        run.wait_for_line("signal received during a topology change: draining", 60)
        run.wait_for_line("drained: nothing in flight", 120)
        assert run.process.wait(60) == 0
    assert_clean(run_dir)


def test_a_retired_gateway_finishes_its_streams_within_the_drain_timeout(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """gateway.replicas 2 -> 1 while HTTP streams run and the engine is frozen for longer than
    the 5 s a stopping stage gets: the retired replica still finishes every stream it holds (its
    own graceful shutdown is bounded by supervisor.drain_timeout_s), so each ends whole with its
    greedy text. It was SIGKILLed 5 s after the reload, cutting its streams."""
    config = tmp_path / "brigade.yaml"
    port = free_port()

    def write(gateways: int) -> None:
        write_config(config, tiny_model_dir, tokenizers=1, detokenizers=1)
        text = yaml.safe_load(config.read_text())
        text["gateway"] = {"replicas": gateways, "port": port}
        text["supervisor"]["drain_timeout_s"] = 30.0
        config.write_text(yaml.safe_dump(text))

    write(2)
    run_dir = tmp_path / "run"
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
    with brigade_run(run_dir, f"gateway.port={port}", config=str(config)) as run:

        def http_streams(during=None) -> list[tuple[str, int]]:
            """NUM_REQUESTS streamed completions, each on a connection of its own (the kernel
            spreads them over the replicas); `during()` once each has its first text."""

            def one(i: int, has_output: Callable[[], None]) -> tuple[str, int]:
                parts, tokens = [], 0
                for chunk in api.completions.create(
                    model=model, prompt=f"request {i}:", max_tokens=400, temperature=0.0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                ):  # fmt: skip
                    parts += [choice.text for choice in chunk.choices]
                    tokens = chunk.usage.completion_tokens if chunk.usage else tokens
                    if len(parts) == 1:
                        has_output()
                return "".join(parts), tokens

            return concurrently(one, during)

        model = api.models.list().data[0].id
        reference = http_streams()
        assert all(tokens == 400 for _, tokens in reference)

        def retire_a_gateway_while_frozen() -> None:
            worker = next(r["pid"] for r in run.status() if r["kind"] == "gpu_worker")
            os.kill(worker, signal.SIGSTOP)  # every stream waits, whichever replica holds it
            try:
                write(1)
                run.process.send_signal(signal.SIGHUP)
                time.sleep(8.0)  # past the 5 s grace a retired replica used to get
            finally:
                os.kill(worker, signal.SIGCONT)

        assert http_streams(during=retire_a_gateway_while_frozen) == reference
        run.wait_for_line("retired gateway-1", 60)
        assert [r["name"] for r in run.status() if r["kind"] == "gateway"] == ["gateway-0"]
    assert_clean(run_dir)


def test_a_gateway_sends_to_tokenizer_replicas_added_live(tmp_path: Path, tiny_model_dir: Path) -> None:
    """tokenizer.replicas 1 -> 2 by hot reload; then tokenizer-0 is frozen, so that only the new
    replica can serve: the gateway, which knew one tokenizer at its start, fails its request over
    to tokenizer-1 and answers with the same text. Its client never heard of added replicas, and
    such a request failed once the frozen replica had been silent for unavailable_after."""
    config = tmp_path / "brigade.yaml"
    port = free_port()

    def write(tokenizers: int) -> None:
        write_config(config, tiny_model_dir, tokenizers=tokenizers, detokenizers=1)
        text = yaml.safe_load(config.read_text())
        text["gateway"] = {"replicas": 1, "port": port}
        config.write_text(yaml.safe_dump(text))

    write(1)
    run_dir = tmp_path / "run"
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
    with brigade_run(run_dir, f"gateway.port={port}", config=str(config)) as run:
        model = api.models.list().data[0].id

        def complete() -> str:
            reply = api.completions.create(
                model=model, prompt="request 0:", max_tokens=NEW_TOKENS, temperature=0.0
            )
            return reply.choices[0].text

        reference = complete()
        write(2)
        run.process.send_signal(signal.SIGHUP)
        run.wait_for_line("reload applied", 120)
        wait_for_stages(run, tokenizers=2, detokenizers=1)
        first = next(r["pid"] for r in run.status() if r["name"] == "tokenizer-0")
        os.kill(first, signal.SIGSTOP)
        try:
            assert complete() == reference
        finally:
            os.kill(first, signal.SIGCONT)
    assert_clean(run_dir)


def test_a_tokenizer_added_with_engine_groups_serves_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    """engine.data_parallel 1 -> 2 and tokenizer.replicas 1 -> 2 in one reload, with clients
    pointed at tokenizer-1 from the moment run.json names it: each request completes within
    seconds of tokenizer-1 being up, with the text tokenizer-0 gave, and none is re-driven. The
    new replica started with the group and routed by the new config to group 1 before it was up,
    and the detokenizer, which knew only tokenizer-0 until the new group was up, dropped its
    replies: every request waited about 20 s for the stall watchdog (tokenizer.stall_timeout_s
    10 s, two answers in a row) to resubmit it."""
    config = tmp_path / "brigade.yaml"
    write_config(config, tiny_model_dir, 1, 1, data_parallel=1, threads=1)
    run_dir = tmp_path / "run"
    prompts = [f"request {i}:" for i in range(NUM_REQUESTS)]

    def generate(client: Client, prompt: str) -> str:
        return client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120).text

    with brigade_run(run_dir, config=str(config)) as run:
        with Client(run_dir) as client:
            reference = [generate(client, prompt) for prompt in prompts]
        write_config(config, tiny_model_dir, 2, 1, data_parallel=2, threads=1)
        run.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while len(endpoints := read_run_info(run_dir).tokenizers) < 2:  # published before it starts
            assert time.monotonic() < deadline, "run.json never named tokenizer-1"
            time.sleep(0.01)
        done_at: list[float] = [0.0] * NUM_REQUESTS

        def one(i: int, has_output: Callable[[], None]) -> str:
            has_output()  # all sent at once, before tokenizer-1 is up
            with Client(endpoints=[endpoints[1]], failover_after=60.0, unavailable_after=120.0) as client:
                text = generate(client, prompts[i])
            done_at[i] = time.monotonic()
            return text

        up_at: list[float] = []

        def watch_tokenizer_1() -> None:
            deadline = time.monotonic() + 120
            while not up_at and time.monotonic() < deadline:
                if any(r["name"] == "tokenizer-1" and r["state"] == "running" for r in run.read_status()):
                    up_at.append(time.monotonic())
                time.sleep(0.01)

        assert concurrently(one, during=watch_tokenizer_1) == reference
        assert up_at, "tokenizer-1 did not come up"
        waits = [round(t - up_at[0], 1) for t in done_at]
        assert max(waits) < 5.0, f"seconds from tokenizer-1 up to each request's end: {waits}"
        run.wait_for_line("reload applied", 60)
    log = run_dir.with_name(run_dir.name + ".log").read_text()
    assert "lost upstream" not in log
    assert_clean(run_dir)


def test_retired_stages_leave_no_socket_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    """tokenizer.replicas, detokenizer.replicas and engine.data_parallel 2 -> 1 by hot reload: the
    retired tokenizer's, detokenizer's and scheduler's socket files are gone once they are
    retired (they stayed in the run dir until the run stopped), the remaining ones are there, and
    the run serves on with the same text."""
    config = tmp_path / "brigade.yaml"
    write_config(config, tiny_model_dir, 2, 2, data_parallel=2, threads=1)
    run_dir = tmp_path / "run"
    retired = ["tokenizer-1", "tokenizer-1-in", "detokenizer-1-in", "scheduler-1-in", "scheduler-1-workers"]
    remaining = ["tokenizer-0", "tokenizer-0-in", "detokenizer-0-in", "scheduler-0-in", "scheduler-0-workers"]
    with brigade_run(run_dir, config=str(config)) as run:
        assert {f"{name}.sock" for name in retired + remaining} <= {p.name for p in run_dir.glob("*.sock")}
        reference = streams(run_dir)
        write_config(config, tiny_model_dir, 1, 1, data_parallel=1, threads=1)
        run.process.send_signal(signal.SIGHUP)
        run.wait_for_line("reload applied", 120)
        sockets = {p.name for p in run_dir.glob("*.sock")}
        assert not sockets & {f"{name}.sock" for name in retired}, sorted(sockets)
        assert {f"{name}.sock" for name in remaining} <= sockets, sorted(sockets)
        assert streams(run_dir) == reference
    assert_clean(run_dir)


def test_stages_a_reload_adds_that_fail_to_start_are_taken_back_and_the_run_serves_on(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A reload whose new stages fail their first start (here: the model's files went bad since
    the run started) ended the run, undrained, as a bad config does at start. Now the setting that
    added them stays as it was and the rest of the change goes on: engine.data_parallel 1 -> 2
    with unreadable weights stays 1 (its rings go) while tokenizer.replicas 1 -> 2 applies, then
    tokenizer.replicas 2 -> 3 with an unreadable tokenizer stays 2. No stream in flight is lost
    or changed."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = tmp_path / "brigade.yaml"
    write_config(config, model_dir, 1, 1, data_parallel=1, threads=1)
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, config=str(config)) as run:
        run_id = read_run_info(run_dir).run_id
        reference = streams(run_dir)
        (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")

        def grow() -> None:
            write_config(config, model_dir, 2, 1, data_parallel=2, threads=1)  # the file watch sees it

        assert streams(run_dir, during=grow) == reference
        line = run.wait_for_line("engine.data_parallel stays 1", 120)
        assert "gpu_worker-1-0 failed to start" in line, line
        run.wait_for_line("reload applied: tokenizer.replicas\n", 60)
        wait_for_stages(run, tokenizers=2, detokenizers=1, schedulers=1)
        assert not {r["name"] for r in run.status()} & {"scheduler-1", "gpu_worker-1-0"}
        assert not [name for name in brigade_shm_objects() if f"{run_id}-step-1" in name]
        assert streams(run_dir) == reference  # over both tokenizers, on group 0

        (model_dir / "tokenizer.json").write_text("{")

        def grow_tokenizers() -> None:
            write_config(config, model_dir, 3, 1, data_parallel=1, threads=1)

        assert streams(run_dir, during=grow_tokenizers) == reference
        line = run.wait_for_line("tokenizer.replicas stays 2", 120)
        assert "tokenizer-2 failed to start" in line, line
        run.wait_for_line("reload applied: nothing", 60)
        wait_for_stages(run, tokenizers=2, detokenizers=1, schedulers=1)
        assert streams(run_dir) == reference
        assert run.process.poll() is None  # the run serves on
    assert run.process.returncode == 0
    assert_clean(run_dir, run_id)


def test_a_second_signal_while_an_engine_group_retires_stops_the_run_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """engine.data_parallel 2 -> 1 while both groups run streams, group 1's frozen, with a long
    drain timeout; SIGTERM twice while group 1 retires: the second signal ("stopping now") waited for the
    retirement's drain_timeout_s, and then for the run's own drain as well. Now the run stops at
    once."""
    config = tmp_path / "brigade.yaml"
    write_config(config, tiny_model_dir, 1, 1, GROUP_TOKENS + 64, data_parallel=2, threads=1)
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, "supervisor.drain_timeout_s=300", config=str(config)) as run:
        outputs: list[str] = []

        def one(i: int) -> None:
            with contextlib.suppress(Exception), Client(run_dir, unavailable_after=5.0) as client:
                for delta in client.stream(
                    f"request {i}:", max_tokens=GROUP_TOKENS, ignore_eos=True, timeout=300
                ):
                    outputs.append(delta.text)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(outputs) < 8:
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.1)
        # Group 1 frozen: what it runs never finishes, as a long request's would not.
        [worker] = [row["pid"] for row in run.status() if row["name"] == "gpu_worker-1-0"]
        os.kill(worker, signal.SIGSTOP)
        write_config(config, tiny_model_dir, 1, 1, GROUP_TOKENS + 64, data_parallel=1, threads=1)
        run.wait_for_line("retiring engine groups 1-1", 60)
        run.process.send_signal(signal.SIGTERM)
        time.sleep(1)  # two signals pending at once are one
        run.process.send_signal(signal.SIGTERM)
        run.wait_for_line("second signal: stopping now", 10)
        assert run.process.wait(30) == 0
    assert_clean(run_dir)
