"""Logging setup: kube-proxy style verbosity (-v N) and text or JSON lines."""

from __future__ import annotations

import json
import logging
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
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """klog-like text: `I1129 17:18:12.123456 name] message`."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        micros = int((record.created % 1) * 1_000_000)
        head = f"{record.levelname[0]}{time.strftime('%m%d %H:%M:%S', t)}.{micros:06d}"
        text = f"{head} {record.name.removeprefix(LOGGER_NAME + '.')}] {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup(verbosity: int = 0, fmt: str = "text", stream: Any = None) -> None:
    """Configure the package logger once; later calls replace the handler."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(verbosity_to_level(verbosity))
    logger.propagate = False


def get(name: str) -> logging.Logger:
    """The logger of a module: `logs.get(__name__)`."""
    return logging.getLogger(name)
