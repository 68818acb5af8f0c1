"""The last applied state, kept in the state directory so that a restart serves at once.

After each sync the controller writes the complete snapshot it applied (service ports with
their settings and endpoints) to `<state-dir>/served.json`, atomically (a temporary file, fsync,
rename). At start, while the API server has not answered a first complete list, the proxy
serves from that file: the earlier run's rules still point at the proxy ports it reclaims, so
every Service answers within a second even through an API-server outage. The file is versioned
and names its node; a corrupt, foreign or newer file is ignored with one warning, and so is a
file others could have written. Each entry is checked as an API object is (`restored`).
A state directory others can write is refused (`check_directory`: the proxy exits 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import stat
import tempfile
import time
from collections.abc import Generator
from operator import itemgetter
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

from kube_userspace_proxy import logs
from kube_userspace_proxy.cluster.objects import Malformed, ip_address
from kube_userspace_proxy.errors import ProxyError
from kube_userspace_proxy.model import (
    BalancingOverrides,
    Endpoint,
    ServicePortInfo,
    ServicePortName,
    Snapshot,
)
from kube_userspace_proxy.restart import restored

log = logs.get(__name__)

FILE_NAME = "served.json"
KIND = "KubeUserspaceProxyServedState"
VERSION = 1


class StateFileError(ValueError):
    """The state file cannot be used (corrupt, foreign or from a newer version)."""


Ports = dict[tuple[str, str, str], int]
"""(`ns/name:port`, protocol, path) -> the proxy port that served it."""


_INFO_FIELDS = tuple(
    (f.name, f.default) for f in dataclasses.fields(ServicePortInfo) if f.name != "name"
)
"""Each field of an entry's info with its default (`dataclasses.MISSING`: none, always
written). A field at its default is left out: the reader (`restored.service_port_info`, the
same since version 1) gives a missing field its default, and a typical entry is half as long,
in the file and in the `Encoder` that keeps it (~2 MiB less at 10,000 Services)."""

STEP = 256
"""Entries (or proxy-port lines) looked at between two yields of `Encoder.steps`."""
ENCODE_STEP = 32
"""Entries encoded anew between two yields: an entry costs ~13 us to encode, so a step of
STEP changed ones (an endpoint storm changes most of them between two saves) took 3-7 ms,
on top of the SLICE_SECONDS that `encode_sliced` had already spent."""
SLICE_SECONDS = 0.004
"""Longest run of encoding between two turns of the event loop (`encode_sliced`)."""


class Encoder:
    """The document, kept encoded from one save to the next.

    At 10,000 Services the file is megabytes. A service port's entry is encoded again only
    when its info or endpoints are other objects than last time (the state keeps unchanged
    ones), a proxy port's line only when its port changed, and the name order is sorted
    again only when service ports come or go: a save after one change costs milliseconds.
    Nothing is allocated for an unchanged entry (a save must not feed the garbage collector
    10,000 new objects each time). One encoder per writer, used by one caller at a time.
    """

    def __init__(self) -> None:
        # Each piece is kept as the bytes written, after a comma: the document is written a
        # piece at a time, never joined into one string of megabytes (whose freed memory
        # the allocator keeps; one save a few times over would add tens of MB to the RSS).
        self._entries: dict[
            ServicePortName, tuple[ServicePortInfo, tuple[Endpoint, ...], bytes]
        ] = {}
        self._order: list[ServicePortName] = []
        self._lines: dict[tuple[str, str, str], bytes] = {}
        """Each proxy port's line, as `_lines_of` maps it (keyed by (key, port) it was a
        tuple more per port: ~0.7 MiB at 10,000)."""
        self._lines_of: Ports | None = None
        """The mapping every line encodes (None: no line is sure to, e.g. an encode left
        before its end)."""
        self._port_order: list[tuple[str, str, str]] = []
        self._ports_seen: Ports | None = None
        """The proxy-port mapping of the last encode: the very same object is not looked
        through again (the caller makes a new mapping whenever a proxy port changes)."""

    @property
    def entries(self) -> dict[ServicePortName, bytes]:
        """Each service port's encoded entry as of the last encode (a copy of the mapping)."""
        return {name: piece for name, (_, _, piece) in self._entries.items()}

    def steps(self, snapshot: Snapshot, ports: Ports) -> Generator[None, None, list[bytes]]:
        """Encode `snapshot` and `ports`, yielding after every STEP items or single large
        step (so that an event loop gets turns in between); the generator returns the
        document as pieces to write one after the other. `ports` is taken as unchanged when
        it is the very mapping of the last call: never change one in place."""
        entries = self._entries
        services = snapshot.services
        reorder = False
        encoded = 0
        for count, (name, info) in enumerate(services.items(), 1):
            endpoints = snapshot.endpoints_of(name)
            known = entries.get(name)
            if known is None or known[0] is not info or known[1] is not endpoints:
                reorder = reorder or known is None
                entries[name] = (info, endpoints, b"," + _entry(name, info, endpoints).encode())
                encoded += 1
                if encoded % ENCODE_STEP == 0:
                    yield
                    continue
            if count % STEP == 0:
                yield
        # Every step below that looks names up (a Python-level hash each) goes STEP names at
        # a time: 10,000 lookups in one step held the loop for 10-20 ms.
        if len(entries) != len(services):
            gone = []
            for count, name in enumerate(entries, 1):
                if name not in services:
                    gone.append(name)
                if count % STEP == 0:
                    yield
            for name in gone:
                del entries[name]
            reorder = True
        if reorder:
            # By the encoded entry, which begins with the name: a file that does not churn.
            keyed = []
            for count, (name, (_, _, piece)) in enumerate(entries.items(), 1):
                keyed.append((piece, name))
                if count % STEP == 0:
                    yield
            keyed.sort(key=itemgetter(0))
            yield
            self._order = [name for _, name in keyed]
            yield
        head = _dumps(
            {
                "kind": KIND,
                "version": VERSION,
                "nodeName": snapshot.node_name,
                "nodeIPs": list(snapshot.node_ips),
                "nodeZone": snapshot.node_zone,
                "podCIDRs": list(snapshot.pod_cidrs),
            }
        )
        pieces = [f'{head[:-1]},"servicePorts":['.encode()]
        for count, name in enumerate(self._order, 1):
            pieces.append(entries[name][2])
            if count % STEP == 0:
                yield
        if ports is not self._ports_seen:
            reorder = len(ports) != len(self._port_order)
            for count, key in enumerate(self._port_order, 1):
                if reorder:
                    break
                reorder = key not in ports
                if count % STEP == 0:
                    yield
            if reorder:
                self._port_order = sorted(ports)
                yield
            self._ports_seen = ports
        pieces.append(b'],"proxyPorts":[')
        lines = self._lines
        valid = self._lines_of
        if valid is not ports:
            self._lines_of = None  # until every line below encodes `ports`
        for count, key in enumerate(self._port_order, 1):
            if valid is ports:
                line = lines[key]
            else:
                port = ports[key]
                kept = lines.get(key)
                if kept is None or valid is None or valid.get(key) != port:
                    line = lines[key] = b"," + _dumps([*key, port]).encode()
                else:
                    line = kept
            pieces.append(line)
            if count % STEP == 0:
                yield
        self._lines_of = ports
        if len(lines) > len(self._port_order):  # drop the lines of ports gone
            for stale in [key for key in lines if key not in ports]:
                del lines[stale]
            yield
        pieces.append(b"]}")
        # The first entry and the first line have no comma before them.
        for at in (1, len(self._order) + 2):
            if pieces[at - 1].endswith(b"[") and pieces[at].startswith(b","):
                pieces[at] = pieces[at][1:]
        return pieces


