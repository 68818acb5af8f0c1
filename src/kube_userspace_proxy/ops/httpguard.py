"""Bounds for the ops HTTP sites: connection caps, per client and per site, and a header timeout.

aiohttp's server waits forever for the first request on a new connection (its keep-alive
timer only starts after a response), so idle or slow-header clients could hold descriptors
for as long as they like. `GuardedSite` wraps each connection's aiohttp protocol:

- a connection that has not sent a complete request header within `header_timeout` seconds
  of connecting (or of its previous request's header: the idle bound) is closed;
- one client address holds at most `max_per_client` connections: past that, its new ones are
  closed at once, so one source (a pod, a scanner) can never take the whole site;
- the site holds at most `max_connections`: when full, a newcomer takes the oldest connection
  of the address holding the most, if that holds more than the newcomer's address would; so
  no set of neighbours starves another address's probes (max-min fairness, as HAProxy's stick
  tables or Envoy's overload manager bound a source rather than everyone).

Every bound and every refusal is a metric (`SiteCollector`), summed per kind of site.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kube_userspace_proxy import logs

log = logs.get(__name__)

HEADER_TIMEOUT = 10.0
"""Seconds a connection may take to send a complete request header (and idle between them)."""
MAX_CONNECTIONS = 64
"""Open connections per site; probes and one or two scrapers need a handful."""
MAX_CONNECTIONS_PER_CLIENT = 8
"""Open connections per client address and site: a kubelet's probes and a scraper need 1-3."""

_END = b"\r\n\r\n"
_PREFIX = "kube_userspace_proxy_ops_"


@dataclass(slots=True)
class SiteTally:
    """Counters of every site of one kind (healthz, metrics, service-health), read at scrape."""

    open: int = 0
    refused_site: int = 0
    refused_client: int = 0
    evicted: int = 0
    header_timeouts: int = 0
    wrong_host: int = 0
    """Requests refused for a Host header naming another server (the metrics site)."""
    max_connections: int = 0
    max_per_client: int = 0
    header_timeout: float = 0.0


TALLIES: dict[str, SiteTally] = {}
"""Kind of site -> its counters; one per process, like dataplane.stats.COUNTERS."""


class _Guard(asyncio.Protocol):
    """Delegates to aiohttp's protocol; closes the connection when its header is late."""

    def __init__(self, site: GuardedSite, inner: asyncio.Protocol) -> None:
        self._site = site
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._started = False
        self.client = ""
        self.counted = False  # holds a place in the site's counts

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.client = peer[0] if peer else ""
        if not self._site.admit(self):
            self._transport.abort()
            return
        self._arm()
        self._started = True
        self._inner.connection_made(transport)

    def evict(self) -> None:
        """Make room for another address's connection: close this one now."""
        if self._transport is not None:
            self._transport.abort()

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._site.header_timeout, self._late)

    def _late(self) -> None:
        self._site.timed_out += 1
        self._site.tally.header_timeouts += 1
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
        self._site.release(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._started:
            self._inner.connection_lost(exc)


class GuardedSite(web.SockSite):
    """A `SockSite` whose connections are capped (per client and in all) and must send
    headers in time; `kind` names the site in the metrics."""

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: Any,
        *,
        kind: str,
        header_timeout: float | None = None,
        max_connections: int | None = None,
        max_per_client: int | None = None,
    ) -> None:
        super().__init__(runner, sock)
        self.header_timeout = HEADER_TIMEOUT if header_timeout is None else header_timeout
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        self.max_per_client = (
            MAX_CONNECTIONS_PER_CLIENT if max_per_client is None else max_per_client
        )
        self.tally = TALLIES.setdefault(kind, SiteTally())
        self.tally.max_connections = self.max_connections
        self.tally.max_per_client = self.max_per_client
        self.tally.header_timeout = self.header_timeout
        self.open = 0
        self.refused = 0
        self.timed_out = 0
        self.evicted = 0
        self._clients: dict[str, list[_Guard]] = {}  # address -> its connections, oldest first

    def admit(self, guard: _Guard) -> bool:
        """Count `guard`'s connection in, making room from a heavier address if need be;
        False: refuse it (the caller closes it)."""
        held = self._clients.get(guard.client, [])
        if len(held) >= self.max_per_client:
            self.refused += 1
            self.tally.refused_client += 1
            return False
        if self.open >= self.max_connections:
            heaviest = max(self._clients.values(), key=len)
            if len(heaviest) <= len(held) + 1:  # every address holds its fair share
                self.refused += 1
                self.tally.refused_site += 1
                return False
            victim = heaviest[0]
            self.release(victim)
            self.evicted += 1
            self.tally.evicted += 1
            victim.evict()
        self._clients.setdefault(guard.client, []).append(guard)
        guard.counted = True
        self.open += 1
        self.tally.open += 1
        return True

    def release(self, guard: _Guard) -> None:
        """`guard`'s connection no longer counts (it closed, or was evicted)."""
        if not guard.counted:
            return
        guard.counted = False
        self.open -= 1
        self.tally.open -= 1
        held = self._clients[guard.client]
        held.remove(guard)
        if not held:
            del self._clients[guard.client]

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()

        def guarded() -> asyncio.Protocol:
            return _Guard(self, cast(asyncio.Protocol, server()))

        self._server = await loop.create_server(guarded, sock=self._sock)


class SiteCollector(Collector):
    """The sites' bounds and counters, per kind of site (read at scrape time)."""

    def collect(self) -> Iterable[Metric]:
        site = ["site"]
        families = (
            GaugeMetricFamily(_PREFIX + "connections", "Open ops connections.", labels=site),
            CounterMetricFamily(
                _PREFIX + "connections_refused",
                "Ops connections closed at once: over the per-client or the site's cap.",
                labels=["site", "reason"],
            ),
            CounterMetricFamily(
                _PREFIX + "connections_evicted",
                "Ops connections closed to make room for another client address's.",
                labels=site,
            ),
            CounterMetricFamily(
                _PREFIX + "header_timeouts",
                "Ops connections closed for sending no complete header in time.",
                labels=site,
            ),
            CounterMetricFamily(
                _PREFIX + "requests_refused",
                "Ops requests answered 421: their Host header named some other server.",
                labels=site,
            ),
            GaugeMetricFamily(
                _PREFIX + "connection_limit",
                "Open connections allowed per site (scope=site) and per client address.",
                labels=["site", "scope"],
            ),
            GaugeMetricFamily(
                _PREFIX + "header_timeout_seconds",
                "Seconds a connection may take to send a request header, or idle between them.",
                labels=site,
            ),
        )
        opened, refused, evicted, timeouts, wrong_host, limits, header = families
        for kind, tally in sorted(TALLIES.items()):
            opened.add_metric([kind], tally.open)
            refused.add_metric([kind, "site_limit"], tally.refused_site)
            refused.add_metric([kind, "client_limit"], tally.refused_client)
            evicted.add_metric([kind], tally.evicted)
            timeouts.add_metric([kind], tally.header_timeouts)
            wrong_host.add_metric([kind], tally.wrong_host)
            limits.add_metric([kind, "site"], tally.max_connections)
            limits.add_metric([kind, "client"], tally.max_per_client)
            header.add_metric([kind], tally.header_timeout)
        return families
