"""Endpoint choice per service port: the scheduler (round robin, least connections node-wide,
Maglev source hashing), ClientIP affinity, penalties and passive outlier ejection (which
endpoints are usable at all is `topology`'s)."""

from __future__ import annotations

import dataclasses
import functools
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kube_userspace_proxy import logs
from kube_userspace_proxy.model import (
    Address,
    DialOutcome,
    Endpoint,
    ServicePortName,
    SourcePolicy,
)
from kube_userspace_proxy.outliers import Outliers, ejections, endpoint_label
from kube_userspace_proxy.schedulers import (
    ALL_PENALIZED,
    PICK_KINDS,
    PINNED,
    RETRY,
    ROUND_ROBIN,
    SCHEDULED_KINDS,
    EndpointTally,
    Mirror,
    Scheduling,
    SharedTally,
    maglev_table,
    mirrored,
)

__all__ = [
    "PICK_KINDS",
    "SCHEDULED_KINDS",
    "EndpointPool",
    "EndpointTally",
    "Mirror",
    "Outliers",
    "SharedTally",
    "ejections",
    "endpoint_label",
    "maglev_table",
]

log = logs.get(__name__)


DEFAULT_MAX_AFFINITY_ENTRIES = 65536
"""Clients remembered per pool; past it expired pins are swept, then the oldest dropped."""
PINS_SHOWN = 20
"""ClientIP pins /debug/state lists per service port (besides how many there are)."""


Transparency = tuple[tuple[str, ...] | None, tuple[Address, ...]]
"""A pool's transparent-dialing inputs as plain tuples (the worker table is marshalled):
(the source policy's local-client CIDRs, None while the mode is off; the local endpoints)."""

_OPAQUE: Transparency = (None, ())
"""The `Transparency` of most pools, one tuple for all (the publisher keeps each pool's)."""


@functools.lru_cache(maxsize=8)
def source_policy(client_cidrs: tuple[str, ...] | None) -> SourcePolicy | None:
    """The SourcePolicy of a `Transparency`'s CIDRs (one object per value in a process)."""
    return None if client_cidrs is None else SourcePolicy(client_cidrs)


RECENT_PICKS = 32
"""Picks remembered per pool for /debug/ui (a power of two: the ring index is a mask)."""
_RECENT_MASK = RECENT_PICKS - 1
# A ring entry: which endpoint (its index in the pool's `_picked_from`) << _KIND_BITS | why.
_KIND_BITS = 2
_KIND_MASK = (1 << _KIND_BITS) - 1
_NO_RING: Any = ()  # a pool's ring before its first pick
# What a pool holds before it needs it, shared by every pool: its pins, penalties and endpoint
# counters before the first pin, penalty and pick. Never written to: each is replaced by a
# dict of the pool's own when it gets its first entry (10,000 pools in a worker, most of
# them never picked from, held 4 dicts and 3 tallies each: 1.3 KiB a pool).
_NO_ENTRIES: dict[Any, Any] = {}
NO_LOCAL: frozenset[Address] = frozenset()
"""No endpoint runs on this node (`EndpointPool.update`'s `local`): one object for every pool."""


def _ring(names: int) -> bytearray | array[int]:
    """An empty ring whose entries can name `names` endpoints: a byte each up to 64 (0.1 KiB;
    a list of tallies and a bytearray of kinds took 0.4), else 2 bytes (16,384) or 4."""
    if names <= 1 << (8 - _KIND_BITS):
        return bytearray(RECENT_PICKS)
    return array("H" if names <= 1 << (16 - _KIND_BITS) else "I", [0] * RECENT_PICKS)


@dataclass(frozen=True, slots=True)
class BalancerView:
    """What the balancer did for one pool, as /debug/state and /debug/ui show it."""

    endpoints: list[tuple[Address, tuple[int, int, int, int, int]]]
    """Per endpoint: (active, total, bytes in, bytes out, dial failures), summed over workers."""
    picks: list[tuple[int | None, list[tuple[Address, str]]]]
    """Per process (worker index, None for this process): its last picks, oldest first."""
    penalized: list[tuple[Address, float]]
    """Endpoints skipped after a failed dial: (endpoint, seconds left)."""
    scheduler: str = "rr"
    """The pool's scheduler (one of `model.SCHEDULERS`)."""
    ejected: list[tuple[Address, float]] = dataclasses.field(default_factory=list)
    """Endpoints ejected after consecutive failed dials: (endpoint, seconds left)."""


