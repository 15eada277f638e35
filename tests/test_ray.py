"""The Ray backend (`cluster.backend: ray`, supervision/ray_stages.py) on a real multi-node Ray
cluster that the test starts on this machine with Ray's own `ray.cluster_utils.Cluster`: a head
node, two engine nodes, each with a resource of its own, and a far engine node at an address of
its own. Placement, serving over tcp:// with CURVE (a wrong key refused), the loss of the node
that holds the engine group in the middle of requests, no room and a node joining, a hot
reload, links across addresses, and runs that leave nothing."""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
import zmq

from client import AuthenticationFailed, Client
from client.errors import Overloaded, RequestTimeout, ServerUnavailable
from services.stage import read_run_info, run_endpoints
from tests.conftest import REPO_ROOT, brigade_shm_objects
from tests.harness import assert_clean, brigade_run, free_port, hf_greedy, start_supervisor
from tests.test_reload import wait_for_stages

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from supervision.ray_stages import boot_id  # noqa: E402

pytestmark = pytest.mark.slow

ENGINE_NODES = ("node_a", "node_b")  # each engine node's own resource says which node it is
FAR_NODE, FAR_ADDRESS = "far_engine", "127.0.0.2"
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 200  # enough that the node is removed while the requests are still decoding
GROUP_TOKENS = 400  # enough that a group retired mid-stream still runs some when it stops
CLIENT_TIMEOUT_S = 240.0
REFUSED_WITHIN_S = 30.0
PROMPT_IDS = [1, 450, 4996, 17354, 1701, 284, 1190, 690]
NEW_TOKENS = 12
NO_ROOM_WAIT_S = 15.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, dict[str, str]]]:
    """Head (where the supervisor's driver attaches) plus two engine nodes; one CPU each, so that
    each engine node holds exactly one engine group. Shut down even when a test fails."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1}})
    try:
        nodes = {
            name: cluster.add_node(num_cpus=1, resources={"engine": 1, name: 1}) for name in ENGINE_NODES
        }
        # Another "host": a node at its own loopback address, so the links to it cross addresses.
        nodes[FAR_NODE] = cluster.add_node(num_cpus=1, resources={FAR_NODE: 1}, node_ip_address=FAR_ADDRESS)
        cluster.wait_for_nodes()
        yield cluster, {name: node.node_id for name, node in nodes.items()}
    finally:
        cluster.shutdown()


def ray_overrides(cluster: Cluster, model_dir: Path, *extra: str) -> tuple[str, ...]:
    return (
        f"model.path={model_dir}", "model.dtype=float32", "model.max_model_len=512", "engine.threads=1",
        "gateway.replicas=0", "cluster.backend=ray", f"cluster.ray_address={cluster.address}",
        "cluster.engine_resources={engine: 1}", "supervisor.start_timeout_s=300", *extra,
    )  # fmt: skip


def nodes_of(run) -> dict[str, str]:
    return {row["name"]: row.get("node", "") for row in run.status()}


def leftovers_in_ray(cluster: Cluster, run_id: str) -> tuple[list[str], list[str]]:
    """Actors of the run still alive, and its placement groups not removed (asked in a child,
    so that this process never joins the cluster it must shut down)."""
    script = (
        "import json, ray, ray._private.state as state\n"
        f"ray.init(address={cluster.address!r}, namespace='brigade', logging_level='ERROR')\n"
        "actors = [a['ActorID'] for a in state.actors().values() if a['State'] != 'DEAD']\n"
        "groups = [g['name'] for g in ray.util.placement_group_table().values() if g['state'] != 'REMOVED']\n"
        "print(json.dumps([actors, groups]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=True
    )
    actors, groups = json.loads(done.stdout.strip().splitlines()[-1])
    return actors, [g for g in groups if run_id in g]


def assert_refuses_a_wrong_key(endpoint: str, server_key: str) -> None:
    """A client with a key of its own making is refused, soon, and the run goes on."""
    start = time.monotonic()
    wrong = Client(endpoint, server_key=server_key, keys=zmq.curve_keypair())
    with wrong, pytest.raises(AuthenticationFailed, match="refused this client's key"):
        wrong.generate("let me in", max_tokens=4, timeout=CLIENT_TIMEOUT_S)
    assert time.monotonic() - start < REFUSED_WITHIN_S


def write_replicas(path: Path, replicas: int) -> None:
    path.write_text(
        yaml.safe_dump({"tokenizer": {"replicas": replicas}, "detokenizer": {"replicas": replicas}})
    )


def drain(run) -> list[str]:
    """The run's log lines, including those after the ready line that nobody waited for."""
    while not run.lines.empty():
        run.log.append(run.lines.get_nowait())
    return run.log


