"""A data-plane byte stream over frame messages, as a real ``asyncio`` transport.

``moeswarm.net.dataplane`` speaks the protocol over ``asyncio.StreamReader``/``StreamWriter``.
``FrameTransport`` lets the same code run over anything that carries one frame per message
(a WebSocket to the relay, or a stream multiplexed inside a device's relay session): bytes
written are cut at frame boundaries and each whole frame is handed to ``deliver``; frames
received are fed in with ``feed``. ``open_stream`` returns the reader/writer pair.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ._outbox import FlowListener

Deliver = Callable[[bytes], None]


class FrameTransport(asyncio.Transport):
    def __init__(self, deliver: Deliver, on_close: Callable[[], None], extra: dict[str, Any] | None = None) -> None:
        super().__init__(dict(extra or {}))
        self._deliver = deliver
        self._on_close = on_close
        self._pending = bytearray()  # bytes of a frame not yet complete
        self._protocol: asyncio.Protocol | None = None
        self._closing = False
        self._lost = False
        self.reading_paused = False

    # -- asyncio.BaseTransport

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol  # type: ignore[assignment]

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop writing; the owner ends the stream and then calls ``connection_lost``."""
        if not self._closing:
            self._closing = True
            self._on_close()

    def abort(self) -> None:
        self.close()

    # -- asyncio.ReadTransport

    def is_reading(self) -> bool:
        return not self.reading_paused

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False

    # -- asyncio.WriteTransport

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        if not self._pending and len(data) >= 4 and int.from_bytes(data[:4], "big") == len(data) - 4:
            self._deliver(bytes(data))  # the usual case: one whole frame per write
            return
        self._pending += data
        while len(self._pending) >= 4:
            end = 4 + int.from_bytes(self._pending[:4], "big")
            if len(self._pending) < end:
                break
            frame = bytes(self._pending[:end])
            del self._pending[:end]
            self._deliver(frame)

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return len(self._pending)

    # -- owner side

    def feed(self, frame: bytes) -> None:
        """Bytes received from the peer."""
        if self._protocol is not None and not self._lost:
            self._protocol.data_received(frame)

    def feed_eof(self) -> None:
        if self._protocol is not None and not self._lost:
            self._protocol.eof_received()

    def connection_lost(self, error: BaseException | None) -> None:
        """The stream is over: tell the protocol once (``StreamWriter.wait_closed`` returns)."""
        self._closing = True
        if self._protocol is not None and not self._lost:
            self._lost = True
            self._protocol.connection_lost(error)  # type: ignore[arg-type]


class StreamFlow(FlowListener):
    """Forwards an outbox's pause/resume to one stream's protocol."""

    def __init__(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def pause_writing(self) -> None:
        self.protocol.pause_writing()

    def resume_writing(self) -> None:
        self.protocol.resume_writing()


def open_stream(deliver: Deliver, on_close: Callable[[], None], extra: dict[str, Any] | None = None,
                *, limit: int = 2**20) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, FrameTransport]:
    """A ``(reader, writer)`` pair over a new ``FrameTransport`` (returned third, for feeding)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport = FrameTransport(deliver, on_close, extra)
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    return reader, writer, transport
