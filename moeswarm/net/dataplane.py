"""The expert data plane: framed protocol messages over TLS/TCP, authenticated by the
Ed25519 handshake of ``moeswarm.protocol``.

``DataPlaneServer`` accepts connections, runs the handshake, then answers ``ExpertRequest``s
and ``WeightsRequest``s (concurrently, through handlers), ``Ping``s (link probes too) and ``ConfigRequest``s (the
config.json of a model served here, for the swarm catalogue).  On a connection of version 2
(v1.3) expert requests go to the ``batched_handler``, whose answers carry no receipt, and the
``receipts`` source's ``receipt_batch``es are sent on the client's connections (and before any
``pong``, so a ping tells a client its receipts are all in).  A bad frame gets an ``Error`` with the
spec's code; after a fatal code the connection is closed, otherwise it keeps going; the server
keeps serving other connections either way.  With a ``fast_handler`` an expert request that reaches
a server with no other expert request in hand is answered by the connection's task itself
(``ExpertService.answer_now``), without a task of its own.  ``ExpertClient`` is one authenticated,
multiplexed connection: many calls in flight, answered by ``request_id``.

Endpoints are written ``tcp+tls://HOST:PORT`` (or ``tcp://HOST:PORT`` without TLS, tests only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..errors import ConfigError, NetworkError, ProtocolError
from ..protocol import (
    BATCHED_RECEIPTS_VERSION,
    DEFAULT_MAX_FRAME,
    FATAL_CODES,
    MAX_HANDSHAKE_FRAME,
    Auth,
    ConfigRequest,
    ConfigResponse,
    Error,
    ErrorCode,
    ExpertRequest,
    ExpertResponse,
    Hello,
    Identity,
    Ping,
    Pong,
    ReceiptBatch,
    ServerHandshake,
    SUPPORTED_VERSIONS,
    WeightsRequest,
    WeightsResponse,
    decode,
    parse_frame_header,
    peek_request_id,
    write_message,
)
from ..protocol._framing import _read_exactly
from ..protocol._limits import FRAME_HEADER_SIZE, MIN_MAX_FRAME
from .addresses import address_key
from .tls import channel_binding, self_signed_server_context

if TYPE_CHECKING:
    from .expert_service import ExpertService

log = logging.getLogger(__name__)

Handler = Callable[[bytes, ExpertRequest], Awaitable[ExpertResponse]]
BatchedHandler = Callable[[bytes, ExpertRequest, object], Awaitable[ExpertResponse]]
"""v1.3: (client, request, channel): the answer without a receipt, which follows in a
``receipt_batch`` on ``channel`` (the connection, handed back to ``DataPlaneServer.send_batch``)."""
WeightsHandler = Callable[[bytes, WeightsRequest], Awaitable[WeightsResponse]]
FastHandler = Callable[[bytes, ExpertRequest, object], "ExpertResponse | None"]
"""(client, request, channel): the answer at once, computed on the connection's own task, or
``None`` when it must wait its turn (``ExpertService.answer_now``: an idle server, a small call);
``channel`` is ``None`` where the answer must carry its receipt (v1.2), else as ``BatchedHandler``'s."""
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
    max_frame: int = DEFAULT_MAX_FRAME  # largest frame body accepted after the handshake, bytes
    max_in_flight: int = 64  # concurrent requests per connection before OVERLOADED
    max_connections: int = 1024  # connections held at once, all peers together
    max_conns_per_ip: int = 32  # connections held at once from one IPv4 address or one IPv6 /64
    max_conns_per_peer: int = 4  # authenticated connections held at once by one peer ID
    frame_timeout_s: float = 10.0  # once a frame's header arrived, its body must follow within this ...
    min_frame_bps: float = 1e6  # ... plus its length at this many bytes per second
    idle_timeout_s: float = 300.0  # a connection with no frame from the peer and nothing in flight is closed
    versions: tuple[int, ...] = SUPPORTED_VERSIONS  # protocol versions spoken ((1,): a v1.2 server)

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_connections", "max_conns_per_ip", "max_conns_per_peer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.max_frame < MIN_MAX_FRAME:
            raise ConfigError(f"max_frame must be at least {MIN_MAX_FRAME} bytes (protocol_spec section 5)")
        if self.frame_timeout_s <= 0 or self.min_frame_bps <= 0 or self.idle_timeout_s <= 0:
            raise ConfigError("frame timeout, frame rate and idle timeout must be positive")

    def body_deadline(self, length: int) -> float:
        """Seconds the body of a frame of ``length`` bytes may take once its header arrived."""
        return self.frame_timeout_s + length / self.min_frame_bps


