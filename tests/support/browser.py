"""Debian's headless Chromium, driven over the DevTools protocol (the docs site's browser test).

Chromium is started with a debugging port on loopback and a fresh profile, with the flags that keep it off the
network (this machine has none beyond its registries: without them Chromium keeps trying Google's hosts). One page
target is driven over a WebSocket (websocket-client, already a dependency of the kubernetes client): navigate and
wait for the load event, evaluate JavaScript, capture a screenshot. Written here rather than taken from Playwright
or Selenium because those bring their own browser download or driver binary; these few protocol calls are all
the test needs.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

FLAGS = (
    "--headless",
    "--no-sandbox",  # as root, Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Browser:
    """One headless Chromium with one page; a context manager that always stops the process."""

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 30.0) -> None:
        binary = chromium()
        if binary is None:
            raise RuntimeError("chromium not found (apt-get install chromium)")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="fe-chromium-")
        port = _free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                *FLAGS,
                f"--user-data-dir={self.profile}",
                f"--remote-debugging-port={port}",
                "--remote-debugging-address=127.0.0.1",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.console_errors: list[str] = []
        self._next_id = 0
        try:
            self._ws = self._connect(port)
            self.call("Page.enable")
            self.call("Runtime.enable")
            self.call(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
            raise

    def _connect(self, port: int) -> websocket.WebSocket:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
                    targets = json.load(r)
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=self.timeout)
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"chromium did not open its debugging port: {err[-2000:]}")
            time.sleep(0.1)

    def _events_until(self, done: Any) -> dict[str, Any]:
        """Read messages until ``done(msg)``; console errors and exceptions met on the way are kept."""
        while True:
            msg: dict[str, Any] = json.loads(self._ws.recv())
            method = msg.get("method")
            if method == "Runtime.exceptionThrown":
                self.console_errors.append(json.dumps(msg["params"]["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and msg["params"].get("type") == "error":
                self.console_errors.append(json.dumps(msg["params"]["args"])[:500])
            if done(msg):
                return msg

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        ident = self._next_id
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        msg = self._events_until(lambda m: m.get("id") == ident)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        result: dict[str, Any] = msg.get("result", {})
        return result

    def open(self, url: str) -> None:
        """Navigate and wait for the page's load event (its scripts have run by then)."""
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise RuntimeError(f"{url}: {result['errorText']}")
        self._events_until(lambda m: m.get("method") == "Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """The viewport as a PNG file."""
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self._ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
