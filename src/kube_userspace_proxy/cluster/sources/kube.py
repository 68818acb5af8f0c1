"""KubeSource: list, then watch, Services, EndpointSlices and this Node into ClusterState.

Each resource is followed by its own loop in the style of client-go's reflector and kopf's
watching.py: list (paginated) and `state.replace` the whole kind, then watch from the list's
resourceVersion; a stream that ends or times out resumes from the last version seen (bookmarks
keep it fresh); 410 Gone relists and reconciles; any other failure backs off exponentially with
jitter (honouring Retry-After) and retries, keeping the last good state meanwhile. A malformed
event or list is such a failure too (one log line, rate-limited), and anything unexpected is
logged and relisted: no input ends a loop. Only raw JSON is decoded: the client's model
deserialisation is too slow for big clusters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
from kubernetes_asyncio import client as kclient
from kubernetes_asyncio import config as kconfig

from kube_userspace_proxy import addresses, logs
from kube_userspace_proxy.cluster.sources.retry import (
    MAX_RETRY_AFTER,
    Backoff,
    RateLimiter,
    parse_retry_after,
)
from kube_userspace_proxy.cluster.state import ClusterState, Event
from kube_userspace_proxy.cluster.state import Kind as ListedKind
from kube_userspace_proxy.errors import ConfigError, ProxyError

log = logs.get(__name__)

PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"

Kind = Literal["Service", "EndpointSlice", "Node"]
EVENTS_SLICE_SECONDS = 0.004
"""Longest run of watch events taken in before the loop gets a turn."""


def label_selector(service_proxy_name: str | None = None) -> str:
    """kube-proxy's selector: Services (and their slices) for no other proxy, not headless.

    With a proxy name X, only objects labelled `service.kubernetes.io/service-proxy-name=X`.
    The EndpointSlice controller copies Service labels to slices, so one selector serves both.
    """
    if service_proxy_name:
        return f"{PROXY_NAME_LABEL}={service_proxy_name},!{HEADLESS_LABEL}"
    return f"!{PROXY_NAME_LABEL},!{HEADLESS_LABEL}"


async def load_client_configuration(
    kubeconfig: str | None = None, master: str | None = None
) -> tuple[Any, Any]:
    """Client configuration (and kubeconfig loader, if any) as kube-proxy finds it.

    Order: the kubeconfig file, else `$KUBECONFIG`; `master` overrides its server. With
    neither file, `master` alone, else the in-cluster service account. ConfigError otherwise.
    """
    configuration = kclient.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    loader = None
    if path:
        if not _any_file(path):
            raise ConfigError(f"cannot load kubeconfig {path}: no such file")
        try:
            loader = await kconfig.load_kube_config(
                config_file=path, client_configuration=configuration, persist_config=False
            )
        except Exception as exc:  # the loader raises many types; all mean "bad kubeconfig"
            raise ConfigError(f"cannot load kubeconfig {path}: {exc}") from exc
        _follow_token_file(loader, configuration)
        if master:
            configuration.host = master.rstrip("/")
    elif master:
        configuration.host = master.rstrip("/")
    else:
        try:
            kconfig.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except kconfig.ConfigException as exc:
            raise ConfigError(
                "no --kubeconfig, $KUBECONFIG or --master given, and the in-cluster "
                f"config is unusable ({exc}); run in a pod or pass --kubeconfig"
            ) from exc
    return configuration, loader


RequestObserver = Callable[[str, str, str, float], None]
"""Told of every API request: (HTTP code or "<error>", method, host, seconds to the answer)."""


def observe_requests(api: Any, observe: RequestObserver) -> None:
    """Report every request of `api` (an ApiClient) to `observe`, as client-go's metrics see
    them: the status code (or `<error>` without an answer), the method, the API server's
    host:port, and the time to the response headers (a watch's stream is not counted)."""
    rest = api.rest_client
    plain = rest.request

    async def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        code = "<error>"
        try:
            response = await plain(method, url, *args, **kwargs)
            code = str(response.status)
            return response
        except kclient.ApiException as exc:
            code = str(exc.status) if exc.status else "<error>"
            raise
        finally:
            observe(code, method, urlsplit(url).netloc, time.monotonic() - started)

    rest.request = request


def _follow_token_file(loader: Any, configuration: Any) -> None:
    """Re-read a kubeconfig user's `tokenFile` whenever the file changes, as client-go does.

    Projected service-account tokens (kubeadm's kubeconfig.conf names one) are rotated by the
    kubelet about hourly; the client reads the token once, so without this the proxy would
    lose the API server when the old token expires. One stat per request: requests are lists
    and watch starts, not per connection.
    """
    user = getattr(loader, "_user", None)
    if user is not None and "exec" in user:
        _rerun_expired_exec(loader, configuration)
        return
    if user is None or "tokenFile" not in user or user.safe_get("token"):
        return
    path = os.path.join(loader._get_base_path(user.path), user["tokenFile"])
    seen = [_stamp(path)]

    def reread(config: Any, *_: Any) -> None:
        stamp = _stamp(path)
        if stamp == seen[0]:
            return
        try:
            with open(path) as handle:
                token = handle.read().strip()
        except OSError as exc:
            log.warning("cannot re-read the API token from %s: %s", path, exc.strerror)
            return
        if not token:
            return  # caught mid-write: the next request reads it again
        seen[0] = stamp
        config.api_key["BearerToken"] = f"Bearer {token}"
        log.info("API token file %s changed: using the new token", path)

    configuration.refresh_api_key_hook = reread


def _rerun_expired_exec(loader: Any, configuration: Any) -> None:
    """Re-run an exec credential plugin at the first request after its token expires.

    (client-go does the same; the client library alone checks only once a minute.) A plugin
    that gives no expirationTimestamp keeps its token until the minutely check re-runs it.
    """

    async def rerun(config: Any, *_: Any) -> None:
        expiry = getattr(loader, "exec_plugin_expiry", None)
        if expiry is None or not kconfig.kube_config._is_expired(expiry):
            return
        run = asyncio.ensure_future(loader.load_from_exec_plugin())
        try:
            renewed = await asyncio.shield(run)
        except asyncio.CancelledError:
            # Stopping: let the plugin process finish rather than leave it behind.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run, PLUGIN_GRACE)
            raise
        if renewed:
            config.api_key["BearerToken"] = loader.token
            log.info("exec credential plugin re-run: its token had expired")

    configuration.refresh_api_key_hook = rerun


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)  # follows the ..data symlink a projected volume swaps
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _any_file(paths: str) -> bool:
    """Like kubectl: of a `:`-separated $KUBECONFIG, missing files are skipped; none is an error."""
    return any(os.path.isfile(p) for p in paths.split(os.pathsep) if p)


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


