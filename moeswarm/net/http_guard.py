"""Bounds every moeswarm HTTP service shares (ledger, OpenAI API, monitor, status): what nginx
does with ``client_header_timeout``, ``client_body_timeout``, ``keepalive_timeout`` and
``limit_conn``, and the Host check that stops DNS rebinding.

aiohttp has no header-read timeout: a client that sends half a request line holds its
connection until the keep-alive timer (an hour by default). ``start_site`` listens through a
protocol (``_Guarded``) that sits between each connection and aiohttp's request handler:

- at most ``max_conns_per_ip`` connections per IPv4 address or IPv6 /64; the next one gets
  ``429`` and is closed before aiohttp sees a byte;
- a connection must deliver a complete request head within ``header_timeout_s`` of opening, or
  of the first byte after its previous response, else it gets ``408`` and is closed;
- a request body must arrive within ``body_timeout_s`` plus 1 s per MB of its length, else the
  connection is dropped;
- a connection idle between requests is closed after ``idle_timeout_s`` (aiohttp's keep-alive).

The head is complete when aiohttp hands the request to the application: ``guard_middleware``
(outermost) tells the connection's ``_Guarded`` so.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..errors import ConfigError
from .addresses import address_key

log = logging.getLogger(__name__)

_BODY_BYTES_PER_S = 1 << 20  # a body may take body_timeout_s plus one second per MiB


def _closing(status: str, text: str) -> bytes:
    body = text.encode() + b"\n"
    return (f"HTTP/1.1 {status}\r\nConnection: close\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


_TOO_MANY = _closing("429 Too Many Requests", "too many connections from your address")
_TOO_SLOW = _closing("408 Request Timeout", "request head not received in time")


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection bounds of an HTTP service (the defaults are nginx's spirit, tighter)."""

    header_timeout_s: float = 20.0  # a request head (line + headers) must arrive within this, seconds
    body_timeout_s: float = 20.0  # a request body within this plus 1 s per MiB of it, seconds
    idle_timeout_s: float = 75.0  # a connection idle between requests is closed after this, seconds
    max_conns_per_ip: int = 64  # open connections per IPv4 address or IPv6 /64


