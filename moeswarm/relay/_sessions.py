"""What the relay holds per connection: a device's session and the client streams it carries.

Frames are forwarded, never decoded: the relay checks the 4-byte length prefix against the
message size and its limit, charges the sender's rate budget, and queues the bytes for the
other side. Each side owns a bounded ``Outbox``: a client whose device queue is full waits
(backpressure on that client only); a device's answer to a client whose queue is full closes
that one stream (the device's reader never waits on a slow client). Either way no other
device is affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import WSMsgType, web

from .._tasks import cancel_and_wait
from ..errors import ProtocolError
from ..protocol import Error, ErrorCode, canonical, peer_id_to_str
from ._envelope import (
    CloseCode,
    Control,
    Kind,
    Publish,
    Published,
    WSClose,
    check_frame,
    close_payload,
    decode_control,
    encode_control,
    pack,
    parse_close,
    unpack,
)
from ._limits import PeerBudget, RelayLimits, TokenBucket
from ._outbox import Outbox, OutboxClosed

if TYPE_CHECKING:
    from ._metrics import RelayMetrics


class RelayHost(Protocol):
    """What a session needs of the relay that owns it (``_server.RelayServer`` is one)."""

    limits: RelayLimits
    metrics: RelayMetrics

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...

    async def publish(self, session: "DeviceSession", msg: Publish) -> tuple[int, int]: ...

log = logging.getLogger(__name__)

CLOSE_TO_WS = {CloseCode.NORMAL: WSClose.NORMAL, CloseCode.PROTOCOL: WSClose.PROTOCOL_ERROR,
               CloseCode.RATE_LIMITED: WSClose.POLICY, CloseCode.SLOW_CONSUMER: WSClose.SLOW_CONSUMER,
               CloseCode.IDLE: WSClose.IDLE, CloseCode.SHUTDOWN: WSClose.GOING_AWAY,
               CloseCode.DEVICE_GONE: WSClose.GOING_AWAY}
MAX_CONTROL_BYTES = 16 * 1024


class Violation(ProtocolError):
    """A peer broke the relay's rules; ``kind`` names the metric, ``close`` the WebSocket close code."""

    def __init__(self, message: str, kind: str, close: WSClose, code: int = ErrorCode.MALFORMED_FRAME) -> None:
        super().__init__(message, code=code)
        self.kind, self.close = kind, close


def violation_of(error: ProtocolError) -> Violation:
    if error.code == ErrorCode.FRAME_TOO_LARGE:
        return Violation(str(error), "too_large", WSClose.TOO_BIG, error.code)
    return Violation(str(error), "malformed", WSClose.PROTOCOL_ERROR, error.code)


async def charge(relay: "RelayHost", budget: PeerBudget, nbytes: int, role: str) -> None:
    """Hold the sender back to its rate; ``Violation`` when it is over quota or far over rate."""
    wait = budget.charge(nbytes)
    if wait is None:
        over_quota = budget.quota.allowance and budget.quota.used > budget.quota.allowance
        kind = "quota" if over_quota else "rate_limited"
        raise Violation(f"{role} exceeded its {'quota' if over_quota else 'rate limit'}", kind, WSClose.POLICY,
                        ErrorCode.OVERLOADED)
    if wait > 0:
        relay.metrics.throttled.labels(role).inc(wait)
        await asyncio.sleep(wait)


