"""The Ray backend's side of autoscaling (supervision/ray_stages.py): an engine group that finds no
room asks Ray's autoscaler for every group's bundle (`ray.autoscaler.sdk.request_resources`), is
placed when a node joins, and a retired group lowers the request. Against a real Ray cluster that
the test starts with `ray.cluster_utils.Cluster`, whose GCS holds the request Ray's autoscaler
reads; no autoscaler runs here, so the node the request asks for is added by the test."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest

from ipc.config import load_config

ray = pytest.importorskip("ray")
from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL  # noqa: E402
from ray.autoscaler.v2.utils import is_autoscaler_v2  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.experimental.internal_kv import _internal_kv_get  # noqa: E402

from supervision.ray_stages import RayStageSet  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BUNDLE = {"autoscaled_engine": 1.0}


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

        stages.release_groups(config.engine)  # group 1 retired: its node may go idle
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
