"""Bounds for the ops HTTP sites: a connection cap and a request-header timeout.

aiohttp's server waits forever for the first request on a new connection (its keep-alive
timer only starts after a response), so idle or slow-header clients could hold descriptors
for as long as they like. `GuardedSite` wraps each connection's aiohttp protocol: past
`max_connections` a new connection is closed at once, and a connection that has not sent a
complete request header within `header_timeout` seconds of connecting (or of its previous
request's header) is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiohttp import web

from kube_userspace_proxy import logs

log = logs.get(__name__)

HEADER_TIMEOUT = 10.0
"""Seconds a connection may take to send a complete request header (and idle between them)."""
MAX_CONNECTIONS = 64
"""Open connections per site; probes and one or two scrapers need a handful."""

_END = b"\r\n\r\n"


class _Guard(asyncio.Protocol):
    """Delegates to aiohttp's protocol; closes the connection when its header is late."""

    def __init__(self, site: GuardedSite, inner: asyncio.Protocol) -> None:
        self._site = site
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._started = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._site.open += 1
        if self._site.open > self._site.max_connections:
            self._site.refused += 1
            self._transport.abort()
            return
        self._arm()
        self._started = True
        self._inner.connection_made(transport)

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._site.header_timeout, self._late)

    def _late(self) -> None:
        self._site.timed_out += 1
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        seen = self._tail + data
        if _END in seen:  # a complete header: the next one gets a fresh window
            if self._timer is not None:
                self._timer.cancel()
            self._arm()
            seen = seen[seen.rindex(_END) + len(_END) :]
        self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._site.open -= 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._started:
            self._inner.connection_lost(exc)


class GuardedSite(web.SockSite):
    """A `SockSite` whose connections are capped and must send headers in time."""

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: Any,
        *,
        header_timeout: float | None = None,
        max_connections: int | None = None,
    ) -> None:
        super().__init__(runner, sock)
        self.header_timeout = HEADER_TIMEOUT if header_timeout is None else header_timeout
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        self.open = 0
        self.refused = 0
        self.timed_out = 0

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()

        def guarded() -> asyncio.Protocol:
            return _Guard(self, cast(asyncio.Protocol, server()))

        self._server = await loop.create_server(guarded, sock=self._sock)
