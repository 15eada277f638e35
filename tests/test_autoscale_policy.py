"""The autoscale policy (supervision/autoscale.py) on a fake clock: a burst adds groups at once,
an idle run gives them back only after its window, a load that comes and goes does not make
groups come and go, cooldowns space changes, and the bounds hold, with the host's limit (the local
stage set's cores or CUDA devices); contradicting settings are refused when the config loads."""

from __future__ import annotations

import math
import os

import msgspec
import pytest

from ipc.config import AutoscaleConfig, ConfigError, load_config
from supervision.autoscale import AutoscalePolicy, Decision, GroupLoad
from supervision.stages import StageSet
from tests.test_restart_policy import FakeClock

CONFIG = AutoscaleConfig(
    enabled=True,
    min_groups=1,
    max_groups=4,
    target_waiting=4.0,
    target_kv_usage=0.8,
    scale_down_ratio=0.5,
    scale_down_window_s=30.0,
    scale_up_cooldown_s=10.0,
    scale_down_cooldown_s=60.0,
)
IDLE = GroupLoad(num_waiting=0, num_running=0, kv_usage=0.0)


def waiting(n: int) -> GroupLoad:
    return GroupLoad(num_waiting=n, num_running=2, kv_usage=0.1)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def run(policy: AutoscalePolicy, clock: FakeClock, groups: int, load: GroupLoad, seconds: float,
        step_s: float = 1.0, limit: int | None = None) -> tuple[int, list[Decision]]:  # fmt: skip
    """Sample the run's `load` (on its first group; the policy sums them) each `step_s` for
    `seconds`, applying each decision; returns the groups at the end and the decisions."""
    decisions = []
    end = clock.now + seconds
    while clock.now < end:
        decision = policy.decide(groups, [load] + [IDLE] * (groups - 1), limit)
        if decision is not None:
            assert decision.current == groups
            decisions.append(decision)
            groups = decision.target
        clock.now += step_s
    return groups, decisions


def test_a_burst_adds_the_groups_it_needs_at_once(clock: FakeClock) -> None:
    policy = AutoscalePolicy(CONFIG, clock)
    decision = policy.decide(1, [waiting(10)])  # 10 waiting at 4 per group: 2.5 groups
    assert decision is not None
    assert (decision.current, decision.target, decision.direction) == (1, 3, "up")
    assert decision.needed == {"waiting": 2.5, "kv_usage": 0.125}
    assert decision.reason == "waiting needs 2.50 groups"


def test_load_at_the_target_is_not_above_it(clock: FakeClock) -> None:
    policy = AutoscalePolicy(CONFIG, clock)
    assert policy.decide(1, [waiting(4)]) is None  # exactly 4 waiting: at the target
    assert policy.decide(2, [waiting(4), waiting(4)]) is None


def test_kv_usage_running_and_ttft_are_targets_too(clock: FakeClock) -> None:
    policy = AutoscalePolicy(CONFIG, clock)
    decision = policy.decide(1, [GroupLoad(0, 3, kv_usage=0.9)])
    assert decision is not None and decision.target == 2 and decision.reason.startswith("kv_usage")
    config = AutoscaleConfig(enabled=True, max_groups=8, target_running=4.0, target_ttft_s=0.5)
    policy = AutoscalePolicy(config, clock)
    decision = policy.decide(1, [GroupLoad(0, 10, 0.1)])
    assert decision is not None and decision.target == 3 and decision.needed["running"] == 2.5
    policy = AutoscalePolicy(config, clock)
    decision = policy.decide(2, [GroupLoad(0, 1, 0.1, ttft_s=1.0), GroupLoad(0, 1, 0.1, ttft_s=0.2)])
    assert decision is not None and decision.target == 4 and decision.reason == "ttft needs 4.00 groups"
    assert AutoscalePolicy(config, clock).decide(1, [GroupLoad(0, 1, 0.1, ttft_s=None)]) is None


