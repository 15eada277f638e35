"""Normal streams beside attacks (issue 29): 16 streaming /v1/completions requests (greedy, fixed
output length, ignore_eos) first alone, then with each attack looping beside them, against one
Brigade run it starts (gateway on, the embedded SmolLM2, float32) on 127.0.0.1.

    python benchmarks/attack_bench.py [--streams 16] [--output-len 64] [--attacks NAME,...]
        [--cpu-shots N] [--set key=value ...] [--json FILE]

Per attack it prints the normal streams' TPOT p50 with and without it and their ratio (target
<= 1.5x), the scheduler's RSS before and after, stage restarts, and the attack's own outcome
(how many of its requests got the refusal they should: a 400 naming the limit, a 401, a 408 or a
closed connection). Every attack loop stops by itself (a shot count and a deadline).
`tests/test_gateway.py::test_normal_streams_beside_every_attack` runs the same attacks, without
timings, on every CI run.

With `--cpu-shots N` it first fires N shots of each attack one after another, with no streams,
and prints the CPU time (user + system, from /proc) each shot cost every stage kind, the
supervisor and the attacking client's own thread: CPU per shot is what an attack takes from the
streams, and unlike their TPOT it hardly moves with the load of a shared host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import itertools
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import datasets, peers, serve  # noqa: E402

ATTACK_REQUEST_TIMEOUT_S = 120.0
# How long past the gateway's own deadline a slow-client connection may stay open before the
# attack counts it as "never closed".
CLOSE_GRACE_S = 30.0
TRICKLE_EVERY_S = 0.2
SLOWLORIS_CONNECTIONS = 8
# The benchmark's run: API keys on (so the 401 flood means something) and short slow-client
# deadlines (the defaults, 10 s and 60 s, would make each slow-client shot outlast the streams).
BENCH_API_KEY = "sk-attack-bench"
# The pathological regexes' own client: past structured.max_costly_compiles refused compiles a
# client gets 429 for every constrained request, which would end the other constrained attacks'
# checks (constraints matching nothing, forced calls) if they shared its key.
COSTLY_API_KEY = "sk-attack-bench-regex"
# Each oversized attack's own client, for the same reason: past gateway.max_oversized_requests a
# client's large bodies get 429 before they are read, and each attack should meet that limit
# afresh rather than start where the one before it left its client.
OVERSIZED_API_KEYS = {
    name: f"sk-attack-bench-{name}" for name in ("many_messages", "huge_tool_arguments", "deep_json")
}
BENCH_OVERRIDES = [
    f"gateway.api_keys=[{','.join([BENCH_API_KEY, COSTLY_API_KEY, *OVERSIZED_API_KEYS.values()])}]",
    "gateway.header_timeout_s=2",
    "gateway.body_timeout_s=5",
]
TPOT_RATIO_TARGET = 1.5


@dataclass(frozen=True)
class Target:
    """The gateway under attack and the limits its refusals are checked against."""

    port: int
    api_key: str | None
    costly_api_key: str | None  # the pathological regexes' (None: api_key)
    max_prompt_chars: int
    max_messages: int
    header_timeout_s: float
    body_timeout_s: float
    # Attack name -> its own key (absent: api_key); not part of the hash (_cached keys on targets).
    oversized_api_keys: dict[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def of_run(
        cls,
        run_dir: Path,
        api_key: str | None,
        costly_api_key: str | None = None,
        oversized_api_keys: dict[str, str] | None = None,
    ) -> Target:
        from services.stage import read_run_info

        config = read_run_info(run_dir).config
        return cls(
            port=config.gateway.port,
            api_key=api_key,
            costly_api_key=costly_api_key,
            oversized_api_keys=oversized_api_keys or {},
            max_prompt_chars=config.tokenizer.max_prompt_chars,
            max_messages=config.tokenizer.max_messages,
            header_timeout_s=config.gateway.header_timeout_s,
            body_timeout_s=config.gateway.body_timeout_s,
        )

    def post(self, path: str, body: bytes, authorization: str | None = None) -> tuple[int, bytes]:
        """One POST on a fresh connection: status and body."""
        headers = {"content-type": "application/json"}
        if authorization or self.api_key:
            headers["authorization"] = authorization or f"Bearer {self.api_key}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=ATTACK_REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", path, body, headers)
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()


# -- attacks: one shot each returns None when it was refused as it should be, else what happened --

Shot = Callable[[Target, int], str | None]


def expect(status: int, reply: bytes, want_status: int, *needles: str) -> str | None:
    if status == want_status and all(n.encode() in reply for n in needles):
        return None
    return f"HTTP {status} (want {want_status} naming {needles}): {reply[:200]!r}"


def huge_tokenize(target: Target, i: int) -> str | None:
    """Twice the character budget through /tokenize (it used to render on the gateway's loop)."""
    body = _cached("huge_tokenize", target, lambda: {"prompt": "x " * target.max_prompt_chars})
    return expect(*target.post("/tokenize", body), 400, "tokenizer.max_prompt_chars")


def many_messages(target: Target, i: int) -> str | None:
    """25x the message budget (102,400 messages at the default 4096) in one chat."""

    def build() -> dict:
        return {"messages": [{"role": "user", "content": "a"}] * (25 * target.max_messages), "max_tokens": 2}

    return expect_oversized(
        target, "many_messages", _cached("many_messages", target, build), "tokenizer.max_messages"
    )


def huge_tool_arguments(target: Target, i: int) -> str | None:
    """6x the character budget (6M chars at the default) as one past tool call's arguments."""

    def build() -> dict:
        arguments = '{"x": "' + "a" * (6 * target.max_prompt_chars) + '"}'
        call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
            ],
            "max_tokens": 2,
        }

    body = _cached("huge_tool_arguments", target, build)
    return expect_oversized(target, "huge_tool_arguments", body, "tokenizer.max_prompt_chars")


