"""The expert data plane: framed protocol messages over TLS/TCP, authenticated by the
Ed25519 handshake of ``moeswarm.protocol``.

``DataPlaneServer`` accepts connections, runs the handshake, then answers ``ExpertRequest``s
and ``WeightsRequest``s (concurrently, through handlers) and ``Ping``s (link probes too).  A bad frame gets an ``Error`` with the
spec's code; after a fatal code the connection is closed, otherwise it keeps going; the server
keeps serving other connections either way.  ``ExpertClient`` is one authenticated,
multiplexed connection: many calls in flight, answered by ``request_id``.

Endpoints are written ``tcp+tls://HOST:PORT`` (or ``tcp://HOST:PORT`` without TLS, tests only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..errors import ConfigError, NetworkError, ProtocolError
from ..protocol import (
    DEFAULT_MAX_FRAME,
    FATAL_CODES,
    Auth,
    Error,
    ErrorCode,
    ExpertRequest,
    ExpertResponse,
    Hello,
    Identity,
    Ping,
    Pong,
    ServerHandshake,
    WeightsRequest,
    WeightsResponse,
    decode,
    peek_request_id,
    read_frame,
    read_message,
    write_message,
)
from .tls import channel_binding, self_signed_server_context

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

Handler = Callable[[bytes, ExpertRequest], Awaitable[ExpertResponse]]
WeightsHandler = Callable[[bytes, WeightsRequest], Awaitable[WeightsResponse]]
HANDSHAKE_TIMEOUT_S = 10.0


def parse_endpoint(url: str) -> tuple[str, int, bool]:
    """``tcp+tls://host:port`` -> (host, port, tls)."""
    parts = urlsplit(url)
    if parts.scheme not in ("tcp+tls", "tcp") or not parts.hostname or not parts.port:
        raise ConfigError(f"not a data-plane endpoint: {url!r} (expected tcp+tls://HOST:PORT)")
    return parts.hostname, parts.port, parts.scheme == "tcp+tls"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # address to listen on
    port: int = 0  # 0 picks a free port
    tls: bool = True  # plain TCP only for tests of the framing itself
    max_frame: int = DEFAULT_MAX_FRAME  # largest frame body accepted, bytes
    max_in_flight: int = 64  # concurrent requests per connection before OVERLOADED


class DataPlaneServer:
    def __init__(self, identity: Identity, handler: Handler, config: ServerConfig = ServerConfig(),
                 weights_handler: WeightsHandler | None = None) -> None:
        self.identity = identity
        self.handler = handler
        self.weights_handler = weights_handler  # None: weight fetches get UNKNOWN_EXPERT
        self.config = config
        self._ssl: ssl.SSLContext | None = None
        self._cert: bytes | None = None
        if config.tls:
            self._ssl, self._cert = self_signed_server_context(identity.peer_id_str)
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        scheme = "tcp+tls" if self.config.tls else "tcp"
        return f"{scheme}://{self.config.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._on_connection, self.config.host, self.config.port, ssl=self._ssl, limit=2**20
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(self._connections, timeout=5)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()

    async def __aenter__(self) -> "DataPlaneServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await _ServerConnection(self, reader, writer).run()
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(task)
            await close_writer(writer)


class _ServerConnection:
    def __init__(self, server: DataPlaneServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader, self.writer = reader, writer
        self.write_lock = asyncio.Lock()
        self.in_flight: set[asyncio.Task[None]] = set()

    async def send(self, msg: object) -> None:
        async with self.write_lock:
            await write_message(self.writer, msg, max_size=self.server.config.max_frame)  # type: ignore[arg-type]

    async def run(self) -> None:
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                client = await self._handshake()
        except (ProtocolError, TimeoutError, NetworkError) as e:
            code = e.code if isinstance(e, ProtocolError) else ErrorCode.AUTH_FAILED
            with contextlib.suppress(NetworkError, ConfigError):
                await self.send(Error(int(code), f"handshake failed: {e or 'timeout'}"))
            return
        if client is None:
            return
        try:
            await self._serve(client)
        finally:
            for task in self.in_flight:
                task.cancel()
            if self.in_flight:
                await asyncio.wait(self.in_flight, timeout=5)

    async def _handshake(self) -> bytes | None:
        binding = channel_binding(self.server._cert)
        hs = ServerHandshake(self.server.identity, channel_binding=binding)
        hello = await read_message(self.reader, max_size=self.server.config.max_frame)
        if hello is None:
            return None
        if not isinstance(hello, Hello):
            raise ProtocolError("expected Hello", code=ErrorCode.UNEXPECTED_MESSAGE)
        await self.send(hs.receive_hello(hello))
        auth = await read_message(self.reader, max_size=self.server.config.max_frame)
        if auth is None:
            return None
        if not isinstance(auth, Auth):
            raise ProtocolError("expected Auth", code=ErrorCode.UNEXPECTED_MESSAGE)
        return hs.receive_auth(auth)

    async def _serve(self, client: bytes) -> None:
        while True:
            body = None
            try:
                body = await read_frame(self.reader, max_size=self.server.config.max_frame)
                if body is None:
                    return
                msg = decode(body)
            except ProtocolError as e:  # tell the peer which request it was, when we can
                await self.send(Error(e.code, str(e), peek_request_id(body) if body else None))
                if e.code in FATAL_CODES:
                    return
                continue
            except NetworkError:
                return
            if isinstance(msg, (ExpertRequest, WeightsRequest)):
                if len(self.in_flight) >= self.server.config.max_in_flight:
                    await self.send(Error(ErrorCode.OVERLOADED, "too many requests in flight", msg.request_id))
                    continue
                task = asyncio.create_task(self._answer(client, msg))
                self.in_flight.add(task)
                task.add_done_callback(self.in_flight.discard)
            elif isinstance(msg, Ping):
                await self.send(Pong(msg.ts, bytes(msg.want)))
            elif isinstance(msg, Error):
                log.info("peer reported error %s: %s", msg.code, msg.message)
            else:
                await self.send(Error(ErrorCode.UNEXPECTED_MESSAGE, f"unexpected {type(msg).__name__}"))
                return

    async def _answer(self, client: bytes, request: ExpertRequest | WeightsRequest) -> None:
        try:
            if isinstance(request, WeightsRequest):
                if self.server.weights_handler is None:
                    raise ProtocolError("this server does not hand out weights", code=ErrorCode.UNKNOWN_EXPERT)
                reply: object = await self.server.weights_handler(client, request)
            else:
                reply = await self.server.handler(client, request)
        except ProtocolError as e:
            reply = Error(e.code, str(e), request.request_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the handler failed: the peer is told, the server keeps serving
            log.exception("expert request failed")
            reply = Error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"[:1000], request.request_id)
        with contextlib.suppress(NetworkError):
            await self.send(reply)


async def close_writer(writer: asyncio.StreamWriter, timeout: float = 2.0) -> None:
    """Close a stream, giving TLS ``timeout`` seconds for its goodbye, then drop the socket: a
    close left waiting on a slow peer's close_notify would outlive the event loop, and its
    socket would never be closed."""
    writer.close()
    try:
        async with asyncio.timeout(timeout):
            await writer.wait_closed()
    except BaseException as e:
        writer.transport.abort()
        if not isinstance(e, Exception):  # our caller's cancellation
            raise
