"""The first half of a hot reload (supervision/reload.py), without a run: when the config file
counts as changed, and which of its settings a reload takes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from ipc.config import load_config
from services.audit import AuditLog
from supervision.reload import ConfigFile


def audit_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_configmap_swap_counts_as_a_change_though_mtime_and_size_match(tmp_path: Path):
    # Kubernetes updates a mounted ConfigMap by pointing a symlink at a new file; that file's
    # mtime can equal the old one's, and a one-digit edit keeps the size.
    old, new = tmp_path / "a.yaml", tmp_path / "b.yaml"
    old.write_text("tokenizer:\n  replicas: 1\n")
    new.write_text("tokenizer:\n  replicas: 2\n")
    stat = old.stat()
    os.utime(new, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    link = tmp_path / "config.yaml"
    link.symlink_to(old)
    config_file = ConfigFile(str(link), [])
    assert not config_file.has_changed()
    swap = tmp_path / "swap"
    swap.symlink_to(new)
    swap.replace(link)
    assert config_file.has_changed()
    assert not config_file.has_changed()  # until it changes again


def test_a_file_that_goes_away_is_no_change_and_its_return_is(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text("tokenizer:\n  replicas: 1\n")
    config_file = ConfigFile(str(path), [])
    path.unlink()
    assert not config_file.has_changed()
    path.write_text("tokenizer:\n  replicas: 1\n")
    assert config_file.has_changed()


def test_an_edit_a_sighup_read_is_not_read_again_by_the_file_watch(tmp_path: Path):
    """An operator edits the file and sends SIGHUP: the watch saw the same edit at its next look
    and applied it a second time (a failed start taken back was tried twice)."""
    path = tmp_path / "config.yaml"
    path.write_text("tokenizer:\n  replicas: 1\n")
    config_file = ConfigFile(str(path), [])
    running = load_config(str(path))
    # Each edit changes the size: the test must not hang on the filesystem's mtime resolution.
    path.write_text("tokenizer:\n  replicas: 2  # edited\n")
    audit = AuditLog(tmp_path / "audit.jsonl", "supervisor")
    reloaded = config_file.live_settings(running, audit)  # the SIGHUP's read
    assert reloaded is not None and reloaded[1] == ["tokenizer.replicas"]
    assert not config_file.has_changed()
    path.write_text("tokenizer:\n  replicas: 3  # edited again\n")
    assert config_file.has_changed()  # the next edit is seen


def test_only_live_settings_are_taken_and_the_rest_is_audited_as_refused(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"tokenizer": {"replicas": 1}}))
    running = load_config(path)
    path.write_text(yaml.safe_dump({"tokenizer": {"replicas": 3}, "model": {"max_model_len": 77}}))
    audit = AuditLog(tmp_path / "audit.jsonl", "supervisor")
    reloaded = ConfigFile(str(path), []).live_settings(running, audit)
    assert reloaded is not None
    config, live = reloaded
    assert live == ["tokenizer.replicas"]
    assert config.tokenizer.replicas == 3
    assert config.model.max_model_len == running.model.max_model_len
    [event] = audit_events(tmp_path / "audit.jsonl")
    assert event["event"] == "reload"
    assert event["applied"] == {"tokenizer.replicas": [1, 3]}
    assert event["refused"] == {"model.max_model_len": [running.model.max_model_len, 77]}


def test_the_overrides_of_the_start_stay_applied(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"tokenizer": {"replicas": 1}}))
    overrides = ["detokenizer.replicas=2"]
    running = load_config(path, overrides)
    path.write_text(yaml.safe_dump({"tokenizer": {"replicas": 2}}))
    audit = AuditLog(tmp_path / "audit.jsonl", "supervisor")
    reloaded = ConfigFile(str(path), overrides).live_settings(running, audit)
    assert reloaded is not None
    config, live = reloaded
    assert live == ["tokenizer.replicas"]
    assert config.detokenizer.replicas == 2


def test_a_broken_or_unchanged_file_gives_nothing_to_apply(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"tokenizer": {"replicas": 1}}))
    running = load_config(path)
    audit_path = tmp_path / "audit.jsonl"
    audit = AuditLog(audit_path, "supervisor")
    config_file = ConfigFile(str(path), [])
    assert config_file.live_settings(running, audit) is None  # nothing changed: nothing audited
    assert audit_events(audit_path) == []
    path.write_text("tokenizer: [")
    assert config_file.live_settings(running, audit) is None
    [event] = audit_events(audit_path)
    assert event["event"] == "reload" and event["error"]
    os.unlink(path)
    os.mkfifo(path)  # read without blocking: a FIFO is refused, not waited on
    assert config_file.live_settings(running, audit) is None
    assert len(audit_events(audit_path)) == 2


def test_with_autoscale_on_a_reload_keeps_the_autoscalers_group_count(tmp_path: Path):
    path = tmp_path / "config.yaml"
    on = {"autoscale": {"enabled": True, "max_groups": 4}}
    path.write_text(yaml.safe_dump({**on, "engine": {"data_parallel": 1}}))
    running = load_config(path, ["engine.data_parallel=3"])  # where the autoscaler has taken the run
    path.write_text(yaml.safe_dump({**on, "engine": {"data_parallel": 1, "max_num_waiting": 9}}))
    audit = AuditLog(tmp_path / "audit.jsonl", "supervisor")
    reloaded = ConfigFile(str(path), []).live_settings(running, audit)
    assert reloaded is not None
    config, live = reloaded
    assert live == ["engine.max_num_waiting"]
    assert config.engine.data_parallel == 3
    [event] = audit_events(tmp_path / "audit.jsonl")
    assert event["applied"] == {"engine.max_num_waiting": [running.engine.max_num_waiting, 9]}


def test_a_reload_of_a_file_with_a_node_inside_itself_is_refused_not_fatal(tmp_path: Path):
    """A YAML alias of an anchor around it makes a value that contains itself: comparing it with
    the running config raised RecursionError out of the supervisor's watch loop, ending the run."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"tokenizer": {"replicas": 1}}))
    running = load_config(path)
    path.write_text(
        "tokenizer:\n  replicas: 2\nmodel:\n  override_generation_config: &x\n    temperature: 0.5\n    top_p: *x\n"
    )
    audit = AuditLog(tmp_path / "audit.jsonl", "supervisor")
    assert ConfigFile(str(path), []).live_settings(running, audit) is None
    [event] = audit_events(tmp_path / "audit.jsonl")
    assert event["error"].startswith("model.override_generation_config.top_p: contains itself")
