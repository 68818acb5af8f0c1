"""TCP listener: accept, dial with a timeout ladder, splice both ways (interface first)."""

from __future__ import annotations

import socket

from kube_userspace_proxy.dataplane.stats import ConnStats, Picker

DIAL_TIMEOUTS = (0.25, 0.5, 1.0, 2.0)


class TcpListener:
    """Serves one proxy port; refuses connections (RST) while the picker has no endpoints."""

    def __init__(
        self,
        sock: socket.socket,
        picker: Picker,
        stats: ConnStats,
        *,
        name: str = "",
        dial_timeouts: tuple[float, ...] = DIAL_TIMEOUTS,
        splice: bool = True,
        high_water: int = 256 * 1024,
        backlog: int = 4096,
    ) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        """Begin serving (listening only if the picker has endpoints)."""
        raise NotImplementedError

    def set_picker(self, picker: Picker) -> None:
        """Use another picker for new connections, then `refresh()`."""
        raise NotImplementedError

    def refresh(self) -> None:
        """Listen while the picker has endpoints; refuse (port kept) while it has none."""
        raise NotImplementedError

    async def close(self) -> None:
        """Stop accepting and release the port; connections in flight go on to finish."""
        raise NotImplementedError

    async def drain(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for connections in flight, then abort the rest."""
        raise NotImplementedError

    @property
    def port(self) -> int:
        raise NotImplementedError

    @property
    def active_connections(self) -> int:
        raise NotImplementedError

    @property
    def accepting(self) -> bool:
        raise NotImplementedError

    @property
    def buffered_bytes(self) -> int:
        raise NotImplementedError
