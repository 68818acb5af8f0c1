"""A real headless Chromium driven over the DevTools protocol (aiohttp's WebSocket client).

Run as a script in the namespace where the page is reachable (loopback of the proxy's node):

    python browser.py URL PROFILE_DIR

It starts Chromium, opens URL, then answers commands read line by line from stdin with one
JSON line each on stdout:

    eval EXPRESSION      -> {"value": ...}   (the expression's JSON-able result)
    viewport WIDTH       -> {"width": WIDTH}  (the window's width in CSS pixels from now on)
    screenshot PATH      -> {"saved": PATH}   (a PNG of the whole page)
    quit                 -> {"bye": true}

Chromium is killed (by its PID) when the script ends, however it ends.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

WIDTH, HEIGHT = 1400, 1000


def chromium() -> str | None:
    """The Chromium binary (Debian's `chromium`), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Page:
    """One DevTools target: send commands, get their results."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.width = WIDTH

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self.ids)
        await self.ws.send_json({"id": ident, "method": method, "params": params})
        while True:
            message = await asyncio.wait_for(self.ws.receive_json(), 30)
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def viewport(self, width: int) -> None:
        """Lay the page out as in a window `width` CSS pixels wide."""
        self.width = width
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=HEIGHT,
            deviceScaleFactor=1,
            mobile=False,
        )

    async def screenshot(self, path: str) -> None:
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=int(height),
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        Path(path).write_bytes(base64.b64decode(shot["data"]))


async def _devtools_port(profile: Path, proc: subprocess.Popen[bytes]) -> int:
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with code {proc.returncode}")
        if marker.exists():
            text = marker.read_text().split()
            if text:
                return int(text[0])
        await asyncio.sleep(0.1)
    raise RuntimeError("chromium did not open its DevTools port within 60 s")


async def drive(url: str, profile: Path) -> None:
    exe = chromium()
    if exe is None:
        raise RuntimeError("chromium is not installed")
    proc = subprocess.Popen(
        [
            exe,
            "--headless=new",
            "--no-sandbox",  # root in a test namespace
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            f"--window-size={WIDTH},{HEIGHT}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port = await _devtools_port(profile, proc)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json(content_type=None)
            target = next(t for t in targets if t.get("type") == "page")
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                await page.call("Page.navigate", url=url)
                await _serve(page)
    finally:
        proc.kill()
        proc.wait(30)


async def _serve(page: Page) -> None:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        command, _, argument = line.strip().partition(" ")
        try:
            if command == "eval":
                reply: dict[str, Any] = {"value": await page.evaluate(argument)}
            elif command == "viewport":
                await page.viewport(int(argument))
                reply = {"width": int(argument)}
            elif command == "screenshot":
                await page.screenshot(argument)
                reply = {"saved": argument}
            elif command in ("quit", ""):
                print(json.dumps({"bye": True}), flush=True)
                return
            else:
                reply = {"error": f"unknown command {command!r}"}
        except (RuntimeError, TimeoutError, aiohttp.ClientError) as exc:
            reply = {"error": repr(exc)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    asyncio.run(drive(sys.argv[1], Path(sys.argv[2])))


class Browser:
    """This script run as a child process (`prefix`, e.g. `ip netns exec NS`, goes first)."""

    def __init__(self, url: str, profile: Path, *, prefix: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, __file__, url, str(profile)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, command: str) -> dict[str, Any]:
        """Send one command; its JSON reply (raises RuntimeError when the browser failed)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the browser driver exited ({self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def eval(self, expression: str) -> Any:
        return self.ask(f"eval {expression}")["value"]

    def close(self) -> None:
        """Quit (the driver kills Chromium), or kill the driver after 30 s."""
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            self.ask("quit")
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
