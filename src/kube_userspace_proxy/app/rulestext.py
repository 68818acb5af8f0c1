"""The `rules` command's text: the rules `run` would install, each explained; what the proxy
decides itself (endpoints, affinity); every object that is not served, and why.

All of it is `#` comments beside the rules on stdout: it is the lesson the command is for,
comes in the order a reader wants it, and survives `rules > file` as valid iptables-save text.
"""

from __future__ import annotations

from collections.abc import Sequence

from kube_userspace_proxy.app.lifecycle import build, make_source
from kube_userspace_proxy.cluster.objects import NO_CLUSTER_IP
from kube_userspace_proxy.cluster.sources.manifests import ManifestSource
from kube_userspace_proxy.cluster.state import ClusterState
from kube_userspace_proxy.config.settings import ProxyConfig
from kube_userspace_proxy.model import (
    DEFAULT_BALANCING,
    MAX_EJECTION_SECONDS,
    Balancing,
    Endpoint,
    ProxiedPort,
    ServicePortInfo,
    Snapshot,
)
from kube_userspace_proxy.portals import explain
from kube_userspace_proxy.topology import topology_mode, unused_endpoints, usable_endpoints

SHOWN = 8
"""Endpoints named per list; the rest are counted."""

ADVICE = {
    NO_CLUSTER_IP: "add spec.clusterIP (an address in the cluster's Service CIDR, e.g. "
    "10.96.100.80): with --manifests no API server allocates one",
}
"""What to change, per reason an object is ignored for, where the reason alone does not say."""


async def rules_text(config: ProxyConfig) -> str:
    """The rules `run` would install for the current sources, each with its explanation, then
    what the proxy decides per service port and what it ignored.

    Proxy ports are picked when the proxy starts, so the ones shown are examples (numbered
    from the start of `--proxy-port-range`, or from 40000); /debug/state shows the live ones.
    """
    proxy = build(config.model_copy(update={"iptables_backend": "none", "workers": "1"}))
    source = make_source(config, proxy.state)
    await source.load_once()
    snapshot = proxy.configured(proxy.state.snapshot())
    ports = example_ports(snapshot, config)
    node_ips = snapshot.node_ips
    lines = [
        f"# {len(ports)} service port(s); this node: {snapshot.node_name or 'unknown'} "
        "(--hostname-override); node IPs: "
        + (", ".join(node_ips) or "none known (pass --node-ip)"),
        "# proxy ports are examples: each run picks free ones (see /debug/state for live ones)",
    ]
    left_out: list[tuple[str, str, str]] = []
    for rule, why in explain(
        ports,
        node_ips=node_ips,
        bind_address=proxy.listen_address,
        nodeport_addresses=config.nodeport_addresses,
        guard=config.guard_proxy_ports,
        node_families=proxy.node_families,
        left_out=left_out,
    ):
        lines.append(f"{rule}\n    # {why}")
    if left_out:
        lines += ["#", f"# {len(left_out)} ClusterIP(s) left out, with no rules:"]
        lines += [f"#   {name}: {ip}: {why}" for name, ip, why in left_out]
    unserved = {(name, ip) for name, ip, _ in left_out}
    lines += decided_by_the_proxy(ports, snapshot, proxy.state, config.balancing, unserved)
    others = source.other_kinds() if isinstance(source, ManifestSource) else []
    lines += not_served(proxy.state, [f"{kind} ({path})" for path, kind in others])
    return "\n".join(lines)


def example_ports(snapshot: Snapshot, config: ProxyConfig) -> list[ProxiedPort]:
    """Each service port with example proxy ports, numbered from the range's start."""
    port_range = config.port_range
    next_port = port_range[0] if port_range else 40000
    ports = []
    for info in sorted(snapshot.services.values(), key=lambda i: i.name):
        cluster = next_port
        external = next_port + 1 if info.paths_differ else cluster
        next_port = external + 1
        ports.append(ProxiedPort(info, cluster, external))
    return ports