@dataclass(eq=False)
class ClientStream:
    """One client connection to a device, carried as a numbered stream in the device's session."""

    relay: "RelayHost"
    ws: web.WebSocketResponse
    device: "DeviceSession"
    stream_id: int
    remote: str
    budget: PeerBudget
    address: str = ""  # what per-address limits count (IPv6: the /64)
    outbox: Outbox = field(init=False)
    last_active: float = field(default_factory=time.monotonic)
    opened: float = field(default_factory=time.monotonic)
    _sent: deque[float] = field(default_factory=deque)  # arrival times of unanswered client frames
    _frames_in: int = 0
    _closing: CloseCode | None = None
    _ws_close: WSClose | None = None  # a more precise WebSocket close code than the stream's

    def __post_init__(self) -> None:
        limits = self.relay.limits
        self.outbox = Outbox(self.ws.send_bytes, max_bytes=limits.queue_bytes, max_frames=limits.queue_frames)

    @property
    def in_flight(self) -> int:
        return len(self._sent)

    @property
    def closing(self) -> bool:
        return self._closing is not None

    async def serve(self) -> None:
        """Forward the client's frames until either side closes; then tell the other side."""
        self.outbox.start()
        code = CloseCode.NORMAL
        try:
            await self.device.outbox.put(pack(Kind.OPEN, self.stream_id, _open_payload(self.remote)))
            code = await self._forward()
        except OutboxClosed:
            code = CloseCode.DEVICE_GONE
        finally:
            code = self._closing or code
            if code is not CloseCode.DEVICE_GONE:
                self.device.outbox.offer(pack(Kind.CLOSE, self.stream_id, close_payload(code)))
            await self.outbox.aclose(flush_s=0.5 if code is CloseCode.DEVICE_GONE else 0.0)
            with contextlib.suppress(Exception):
                await self.ws.close(code=self._ws_close or CLOSE_TO_WS[code])

    async def _forward(self) -> CloseCode:
        relay, limits = self.relay, self.relay.limits
        async for msg in self.ws:
            if msg.type is not WSMsgType.BINARY:
                relay.metrics.error("text_message" if msg.type is WSMsgType.TEXT else "malformed")
                self._ws_close = WSClose.UNSUPPORTED_DATA if msg.type is WSMsgType.TEXT else None
                return CloseCode.PROTOCOL
            data = msg.data
            try:
                check_frame(data, limits.max_frame)
            except ProtocolError as e:
                violation = violation_of(e)
                relay.metrics.error(violation.kind)
                self._ws_close = violation.close
                return CloseCode.PROTOCOL
            try:
                await charge(relay, self.budget, len(data), "client")
            except Violation as v:
                relay.metrics.error(v.kind)
                return CloseCode.RATE_LIMITED
            if not self.device.budget.account(len(data)):
                relay.metrics.error("quota")
                return CloseCode.RATE_LIMITED
            self.last_active = time.monotonic()
            self._frames_in += 1
            if self._frames_in != 2:  # the handshake's Auth is the one client frame nobody answers
                self._sent.append(self.last_active)
            await self.device.outbox.put(pack(Kind.DATA, self.stream_id, data))
            relay.metrics.frames.labels("to_device").inc()
            relay.metrics.bytes.labels("to_device").inc(len(data))
            if self._closing is not None:
                break
        return self._closing or CloseCode.NORMAL

    def deliver(self, frame: memoryview) -> None:
        """A frame from the device: queue it for the client, or drop the stream if it lags."""
        now = time.monotonic()
        self.last_active = now
        if self._sent:
            self.relay.metrics.latency.observe(now - self._sent.popleft())
            self.relay.metrics.calls.inc()
        if not self.budget.account(len(frame)):
            self.relay.metrics.error("quota")
            self.close(CloseCode.RATE_LIMITED)
        elif not self.outbox.offer(frame):  # type: ignore[arg-type]
            self.relay.metrics.error("slow_consumer")
            self.close(CloseCode.SLOW_CONSUMER)
        else:
            self.relay.metrics.frames.labels("to_client").inc()
            self.relay.metrics.bytes.labels("to_client").inc(len(frame))

    def close(self, code: CloseCode) -> None:
        """End the stream from the relay's side (the serving task notices and cleans up)."""
        if self._closing is None:
            self._closing = code
            self.relay.spawn(self.ws.close(code=CLOSE_TO_WS[code]))


def _open_payload(remote: str) -> bytes:
    return canonical({"remote": remote[:64]})


