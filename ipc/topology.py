"""The run's topology as one value: which stages exist, which engine groups take new requests,
and where stages on other hosts run.

Pure: no processes, no sockets. The supervisor derives a `Topology` from its config and its
cluster placement; `Topology.stages()` is the one place the start order lives, and `diff` turns a
change of topology (a hot reload of replica counts or engine groups, an engine group placed on
another node) into the `Transition` the supervisor carries out. The stages receive it whole
(`TopologyChanged`) and resize their peer links from it (`services/peers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ipc.config import Config

# Stopping goes from the entry of requests to their exit, so that nothing in flight is cut off
# by a stage downstream stopping first.
STOP_ORDER = ("gateway", "tokenizer", "encoder", "scheduler", "gpu_worker", "detokenizer")


class Topology(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Every stage of a run, by count.

    `num_groups` engine groups have stages; the first `num_routed_groups` of them take new
    requests, and the rest are retiring (they finish what they run, then stop). `hosts` maps the
    name of each stage that runs on another host than the supervisor's to that host's address.
    `num_encoders` run a vision-language model's vision tower for the tokenizers. Clients find
    the tokenizer replicas that take requests in run.json's list: while a change removes some,
    `num_tokenizers` still counts them (they finish what they hold).
    """

    num_tokenizers: int
    num_detokenizers: int
    num_gateways: int
    num_groups: int
    num_routed_groups: int
    tensor_parallel: int
    hosts: dict[str, str] = {}
    num_encoders: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.num_routed_groups <= self.num_groups:
            raise ValueError(f"engine groups taking requests: {self.num_routed_groups} of {self.num_groups}")

    @classmethod
    def of(cls, config: Config, hosts: dict[str, str] | None = None) -> Topology:
        """The topology `config` asks for, with the stages placed on other hosts in `hosts`."""
        groups = config.engine.data_parallel
        return cls(
            num_tokenizers=config.tokenizer.replicas,
            num_detokenizers=config.detokenizer.replicas,
            num_gateways=config.gateway.replicas,
            num_groups=groups,
            num_routed_groups=groups,
            tensor_parallel=config.engine.tensor_parallel,
            hosts=hosts or {},
            num_encoders=config.encoder.replicas,
        )

    def stages(self) -> list[StageSpec]:
        """Every stage, in start order: the detokenizers first (everything upstream sends to
        them), each engine group's scheduler before its workers (they handshake with it), the
        encoders, then the tokenizers (which ask the encoders), whose clients may send at once,
        and the gateways in front of them."""
        specs = [StageSpec("detokenizer", j) for j in range(self.num_detokenizers)]
        for g in range(self.num_groups):
            specs.append(StageSpec("scheduler", g, group=g))
            specs += [StageSpec("gpu_worker", g, group=g, rank=r) for r in range(self.tensor_parallel)]
        specs += [StageSpec("encoder", e) for e in range(self.num_encoders)]
        specs += [StageSpec("tokenizer", i) for i in range(self.num_tokenizers)]
        specs += [StageSpec("gateway", i) for i in range(self.num_gateways)]
        return specs


@dataclass(frozen=True)
class StageSpec:
    """One stage of a topology. `group` and `rank` only for an engine group's stages."""

    kind: str
    index: int
    group: int = -1
    rank: int | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}" + (f"-{self.rank}" if self.rank is not None else "")


@dataclass(frozen=True)
class Transition:
    """What turns one topology into another, in the order the supervisor carries it out:
    1. start the `added` detokenizers, engine groups and encoders (in start order) and wait
       until they are ready;
    2. tell every stage `during`: the new counts, with the engine groups in `draining` still
       running but no longer taking new requests (the supervisor keeps the removed tokenizer
       replicas linked beside it until step 4: they finish their streams, whose replies come
       back from the detokenizers and the schedulers); then start the `added` tokenizers and
       gateways, which read `during` from run.json, so that they take requests only once every
       group they route to is up and every stage that answers them links to them; tell the
       removed tokenizers to take no new calls;
    3. let the groups in `draining` finish what they run, stop their stages, and tell every
       stage (the tokenizers move whatever was left on those groups to the others);
    4. let the removed tokenizer and gateway replicas finish what they hold, tell every stage
       `after` (the links to the removed tokenizers close), and stop the rest of `removed` (in
       stop order).
    The stages' hosts are `new`'s in `during` and `after`: a stage placed on another host is
    linked there."""

    added: list[StageSpec]
    during: Topology
    draining: range
    after: Topology
    removed: list[StageSpec]


def diff(old: Topology, new: Topology) -> Transition:
    """The transition from `old` to `new`. tensor_parallel cannot change in a live run
    (ValueError): a group's workers share one model split."""
    if old.tensor_parallel != new.tensor_parallel:
        raise ValueError("tensor_parallel cannot change in a live run")
    old_names = {s.name for s in old.stages()}
    new_names = {s.name for s in new.stages()}
    added = [s for s in new.stages() if s.name not in old_names]
    removed = sorted(
        (s for s in old.stages() if s.name not in new_names), key=lambda s: STOP_ORDER.index(s.kind)
    )
    during = msgspec.structs.replace(
        new,
        num_groups=max(old.num_groups, new.num_groups),
        num_routed_groups=new.num_routed_groups,
    )
    return Transition(added, during, range(new.num_groups, old.num_groups), new, removed)
