"""The libp2p-specific half of ``moeswarm.net.p2p``: host, DHT and every workaround for
py-libp2p 0.8.1 (``spikes/libp2p/FINDINGS.md``); the DHT's part of them lives in
``_libp2p_dht``. Importing it imports libp2p (1-2 s); ``p2p`` does so in its trio thread.

* ``make_host``: Noise only (finding 5), Yamux only, one connection per peer so that dials
  do not wait 250 ms (finding 4), lower connection limits (finding 9), one attempt per dial;
  the resource manager's own cap (256 connections each way) raised to ``max_connections``.
* ``close_host``: closes connections before leaving ``host.run()`` (finding 2), all at once.
* ``install_inbound_slot_fix``: an inbound connection used to hold one of the swarm's inbound
  slots until the whole swarm stopped; after ``max_connections`` inbound connections over its
  lifetime a node refused every new one (finding 1).
* ``install_routing_table_hygiene`` + ``MoeswarmDHT.add_peer``: client-mode peers entered servers'
  routing tables and nobody dropped a departed peer; every stale entry stalls lookups
  (finding 3).
* ``MoeswarmDHT``: only ``/moeswarm/`` records, checked by ``validate_record`` (finding 7);
  ``get``/``find_providers`` that ask the network instead of returning a cached answer;
  ``find_providers`` without duplicates; a replica count for ``put``.
* ``install_find_node_fix``: servers refused FIND_NODE for keys over 50 bytes, so lookups for
  our keys never went past the first hop.
* ``install_window_update_batching``: a Yamux reader sent a WINDOW_UPDATE frame for every read
  (``PY_YAMUX_RELEASE_ON_READ`` defaults on), so every small message (a gossip RPC, a DHT reply)
  cost a second encrypted frame back; now updates batch to half the window, as go-yamux does.
  Half of a holder's start-up CPU went there (tests/peer_swarm.py: 20 holders, 20.5 s of CPU
  before, 10.7 s after). Its auto-tuning kept a "partial slack" rule that still sent one after
  nearly every read of a small message (38,342 WINDOW_UPDATEs for 25,091 data frames while 100
  holders started); now only go-yamux's rule: once half the window is consumed.
* ``install_socket_tracking`` + ``close_sockets_left``: a connection whose graceful close did not
  finish within the stop budget (a loaded machine, a close cancelled half way) kept its socket
  open after the node stopped, until the collector found it (an intermittent "unclosed socket"
  at the end of a swarm test). Every TCP stream of a trio run is remembered; whatever is still
  open when the node has stopped is closed then.
* ``configure_logging``: ``import libp2p`` cuts its logger off from ours; routine dial
  failures log at ERROR (finding 8).
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from typing import TYPE_CHECKING, Any

import libp2p  # noqa: F401  (first: its import resets the "libp2p" logger)
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn, ISecureTransport
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.trio import TrioTCPStream
from libp2p.network import swarm as _swarm
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.records.utils import InvalidRecordType
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux import yamux as _yamux
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service
from libp2p.transport.exceptions import OpenConnectionError, UpgradeFailure
from multiaddr import Multiaddr

from moeswarm.errors import ConfigError, NetworkError, SwarmError, Timeout, Unreachable
from moeswarm.protocol import DHT_NAMESPACE, Identity

from ._libp2p_dht import MoeswarmDHT, install_find_node_fix

if TYPE_CHECKING:
    from .p2p_config import P2PConfig

__all__ = [
    "Multiaddr", "MoeswarmDHT", "background_trio_service", "bootstrap", "close_connections", "close_host",
    "close_sockets_left",
    "listen_addrs", "make_host", "noise_only", "translate_error",
]


# ---------------------------------------------------------------- logging (finding 8)

_ROUTINE = {  # logger -> message prefixes that are everyday churn, logged as DEBUG instead
    "libp2p.transport.tcp.tcp": ("Failed to open TCP stream", "Unexpected error opening TCP"),
    "libp2p.network.swarm": ("failed to upgrade security", "fail to upgrade mux"),
    "libp2p.host.basic_host": ("Failed to open stream to peer",),
    "libp2p.protocol_muxer.multiselect_client": ("MultiselectClient handshake",),
    "libp2p.kad_dht.kad_dht": ("Failed to read DHT message", "Value not found for key",
                               "Failed to store value"),  # the latter: refused by our validator
    "libp2p.kad_dht.provider_store": ("Error getting providers from", "Failed to get providers",
                                      "Failed to send ADD_PROVIDER", "Error sending ADD_PROVIDER"),
    "libp2p.kad_dht.peer_routing": ("Failed to open stream to",),
    "libp2p.kad_dht.value_store": ("Failed to store value at peer", "Failed to get value from"),
}


class _DemoteRoutine(logging.Filter):
    """Turn py-libp2p's WARNING/ERROR records for routine failures into DEBUG records."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self._prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG or not str(record.msg).startswith(self._prefixes):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_logging_done = False