OUT_OF_RANGE = [
    ("/v1/completions", {"prompt": [2**31], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {str(2**70): 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [2**64]}),
]


def out_of_range_ints(target: Target, i: int) -> str | None:
    """Integers past the wire (they used to kill the gateway's job task: the client hung)."""
    path, body = OUT_OF_RANGE[i % len(OUT_OF_RANGE)]
    return expect(*target.post(path, json.dumps(body).encode()), 400, "out of range")


DEEP_JSON = (
    b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"x": '
    + b"[" * 10_000
    + b"]" * 10_000
    + b"}}"
)


def deep_json(target: Target, i: int) -> str | None:
    """10k levels of JSON (it ran the decoder out of stack: a 500)."""
    return expect_oversized(target, "deep_json", DEEP_JSON, "levels deep")


def expect_oversized(target: Target, name: str, body: bytes, needle: str) -> str | None:
    """A chat over a size budget: a 400 naming it, or, once the attack's client has had
    gateway.max_oversized_requests of them refused, a 429 naming that, sent before the body is
    read (the client may then see the connection reset under what it is still sending)."""
    key = target.oversized_api_keys.get(name)
    try:
        status, reply = target.post("/v1/chat/completions", body, f"Bearer {key}" if key else None)
    except OSError:  # reset: refused and closed before the body was read
        return None
    if status == 429:
        return expect(status, reply, 429, "gateway.max_oversized_requests")
    return expect(status, reply, 400, needle)


def regex(pattern: str) -> bytes:
    body = {"prompt": "a", "max_tokens": 8, "structured_outputs": {"regex": pattern}}
    return json.dumps(body).encode()


def expect_costly(target: Target, pattern: str) -> str | None:
    """A pathological regex: a 400 naming it, or, once its client has had
    structured.max_costly_compiles of them refused for their compile's cost, a 429 naming that."""
    authorization = f"Bearer {target.costly_api_key}" if target.costly_api_key else None
    status, reply = target.post("/v1/completions", regex(pattern), authorization)
    if status == 429:
        return expect(status, reply, 429, "structured.max_costly_compiles")
    return expect(status, reply, 400, "structured.regex")


def regex_611(target: Target, i: int) -> str | None:
    """`(a{600}){611}`: its lexer ran for seconds per step, slowing every other stream 5x."""
    return expect_costly(target, "(a{600}){611}")


_distinct = itertools.count(1)


def regex_700_distinct(target: Target, i: int) -> str | None:
    """`(a{700}){700}b{k}`, a new k each time: each compile kept ~160 MB in the scheduler and
    cost it about 0.2 s of CPU; past its client's costly compiles, a 429 costs nothing."""
    return expect_costly(target, f"(a{{700}}){{700}}b{{{next(_distinct)}}}")


def matches_nothing(target: Target, i: int) -> str | None:
    """A constraint no output satisfies (it was a 200 with empty text)."""
    spec = {"regex": r"[^\s\S]"} if i % 2 == 0 else {"grammar": "start: start"}
    body = json.dumps({"prompt": "a", "max_tokens": 4, "structured_outputs": spec}).encode()
    return expect(*target.post("/v1/completions", body), 400, "matches no output")


NON_OBJECT_TOOL = json.dumps(
    {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}],
        "tool_choice": "required",
    }
).encode()


