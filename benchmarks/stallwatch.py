"""Run the proxy with a loop-stall watchdog: what held its event loop, each time it was late.

    .venv/bin/python benchmarks/stallwatch.py [--threshold-ms 8] [--gc-census]
        [--gc-threshold A,B,C] OUT.json -- run --kubeconfig ...

The arguments after `--` are the proxy's own (`kube-userspace-proxy ...`). A 1 ms ticker on
the proxy's event loop stamps the time of each wake-up; a thread of its own checks that stamp
every millisecond and, while the ticker is more than `--threshold-ms` late, samples the loop
thread's Python stack (`sys._current_frames`). When the ticker wakes again the stall is
recorded: when it began (wall clock), how long it held, the garbage-collector passes inside it
(timestamped by a `gc.callbacks` hook, with their generation), and its stacks, collapsed
(`outer;...;inner count`). The sampler needs the GIL, so a stall in one C call (a sort, an
encode) shows the Python line that made the call. Every collector pass is logged with its
generation, wall time and CPU; `--gc-census` also counts the young generations' objects by
type before each middle or full pass (and the old one's before a full pass: a diagnosis
that costs a pass of its own); `--gc-threshold` sets `gc.set_threshold` before the proxy
starts, to compare thresholds. OUT.json is
written at exit (SIGTERM included: the proxy shuts down gracefully) and every 5 s meanwhile.

Only for benchmarks: the proxy runs as usual, with the ticker's small cost on its loop.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvloop

TICK = 0.001


def collapsed(frame: FrameType | None) -> str:
    parts = []
    while frame is not None:
        code = frame.f_code
        parts.append(f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})")
        frame = frame.f_back
    return ";".join(reversed(parts))


class Watchdog:
    """Samples the loop thread's stack while the loop's ticker is late."""

    def __init__(self, out: Path, threshold: float) -> None:
        self.out = out
        self.threshold = threshold
        self.last = time.perf_counter()
        self.loop_thread = threading.get_ident()
        self.stalls: list[dict[str, Any]] = []
        self.gc_passes: collections.deque[tuple[float, float, int, int]] = collections.deque(
            maxlen=20_000
        )
        self._gc_began = self._gc_cpu = 0.0
        self.census = False
        self.gc_log: collections.deque[tuple[float, int, float, float]] = collections.deque(
            maxlen=100_000
        )
        self.young: collections.deque[tuple[float, int, int, list[tuple[str, int]]]] = (
            collections.deque(maxlen=60)
        )
        self.ticks = 0
        self.lateness: list[float] = []
        self._lock = threading.Lock()
        self._written = time.monotonic()

    # ---- on the loop -------------------------------------------------------------------
    def tick(self, loop: Any) -> None:
        now = time.perf_counter()
        self.lateness.append(now - self.last - TICK)
        self.last = now
        self.ticks += 1
        loop.call_later(TICK, self.tick, loop)

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() != self.loop_thread:
            return
        if phase == "start":
            if self.census and info["generation"] >= 1:
                # What the young generations hold (diagnosis: costs a pass of its own).
                kinds = collections.Counter(type(o).__name__ for o in gc.get_objects(1))
                kinds.update(type(o).__name__ for o in gc.get_objects(0))
                if info["generation"] == 2:
                    kinds.update("old:" + type(o).__name__ for o in gc.get_objects(2))
                self.young.append(
                    (time.time(), info["generation"], sum(kinds.values()), kinds.most_common(8))
                )
            self._gc_cpu = time.thread_time()
            self._gc_began = time.perf_counter()
        else:
            now = time.perf_counter()
            self.gc_passes.append((self._gc_began, now, info["generation"], info["collected"]))
            self.gc_log.append(
                (
                    time.time(),
                    info["generation"],
                    round(1e3 * (now - self._gc_began), 3),
                    round(1e3 * (time.thread_time() - self._gc_cpu), 3),
                )
            )

    # ---- the watchdog thread -----------------------------------------------------------
    def watch(self) -> None:
        current: dict[str, Any] | None = None
        stacks: collections.Counter[str] = collections.Counter()
        others: collections.Counter[str] = collections.Counter()
        began = cpu_began = 0.0
        clock = time.pthread_getcpuclockid(self.loop_thread)
        me = threading.get_ident()
        while True:
            time.sleep(TICK)
            now = time.perf_counter()
            last = self.last
            if now - last > self.threshold + TICK:
                if current is None:
                    current, began, stacks = {}, last, collections.Counter()
                    others = collections.Counter()
                    cpu_began = time.clock_gettime(clock)
                frames = sys._current_frames()
                stacks[collapsed(frames.get(self.loop_thread))] += 1
                for ident, frame in frames.items():
                    if ident not in (me, self.loop_thread) and frame.f_code.co_name != "_worker":
                        others[collapsed(frame)] += 1
                    elif ident not in (me, self.loop_thread):
                        # A pool thread: busy unless it waits for its next work item.
                        inner = collapsed(frame)
                        if "get (queue.py" not in inner and "_worker (thread.py:81)" not in inner:
                            others[inner] += 1
            elif current is not None:
                held = last - began
                gcs = [
                    {"gen": g, "ms": round(1e3 * (e - s), 2), "collected": c}
                    for s, e, g, c in list(self.gc_passes)
                    if s >= began and e <= last
                ]
                with self._lock:
                    self.stalls.append(
                        {
                            "at": time.time() - (now - began),
                            "held_ms": round(1e3 * held, 2),
                            "gc": gcs,
                            "loop_cpu_ms": round(1e3 * (time.clock_gettime(clock) - cpu_began), 2),
                            "stacks": stacks.most_common(8),
                            "others": others.most_common(4),
                        }
                    )
                current = None
            if time.monotonic() - self._written > 5:
                self.write()

    def write(self) -> None:
        self._written = time.monotonic()
        with self._lock:
            late = sorted(self.lateness[-200_000:])
            report = {
                "threshold_ms": 1e3 * self.threshold,
                "ticks": self.ticks,
                "lateness_p99_ms": 1e3 * late[int(0.99 * (len(late) - 1))] if late else None,
                "stalls": self.stalls,
                "young": list(self.young),
                "gc_passes": list(self.gc_log),
                "gc_threshold": gc.get_threshold(),
            }
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report))
        tmp.replace(self.out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--threshold-ms", type=float, default=8.0)
    parser.add_argument("--gc-census", action="store_true", help="count the young objects")
    parser.add_argument("--gc-threshold", help="gc.set_threshold before the proxy starts: A,B,C")
    parser.add_argument("proxy_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    proxy_args = args.proxy_args[1:] if args.proxy_args[:1] == ["--"] else args.proxy_args
    dog = Watchdog(args.out, args.threshold_ms / 1e3)
    dog.census = args.gc_census
    if args.gc_threshold:
        gc.set_threshold(*(int(x) for x in args.gc_threshold.split(",")))
    gc.callbacks.append(dog.on_gc)
    make_loop = uvloop.new_event_loop

    def new_event_loop() -> Any:
        loop = make_loop()
        loop.call_soon(dog.tick, loop)
        return loop

    uvloop.new_event_loop = new_event_loop  # app.run_loop looks it up at call time
    threading.Thread(target=dog.watch, name="stallwatch", daemon=True).start()
    from kube_userspace_proxy import cli

    try:
        return cli.main(proxy_args)
    finally:
        dog.write()


if __name__ == "__main__":
    sys.exit(main())
