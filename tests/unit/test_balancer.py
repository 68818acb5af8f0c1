"""usable_endpoints and EndpointPool: round robin, ClientIP affinity, dial penalties."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kube_userspace_proxy.balancer import EndpointPool
from kube_userspace_proxy.model import Endpoint, ServicePortName
from kube_userspace_proxy.topology import usable_endpoints

NAME = ServicePortName("default", "web", "http")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def eps(count: int, port: int = 8080) -> list[Endpoint]:
    return [Endpoint(f"10.0.0.{i + 1}", port) for i in range(count)]


def pool_of(
    endpoints: list[Endpoint], clock: Clock | None = None, timeout: float | None = None
) -> EndpointPool:
    pool = EndpointPool(NAME, affinity_timeout=timeout, clock=clock or Clock())
    pool.update(endpoints, affinity_timeout=timeout)
    return pool


# -- usable_endpoints -------------------------------------------------------------------------


def test_ready_endpoints_are_usable() -> None:
    ready = Endpoint("10.0.0.1", 80)
    not_ready = Endpoint("10.0.0.2", 80, ready=False, serving=False)
    terminating = Endpoint("10.0.0.3", 80, ready=False, serving=True, terminating=True)
    got = usable_endpoints([ready, not_ready, terminating], local_only=False, node_name=None)
    assert got == (ready,)


def test_serving_terminating_endpoints_are_the_fallback_when_none_is_ready() -> None:
    not_ready = Endpoint("10.0.0.2", 80, ready=False, serving=False)
    serving = Endpoint("10.0.0.3", 80, ready=False, serving=True, terminating=True)
    gone = Endpoint("10.0.0.4", 80, ready=False, serving=False, terminating=True)
    got = usable_endpoints([not_ready, serving, gone], local_only=False, node_name=None)
    assert got == (serving,)


def test_local_policy_keeps_only_endpoints_of_this_node() -> None:
    here = Endpoint("10.0.0.1", 80, node_name="n1")
    there = Endpoint("10.0.0.2", 80, node_name="n2")
    nowhere = Endpoint("10.0.0.3", 80)
    assert usable_endpoints([here, there, nowhere], local_only=True, node_name="n1") == (here,)
    assert usable_endpoints([here, there, nowhere], local_only=False, node_name="n1") == (
        here,
        there,
        nowhere,
    )


def test_local_filter_applies_before_the_terminating_fallback() -> None:
    remote_ready = Endpoint("10.0.0.1", 80, node_name="n2")
    local_terminating = Endpoint(
        "10.0.0.2", 80, ready=False, serving=True, terminating=True, node_name="n1"
    )
    got = usable_endpoints([remote_ready, local_terminating], local_only=True, node_name="n1")
    assert got == (local_terminating,)


def test_unknown_node_name_has_no_local_endpoints() -> None:
    assert usable_endpoints(eps(2), local_only=True, node_name=None) == ()


# -- round robin ------------------------------------------------------------------------------


def test_no_endpoints_picks_none() -> None:
    pool = EndpointPool(NAME)
    assert pool.pick("1.2.3.4") is None
    assert not pool
    assert not pool.has_endpoints


def test_all_endpoints_gone_picks_none() -> None:
    pool = pool_of(eps(3), timeout=60)
    pool.pick("1.2.3.4")
    pool.update([], affinity_timeout=60)
    assert pool.pick("1.2.3.4") is None
    assert pool.affinity_entries() == []


@given(st.integers(1, 30), st.integers(1, 8))
def test_round_robin_spreads_evenly(count: int, rounds: int) -> None:
    pool = pool_of(eps(count))
    picks = Counter(pool.pick("1.2.3.4") for _ in range(count * rounds))
    assert picks == {e.address: rounds for e in eps(count)}


@given(st.integers(1, 10), st.integers(1, 8), st.integers(0, 9))
def test_round_robin_with_penalised_endpoint_spreads_over_the_rest(
    count: int, rounds: int, victim: int
) -> None:
    clock = Clock()
    pool = pool_of(eps(count + 1), clock)
    bad = eps(count + 1)[victim % (count + 1)].address
    pool.dial_failed(bad)
    picks = Counter(pool.pick("1.2.3.4") for _ in range(count * rounds))
    assert bad not in picks
    assert set(picks.values()) == {rounds}


def test_duplicate_addresses_count_once() -> None:
    pool = pool_of(eps(2) + eps(2))
    assert len(pool) == 2


# -- affinity ---------------------------------------------------------------------------------


def test_affinity_sticks_until_timeout() -> None:
    clock = Clock()
    pool = pool_of(eps(3), clock, timeout=60)
    first = pool.pick("192.168.0.7")
    for _ in range(10):
        clock.advance(59)  # idle timeout: each use renews it
        assert pool.pick("192.168.0.7") == first
    clock.advance(60)
    assert pool.pick("192.168.0.7") != first


def test_affinity_separates_clients() -> None:
    pool = pool_of(eps(3), timeout=60)
    a, b = pool.pick("192.168.0.1"), pool.pick("192.168.0.2")
    assert a != b
    assert [pool.pick("192.168.0.1") for _ in range(5)] == [a] * 5
    assert [pool.pick("192.168.0.2") for _ in range(5)] == [b] * 5


@given(st.integers(1, 1000), st.integers(1, 1000), st.integers(0, 1500))
def test_affinity_timeout_follows_service_updates(first: int, second: int, idle: int) -> None:
    # kubernetes#107398: the Go userspace proxier kept the first timeout forever.
    clock = Clock()
    pool = pool_of(eps(3), clock, timeout=first)
    pinned = pool.pick("192.168.0.7")
    pool.update(eps(3), affinity_timeout=second)
    assert pool.affinity_timeout == second
    clock.advance(idle)
    assert (pool.pick("192.168.0.7") == pinned) is (idle < second)


def test_affinity_turned_off_forgets_pins_and_round_robins() -> None:
    pool = pool_of(eps(3), timeout=60)
    pool.pick("192.168.0.7")
    pool.update(eps(3), affinity_timeout=None)
    assert pool.affinity_entries() == []
    assert len({pool.pick("192.168.0.7") for _ in range(3)}) == 3


def test_affinity_entries_report_seconds_left() -> None:
    clock = Clock()
    pool = pool_of(eps(2), clock, timeout=100)
    address = pool.pick("192.168.0.7")
    clock.advance(30)
    ((client, pinned, left),) = pool.affinity_entries()
    assert (client, pinned) == ("192.168.0.7", address)
    assert left == pytest.approx(70)
    clock.advance(71)
    assert pool.affinity_entries() == []


def test_retry_moves_the_client_to_another_endpoint_and_repins() -> None:
    pool = pool_of(eps(3), timeout=60)
    first = pool.pick("192.168.0.7")
    assert first is not None
    pool.dial_failed(first)
    second = pool.pick("192.168.0.7", retry=True)
    assert second not in (None, first)
    assert pool.pick("192.168.0.7") == second


def test_affinity_table_stays_bounded() -> None:
    clock = Clock()
    pool = EndpointPool(NAME, affinity_timeout=3600, clock=clock, max_affinity_entries=100)
    pool.update(eps(3), affinity_timeout=3600)
    for i in range(5000):
        pool.pick(f"10.1.{i // 256}.{i % 256}")
    clients = [client for client, _, _ in pool.affinity_entries()]
    assert len(clients) <= 100
    assert "10.1.19.135" in clients  # the newest client is kept; the oldest were dropped


def test_expired_pins_are_swept_before_live_ones_are_dropped() -> None:
    clock = Clock()
    pool = EndpointPool(NAME, affinity_timeout=10, clock=clock, max_affinity_entries=2000)
    pool.update(eps(3), affinity_timeout=10)
    for i in range(1500):
        pool.pick(f"old-{i}")
    clock.advance(11)
    for i in range(1500):
        pool.pick(f"new-{i}")
    clients = {client for client, _, _ in pool.affinity_entries()}
    assert clients == {f"new-{i}" for i in range(1500)}


# -- penalties --------------------------------------------------------------------------------


def test_penalised_endpoint_is_skipped_until_the_penalty_ends() -> None:
    clock = Clock()
    pool = pool_of(eps(3), clock)
    bad = eps(3)[1].address
    pool.dial_failed(bad)
    assert bad not in {pool.pick("1.2.3.4") for _ in range(12)}
    clock.advance(1.01)
    assert bad in {pool.pick("1.2.3.4") for _ in range(3)}


def test_all_penalised_still_picks_in_turn() -> None:
    pool = pool_of(eps(3))
    for endpoint in eps(3):
        pool.dial_failed(endpoint.address)
    assert {pool.pick("1.2.3.4") for _ in range(3)} == {e.address for e in eps(3)}


def test_pinned_endpoint_under_penalty_moves_its_client() -> None:
    pool = pool_of(eps(3), timeout=60)
    pinned = pool.pick("192.168.0.7")
    assert pinned is not None
    pool.dial_failed(pinned)
    moved = pool.pick("192.168.0.7")
    assert moved not in (None, pinned)


def test_dial_failure_of_unknown_address_is_ignored() -> None:
    pool = pool_of(eps(2))
    pool.dial_failed(("10.9.9.9", 1))
    assert {pool.pick("1.2.3.4") for _ in range(2)} == {e.address for e in eps(2)}


# -- updates ------------------------------------------------------------------------------------


def test_update_keeps_the_cursor_on_its_endpoint() -> None:
    a, b, c, d = eps(4)
    pool = pool_of([a, b, c])
    assert pool.pick("x") == a.address
    pool.update([d, b, c], affinity_timeout=None)  # b was next; still is
    assert pool.pick("x") == b.address


def test_update_moves_cursor_to_next_survivor() -> None:
    a, b, c = eps(3)
    pool = pool_of([a, b, c])
    assert pool.pick("x") == a.address
    pool.update([a, c], affinity_timeout=None)  # b (next) is gone: c comes next
    assert pool.pick("x") == c.address


@given(
    st.integers(2, 12),
    st.lists(st.integers(0, 11), unique=True),
    st.integers(0, 3),
)
def test_survivors_keep_pins_across_updates(count: int, removed_idx: list[int], added: int) -> None:
    clock = Clock()
    old = eps(count)
    pool = pool_of(old, clock, timeout=600)
    pins = {f"c{i}": pool.pick(f"c{i}") for i in range(count * 2)}
    removed = {old[i].address for i in removed_idx if i < count}
    new = [e for e in old if e.address not in removed] + [
        Endpoint(f"10.0.1.{i}", 8080) for i in range(added)
    ]
    pool.update(new, affinity_timeout=600)
    alive = {e.address for e in new}
    for client, pinned in pins.items():
        now = pool.pick(client)
        if pinned in alive:
            assert now == pinned
        else:
            assert now is None if not new else now in alive


def test_update_with_same_endpoints_changes_nothing() -> None:
    pool = pool_of(eps(3), timeout=60)
    pinned = pool.pick("c")
    before = pool.pick("other")
    pool.update(eps(3), affinity_timeout=60)
    assert pool.pick("c") == pinned
    assert pool.pick("third") not in (None, before)


# -- copies of a pool, one per worker: where each starts --------------------------------------


def copies(slots: int, endpoints: list[Endpoint]) -> list[EndpointPool]:
    """Each worker's copy of one pool, given the same endpoints (as a table push does)."""
    pools = [EndpointPool(NAME, slot=slot, slots=slots) for slot in range(slots)]
    for pool in pools:
        pool.update(endpoints, affinity_timeout=None)
    return pools


