"""A device's session with a relay: dial out, authenticate, serve the streams the relay opens.

``RelayLink`` keeps one session alive, reconnecting with jittered exponential backoff whenever
the relay goes away (or asks the device to, with ``relay_goaway``). Each client stream the
relay opens becomes an ``asyncio`` reader/writer pair handed to ``serve_stream`` (the data
plane's own connection handler), so the device answers exactly like a directly reachable node.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from .._tasks import cancel_and_wait
from ..errors import ConfigError, NetworkError, ProtocolError, Unreachable
from ..protocol import DEFAULT_MAX_FRAME, ClientHandshake, Error, ErrorCode, HelloAck, Identity
from ..relay import (
    DEVICE_PATH,
    DEVICE_SUBPROTOCOL,
    CloseCode,
    GoAway,
    Kind,
    Outbox,
    OutboxClosed,
    Publish,
    Published,
    StreamFlow,
    Welcome,
    binding_of,
    client_context,
    close_payload,
    decode_control,
    encode_control,
    open_stream,
    pack,
    unpack,
)
from ..relay._tls import is_certificate_error

log = logging.getLogger(__name__)

ServeStream = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class LinkConfig:
    relay_url: str  # wss://HOST:PORT of the relay
    ca_file: str | None = None  # trust only this CA for the relay's certificate; None: system store
    relay_peer: bytes | None = None  # pin the relay's peer ID (None: any relay that holds the URL's certificate)
    initial_backoff_s: float = 0.5  # first reconnect delay; doubles up to max_backoff_s, full jitter
    max_backoff_s: float = 30.0
    heartbeat_s: float = 20.0  # WebSocket ping period towards the relay
    max_frame: int = DEFAULT_MAX_FRAME  # largest frame body accepted from clients
    queue_bytes: int = 16 << 20  # outbound queue above which streams' writers wait
    handshake_timeout_s: float = 10.0


class _Stream:
    def __init__(self, link_session: "_Session", stream_id: int) -> None:
        self.session, self.stream_id = link_session, stream_id
        self.closed_by_relay = False
        outbox = link_session.outbox
        self.reader, self.writer, self.transport = open_stream(
            lambda frame: outbox.push(pack(Kind.DATA, stream_id, frame)), self._on_close, {"peername": None})
        self.flow = StreamFlow(self.transport.get_protocol())
        outbox.watch(self.flow)

    def _on_close(self) -> None:
        self.session.outbox.unwatch(self.flow)
        self.session.streams.pop(self.stream_id, None)
        if not self.closed_by_relay and not self.session.outbox.closed:
            with contextlib.suppress(OutboxClosed):
                self.session.outbox.push(pack(Kind.CLOSE, self.stream_id, close_payload(CloseCode.NORMAL)))
        asyncio.get_running_loop().call_soon(self.transport.connection_lost, None)


class _Session:
    """One connected session: the WebSocket, its outbox and the streams it carries."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, welcome: Welcome, config: LinkConfig) -> None:
        self.ws, self.welcome = ws, welcome
        self.outbox = Outbox(ws.send_bytes, max_bytes=config.queue_bytes)
        self.streams: dict[int, _Stream] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.publish_waiter: asyncio.Future[Published] | None = None
        self.goaway: GoAway | None = None


