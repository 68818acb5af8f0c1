"""An HTTP-level fake of kube-apiserver for Services, EndpointSlices and Nodes.

It speaks the real wire protocol (LIST with `metadata.resourceVersion`, WATCH as JSON lines,
410 Expired, bookmarks, selectors, pagination) so the unmodified kubernetes-asyncio client can
be tested against it, and it has fault switches for the bad days: dropped watches, compacted
history, failing or hanging requests, malformed watch lines and bodies, and a full stop and
restart on the same port.

Run it alone: `python -m tests.fakes.apiserver --port 6443 --kubeconfig /tmp/fake.kubeconfig
[--seed objects.yaml ...]`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import copy
import json
import re
import signal
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from aiohttp import web

if TYPE_CHECKING:
    from tests.fakes.rbac import Rbac

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Kind:
    """One resource type served by the fake."""

    kind: str
    api_version: str
    plural: str
    namespaced: bool

    @property
    def prefix(self) -> str:
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"


KINDS = {
    k.plural: k
    for k in (
        Kind("Service", "v1", "services", True),
        Kind("EndpointSlice", "discovery.k8s.io/v1", "endpointslices", True),
        Kind("Node", "v1", "nodes", False),
    )
}
BY_KIND = {k.kind: k for k in KINDS.values()}


@dataclass(slots=True)
class RequestRecord:
    """One request the fake received (for counting in tests), recorded when it arrives."""

    method: str
    plural: str
    verb: str  # list | watch | get | create | update | patch | delete | discovery
    at: float  # time.monotonic() of arrival
    status: int = 0  # set when the answer is sent (0: still open, or cut)


@dataclass(slots=True)
class _Fault:
    remaining: int
    status: int
    retry_after: float | None
    plural: str | None
    verb: str | None

    def applies(self, plural: str, verb: str) -> bool:
        return self.remaining > 0 and self.plural in (None, plural) and self.verb in (None, verb)


@dataclass(frozen=True, slots=True)
class _Event:
    rv: int
    kind: str
    type: str
    obj: Obj
    prev: Obj | None


_DROP = object()  # queue sentinel: end the watch abruptly
_END = object()  # queue sentinel: end the watch cleanly


@dataclass(frozen=True, slots=True)
class _Raw:
    """Queue item: bytes written to a watch stream as they are (a malformed line)."""

    data: bytes


@dataclass(slots=True)
class _RawAnswer:
    remaining: int
    body: bytes
    plural: str | None
    verb: str | None

    def applies(self, plural: str, verb: str) -> bool:
        return self.remaining > 0 and self.plural in (None, plural) and self.verb in (None, verb)


@dataclass(eq=False, slots=True)
class _Watcher:
    kind: str
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


class ApiError(Exception):
    """An API-level failure, answered as a Status object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


