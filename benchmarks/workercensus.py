"""Which Python objects a worker holds per service port: a census after a full table.

A `Worker` (workers/process.py) runs in this process, fed through a real channel a table of
`--ports` TCP ports on loopback (3 endpoints each, as a marshalled table arrives), then
`gc.get_objects()` is counted by type (shallow sizes; tuples and dicts the collector stopped
tracking are counted apart, through `gc.get_referents` of the tracked ones).

`--touch`: then one connection goes through every port (to backends this process serves), and
the census counts what that left behind, against the census after the table; with
`--tracemalloc` also the lines that allocated it (the top `--top`).

    .venv/bin/python benchmarks/workercensus.py [--ports 10000] [--touch [--tracemalloc]]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from workermem import Answer, touch  # noqa: E402

from kube_userspace_proxy.app.lifecycle import raise_nofile_limit  # noqa: E402
from kube_userspace_proxy.workers import protocol  # noqa: E402
from kube_userspace_proxy.workers.process import Worker  # noqa: E402
from kube_userspace_proxy.workers.protocol import Settings, Table  # noqa: E402

BACKEND = "127.0.0.2"
BACKEND_PORTS = range(18000, 18016)


def table(ports: list[int]) -> Table:
    listeners = []
    pools = {}
    routes = {}
    for i, port in enumerate(ports):
        key = ("TCP", "127.0.0.1", port)
        listeners.append((key, f"default/s{i}:p", i, 0))
        addresses = tuple((BACKEND, BACKEND_PORTS[(i + k) % 16]) for k in range(3))
        pools[i] = (("default", f"s{i}", "p", "TCP"), addresses, None, 0, (None, ()))
        routes[key] = (0,)
    return Table(1, Settings(0.25, 15.0), listeners, pools, routes)


def rss_kib() -> int:
    """This process's resident set in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


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


def report(title: str, before: list[tuple[str, int, int]], ports: int, top: int) -> None:
    """What the census after `title` holds more than `before`, by type."""
    after = census()
    base = {k: (n, b) for k, n, b in before}
    rows = [(k, n - base.get(k, (0, 0))[0], b - base.get(k, (0, 0))[1]) for k, n, b in after]
    rows.sort(key=lambda r: -r[2])
    total = sum(b for _, _, b in rows)
    per = total / ports
    print(f"{title}, {ports} ports: {total / 2**20:.1f} MiB of objects, {per:.0f} B a port")
    for kind, n, b in rows[:top]:
        print(f"{kind:40s} {n:8d} {b / 2**20:7.2f} MiB {b / ports:6.0f} B/port")


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
    if not args.touch:
        report("table", before, args.ports, args.top)
    else:
        loop = asyncio.get_running_loop()
        backends = [
            await loop.create_server(Answer, BACKEND, port, reuse_address=True)
            for port in BACKEND_PORTS
        ]
        await touch(ports[: min(64, len(ports))])  # what the first connections of a process make
        await asyncio.sleep(0.5)  # the proxy's sides of the connections close
        gc.collect()
        before = census()
        if args.tracemalloc:
            tracemalloc.start(args.frames)
            snapshot = tracemalloc.take_snapshot()
        rss = rss_kib()
        answered = await touch(ports)
        await asyncio.sleep(0.5)  # the proxy's sides of the connections close
        gc.collect()
        grew = (rss_kib() - rss) / 1024
        print(f"touched: {answered} of {len(ports)} answered; RSS {grew:+.1f} MiB")
        if args.tracemalloc:
            grown = tracemalloc.take_snapshot().compare_to(snapshot, "traceback")
            tracemalloc.stop()
            total = sum(s.size_diff for s in grown)
            print(f"traced: {total / 2**20:.2f} MiB more, {total / args.ports:.0f} B a port")
            for stat in grown[: args.top]:
                print(f"{stat.size_diff / args.ports:7.0f} B/port {stat.count_diff:+8d}")
                for line in stat.traceback.format()[-2 * args.frames :]:
                    print("    " + line.strip())
        report("touched", before, args.ports, args.top)
        for server in backends:
            server.close()
    await worker.drain(0.1)
    task.cancel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", type=int, default=10_000)
    parser.add_argument("--first-port", type=int, default=20000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--touch", action="store_true", help="then a connection through each port")
    parser.add_argument("--tracemalloc", action="store_true", help="with --touch: by line too")
    parser.add_argument("--frames", type=int, default=1, help="tracemalloc's frames per trace")
    args = parser.parse_args()
    raise_nofile_limit()
    import uvloop

    uvloop.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