def test_the_host_limit_and_max_groups_bound_a_burst(clock: FakeClock) -> None:
    decision = AutoscalePolicy(CONFIG, clock).decide(1, [waiting(100)])
    assert decision is not None and decision.target == 4  # max_groups
    decision = AutoscalePolicy(CONFIG, clock).decide(1, [waiting(100)], limit=2)
    assert decision is not None and decision.target == 2  # the host has room for two
    assert AutoscalePolicy(CONFIG, clock).decide(2, [waiting(100)] * 2, limit=2) is None


def test_groups_outside_the_bounds_are_brought_back(clock: FakeClock) -> None:
    decision = AutoscalePolicy(CONFIG, clock).decide(3, [waiting(100)] * 3, limit=2)
    assert decision is not None and (decision.target, decision.reason) == (2, "outside the bounds 1..2")
    config = AutoscaleConfig(enabled=True, min_groups=2, max_groups=4)
    decision = AutoscalePolicy(config, clock).decide(1, [IDLE])
    assert decision is not None and decision.target == 2


def test_idle_groups_are_removed_only_after_the_window_and_the_cooldown(clock: FakeClock) -> None:
    policy = AutoscalePolicy(CONFIG, clock)
    start = clock.now
    groups, decisions = run(policy, clock, 1, waiting(12), seconds=1)
    assert groups == 3 and [d.direction for d in decisions] == ["up"]
    groups, decisions = run(policy, clock, groups, IDLE, seconds=120)
    assert groups == 1 and [(d.current, d.target) for d in decisions] == [(3, 1)]
    # Not before the cooldown after the scale up (60 s), itself longer than the window (30 s).
    assert policy.last_change_at - start == pytest.approx(60.0)
    assert decisions[0].reason == "at most 1 group(s) needed at 0.5 of the targets for 30s"


def test_the_window_keeps_the_groups_a_recent_sample_needed(clock: FakeClock) -> None:
    config = AutoscaleConfig(enabled=True, max_groups=4, scale_down_window_s=30.0, scale_down_cooldown_s=0.0)
    policy = AutoscalePolicy(config, clock)
    groups, _ = run(policy, clock, 3, waiting(9), seconds=40)  # 9 waiting: 3 groups at half the target
    assert groups == 3
    groups, decisions = run(policy, clock, groups, IDLE, seconds=29)
    assert groups == 3 and decisions == []  # the window still holds a sample that needed 3
    groups, decisions = run(policy, clock, groups, IDLE, seconds=3)
    assert groups == 1 and len(decisions) == 1


def test_a_freshly_started_run_is_not_shrunk_before_one_window(clock: FakeClock) -> None:
    config = AutoscaleConfig(enabled=True, max_groups=4, scale_down_window_s=30.0, scale_down_cooldown_s=0.0)
    policy = AutoscalePolicy(config, clock)
    groups, decisions = run(policy, clock, 2, IDLE, seconds=30)
    assert groups == 2 and decisions == []
    groups, decisions = run(policy, clock, 2, IDLE, seconds=1)
    assert groups == 1


def test_a_load_that_comes_and_goes_does_not_flap_the_groups(clock: FakeClock) -> None:
    """Bursts every 20 s, idle in between, for ten minutes: one scale up, no scale down (each
    window sees a burst), however long it goes on."""
    policy = AutoscalePolicy(CONFIG, clock)
    groups, changes = 1, []
    for _ in range(30):
        groups, decisions = run(policy, clock, groups, waiting(6), seconds=2)
        changes += decisions
        groups, decisions = run(policy, clock, groups, IDLE, seconds=18)
        changes += decisions
    assert [(d.current, d.target) for d in changes] == [(1, 2)]


