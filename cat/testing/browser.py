"""Headless Chromium for the server's page test: a fake microphone fed from a wav, the
page driven and read through the DevTools protocol (over `websockets`), a screenshot.

Chromium runs with a fresh profile, no network of its own (no background fetches, sync,
component updates or QUIC), no sandbox and no GPU, as a child killed with its parent;
`with` stops it by its pid. Every wait is bounded.

Usage:
    with Chromium(url, microphone_wav=wav, profile=tmp_path / "profile") as browser:
        browser.wait_until("document.body.dataset.state === 'done'", timeout=120)
        text = browser.evaluate("document.getElementById('final-text').textContent")
        browser.screenshot(tmp_path / "page.png")
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from cat.core.io import PathLike
from cat.core.process import parent_death_preexec

#: The names Debian and others give the browser.
EXECUTABLES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio",
         "--autoplay-policy=no-user-gesture-required", "--window-size=1000,900",
         "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream")


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) executable, or None."""
    for name in EXECUTABLES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    """The browser did not start, or the page did not do what was waited for."""


class Chromium:
    """Headless Chromium showing `url`, its microphone the wav `microphone_wav` played once
    (then silence), its profile in the new directory `profile` (see the module doc)."""

    def __init__(self, url: str, microphone_wav: PathLike, profile: PathLike,
                 timeout: float = 60.0) -> None:
        self.url, self.timeout = url, timeout
        self.wav, self.profile = Path(microphone_wav), Path(profile)
        self._ids = itertools.count(1)
        self.closing = contextlib.ExitStack()

    def __enter__(self) -> Chromium:
        executable = find_chromium()
        if executable is None:
            raise BrowserError("no Chromium executable on PATH")
        self.profile.mkdir(parents=True)
        command = [executable, *FLAGS, f"--user-data-dir={self.profile}",
                   "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
                   f"--use-file-for-fake-audio-capture={self.wav}%noloop", self.url]
        self.log = (self.profile.parent / f"{self.profile.name}.log").open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL,
                                        preexec_fn=parent_death_preexec())
        try:
            self._connect()
        except BaseException:
            self.stop()
            raise
        return self

    def _connect(self) -> None:
        from websockets.sync.client import connect

        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise BrowserError(f"Chromium did not start (exit status "
                                   f"{self.process.poll()}); see {self.log.name}")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        page = None
        while page is None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list",
                                        timeout=10) as response:
                targets = json.loads(response.read())
            page = next((t for t in targets if t.get("type") == "page"
                         and t.get("url", "").startswith(self.url.split("?")[0])), None)
            if page is None:
                if time.monotonic() > deadline:
                    raise BrowserError(f"no page of {self.url} among {targets}")
                time.sleep(0.1)
        self.devtools = self.closing.enter_context(connect(
            page["webSocketDebuggerUrl"], max_size=None, open_timeout=self.timeout))

    def command(self, method: str, **params: Any) -> dict[str, Any]:
        """Send a DevTools command; its result (events on the way are skipped)."""
        number = next(self._ids)
        self.devtools.send(json.dumps({"id": number, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            message = json.loads(self.devtools.recv(timeout=max(0.1, deadline -
                                                                 time.monotonic())))
            if message.get("id") == number:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.command("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_until(self, expression: str, timeout: float) -> None:
        """Poll `expression` until it is true (while the page loads it may throw: false);
        BrowserError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        guarded = (f"(() => {{ try {{ return !!({expression}); }} "
                   "catch (error) { return false; } })()")
        while not self.evaluate(guarded):
            if time.monotonic() > deadline:
                state = self.evaluate("document.body && (document.body.dataset.state + ': ' + "
                                      "document.getElementById('status').textContent)")
                raise BrowserError(f"not within {timeout:g} s: {expression} (page: {state})")
            time.sleep(0.2)

    def choose_file(self, selector: str, path: PathLike) -> None:
        """Put the file `path` in the page's file input `selector` (as a user choosing it)
        and tell the page it changed."""
        root = self.command("DOM.getDocument")["root"]["nodeId"]
        node = self.command("DOM.querySelector", nodeId=root, selector=selector)["nodeId"]
        self.command("DOM.setFileInputFiles", nodeId=node, files=[str(path)])
        self.evaluate(f"document.querySelector({json.dumps(selector)})"
                      ".dispatchEvent(new Event('change'))")

    def screenshot(self, path: PathLike) -> Path:
        """A PNG of the page's viewport."""
        data = self.command("Page.captureScreenshot", format="png")["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.closing.close()  # the DevTools connection
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()
