"""List, then watch, one resource: layered async generators, each doing one thing.

From the bottom up (in the manner of kopf's watching.py):

- `json_lines`: the lines of a watch stream, of any length;
- `in_turns`: the same items, with a turn for the event loop every few milliseconds;
- `watch_stream`: one watch request from a version: its parsed events (ERROR events raise);
- `list_pages`: one paginated list: `LIST_BEGUN`, its `Page`s, then the `Listed` sentinel
  with the list's resourceVersion (an expired continue token begins the list again);
- `follow`: list when the `Cursor` says so (first time, after a 410, periodic relist), then
  watch stream after stream from the last version seen, forever.

Failures are raised, never swallowed: the consumer (`kube.KubeSource`) decides to back off,
resume or relist; the `Cursor` it owns says where to resume. Only raw JSON is decoded: the
client's model deserialisation is too slow for big clusters.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import random
import time
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

import aiohttp

from kube_userspace_proxy import logs
from kube_userspace_proxy.cluster.sources.failures import (
    ApiStatusError,
    BadData,
    Expired,
    check,
    describe,
    json_type,
    status_error,
)
from kube_userspace_proxy.cluster.sources.retry import RateLimiter

log = logs.get(__name__)

Kind = Literal["Service", "EndpointSlice", "Node"]

EVENTS_SLICE_SECONDS = 0.004
"""Longest run of watch events taken in before the loop gets a turn."""
WATCH_TIMEOUT = 30.0
"""Seconds: each watch asks the server to end it after [t, 1.5 t) (`timeoutSeconds`)."""
WATCH_READ_SLACK = 10.0
"""Seconds a watch may stay silent past its `timeoutSeconds` before it counts as dead."""
EMPTY_WATCH_SECONDS = 1.0
"""client-go's rule: a watch that ends sooner without events is a failure, or a server that
closes at once would be hammered."""

RESUMABLE = frozenset(("ADDED", "MODIFIED", "DELETED", "BOOKMARK"))
"""Event types that move the resume point (and whose objects must carry object metadata)."""


@dataclass(frozen=True, slots=True)
class Resource:
    """What to follow: a kind, the client's list call for it, and its selectors."""

    kind: Kind
    lister: Callable[..., Awaitable[Any]]
    label_selector: str | None = None
    field_selector: str | None = None


@dataclass(frozen=True, slots=True)
class WatchSettings:
    """Sizes and timeouts of lists and watches (seconds unless named otherwise)."""

    page_size: int = 500
    """Objects per list page (`limit`)."""
    request_timeout: float = 30
    """Connect and read timeout of a list request, connect timeout of a watch."""
    watch_timeout: float = WATCH_TIMEOUT
    """Each watch asks the server to end it after about this long (`watch_timeouts`)."""
    watch_read_slack: float = WATCH_READ_SLACK
    """A watch silent this long past its `timeoutSeconds` is dead."""
    relist_period: float | None = None
    """List again this long after the last list; None: only when needed."""


class Cursor:
    """Where following one resource stands: listed or not, since when, and the resume version.

    `follow` moves it once the consumer has taken an item, so a stream cut mid-way resumes
    exactly after the last event the sink has seen. The consumer calls `forget` when the sink
    may have missed a change: the next `follow` lists again.
    """

    __slots__ = ("listed", "listed_at", "version")

    def __init__(self) -> None:
        self.version: str | None = None
        self.listed = False
        self.listed_at = 0.0

    def forget(self) -> None:
        """List again before the next watch."""
        self.listed = False

    def relist_in(self, period: float | None) -> float:
        """Seconds until the periodic relist; infinity without one."""
        if period is None:
            return float("inf")
        return self.listed_at + period - time.monotonic()


class WatchEvent(NamedTuple):
    """One event of a watch stream, as the API server sent it (type and raw object)."""

    type: str
    obj: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Page:
    """One list page's objects; `skipped` items were not objects and are left out."""

    items: list[Mapping[str, Any]]
    skipped: int


@dataclass(frozen=True, slots=True)
class Listed:
    """The sentinel after a list's last page: the list is complete at `version`."""

    version: str


class Mark(enum.Enum):
    """Points in the flow that carry no data."""

    LIST_BEGUN = "list begun"
    """A list begins (again): what earlier pages of it said is void."""
    STREAM_DONE = "stream done"
    """A watch stream that brought events ended as the server meant it to."""