def non_object_tool(target: Target, i: int) -> str | None:
    """A forced call whose parameters are no object (it came back as plain content)."""
    return expect(*target.post("/v1/chat/completions", NON_OBJECT_TOOL), 400, "'object'")


def slowloris_headers(target: Target, i: int) -> str | None:
    """Connections that send half their headers, then nothing: each must be closed (a 408 or
    just closed) by the header deadline."""
    sockets = []
    try:
        for _ in range(SLOWLORIS_CONNECTIONS):
            sock = socket.create_connection(
                ("127.0.0.1", target.port), timeout=target.header_timeout_s + CLOSE_GRACE_S
            )
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            sockets.append(sock)
        for sock in sockets:
            reply = _read_until_closed(sock)
            if reply is None:
                return "a stalled header was never closed"
            if reply and not reply.startswith(b"HTTP/1.1 408"):
                return f"a stalled header got {reply[:100]!r}"
        return None
    finally:
        for sock in sockets:
            sock.close()


def trickled_body(target: Target, i: int) -> str | None:
    """A body sent one byte at a time: cut off with a 408 at the body deadline."""
    body = json.dumps({"prompt": "x" * 200, "max_tokens": 1}).encode()
    auth = f"Authorization: Bearer {target.api_key}\r\n" if target.api_key else ""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    deadline = time.monotonic() + target.body_timeout_s + CLOSE_GRACE_S
    with socket.create_connection(("127.0.0.1", target.port), timeout=TRICKLE_EVERY_S) as sock:
        sock.sendall(head)
        reply = b""
        for byte in body:
            if time.monotonic() > deadline:
                return "a trickled body was never cut off"
            try:
                sock.sendall(bytes([byte]))
                reply += sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # reset: the server closed the connection
                break
            if reply:
                sock.settimeout(CLOSE_GRACE_S)
                reply += _read_until_closed(sock) or b""  # the 408's body may come in a later packet
                break
    return expect(
        int(reply.split()[1]) if reply.startswith(b"HTTP/") else 0, reply, 408, "gateway.body_timeout_s"
    )


UNAUTHORIZED = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()


def unauthorized(target: Target, i: int) -> str | None:
    """Requests with a wrong key, each a different one (the 401s are aggregated, not logged each)."""
    reply = target.post("/v1/completions", UNAUTHORIZED, authorization=f"Bearer sk-wrong-{i}")
    return expect(*reply, 401)


