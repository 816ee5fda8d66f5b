"""Serve a ``SwarmWatch``'s page from a background thread with its own event loop (tests and the
monitor benchmark drive a browser from the main thread meanwhile)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from .watch import SwarmWatch
from .web import serve


@contextlib.contextmanager
def serving(watch: SwarmWatch, host: str = "127.0.0.1", port: int = 0, refresh: bool = True) -> Iterator[str]:
    """The page's base URL while the block runs; ``refresh`` runs one crawl round first."""
    loop = asyncio.new_event_loop()
    started: dict[str, object] = {}
    ready = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            if refresh:
                await watch.refresh()
            runner, url = await serve(watch.snapshot, host, port)
            started["url"] = url
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            started["error"] = e
            ready.set()
            return
        ready.set()
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            await watch.aclose()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not ready.wait(120) or "error" in started:
        raise RuntimeError(f"the monitor's page did not start: {started.get('error')}")
    try:
        yield str(started["url"])
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
