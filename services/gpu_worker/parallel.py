"""Tensor parallelism: which slice of each weight a rank owns, and the few collectives the model
runs (all_reduce after row-parallel layers, all_gather of the vocab-sharded logits).

With one rank every collective is the identity and torch.distributed is never initialised.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ipc.ports import is_loopback, tcp_endpoint

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class Parallel:
    """This worker's place in its engine group: rank `rank` of `world_size` tensor-parallel ranks;
    with `expert_parallel`, a mixture of experts' experts are divided among them (Shard)."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and writes results; the other ranks only compute their shards."""
        return self.rank == 0

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of `size` rows; refuses an uneven split."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel ({self.world_size})")
        share = size // self.world_size
        return self.rank * share, share

    def split_uneven(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's share of `size` rows, the first `size % world_size`
        ranks taking one more."""
        base, extra = divmod(size, self.world_size)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial results, in place."""
        if self.is_parallel:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' [.., n] shards concatenated along the last dim, in rank order."""
        if not self.is_parallel:
            return x
        shards = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(shards, x.contiguous())
        return torch.cat(shards, dim=-1)

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (the other ranks pass a buffer of the same shape)."""
        if self.is_parallel:
            dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (the KV cache size every rank can hold)."""
        if not self.is_parallel:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def _collective_device() -> torch.device:
    is_nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if is_nccl else torch.device("cpu")


def init_parallel(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    device: torch.device,
    timeout_s: float,
    expert_parallel: bool = False,
) -> Parallel:
    """Join the group's process group (NCCL on CUDA, gloo on the CPU), meeting at rank 0's `host`
    (its node's address, `network.host`; 127.0.0.1 by default) and `port`.

    `timeout_s` bounds every collective: a rank whose peer died fails instead of waiting forever
    (gloo also fails at once when the peer's socket closes; the supervisor kills the group anyway).
    """
    if world_size == 1:
        return Parallel()
    interface = None if is_loopback(host) else interface_of(host)
    if interface is not None:
        # gloo's and NCCL's own connections between the ranks go over the interface the
        # hostname resolves to (often loopback) unless told: on the node's address, as the rendezvous.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=tcp_endpoint(host, port),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return Parallel(rank, world_size, expert_parallel)


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address` (None: none here, or IPv6)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None
