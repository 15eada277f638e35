"""Structured output end to end, through real processes on SmolLM2-135M: the SDK's request reaches
the tokenizer (which checks the constraint), the scheduler (compile, matcher, bitmask rows in the
step ring) and the worker (masking before sampling). Outputs are validated independently: JSON
with the `jsonschema` package, regex with Python's `re`, choices by membership.

One workload of constrained requests (greedy, and seeded at temperature 1) runs concurrently: once
calm, then with the gpu_worker and then the scheduler SIGKILLed mid-generation, which must give
exactly the calm outputs (matchers are rebuilt from the token history). Outputs are short and
requests few: every wait has a deadline, and the module stays cheap on a loaded 2-core host.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from client import Client, InvalidRequest
from ipc.messages import StructuredOutput
from tests.conftest import REPO_ROOT
from tests.harness import Run, assert_clean, brigade_run
from tests.test_chaos import all_running, running_pid, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TIMEOUT_S = 300.0  # every client wait

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "age", "role", "address", "tags", "score"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
COLOURS = ["red", "green", "blue"]


@dataclass(frozen=True)
class Case:
    name: str
    structured: StructuredOutput
    check: Callable[[str], None]
    prompt: str | None = None
    chat: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)

    def stream(self, client: Client) -> Iterator:
        kwargs: dict[str, Any] = {"structured": self.structured, "timeout": TIMEOUT_S, **self.sampling}
        if self.chat is not None:
            return client.stream(messages=[{"role": "user", "content": self.chat}], **kwargs)
        return client.stream(self.prompt, **kwargs)


def check_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def check_date(text: str) -> None:
    assert re.fullmatch(DATE, text), text


def check_colour(text: str) -> None:
    assert text in COLOURS, text


PERSON_SPEC = StructuredOutput("json", json.dumps(PERSON))
ASK_PERSON = "Describe a user of a web service as JSON."
WORKLOAD = [
    Case(
        "json greedy",
        PERSON_SPEC,
        check_person,
        chat=ASK_PERSON,
        sampling={"max_tokens": 200, "temperature": 0.0},
    ),
    Case(
        "json seeded",
        PERSON_SPEC,
        check_person,
        chat=ASK_PERSON,
        sampling={"max_tokens": 200, "temperature": 1.0, "seed": 11},
    ),
    Case(
        "regex seeded",
        StructuredOutput("regex", DATE),
        check_date,
        prompt="Today's date is",
        sampling={"max_tokens": 30, "temperature": 1.0, "seed": 3},
    ),
    Case(
        "choice greedy",
        StructuredOutput("choice", json.dumps(COLOURS)),
        check_colour,
        chat="Name a colour.",
        sampling={"max_tokens": 10, "temperature": 0.0},
    ),
]

Output = tuple[str, list[int], str]  # text, token ids, finish reason


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Run]:
    run_dir = tmp_path_factory.mktemp("structured")
    with brigade_run(
        run_dir,
        "model.dtype=float32",
        "engine.max_num_seqs=8",
        "model.max_model_len=1024",
        "supervisor.restart_intensity=100",
        "supervisor.backoff_initial_s=0.1",
        "supervisor.backoff_max_s=0.5",
        "tokenizer.stall_timeout_s=1.0",
    ) as live:
        yield live
    assert_clean(run_dir)


def run_all(
    run: Run, cases: list[Case], during: Callable[[list[int]], None] | None = None
) -> list[Output | BaseException]:
    """Every case at once, streamed; `during(received)` runs while they are in flight, with the
    live count of tokens received by each case. Each case's output, or what it raised."""
    results: list[Output | BaseException | None] = [None] * len(cases)
    received = [0] * len(cases)

    def one(i: int) -> None:
        try:
            with Client(run.run_dir, failover_after=2.0, unavailable_after=TIMEOUT_S) as client:
                deltas = []
                for delta in cases[i].stream(client):
                    deltas.append(delta)
                    received[i] += len(delta.token_ids)
            text = "".join(d.text for d in deltas)
            results[i] = (text, [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason)
        except BaseException as exc:  # reported below, with the others
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(cases))]
    for t in threads:
        t.start()
    if during is not None:
        during(received)
    for t in threads:
        t.join(TIMEOUT_S + 30)
    assert all(r is not None for r in results), "a request neither finished nor failed in time"
    return results  # type: ignore[return-value]


def completed(results: list[Output | BaseException], cases: list[Case]) -> list[Output]:
    failures = {case.name: r for case, r in zip(cases, results, strict=True) if not isinstance(r, tuple)}
    assert not failures, f"requests did not complete: {failures}"
    return results  # type: ignore[return-value]