def configure_logging() -> None:
    """Reconnect the "libp2p" logger to the application's handlers, at WARNING (idempotent).

    ``import libp2p`` clears the logger's handlers and stops propagation (unless
    ``LIBP2P_DEBUG`` set up its own handlers, which we then leave alone); its auto-connector
    logs every 30 s at INFO. Routine failures of dials and streams are demoted to DEBUG.
    """
    global _logging_done
    if _logging_done:
        return
    _logging_done = True
    root = logging.getLogger("libp2p")
    if not root.handlers:
        root.propagate = True
        root.setLevel(logging.WARNING)
    logging.getLogger("libp2p.network.auto_connector").setLevel(logging.NOTSET)  # was INFO
    for name, prefixes in _ROUTINE.items():
        logging.getLogger(name).addFilter(_DemoteRoutine(prefixes))


# ---------------------------------------------------------------- inbound slots (finding 1)

_INBOUND = contextvars.ContextVar("moeswarm_inbound_handler", default=False)


class _ConnectionEnded(Exception):
    """Raised into the swarm's inbound handler so that it returns and frees its slot."""


def install_inbound_slot_fix(swarm: Any) -> None:
    """Make ``swarm`` free its inbound slot when each inbound connection closes.

    ``Swarm._do_handle_inbound_connection`` upgrades the connection, then awaits
    ``manager.wait_finished()`` (the end of the whole swarm) while its caller holds a slot of
    ``_inbound_limiter``. The patched upgrade step (installed once on the class, active for
    swarms marked here) waits for *its own* connection to close instead and raises, which sends
    the handler down its ``except Exception`` path: close the raw connection, return.
    """
    swarm._moeswarm_release_inbound_slots = True
    cls = _swarm.Swarm
    if getattr(cls, "_moeswarm_inbound_fix", False):
        return
    original_handle = cls._do_handle_inbound_connection
    original_upgrade = cls.upgrade_inbound_raw_conn

    async def handle(self: Any, *args: Any, **kwargs: Any) -> None:
        token = _INBOUND.set(True)
        try:
            await original_handle(self, *args, **kwargs)
        finally:
            _INBOUND.reset(token)

    async def upgrade(self: Any, raw_conn: Any, maddr: Multiaddr) -> Any:
        muxed = await original_upgrade(self, raw_conn, maddr)
        if not (_INBOUND.get() and getattr(self, "_moeswarm_release_inbound_slots", False)):
            return muxed
        # add_conn() ran inside the upgrade: our SwarmConn is registered, or was refused
        # (and closed) as a duplicate or over a limit.
        for conn in self.connections.get(muxed.peer_id, []):
            if conn.muxed_conn is muxed:
                await conn.event_closed.wait()
                break
        raise _ConnectionEnded

    cls._do_handle_inbound_connection, cls.upgrade_inbound_raw_conn = handle, upgrade
    cls._moeswarm_inbound_fix = True


# ---------------------------------------------------------------- Yamux window updates


def install_window_update_batching() -> None:
    """Send Yamux WINDOW_UPDATEs once half the receive window is consumed (go-yamux's rule),
    not after every read. py-libp2p 0.8.1 releases on every read unless the environment says
    ``PY_YAMUX_RELEASE_ON_READ=0``; an explicit setting of that variable still wins."""
    if getattr(_yamux, "_moeswarm_release_on_read", None) is not None:
        return
    original = _yamux._yamux_release_on_read

    def release_on_read() -> bool:
        return original() if _yamux._py_yamux_env_set("RELEASE_ON_READ") else False

    _yamux._moeswarm_release_on_read = original
    _yamux._yamux_release_on_read = release_on_read
    stream = _yamux.YamuxStream
    auto_tune = stream._auto_tune_and_send_window_update

    async def half_window(self: Any, *, bytes_read: int = 0) -> None:
        # go-yamux's sendWindowUpdate: the window consumed (what the peer sent, less what is still
        # buffered) goes back in one update once it reaches the threshold (half the window), never
        # before. py-libp2p's "partial slack" branch sent one after every read of a small message
        if _yamux._py_yamux_env_set("RELEASE_ON_READ") or _yamux._yamux_disable_hysteresis():
            await auto_tune(self, bytes_read=bytes_read)
            return
        increment = 0
        async with self.window_lock:
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            consumed = self.target_recv_window - (self.recv_window + buffered)
            if consumed > 0 and consumed >= self._grow_threshold():
                increment = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
                self._pending_recv_release = 0
        if increment > 0:
            await self.send_window_update(increment, skip_lock=True)

    stream._auto_tune_and_send_window_update = half_window
    stream._moeswarm_unbatched_auto_tune = auto_tune  # for the test that shows why


