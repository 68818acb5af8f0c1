"""The ops HTTP server: kube-proxy's health site and metrics site, on aiohttp.

Health site (`--healthz-bind-address`, default 0.0.0.0:10256): `/healthz`, `/livez`.
Metrics site (`--metrics-bind-address`, default 127.0.0.1:10249): `/metrics`, `/proxyMode`,
`/healthz` (a plain "ok": the metrics server is up), `/configz`, `/debug/state`, `/debug/ui`.
It answers only requests whose `Host` is an IP literal, `localhost` or a name given with
`--metrics-allowed-hosts` (421 otherwise, as Prometheus's and Grafana's servers refuse
foreign names): a web page that rebinds its own name to 127.0.0.1 cannot read the state.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import json
import socket
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from aiohttp import web

from kube_userspace_proxy import collector, logs
from kube_userspace_proxy.errors import ConfigError, PortInUseError
from kube_userspace_proxy.ops.debugui import DebugUi, PlannedRules, RuleSource
from kube_userspace_proxy.ops.health import ProxyHealth
from kube_userspace_proxy.ops.httpguard import TALLIES, GuardedSite, SiteCollector, SiteTally
from kube_userspace_proxy.ops.metrics import CONTENT_TYPE, ProxyMetrics

log = logs.get(__name__)

PROXY_MODE = "userspace"
HTTP_MISDIRECTED = 421
HEALTHZ_FLAG = "--healthz-bind-address"
METRICS_FLAG = "--metrics-bind-address"
DEFAULT_HEALTHZ_PORT = 10256
DEFAULT_METRICS_PORT = 10249
HEALTHZ_SITE = "healthz"
METRICS_SITE = "metrics"
"""The sites' names in the ops connection metrics (`site` label)."""

_NOSNIFF = {"X-Content-Type-Options": "nosniff"}
_pretty = functools.partial(json.dumps, indent=2, sort_keys=True, default=str)

StateView = Mapping[str, Any] | Iterable[tuple[str, Any]] | AsyncIterable[tuple[str, Any]]
"""A mapping, or (key, value) pairs produced one at a time (an async iterable may yield to
the event loop between pairs, as `Proxier.debug_items` does while it sorts)."""
StateSource = Callable[[], StateView]
"""The view /debug/state streams (and /debug/ui shows)."""
STATE_CHUNK = 25
"""Service ports /debug/state encodes between two yields to the event loop (~1 ms of work)."""


class Collector(Protocol):
    """Brings counters up to date before a view is rendered (the workers' sums)."""

    def __call__(self, *, debug: bool = False) -> Awaitable[None]: ...


async def _nothing_to_collect(*, debug: bool = False) -> None:
    """Counters of the in-process data plane are always current."""


def parse_bind_address(text: str, *, default_port: int, flag: str) -> tuple[str, int] | None:
    """`host:port`, `[v6]:port`, `:port` or a bare IP (default port); None when disabled.

    An empty value or "0" disables the site, as in kube-proxy. Port 0 asks the kernel for one.
    """
    text = text.strip()
    if text in ("", "0"):
        return None
    host, port_text = text, ""
    if text.startswith("["):
        close = text.find("]")
        rest = text[close + 1 :]
        if close < 0 or (rest and not rest.startswith(":")):
            raise ConfigError(f"{flag}={text!r}: expected [IPv6]:port")
        host, port_text = text[1:close], rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    host = host or "0.0.0.0"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"{flag}={text!r}: {host!r} is not an IP address") from None
    if not port_text:
        return str(ip), default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{flag}={text!r}: port must be a number from 0 to 65535")
    return str(ip), int(port_text)


def _listen(address: tuple[str, int], *, flag: str, what: str) -> socket.socket:
    """A listening socket, or an operator-facing error naming the address and the flag."""
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Lets a restarted proxy bind while old connections sit in TIME_WAIT; a live listener
        # on the port still makes bind fail with EADDRINUSE.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        shown = _show(address)
        if err.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"cannot serve {what} on {shown} ({flag}): the address is already in use; "
                f"is another kube-proxy running on this node? Stop it or choose another {flag}"
            ) from err
        raise ConfigError(f"cannot serve {what} on {shown} ({flag}): {err.strerror}") from err
    return sock