def _plain(value: object) -> object:
    """A field's value as JSON holds it (the annotations' overrides: a list of three)."""
    if isinstance(value, BalancingOverrides):
        return [value.scheduler, value.outlier_failures, value.outlier_base_ejection]
    return value


def _entry(name: ServicePortName, info: ServicePortInfo, endpoints: tuple[Endpoint, ...]) -> str:
    return _dumps(
        {
            "name": [name.namespace, name.name, name.port, str(name.protocol)],
            "info": {
                field: _plain(value)
                for field, default in _INFO_FIELDS
                if (value := getattr(info, field)) != default
            },
            # What dataclasses.astuple gives, without its deep copy (a tenth of the cost).
            "endpoints": [
                (e.ip, e.port, e.ready, e.serving, e.terminating, e.node_name)
                if not (e.node_hints or e.zone_hints)  # most have none: keep the file short
                else (
                    e.ip,
                    e.port,
                    e.ready,
                    e.serving,
                    e.terminating,
                    e.node_name,
                    e.node_hints,
                    e.zone_hints,
                )
                for e in endpoints
            ],
        }
    )


def encode(snapshot: Snapshot, ports: Ports, encoder: Encoder | None = None) -> bytes:
    """The snapshot and its proxy ports as the versioned JSON document the file holds, at once.

    With an `encoder` kept from one call to the next, only what changed is encoded again.
    """
    steps = (encoder or Encoder()).steps(snapshot, ports)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return b"".join(cast(list[bytes], done.value))