class DataPlaneServer:
    def __init__(self, identity: Identity, handler: Handler, config: ServerConfig = ServerConfig(),
                 weights_handler: WeightsHandler | None = None, configs: Mapping[str, bytes] | None = None,
                 *, batched_handler: BatchedHandler | None = None, receipts: "ExpertService | None" = None,
                 fast_handler: FastHandler | None = None) -> None:
        self.identity = identity
        self.configs = dict(configs or {})  # model id -> the config bytes its id hashes (config_request)
        self.handler = handler
        self.batched_handler = batched_handler  # v1.3 connections: answers without receipts (None: handler)
        self.fast_handler = fast_handler  # answers computed at once when nothing waits (None: always a handler task)
        self.answering = 0  # expert requests handed to a handler task and not yet answered, all connections
        self.receipts = receipts  # v1.3: whose receipt batches go to clients (its batch_sink is set here)
        if receipts is not None:
            receipts.batch_sink = self.send_batch
        self.weights_handler = weights_handler  # None: weight fetches get UNKNOWN_EXPERT
        self.config = config
        self._ssl: ssl.SSLContext | None = None
        self._cert: bytes | None = None
        if config.tls:
            self._ssl, self._cert = self_signed_server_context(identity.peer_id_str)
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._per_address: dict[str, dict[asyncio.Task[None], None]] = {}  # address_key -> its connections, oldest first
        self._per_peer: dict[bytes, int] = {}  # authenticated connections by client peer ID
        self.refused = {"connections": 0, "address": 0, "peer": 0}  # connections turned away, by limit
        self.evicted = 0  # connections closed to make room for a newcomer's address (fair share)
        self.port = 0

    @property
    def endpoint(self) -> str:
        scheme = "tcp+tls" if self.config.tls else "tcp"
        return f"{scheme}://{self.config.host}:{self.port}"

    async def start(self) -> None:
        # TLS starts inside _on_connection, after the address is counted: a peer that never sends
        # a ClientHello holds a slot (and is timed out), not an uncounted descriptor
        self._server = await asyncio.start_server(
            self._on_connection, self.config.host, self.config.port, limit=2**20, backlog=1024
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
        peername = writer.get_extra_info("peername")
        address = address_key(peername) if peername is not None else ""  # "": a relayed stream (the relay counts)
        if address and len(self._per_address.get(address, ())) >= self.config.max_conns_per_ip:
            self.refused["address"] += 1
            writer.transport.abort()
            return
        if len(self._connections) >= self.config.max_connections and not self._make_room(address):
            self.refused["connections"] += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self._per_address.setdefault(address, {})[task] = None
        try:
            await _ServerConnection(self, reader, writer).run()
        except asyncio.CancelledError:
            pass
        finally:
            self._forget(task, address)
            await close_writer(writer)

    def _forget(self, task: asyncio.Task[None], address: str) -> None:
        self._connections.discard(task)
        held = self._per_address.get(address)
        if held is not None:
            held.pop(task, None)
            if not held:
                del self._per_address[address]

    def _make_room(self, address: str) -> bool:
        """Fair share of a full server among addresses (the relay's rule for a full device): if some
        address holds at least two more connections than ``address`` does, close that address's
        oldest and say yes. So no set of addresses can lock a newcomer out: at worst every address
        ends up with an equal share of ``max_connections``."""
        counted = [a for a in self._per_address if a]  # "": relayed streams, counted by their relay
        if not counted:
            return False
        mine = len(self._per_address.get(address, ()))
        heaviest = max(counted, key=lambda a: len(self._per_address[a]))
        if len(self._per_address[heaviest]) <= mine + 1:
            return False
        victim = next(iter(self._per_address[heaviest]))
        self._forget(victim, heaviest)
        victim.cancel()
        self.evicted += 1
        return True

    def _admit_peer(self, peer: bytes) -> bool:
        if self._per_peer.get(peer, 0) >= self.config.max_conns_per_peer:
            self.refused["peer"] += 1
            return False
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        return True

    def _release_peer(self, peer: bytes) -> None:
        left = self._per_peer.pop(peer) - 1
        if left:
            self._per_peer[peer] = left

    async def send_batch(self, channel: object, batch: ReceiptBatch) -> bool:
        """Send a receipt batch on the connection ``channel``; False if it is gone."""
        if not isinstance(channel, _ServerConnection) or channel.closed:
            return False
        try:
            await channel.send(batch)
            return True
        except (NetworkError, ConfigError, ConnectionError, OSError):
            return False


class _ServerConnection:
    def __init__(self, server: DataPlaneServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader, self.writer = reader, writer
        self.write_lock = asyncio.Lock()
        self.in_flight: set[asyncio.Task[None]] = set()
        self.version = 0  # negotiated in the handshake
        self.closed = False

    async def send(self, msg: object) -> None:
        async with self.write_lock:
            await write_message(self.writer, msg, max_size=self.server.config.max_frame)  # type: ignore[arg-type]

    async def run(self) -> None:
        secured = self.server._ssl is None
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                if not secured:
                    await self.writer.start_tls(self.server._ssl)
                    secured = True
                client = await self._handshake()
        except (ProtocolError, TimeoutError, NetworkError, ConnectionError, OSError, ssl.SSLError) as e:
            if secured and isinstance(e, (ProtocolError, TimeoutError)):  # nothing in clear text
                code = e.code if isinstance(e, ProtocolError) else ErrorCode.AUTH_FAILED
                with contextlib.suppress(NetworkError, ConfigError, ConnectionError, OSError):
                    await self.send(Error(int(code), f"handshake failed: {e or 'timeout'}"))
            return
        if client is None:
            return
        if not self.server._admit_peer(client):
            with contextlib.suppress(NetworkError, ConfigError):
                await self.send(Error(ErrorCode.OVERLOADED, f"at most {self.server.config.max_conns_per_peer} "
                                      "connections per peer"))
            return
        try:
            await self._serve(client)
        finally:
            self.closed = True
            if self.server.receipts is not None:
                self.server.receipts.forget(self)
            self.server._release_peer(client)
            for task in self.in_flight:
                task.cancel()
            if self.in_flight:
                await asyncio.wait(self.in_flight, timeout=5)

    async def _read(self, max_size: int, idle_timeout: float | None) -> bytes | None:
        """One frame body (``None`` on a clean end between frames). The header may take
        ``idle_timeout`` (``None``: no limit) while nothing is in flight; once it arrived the body
        must follow within the config's deadline for its length (``TimeoutError`` otherwise)."""
        config = self.server.config
        while True:
            try:
                async with asyncio.timeout(idle_timeout):
                    header = await _read_exactly(self.reader, FRAME_HEADER_SIZE, at_boundary=True)
                break
            except TimeoutError:
                if not self.in_flight:
                    raise
        if header is None:
            return None
        length = parse_frame_header(header, max_size=max_size)
        async with asyncio.timeout(config.body_deadline(length)):
            return await _read_exactly(self.reader, length, at_boundary=False)

    async def _handshake(self) -> bytes | None:
        binding = channel_binding(self.server._cert)
        hs = ServerHandshake(self.server.identity, channel_binding=binding, versions=self.server.config.versions)
        # nothing a peer sends before it authenticated may be larger than a hello needs
        body = await self._read(MAX_HANDSHAKE_FRAME, None)
        if body is None:
            return None
        hello = decode(body)
        if not isinstance(hello, Hello):
            raise ProtocolError("expected Hello", code=ErrorCode.UNEXPECTED_MESSAGE)
        await self.send(hs.receive_hello(hello))
        body = await self._read(MAX_HANDSHAKE_FRAME, None)
        if body is None:
            return None
        auth = decode(body)
        if not isinstance(auth, Auth):
            raise ProtocolError("expected Auth", code=ErrorCode.UNEXPECTED_MESSAGE)
        client = hs.receive_auth(auth)
        self.version = hs.version or 0
        return client

    async def _serve(self, client: bytes) -> None:
        config = self.server.config
        while True:
            body = None
            try:
                body = await self._read(config.max_frame, config.idle_timeout_s)
                if body is None:
                    return
                msg = decode(body)
            except ProtocolError as e:  # tell the peer which request it was, when we can
                with contextlib.suppress(NetworkError):
                    await self.send(Error(e.code, str(e)[:1000], peek_request_id(body) if body else None))
                if e.code in FATAL_CODES:
                    return
                continue
            except TimeoutError:  # idle, or a frame body that did not come in time
                log.info("closing a connection: idle or frame body too slow")
                return
            except NetworkError:
                return
            if isinstance(msg, (ExpertRequest, WeightsRequest)):
                if len(self.in_flight) >= self.server.config.max_in_flight:
                    await self.send(Error(ErrorCode.OVERLOADED, "too many requests in flight", msg.request_id))
                    continue
                batched = self.version >= BATCHED_RECEIPTS_VERSION
                expert = isinstance(msg, ExpertRequest)
                if expert and self.server.fast_handler is not None and not self.server.answering:
                    try:  # an idle server answers here: no task, no queue (under load the queue batches as ever)
                        reply = self.server.fast_handler(client, msg, self if batched and self.server.batched_handler
                                                         is not None else None)
                    except Exception as e:  # noqa: BLE001 - the peer is told, the connection keeps going
                        reply = _error_reply(e, msg.request_id)
                    if reply is not None:
                        await self._reply(reply, msg.request_id)
                        continue
                task = asyncio.create_task(self._answer(client, msg, batched))
                self.in_flight.add(task)
                task.add_done_callback(self.in_flight.discard)
                if expert:
                    self.server.answering += 1
                    task.add_done_callback(self._answered)
            elif isinstance(msg, Ping):
                if self.version >= BATCHED_RECEIPTS_VERSION and self.server.receipts is not None:
                    await asyncio.sleep(0)  # answers already computed are sent before their receipts
                    for batch in self.server.receipts.flush(self):  # v1.3: receipts first, then the pong
                        await self.send(batch)
                await self.send(Pong(msg.ts, bytes(msg.want)))
            elif isinstance(msg, ConfigRequest):
                held = self.server.configs.get(msg.model_id)
                await self.send(Error(ErrorCode.UNKNOWN_EXPERT, f"model {msg.model_id!r} is not served here",
                                      msg.request_id) if held is None else ConfigResponse(msg.request_id, held))
            elif isinstance(msg, Error):
                log.info("peer reported error %s: %s", msg.code, msg.message)
            else:
                await self.send(Error(ErrorCode.UNEXPECTED_MESSAGE, f"unexpected {type(msg).__name__}"))
                return

    def _answered(self, task: asyncio.Task[None]) -> None:
        self.server.answering -= 1

    async def _answer(self, client: bytes, request: ExpertRequest | WeightsRequest, batched: bool) -> None:
        try:
            if isinstance(request, WeightsRequest):
                if self.server.weights_handler is None:
                    raise ProtocolError("this server does not hand out weights", code=ErrorCode.UNKNOWN_EXPERT)
                reply: object = await self.server.weights_handler(client, request)
            elif batched and self.server.batched_handler is not None:
                reply = await self.server.batched_handler(client, request, self)
            else:
                reply = await self.server.handler(client, request)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the peer is told, the server keeps serving
            reply = _error_reply(e, request.request_id)
        await self._reply(reply, request.request_id)

    async def _reply(self, reply: object, request_id: bytes) -> None:
        try:
            await self.send(reply)
        except ConfigError as e:  # the answer does not fit a frame: say so instead of going silent
            with contextlib.suppress(NetworkError, ConfigError):
                await self.send(Error(ErrorCode.BAD_FIELD, f"the answer does not fit a frame: {e}"[:1000], request_id))
        except NetworkError:
            pass


def _error_reply(e: Exception, request_id: bytes) -> Error:
    """The ``Error`` answering a request whose handler raised ``e``."""
    if isinstance(e, ProtocolError):
        return Error(e.code, str(e), request_id)
    log.error("expert request failed", exc_info=e)  # the handler failed: the peer is told, the server keeps serving
    return Error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"[:1000], request_id)


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