@given(st.integers(1, 8), st.integers(1, 12))
def test_the_first_picks_of_n_workers_spread_over_the_endpoints(slots: int, count: int) -> None:
    firsts = Counter(pool.pick("1.2.3.4") for pool in copies(slots, eps(count)))
    # Fewer workers than endpoints: n different endpoints; more: every endpoint, evenly.
    assert len(firsts) == min(slots, count)
    assert max(firsts.values()) - min(firsts.values()) <= 1


def test_fewer_workers_than_endpoints_start_as_far_apart_as_they_can() -> None:
    a, b, c, d, e, f = eps(6)
    firsts = [pool.pick("1.2.3.4") for pool in copies(2, [a, b, c, d, e, f])]
    # Each worker's first three picks are different endpoints from the other's (with starts
    # at #1 and #2 they would share two of three), so sticky clients spread from the start.
    assert firsts == [a.address, d.address]


@given(st.integers(1, 8), st.integers(1, 12), st.integers(0, 40))
def test_each_copy_still_visits_every_endpoint_evenly(slots: int, count: int, turns: int) -> None:
    for pool in copies(slots, eps(count)):
        for _ in range(turns):
            pool.pick("1.2.3.4")
        picks = Counter(pool.pick("1.2.3.4") for _ in range(count * 3))
        assert picks == {e.address: 3 for e in eps(count)}


