"""`python -m client`: generate, chat (one shot or interactive), embed and health against a running Brigade."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from client.errors import BrigadeError, InvalidRequest
from client.sdk import Client, StreamDelta


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    parser.add_argument(
        "--run",
        metavar="DIR|FILE",
        help="run directory of the Brigade, or its run.json (default: the per-user one)",
    )
    parser.add_argument(
        "--endpoint",
        action="append",
        help="tokenizer endpoint instead of --run, e.g. tcp://host:port (repeatable)",
    )
    parser.add_argument(
        "--server-key",
        metavar="KEY|FILE",
        help="the run's CURVE server public key (z85) or its certificate file",
    )
    parser.add_argument(
        "--keys", metavar="FILE", help="this client's CURVE secret certificate (the run's client.key_secret)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds per request")
    sub = parser.add_subparsers(dest="command", required=True)
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", type=int, default=None)
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument(
        "--adapter", metavar="NAME", help="the LoRA adapter to generate with (lora.adapters)"
    )
    sampling.add_argument("--stop", nargs="+", action="extend", metavar="STR", help="stop strings")
    sampling.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    constraint = sampling.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="FILE|JSON", help="constrain the output to this JSON schema"
    )
    constraint.add_argument("--regex", metavar="PATTERN", help="constrain the output to match this regex")
    constraint.add_argument(
        "--choice", metavar="A,B,...", help="the output is one of these comma-separated strings"
    )
    constraint.add_argument(
        "--grammar", metavar="FILE|TEXT", help="constrain the output to this EBNF/GBNF or Lark"
    )
    generate = sub.add_parser("generate", parents=[sampling], help="continue a raw text prompt")
    generate.add_argument("prompt", metavar="PROMPT")
    chat = sub.add_parser(
        "chat", parents=[sampling], help="one chat turn, or an interactive chat without MESSAGE"
    )
    chat.add_argument("message", metavar="MESSAGE", nargs="?")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument(
        "--tools", metavar="FILE|JSON", help="functions the model may call: OpenAI's tools list"
    )
    chat.add_argument(
        "--tool-choice",
        metavar="none|auto|required|NAME",
        help="auto (the default with --tools), none, required, or the name of the function to call",
    )
    chat.add_argument(
        "--no-parallel-tool-calls", action="store_true", help="at most one tool call in a reply"
    )
    embed = sub.add_parser(
        "embed", help="one vector per TEXT from an embedding run: a JSON line each, then the prompt tokens"
    )
    embed.add_argument("texts", metavar="TEXT", nargs="+")
    embed.add_argument(
        "--dimensions", type=int, default=None, help="keep the first N values (normalized again)"
    )
    sub.add_parser(
        "health", help="ask every tokenizer replica whether it is ready (exit 1 if one is not, or is silent)"
    )
    return parser


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "regex", "adapter")
    sampling = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.json_schema is not None:
        sampling["json_schema"] = _file_or_text(args.json_schema)
    if args.choice is not None:
        sampling["choice"] = args.choice.split(",")
    if args.grammar is not None:
        sampling["grammar"] = _file_or_text(args.grammar)
    return sampling


def _tools(args: argparse.Namespace) -> dict[str, Any]:
    """--tools, --tool-choice and --no-parallel-tool-calls -> the SDK's tools arguments (chat only)."""
    if getattr(args, "tools", None) is None:
        if getattr(args, "tool_choice", None) is not None or getattr(args, "no_parallel_tool_calls", False):
            raise InvalidRequest("--tool-choice and --no-parallel-tool-calls need --tools")
        return {}
    text = _file_or_text(args.tools)
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"--tools: not JSON (OpenAI's tools list): {exc}") from None
    choice: Any = args.tool_choice
    if choice is not None and choice not in ("none", "auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": not args.no_parallel_tool_calls}


