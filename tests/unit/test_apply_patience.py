"""The control process waits for a worker that is busy applying a table, and replaces one that
is stuck (issue 22 item 8, issue 24: a fixed 10 s deadline killed a worker applying 10,000
ports beside two CPU hogs, and then its replacement, again and again).

Real processes stand in for the worker's CPU use: one spinning, one asleep; the publisher's
patience reads their CPU time from /proc like a worker's."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kube_userspace_proxy.workers import publisher

SPIN = "while True: pass"
SLEEP = "import time; time.sleep(600)"


@pytest.fixture
def process() -> Iterator[object]:
    started: list[subprocess.Popen[bytes]] = []

    def start(code: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", code])
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def worker_of(proc: subprocess.Popen[bytes]) -> object:
    return SimpleNamespace(index=0, process=SimpleNamespace(pid=proc.pid))


def test_a_busy_worker_is_waited_for_past_the_timeout(
    process: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher, "APPLY_TIMEOUT", 0.3)
    worker = worker_of(process(SPIN))  # type: ignore[operator]

    async def run() -> str:
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(2.0, done.set_result, "applied")
        return await publisher._while_working(worker, done)  # type: ignore[arg-type]

    assert asyncio.run(run()) == "applied"


def test_a_worker_that_uses_no_cpu_is_given_up_on(
    process: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher, "APPLY_TIMEOUT", 0.3)
    worker = worker_of(process(SLEEP))  # type: ignore[operator]

    async def run() -> asyncio.Future[str]:
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await publisher._while_working(worker, done)  # type: ignore[arg-type]
        return done

    assert asyncio.run(run()).cancelled()  # its answer is not awaited any more


def test_a_busy_worker_is_given_up_on_at_the_limit(
    process: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher, "APPLY_TIMEOUT", 0.2)
    monkeypatch.setattr(publisher, "APPLY_LIMIT", 1.0)
    worker = worker_of(process(SPIN))  # type: ignore[operator]

    async def run() -> None:
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await publisher._while_working(worker, done)  # type: ignore[arg-type]

    asyncio.run(run())
