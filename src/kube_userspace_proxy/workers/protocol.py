"""Every message between the control process and its workers, one declared type per kind.

Both sides import this module (the worker process too: it imports only the data plane and the
standard library). On the channel a message travels as a plain tuple, its kind's tag first,
then its fields, nested records as plain tuples too: marshal refuses tuple subclasses and
reads plain tuples about three times faster than pickle (a table of 10,000 ports is 1.5 MB).
`encode` and `receive` convert at the edge; nothing past them reads a message by position.

The two records a table holds 10,000 of, `ListenerEntry` and `PoolEntry`, are typed plain
tuples, read by unpacking: a NamedTuple each would cost both processes a conversion per entry
at the edge (at 10,000 ports that doubled the worker's decoding time and added ~15 % to a
full publish).

Control process -> worker: `Table`, `Delta`, `Steer`, `Ping`, `Become`, `Penalty` (passed
on from another worker), `Eject`, `Collect`, `Adopt`, `Export`, `Drain`.
Worker -> control process: `Hello`, `Pong`, `Applied`, `Penalty`, `Recovered`, `Collected`,
`Adopting`, `Adopted`, `Exported`, `Drained`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, NamedTuple

from kube_userspace_proxy.balancer import Transparency
from kube_userspace_proxy.model import Address, SocketKey
from kube_userspace_proxy.workers import channel

Routes = dict[SocketKey, tuple[int, ...]]
"""Per reuseport group: the group index of each worker's socket (`steering.route_for`)."""
Pin = tuple[str, Address, float]
"""A ClientIP pin: (client ip, endpoint, seconds left)."""


# ---- records inside messages ------------------------------------------------------------------


class Settings(NamedTuple):
    """The data-plane settings every table and delta carries."""

    udp_idle_timeout: float
    tcp_keepalive: float


ListenerEntry = tuple[SocketKey, str, int, int]
"""One port to serve: (its socket's key, its service port's name, its pool's id, IPV6_V6ONLY)."""
PoolName = tuple[str, str, str, str]
"""A pool's service port: (namespace, name, port, protocol), plain strings (10,000 dataclasses
unpickle in 0.1 s)."""
Scheduled = tuple[int, tuple[int, ...]]
"""How a pool picks: (its scheduler: `schedulers.RR`, `LC` or `SH`; lc: each endpoint's slot
in the node's shared counts, `nodecounts`, -1 for none; otherwise ())."""
PoolEntry = tuple[PoolName, tuple[Address, ...], float | None, int, Transparency, Scheduled]
"""One endpoint pool: (its name, its endpoints, its affinity timeout or None, its PROXY
protocol version or 0, its transparent-dialing inputs: `balancer.Transparency`, how it
picks: `Scheduled`)."""


class Membership(NamedTuple):
    """A worker's socket joined (or left) the reuseport group of `key`."""

    joined: bool
    key: SocketKey


class PoolView(NamedTuple):
    """What one worker's copy of a pool did, for the debug views (`pack_view`ed)."""

    pins: int
    shown: tuple[Pin, ...]
    tallies: tuple[tuple[Address, tuple[int, int, int, int, int]], ...]
    recent: tuple[tuple[Address, str], ...]
    penalized: tuple[tuple[Address, float], ...]


# ---- control process -> worker ----------------------------------------------------------------


class Table(NamedTuple):
    """The whole table: every port to serve (to a worker that takes a slot)."""

    seq: int
    settings: Settings
    listeners: list[ListenerEntry]
    pools: dict[int, PoolEntry]
    routes: Routes


class Delta(NamedTuple):
    """The ports changed since the last table or delta (`removed`: no longer served)."""

    seq: int
    settings: Settings
    listeners: list[ListenerEntry]
    removed: list[SocketKey]
    pools: dict[int, PoolEntry]
    routes: Routes


class Steer(NamedTuple):
    """New routes for groups whose members changed: attach their programs."""

    routes: Routes


class Ping(NamedTuple):
    """Is the worker's event loop running? (answered with `Pong`)"""

    seq: int


class Become(NamedTuple):
    """The spare takes over slot `worker` (becomes worker number `worker`)."""

    worker: int


class Penalty(NamedTuple):
    """A dial to `address` of pool `pool_id` failed: skip it for a while (worker -> control
    process -> every other worker)."""

    pool_id: int
    address: Address


class Eject(NamedTuple):
    """Endpoint `address` of pool `pool_id` is ejected for `seconds` from now (the control
    process decided, from the workers' `Penalty` and `Recovered` reports)."""

    pool_id: int
    address: Address
    seconds: float


class Recovered(NamedTuple):
    """A dial to `address` of pool `pool_id` connected after a failed one (in this worker or
    another): its run of failures is over (worker -> control process)."""

    pool_id: int
    address: Address


class Collect(NamedTuple):
    """Report the counters (`debug`: each pool's `PoolView` too), in `Collected` parts."""

    seq: int
    debug: bool


class Adopt(NamedTuple):
    """Listen at `path` for the sockets of this slot's worker in the process being replaced."""

    seq: int
    path: str


class Export(NamedTuple):
    """Send every served socket to the worker listening at `path`."""

    seq: int
    path: str


class Drain(NamedTuple):
    """Stop accepting, give connections `grace` seconds, exit (`release`: the sockets were
    handed over; close this process's descriptors only)."""

    seq: int
    grace: float
    release: bool


