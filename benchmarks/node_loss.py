"""Time from an engine node's death to its group serving again, on a Ray cluster that this script
starts on this machine (`ray.cluster_utils.Cluster`): a head node, and engine nodes that take turns
at two addresses (the head's and 127.0.0.2), so that every re-placement also moves the group's
links (docs/scaling.md "When a node dies").

    python benchmarks/node_loss.py [--repeat 3] [--max-tokens 64] [--set key=value ...] [--json out.json]

Each round, a spare engine node joins at the other address; a greedy request streams; the node
that holds the engine group is removed (its raylet and every process on it killed) and Ray places
the group again on the spare. Seconds from the removal to:
- `placed`: the supervisor sees the group's scheduler on the spare node (`status`);
- `ready`: that scheduler is up again (its worker loaded the model and said hello);
- `served`: the first token of a request sent right after the removal.
The request in flight must end with the same text as without the fault.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ray.cluster_utils import Cluster  # noqa: E402

from benchmarks.serve import BrigadeProcess  # noqa: E402
from client import Client  # noqa: E402
from services.stage_rows import STATUS_FILE  # noqa: E402

ENGINE = "bench_engine"  # the resource that marks the engine nodes
OTHER_ADDRESS = "127.0.0.2"
PROMPT = "Once upon a time"
READY_TIMEOUT_S = 900.0
WAIT_S = 600.0  # for any one event of a round


def status_row(run_dir: Path, name: str) -> dict:
    try:
        rows = json.loads((run_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):  # replaced as we read it
        return {}
    return next((row for row in rows if row["name"] == name), {})


def wait_for(what: str, condition, deadline: float) -> float:
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {WAIT_S:.0f}s")
        time.sleep(0.05)
    return time.monotonic()


def one_round(
    cluster: Cluster, run_dir: Path, holder, reference: str, max_tokens: int
) -> tuple[dict, object]:
    """Remove `holder` (the node with the group) while a request streams; the times, and the spare
    node that holds the group now."""
    at_other = {} if holder.node_ip_address == OTHER_ADDRESS else {"node_ip_address": OTHER_ADDRESS}
    spare = cluster.add_node(num_cpus=1, resources={ENGINE: 1}, **at_other)
    cluster.wait_for_nodes()
    restarts = status_row(run_dir, "scheduler-0")["restarts"]
    texts: list[str] = []
    first_token, served = threading.Event(), threading.Event()

    def stream() -> None:
        with Client(run_dir, failover_after=5.0, unavailable_after=WAIT_S) as client:
            parts = []
            for delta in client.stream(
                PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=WAIT_S
            ):
                parts.append(delta.text)
                first_token.set()
            texts.append("".join(parts))

    def fresh() -> None:
        with Client(run_dir, failover_after=5.0, unavailable_after=WAIT_S) as client:
            for _ in client.stream(PROMPT, max_tokens=1, temperature=0.0, timeout=WAIT_S):
                served.set()

    in_flight = threading.Thread(target=stream, daemon=True)
    in_flight.start()
    if not first_token.wait(WAIT_S):
        raise TimeoutError("the request in flight got no first token")
    start = time.monotonic()
    cluster.remove_node(holder)
    threading.Thread(target=fresh, daemon=True).start()
    deadline = start + WAIT_S
    placed = wait_for(
        "placement", lambda: status_row(run_dir, "scheduler-0").get("node") == spare.node_id, deadline
    )
    ready = wait_for(
        "ready scheduler",
        lambda: (
            status_row(run_dir, "scheduler-0").get("state") == "running"
            and status_row(run_dir, "scheduler-0")["restarts"] > restarts
        ),
        deadline,
    )
    wait_for("first token", served.is_set, deadline)
    times = {"placed": placed - start, "ready": ready - start, "served": time.monotonic() - start}
    in_flight.join(WAIT_S)
    if texts != [reference]:
        raise AssertionError(f"the request in flight ended with {texts!r}, not {reference!r}")
    times["to_address"] = spare.node_ip_address
    return times, spare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="node deaths to measure")
    parser.add_argument("--max-tokens", type=int, default=64, help="of the request in flight")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    parser.add_argument("--json", type=Path, help="write the rounds and their medians here")
    args = parser.parse_args(argv)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    run = None
    try:
        holder = cluster.add_node(num_cpus=1, resources={ENGINE: 1}, node_ip_address=OTHER_ADDRESS)
        cluster.wait_for_nodes()
        head_address = cluster.address.rsplit(":", 1)[0]
        overrides = [
            "cluster.backend=ray", f"cluster.ray_address={cluster.address}",
            f"cluster.engine_resources={{{ENGINE}: 1}}", f"network.host={head_address}", "gateway.replicas=0",
            "supervisor.metrics_port=0", *args.set,
        ]  # fmt: skip
        run_dir = Path(tempfile.mkdtemp(prefix="brigade-node-loss-"))
        run = BrigadeProcess(
            run_dir, "configs/default.yaml", overrides, run_dir.parent / f"{run_dir.name}.log"
        )
        run.wait_ready(READY_TIMEOUT_S)
        with Client(run_dir) as client:
            reference = client.generate(
                PROMPT, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, timeout=WAIT_S
            ).text
        rounds = []
        for i in range(args.repeat):
            times, holder = one_round(cluster, run_dir, holder, reference, args.max_tokens)
            rounds.append(times)
            print(
                f"round {i + 1}: to {times['to_address']}: placed {times['placed']:.1f} s, "
                f"ready {times['ready']:.1f} s, served {times['served']:.1f} s",
                flush=True,
            )
        medians = {key: statistics.median(r[key] for r in rounds) for key in ("placed", "ready", "served")}
        print("median: " + ", ".join(f"{key} {value:.1f} s" for key, value in medians.items()))
        if args.json:
            args.json.write_text(json.dumps({"rounds": rounds, "median": medians}, indent=2))
    finally:
        if run is not None:
            leftovers = run.stop()
            if leftovers:
                print(f"warning: Brigade left {leftovers} behind (removed)", file=sys.stderr)
            shutil.rmtree(run.run_dir, ignore_errors=True)
            print(f"the run's log: {run.log_path}")
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
