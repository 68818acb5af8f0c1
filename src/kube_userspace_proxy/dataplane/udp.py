"""UDP listener: one connected backend socket per client address, idle expiry (interface first)."""

from __future__ import annotations

import socket

from kube_userspace_proxy.dataplane.stats import ConnStats, Picker


class UdpListener:
    """Serves one UDP proxy port; replies leave from the service port."""

    def __init__(
        self,
        sock: socket.socket,
        picker: Picker,
        stats: ConnStats,
        *,
        name: str = "",
        idle_timeout: float = 0.25,
        max_sessions: int = 4096,
    ) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    def set_picker(self, picker: Picker) -> None:
        raise NotImplementedError

    def refresh(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def drain(self, timeout: float) -> None:
        raise NotImplementedError

    @property
    def port(self) -> int:
        raise NotImplementedError

    @property
    def active_connections(self) -> int:
        raise NotImplementedError