# ---- worker -> control process ----------------------------------------------------------------


class Hello(NamedTuple):
    """The worker started and reads its channel."""

    worker: int
    pid: int


class Pong(NamedTuple):
    """The answer to `Ping`."""

    seq: int
    worker: int


class Applied(NamedTuple):
    """A table or delta applied: the group joins and leaves it made, in order, and the ports
    it could not open (sent again later)."""

    seq: int
    worker: int
    changes: list[Membership]
    unserved: list[SocketKey]


class Collected(NamedTuple):
    """One part of the answer to `Collect`: counters per service port name, `pack_view`ed
    pool views per pool id; `last` ends the answer."""

    seq: int
    worker: int
    counters: dict[str, tuple[int, ...]]
    views: dict[int, bytes]
    last: bool


class Adopting(NamedTuple):
    """The worker listens for its predecessor's sockets (`error`: it cannot)."""

    seq: int
    worker: int
    error: str


class Adopted(NamedTuple):
    """The predecessor's sockets arrived: how many (`error`: they did not)."""

    seq: int
    worker: int
    sockets: int
    error: str


class Exported(NamedTuple):
    """The worker sent its sockets: how many (`error`: it could not)."""

    seq: int
    worker: int
    sockets: int
    error: str


class Drained(NamedTuple):
    """The worker drained and exits now."""

    seq: int
    worker: int


ToWorker = (
    Table | Delta | Steer | Ping | Become | Penalty | Eject | Collect | Adopt | Export | Drain
)
FromWorker = (
    Hello
    | Pong
    | Applied
    | Penalty
    | Recovered
    | Collected
    | Adopting
    | Adopted
    | Exported
    | Drained
)
Message = ToWorker | FromWorker
Reply = Applied | Adopting | Adopted | Exported | Drained
"""The answers to one request, matched to it by `seq`."""


# ---- the channel's edge: declared types <-> plain tuples --------------------------------------


def _table_out(message: Table) -> tuple[object, ...]:
    seq, settings, listeners, pools, routes = message
    return (seq, tuple(settings), listeners, pools, routes)


def _table_in(fields: tuple[Any, ...]) -> Table:
    seq, settings, listeners, pools, routes = fields
    return Table(seq, Settings._make(settings), listeners, pools, routes)


def _delta_out(message: Delta) -> tuple[object, ...]:
    seq, settings, listeners, removed, pools, routes = message
    return (seq, tuple(settings), listeners, removed, pools, routes)


def _delta_in(fields: tuple[Any, ...]) -> Delta:
    seq, settings, listeners, removed, pools, routes = fields
    return Delta(seq, Settings._make(settings), listeners, removed, pools, routes)


def _applied_out(message: Applied) -> tuple[object, ...]:
    seq, worker, changes, unserved = message
    return (seq, worker, list(map(tuple, changes)), unserved)


def _applied_in(fields: tuple[Any, ...]) -> Applied:
    seq, worker, changes, unserved = fields
    return Applied(seq, worker, list(map(Membership._make, changes)), unserved)


_Encoder = Callable[[Any], tuple[object, ...]]
_Decoder = Callable[[tuple[Any, ...]], Any]
_KINDS: dict[type[Any], tuple[str, _Encoder, _Decoder]] = {
    Table: ("table", _table_out, _table_in),
    Delta: ("delta", _delta_out, _delta_in),
    Applied: ("applied", _applied_out, _applied_in),
    # The rest hold plain values only: the fields as they are.
    **{
        kind: (kind.__name__.lower(), tuple, kind._make)
        for kind in (
            Steer,
            Ping,
            Become,
            Penalty,
            Eject,
            Recovered,
            Collect,
            Adopt,
            Export,
            Drain,
            Hello,
            Pong,
            Collected,
            Adopting,
            Adopted,
            Exported,
            Drained,
        )
    },
}
_DECODERS: dict[str, _Decoder] = {tag: decode for tag, _, decode in _KINDS.values()}


def encode(message: Message) -> bytes:
    """`message` framed for the channel (encode once to send the same delta to every worker)."""
    tag, to_fields, _ = _KINDS[type(message)]
    return channel.encode((tag, *to_fields(message)))


def decode(frame: tuple[Any, ...]) -> Message:
    """The message a channel frame (a plain tuple: tag, fields) carries."""
    decoder = _DECODERS.get(frame[0]) if isinstance(frame[0], str) else None
    if decoder is None:
        raise ValueError(f"unknown channel message kind {frame[0]!r}")
    try:
        message: Message = decoder(frame[1:])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed {frame[0]!r} message: {exc}") from None
    return message


def send(writer: asyncio.StreamWriter, message: Message | bytes) -> None:
    """Queue `message` (or one `encode`d already) on the channel; never blocks."""
    writer.write(message if isinstance(message, bytes) else encode(message))


async def receive(reader: asyncio.StreamReader) -> Message:
    """The next message; raises asyncio.IncompleteReadError at end of stream, ValueError
    for a frame that is not a message."""
    return decode(await channel.receive(reader))


def pack_view(view: PoolView) -> bytes:
    """`view` as one bytes object (a `Collected` part carries it so; see `Collected`)."""
    return channel.pack(tuple(view))


def unpack_view(data: bytes) -> PoolView:
    """The view `pack_view` packed."""
    return PoolView._make(channel.unpack(data))
