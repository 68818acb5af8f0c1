"""Logging setup: kube-proxy style verbosity (-v N) and text or JSON lines.

Records never block the event loop on the log's pipe: the loop only formats a record and
puts it on a bounded queue (`QueueHandler`); a writer thread (`QueueListener`) writes them
out. When the queue is full (stderr is not being read), records are dropped and counted
(`dropped()`), so a stuck log reader never stalls traffic.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import logging.handlers
import queue
import sys
import time
from typing import Any

LOGGER_NAME = "kube_userspace_proxy"


def verbosity_to_level(verbosity: int) -> int:
    """Map klog-style `-v N` to a logging level: 0-1 INFO, 2-3 INFO with more, >=4 DEBUG.

    Per-connection lines are logged at DEBUG, so they only appear with `-v 4` or higher.
    """
    return logging.DEBUG if verbosity >= 4 else logging.INFO


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the fields log shippers expect."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if exc := _exception_text(self, record):
            entry["exc"] = exc
        return json.dumps(entry, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """klog-like text: `I1129 17:18:12.123456 name] message`."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        micros = int((record.created % 1) * 1_000_000)
        head = f"{record.levelname[0]}{time.strftime('%m%d %H:%M:%S', t)}.{micros:06d}"
        text = f"{head} {record.name.removeprefix(LOGGER_NAME + '.')}] {record.getMessage()}"
        if exc := _exception_text(self, record):
            text += "\n" + exc
        return text


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    # A queued record carries its traceback as text (see _DroppingQueueHandler.prepare).
    if record.exc_info:
        return formatter.formatException(record.exc_info)
    return record.exc_text or ""


QUEUE_RECORDS = 10_000
"""Records waiting for the writer thread before new ones are dropped (a few MB at most)."""


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """Puts records on a bounded queue; a full queue drops the record and counts it.

    `QueueHandler.enqueue` would raise `queue.Full`, and `handleError` then writes a traceback
    to stderr: the very pipe that is full.
    """

    def __init__(self, records: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(records)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """A copy safe to hand to another thread: message resolved, traceback as text."""
        record = copy.copy(record)
        record.msg = record.getMessage()
        record.args = None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.exc_info = None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class _Writer(logging.handlers.QueueListener):
    """The writer thread (a daemon), with a stop that gives up on a log nobody reads."""

    def stop_within(self, seconds: float) -> None:
        """Write what is queued and end the thread, waiting at most about `seconds`."""
        records: queue.Queue[Any] = self.queue  # type: ignore[assignment]
        thread = getattr(self, "_thread", None)
        self._thread = None
        try:
            records.put(None, timeout=seconds)  # QueueListener's sentinel
        except queue.Full:
            return  # the thread is stuck writing; being a daemon, it dies with the process
        if thread is not None:
            thread.join(seconds)


_active: tuple[_DroppingQueueHandler, _Writer] | None = None


def setup(verbosity: int = 0, fmt: str = "text", stream: Any = None) -> None:
    """Configure the package logger; later calls replace the handler (and its writer thread)."""
    global _active
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    stop()
    writer = logging.StreamHandler(stream or sys.stderr)
    writer.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    records: queue.Queue[logging.LogRecord] = queue.Queue(QUEUE_RECORDS)
    handler = _DroppingQueueHandler(records)
    listener = _Writer(records, writer)
    listener.start()
    _active = (handler, listener)
    logger.addHandler(handler)
    logger.setLevel(verbosity_to_level(verbosity))
    logger.propagate = False


def flush(timeout: float = 5.0) -> bool:
    """Wait until the writer thread has written every record queued so far (False: timeout)."""
    if _active is None:
        return True
    records: queue.Queue[Any] = _active[1].queue  # type: ignore[assignment]
    deadline = time.monotonic() + timeout
    while records.unfinished_tasks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def dropped() -> int:
    """Records dropped because the queue was full (the log reader fell behind)."""
    return _active[0].dropped if _active is not None else 0


def stop() -> None:
    """Write what is queued and end the writer thread (at exit, or before a new setup)."""
    global _active
    if _active is not None:
        _active[1].stop_within(2.0)
        _active = None


atexit.register(stop)


def get(name: str) -> logging.Logger:
    """The logger of a module: `logs.get(__name__)`."""
    return logging.getLogger(name)