def decided_by_the_proxy(
    ports: Sequence[ProxiedPort],
    snapshot: Snapshot,
    state: ClusterState,
    defaults: Balancing = DEFAULT_BALANCING,
    left_out: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset(),
) -> list[str]:
    """Per service port: how the proxy picks an endpoint, the ones it uses and the ones it
    does not, with the reason. No rule decides any of it: the rules only reach the proxy.
    `left_out`: (service port, ClusterIP) pairs that get no rules, marked as such."""
    if not ports:
        return []
    lines = [
        "#",
        "# Decided in the proxy, not by a rule: the rules above send each connection to a proxy",
        "# port; the proxy picks its endpoint (with the Service's scheduler, or the client's",
        "# endpoint under sessionAffinity ClientIP) among the endpoints readiness, traffic",
        "# policy and topology hints leave it, less those ejected after failed dials:",
    ]
    node, zone = snapshot.node_name, snapshot.node_zone
    for port in ports:
        info = port.info
        endpoints = snapshot.endpoints_of(info.name)
        name = str(info.name)
        served = [ip for ip in info.cluster_ips if (name, ip) not in left_out]
        ips = ", ".join(ip if ip in served else f"{ip} (left out)" for ip in info.cluster_ips)
        external = f" (external traffic: {port.external_port})" if info.paths_differ else ""
        if served or not info.cluster_ips:
            target = f"-> proxy port {port.cluster_port}{external}"
        else:
            target = "-> not served on this node (no rules: see above)"
        lines.append(f"# {info.name}: {info.protocol} {ips} port {info.port} {target}")
        lines += _balancing_lines(info, defaults)
        if info.client_ip_affinity:
            lines.append(
                f"#   sessionAffinity ClientIP: a client keeps its endpoint for "
                f"{info.affinity_timeout_seconds}s after its last connection (over the scheduler)"
            )
        paths = [("", info.internal_traffic_local)]
        if info.paths_differ:
            paths = [
                (" by cluster traffic", info.internal_traffic_local),
                (" by NodePort/external traffic", info.external_traffic_local),
            ]
        mode = topology_mode(endpoints, node, zone)
        for label, local in paths:
            policy = " (traffic policy Local)" if local else ""
            used = usable_endpoints(
                endpoints, local_only=local, node_name=node, topology=mode, zone=zone
            )
            lines.append(f"#   used{label}{policy}: {_listed(used) or 'none'}")
            unused = unused_endpoints(
                endpoints, local_only=local, node_name=node, topology=mode, zone=zone
            )
            for endpoint, why in unused[:SHOWN]:
                lines.append(f"#   not used{label}: {endpoint}: {why}")
            if len(unused) > SHOWN:
                lines.append(f"#   not used{label}: {len(unused) - SHOWN} more")
        for address, why in state.dropped_endpoints((info.name.namespace, info.name.name)):
            lines.append(f"#   not used: {address}: {why}")
        if not endpoints:
            lines.append(
                f"#   no EndpointSlice names Service {info.name.namespace}/{info.name.name}: "
                "in a cluster its controller writes them; with --manifests, write them yourself"
            )
    return lines


SCHEDULER_TEXT = {
    "rr": "round robin: each new connection (UDP: client) to the next endpoint",
    "lc": "least connections: each new connection to an endpoint with the fewest open on"
    " this node (all workers), ties round robin",
    "sh": "source hashing (Maglev): a client address to one endpoint, from every worker and"
    " across restarts; when an endpoint goes, its clients move and few others (~1 %)",
}


def _balancing_lines(info: ServicePortInfo, defaults: Balancing) -> list[str]:
    """The scheduler and outlier ejection of one service port, and where each comes from."""
    overrides = info.balancing
    balancing = overrides.over(defaults)
    where = "annotation" if overrides.scheduler is not None else "--ipvs-scheduler"
    lines = [
        f"#   scheduler {balancing.scheduler} ({where}): {SCHEDULER_TEXT[balancing.scheduler]}"
    ]
    if balancing.outlier_failures <= 0:
        lines.append("#   outlier ejection: off")
    else:
        lines.append(
            f"#   outlier ejection: after {balancing.outlier_failures} consecutive failed dials"
            f" an endpoint is out for {balancing.outlier_base_ejection:g}s x its ejections"
            f" (at most {MAX_EJECTION_SECONDS:g}s; max(1, 10%) of the endpoints at once)"
        )
    return lines


def not_served(state: ClusterState, other_kinds: Sequence[str]) -> list[str]:
    """Every Service and EndpointSlice not served, and every object of another kind, with
    the reason and, where one helps, what to change."""
    ignored = state.ignored()
    if not ignored and not other_kinds:
        return []
    lines = ["#", f"# {len(ignored) + len(other_kinds)} object(s) not served:"]
    for kind, (namespace, name), why in ignored:
        advice = ADVICE.get(why)
        lines.append(f"#   {kind} {namespace}/{name}: {why}" + (f"; {advice}" if advice else ""))
    for other in other_kinds:
        lines.append(
            f"#   {other}: the proxy reads Services and EndpointSlices only (a cluster's "
            "controllers turn pods into EndpointSlices)"
        )
    return lines


def _listed(endpoints: Sequence[Endpoint]) -> str:
    text = ", ".join(str(e) for e in endpoints[:SHOWN])
    more = len(endpoints) - SHOWN
    return text + (f" and {more} more" if more > 0 else "")