def generate_all(run_dir: Path, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    with Client(run_dir, failover_after=5.0, unavailable_after=CLIENT_TIMEOUT_S) as client:
        return [
            client.generate(
                p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=CLIENT_TIMEOUT_S
            ).text
            for p in prompts
        ]


def stream_through_fault(
    run_dir: Path, prompts: list[str], fault: Callable[[], None], max_tokens: int = MAX_TOKENS
) -> list[str]:
    """Stream every prompt (greedy, each in a client of its own), call `fault` once every stream
    has its first text, and return the texts; any client error fails the test."""
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    first_tokens = [threading.Event() for _ in prompts]

    def stream(i: int) -> None:
        try:
            with Client(run_dir, failover_after=5.0, unavailable_after=CLIENT_TIMEOUT_S) as client:
                parts = []
                for delta in client.stream(
                    prompts[i],
                    max_tokens=max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    timeout=CLIENT_TIMEOUT_S,
                ):
                    parts.append(delta.text)
                    first_tokens[i].set()
                results[i] = "".join(parts)
        except BaseException as exc:
            errors.append(exc)
            first_tokens[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for event in first_tokens:
        assert event.wait(CLIENT_TIMEOUT_S)
    fault()
    for thread in threads:
        thread.join(CLIENT_TIMEOUT_S + 30)
    assert not errors, errors
    assert not [t for t in threads if t.is_alive()], "a stream did not end"
    return [results[i] for i in range(len(prompts))]


@pytest.mark.timeout(240)
def test_an_engine_group_that_no_node_can_hold_is_refused_clearly(
    tmp_path: Path, cluster, tiny_model_dir
) -> None:
    ray_cluster, _ = cluster
    overrides = ray_overrides(
        ray_cluster,
        tiny_model_dir,
        "cluster.engine_resources={accelerator: 1}",
        "cluster.placement_timeout_s=5",
    )
    process = start_supervisor(tmp_path / "run", *overrides)
    try:
        out, _ = process.communicate(timeout=180)
    finally:
        process.kill()
    assert process.returncode == 1, out
    assert "found no Ray node with {'accelerator': 1.0, 'CPU': 1.0} free" in out, out
    actors, groups = leftovers_in_ray(ray_cluster, "")
    assert groups == [] and actors == [], (actors, groups)


@pytest.mark.timeout(500)
def test_engine_groups_are_added_on_another_node_and_retired_live(
    tmp_path: Path, cluster, tiny_model_dir
) -> None:
    """engine.data_parallel 1 -> 2 -> 1 by hot reload while requests stream: the new group gets a
    placement group of its own, on the other engine node; the retired one drains, and what it
    still ran when supervisor.drain_timeout_s ended moves to group 0. Greedy text is unchanged,
    and the retired group leaves no placement group or actor behind."""
    ray_cluster, nodes = cluster
    engine_nodes = {nodes[name] for name in ENGINE_NODES}
    run_dir = tmp_path / "run"
    config = tmp_path / "groups.yaml"
    config.write_text(yaml.safe_dump({"engine": {"data_parallel": 1}}))
    # A short drain and heartbeat (the retirement reads loads for two beats first), so that the
    # retired group still runs requests when it stops (the move) even on a fast CPU.
    drain = ("supervisor.drain_timeout_s=0.05", "supervisor.heartbeat_interval_s=0.1")
    overrides = ray_overrides(ray_cluster, tiny_model_dir, *drain)
    with brigade_run(run_dir, *overrides, config=str(config)) as run:
        run_id = read_run_info(run_dir).run_id
        first = nodes_of(run)["scheduler-0"]
        assert first in engine_nodes
        calm = generate_all(run_dir, PROMPTS, GROUP_TOKENS)

        def reload_groups(count: int) -> None:
            config.write_text(yaml.safe_dump({"engine": {"data_parallel": count}}))
            run.process.send_signal(signal.SIGHUP)

        assert stream_through_fault(run_dir, PROMPTS, lambda: reload_groups(2), GROUP_TOKENS) == calm
        wait_for_stages(run, tokenizers=1, detokenizers=1, schedulers=2, timeout=180)
        placed = nodes_of(run)
        assert placed["scheduler-1"] == placed["gpu_worker-1-0"] in engine_nodes - {first}, placed
        _, groups = leftovers_in_ray(ray_cluster, run_id)
        assert sorted(groups) == [f"brigade-{run_id}-group-0", f"brigade-{run_id}-group-1"]

        assert stream_through_fault(run_dir, PROMPTS * 2, lambda: reload_groups(1), GROUP_TOKENS) == calm * 2
        wait_for_stages(run, tokenizers=1, detokenizers=1, schedulers=1, timeout=180)
        assert "scheduler-1" not in nodes_of(run)
        moved = run.wait_for_line("engine groups from 1 on retired: moving", 60)
        assert int(moved.split("moving ")[1].split()[0]) > 0, moved  # group 1 still had requests
        _, groups = leftovers_in_ray(ray_cluster, run_id)
        assert groups == [f"brigade-{run_id}-group-0"]
        assert generate_all(run_dir, PROMPTS[:1], GROUP_TOKENS) == calm[:1]
    assert run.process.returncode == 0, "".join(drain(run)[-60:])
    assert_clean(run_dir, run_id)
    actors, groups = leftovers_in_ray(ray_cluster, run_id)
    assert actors == [] and groups == [], (actors, groups)
    assert not [name for name in brigade_shm_objects() if run_id in name]


@pytest.mark.timeout(300)
def test_a_reload_to_more_engine_groups_than_the_cluster_holds_keeps_the_old_count(
    tmp_path: Path, cluster, tiny_model_dir
) -> None:
    """engine.data_parallel 1 -> 3 by hot reload where only two nodes have the engine resource:
    group 1 finds a node, group 2 never does. The reload keeps one group (and says so), gives
    both placement groups back, and the run goes on serving; the never placed group once made
    the supervisor crash while it released it."""
    ray_cluster, _ = cluster
    run_dir = tmp_path / "run"
    config = tmp_path / "groups.yaml"
    config.write_text(yaml.safe_dump({"engine": {"data_parallel": 1}}))
    overrides = ray_overrides(ray_cluster, tiny_model_dir, "cluster.placement_timeout_s=5")
    with brigade_run(run_dir, *overrides, config=str(config)) as run:
        run_id = read_run_info(run_dir).run_id
        calm = generate_all(run_dir, PROMPTS[:1], NEW_TOKENS)
        config.write_text(yaml.safe_dump({"engine": {"data_parallel": 3}}))
        run.process.send_signal(signal.SIGHUP)
        run.wait_for_line("reload: engine.data_parallel stays 1: engine groups [2] found no room", 60)
        run.wait_for_line("reload applied", 60)  # the reload's end
        assert run.process.poll() is None, "".join(drain(run)[-60:])
        deadline = time.monotonic() + 60  # Ray removes placement groups asynchronously
        while (groups := leftovers_in_ray(ray_cluster, run_id)[1]) != [f"brigade-{run_id}-group-0"]:
            assert time.monotonic() < deadline, groups
            time.sleep(1)
        assert generate_all(run_dir, PROMPTS[:1], NEW_TOKENS) == calm
    assert run.process.returncode == 0, "".join(drain(run)[-60:])
    assert_clean(run_dir, run_id)
    assert not [name for name in brigade_shm_objects() if run_id in name]


@pytest.mark.timeout(600)
def test_group_lands_on_an_engine_node_survives_its_removal_and_replicas_reload_live(
    tmp_path: Path, cluster, tiny_model_dir
) -> None:
    ray_cluster, nodes = cluster
    engine_nodes = {name: nodes[name] for name in ENGINE_NODES}
    run_dir = tmp_path / "run"
    config = tmp_path / "replicas.yaml"  # what the hot reload at the end changes; the rest is --set
    write_replicas(config, 1)
    overrides = ray_overrides(ray_cluster, tiny_model_dir, "network.transport=tcp")
    with brigade_run(run_dir, *overrides, config=str(config)) as run:
        info = read_run_info(run_dir)
        run_id = info.run_id
        assert not list(run_dir.glob("*.sock")), "an ipc:// link in a network.transport=tcp run"
        assert_refuses_a_wrong_key(info.tokenizers[0], info.curve_server_key)
        placed = nodes_of(run)
        head = ray_cluster.head_node.node_id
        group_node = placed["scheduler-0"]
        assert group_node in engine_nodes.values(), placed
        assert placed["gpu_worker-0-0"] == group_node, placed  # one group, one node (its /dev/shm)
        assert placed["tokenizer-0"] == head and placed["detokenizer-0"] == head, placed

        calm = generate_all(run_dir, PROMPTS)
        assert all(len(text) > 0 for text in calm)

        # The same requests again, and the node that holds the group goes away while they decode.
        [lost] = [node for node in ray_cluster.worker_nodes if node.node_id == group_node]
        assert stream_through_fault(run_dir, PROMPTS, lambda: ray_cluster.remove_node(lost)) == calm

        run.wait_until_running(120)
        moved = nodes_of(run)
        assert moved["scheduler-0"] in set(engine_nodes.values()) - {group_node}, moved
        assert moved["gpu_worker-0-0"] == moved["scheduler-0"], moved
        rows = {row["name"]: row for row in run.status()}
        assert rows["scheduler-0"]["restarts"] >= 1 and rows["gpu_worker-0-0"]["restarts"] >= 1
        assert generate_all(run_dir, PROMPTS[:1]) == calm[:1]

        # No node has room: the group waits, and a request whose deadline passes meanwhile gets
        # a clear error rather than a hang ...
        [second] = [node for node in ray_cluster.worker_nodes if node.node_id == moved["scheduler-0"]]
        ray_cluster.remove_node(second)
        no_room = pytest.raises((RequestTimeout, Overloaded, ServerUnavailable))
        with (
            Client(run_dir, failover_after=5.0, unavailable_after=CLIENT_TIMEOUT_S) as client,
            no_room as refused,
        ):
            client.generate(
                PROMPTS[0], max_tokens=8, temperature=0.0, ignore_eos=True, timeout=NO_ROOM_WAIT_S
            )
        assert str(refused.value), refused
        # ... and it serves again, with the same text, once a node with room joins.
        joined = ray_cluster.add_node(num_cpus=1, resources={"engine": 1, "node_c": 1})
        run.wait_until_running(180)
        assert nodes_of(run)["scheduler-0"] == joined.node_id
        assert generate_all(run_dir, PROMPTS[:1]) == calm[:1]

        # Hot reload is Brigade's as on one host: new replicas start on the head node, retired
        # ones leave no host actor behind (checked with the rest after the run).
        write_replicas(config, 2)
        run.process.send_signal(signal.SIGHUP)
        wait_for_stages(run, tokenizers=2, detokenizers=2)
        placed = nodes_of(run)
        assert placed["tokenizer-1"] == head and placed["detokenizer-1"] == head, placed
        assert generate_all(run_dir, PROMPTS[:1]) == calm[:1]
        write_replicas(config, 1)
        run.process.send_signal(signal.SIGHUP)
        wait_for_stages(run, tokenizers=1, detokenizers=1)
    assert run.process.returncode == 0, "".join(drain(run)[-60:])
    assert_clean(run_dir, run_id)
    actors, groups = leftovers_in_ray(ray_cluster, run_id)
    assert actors == [] and groups == [], (actors, groups)
    assert not [name for name in brigade_shm_objects() if run_id in name]


@pytest.mark.timeout(400)
def test_a_group_on_a_node_at_another_address_is_served_over_tcp_with_curve(
    tmp_path: Path, cluster, tiny_model_dir
) -> None:
    """The far node has an address of its own: the links that cross to it are tcp:// with CURVE
    (ipc/endpoints.py, from the addresses place() found), the scheduler-workers link stays
    inside the node, and greedy output equals HF transformers'."""
    ray_cluster, nodes = cluster
    head_address = ray_cluster.address.rsplit(":", 1)[0]  # the head node's, where the supervisor runs
    run_dir = tmp_path / "run"
    metrics_port = free_port()
    overrides = ray_overrides(
        ray_cluster,
        tiny_model_dir,
        f"cluster.engine_resources={{{FAR_NODE}: 1}}",
        f"network.host={head_address}",
        f"supervisor.metrics_port={metrics_port}",
    )
    with brigade_run(run_dir, *overrides) as run:
        info = read_run_info(run_dir)
        assert nodes_of(run)["scheduler-0"] == nodes[FAR_NODE]
        assert info.network.hosts == {"scheduler-0": FAR_ADDRESS, "gpu_worker-0-0": FAR_ADDRESS}
        endpoints = run_endpoints(run_dir, info)
        to_scheduler = endpoints.scheduler_in(0)
        assert (
            to_scheduler.connect.startswith(f"tcp://{FAR_ADDRESS}:") and to_scheduler.server_curve is not None
        )
        assert endpoints.detokenizer_in(0).connect.startswith(f"tcp://{head_address}:")
        assert endpoints.scheduler_workers(0).connect.startswith("ipc://")  # inside the far node
        assert info.tokenizers[0].startswith(f"tcp://{head_address}:")
        with Client(run_dir) as client:
            result = client.generate(
                PROMPT_IDS, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=CLIENT_TIMEOUT_S
            )
        assert result.token_ids == hf_greedy(tiny_model_dir, PROMPT_IDS, NEW_TOKENS)
        assert_refuses_a_wrong_key(info.tokenizers[0], info.curve_server_key)
        # The far scheduler's engine metrics are written on its node, in a directory of the node's
        # own, and reach the head's /metrics only by being gathered from there.
        far_dir = run_dir / "metrics" / f"node-{nodes[FAR_NODE]}"
        assert list(far_dir.glob("*.db")), list((run_dir / "metrics").iterdir())
        wait_for_queue_time_count(metrics_port, engine=0, expected=1.0)  # the one request of this run
    assert run.process.returncode == 0, "".join(drain(run)[-60:])
    assert_clean(run_dir, info.run_id)
    actors, groups = leftovers_in_ray(ray_cluster, info.run_id)
    assert actors == [] and groups == [], (actors, groups)


@pytest.mark.timeout(500)
def test_a_group_whose_node_dies_is_served_again_from_a_node_at_another_address(
    tmp_path: Path, cluster, tiny_model_dir
) -> None:
    """The far node (at 127.0.0.2) holds the group and is removed while requests decode; Ray
    places the group again on a node at the head's address. The supervisor re-plans the group's
    links there (same ports, same CURVE keys), the tokenizer and the detokenizer reconnect
    (TopologyChanged with the new hosts), the requests are resubmitted, and every text equals the un-faulted run's."""
    ray_cluster, nodes = cluster
    head_address = ray_cluster.address.rsplit(":", 1)[0]
    run_dir = tmp_path / "run"
    overrides = ray_overrides(
        ray_cluster,
        tiny_model_dir,
        f"cluster.engine_resources={{{FAR_NODE}: 1}}",
        f"network.host={head_address}",
    )
    with brigade_run(run_dir, *overrides) as run:
        info = read_run_info(run_dir)
        assert nodes_of(run)["scheduler-0"] == nodes[FAR_NODE]
        before = run_endpoints(run_dir, info).scheduler_in(0).connect
        assert before.startswith(f"tcp://{FAR_ADDRESS}:")
        calm = generate_all(run_dir, PROMPTS)
        # Where the group can go next: a node with the group's resource, at the head's address.
        spare = ray_cluster.add_node(num_cpus=1, resources={FAR_NODE: 1})
        ray_cluster.wait_for_nodes()
        [far] = [node for node in ray_cluster.worker_nodes if node.node_id == nodes[FAR_NODE]]
        assert stream_through_fault(run_dir, PROMPTS, lambda: ray_cluster.remove_node(far)) == calm

        run.wait_until_running(120)
        assert nodes_of(run)["scheduler-0"] == spare.node_id
        moved = read_run_info(run_dir)
        assert moved.network.hosts == {"scheduler-0": head_address, "gpu_worker-0-0": head_address}
        assert (moved.network.port_base, moved.network.keys) == (info.network.port_base, info.network.keys)
        after = run_endpoints(run_dir, moved).scheduler_in(0).connect
        assert after == before.replace(FAR_ADDRESS, head_address, 1)
        log = "".join(drain(run))
        assert f"engine group 0 moved to a node at {head_address}" in log, log[-4000:]
        reconnected = [line for line in log.splitlines() if f"reconnected {before} -> {after}" in line]
        for stage in ("tokenizer-0", "detokenizer-0"):  # each was told, and followed
            assert any(f"[{stage} pid=" in line for line in reconnected), log[-4000:]
        assert generate_all(run_dir, PROMPTS[:1]) == calm[:1]
    assert run.process.returncode == 0, "".join(drain(run)[-60:])
    assert_clean(run_dir, info.run_id)
    actors, groups = leftovers_in_ray(ray_cluster, info.run_id)
    assert actors == [] and groups == [], (actors, groups)
    assert not [name for name in brigade_shm_objects() if info.run_id in name]


def wait_for_queue_time_count(port: int, engine: int, expected: float, timeout: float = 60.0) -> None:
    """`brigade:request_queue_time_seconds_count` of engine group `engine` on the run's /metrics
    reaches `expected` (the gathering from other nodes runs every few seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        counts = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("brigade:request_queue_time_seconds_count{") and f'engine="{engine}"' in line
        ]
        if counts == [expected]:
            return
        assert time.monotonic() < deadline, f"queue times of engine {engine}: {counts}, not [{expected}]"
        time.sleep(1.0)


def test_group_setup_makes_the_rings_once_per_node_and_keeps_the_port(tmp_path: Path) -> None:
    """What the first stage of a group to start on a node makes there, the others find; the
    node's cleanup removes it all."""
    from ipc.shm import ShmRing
    from supervision.ray_stages import GroupSetup, clean_node
    from supervision.stages import RingSpec

    run_id = f"{os.getpid()}x{secrets.token_hex(4)}"
    rings = [
        RingSpec(0, f"/brigade-{run_id}-step-0", 2, 4096, 2),
        RingSpec(0, f"/brigade-{run_id}-result-0", 2, 512, 1),
    ]
    try:
        port = GroupSetup(run_id, 0, rings, "127.0.0.1").prepare()
        assert (
            GroupSetup(run_id, 0, rings, "127.0.0.1").prepare() == port
        )  # a later host of the group on this node
        step = ShmRing.attach(rings[0].name)
        assert step.num_readers == 2
        step.close()
        assert any(run_id in name for name in brigade_shm_objects())
    finally:
        removed = clean_node(f"brigade-{run_id}-", str(tmp_path), supervisor_host=boot_id())
    assert f"brigade-{run_id}-group-0.json" in removed and f"brigade-{run_id}-step-0" in removed
    assert not [name for name in brigade_shm_objects() if run_id in name]


def test_a_node_off_the_supervisors_host_gets_a_private_run_dir_and_loses_it_at_cleanup(
    tmp_path: Path,
) -> None:
    from supervision.ray_stages import _materialize_run_dir, clean_node

    run_dir = tmp_path / "elsewhere" / "run"
    _materialize_run_dir(run_dir, b'{"run_id": "x"}')
    assert (run_dir / "run.json").read_bytes() == b'{"run_id": "x"}'
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "run.json").stat().st_mode) == 0o600
    (run_dir / "scheduler-0-in.sock").touch()
    clean_node("brigade-none-", str(run_dir), supervisor_host="another host")
    assert list(run_dir.iterdir()) == []
    # On the supervisor's own host its run dir is the supervisor's to clean, not the node's.
    _materialize_run_dir(run_dir, b"{}")
    clean_node("brigade-none-", str(run_dir), supervisor_host=boot_id())
    assert (run_dir / "run.json").exists()


