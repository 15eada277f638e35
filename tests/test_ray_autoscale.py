"""The Ray backend's side of autoscaling (supervision/ray_stages.py): an engine group that finds no
room asks Ray's autoscaler for every group's bundle (`ray.autoscaler.sdk.request_resources`), is
placed when a node joins, and a retired group lowers the request. First against a plain
`ray.cluster_utils.Cluster`, where the test adds the node the request asks for; then a whole
autoscaled run on a cluster whose own Ray autoscaler launches and terminates the nodes
(tests/ray_autoscaling.py: the fake multi-node provider)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from ipc.config import load_config
from ipc.endpoints import SHM_PREFIX
from ipc.shm import SHM_DIR, unlink_ring
from services.stage import read_run_info
from tests.harness import assert_clean, brigade_run, free_port
from tests.test_autoscale_run import (
    AFTER,
    AUTOSCALE,
    BURST,
    COMMON,
    Streams,
    autoscale_events,
    metric,
    scrape,
)
from tests.test_reload import wait_for_stages

ray = pytest.importorskip("ray")
from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL  # noqa: E402
from ray.autoscaler.v2.utils import is_autoscaler_v2  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.experimental.internal_kv import _internal_kv_get  # noqa: E402
from ray.util.placement_group import remove_placement_group  # noqa: E402

from supervision.ray_stages import GroupSetup, RayStageSet, group_state_path  # noqa: E402
from supervision.stages import RingSpec  # noqa: E402
from tests.ray_autoscaling import autoscaling_ray, cluster_processes  # noqa: E402
from tests.test_ray import drain, nodes_of  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BUNDLE = {"autoscaled_engine": 1.0}
# The node type Ray's autoscaler launches: room for one engine group (a CPU and the custom
# resource the groups ask for); the head has no autoscaled_engine, so no group fits there.
ENGINE_NODE_TYPE = {"resources": {"CPU": 1, "autoscaled_engine": 1}, "max_workers": 2}
IDLE_TIMEOUT_S = 6.0  # how long an autoscaled node stays idle before the autoscaler ends it
NODE_CHANGE_S = 120.0  # for a node to be launched and join, or to be found idle and ended


def group_shm(run_id: str, group: int) -> list[str]:
    """What /dev/shm holds of one engine group: its rings' segments and semaphores, its state."""
    pattern = re.compile(rf"{re.escape(run_id)}-(step|result|group)-{group}(-|\.|$)")
    return sorted(name for name in os.listdir(SHM_DIR) if pattern.search(name))


def requested_bundles() -> list[dict[str, float]]:
    """The standing request Ray's (v1) autoscaler reads from the GCS."""
    assert not is_autoscaler_v2(), "this cluster runs autoscaler v2, which keeps requests elsewhere"
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def test_a_group_that_finds_no_room_asks_rays_autoscaler_and_is_placed_when_a_node_joins(
    tmp_path: Path,
) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    stages = None
    try:
        cluster.add_node(num_cpus=0, resources=BUNDLE)
        cluster.wait_for_nodes()
        config = load_config(None, [
            "cluster.backend=ray", f"cluster.ray_address={cluster.address}", "cluster.engine_cpus=0",
            "cluster.engine_resources={autoscaled_engine: 1}", "cluster.placement_timeout_s=60",
        ])  # fmt: skip
        stages = RayStageSet(config, tmp_path, "text", "autoscaletest")
        stages.place()  # group 0 on the node that has room
        assert stages.unplaced() == [] and requested_bundles() == []  # room at once: nothing asked

        two = msgspec.structs.replace(config.engine, data_parallel=2)
        stages.place_groups(two)
        assert stages.unplaced() == [1]  # no node has a second autoscaled_engine
        assert requested_bundles() == [BUNDLE, BUNDLE]  # every group's: the request is a floor
        stages.unplaced()
        assert requested_bundles() == [BUNDLE, BUNDLE]  # asked once, not again each round

        cluster.add_node(num_cpus=0, resources=BUNDLE)  # what the autoscaler would do
        deadline = time.monotonic() + 60
        while stages.unplaced() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stages.unplaced() == []

        # Each group's rings, made on its node as its first stage would (GroupSetup.prepare).
        rings = [RingSpec(g, f"/{SHM_PREFIX}autoscaletest-{kind}-{g}", 2, 4096, 1)
                 for g in (0, 1) for kind in ("step", "result")]  # fmt: skip
        stages.create_rings(rings)
        for g in (0, 1):
            GroupSetup("autoscaletest", g, [r for r in rings if r.group == g], "127.0.0.1").prepare()
        made = [group_shm("autoscaletest", g) for g in (0, 1)]
        try:
            stages.release_groups(config.engine)  # group 1 retired: its node may go idle
            left = [group_shm("autoscaletest", g) for g in (0, 1)]
        finally:
            for ring in rings:
                unlink_ring(ring.name)
            for g in (0, 1):
                group_state_path("autoscaletest", g).unlink(missing_ok=True)
        # The run goes on: group 0's rings stay, group 1's are gone from its node.
        assert len(made[1]) > 2 and left == [made[0], []], (made, left)
        assert requested_bundles() == [BUNDLE]
        assert stages.max_groups() is None  # the cluster's autoscaler bounds it, not this host
        stages.close()
        ray.init(address=cluster.address, logging_level="ERROR")
        assert requested_bundles() == []  # a stopped run keeps no nodes up
        ray.shutdown()
    finally:
        if stages is not None:
            stages.close()
        ray.shutdown()
        cluster.shutdown()


