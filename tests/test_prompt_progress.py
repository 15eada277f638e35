"""llama-server's return_progress: a stream that asks (SamplingParams.report_prompt_progress)
hears how much of its prompt is computed before its first output. The scheduler reports when a
prefill starts (the prefix cache's part) and after each chunk; the tokenizer forwards the reports
to the client until the first output; the SDK gives them as deltas of no output; a slow client's
held replies never join a report with output. The gateway's events are tested in
tests/test_llamacpp_api.py."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import numpy as np
import openai
import pytest

from client.sdk import RequestState
from ipc import messages as m
from ipc.sockets import Sent
from services.common.text import Tokenizer
from services.gateway.timings import PromptReports
from services.scheduler.core import Scheduler
from services.scheduler.request import Request
from services.tokenizer.backlog import Backlog
from services.tokenizer.core import TokenizerCore
from tests.harness import assert_clean, brigade_run, free_port
from tests.test_gateway import HTTP_TIMEOUT_S, parse_sse
from tests.test_scheduler_core import FakeExecutor, drive, engine_params, small_config

pytestmark = pytest.mark.timeout(300)

CHUNK = 32


def request(rid: str, prompt: list[int], report: bool = True) -> Request:
    params = engine_params(seed=3, max_tokens=3, ignore_eos=True, report_prompt_progress=report)
    return Request(rid, 0, np.array(prompt, np.int32), params)


def reports_of(sched: Scheduler, executor: FakeExecutor) -> dict[str, list[tuple[int, int]]]:
    """Run everything to the end: each request's reports, (cached, processed), as made."""
    reports: dict[str, list[tuple[int, int]]] = {}
    for _ in range(100):
        step = sched.schedule()
        for req, processed in sched.state.prompt_progress:
            reports.setdefault(req.request_id, []).append((req.num_cached_tokens, processed))
        sched.state.prompt_progress.clear()
        if step is None or not step.num_seqs:
            break
        sched.update(step, *executor.run(step))
        for req, processed in sched.state.prompt_progress:
            reports.setdefault(req.request_id, []).append((req.num_cached_tokens, processed))
        sched.state.prompt_progress.clear()
    return reports


def test_the_scheduler_reports_a_prefills_start_and_each_chunk_until_the_first_output() -> None:
    sched = Scheduler(small_config(max_num_batched_tokens=CHUNK))
    executor = FakeExecutor(sched)
    prompt = np.random.default_rng(0).integers(1, 40, 100).tolist()
    sched.add(request("asks", prompt))
    sched.add(request("quiet", prompt[:40], report=False))
    reports = reports_of(sched, executor)
    # Its start (nothing cached), then the end of each chunk of 32, the last one's its whole prompt.
    assert reports == {"asks": [(0, 0), (0, 32), (0, 64), (0, 96), (0, 100)]}
    # The same prompt again: its prefill starts past the cached blocks (6 of 16 tokens), and the
    # decode steps after its first output report nothing.
    sched.add(request("again", prompt))
    assert reports_of(sched, executor) == {"again": [(96, 96), (96, 100)]}
    drive(sched, executor)


def test_a_held_report_is_replaced_by_a_newer_one_and_never_joined_with_output() -> None:
    report = m.Delta("r", 0, 0, "", b"", prompt_progress=m.PromptProgress(10, 0, 5))
    later = m.Delta("r", 0, 0, "", b"", prompt_progress=m.PromptProgress(10, 0, 10))
    first = m.Delta("r", 0, 0, "Hi", m.pack_ids([7]), prompt_ids=m.pack_ids([1, 2]))
    backlog = Backlog(report, 0.0)
    backlog.add(later)
    backlog.add(first)
    sent: list[m.Delta] = []

    def send(reply: m.Delta) -> Sent:
        sent.append(reply)
        return Sent.OK

    assert backlog.flush(send, 0.0) is Sent.OK
    # The latest report only, and the first output whole, with its first-output fields.
    assert sent == [later, first]