# Failures of the connection or the server: back off and retry. (Undecodable bodies are BadData.)
_RETRYABLE = (aiohttp.ClientError, OSError, TimeoutError, ApiStatusError)

_EXCERPT = 160  # bytes of a bad line quoted in the log
PLUGIN_GRACE = 5.0  # seconds an exec credential plugin may take to finish when we stop
REPEAT_LOG_INTERVAL = 60.0  # seconds: the same trouble is logged at most once per interval
WATCH_TIMEOUT = 30.0
"""Seconds: each watch asks the server to end it after [t, 1.5 t) (`timeoutSeconds`)."""
WATCH_READ_SLACK = 10.0
"""Seconds a watch may stay silent past its `timeoutSeconds` before it counts as dead."""


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


_WATCH_EVENTS: dict[str, Event] = {"ADDED": "ADDED", "MODIFIED": "MODIFIED", "DELETED": "DELETED"}


@dataclass(frozen=True, slots=True)
class _Resource:
    kind: Kind
    lister: Callable[..., Awaitable[Any]]
    label_selector: str | None = None
    field_selector: str | None = None


class KubeSource:
    """Follows the API server into a ClusterState; `run()` is a long-lived root task.

    Nothing is programmed from a half-listed world: the state counts as listed only when
    both the Service and EndpointSlice lists are in. While the API server is away the last
    good state stays as it is.
    """

    def __init__(
        self,
        state: ClusterState,
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
        self._state = state
        self._on_request = on_request
        self._kubeconfig = kubeconfig or None
        self._master = master or None
        self.node_name = addresses.node_name(node_name)
        self.label_selector = label_selector(service_proxy_name)
        self._limiter = RateLimiter(qps, burst)
        self._backoff = (backoff_initial, backoff_max)
        self._watch_timeout = watch_timeout
        self._watch_read_slack = watch_read_slack
        self._request_timeout = request_timeout
        self._page_size = page_size
        self._relist_period = relist_period or None
        self._versions: dict[Kind, str] = {}
        self.relists_total = 0
        self.errors_total = 0  # every failed list or watch, bad data and unexpected errors too
        self.bad_data_total = 0  # malformed events and list bodies
        self._repeats = RepeatLimiter(REPEAT_LOG_INTERVAL)
        self._api_url = "?"  # known once run() has loaded the client configuration

    def resource_version(self, kind: Kind) -> str | None:
        """The version a watch of `kind` would resume from (None before the first list)."""
        return self._versions.get(kind)

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
                group.create_task(_refresh_credentials(loader, configuration))

    async def load_once(self) -> None:
        """List Services, EndpointSlices and the Node once (for one-shot commands like `rules`).

        Raises ProxyError naming the API server and the failure; no retries.
        """
        configuration, _ = await load_client_configuration(self._kubeconfig, self._master)
        async with kclient.ApiClient(configuration) as api:
            for resource in self._resources(api):
                try:
                    await self._list(resource)
                except (*_RETRYABLE, Expired, BadData) as exc:
                    raise ProxyError(
                        f"cannot list {resource.kind}s from {configuration.host}: {_describe(exc)}"
                    ) from exc

    def _resources(self, api: Any) -> tuple[_Resource, ...]:
        core = kclient.CoreV1Api(api)
        discovery = kclient.DiscoveryV1Api(api)
        return (
            _Resource("Service", core.list_service_for_all_namespaces, self.label_selector),
            _Resource(
                "EndpointSlice",
                discovery.list_endpoint_slice_for_all_namespaces,
                self.label_selector,
            ),
            _Resource("Node", core.list_node, None, f"metadata.name={self.node_name}"),
        )

    async def _follow(self, res: _Resource) -> None:
        # The resume point lives in self._versions, updated per event as it is applied, so
        # a stream cut mid-way resumes exactly after the last event the state has seen.
        backoff = Backoff(*self._backoff)
        listed = False
        gone_in_a_row = 0
        listed_at = 0.0
        while True:
            try:
                if listed and self._relist_due(listed_at) <= 0:
                    log.debug("%s: periodic relist", res.kind)
                    listed = False
                if not listed:
                    self._versions[res.kind] = await self._list(res)
                    listed, listed_at = True, time.monotonic()
                    if backoff.failures:
                        log.info("%s list succeeded after %d failures", res.kind, backoff.failures)
                    backoff.reset()
                started = time.monotonic()
                events = await self._watch(
                    res, self._versions[res.kind], self._relist_due(listed_at)
                )
                if events:
                    backoff.reset()
                    gone_in_a_row = 0
                elif time.monotonic() - started < 1.0:
                    # client-go's rule: an empty watch shorter than a second is a failure,
                    # or a server that closes at once would be hammered.
                    raise ApiStatusError(0, "watch closed at once without events")
            except Expired:
                self.relists_total += 1
                gone_in_a_row += 1
                log.info(
                    "%s version %s expired; relisting",
                    res.kind,
                    self._versions.get(res.kind),
                )
                listed = False
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
                    "watch" if listed else "list",
                    "event" if listed else "response",
                    exc,
                    f"resuming from version {self._versions.get(res.kind)}"
                    if listed
                    else "listing again",
                    delay,
                )
                await asyncio.sleep(delay)
            except _RETRYABLE as exc:
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
                    "watch" if listed else "list",
                    _describe(exc),
                    self._api_url,
                    backoff.failures,
                    delay,
                )
                await asyncio.sleep(delay)
            except Exception as exc:  # data or a bug nobody foresaw: this loop must never end
                self.errors_total += 1
                listed = False  # the state may have missed part of a change: start over
                delay = backoff.next()
                self._repeats.log(
                    (res.kind, type(exc).__name__),
                    logging.ERROR,
                    "%s: unexpected error (%s); relisting in %.2fs",
                    res.kind,
                    _describe(exc),
                    delay,
                    exc_info=True,
                )
                await asyncio.sleep(delay)

    def _relist_due(self, listed_at: float) -> float:
        """Seconds until the periodic relist (`relist_period`); infinity without one."""
        if self._relist_period is None:
            return float("inf")
        return listed_at + self._relist_period - time.monotonic()

    async def _list(self, res: _Resource) -> str:
        """List every page into the state as it arrives; returns the list version.

        Pages are parsed and applied one by one (no list of raw pages is held); the state
        drops what the whole list did not name at the end. The client-side rate limit
        (`--kube-api-qps`) counts a list once, not once per page: kube-proxy's informers list
        from the API server's watch cache in one request per kind, and at 10,000 Services
        the 41 pages of a start waited ~7 s for tokens at the default 5/s. The pages go one
        at a time, so a list never has more than one request in flight.
        """
        node: list[Mapping[str, Any]] = []
        kind: ListedKind | None = None if res.kind == "Node" else res.kind
        if kind is not None:
            self._state.begin_list(kind)
        token: str | None = None
        while True:
            if token is None:  # a list begins (again): its one token
                await self._limiter.acquire()
            params: dict[str, Any] = {"limit": self._page_size}
            if token:
                params["_continue"] = token
            try:
                body = await self._request_json(res, params)
            except Expired:
                if token is None:
                    raise
                log.info("%s list continue token expired; listing again", res.kind)
                token = None
                if kind is not None:
                    self._state.begin_list(kind)
                continue
            items = self._list_items(res, body)
            if kind is not None:
                self._state.list_page(kind, items)
            else:
                node.extend(items)
            body.pop("items", None)  # only this page's parsed state stays
            meta = body.get("metadata")
            if not isinstance(meta, dict):
                raise BadData(f"list metadata is {_json_type(meta)}, not an object")
            token = meta.get("continue") or None
            if token is not None and not isinstance(token, str):
                raise BadData(f"list metadata.continue is {_json_type(token)}, not a string")
            if token is None:
                break
        version = meta.get("resourceVersion")
        if not isinstance(version, str) or not version:
            raise BadData(f"list metadata.resourceVersion is {_json_type(version)}, not a version")
        if kind is not None:
            self._state.end_list(kind)
        else:
            self._state.set_node(node[0] if node else None)
        log.debug("%s listed at version %s", res.kind, version)
        return version

    def _list_items(self, res: _Resource, body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        """The objects of one list page; items that are not objects are dropped, counted once."""
        items = body.get("items")
        if items is None:
            return []
        if not isinstance(items, list):
            raise BadData(f"list items is {_json_type(items)}, not an array")
        good: list[Mapping[str, Any]] = [item for item in items if isinstance(item, dict)]
        if len(good) < len(items):
            self.bad_data_total += 1
            self._repeats.log(
                (res.kind, "list items"),
                logging.WARNING,
                "%s list: skipping %d of %d items that are not objects",
                res.kind,
                len(items) - len(good),
                len(items),
            )
        return good

    async def _request_json(self, res: _Resource, params: dict[str, Any]) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(
            sock_connect=self._request_timeout, sock_read=self._request_timeout
        )
        response = await res.lister(
            label_selector=res.label_selector,
            field_selector=res.field_selector,
            _preload_content=False,
            _request_timeout=timeout,
            **params,
        )
        async with response:
            await _check(response)
            raw = await response.read()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # garbled, not UTF-8, absurdly nested
            raise BadData("list body is not JSON", raw, _describe(exc)) from exc
        if not isinstance(body, dict):
            raise BadData(f"list body is {_json_type(body)}, not an object", raw)
        return body

    async def _watch(self, res: _Resource, version: str, relist_in: float) -> int:
        """Stream events into the state until the stream ends; returns how many arrived."""
        await self._limiter.acquire()
        seconds, read_timeout = watch_timeouts(
            self._watch_timeout, self._watch_read_slack, relist_in, random.random()
        )
        timeout = aiohttp.ClientTimeout(sock_connect=self._request_timeout, sock_read=read_timeout)
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
        events = 0
        async with response:
            await _check(response)
            turn = time.perf_counter()
            async for line in _json_lines(response.content):
                if time.perf_counter() - turn > EVENTS_SLICE_SECONDS:
                    # A storm's events come many to a chunk: let connections (and the apply
                    # of the events so far) in between, rather than take them all in one turn.
                    await asyncio.sleep(0)
                    turn = time.perf_counter()
                type_, obj = parse_event(line)
                if type_ == "ERROR":
                    code, reason = _error_status(obj)
                    if code == 410:
                        raise Expired(reason)
                    raise ApiStatusError(code, reason)
                change = _WATCH_EVENTS.get(type_)
                if change is not None:
                    if res.kind == "Node":
                        self._state.set_node(None if change == "DELETED" else obj)
                    else:
                        self._state.apply(res.kind, change, obj)
                elif type_ != "BOOKMARK":
                    self._repeats.log(
                        (res.kind, "event type"),
                        logging.WARNING,
                        "%s watch: ignoring event type %r",
                        res.kind,
                        type_[:_EXCERPT],
                    )
                    continue
                events += 1
                new_version = obj["metadata"].get("resourceVersion")
                if new_version:
                    self._versions[res.kind] = new_version
        return events


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


def parse_event(line: bytes) -> tuple[str, dict[str, Any]]:
    """One watch-stream line as (type, object); BadData unless it is a well-formed event.

    Every event's object must be an object; ADDED/MODIFIED/DELETED/BOOKMARK objects must
    have object metadata whose resourceVersion, when present, is a string.
    """
    try:
        event = json.loads(line)
    except (ValueError, RecursionError) as exc:  # garbled, not UTF-8, absurdly nested
        raise BadData("line is not JSON", line, _describe(exc)) from exc
    if not isinstance(event, dict):
        raise BadData(f"event is {_json_type(event)}, not an object", line)
    type_ = event.get("type")
    if not isinstance(type_, str):
        raise BadData(f"event type is {_json_type(type_)}, not a string", line)
    obj = event.get("object")
    if not isinstance(obj, dict):
        raise BadData(f"event object is {_json_type(obj)}, not an object", line)
    if type_ in _WATCH_EVENTS or type_ == "BOOKMARK":
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            raise BadData(f"object metadata is {_json_type(meta)}, not an object", line)
        version = meta.get("resourceVersion")
        if version is not None and not isinstance(version, str):
            raise BadData(f"resourceVersion is {_json_type(version)}, not a string", line)
    return type_, obj


def _error_status(status: Mapping[str, Any]) -> tuple[int, str]:
    """(code, message) of an ERROR event's Status; code 0 when it is not an HTTP status."""
    raw = status.get("code")
    code = 0
    if isinstance(raw, int) and not isinstance(raw, bool) and 100 <= raw <= 599:
        code = raw
    elif isinstance(raw, str) and len(raw) == 3 and raw.isascii() and raw.isdigit():
        code = int(raw)
    reason = str(status.get("message") or status.get("reason") or "ERROR event")[:_EXCERPT]
    if code == 0 and raw is not None:
        reason += f" (code {str(raw)[:_EXCERPT]!r})"
    return code, reason


def _json_type(value: object) -> str:
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


def _excerpt(raw: bytes) -> str:
    text = raw[:_EXCERPT].decode("utf-8", "replace")
    return repr(text) + ("..." if len(raw) > _EXCERPT else "")


async def _check(response: aiohttp.ClientResponse) -> None:
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


async def _json_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
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


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _refresh_credentials(loader: Any, configuration: Any) -> None:
    """Keep exec-plugin / GCP tokens of a kubeconfig fresh; other auth needs nothing."""
    while True:
        try:
            await kconfig.refresh_token(loader, configuration)
            return  # nothing to refresh for this kind of credential
        except Exception as exc:  # a failed refresh must not stop the proxy; try again later
            log.warning("kubeconfig credential refresh failed: %s", _describe(exc))
            await asyncio.sleep(60)
