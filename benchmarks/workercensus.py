"""Which Python objects a worker holds per service port: a census after a full table.

A `Worker` (workers/process.py) runs in this process, fed through a real channel a table of
`--ports` TCP ports on loopback (3 endpoints each, as a marshalled table arrives), then
`gc.get_objects()` is counted by type (shallow sizes; tuples and dicts the collector stopped
tracking are counted apart, through `gc.get_referents` of the tracked ones).

    .venv/bin/python benchmarks/workercensus.py [--ports 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kube_userspace_proxy.app.lifecycle import raise_nofile_limit  # noqa: E402
from kube_userspace_proxy.workers import protocol  # noqa: E402
from kube_userspace_proxy.workers.process import Worker  # noqa: E402
from kube_userspace_proxy.workers.protocol import Settings, Table  # noqa: E402

BACKEND = "127.0.0.2"


def table(ports: list[int]) -> Table:
    listeners = []
    pools = {}
    routes = {}
    for i, port in enumerate(ports):
        key = ("TCP", "127.0.0.1", port)
        listeners.append((key, f"default/s{i}:p", i, 0))
        addresses = tuple((BACKEND, 18000 + (i + k) % 16) for k in range(3))
        pools[i] = (("default", f"s{i}", "p", "TCP"), addresses, None, 0, (None, ()))
        routes[key] = (0,)
    return Table(1, Settings(0.25, 15.0), listeners, pools, routes)


def census() -> list[tuple[str, int, int]]:
    """(type, count, bytes) of every object the collector sees, and the untracked tuples and
    dicts they refer to, largest first."""
    gc.collect()
    objects = gc.get_objects()
    seen = {id(o) for o in objects}
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for o in objects:
        kind = type(o).__qualname__
        counts[kind] += 1
        sizes[kind] += sys.getsizeof(o)
        for r in gc.get_referents(o):
            if id(r) in seen:
                continue
            seen.add(id(r))
            kind = ("untracked " if type(r) in (tuple, dict) else "") + type(r).__qualname__
            counts[kind] += 1
            sizes[kind] += sys.getsizeof(r)
    return sorted(((k, counts[k], sizes[k]) for k in counts), key=lambda r: -r[2])


async def run(args: argparse.Namespace) -> None:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    worker = Worker(0, reader, writer, slots=1)
    task = asyncio.create_task(worker.run())
    peer_reader, peer_writer = await asyncio.open_unix_connection(sock=theirs)
    await protocol.receive(peer_reader)  # Hello
    ports = list(range(args.first_port, args.first_port + args.ports))
    before = census()
    peer_writer.write(protocol.encode(table(ports)))
    applied = await protocol.receive(peer_reader)
    assert isinstance(applied, protocol.Applied), applied
    del applied
    # A heartbeat, as the control process sends every second: the worker's loop lets go of
    # the table it read (held as its last message until the next one arrives).
    peer_writer.write(protocol.encode(protocol.Ping(2)))
    await protocol.receive(peer_reader)
    gc.unfreeze()
    after = census()
    base = {k: (n, b) for k, n, b in before}
    rows = [(k, n - base.get(k, (0, 0))[0], b - base.get(k, (0, 0))[1]) for k, n, b in after]
    rows.sort(key=lambda r: -r[2])
    total = sum(b for _, _, b in rows)
    per = total / args.ports
    print(f"{args.ports} ports: {total / 2**20:.1f} MiB of objects, {per:.0f} B a port")
    for kind, n, b in rows[: args.top]:
        print(f"{kind:40s} {n:8d} {b / 2**20:7.2f} MiB {b / args.ports:6.0f} B/port")
    await worker.drain(0.1)
    task.cancel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", type=int, default=10_000)
    parser.add_argument("--first-port", type=int, default=20000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    raise_nofile_limit()
    import uvloop

    uvloop.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
