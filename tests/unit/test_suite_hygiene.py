"""Every test stops what it started and owns what it writes (issue 22, item 8): no log writer
thread outlives its test, and no proxy a test runs shares the default state directory.

A writer thread left behind writes to the stderr pytest captured for a test that has ended
("--- Logging error --- ValueError: I/O operation on closed file"). The two tests run in
this order: the first starts a writer as `cli.main` does, the second finds none.
"""

from __future__ import annotations

import logging
import logging.handlers
import threading
from pathlib import Path

from kube_userspace_proxy import logs

TESTS = Path(__file__).resolve().parents[1]


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("(_monitor)") and t.is_alive()]


def test_a_test_that_sets_up_logging_starts_a_writer_thread() -> None:
    logs.setup(0)
    assert _writers()


def test_no_writer_thread_or_handler_is_left_from_an_earlier_test() -> None:
    assert _writers() == []
    logger = logging.getLogger(logs.LOGGER_NAME)
    assert not any(isinstance(h, logging.handlers.QueueHandler) for h in logger.handlers)


def test_every_test_that_runs_the_proxy_gives_it_a_state_directory_of_its_own() -> None:
    """A proxy run with the default state directory (/var/lib/kube-userspace-proxy) restores the
    ports an earlier test served and finds another run's handover socket: a test passes or fails
    by what ran before it (seen as a stray "refused" beside a concurrent run)."""
    starts = [
        path
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != Path(__file__).name
        and ("str(PROXY),\n" in (text := path.read_text()) or 'str(PROXY), "run"' in text)
        and '"run",' in text
    ]
    assert starts, "no test starts the proxy's CLI: this check finds nothing to check"
    missing = [str(p.relative_to(TESTS)) for p in starts if '"--state-dir"' not in p.read_text()]
    assert missing == []
