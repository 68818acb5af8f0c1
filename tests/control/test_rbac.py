"""The chart's RBAC, proven against the fake API server, which enforces the rendered
ClusterRole (tests/fakes/rbac.py) in every control-plane test.

Here a representative run of the whole proxy (Services, EndpointSlices and the Node listed and
watched, a change followed) must be denied nothing, and must use every (group, resource, verb)
the role grants: a verb the proxy needs and the chart lacks fails the first check, a rule the
proxy never uses the second. Taking one verb away from the role shows the first check can
fail, and what the proxy then says.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from kube_userspace_proxy.model import ServicePortName
from tests.control.conftest import NODE, endpoint_slice, eventually, node, service
from tests.control.test_kube_end_to_end import kube_config, programmed
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.rbac import Rbac, chart_rules
from tests.loopback.proxyrun import ask, running_proxy, start_named_backends

WEB = ServicePortName("default", "web", "http")


async def _representative_run(apiserver: FakeApiServer, kubeconfig: str) -> None:
    """The proxy follows the API server through creation and a change."""
    backends = await start_named_backends(["pod-a", "pod-b"])
    try:
        apiserver.create(node(NODE))
        apiserver.create(service("web"))
        apiserver.create(endpoint_slice("web-a", "web", ["127.0.0.1"], port=backends[0][1]))
        async with running_proxy(kube_config(kubeconfig)) as proxy:
            await eventually(lambda: programmed(proxy), what="web's endpoint programmed")
            port = proxy.proxier.port_of(WEB)
            assert await ask(port) == "pod-a"
            apiserver.update(endpoint_slice("web-a", "web", ["127.0.0.1"], port=backends[1][1]))
            for _ in range(600):  # the change followed: at most 30 s
                if await ask(port) == "pod-b":
                    break
                await asyncio.sleep(0.05)
            assert await ask(port) == "pod-b"
    finally:
        for _, _, server in backends:
            server.close()


async def test_the_proxy_is_denied_nothing_and_uses_every_rule_the_chart_grants(
    apiserver: FakeApiServer, kubeconfig: str
) -> None:
    rbac = apiserver.rbac
    assert rbac is not None and rbac.rules == chart_rules()
    await _representative_run(apiserver, kubeconfig)
    assert rbac.denied == set(), f"the proxy needs what the chart does not grant: {rbac.denied}"
    unused = rbac.granted() - rbac.used
    assert unused == set(), f"the chart grants what the proxy never uses: {sorted(unused)}"


@pytest.mark.parametrize(("resource", "verb"), [("nodes", "list"), ("endpointslices", "watch")])
async def test_a_role_without_a_verb_the_proxy_needs_is_a_403_it_names(
    apiserver: FakeApiServer,
    kubeconfig: str,
    caplog: pytest.LogCaptureFixture,
    resource: str,
    verb: str,
) -> None:
    apiserver.rbac = Rbac(chart_rules()).without(resource, verb)
    logger = logging.getLogger("kube_userspace_proxy")
    logger.addHandler(caplog.handler)
    try:
        apiserver.create(node(NODE))
        apiserver.create(service("web"))
        async with running_proxy(kube_config(kubeconfig), sync=60) as proxy:
            del proxy
            await eventually(
                lambda: any(t[1:] == (resource, verb) for t in apiserver.rbac.denied),  # type: ignore[union-attr]
                what=f"the fake to deny {verb} {resource}",
            )
            await eventually(
                lambda: "403" in caplog.text or "forbidden" in caplog.text.lower(),
                what="the proxy to say it was forbidden",
            )
    finally:
        logger.removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records if "forbidden" in r.getMessage().lower()]
    assert said and resource in said[0], said
