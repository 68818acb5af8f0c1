"""KubeSource: list, then watch, Services, EndpointSlices and this Node into ClusterState.

Each resource is followed by its own loop in the style of client-go's reflector and kopf's
watching.py: list (paginated) and `state.replace` the whole kind, then watch from the list's
resourceVersion; a stream that ends or times out resumes from the last version seen (bookmarks
keep it fresh); 410 Gone relists and reconciles; any other failure backs off exponentially with
jitter (honouring Retry-After) and retries, keeping the last good state meanwhile. Only raw JSON
is decoded: the client's model deserialisation is too slow for big clusters.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from kubernetes_asyncio import client as kclient
from kubernetes_asyncio import config as kconfig

from kube_userspace_proxy import logs, netutil
from kube_userspace_proxy.errors import ConfigError, ProxyError
from kube_userspace_proxy.sources.retry import (
    MAX_RETRY_AFTER,
    Backoff,
    RateLimiter,
    parse_retry_after,
)
from kube_userspace_proxy.state import ClusterState

log = logs.get(__name__)

PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"

Kind = Literal["Service", "EndpointSlice", "Node"]


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


# JSONDecodeError/UnicodeDecodeError: a truncated or garbled body; resume like any failure.
_RETRYABLE = (
    aiohttp.ClientError,
    OSError,
    TimeoutError,
    ApiStatusError,
    json.JSONDecodeError,
    UnicodeDecodeError,
)


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
        watch_timeout: float = 300,
        request_timeout: float = 30,
        page_size: int = 500,
        relist_period: float | None = None,
    ) -> None:
        self._state = state
        self._kubeconfig = kubeconfig or None
        self._master = master or None
        self.node_name = netutil.node_name(node_name)
        self.label_selector = label_selector(service_proxy_name)
        self._limiter = RateLimiter(qps, burst)
        self._backoff = (backoff_initial, backoff_max)
        self._watch_timeout = watch_timeout
        self._request_timeout = request_timeout
        self._page_size = page_size
        self._relist_period = relist_period or None
        self._versions: dict[Kind, str] = {}
        self.relists_total = 0
        self.errors_total = 0

    def resource_version(self, kind: Kind) -> str | None:
        """The version a watch of `kind` would resume from (None before the first list)."""
        return self._versions.get(kind)

    async def run(self) -> None:
        """List and watch until cancelled; raises ConfigError if no client config is usable."""
        configuration, loader = await load_client_configuration(self._kubeconfig, self._master)
        log.info(
            "Watching %s for Services and EndpointSlices (%s) and Node %s",
            configuration.host,
            self.label_selector,
            self.node_name,
        )
        async with kclient.ApiClient(configuration) as api, asyncio.TaskGroup() as group:
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
                except (*_RETRYABLE, Expired) as exc:
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
            except _RETRYABLE as exc:
                self.errors_total += 1
                retry_after = exc.retry_after if isinstance(exc, ApiStatusError) else None
                delay = backoff.next(min(retry_after or 0.0, MAX_RETRY_AFTER))
                log.warning(
                    "%s %s failed (%s); retry %d in %.2fs",
                    res.kind,
                    "watch" if listed else "list",
                    _describe(exc),
                    backoff.failures,
                    delay,
                )
                await asyncio.sleep(delay)

    def _relist_due(self, listed_at: float) -> float:
        """Seconds until the periodic relist (`relist_period`); infinity without one."""
        if self._relist_period is None:
            return float("inf")
        return listed_at + self._relist_period - time.monotonic()

    async def _list(self, res: _Resource) -> str:
        """List every page, then hand the whole kind to the state; returns the list version."""
        items: list[Mapping[str, Any]] = []
        token: str | None = None
        while True:
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
                items, token = [], None
                continue
            items.extend(body.get("items") or ())
            meta = body.get("metadata") or {}
            token = meta.get("continue") or None
            if token is None:
                break
        version = str(meta.get("resourceVersion") or "")
        if not version:
            raise ApiStatusError(0, f"{res.kind} list without metadata.resourceVersion")
        if res.kind == "Node":
            self._state.set_node(items[0] if items else None)
        else:
            self._state.replace(res.kind, items)
        log.debug("%s listed: %d objects at version %s", res.kind, len(items), version)
        return version

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
            body = json.loads(await response.read())
        if not isinstance(body, dict):
            raise ApiStatusError(0, f"{res.kind} list is not a JSON object")
        return body

    async def _watch(self, res: _Resource, version: str, relist_in: float) -> int:
        """Stream events into the state until the stream ends; returns how many arrived."""
        await self._limiter.acquire()
        # Spread watch renewals like client-go: timeout in [t, 2t).
        spread = self._watch_timeout * (1 + random.random())
        seconds = max(1, math.ceil(min(spread, relist_in)))
        timeout = aiohttp.ClientTimeout(
            sock_connect=self._request_timeout, sock_read=seconds + self._request_timeout
        )
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
            async for line in _json_lines(response.content):
                event = json.loads(line)
                type_ = event.get("type")
                obj = event.get("object") or {}
                if type_ == "ERROR":
                    code = int(obj.get("code") or 0)
                    if code == 410:
                        raise Expired(obj.get("message", "Gone"))
                    raise ApiStatusError(code, str(obj.get("message") or obj.get("reason")))
                if type_ in {"ADDED", "MODIFIED", "DELETED"}:
                    if res.kind == "Node":
                        self._state.set_node(None if type_ == "DELETED" else obj)
                    else:
                        self._state.apply(res.kind, type_, obj)
                elif type_ != "BOOKMARK":
                    log.warning("%s watch: ignoring event type %r", res.kind, type_)
                    continue
                events += 1
                new_version = (obj.get("metadata") or {}).get("resourceVersion")
                if new_version:
                    self._versions[res.kind] = str(new_version)
        return events


async def _check(response: aiohttp.ClientResponse) -> None:
    """Raise Expired on 410 and ApiStatusError on any other non-2xx answer."""
    if 200 <= response.status < 300:
        return
    reason = response.reason or ""
    try:
        body = json.loads(await response.read())
        if isinstance(body, dict):
            reason = str(body.get("message") or body.get("reason") or reason)
    except (ValueError, aiohttp.ClientError):
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
