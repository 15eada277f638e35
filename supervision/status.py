"""What a run says of its stages, in two files of one row shape (services/stage_rows.py's
`StageRow`), and `python supervisor.py status`, which reads one.

The supervisor rewrites status.json (the `status` table; the gateways' /health) when a stage
changes state and once per heartbeat interval, and metrics/stages.json (read by /metrics at
scrape time) once per heartbeat interval: `StatusWriter`. On a terminal, or with --watch, `status`
refreshes every second; otherwise (piped, redirected) it prints once, so that scripts end."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from ipc.endpoints import is_process_alive
from services import metrics
from services.stage import RUN_FILE
from services.stage_rows import STATUS_FILE, StageRow, read_status
from supervision.stages import StageHandle

REFRESH_S = 1.0

log = logging.getLogger("supervisor")


def stage_row(stage: StageHandle, now: float) -> StageRow:
    """One stage's row of both files."""
    load = stage.load
    return StageRow(
        name=stage.name,
        kind=stage.kind,
        pid=stage.pid,
        state=stage.state,
        restarts=stage.num_restarts,
        engine=stage.group,
        uptime_s=round(now - stage.started_at, 1) if stage.state == "running" else 0.0,
        queue_depth=load.num_waiting + load.num_in_flight,
        running=load.num_running,
        waiting=load.num_waiting,
        kv_usage=load.kv_usage,
        tokens_per_s=round(stage.tokens_rate, 1),
        malformed=load.num_malformed,
        auth_failures=load.num_auth_failures,
        gpu_memory_allocated=load.gpu_memory_allocated,
        gpu_memory_reserved=load.gpu_memory_reserved,
        node=stage.node,
        protections=stage.protections,
        lora_adapters=load.lora_adapters,
        lora_running=load.lora_running,
        lora_waiting=load.lora_waiting,
    )


class StatusWriter:
    """Writes both files. A full disk must not end the run: a failed write is logged once, when
    that file's writes start failing, and once when they work again; meanwhile the file keeps its
    last content, and each later update tries again."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.failing: set[str] = set()
        self.states: list[tuple[str, int, str, int]] = []  # what status.json last said of each stage

    def write_status(self, stages: Iterable[StageHandle], is_due: bool) -> None:
        """status.json, when a stage changed state, at once (the gateways' /health and `status`
        read it), or when `is_due` (fresh loads, once per heartbeat interval): a rewrite costs a
        file write and a rename, too much for every round of the watch loop."""
        stages = list(stages)
        states = [(s.name, s.pid, s.state, s.num_restarts) for s in stages]
        if not is_due and states == self.states:
            return
        self.states = states
        now = time.monotonic()
        rows = [stage_row(stage, now) for stage in stages]

        def write() -> None:
            tmp = self.run_dir / (STATUS_FILE + ".tmp")
            tmp.write_bytes(msgspec.json.encode(rows))
            tmp.replace(self.run_dir / STATUS_FILE)

        self._attempt(STATUS_FILE, write)

    def write_samples(
        self,
        stages: Iterable[StageHandle],
        rings: list[metrics.RingSample],
        model: str,
        device: str,
        num_auth_failures: int,
        groups: metrics.EngineGroupsSample | None = None,
    ) -> None:
        now = time.monotonic()
        supervisor = StageRow(
            "supervisor", "supervisor", os.getpid(), "running", auth_failures=num_auth_failures
        )
        rows = [supervisor, *(stage_row(stage, now) for stage in stages)]
        samples = metrics.StageSamples(model, device, rows, rings, groups)
        self._attempt(
            f"{metrics.METRICS_DIR}/{metrics.STAGES_FILE}",
            lambda: metrics.write_stage_samples(self.run_dir, samples),
        )

    def _attempt(self, what: str, write: Callable[[], None]) -> None:
        try:
            write()
        except OSError as exc:
            if what not in self.failing:
                log.error(
                    "could not write %s (%s); serving on, and retrying with each update", what, exc.strerror
                )
                self.failing.add(what)
            return
        if what in self.failing:
            self.failing.discard(what)
            log.info("%s written again", what)


def format_table(rows: list[StageRow]) -> str:
    header = (
        f"{'stage':<18}{'pid':>8}  {'state':<11}{'restarts':>8}{'uptime':>9}{'queue':>7}{'running':>8}"
        f"{'kv':>7}{'tok/s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.name:<18}{r.pid:>8}  {r.state:<11}{r.restarts:>8}{r.uptime_s:>8.0f}s"
            f"{r.queue_depth:>7}{r.running:>8}{r.kv_usage * 100:>6.1f}%{r.tokens_per_s:>8.1f}"
        )
    return "\n".join(lines)


# A live supervisor rewrites status.json every heartbeat (supervisor.heartbeat_interval_s). One
# that no process here is, and whose file has stood still this long, was killed and removed
# nothing; a run on another host (a shared run dir) keeps its file fresh.
STALE_STATUS_S = 10.0


def _age_s(path: Path) -> float:
    return time.time() - path.stat().st_mtime


class _RunPid(msgspec.Struct):
    supervisor_pid: int


def supervisor_pid(run_dir: Path) -> int | None:
    """The run's supervisor, from run.json (None without one to read)."""
    try:
        return msgspec.json.decode((run_dir / RUN_FILE).read_bytes(), type=_RunPid).supervisor_pid
    except (OSError, msgspec.DecodeError):
        return None


def status(run_dir: Path, as_json: bool = False, watch: bool | None = None) -> int:
    """Print the table (or one JSON list); `watch=None` refreshes only when stdout is a terminal."""
    try:
        return _print_status(run_dir, as_json, sys.stdout.isatty() if watch is None else watch)
    except BrokenPipeError:  # the reader went away (`| head`): done, without a traceback at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _print_status(run_dir: Path, as_json: bool, watch: bool) -> int:
    while True:
        try:
            rows = read_status(run_dir)
        except FileNotFoundError:  # no run, or it stopped (status.json goes with it)
            print(f"no live Brigade run in {run_dir}", file=sys.stderr)
            return 1
        except OSError as exc:  # not a directory, unreadable, a directory in the file's place
            print(f"no Brigade run to read in {run_dir}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        except msgspec.DecodeError as exc:  # the supervisor replaces it whole: not one of its files
            print(f"{run_dir / STATUS_FILE} is not a Brigade status file ({exc})", file=sys.stderr)
            return 1
        pid = supervisor_pid(run_dir)
        if pid is not None and not is_process_alive(pid) and _age_s(run_dir / STATUS_FILE) > STALE_STATUS_S:
            print(f"no live Brigade run in {run_dir}: its supervisor (pid {pid}) is gone", file=sys.stderr)
            return 1
        if as_json:
            print(json.dumps(msgspec.to_builtins(rows)))
            return 0
        if not watch:
            print(format_table(rows))
            return 0
        print("\033[2J\033[H" + format_table(rows), flush=True)
        time.sleep(REFRESH_S)
