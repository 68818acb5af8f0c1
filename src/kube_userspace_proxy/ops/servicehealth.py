"""kube-proxy's per-Service health checks on `healthCheckNodePort` (pkg/proxy/healthcheck).

A LoadBalancer Service with `externalTrafficPolicy: Local` names a node port on which every
node proxy answers whether it has local endpoints: cloud load balancers send traffic only to
nodes that answer 200. Every path answers, with kube-proxy's JSON body:
`{"service": {"namespace", "name"}, "localEndpoints": N, "serviceProxyHealthy": bool}`;
200 while N > 0 and the proxy is healthy, else 503.

These servers listen on node addresses that load balancers reach from outside the cluster:
they get the ops sites' bounds (httpguard: header and idle timeouts, caps per client address
and per server), so idle connections can neither pile up nor crowd out a prober.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from aiohttp import web

from kube_userspace_proxy import logs
from kube_userspace_proxy.model import Change, ServicePortInfo, ServicePortName, Snapshot
from kube_userspace_proxy.ops.health import HTTP_OK, HTTP_UNAVAILABLE, ProxyHealth
from kube_userspace_proxy.ops.httpguard import GuardedSite
from kube_userspace_proxy.restart.sockets import HealthSocket, SocketDescription

log = logs.get(__name__)

ServiceName = tuple[str, str]  # (namespace, name)
SITE_KIND = "service-health"
"""These servers' name in the ops connection metrics (`site` label)."""


@dataclass
class _Instance:
    """One Service's health check: its port, its local endpoint count, its HTTP runners."""

    name: ServiceName
    port: int
    endpoints: int = 0
    runners: list[web.AppRunner] = field(default_factory=list)
    sockets: list[tuple[str, socket.socket]] = field(default_factory=list)


def wanted(snapshot: Snapshot | Change) -> dict[ServiceName, tuple[int, int]]:
    """(namespace, name) -> (healthCheckNodePort, ready endpoints on this node), per Service."""
    out: dict[ServiceName, tuple[int, int]] = {}
    local: dict[ServiceName, set[str]] = {}
    for port_name, info in snapshot.services.items():
        if not info.health_check_node_port:
            continue
        key = (port_name.namespace, port_name.name)
        ips = local.setdefault(key, set())
        for endpoint in snapshot.endpoints_of(port_name):
            if endpoint.ready and endpoint.node_name == snapshot.node_name:
                ips.add(endpoint.ip)
        out[key] = (info.health_check_node_port, 0)
    return {key: (port, len(local[key])) for key, (port, _) in out.items()}


def no_local_endpoints(snapshot: Snapshot) -> tuple[int, int]:
    """(internal, external): service ports whose Local traffic policy finds ready endpoints,
    but none on this node (kube-proxy's `..._no_local_endpoints_total` by traffic_policy)."""
    internal = external = 0
    for name, info in snapshot.services.items():
        pair = _no_local(snapshot, name, info)
        internal += pair[0]
        external += pair[1]
    return internal, external


def _no_local(
    snapshot: Snapshot | Change, name: ServicePortName, info: ServicePortInfo
) -> tuple[int, int]:
    if not (info.internal_traffic_local or info.external_traffic_local):
        return (0, 0)
    ready = [e for e in snapshot.endpoints_of(name) if e.ready]
    if not ready or any(e.node_name == snapshot.node_name for e in ready):
        return (0, 0)
    return (int(info.internal_traffic_local), int(info.external_traffic_local))


class NoLocalEndpoints:
    """`no_local_endpoints` kept up to date from snapshots and changes alike."""

    def __init__(self) -> None:
        self._counted: dict[ServicePortName, tuple[int, int]] = {}  # only non-zero ones

    def update(self, snapshot: Snapshot | Change) -> tuple[int, int]:
        """Take `snapshot` (a Change: only the service ports it names); the totals."""
        if isinstance(snapshot, Change):
            names: Iterable[ServicePortName] = snapshot.changed
        else:
            self._counted.clear()
            names = snapshot.services
        for name in names:
            info = snapshot.services.get(name)
            pair = _no_local(snapshot, name, info) if info is not None else (0, 0)
            if pair == (0, 0):
                self._counted.pop(name, None)
            else:
                self._counted[name] = pair
        return (
            sum(p[0] for p in self._counted.values()),
            sum(p[1] for p in self._counted.values()),
        )


