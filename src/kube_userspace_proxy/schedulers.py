"""The schedulers' side of an endpoint pool: least connections (node-wide through the shared
`nodecounts`), source hashing on a Maglev table, and the tallies the data plane bumps.

`Scheduling` is `balancer.EndpointPool`'s base: it keeps what only `lc` and `sh` need and the
runs of failed dials that outlier ejection counts, and picks for those two schedulers; round
robin and affinity stay in the pool.

A pool may also have a `Mirror`: the native data plane's copy of a pool in plain round robin,
which picks for accepted connections without a Python call (`dataplane/native.py`). Every
method that changes what a pick depends on is `mirrored`: it takes the cursor back first and
shows the mirror the pool's state after, or keeps it disabled while the pool is not plain.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from kube_userspace_proxy.model import (
    SCHEDULERS,
    Address,
    Balancing,
    ServicePortName,
    SourcePolicy,
)
from kube_userspace_proxy.nodecounts import NodeCounts
from kube_userspace_proxy.outliers import Outliers

# Why an endpoint was picked (kept as ints in the ring; named only when viewed). The first
# is the pool's scheduler's own choice, named after it (`SCHEDULED_KINDS`).
ROUND_ROBIN, PINNED, RETRY, ALL_PENALIZED = 0, 1, 2, 3
PICK_KINDS = ("round-robin", "affinity", "retry", "all-penalized")
RR, LC, SH = 0, 1, 2
"""A pool's scheduler as the int it keeps (the index in `model.SCHEDULERS`)."""
SCHEDULED_KINDS = ("round-robin", "least-connections", "source-hash")
"""What a pick by each scheduler is called in the recent picks."""
NO_SLOTS: tuple[int, ...] = ()
"""A pool's endpoints' shared-count slots when it has none (not lc, or a single process)."""


def scheduler_code(name: str) -> int:
    """The int of scheduler `name` (one of `model.SCHEDULERS`; anything else is rr)."""
    return SCHEDULERS.index(name) if name in SCHEDULERS else RR


class EndpointTally:
    """Counters of one endpoint in one pool, plain ints the data plane bumps (see Picker).

    TCP: `active` open connections, `total` connections that reached it; UDP: sessions.
    `bytes_in` client -> endpoint, `bytes_out` endpoint -> client; `dial_failures` its
    failed dials. Kept across endpoint updates while the address stays. `local`: the
    endpoint runs on this node (its replies leave through this node). Its pool knows its
    address (a slot less: 80 B a tally, 96 with it).
    """

    __slots__ = ("active", "bytes_in", "bytes_out", "dial_failures", "local", "total")

    def __init__(self) -> None:
        self.active = 0
        self.total = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.dial_failures = 0
        self.local = False

    def values(self) -> tuple[int, int, int, int, int]:
        """(active, total, bytes_in, bytes_out, dial_failures)."""
        return (self.active, self.total, self.bytes_in, self.bytes_out, self.dial_failures)


class SharedTally(EndpointTally):
    """An endpoint's tally whose `active` count is also written to this worker's cell of the
    node's shared counts (`nodecounts`), which least-connection picks sum over the workers.

    The data plane bumps `active` as it does a plain tally's; only this process writes the
    cell. `detach` zeroes the cell and stops writing it (the endpoint left the pool, or its
    slot changed): connections still open keep counting here only.
    """

    __slots__ = ("_cell", "_cells", "_own")

    def __init__(self, cells: memoryview, cell: int) -> None:
        self._cells = cells
        self._cell = cell
        self._own = 0
        super().__init__()

    @property  # a slot in the base, a write-through property here
    def active(self) -> int:
        return self._own

    @active.setter
    def active(self, value: int) -> None:
        self._own = value
        if self._cell >= 0:
            self._cells[self._cell] = value

    def detach(self) -> None:
        if self._cell >= 0:
            self._cells[self._cell] = 0
            self._cell = -1