def test_the_autoscaling_cluster_launches_a_node_on_request_and_its_teardown_ends_every_process(
    tmp_path: Path,
) -> None:
    """tests/ray_autoscaling.py itself: Ray's autoscaler launches a node for a request, and the
    teardown ends that node too (the monitor's raylet, which no fate sharing ends) while it is up,
    as it must when a test fails midway; nothing of the cluster is left."""
    with autoscaling_ray({"engine": ENGINE_NODE_TYPE}, tmp_path / "ray-logs") as cluster:
        token, temp_dir = cluster.token, cluster.temp_dir
        assert cluster.worker_nodes() == {}
        ask = (
            "import ray\nfrom ray.autoscaler.sdk import request_resources\n"
            f"ray.init(address={cluster.address!r}, logging_level='ERROR')\n"
            f"request_resources(bundles=[{BUNDLE!r}])\n"
        )
        subprocess.run([sys.executable, "-c", ask], check=True, timeout=120)
        (resources,) = cluster.wait_for_worker_nodes(1, NODE_CHANGE_S).values()
        assert resources["autoscaled_engine"] == 1 and resources["CPU"] == 1, resources
        raylets = [pid for pid in cluster.processes() if b"raylet" in Path(f"/proc/{pid}/comm").read_bytes()]
        assert len(raylets) == 2  # the head's and the launched node's
    assert cluster_processes(token, temp_dir) == [] and not temp_dir.exists()
    # Kept, and written before the node was started: the autoscaler launched it.
    assert "Queue 1 new nodes for launch" in (tmp_path / "ray-logs" / "monitor.log").read_text()


def test_a_stopping_run_cleans_every_node_before_it_lets_rays_autoscaler_end_them(tmp_path: Path) -> None:
    """RayStageSet.close: a node that only the run's request keeps (idle past the autoscaler's
    idle timeout) is cleaned before the request is dropped; dropped first, the autoscaler ended
    it in the middle of its cleanup, and the failed cleanup abandoned the others, leaving the
    run's shared memory behind."""
    with autoscaling_ray({"engine": ENGINE_NODE_TYPE}, tmp_path / "ray-logs", idle_timeout_s=1.0) as cluster:
        config = load_config(None, [
            "cluster.backend=ray", f"cluster.ray_address={cluster.address}", "cluster.engine_cpus=1",
            "cluster.engine_resources={autoscaled_engine: 1}", f"cluster.placement_timeout_s={NODE_CHANGE_S}",
        ])  # fmt: skip
        stages = RayStageSet(config, tmp_path, "text", "closetest")
        try:
            stages.place()  # the autoscaler launches a node for group 0
            (node,) = cluster.worker_nodes()
            left_by_the_run = Path(SHM_DIR) / f"{SHM_PREFIX}closetest-step-0"
            left_by_the_run.write_bytes(b"")
            remove_placement_group(stages.groups[0])  # the node idles, kept by the request alone
            time.sleep(5)
            assert list(cluster.worker_nodes()) == [node]
        finally:
            stages.close()
        cleaned = not left_by_the_run.exists()
        left_by_the_run.unlink(missing_ok=True)
        assert cleaned, "the run's shared memory was left"
        cluster.wait_for_worker_nodes(0, NODE_CHANGE_S)  # then the request is dropped


