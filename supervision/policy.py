"""The restart policy, as in Erlang/OTP supervisors: a stage may fail `intensity` times within
`period_s`; one more failure ends the run. Restarts back off exponentially with the number of
recent failures. Pure: it takes a clock, and owns no process."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ipc.config import SupervisorConfig


@dataclass
class RestartPolicy:
    intensity: int
    period_s: float
    backoff_initial_s: float
    backoff_max_s: float
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    @classmethod
    def from_config(
        cls, config: SupervisorConfig, clock: Callable[[], float] = time.monotonic
    ) -> RestartPolicy:
        return cls(
            config.restart_intensity,
            config.restart_period_s,
            config.backoff_initial_s,
            config.backoff_max_s,
            clock,
        )

    def on_failure(self, failures: deque[float]) -> float | None:
        """Record one failure of a stage in its `failures` (times, oldest first). Returns the
        delay before its restart, or None when it failed too often and the run must give up."""
        now = self.clock()
        failures.append(now)
        while now - failures[0] > self.period_s:
            failures.popleft()
        if len(failures) > self.intensity:
            return None
        return min(self.backoff_initial_s * 2 ** (len(failures) - 1), self.backoff_max_s)


class GiveUp(Exception):
    """The run cannot go on (a stage failed too often, or cannot start at all); the run ends."""


class StartFailed(GiveUp):
    """Stages `names` failed their first start, or did not come up within
    supervisor.start_timeout_s. At the run's start the run ends; a topology change takes back the
    settings that added them instead (supervision/transition.py)."""

    def __init__(self, message: str, names: list[str]) -> None:
        super().__init__(message)
        self.names = names


def is_fatal_start_failure(has_been_ready: bool, returncode: int) -> bool:
    """A stage that exits with an error before it was ever ready, on its first start, failed on
    something a restart will not change (its config, its model): restarting it would only loop.
    A stage killed by a signal (negative code: SIGKILL from outside, the OOM killer) did not
    fail by itself, and is restarted as usual."""
    return not has_been_ready and returncode > 0
