"""workers.process.Addresses: one object per endpoint address among a worker's pools."""

from __future__ import annotations

from kube_userspace_proxy.balancer import EndpointPool
from kube_userspace_proxy.model import ServicePortName
from kube_userspace_proxy.workers.process import Addresses


def fresh(addresses: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """Equal addresses in new objects, as a table decoded from the channel brings them."""
    return tuple(("".join(ip), int(str(port))) for ip, port in addresses)


def test_equal_addresses_become_one_object_and_keep_their_order() -> None:
    known = Addresses()
    first = known.one(fresh([("10.0.0.1", 8080), ("10.0.0.2", 8080)]))
    again = known.one(fresh([("10.0.0.1", 8080), ("10.0.0.2", 8080)]))
    other = known.one(fresh([("10.0.0.2", 8080), ("10.0.0.3", 9090)]))
    assert first == (("10.0.0.1", 8080), ("10.0.0.2", 8080))
    assert again is first
    assert other == (("10.0.0.2", 8080), ("10.0.0.3", 9090))
    assert other[0] is first[1]
    assert known.one(()) == ()


def test_prune_forgets_what_no_pool_holds_once_the_count_doubled() -> None:
    known = Addresses()
    pool = EndpointPool(ServicePortName("default", "web"))
    held = known.one(fresh([("10.0.0.1", 80)]))
    pool.take_addresses(held, affinity_timeout=None)
    for i in range(2100):  # 2 entries each: the address and its list
        known.one(fresh([(f"10.1.{i // 256}.{i % 256}", 80)]))
    known.prune([pool])
    # What the pool holds is kept (the same object comes back); the rest is made anew.
    assert known.one(fresh([("10.0.0.1", 80)])) is held
    assert len(known._known) == 2  # the held list and its address
    assert known.one(fresh([("10.1.0.0", 80)])) == (("10.1.0.0", 80),)
    assert len(known._known) == 4