def _file_or_text(value: str) -> str:
    """The contents of the file `value` names, or `value` itself when no such file exists."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a long text is no file name (ENAMETOOLONG)
        return value
    if not is_file:
        return value
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"cannot read {value}: {exc}") from None


def _emit(deltas: Any, as_json: bool) -> str:
    """Stream text to stdout (or collect it for --json); returns the whole text."""
    text: list[str] = []
    ids: list[int] = []
    last: StreamDelta | None = None
    for last in deltas:
        text.append(last.text)
        ids += last.token_ids
        if not as_json:
            print(last.text, end="", flush=True)
    assert last is not None
    usage = last.usage
    calls = [] if last.tools is None else [msgspec.structs.asdict(call) for call in last.tools.calls]
    if as_json:
        print(
            json.dumps(
                {
                    "text": "".join(text),
                    "token_ids": ids,
                    "finish_reason": last.finish_reason,
                    **({} if last.tools is None else {"content": last.tools.content, "tool_calls": calls}),
                    "usage": None
                    if usage is None
                    else {
                        "prompt_tokens": usage.prompt_tokens,
                        "completion_tokens": usage.completion_tokens,
                        "cached_tokens": usage.cached_tokens,
                    },
                },
                ensure_ascii=False,
            )
        )
    else:
        print(flush=True)
        for (
            call
        ) in calls:  # the streamed text shows the model's call markup; these are the calls read from it
            print(f"tool call {call['id']}: {call['name']}({call['arguments']})", flush=True)
    return "".join(text)


def _interactive(client: Client, args: argparse.Namespace) -> None:
    history = [{"role": "system", "content": args.system}] if args.system else []
    print(f"chatting with {client.model or 'Brigade'} (Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = _emit(
                client.stream(messages=history, timeout=args.timeout, **_sampling(args)), as_json=False
            )
        except BrigadeError as exc:
            history.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})


def _health(client: Client, timeout: float) -> int:
    """A line per replica that answered; 1 when one did not answer or is not ready, which scripts
    and probes read from the exit status (a hung replica used to leave no trace and exit 0)."""
    replies = client.health(timeout=timeout)
    for reply in replies:
        print(
            json.dumps(
                {
                    "tokenizer_id": reply.tokenizer_id,
                    "is_ready": reply.is_ready,
                    "model": reply.model,
                    "num_in_flight": reply.num_in_flight,
                    "max_model_len": reply.max_model_len,
                }
            )
        )
    silent = [replica.endpoint for replica in client.session.replicas if replica.health is None]
    not_ready = [reply.tokenizer_id for reply in replies if not reply.is_ready]
    if silent:
        print(f"error: no health reply within {timeout:g}s from {', '.join(silent)}", file=sys.stderr)
    if not_ready:
        print(f"error: tokenizer(s) {', '.join(map(str, not_ready))} not ready", file=sys.stderr)
    return 1 if silent or not_ready else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        client = Client(
            args.run,
            endpoints=args.endpoint,
            timeout=args.timeout,
            server_key=args.server_key,
            keys=args.keys,
        )
        with client:
            if args.command == "health":
                return _health(client, 5.0 if args.timeout is None else args.timeout)
            elif args.command == "embed":
                result = client.embed(args.texts, dimensions=args.dimensions)
                for index, vector in enumerate(result.embeddings):
                    print(json.dumps({"index": index, "embedding": vector.tolist()}))
                print(json.dumps({"prompt_tokens": result.prompt_tokens}))
            elif args.command == "generate":
                _emit(client.stream(args.prompt, **_sampling(args)), args.json)
            elif args.message is None:
                if args.tools is not None:
                    raise InvalidRequest("--tools needs a MESSAGE (the interactive chat takes no tools)")
                _interactive(client, args)
            else:
                messages = [{"role": "system", "content": args.system}] if args.system else []
                messages.append({"role": "user", "content": args.message})
                _emit(client.stream(messages=messages, **_sampling(args), **_tools(args)), args.json)
    except BrigadeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`| head -c 10`); the client's close has aborted the request.
        # Stop quietly, as `cat` does: stdout points to /dev/null so that the interpreter's last
        # flush at exit does not fail on the pipe again and print "Exception ignored".
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # what a process killed by SIGPIPE exits with: the shell's convention
    return 0


if __name__ == "__main__":
    sys.exit(main())
