"""Putting OpenAI `tools` in front of the model: through its chat template, or by an instruction.

A template that reads `tools` (Qwen2.5, Llama 3.1+, Hermes) renders them itself: pass them to it.
SmolLM2-135M-Instruct's template never reads `tools` (tests/test_tool_parsers.py checks it with
transformers), so for such a template the frontend adds `tools_instruction(tools)` to the system
message: it asks for the Hermes format, which tool_parsers.py's `hermes` parser reads back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


def template_renders_tools(template_source: str) -> bool:
    """Whether the chat template reads the `tools` variable at all."""
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template_source))


def tool_format_for_template(template_source: str | None) -> str:
    """The tool-call format a template's model writes: llama3_json where the template speaks
    Llama 3's `<|python_tag|>` / `parameters` dialect, hermes otherwise (the instruction's too)."""
    if template_source and "<|python_tag|>" in template_source:
        return "llama3_json"
    return "hermes"


def tools_instruction(tools: Sequence[Mapping[str, Any]]) -> str:
    """A system-message paragraph that lists the tools and asks for Hermes-style calls."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call functions. Their signatures, one JSON object per line:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, write a JSON object with its name and arguments between tags, "
        "one call per block:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
    )
