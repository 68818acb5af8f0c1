"""The fault suite's churn soak (tests/faults/) for 10 minutes, reporting the same figures.

Steady traffic to two stable Services while Services and EndpointSlices churn at 12 changes a
second, the fake API server is stopped, compacted and started every 20 s, and the stable
backends are taken out, killed and revived one at a time every 4 s. Prints the requests and
failures, and the proxy's RSS and open descriptors (medians of the first and last minute, and
every minute in between).

    .venv/bin/python benchmarks/soak.py [--minutes 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.faults.soak import run


async def main(minutes: float) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        result = await run(Path(tmp), warmup=10, measure=minutes * 60)
    print(
        f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()};"
        f" {minutes:g} minutes measured after 10 s of warm-up"
    )
    for minute in range(int(minutes)):
        rows = [s for s in result.samples if minute * 60 <= s[0] < (minute + 1) * 60]
        if rows:
            rss = statistics.median(r[1] for r in rows) / 1024
            fds = statistics.median(r[2] for r in rows)
            print(f"  minute {minute + 1:2d}: RSS {rss:6.1f} MiB, descriptors {fds:5.1f}")
    (rss0, fd0), (rss1, fd1) = result.window(True, 60), result.window(False, 60)
    print(
        f"{result.requests} requests, {len(result.failures)} failed; {result.churn_events} churn"
        f" events, {result.api_restarts} API-server restarts, {result.backend_kills} backend"
        f" kills; first -> last minute: RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB"
        f" ({(rss1 - rss0) / rss0:+.1%}), descriptors {fd0:.0f} -> {fd1:.0f}"
        f" ({(fd1 - fd0) / fd0:+.1%})"
    )
    return 1 if result.failures else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    sys.exit(asyncio.run(main(parser.parse_args().minutes)))
