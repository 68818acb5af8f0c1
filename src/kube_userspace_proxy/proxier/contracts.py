"""What the proxier drives, declared as Protocols: listeners, the data plane, the rule sink.

A data plane is generic in the pools it takes (`PoolT_contra`): the proxier hands every data plane
the `EndpointPool`s it fills. The data plane in this process picks from them
(`LocalDataPlane`, a `DataPlane[EndpointPool]`); the worker pool only describes them to its
workers (a `DataPlane[PoolView]`, which is a `DataPlane[EndpointPool]` too).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Protocol, TypeVar

from kube_userspace_proxy.balancer import BalancerView
from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.model import ClaimKey, ProxiedPort

PoolT_contra = TypeVar("PoolT_contra", contravariant=True)
"""The pools a data plane takes (and its listeners serve from)."""

Pins = list[tuple[str, tuple[str, int], float]]
"""ClientIP pins shown: (client, endpoint, seconds left)."""


class Listener(Protocol[PoolT_contra]):
    """One served socket of a service port (TCP or UDP; in this process or in the workers)."""

    @property
    def picker(self) -> object:
        """The pool it serves from now (the proxier only compares it with its own)."""
        ...

    async def start(self) -> None:
        """Begin serving (TCP: listen while the picker has endpoints)."""
        ...

    def refresh(self) -> None:
        """The picker's endpoints changed: listen or refuse, end sessions to removed ones."""
        ...

    def set_picker(self, picker: PoolT_contra) -> None:
        """Serve new connections from `picker`, then `refresh()`."""
        ...

    async def close(self) -> None:
        """Stop accepting and release the port; open connections go on."""
        ...

    async def release(self) -> None:
        """Stop serving and close this process's descriptor only, leaving the socket as it
        is to the process it was handed over to; open connections go on."""
        ...

    def fileno(self) -> int:
        """The descriptor of the served socket, to hand it over; -1 once closed."""
        ...

    async def drain(self, timeout: float) -> None:  # noqa: ASYNC109 - the contract's shape
        """Give open connections `timeout` seconds, then close them."""
        ...

    @property
    def port(self) -> int: ...

    @property
    def active_connections(self) -> int: ...


class DataPlane(Protocol[PoolT_contra]):
    """Where the listeners run: in this process (`LocalDataPlane`) or in worker processes."""

    shares_ports: bool
    """True when other processes join the proxy ports with SO_REUSEPORT (UDP binds with it)."""

    def listener(
        self,
        sock: socket.socket,
        pool: PoolT_contra,
        stats: ConnStats,
        name: str,
        *,
        adopt: bool = False,
    ) -> Listener[PoolT_contra]:
        """A listener for the bound socket `sock` (the data plane owns it from now on);
        `adopt`: a socket handed over by an earlier process, used as it is."""
        ...

    async def publish(self) -> None:
        """Make every listener serve its pool's current endpoints (before rules point at it)."""
        ...

    def affinity_summary(self, pool: PoolT_contra) -> tuple[int, Pins]:
        """How many ClientIP pins `pool` holds, and up to PINS_SHOWN live ones:
        (client, endpoint, seconds left)."""
        ...

    def balancer_view(self, pool: PoolT_contra) -> BalancerView:
        """`pool`'s per-endpoint counters, recent picks (per process) and penalized endpoints."""
        ...


class RuleSink(Protocol):
    """What the proxier needs of the portals: take the full desired set, apply the difference."""

    def apply(self, ports: Sequence[ProxiedPort], node_ips: Sequence[str]) -> None:
        """Install the rules for `ports`; the node's own traffic is DNATed to `node_ips`.

        Once it returns the rules are live; rules that no longer take packets may remain
        until `commit_deferred`."""
        ...

    def commit_deferred(self) -> None:
        """Delete what the last `apply` left behind (off the latency path); a no-op if none."""
        ...

    def claimed_ports(self) -> dict[ClaimKey, int]:
        """The proxy ports the rules installed now (perhaps by an earlier run) point at."""
        ...
