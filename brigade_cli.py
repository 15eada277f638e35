"""`brigade`: one command for the whole system (installed by pip as a console script).

    brigade serve [--config FILE] [--set key.path=value ...]   # python supervisor.py ...
    brigade status [--run DIR] [--json] [--once]                # python supervisor.py status ...
    brigade chat|generate|embed|health [--run DIR] ...          # python -m client ...

It only dispatches: the supervisor and the client CLI parse their own arguments, so each
command's --help is theirs.
"""

from __future__ import annotations

import argparse
import sys

SERVER_COMMANDS = ("serve", "status")
CLIENT_COMMANDS = ("chat", "generate", "embed", "health")
CLIENT_OPTIONS = ("--run", "--endpoint", "--timeout")  # the client CLI takes these before its command


def _usage() -> str:
    return (
        "usage: brigade {serve,status,chat,generate,embed,health} ...\n\n"
        "  serve     run a Brigade (python supervisor.py; see brigade serve --help)\n"
        "  status    the stages of a live run (python supervisor.py status)\n"
        "  chat      one chat turn, or an interactive chat (python -m client chat)\n"
        "  generate  continue a raw text prompt (python -m client generate)\n"
        "  embed     one vector per text from an embedding run (python -m client embed)\n"
        "  health    ask every tokenizer replica whether it is ready (python -m client health)\n"
    )


def _client_argv(command: str, rest: list[str]) -> list[str]:
    """`brigade chat --run DIR hi` -> `--run DIR chat hi`, the order the client CLI parses."""
    hoister = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for option in CLIENT_OPTIONS:
        hoister.add_argument(option, action="append", default=[])
    known, others = hoister.parse_known_args(rest)
    front: list[str] = []
    for option in CLIENT_OPTIONS:
        for value in getattr(known, option.lstrip("-")):
            front += [option, value]
    return [*front, command, *others]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in SERVER_COMMANDS:
        import supervisor  # only now: the client commands never load the server side

        return supervisor.main(rest if command == "serve" else ["status", *rest])
    if command in CLIENT_COMMANDS:
        from client.__main__ import main as client_main

        return client_main(_client_argv(command, rest))
    print(f"brigade: unknown command {command!r}\n\n{_usage()}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