ATTACKS: dict[str, Shot] = {
    "huge_tokenize": huge_tokenize,
    "many_messages": many_messages,
    "huge_tool_arguments": huge_tool_arguments,
    "out_of_range_ints": out_of_range_ints,
    "deep_json": deep_json,
    "regex_611": regex_611,
    "regex_700_distinct": regex_700_distinct,
    "matches_nothing": matches_nothing,
    "non_object_tool": non_object_tool,
    "slowloris_headers": slowloris_headers,
    "trickled_body": trickled_body,
    "unauthorized": unauthorized,  # only where the run has API keys
}

_bodies: dict[tuple[str, Target], bytes] = {}


def _cached(name: str, target: Target, build: Callable[[], dict]) -> bytes:
    """A big body built once per target: building it in every shot would load the client, not the server."""
    if (name, target) not in _bodies:
        _bodies[name, target] = json.dumps(build()).encode()
    return _bodies[name, target]


def _read_until_closed(sock: socket.socket) -> bytes | None:
    """Everything the server sends until it closes; None if it did not within the socket's timeout."""
    reply = b""
    try:
        while data := sock.recv(4096):
            reply += data
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return reply


# -- running attacks beside a load ----------------------------------------------------------------


@dataclass
class AttackOutcome:
    """What one attack's loops did: shots started and finished, how many went wrong (the first
    few of them described)."""

    started: int = 0
    done: int = 0
    num_wrong: int = 0
    wrong: list[str] = field(default_factory=list)


@contextlib.contextmanager
def attacking(
    target: Target, names: list[str], workers: int = 2, max_shots: int = 200, max_seconds: float = 300.0
) -> Iterator[dict[str, AttackOutcome]]:
    """Loop each named attack in `workers` threads while the body runs: every attack has a shot in
    flight before the body starts; on exit the loops stop (after their current shot) and are joined.
    Each loop also stops by itself after `max_shots` shots or `max_seconds`."""
    outcomes = {name: AttackOutcome() for name in names}
    stop = threading.Event()
    lock = threading.Lock()
    deadline = time.monotonic() + max_seconds

    def loop(name: str) -> None:
        outcome = outcomes[name]
        while not stop.is_set() and time.monotonic() < deadline:
            with lock:
                if outcome.started >= max_shots:
                    return
                i = outcome.started
                outcome.started += 1
            try:
                wrong = ATTACKS[name](target, i)
            except Exception as exc:  # a failed shot is an outcome to report, not the end of the run
                wrong = f"{type(exc).__name__}: {exc}"[:200]
            with lock:
                outcome.done += 1
                if wrong is not None:
                    outcome.num_wrong += 1
                    if len(outcome.wrong) < 5:
                        outcome.wrong.append(wrong)

    threads = [
        threading.Thread(target=loop, args=(name,), daemon=True) for name in names for _ in range(workers)
    ]
    for thread in threads:
        thread.start()
    while time.monotonic() < deadline and not all(o.started for o in outcomes.values()):
        time.sleep(0.01)
    try:
        yield outcomes
    finally:
        stop.set()
        join_deadline = time.monotonic() + ATTACK_REQUEST_TIMEOUT_S + CLOSE_GRACE_S
        for thread in threads:
            thread.join(timeout=max(0.0, join_deadline - time.monotonic()))
        for outcome in outcomes.values():
            if outcome.done < outcome.started:
                outcome.num_wrong += outcome.started - outcome.done
                outcome.wrong.append(f"{outcome.started - outcome.done} shots never finished")


CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S  # utime, stime: fields 14, 15


def cpu_by_kind(run_dir: Path, supervisor_pid: int) -> dict[str, float]:
    """CPU seconds so far of each stage kind (its replicas summed) and of the supervisor."""
    totals = {"supervisor": process_cpu_s(supervisor_pid)}
    for row in json.loads((run_dir / "status.json").read_text()):
        totals[row["kind"]] = totals.get(row["kind"], 0.0) + process_cpu_s(row["pid"])
    return totals