Item = WatchEvent | Page | Listed | Mark
"""What `follow` yields."""


async def follow(
    res: Resource, cursor: Cursor, limiter: RateLimiter, settings: WatchSettings
) -> AsyncGenerator[Item, None]:
    """List when `cursor` is not listed (or a relist is due), then watch from its version.

    Never ends by itself: a stream that ends or times out is followed by the next one from
    the last version seen. Raises what the layers below raise, and ApiStatusError for a watch
    that ended at once without events.
    """
    while True:
        if cursor.listed and cursor.relist_in(settings.relist_period) <= 0:
            log.debug("%s: periodic relist", res.kind)
            cursor.forget()
        if not cursor.listed:
            async with aclosing(list_pages(res, limiter, settings)) as pages:
                async for item in pages:
                    yield item
                    if isinstance(item, Listed):
                        cursor.version, cursor.listed = item.version, True
                        cursor.listed_at = time.monotonic()
        assert cursor.version is not None  # a list sets it
        started = time.monotonic()
        events = 0
        relist_in = cursor.relist_in(settings.relist_period)
        stream = watch_stream(res, cursor.version, relist_in, limiter, settings)
        async with aclosing(stream) as watched:
            async for event in watched:
                yield event
                if event.type in RESUMABLE:
                    events += 1
                    version = event.obj["metadata"].get("resourceVersion")
                    if version:
                        cursor.version = version
        if events:
            yield Mark.STREAM_DONE
        elif time.monotonic() - started < EMPTY_WATCH_SECONDS:
            raise ApiStatusError(0, "watch closed at once without events")


async def list_pages(
    res: Resource, limiter: RateLimiter, settings: WatchSettings
) -> AsyncGenerator[Page | Listed | Mark, None]:
    """One complete list, page by page: `LIST_BEGUN`, `Page`s, then `Listed`.

    Pages are yielded as they arrive (no list of raw pages is held). The client-side rate
    limit (`--kube-api-qps`) counts a list once, not once per page: kube-proxy's informers
    list from the API server's watch cache in one request per kind, and at 10,000 Services
    the 41 pages of a start waited ~7 s for tokens at the default 5/s. The pages go one at a
    time, so a list never has more than one request in flight.
    """
    yield Mark.LIST_BEGUN
    token: str | None = None
    while True:
        if token is None:  # a list begins (again): its one token
            await limiter.acquire()
        params: dict[str, Any] = {"limit": settings.page_size}
        if token:
            params["_continue"] = token
        try:
            body = await _request_json(res, params, settings.request_timeout)
        except Expired:
            if token is None:
                raise
            log.info("%s list continue token expired; listing again", res.kind)
            token = None
            yield Mark.LIST_BEGUN
            continue
        yield _page(body)
        body.pop("items", None)  # only this page's parsed state stays
        meta = body.get("metadata")
        if not isinstance(meta, dict):
            raise BadData(f"list metadata is {json_type(meta)}, not an object")
        token = meta.get("continue") or None
        if token is not None and not isinstance(token, str):
            raise BadData(f"list metadata.continue is {json_type(token)}, not a string")
        if token is None:
            break
    version = meta.get("resourceVersion")
    if not isinstance(version, str) or not version:
        raise BadData(f"list metadata.resourceVersion is {json_type(version)}, not a version")
    log.debug("%s listed at version %s", res.kind, version)
    yield Listed(version)


def _page(body: Mapping[str, Any]) -> Page:
    """The objects of one list page; items that are not objects are counted, not kept."""
    items = body.get("items")
    if items is None:
        return Page([], 0)
    if not isinstance(items, list):
        raise BadData(f"list items is {json_type(items)}, not an array")
    good: list[Mapping[str, Any]] = [item for item in items if isinstance(item, dict)]
    return Page(good, len(items) - len(good))


async def _request_json(
    res: Resource, params: dict[str, Any], request_timeout: float
) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(sock_connect=request_timeout, sock_read=request_timeout)
    response = await res.lister(
        label_selector=res.label_selector,
        field_selector=res.field_selector,
        _preload_content=False,
        _request_timeout=timeout,
        **params,
    )
    async with response:
        await check(response)
        raw = await response.read()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # garbled, not UTF-8, absurdly nested
        raise BadData("list body is not JSON", raw, describe(exc)) from exc
    if not isinstance(body, dict):
        raise BadData(f"list body is {json_type(body)}, not an object", raw)
    return body


