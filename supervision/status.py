"""`python supervisor.py status`: the stage table from the run's status.json (the supervisor
rewrites it every watch round). On a terminal, or with --watch, it refreshes every second;
otherwise (piped, redirected) it prints once, so that scripts end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

STATUS_FILE = "status.json"
REFRESH_S = 1.0


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'stage':<18}{'pid':>8}  {'state':<11}{'restarts':>8}{'uptime':>9}{'queue':>7}{'running':>8}"
        f"{'kv':>7}{'tok/s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['name']:<18}{r['pid']:>8}  {r['state']:<11}{r['restarts']:>8}{r['uptime_s']:>8.0f}s"
            f"{r['queue_depth']:>7}{r['running']:>8}{r['kv_usage'] * 100:>6.1f}%{r['tokens_per_s']:>8.1f}"
        )
    return "\n".join(lines)


def status(run_dir: Path, as_json: bool = False, watch: bool | None = None) -> int:
    """Print the table (or one JSON list); `watch=None` refreshes only when stdout is a terminal."""
    if watch is None:
        watch = sys.stdout.isatty()
    path = run_dir / STATUS_FILE
    while True:
        try:
            rows = json.loads(path.read_text())
        except FileNotFoundError:  # no run, or it stopped (status.json goes with it)
            print(f"no live Brigade run in {run_dir}", file=sys.stderr)
            return 1
        if as_json:
            print(json.dumps(rows))
            return 0
        if not watch:
            print(format_table(rows))
            return 0
        print("\033[2J\033[H" + format_table(rows), flush=True)
        time.sleep(REFRESH_S)