class OpsServer:
    """The running health and metrics sites; `close()` stops both."""

    def __init__(self) -> None:
        self._runners: list[web.AppRunner] = []
        self.sites: list[GuardedSite] = []
        """Each site's connection counts (open, refused over the cap, closed for a late header)."""
        self.healthz_address: tuple[str, int] | None = None
        self.metrics_address: tuple[str, int] | None = None
        self.listening: list[tuple[tuple[str, int], socket.socket]] = []
        """(the configured address, its listening socket): what a handover passes on."""

    @property
    def healthz_port(self) -> int | None:
        """The bound health port (the real one when 0 was asked); None when disabled."""
        return self.healthz_address[1] if self.healthz_address else None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_address[1] if self.metrics_address else None

    async def serve(self, app: web.Application, sock: socket.socket, kind: str) -> tuple[str, int]:
        """Serve `app` on a listening socket (owned from now on) as the site `kind` (its name in
        the metrics); returns the bound address."""
        # Probes and scrapers keep connections alive: do not wait long for them on close.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        self._runners.append(runner)
        bound: tuple[str, int] = sock.getsockname()[:2]
        site = GuardedSite(runner, sock, kind=kind)
        await site.start()
        self.sites.append(site)
        return bound

    async def close(self) -> None:
        """Stop both sites; open keep-alive connections are closed."""
        runners, self._runners = self._runners, []
        for runner in reversed(runners):
            await runner.cleanup()


def _health_app(health: ProxyHealth, metrics: ProxyMetrics) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        code, body = health.healthz()
        metrics.healthz_served(code)
        return web.json_response(body, status=code, headers=_NOSNIFF)

    async def livez(_: web.Request) -> web.Response:
        code, body = health.livez()
        metrics.livez_served(code)
        return web.json_response(body, status=code, headers=_NOSNIFF)

    async def readyz(_: web.Request) -> web.Response:
        code, body = health.readyz()
        return web.json_response(body, status=code, headers=_NOSNIFF)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    return app


async def stream_state(request: web.Request, state: StateView) -> web.StreamResponse:
    """Write a JSON object a few entries at a time, yielding to the loop in between, so a
    large table (10,000 service ports) never holds the data plane up for long."""
    response = web.StreamResponse(
        headers={"Content-Type": "application/json; charset=utf-8", **_NOSNIFF}
    )
    await response.prepare(request)
    separator = "{\n"
    parts = []
    async for key, value in _pairs(state):
        parts.append(f"{separator}  {json.dumps(key)}: {_entry(value)}")
        separator = ",\n"
        if len(parts) == STATE_CHUNK:
            await response.write("".join(parts).encode())
            parts = []
            await asyncio.sleep(0)
    if parts:
        await response.write("".join(parts).encode())
    await response.write(b"{}\n" if separator == "{\n" else b"\n}\n")
    await response.write_eof()
    return response


async def _pairs(state: StateView) -> AsyncIterator[tuple[str, Any]]:
    """The (key, value) pairs of any form of view, one at a time."""
    if isinstance(state, AsyncIterable):
        async for pair in state:
            yield pair
    else:
        for pair in state.items() if isinstance(state, Mapping) else state:
            yield pair


async def _as_dict(state: StateView, limit: int | None = None) -> dict[str, Any]:
    """The first `limit` entries of `state` (all when None), in its order."""
    view: dict[str, Any] = {}
    async for key, value in _pairs(state):
        if limit is not None and len(view) >= limit:
            break
        view[key] = value
    return view


# One line per entry: json's C encoder (indent= would take the pure-Python one, ~10x slower).
_entry = functools.partial(json.dumps, sort_keys=True, default=str)


def host_allowed(host: str | None, names: frozenset[str]) -> bool:
    """Whether a `Host` header names this server: an IP literal, localhost or one of `names`
    (lower case, no trailing dot). No header at all (HTTP/1.0) is no browser's: allowed."""
    if host is None:
        return True
    name = host.strip()
    if name.startswith("["):  # [v6] or [v6]:port
        end = name.find("]")
        literal = name[1:end] if end > 0 else ""
        return _is_ip(literal) and (end + 1 == len(name) or name[end + 1] == ":")
    if name.count(":") == 1:
        name = name.split(":")[0]
    name = name.rstrip(".").lower()
    return name == "localhost" or name in names or _is_ip(name)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _host_check(names: Iterable[str], tally: SiteTally) -> Any:
    """Middleware: 421 for a request whose Host names some other server."""
    allowed = frozenset(n.rstrip(".").lower() for n in names)

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if not host_allowed(request.headers.get("Host"), allowed):
            tally.wrong_host += 1
            return web.Response(
                status=HTTP_MISDIRECTED,
                text="this server answers to IP addresses, localhost and "
                "--metrics-allowed-hosts only\n",
                headers=_NOSNIFF,
            )
        response: web.StreamResponse = await handler(request)
        return response

    return check


