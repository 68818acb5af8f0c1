"""The data plane's structural inputs (Picker), its per-service-port counters (ConnStats), and
the rate-limited notices about resources the whole process shares (descriptors)."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

from kube_userspace_proxy import logs
from kube_userspace_proxy.model import DialOutcome, SourcePolicy

log = logs.get(__name__)

NO_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""errno values meaning "this process (or the node) is out of descriptors or socket memory"."""


class Tally(Protocol):
    """One endpoint's counters (the balancer's EndpointTally): plain ints, bumped in place."""

    active: int
    total: int
    bytes_in: int
    bytes_out: int
    local: bool
    """The endpoint runs on this node: its replies come back through this node."""


class Picker(Protocol):
    """Chooses backends for one service port (the balancer's EndpointPool fits this shape)."""

    def pick(self, client_ip: str, *, retry: bool = False) -> tuple[str, int] | None:
        """An endpoint for `client_ip` (`retry` after a failed dial); None if none is usable."""
        ...

    def dial_failed(self, address: tuple[str, int], outcome: int = DialOutcome.REFUSED) -> None:
        """Report that dialing `address` failed, and how (a `DialOutcome`); the picker may
        penalize or eject it. Every failed dial of either data plane is reported."""
        ...

    def dial_succeeded(self, address: tuple[str, int]) -> None:
        """Report that dialing `address` connected (a run of failures ends here)."""
        ...

    def __bool__(self) -> bool:
        """True while the picker has usable endpoints."""
        ...

    @property
    def picked(self) -> Tally:
        """The counters of the endpoint the last `pick()` returned; read right after picking."""
        ...

    proxy_protocol: int
    """PROXY protocol version sent to the endpoints before the first byte (1, 2; 0: none)."""

    source: SourcePolicy | None
    """Transparent dialing (--preserve-source-ip) and the node's local clients; None: off."""

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
    `no_descriptors` counts accepts, dials and UDP session sockets that failed because the
    process ran out of descriptors (EMFILE, ENFILE) or socket memory; never a dial failure.
    UDP drops by reason: `udp_dropped_table_full` (no room for a new client's session),
    `udp_dropped_send_failed` (the backend socket refused the datagram),
    `udp_dropped_no_descriptors` (no socket could be opened for a new session).
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
    udp_dropped_table_full: int = 0
    udp_dropped_send_failed: int = 0
    udp_dropped_no_descriptors: int = 0
    no_descriptors: int = 0
    udp_sessions_evicted: int = 0
    """Idle UDP sessions ended early to make room for a new client (table full)."""
    source_node: int = 0
    """--preserve-source-ip: dials (TCP connections, UDP sessions) from the node's address
    (an external client and a remote endpoint, or a client on the node itself)."""
    source_client_pod: int = 0
    """--preserve-source-ip: dials from the client's address because it is a pod of this node."""
    source_local_endpoint: int = 0
    """--preserve-source-ip: dials from the client's address because the endpoint is local."""
    core_picks: int = 0
    """TCP connections the native core picked and dialed from the pool's round-robin table
    (no Python call before the dial); the others of `accepted` were picked in Python."""

    @property
    def udp_dropped(self) -> int:
        """UDP datagrams dropped by the proxy, every reason (no endpoints is counted apart)."""
        return (
            self.udp_dropped_table_full
            + self.udp_dropped_send_failed
            + self.udp_dropped_no_descriptors
        )


class Notices:
    """Warnings about exhausted process-wide resources: at most one line per `interval` s.

    The first event logs at once; events within the interval after it are summed into the
    next line, so a flood of EMFILE costs a counter bump each, not a log line each.
    """

    def __init__(self, interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._next = 0.0
        self._quiet = 0  # events not logged since the last line

    def no_descriptors(self, name: str, what: str, exc: OSError) -> None:
        """`what` ("accept", "dial", "UDP session") on `name` failed for want of descriptors."""
        now = self._clock()
        if now < self._next:
            self._quiet += 1
            return
        quiet, self._quiet = self._quiet, 0
        self._next = now + self._interval
        log.warning(
            "%s: %s failed: %s (out of file descriptors or socket memory; %d more such"
            " failures since the last line); raise the descriptor limit (ulimit -n)",
            name,
            what,
            exc.strerror or exc,
            quiet,
        )


notices = Notices()
"""The process's one rate limiter for descriptor-exhaustion warnings."""


COUNTERS = tuple(f.name for f in fields(ConnStats))
"""ConnStats' counter names, in the order workers send them to the control process."""
