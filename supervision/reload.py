"""A hot reload's first half: the run's config file, watched for a change (SIGHUP, or a new file),
read again, and the live settings taken from it (supervision/live_settings.py). The supervisor
carries out the second half: the topology change (supervision/transition.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from ipc.config import Config, ConfigError, load_config
from services.audit import AuditLog
from supervision.live_settings import LIVE_SETTINGS, apply_live, diff_fields, get_setting, with_setting

log = logging.getLogger("supervisor")


def file_signature(path: str | None) -> tuple[int, int, int, int] | None:
    """What tells a changed config file: its inode as well as its mtime and size, because a
    Kubernetes ConfigMap update swaps a symlink over to a new file, whose mtime may equal the
    old one's; None while it cannot be read."""
    if not path:
        return None
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class ConfigFile:
    """The config file a run started from (None: defaults only), with its `--set` overrides."""

    def __init__(self, path: str | None, overrides: list[str]) -> None:
        self.path = path
        self.overrides = overrides
        self.signature = file_signature(path)

    def has_changed(self) -> bool:
        """Whether the file changed since the last look (a file that went away has not)."""
        signature = file_signature(self.path)
        changed, self.signature = signature != self.signature, signature
        return changed and signature is not None

    def live_settings(self, config: Config, audit: AuditLog) -> tuple[Config, list[str]] | None:
        """`config` with the live settings the file has now, and their paths; None, logged and
        audited, when it does not load or changes no live setting. Every changed setting that
        needs a restart is logged and kept at its old value."""
        # Taken before the read: a SIGHUP's read counts as the file watch's look too (or the watch
        # would apply the same edit again), and an edit made during the read is still seen.
        self.signature = file_signature(self.path)
        try:
            # Only a regular file, read without blocking: a FIFO put in its place must not stop
            # the watch loop (no restarts, no signals) until someone writes to it.
            new = load_config(self.path, self.overrides, regular_file_only=True)
        except ConfigError as exc:
            log.error("reload refused, config unchanged: %s", exc)
            audit.reload({}, error=str(exc))
            return None
        except Exception:  # whatever a config file does, it must not end a live run
            log.exception("reload refused, config unchanged: the config could not be read")
            audit.reload({}, error="the config could not be read")
            return None
        if config.autoscale.enabled and new.engine.data_parallel != config.engine.data_parallel:
            log.info(
                "reload: engine.data_parallel is the autoscaler's while autoscale.enabled; it stays %d",
                config.engine.data_parallel,
            )
            new = with_setting(new, "engine.data_parallel", config.engine.data_parallel)
        old_encoders, new_encoders = config.encoder.replicas, new.encoder.replicas
        if old_encoders != new_encoders and 0 in (old_encoders, new_encoders):
            # With none the run reads no images: its tokenizers refuse them and keep no encoder links.
            log.warning(
                "reload: encoder.replicas from %d to %d turns images on or off, which needs a restart; "
                "it stays %d",
                old_encoders,
                new_encoders,
                old_encoders,
            )
            new = with_setting(new, "encoder.replicas", old_encoders)
        changed = diff_fields(config, new)
        diff = {path: [get_setting(config, path), get_setting(new, path)] for path in changed}
        if diff:
            audit.reload(
                applied={p: v for p, v in diff.items() if p in LIVE_SETTINGS},
                refused={p: v for p, v in diff.items() if p not in LIVE_SETTINGS},
            )
        for path in sorted(set(changed) - set(LIVE_SETTINGS)):
            log.warning("reload: %s changed but needs a restart to take effect; keeping the old value", path)
        live = sorted(set(changed) & set(LIVE_SETTINGS))
        if not live:
            log.info("reload: nothing to apply live")
            return None
        return apply_live(config, new), live
