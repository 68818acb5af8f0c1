"""The schedulers (rr, lc node-wide, sh as Maglev hashing), the IPVS names mapped to them,
and passive outlier ejection (runs of failed dials, max ejected, panic threshold)."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_userspace_proxy.balancer import EndpointPool, Outliers, ejections, maglev_table
from kube_userspace_proxy.model import (
    SCHEDULER_ALIASES,
    Balancing,
    BalancingOverrides,
    DialOutcome,
    Endpoint,
    ServicePortName,
    scheduler_named,
)
from kube_userspace_proxy.nodecounts import NodeCounts, SlotBook

NAME = ServicePortName("default", "db", "sql")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def eps(count: int) -> list[Endpoint]:
    return [Endpoint(f"10.0.{i // 250}.{i % 250 + 1}", 5432) for i in range(count)]


def pool_of(count: int, scheduler: str, clock: Clock | None = None) -> EndpointPool:
    pool = EndpointPool(NAME, clock=clock or Clock())
    pool.set_scheduler(scheduler)
    pool.update(eps(count), affinity_timeout=None)
    return pool


def clients(n: int) -> list[str]:
    return [f"10.244.{i // 200}.{i % 200 + 1}" for i in range(n)]


# ---- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rr", "lc", "sh", "RR", " lc "])
def test_implemented_scheduler_names_need_no_warning(name: str) -> None:
    assert scheduler_named(name) == (name.strip().lower(), None)


@pytest.mark.parametrize(("ipvs", "nearest"), sorted(SCHEDULER_ALIASES.items()))
def test_every_other_ipvs_name_maps_to_the_nearest_with_a_warning(ipvs: str, nearest: str) -> None:
    name, problem = scheduler_named(ipvs)
    assert name == nearest
    assert problem is not None and repr(ipvs) in problem and repr(nearest) in problem


def test_mh_is_sh() -> None:
    assert scheduler_named("mh")[0] == "sh"


def test_an_unknown_scheduler_is_rr_with_a_warning_naming_it() -> None:
    name, problem = scheduler_named("fastest")
    assert name == "rr"
    assert problem is not None and "'fastest'" in problem


def test_overrides_replace_only_what_the_annotations_set() -> None:
    defaults = Balancing("lc", 5, 30.0)
    assert BalancingOverrides(scheduler="sh").over(defaults) == Balancing("sh", 5, 30.0)
    assert BalancingOverrides(outlier_failures=0).over(defaults) == Balancing("lc", 0, 30.0)
    assert BalancingOverrides().over(defaults) is defaults


# ---- rr ----------------------------------------------------------------------------------------


def test_rr_is_the_default_and_visits_in_order() -> None:
    pool = EndpointPool(NAME)
    pool.update(eps(3), affinity_timeout=None)
    assert pool.scheduler == "rr"
    assert [pool.pick("c") for _ in range(6)] == [e.address for e in eps(3)] * 2


# ---- lc ----------------------------------------------------------------------------------------


def test_lc_picks_the_endpoint_with_fewest_open_connections() -> None:
    pool = pool_of(3, "lc")
    held = []
    for _ in range(3):
        pool.pick("c")
        pool.picked.active += 1
        held.append(pool.picked)
    held[1].active -= 1  # the second endpoint's connection closed
    assert pool.pick("c") == eps(3)[1].address


def test_lc_ties_go_round_robin() -> None:
    pool = pool_of(4, "lc")
    picks = [pool.pick("c") for _ in range(8)]  # nothing held open: all tie at 0
    assert Counter(picks) == Counter({e.address: 2 for e in eps(4)})
    assert picks[:4] == [e.address for e in eps(4)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.booleans(), st.integers(0, 11)), max_size=80))
def test_lc_always_picks_a_minimum(count: int, steps: list[tuple[bool, int]]) -> None:
    pool = pool_of(count, "lc")
    open_to: list = []
    for opens, which in steps:
        if opens or not open_to:
            loads = dict(pool.active_counts())
            address = pool.pick("c")
            assert address is not None
            assert loads[address] == min(loads.values())
            pool.picked.active += 1
            open_to.append(pool.picked)
        else:
            open_to.pop(which % len(open_to)).active -= 1


def test_lc_counts_are_node_wide_across_two_workers() -> None:
    counts = NodeCounts.create(workers=2, slots=64)
    book = SlotBook(64)
    slots = tuple(book.take() for _ in range(3))
    first, second = pool_of(3, "lc"), pool_of(3, "lc")
    first.share_counts(counts, 0, slots)
    second.share_counts(counts, 1, slots)
    # Worker 0 opens two connections to the first two endpoints (its round robin's first).
    for _ in range(2):
        first.pick("a")
        first.picked.active += 1
    # Worker 1 has opened none itself, yet its next pick is the endpoint worker 0 left idle.
    assert second.pick("b") == eps(3)[2].address
    assert dict(second.active_counts()) == {
        eps(3)[0].address: 1,
        eps(3)[1].address: 1,
        eps(3)[2].address: 0,
    }


def test_a_shared_tally_clears_its_cell_when_its_endpoint_leaves() -> None:
    counts = NodeCounts.create(workers=1, slots=8)
    pool = pool_of(2, "lc")
    pool.share_counts(counts, 0, (0, 1))
    pool.pick("a")
    pool.picked.active += 1
    assert counts.load(0) == 1
    pool.update(eps(2)[1:], affinity_timeout=None)  # the first endpoint is gone
    assert counts.load(0) == 0


def test_a_slot_freed_is_reused_last() -> None:
    book = SlotBook(3)
    a, b, c = book.take(), book.take(), book.take()
    book.give_back((b,))
    assert book.take() == b
    assert book.take() == -1  # every slot taken: counted per worker
    assert (a, c) == (0, 2)


# ---- sh ----------------------------------------------------------------------------------------


def test_sh_sends_a_client_to_the_same_endpoint_from_every_copy() -> None:
    one, other = pool_of(5, "sh"), pool_of(5, "sh")
    other.take_slot(1, 2)  # a second worker's copy, starting elsewhere in its round robin
    for client in clients(200):
        assert one.pick(client) == other.pick(client)


def test_sh_does_not_depend_on_the_endpoint_order() -> None:
    forward = pool_of(6, "sh")
    backward = EndpointPool(NAME)
    backward.set_scheduler("sh")
    backward.update(list(reversed(eps(6))), affinity_timeout=None)
    assert all(forward.pick(c) == backward.pick(c) for c in clients(300))


def test_sh_spreads_clients_over_the_endpoints() -> None:
    pool = pool_of(4, "sh")
    spread = Counter(pool.pick(c) for c in clients(4000))
    assert len(spread) == 4
    assert min(spread.values()) > 0.15 * 4000


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 40), st.data())
def test_sh_removing_one_endpoint_keeps_95_percent_of_the_others_clients(
    count: int, data: st.DataObject
) -> None:
    gone = data.draw(st.integers(0, count - 1))
    endpoints = [e.address for e in eps(count)]
    left = endpoints[:gone] + endpoints[gone + 1 :]
    before, after = maglev_table(endpoints), maglev_table(left)
    # Every client hash lands on one entry: of the entries that were another endpoint's, at
    # least 95 % still are.
    others = [i for i in range(len(before)) if before[i] != gone]
    kept = sum(1 for i in others if left[after[i]] == endpoints[before[i]])
    assert kept / len(others) >= 0.95


def test_sh_removing_one_endpoint_moves_only_its_clients_by_pick() -> None:
    before, after = pool_of(10, "sh"), EndpointPool(NAME)
    after.set_scheduler("sh")
    after.update(eps(10)[1:], affinity_timeout=None)
    gone = eps(10)[0].address
    picks = [(before.pick(c), after.pick(c)) for c in clients(3000)]
    others = [(b, a) for b, a in picks if b != gone]
    assert sum(b == a for b, a in others) / len(others) >= 0.95
    assert all(a != gone for _, a in picks)


def test_sh_skips_a_penalized_endpoint_the_same_way_everywhere() -> None:
    one, other = pool_of(3, "sh"), pool_of(3, "sh")
    client = "10.244.0.7"
    first = one.pick(client)
    assert first is not None
    one.dial_failed(first, DialOutcome.REFUSED)
    other.dial_failed(first, DialOutcome.REFUSED)
    second = one.pick(client, retry=True)
    assert second not in (first, None)
    assert other.pick(client) == second


def test_affinity_wins_over_sh_for_a_pinned_client() -> None:
    clock = Clock()
    pool = EndpointPool(NAME, affinity_timeout=60, clock=clock)
    pool.set_scheduler("sh")
    pool.update(eps(3), affinity_timeout=60)
    client = "10.244.0.9"
    hashed = pool.pick(client)
    assert hashed is not None
    pool.dial_failed(hashed)
    moved = pool.pick(client, retry=True)  # re-pinned elsewhere
    clock.now += 5  # the penalty is over: the hash would say `hashed` again
    assert moved != hashed
    assert pool.pick(client) == moved


# ---- ejection ------------------------------------------------------------------------------------


def ejecting_pool(count: int, clock: Clock, failures: int = 5, base: float = 30.0) -> EndpointPool:
    pool = EndpointPool(NAME, clock=clock)
    pool.outliers = Outliers(NAME, failures=failures, base=base, clock=clock)
    pool.update(eps(count), affinity_timeout=None)
    return pool


def test_five_consecutive_failures_eject_an_endpoint_for_the_base_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    pool = ejecting_pool(10, clock)
    dead = eps(10)[0].address
    for _ in range(4):
        pool.dial_failed(dead, DialOutcome.TIMED_OUT)
    assert pool.outliers is not None and pool.outliers.ejected() == []
    with caplog.at_level(logging.WARNING):
        pool.dial_failed(dead, DialOutcome.TIMED_OUT)
    assert pool.outliers.ejected() == [(dead, 30.0)]
    assert "ejected for 30s" in caplog.text
    clock.now += 29.0
    assert dead not in [pool.pick("c") for _ in range(20)]
    clock.now += 1.5
    assert dead in [pool.pick("c") for _ in range(20)]


def test_a_success_ends_the_run_of_failures() -> None:
    clock = Clock()
    pool = ejecting_pool(10, clock)
    dead = eps(10)[0].address
    for _ in range(4):
        pool.dial_failed(dead, DialOutcome.REFUSED)
    pool.dial_succeeded(dead)
    for _ in range(4):
        pool.dial_failed(dead, DialOutcome.REFUSED)
    assert pool.outliers is not None and pool.outliers.ejected() == []


def test_a_returned_endpoint_is_ejected_again_by_one_failure_for_longer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    pool = ejecting_pool(10, clock)
    dead = eps(10)[0].address
    for _ in range(5):
        pool.dial_failed(dead, DialOutcome.UNREACHABLE)
    clock.now += 31
    with caplog.at_level(logging.WARNING):
        assert pool.outliers is not None and pool.outliers.ejected() == []
    assert "returns after its ejection" in caplog.text
    pool.dial_failed(dead, DialOutcome.UNREACHABLE)
    assert pool.outliers.ejected() == [(dead, 60.0)]


def test_ejection_time_is_capped_at_300_seconds() -> None:
    clock = Clock()
    outliers = Outliers(NAME, failures=1, base=200.0, clock=clock)
    dead = eps(10)[0].address
    assert outliers.failed(dead, 10) == 200.0
    clock.now += 201
    assert outliers.failed(dead, 10) == 300.0


def test_at_most_ten_percent_of_the_endpoints_are_ejected_at_once() -> None:
    clock = Clock()
    outliers = Outliers(NAME, failures=1, clock=clock)
    addresses = [e.address for e in eps(20)]
    ejected = [a for a in addresses[:5] if outliers.failed(a, 20)]
    assert len(ejected) == 2


def test_one_endpoint_may_be_ejected_however_few_there_are_above_the_panic_threshold() -> None:
    outliers = Outliers(NAME, failures=1, clock=Clock())
    assert outliers.failed(eps(3)[0].address, 3) > 0


def test_no_ejection_when_fewer_than_half_would_be_left() -> None:
    outliers = Outliers(NAME, failures=1, clock=Clock())
    assert outliers.failed(eps(1)[0].address, 1) == 0  # none of one left
    assert outliers.failed(eps(2)[0].address, 2) > 0  # one of two left: half, allowed


def test_zero_failures_turns_ejection_off() -> None:
    outliers = Outliers(NAME, failures=0, clock=Clock())
    assert all(outliers.failed(eps(3)[0].address, 3) == 0 for _ in range(50))


def test_ejections_are_counted_for_the_metrics() -> None:
    clock = Clock()
    name = ServicePortName("metrics", "counted", "p")
    outliers = Outliers(name, failures=1, clock=clock)
    outliers.failed(("10.9.9.9", 80), 10)
    assert ejections.totals[("metrics/counted:p", "10.9.9.9:80")] == 1


def test_a_workers_column_clears_without_touching_the_others() -> None:
    counts = NodeCounts.create(workers=2, slots=16)
    counts.cells[0 * 16 + 3] = 4  # worker 0, slot 3
    counts.cells[1 * 16 + 3] = 2  # worker 1, slot 3
    assert counts.load(3) == 6
    counts.clear_column(0)  # worker 0 died; its successor starts from nothing
    assert counts.load(3) == 2


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(0, 39), st.booleans(), st.floats(0, 40)), max_size=200),
)
def test_ejections_never_pass_the_cap_nor_the_panic_threshold(
    count: int, failures: int, dials: list[tuple[int, bool, float]]
) -> None:
    clock = Clock()
    outliers = Outliers(NAME, failures=failures, base=30.0, clock=clock)
    addresses = [e.address for e in eps(count)]
    for which, failed, later in dials:
        clock.now += later
        address = addresses[which % count]
        if failed:
            outliers.failed(address, count)
        else:
            outliers.succeeded(address)
        out = len(outliers.ejected())
        assert out <= max(1, count // 10)
        assert out == 0 or count - out >= count / 2
