"""The supervisor's pure parts, without processes: the restart policy and the hang rule on a fake
clock, the fatal start rule, and the table of live settings against the Reconfigure command."""

from __future__ import annotations

from collections import deque

import msgspec
import pytest

from ipc import messages as m
from ipc.config import SupervisorConfig, load_config
from ipc.topology import StageSpec, Topology
from supervision.health import Health
from supervision.live_settings import (
    LIVE_SETTINGS,
    RECONFIGURED,
    TOPOLOGY_SETTINGS,
    apply_live,
    diff_fields,
    reconfigure_message,
)
from supervision.policy import RestartPolicy, is_fatal_start_failure


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def policy(clock: FakeClock, intensity: int = 3) -> RestartPolicy:
    return RestartPolicy(
        intensity=intensity, period_s=60.0, backoff_initial_s=0.5, backoff_max_s=3.0, clock=clock
    )


def test_backoff_doubles_with_recent_failures_up_to_the_maximum(clock: FakeClock) -> None:
    restarts = policy(clock, intensity=10)
    failures: deque[float] = deque()
    delays = []
    for _ in range(5):
        delays.append(restarts.on_failure(failures))
        clock.now += 1.0
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_one_failure_more_than_the_intensity_within_the_period_gives_up(clock: FakeClock) -> None:
    restarts = policy(clock, intensity=3)
    failures: deque[float] = deque()
    for _ in range(3):
        assert restarts.on_failure(failures) is not None
        clock.now += 10.0
    assert restarts.on_failure(failures) is None
    assert len(failures) == 4


def test_failures_older_than_the_period_are_forgotten(clock: FakeClock) -> None:
    restarts = policy(clock, intensity=2)
    failures: deque[float] = deque()
    assert restarts.on_failure(failures) == 0.5
    clock.now += 30.0
    assert restarts.on_failure(failures) == 1.0
    clock.now += 31.0  # the first failure is now 61 s old
    assert restarts.on_failure(failures) == 1.0  # two recent failures, not three
    assert list(failures) == [1030.0, 1061.0]
    clock.now += 61.0
    assert restarts.on_failure(failures) == 0.5  # a fresh start


def test_zero_intensity_gives_up_at_the_first_failure(clock: FakeClock) -> None:
    assert policy(clock, intensity=0).on_failure(deque()) is None


def test_policy_from_config_takes_the_supervisor_section(clock: FakeClock) -> None:
    config = SupervisorConfig(
        restart_intensity=1, restart_period_s=5.0, backoff_initial_s=0.1, backoff_max_s=0.2
    )
    restarts = RestartPolicy.from_config(config, clock)
    failures: deque[float] = deque()
    assert restarts.on_failure(failures) == 0.1
    assert restarts.on_failure(failures) is None


@pytest.mark.parametrize(
    ("was_ever_ready", "returncode", "fatal"),
    [(False, 1, True), (False, 2, True), (False, -9, False), (True, 1, False), (True, -9, False)],
)
def test_only_an_error_exit_before_ever_being_ready_is_fatal(
    was_ever_ready: bool, returncode: int, fatal: bool
) -> None:
    assert is_fatal_start_failure(was_ever_ready, returncode) is fatal


def test_a_stage_without_heartbeats_is_hung() -> None:
    health = Health.started(0.0)
    health.on_beat(1.0, progress=0, has_work=False)
    assert health.hang_reason(10.0, timeout_s=10.0) is None
    assert health.hang_reason(11.5, timeout_s=10.0) == "no heartbeat for 10s"


def test_a_stage_with_work_and_no_progress_is_hung() -> None:
    health = Health.started(0.0)
    for t in range(0, 12):
        health.on_beat(float(t), progress=5, has_work=True)
    assert health.hang_reason(11.0, timeout_s=10.0) == "no progress for 11s with work pending"


