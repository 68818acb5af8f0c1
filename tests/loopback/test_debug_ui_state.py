"""/debug/ui on the whole proxy (loopback): a self-contained page, a live event stream, and
per-endpoint counts that rise by the connections each endpoint served (in-process data plane
and worker processes)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.loopback.proxyrun import (
    ask,
    endpoint_slice,
    loopback_config,
    running_proxy,
    service,
    start_named_backends,
    write_manifests,
)

WEB = "default/web:http"
Backends = list[tuple[str, int, asyncio.Server]]


@pytest.fixture
async def backends() -> AsyncIterator[Callable[..., Awaitable[Backends]]]:
    made: list[asyncio.Server] = []

    async def start(*names: str) -> Backends:
        started = await start_named_backends(names)
        made.extend(server for _, _, server in started)
        return started

    yield start
    for server in made:
        server.close()
        await server.wait_closed()


async def get(url: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return response.status, response.headers["Content-Type"], await response.text()


def totals(view: dict[str, Any]) -> dict[str, int]:
    entry = view["services"][WEB]["balancer"]["cluster"]
    return {e["endpoint"]: e["total"] for e in entry["endpoints"]}


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_endpoint_totals_rise_by_the_connections_each_endpoint_served(
    tmp_path: Path, backends: Callable[..., Awaitable[Backends]], workers: str
) -> None:
    started = await backends("pod-a", "pod-b", "pod-c")
    by_name = {name: f"127.0.0.1:{port}" for name, port, _ in started}
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest,
        [
            service("web", [{"name": "http", "port": 80, "protocol": "TCP"}]),
            *endpoint_slice("web", "http", [("127.0.0.1", port) for _, port, _ in started]),
        ],
    )
    async with running_proxy(loopback_config(manifest, workers=workers)) as proxy:
        assert proxy.ops is not None
        state_url = f"http://127.0.0.1:{proxy.ops.metrics_port}/debug/ui/state"
        port = proxy.proxier.port_of(proxy.proxier.proxied_ports()[0].info.name)
        before = totals(json.loads((await get(state_url))[2]))
        answers = [await ask(port) for _ in range(10)]
        served = Counter(by_name[a] for a in answers)
        view: dict[str, Any] = {}

        async def counted() -> bool:
            view.update(json.loads((await get(state_url))[2]))
            return sum(totals(view).values()) - sum(before.values()) >= 10

        for _ in range(250):  # the workers' counters arrive with the next collect
            if await counted():
                break
            await asyncio.sleep(0.02)
        rise = {ep: total - before[ep] for ep, total in totals(view).items()}
        assert rise == {ep: served.get(ep, 0) for ep in by_name.values()}
        picks = view["services"][WEB]["balancer"]["cluster"]["recentPicks"]
        assert sum(len(w["picks"]) for w in picks) >= 10
        assert view["rules"] is None  # --iptables-backend none: the page says so
        # ... and shows the rules that would capture the Service, not installed.
        planned = view["planned"]
        redirect = [r for r in planned if r["chain"].startswith("KUBE-PORTALS-CONTAINER")]
        assert redirect, planned
        assert all(f'"{WEB}"' in r["rule"] for r in redirect)
        # To the proxy port (DNAT to 127.0.0.1:port here: the proxy listens on loopback only).
        assert all(re.search(rf"\b{port}$", r["rule"]) for r in redirect), redirect
        assert "10.96.0.10" in redirect[0]["why"]


async def test_page_is_self_contained_and_streams_events(
    tmp_path: Path, backends: Callable[..., Awaitable[Backends]]
) -> None:
    started = await backends("pod-a")
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest,
        [
            service("web", [{"name": "http", "port": 80, "protocol": "TCP"}]),
            *endpoint_slice("web", "http", [("127.0.0.1", started[0][1])]),
        ],
    )
    async with running_proxy(loopback_config(manifest)) as proxy:
        assert proxy.ops is not None
        base = f"http://127.0.0.1:{proxy.ops.metrics_port}"
        status, kind, html = await get(f"{base}/debug/ui")
        assert status == 200 and kind.startswith("text/html")
        # Nothing is fetched from elsewhere: no URL with a host, no fonts, no imports.
        assert "http:" not in html and "https:" not in html
        assert not re.search(r"<(link|script)[^>]+(src|href)=", html)
        assert "@import" not in html and "@font-face" not in html and "url(" not in html
        assert "/debug/ui/events" in html
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{base}/debug/ui/events") as response,
        ):
            assert response.headers["Content-Type"] == "text/event-stream"
            # A stream is a few events, then it ends (before the ops site's 10 s header
            # timeout would cut it); the browser reconnects after the `retry:` it was given.
            body = await asyncio.wait_for(response.content.read(), 20)
        events = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert len(events) == 8
        assert body.startswith(b"retry: ")
        assert all(WEB in event["services"] for event in events)


async def test_the_page_shows_the_first_service_ports_and_only_their_rules(
    tmp_path: Path, backends: Callable[..., Awaitable[Backends]]
) -> None:
    from kube_userspace_proxy.ops import debugui

    [(_, port, _)] = await backends("pod-a")
    count = debugui.SHOWN + 20
    objects: list[Any] = []
    for i in range(count):
        objects.append(service(f"s{i:03d}", [{"name": "http", "port": 80, "protocol": "TCP"}]))
        objects.extend(endpoint_slice(f"s{i:03d}", "http", [("127.0.0.1", port)]))
    manifest = tmp_path / "svc.yaml"
    write_manifests(manifest, objects)
    async with running_proxy(loopback_config(manifest)) as proxy:
        assert proxy.ops is not None and proxy.ops.metrics_port is not None
        base = f"http://127.0.0.1:{proxy.ops.metrics_port}"
        view = json.loads((await get(f"{base}/debug/ui/state"))[2])
        names = [f"default/s{i:03d}:http" for i in range(count)]
        assert list(view["services"]) == names[: debugui.SHOWN]
        assert view["truncated"] is True
        full = json.loads((await get(f"{base}/debug/state"))[2])
        assert sorted(full) == names  # /debug/state has them all


def test_only_rules_naming_a_shown_service_port_reach_the_page() -> None:
    from kube_userspace_proxy.ops.debugui import _naming

    counted = [
        (
            4,
            "KUBE-PORTALS-CONTAINER-3F",
            '-d 10.96.0.1/32 -p tcp -m comment --comment "a/b:http"'
            " -m tcp --dport 80 -j REDIRECT --to-ports 30001",
            5,
            300,
        ),
        (
            4,
            "KUBE-PORTALS-CONTAINER-40",
            "-d 10.96.0.2/32 -p tcp -m comment --comment a/c:http"
            " -m tcp --dport 80 -j REDIRECT --to-ports 30002",
            1,
            60,
        ),
        (4, "KUBE-PORTALS-CONTAINER", "-j KUBE-PORTALS-CONTAINER-3F", 9, 900),
        (4, "KUBE-PORTALS-CONTAINER-41", '-m comment --comment "a/b:http2" -j ACCEPT', 0, 0),
    ]
    shown = _naming(counted, frozenset({"a/b:http", "a/c:http"}))
    assert [(r["chain"], r["packets"]) for r in shown] == [
        ("KUBE-PORTALS-CONTAINER-3F", 5),
        ("KUBE-PORTALS-CONTAINER-40", 1),
    ]


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_udp_sessions_count_at_the_proxy_port_as_at_the_endpoints(
    tmp_path: Path, udp_backends: Callable[[str], Awaitable[Any]], workers: str
) -> None:
    backend = await udp_backends("a")
    manifest = tmp_path / "svc.yaml"
    write_manifests(
        manifest,
        [
            service("dns", [{"name": "dns", "port": 53, "protocol": "UDP"}]),
            *endpoint_slice("dns", "dns", [("127.0.0.1", backend.address[1])], protocol="UDP"),
        ],
    )
    name = "default/dns:dns"
    async with running_proxy(loopback_config(manifest, workers=workers)) as proxy:
        assert proxy.ops is not None
        state_url = f"http://127.0.0.1:{proxy.ops.metrics_port}/debug/ui/state"
        port = proxy.proxier.port_of(proxy.proxier.proxied_ports()[0].info.name)
        view: dict[str, Any] = {}

        async def sessions() -> tuple[int, int]:
            view.update(json.loads((await get(state_url))[2]))
            entry = view["services"][name]
            (endpoint,) = entry["balancer"]["cluster"]["endpoints"]
            return entry["udp"]["sessionsTotal"], endpoint["total"]

        assert await sessions() == (0, 0)
        loop = asyncio.get_running_loop()
        for client in range(3):  # each client socket is a session of its own
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, ("127.0.0.1", port))
                await loop.sock_sendall(sock, b"ping %d" % client)
                answer = await asyncio.wait_for(loop.sock_recv(sock, 100), 10)
                assert answer == b"a|ping %d" % client
            finally:
                sock.close()
        for _ in range(250):  # the workers' counters arrive with the next collect
            if await sessions() == (3, 3):
                break
            await asyncio.sleep(0.02)
        # The proxy port counts the sessions its endpoints count (not 0 "accepted").
        assert await sessions() == (3, 3)
        assert view["services"][name]["connections"]["accepted"] == 0
