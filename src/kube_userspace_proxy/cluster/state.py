"""ClusterState: raw Services, EndpointSlices and the Node -> an immutable Snapshot.

Raw objects are plain dicts shaped like the API's JSON (camelCase), from the kube watch and
from YAML manifests alike. Each object is parsed once when it arrives (by `objects`); a
malformed one is skipped with one log line naming it, and never stops the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from kube_userspace_proxy import logs
from kube_userspace_proxy.cluster.objects import (
    Key,
    Malformed,
    NodeFacts,
    Skip,
    Slice,
    describe,
    ignore_reason,
    object_key,
    parse_node,
    parse_service,
    parse_slice,
    trigger_time,
)
from kube_userspace_proxy.cluster.sink import Event, Kind, StateSink
from kube_userspace_proxy.model import (
    Change,
    Desired,
    Endpoint,
    ServicePortInfo,
    ServicePortName,
    Snapshot,
)

log = logs.get(__name__)

D = TypeVar("D", bound=Desired)


# -- the state ------------------------------------------------------------------------------


class ClusterState:
    """Holds the parsed Services and EndpointSlices and builds Snapshots from them.

    `on_change()` runs after every change that alters what a Snapshot would contain.
    """

    def __init__(
        self,
        *,
        node_name: str | None = None,
        service_proxy_name: str | None = None,
        on_change: Callable[[], None] = lambda: None,
        loopback_endpoints: bool = False,
    ) -> None:
        self.node_name = node_name
        self.loopback_endpoints = loopback_endpoints
        self.service_proxy_name = service_proxy_name
        self.on_change = on_change
        self.pending_service_changes = 0
        self.pending_endpoint_changes = 0
        self.service_changes_total = 0
        self.endpoint_changes_total = 0
        self._services: dict[Key, tuple[ServicePortInfo, ...]] = {}
        self._slices: dict[Key, Slice] = {}
        # service key -> slice keys; a tuple, not a set: most Services have one slice, and
        # 10,000 one-member sets cost 2 MiB.
        self._slices_of: dict[Key, tuple[Key, ...]] = {}
        self._rejected: dict[tuple[Kind, Key], Any] = {}  # last raw object already logged
        self._ignored: dict[tuple[Kind, Key], str] = {}  # objects not served now -> why
        # The resourceVersion last parsed, per kind: keyed by the objects' own keys (a
        # (kind, key) pair per object was 20,000 tuples more at 10,000 Services).
        self._versions: dict[Kind, dict[Key, str]] = {"Service": {}, "EndpointSlice": {}}
        self._sctp_warned: set[ServicePortName] = set()
        self._problems_warned: dict[Key, tuple[str, ...]] = {}
        self._listed: set[Kind] = set()
        # A list in progress, per kind: the keys it named so far and its change count.
        self._listing: dict[Kind, tuple[set[Key], list[int]]] = {}
        self._trigger_times: list[float] = []
        self._node_ips: tuple[str, ...] = ()
        self._node_eligible = True
        self._node_zone = ""
        self._pod_cidrs: tuple[str, ...] = ()
        # Snapshot parts kept between snapshots; only services marked dirty are rebuilt.
        self._dirty: set[Key] = set()
        self._built: dict[Key, tuple[ServicePortName, ...]] = {}
        self._snap_services: dict[ServicePortName, ServicePortInfo] = {}
        self._snap_endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = {}
        # Service ports rebuilt (added, changed or removed) since the last snapshot.
        self._touched: set[ServicePortName] = set()

    @property
    def listed(self) -> bool:
        """True once both Services and EndpointSlices were listed (replaced) at least once."""
        return len(self._listed) == 2

    @property
    def node_eligible(self) -> bool:
        """False while the own Node is being deleted or tainted for scale-down."""
        return self._node_eligible

    @property
    def node_ips(self) -> tuple[str, ...]:
        return self._node_ips

    @property
    def node_zone(self) -> str:
        """The own Node's `topology.kubernetes.io/zone` label ("": none or unknown)."""
        return self._node_zone

    # -- input ----------------------------------------------------------------------------

    def replace(self, kind: Kind, objects: Iterable[Mapping[str, Any]]) -> None:
        """Take the complete list of one kind (list, relist, manifest reload)."""
        self.begin_list(kind)
        self.list_page(kind, objects)
        self.end_list(kind)

    def begin_list(self, kind: Kind) -> None:
        """A complete list of `kind` follows, page by page (`list_page`, then `end_list`).

        Each page is parsed into the state as it arrives, so no list of raw pages is held;
        what the list did not name is removed at `end_list`. Beginning again forgets the
        pages seen so far (a list restarted after its continue token expired).
        """
        if kind not in ("Service", "EndpointSlice"):
            log.warning("ignoring a list of unknown kind %r", kind)
            return
        self._listing[kind] = (set(), [0])

    def list_page(self, kind: Kind, objects: Iterable[Mapping[str, Any]]) -> None:
        """One page of the list begun with `begin_list`."""
        listing = self._listing.get(kind)
        if listing is None:
            return
        seen, changes = listing
        for obj in objects:
            key = self._key(kind, obj)
            if key is None:
                continue
            seen.add(key)
            changes[0] += self._upsert(kind, key, obj)

    def end_list(self, kind: Kind) -> None:
        """The list is complete: remove what it did not name, then tell `on_change`."""
        listing = self._listing.pop(kind, None)
        if listing is None:
            return
        seen, (changes,) = listing
        first = kind not in self._listed
        self._listed.add(kind)
        known = self._services if kind == "Service" else self._slices
        for key in [k for k in known if k not in seen]:
            changes += self._remove(kind, key)
        for rejected in [r for r in self._rejected if r[0] == kind and r[1] not in seen]:
            del self._rejected[rejected]
        for gone in [r for r in self._ignored if r[0] == kind and r[1] not in seen]:
            del self._ignored[gone]
        self._count(kind, changes)
        if changes or (first and self.listed):
            self.on_change()

    def apply(self, kind: Kind, event: Event, obj: Mapping[str, Any]) -> None:
        """Take one watch event for one object."""
        if kind not in ("Service", "EndpointSlice"):
            log.warning("ignoring an event for unknown kind %r", kind)
            return
        key = self._key(kind, obj)
        if key is None:
            return
        if event == "DELETED":
            self._rejected.pop((kind, key), None)
            self._ignored.pop((kind, key), None)
            changes = self._remove(kind, key)
        elif event in ("ADDED", "MODIFIED"):
            changes = self._upsert(kind, key, obj)
        else:
            log.warning("ignoring %s event %r for %s/%s", kind, event, *key)
            return
        self._count(kind, changes)
        if changes:
            self.on_change()

    def set_node(self, node: Mapping[str, Any] | None) -> None:
        """Take the own Node object (None: unknown or gone): addresses, eligibility, zone,
        podCIDRs."""
        facts = NodeFacts((), True)
        if node is not None:
            try:
                facts = parse_node(node)
            except Exception as exc:
                log.warning("skipping Node %s: %s", _name_of(node), exc)
                return
        known = NodeFacts(self._node_ips, self._node_eligible, self._node_zone, self._pod_cidrs)
        if facts == known:
            return
        if not facts.eligible and self._node_eligible:
            log.info("node %s is being deleted: reporting not eligible", _name_of(node))
        if (facts.ips, facts.zone, facts.pod_cidrs) != (known.ips, known.zone, known.pod_cidrs):
            if facts.zone != self._node_zone:
                log.info("node zone is now %r (was %r)", facts.zone, self._node_zone)
            # Zone hints, NodePort addresses (`primary`), local clients (podCIDRs): every
            # service port is chosen again.
            self._touched.update(self._snap_services)
        self._node_ips, self._node_eligible = facts.ips, facts.eligible
        self._node_zone, self._pod_cidrs = facts.zone, facts.pod_cidrs
        self.on_change()

    # -- output ---------------------------------------------------------------------------

    def ignored(self) -> list[tuple[Kind, Key, str]]:
        """(kind, key, why) of every Service and EndpointSlice given but not served now."""
        return sorted((kind, key, why) for (kind, key), why in self._ignored.items())

    def dropped_endpoints(self, service: Key) -> list[tuple[str, str]]:
        """(address, why) of the endpoints a Service's slices name that are never dialed."""
        slices = sorted(self._slices_of.get(service, ()))
        return [dropped for key in slices for dropped in self._slices[key].dropped]

    def snapshot(self) -> Snapshot:
        """The complete state now; resets the trigger times and pending change counts."""
        self._rebuild_dirty()
        self._touched.clear()
        return self._take(Snapshot, dict(self._snap_services), dict(self._snap_endpoints))

    def changes(self) -> Change:
        """What changed since the last snapshot or changes (`Change.changed`).

        Costs time in proportion to the change: only the Services changed since are rebuilt,
        and only their service ports are copied. Resets what `snapshot()` resets.
        """
        self._rebuild_dirty()
        touched, self._touched = self._touched, set()
        services = self._snap_services
        endpoints = self._snap_endpoints
        return self._take(
            functools.partial(Change, changed=frozenset(touched)),
            {n: services[n] for n in touched if n in services},
            {n: endpoints[n] for n in touched if n in endpoints},
        )

    def view(self) -> Snapshot:
        """The complete state as of the last snapshot (or changes), consuming nothing."""
        return Snapshot(
            services=MappingProxyType(dict(self._snap_services)),
            endpoints=MappingProxyType(dict(self._snap_endpoints)),
            node_name=self.node_name,
            node_ips=self._node_ips,
            node_zone=self._node_zone,
            pod_cidrs=self._pod_cidrs,
        )

    def _rebuild_dirty(self) -> None:
        for key in self._dirty:
            self._rebuild(key)
        self._dirty.clear()

    def _take(
        self,
        make: Callable[..., D],
        services: dict[ServicePortName, ServicePortInfo],
        endpoints: dict[ServicePortName, tuple[Endpoint, ...]],
    ) -> D:
        times = tuple(self._trigger_times)
        self._trigger_times.clear()
        changes = (self.pending_service_changes, self.pending_endpoint_changes)
        self.pending_service_changes = 0
        self.pending_endpoint_changes = 0
        return make(
            services=MappingProxyType(services),
            endpoints=MappingProxyType(endpoints),
            node_name=self.node_name,
            node_ips=self._node_ips,
            node_zone=self._node_zone,
            pod_cidrs=self._pod_cidrs,
            trigger_times=times,
            service_changes=changes[0],
            endpoint_changes=changes[1],
        )

    # -- internals --------------------------------------------------------------------------

    def _key(self, kind: Kind, obj: Any) -> Key | None:
        try:
            return object_key(obj)
        except Malformed as exc:
            log.warning("skipping %s %s: %s", kind, describe(obj), exc)
            return None

    def _count(self, kind: Kind, changes: int) -> None:
        if kind == "Service":
            self.pending_service_changes += changes
            self.service_changes_total += changes
        else:
            self.pending_endpoint_changes += changes
            self.endpoint_changes_total += changes

    def _reject(self, kind: Kind, key: Key, obj: Any, reason: str, *, warn: bool) -> int:
        """Remove what the object was (changes made), and log why once per version."""
        changes = self._ignore(kind, key, reason)
        if self._rejected.get((kind, key)) != obj:
            self._rejected[(kind, key)] = obj
            (log.warning if warn else log.info)("skipping %s %s/%s: %s", kind, *key, reason)
        return changes

    def _ignore(self, kind: Kind, key: Key, reason: str) -> int:
        """Remove what the object was (changes made); `ignored()` names it with `reason`."""
        changes = self._remove(kind, key)
        self._ignored[(kind, key)] = reason
        return changes

    def _upsert(self, kind: Kind, key: Key, obj: Mapping[str, Any]) -> int:
        version = obj["metadata"].get("resourceVersion")
        versions = self._versions[kind]
        if isinstance(version, str) and version and versions.get(key) == version:
            return 0  # a relist repeats what we have: skip parsing thousands of objects again
        if kind == "Service":
            changes = self._upsert_service(key, obj)
        else:
            changes = self._upsert_slice(key, obj)
        if isinstance(version, str) and version:
            versions[key] = version
        return changes

    def _remove(self, kind: Kind, key: Key) -> int:
        self._versions[kind].pop(key, None)
        self._ignored.pop((kind, key), None)
        if kind == "Service":
            if self._services.pop(key, None) is None:
                return 0
            self._sctp_warned = {n for n in self._sctp_warned if (n.namespace, n.name) != key}
            self._problems_warned.pop(key, None)
            self._dirty.add(key)
            return 1
        old = self._slices.pop(key, None)
        if old is None:
            return 0
        rest = tuple(k for k in self._slices_of.get(old.service, ()) if k != key)
        if rest:
            self._slices_of[old.service] = rest
        else:
            self._slices_of.pop(old.service, None)
        self._dirty.add(old.service)
        return 1

    def _upsert_service(self, key: Key, obj: Mapping[str, Any]) -> int:
        infos: tuple[ServicePortInfo, ...] = ()
        try:
            reason = ignore_reason(obj, self.service_proxy_name)
            if reason is None:
                infos, sctp, problems = parse_service(obj, key)
                self._warn_sctp(sctp)
                self._warn_problems(key, problems)
            else:
                log.debug("ignoring Service %s/%s: %s", *key, reason)
            self._rejected.pop(("Service", key), None)
        except Exception as exc:  # never let one bad object stop the others
            return self._reject("Service", key, obj, str(exc), warn=True)
        if reason is not None:
            return self._ignore("Service", key, reason)
        if self._services.get(key) == infos:
            return 0
        self._services[key] = infos
        self._dirty.add(key)
        return 1

    def _warn_sctp(self, names: tuple[ServicePortName, ...]) -> None:
        for name in names:
            if name not in self._sctp_warned:
                self._sctp_warned.add(name)
                log.warning("skipping service port %s: protocol SCTP is not proxied", name)

    def _warn_problems(self, key: Key, problems: tuple[str, ...]) -> None:
        # Once per Service and set of problems: not again on every relist or reload.
        if self._problems_warned.get(key, ()) != problems:
            for problem in problems:
                log.warning("Service %s/%s: %s", *key, problem)
        if problems:
            self._problems_warned[key] = problems
        else:
            self._problems_warned.pop(key, None)

    def _upsert_slice(self, key: Key, obj: Mapping[str, Any]) -> int:
        try:
            parsed = parse_slice(obj, key, loopback=self.loopback_endpoints)
            self._rejected.pop(("EndpointSlice", key), None)
        except Skip as exc:
            if not exc.quiet:
                return self._reject("EndpointSlice", key, obj, str(exc), warn=False)
            log.debug("ignoring EndpointSlice %s/%s: %s", *key, exc)
            return self._ignore("EndpointSlice", key, str(exc))
        except Exception as exc:  # never let one bad object stop the others
            return self._reject("EndpointSlice", key, obj, str(exc), warn=True)
        old = self._slices.get(key)
        if old == parsed:
            return 0
        if old is not None and old.service != parsed.service:
            self._remove("EndpointSlice", key)
        elif old is not None:
            parsed = _reusing(parsed, old)
        self._slices[key] = parsed
        siblings = self._slices_of.get(parsed.service, ())
        if key not in siblings:
            self._slices_of[parsed.service] = (*siblings, key)
        self._dirty.add(parsed.service)
        when = trigger_time(obj)
        if when is not None:
            self._trigger_times.append(when)
        return 1

    def _rebuild(self, key: Key) -> None:
        """Recompute the Snapshot entries of one Service from its object and its slices.

        Endpoints equal to ones it had are those same objects (and an unchanged list the same
        tuple): in an endpoint storm only what moved is new, so the garbage collector's passes
        have that much less long-lived state to walk.
        """
        previous: dict[ServicePortName, tuple[Endpoint, ...]] = {}
        for stale in self._built.pop(key, ()):
            self._snap_services.pop(stale, None)
            previous[stale] = self._snap_endpoints.pop(stale, ())
            self._touched.add(stale)
        infos = self._services.get(key)
        if not infos:
            return
        pieces = [self._slices[k] for k in sorted(self._slices_of.get(key, ()))]
        merged = _merged(key, infos, pieces)
        for info in infos:
            self._touched.add(info.name)
            self._snap_services[info.name] = info
            before = previous.get(info.name, ())
            known = {e: e for e in before}
            endpoints = tuple(
                known.get(e, e)
                for e in (merged[info.name][address] for address in sorted(merged[info.name]))
            )
            self._snap_endpoints[info.name] = before if endpoints == before else endpoints
        self._built[key] = tuple(info.name for info in infos)


