"""The volunteer page as a device: headless Chromium (Debian's) driven by Playwright in a thread of
its own, so the test's thread stays free for ``asyncio.run`` (Playwright's sync API cannot share
a thread with a running event loop)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from browser_support import chromium_page

SHOWN = ("state", "peer", "endpoint", "holding", "calls")


def shown(page: Any) -> dict[str, str]:
    """What a person reads on the page: the rendered text of its status fields (empty if hidden)."""
    return {name: page.inner_text(f"#{name}") if page.is_visible(f"#{name}") else "" for name in SHOWN}


READY_JS = "() => window.volunteer && (window.volunteer.state === 'volunteering' || window.volunteer.error)"


class BrowserDevice:
    """``with BrowserDevice(url) as device``: the page at ``url`` is volunteering (its announcement
    published); ``device.info`` has its peer ID and endpoint; ``device.call(fn)`` runs ``fn(page)``
    in the browser's thread and returns its result."""

    def __init__(self, url: str, ready_timeout_s: float = 240.0, expect_error: bool = False) -> None:
        self.url, self.ready_timeout_s, self.expect_error = url, ready_timeout_s, expect_error
        self.info: dict[str, Any] = {}
        self.console: list[str] = []
        self._commands: queue.Queue[Callable[[Any], Any] | None] = queue.Queue()
        self._results: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="chromium", daemon=True)

    def __enter__(self) -> "BrowserDevice":
        self._thread.start()
        ok, value = self._results.get(timeout=self.ready_timeout_s + 60)
        if not ok:
            self._thread.join(30)
            raise AssertionError(f"the volunteer page did not start: {value}\nconsole: {self.console[-30:]}")
        self.info = value
        return self

    def __exit__(self, *exc: object) -> None:
        self._commands.put(None)
        self._thread.join(60)

    def call(self, fn: Callable[[Any], Any], timeout: float = 120.0) -> Any:
        self._commands.put(fn)
        ok, value = self._results.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def _run(self) -> None:
        try:
            with chromium_page() as first:
                context = first.context.browser.new_context(ignore_https_errors=True,  # the test CA
                                                            viewport={"width": 480, "height": 900})
                try:
                    page = context.new_page()
                    page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
                    page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
                    page.goto(self.url)
                    page.wait_for_function(READY_JS, timeout=self.ready_timeout_s * 1000)
                    error = page.evaluate("window.volunteer.error")
                    if self.expect_error:  # the page must fail: report what it says
                        if error is None:
                            raise AssertionError("the page did not fail")
                        self._results.put((True, {"error": error, "state": page.evaluate("window.volunteer.state"),
                                               "shown": shown(page)}))
                    elif error:
                        raise AssertionError(error)
                    else:
                        self._results.put((True, {**page.evaluate(
                            "({peer_id: window.volunteer.identity.peerIdStr, endpoint: window.volunteer.device.endpoint,"
                            " state: window.volunteer.state})"), "shown": shown(page)}))
                except Exception as e:  # noqa: BLE001 - reported to the test's thread
                    self._results.put((False, e))
                    return
                while (command := self._commands.get()) is not None:
                    try:
                        self._results.put((True, command(page)))
                    except Exception as e:  # noqa: BLE001 - reported to the test's thread
                        self._results.put((False, e))
                context.close()
        except Exception as e:  # noqa: BLE001 - the browser could not start
            self._results.put((False, e))