@pytest.fixture(scope="module")
def calm(run: Run) -> list[Output]:
    return completed(run_all(run, WORKLOAD), WORKLOAD)


def test_outputs_follow_their_constraints(calm: list[Output]) -> None:
    for case, (text, _, finish_reason) in zip(WORKLOAD, calm, strict=True):
        assert finish_reason == "stop", (case.name, text)
        case.check(text)


@pytest.mark.parametrize("kind", ["gpu_worker", "scheduler"])
def test_a_stage_killed_mid_generation_changes_no_output(run: Run, calm: list[Output], kind: str) -> None:
    """SIGKILL once the JSON requests are some tokens in: the restarted stage rebuilds each
    matcher from the outputs so far, and every output is the calm one, token for token."""
    pid = running_pid(run, kind)

    def kill_mid_generation(received: list[int]) -> None:
        wait_for("the JSON requests under way", lambda: min(received[:2]) >= 8, timeout=TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    outputs = completed(run_all(run, WORKLOAD, during=kill_mid_generation), WORKLOAD)
    for case, got, want in zip(WORKLOAD, outputs, calm, strict=True):
        assert got == want, f"{case.name} changed after the {kind} was killed"
    wait_for("every stage running", lambda: all_running(run))
    assert running_pid(run, kind) != pid


def test_an_uncompilable_schema_fails_alone_while_the_batch_completes(run: Run, calm: list[Output]) -> None:
    bad = Case(
        "bad",
        StructuredOutput("json", json.dumps({"type": "array", "uniqueItems": True})),
        check_person,
        prompt="x",
        sampling={"max_tokens": 5},
    )
    *good, failed = run_all(run, [WORKLOAD[2], WORKLOAD[3], bad])
    assert isinstance(failed, InvalidRequest) and "uniqueItems" in str(failed), failed
    assert good == calm[2:]
    with Client(run.run_dir) as client:
        with pytest.raises(InvalidRequest, match=r"structured\.json: .*uniqueItems"):
            client.generate("x", structured=bad.structured, max_tokens=5, timeout=TIMEOUT_S)
        with pytest.raises(InvalidRequest, match=r"min_tokens cannot be combined with structured output"):
            client.generate("x", structured=PERSON_SPEC, min_tokens=2, max_tokens=5, timeout=TIMEOUT_S)


def test_json_cut_short_by_max_tokens_is_a_length_finish(run: Run) -> None:
    with Client(run.run_dir) as client:
        result = client.chat(
            [{"role": "user", "content": ASK_PERSON}],
            structured=PERSON_SPEC,
            max_tokens=5,
            temperature=0.0,
            timeout=TIMEOUT_S,
        )
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


def test_the_cli_constrains_its_output(run: Run, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    flag = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    schema.write_text(json.dumps(flag))
    outputs = {}
    cli = [sys.executable, "-m", "client", "--run", str(run.run_dir), "--timeout", str(TIMEOUT_S), "generate"]
    for name, flags in (("regex", ["--regex", DATE]), ("json", ["--json-schema", str(schema)])):
        done = subprocess.run(
            [*cli, "Today's date is", "--max-tokens", "20", "--temperature", "0", "--json", *flags],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert done.returncode == 0, done.stderr
        outputs[name] = json.loads(done.stdout)
    check_date(outputs["regex"]["text"])
    jsonschema.validate(json.loads(outputs["json"]["text"]), flag)
    assert outputs["json"]["finish_reason"] == "stop"


def test_the_cli_chat_calls_a_forced_tool(run: Run, tmp_path: Path) -> None:
    """`chat --tools FILE --tool-choice NAME --json`: the reply is a call of NAME whose arguments
    parse and match the function's parameters (jsonschema), with finish_reason tool_calls."""
    parameters = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools = tmp_path / "tools.json"
    tools.write_text(
        json.dumps([{"type": "function", "function": {"name": "forecast", "parameters": parameters}}])
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "client",
            "--run",
            str(run.run_dir),
            "--timeout",
            str(TIMEOUT_S),
            "chat",
            "What will the weather be in Paris this week?",
            "--tools",
            str(tools),
            "--tool-choice",
            "forecast",
            "--max-tokens",
            "40",
            "--temperature",
            "0",
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["finish_reason"] == "tool_calls", reply
    [call] = reply["tool_calls"]
    assert call["name"] == "forecast" and call["id"]
    jsonschema.validate(json.loads(call["arguments"]), parameters)
