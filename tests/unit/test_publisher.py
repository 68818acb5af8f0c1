"""The publisher's deltas: a port goes out again when what the workers have of it changed,
and only then (it keeps a pool id per port and a pool's entry less its name, not the entries
it sent)."""

from __future__ import annotations

from kube_userspace_proxy.balancer import EndpointPool
from kube_userspace_proxy.dataplane import ConnStats
from kube_userspace_proxy.model import Endpoint, ServicePortName, SocketKey
from kube_userspace_proxy.workers.groups import Groups
from kube_userspace_proxy.workers.link import Replies
from kube_userspace_proxy.workers.protocol import Settings
from kube_userspace_proxy.workers.publisher import Publisher

WEB = ServicePortName("default", "web", "http")


class _Port:
    """A served port as the publisher reads it (`pool.SharedPort`'s attributes)."""

    def __init__(self, port: int, name: str, picker: EndpointPool, v6only: int = 0) -> None:
        self.key: SocketKey = ("TCP", "127.0.0.1", port)
        self.name = name
        self.picker = picker
        self.v6only = v6only
        self.stats = ConnStats()


def _pool(*ips: str) -> EndpointPool:
    pool = EndpointPool(WEB)
    pool.update([Endpoint(ip, 8080) for ip in ips], affinity_timeout=None)
    return pool


async def _sent(publisher: Publisher) -> int:
    """Port entries the next publish carries (no workers: counted, not sent)."""
    before = publisher.ports_sent
    await publisher.publish()
    return publisher.ports_sent - before


async def test_a_port_goes_out_again_only_when_its_entry_or_pool_changed() -> None:
    publisher = Publisher(Settings(30.0, 0.0), Groups(1), Replies(), list)
    pool = _pool("10.244.1.5")
    web = _Port(40001, str(WEB), pool)
    other = _Port(40002, "default/other:http", _pool("10.244.1.6"))
    publisher.add(web)
    publisher.add(other)
    assert await _sent(publisher) == 2
    publisher.touch(web)  # a resync: nothing changed
    publisher.touch(other)
    assert await _sent(publisher) == 0
    pool.update([Endpoint("10.244.1.7", 8080)], affinity_timeout=None)
    publisher.touch(web)
    publisher.touch(other)
    assert await _sent(publisher) == 1
    pool.update([Endpoint("10.244.1.7", 8080)], affinity_timeout=30.0)  # its affinity alone
    publisher.touch(web)
    assert await _sent(publisher) == 1
    web.picker = _pool("10.244.1.7")  # another pool, with the same endpoints
    publisher.touch(web)
    assert await _sent(publisher) == 1
    # Taken away and given again, as another object with the same pool (a name, or
    # IPV6_V6ONLY, of its own): sent again, though its pool id did not change.
    publisher.remove(web)
    again = _Port(40001, "default/renamed:http", web.picker, v6only=1)
    publisher.add(again)
    assert await _sent(publisher) == 1
    publisher.touch(again)
    assert await _sent(publisher) == 0