MAGLEV_SIZES = (4093, 16381, 65521)
"""Prime lookup-table sizes; a pool takes the first of at least 100 entries per endpoint
(Maglev's M >> N keeps each endpoint's share within ~1 % and the disruption near 1/N). Few
sizes, so that one endpoint more or less changes the size only at 40/41 and 163/164
endpoints (a new size moves most clients); a table takes ~7 ms to build at 4093 entries,
~35 ms at 16381, in each worker, when the endpoints change."""


def _endpoint_hashes(address: Address, size: int) -> tuple[int, int]:
    """(offset, skip) of an endpoint's permutation: from its address alone, so every worker,
    and every restart, builds the same table."""
    digest = hashlib.blake2b(f"{address[0]}|{address[1]}".encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8]) % size, int.from_bytes(digest[8:]) % (size - 1) + 1


def maglev_table(addresses: Sequence[Address]) -> array[int]:
    """Maglev's lookup table for `addresses` (Eisenbud et al., NSDI 2016): each entry is an
    index into `addresses`. Built in the addresses' sorted order, so the order of the list
    does not matter; removing one endpoint moves its entries and few others."""
    count = len(addresses)
    size = next((m for m in MAGLEV_SIZES if m >= 100 * count), MAGLEV_SIZES[-1])
    order = sorted(range(count), key=lambda i: addresses[i])
    perms = [_endpoint_hashes(addresses[i], size) for i in order]
    table = array("i", [-1]) * size
    following = [0] * count
    filled = 0
    while True:
        for k, (offset, skip) in enumerate(perms):
            n = following[k]
            place = (offset + n * skip) % size
            while table[place] >= 0:
                n += 1
                place = (offset + n * skip) % size
            table[place] = order[k]
            following[k] = n + 1
            filled += 1
            if filled == size:
                return table


def client_hash(client_ip: str) -> int:
    """The client address's place in a Maglev table (any size): stable across processes."""
    return zlib.crc32(client_ip.encode())


_NO_SUSPECTS: set[Any] = set()


class Mirror(Protocol):
    """A copy of a pool in plain round robin that picks on its own while it is enabled (the
    native data plane's table). The pool owns the cursor whenever the mirror is disabled."""

    @property
    def enabled(self) -> bool:
        """True while the mirror picks (and holds the cursor)."""
        ...

    def disable(self) -> int:
        """Stop picking; the cursor, where the mirror's next pick would have been."""
        ...

    def show(
        self, addresses: tuple[Address, ...], tallies: tuple[EndpointTally, ...], cursor: int
    ) -> None:
        """Pick from `addresses` (with their `tallies`) from `cursor` on, round robin."""
        ...


