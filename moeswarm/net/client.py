"""The client side of the expert data plane: ``ExpertClient`` is one authenticated, multiplexed
connection to an expert server (many calls in flight, answered by ``request_id``); ``Connections``
keeps one per peer.  Endpoints: ``tcp+tls://``, ``tcp://`` (tests only) and ``relay+wss://`` (a
device behind the 443 relay, dialled through it)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._tasks import cancel_and_wait
from ..errors import (
    BadResponse,
    ConfigError,
    NetworkError,
    ProtocolError,
    Timeout,
    Unreachable,
)
from ..protocol import (
    DEFAULT_MAX_FRAME,
    FATAL_CODES,
    ClientHandshake,
    ConfigRequest,
    ConfigResponse,
    Error,
    ErrorCode,
    ExpertRequest,
    ExpertResponse,
    MAX_HANDSHAKE_FRAME,
    HelloAck,
    Identity,
    Ping,
    Pong,
    ReceiptBatch,
    SUPPORTED_VERSIONS,
    WeightsRequest,
    WeightsResponse,
    decode,
    frame,
    peek_request_id,
    read_frame,
    read_message,
    write_message,
)
from .dataplane import close_writer, parse_endpoint
from .tls import channel_binding, client_context

if TYPE_CHECKING:
    from .routing_table import Holder

log = logging.getLogger(__name__)

BatchHandler = Callable[[bytes, ReceiptBatch], None]
"""Told every ``receipt_batch`` a server sends (v1.3): (the server's peer ID, the batch)."""


class ExpertClient:
    """One authenticated connection to an expert server; calls are multiplexed by request id.

    ``version`` is the protocol version the handshake chose: from 2 (v1.3) on, answers may come
    without a receipt, and the server's ``receipt_batch``es go to ``on_batch``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server_peer: bytes,
                 max_frame: int, version: int = 1, on_batch: BatchHandler | None = None) -> None:
        self.reader, self.writer = reader, writer
        self.server_peer = server_peer
        self.version = version
        self.on_batch = on_batch
        self.max_frame = max_frame
        self._pending: dict[bytes, asyncio.Future[ExpertResponse | WeightsResponse | ConfigResponse]] = {}
        self._pings: dict[int, asyncio.Future[float]] = {}
        self._write_lock = asyncio.Lock()
        self._closed: BaseException | None = None
        self._reader_task = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect(cls, endpoint: str, identity: Identity, *, expected_peer: bytes | None = None,
                      timeout: float = 10.0, max_frame: int = DEFAULT_MAX_FRAME,
                      versions: Sequence[int] = SUPPORTED_VERSIONS, on_batch: BatchHandler | None = None,
                      ) -> "ExpertClient":
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
                server_peer, version = await cls._handshake(reader, writer, identity, expected_peer, max_frame,
                                                            versions)
        except BaseException as e:
            writer.transport.abort()  # no TLS goodbye for a connection that never worked
            if isinstance(e, TimeoutError):
                raise Timeout(f"handshake with {endpoint} timed out") from None
            raise
        return cls(reader, writer, server_peer, max_frame, version, on_batch)

    @staticmethod
    async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, identity: Identity,
                         expected: bytes | None, max_frame: int, versions: Sequence[int]) -> tuple[bytes, int]:
        ssl_obj = writer.get_extra_info("ssl_object")
        cert = ssl_obj.getpeercert(binary_form=True) if ssl_obj is not None else None
        hs = ClientHandshake(identity, expected_server=expected, channel_binding=channel_binding(cert),
                             versions=versions)
        await write_message(writer, hs.hello, max_size=max_frame)
        ack = await read_message(reader, max_size=min(max_frame, MAX_HANDSHAKE_FRAME))  # the server is a stranger yet
        if isinstance(ack, Error):
            raise ProtocolError(f"server refused the handshake: {ack.message}", code=ack.code)
        if not isinstance(ack, HelloAck):
            raise ProtocolError("expected HelloAck", code=ErrorCode.UNEXPECTED_MESSAGE)
        await write_message(writer, hs.receive_ack(ack), max_size=max_frame)
        assert hs.server_peer is not None and hs.version is not None
        return hs.server_peer, hs.version

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def call(self, request: ExpertRequest, timeout: float) -> ExpertResponse:
        """The answer to ``request``. Its receipt is in it unless this is a v1.3 connection whose
        ``on_batch`` takes receipt batches and the request did not ask for it (``signed``)."""
        if self.on_batch is None and self.version >= 2 and not request.signed:
            request = dataclasses.replace(request, signed=True)  # nobody here would take a batch
        response = await self._request(request, timeout, "expert call")
        if not isinstance(response, ExpertResponse):
            raise ProtocolError("a weights_response answered an expert_request", code=ErrorCode.UNEXPECTED_MESSAGE)
        return response

    def send_now(self, request: ExpertRequest) -> asyncio.Future[ExpertResponse | WeightsResponse | ConfigResponse] | None:
        """Write ``request`` at once, from synchronous code on the loop (a forward pass run by
        ``onloop.run_on_loop``), and return the future its answer will complete: hand both to
        ``answer``. ``None`` (nothing sent) if another write is under way (then ``call``).
        ``Unreachable`` if the connection is closed, ``ConfigError`` if it does not fit a frame."""
        if self._closed is not None:
            raise Unreachable(f"connection is closed: {self._closed}")
        if self._write_lock.locked():
            return None
        if self.on_batch is None and self.version >= 2 and not request.signed:
            request = dataclasses.replace(request, signed=True)  # nobody here would take a batch
        data = frame(request, max_size=self.max_frame)
        future: asyncio.Future[ExpertResponse | WeightsResponse | ConfigResponse] = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = future
        try:
            self.writer.write(data)  # whole frames only: a concurrent call's frame goes before or after it
        except (ConnectionError, OSError, RuntimeError) as e:
            del self._pending[request.request_id]
            raise NetworkError(f"connection failed while writing a frame: {e}") from e
        return future

    async def answer(self, request: ExpertRequest, future: asyncio.Future[ExpertResponse | WeightsResponse | ConfigResponse],
                     timeout: float) -> ExpertResponse:
        """The answer to a request sent by ``send_now``."""
        try:
            async with self._write_lock:  # flow control: wait as ``call`` would for the buffer to drain
                await self.writer.drain()
            async with asyncio.timeout(timeout):
                response = await future
        except TimeoutError:
            raise Timeout(f"expert call timed out after {timeout:.1f}s") from None
        except (ConnectionError, OSError) as e:
            raise NetworkError(f"connection failed while writing a frame: {e}") from e
        finally:
            self._pending.pop(request.request_id, None)
        if not isinstance(response, ExpertResponse):
            raise ProtocolError("a weights_response answered an expert_request", code=ErrorCode.UNEXPECTED_MESSAGE)
        return response

    async def fetch(self, request: WeightsRequest, timeout: float) -> WeightsResponse:
        """Rows of one tensor of one expert (``moeswarm.node.fetch`` assembles whole experts)."""
        response = await self._request(request, timeout, "weight fetch")
        if not isinstance(response, WeightsResponse):
            raise ProtocolError("an expert_response answered a weights_request", code=ErrorCode.UNEXPECTED_MESSAGE)
        return response

    async def config(self, model_id: str, timeout: float) -> bytes:
        """The config bytes the server's ``model_id`` hashes (the caller checks them against a digest)."""
        response = await self._request(ConfigRequest(os.urandom(16), model_id), timeout, "config fetch")
        if not isinstance(response, ConfigResponse):
            raise ProtocolError("another response answered a config_request", code=ErrorCode.UNEXPECTED_MESSAGE)
        return response.config

    async def _request(self, request: ExpertRequest | WeightsRequest | ConfigRequest, timeout: float,
                       what: str) -> ExpertResponse | WeightsResponse | ConfigResponse:
        if self._closed is not None:
            raise Unreachable(f"connection is closed: {self._closed}")
        future: asyncio.Future[ExpertResponse | WeightsResponse | ConfigResponse] = asyncio.get_running_loop().create_future()
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
                if isinstance(msg, (ExpertResponse, WeightsResponse, ConfigResponse)):
                    fut = self._pending.pop(msg.request_id, None)  # answered: nothing left behind
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, Error):
                    fut = self._pending.get(msg.request_id or b"")
                    err = ProtocolError(f"server error {msg.code}: {msg.message}", code=msg.code)
                    if fut is not None and not fut.done():
                        fut.set_exception(err)
                    elif msg.code in FATAL_CODES:
                        raise err
                elif isinstance(msg, ReceiptBatch) and self.version >= 2:
                    if msg.statement.server != self.server_peer:
                        raise ProtocolError("a receipt batch names another server", code=ErrorCode.AUTH_FAILED)
                    if self.on_batch is not None:
                        self.on_batch(self.server_peer, msg)
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