class PoolView(Protocol):
    """A pool as a process that never picks reads it (the worker pool describing it to its
    workers): which service port, its usable endpoints, how it balances. `EndpointPool` fits."""

    @property
    def name(self) -> ServicePortName: ...

    @property
    def addresses(self) -> tuple[Address, ...]:
        """The usable endpoint addresses, in round-robin order."""
        ...

    @property
    def affinity_timeout(self) -> float | None:
        """The ClientIP affinity timeout in seconds; None without affinity."""
        ...

    @property
    def proxy_protocol(self) -> int:
        """PROXY protocol version sent to the endpoints (1, 2; 0: none)."""
        ...

    @property
    def transparency(self) -> Transparency:
        """The transparent-dialing inputs the workers need (--preserve-source-ip)."""
        ...

    @property
    def scheduled(self) -> tuple[int, tuple[int, ...]]:
        """How the workers pick: (scheduler code, lc's shared-count slot per endpoint)."""
        ...


_NOBODY = EndpointTally()  # `picked` before any pick: a sink nobody reads


class EndpointPool(Scheduling):
    """Chooses an endpoint for each new connection of one service port (one traffic path).

    Round robin over the usable endpoints; with ClientIP affinity a client keeps its endpoint
    while it used it within the Service's *current* timeout (idle timeout, as kube-proxy). An
    endpoint whose dial just failed is skipped for `penalty_seconds` unless all are penalised.

    Each worker process holds its own copy of a pool: copy `slot` of `slots` starts its round
    robin `slot / slots` of the way round the endpoints, so the workers' first picks spread.

    Slotted, and what only picking needs (the endpoints' tallies, the ring of recent picks) is
    made at the first pick: a worker holds a pool per service port, 10,000 of them at scale.
    """

    __slots__ = (
        "__weakref__",  # the worker pool's publisher keys its pools weakly
        "_fresh_at",
        "_index_of",
        "_local",
        "_picked_from",
        "_picks",
        "_pin_used",
        "_pinned",
        "_recent",
        "_slot",
        "_slots",
        "_sweep_at",
        "_timeout",
        "max_affinity_entries",
        "name",
        "penalty_seconds",
        "picked",
    )

    def __init__(
        self,
        name: ServicePortName,
        *,
        affinity_timeout: float | None = None,
        penalty_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        max_affinity_entries: int = DEFAULT_MAX_AFFINITY_ENTRIES,
        slot: int = 0,
        slots: int = 1,
        source: SourcePolicy | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.penalty_seconds = penalty_seconds
        self.max_affinity_entries = max(1, max_affinity_entries)
        self._clock = clock
        self._addresses: tuple[Address, ...] = ()
        self._cursor = 0
        self._slot = 0
        self._slots = 1
        # `_picks` when this pool last had no endpoints: while it is still the same, no pick
        # has followed the order, so an update places the cursor at the slot's start rather
        # than carrying it (kept as a count so that pick() stays as it was).
        self._fresh_at = 0
        self._timeout: float | None = _normal_timeout(affinity_timeout)
        # ClientIP pins as two plain dicts (client -> endpoint, client -> last use) rather than
        # an object per client: hundreds of thousands of objects made every full pass of the
        # cyclic garbage collector walk them all (21 ms at 330,000 pins); strings, floats and
        # the pool's own address tuples are not walked. _NO_ENTRIES until the first pin.
        self._pinned: dict[str, Address] = _NO_ENTRIES
        self._pin_used: dict[str, float] = _NO_ENTRIES
        # address -> monotonic time it ends; _NO_ENTRIES until the first penalty.
        self._penalties: dict[Address, float] = _NO_ENTRIES
        self._sweep_at = min(1024, self.max_affinity_entries)
        # Made at the first pick or dial failure (`_start_ring`): tallies parallel to _addresses;
        # the last RECENT_PICKS picks, a ring of ints (see _KIND_BITS) naming _picked_from: the
        # usable endpoints (a round-robin cursor is an index), then gone ones it still names.
        # Address -> index for pins and dial failures, made at the first need after an update.
        self._tallies: tuple[EndpointTally, ...] = ()
        self._recent: bytearray | array[int] = _NO_RING
        self._picked_from: tuple[Address, ...] = ()
        self._index_of: dict[Address, int] = _NO_ENTRIES
        self.picked: EndpointTally = _NOBODY
        """The tally of the endpoint the last pick() returned (read right after picking)."""
        self._picks = 0
        self._source = source
        self._local: frozenset[Address] = NO_LOCAL
        self.take_slot(slot, slots)

    # -- reading -------------------------------------------------------------------------------

    def __bool__(self) -> bool:
        return bool(self._addresses)

    def __len__(self) -> int:
        return len(self._addresses)

    @property
    def has_endpoints(self) -> bool:
        return bool(self._addresses)

    @property
    def addresses(self) -> tuple[Address, ...]:
        """The usable endpoint addresses, in round-robin order."""
        return self._addresses

    @property
    def local_addresses(self) -> tuple[Address, ...]:
        """The usable endpoints that run on this node, in round-robin order."""
        return tuple(a for a in self._addresses if a in self._local)

    def source_choices(self) -> dict[Address, str]:
        """Per usable endpoint, the source address its dials get under --preserve-source-ip:
        `client` (it runs on this node: every client keeps its address) or `client-if-pod`
        (this node's pods keep theirs, other clients dial from the node). {} while off."""
        if self.source is None:
            return {}
        local = self._local
        return {a: "client" if a in local else "client-if-pod" for a in self._addresses}

    @property
    def transparency(self) -> Transparency:
        """The source policy's CIDRs (None: off) and the local endpoints, for the workers."""
        source = self.source
        local = self.local_addresses
        if source is None and not local:
            return _OPAQUE
        return (None if source is None else source.client_cidrs, local)

    @property
    def affinity_timeout(self) -> float | None:
        """The ClientIP affinity timeout in seconds now in force; None without affinity."""
        return self._timeout

    def affinity_entries(self, limit: int | None = None) -> list[tuple[str, Address, float]]:
        """Live pins: (client ip, endpoint address, seconds left before it expires).

        At most `limit` of them (None: all; a pool may hold tens of thousands).
        """
        timeout = self._timeout
        if timeout is None:
            return []
        now = self._clock()
        out: list[tuple[str, Address, float]] = []
        used = self._pin_used
        for client, address in self._pinned.items():
            age = now - used[client]
            if age < timeout:
                if limit is not None and len(out) >= limit:
                    break
                out.append((client, address, timeout - age))
        return out

    def affinity_count(self) -> int:
        """Pins held (expired ones not swept yet included): a cheap size for /debug/state."""
        return len(self._pinned) if self._timeout is not None else 0

    def tallies(self) -> list[tuple[Address, tuple[int, int, int, int, int]]]:
        """Each usable endpoint's counters (see `EndpointTally.values`), in round-robin order."""
        if self._recent is _NO_RING:  # never used: every counter is 0
            return [(a, (0, 0, 0, 0, 0)) for a in self._addresses]
        return [(a, t.values()) for a, t in zip(self._addresses, self._tallies, strict=True)]

    def recent_picks(self) -> list[tuple[Address, str]]:
        """The last picks, oldest first: (endpoint, why: one of PICK_KINDS, the first named
        after the scheduler: `SCHEDULED_KINDS`)."""
        ring, names, n = self._recent, self._picked_from, self._picks
        kinds = (SCHEDULED_KINDS[self._scheduler], *PICK_KINDS[1:])
        picks = (ring[i & _RECENT_MASK] for i in range(max(0, n - RECENT_PICKS), n))
        return [(names[e >> _KIND_BITS], kinds[e & _KIND_MASK]) for e in picks]

    def penalized(self) -> list[tuple[Address, float]]:
        """Endpoints skipped after a failed dial: (endpoint, seconds left)."""
        now = self._clock()
        return [(a, until - now) for a, until in self._penalties.items() if until > now]

    # -- changing ------------------------------------------------------------------------------

    def update(
        self,
        endpoints: Sequence[Endpoint],
        *,
        affinity_timeout: float | None,
        local: frozenset[Address] = NO_LOCAL,
    ) -> None:
        """Take a new endpoint list, the Service's current affinity timeout and which of the
        endpoints run on this node (`local`, see `on_node`).

        The cursor stays on the endpoint it pointed at (or the next one that survives), pins to
        surviving endpoints are kept and the new timeout applies to them at once.
        """
        addresses = tuple(dict.fromkeys(e.address for e in endpoints))
        self.take_addresses(addresses, affinity_timeout=affinity_timeout, local=local)

    @mirrored
    def take_addresses(
        self,
        addresses: tuple[Address, ...],
        *,
        affinity_timeout: float | None,
        local: frozenset[Address] = NO_LOCAL,
    ) -> None:
        """`update` with the usable endpoints' addresses already deduplicated, in order (a
        worker takes them so from its table, without an `Endpoint` each)."""
        self._timeout = _normal_timeout(affinity_timeout)
        if self._timeout is None and self._pinned:
            self._pinned = self._pin_used = _NO_ENTRIES
        if local != self._local:
            self._local = local
            for address, tally in zip(self._addresses, self._tallies, strict=False):  # () unused
                tally.local = address in local
        if addresses == self._addresses:
            return
        old = self._addresses
        self._addresses = addresses
        self._index_of = _NO_ENTRIES
        self._addresses_changed(addresses)
        if self._recent is not _NO_RING:
            self._renew(old, addresses)
        if self._picks == self._fresh_at:
            self._cursor = self._start(len(addresses))
        else:
            self._cursor = _carry_cursor(old, self._cursor, addresses)
        if not addresses:  # the order ends here: the next one starts at the slot's start
            self._fresh_at = self._picks
        if self._pinned or self._penalties:
            alive = set(addresses)
        if self._pinned:
            used = self._pin_used
            self._pinned = {c: a for c, a in self._pinned.items() if a in alive}
            self._pin_used = {c: used[c] for c in self._pinned}
        if self._penalties:
            self._penalties = {a: t for a, t in self._penalties.items() if a in alive}

    def _renew(self, old: tuple[Address, ...], addresses: tuple[Address, ...]) -> None:
        """The tallies (kept while the address stays) and the ring of a pool in use for its new
        `addresses` (after `old`): entries renumbered, the endpoints gone after the usable."""
        self._tallies = self._tallied(addresses, self._tallies, old)
        for address, tally in zip(addresses, self._tallies, strict=True):
            tally.local = address in self._local
        where = {a: i for i, a in enumerate(addresses)}
        names = list(addresses)
        picks = range(max(0, self._picks - RECENT_PICKS), self._picks)
        entries = [self._recent[i & _RECENT_MASK] for i in picks]
        for k, entry in enumerate(entries):
            address = self._picked_from[entry >> _KIND_BITS]
            index = where.setdefault(address, len(names))
            if index == len(names):  # gone: named after the usable ones
                names.append(address)
            entries[k] = index << _KIND_BITS | entry & _KIND_MASK
        self._picked_from = addresses + tuple(names[len(addresses) :])
        ring = self._recent = _ring(len(names))
        for i, entry in zip(picks, entries, strict=True):
            ring[i & _RECENT_MASK] = entry

    @mirrored
    def take_slot(self, slot: int, slots: int) -> None:
        """Make this pool worker `slot`'s copy of `slots`; it starts there if it has not picked.

        `slot * count // slots` for `count` endpoints: with fewer workers than endpoints the
        starts are as far apart as they can be, so the copies' first picks differ for longer;
        with more, every endpoint is some worker's start.
        """
        self._slots = max(1, slots)
        self._slot = slot % self._slots
        if self._picks == self._fresh_at:
            self._cursor = self._start(len(self._addresses))

    @mirrored
    def dial_failed(self, address: Address, outcome: int = DialOutcome.REFUSED) -> None:
        """Skip `address` for `penalty_seconds` (its dial just failed, as `outcome` says);
        with outlier ejection here, count it and maybe eject it for longer."""
        if self._recent is _NO_RING:
            self._start_ring()
        index = self._index(address)
        if index is None:
            return
        self._tallies[index].dial_failures += 1
        self.penalize(address, max(self._suspect(address), self.penalty_seconds))

    def pick(self, client_ip: str, *, retry: bool = False) -> Address | None:
        """The endpoint for a new connection from `client_ip`; None when there is none.

        `retry=True` says the previous dial failed: the client's pin is not honoured and the
        client is re-pinned to the endpoint chosen now.
        """
        return (self._pick if self.mirror is None else self._pick_mirrored)(client_ip, retry)

    def _pick(self, client_ip: str, retry: bool) -> Address | None:
        addresses = self._addresses
        count = len(addresses)
        if not count:
            return None
        timeout = self._timeout
        if timeout is None and not self._penalties and not self._scheduler:
            # Fast path: plain round robin, no clock read.
            cursor = self._cursor
            self._cursor = cursor + 1 if cursor + 1 < count else 0
            try:
                self.picked = self._tallies[cursor]
            except IndexError:  # no tallies nor ring yet: this is the first pick
                self._start_ring()
                self.picked = self._tallies[cursor]
            n = self._picks
            self._recent[n & _RECENT_MASK] = cursor << _KIND_BITS  # | ROUND_ROBIN, which is 0
            self._picks = n + 1
            return addresses[cursor]
        now = self._clock()
        if timeout is not None and not retry:
            pinned = self._pinned.get(client_ip)
            if (
                pinned is not None
                and now - self._pin_used[client_ip] < timeout
                and (not self._penalties or not self._penalised(pinned, now))
                and (index := self._index(pinned)) is not None  # always: pins follow updates
            ):
                self._pin_used[client_ip] = now
                self._record(index, PINNED)
                return pinned
        address = self._next(addresses, count, now, retry, client_ip)
        if timeout is not None:
            self._pin(client_ip, address, now, timeout)
        return address

    # -- internals -----------------------------------------------------------------------------

    def _record(self, index: int, kind: int) -> None:
        """The endpoint at `index` of the usable ones was picked, for reason `kind`."""
        if self._recent is _NO_RING:
            self._start_ring()
        self.picked = self._tallies[index]
        n = self._picks
        self._recent[n & _RECENT_MASK] = index << _KIND_BITS | kind
        self._picks = n + 1

    def _index(self, address: Address) -> int | None:
        """Where `address` is among the usable endpoints (None: not there)."""
        if self._index_of is _NO_ENTRIES:
            self._index_of = {a: i for i, a in enumerate(self._addresses)}
        return self._index_of.get(address)

    def _start_ring(self) -> None:
        """The pool's first use: its ring of recent picks and its endpoints' tallies."""
        self._renew((), self._addresses)

    def _next(
        self, addresses: tuple[Address, ...], count: int, now: float, retry: bool, client_ip: str
    ) -> Address:
        if self._scheduler:  # lc or sh
            return self._scheduled(addresses, count, now, retry, client_ip)
        cursor = self._cursor
        first = cursor
        for _ in range(count):
            index, address = cursor, addresses[cursor]
            cursor = cursor + 1 if cursor + 1 < count else 0
            if not self._penalties or not self._penalised(address, now):
                self._cursor = cursor
                self._record(index, RETRY if retry else ROUND_ROBIN)
                return address
        # Every endpoint is penalised: still try one, in round-robin order.
        self._cursor = first + 1 if first + 1 < count else 0
        self._record(first, ALL_PENALIZED)
        return addresses[first]

    def _start(self, count: int) -> int:
        """Where this slot's copy starts its round robin over `count` endpoints."""
        return self._slot * count // self._slots

    def _penalised(self, address: Address, now: float) -> bool:
        until = self._penalties.get(address)
        if until is None:
            return False
        if until > now:
            return True
        del self._penalties[address]
        return False

    def _pin(self, client_ip: str, address: Address, now: float, timeout: float) -> None:
        pinned = self._pinned
        if pinned is _NO_ENTRIES:
            pinned = self._pinned = {}
            self._pin_used = {}
        elif client_ip not in pinned and len(pinned) >= self._sweep_at:
            self._sweep(now, timeout)
            pinned = self._pinned
        # A re-pin keeps the client's place in the (creation) order the sweep drops from.
        pinned[client_ip] = address
        self._pin_used[client_ip] = now

    def _sweep(self, now: float, timeout: float) -> None:
        used = self._pin_used
        live = {c: a for c, a in self._pinned.items() if now - used[c] < timeout}
        # Still full: drop the oldest-created pins (dict order) down to 7/8 of the bound, so the
        # next sweep is max/8 inserts away rather than one.
        limit = self.max_affinity_entries
        excess = len(live) - (limit - max(1, limit // 8))
        if excess > 0:
            for client in list(live)[:excess]:
                del live[client]
            log.debug("%s: affinity table full, dropped %d oldest pins", self.name, excess)
        self._pinned = live
        self._pin_used = {c: used[c] for c in live}
        # Sweep again once the table has doubled, so sweeping stays amortised O(1) per pick.
        self._sweep_at = min(max(1024, 2 * len(live)), self.max_affinity_entries)


def _normal_timeout(timeout: float | None) -> float | None:
    return timeout if timeout is not None and timeout > 0 else None


def _carry_cursor(old: tuple[Address, ...], cursor: int, new: tuple[Address, ...]) -> int:
    """The new cursor: on the old next endpoint, or the first survivor after it."""
    if not new:
        return 0
    if old:
        index = {a: i for i, a in enumerate(new)}
        count = len(old)
        for step in range(count):
            found = index.get(old[(cursor + step) % count])
            if found is not None:
                return found
    return cursor % len(new)