def test_a_pool_without_a_pick_starts_where_its_new_slot_starts() -> None:
    a, b, c = eps(3)
    pool = EndpointPool(NAME, slot=-2, slots=2)  # a warm spare's (SPARE is -2)
    pool.update([a, b, c], affinity_timeout=None)
    pool.take_slot(1, 2)  # it becomes worker 1
    assert pool.pick("1.2.3.4") == b.address


def test_a_pool_that_picked_keeps_its_place_when_it_takes_a_slot() -> None:
    a, b, c, d = eps(4)
    pool = EndpointPool(NAME, slot=0, slots=2)
    pool.update([a, b, c, d], affinity_timeout=None)
    assert pool.pick("1.2.3.4") == a.address
    pool.take_slot(1, 2)  # slot 1 starts at c: a pool that picked goes on in its order
    assert pool.pick("1.2.3.4") == b.address


def test_updates_before_the_first_pick_place_the_cursor_at_the_slot_start() -> None:
    a, b, c, d = eps(4)
    pool = EndpointPool(NAME, slot=1, slots=2)
    pool.update([a], affinity_timeout=None)  # one endpoint: every worker starts on it
    pool.update([a, b, c, d], affinity_timeout=None)  # nothing picked yet: spread now
    assert pool.pick("1.2.3.4") == c.address


