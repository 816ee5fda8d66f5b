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
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .._tasks import cancel_and_wait
from ..errors import BadResponse, ConfigError, NetworkError, ProtocolError, Timeout, Unreachable
from ..protocol import (
    DEFAULT_MAX_FRAME,
    FATAL_CODES,
    Auth,
    ClientHandshake,
    Error,
    ErrorCode,
    ExpertRequest,
    ExpertResponse,
    Hello,
    HelloAck,
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
from .tls import channel_binding, client_context, self_signed_server_context

if TYPE_CHECKING:
    from .routing_table import Holder

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


class ExpertClient:
    """One authenticated connection to an expert server; calls are multiplexed by request id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server_peer: bytes,
                 max_frame: int) -> None:
        self.reader, self.writer = reader, writer
        self.server_peer = server_peer
        self.max_frame = max_frame
        self._pending: dict[bytes, asyncio.Future[ExpertResponse | WeightsResponse]] = {}
        self._pings: dict[int, asyncio.Future[float]] = {}
        self._write_lock = asyncio.Lock()
        self._closed: BaseException | None = None
        self._reader_task = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect(cls, endpoint: str, identity: Identity, *, expected_peer: bytes | None = None,
                      timeout: float = 10.0, max_frame: int = DEFAULT_MAX_FRAME) -> "ExpertClient":
        # --- begin relay dispatch (issue 5): relay+wss:// endpoints are dialled through the relay,
        # whose WebSocket carries the same frames; channel binding is empty (no TLS to the device).
        if endpoint.startswith(("relay+wss://", "relay+ws://")):
            from ..relay import open_relay_stream

            reader, writer = await open_relay_stream(endpoint, timeout=timeout, max_frame=max_frame)
        else:  # --- end relay dispatch; below, unchanged: tcp+tls:// and tcp://
            host, port, tls = parse_endpoint(endpoint)
            try:
                async with asyncio.timeout(timeout):
                    reader, writer = await asyncio.open_connection(
                        host, port, ssl=client_context() if tls else None, limit=2**20)
            except TimeoutError:
                raise Timeout(f"connecting to {endpoint} timed out") from None
            except OSError as e:
                raise Unreachable(f"cannot connect to {endpoint}: {e}") from None
        try:
            async with asyncio.timeout(timeout):
                server_peer = await cls._handshake(reader, writer, identity, expected_peer, max_frame)
        except BaseException as e:
            writer.transport.abort()  # no TLS goodbye for a connection that never worked
            if isinstance(e, TimeoutError):
                raise Timeout(f"handshake with {endpoint} timed out") from None
            raise
        return cls(reader, writer, server_peer, max_frame)

    @staticmethod
    async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, identity: Identity,
                         expected: bytes | None, max_frame: int) -> bytes:
        ssl_obj = writer.get_extra_info("ssl_object")
        cert = ssl_obj.getpeercert(binary_form=True) if ssl_obj is not None else None
        hs = ClientHandshake(identity, expected_server=expected, channel_binding=channel_binding(cert))
        await write_message(writer, hs.hello, max_size=max_frame)
        ack = await read_message(reader, max_size=max_frame)
        if isinstance(ack, Error):
            raise ProtocolError(f"server refused the handshake: {ack.message}", code=ack.code)
        if not isinstance(ack, HelloAck):
            raise ProtocolError("expected HelloAck", code=ErrorCode.UNEXPECTED_MESSAGE)
        await write_message(writer, hs.receive_ack(ack), max_size=max_frame)
        assert hs.server_peer is not None
        return hs.server_peer

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def call(self, request: ExpertRequest, timeout: float) -> ExpertResponse:
        response = await self._request(request, timeout, "expert call")
        if not isinstance(response, ExpertResponse):
            raise ProtocolError("a weights_response answered an expert_request", code=ErrorCode.UNEXPECTED_MESSAGE)
        return response

    async def fetch(self, request: WeightsRequest, timeout: float) -> WeightsResponse:
        """Rows of one tensor of one expert (``moeswarm.node.fetch`` assembles whole experts)."""
        response = await self._request(request, timeout, "weight fetch")
        if not isinstance(response, WeightsResponse):
            raise ProtocolError("an expert_response answered a weights_request", code=ErrorCode.UNEXPECTED_MESSAGE)
        return response

    async def _request(self, request: ExpertRequest | WeightsRequest, timeout: float,
                       what: str) -> ExpertResponse | WeightsResponse:
        if self._closed is not None:
            raise Unreachable(f"connection is closed: {self._closed}")
        future: asyncio.Future[ExpertResponse | WeightsResponse] = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = future
        try:
            async with self._write_lock:
                await write_message(self.writer, request, max_size=self.max_frame)
            async with asyncio.timeout(timeout):  # not wait_for: see moeswarm._tasks
                return await future
        except TimeoutError:
            raise Timeout(f"{what} timed out after {timeout:.1f}s") from None
        finally:
            self._pending.pop(request.request_id, None)

    async def ping(self, timeout: float = 5.0, *, pad: int = 0, want: int = 0) -> float:
        """Seconds from sending a ``Ping`` (carrying ``pad`` filler bytes) until its ``Pong``
        (carrying ``want`` filler bytes back) has been read: the round trip plus the transfer time
        of ``pad`` bytes up and ``want`` bytes down (``moeswarm.node.links`` times each direction)."""
        ts = time.monotonic_ns() // 1000
        while ts in self._pings:  # two probes in the same microsecond
            ts += 1
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pings[ts] = future
        try:
            async with self._write_lock:
                await write_message(self.writer, Ping(ts, bytes(pad), want), max_size=self.max_frame)
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise Timeout("ping timed out") from None
        finally:
            self._pings.pop(ts, None)

    async def _read_loop(self) -> None:
        try:
            while True:
                body = await read_frame(self.reader, max_size=self.max_frame)
                if body is None:
                    raise Unreachable("server closed the connection")
                try:
                    msg = decode(body)
                except ProtocolError as e:  # a bad answer fails its own call, not the connection
                    rid = peek_request_id(body)
                    fut = self._pending.get(rid or b"")
                    if e.code in FATAL_CODES or fut is None:
                        raise
                    if not fut.done():
                        fut.set_exception(BadResponse(f"the server's answer is invalid: {e}", code=e.code))
                    continue
                if isinstance(msg, (ExpertResponse, WeightsResponse)):
                    fut = self._pending.get(msg.request_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, Error):
                    fut = self._pending.get(msg.request_id or b"")
                    err = ProtocolError(f"server error {msg.code}: {msg.message}", code=msg.code)
                    if fut is not None and not fut.done():
                        fut.set_exception(err)
                    elif msg.code in FATAL_CODES:
                        raise err
                elif isinstance(msg, Pong):
                    pf = self._pings.get(msg.ts)
                    if pf is not None and not pf.done():
                        pf.set_result((time.monotonic_ns() // 1000 - msg.ts) / 1e6)
        except asyncio.CancelledError:
            self._fail(Unreachable("connection closed by us"))
            raise
        except (ProtocolError, NetworkError) as e:
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - anything else still fails the calls, never hangs them
            self._fail(NetworkError(f"connection failed: {e}"))

    def _fail(self, error: BaseException) -> None:
        self._closed = error
        for fut in list(self._pending.values()) + list(self._pings.values()):  # type: ignore[operator]
            if not fut.done():
                fut.set_exception(error)
        self.writer.close()

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):  # the reader's own failure was already reported to its calls
            await cancel_and_wait(self._reader_task)  # ... but a cancellation of whoever closes us is not swallowed
        await close_writer(self.writer)

    def abort(self) -> None:
        """Drop the connection at once, without the TLS goodbye (for a client that already failed)."""
        self._reader_task.cancel()
        self.writer.transport.abort()


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


class Connections:
    """One ``ExpertClient`` per peer, opened on first use (one dial however many ask at once),
    replaced when it breaks."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self._clients: dict[bytes, ExpertClient] = {}
        self._locks: dict[bytes, asyncio.Lock] = {}

    async def get(self, holder: "Holder", timeout: float) -> ExpertClient:
        client = self._clients.get(holder.peer_id)
        if client is not None and not client.closed:
            return client
        lock = self._locks.setdefault(holder.peer_id, asyncio.Lock())
        async with lock:
            client = self._clients.get(holder.peer_id)
            if client is not None and not client.closed:
                return client
            if client is not None:  # it failed: its socket goes now, not whenever it is collected
                del self._clients[holder.peer_id]
                client.abort()
            error: Exception | None = None
            for endpoint in holder.endpoints:
                try:
                    client = await ExpertClient.connect(endpoint, self.identity, expected_peer=holder.peer_id,
                                                        timeout=timeout)
                    self._clients[holder.peer_id] = client
                    return client
                except (NetworkError, ProtocolError, ConfigError) as e:
                    error = e
            raise error or NetworkError("holder announced no endpoint")

    def is_open(self, peer: bytes) -> bool:
        """Whether a connection to ``peer`` was opened earlier (it may have died since)."""
        return peer in self._clients

    async def drop(self, peer: bytes) -> None:
        client = self._clients.pop(peer, None)
        if client is not None:
            await client.aclose()

    async def aclose(self) -> None:
        for peer in list(self._clients):
            await self.drop(peer)