@pytest.mark.timeout(900)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two engine groups of one thread need two cores")
def test_rays_autoscaler_launches_a_node_for_a_burst_and_takes_it_back_when_the_run_idles(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Autoscaling end to end on Ray: the run starts with no node that can hold an engine group,
    and Ray's real autoscaler launches one for group 0; a burst makes the policy add group 1,
    which finds no room, asks (request_resources), and is placed on the second node the
    autoscaler launches, and serves; the idle run retires it, and the autoscaler ends its node
    once idle; a stopped run gives back the last. Every text equals a fixed one-group run's."""
    common = (f"model.path={tiny_model_dir}", *COMMON)
    with brigade_run(tmp_path / "fixed", *common):
        reference = Streams(tmp_path / "fixed", range(16)).texts()
    with autoscaling_ray(
        {"engine": ENGINE_NODE_TYPE}, tmp_path / "ray-logs", idle_timeout_s=IDLE_TIMEOUT_S
    ) as cluster:
        assert cluster.worker_nodes() == {}  # min_workers 0: nothing until a group asks
        run_dir = tmp_path / "run"
        port = free_port()
        on_ray = ("cluster.backend=ray", f"cluster.ray_address={cluster.address}", "cluster.engine_cpus=1",
                  "cluster.engine_resources={autoscaled_engine: 1}", f"cluster.placement_timeout_s={NODE_CHANGE_S}",
                  "gateway.replicas=0", "supervisor.start_timeout_s=300")  # fmt: skip
        with brigade_run(run_dir, *common, *AUTOSCALE, *on_ray, f"supervisor.metrics_port={port}") as run:
            run_id = read_run_info(run_dir).run_id
            (first,) = cluster.worker_nodes()
            assert nodes_of(run)["scheduler-0"] == first

            burst = Streams(run_dir, BURST)
            wait_for_stages(run, tokenizers=1, detokenizers=1, schedulers=2, timeout=300)
            after = Streams(run_dir, AFTER)
            assert {**burst.texts(), **after.texts()} == reference
            nodes = cluster.worker_nodes()
            assert len(nodes) == 2 and all(r["autoscaled_engine"] == 1 for r in nodes.values()), nodes
            placed = nodes_of(run)
            assert placed["scheduler-1"] == placed["gpu_worker-1-0"] == (set(nodes) - {first}).pop(), placed
            assert any("room for 2 engine group(s)" in line for line in drain(run))  # request_resources
            deadline = time.monotonic() + 30  # /metrics gathers other nodes' stages every few seconds
            while not metric(scrape(port), "brigade:request_queue_time_seconds_count", engine="1"):
                assert time.monotonic() < deadline, "group 1 served nothing"
                time.sleep(0.5)

            wait_for_stages(run, tokenizers=1, detokenizers=1, schedulers=1, timeout=180)  # idle: one group
            assert group_shm(run_id, 1) == [], "the retired group's shared memory stayed"
            up, down = autoscale_events(run_dir)
            fields = ("direction", "current", "target", "groups", "error")
            assert [up[f] for f in fields] == ["up", 1, 2, 2, ""], up
            assert [down[f] for f in fields] == ["down", 2, 1, 1, ""], down
            assert list(cluster.wait_for_worker_nodes(1, NODE_CHANGE_S)) == [first]  # group 1's node ended
            assert nodes_of(run)["scheduler-0"] == first
            assert Streams(run_dir, range(4)).texts() == {i: reference[i] for i in range(4)}
        assert run.process.returncode == 0, "".join(drain(run)[-60:])
        assert_clean(run_dir, run_id)
        cluster.wait_for_worker_nodes(0, NODE_CHANGE_S)  # a stopped run keeps no node up