class RelayLink:
    def __init__(self, identity: Identity, config: LinkConfig, serve_stream: ServeStream,
                 on_session: Callable[[Welcome], None] = lambda w: None) -> None:
        self.identity, self.config = identity, config
        self.serve_stream, self.on_session = serve_stream, on_session
        self.session: _Session | None = None
        self.sessions = 0  # sessions established so far
        self._connected = asyncio.Event()
        self._first: asyncio.Future[Welcome] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task[None] | None = None
        self._publish_lock = asyncio.Lock()
        self._failures = _Failures(config.relay_url)

    async def __aenter__(self) -> "RelayLink":
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def first_session(self) -> Welcome:
        """The first session's welcome; raises what made the very first attempt fail for good
        (an untrusted certificate, a refused identity)."""
        return await asyncio.shield(self._first)

    async def publish(self, record: bytes, layers: tuple[int, ...], timeout: float = 60.0) -> Published:
        """Hand a signed announcement to the relay and wait for its answer (``ProtocolError`` if refused)."""
        async with self._publish_lock:
            async with asyncio.timeout(timeout):
                await self._connected.wait()
            session = self.session
            assert session is not None
            session.publish_waiter = asyncio.get_running_loop().create_future()
            session.outbox.push(pack(Kind.CONTROL, 0, encode_control(Publish(record, layers))))
            try:
                async with asyncio.timeout(timeout):
                    return await asyncio.shield(session.publish_waiter)
            finally:
                session.publish_waiter = None

    # ------------------------------------------------------------------ connection loop

    async def _run(self) -> None:
        delay = self.config.initial_backoff_s
        failures = self._failures
        while True:
            retry_after: float | None = None
            sessions = self.sessions
            try:
                retry_after = await self._one_session()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure means: wait, then dial again
                fatal = isinstance(e, ConfigError) or is_certificate_error(e) or (
                    isinstance(e, ProtocolError) and e.code == ErrorCode.AUTH_FAILED)
                if not self._first.done() and fatal:
                    self._first.set_exception(Unreachable(f"relay {self.config.relay_url} refused: {e}")
                                              if not isinstance(e, ConfigError) else e)
                    return
                failures.failed(e)
            if self.sessions > sessions:
                delay = self.config.initial_backoff_s  # a session was welcomed: start over
            self._connected.clear()
            wait = retry_after if retry_after is not None else random.uniform(0, delay)
            delay = min(self.config.max_backoff_s, delay * 2)
            await asyncio.sleep(wait)

    async def _one_session(self) -> float | None:
        """Connect, serve until the session ends; the relay's requested reconnect delay, if any."""
        ssl_ctx = client_context(self.config.ca_file) if self.config.relay_url.startswith("wss://") else False
        url = self.config.relay_url.rstrip("/") + DEVICE_PATH
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(url, ssl=ssl_ctx, protocols=(DEVICE_SUBPROTOCOL,), compress=0,
                                       heartbeat=self.config.heartbeat_s, max_msg_size=self.config.max_frame + 9,
                                       timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=2.0)) as ws:
                async with asyncio.timeout(self.config.handshake_timeout_s):
                    welcome = await self._authenticate(ws)
                session = _Session(ws, welcome, self.config)
                session.outbox.start()
                self.session, self.sessions = session, self.sessions + 1
                self._connected.set()
                if not self._first.done():
                    self._first.set_result(welcome)
                log.info("relay session %d up: reachable at %s", self.sessions, welcome.endpoint)
                self._failures.recovered()
                self.on_session(welcome)
                try:
                    await self._serve(session)
                finally:
                    self._connected.clear()
                    await self._end(session)
                if session.goaway is not None:
                    return session.goaway.retry_after_ms / 1000 * random.uniform(1.0, 1.5)
        return None

    async def _authenticate(self, ws: aiohttp.ClientWebSocketResponse) -> Welcome:
        ssl_obj = ws.get_extra_info("ssl_object")
        cert = ssl_obj.getpeercert(binary_form=True) if ssl_obj is not None else None
        hs = ClientHandshake(self.identity, expected_server=self.config.relay_peer, channel_binding=binding_of(cert))
        await ws.send_bytes(pack(Kind.CONTROL, 0, encode_control(hs.hello)))
        ack = await self._control(ws)
        if not isinstance(ack, HelloAck):
            raise ProtocolError("relay did not answer hello with hello_ack", code=ErrorCode.UNEXPECTED_MESSAGE)
        await ws.send_bytes(pack(Kind.CONTROL, 0, encode_control(hs.receive_ack(ack))))
        welcome = await self._control(ws)
        if not isinstance(welcome, Welcome):
            raise ProtocolError("relay did not welcome us", code=ErrorCode.UNEXPECTED_MESSAGE)
        return welcome

    async def _control(self, ws: aiohttp.ClientWebSocketResponse) -> object:
        msg = await ws.receive()
        if msg.type is not aiohttp.WSMsgType.BINARY:
            raise NetworkError(f"relay closed the session during the handshake ({msg.type.name} {msg.data})")
        kind, _, payload = unpack(msg.data)
        if kind is not Kind.CONTROL:
            raise ProtocolError("expected a control envelope", code=ErrorCode.UNEXPECTED_MESSAGE)
        control = decode_control(payload)
        if isinstance(control, Error):
            raise ProtocolError(f"relay refused: {control.message}", code=control.code)
        return control

    async def _serve(self, session: _Session) -> None:
        async for msg in session.ws:
            if msg.type is not aiohttp.WSMsgType.BINARY:
                raise ProtocolError(f"relay sent a {msg.type.name} message", code=ErrorCode.MALFORMED_FRAME)
            kind, stream_id, payload = unpack(msg.data)
            if kind is Kind.DATA:
                stream = session.streams.get(stream_id)
                if stream is not None:
                    stream.transport.feed(payload)
            elif kind is Kind.OPEN:
                self._open(session, stream_id)
            elif kind is Kind.CLOSE:
                stream = session.streams.get(stream_id)
                if stream is not None:
                    stream.closed_by_relay = True
                    stream.transport.feed_eof()
            else:
                self._on_control(session, decode_control(payload))

    def _open(self, session: _Session, stream_id: int) -> None:
        if stream_id in session.streams:
            raise ProtocolError(f"relay reopened stream {stream_id}", code=ErrorCode.UNEXPECTED_MESSAGE)
        stream = _Stream(session, stream_id)
        session.streams[stream_id] = stream
        task: asyncio.Task[None] = asyncio.create_task(self.serve_stream(stream.reader, stream.writer))
        session.tasks.add(task)
        task.add_done_callback(session.tasks.discard)

    def _on_control(self, session: _Session, msg: object) -> None:
        waiter = session.publish_waiter
        if isinstance(msg, Published):
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif isinstance(msg, Error):
            if waiter is not None and not waiter.done():
                waiter.set_exception(ProtocolError(f"relay: {msg.message}", code=msg.code))
            else:
                log.warning("relay reports error %d: %s", msg.code, msg.message)
        elif isinstance(msg, GoAway):
            log.info("relay going away (%s); reconnecting in %d ms", msg.reason, msg.retry_after_ms)
            session.goaway = msg

    async def _end(self, session: _Session) -> None:
        for stream in list(session.streams.values()):
            stream.closed_by_relay = True
            stream.transport.feed_eof()
        if session.tasks:
            for task in session.tasks:
                task.cancel()
            await asyncio.wait(session.tasks, timeout=5)
        await session.outbox.aclose()
        if session.publish_waiter is not None and not session.publish_waiter.done():
            session.publish_waiter.set_exception(NetworkError("relay session ended"))



