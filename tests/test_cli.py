"""The `brigade` console script as pip installs it from a wheel built from this tree: its
dispatch and its errors without a run (tests/test_operations.py drives it against a live one)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


def brigade(installed, *args: str) -> subprocess.CompletedProcess:
    script, env = installed
    return subprocess.run(
        [str(script), *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_help_lists_the_commands(installed) -> None:
    done = brigade(installed, "--help")
    assert done.returncode == 0
    for command in ("serve", "status", "chat", "generate", "embed", "health"):
        assert f"  {command} " in done.stdout


def test_bad_commands_and_arguments_are_clear_errors(installed, tmp_path: Path) -> None:
    unknown = brigade(installed, "bogus")
    assert unknown.returncode == 2 and "unknown command 'bogus'" in unknown.stderr
    assert brigade(installed).returncode == 2
    missing = brigade(installed, "status", "--run", str(tmp_path / "none"))
    assert missing.returncode == 1 and "no live Brigade run" in missing.stderr
    bad = brigade(installed, "serve", "--set", "engine.max_num_seqs=-3", "--run-dir", str(tmp_path / "run"))
    assert bad.returncode == 2 and "engine.max_num_seqs: expected int >= 1, got -3" in bad.stderr


def test_client_options_may_follow_the_command(installed, tmp_path: Path) -> None:
    """`brigade chat --run DIR ...`: the client CLI gets `--run DIR chat ...` and looks there."""
    done = brigade(installed, "health", "--run", str(tmp_path / "none"), "--timeout", "2")
    assert done.returncode != 0
    assert str(tmp_path / "none") in done.stderr


def test_constraint_flags_become_the_sdk_shorthands(tmp_path: Path) -> None:
    """--json-schema and --grammar take a file or the text itself, --choice a comma-separated list;
    at most one of them (argparse refuses two)."""
    from client.__main__ import _parser, _sampling

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')

    def sampling(*args: str) -> dict:
        return _sampling(_parser().parse_args(["generate", "hi", *args]))

    assert sampling("--json-schema", str(schema)) == {"json_schema": '{"type": "object"}'}
    assert sampling("--json-schema", '{"type": "array"}') == {"json_schema": '{"type": "array"}'}
    assert sampling("--json-schema", "{" + "x" * 5000 + "}") == {"json_schema": "{" + "x" * 5000 + "}"}
    assert sampling("--regex", "[0-9]+", "--max-tokens", "3") == {"max_tokens": 3, "regex": "[0-9]+"}
    assert sampling("--choice", "red,green") == {"choice": ["red", "green"]}
    assert sampling("--grammar", 'root ::= "x"') == {"grammar": 'root ::= "x"'}
    assert sampling("--adapter", "sql-lora") == {"adapter": "sql-lora"}  # SamplingParams.adapter
    with pytest.raises(SystemExit):
        _parser().parse_args(["generate", "hi", "--regex", "a", "--choice", "a,b"])


def test_tool_flags_become_the_sdk_tools_arguments(tmp_path: Path) -> None:
    """--tools takes a file or the JSON itself; --tool-choice NAME forces that function; the flags
    without --tools, or tools that are not JSON, are clear errors."""
    from client.__main__ import _parser, _tools
    from client.errors import InvalidRequest

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(tools))

    def parsed(*args: str) -> dict:
        return _tools(_parser().parse_args(["chat", "hi", *args]))

    assert parsed() == {}
    assert parsed("--tools", str(path)) == {"tools": tools, "tool_choice": None, "parallel_tool_calls": True}
    assert parsed(
        "--tools", json.dumps(tools), "--tool-choice", "get_weather", "--no-parallel-tool-calls"
    ) == {
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }
    assert parsed("--tools", str(path), "--tool-choice", "required")["tool_choice"] == "required"
    with pytest.raises(InvalidRequest, match="need --tools"):
        parsed("--tool-choice", "auto")
    with pytest.raises(InvalidRequest, match="not JSON"):
        parsed("--tools", "[{")