def test_the_sdk_gives_reports_as_deltas_of_no_output_until_the_first() -> None:
    state = RequestState(
        m.Generate("r", "x", params=m.SamplingParams(report_prompt_progress=True)), None, 0.0
    )
    progress = m.PromptProgress(10, 2, 6)
    state.apply(m.Delta("r", 0, 0, "", b"", prompt_progress=progress))
    state.apply(m.Delta("r", 0, 0, "Hi", m.pack_ids([7])))
    state.apply(m.Delta("r", 0, 0, "", b"", prompt_progress=m.PromptProgress(10, 2, 10)))  # late: dropped
    state.apply(m.Delta("r", 1, 2, "!", m.pack_ids([8]), finish_reason="length"))
    deltas = list(state.ready)
    assert [(d.text, d.token_ids, d.prompt_progress) for d in deltas] == [
        ("", [], progress),
        ("Hi", [7], None),
        ("!", [8], None),
    ]
    assert state.result().text == "Hi!" and state.result().token_ids == [7, 8]


def test_the_tokenizer_forwards_a_streams_reports_until_its_first_output(smollm2_dir: Path) -> None:
    core = TokenizerCore(Tokenizer(smollm2_dir), 0, 1, max_model_len=256, max_prompt_chars=1000,
                         default_max_tokens=7, stall_timeout_s=10.0)  # fmt: skip
    params = m.SamplingParams(report_prompt_progress=True)
    streamed = core.admit(b"c", m.Generate("s", "x", params=params)).submit.request_id  # the engine's ids
    whole = core.admit(b"c", m.Generate("w", "x", params=params, stream=False)).submit.request_id
    progress = m.PromptProgress(4, 0, 2)
    reply = core.relay(m.Delta(streamed, 0, 0, "", b"", prompt_progress=progress))
    assert reply is not None and reply.identity == b"c"
    assert reply.message == m.Delta("s", 0, 0, "", b"", prompt_progress=progress)  # the client's id
    assert (
        core.relay(m.Delta(whole, 0, 0, "", b"", prompt_progress=progress)) is None
    )  # nothing to show it in
    # A prefill again (preempted, or its scheduler restarted) says less: the client's bar never
    # steps back, and goes on once the prefill passes what it was told.
    for processed, is_news in ((0, False), (2, False), (3, True)):
        again = core.relay(
            m.Delta(streamed, 0, 0, "", b"", prompt_progress=m.PromptProgress(4, 0, processed))
        )
        assert (again is not None) == is_news, processed
    assert core.relay(m.Delta(streamed, 0, 0, "Hi", m.pack_ids([5]))) is not None
    assert core.relay(m.Delta(streamed, 0, 0, "", b"", prompt_progress=m.PromptProgress(4, 0, 4))) is None
    assert core.journal[streamed].output_ids == [5]  # a report changes nothing of the output


# -- through the gateway, as llama.cpp's web UI asks for it --------------------------------------

SERVED_CHUNK = 16  # the run's prefill budget: a long prompt computes in several chunks
BLOCK_SIZE = 16  # the run's KV block (engine.block_size's default): what the prefix cache keys
LONG_PROMPT = "The lighthouse keeper climbed the stairs and looked out at the sea. " * 6
OTHER_PROMPT = "A fox crossed the frozen river at dawn, looking for its den. " * 6


def reported(items: list[dict]) -> list[dict]:
    return [item["prompt_progress"] for item in items if "prompt_progress" in item]


