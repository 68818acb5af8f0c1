"""KubeSource: Services, EndpointSlices and this Node from the API server into a StateSink.

Which resources, with which selectors, into the sink, and the supervision of one loop per
resource in the style of client-go's reflector: the loop takes what `watching.follow` yields
(a paginated list, the `Listed` sentinel, then watch events from the list's resourceVersion)
into the sink. 410 Gone relists and reconciles; any other failure backs off exponentially with
jitter (honouring Retry-After) and retries, keeping the last good state meanwhile. A malformed
event or list is such a failure too (one log line, rate-limited), and anything unexpected is
logged and relisted: no input ends a loop. `client` finds the API server and keeps the
credentials fresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import aclosing
from typing import Any

from kube_userspace_proxy import addresses, logs
from kube_userspace_proxy.cluster.sink import Event, StateSink
from kube_userspace_proxy.cluster.sources.client import (
    RequestObserver,
    load_client_configuration,
    observe_requests,
    refresh_credentials,
)
from kube_userspace_proxy.cluster.sources.failures import (
    EXCERPT,
    RETRYABLE,
    ApiStatusError,
    BadData,
    Expired,
    describe,
)
from kube_userspace_proxy.cluster.sources.kubeapi import kclient
from kube_userspace_proxy.cluster.sources.retry import MAX_RETRY_AFTER, Backoff, RateLimiter
from kube_userspace_proxy.cluster.sources.watching import (
    WATCH_READ_SLACK,
    WATCH_TIMEOUT,
    Cursor,
    Item,
    Kind,
    Listed,
    Mark,
    Page,
    Resource,
    WatchEvent,
    WatchSettings,
    follow,
    list_pages,
)
from kube_userspace_proxy.errors import ProxyError

log = logs.get(__name__)

PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
REPEAT_LOG_INTERVAL = 60.0  # seconds: the same trouble is logged at most once per interval

_SINK_EVENTS: dict[str, Event] = {"ADDED": "ADDED", "MODIFIED": "MODIFIED", "DELETED": "DELETED"}


def label_selector(service_proxy_name: str | None = None) -> str:
    """kube-proxy's selector: Services (and their slices) for no other proxy, not headless.

    With a proxy name X, only objects labelled `service.kubernetes.io/service-proxy-name=X`.
    The EndpointSlice controller copies Service labels to slices, so one selector serves both.
    """
    if service_proxy_name:
        return f"{PROXY_NAME_LABEL}={service_proxy_name},!{HEADLESS_LABEL}"
    return f"!{PROXY_NAME_LABEL},!{HEADLESS_LABEL}"


class KubeSource:
    """Follows the API server into a StateSink; `run()` is a long-lived root task.

    Nothing is programmed from a half-listed world: the state counts as listed only when
    both the Service and EndpointSlice lists are in. While the API server is away the last
    good state stays as it is.
    """

    def __init__(
        self,
        state: StateSink,
        *,
        kubeconfig: str | None = None,
        master: str | None = None,
        node_name: str | None = None,
        service_proxy_name: str | None = None,
        qps: float = 5,
        burst: int = 10,
        backoff_max: float = 30,
        backoff_initial: float = 0.8,
        watch_timeout: float = WATCH_TIMEOUT,
        watch_read_slack: float = WATCH_READ_SLACK,
        request_timeout: float = 30,
        page_size: int = 500,
        relist_period: float | None = None,
        on_request: RequestObserver | None = None,
    ) -> None:
        self._sink = state
        self._on_request = on_request
        self._kubeconfig = kubeconfig or None
        self._master = master or None
        self.node_name = addresses.node_name(node_name)
        self.label_selector = label_selector(service_proxy_name)
        self._limiter = RateLimiter(qps, burst)
        self._backoff = (backoff_initial, backoff_max)
        self._settings = WatchSettings(
            page_size=page_size,
            request_timeout=request_timeout,
            watch_timeout=watch_timeout,
            watch_read_slack=watch_read_slack,
            relist_period=relist_period or None,
        )
        self._cursors: dict[Kind, Cursor] = {}
        self.relists_total = 0
        self.errors_total = 0  # every failed list or watch, bad data and unexpected errors too
        self.bad_data_total = 0  # malformed events and list bodies
        self._repeats = RepeatLimiter(REPEAT_LOG_INTERVAL)
        self._api_url = "?"  # known once run() has loaded the client configuration

    def resource_version(self, kind: Kind) -> str | None:
        """The version a watch of `kind` would resume from (None before the first list)."""
        cursor = self._cursors.get(kind)
        return None if cursor is None else cursor.version

    async def run(self) -> None:
        """List and watch until cancelled; raises ConfigError if no client config is usable."""
        configuration, loader = await load_client_configuration(self._kubeconfig, self._master)
        self._api_url = configuration.host
        log.info(
            "Watching %s for Services and EndpointSlices (%s) and Node %s",
            configuration.host,
            self.label_selector,
            self.node_name,
        )
        async with kclient.ApiClient(configuration) as api, asyncio.TaskGroup() as group:
            if self._on_request is not None:
                observe_requests(api, self._on_request)
            for resource in self._resources(api):
                group.create_task(self._follow(resource), name=f"kube-{resource.kind}")
            if loader is not None:
                group.create_task(refresh_credentials(loader, configuration))

    async def load_once(self) -> None:
        """List Services, EndpointSlices and the Node once (for one-shot commands like `rules`).

        Raises ProxyError naming the API server and the failure; no retries.
        """
        configuration, _ = await load_client_configuration(self._kubeconfig, self._master)
        async with kclient.ApiClient(configuration) as api:
            for resource in self._resources(api):
                node: list[Mapping[str, Any]] = []
                try:
                    pages = list_pages(resource, self._limiter, self._settings)
                    async with aclosing(pages) as listed:
                        async for item in listed:
                            self._take(resource, item, node)
                except (*RETRYABLE, Expired, BadData) as exc:
                    raise ProxyError(
                        f"cannot list {resource.kind}s from {configuration.host}: {describe(exc)}"
                    ) from exc

    def _resources(self, api: Any) -> tuple[Resource, ...]:
        core = kclient.CoreV1Api(api)
        discovery = kclient.DiscoveryV1Api(api)
        return (
            Resource("Service", core.list_service_for_all_namespaces, self.label_selector),
            Resource(
                "EndpointSlice",
                discovery.list_endpoint_slice_for_all_namespaces,
                self.label_selector,
            ),
            Resource("Node", core.list_node, None, f"metadata.name={self.node_name}"),
        )

    async def _follow(self, res: Resource) -> None:
        """Follow one resource forever: its items into the sink, each failure dealt with."""
        backoff = Backoff(*self._backoff)
        cursor = self._cursors[res.kind] = Cursor()
        node: list[Mapping[str, Any]] = []  # the Node list's pages, until it is complete
        gone_in_a_row = 0
        while True:
            try:
                items = follow(res, cursor, self._limiter, self._settings)
                async with aclosing(items) as followed:
                    async for item in followed:
                        self._take(res, item, node)
                        if isinstance(item, Listed):
                            if backoff.failures:
                                log.info(
                                    "%s list succeeded after %d failures",
                                    res.kind,
                                    backoff.failures,
                                )
                            backoff.reset()
                        elif item is Mark.STREAM_DONE:
                            backoff.reset()
                            gone_in_a_row = 0
            except Expired:
                self.relists_total += 1
                gone_in_a_row += 1
                log.info("%s version %s expired; relisting", res.kind, cursor.version)
                cursor.forget()
                if gone_in_a_row > 1:
                    await asyncio.sleep(backoff.next())
            except BadData as exc:
                # A stream failure like any other: the resume point is the last good event.
                self.errors_total += 1
                self.bad_data_total += 1
                delay = backoff.next()
                self._repeats.log(
                    (res.kind, exc.problem),
                    logging.WARNING,
                    "%s %s: bad %s from the API server, %s; %s in %.2fs",
                    res.kind,
                    "watch" if cursor.listed else "list",
                    "event" if cursor.listed else "response",
                    exc,
                    f"resuming from version {cursor.version}" if cursor.listed else "listing again",
                    delay,
                )
                await asyncio.sleep(delay)
            except RETRYABLE as exc:
                self.errors_total += 1
                retry_after = exc.retry_after if isinstance(exc, ApiStatusError) else None
                delay = backoff.next(min(retry_after or 0.0, MAX_RETRY_AFTER))
                # Every step is logged: an unreachable or refusing API server is an error
                # (named, with the reason); a watch stream merely cut is a warning.
                log.log(
                    logging.ERROR
                    if isinstance(exc, OSError | TimeoutError | ApiStatusError)
                    else logging.WARNING,
                    "%s %s failed (%s) talking to the API server at %s; retry %d in %.2fs",
                    res.kind,
                    "watch" if cursor.listed else "list",
                    describe(exc),
                    self._api_url,
                    backoff.failures,
                    delay,
                )
                await asyncio.sleep(delay)
            except Exception as exc:  # data or a bug nobody foresaw: this loop must never end
                self.errors_total += 1
                cursor.forget()  # the state may have missed part of a change: start over
                delay = backoff.next()
                self._repeats.log(
                    (res.kind, type(exc).__name__),
                    logging.ERROR,
                    "%s: unexpected error (%s); relisting in %.2fs",
                    res.kind,
                    describe(exc),
                    delay,
                    exc_info=True,
                )
                await asyncio.sleep(delay)

    def _take(self, res: Resource, item: Item, node: list[Mapping[str, Any]]) -> None:
        """One item of a list or watch into the sink (the Node's list is gathered first)."""
        kind = res.kind
        if isinstance(item, WatchEvent):
            change = _SINK_EVENTS.get(item.type)
            if change is None:
                if item.type != "BOOKMARK":
                    self._repeats.log(
                        (kind, "event type"),
                        logging.WARNING,
                        "%s watch: ignoring event type %r",
                        kind,
                        item.type[:EXCERPT],
                    )
            elif kind == "Node":
                self._sink.set_node(None if change == "DELETED" else item.obj)
            else:
                self._sink.apply(kind, change, item.obj)
        elif isinstance(item, Page):
            if item.skipped:
                self.bad_data_total += 1
                self._repeats.log(
                    (kind, "list items"),
                    logging.WARNING,
                    "%s list: skipping %d of %d items that are not objects",
                    kind,
                    item.skipped,
                    len(item.items) + item.skipped,
                )
            if kind == "Node":
                node.extend(item.items)
            else:
                self._sink.list_page(kind, item.items)
        elif isinstance(item, Listed):
            if kind == "Node":
                self._sink.set_node(node[0] if node else None)
            else:
                self._sink.end_list(kind)
        elif item is Mark.LIST_BEGUN:
            if kind == "Node":
                node.clear()
            else:
                self._sink.begin_list(kind)


class RepeatLimiter:
    """Logs one kind of trouble at most once per `interval`; the next line counts the repeats."""

    def __init__(self, interval: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (logged at, repeats)

    def log(
        self, key: tuple[str, str], level: int, msg: str, *args: object, exc_info: bool = False
    ) -> bool:
        """Log unless `key` was logged within the interval; True when a line was written."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval:
            self._last[key] = (last[0], last[1] + 1)
            return False
        if last is not None and last[1]:
            msg += " (%d more like it in the last %.0fs)"
            args = (*args, last[1], now - last[0])
        self._last[key] = (now, 0)
        log.log(level, msg, *args, exc_info=exc_info)
        return True
