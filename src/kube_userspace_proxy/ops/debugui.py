"""/debug/ui on the metrics site: each Service's path through the proxy, live (teaching tool).

The page (static/debug-ui.html: plain HTML, CSS and JavaScript, no build step, nothing loaded
from elsewhere) opens `/debug/ui/events`, a Server-Sent Events stream that sends the whole
view about once a second while the page is open: the `/debug/state` view (collected from the
workers first) and the installed iptables rules of our chains with their packet counters, or,
for a proxy that installs none (`--iptables-backend none`, the demo), the rules it would
install for the shown service ports, marked as not installed.
`/debug/ui/state` answers the same view once, as JSON. Each stream carries 8 events and
ends; the page's EventSource reconnects within 0.1 s.

The page shows at most `SHOWN` service ports (the first by name) and only the rules that name
them: at 10,000 service ports a whole view each second would be megabytes of JSON built on
the event loop. `/debug/state` streams everything.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kube_userspace_proxy import logs

log = logs.get(__name__)

CountedRules = list[tuple[int, str, str, int, int]]
RuleSource = Callable[[], CountedRules | None]
"""Blocking: our rules with counters, (family, chain, spec, packets, bytes); None: no rules."""
PlannedRules = Callable[[frozenset[str]], list[tuple[str, str]]]
"""The rules this proxy would install for the named service ports, (iptables-save line, why):
what the page shows when no rules are installed. Called on the event loop, for the shown
service ports only."""
INTERVAL = 1.0
"""Seconds between two events of the stream."""
RULES_EVERY = 2.0
"""Seconds between two reads of the rules' counters (an iptables-save run per family)."""
STREAM_EVENTS = 8
"""Events per stream: the ops sites close a connection 10 s after its last request header
(httpguard), so a stream ends itself before that and the browser reconnects at once."""
RECONNECT_MS = 100
"""The `retry:` the stream asks of the browser's EventSource, in milliseconds."""
SHOWN = 100
"""Service ports the page shows at most (the first by name)."""
_COMMENT = re.compile(r'--comment (?:"([^"]*)"|(\S+))')


def page() -> bytes:
    """The page, as packaged."""
    ref = importlib.resources.files("kube_userspace_proxy.ops") / "static" / "debug-ui.html"
    return ref.read_bytes()


class DebugUi:
    """Builds the page's view; rule counters are read in a thread, at most every 2 s."""

    def __init__(
        self,
        debug_state: Callable[[int], Awaitable[dict[str, Any]]],
        collect: Callable[..., Awaitable[None]],
        rules: RuleSource | None,
        planned: PlannedRules | None = None,
    ) -> None:
        self._debug_state = debug_state
        self._collect = collect
        self._rules = rules
        self._rules_read = 0.0
        self._rules_cache: CountedRules | None = None
        self._planned = planned
        self._planned_read = 0.0
        self._planned_cache: list[dict[str, Any]] | None = None

    async def view(self) -> dict[str, Any]:
        """Services (as /debug/state, the first `SHOWN`), the rules that name them (None when
        this proxy installs none; then `planned`: the rules it would install), and whether
        service ports were left out."""
        await self._collect(debug=True)
        services = await self._debug_state(SHOWN + 1)
        truncated = len(services) > SHOWN
        if truncated:
            services.pop(next(reversed(services)))
        now = time.monotonic()
        if self._rules is not None and now - self._rules_read >= RULES_EVERY:
            self._rules_read = now
            try:
                self._rules_cache = await asyncio.to_thread(self._rules)
            except Exception as exc:  # a view must not fail for the rules' sake
                log.debug("cannot read the rules' counters: %r", exc)
                self._rules_cache = None
        rules = None
        if self._rules_cache is not None:
            rules = await asyncio.to_thread(_naming, self._rules_cache, frozenset(services))
        view = {"services": services, "truncated": truncated, "rules": rules, "time": time.time()}
        if rules is None and self._planned is not None:
            view["planned"] = self._planned_rules(frozenset(services), now)
        return view

    def _planned_rules(self, names: frozenset[str], now: float) -> list[dict[str, Any]] | None:
        """The rules the proxy would install that name one of `names` (not the jumps into
        shards: like the installed ones the page shows), re-rendered at most every 2 s."""
        assert self._planned is not None
        if now - self._planned_read >= RULES_EVERY:
            self._planned_read = now
            try:
                self._planned_cache = [
                    {"chain": line.split()[1], "rule": line, "why": why}
                    for line, why in self._planned(names)
                    if line.startswith("-A ") and _names(line) in names
                ]
            except Exception as exc:  # a view must not fail for the rules' sake
                log.debug("cannot render the rules this proxy would install: %r", exc)
                self._planned_cache = None
        return self._planned_cache

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/debug/ui", self._page)
        app.router.add_get("/debug/ui/state", self._state)
        app.router.add_get("/debug/ui/events", self._events)

    async def _page(self, _: web.Request) -> web.Response:
        return web.Response(
            body=page(),
            content_type="text/html",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"},
        )

    async def _state(self, _: web.Request) -> web.Response:
        return web.json_response(await self.view())

    async def _events(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        try:
            await response.write(f"retry: {RECONNECT_MS}\n\n".encode())
            for sent in range(STREAM_EVENTS):  # or until the page goes away (the write fails)
                if sent:
                    await asyncio.sleep(INTERVAL)
                body = json.dumps(await self.view(), separators=(",", ":"))
                await response.write(f"data: {body}\n\n".encode())
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass
        return response


def _names(rule: str) -> str | None:
    """The service port a rule's comment names (or a shard's comment, or None)."""
    found = _COMMENT.search(rule)
    return (found.group(1) or found.group(2)) if found else None


def _naming(counted: CountedRules, names: frozenset[str]) -> list[dict[str, Any]]:
    """The rules whose comment is one of `names` (a service port), as the page reads them."""
    shown = []
    for family, chain, rule, packets, size in counted:
        found = _COMMENT.search(rule)
        if found and (found.group(1) or found.group(2)) in names:
            shown.append(
                {"family": family, "chain": chain, "rule": rule, "packets": packets, "bytes": size}
            )
    return shown