def check_reports(reports: list[dict], total: int) -> None:
    """llama-server's shape: the start (cache == processed), then more each time, to the whole
    prompt; one report a chunk of the run's budget after the cache's part."""
    assert reports and reports[0]["cache"] == reports[0]["processed"], reports
    assert all(r["total"] == total and r["cache"] == reports[0]["cache"] for r in reports), reports
    processed = [r["processed"] for r in reports]
    assert processed == sorted(set(processed)) and processed[-1] == total, reports
    assert len(reports) == 1 + -(-(total - reports[0]["cache"]) // SERVED_CHUNK), reports
    assert all(r["time_ms"] >= 0 for r in reports)


def sse(port: int, path: str, body: dict, headers: dict[str, str] | None = None) -> list[dict]:
    """A streamed POST's events (each with its `data`, and its `id` where it has one)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **(headers or {})})
    response = conn.getresponse()
    data = response.read().decode()
    conn.close()
    assert response.status == 200, data
    return parse_sse(data)


def test_prompt_reports_end_with_the_whole_prompt_whatever_came_first() -> None:
    """The first output may overtake the last report (they come by different paths, and the
    tokenizer drops a report after output): the gateway then says the whole prompt is done."""
    reports = PromptReports()
    reports.report(0, m.PromptProgress(40, 8, 8))
    reports.report(0, m.PromptProgress(40, 8, 24))
    assert reports.completing(0) == m.PromptProgress(40, 8, 40)
    assert reports.completing(0) is None  # once
    reports.report(1, m.PromptProgress(40, 0, 40))
    assert reports.completing(1) is None  # it said so itself
    assert reports.completing(2) is None  # it asked for none


def test_a_stream_reports_its_prompts_progress_through_the_gateway(
    tmp_path: Path, tiny_model_dir: Path
) -> None:

    port = free_port()
    run_dir = tmp_path / "run"
    overrides = (f"model.path={tiny_model_dir}", f"gateway.port={port}", "gateway.replicas=1",
                 f"engine.max_num_batched_tokens={SERVED_CHUNK}")  # fmt: skip
    with brigade_run(run_dir, *overrides):
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=HTTP_TIMEOUT_S)
        body = {"model": str(tiny_model_dir), "messages": [{"role": "user", "content": LONG_PROMPT}],
                "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        for attempt in ("first", "cached"):
            chunks = [c.model_dump() | (c.model_extra or {}) for c in api.chat.completions.create(
                **body, extra_body={"return_progress": True})]  # fmt: skip
            usage = chunks[-1]["usage"]
            reports = reported(chunks)
            check_reports(reports, usage["prompt_tokens"])
            assert (reports[0]["cache"] > 0) == (attempt == "cached"), reports
            first_output = next(
                i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"]["content"]
            )
            assert all("prompt_progress" not in c for c in chunks[first_output:]), chunks  # none after output
            text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
        # n = 2: the second choice goes once the first has output (its prompt cached), not at the
        # first's first report: its prefill starts with the prompt's cached blocks.
        chunks = [c.model_dump() | (c.model_extra or {}) for c in api.chat.completions.create(
            **{**body, "n": 2, "messages": [{"role": "user", "content": OTHER_PROMPT}]},
            extra_body={"return_progress": True})]  # fmt: skip
        total = chunks[-1]["usage"]["prompt_tokens"]
        caches = []
        for index in (0, 1):
            reports = reported([c for c in chunks if c["choices"] and c["choices"][0]["index"] == index])
            check_reports(reports, total)
            caches.append(reports[0]["cache"])
        # The first finds the chat template's opening cached at most; the second all but the last block.
        assert caches[0] < caches[1] and caches[1] >= total - BLOCK_SIZE, caches
        plain = list(api.chat.completions.create(**body))
        assert (
            "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == text
        )  # the same output
        assert not any("prompt_progress" in (c.model_extra or {}) for c in plain)
        whole = api.chat.completions.create(**{**body, "stream": False, "stream_options": None},
                                            extra_body={"return_progress": True})  # fmt: skip
        assert whole.choices[0].message.content == text and "prompt_progress" not in (whole.model_extra or {})

        # A stream resumed after some of its output (Last-Event-ID) hears no progress again; one
        # resumed before any (after its role's chunk) does.
        raw = {**body, "return_progress": True, "stream_options": None}
        events = sse(port, "/v1/chat/completions", raw)
        ids = [e["id"] for e in events if "id" in e and "prompt_progress" not in e["data"]]
        resumed = sse(port, "/v1/chat/completions", raw, {"last-event-id": ids[1]})
        assert any("prompt_progress" in e["data"] for e in events), events
        assert resumed and not any("prompt_progress" in e["data"] for e in resumed), resumed
        assert ids[0] == "0.0", ids
        resumed = sse(port, "/v1/chat/completions", raw, {"last-event-id": ids[0]})
        assert any("prompt_progress" in e["data"] for e in resumed), resumed

        # llama.cpp's own /completion: its events of no output carry the reports.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
        request = {"prompt": LONG_PROMPT + "!", "n_predict": 3, "stream": True, "return_progress": True}
        conn.request("POST", "/completion", json.dumps(request), {"content-type": "application/json"})
        response = conn.getresponse()
        events = [json.loads(e["data"]) for e in parse_sse(response.read().decode()) if "data" in e]
        conn.close()
        assert response.status == 200 and events[-1]["stop"], events
        reports = reported(events)
        check_reports(reports, events[-1]["tokens_evaluated"])
        progress_events = [e for e in events if "prompt_progress" in e]
        assert all(e["content"] == "" and e["tokens"] == [] and not e["stop"] for e in progress_events)
        assert all(e["tokens_evaluated"] == e["prompt_progress"]["total"] for e in progress_events)
    assert_clean(run_dir)
