"""A bounded outbound queue in front of one WebSocket, drained by one owned sender task.

Producers that must never wait (the relay forwarding a device's answer to a client) call
``offer``, which refuses when the queue is full; producers that should be held back (a client's
requests to a busy device) ``await put``. Stream transports ``push`` without a bound and are
paused and resumed through ``watch`` listeners at the high and low water marks instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from .._tasks import cancel_and_wait
from ..errors import NetworkError

log = logging.getLogger(__name__)

Send = Callable[[bytes], Awaitable[None]]


class FlowListener(Protocol):
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...


class OutboxClosed(NetworkError):
    """The outbox no longer sends (its WebSocket is gone)."""


class Outbox:
    def __init__(self, send: Send, *, max_bytes: int, max_frames: int = 1 << 30) -> None:
        self._send = send
        self.max_bytes, self.max_frames = max_bytes, max_frames
        self._queue: deque[bytes] = deque()
        self.queued_bytes = 0
        self._wakeup = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._task: asyncio.Task[None] | None = None
        self._listeners: set[FlowListener] = set()
        self._paused = False
        self.error: BaseException | None = None  # why the sender stopped, once it has

    # -- lifecycle

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def aclose(self, flush_s: float = 0.0) -> None:
        """Send what is queued (for at most ``flush_s``), then stop the sender."""
        if self._task is None:
            return
        if flush_s > 0 and self._queue and self.error is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(flush_s):
                    await self._drained()
        await cancel_and_wait(self._task)
        self._fail(self.error or OutboxClosed("closed"))

    async def _drained(self) -> None:
        while self._queue and self.error is None:
            self._space.clear()
            await self._space.wait()

    @property
    def closed(self) -> bool:
        return self.error is not None

    # -- producers

    def full(self, size: int) -> bool:
        return bool(self._queue) and (self.queued_bytes + size > self.max_bytes or len(self._queue) >= self.max_frames)

    def offer(self, data: bytes) -> bool:
        """Queue ``data`` unless the queue is full (one item may exceed ``max_bytes``)."""
        if self.error is not None or self.full(len(data)):
            return False
        self._append(data)
        return True

    async def put(self, data: bytes) -> None:
        """Queue ``data``, waiting for room; ``OutboxClosed`` if the WebSocket goes away."""
        while not self.offer(data):
            if self.error is not None:
                raise OutboxClosed(str(self.error))
            self._space.clear()
            await self._space.wait()

    def push(self, data: bytes) -> None:
        """Queue without a bound; listeners are paused above ``max_bytes``."""
        if self.error is not None:
            raise OutboxClosed(str(self.error))
        self._append(data)

    def watch(self, listener: FlowListener) -> None:
        self._listeners.add(listener)
        if self._paused:
            listener.pause_writing()

    def unwatch(self, listener: FlowListener) -> None:
        self._listeners.discard(listener)

    def _append(self, data: bytes) -> None:
        self._queue.append(data)
        self.queued_bytes += len(data)
        self._wakeup.set()
        if not self._paused and self.queued_bytes > self.max_bytes:
            self._paused = True
            for listener in list(self._listeners):
                listener.pause_writing()

    # -- the sender

    async def _run(self) -> None:
        try:
            while True:
                while not self._queue:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                data = self._queue.popleft()
                self.queued_bytes -= len(data)
                self._space.set()
                if self._paused and self.queued_bytes <= self.max_bytes // 4:
                    self._paused = False
                    for listener in list(self._listeners):
                        listener.resume_writing()
                await self._send(data)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the WebSocket failed: stop sending, wake producers
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._queue.clear()
        self.queued_bytes = 0
        self._space.set()
        if self._paused:
            self._paused = False
            for listener in list(self._listeners):
                listener.resume_writing()  # let writers run into the closed transport