class DeviceSession:
    """An authenticated device's WebSocket: CONTROL messages, and DATA for its client streams."""

    def __init__(self, relay: "RelayHost", ws: web.WebSocketResponse, peer: bytes, endpoint: str,
                 budget: PeerBudget) -> None:
        self.relay, self.ws, self.peer, self.endpoint, self.budget = relay, ws, peer, endpoint, budget
        self.peer_str = peer_id_to_str(peer)
        limits: RelayLimits = relay.limits
        self.outbox = Outbox(ws.send_bytes, max_bytes=limits.queue_bytes, max_frames=limits.queue_frames)
        self.streams: dict[int, ClientStream] = {}
        self._next_stream = 1
        self._publish_rate = TokenBucket(0.2, 5)  # DHT writes are expensive: 5 at once, then one per 5 s
        self._publish_task: asyncio.Task[None] | None = None
        self._queued_publish: deque[Publish] = deque()
        self.close_code = WSClose.NORMAL

    def new_stream_id(self) -> int:
        stream_id = self._next_stream
        self._next_stream = self._next_stream % (2**32 - 1) + 1
        return stream_id

    def send_control(self, msg: Control) -> bool:
        return self.outbox.offer(pack(Kind.CONTROL, 0, encode_control(msg)))

    async def serve(self) -> None:
        """Read the device's envelopes until it leaves or breaks a rule."""
        try:
            async for msg in self.ws:
                if msg.type is not WSMsgType.BINARY:
                    raise Violation(f"device sent a {msg.type.name} message", "text_message"
                                    if msg.type is WSMsgType.TEXT else "malformed", WSClose.UNSUPPORTED_DATA)
                await charge(self.relay, self.budget, len(msg.data), "device")
                await self._dispatch(msg.data)
        except Violation as v:
            self.relay.metrics.error(v.kind)
            log.info("device %s disconnected: %s", self.peer_str, v)
            self.send_control(Error(v.code, str(v)[:200]))
            self.close_code = v.close
        finally:
            if self._publish_task is not None:
                await cancel_and_wait(self._publish_task)

    async def _dispatch(self, data: bytes) -> None:
        try:
            kind, stream_id, payload = unpack(data)
        except ProtocolError as e:
            raise violation_of(e) from None
        if kind is Kind.DATA:
            view = memoryview(data)[5:]
            try:
                check_frame(view, self.relay.limits.max_frame)
            except ProtocolError as e:
                raise violation_of(e) from None
            stream = self.streams.get(stream_id)
            if stream is None:
                self.relay.metrics.error("unknown_stream")  # a race with a closing stream, or garbage
            elif self.budget.account(len(view)):
                stream.deliver(view)
            else:
                raise Violation("device exceeded its quota", "quota", WSClose.POLICY, ErrorCode.OVERLOADED)
        elif kind is Kind.CLOSE:
            stream = self.streams.get(stream_id)
            if stream is not None:
                code, _ = parse_close(payload)
                stream.close(CloseCode(code) if code in CloseCode._value2member_map_ else CloseCode.NORMAL)
        elif kind is Kind.CONTROL:
            if len(payload) > MAX_CONTROL_BYTES:
                raise Violation("control message too large", "too_large", WSClose.TOO_BIG, ErrorCode.FRAME_TOO_LARGE)
            try:
                control = decode_control(payload)
            except ProtocolError as e:
                if e.code == ErrorCode.MALFORMED_FRAME:
                    raise violation_of(e) from None
                self.relay.metrics.error("publish_rejected")  # a well-formed control message with a bad field
                self.send_control(Error(e.code, str(e)[:1000]))
                return
            await self._control(control)
        else:
            raise Violation("devices do not send OPEN", "malformed", WSClose.PROTOCOL_ERROR)

    async def _control(self, msg: Control) -> None:
        if isinstance(msg, Publish):
            if self._publish_rate.take(1) > 0:
                self.relay.metrics.error("rate_limited")
                self.send_control(Error(ErrorCode.OVERLOADED, "publishing too often"))
                return
            if len(self._queued_publish) >= 4:
                self.send_control(Error(ErrorCode.OVERLOADED, "too many announcements queued"))
                return
            self._queued_publish.append(msg)
            if self._publish_task is None or self._publish_task.done():
                self._publish_task = asyncio.create_task(self._publish_loop())
        elif isinstance(msg, Error):
            log.info("device %s reports error %d: %s", self.peer_str, msg.code, msg.message)
        # pings are answered by WebSocket pongs; other control messages are ignored (forward compat)

    async def _publish_loop(self) -> None:
        while self._queued_publish:
            msg = self._queued_publish.popleft()
            try:
                keys, seq = await self.relay.publish(self, msg)
                self.send_control(Published(seq, keys))
            except ProtocolError as e:
                self.relay.metrics.error("publish_rejected")
                self.send_control(Error(e.code, f"announcement refused: {e}"[:1000]))
            except Exception as e:  # noqa: BLE001 - the DHT failed; the device will retry
                log.warning("publishing for %s failed: %s", self.peer_str, e)
                self.send_control(Error(ErrorCode.INTERNAL, f"DHT publish failed: {e}"[:1000]))