class ServiceHealthServers:
    """Opens, updates and closes the health-check servers to match each sync's snapshot."""

    def __init__(self, health: ProxyHealth, addresses: Callable[[], Sequence[str]]) -> None:
        self._health = health
        self._addresses = addresses
        self._services: dict[ServiceName, _Instance] = {}
        self._adopted: dict[tuple[str, int], socket.socket] = {}

    def adopt(self, sockets: dict[tuple[str, int], socket.socket]) -> None:
        """Listening sockets (address, port) a process this one replaces handed over; served
        instead of binding anew when a Service asks for that port."""
        self._adopted.update(sockets)

    def handover_sockets(self) -> list[tuple[SocketDescription, int]]:
        """(description, descriptor) for every health-check socket served."""
        return [
            (HealthSocket(address, instance.port), sock.fileno())
            for instance in self._services.values()
            for address, sock in instance.sockets
            if sock.fileno() >= 0
        ]

    @property
    def ports(self) -> dict[str, int]:
        """`namespace/name` -> the health-check port being served."""
        return {f"{ns}/{name}": inst.port for (ns, name), inst in self._services.items()}

    async def sync(self, snapshot: Snapshot | Change) -> None:
        """Serve exactly the Services of `snapshot` that want a health check (a Change: look
        only at the Services it names)."""
        want = wanted(snapshot)
        if isinstance(snapshot, Change):
            keys = sorted({(n.namespace, n.name) for n in snapshot.changed})
        else:
            keys = list(self._services)
        for key in keys:
            old = self._services.get(key)
            if old is not None and want.get(key, (None,))[0] != old.port:
                log.info("closing health check of %s/%s on port %d", *key, old.port)
                del self._services[key]
                await _close(old)
        for key, (port, count) in want.items():
            instance = self._services.get(key)
            if instance is None:
                instance = _Instance(key, port)
                try:
                    await self._open(instance)
                except OSError as exc:
                    # As kube-proxy: log it and try again at the next sync.
                    log.error(
                        "cannot serve the health check of %s/%s on port %d: %s",
                        *key,
                        port,
                        exc.strerror or exc,
                    )
                    continue
                self._services[key] = instance
                log.info("serving the health check of %s/%s on port %d", *key, port)
            instance.endpoints = count

    async def close(self) -> None:
        """Close every health-check server (and handed-over sockets never served)."""
        services, self._services = self._services, {}
        for instance in services.values():
            await _close(instance)
        for sock in self._adopted.values():
            sock.close()
        self._adopted.clear()

    async def _open(self, instance: _Instance) -> None:
        try:
            for address in self._addresses():
                sock = self._adopted.pop((address, instance.port), None) or _listen(
                    address, instance.port
                )
                instance.sockets.append((address, sock))
                runner = web.AppRunner(self._app(instance), access_log=None, shutdown_timeout=0.5)
                await runner.setup()
                instance.runners.append(runner)
                await GuardedSite(runner, sock, kind=SITE_KIND).start()
        except BaseException:
            await _close(instance)
            raise

    def _app(self, instance: _Instance) -> web.Application:
        namespace, name = instance.name

        async def answer(_: web.Request) -> web.Response:
            healthy = self._health.is_healthy()
            count = instance.endpoints
            body = {
                "service": {"namespace": namespace, "name": name},
                "localEndpoints": count,
                "serviceProxyHealthy": healthy,
            }
            return web.Response(
                text=json.dumps(body),
                status=HTTP_OK if count and healthy else HTTP_UNAVAILABLE,
                content_type="application/json",
                headers={"X-Content-Type-Options": "nosniff"},
            )

        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", answer)
        return app


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(64)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def _close(instance: _Instance) -> None:
    runners, instance.runners = instance.runners, []
    for runner in runners:
        await runner.cleanup()
