"""A real browser for tests and screenshots: Debian's headless Chromium, driven over the Chrome DevTools
Protocol (a websocket, aiohttp's client): navigate, evaluate JavaScript in the page, screenshot.

Started with its own empty profile and without background networking (this machine's network is
closed: the probes' flags), stopped by its PID. `chromium_binary()` is None where none is installed.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.procs import Proc, free_port, port_open

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """One headless Chromium with one page; use as `async with Browser(workdir) as page`."""

    def __init__(self, workdir: Path, width: int = 1100, height: int = 900) -> None:
        self.workdir = workdir
        self.size = (width, height)
        self._proc: Proc | None = None
        self._session: aiohttp.ClientSession | None = None
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        binary = chromium_binary()
        if binary is None:
            raise RuntimeError("no Chromium installed")
        port = free_port()
        # its profile in the caller's working directory, left there: Chromium's helper processes
        # may still write into it a moment after the browser's own PID has been stopped, so
        # removing it at once failed now and then ("Directory not empty") in a clean-clone CI run
        self.workdir.mkdir(parents=True, exist_ok=True)
        profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=self.workdir)  # a fresh one each time
        argv = [
            binary,
            *FLAGS,
            f"--remote-debugging-port={port}",
            "--remote-debugging-address=127.0.0.1",
            f"--user-data-dir={profile}",
            f"--window-size={self.size[0]},{self.size[1]}",
            "about:blank",
        ]
        self._proc = Proc("chromium", argv, self.workdir / "chromium.log")
        try:
            self._proc.wait_ready(lambda: port_open(port), timeout=30)
            self._session = aiohttp.ClientSession()
            pages = await self._pages(port)
            self._socket = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
            await self.call("Page.enable")
            await self.call("Runtime.enable")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _pages(self, port: int) -> list[dict[str, Any]]:
        assert self._session is not None
        deadline = time.monotonic() + 20
        while True:  # the debugging endpoint answers a moment after the port opens
            try:
                async with self._session.get(f"http://127.0.0.1:{port}/json/list") as answer:
                    pages = [p for p in await answer.json() if p.get("type") == "page"]
                if pages:
                    return pages
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium's debugging endpoint listed no page")
            await _pause()

    async def __aexit__(self, *_: object) -> None:
        if self._socket is not None:
            await self._socket.close()
        if self._session is not None:
            await self._session.close()
        if self._proc is not None:
            self._proc.stop()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events in between are skipped)."""
        assert self._socket is not None
        ident = next(self._ids)
        await self._socket.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = await self._socket.receive(timeout=30)
            if message.type is not aiohttp.WSMsgType.TEXT:
                raise ConnectionError(f"DevTools socket: {message.type}")
            data = json.loads(message.data)
            if data.get("id") == ident:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return dict(data.get("result", {}))

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able)."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails'].get('text')}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Poll `expression` until it is truthy (bounded); its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never showed {what} within {timeout_s} s")
            await _pause()

    async def screenshot(self, path: Path, full_page: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            metrics = await self.call("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            width, height = self.size[0], max(int(size["height"]), 200)
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
            params["captureBeyondViewport"] = True
        data = await self.call("Page.captureScreenshot", **params)
        png = base64.b64decode(data["data"])
        await asyncio.to_thread(path.write_bytes, png)
        return path

    async def emulate_phone(self) -> None:
        """A phone's viewport (390 x 844 CSS pixels, touch): the page must read there too."""
        self.size = (390, 844)
        await self.call(
            "Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=2, mobile=True
        )


async def _pause() -> None:
    await asyncio.sleep(0.05)  # between polls of a condition with a deadline, never as a wait
