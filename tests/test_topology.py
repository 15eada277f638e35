"""The run's topology as a value: start order, and the transitions of every reload and node move
(ipc/topology.py). No process starts here."""

from __future__ import annotations

import msgspec
import pytest

from ipc.config import load_config
from ipc.topology import STOP_ORDER, Topology, diff


def topology(tokenizers=1, detokenizers=1, gateways=1, groups=1, routed=None, tp=1, hosts=None) -> Topology:
    return Topology(
        num_tokenizers=tokenizers,
        num_detokenizers=detokenizers,
        num_gateways=gateways,
        num_groups=groups,
        num_routed_groups=groups if routed is None else routed,
        tensor_parallel=tp,
        hosts=hosts or {},
    )


def names(specs) -> list[str]:
    return [s.name for s in specs]


def test_stages_start_downstream_first_and_each_scheduler_before_its_workers():
    t = topology(tokenizers=2, detokenizers=2, gateways=1, groups=2, tp=2)
    assert names(t.stages()) == [
        "detokenizer-0", "detokenizer-1",
        "scheduler-0", "gpu_worker-0-0", "gpu_worker-0-1",
        "scheduler-1", "gpu_worker-1-0", "gpu_worker-1-1",
        "tokenizer-0", "tokenizer-1",
        "gateway-0",
    ]  # fmt: skip
    workers = [s for s in t.stages() if s.kind == "gpu_worker"]
    assert [(s.group, s.rank) for s in workers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {s.kind for s in t.stages()} <= set(STOP_ORDER)


def test_of_config_counts_every_section():
    config = load_config(
        None,
        ["tokenizer.replicas=3", "detokenizer.replicas=2", "gateway.replicas=2", "engine.data_parallel=2"],
    )
    t = Topology.of(config, {"scheduler-1": "10.0.0.2"})
    assert (t.num_tokenizers, t.num_detokenizers, t.num_gateways) == (3, 2, 2)
    assert (t.num_groups, t.num_routed_groups, t.tensor_parallel) == (2, 2, 1)
    assert t.hosts == {"scheduler-1": "10.0.0.2"}


def test_it_travels_as_a_message():
    t = topology(groups=3, routed=2, hosts={"scheduler-2": "10.0.0.3"})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(t), type=Topology) == t


@pytest.mark.parametrize("groups, routed", [(2, 0), (2, 3)])
def test_routed_groups_must_be_some_of_the_groups(groups, routed):
    with pytest.raises(ValueError, match="taking requests"):
        topology(groups=groups, routed=routed)


def test_the_same_topology_is_no_transition():
    t = topology(tokenizers=2, groups=2)
    step = diff(t, t)
    assert (step.added, step.removed, list(step.draining)) == ([], [], [])
    assert step.during == step.after == t


def test_added_replicas_and_groups_start_in_start_order():
    step = diff(topology(tp=2), topology(tokenizers=2, detokenizers=2, gateways=2, groups=2, tp=2))
    assert names(step.added) == [
        "detokenizer-1", "scheduler-1", "gpu_worker-1-0", "gpu_worker-1-1", "tokenizer-1", "gateway-1"
    ]  # fmt: skip
    assert step.removed == [] and list(step.draining) == []
    assert step.during.num_routed_groups == step.during.num_groups == 2


def test_retired_groups_drain_while_the_others_take_the_requests():
    old = topology(groups=3, tp=2)
    step = diff(old, topology(groups=1, tp=2))
    assert list(step.draining) == [1, 2]
    assert (step.during.num_groups, step.during.num_routed_groups) == (3, 1)  # they still run...
    assert (step.after.num_groups, step.after.num_routed_groups) == (1, 1)  # ...then they are gone
    assert names(step.removed) == [
        "scheduler-1", "scheduler-2", "gpu_worker-1-0", "gpu_worker-1-1", "gpu_worker-2-0", "gpu_worker-2-1"
    ]  # fmt: skip


def test_removed_replicas_stop_from_the_entry_of_requests_to_their_exit():
    step = diff(topology(tokenizers=3, detokenizers=3, gateways=2), topology())
    assert names(step.removed) == [
        "gateway-1", "tokenizer-1", "tokenizer-2", "detokenizer-1", "detokenizer-2"
    ]  # fmt: skip
    # The schedulers move every request off the removed detokenizer shards. (The supervisor keeps
    # the removed tokenizer replicas linked while they finish: tests/test_transition.py.)
    assert step.during.num_detokenizers == step.after.num_detokenizers == 1
    assert step.during.num_tokenizers == step.after.num_tokenizers == 1


def test_a_reload_that_grows_one_count_and_shrinks_another():
    step = diff(
        topology(tokenizers=2, detokenizers=1, groups=2), topology(tokenizers=1, detokenizers=2, groups=3)
    )
    assert names(step.added) == ["detokenizer-1", "scheduler-2", "gpu_worker-2-0"]
    assert names(step.removed) == ["tokenizer-1"]
    assert list(step.draining) == []


def test_a_group_placed_on_another_node_is_linked_there_and_nothing_starts_or_stops():
    old = topology(groups=2, hosts={"scheduler-1": "10.0.0.2", "gpu_worker-1-0": "10.0.0.2"})
    new = topology(groups=2, hosts={"scheduler-1": "10.0.0.9", "gpu_worker-1-0": "10.0.0.9"})
    step = diff(old, new)
    assert step.added == [] and step.removed == []
    assert step.during.hosts == new.hosts


def test_tensor_parallel_cannot_change_live():
    with pytest.raises(ValueError, match="tensor_parallel"):
        diff(topology(tp=1), topology(tp=2))
