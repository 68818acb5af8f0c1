"""The data plane's structural inputs (Picker) and its per-service-port counters (ConnStats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Picker(Protocol):
    """Chooses backends for one service port (the balancer's EndpointPool fits this shape)."""

    def pick(self, client_ip: str, *, retry: bool = False) -> tuple[str, int] | None:
        """An endpoint for `client_ip` (`retry` after a failed dial); None if none is usable."""
        ...

    def dial_failed(self, address: tuple[str, int]) -> None:
        """Report that dialing `address` failed (the picker may penalize it)."""
        ...

    def __bool__(self) -> bool:
        """True while the picker has usable endpoints."""
        ...

    proxy_protocol: int
    """PROXY protocol version sent to the endpoints before the first byte (1, 2; 0: none)."""

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        """The (ip, port) of every usable endpoint (read on endpoint updates, not per packet)."""
        ...


@dataclass(slots=True)
class ConnStats:
    """Counters of one service port, mutated on the hot path and read at scrape time.

    TCP: `accepted` counts connections the listener accepted; `completed` those that ended
    after reaching a backend; `failed` those for which every dial failed (or no endpoint was
    left); `refused_no_endpoints` connections (and UDP datagrams) turned away for lack of
    endpoints after reaching the proxy (while the port has no endpoints the kernel refuses
    TCP connections itself and they are not counted); `dial_failures` individual failed dials.
    Bytes: `bytes_in` client -> backend, `bytes_out` backend -> client (TCP and UDP payload).
    `spliced` counts connection directions that switched to the zero-copy path.
    """

    accepted: int = 0
    active: int = 0
    completed: int = 0
    refused_no_endpoints: int = 0
    dial_failures: int = 0
    failed: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    spliced: int = 0
    udp_sessions_active: int = 0
    udp_sessions_total: int = 0
    udp_datagrams_in: int = 0
    udp_datagrams_out: int = 0
    udp_dropped: int = 0