def cpu_per_shot(target: Target, run_dir: Path, supervisor_pid: int, name: str, shots: int) -> dict:
    """Fire `shots` shots of one attack in a row (after one unmeasured) and return the CPU
    milliseconds per shot of each process kind and of the client's shot thread, idle CPU taken out:
    each process's rate over an idle second before, times the shots' wall time."""
    ATTACKS[name](target, -1)  # builds and caches the body, warms the connection path
    idle_s = 1.0
    before = cpu_by_kind(run_dir, supervisor_pid)
    time.sleep(idle_s)
    idle = {k: (v - before[k]) / idle_s for k, v in cpu_by_kind(run_dir, supervisor_pid).items()}
    wrong = 0
    before = cpu_by_kind(run_dir, supervisor_pid)
    started, client_started = time.monotonic(), time.thread_time()
    for i in range(shots):
        wrong += ATTACKS[name](target, i) is not None
    client_s, wall_s = time.thread_time() - client_started, time.monotonic() - started
    after = cpu_by_kind(run_dir, supervisor_pid)
    ms = {k: max(0.0, after[k] - before[k] - idle[k] * wall_s) * 1000 / shots for k in after}
    ms["client"] = client_s * 1000 / shots
    return {"shots": shots, "wrong": wrong, "wall_ms": wall_s * 1000 / shots, "cpu_ms": ms,
            "idle_cpu_per_s": idle}  # fmt: skip


CPU_COLUMNS = ("client", "gateway", "tokenizer", "scheduler", "gpu_worker", "detokenizer", "supervisor")


def stage_table(run_dir: Path) -> dict[str, tuple[int, int]]:
    """{stage name: (pid, restarts)} from the supervisor's status.json."""
    rows = json.loads((run_dir / "status.json").read_text())
    return {row["name"]: (row["pid"], row["restarts"]) for row in rows}


def scheduler_rss_mib(run_dir: Path) -> float:
    """The scheduler stages' resident memory (VmRSS), summed."""
    total = 0.0
    for row in json.loads((run_dir / "status.json").read_text()):
        if row["kind"] == "scheduler":
            for line in Path(f"/proc/{row['pid']}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


# -- the benchmark --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--streams", type=int, default=16, help="normal streams, all at once (0: none, only --cpu-shots)"
    )
    p.add_argument("--output-len", type=int, default=64, help="tokens each normal stream generates")
    p.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated, from " + ",".join(ATTACKS))
    p.add_argument("--workers", type=int, default=2, help="concurrent loops per attack")
    p.add_argument("--max-shots", type=int, default=200, help="per attack loop")
    p.add_argument("--cpu-shots", type=int, default=0, help="first measure CPU per shot over this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--log-dir", type=Path, help="where Brigade's log goes (default: a temp dir)")
    args = p.parse_args(argv)
    args.attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(args.attacks) - set(ATTACKS)
    if unknown:
        p.error(f"unknown attacks {sorted(unknown)}; choose from {', '.join(ATTACKS)}")
    return args