async def encode_sliced(encoder: Encoder, snapshot: Snapshot, ports: Ports) -> list[bytes]:
    """`encode` on the event loop, giving it a turn after every SLICE_SECONDS of work; the
    document as pieces (for `write`).

    Not in a thread: a thread running Python code holds the GIL for up to the switch
    interval (5 ms) each time the loop's thread wants it back, and the loop wants it after
    every wait for events, so each of its turns waited: measured at 10,000 Services, /livez
    and requests through the data plane took 20-50 ms while a thread encoded the file.
    """
    steps = encoder.steps(snapshot, ports)
    turn = time.perf_counter()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(list[bytes], done.value)
        if time.perf_counter() - turn > SLICE_SECONDS:
            await asyncio.sleep(0)
            turn = time.perf_counter()


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def decode(data: bytes, *, node_name: str | None, loopback: bool = False) -> tuple[Snapshot, Ports]:
    """The snapshot and ports in `data`; StateFileError when not ours, not this node's, broken.

    Every entry is checked as the API's objects are (`restored`): a bad one is dropped with
    one warning, the rest kept; endpoints on loopback addresses only with `loopback` (the
    --loopback-endpoints policy).
    """
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
    parts: dict[str, list[Any]] = {}
    for part in ("servicePorts", "nodeIPs", "proxyPorts"):
        value = document.get(part)
        if not isinstance(value, list):
            raise StateFileError(f"malformed ({part}: expected a list, got {value!r:.80})")
        parts[part] = value
    services: dict[ServicePortName, ServicePortInfo] = {}
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    for i, entry in enumerate(parts["servicePorts"]):
        what = f"servicePorts[{i}]"
        try:
            if not isinstance(entry, dict):
                raise Malformed(f"expected an object, got {entry!r:.80}")
            key = restored.service_port_name(entry.get("name"))
            what = f"service port {key}"
            if key in services:
                raise Malformed("listed twice")
            info = restored.service_port_info(key, entry.get("info"))
            found = restored.endpoints(key, entry.get("endpoints"), loopback=loopback)
        except Malformed as exc:
            restored.dropped(what, exc)
            continue
        services[key], endpoints[key] = info, found
    node_ips = []
    for i, raw in enumerate(parts["nodeIPs"]):
        try:
            node_ips.append(ip_address(raw, f"nodeIPs[{i}]"))
        except Malformed as exc:
            restored.dropped("a node IP", exc)
    ports: Ports = {}
    for i, line in enumerate(parts["proxyPorts"]):
        try:
            name, port = restored.proxy_port(line)
        except Malformed as exc:
            restored.dropped(f"proxyPorts[{i}]", exc)
            continue
        ports[name] = port
    snapshot = Snapshot(
        services=MappingProxyType(services),
        endpoints=MappingProxyType(endpoints),
        node_name=node_name,
        node_ips=tuple(node_ips),
        node_zone=zone if isinstance(zone := document.get("nodeZone"), str) else "",
        pod_cidrs=restored.pod_cidrs(document.get("podCIDRs")),
    )
    return snapshot, ports


def save(directory: str, snapshot: Snapshot, ports: Ports) -> None:
    """Encode the state and write it atomically into `directory`; blocking."""
    write(directory, encode(snapshot, ports))


def write(directory: str, data: bytes | list[bytes]) -> None:
    """Write an encoded state (whole, or the pieces of `encode_sliced`) atomically into
    `directory` (created if missing); blocking (file I/O: a thread that runs it leaves the
    GIL to the event loop)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{FILE_NAME}.")
    try:
        with os.fdopen(fd, "wb") as out:
            if isinstance(data, bytes):
                out.write(data)
            else:
                out.writelines(data)
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


def load(
    directory: str, *, node_name: str | None, loopback: bool = False
) -> tuple[Snapshot, Ports] | None:
    """The snapshot and ports an earlier run saved, or None (missing; unusable: a warning).

    A file others could have written (not a regular file, another owner, writable by its
    group or others) is unusable too: it is ignored, and the next save replaces it.
    """
    path = Path(directory) / FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the state file %s: %s; starting without it", path, exc)
        return None
    with os.fdopen(fd, "rb") as file:
        unsafe = _others_can_write(os.fstat(file.fileno()), directory=False)
        if unsafe:
            log.warning("ignoring the state file %s: %s", path, unsafe)
            return None
        try:
            data = file.read()
        except OSError as exc:
            log.warning("cannot read the state file %s: %s; starting without it", path, exc)
            return None
    try:
        return decode(data, node_name=node_name, loopback=loopback)
    except StateFileError as exc:
        log.warning("ignoring the state file %s: %s", path, exc)
        return None


class UnsafeDirectory(ProxyError):
    """The state directory exists and others than this user can write to it."""


def check_directory(directory: str) -> None:
    """Raise UnsafeDirectory when `directory` exists and is not a directory only this
    process's user may write to (a missing one is created with mode 0700 when needed)."""
    try:
        found = os.stat(directory)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnsafeDirectory(f"the state directory {directory}: {exc.strerror or exc}") from None
    unsafe = _others_can_write(found, directory=True)
    if unsafe:
        raise UnsafeDirectory(
            f"refusing the state directory {directory}: {unsafe}; the state file and"
            " handover.sock would be open to them (fix it, e.g. chown and chmod 0700, or pass"
            " another --state-dir)"
        )


def _others_can_write(found: os.stat_result, *, directory: bool) -> str:
    """Why others than this user could write the file `found` describes ("" if none can)."""
    if directory and not stat.S_ISDIR(found.st_mode):
        return "not a directory"
    if not directory and not stat.S_ISREG(found.st_mode):
        return "not a regular file"
    if found.st_uid != os.geteuid():
        return f"owned by uid {found.st_uid}, not {os.geteuid()} (this process)"
    if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by its group or others (mode {stat.S_IMODE(found.st_mode):04o})"
    return ""
