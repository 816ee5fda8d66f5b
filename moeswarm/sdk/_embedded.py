"""A backbone inside the client's process: ``Client(bootstrap=..., model_dir=...)``.

It runs ``moeswarm.node.backbone.run_backbone`` (DHT discovery, routed experts from the swarm,
the OpenAI API on a private loopback port) on an event loop in a background thread, and the
client talks to it like to any backbone.  ``close()`` stops it within a bounded time.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from ..errors import SwarmError, Timeout


class EmbeddedBackbone:
    def __init__(self, model_dir: str, bootstrap: tuple[str, ...], *, coverage_timeout_s: float = 60.0,
                 local_fallback: bool = False) -> None:
        from ..daemon import SwarmConfig
        from ..node.config import BackboneConfig

        self.config = BackboneConfig(SwarmConfig(model_dir, bootstrap=bootstrap, client_mode=True),
                                     http=("127.0.0.1", 0), local_fallback=local_fallback,
                                     coverage_timeout_s=coverage_timeout_s)
        self.info: dict[str, Any] = {}
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="moeswarm-embedded-backbone", daemon=True)
        self._thread.start()
        if not self._ready.wait(coverage_timeout_s + 60):
            raise Timeout("the embedded backbone did not start in time")
        if self._error is not None:
            raise self._error

    @property
    def url(self) -> str:
        return str(self.info["http"])

    def _run(self) -> None:
        from ..node.backbone import run_backbone

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def on_ready(info: dict[str, Any]) -> None:
                self.info.update(info)
                self._ready.set()

            await run_backbone(self.config, on_ready=on_ready, stop=self._stop)

        try:
            asyncio.run(main())
        except (SwarmError, OSError) as e:
            self._error = e
        finally:
            self._ready.set()

    def close(self, timeout_s: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
