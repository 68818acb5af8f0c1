"""The embedded demo: the bundled manifests served to three local "pods", with the spread shown.

No cluster and no root: the backends listen on 127.0.0.11-13 (all of 127.0.0.0/8 is local on
Linux), the proxy ports on 127.0.0.1, and no iptables rule is installed; the rules that would
capture the ClusterIPs and NodePorts are printed instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.resources
import socket
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path as FsPath
from typing import cast

from kube_userspace_proxy import app, logs
from kube_userspace_proxy.config.settings import ProxyConfig
from kube_userspace_proxy.model import Protocol, ServicePortName
from kube_userspace_proxy.portals import explain

log = logs.get(__name__)

PODS = (("pod-a", "127.0.0.11"), ("pod-b", "127.0.0.12"), ("pod-c", "127.0.0.13"))
HTTP_PORT = 8080
UDP_PORT = 5353
EXAMPLE_NODE_IP = "172.18.0.2"  # a typical kind node address, for the printed rules only
MYAPP = ServicePortName("demo", "myapp", "http", Protocol.TCP)
STICKY = ServicePortName("demo", "myapp-sticky", "http", Protocol.TCP)
ECHO = ServicePortName("demo", "echo-udp", "echo", Protocol.UDP)


@contextlib.contextmanager
def bundled_manifests() -> Iterator[FsPath]:
    """The packaged demo manifest directory as a real path (works from any directory)."""
    ref = importlib.resources.files("kube_userspace_proxy") / "manifests"
    with importlib.resources.as_file(ref) as path:
        yield FsPath(path)


class _HttpPod(asyncio.Protocol):
    """A tiny HTTP/1.0 server that answers every request with its pod name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if b"\r\n\r\n" in self.buffer and self.transport is not None:
            body = f"{self.name}\n".encode()
            head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            self.transport.write(head.encode() + body)
            self.transport.close()


class _UdpPod(asyncio.DatagramProtocol):
    """Echoes each datagram prefixed with the pod name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if self.transport is not None:
            self.transport.sendto(self.name.encode() + b": " + data, addr)


async def start_pods() -> list[asyncio.AbstractServer | asyncio.BaseTransport]:
    """Start the three demo pods (HTTP on :8080 and UDP echo on :5353 of 127.0.0.11-13)."""
    loop = asyncio.get_running_loop()
    opened: list[asyncio.AbstractServer | asyncio.BaseTransport] = []
    try:
        for name, ip in PODS:
            server = await loop.create_server(
                functools.partial(_HttpPod, name), ip, HTTP_PORT, reuse_address=True
            )
            opened.append(server)
            transport, _ = await loop.create_datagram_endpoint(
                functools.partial(_UdpPod, name), local_addr=(ip, UDP_PORT)
            )
            opened.append(transport)
    except OSError as exc:
        for item in opened:
            item.close()
        raise OSError(
            exc.errno,
            f"demo pods need 127.0.0.11-13 ports {HTTP_PORT}/tcp and {UDP_PORT}/udp: "
            f"{exc.strerror} (another demo running?)",
        ) from exc
    return opened


async def http_get(host: str, port: int, *, source: str = "127.0.0.1") -> str:
    """One HTTP/1.0 request; the body (the pod's name) stripped."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    writer.write(b"GET / HTTP/1.0\r\nHost: myapp\r\n\r\n")
    data = await reader.read()
    writer.close()
    return data.partition(b"\r\n\r\n")[2].decode().strip()


async def udp_ask(host: str, port: int, payload: bytes) -> str:
    """Send one datagram from a fresh client socket; return the reply's pod name."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.connect((host, port))
        await loop.sock_sendall(sock, payload)
        reply = await asyncio.wait_for(loop.sock_recv(sock, 65536), 2.0)
    return reply.decode().partition(":")[0]


def spread_table(title: str, counts: Counter[str], total: int) -> str:
    """A small table: backend, requests, share and a bar."""
    lines = [title, f"  {'backend':<24}{'requests':>9}{'share':>8}"]
    for name, ip in PODS:
        n = counts.get(name, 0)
        share = n / total if total else 0.0
        lines.append(
            f"  {name + ' (' + ip + ')':<24}{n:>9}{share:>8.0%}  {'#' * round(share * 30)}"
        )
    return "\n".join(lines)


def demo_config(manifests: FsPath) -> ProxyConfig:
    """The demo's proxy: loopback only, no rules, ephemeral ops ports."""
    return ProxyConfig(
        bind_address="127.0.0.1",
        manifests=(str(manifests),),
        iptables_backend="none",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
        hostname_override="demo-node",
        nodeport_addresses=("127.0.0.1/32",),
        min_sync_period=0.1,
        shutdown_grace=1.0,
        state_dir="",  # the demo leaves nothing behind
    )


async def _show(proxy: app.Proxy, requests: int, out: list[str]) -> None:
    assert proxy.synced_once is not None
    await asyncio.wait_for(proxy.synced_once.wait(), 10)
    proxier = proxy.proxier
    port = proxier.port_of(MYAPP)
    counts = Counter([await http_get("127.0.0.1", port) for _ in range(requests)])
    out.append(
        spread_table(
            f"{MYAPP}  ClusterIP 10.96.0.10:80 -> proxy port 127.0.0.1:{port}, round robin:",
            counts,
            requests,
        )
    )
    port = proxier.port_of(STICKY)
    counts = Counter([await http_get("127.0.0.1", port) for _ in range(requests)])
    out.append(
        spread_table(
            f"{STICKY}  sessionAffinity ClientIP -> proxy port 127.0.0.1:{port}, one client:",
            counts,
            requests,
        )
    )
    port = proxier.port_of(ECHO)
    udp = Counter([await udp_ask("127.0.0.1", port, b"ping %d" % i) for i in range(requests)])
    out.append(
        spread_table(
            f"{ECHO}  UDP -> proxy port 127.0.0.1:{port}, one datagram per client socket:",
            udp,
            requests,
        )
    )
    lines = explain(proxier.proxied_ports(), node_ips=(EXAMPLE_NODE_IP,))
    rules = [f"  {rule}\n      # {why}" for rule, why in lines]
    out.append(
        "iptables rules that would capture these Services on a node with IP "
        f"{EXAMPLE_NODE_IP} (not installed by the demo; `kube-userspace-proxy rules` shows them "
        "for any manifests):\n" + "\n".join(rules)
    )


async def _run(serve: bool, requests: int) -> int:
    pods = await start_pods()
    try:
        with bundled_manifests() as manifests:
            config = demo_config(manifests)
            stop = asyncio.Event()
            out: list[str] = []
            failure: list[BaseException] = []

            async def started(proxy: app.Proxy) -> None:
                async def drive() -> None:
                    try:
                        await _show(proxy, requests, out)
                        print("\n\n".join(out), flush=True)
                        if serve:
                            _print_try(proxy)
                            await _trickle(proxy, stop)
                    except Exception as exc:  # reported below, then the demo stops
                        failure.append(exc)
                    finally:
                        if not serve or failure:
                            stop.set()

                task = asyncio.create_task(drive(), name="demo")
                _tasks.add(task)
                task.add_done_callback(_tasks.discard)

            code = await app.serve(config, stop=stop, started=started)
            if failure:
                print(f"demo failed: {failure[0]!r}", file=sys.stderr)
                return 1
            return code
    finally:
        for item in pods:
            item.close()


_tasks: set[asyncio.Task[None]] = set()


TRICKLE_PERIOD = 1.5
"""Seconds between two rounds of demo traffic while serving."""
TRICKLE_ROUNDS = 57600
"""Rounds before the trickle stops by itself (a day)."""


async def _trickle(proxy: app.Proxy, stop: asyncio.Event) -> None:
    """A little traffic through each demo Service, so /debug/ui has something to show."""
    proxier = proxy.proxier
    for i in range(TRICKLE_ROUNDS):
        if stop.is_set():
            return
        try:
            await http_get("127.0.0.1", proxier.port_of(MYAPP))
            # Two client addresses: the sticky Service pins each to its own endpoint.
            source = "127.0.0.1" if i % 2 else "127.0.0.2"
            await http_get("127.0.0.1", proxier.port_of(STICKY), source=source)
            await udp_ask("127.0.0.1", proxier.port_of(ECHO), b"ping %d" % i)
        except (OSError, TimeoutError) as exc:  # e.g. a Service being reloaded: try again
            log.debug("demo traffic: %r", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), TRICKLE_PERIOD)


