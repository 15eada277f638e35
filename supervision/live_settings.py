"""The settings a hot reload applies to a live run, declared once. Every other changed field is
logged as needing a restart. Each live setting reaches the stages as one field of the
`Reconfigure` command; the replica and engine group counts change the run's topology instead
(ipc/topology.py), which the supervisor carries out and sends as `TopologyChanged`."""

from __future__ import annotations

import msgspec

from ipc import messages as m
from ipc.config import Config

# config path -> the Reconfigure field that carries it to the stages
RECONFIGURED: dict[str, str] = {
    "supervisor.log_level": "log_level",
    "tokenizer.default_max_tokens": "default_max_tokens",
    "engine.max_num_waiting": "max_num_waiting",
    "lora.adapters": "lora_adapters",
}
# The counts of ipc/topology.py's Topology.of, by the kind of stage a change of each starts or
# retires (a setting whose added stages fail to start goes back: supervision/transition.py).
SETTING_OF_KIND = {
    "tokenizer": "tokenizer.replicas", "detokenizer": "detokenizer.replicas", "gateway": "gateway.replicas",
    "encoder": "encoder.replicas", "scheduler": "engine.data_parallel", "gpu_worker": "engine.data_parallel",
}  # fmt: skip
TOPOLOGY_SETTINGS = tuple(dict.fromkeys(SETTING_OF_KIND.values()))
LIVE_SETTINGS = (*RECONFIGURED, *TOPOLOGY_SETTINGS)


def get_setting(config: msgspec.Struct, path: str) -> object:
    node = config
    for part in path.split("."):
        node = getattr(node, part)
    return node


def with_setting(config: msgspec.Struct, path: str, value: object) -> msgspec.Struct:
    """A copy of `config` (frozen structs) with the field at dotted `path` set to `value`."""
    head, _, rest = path.partition(".")
    if not rest:
        return msgspec.structs.replace(config, **{head: value})
    return msgspec.structs.replace(config, **{head: with_setting(getattr(config, head), rest, value)})


def diff_fields(old: msgspec.Struct, new: msgspec.Struct, prefix: str = "") -> list[str]:
    """Dotted paths of the fields whose values differ between two configs."""
    paths = []
    for spec in msgspec.structs.fields(old):
        a, b = getattr(old, spec.name), getattr(new, spec.name)
        if isinstance(a, msgspec.Struct):
            paths += diff_fields(a, b, f"{prefix}{spec.name}.")
        elif a != b:
            paths.append(f"{prefix}{spec.name}")
    return paths


def apply_live(old: Config, new: Config) -> Config:
    """`old` with the live settings of `new`."""
    for path in LIVE_SETTINGS:
        old = with_setting(old, path, get_setting(new, path))
    return old


def reconfigure_message(config: Config) -> m.Reconfigure:
    return m.Reconfigure(**{name: get_setting(config, path) for path, name in RECONFIGURED.items()})
