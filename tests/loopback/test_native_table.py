"""Picks in the native core (`native.PoolTable`, the C `Table`): the same picks as
`balancer.EndpointPool` for the same events, and through real sockets, a pool in plain round
robin is picked in C until a dial fails, then in Python until it is plain again."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from kube_userspace_proxy.balancer import EndpointPool, source_policy
from kube_userspace_proxy.dataplane import ConnStats, native
from kube_userspace_proxy.model import DialOutcome, Protocol, ServicePortName

pytestmark = pytest.mark.skipif(
    native.unavailable().startswith("the C extension"), reason="the C extension is not built"
)

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
ENDPOINTS = tuple((f"10.0.0.{i}", 8080 + i) for i in range(1, 7))
CLIENTS = ("10.1.0.1", "10.1.0.2", "10.1.0.3", "fd00::9", "10.1.0.5")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pick_mirrored(pool: EndpointPool, table: native.PoolTable, client: str) -> Any:
    """What the native plane does for an accept: the table's pick while it is enabled (and
    the pool records it, as EV_FAST does), else the pool's own."""
    if table.enabled:
        _, data = table.table.pick()
        pool.record_pick(data[1])
        return data[1]
    return pool.pick(client)


@pytest.mark.parametrize("seed", range(6))
def test_native_table_picks_what_the_pool_would_for_the_same_events(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    mirrored = EndpointPool(WEB, clock=clock, penalty_seconds=1.0, slot=1, slots=3)
    plain = EndpointPool(WEB, clock=clock, penalty_seconds=1.0, slot=1, slots=3)
    table = native.PoolTable(250)
    mirrored.attach_mirror(table)
    for pool in (mirrored, plain):
        pool.take_addresses(ENDPOINTS[:4], affinity_timeout=None)
    in_core = picks = 0
    for step in range(3000):
        r = rng.random()
        client = rng.choice(CLIENTS)
        where = f"seed {seed}, step {step}"
        if r < 0.6:
            in_core += table.enabled
            got = _pick_mirrored(mirrored, table, client)
            assert got == plain.pick(client), where
            picks += 1
        elif r < 0.65:  # an accept of a listener that does not use the table (yet)
            assert mirrored.pick(client) == plain.pick(client), where
            picks += 1
        elif r < 0.68:  # a failed dial, then the retry on the ladder (always in Python)
            in_core += table.enabled
            got = _pick_mirrored(mirrored, table, client)
            assert got == plain.pick(client), where
            picks += 1
            if got is None:
                continue
            outcome = rng.choice(list(DialOutcome)[1:])
            mirrored.dial_failed(got, outcome)
            plain.dial_failed(got, outcome)
            assert not table.enabled, where  # a penalty: the pool is not plain any more
            assert mirrored.pick(client, retry=True) == plain.pick(client, retry=True), where
        elif r < 0.8:  # a success ends a run of failures (the outlier state)
            address = rng.choice(ENDPOINTS)
            mirrored.dial_succeeded(address)
            plain.dial_succeeded(address)
        elif r < 0.9:
            clock.now += rng.uniform(0.0, 1.5)
        elif r < 0.95:
            chosen = list(ENDPOINTS)
            rng.shuffle(chosen)
            addresses = tuple(chosen[: rng.randint(0 if rng.random() < 0.05 else 1, 6)])
            timeout = 10.0 if rng.random() < 0.1 else None
            mirrored.take_addresses(addresses, affinity_timeout=timeout)
            plain.take_addresses(addresses, affinity_timeout=timeout)
        elif r < 0.965:  # the pool stops being plain round robin for a while
            what = rng.random()
            if what < 0.4:
                scheduler = rng.choice(["lc", "sh"])
                mirrored.set_scheduler(scheduler)
                plain.set_scheduler(scheduler)
            elif what < 0.8:
                version = rng.choice([1, 2])
                mirrored.proxy_protocol = plain.proxy_protocol = version
            else:
                mirrored.source = plain.source = source_policy(("10.1.0.0/16",))
        elif r < 0.985:  # and is plain again
            mirrored.set_scheduler("rr")
            plain.set_scheduler("rr")
            mirrored.proxy_protocol = plain.proxy_protocol = 0
            mirrored.source = plain.source = None
        else:
            slot = rng.randrange(3)
            mirrored.take_slot(slot, 3)
            plain.take_slot(slot, 3)
        assert mirrored.penalized() == plain.penalized(), where
        if table.enabled:  # the core dials only what needs no header, source or pin
            assert mirrored.proxy_protocol == 0, where
            assert mirrored.source is None, where
            assert mirrored.affinity_timeout is None, where
            assert mirrored.scheduler == "rr", where
    assert mirrored.recent_picks() == plain.recent_picks()
    assert table.table.picks == in_core
    # The comparison means something only if the core picked often and Python did too.
    assert picks / 4 < in_core < picks, (in_core, picks)


def test_native_table_refuses_what_it_cannot_dial_and_keeps_its_entries() -> None:
    table = native.PoolTable(250)
    tally = object()
    table.show((("10.0.0.1", 80), ("10.0.0.2", 81)), (tally, tally), 1)
    assert table.enabled
    assert table.table.pick()[1][1] == ("10.0.0.2", 81)
    for entries in ([("10.0.0.300", 80, None)], [("10.0.0.1", 0, None)], [("web", 80, None)]):
        with pytest.raises(ValueError, match="not an endpoint"):
            table.table.set(entries, 0)
    with pytest.raises(ValueError, match="cursor"):
        table.table.set([("10.0.0.1", 80, None)], 1)
    with pytest.raises(ValueError, match="cursor"):
        table.table.resume(2)
    assert table.disable() == 0
    assert not table.enabled and table.table.pick() is None
    table.table.resume(1)
    assert table.table.pick()[1][1] == ("10.0.0.2", 81)  # the entries of the last set()
    # A pool whose address the core cannot dial stays in Python, and is not broken.
    pool = EndpointPool(WEB)
    pool.attach_mirror(native.PoolTable(250))
    pool.take_addresses((("fe80::1%eth0", 80),), affinity_timeout=None)
    assert pool.pick("10.1.0.1") == ("fe80::1%eth0", 80)
    assert pool.mirror is not None and not pool.mirror.enabled


async def _ask(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"hi\n")
        await writer.drain()
        return (await reader.readline()).decode().strip()
    finally:
        writer.close()
        await writer.wait_closed()


async def test_native_accepts_are_picked_in_the_core_until_a_dial_fails(
    tcp_backends: Any, tcp_listener: Any, eventually: Any
) -> None:
    backends = [await tcp_backends("name", n) for n in ("a", "b", "c")]
    pool = EndpointPool(WEB, penalty_seconds=2.0)
    pool.take_addresses(tuple(b.address for b in backends), affinity_timeout=None)
    stats = ConnStats()
    listener = await tcp_listener(pool, stats=stats, dataplane="native")
    port = listener.port
    names = [await _ask(port) for _ in range(30)]
    assert names == ["a", "b", "c"] * 10
    # The first pick was Python's (it made the pool's table); the core picked the rest.
    await eventually(lambda: stats.completed == 30)
    assert (stats.accepted, stats.core_picks) == (30, 29)
    assert [kind for _, kind in pool.recent_picks()][-29:] == ["round-robin"] * 29
    assert [t[1][1] for t in pool.tallies()] == [10, 10, 10]
    assert stats.active == 0

    # b stops listening: the core's dial to it is refused, Python dials the next one, and
    # picks while b is penalised.
    b_port = backends[1].address[1]
    await backends[1].close()
    before = stats.core_picks
    names = [await _ask(port) for _ in range(6)]
    assert "b" not in names
    assert stats.dial_failures >= 1
    assert stats.core_picks < before + 6
    # Once b's penalty is over the pool is plain round robin again and the core picks again;
    # b is back by then.
    await backends[1].start(b_port)
    seen: list[str] = []
    for _ in range(300):
        seen.append(await _ask(port))
        if stats.core_picks >= before + 6:
            break
        await asyncio.sleep(0.05)
    assert "b" in seen
    assert stats.core_picks >= before + 6, (stats, seen)
    assert stats.failed == 0