def udp_command(port: int) -> str:
    """A shell command that sends one datagram to `port` and prints the reply, with nothing
    but Python (which the proxy needs anyway): `nc` is often not installed."""
    return (
        "python3 -c 'import socket as s; c = s.socket(s.AF_INET, s.SOCK_DGRAM); c.settimeout(2);"
        f' c.sendto(b"hi", ("127.0.0.1", {port})); print(c.recv(512).decode())\''
    )


def _print_try(proxy: app.Proxy) -> None:
    proxier = proxy.proxier
    ops = proxy.ops
    print("\nServing until Ctrl-C. Try:")
    print(f"  curl -s http://127.0.0.1:{proxier.port_of(MYAPP)}/        # {MYAPP}, round robin")
    print(f"  curl -s http://127.0.0.1:{proxier.port_of(STICKY)}/        # {STICKY}, sticky")
    print(f"  curl -s http://127.0.0.1:30080/        # NodePort of {MYAPP}")
    print(f"  {udp_command(proxier.port_of(ECHO))}     # {ECHO}")
    if ops is not None and ops.metrics_port:
        base = f"http://127.0.0.1:{ops.metrics_port}"
        print(f"\n  Open {base}/debug/ui in a browser: each Service's path, live")
        print("  (a little demo traffic flows every 1.5 s)\n")
        print(f"  curl -s {base}/metrics | grep kube_userspace_proxy_    # per-service counters")
        print(f"  curl -s {base}/debug/state         # service port -> proxy port -> endpoints")
    if ops is not None and ops.healthz_port:
        print(f"  curl -s http://127.0.0.1:{ops.healthz_port}/healthz")


def main(*, serve: bool = False, requests: int = 30, event_loop: str = "auto") -> int:
    """Run the demo; exit code 0 when every request was answered."""
    serves_native = app.serves_native(demo_config(FsPath(".")))
    try:
        return app.run_loop(_run(serve, requests), event_loop, serves_native=serves_native)
    except OSError as exc:
        print(f"kube-userspace-proxy demo: {exc.strerror or exc}", file=sys.stderr)
        return 1
