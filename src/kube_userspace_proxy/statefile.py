"""The last applied state, kept in the state directory so that a restart serves at once.

After each sync the controller writes the complete snapshot it applied (service ports with
their settings and endpoints) to `<state-dir>/served.json`, atomically (a temporary file, fsync,
rename). At start, while the API server has not answered a first complete list, the proxy
serves from that file: the earlier run's rules still point at the proxy ports it reclaims, so
every Service answers within a second even through an API-server outage. The file is versioned
and names its node; a corrupt, foreign or newer file is ignored with one warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kube_userspace_proxy import logs
from kube_userspace_proxy.model import (
    Endpoint,
    Protocol,
    ServicePortInfo,
    ServicePortName,
    Snapshot,
)

log = logs.get(__name__)

FILE_NAME = "served.json"
KIND = "KubeUserspaceProxyServedState"
VERSION = 1


class StateFileError(ValueError):
    """The state file cannot be used (corrupt, foreign or from a newer version)."""


Ports = dict[tuple[str, str, str], int]
"""(`ns/name:port`, protocol, path) -> the proxy port that served it."""


_INFO_FIELDS = tuple(f.name for f in dataclasses.fields(ServicePortInfo) if f.name != "name")

EntryCache = dict[ServicePortName, tuple[ServicePortInfo, tuple[Endpoint, ...], str]]
"""Each service port's encoded entry, with the info and endpoint objects it was made from."""


def encode(snapshot: Snapshot, ports: Ports, cache: EntryCache | None = None) -> bytes:
    """The snapshot and its proxy ports as the versioned JSON document the file holds.

    Encoded an entry at a time: one `json.dumps` of the whole document (megabytes at 10,000
    Services) would hold the GIL, and so stall the event loop, for a tenth of a second even
    from a worker thread; small calls let the loop's thread in between. With a `cache` kept
    from one call to the next, only the entries whose info or endpoints are other objects
    than last time are encoded again (the state keeps unchanged ones): at 10,000 Services
    a save after one change costs milliseconds, not a second of the GIL.
    """
    entries = []
    fresh: EntryCache = {}
    for name, info in snapshot.services.items():
        endpoints = snapshot.endpoints_of(name)
        known = cache.get(name) if cache is not None else None
        if known is not None and known[0] is info and known[1] is endpoints:
            text = known[2]
        else:
            entry = {
                "name": [name.namespace, name.name, name.port, str(name.protocol)],
                "info": {field: getattr(info, field) for field in _INFO_FIELDS},
                # What dataclasses.astuple gives, without its deep copy (a tenth of the cost).
                "endpoints": [
                    (e.ip, e.port, e.ready, e.serving, e.terminating, e.node_name)
                    for e in endpoints
                ],
            }
            text = _dumps(entry)
        fresh[name] = (info, endpoints, text)
        entries.append(text)
    if cache is not None:
        cache.clear()
        cache.update(fresh)
    entries.sort()  # by name (each entry starts with it): a file that does not churn
    head = _dumps(
        {
            "kind": KIND,
            "version": VERSION,
            "nodeName": snapshot.node_name,
            "nodeIPs": list(snapshot.node_ips),
        }
    )
    proxy_ports = [_dumps([*key, port]) for key, port in sorted(ports.items())]
    text = (
        f'{head[:-1]},"servicePorts":[{",".join(entries)}],"proxyPorts":[{",".join(proxy_ports)}]}}'
    )
    return text.encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def decode(data: bytes, *, node_name: str | None) -> tuple[Snapshot, Ports]:
    """The snapshot and ports in `data`; StateFileError when not ours, not this node's, broken."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StateFileError(f"not JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("kind") != KIND:
        raise StateFileError("not a kube-userspace-proxy state file")
    if document.get("version") != VERSION:
        raise StateFileError(f"version {document.get('version')!r}, this proxy reads {VERSION}")
    if document.get("nodeName") != node_name:
        raise StateFileError(
            f"written for node {document.get('nodeName')!r}, this is {node_name!r}"
        )
    services: dict[ServicePortName, ServicePortInfo] = {}
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    try:
        for entry in document["servicePorts"]:
            namespace, name, port, protocol = entry["name"]
            key = ServicePortName(str(namespace), str(name), str(port), Protocol(protocol))
            services[key] = _info(key, entry["info"])
            endpoints[key] = tuple(_endpoint(e) for e in entry["endpoints"])
        node_ips = tuple(str(ip) for ip in document["nodeIPs"])
        ports: Ports = {}
        for name, protocol, path, port in document["proxyPorts"]:
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"bad proxy port {port!r}")
            ports[(str(name), str(protocol), str(path))] = port
    except (KeyError, TypeError, ValueError) as exc:
        raise StateFileError(f"malformed ({exc!r})") from None
    snapshot = Snapshot(
        services=MappingProxyType(services),
        endpoints=MappingProxyType(endpoints),
        node_name=node_name,
        node_ips=node_ips,
    )
    return snapshot, ports


def _info(name: ServicePortName, raw: Any) -> ServicePortInfo:
    if not isinstance(raw, dict):
        raise TypeError("service port info is not an object")
    values: dict[str, Any] = {"name": name}
    for f in dataclasses.fields(ServicePortInfo):
        if f.name == "name" or f.name not in raw:
            continue  # a field this file predates keeps its default
        value = raw[f.name]
        values[f.name] = tuple(str(v) for v in value) if isinstance(value, list) else value
    info = ServicePortInfo(**values)
    for f in dataclasses.fields(info):
        default = f.default if f.default is not dataclasses.MISSING else None
        value = getattr(info, f.name)
        if default is not None and type(value) is not type(default):
            raise TypeError(f"{f.name} is a {type(value).__name__}")
    return info


def _endpoint(raw: Any) -> Endpoint:
    ip, port, ready, serving, terminating, node = raw
    if not isinstance(ip, str) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"bad endpoint {raw!r}")
    return Endpoint(ip, port, bool(ready), bool(serving), bool(terminating), node)


def save(directory: str, snapshot: Snapshot, ports: Ports, cache: EntryCache | None = None) -> None:
    """Write the state atomically into `directory` (created if missing); blocking.

    `cache`: see `encode` (one cache per writer, used by one thread at a time)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = encode(snapshot, ports, cache)
    fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{FILE_NAME}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path / FILE_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def path(directory: str) -> Path:
    """Where the state file of `directory` is."""
    return Path(directory) / FILE_NAME


def load(directory: str, *, node_name: str | None) -> tuple[Snapshot, Ports] | None:
    """The snapshot and ports an earlier run saved, or None (missing; unusable: a warning)."""
    path = Path(directory) / FILE_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the state file %s: %s; starting without it", path, exc)
        return None
    try:
        return decode(data, node_name=node_name)
    except StateFileError as exc:
        log.warning("ignoring the state file %s: %s", path, exc)
        return None
