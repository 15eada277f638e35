"""Serving throughput with the light stages on another (simulated) node than the engine group,
against the same engine with every stage on one node, in one invocation (docs/scaling.md).

    python benchmarks/cross_node.py [--concurrency 1,16] [--output-len 64] [--json out.json]

`split`: a Ray cluster started here (`ray.cluster_utils.Cluster`): the head runs the supervisor,
the tokenizer, the detokenizer and the gateway; the engine group (scheduler and worker) is placed
on a node at 127.0.0.2, so every link between them is tcp:// with CURVE across addresses.
`local`: the default layout (ipc:// links, shared memory), started after the split run stopped.
Both are driven over HTTP through the gateway by benchmarks/serve.py's sweep, on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ray.cluster_utils import Cluster  # noqa: E402

from benchmarks import peers, serve  # noqa: E402

ENGINE = "bench_engine"  # the resource that marks the engine node
ENGINE_ADDRESS = "127.0.0.2"
READY_TIMEOUT_S = 900.0


def sweep(run_dir: Path, args: argparse.Namespace, out: Path) -> dict:
    """serve.py's HTTP sweep against the run in `run_dir`; its report's Brigade section."""
    serve.main([
        "--run", str(run_dir), "--backend", "http", "--engines", "brigade", "--concurrency", args.concurrency,
        "--output-len", str(args.output_len), "--json", str(out),
    ])  # fmt: skip
    return json.loads(out.read_text())["brigade_http"]["settings"]


def split_run(args: argparse.Namespace, work: Path) -> dict:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    run = None
    try:
        cluster.add_node(num_cpus=1, resources={ENGINE: 1}, node_ip_address=ENGINE_ADDRESS)
        cluster.wait_for_nodes()
        overrides = [
            "cluster.backend=ray", f"cluster.ray_address={cluster.address}",
            f"cluster.engine_resources={{{ENGINE}: 1}}", f"network.host={cluster.address.rsplit(':', 1)[0]}",
            f"gateway.port={peers.free_port()}", "supervisor.metrics_port=0", "model.dtype=float32",
        ]  # fmt: skip
        run_dir = Path(tempfile.mkdtemp(prefix="split-", dir=work))  # private, as a run dir must be
        run = serve.BrigadeProcess(run_dir, "configs/default.yaml", overrides, work / "split.log")
        run.wait_ready(READY_TIMEOUT_S)
        return sweep(run_dir, args, work / "split.json")
    finally:
        if run is not None:
            run.stop()
        cluster.shutdown()


def local_run(args: argparse.Namespace, work: Path) -> dict:
    overrides = [f"gateway.port={peers.free_port()}", "supervisor.metrics_port=0", "model.dtype=float32"]
    run_dir = Path(tempfile.mkdtemp(prefix="local-", dir=work))
    run = serve.BrigadeProcess(run_dir, "configs/default.yaml", overrides, work / "local.log")
    try:
        run.wait_ready(READY_TIMEOUT_S)
        return sweep(run_dir, args, work / "local.json")
    finally:
        run.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="brigade-cross-node-"))
    try:
        layouts = {"split": split_run(args, work), "local": local_run(args, work)}
    finally:
        print(f"logs: {work}/*.log")
    print("\n| layout | c | out tok/s | TTFT p50 ms | TPOT p50 ms |\n| --- | --- | --- | --- | --- |")
    for name, settings in layouts.items():
        for c, s in settings.items():
            print(
                f"| {name} | {c} | {s['output_tok_s']:.1f} | {s['ttft_ms']['p50']:.1f} | {s['tpot_ms']['p50']:.1f} |"
            )
    for c in layouts["split"]:
        split, local = layouts["split"][c], layouts["local"][c]
        print(f"c={c}: split / local output tok/s {split['output_tok_s'] / local['output_tok_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(layouts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