def load_phase(target: Target, requests: list, seed: int, desc: str) -> dict:
    def send(request: datasets.BenchRequest):
        return peers.openai_stream(target.port, request, api_key=target.api_key)

    results, duration = asyncio.run(serve.drive(send, requests, len(requests), None, seed, desc))
    return serve.setting_stats(results, duration)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, serve._exit_on_signal)
    from services.gpu_worker.loader import prepare_model

    model_dir = prepare_model(None)
    requests = datasets.chat_requests(
        model_dir, max(args.streams, 1), (args.output_len, args.output_len), args.seed
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="brigade-attack-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="brigade-attack-"))
    overrides = [
        f"model.dtype={args.dtype}",
        f"gateway.port={peers.free_port()}",
        *BENCH_OVERRIDES,
        *args.set,
    ]
    report: dict = {
        "command": " ".join(
            ["python", "benchmarks/attack_bench.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "model": "SmolLM2-135M-Instruct",
        "machine": {**serve.machine_info(), "loadavg": os.getloadavg()},
        "config": {"streams": args.streams, "output_len": args.output_len, "overrides": overrides},
        "tpot_ratio_target": TPOT_RATIO_TARGET,
        "attacks": {},
    }
    run = serve.BrigadeProcess(run_dir, args.config, overrides, log_dir / "brigade.log")
    try:
        run.wait_ready(serve.READY_TIMEOUT_S)
        target = Target.of_run(run_dir, BENCH_API_KEY, COSTLY_API_KEY, OVERSIZED_API_KEYS)
        load_phase(target, serve.warmup_requests(requests), args.seed, "warmup")
        if args.cpu_shots:
            print(f"CPU ms per shot ({args.cpu_shots} shots in a row, no streams, idle CPU taken out)")
            print(f"{'attack':<22}{'wall':>7}" + "".join(f"{c:>12}" for c in CPU_COLUMNS) + f"{'total':>8}")
            report["cpu_per_shot"] = {}
            for name in args.attacks:
                row = cpu_per_shot(target, run_dir, run.process.pid, name, args.cpu_shots)
                report["cpu_per_shot"][name] = row
                cpu = row["cpu_ms"]
                print(
                    f"{name:<22}{row['wall_ms']:>7.0f}"
                    + "".join(f"{cpu.get(c, 0.0):>12.1f}" for c in CPU_COLUMNS)
                    + f"{sum(cpu.values()):>8.0f}"
                    + (f"  {row['wrong']} WRONG" if row["wrong"] else ""),
                    flush=True,
                )
        stages_before = stage_table(run_dir)
        beside_streams = args.attacks if args.streams else []  # --streams 0: CPU per shot only
        if beside_streams:
            print(
                f"{args.streams} streams x {args.output_len} tokens; TPOT p50 in ms alone (just before) and beside"
            )
            print(
                f"{'attack':<22}{'alone':>7}{'beside':>8}{'ratio':>7}{'sched RSS MiB':>16}{'restarts':>9}  outcome"
            )
        for name in beside_streams:
            # Alone right before each attack: on a shared host the load drifts more over the whole
            # run than the attacks move the streams.
            alone = load_phase(target, requests, args.seed, f"alone before {name}")
            rss_before = scheduler_rss_mib(run_dir)
            with attacking(target, [name], args.workers, args.max_shots) as outcomes:
                stats = load_phase(target, requests, args.seed, name)
            stages = stage_table(run_dir)
            outcome = outcomes[name]
            row = {
                "alone": alone,
                "normal": stats,
                "tpot_p50_ratio": stats["tpot_ms"]["p50"] / alone["tpot_ms"]["p50"],
                "scheduler_rss_mib": [rss_before, scheduler_rss_mib(run_dir)],
                "restarts": sum(r for _, r in stages.values()) - sum(r for _, r in stages_before.values()),
                "pids_changed": sorted(n for n in stages if stages[n][0] != stages_before.get(n, (None,))[0]),
                "attack": {
                    "shots": outcome.done,
                    "shots_per_s": outcome.done / stats["duration_s"],
                    "as_expected": outcome.done - outcome.num_wrong,
                    "wrong": outcome.wrong,
                },
            }
            report["attacks"][name] = row
            verdict = "ok" if not outcome.wrong else f"WRONG: {outcome.wrong[0]}"
            failed = stats["failures"]["total"] + alone["failures"]["total"]
            print(
                f"{name:<22}{alone['tpot_ms']['p50']:>7.1f}{stats['tpot_ms']['p50']:>8.1f}{row['tpot_p50_ratio']:>6.2f}x"
                f"{row['scheduler_rss_mib'][0]:>7.0f} ->{row['scheduler_rss_mib'][1]:>6.0f}{row['restarts']:>9}"
                f"  {outcome.done} shots ({outcome.done / stats['duration_s']:.0f}/s) {verdict}"
                + (f"; {failed} normal streams failed" if failed else ""),
                flush=True,
            )
    finally:
        report["leftovers"] = run.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