def status_object(code: int, reason: str, message: str) -> Obj:
    """A metav1.Status body as kube-apiserver sends it."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


# --- selectors --------------------------------------------------------------------------------

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_requirements(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(text: str | None) -> Callable[[Mapping[str, str]], bool]:
    """A predicate for the label selector forms: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (..)`."""
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for req in _split_requirements(text or ""):
        if m := _SET_RE.match(req):
            key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",") if v.strip()}
            if op == "in":
                checks.append(lambda ls, k=key, vs=values: ls.get(k) in vs)
            else:
                checks.append(lambda ls, k=key, vs=values: ls.get(k) not in vs)
        elif "!=" in req:
            key, value = (s.strip() for s in req.split("!=", 1))
            checks.append(lambda ls, k=key, v=value: ls.get(k) != v)
        elif "=" in req:
            key, value = (s.strip() for s in req.replace("==", "=").split("=", 1))
            checks.append(lambda ls, k=key, v=value: ls.get(k) == v)
        elif req.startswith("!"):
            absent = req[1:].strip()
            checks.append(lambda ls, k=absent: k not in ls)
        else:
            checks.append(lambda ls, k=req: k in ls)
    return lambda labels: all(check(labels) for check in checks)


def parse_field_selector(text: str | None) -> Callable[[Obj], bool]:
    """A predicate for `path=value` / `path!=value` field selectors (e.g. metadata.name=n1)."""
    checks: list[Callable[[Obj], bool]] = []
    for req in _split_requirements(text or ""):
        negate = "!=" in req
        path, value = (s.strip() for s in req.replace("!=", "=").replace("==", "=").split("=", 1))

        def check(obj: Obj, p: str = path, v: str = value, neg: bool = negate) -> bool:
            cur: Any = obj
            for part in p.split("."):
                cur = cur.get(part, "") if isinstance(cur, dict) else ""
            return (str(cur) == v) != neg

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


# --- the server -------------------------------------------------------------------------------


class FakeApiServer:
    """kube-apiserver for Services, EndpointSlices and Nodes, in one process, on 127.0.0.1.

    `history_limit` bounds the watch history (older resume points get 410 Expired);
    `bookmark_interval` (seconds) sends BOOKMARK events to watches that asked for them
    (None: only when `send_bookmarks()` is called); `gone_as_http_status` answers an expired
    watch with HTTP 410 instead of the usual 200 + in-stream ERROR event.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        history_limit: int = 10_000,
        bookmark_interval: float | None = None,
        gone_as_http_status: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.history_limit = history_limit
        self.bookmark_interval = bookmark_interval
        self.gone_as_http_status = gone_as_http_status
        self.end_watches_at_once = False
        """Fault switch: every new watch ends cleanly right after its headers."""
        self.rbac: Rbac | None = None
        """When set, every resource request is authorized against these rules (the chart's
        ClusterRole: tests/fakes/rbac.py); a request they do not allow gets 403 Forbidden."""
        self.accepted_tokens: set[str] | None = None
        """When set, resource requests must carry `Authorization: Bearer <one of these>`;
        others get 401 Unauthorized, as from kube-apiserver (see `rotate_token`)."""
        self.before_request: Callable[[web.Request], None] | None = None
        """Test hook, called as each resource request arrives (before any fault applies)."""
        self.requests: list[RequestRecord] = []
        self._rv = 1
        self._floor = 1  # history holds every event with rv > floor
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {k: {} for k in BY_KIND}
        self._history: deque[_Event] = deque()
        self._watchers: set[_Watcher] = set()
        self._faults: list[_Fault] = []
        self._hangs: list[_Fault] = []
        self._silent = False
        self._raw_answers: list[_RawAnswer] = []
        self._hang_release = asyncio.Event()
        self._continues: dict[str, tuple[int, list[Obj], str]] = {}
        self._runner: web.AppRunner | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self, sock: socket.socket | None = None) -> None:
        """Listen (again) on the same port; objects and history survive a stop.

        `sock`: a listening socket to serve on instead (one made in another network namespace).
        """
        app = web.Application(middlewares=[self._middleware])
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        # handler_cancellation: like kube-apiserver, notice a client that hangs up on a quiet watch.
        runner = web.AppRunner(
            app, handle_signals=False, shutdown_timeout=0.5, handler_cancellation=True
        )
        await runner.setup()
        site: web.BaseSite = (
            web.SockSite(runner, sock)
            if sock is not None
            else web.TCPSite(runner, self.host, self.port)
        )
        await site.start()
        sockets = getattr(site._server, "sockets", None) or ()
        self.port = sockets[0].getsockname()[1]
        self._hang_release = asyncio.Event()
        self._runner = runner

    async def stop(self) -> None:
        """Stop listening and cut every open connection (like a crashed API server)."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._broadcast(_DROP)
        self._hang_release.set()
        await runner.cleanup()

    async def __aenter__(self) -> FakeApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def kubeconfig(self, *, token: str = "fake-token") -> Obj:
        """A kubeconfig pointing at this server."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }

    def write_kubeconfig(self, path: str | Path) -> Path:
        """Write `kubeconfig()` to a file and return its path."""
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(yaml.safe_dump(self.kubeconfig(), sort_keys=False))
        partial.replace(target)  # atomically: a reader never sees half a file
        return target

    # -- fault switches and counters ----------------------------------------------------------

    def rotate_token(self, token: str) -> None:
        """Accept only `token` from now on and end every open watch (its token is stale)."""
        self.accepted_tokens = {token}
        self.drop_watches()

    def drop_watches(self, *, abrupt: bool = True) -> None:
        """End every open watch: `abrupt` cuts the connection, otherwise the stream just ends."""
        self._broadcast(_DROP if abrupt else _END)

    def compact(self) -> None:
        """Forget all watch history: resuming from any earlier resourceVersion gets 410."""
        self._history.clear()
        self._floor = self._rv

    def fail_next(
        self,
        count: int,
        status: int = 500,
        *,
        retry_after: float | None = None,
        plural: str | None = None,
        verb: str | None = None,
    ) -> None:
        """Answer the next `count` matching resource requests with `status` (429: Retry-After)."""
        self._faults.append(_Fault(count, status, retry_after, plural, verb))

    def inject_raw(self, line: str | bytes, *, plural: str | None = None) -> int:
        """Write `line` (newline added if missing) as it is into every open watch of `plural`.

        For malformed events: `'{"type":"MODIFIED","object":"oops"}'`, `'["x"]'`, `'garbage'`.
        Returns how many watches got it.
        """
        data = line.encode() if isinstance(line, str) else line
        if not data.endswith(b"\n"):
            data += b"\n"
        kind = KINDS[plural].kind if plural is not None else None
        targets = [w for w in self._watchers if kind in (None, w.kind)]
        for watcher in targets:
            watcher.queue.put_nowait(_Raw(data))
        return len(targets)

    def raw_next(
        self,
        count: int,
        body: str | bytes,
        *,
        plural: str | None = None,
        verb: str | None = None,
    ) -> None:
        """Answer the next `count` matching resource requests with 200 and `body` as it is.

        For malformed list bodies (a watch answered so gets `body` as its whole stream).
        """
        data = body.encode() if isinstance(body, str) else body
        self._raw_answers.append(_RawAnswer(count, data, plural, verb))

    def clear_faults(self) -> None:
        """Cancel pending failures, raw answers and release hung requests."""
        self._faults.clear()
        self._raw_answers.clear()
        self._hangs.clear()
        self._silent = False
        self._hang_release.set()
        self._hang_release = asyncio.Event()

    def hang_next(self, count: int, *, plural: str | None = None, verb: str | None = None) -> None:
        """Accept the next `count` matching resource requests and never answer them.

        They hang until `clear_faults()` or `stop()`.
        """
        self._hangs.append(_Fault(count, 0, None, plural, verb))

    def silence_watches(self) -> None:
        """Open watches go silent (no events, no bookmarks, no end); new ones send headers,
        then nothing. Until `clear_faults()` or `stop()`: then they end."""
        self._silent = True

    def send_bookmarks(self) -> None:
        """Send a BOOKMARK with the current resourceVersion to watches that allow bookmarks."""
        for watcher in self._watchers:
            watcher.queue.put_nowait("BOOKMARK")

    def count(self, plural: str | None = None, verb: str | None = None) -> int:
        """How many requests matched (any resource / any verb when None)."""
        return sum(
            1 for r in self.requests if plural in (None, r.plural) and verb in (None, r.verb)
        )

    def records(self, plural: str | None = None, verb: str | None = None) -> list[RequestRecord]:
        """The matching request records, oldest first."""
        return [r for r in self.requests if plural in (None, r.plural) and verb in (None, r.verb)]

    @property
    def watch_count(self) -> int:
        """Open watch streams right now."""
        return len(self._watchers)

    @property
    def resource_version(self) -> str:
        """The newest resourceVersion (global, as in etcd)."""
        return str(self._rv)

    # -- objects (Python side; HTTP writes use the same paths) --------------------------------

    def get(self, kind: str, name: str, namespace: str = "default") -> Obj | None:
        """A copy of the stored object, or None."""
        key = (namespace if BY_KIND[kind].namespaced else "", name)
        obj = self._objects[kind].get(key)
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, kind: str) -> list[Obj]:
        """Copies of every stored object of a kind."""
        return [copy.deepcopy(o) for _, o in sorted(self._objects[kind].items())]

    def create(self, obj: Mapping[str, Any]) -> Obj:
        """Store a new object (409 AlreadyExists if present); returns the stored copy."""
        new, kind, key = self._prepare(obj)
        if key in self._objects[kind]:
            raise ApiError(409, "AlreadyExists", f'{kind} "{key[1]}" already exists')
        meta = new["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now_rfc3339()
        return self._commit(kind, key, "ADDED", new, None)

    def update(self, obj: Mapping[str, Any]) -> Obj:
        """Replace a stored object (404 if absent; 409 on a stale resourceVersion)."""
        new, kind, key = self._prepare(obj)
        old = self._objects[kind].get(key)
        if old is None:
            raise ApiError(404, "NotFound", f'{kind} "{key[1]}" not found')
        wanted = new["metadata"].get("resourceVersion")
        if wanted and wanted != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'the object {kind} "{key[1]}" has been modified')
        for keep in ("uid", "creationTimestamp"):
            new["metadata"][keep] = old["metadata"].get(keep)
        return self._commit(kind, key, "MODIFIED", new, old)

    def apply(self, obj: Mapping[str, Any]) -> Obj:
        """Create or update (ignoring resourceVersion): the test helper's `kubectl apply`."""
        new, kind, key = self._prepare(obj)
        new["metadata"].pop("resourceVersion", None)
        return self.update(new) if key in self._objects[kind] else self.create(new)

    def delete(self, kind: str, name: str, namespace: str = "default") -> Obj:
        """Delete a stored object (404 if absent); returns its last state."""
        key = (namespace if BY_KIND[kind].namespaced else "", name)
        old = self._objects[kind].get(key)
        if old is None:
            raise ApiError(404, "NotFound", f'{kind} "{name}" not found')
        gone = copy.deepcopy(old)
        del self._objects[kind][key]
        return self._commit(kind, key, "DELETED", gone, old, store=False)

    def load_yaml(self, path: str | Path) -> int:
        """Apply every Service, EndpointSlice and Node of a (multi-document) YAML file."""
        applied = 0
        for doc in yaml.safe_load_all(Path(path).read_text()):
            items = doc.get("items", []) if doc and doc.get("kind", "").endswith("List") else [doc]
            for item in items:
                if item and item.get("kind") in BY_KIND:
                    self.apply(item)
                    applied += 1
        return applied

    def _prepare(self, obj: Mapping[str, Any]) -> tuple[Obj, str, tuple[str, str]]:
        new = copy.deepcopy(dict(obj))
        kind = BY_KIND.get(new.get("kind", ""))
        if kind is None:
            raise ApiError(400, "BadRequest", f"unsupported kind {new.get('kind')!r}")
        meta = new.setdefault("metadata", {})
        if not meta.get("name"):
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        if kind.namespaced:
            meta.setdefault("namespace", "default")
        else:
            meta.pop("namespace", None)
        new["apiVersion"] = kind.api_version
        return new, kind.kind, (meta.get("namespace", ""), meta["name"])

    def _commit(
        self,
        kind: str,
        key: tuple[str, str],
        type_: str,
        obj: Obj,
        prev: Obj | None,
        *,
        store: bool = True,
    ) -> Obj:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        if store:
            self._objects[kind][key] = obj
        self._history.append(_Event(self._rv, kind, type_, obj, prev))
        while len(self._history) > self.history_limit:
            self._floor = self._history.popleft().rv
        for watcher in self._watchers:
            if watcher.kind == kind:
                watcher.queue.put_nowait(self._history[-1])
        return copy.deepcopy(obj)

    def _broadcast(self, item: object) -> None:
        for watcher in self._watchers:
            watcher.queue.put_nowait(item)

    # -- HTTP ---------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        plural, verb = _classify(request)
        record = RequestRecord(request.method, plural, verb, time.monotonic())
        self.requests.append(record)
        status = 0
        try:
            if verb != "discovery":
                if self.accepted_tokens is not None:
                    given = request.headers.get("Authorization", "").removeprefix("Bearer ")
                    if given not in self.accepted_tokens:
                        raise ApiError(401, "Unauthorized", "Unauthorized")
                if self.rbac is not None and plural in _GROUPS:
                    denied = self.rbac.check(_GROUPS[plural], plural, verb)
                    if denied is not None:
                        raise ApiError(403, "Forbidden", denied)
                if self.before_request is not None:
                    self.before_request(request)
                hang = next((h for h in self._hangs if h.applies(plural, verb)), None)
                if hang is not None:
                    hang.remaining -= 1
                    await self._hang_release.wait()
                for fault in self._faults:
                    if fault.applies(plural, verb):
                        fault.remaining -= 1
                        raise _Injected(fault.status, fault.retry_after)
                for answer in self._raw_answers:
                    if answer.applies(plural, verb):
                        answer.remaining -= 1
                        status = 200
                        return web.Response(body=answer.body, content_type="application/json")
            response: web.StreamResponse = await handler(request)
            status = response.status
            return response
        except _Injected as inj:
            status = inj.status
            headers = {"Retry-After": f"{inj.retry_after:g}"} if inj.retry_after else {}
            reason = "TooManyRequests" if inj.status == 429 else "InternalError"
            body = status_object(inj.status, reason, f"injected failure {inj.status}")
            return web.json_response(body, status=inj.status, headers=headers)
        except ApiError as err:
            status = err.code
            return web.json_response(
                status_object(err.code, err.reason, err.message), status=status
            )
        finally:
            record.status = status

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/")
        if path == "/version":
            return web.json_response(
                {
                    "major": "1",
                    "minor": "31",
                    "gitVersion": "v1.31.0-fake",
                    "platform": "linux/amd64",
                }
            )
        if path in {"/api", "/apis"} or path in {"/api/v1", "/apis/discovery.k8s.io/v1"}:
            return web.json_response(_discovery(path))
        kind, namespace, name = _parse_resource_path(path)
        method = request.method
        if name is None and method == "GET":
            if _flag(request.query.get("watch")):
                return await self._watch(request, kind, namespace)
            return web.json_response(self._list(request, kind, namespace))
        if name is None and method == "POST":
            return web.json_response(
                self.create(await self._body(request, kind, namespace)), status=201
            )
        if name is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")
        key_ns = namespace or "default"
        if method == "GET":
            obj = self.get(kind.kind, name, key_ns)
            if obj is None:
                raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
            return web.json_response(obj)
        if method == "PUT":
            return web.json_response(self.update(await self._body(request, kind, namespace)))
        if method == "PATCH":
            current = self.get(kind.kind, name, key_ns)
            if current is None:
                raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
            patched = _merge_patch(current, await request.json())
            patched["metadata"].pop("resourceVersion", None)
            return web.json_response(self.update(patched))
        if method == "DELETE":
            return web.json_response(self.delete(kind.kind, name, key_ns))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

    async def _body(self, request: web.Request, kind: Kind, namespace: str | None) -> Obj:
        body = await request.json()
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        body.setdefault("kind", kind.kind)
        if namespace:
            body.setdefault("metadata", {})["namespace"] = namespace
        return body

    def _selectors(
        self, request: web.Request, kind: Kind, namespace: str | None
    ) -> Callable[[Obj], bool]:
        labels = parse_label_selector(request.query.get("labelSelector"))
        fields = parse_field_selector(request.query.get("fieldSelector"))

        def matches(obj: Obj) -> bool:
            meta = obj.get("metadata", {})
            return (
                (namespace is None or meta.get("namespace") == namespace)
                and labels(meta.get("labels") or {})
                and fields(obj)
            )

        return matches

    def _list(self, request: web.Request, kind: Kind, namespace: str | None) -> Obj:
        token = request.query.get("continue")
        limit = int(request.query.get("limit") or 0)
        if token:
            entry = self._continues.pop(token, None)
            if entry is None or entry[0] < self._floor:
                raise ApiError(410, "Expired", "The provided continue parameter is too old")
            rv, remaining, _ = entry
        else:
            matches = self._selectors(request, kind, namespace)
            rv = self._rv
            remaining = [o for _, o in sorted(self._objects[kind.kind].items()) if matches(o)]
        page, rest = (remaining[:limit], remaining[limit:]) if limit > 0 else (remaining, [])
        meta: Obj = {"resourceVersion": str(rv)}
        if rest:
            new_token = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode()
            self._continues[new_token] = (rv, rest, kind.plural)
            while len(self._continues) > 100:
                self._continues.pop(next(iter(self._continues)))
            meta["continue"] = new_token
            meta["remainingItemCount"] = len(rest)
        # List items carry no kind/apiVersion on the wire; the list does.
        items = [{k: v for k, v in o.items() if k not in {"kind", "apiVersion"}} for o in page]
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": meta,
            "items": items,
        }

    async def _watch(
        self, request: web.Request, kind: Kind, namespace: str | None
    ) -> web.StreamResponse:
        matches = self._selectors(request, kind, namespace)
        bookmarks = _flag(request.query.get("allowWatchBookmarks"))
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        since = request.query.get("resourceVersion") or "0"
        backlog: list[tuple[str, Obj]] = []
        expired = False
        if since == "0":
            backlog = [
                ("ADDED", o) for _, o in sorted(self._objects[kind.kind].items()) if matches(o)
            ]
        elif not since.isdigit():
            raise ApiError(400, "BadRequest", f"invalid resourceVersion {since!r}")
        elif int(since) < self._floor:
            expired = True
        else:
            start = int(since)
            for event in self._history:
                if event.rv > start and event.kind == kind.kind:
                    backlog.extend(_visible(event, matches))
        if expired and self.gone_as_http_status:
            raise ApiError(410, "Expired", f"too old resource version: {since} ({self._floor})")

        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if self._silent:
            await self._hang_release.wait()
            return response
        if self.end_watches_at_once:
            await response.write_eof()
            return response
        if expired:
            body = status_object(
                410, "Expired", f"too old resource version: {since} ({self._floor})"
            )
            await response.write(_line("ERROR", body))
            await response.write_eof()
            return response
        # Registered in the same synchronous step as the backlog was taken: no event is lost.
        watcher = _Watcher(kind.kind)
        self._watchers.add(watcher)
        try:
            for type_, obj in backlog:
                await response.write(_line(type_, obj))
            await self._stream(
                request=request,
                response=response,
                watcher=watcher,
                matches=matches,
                bookmarks=bookmarks,
                timeout=timeout,
            )
        except ConnectionError:
            pass  # the client went away, or the fake cut the stream on purpose
        finally:
            self._watchers.discard(watcher)
        return response

    async def _stream(
        self,
        *,
        request: web.Request,
        response: web.StreamResponse,
        watcher: _Watcher,
        matches: Callable[[Obj], bool],
        bookmarks: bool,
        timeout: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_bookmark = loop.time() + self.bookmark_interval if self.bookmark_interval else None
        kind = BY_KIND[watcher.kind]
        while True:
            now = loop.time()
            wake = min(deadline, next_bookmark) if next_bookmark else deadline
            try:
                item = await asyncio.wait_for(watcher.queue.get(), max(0.0, wake - now))
            except TimeoutError:
                if self._silent:
                    await self._hang_release.wait()
                    return
                if loop.time() >= deadline:
                    await response.write_eof()
                    return
                item = "BOOKMARK"
                next_bookmark = loop.time() + (self.bookmark_interval or 0)
            if self._silent and item is not _DROP:
                await self._hang_release.wait()
                return
            if item is _DROP:
                if request.transport is not None:
                    request.transport.abort()
                return
            if item is _END:
                await response.write_eof()
                return
            if isinstance(item, _Raw):
                await response.write(item.data)
                continue
            if item == "BOOKMARK":
                if bookmarks:
                    mark = {
                        "kind": kind.kind,
                        "apiVersion": kind.api_version,
                        "metadata": {"resourceVersion": str(self._rv)},
                    }
                    await response.write(_line("BOOKMARK", mark))
                continue
            for type_, obj in _visible(item, matches):
                await response.write(_line(type_, obj))


class _Injected(Exception):
    def __init__(self, status: int, retry_after: float | None) -> None:
        super().__init__(status)
        self.status = status
        self.retry_after = retry_after


def _visible(event: _Event, matches: Callable[[Obj], bool]) -> list[tuple[str, Obj]]:
    """What a filtered watch sees: an object leaving the selector is a DELETED, entering ADDED."""
    now = matches(event.obj)
    before = event.prev is not None and matches(event.prev)
    if event.type == "MODIFIED":
        if now and before:
            return [("MODIFIED", event.obj)]
        if now:
            return [("ADDED", event.obj)]
        if before and event.prev is not None:
            gone = copy.deepcopy(event.prev)
            gone["metadata"]["resourceVersion"] = str(event.rv)
            return [("DELETED", gone)]
        return []
    if event.type == "DELETED":
        return [("DELETED", event.obj)] if now else []
    return [(event.type, event.obj)] if now else []


def _flag(value: str | None) -> bool:
    """Go's strconv.ParseBool truths, as kube-apiserver parses query flags."""
    return value in {"1", "t", "T", "true", "TRUE", "True"}


def _line(type_: str, obj: Obj) -> bytes:
    return json.dumps({"type": type_, "object": obj}, separators=(",", ":")).encode() + b"\n"


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also used, approximately, for strategic merge patches)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


_GROUPS = {kind.plural: kind.api_version.rpartition("/")[0] for kind in KINDS.values()}
"""Each resource's API group ("" for the core group), for RBAC."""


def _classify(request: web.Request) -> tuple[str, str]:
    path = request.path.rstrip("/")
    if path in {"/version", "/api", "/apis", "/api/v1", "/apis/discovery.k8s.io/v1"}:
        return "", "discovery"
    try:
        kind, _, name = _parse_resource_path(path)
    except ApiError:
        return "", "unknown"
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
    if request.method == "GET":
        if name is not None:
            return kind.plural, "get"
        return kind.plural, "watch" if _flag(request.query.get("watch")) else "list"
    return kind.plural, verbs.get(request.method, request.method.lower())


def _parse_resource_path(path: str) -> tuple[Kind, str | None, str | None]:
    """`/api/v1[/namespaces/NS]/PLURAL[/NAME]` (or `/apis/GROUP/VERSION/...`) -> parts."""
    parts = path.strip("/").split("/")
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    kind = KINDS.get(rest[0]) if rest else None
    prefix = "/" + "/".join(parts[: 2 if parts[:1] == ["api"] else 3])
    if (
        kind is None
        or kind.prefix != prefix
        or len(rest) > 2
        or (namespace and not kind.namespaced)
    ):
        raise ApiError(
            404, "NotFound", f"the server could not find the requested resource ({path})"
        )
    return kind, namespace, rest[1] if len(rest) == 2 else None


def _discovery(path: str) -> Obj:
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    if path == "/apis":
        version = {"groupVersion": "discovery.k8s.io/v1", "version": "v1"}
        group = {"name": "discovery.k8s.io", "versions": [version], "preferredVersion": version}
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]}
    group_version = "v1" if path == "/api/v1" else "discovery.k8s.io/v1"
    resources = [
        {
            "name": k.plural,
            "singularName": k.kind.lower(),
            "namespaced": k.namespaced,
            "kind": k.kind,
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
        }
        for k in KINDS.values()
        if k.api_version == group_version
    ]
    return {"kind": "APIResourceList", "groupVersion": group_version, "resources": resources}


# --- command line -----------------------------------------------------------------------------


def _parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes.apiserver",
        description="A fake kube-apiserver (Services, EndpointSlices, Nodes) for trying the proxy.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="listen port (default: any free one)")
    parser.add_argument("--kubeconfig", help="write a kubeconfig for this server to this path")
    parser.add_argument(
        "--seed",
        action="append",
        default=[],
        metavar="YAML",
        help="apply the Services, EndpointSlices and Nodes of this file at start (repeatable)",
    )
    parser.add_argument(
        "--bookmark-interval",
        type=float,
        default=60.0,
        help="seconds between BOOKMARK events on watches that allow them (default 60)",
    )
    return parser.parse_args(None if argv is None else list(argv))


async def _serve(args: argparse.Namespace) -> None:
    server = FakeApiServer(host=args.host, port=args.port, bookmark_interval=args.bookmark_interval)
    for path in args.seed:
        print(f"seeded {server.load_yaml(path)} objects from {path}", flush=True)
    await server.start()
    if args.kubeconfig:
        server.write_kubeconfig(args.kubeconfig)
        print(f"kubeconfig written to {args.kubeconfig}", flush=True)
    print(f"fake kube-apiserver listening on {server.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: Iterable[str] | None = None) -> int:
    """Entry point of `python -m tests.fakes.apiserver`."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(_parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