_ERRNO_OF = {ConnectionResetError: errno.ECONNRESET, ConnectionRefusedError: errno.ECONNREFUSED,
             ConnectionAbortedError: errno.ECONNABORTED}  # raised without an errno by the TLS layer


def describe_failure(e: BaseException) -> str:
    """Why a session with the relay failed, in words: not aiohttp's ``Cannot connect to host H:P
    ssl:<ssl.SSLContext object at 0x...> [Connect call failed ...]``."""
    if isinstance(e, aiohttp.ClientConnectorError):
        os_error = e.os_error
        code = os_error.errno or _ERRNO_OF.get(type(os_error))
        reason = os.strerror(code).lower() if code else str(os_error) or type(os_error).__name__
        return f"cannot connect to {e.host}:{e.port}: {reason}"
    if isinstance(e, aiohttp.WSServerHandshakeError):
        return f"the relay refused the WebSocket: HTTP {e.status} {e.message}"
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "no answer in time"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class _Failures:
    """Logs failed sessions without flooding: one line for the first failure, then at most one a
    minute with the count and the latest reason, and one when a session is up again."""

    REPEAT_S = 60.0

    def __init__(self, relay_url: str) -> None:
        self.relay_url = relay_url
        self.count = 0  # failures in a row
        self.logged_at = 0.0

    def failed(self, e: BaseException) -> None:
        now = time.monotonic()
        self.count += 1
        if self.count == 1:
            log.warning("relay %s: %s; retrying with backoff", self.relay_url, describe_failure(e))
        elif now - self.logged_at >= self.REPEAT_S:
            log.warning("relay %s: still failing after %d attempts, the last: %s", self.relay_url, self.count,
                        describe_failure(e))
        else:
            return
        self.logged_at = now

    def recovered(self) -> None:
        if self.count:
            log.warning("relay %s: session up after %d failed attempts", self.relay_url, self.count)
        self.count = 0
