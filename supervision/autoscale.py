"""The autoscale policy: how many engine groups the run's load asks for, between
autoscale.min_groups and max_groups. Pure: it takes load samples and a clock, and owns no process
(supervision/group_scaler.py carries its decisions out).

Each target (waiting requests, running sequences, KV usage per group; time to first token) turns
the groups' summed load into the number of groups that would hold it at the target; the largest
of them is what the run needs. It grows at once when it needs more groups than it has (a burst
is served, not averaged away), and shrinks only when the load would stay under
scale_down_ratio of the targets on fewer groups for all of scale_down_window_s (the most groups
any sample in the window asked for is kept, so a load that comes and goes does not make groups
come and go). After any change, adding waits scale_up_cooldown_s and removing
scale_down_cooldown_s: a new group needs time before its effect shows in the samples."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ipc.config import AutoscaleConfig

# More groups than any backend holds: what an infinite sample asks for (decide bounds it).
MOST_GROUPS = float(1 << 31)


def _bounded(groups: float) -> float:
    """A number of groups that `math.ceil` takes: the heartbeats are other processes' numbers,
    and one inf (OverflowError) ended the supervisor's watch loop, and the run. NaN (which `max`
    keeps or drops by its place) and negatives ask for none; inf, for as many as the bounds allow."""
    return 0.0 if math.isnan(groups) or groups < 0 else min(groups, MOST_GROUPS)


@dataclass(frozen=True)
class GroupLoad:
    """One engine group's load, from its scheduler's heartbeat."""

    num_waiting: int
    num_running: int
    kv_usage: float  # fraction of its KV blocks in use
    ttft_s: float | None = None  # recent time to first token, where known


@dataclass(frozen=True)
class Decision:
    """A change of the number of engine groups, and what it was decided on (the audit log's)."""

    current: int
    target: int
    reason: str
    needed: dict[str, float]  # per target: the groups that would hold the load at it

    @property
    def direction(self) -> Literal["up", "down"]:
        return "up" if self.target > self.current else "down"


@dataclass
class AutoscalePolicy:
    config: AutoscaleConfig
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    last_change_at: float = -math.inf
    # (time, groups it asked for) of the samples within scale_down_window_s, oldest first
    recent: deque[tuple[float, int]] = field(default_factory=deque, repr=False)
    watching_since: float | None = None  # the first sample: a window is full only after it

    def needed(self, current: int, loads: Sequence[GroupLoad]) -> dict[str, float]:
        """Per target: the (fractional) number of groups that would hold `loads` at it."""
        config = self.config
        needed = {"waiting": sum(g.num_waiting for g in loads) / config.target_waiting}
        needed["kv_usage"] = sum(g.kv_usage for g in loads) / config.target_kv_usage
        if config.target_running:
            needed["running"] = sum(g.num_running for g in loads) / config.target_running
        ttfts = [g.ttft_s for g in loads if g.ttft_s is not None]
        if config.target_ttft_s and ttfts:
            needed["ttft"] = current * max(ttfts) / config.target_ttft_s
        return {name: _bounded(value) for name, value in needed.items()}

    def decide(self, current: int, loads: Sequence[GroupLoad], limit: int | None = None) -> Decision | None:
        """The change `loads` (one per running group) ask of `current` groups, or None. `limit`
        is the most groups the backend can hold (the host's devices), below max_groups."""
        config = self.config
        now = self.clock()
        if self.watching_since is None:
            self.watching_since = now
        lowest = config.min_groups
        highest = max(lowest, min(config.max_groups, limit if limit is not None else config.max_groups))
        needed = self.needed(current, loads)
        peak = max(needed.values())
        # Hysteresis: the groups that hold the load at scale_down_ratio of the targets.
        wanted_down = max(lowest, math.ceil(peak / config.scale_down_ratio - 1e-9))
        self.recent.append((now, wanted_down))
        while self.recent[0][0] < now - config.scale_down_window_s:
            self.recent.popleft()
        since_change = now - self.last_change_at
        is_cool = since_change >= min(config.scale_up_cooldown_s, config.scale_down_cooldown_s)
        if not lowest <= current <= highest and is_cool:  # bounds first, whatever the load
            target = min(max(current, lowest), highest)
            return self.change(current, target, f"outside the bounds {lowest}..{highest}", needed, now)
        if peak > current and current < highest and since_change >= config.scale_up_cooldown_s:
            target = min(math.ceil(peak - 1e-9), highest)
            name = max(needed, key=needed.__getitem__)
            reason = f"{name} needs {peak:.2f} groups"
            return self.change(current, target, reason, needed, now)
        is_window_full = now - self.watching_since >= config.scale_down_window_s
        held = min(max(wanted for _, wanted in self.recent), highest)
        if is_window_full and held < current and since_change >= config.scale_down_cooldown_s:
            window = config.scale_down_window_s
            reason = f"at most {held} group(s) needed at {config.scale_down_ratio:g} of the targets for {window:g}s"
            return self.change(current, held, reason, needed, now)
        return None

    def change(
        self, current: int, target: int, reason: str, needed: dict[str, float], now: float
    ) -> Decision:
        self.last_change_at = now
        return Decision(current, target, reason, {name: round(value, 3) for name, value in needed.items()})
