"""Reaching a device through a relay: ``relay+wss://HOST:PORT/<device peer id>`` endpoints.

A client opens ``wss://HOST:PORT/<device peer id>`` (the endpoint with ``relay+`` dropped) and
then speaks the ordinary data-plane protocol, one frame per binary WebSocket message, with the
device at the far end; the relay forwards the frames. ``open_relay_stream`` returns that
connection as an ``asyncio`` reader/writer pair, so ``ExpertClient`` runs over it unchanged.

While a relay restarts (connection refused) or a device is reconnecting to it (HTTP 503), the
dial is retried with a short backoff until ``timeout``; an unknown device (404) or an untrusted
certificate fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import time
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from .._tasks import cancel_and_wait
from ..errors import ConfigError, NetworkError, Timeout, Unreachable
from ..protocol import DEFAULT_MAX_FRAME, peer_id_from_str, peer_id_to_str
from ._envelope import CLIENT_SUBPROTOCOL, RELAY_SCHEME
from ._outbox import Outbox
from ._tls import default_client_context, is_certificate_error
from ._transport import StreamFlow, open_stream

RETRY_STATUSES = frozenset({502, 503, 504})
CLIENT_QUEUE_BYTES = 4 << 20  # writers pause above this many queued bytes


def relay_endpoint(relay_url: str, peer_id: bytes) -> str:
    """The endpoint a device announces: ``relay+wss://HOST:PORT[/prefix]/<peer id>``."""
    parts = urlsplit(relay_url)
    if parts.scheme not in ("wss", "ws") or not parts.hostname:
        raise ConfigError(f"a relay URL looks like wss://HOST:PORT, not {relay_url!r}")
    path = parts.path.rstrip("/") + "/" + peer_id_to_str(peer_id)
    return urlunsplit((f"relay+{parts.scheme}", parts.netloc, path, "", ""))


def parse_relay_endpoint(endpoint: str) -> tuple[str, bytes]:
    """``relay+wss://...`` -> (the ``wss://`` URL to open, the device's peer ID)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in (RELAY_SCHEME, "relay+ws") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"not a relay endpoint: {endpoint!r} (expected relay+wss://HOST:PORT/<peer id>)")
    peer_text = parts.path.rsplit("/", 1)[-1]
    try:
        peer = peer_id_from_str(peer_text)
    except Exception:  # noqa: BLE001 - ProtocolError from the parser: here a config problem
        raise ConfigError(f"relay endpoint {endpoint!r} does not end in a peer ID") from None
    return urlunsplit((parts.scheme[len("relay+"):], parts.netloc, parts.path, "", "")), peer


class WebSocketStream:
    """Owns one client WebSocket and the tasks that move its frames to and from a transport."""

    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.session, self.ws = session, ws
        self.outbox = Outbox(ws.send_bytes, max_bytes=CLIENT_QUEUE_BYTES)
        self._closer: asyncio.Task[None] | None = None
        self.reader, self.writer, self.transport = open_stream(self.outbox.push, self._close, {"peername": None})
        self.outbox.watch(StreamFlow(self.transport.get_protocol()))
        self.outbox.start()
        self._pump = asyncio.create_task(self._pump_in())

    async def _pump_in(self) -> None:
        error: BaseException | None = None
        try:
            async for msg in self.ws:
                if msg.type is aiohttp.WSMsgType.BINARY:
                    self.transport.feed(msg.data)
                else:  # text: not our protocol; anything else ends the iteration
                    error = NetworkError(f"relay sent a {msg.type.name} message")
                    break
        except Exception as e:  # noqa: BLE001 - a broken socket ends the stream like an EOF
            error = e
        finally:
            self.transport.feed_eof()
            if self._closer is None:
                self._closer = asyncio.create_task(self._shutdown(error))

    def _close(self) -> None:
        if self._closer is None:
            self._closer = asyncio.create_task(self._shutdown(None))

    async def _shutdown(self, error: BaseException | None) -> None:
        current = asyncio.current_task()
        try:
            if self._pump is not current:
                await cancel_and_wait(self._pump)
            await self.outbox.aclose(flush_s=1.0)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await self.ws.close()
            await self.session.close()
        finally:
            self.transport.connection_lost(error)


async def _connect_once(url: str, ssl_ctx: ssl.SSLContext | bool, max_frame: int,
                        timeout: float) -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse]:
    session = aiohttp.ClientSession()
    try:
        ws = await session.ws_connect(
            url, ssl=ssl_ctx, protocols=(CLIENT_SUBPROTOCOL,), compress=0, max_msg_size=max_frame + 4,
            heartbeat=20.0, timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=2.0),
        )
    except BaseException:
        await session.close()
        raise
    return session, ws


async def open_relay_stream(endpoint: str, *, timeout: float = 10.0, max_frame: int = DEFAULT_MAX_FRAME,
                            ssl_context: ssl.SSLContext | None = None,
                            ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a data-plane byte stream to the device behind ``endpoint`` (see the module docstring).

    ``Unreachable`` for an unknown device, a refused certificate or a relay that stays down;
    ``Timeout`` when ``timeout`` passes while retrying.
    """
    url, _peer = parse_relay_endpoint(endpoint)
    ssl_ctx: ssl.SSLContext | bool = False
    if url.startswith("wss://"):
        ssl_ctx = ssl_context or default_client_context()
    deadline = time.monotonic() + timeout
    delay = 0.05
    last: str = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Timeout(f"could not reach {endpoint} within {timeout:.1f}s: {last}")
        try:
            async with asyncio.timeout(remaining):
                session, ws = await _connect_once(url, ssl_ctx, max_frame, remaining)
            stream = WebSocketStream(session, ws)
            return stream.reader, stream.writer
        except TimeoutError:
            last = "timed out"
        except aiohttp.WSServerHandshakeError as e:
            if e.status not in RETRY_STATUSES:
                raise Unreachable(f"relay refused {endpoint}: HTTP {e.status} {e.message}") from None
            last = f"HTTP {e.status} (device reconnecting or relay busy)"
        except (aiohttp.ClientError, OSError) as e:
            if is_certificate_error(e):
                raise Unreachable(f"relay certificate for {endpoint} is not trusted: {e}") from None
            last = f"{type(e).__name__}: {e}"
        await asyncio.sleep(min(delay * (0.5 + random.random()), max(0.0, deadline - time.monotonic())))
        delay = min(1.0, delay * 2)

