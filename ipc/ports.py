"""The tcp:// port layout of a run, and what counts as loopback.

A leaf module: the config validates port counts against this layout, and `ipc/endpoints.py`
builds the links from it, without either importing the other's module.
"""

from __future__ import annotations

import ipaddress

# tcp:// ports: each link kind owns a block of PORTS_PER_KIND ports from the run's port base,
# so that every process computes the same port for a link without asking anyone.
LINK_KINDS = (
    "supervisor",
    "tokenizer",
    "tokenizer_in",
    "scheduler_in",
    "scheduler_workers",
    "detokenizer_in",
    "encoder",
)
PORTS_PER_KIND = 64
PORT_SPAN = len(LINK_KINDS) * PORTS_PER_KIND


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def link_port(port_base: int, kind: str, index: int) -> int:
    """The tcp port of link `kind` number `index` (ValueError past its block)."""
    if not 0 <= index < PORTS_PER_KIND:
        raise ValueError(f"{kind} {index}: at most {PORTS_PER_KIND} links of a kind over tcp://")
    return port_base + LINK_KINDS.index(kind) * PORTS_PER_KIND + index


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address or "localhost") reaches only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