def test_endpoints_back_after_none_start_at_the_slot_start_again() -> None:
    a, b, c, d = eps(4)
    pool = EndpointPool(NAME, slot=1, slots=2)
    pool.update([a, b, c, d], affinity_timeout=None)
    assert [pool.pick("1.2.3.4") for _ in range(3)] == [c.address, d.address, a.address]
    pool.update([], affinity_timeout=None)
    pool.update([a, b, c, d], affinity_timeout=None)
    assert pool.pick("1.2.3.4") == c.address


@given(
    st.integers(1, 4),
    st.integers(2, 10),
    st.integers(0, 25),
    # The push: endpoints removed (by index), endpoints added, the new order.
    st.tuples(
        st.lists(st.integers(0, 9), unique=True), st.integers(0, 3), st.permutations(range(13))
    ),
)
def test_a_table_push_neither_resets_nor_moves_the_cursor_back(
    slots: int, count: int, turns: int, push: tuple[list[int], int, list[int]]
) -> None:
    removed_idx, added, order = push
    old = eps(count)
    for slot in range(slots):
        pool = EndpointPool(NAME, slot=slot, slots=slots)
        pool.update(old, affinity_timeout=None)
        picked = [pool.pick("1.2.3.4") for _ in range(turns + 1)]
        removed = {old[i].address for i in removed_idx if i < count}
        kept = [e for e in old if e.address not in removed]
        new = kept + [Endpoint(f"10.0.1.{i}", 8080) for i in range(added)]
        new = [new[i] for i in order if i < len(new)]  # the push may reorder them, too
        pool.update(new, affinity_timeout=None)
        after = pool.pick("1.2.3.4")
        if not kept:  # no order to keep: any endpoint of the new list
            assert after in {e.address for e in new} if new else after is None
            continue
        # The endpoint it would have picked next, or the first survivor after it in the old
        # order: never the slot's start again, never one it picked just before.
        last = [e.address for e in old].index(picked[-1])
        following = [old[(last + step) % count].address for step in range(1, count + 1)]
        assert after == next(a for a in following if a not in removed)


