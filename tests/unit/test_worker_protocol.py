"""The control process <-> worker protocol: every message survives the channel unchanged."""

from __future__ import annotations

import asyncio
import marshal
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kube_userspace_proxy.workers import protocol
from kube_userspace_proxy.workers.protocol import (
    Adopt,
    Adopted,
    Adopting,
    Applied,
    Become,
    Collect,
    Collected,
    Delta,
    Drain,
    Drained,
    Eject,
    Export,
    Exported,
    Hello,
    Membership,
    Message,
    Penalty,
    Ping,
    Pong,
    PoolView,
    Recovered,
    Settings,
    Steer,
    Table,
)

KEY = ("TCP", "10.0.0.1", 30080)
UDP_KEY = ("UDP", "fd00::1", 30053)
POOL = (
    ("default", "web", "http", "TCP"),
    (("10.1.0.1", 8080), ("10.1.0.2", 8080)),
    10800.0,
    0,
    (("10.244.1.0/24",), (("10.1.0.1", 8080),)),
    (1, (0, 5)),  # lc, each endpoint's slot in the shared counts
)
SETTINGS = Settings(0.25, 15.0)
VIEW = PoolView(
    3,
    (("10.2.0.1", ("10.1.0.1", 8080), 10799.5),),
    ((("10.1.0.1", 8080), (1, 7, 100, 200, 0)),),
    ((("10.1.0.1", 8080), "affinity"),),
    ((("10.1.0.2", 8080), 0.8),),
)

EVERY_MESSAGE: list[Message] = [
    Table(1, SETTINGS, [(KEY, "default/web:http", 7, 0)], {7: POOL}, {KEY: (0, 1)}),
    Delta(2, SETTINGS, [(UDP_KEY, "default/dns:dns", 8, 1)], [KEY], {8: POOL}, {}),
    Steer({KEY: (1, 0), UDP_KEY: (-1, 0, 1)}),
    Ping(3),
    Become(1),
    Penalty(7, ("10.1.0.2", 8080)),
    Eject(7, ("10.1.0.2", 8080), 30.0),
    Recovered(7, ("10.1.0.2", 8080)),
    Collect(4, True),
    Adopt(5, "/run/kube-userspace-proxy/.handover-1-0.sock"),
    Export(6, "/run/kube-userspace-proxy/.handover-1-0.sock"),
    Drain(7, 30.0, False),
    Hello(0, 4242),
    Pong(3, 1),
    Applied(1, 0, [Membership(True, KEY), Membership(False, UDP_KEY)], [UDP_KEY]),
    Collected(4, 1, {"default/web:http": (1, 2, 3)}, {7: protocol.pack_view(VIEW)}, True),
    Adopting(5, 0, ""),
    Adopted(5, 0, 12, ""),
    Exported(6, 1, 0, "OSError(24, 'Too many open files')"),
    Drained(7, 1),
]


def _round_trip(message: Message) -> Message:
    """Encode -> channel bytes -> decode, through a real socketpair."""

    async def run() -> Message:
        ours, theirs = socket.socketpair()
        _, writer = await asyncio.open_unix_connection(sock=ours)
        reader, their_writer = await asyncio.open_unix_connection(sock=theirs)
        try:
            protocol.send(writer, message)
            await writer.drain()
            return await protocol.receive(reader)
        finally:
            writer.close()
            their_writer.close()

    return asyncio.run(run())


def test_every_message_kind_is_covered() -> None:
    assert {type(m) for m in EVERY_MESSAGE} == set(protocol._KINDS)


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_a_message_comes_out_of_the_channel_as_it_went_in(message: Message) -> None:
    received = _round_trip(message)
    assert type(received) is type(message)
    assert received == message


def test_records_inside_messages_come_back_as_their_declared_types() -> None:
    applied = protocol.decode(_frame(next(m for m in EVERY_MESSAGE if isinstance(m, Applied))))
    assert isinstance(applied, Applied)
    assert all(isinstance(change, Membership) for change in applied.changes)
    table = protocol.decode(_frame(next(m for m in EVERY_MESSAGE if isinstance(m, Table))))
    assert isinstance(table, Table) and isinstance(table.settings, Settings)


def test_a_pool_view_survives_packing() -> None:
    unpacked = protocol.unpack_view(protocol.pack_view(VIEW))
    assert isinstance(unpacked, PoolView) and unpacked == VIEW


def test_tables_travel_as_marshal_not_pickle() -> None:
    """The fast path: a table is plain tuples on the wire (pickle is 3x slower to read)."""
    table = next(m for m in EVERY_MESSAGE if isinstance(m, Table))
    assert protocol.encode(table)[4:5] == b"m"


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        protocol.decode(("gossip", 1))


def test_a_message_with_missing_fields_is_refused() -> None:
    with pytest.raises(ValueError, match="malformed"):
        protocol.decode(("pong", 1))


def _frame(message: Message) -> tuple[object, ...]:
    """The plain tuple `message` travels as (what `channel.receive` hands `decode`)."""
    body = protocol.encode(message)
    return tuple(marshal.loads(body[5:]))


keys = st.tuples(
    st.sampled_from(["TCP", "UDP"]),
    st.sampled_from(["127.0.0.1", "10.96.0.10", "fd00::a"]),
    st.integers(1, 65535),
)
addresses = st.tuples(st.text(max_size=40), st.integers(0, 65535))
pools = st.tuples(
    st.tuples(st.text(), st.text(), st.text(), st.sampled_from(["TCP", "UDP", "SCTP"])),
    st.lists(addresses, max_size=5).map(tuple),
    st.none() | st.floats(0, 86400),
    st.integers(0, 2),
    st.tuples(
        st.none() | st.lists(st.text(max_size=20), max_size=3).map(tuple),
        st.lists(addresses, max_size=3).map(tuple),
    ),
)
listeners = st.lists(st.tuples(keys, st.text(), st.integers(1, 10**6), st.integers(0, 1)))
routes = st.dictionaries(keys, st.lists(st.integers(-1, 63), max_size=8).map(tuple))
settings = st.builds(Settings, st.floats(0, 3600), st.floats(0, 3600))


@given(
    st.builds(
        Delta,
        st.integers(0, 2**62),
        settings,
        listeners,
        st.lists(keys),
        st.dictionaries(st.integers(1, 10**6), pools),
        routes,
    )
)
def test_any_delta_comes_back_equal(delta: Delta) -> None:
    assert protocol.decode(_frame(delta)) == delta


@given(
    st.builds(
        Applied,
        st.integers(0, 2**62),
        st.integers(-2, 63),
        st.lists(st.builds(Membership, st.booleans(), keys)),
        st.lists(keys),
    )
)
def test_any_applied_comes_back_equal(applied: Applied) -> None:
    assert protocol.decode(_frame(applied)) == applied


@given(
    st.builds(
        Collected,
        st.integers(0, 2**62),
        st.integers(0, 63),
        st.dictionaries(st.text(), st.lists(st.integers(0, 2**62), max_size=12).map(tuple)),
        st.dictionaries(st.integers(1, 10**6), st.binary()),
        st.booleans(),
    )
)
def test_any_collected_part_comes_back_equal(part: Collected) -> None:
    assert protocol.decode(_frame(part)) == part
