"""A witness of the event loop's turns, for tests that bound the work done in one turn."""

from __future__ import annotations

import asyncio


class Turns:
    """Counts the event loop's turns: a task that wakes once on each."""

    def __init__(self) -> None:
        self.count = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.count += 1