# -- what /debug/ui shows: recent picks, per-endpoint tallies, penalties ----------------------


def test_recent_picks_show_the_round_robin_order_oldest_first() -> None:
    pool = pool_of(eps(3))
    picked = [pool.pick("10.1.0.1") for _ in range(5)]
    assert pool.recent_picks() == [(address, "round-robin") for address in picked]
    assert [a[0] for a in picked] == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.1", "10.0.0.2"]


def test_recent_picks_keep_only_the_last_32() -> None:
    pool = pool_of(eps(3))
    picked = [pool.pick("10.1.0.1") for _ in range(40)]
    assert [a for a, _ in pool.recent_picks()] == picked[-32:]


def test_recent_picks_name_affinity_retries_and_the_all_penalized_fallback() -> None:
    clock = Clock()
    pool = pool_of(eps(2), clock, timeout=60)
    first = pool.pick("10.1.0.1")
    assert pool.pick("10.1.0.1") == first  # pinned
    assert first is not None
    pool.dial_failed(first)
    retried = pool.pick("10.1.0.1", retry=True)
    assert retried is not None
    pool.dial_failed(retried)
    pool.pick("10.1.0.2")  # both penalized: tried anyway
    kinds = [why for _, why in pool.recent_picks()]
    assert kinds == ["round-robin", "affinity", "retry", "all-penalized"]
    assert sorted(a for a, _ in pool.penalized()) == sorted([first, retried])
    clock.advance(2)
    assert pool.penalized() == []


def test_recent_picks_still_name_the_endpoints_picked_after_they_moved_or_went() -> None:
    pool = pool_of(eps(4))
    picked = [pool.pick("10.1.0.1") for _ in range(6)]
    shown = pool.recent_picks()
    assert [a for a, _ in shown] == picked
    # 10.0.0.2 and 10.0.0.4 go, the others change places, two come.
    new = [Endpoint("10.0.0.9", 8080), *reversed(eps(3)[::2]), Endpoint("10.0.0.8", 8080)]
    pool.update(new, affinity_timeout=None)
    assert pool.recent_picks() == shown
    more = [pool.pick("10.1.0.1") for _ in range(5)]
    assert [a for a, _ in pool.recent_picks()] == picked + more
    assert set(more) == {e.address for e in new}
    pool.update([], affinity_timeout=None)  # every endpoint goes
    assert [a for a, _ in pool.recent_picks()] == picked + more
    pool.update(eps(1), affinity_timeout=None)
    again = [pool.pick("10.1.0.1") for _ in range(30)]
    assert [a for a, _ in pool.recent_picks()] == (picked + more + again)[-32:]


