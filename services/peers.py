"""A stage's PUSH links to its peers, sized from the run's topology (ipc/topology.py).

The tokenizers, the detokenizers and the schedulers each push to some of: the tokenizers
(`tokenizer_in`), the engine groups' schedulers (`scheduler_in`) and the detokenizer shards
(`detokenizer_in`). `Peers.apply` is the one place a stage resizes those links when the
topology changes (`TopologyChanged`) and reconnects those whose server moved to another host.
What a stage does about the change beyond its links (a tokenizer moving requests off retired
groups, a scheduler moving requests to new shards) it does itself, from the old and new
topologies.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

import zmq

from ipc.codec import DETOKENIZER_INPUT, SCHEDULER_INPUT, TOKENIZER_INPUT, Codec
from ipc.endpoints import Endpoints, Link
from ipc.sockets import PushQueue
from ipc.topology import Topology
from services.stage import Stage, reconnect_moved


class Peers:
    """The queues to the peers of the kinds a stage names; the others stay empty lists."""

    def __init__(
        self,
        ctx: zmq.Context,
        stage: Stage,
        *,
        tokenizers: bool = False,
        schedulers: bool = False,
        detokenizers: bool = False,
    ) -> None:
        self.ctx = ctx
        self.stage = stage
        self.topology = stage.topology
        self.tokenizers: list[PushQueue] = []
        self.schedulers: list[PushQueue] = []
        self.detokenizers: list[PushQueue] = []
        # (queues, their links, codec, how many the topology has), for each kind asked for
        self._kinds = [
            kind[1:]
            for kind in (
                (
                    tokenizers,
                    self.tokenizers,
                    Endpoints.tokenizer_in,
                    TOKENIZER_INPUT,
                    attrgetter("num_tokenizers"),
                ),
                (
                    schedulers,
                    self.schedulers,
                    Endpoints.scheduler_in,
                    SCHEDULER_INPUT,
                    attrgetter("num_groups"),
                ),
                (
                    detokenizers,
                    self.detokenizers,
                    Endpoints.detokenizer_in,
                    DETOKENIZER_INPUT,
                    attrgetter("num_detokenizers"),
                ),
            )
            if kind[0]
        ]
        self._resize(self.topology)

    def apply(self, topology: Topology) -> Topology:
        """Take the run's new topology: reconnect the links whose server moved, open the links
        of added peers, close those of removed ones. Returns the topology it replaced."""
        old, self.topology = self.topology, topology
        if topology.hosts != old.hosts:
            before = self.stage.relink(topology.hosts)
            for queues, link, codec, _ in self._kinds:
                reconnect_moved(
                    self.ctx,
                    queues,
                    _bound(link, before),
                    _bound(link, self.stage.endpoints),
                    codec,
                    self.stage.log,
                )
        self._resize(topology)
        return old

    def _resize(self, topology: Topology) -> None:
        for queues, link, codec, count_of in self._kinds:
            count = count_of(topology)
            for queue in queues[count:]:
                queue.close()
            del queues[count:]
            queues += [self._open(link, i, codec) for i in range(len(queues), count)]

    def _open(self, link: Callable[[Endpoints, int], Link], index: int, codec: Codec[Any]) -> PushQueue:
        return PushQueue(self.ctx, link(self.stage.endpoints, index), codec)

    def close(self) -> None:
        for queues, *_ in self._kinds:
            for queue in queues:
                queue.close()


def _bound(link: Callable[[Endpoints, int], Link], endpoints: Endpoints) -> Callable[[int], Link]:
    return lambda index: link(endpoints, index)