def _merged(
    key: Key, infos: tuple[ServicePortInfo, ...], pieces: list[Slice]
) -> dict[ServicePortName, dict[tuple[str, int], Endpoint]]:
    """Per service port of a Service, its endpoints by (ip, port) from all its slices."""
    merged: dict[ServicePortName, dict[tuple[str, int], Endpoint]] = {
        info.name: {} for info in infos
    }
    namespace, name = key
    for piece in pieces:
        for port_name, protocol, number in piece.ports:
            into = merged.get(ServicePortName(namespace, name, port_name, protocol))
            if into is None:
                continue
            for e in piece.endpoints:
                seen = into.get((e.ip, number))
                # The same endpoint in two slices (during a move): the ready copy wins.
                if seen is None or (e.ready and not seen.ready):
                    # The slice's own object for its first port (`Slice.endpoints`).
                    into[(e.ip, number)] = (
                        e
                        if e.port == number
                        else Endpoint(
                            e.ip,
                            number,
                            e.ready,
                            e.serving,
                            e.terminating,
                            e.node_name,
                            e.node_hints,
                            e.zone_hints,
                        )
                    )
    return merged


def _reusing(parsed: Slice, old: Slice) -> Slice:
    """`parsed` with the endpoint objects (and ports) of `old` that are equal to its own."""
    known = {e: e for e in old.endpoints}
    return Slice(
        parsed.service,
        old.ports if old.ports == parsed.ports else parsed.ports,
        tuple(known.get(e, e) for e in parsed.endpoints),
        parsed.dropped,
    )


def _name_of(node: Mapping[str, Any] | None) -> str:
    if isinstance(node, Mapping) and isinstance(node.get("metadata"), Mapping):
        return str(node["metadata"].get("name") or "?")
    return "?"


_sink: StateSink = ClusterState()  # conformance: ClusterState is a StateSink
