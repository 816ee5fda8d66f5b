"""The relay: an aiohttp server that devices dial out to and clients reach them through.

    GET /device          WebSocket: a device's session (handshake, then envelopes)
    GET /<peer id>       WebSocket: a client's data-plane connection to that device
    GET /healthz         JSON status; 503 while draining
    GET /metrics         Prometheus text format
    GET /volunteer/      the volunteer page: a browser tab as a device (``moeswarm.web``)

See ``protocol_spec/relay.md`` for the wire format and ``_sessions`` for the forwarding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from ..errors import ConfigError, ProtocolError
from ..net.addresses import address_key
from ..web import VolunteerSite, add_volunteer_routes
from ..protocol import (
    Auth,
    Error,
    ErrorCode,
    Hello,
    Identity,
    ServerHandshake,
    peer_id_from_str,
    peer_id_to_str,
)
from ._dial import relay_endpoint
from ._directory import Directory, check_publish
from ._envelope import (
    CLIENT_SUBPROTOCOL,
    DEVICE_PATH,
    DEVICE_SUBPROTOCOL,
    GoAway,
    Kind,
    Publish,
    Welcome,
    WSClose,
    decode_control,
    encode_control,
    pack,
    unpack,
)
from ._limits import PeerBudget, RelayLimits, client_budget, device_budget
from ._metrics import CONTENT_TYPE, RelayMetrics
from ._sessions import ClientStream, CloseCode, DeviceSession
from ._tls import ServerTLS, binding_of, first_certificate_der

log = logging.getLogger(__name__)


class _PreAuthCap(asyncio.Protocol):
    """Sits between a device's transport and aiohttp until the device authenticated, and closes
    the connection as soon as more than ``limit`` bytes arrived: aiohttp would otherwise gather
    one WebSocket message of up to the frame limit (64 MiB) before anyone looked at it."""

    def __init__(self, transport: asyncio.Transport, inner: asyncio.Protocol, limit: int) -> None:
        self.transport, self.inner, self.limit, self.seen = transport, inner, limit, 0

    @classmethod
    def install(cls, request: web.Request, limit: int) -> "_PreAuthCap | None":
        transport = request.transport
        if transport is None or transport.is_closing():
            return None
        cap = cls(transport, transport.get_protocol(), limit)  # type: ignore[arg-type]
        transport.set_protocol(cap)
        return cap

    def remove(self) -> None:
        if self.transport.get_protocol() is self:
            self.transport.set_protocol(self.inner)

    def data_received(self, data: bytes) -> None:
        self.seen += len(data)
        if self.seen > self.limit:
            log.warning("device sent %d bytes before authenticating: closed", self.seen)
            self.transport.abort()
            return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


@dataclass(frozen=True)
class RelayConfig:
    host: str = "0.0.0.0"  # address to listen on
    port: int = 443  # 0 picks a free port (tests)
    cert_file: str | None = None  # PEM chain; without it the relay speaks plain ws:// (behind a TLS proxy)
    key_file: str | None = None  # PEM private key of cert_file
    public_url: str | None = None  # wss://NAME:PORT as devices and clients reach it; default from host:port
    binding_cert: str | None = None  # certificate devices see, if a proxy terminates TLS (default: cert_file)
    limits: RelayLimits = field(default_factory=RelayLimits)
    volunteer_shards: str | None = None  # an export-onnx folder the volunteer page downloads (/volunteer/shards/)
    volunteer_shards_url: str | None = None  # or the URL of one on another HTTP server


class RelayServer:
    def __init__(self, identity: Identity, config: RelayConfig, directory: Directory | None = None) -> None:
        if (config.cert_file is None) != (config.key_file is None):
            raise ConfigError("--cert and --key go together")
        if config.public_url is None and config.host in ("0.0.0.0", "::", ""):
            raise ConfigError("listening on a wildcard address: say how devices reach the relay with --public-url")
        self.identity, self.config, self.directory = identity, config, directory
        self.limits = config.limits
        self.metrics = RelayMetrics()
        self.tls = ServerTLS(config.cert_file, config.key_file) if config.cert_file and config.key_file else None
        self.devices: dict[bytes, DeviceSession] = {}
        self.draining = False
        self.port = 0
        self._budgets: dict[tuple[str, str], tuple[PeerBudget, float]] = {}  # (role, key) -> (budget, last use)
        self._left: dict[bytes, float] = {}  # device -> when its session ended
        self._streams = 0
        self._device_conns: dict[str, int] = {}  # device WebSockets (before and after auth) by address
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None
        self._started = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        if self.config.public_url:
            return self.config.public_url.rstrip("/")
        return f"{'wss' if self.tls else 'ws'}://{self.config.host}:{self.port}"

    @property
    def binding(self) -> bytes:
        if self.config.binding_cert:
            return binding_of(first_certificate_der(self.config.binding_cert))
        return binding_of(self.tls.cert_der if self.tls else None)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get(DEVICE_PATH, self._device)
        add_volunteer_routes(app, VolunteerSite(lambda: self.url, lambda: self.binding, self.config.volunteer_shards,
                                                self.config.volunteer_shards_url))
        app.router.add_get("/{peer}", self._client)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.limits.drain_timeout_s + 2,
                                     handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port,
                           ssl_context=self.tls.context if self.tls else None, backlog=1024)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self._started = time.monotonic()
        self.spawn(self._housekeeping())

    async def aclose(self, graceful: bool = True) -> None:
        """Tell devices to reconnect, let answers in flight arrive, then close everything."""
        self.draining = True
        if graceful:
            for session in list(self.devices.values()):
                session.send_control(GoAway("relay shutting down", random.randint(500, 3000)))
            deadline = time.monotonic() + self.limits.drain_timeout_s
            while any(s.in_flight for d in self.devices.values() for s in d.streams.values()):
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.02)
        for session in list(self.devices.values()):
            for stream in list(session.streams.values()):
                stream.close(CloseCode.SHUTDOWN)
            session.close_code = WSClose.GOING_AWAY
            self.spawn(session.ws.close(code=WSClose.GOING_AWAY))
        if self._runner is not None:
            await self._runner.cleanup()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task this server owns (cancelled and awaited by ``aclose``)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def reload_tls(self) -> None:
        """Pick up renewed certificate files (SIGHUP); existing sessions keep theirs."""
        if self.tls is not None:
            self.tls.reload()
            log.info("reloaded %s", self.tls.cert_file)

    async def _housekeeping(self) -> None:
        period = max(0.05, min(5.0, self.limits.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for session in list(self.devices.values()):
                for stream in list(session.streams.values()):
                    if now - stream.last_active > self.limits.idle_timeout_s:
                        self.metrics.error("idle")
                        stream.close(CloseCode.IDLE)
            for peer, left in list(self._left.items()):
                if now - left > self.limits.reconnect_grace_s:
                    del self._left[peer]
                    if peer not in self.devices and self.directory is not None:
                        with contextlib.suppress(Exception):
                            await self.directory.forget(peer)
            keep = max(60.0, self.limits.quota_window_s if self.limits.device_quota_bytes
                       or self.limits.client_quota_bytes else 0.0)
            live = {s.peer_str for s in self.devices.values()}
            for key, (budget, used) in list(self._budgets.items()):
                if budget.streams == 0 and now - used > keep and key[1] not in live:
                    del self._budgets[key]

    def _budget(self, role: str, key: str) -> PeerBudget:
        entry = self._budgets.get((role, key))
        budget = entry[0] if entry else (device_budget if role == "device" else client_budget)(self.limits)
        self._budgets[(role, key)] = (budget, time.monotonic())
        return budget

    # ------------------------------------------------------------------ HTTP endpoints

    async def _healthz(self, request: web.Request) -> web.Response:
        body = {"status": "draining" if self.draining else "ok", "devices": len(self.devices),
                "streams": self._streams, "peer_id": self.identity.peer_id_str, "url": self.url}
        return web.json_response(body, status=503 if self.draining else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics.devices.set(len(self.devices))
        self.metrics.streams.set(self._streams)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _device(self, request: web.Request) -> web.StreamResponse:
        if self.draining:
            return web.Response(status=503, text="relay is draining", headers={"Retry-After": "2"})
        address = address_key(request.remote or "unknown")
        if self._device_conns.get(address, 0) >= self.limits.max_devices_per_ip:
            self.metrics.error("session_limit")
            return web.Response(status=429, text="too many devices from your address", headers={"Retry-After": "30"})
        self._device_conns[address] = self._device_conns.get(address, 0) + 1
        try:
            return await self._device_session(request)
        finally:
            left = self._device_conns.pop(address) - 1
            if left:
                self._device_conns[address] = left

    async def _device_session(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(protocols=(DEVICE_SUBPROTOCOL,), heartbeat=self.limits.heartbeat_s,
                                   max_msg_size=self.limits.max_frame + 9, compress=False)
        await ws.prepare(request)
        cap = _PreAuthCap.install(request, self.limits.preauth_bytes)  # nothing past 16 KiB reaches the parser
        try:
            async with asyncio.timeout(self.limits.handshake_timeout_s):
                peer = await self._authenticate(ws)
            if cap is not None:
                cap.remove()
        except (ProtocolError, TimeoutError) as e:
            code = e.code if isinstance(e, ProtocolError) else ErrorCode.AUTH_FAILED
            self.metrics.error("auth_failed" if code == ErrorCode.AUTH_FAILED else "malformed")
            with contextlib.suppress(Exception):
                await ws.send_bytes(pack(Kind.CONTROL, 0, encode_control(Error(int(code), f"refused: {e or 'timeout'}"))))
            await ws.close(code=WSClose.POLICY)
            return ws
        if peer not in self.devices and len(self.devices) >= self.limits.max_devices:
            self.metrics.error("session_limit")
            await ws.send_bytes(pack(Kind.CONTROL, 0, encode_control(Error(ErrorCode.OVERLOADED, "relay is full"))))
            await ws.close(code=WSClose.TRY_AGAIN_LATER)
            return ws
        await self._run_device(ws, peer)
        return ws

    async def _authenticate(self, ws: web.WebSocketResponse) -> bytes:
        hs = ServerHandshake(self.identity, channel_binding=self.binding)
        hello = await self._control(ws)
        if not isinstance(hello, Hello):
            raise ProtocolError("expected hello", code=ErrorCode.UNEXPECTED_MESSAGE)
        await ws.send_bytes(pack(Kind.CONTROL, 0, encode_control(hs.receive_hello(hello))))
        auth = await self._control(ws)
        if not isinstance(auth, Auth):
            raise ProtocolError("expected auth", code=ErrorCode.UNEXPECTED_MESSAGE)
        return hs.receive_auth(auth)

    async def _control(self, ws: web.WebSocketResponse) -> object:
        msg = await ws.receive()
        if msg.type is not WSMsgType.BINARY:
            raise ProtocolError(f"expected a binary message, got {msg.type.name}", code=ErrorCode.MALFORMED_FRAME)
        kind, _, payload = unpack(msg.data)
        if kind is not Kind.CONTROL or len(payload) > 16 * 1024:
            raise ProtocolError("expected a control envelope", code=ErrorCode.UNEXPECTED_MESSAGE)
        return decode_control(payload)

    async def _run_device(self, ws: web.WebSocketResponse, peer: bytes) -> None:
        session = DeviceSession(self, ws, peer, relay_endpoint(self.url, peer), self._budget("device", peer_id_to_str(peer)))
        old = self.devices.get(peer)
        if old is not None:  # a reconnect while the old connection lingers: the newer one wins
            old.close_code = WSClose.REPLACED
            self.spawn(old.ws.close(code=WSClose.REPLACED))
        self.devices[peer] = session
        self._left.pop(peer, None)
        self.metrics.sessions.labels("device").inc()
        session.outbox.start()
        session.send_control(Welcome(session.endpoint, self.identity.peer_id, self.limits.max_frame,
                                     self.limits.max_streams_per_device, int(self.limits.heartbeat_s)))
        log.info("device %s connected", session.peer_str)
        try:
            await session.serve()
        finally:
            if self.devices.get(peer) is session:
                del self.devices[peer]
                self._left[peer] = time.monotonic()
            for stream in list(session.streams.values()):
                stream.close(CloseCode.DEVICE_GONE)
            await session.outbox.aclose(flush_s=0.2)
            with contextlib.suppress(Exception):
                await ws.close(code=session.close_code)
            log.info("device %s disconnected", session.peer_str)

    async def _client(self, request: web.Request) -> web.StreamResponse:
        try:
            peer = peer_id_from_str(request.match_info["peer"])
        except ProtocolError:
            raise web.HTTPNotFound(text="not a peer ID") from None
        if self.draining:
            raise web.HTTPServiceUnavailable(text="relay is draining", headers={"Retry-After": "2"})
        device = self.devices.get(peer)
        if device is None:
            self.metrics.error("no_device")
            now = time.monotonic()
            if now - self._started < self.limits.startup_grace_s or now - self._left.get(peer, -1e9) < \
                    self.limits.reconnect_grace_s:
                raise web.HTTPServiceUnavailable(text="device is reconnecting", headers={"Retry-After": "1"})
            raise web.HTTPNotFound(text="no such device here")
        remote = request.remote or "unknown"
        address = address_key(remote)
        budget = self._budget("client", address)
        if budget.streams >= self.limits.max_streams_per_client:
            self.metrics.error("session_limit")
            raise web.HTTPTooManyRequests(text="too many streams from your address")
        if self._streams >= self.limits.max_streams:
            self.metrics.error("session_limit")
            raise web.HTTPServiceUnavailable(text="stream limit reached", headers={"Retry-After": "1"})
        if len(device.streams) >= self.limits.max_streams_per_device and not self._make_room(device, address):
            self.metrics.error("session_limit")
            raise web.HTTPServiceUnavailable(text="stream limit reached", headers={"Retry-After": "1"})
        ws = web.WebSocketResponse(protocols=(CLIENT_SUBPROTOCOL,), heartbeat=self.limits.heartbeat_s,
                                   max_msg_size=self.limits.max_frame + 4, compress=False)
        await ws.prepare(request)
        stream = ClientStream(self, ws, device, device.new_stream_id(), remote, budget, address)
        device.streams[stream.stream_id] = stream
        budget.streams += 1
        self._streams += 1
        self.metrics.sessions.labels("client").inc()
        try:
            await stream.serve()
        finally:
            device.streams.pop(stream.stream_id, None)
            budget.streams -= 1
            self._streams -= 1
        return ws

    def _make_room(self, device: DeviceSession, address: str) -> bool:
        """Fair share of a full device among client addresses (/64s): if some address holds more of
        its streams than ``address`` does, close that address's oldest stream and say yes. So no set
        of addresses can lock another out: at worst they all end up with equal shares."""
        held: dict[str, list[ClientStream]] = {}
        for stream in device.streams.values():
            if not stream.closing:
                held.setdefault(stream.address, []).append(stream)
        mine = len(held.get(address, ()))
        if not held:
            return False
        heaviest = max(held, key=lambda a: len(held[a]))
        if len(held[heaviest]) <= mine + 1:
            return False
        victim = min(held[heaviest], key=lambda s: s.opened)
        self.metrics.error("fair_share")
        victim.close(CloseCode.RATE_LIMITED)
        device.streams.pop(victim.stream_id, None)
        return True

    async def publish(self, session: DeviceSession, msg: Publish) -> tuple[int, int]:
        """Check a device's announcement and store it; returns (keys written, record seq)."""
        if len(msg.layers) > self.limits.max_publish_layers or len(set(msg.layers)) != len(msg.layers):
            raise ProtocolError(f"relay_publish.layers must be at most {self.limits.max_publish_layers} distinct "
                                "layers", code=ErrorCode.BAD_FIELD)
        record = check_publish(msg.record, msg.layers, session.peer, session.endpoint)
        keys = 0
        if self.directory is not None:
            keys = await self.directory.publish(record, msg.record, msg.layers)
        self.metrics.published.inc()
        return keys, record.seq