def test_two_nodes_metrics_with_the_same_pids_are_both_counted(tmp_path: Path) -> None:
    """What gather_metrics copies from two nodes whose stages had the same pid: both are summed
    on the head's /metrics, neither overwrites the other."""
    from services import metrics
    from supervision.ray_stages import read_node_metrics, write_node_metrics
    from tests.test_metrics import observe_in_process, scrape

    node_run = tmp_path / "node"
    metrics.metrics_dir(node_run).mkdir(parents=True)
    observe_in_process(node_run, "EngineMetrics('m', 0).update(deque([0.5]), 40, 8, deque(), 0, deque())")
    files = read_node_metrics(metrics.metrics_dir(node_run))
    sizes = {path.name: path.stat().st_size for path in metrics.metrics_dir(node_run).glob("*.db")}
    assert files and all(len(data) < sizes[name] for name, data in files.items())  # the used part only
    head = tmp_path / "head"
    metrics.metrics_dir(head).mkdir(parents=True)
    for node in ("a" * 56, "b" * 56):
        write_node_metrics(metrics.metrics_dir(head), node, files)
    got = scrape(metrics.registry_for_run(head))
    labels = (("engine", "0"), ("model_name", "m"))
    assert got[("brigade:prefix_cache_queries_total", labels)] == 80
    assert got[("brigade:request_queue_time_seconds_count", labels)] == 2
