"""Every test stops what it started: no log writer thread outlives its test (issue 22, item 8).

A writer thread left behind writes to the stderr pytest captured for a test that has ended
("--- Logging error --- ValueError: I/O operation on closed file"). The two tests run in
this order: the first starts a writer as `cli.main` does, the second finds none.
"""

from __future__ import annotations

import logging
import logging.handlers
import threading

from kube_userspace_proxy import logs


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("(_monitor)") and t.is_alive()]


def test_a_test_that_sets_up_logging_starts_a_writer_thread() -> None:
    logs.setup(0)
    assert _writers()


def test_no_writer_thread_or_handler_is_left_from_an_earlier_test() -> None:
    assert _writers() == []
    logger = logging.getLogger(logs.LOGGER_NAME)
    assert not any(isinstance(h, logging.handlers.QueueHandler) for h in logger.handlers)
