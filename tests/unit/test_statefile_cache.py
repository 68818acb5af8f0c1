"""The state file's encoder: a save after one change encodes that change only, on the loop
a slice at a time, and gives the same document as a fresh encode."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

from kube_userspace_proxy.model import (
    BalancingOverrides,
    Endpoint,
    ServicePortInfo,
    ServicePortName,
    Snapshot,
)
from kube_userspace_proxy.restart import statefile


def _snapshot(count: int) -> Snapshot:
    names = [ServicePortName("default", f"s{i}", "http") for i in range(count)]
    return Snapshot(
        services=MappingProxyType(
            {n: ServicePortInfo(n, 80, (f"10.96.0.{i % 250 + 1}",)) for i, n in enumerate(names)}
        ),
        endpoints=MappingProxyType({n: (Endpoint("10.244.1.5", 8080),) for n in names}),
        node_name="node-1",
    )


def _ports(snapshot: Snapshot) -> statefile.Ports:
    return {(str(name), "TCP", "cluster"): 40000 + i for i, name in enumerate(snapshot.services)}


def test_a_kept_encoding_equals_a_fresh_one_and_reencodes_only_the_changed_entry() -> None:
    first = _snapshot(50)
    encoder = statefile.Encoder()
    statefile.encode(first, {}, encoder)
    before = encoder.entries
    moved = ServicePortName("default", "s7", "http")
    endpoints = dict(first.endpoints)
    endpoints[moved] = (Endpoint("10.244.9.9", 8080),)
    second = replace(first, endpoints=MappingProxyType(endpoints))
    ports = {("default/s7:http", "TCP", "cluster"): 40007}
    assert statefile.encode(second, ports, encoder) == statefile.encode(second, ports)
    again = [name for name, text in encoder.entries.items() if text is not before[name]]
    assert again == [moved]
    decoded, decoded_ports = statefile.decode(
        statefile.encode(second, ports, encoder), node_name="node-1"
    )
    assert decoded.endpoints_of(moved) == (Endpoint("10.244.9.9", 8080),)
    assert dict(decoded.services) == dict(second.services) and decoded_ports == ports


def test_a_kept_encoding_follows_service_ports_and_proxy_ports_that_come_and_go() -> None:
    encoder = statefile.Encoder()
    first = _snapshot(600)
    statefile.encode(first, _ports(first), encoder)
    # 100 gone, 3 new ones (named to sort among the others), a proxy port moved.
    services = {
        n: i for n, i in first.services.items() if n.name not in {f"s{k}" for k in range(100)}
    }
    endpoints = {n: first.endpoints_of(n) for n in services}
    for extra in ("s3a", "s55x", "zz"):
        name = ServicePortName("default", extra, "http")
        services[name] = ServicePortInfo(name, 80, ("10.96.9.9",))
        endpoints[name] = (Endpoint("10.244.1.6", 8080),)
    second = replace(
        first, services=MappingProxyType(services), endpoints=MappingProxyType(endpoints)
    )
    ports = _ports(second)
    ports[("default/s300:http", "TCP", "cluster")] = 50000
    kept = statefile.encode(second, ports, encoder)
    assert kept == statefile.encode(second, ports)
    decoded, decoded_ports = statefile.decode(kept, node_name="node-1")
    assert dict(decoded.services) == services and decoded_ports == ports
    assert len(encoder.entries) == len(services)


def _yields(steps: Generator[None, None, list[bytes]]) -> int:
    """How many times the encoder gave the loop a turn before it was done."""
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration:
            return yields
        yields += 1


def test_the_encoder_yields_every_step_of_entries_and_proxy_port_lines() -> None:
    snapshot = _snapshot(3000)
    assert _yields(statefile.Encoder().steps(snapshot, _ports(snapshot))) >= 2 * 3000 // (
        statefile.STEP
    )


def test_the_pieces_written_make_the_document(tmp_path: Path) -> None:
    for count in (0, 1, 700):
        snapshot = _snapshot(count)
        ports = _ports(snapshot)
        pieces = asyncio.run(statefile.encode_sliced(statefile.Encoder(), snapshot, ports))
        statefile.write(str(tmp_path), pieces)
        assert statefile.path(str(tmp_path)).read_bytes() == statefile.encode(snapshot, ports)
        loaded = statefile.load(str(tmp_path), node_name="node-1")
        assert loaded is not None and dict(loaded[0].services) == dict(snapshot.services)
        assert loaded[1] == ports


def test_a_sliced_encode_gives_the_loop_turns_and_the_same_document() -> None:
    snapshot = _snapshot(3000)
    ports = _ports(snapshot)
    turns = 0

    async def run() -> list[bytes]:
        nonlocal turns
        done = False

        async def count_turns() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count_turns())
        await asyncio.sleep(0)
        turns = 0
        started = time.perf_counter()
        data = await statefile.encode_sliced(statefile.Encoder(), snapshot, ports)
        took = time.perf_counter() - started
        done = True
        await counter
        if took > 3 * statefile.SLICE_SECONDS:
            assert turns >= 1
        return data

    assert b"".join(asyncio.run(run())) == statefile.encode(snapshot, ports)


def test_the_encoder_yields_every_few_entries_it_encodes_anew() -> None:
    """Changed entries cost far more than unchanged ones: a step holds at most ENCODE_STEP
    of them, so a save after a storm of changes still gives the loop its turns."""
    snapshot = _snapshot(1000)
    encoder = statefile.Encoder()
    statefile.encode(snapshot, {}, encoder)
    changed = replace(
        snapshot,
        endpoints=MappingProxyType({n: (Endpoint("10.244.2.7", 8080),) for n in snapshot.services}),
    )
    assert _yields(encoder.steps(changed, {})) >= 1000 // statefile.ENCODE_STEP
    assert statefile.encode(changed, {}, encoder) == statefile.encode(changed, {})


def test_the_same_proxy_port_mapping_is_not_looked_through_again() -> None:
    """A save in an endpoint storm gets the very mapping of the last save (the proxy ports
    change only with a rule target): the encoder skips looking through its 3,000 keys; an
    equal new mapping is looked through, and both give the fresh encoder's document."""
    snapshot = _snapshot(3000)
    ports = _ports(snapshot)
    encoder = statefile.Encoder()
    statefile.encode(snapshot, ports, encoder)
    same = _yields(encoder.steps(snapshot, ports))
    equal = _yields(encoder.steps(snapshot, dict(ports)))
    assert equal - same >= 3000 // statefile.STEP - 1
    assert statefile.encode(snapshot, ports, encoder) == statefile.encode(snapshot, ports)
    moved = {**ports, ("default/s9:http", "TCP", "cluster"): 50009}
    assert statefile.encode(snapshot, moved, encoder) == statefile.encode(snapshot, moved)