def watch_timeouts(
    watch_timeout: float, slack: float, relist_in: float, spread: float
) -> tuple[int, float]:
    """(`timeoutSeconds` asked of the server, client read timeout) for one watch.

    `spread` in [0, 1) staggers renewals. A healthy server ends the stream by
    `timeoutSeconds` and sends bookmarks in between, so a stream silent for longer than the
    read timeout is dead (a hung API server or a broken path): it is dropped and resumed from
    the last version. With the defaults a silent watch is noticed within 55 s.
    """
    seconds = max(1, math.ceil(min(watch_timeout * (1 + spread / 2), relist_in)))
    return seconds, seconds + slack


async def watch_stream(
    res: Resource,
    version: str,
    relist_in: float,
    limiter: RateLimiter,
    settings: WatchSettings,
) -> AsyncGenerator[WatchEvent, None]:
    """One watch request from `version` (bookmarks asked for): its events until it ends.

    An ERROR event raises (Expired for 410); a malformed line raises BadData.
    """
    await limiter.acquire()
    seconds, read_timeout = watch_timeouts(
        settings.watch_timeout, settings.watch_read_slack, relist_in, random.random()
    )
    timeout = aiohttp.ClientTimeout(sock_connect=settings.request_timeout, sock_read=read_timeout)
    response = await res.lister(
        label_selector=res.label_selector,
        field_selector=res.field_selector,
        watch=True,
        allow_watch_bookmarks=True,
        resource_version=version,
        timeout_seconds=seconds,
        _preload_content=False,
        _request_timeout=timeout,
    )
    async with response:
        await check(response)
        async with aclosing(in_turns(json_lines(response.content))) as lines:
            async for line in lines:
                event = parse_event(line)
                if event.type == "ERROR":
                    raise status_error(event.obj)
                yield event


def parse_event(line: bytes) -> WatchEvent:
    """One watch-stream line as an event; BadData unless it is a well-formed event.

    Every event's object must be an object; ADDED/MODIFIED/DELETED/BOOKMARK objects must
    have object metadata whose resourceVersion, when present, is a string.
    """
    try:
        event = json.loads(line)
    except (ValueError, RecursionError) as exc:  # garbled, not UTF-8, absurdly nested
        raise BadData("line is not JSON", line, describe(exc)) from exc
    if not isinstance(event, dict):
        raise BadData(f"event is {json_type(event)}, not an object", line)
    type_ = event.get("type")
    if not isinstance(type_, str):
        raise BadData(f"event type is {json_type(type_)}, not a string", line)
    obj = event.get("object")
    if not isinstance(obj, dict):
        raise BadData(f"event object is {json_type(obj)}, not an object", line)
    if type_ in RESUMABLE:
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            raise BadData(f"object metadata is {json_type(meta)}, not an object", line)
        version = meta.get("resourceVersion")
        if version is not None and not isinstance(version, str):
            raise BadData(f"resourceVersion is {json_type(version)}, not a string", line)
    return WatchEvent(type_, obj)


T = TypeVar("T")


async def in_turns(
    items: AsyncIterable[T], slice_seconds: float = EVENTS_SLICE_SECONDS
) -> AsyncGenerator[T, None]:
    """`items` as they come, with a turn for the loop after each `slice_seconds` of them.

    A storm's events come many to a chunk: let connections (and the apply of the events so
    far) in between, rather than take them all in one turn.
    """
    turn = time.perf_counter()
    async for item in items:
        if time.perf_counter() - turn > slice_seconds:
            await asyncio.sleep(0)
            turn = time.perf_counter()
        yield item


async def json_lines(content: aiohttp.StreamReader) -> AsyncGenerator[bytes, None]:
    """Lines of a watch stream of any length (aiohttp's readline caps line size)."""
    buffer = bytearray()
    async for chunk in content.iter_any():
        buffer += chunk
        start = 0
        end = buffer.find(b"\n")
        while end >= 0:
            if end > start:
                yield bytes(buffer[start:end])
            start = end + 1
            end = buffer.find(b"\n", start)
        del buffer[:start]
    if buffer.strip():
        yield bytes(buffer)
