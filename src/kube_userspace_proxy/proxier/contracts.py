"""What the proxier drives, declared as Protocols: listeners, the data plane, the rule sink.

A data plane is generic in its pools (`PoolT`): it makes them (`new_pool`), the proxier fills
them (`Pool`) and hands them back to it. The data plane in this process picks from
`balancer.EndpointPool`s (`LocalDataPlane`, a `DataPlane[EndpointPool]`); the worker pool's
are `workers.pool.EndpointSet`s, which only describe the endpoints to the workers: the control
process keeps no picking state (cursors, tallies, pins) the workers keep their own copies of.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Protocol, TypeVar

from kube_userspace_proxy.balancer import BalancerView
from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.model import (
    Address,
    Balancing,
    ClaimKey,
    Endpoint,
    ProxiedPort,
    ServicePortName,
    SourcePolicy,
)


class Pool(Protocol):
    """One traffic path's usable endpoints as the proxier fills and shows them."""

    source: SourcePolicy | None
    """Transparent dialing (--preserve-source-ip) and the node's local clients; None: off."""
    proxy_protocol: int
    """PROXY protocol version sent to the endpoints first (0: none)."""

    @property
    def name(self) -> ServicePortName: ...

    @property
    def addresses(self) -> tuple[Address, ...]:
        """The usable endpoint addresses, in round-robin order."""
        ...

    def __len__(self) -> int: ...

    def update(
        self,
        endpoints: Sequence[Endpoint],
        *,
        affinity_timeout: float | None,
        local: frozenset[Address] = ...,
    ) -> None:
        """Take a new endpoint list, the affinity timeout and which endpoints are on this node."""
        ...

    def source_choices(self) -> dict[Address, str]:
        """Per usable endpoint, the source its dials get under --preserve-source-ip ({}: off)."""
        ...

    def balance(self, balancing: Balancing) -> None:
        """Pick with `balancing.scheduler`; eject outliers as it says."""
        ...


PoolT_contra = TypeVar("PoolT_contra", contravariant=True)
"""The pools a listener serves from."""
PoolT = TypeVar("PoolT", bound=Pool)
"""The pools a data plane makes and takes back."""

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


class DataPlane(Protocol[PoolT]):
    """Where the listeners run: in this process (`LocalDataPlane`) or in worker processes."""

    shares_ports: bool
    """True when other processes join the proxy ports with SO_REUSEPORT (UDP binds with it)."""

    def new_pool(self, name: ServicePortName) -> PoolT:
        """An empty pool for one traffic path of `name`, of the kind this data plane serves."""
        ...

    def listener(
        self,
        sock: socket.socket,
        pool: PoolT,
        stats: ConnStats,
        name: str,
        *,
        adopt: bool = False,
    ) -> Listener[PoolT]:
        """A listener for the bound socket `sock` (the data plane owns it from now on);
        `adopt`: a socket handed over by an earlier process, used as it is."""
        ...

    async def publish(self) -> None:
        """Make every listener serve its pool's current endpoints (before rules point at it)."""
        ...

    def affinity_summary(self, pool: PoolT) -> tuple[int, Pins]:
        """How many ClientIP pins `pool` holds, and up to PINS_SHOWN live ones:
        (client, endpoint, seconds left)."""
        ...

    def balancer_view(self, pool: PoolT) -> BalancerView:
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