class _Gate:
    """Open connections per address of one listening site."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.open: dict[str, int] = {}
        self.refused = 0  # connections closed by the per-address cap
        self.timed_out = 0  # connections closed by the header timeout

    def admit(self, key: str) -> bool:
        if self.open.get(key, 0) >= self.limits.max_conns_per_ip:
            self.refused += 1
            return False
        self.open[key] = self.open.get(key, 0) + 1
        return True

    def release(self, key: str) -> None:
        left = self.open.get(key, 0) - 1
        if left > 0:
            self.open[key] = left
        else:
            self.open.pop(key, None)


class _Guarded(asyncio.Protocol):
    """One connection: the per-address cap, the header and body timers, then aiohttp's handler."""

    def __init__(self, gate: _Gate, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self.gate, self.make_inner = gate, make_inner
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.key = ""
        self.busy = False  # the application is handling a request
        self.body_done = True  # the current request's body has all arrived
        self.next_started = False  # bytes of the next request arrived while busy
        self.timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.key = address_key(transport.get_extra_info("peername"))
        if not self.gate.admit(self.key):
            self.key = ""
            transport.write(_TOO_MANY)  # type: ignore[attr-defined]
            transport.close()
            return
        self.inner = self.make_inner()
        self.inner.connection_made(transport)
        self._arm(self.gate.limits.header_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.busy:
            self.next_started = self.next_started or self.body_done
        elif self.timer is None:  # the first byte of the next request: its head has a deadline
            self._arm(self.gate.limits.header_timeout_s, self._head_late)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else False

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.key:
            self.gate.release(self.key)
            self.key = ""
        if self.inner is not None:
            inner, self.inner = self.inner, None
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # ---- request boundaries (from guard_middleware)

    def request_started(self, request: web.BaseRequest) -> None:
        self._disarm()
        self.busy, self.next_started = True, False
        self.body_done = not request.can_read_body
        if not self.body_done:
            size = request.content_length or 0
            self._arm(self.gate.limits.body_timeout_s + size / _BODY_BYTES_PER_S, self._body_late)
            request.content.on_eof(self._body_arrived)

    def request_ended(self) -> None:
        self.busy = False
        self._disarm()
        if self.next_started:
            self._arm(self.gate.limits.header_timeout_s, self._head_late)

    def _body_arrived(self) -> None:
        self.body_done = True
        if self.busy:
            self._disarm()

    # ---- timers

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(seconds, then)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _head_late(self) -> None:
        self.timer = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        self.gate.timed_out += 1
        self.transport.write(_TOO_SLOW)
        self.transport.close()

    def _body_late(self) -> None:
        self.timer = None
        if self.transport is not None and not self.body_done:
            log.info("request body from %s not received in time: connection dropped", self.key)
            self.transport.abort()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Marks where a request starts and ends for its connection's timers (install it outermost)."""
    transport = request.transport
    guarded = transport.get_protocol() if transport is not None else None
    if not isinstance(guarded, _Guarded):
        return await handler(request)
    guarded.request_started(request)
    try:
        return await handler(request)
    finally:
        guarded.request_ended()


class GuardedSite(web.BaseSite):
    """A ``web.TCPSite`` whose connections pass through ``_Guarded`` (the runner's app must carry
    ``guard_middleware``, see ``guarded_app``)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: HttpLimits, *,
                 ssl_context: Any = None, backlog: int = 128) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host, self._port = host, port
        self.gate = _Gate(limits)

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        inner = self._runner.server
        assert inner is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Guarded(self.gate, inner), self._host, self._port, ssl=self._ssl_context,  # type: ignore[arg-type]
            backlog=self._backlog)


def guarded_app(app: web.Application) -> web.Application:
    """``app`` with ``guard_middleware`` first (before the app is frozen by its runner)."""
    if guard_middleware not in app.middlewares:
        app.middlewares.insert(0, guard_middleware)
    return app


def guarded_runner(app: web.Application, limits: HttpLimits, **kwargs: Any) -> web.AppRunner:
    """An ``AppRunner`` whose keep-alive timeout is ``limits.idle_timeout_s``."""
    return web.AppRunner(guarded_app(app), keepalive_timeout=limits.idle_timeout_s, **kwargs)


async def start_site(runner: web.AppRunner, host: str, port: int, limits: HttpLimits, **kwargs: Any) -> GuardedSite:
    """``runner.setup()`` (if not done) and listen on ``host:port`` through the guard; port 0 picks one."""
    if guard_middleware not in runner.app.middlewares:
        raise TypeError("make the runner with guarded_runner(): its app needs guard_middleware")
    if runner.server is None:
        await runner.setup()
    site = GuardedSite(runner, host, port, limits, **kwargs)
    await site.start()
    return site


async def start_runner(runner: web.AppRunner, host: str, port: int, what: str,
                       limits: HttpLimits = HttpLimits()) -> int:
    """Set ``runner`` (made by ``guarded_runner``) up and listen on ``host:port`` (0 picks a free
    port) through these bounds -> the bound port; ``ConfigError``
    ("cannot <what> on host:port") if the address cannot be had."""
    await runner.setup()
    try:
        await start_site(runner, host, port, limits)
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"cannot {what} on {host}:{port}: {e}") from None
    return int(runner.addresses[0][1])


# ---- Host checks (DNS rebinding)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or a name) only reaches this machine."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host part of a Host header or of an Origin's authority, lower case, no port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def allowed_hosts(bound: str, extra: Iterable[str] = ()) -> set[str]:
    """The names a Host header may carry for a server bound to ``bound``: its own address (the
    loopback names on loopback) and ``extra``; empty for a wildcard bind (no one name to check)."""
    if bound in ("0.0.0.0", "::", ""):
        return set()
    allowed = {host_name(h) for h in extra}
    if is_loopback(bound):
        allowed.update(LOOPBACK_NAMES)
    else:
        allowed.add(host_name(bound))
    return allowed


def host_allowed(host: str | None, allowed: set[str]) -> bool:
    """Whether a request's Host header names this server (always, when ``allowed`` is empty)."""
    return not allowed or (host is not None and host_name(host) in allowed)


def host_check(bound: str, extra: Iterable[str] = ()) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware answering ``421`` to a request whose Host is not this server's address."""
    allowed = allowed_hosts(bound, extra)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not host_allowed(host, allowed):
            return web.json_response({"error": f"Host {str(host)[:100]!r} is not this server's address"},
                                     status=421)
        return await handler(request)

    return check


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes: ``413`` before reading anything when its
    Content-Length says more, or as soon as more arrived (the connection is not kept)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit, declared)
    body = bytearray()
    while True:
        chunk = await request.content.read(64 * 1024)
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > limit:
            raise _too_large(limit, len(body))


def _too_large(limit: int, size: int) -> web.HTTPRequestEntityTooLarge:
    error = web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
    error.force_close()  # the rest of the body is not worth reading
    return error
