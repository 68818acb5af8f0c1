"""Where proxy ports come from: the port book.

A service port's proxy port is, in this order: a socket the process this one replaces handed
over; the port the installed rules (perhaps an earlier run's) already name; the port the state
file remembers; else a free one from the allocator. A port whose listener was retired is
quarantined until no rule names it any more, then released.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable

from kube_userspace_proxy import logs
from kube_userspace_proxy.errors import PortExhaustedError
from kube_userspace_proxy.model import ClaimKey, Path, Protocol, ProxiedPort, ServicePortInfo
from kube_userspace_proxy.ports import DescriptorBudget, PortAllocator
from kube_userspace_proxy.proxier.contracts import RuleSink

log = logs.get(__name__)


class PortBook:
    """The proxy ports held for service ports not served yet (claims), and those in quarantine."""

    def __init__(self, allocator: PortAllocator, budget: DescriptorBudget) -> None:
        self._allocator = allocator
        self._budget = budget
        # Sockets on the ports an earlier run's rules point at, kept for the same service
        # ports until the first commit; None until they have been read.
        self._claims: dict[ClaimKey, socket.socket] | None = None
        self._preferred: dict[ClaimKey, int] = {}
        # Sockets an earlier process handed over (`adopt`), used instead of binding anew.
        self._adopted_claims: dict[ClaimKey, socket.socket] = {}
        self._adopted: set[int] = set()  # their descriptors, until a listener takes them
        # Ports of retired listeners, released once a rule commit no longer names them.
        self._quarantine: list[tuple[Protocol, int]] = []

    @property
    def host(self) -> str:
        """The address the proxy ports are bound to."""
        return self._allocator.host

    def prefer(self, ports: dict[ClaimKey, int]) -> None:
        """Before the first sync: serve these service ports on these proxy ports if free."""
        self._preferred = dict(ports)

    def adopt(self, claims: dict[ClaimKey, socket.socket]) -> None:
        """Before the first sync: serve on these handed-over sockets instead of binding."""
        self._adopted_claims = dict(claims)
        self._adopted = {s.fileno() for s in claims.values()}

    @property
    def loaded(self) -> bool:
        """True once the earlier run's ports have been claimed (`load`)."""
        return self._claims is not None

    @property
    def claiming(self) -> bool:
        """True while claims are held (until the first commit replaced the earlier rules)."""
        return bool(self._claims)

    async def load(self, rules: RuleSink | None) -> None:
        """Hold the ports that installed rules point at, to give each back to its service port.

        After a restart the earlier run's rules stay in place until the first commit; serving
        each service port on the port its rules already name keeps its clients working
        throughout, and no other service port can receive its traffic meanwhile.
        """
        self._claims = {}
        for key, sock in self._adopted_claims.items():
            self._claims[key] = self._allocator.adopt(Protocol(key[1]), sock)
        self._adopted_claims = {}
        # The state file's ports first, the installed rules' over them: rules carry traffic.
        claimed = dict(self._preferred)
        if rules is not None:
            try:
                claimed.update(await asyncio.to_thread(rules.claimed_ports))
            except Exception as exc:
                log.warning("cannot read the installed rules' proxy ports: %s", exc)
        for key, port in sorted(claimed.items()):
            if key in self._claims:
                continue  # handed over
            protocol = Protocol(key[1])
            try:
                sock = self._allocator.reserve(protocol, name=key[0], prefer=port)
            except (PortExhaustedError, OSError):
                continue
            if sock.getsockname()[1] != port:  # taken, or outside the range now
                log.debug("cannot hold proxy port %s/%d for %s %s", protocol, port, key[0], key[2])
                self._allocator.release(protocol, sock.getsockname()[1])
                sock.close()
                continue
            log.debug("holding proxy port %s/%d for %s %s", protocol, port, key[0], key[2])
            self._claims[key] = sock
        if self._claims:
            log.info("holding %d proxy port(s) an earlier run served", len(self._claims))

    def reserve_early(self, info: ServicePortInfo, path: Path) -> int:
        """The proxy port `take` will give `path` of `info`: a claim held, or one reserved
        now and held as a claim (for the early first commit to name)."""
        assert self._claims is not None
        key = (str(info.name), str(info.protocol))
        claimed = self._claims.get((*key, str(path)))
        if claimed is None and path is Path.CLUSTER and not info.paths_differ:
            claimed = self._claims.get((*key, str(Path.EXTERNAL)))
        if claimed is None:
            self._budget.take(f"its {path} proxy port")
            claimed = self._allocator.reserve(info.protocol, name=str(info.name))
            self._claims[(*key, str(path))] = claimed
        return int(claimed.getsockname()[1])

    def take(self, info: ServicePortInfo, path: Path) -> tuple[socket.socket, bool]:
        """A bound socket to serve `path` of `info` on (the caller owns it), and whether it
        was handed over by an earlier process (to be used as it is)."""
        claimed = None
        if self._claims:
            key = (str(info.name), str(info.protocol))
            claimed = self._claims.pop((*key, str(path)), None)
            if claimed is None and path is Path.CLUSTER and not info.paths_differ:
                # One port for both paths: the rules may name it only as the external one.
                claimed = self._claims.pop((*key, str(Path.EXTERNAL)), None)
        if claimed is None:
            self._budget.take(f"its {path} proxy port")
        sock = claimed or self._allocator.reserve(info.protocol, name=str(info.name))
        adopted = sock.fileno() in self._adopted
        self._adopted.discard(sock.fileno())
        return sock, adopted

    def release(self, protocol: Protocol, port: int) -> None:
        """Give `port` back to the allocator (its socket is closed by its owner)."""
        self._allocator.release(protocol, port)

    def quarantine(self, protocol: Protocol, port: int) -> None:
        """Keep `port` out of use until a rule commit no longer names it."""
        self._quarantine.append((protocol, port))

    @property
    def quarantined(self) -> bool:
        """True while ports wait for a rule commit to be released."""
        return bool(self._quarantine)

    def take_quarantine(self) -> list[tuple[Protocol, int]]:
        """The ports in quarantine now (for the commit that starts), leaving it empty."""
        taken, self._quarantine = self._quarantine, []
        return taken

    def requarantine(self, ports: list[tuple[Protocol, int]]) -> None:
        """Put back `ports` taken for a commit that failed: the next one releases them."""
        self._quarantine = ports + self._quarantine

    def drop_claims(self) -> None:
        """Release the claims nothing took: once the rules are replaced they name nothing."""
        if not self._claims:
            return
        for (_, protocol, _), sock in self._claims.items():
            self._allocator.release(Protocol(protocol), sock.getsockname()[1])
            sock.close()
        self._claims.clear()

    def close(self) -> None:
        """At shutdown: drop the claims, close handed-over sockets never used (this
        process's descriptors only)."""
        self.drop_claims()
        for sock in self._adopted_claims.values():
            sock.close()


def ports_of(targets: Iterable[ProxiedPort]) -> dict[ClaimKey, int]:
    """The proxy port of each (service port, protocol, path) of rule targets, as the state
    file keeps them (a path that shares the cluster port is left out)."""
    ports: dict[ClaimKey, int] = {}
    # The enums' own strings (`str()` of one makes a copy): the saver keeps this mapping,
    # and a copy of each per service port was ~1 MiB at 10,000.
    cluster, external = Path.CLUSTER.value, Path.EXTERNAL.value
    for target in targets:
        name = target.info.name
        text, protocol = str(name), name.protocol.value
        if target.cluster_port:
            ports[(text, protocol, cluster)] = target.cluster_port
        if target.external_port != target.cluster_port:
            ports[(text, protocol, external)] = target.external_port
    return ports
