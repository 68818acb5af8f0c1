"""/debug/state's names are sorted a bounded run at a time, yielding to the event loop between."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from kube_userspace_proxy.model import Protocol, ServicePortName
from kube_userspace_proxy.proxier import debugview as proxier
from tests.turns import Turns


def names(count: int) -> list[ServicePortName]:
    out = [
        ServicePortName(f"ns-{i % 7}", f"svc-{i}", port, protocol)
        for i in range(count)
        for port, protocol in (("http", Protocol.TCP), ("dns", Protocol.UDP))
    ]
    random.Random(7).shuffle(out)
    return out


async def test_names_come_out_in_name_order() -> None:
    given = names(500)
    result = list(await proxier.sorted_in_runs(given))
    assert result == sorted(given, key=proxier.by_name)
    assert result == sorted(given)  # the dataclass's own order, which the key mirrors


async def test_no_loop_turn_sorts_more_than_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """10,000 names sorted in one step held the loop 25-45 ms; a run is SORT_RUN names."""
    turns = Turns()
    keyed_in_turn: Counter[int] = Counter()
    real_key = proxier.by_name

    def counting_key(name: ServicePortName) -> tuple[str, str, str, str]:
        keyed_in_turn[turns.count] += 1
        return real_key(name)

    monkeypatch.setattr(proxier, "by_name", counting_key)
    given = names(5 * proxier.SORT_RUN)
    witness = asyncio.create_task(turns.run())
    await asyncio.sleep(0)  # the witness is waiting for the next turn
    try:
        merged = await proxier.sorted_in_runs(given)
    finally:
        witness.cancel()
    assert sum(keyed_in_turn.values()) == len(given)  # each name keyed once, before the merge
    assert max(keyed_in_turn.values()) <= proxier.SORT_RUN
    assert len(keyed_in_turn) >= len(given) // proxier.SORT_RUN
    assert list(merged) == sorted(given, key=real_key)