@pytest.mark.parametrize("count", [64, 65, 16384, 16385])
def test_recent_picks_of_pools_of_many_endpoints(count: int) -> None:
    # Past 64 endpoints, then past 16,384, a pick takes more than a byte to remember.
    many = [Endpoint(f"10.{i >> 16}.{i >> 8 & 255}.{i & 255}", 80) for i in range(count)]
    clock = Clock()
    pool = pool_of(many[:10], clock, timeout=60)
    pool.pick("10.1.0.1")
    pool.update(many, affinity_timeout=60)  # grows past the width of its ring
    pool.dial_failed(many[0].address)
    pool.dial_failed(many[1].address)
    picked = [pool.pick(f"10.2.0.{i}") for i in range(40)]
    assert picked[0] == many[2].address  # the two penalized are skipped
    assert pool.pick("10.2.0.39") == picked[-1]
    picked.append(picked[-1])
    pool.update(many[-3:], affinity_timeout=60)  # shrinks: the ring names the gone ones
    picked.append(pool.pick("10.2.0.39"))  # its endpoint went: picked anew
    assert picked[-1] in {e.address for e in many[-3:]}
    assert [a for a, _ in pool.recent_picks()] == picked[-32:]
    kinds = [why for _, why in pool.recent_picks()]
    assert kinds == ["round-robin"] * 30 + ["affinity", "round-robin"]


def test_picked_is_the_tally_of_the_endpoint_just_picked_and_survives_updates() -> None:
    pool = pool_of(eps(3))
    address = pool.pick("10.1.0.1")
    tally = pool.picked
    tally.total += 1
    tally.bytes_in += 100
    assert dict(pool.tallies())[address] == (0, 1, 100, 0, 0)
    pool.dial_failed(("10.0.0.2", 8080))
    pool.update(eps(2), affinity_timeout=None)  # 10.0.0.3 goes, the others stay
    assert pool.tallies() == [
        (("10.0.0.1", 8080), (0, 1, 100, 0, 0)),
        (("10.0.0.2", 8080), (0, 0, 0, 0, 1)),
    ]


def test_a_pool_never_picked_from_reads_zeros_and_counts_from_its_first_pick() -> None:
    pool = pool_of(eps(2))
    pool.update(eps(3), affinity_timeout=None)
    assert pool.tallies() == [((f"10.0.0.{i}", 8080), (0, 0, 0, 0, 0)) for i in (1, 2, 3)]
    assert pool.recent_picks() == []
    assert pool.pick("10.1.0.1") == ("10.0.0.1", 8080)
    pool.picked.total += 1
    assert pool.tallies()[0] == (("10.0.0.1", 8080), (0, 1, 0, 0, 0))
    assert pool.recent_picks() == [(("10.0.0.1", 8080), "round-robin")]


def test_a_dial_failure_before_any_pick_is_counted_and_penalizes() -> None:
    clock = Clock()
    pool = pool_of(eps(2), clock)
    pool.dial_failed(("10.0.0.1", 8080))
    assert pool.tallies()[0] == (("10.0.0.1", 8080), (0, 0, 0, 0, 1))
    assert [a for a, _ in pool.penalized()] == [("10.0.0.1", 8080)]
    assert [pool.pick("10.1.0.1") for _ in range(2)] == [("10.0.0.2", 8080)] * 2


def test_pools_never_share_their_pins_penalties_or_tallies() -> None:
    # Before their first entry, pools hold one shared empty dict for each: it must stay empty.
    clock = Clock()
    pinned, penalized, fresh = (pool_of(eps(2), clock, timeout=60) for _ in range(3))
    pinned.pick("10.1.0.1")
    penalized.dial_failed(("10.0.0.2", 8080))
    counts = (pinned.affinity_count(), penalized.affinity_count(), fresh.affinity_count())
    assert counts == (1, 0, 0)
    assert fresh.penalized() == [] and pinned.penalized() == []
    assert fresh.tallies() == [((f"10.0.0.{i}", 8080), (0, 0, 0, 0, 0)) for i in (1, 2)]
    pinned.update(eps(2), affinity_timeout=None)  # affinity off: its pins go
    assert pinned.affinity_count() == 0
    pinned.update(eps(2), affinity_timeout=60)
    assert pinned.pick("10.1.0.2") == pinned.pick("10.1.0.2")
    assert (pinned.affinity_count(), fresh.affinity_count()) == (1, 0)
