"""/debug/ui in a real headless Chromium: the page of a proxy in a node namespace counts, live,
the connections each endpoint served and the packets its iptables rules caught, counts UDP
sessions at the proxy port, and fits a window 800 px wide."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.browser import Browser, chromium
from tests.integration.conftest import running_proxies, service
from tests.integration.netns import POD_PORT, PODS, Topology, wait_for

pytestmark = pytest.mark.integration

SERVICE = "default/web:p"
UDP_SERVICE = "default/dns:p"
METRICS = "127.0.0.1:10249"  # the node namespace is the test's own: a fixed port is free
# {endpoint: total connections} of one Service, as the page shows it.
TOTALS = (
    "JSON.stringify(Object.fromEntries([...document.querySelectorAll("
    "'[data-service=\"%s\"] [data-endpoint]')].map(row => [row.dataset.endpoint,"
    " Number(row.querySelector('.total').textContent)])))"
)
# Packets the Service's ClusterIP rule (pods' traffic: KUBE-PORTALS-CONTAINER) caught.
PACKETS = (
    '[...document.querySelectorAll(\'[data-service="%s"] tr[data-chain='
    '"KUBE-PORTALS-CONTAINER"] .packets\')].reduce((n, cell) => n + Number(cell.textContent), 0)'
)


@pytest.fixture
def browser_ok() -> None:
    if chromium() is None:
        pytest.skip("needs chromium (Debian's chromium; scripts/dev installs it as root)")


@pytest.fixture
def page(
    browser_ok: None, topology: Topology, tmp_path: Path
) -> Iterator[tuple[Topology, Browser]]:
    with running_proxies(topology, tmp_path, "restore") as make:
        proxy = make(
            [
                *service("web", "10.96.0.10", 80, node_port=30080),
                *service("dns", "10.96.0.53", 53, protocol="UDP"),
            ],
            "--metrics-bind-address",
            METRICS,
        )
        proxy.wait_rules(f'"{SERVICE}"', f'"{UDP_SERVICE}"')
        wait_for(lambda: topology.client.ask("tcp", "10.96.0.10", 80)[0] in PODS, "web answering")
        browser = Browser(
            f"http://{METRICS}/debug/ui",
            tmp_path / "profile",
            prefix=("ip", "netns", "exec", topology.node.name),
        )
        try:
            yield topology, browser
        finally:
            browser.close()


def totals(browser: Browser) -> dict[str, int]:
    counts: dict[str, int] = json.loads(browser.eval(TOTALS % SERVICE))
    return counts


def test_endpoint_counts_in_the_page_rise_by_the_connections_each_served(
    page: tuple[Topology, Browser], tmp_path: Path
) -> None:
    topo, browser = page
    endpoints = {f"{ip}:{POD_PORT}" for ip in PODS.values()}
    wait_for(lambda: set(totals(browser)) == endpoints, "the page showing the 3 endpoints", 60)
    wait_for(lambda: browser.eval(PACKETS % SERVICE) > 0, "the page showing rule counters", 30)
    before = totals(browser)
    packets_before = browser.eval(PACKETS % SERVICE)

    answers = topo.client.ask("tcp", "10.96.0.10", 80, 10)

    assert all(answer in PODS for answer in answers), answers
    served = Counter(f"{PODS[answer]}:{POD_PORT}" for answer in answers)
    rise: dict[str, int] = {}

    def risen() -> bool:
        now = totals(browser)
        rise.update({ep: now[ep] - before[ep] for ep in endpoints})
        return sum(rise.values()) >= 10

    wait_for(risen, "the page's counts to rise by 10", timeout=30)
    # Each endpoint rose by exactly the connections it served (the backends name themselves).
    assert rise == {ep: served.get(ep, 0) for ep in endpoints}
    # Each connection's first packet walked the ClusterIP rule.
    wait_for(
        lambda: browser.eval(PACKETS % SERVICE) - packets_before >= 10,
        "the rule's packet counter to rise by 10",
        timeout=30,
    )
    # Still live after its event stream ended and the browser reconnected (8 events a stream).
    wait_for(
        lambda: browser.eval("Number(document.body.dataset.updates)") > 10,
        "updates across a reconnect of the event stream",
        timeout=40,
    )
    assert browser.eval("document.getElementById('status').textContent") == "live"
    shot = os.environ.get("DEBUG_UI_SCREENSHOT") or str(tmp_path / "debug-ui.png")
    assert browser.ask(f"screenshot {shot}")["saved"] == shot
    assert Path(shot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Whether anything is wider than the window or cut off: the page, a Service, a panel.
OVERFLOW = (
    "JSON.stringify([document.documentElement, ...document.querySelectorAll('.svc, .panel')]"
    ".filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.className || e.tagName))"
)


def test_the_page_fits_a_window_800_px_wide(page: tuple[Topology, Browser]) -> None:
    _, browser = page
    assert browser.ask("viewport 800") == {"width": 800}
    endpoints = {f"{ip}:{POD_PORT}" for ip in PODS.values()}
    wait_for(lambda: set(totals(browser)) == endpoints, "the page showing the 3 endpoints", 60)
    assert browser.eval("window.innerWidth") == 800
    # Nothing to scroll sideways, nothing cut off inside a panel (the endpoint table first).
    assert json.loads(browser.eval(OVERFLOW)) == []
    assert browser.eval("document.documentElement.scrollWidth") <= 800
    table = f'[data-service="{SERVICE}"] [data-endpoint]'
    assert browser.eval(f"document.querySelector('{table}').getBoundingClientRect().right") <= 800


SESSIONS = (
    f"Number(document.querySelector('[data-service=\"{UDP_SERVICE}\"] .sessions')"
    "?.textContent ?? -1)"
)


def test_a_udp_datagram_moves_the_proxy_port_session_count(
    page: tuple[Topology, Browser],
) -> None:
    topo, browser = page
    wait_for(lambda: browser.eval(SESSIONS) >= 0, "the page showing the UDP Service", 60)
    before = browser.eval(SESSIONS)

    answers = topo.client.ask("udp", "10.96.0.53", 53)

    assert answers[0] in PODS, answers
    # One client socket, one datagram: one session, counted where the page shows the port.
    wait_for(lambda: browser.eval(SESSIONS) == before + 1, "the proxy port's sessions +1", 30)