def _metrics_app(
    metrics: ProxyMetrics,
    debug_state: StateSource,
    configz: Callable[[], Mapping[str, Any]],
    collect: Collector,
    *,
    rules: RuleSource | None = None,
    planned: PlannedRules | None = None,
    allowed_hosts: Iterable[str] = (),
) -> web.Application:
    async def scrape(_: web.Request) -> web.Response:
        await collect()
        # Counters are copied on the loop in one go (no races with the proxier's tables); the
        # process metrics read /proc in a worker thread; the per-port text is formatted on the
        # loop a family at a time, yielding in between, so the data plane never waits long.
        # (Formatting in a thread was tried: GIL hand-offs stalled the loop more, not less.)
        captured = metrics.capture()
        chunks = [await asyncio.to_thread(metrics.render_base)]
        for chunk in metrics.render_ports(captured):
            chunks.append(chunk)
            await asyncio.sleep(0)
        body = b"".join(chunks)
        # At 10,000 service ports a scrape frees ~45 MiB of small objects (the workers'
        # counters, the rows, the chunks) that the allocator would otherwise keep.
        del chunks, captured
        collector.release_free_memory()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def proxy_mode(_: web.Request) -> web.Response:
        return web.Response(text=PROXY_MODE, headers=_NOSNIFF)

    async def ping(_: web.Request) -> web.Response:
        return web.Response(text="ok", headers=_NOSNIFF)

    async def config(_: web.Request) -> web.Response:
        return web.json_response(configz(), dumps=_pretty, headers=_NOSNIFF)

    async def state(request: web.Request) -> web.StreamResponse:
        await collect(debug=True)
        response = await stream_state(request, debug_state())
        collector.release_free_memory()  # as after a scrape: the whole view was built
        return response

    tally = TALLIES.setdefault(METRICS_SITE, SiteTally())
    app = web.Application(middlewares=[_host_check(allowed_hosts, tally)])
    app.router.add_get("/metrics", scrape)
    app.router.add_get("/proxyMode", proxy_mode)
    app.router.add_get("/healthz", ping)
    app.router.add_get("/configz", config)
    app.router.add_get("/debug/state", state)
    DebugUi(lambda limit: _as_dict(debug_state(), limit), collect, rules, planned).add_routes(app)
    return app


async def start_ops(
    *,
    healthz_bind: str,
    metrics_bind: str,
    health: ProxyHealth,
    metrics: ProxyMetrics,
    debug_state: StateSource,
    configz: Callable[[], Mapping[str, Any]],
    collect: Collector = _nothing_to_collect,
    rules: RuleSource | None = None,
    planned: PlannedRules | None = None,
    adopted: Mapping[tuple[str, int], socket.socket] | None = None,
    allowed_hosts: Iterable[str] = (),
) -> OpsServer:
    """Bind and start both sites; raises PortInUseError or ConfigError before serving anything.

    `adopted`: listening sockets a process this one replaces handed over, by the address it
    was configured with; a site whose address (with a fixed port) is among them serves it.
    `allowed_hosts`: names the metrics site answers to besides IP literals and localhost.
    """
    healthz_at = parse_bind_address(
        healthz_bind, default_port=DEFAULT_HEALTHZ_PORT, flag=HEALTHZ_FLAG
    )
    metrics_at = parse_bind_address(
        metrics_bind, default_port=DEFAULT_METRICS_PORT, flag=METRICS_FLAG
    )
    metrics.follow_sites(SiteCollector())
    # Bind both first, so a taken port fails the start before anything is served.
    sockets: list[socket.socket] = []
    server = OpsServer()
    inherited = dict(adopted or {})

    def bind(address: tuple[str, int], flag: str, what: str) -> socket.socket:
        sock = inherited.pop(address, None) if address[1] else None
        if sock is None:
            sock = _listen(address, flag=flag, what=what)
        server.listening.append((address, sock))
        return sock

    try:
        if healthz_at is not None:
            sockets.append(bind(healthz_at, HEALTHZ_FLAG, "health checks"))
        if metrics_at is not None:
            sockets.append(bind(metrics_at, METRICS_FLAG, "metrics"))
        pending = iter(sockets)
        if healthz_at is not None:
            app = _health_app(health, metrics)
            server.healthz_address = await server.serve(app, next(pending), HEALTHZ_SITE)
            log.info("Serving /healthz and /livez on %s", _show(server.healthz_address))
        if metrics_at is not None:
            app = _metrics_app(
                metrics,
                debug_state,
                configz,
                collect,
                rules=rules,
                planned=planned,
                allowed_hosts=allowed_hosts,
            )
            server.metrics_address = await server.serve(app, next(pending), METRICS_SITE)
            log.info("Serving /metrics and /proxyMode on %s", _show(server.metrics_address))
    except BaseException:
        await server.close()
        for sock in sockets:
            sock.close()  # a no-op for sockets the runners already closed
        raise
    return server


def _show(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