# ---------------------------------------------------------------- sockets left open at stop

_STREAMS: trio.lowlevel.RunVar[weakref.WeakSet[TrioTCPStream]] = trio.lowlevel.RunVar("moeswarm_tcp_streams")


def install_socket_tracking() -> None:
    """Remember every TCP stream (dialled or accepted) in the trio run that makes it."""
    if getattr(TrioTCPStream, "_moeswarm_tracked", False):
        return
    original = TrioTCPStream.__init__

    def __init__(self: TrioTCPStream, stream: trio.SocketStream) -> None:
        original(self, stream)
        try:
            streams = _STREAMS.get()
        except LookupError:
            streams = weakref.WeakSet()
            _STREAMS.set(streams)
        streams.add(self)

    TrioTCPStream.__init__ = __init__  # type: ignore[method-assign]
    TrioTCPStream._moeswarm_tracked = True  # type: ignore[attr-defined]


def close_sockets_left() -> int:
    """Close, at once and without a goodbye, every socket of this trio run still open; the
    number closed. Called when the node has stopped and its graceful closes have had their time."""
    try:
        streams = _STREAMS.get()
    except LookupError:
        return 0
    closed = 0
    for stream in list(streams):
        sock = stream.stream.socket
        if sock.fileno() != -1:
            sock.close()
            closed += 1
    return closed


# ---------------------------------------------------------------- host, bootstrap, errors


def noise_only(key_pair: KeyPair) -> dict[TProtocol, ISecureTransport]:
    """Security options offering Noise alone: the default adds plaintext (finding 5)."""
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    return {TProtocol(NOISE_PROTOCOL_ID): noise}


def make_host(identity: Identity, config: P2PConfig, release_slots: bool) -> IHost:
    """A TCP host with our key, Noise only (finding 5), Yamux only, fast dials (finding 4)."""
    key_pair = create_new_key_pair(identity.seed())
    if str(ID.from_pubkey(key_pair.public_key)) != identity.peer_id_str:
        raise ConfigError("libp2p derives another peer ID from this key")  # cannot happen
    limit = config.max_connections
    host = new_host(
        key_pair=key_pair,
        sec_opt=noise_only(key_pair),
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        listen_addrs=[Multiaddr(config.listen)],
        connection_config=ConnectionConfig(
            max_connections=limit,
            min_connections=0,  # auto-dial target is (low + high) / 2 (finding 9)
            low_watermark=limit // 8,
            high_watermark=limit * 3 // 4,
            max_connections_per_peer=1,  # otherwise every connect() waits 250 ms (finding 4)
            dial_timeout=config.dial_timeout_s,
            outbound_upgrade_timeout=config.dial_timeout_s,  # a dial includes the handshake
        ),
    )
    # py-libp2p's resource manager also caps established connections at 256 each way whatever
    # max_connections says: a bootstrap node with max_connections 1024 refused its 257th holder
    limits = getattr(host.get_network(), "_resource_manager", None)
    limits = getattr(limits, "connection_limits", None)
    if limits is not None:
        for name in ("max_established_inbound", "max_established_outbound", "max_established_total"):
            setattr(limits, name, max(getattr(limits, name) or 0, limit))
    # One attempt per dial: py-libp2p retries 3 times with backoff (0.7 s per refused dial),
    # which every lookup that meets a departed peer pays; callers retry at their own pace.
    host.get_network().retry_config = RetryConfig(max_retries=0)
    install_find_node_fix()
    install_window_update_batching()
    install_socket_tracking()
    if release_slots:
        install_inbound_slot_fix(host.get_network())
    return host


async def close_host(host: IHost) -> None:
    """Close every connection at once (py-libp2p closes them one by one, 0.2 s each), then
    the host: leaving ``host.run()`` alone would leave them open (finding 2)."""
    await close_connections(host)
    await host.close()


