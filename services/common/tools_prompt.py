"""Putting OpenAI `tools` in front of the model: through its chat template, or by an instruction.

A template that reads `tools` (Qwen2.5, Llama 3.1+, Hermes) renders them itself: pass them to it.
SmolLM2-135M-Instruct's template never reads `tools` (tests/test_tool_parsers.py checks it with
transformers), so for such a template the tokenizer adds `tools_instruction(tools)` to the system
message: it asks for the Hermes format, which tool_parsers.py's `hermes` parser reads back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ipc.messages import ChatMessage, ImagePart, ToolCall, Tools, content_text
from services.common.tool_parsers import ToolParser


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


def auto_tool_format(template_source: str | None) -> str:
    """The format the model writes calls in by itself: its template's, or, for a template that
    ignores tools, the format `tools_instruction` asks for (hermes)."""
    if template_source is not None and template_renders_tools(template_source):
        return tool_format_for_template(template_source)
    return "hermes"


def tool_parser_for(tools: Tools, auto_format: str) -> ToolParser | None:
    """The parser that reads a request's output back into calls; None under tool_choice none
    (OpenAI: the model answers in text, and nothing it writes is a call). The tokenizer (whole
    outputs) and the gateway (stream deltas) both take it from here."""
    if tools.choice == "none":
        return None
    if tools.choice == "required":
        return ToolParser("required", parallel_tool_calls=tools.parallel)
    if tools.choice == "function":
        return ToolParser("named", function_name=tools.function)
    return ToolParser(auto_format, parallel_tool_calls=tools.parallel)


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


def hermes_call(call: ToolCall) -> str:
    """A past call as the Hermes block the instruction asks for (and the hermes parser reads)."""
    return f'<tool_call>\n{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": {call.arguments}}}\n</tool_call>'


def template_messages(
    messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None, renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation as the chat template reads it, and the `tools` to pass the template.

    A template that renders tools gets OpenAI's message shapes (arguments as objects, as
    transformers and vLLM pass them). For one that does not, past calls become Hermes blocks in
    the assistant's text and the tools become `tools_instruction` in the system message, so the
    model sees the same protocol it is asked to answer in.
    """
    if renders_tools:
        return [_openai_message(x) for x in messages], tools
    out = [{"role": template_role(x.role), "content": _flat_content(x), **_reasoning(x)} for x in messages]
    if tools:
        instruction = tools_instruction(tools)
        if out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{instruction}" if out[0]["content"] else instruction
        else:
            out.insert(0, {"role": "system", "content": instruction})
    return out, None


def template_role(role: str) -> str:
    """OpenAI's `developer` role (its newer name for the system prompt) is `system` to a chat
    template: templates know only system, user, assistant and tool."""
    return "system" if role == "developer" else role


def template_content(message: ChatMessage) -> str | list[dict[str, str]] | None:
    """A turn's content as chat templates read it: its text, or, when it has images, HF's parts
    in order (`{"type": "image"}` where each image goes, which the template renders as the
    model's image placeholder)."""
    content = message.content
    if isinstance(content, list) and any(isinstance(part, ImagePart) for part in content):
        return [
            {"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
            for part in content
        ]
    return content_text(content) if isinstance(content, list) else content


def _flat_content(message: ChatMessage) -> str | list[dict[str, str]]:
    content = template_content(message)
    calls = [hermes_call(call) for call in message.tool_calls or []]
    if isinstance(content, list):  # a user turn with images (they have no tool calls)
        return content
    return "\n".join(([content] if content else []) + calls)


def _reasoning(message: ChatMessage) -> dict[str, str]:
    """An assistant turn's thinking under the names chat templates read it by: Qwen3's, Kimi's,
    GLM's and MiniMax's `reasoning_content` (vLLM passes `reasoning` too). A template renders
    what it wants of it: most, only after the last user turn (interleaved thinking)."""
    if message.reasoning is None:
        return {}
    return {"reasoning_content": message.reasoning, "reasoning": message.reasoning}


def _openai_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": template_role(message.role),
        "content": template_content(message),
        **_reasoning(message),
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments(c.arguments)},
            }
            for c in message.tool_calls
        ]
    return out


def _arguments(text: str) -> Any:
    """Templates write arguments with `tojson`: give them the object, or the text when it is none."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # nested past the decoder's stack: not an object to give
        return text
    return value if isinstance(value, dict) else text