def test_an_entry_leaves_out_the_fields_at_their_defaults_and_reads_back_whole() -> None:
    """Only the fields off their defaults are written (half the file, and half what the
    encoder keeps); the reader gives a missing one its default, as it did for the documents
    of earlier releases, which wrote every field: both read back to the same state."""
    plain = ServicePortName("default", "plain", "http")
    full = ServicePortName("default", "full", "https")
    infos = {
        plain: ServicePortInfo(plain, 80, ("10.96.0.1",)),
        full: ServicePortInfo(
            full,
            443,
            ("10.96.0.2", "fd00:96::2"),
            node_port=30443,
            external_ips=("203.0.113.4",),
            load_balancer_ips=("198.51.100.4",),
            client_ip_affinity=True,
            affinity_timeout_seconds=600,
            internal_traffic_local=True,
            external_traffic_local=True,
            health_check_node_port=32000,
            proxy_protocol=2,
            balancing=BalancingOverrides("lc", 3, 10.0),
        ),
    }
    snapshot = Snapshot(
        services=MappingProxyType(infos),
        endpoints=MappingProxyType({n: (Endpoint("10.244.1.5", 8080),) for n in infos}),
        node_name="node-1",
    )
    data = statefile.encode(snapshot, {})
    document = json.loads(data)
    written = {tuple(e["name"][:2]): e["info"] for e in document["servicePorts"]}
    assert written[("default", "plain")] == {"port": 80, "cluster_ips": ["10.96.0.1"]}
    assert len(written[("default", "full")]) == len(dataclasses.fields(ServicePortInfo)) - 1
    decoded, _ = statefile.decode(data, node_name="node-1")
    assert dict(decoded.services) == infos
    # As earlier releases wrote it: every field, those at their defaults too.
    for entry in document["servicePorts"]:
        name = ServicePortName(*entry["name"][:3])
        entry["info"] = {
            f.name: list(v)
            if isinstance(v := statefile._plain(getattr(infos[name], f.name)), tuple)
            else v
            for f in dataclasses.fields(ServicePortInfo)
            if f.name != "name"
        }
    older, _ = statefile.decode(json.dumps(document).encode(), node_name="node-1")
    assert dict(older.services) == infos
    assert dict(older.endpoints) == dict(decoded.endpoints) == dict(snapshot.endpoints)


def test_an_encode_left_before_its_end_leaves_no_line_taken_for_current() -> None:
    """The proxy-port lines are kept per key, valid for the mapping they were encoded from:
    an encode abandoned among them (a save cancelled at shutdown) must not leave a line of
    its mapping that a later encode takes for another's."""
    snapshot = _snapshot(3000)
    first = _ports(snapshot)
    moved = {key: port + 5000 for key, port in first.items()}
    encoder, twin = statefile.Encoder(), statefile.Encoder()
    statefile.encode(snapshot, first, encoder)
    statefile.encode(snapshot, first, twin)
    total = _yields(twin.steps(snapshot, moved))  # what the same encode gives the loop
    steps = encoder.steps(snapshot, moved)
    for _ in range(total - 3):  # into the proxy-port lines, most of them encoded anew
        next(steps)
    steps.close()
    back = dict(first)  # equal to the first mapping, not the same object
    assert statefile.encode(snapshot, back, encoder) == statefile.encode(snapshot, back)
    assert statefile.encode(snapshot, moved, encoder) == statefile.encode(snapshot, moved)