_S = TypeVar("_S", bound="Scheduling")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def mirrored(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """`method` changes what a pick depends on: with a mirror, the pool takes the cursor back
    before it and shows the mirror its state after (`Scheduling._mirror_sync`)."""

    @functools.wraps(method)
    def wrapper(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self.mirror is None:
            return method(self, *args, **kwargs)
        self._mirror_take()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._mirror_sync()

    return wrapper


class Scheduling:
    """What an endpoint pool keeps for its scheduler and for outlier ejection, and the picks
    of `lc` and `sh` (the pool calls `_least` and `_hashed`); its mirror, and what decides
    whether the mirror may pick (a PROXY header or a transparent source means it may not)."""

    __slots__ = (
        # The pool's, which the schedulers read and write too (set in its __init__).
        "_addresses",
        "_clock",
        "_counts",
        "_cursor",
        "_ejecting",
        "_maglev",
        "_penalties",
        "_proxy_protocol",
        "_scheduler",
        "_shared_slots",
        "_source",
        "_suspects",
        "_tallies",
        "_worker",
        "mirror",
        "outliers",
    )

    _addresses: tuple[Address, ...]
    _tallies: tuple[EndpointTally, ...]
    _penalties: dict[Address, float]
    _cursor: int
    _timeout: float | None
    _clock: Callable[[], float]

    def __init__(self) -> None:
        self._scheduler = RR
        self._maglev: array[int] | None = None  # sh: made at the first pick after an update
        # lc across workers: the node's shared counts, this worker's column, the endpoints'
        # slots (parallel to _addresses; -1: counted here only). None: this process's counts.
        self._counts: NodeCounts | None = None
        self._worker = -1
        self._shared_slots: tuple[int, ...] = NO_SLOTS
        # Endpoints with a failed dial since their last success (a success is then reported).
        self._suspects: set[Address] = _NO_SUSPECTS
        self.outliers: Outliers | None = None
        """Passive ejection decided here (a single process), made at the first failed dial;
        None: none yet, off, or decided by the control process from the workers' reports."""
        self._ejecting: Balancing | None = None  # the settings of ejection here (None: off)
        self.mirror: Mirror | None = None
        """The native data plane's copy of this pool (`attach_mirror`); None: none."""
        self._proxy_protocol = 0
        self._source: SourcePolicy | None = None

    name: ServicePortName

    @property
    def proxy_protocol(self) -> int:
        """PROXY protocol version the data plane sends these endpoints first (0: none)."""
        return self._proxy_protocol

    @proxy_protocol.setter
    def proxy_protocol(self, version: int) -> None:
        if version != self._proxy_protocol:
            self._mirror_take()
            self._proxy_protocol = version
            self._mirror_sync()

    @property
    def source(self) -> SourcePolicy | None:
        """Transparent dialing (--preserve-source-ip) and the node's local clients; None: off."""
        return self._source

    @source.setter
    def source(self, policy: SourcePolicy | None) -> None:
        if policy != self._source:
            self._mirror_take()
            self._source = policy
            self._mirror_sync()

    def attach_mirror(self, mirror: Mirror) -> None:
        """Let `mirror` pick for this pool while it is plain round robin: no affinity, no
        penalty, no PROXY header, no transparent source. The data plane reports each of its
        picks (`record_pick`) and every dial's outcome, as for the pool's own picks."""
        self._mirror_take()
        self.mirror = mirror
        self._mirror_sync()

    def record_pick(self, address: Address) -> None:
        """The mirror picked `address` (the native data plane reports each of its picks)."""
        index = self._index(address)
        if index is not None:
            self._record(index, ROUND_ROBIN)

    def _mirror_sync(self) -> None:
        """Show the mirror this pool while it is plain round robin; else keep it disabled."""
        mirror = self.mirror
        if mirror is None:
            return
        if mirror.enabled:
            self._cursor = mirror.disable()
        if (
            self._timeout is None
            and not self._penalties
            and not self._scheduler
            and not self._proxy_protocol
            and self._source is None
            and self._addresses
            and len(self._tallies) == len(self._addresses)
        ):
            mirror.show(self._addresses, self._tallies, self._cursor)

    @mirrored
    def _pick_mirrored(self, client_ip: str, retry: bool) -> Address | None:
        """`_pick` of a pool with a mirror: the cursor is the pool's while it picks."""
        return self._pick(client_ip, retry)

    def _pick(self, client_ip: str, retry: bool) -> Address | None:
        raise NotImplementedError

    def _mirror_take(self) -> None:
        """Before the pool reads or moves its cursor: take it back from an enabled mirror."""
        mirror = self.mirror
        if mirror is not None and mirror.enabled:
            self._cursor = mirror.disable()

    @property
    def scheduled(self) -> tuple[int, tuple[int, ...]]:
        """How this pool picks: (scheduler code, lc's shared-count slot per endpoint)."""
        return (self._scheduler, self._shared_slots)

    @mirrored
    def balance(self, balancing: Balancing) -> None:
        """Pick with `balancing.scheduler` and eject outliers here as `balancing` says (a
        single process: no control process decides for this pool)."""
        self.set_scheduler(balancing.scheduler)
        self._ejecting = balancing if balancing.outlier_failures > 0 else None
        if self._ejecting is None:
            self.outliers = None
        elif self.outliers is not None:
            self.outliers.failures = balancing.outlier_failures
            self.outliers.base = balancing.outlier_base_ejection

    def _record(self, index: int, kind: int) -> None:
        raise NotImplementedError

    def _penalised(self, address: Address, now: float) -> bool:
        raise NotImplementedError

    def _index(self, address: Address) -> int | None:
        raise NotImplementedError

    @property
    def scheduler(self) -> str:
        """The scheduler picking now (one of `model.SCHEDULERS`)."""
        return SCHEDULERS[self._scheduler]

    @mirrored
    def set_scheduler(self, name: str) -> None:
        """Pick with scheduler `name` from now on (one of `model.SCHEDULERS`; else rr)."""
        code = scheduler_code(name)
        if code != self._scheduler:
            self._scheduler = code
            self._maglev = None

    @mirrored
    def share_counts(self, counts: NodeCounts | None, worker: int, slots: tuple[int, ...]) -> None:
        """Count active connections in the node's shared `counts` (column `worker`), each
        endpoint in its slot of `slots` (parallel to the addresses; -1: not shared), so that
        least-connection picks see every worker's. `counts` None: this process's own."""
        if counts is None or worker < 0 or len(slots) != len(self._addresses):
            counts, slots = None, NO_SLOTS
        if (counts, worker, slots) == (self._counts, self._worker, self._shared_slots):
            return
        self._counts, self._worker, self._shared_slots = counts, worker, slots
        if self._tallies:  # in use (tallies are made at the first pick)
            self._tallies = self._tallied(self._addresses, self._tallies)

    def active_counts(self) -> list[tuple[Address, int]]:
        """Each usable endpoint's open connections as `lc` sees them (node-wide when the
        counts are shared), in round-robin order."""
        return [(a, self._load(i)) for i, a in enumerate(self._addresses)]

    def _tallied(
        self,
        addresses: tuple[Address, ...],
        tallies: tuple[EndpointTally, ...],
        old: tuple[Address, ...] | None = None,
    ) -> tuple[EndpointTally, ...]:
        """Tallies for `addresses`, taken over from `tallies` (of `old`; None: of the same
        addresses) while the address stays: shared ones (`SharedTally`) in this worker's cell
        of each endpoint's slot when the counts are shared, plain ones otherwise."""
        kept = dict(zip(addresses if old is None else old, tallies, strict=True))
        counts, slots = self._counts, self._shared_slots
        out: list[EndpointTally] = []
        for i, address in enumerate(addresses):
            tally = kept.pop(address, None)
            cell = -1 if counts is None else slots[i]
            if cell >= 0 and counts is not None:
                cell += self._worker * counts.slots
            if isinstance(tally, SharedTally) and tally._cell == cell >= 0:
                out.append(tally)
                continue
            if isinstance(tally, SharedTally):
                tally.detach()
            fresh = (
                EndpointTally() if cell < 0 or counts is None else SharedTally(counts.cells, cell)
            )
            if tally is not None:  # carried over: its counters go on
                fresh.total, fresh.bytes_in, fresh.bytes_out = (
                    tally.total,
                    tally.bytes_in,
                    tally.bytes_out,
                )
                fresh.dial_failures, fresh.active = tally.dial_failures, tally.active
            out.append(fresh)
        for gone in kept.values():
            if isinstance(gone, SharedTally):
                gone.detach()
        return tuple(out)

    def dial_succeeded(self, address: Address) -> None:
        """A dial to `address` connected (the data plane reports every one): a run of failed
        dials to it, if any, ends."""
        if self._suspects and address in self._suspects:
            self._recovered(address)

    @mirrored
    def _recovered(self, address: Address) -> None:
        """`address` connected after a failed dial (here, or another worker's)."""
        self._suspects.discard(address)
        if self.outliers is not None:
            self.outliers.succeeded(address)

    @mirrored
    def penalize(self, address: Address, seconds: float) -> None:
        """Skip `address` for `seconds` from now (a failed dial's penalty, or an ejection)."""
        if seconds > 0 and self._index(address) is not None:
            if not self._penalties:
                self._penalties = {}  # the pool's own (it may hold a shared empty one)
            until = self._clock() + seconds
            if until > self._penalties.get(address, 0.0):
                self._penalties[address] = until

    def _suspect(self, address: Address) -> float:
        """A dial to `address` failed: its next success is news (`_recovered`). The seconds
        it is ejected for when this pool decides ejections (0: not ejected)."""
        if self._suspects is _NO_SUSPECTS:
            self._suspects = set()
        self._suspects.add(address)
        outliers = self.outliers
        if outliers is None:  # made at the first failure: most pools never see one
            ejecting = self._ejecting
            if ejecting is None:
                return 0.0
            outliers = self.outliers = Outliers(
                self.name,
                failures=ejecting.outlier_failures,
                base=ejecting.outlier_base_ejection,
                clock=self._clock,
            )
        return outliers.failed(address, len(self._addresses))

    def _scheduled(
        self, addresses: tuple[Address, ...], count: int, now: float, retry: bool, client: str
    ) -> Address:
        """The pick of this pool's scheduler when it is not round robin."""
        if self._scheduler == LC:
            return self._least(addresses, count, now, retry)
        return self._hashed(addresses, count, now, retry, client)

    def _addresses_changed(self, addresses: tuple[Address, ...]) -> None:
        """The pool took new `addresses`: what was made for the old ones is dropped."""
        self._maglev = None
        if self._counts is not None:  # the slots were for the old list: the next table's
            self._counts, self._shared_slots = None, NO_SLOTS
        if self.outliers is not None:
            self.outliers.keep(addresses)
        if self._suspects:
            self._suspects = self._suspects & set(addresses)

    def _load(self, index: int) -> int:
        """Open connections to the endpoint at `index`: node-wide when shared, else here."""
        counts = self._counts
        if counts is not None:
            slot = self._shared_slots[index]
            if slot >= 0:
                return counts.load(slot)
        if not self._tallies:  # never picked from: nothing open
            return 0
        return self._tallies[index].active

    def _least(
        self, addresses: tuple[Address, ...], count: int, now: float, retry: bool
    ) -> Address:
        """lc: the usable endpoint with the fewest open connections; among equals, the first
        from the round-robin cursor (so ties go round robin)."""
        cursor = self._cursor
        best, fewest = -1, 0
        penalties = self._penalties
        for step in range(count):
            index = cursor + step
            if index >= count:
                index -= count
            if penalties and self._penalised(addresses[index], now):
                continue
            load = self._load(index)
            if best < 0 or load < fewest:
                best, fewest = index, load
                if not load:
                    break
        if best < 0:  # every endpoint is penalised: still try one, in round-robin order
            self._cursor = cursor + 1 if cursor + 1 < count else 0
            self._record(cursor, ALL_PENALIZED)
            return addresses[cursor]
        self._cursor = best + 1 if best + 1 < count else 0
        self._record(best, RETRY if retry else ROUND_ROBIN)
        return addresses[best]

    def _hashed(
        self, addresses: tuple[Address, ...], count: int, now: float, retry: bool, client: str
    ) -> Address:
        """sh: the client's entry of the Maglev table; past a penalised endpoint, the next
        entries in turn (the same ones in every worker, so the client still lands together)."""
        table = self._maglev
        if table is None:
            table = self._maglev = maglev_table(addresses)
        size = len(table)
        place = client_hash(client) % size
        first = table[place]
        if not self._penalties or not self._penalised(addresses[first], now):
            self._record(first, RETRY if retry else ROUND_ROBIN)
            return addresses[first]
        for step in range(1, size):
            index = table[(place + step) % size]
            if index != first and not self._penalised(addresses[index], now):
                self._record(index, RETRY)
                return addresses[index]
        self._record(first, ALL_PENALIZED)
        return addresses[first]
