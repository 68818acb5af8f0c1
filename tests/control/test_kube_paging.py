"""Listing page by page: each page is parsed into the state as it arrives.

With 5,000 EndpointSlices listed 500 a page, the memory a list needs beyond what the state
keeps stays far below what holding every raw page until the end would take.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest

from tests.control.conftest import StartSource, endpoint_slice, service
from tests.fakes.apiserver import FakeApiServer

SLICES = 5000
PAGE = 500


def _slice(i: int) -> dict[str, object]:
    ips = [f"10.{1 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}", "10.200.0.1", "10.200.0.2"]
    return endpoint_slice(f"svc-{i}-a", f"svc-{i}", ips)


@pytest.mark.timeout(300)
async def test_a_list_of_5000_slices_never_holds_every_raw_page(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    for i in range(SLICES):
        apiserver.create(service(f"svc-{i}", cluster_ip=f"10.96.{i // 250}.{i % 250 + 1}"))
        apiserver.create(_slice(i))
    # What every raw slice of the list takes once parsed from JSON, held at once.
    body = json.dumps({"items": apiserver.list("EndpointSlice")})
    tracemalloc.start()
    held = json.loads(body)
    raw_pages, _ = tracemalloc.get_traced_memory()
    del held, body
    tracemalloc.stop()

    tracemalloc.start()
    watching = await start_source(page_size=PAGE)
    retained, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(watching.snapshot().services) == SLICES
    # Beyond what the state keeps, the list needed a page or two of the ten, not all of them.
    assert peak - retained < raw_pages / 2, (peak - retained, raw_pages)


async def test_a_paged_list_takes_one_token_of_the_rate_limit(
    apiserver: FakeApiServer, start_source: StartSource
) -> None:
    for i in range(10):
        apiserver.create(service(f"svc-{i}", cluster_ip=f"10.96.0.{i + 1}"))
        apiserver.create(_slice(i))
    # Three tokens and next to no refill: one for each list (Services, EndpointSlices, the
    # Node), whatever its pages. A token per page would leave the lists waiting for hours.
    watching = await start_source(page_size=2, qps=0.0001, burst=3)
    assert len(watching.snapshot().services) == 10
    assert apiserver.count("services", "list") >= 5  # it was paged
    assert apiserver.count("endpointslices", "list") >= 5
