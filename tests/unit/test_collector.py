"""The cyclic collector held off while the first state is built (collector.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kube_userspace_proxy import collector
from tests import polling


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    """Each test starts with the collector running and leaves it running."""
    gc.enable()
    yield
    gc.enable()


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generation of each collection that starts while the test runs."""
    started: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(count)
    yield started
    gc.callbacks.remove(count)


async def test_a_hold_stops_collections_until_it_ends_then_freezes_what_was_built(
    collections: list[int],
) -> None:
    hold = collector.Hold(limit=60)
    hold.begin()
    assert not gc.isenabled()
    built = [[i] for i in range(50_000)]  # many times the first generation's threshold
    assert collections == []
    frozen = gc.get_freeze_count()
    hold.end()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(built)
    hold.end()  # a second end changes nothing
    assert gc.isenabled()
    more = [[i] for i in range(50_000)]
    assert collections and len(more) == len(built)  # collecting again


async def test_a_hold_ends_by_itself_at_its_limit_without_a_freeze() -> None:
    hold = collector.Hold(limit=0.05)
    hold.begin()
    frozen = gc.get_freeze_count()
    await polling.eventually(gc.isenabled, "the hold to end at its limit")
    assert gc.isenabled() and not hold.held
    assert gc.get_freeze_count() == frozen


async def test_an_abandoned_hold_lets_the_collector_run_without_a_freeze() -> None:
    hold = collector.Hold(limit=60)
    hold.begin()
    frozen = gc.get_freeze_count()
    hold.abandon()
    assert gc.isenabled() and not hold.held
    assert gc.get_freeze_count() == frozen


async def test_a_collector_disabled_by_someone_else_stays_disabled() -> None:
    gc.disable()
    hold = collector.Hold(limit=60)
    hold.begin()
    assert not hold.held
    hold.end()
    assert not gc.isenabled()
    with collector.held_off():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_held_off_restores_the_collector_even_on_error() -> None:
    with pytest.raises(RuntimeError), collector.held_off():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_freed_memory_goes_back_to_the_kernel_where_the_c_library_can() -> None:
    # Debian's glibc has malloc_trim; the call is cheap enough to follow every scrape.
    garbage = [bytes(1000) for _ in range(20_000)]  # above pymalloc's sizes: malloc's
    del garbage
    assert collector.release_free_memory() is True
