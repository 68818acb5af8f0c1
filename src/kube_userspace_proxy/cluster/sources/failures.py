"""What can go wrong talking to the API server, and how each failure reads in a log line.

`ApiStatusError` (an error status, over HTTP or as an in-stream ERROR event), `Expired` (410:
relist), `BadData` (what the API does not allow); `RETRYABLE` is the set a source backs off
from and retries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from kube_userspace_proxy.cluster.sources.retry import parse_retry_after

EXCERPT = 160  # bytes (or characters) of bad input quoted in the log


class ApiStatusError(Exception):
    """The API server answered with an error status (HTTP or an in-stream ERROR event)."""

    def __init__(self, code: int, reason: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code} {reason}")
        self.code = code
        self.reason = reason
        self.retry_after = retry_after


class Expired(Exception):
    """410 Gone: the resourceVersion (or continue token) is too old; relist."""


class BadData(Exception):
    """The API server sent what the API does not allow: a malformed watch event or list body."""

    def __init__(self, problem: str, raw: bytes | None = None, detail: str = "") -> None:
        text = f"{problem} ({detail})" if detail else problem
        super().__init__(text if raw is None else f"{text}: {_excerpt(raw)}")
        self.problem = problem  # no data in it: the key for rate-limiting the log line


RETRYABLE = (aiohttp.ClientError, OSError, TimeoutError, ApiStatusError)
"""Failures of the connection or the server: back off and retry. (Undecodable bodies are
BadData.)"""


async def check(response: aiohttp.ClientResponse) -> None:
    """Raise Expired on 410 and ApiStatusError on any other non-2xx answer."""
    if 200 <= response.status < 300:
        return
    reason = response.reason or ""
    try:
        body = json.loads(await response.read())
        if isinstance(body, dict):
            reason = str(body.get("message") or body.get("reason") or reason)
    except (ValueError, RecursionError, aiohttp.ClientError):
        pass  # keep the HTTP reason
    if response.status == 410:
        raise Expired(reason)
    raise ApiStatusError(
        response.status, reason, parse_retry_after(response.headers.get("Retry-After"))
    )


def status_error(status: Mapping[str, Any]) -> Expired | ApiStatusError:
    """The failure an ERROR event's Status stands for: Expired for 410, else ApiStatusError."""
    code, reason = _error_status(status)
    if code == 410:
        return Expired(reason)
    return ApiStatusError(code, reason)


def _error_status(status: Mapping[str, Any]) -> tuple[int, str]:
    """(code, message) of an ERROR event's Status; code 0 when it is not an HTTP status."""
    raw = status.get("code")
    code = 0
    if isinstance(raw, int) and not isinstance(raw, bool) and 100 <= raw <= 599:
        code = raw
    elif isinstance(raw, str) and len(raw) == 3 and raw.isascii() and raw.isdigit():
        code = int(raw)
    reason = str(status.get("message") or status.get("reason") or "ERROR event")[:EXCERPT]
    if code == 0 and raw is not None:
        reason += f" (code {str(raw)[:EXCERPT]!r})"
    return code, reason


def json_type(value: object) -> str:
    """What a decoded JSON value is, in JSON's words (for log lines)."""
    if value is None:
        return "null or missing"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string" if value else "an empty string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def describe(exc: BaseException) -> str:
    """`Type: message` of an exception (just the type when it has no message)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _excerpt(raw: bytes) -> str:
    text = raw[:EXCERPT].decode("utf-8", "replace")
    return repr(text) + ("..." if len(raw) > EXCERPT else "")
