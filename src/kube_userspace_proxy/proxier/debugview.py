"""The proxier's debug view (/debug/state): service port -> proxy ports -> endpoints,
balancer counters, affinity pins and connection counters, in name order."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kube_userspace_proxy.balancer import BalancerView
from kube_userspace_proxy.model import Address, Path, ServicePortName
from kube_userspace_proxy.proxier.contracts import DataPlane, PoolT
from kube_userspace_proxy.proxier.served import Served


def names_shown(
    served_ports: Mapping[ServicePortName, Served[Any]], errors: Mapping[ServicePortName, str]
) -> list[ServicePortName]:
    """The service ports the view shows, unsorted: those served and those that failed."""
    shown = list(served_ports)
    shown += [name for name in errors if name not in served_ports]
    return shown


def entries(
    served_ports: Mapping[ServicePortName, Served[PoolT]],
    errors: Mapping[ServicePortName, str],
    dataplane: DataPlane[PoolT],
    names: Iterable[ServicePortName],
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The view of each of `names` in turn, as it is when reached (gone ones are skipped)."""
    for name in names:
        served = served_ports.get(name)
        error = errors.get(name)
        if served is None:
            if error is not None:
                yield str(name), {"error": error}
            continue
        info = served.info
        stats = served.stats
        pins, shown = dataplane.affinity_summary(served.pools[Path.CLUSTER])
        entry: dict[str, Any] = {
            "protocol": str(info.protocol),
            "clusterIPs": list(info.cluster_ips),
            "port": info.port,
            "nodePort": info.node_port or None,
            "externalIPs": list(info.external_ips),
            "loadBalancerIPs": list(info.load_balancer_ips),
            "sessionAffinity": "ClientIP" if info.client_ip_affinity else "None",
            "proxyPorts": {str(path): listener.port for path, listener in served.listeners.items()},
            "nodePortListeners": [
                f"{address}:{listener.port}" for address, listener in served.node_port_listeners
            ],
            "endpoints": {
                str(path): [f"{ip}:{port}" for ip, port in pool.addresses]
                for path, pool in served.pools.items()
            },
            "knownEndpoints": served.all_endpoints,
            "topology": served.topology or "none",
            "sourceAddress": {  # --preserve-source-ip: the dial's source, per endpoint
                str(path): {_show(a): why for a, why in pool.source_choices().items()}
                for path, pool in served.pools.items()
                if pool.source is not None
            },
            "balancer": {
                str(path): _balancer_json(dataplane.balancer_view(pool))
                for path, pool in served.pools.items()
            },
            "affinity": {
                "pins": pins,
                "shown": [
                    {
                        "clientIP": client,
                        "endpoint": f"{ep[0]}:{ep[1]}",
                        "expiresIn": round(left, 1),
                    }
                    for client, ep, left in shown
                ],
            },
            "connections": {
                "active": stats.active,
                "accepted": stats.accepted,
                "completed": stats.completed,
                "refusedNoEndpoints": stats.refused_no_endpoints,
                "dialFailures": stats.dial_failures,
                "failed": stats.failed,
            },
            "bytes": {"in": stats.bytes_in, "out": stats.bytes_out},
            "udp": {
                "sessionsActive": stats.udp_sessions_active,
                "sessionsTotal": stats.udp_sessions_total,
                "datagramsIn": stats.udp_datagrams_in,
                "datagramsOut": stats.udp_datagrams_out,
                "dropped": stats.udp_dropped,
            },
        }
        if error is not None:
            entry["error"] = error
        yield str(name), entry


SORT_RUN = 256
"""Names `sorted_in_runs` sorts between two yields to the event loop (~0.3 ms of work)."""


def by_name(name: ServicePortName) -> tuple[str, str, str, str]:
    """The sort key of a service port name: a plain tuple sorts in C; the dataclass's
    generated __lt__ does not."""
    return (name.namespace, name.name, name.port, name.protocol)


async def sorted_in_runs(names: list[ServicePortName]) -> Iterator[ServicePortName]:
    """`names` in `by_name` order, sorted SORT_RUN at a time with a yield to the event loop
    after each run, then merged lazily: no step costs more than a run or one merge step."""
    runs = []
    for start in range(0, len(names), SORT_RUN):
        runs.append(sorted([(by_name(n), n) for n in names[start : start + SORT_RUN]]))
        await asyncio.sleep(0)
    # Keys are unique (equal keys are equal names), so the names themselves are never compared.
    return (name for _, name in heapq.merge(*runs))


def _show(address: Address) -> str:
    ip, port = address
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _balancer_json(view: BalancerView) -> dict[str, Any]:
    out = {n: round(left, 1) for n, left in view.ejected}
    return {
        "scheduler": view.scheduler,
        "endpoints": [
            {
                "endpoint": _show(address),
                "active": values[0],
                "total": values[1],
                "bytesIn": values[2],
                "bytesOut": values[3],
                "dialFailures": values[4],
                **({"state": "ejected", "secondsLeft": out[address]} if address in out else {}),
            }
            for address, values in view.endpoints
        ],
        "ejected": [
            {"endpoint": _show(a), "state": "ejected", "secondsLeft": round(left, 1)}
            for a, left in view.ejected
        ],
        "recentPicks": [
            {"worker": worker, "picks": [[_show(a), why] for a, why in picks]}
            for worker, picks in view.picks
        ],
        "penalized": [
            {"endpoint": _show(a), "secondsLeft": round(left, 1)} for a, left in view.penalized
        ],
    }