class Connections:
    """One ``ExpertClient`` per peer, opened on first use (one dial however many ask at once),
    replaced when it breaks; once closed, it opens none (a dial that finishes after ``aclose`` is
    dropped at once: nobody would close it, and its socket would outlive the event loop)."""

    def __init__(self, identity: Identity, *, versions: Sequence[int] = SUPPORTED_VERSIONS,
                 on_batch: BatchHandler | None = None) -> None:
        self.identity = identity
        self.versions = tuple(versions)  # offered in every handshake ((1,): a v1.2 client)
        self.on_batch = on_batch  # v1.3: told every receipt batch of every connection
        self._clients: dict[bytes, ExpertClient] = {}
        self._locks: dict[bytes, asyncio.Lock] = {}
        self._closed = False

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
                if self._closed:
                    raise Unreachable("these connections are closed")
                try:
                    client = await ExpertClient.connect(endpoint, self.identity, expected_peer=holder.peer_id,
                                                        timeout=timeout, versions=self.versions,
                                                        on_batch=self.on_batch)
                except (NetworkError, ProtocolError, ConfigError) as e:
                    error = e
                    continue
                if self._closed:  # closed while we dialled
                    client.abort()
                    raise Unreachable("these connections were closed during the dial")
                self._clients[holder.peer_id] = client
                return client
            raise error or NetworkError("holder announced no endpoint")

    def open_client(self, peer: bytes) -> ExpertClient | None:
        """The open connection to ``peer``, if there is one (no dial)."""
        client = self._clients.get(peer)
        return client if client is not None and not client.closed else None

    def open_clients(self) -> list[ExpertClient]:
        return [c for c in self._clients.values() if not c.closed]

    def is_open(self, peer: bytes) -> bool:
        """Whether a connection to ``peer`` was opened earlier (it may have died since)."""
        return peer in self._clients

    async def drop(self, peer: bytes) -> None:
        client = self._clients.pop(peer, None)
        if client is not None:
            await client.aclose()

    async def aclose(self) -> None:
        self._closed = True
        for peer in list(self._clients):
            await self.drop(peer)


async def fetch_config(identity: Identity, peer_id: bytes, endpoints: Sequence[str], model_id: str,
                       timeout: float = 10.0) -> bytes:
    """The config bytes ``peer_id`` hands out for ``model_id`` (``config_request``), over the first of
    its ``endpoints`` that answers; the caller checks them against the digest it trusts."""
    error: Exception = NetworkError("no endpoint given")
    for endpoint in endpoints:
        try:
            client = await ExpertClient.connect(endpoint, identity, expected_peer=peer_id, timeout=timeout)
        except (NetworkError, ProtocolError, ConfigError) as e:
            error = e
            continue
        try:
            return await client.config(model_id, timeout)
        finally:
            await client.aclose()
    raise error
