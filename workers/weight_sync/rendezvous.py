"""Rendezvous stores on a port the OS picked, held open from the bind to the last join.

A torch.distributed group (the trainer's data-parallel group, a weight-sync group) meets at a
TCPStore. Picking a "free" port by binding a socket, closing it and handing the number on leaves a
window in which another process can take the port (the bind-close-reuse race). Here the process
that picks the port is the one that serves it: `host_store(host)` starts the TCPStore server on
port 0 (the OS binds a free port; the store reports it) and keeps it in this process until
`release_store`; every rank, the hosting process included, then joins with `join_store(address)`.

Invariants: a port is never handed on unbound; every `join_store` is a client connection of its
own, also in the hosting process (ranks that share a process, e.g. a trainer and an in-process
vLLM engine, must not share one store object: its blocking waits hold a per-object lock); a
process forked after `host_store` never touches its parent's server (it only joins).

Callers: workers/trainer/shell.py (process group of the trainer ranks), workers/trainer/group.py
(the driver hosts the ranks' rendezvous), workers/weight_sync/setup.py and broadcast.py (the sender
hosts the weight-sync group's store), workers/weight_sync/transport.py (every rank joins).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

HOST_TIMEOUT_S = 300.0  # the server's default wait bound (s); `join_store` sets the caller's own

_HOSTED: dict[tuple[str, int], tuple[int, Any]] = {}  # (host, port) -> (pid of the host, TCPStore server)


@dataclass(frozen=True)
class StoreAddress:
    """Where a hosted rendezvous store listens. `url` is the `tcp://HOST:PORT` spelling."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @classmethod
    def parse(cls, url: str) -> "StoreAddress":
        """`tcp://HOST:PORT` -> StoreAddress; raises ValueError for anything else."""
        rest = url.removeprefix("tcp://")
        host, sep, port = rest.rpartition(":")
        if not url.startswith("tcp://") or not sep or not host or not port.isdigit():
            raise ValueError(f"rendezvous address must be tcp://HOST:PORT, got {url!r}")
        return cls(host, int(port))


def node_ip() -> str:
    """This node's IP as Ray sees it (inside a Ray driver or worker), else 127.0.0.1."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def host_store(host: str | None = None) -> StoreAddress:
    """Start a TCPStore server on `host` (default `node_ip()`), port chosen by the OS, and keep it
    in this process until `release_store`. Returns its address."""
    from torch.distributed import TCPStore

    host = host or node_ip()
    store = TCPStore(host, 0, None, True, timeout=timedelta(seconds=HOST_TIMEOUT_S), wait_for_workers=False)
    address = StoreAddress(host, int(store.port))
    _HOSTED[(address.host, address.port)] = (os.getpid(), store)
    return address


def host_store_in(_actor: Any = None, host: str | None = None) -> StoreAddress:
    """`host_store` shaped for Ray's `__ray_call__` (first argument: the actor instance), so that
    the store is served by the process of the actor that will use it."""
    return host_store(host)


def join_store(address: StoreAddress, *, timeout_s: float) -> Any:
    """A new client of the store at `address` (connects at once: the server is up). Every wait on
    it is bounded by `timeout_s`. Raises torch's DistNetworkError when nothing listens there."""
    from torch.distributed import TCPStore

    return TCPStore(address.host, address.port, None, False, timeout=timedelta(seconds=timeout_s))


def release_store(address: StoreAddress) -> None:
    """Stop serving `address` if this process hosts it; else no-op. Call once no rank needs the
    store any more (after the group's last collective: NCCL creates communicators lazily)."""
    hosted = _HOSTED.get((address.host, address.port))
    if hosted is not None and hosted[0] == os.getpid():
        del _HOSTED[(address.host, address.port)]