def test_a_load_around_the_target_stays_in_the_hysteresis_band(clock: FakeClock) -> None:
    """Between half the target and the target on two groups: neither up nor down."""
    policy = AutoscalePolicy(CONFIG, clock)
    groups, decisions = run(policy, clock, 2, waiting(7), seconds=600)
    assert groups == 2 and decisions == []


@pytest.mark.parametrize("bad", [math.inf, math.nan, -math.inf, -3.0])
def test_a_non_finite_or_negative_load_sample_is_bounded_not_raised(clock: FakeClock, bad: float) -> None:
    """A heartbeat's kv_usage or ttft of inf made math.ceil raise OverflowError in the
    supervisor's watch loop. inf asks for the most groups the bounds allow; NaN and negatives
    ask for none."""
    config = AutoscaleConfig(**{**msgspec.structs.asdict(CONFIG), "target_ttft_s": 1.0})
    for load in (GroupLoad(0, 0, bad), GroupLoad(0, 0, 0.0, bad), GroupLoad(-5, -5, bad, bad)):
        policy = AutoscalePolicy(config, clock)
        decision = policy.decide(2, [load, IDLE])
        if bad == math.inf:
            assert decision is not None and decision.target == CONFIG.max_groups, decision
        else:
            assert decision is None, decision  # the window is not full yet: no change


def test_cooldowns_space_the_scale_ups(clock: FakeClock) -> None:
    policy = AutoscalePolicy(CONFIG, clock)
    assert policy.decide(1, [waiting(5)]).target == 2  # type: ignore[union-attr]
    clock.now += 9.9
    assert policy.decide(2, [waiting(5)] * 2) is None  # still cooling down
    clock.now += 0.1
    assert policy.decide(2, [waiting(5)] * 2).target == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["autoscale.min_groups=3", "autoscale.max_groups=2"],
         "autoscale.min_groups (3) must be at most autoscale.max_groups (2)"),
        (["engine.data_parallel=3", "autoscale.max_groups=2"],
         "engine.data_parallel (3) is the number of engine groups the run starts with: it must be within "
         "autoscale.min_groups..max_groups (1..2)"),
        (["engine.devices=[0]"], "engine.devices lists one device per worker"),
        (["network.transport=tcp", "autoscale.max_groups=65"], "autoscale.max_groups: at most 64 engine groups"),
        (["autoscale.scale_down_ratio=1"], "autoscale.scale_down_ratio: expected float < 1.0, got 1"),
        (["autoscale.target_waiting=0"], "autoscale.target_waiting: expected float > 0.0, got 0"),
        (["autoscale.scale_up_cooldown_s=-1"], "autoscale.scale_up_cooldown_s: expected float >= 0.0, got -1"),
    ],
)  # fmt: skip
def test_contradicting_autoscale_settings_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["autoscale.enabled=true", *overrides])
    assert str(info.value).startswith(message)


def test_autoscale_is_off_by_default_and_its_bounds_are_then_not_checked() -> None:
    config = load_config(None, ["autoscale.min_groups=3", "autoscale.max_groups=2"])
    assert config.autoscale.enabled is False


@pytest.mark.parametrize(
    ("overrides", "per_group"),
    [(["engine.threads=1"], 1), (["engine.threads=2"], 2), (["engine.threads=0"], 1),
     (["engine.threads=1", "engine.tensor_parallel=2"], 2)],
)  # fmt: skip
def test_the_local_backend_holds_the_groups_its_cores_have_room_for(
    tmp_path, overrides: list[str], per_group: int
) -> None:
    stages = StageSet(load_config(None, overrides), tmp_path, "text")
    assert stages.max_groups() == max(1, len(os.sched_getaffinity(0)) // per_group)


def test_the_local_backend_holds_a_group_per_tensor_parallel_cuda_devices(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("supervision.stages.cuda_device_count", lambda: 8)
    config = load_config(None, ["engine.device=cuda", "engine.tensor_parallel=2", "model.dtype=bfloat16"])
    assert StageSet(config, tmp_path, "text").max_groups() == 4