async def close_connections(host: IHost) -> None:
    """Close every connection of ``host`` at once."""

    async def close(conn: INetConn) -> None:
        try:
            await conn.close()
        except Exception as exc:  # noqa: BLE001 -- best effort, the socket goes anyway
            logging.getLogger(__name__).debug("closing %s: %r", conn, exc)

    async with trio.open_nursery() as nursery:
        for conns in list(host.get_network().connections.values()):
            for conn in list(conns):
                nursery.start_soon(close, conn)


def listen_addrs(host: IHost) -> list[str]:
    """The host's listen multiaddrs, each ending in ``/p2p/<peer id>``."""
    suffix = f"/p2p/{host.get_id()}"
    return [a if a.endswith(suffix) else a + suffix for a in map(str, host.get_addrs())]


async def bootstrap(host: IHost, dht: MoeswarmDHT, config: P2PConfig) -> None:
    """Dial every bootstrap peer at once; seed the routing table; look ourselves up.

    ``Unreachable`` if none of them answers within ``dial_timeout_s``.
    """
    if not config.bootstrap:
        return
    try:
        peers = [info_from_p2p_addr(Multiaddr(a)) for a in config.bootstrap]
    except Exception as exc:
        raise ConfigError(f"bad bootstrap address: {exc}") from exc
    peers = [p for p in peers if p.peer_id != host.get_id()]
    answered: list[PeerInfo] = []
    failures: list[str] = []

    async def dial(info: PeerInfo) -> None:
        """Dial until it answers or ``dial_timeout_s`` is over (it may be starting too)."""
        host.get_peerstore().add_addrs(info.peer_id, info.addrs, _BOOTSTRAP_ADDR_TTL_S)
        pause, error = _BOOTSTRAP_RETRY_S, "no answer"
        with trio.move_on_after(config.dial_timeout_s):
            while True:
                try:
                    await host.connect(info)
                except Exception as exc:  # noqa: BLE001 -- retried, then reported
                    if error == "no answer" or not _negative_cache(exc):  # retries only say "recently failed"
                        error = _dial_problem(exc, info)
                    await trio.sleep(pause)
                    pause *= 2
                    continue
                answered.append(info)
                return
        failures.append(error[:300])

    async with trio.open_nursery() as nursery:
        for info in peers:
            nursery.start_soon(dial, info)
    if peers and not answered:
        raise Unreachable("no bootstrap peer answered: " + "; ".join(failures)[:500])
    for info in answered:
        await dht.routing_table.add_peer(info)
    if config.bootstrap_lookup:
        with trio.move_on_after(config.op_timeout_s):
            await dht.refresh_routing_table()


def _negative_cache(exc: BaseException) -> bool:
    return isinstance(exc, SwarmException) and "negative cache" in str(exc)


def _dial_problem(exc: BaseException, info: PeerInfo) -> str:
    """Why dialling a bootstrap peer failed, as a person reads it: "connection refused at ADDR"
    rather than the chain of libp2p exceptions around the OSError."""
    where = " or ".join(f"{a}/p2p/{info.peer_id}" for a in info.addrs) or str(info.peer_id)
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo and len(seen) < 64:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError):
            return f"connection refused at {where} (is the peer running?)"
        if isinstance(e, (TimeoutError, trio.TooSlowError)):
            return f"no answer from {where}"
        if isinstance(e, OSError) and e.errno is not None:
            return f"{e.strerror or e} at {where}"
        todo += [*(getattr(e, "errors", None) or ()), *(getattr(e, "exceptions", None) or ())]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return f"{type(exc).__name__}: {exc} (dialling {where})"


_BOOTSTRAP_ADDR_TTL_S = 24 * 3600
_BOOTSTRAP_RETRY_S = 0.1  # first pause between bootstrap dials; doubles each time


def translate_error(exc: BaseException) -> BaseException:
    """The ``moeswarm.errors`` exception for a libp2p/trio one, chained to it."""
    leaf = exc
    while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
        leaf = leaf.exceptions[0]
    if isinstance(leaf, (SwarmError, KeyboardInterrupt, SystemExit)):
        return leaf
    error: SwarmError
    if isinstance(leaf, InvalidRecordType):
        error = ConfigError(f"key outside the /{DHT_NAMESPACE}/ namespace: {leaf}")
    elif isinstance(leaf, (SwarmException, OpenConnectionError, UpgradeFailure)):
        error = Unreachable(f"{type(leaf).__name__}: {leaf}")
    elif isinstance(leaf, trio.TooSlowError):
        error = Timeout("libp2p operation timed out")
    else:
        error = NetworkError(f"libp2p failed: {type(leaf).__name__}: {leaf}")
    error.__cause__ = leaf
    return error


configure_logging()  # here, after `import libp2p` has reset its logger
