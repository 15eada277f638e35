"""When a live stage counts as hung, from what its heartbeats say. Pure: the caller passes the
time, so that tests drive it with a fake clock."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Health:
    """The supervisor's view of one stage process since it was (re)started at `now`."""

    last_beat: float
    progress: int = -1
    progress_at: float = 0.0
    has_work: bool = False

    @classmethod
    def started(cls, now: float) -> Health:
        return cls(last_beat=now, progress_at=now)

    def on_beat(self, now: float, progress: int | None = None, has_work: bool = False) -> None:
        """Any message from the stage; a heartbeat carries its progress counter and whether it has
        work. Progress is measured from the moment work appeared: a stage that was idle (say, a
        scheduler whose worker was being replaced) has not been stuck meanwhile."""
        self.last_beat = now
        if progress is None:
            return
        if progress != self.progress or (has_work and not self.has_work):
            self.progress, self.progress_at = progress, now
        self.has_work = has_work

    def hang_reason(self, now: float, timeout_s: float) -> str | None:
        """Why a ready stage counts as hung now, or None."""
        if now - self.last_beat > timeout_s:
            return f"no heartbeat for {now - self.last_beat:.0f}s"
        if self.has_work and now - self.progress_at > timeout_s:
            return f"no progress for {now - self.progress_at:.0f}s with work pending"
        return None