def test_progress_counts_from_when_work_appeared() -> None:
    """A scheduler idle while its worker restarted, then given work again: not stuck, although its
    progress counter last moved long ago (it would otherwise be killed on its first heartbeat)."""
    health = Health.started(0.0)
    health.on_beat(0.0, progress=7, has_work=True)
    for t in range(1, 60):
        health.on_beat(float(t), progress=7, has_work=False)  # idle: the worker is being replaced
    health.on_beat(60.0, progress=7, has_work=True)
    assert health.hang_reason(65.0, timeout_s=10.0) is None
    health.on_beat(69.0, progress=7, has_work=True)
    assert health.hang_reason(71.0, timeout_s=10.0) == "no progress for 11s with work pending"


def test_idle_stage_is_never_hung_while_it_beats() -> None:
    health = Health.started(0.0)
    for t in range(0, 100):
        health.on_beat(float(t), progress=1, has_work=False)
    assert health.hang_reason(100.0, timeout_s=10.0) is None


def test_live_settings_are_the_reconfigure_fields_and_the_topology_counts() -> None:
    assert sorted(RECONFIGURED.values()) == sorted(f.name for f in msgspec.structs.fields(m.Reconfigure))
    assert set(LIVE_SETTINGS) == set(RECONFIGURED) | set(TOPOLOGY_SETTINGS)
    config = load_config(None)
    for path in LIVE_SETTINGS:
        section, name = path.split(".")
        assert hasattr(getattr(config, section), name), path


def test_apply_live_takes_only_the_live_settings() -> None:
    old = load_config(None)
    new = load_config(
        None,
        [
            "tokenizer.replicas=3",
            "detokenizer.replicas=2",
            "gateway.replicas=2",
            "encoder.replicas=2",
            "engine.max_num_waiting=7",
            "engine.data_parallel=3",
            "tokenizer.default_max_tokens=9",
            "supervisor.log_level=DEBUG",
            "model.max_model_len=256",
            "engine.max_num_seqs=8",
            "lora.max_loras=1",
            "lora.adapters={sql: /adapters/sql}",
        ],
    )
    applied = apply_live(old, new)
    assert sorted(diff_fields(old, applied)) == sorted(LIVE_SETTINGS)
    assert sorted(diff_fields(applied, new)) == [
        "engine.max_num_seqs",
        "lora.max_loras",
        "model.max_model_len",
    ]
    assert reconfigure_message(applied) == m.Reconfigure(
        log_level="DEBUG", max_num_waiting=7, default_max_tokens=9, lora_adapters={"sql": "/adapters/sql"}
    )
    topology = Topology.of(applied)
    assert (topology.num_tokenizers, topology.num_detokenizers, topology.num_gateways) == (3, 2, 2)
    assert topology.num_groups == topology.num_routed_groups == 3


def test_stage_set_plans_every_stage_in_start_order(tmp_path) -> None:
    from supervision.stages import StageSet

    config = load_config(None, ["engine.data_parallel=2", "engine.tensor_parallel=2", "tokenizer.replicas=2"])
    stages = StageSet(config, tmp_path, "text")
    planned = [(stages.add(spec).name, spec.group) for spec in Topology.of(config).stages()]
    assert planned == [
        ("detokenizer-0", -1),
        ("scheduler-0", 0), ("gpu_worker-0-0", 0), ("gpu_worker-0-1", 0),
        ("scheduler-1", 1), ("gpu_worker-1-0", 1), ("gpu_worker-1-1", 1),
        ("tokenizer-0", -1), ("tokenizer-1", -1),
        ("gateway-0", -1),
    ]  # fmt: skip
    worker = stages["gpu_worker-1-1"]
    assert worker.argv[-2:] == ["--rank", "1"] and worker.argv[2] == "services.gpu_worker"
    assert worker.env["BRIGADE_DIST_PORT"] == str(stages.dist_ports[1])
    assert all(s.process is None for s in stages)  # planning spawns nothing


def test_a_stage_kind_without_a_stop_place_is_refused(tmp_path) -> None:
    from supervision.stages import StageSet

    with pytest.raises(ValueError, match="STOP_ORDER"):
        StageSet(load_config(None), tmp_path, "text").add(StageSpec("mystery", 0))
