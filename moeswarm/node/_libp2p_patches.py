"""The libp2p-specific half of ``moeswarm.node.p2p``: host, DHT and every workaround for
py-libp2p 0.8.1 (``spikes/libp2p/FINDINGS.md``), in one place. Importing it imports libp2p
(1-2 s); ``p2p`` does so in its trio thread.

* ``make_host``: Noise only (finding 5), Yamux only, one connection per peer so that dials
  do not wait 250 ms (finding 4), lower connection limits (finding 9), one attempt per dial.
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
* ``configure_logging``: ``import libp2p`` cuts its logger off from ours; routine dial
  failures log at ERROR (finding 8).
"""

from __future__ import annotations

import contextvars
import logging
from typing import TYPE_CHECKING, Any

import libp2p  # noqa: F401  (first: its import resets the "libp2p" logger)
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn, ISecureTransport
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL_ID
from libp2p.kad_dht import kad_dht as _kad_module
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL_ID
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.kad_dht.provider_store import ProviderStore
from libp2p.kad_dht.value_store import ValueStore
from libp2p.network import swarm as _swarm
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError
from libp2p.records.utils import InvalidRecordType
from libp2p.records.validator import NamespacedValidator, Validator
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service
from libp2p.transport.exceptions import OpenConnectionError, UpgradeFailure
from multiaddr import Multiaddr

from moeswarm.errors import (
    ConfigError, NetworkError, ProtocolError, SwarmError, Timeout, Unreachable,
)
from moeswarm.node.records import select_any, validate_any
from moeswarm.protocol import DHT_NAMESPACE, Identity

if TYPE_CHECKING:
    from .p2p import P2PConfig

__all__ = [
    "Multiaddr", "MoeswarmDHT", "background_trio_service", "bootstrap", "close_host",
    "listen_addrs", "make_host", "noise_only", "translate_error",
]

IDENTIFY_WAIT_S = 2.0
"""How long an inbound KAD stream waits for identify to tell whether its peer is a server."""

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


# ---------------------------------------------------------------- FIND_NODE keys


MAX_FIND_NODE_KEY_BYTES = 128


class _LenientMultihash:
    """Stands in for ``multihash`` in ``libp2p.kad_dht.kad_dht``, which uses it only to vet
    FIND_NODE keys: a key that is no multihash and over 50 bytes is refused there, so lookups
    for our keys (/moeswarm/v1/...: 60-128 bytes) ended after the first hop. Now any key up
    to the 128 bytes GET_VALUE allows passes."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def decode(self, key: bytes) -> Any:
        return None if 0 < len(key) <= MAX_FIND_NODE_KEY_BYTES else self.real.decode(key)


def install_find_node_fix() -> None:
    """Let this process's DHT servers answer FIND_NODE for keys up to 128 bytes (idempotent)."""
    if not isinstance(_kad_module.multihash, _LenientMultihash):
        _kad_module.multihash = _LenientMultihash(_kad_module.multihash)


# ---------------------------------------------------------------- routing table (finding 3)


def install_routing_table_hygiene(dht: MoeswarmDHT) -> None:
    """When a peer's last connection goes, drop it from the routing table, and forget it
    altogether unless identify said it is a DHT server.

    py-libp2p never removes a departed peer; each stale entry then costs a dial (up to the
    dial timeout when its address swallows packets, as a NAT'd peer's does) in every lookup
    that meets it. Lookups also fall back to *every* peer in the peerstore while the routing
    table holds fewer than 5 peers, hence forgetting client peers. A server that is merely
    disconnected comes back as soon as a lookup meets it in another server's answer.
    Hooked on ``Swarm.remove_conn``: the "disconnected" notification comes 0.1 s later.
    """
    network = dht.host.get_network()
    peerstore = dht.host.get_peerstore()
    remove_conn = network.remove_conn

    def remove_and_forget(swarm_conn: INetConn) -> None:
        remove_conn(swarm_conn)
        peer_id = swarm_conn.muxed_conn.peer_id
        if network.get_connections(peer_id):
            return
        try:  # runs inside the connection's cleanup: must not raise
            dht.routing_table.remove_peer(peer_id)
            if not peerstore.supports_protocols(peer_id, [str(KAD_PROTOCOL_ID)]):
                peerstore.clear_peerdata(peer_id)
        except (PeerStoreError, ValueError) as exc:
            logging.getLogger(__name__).debug("forgetting %s: %r", peer_id, exc)

    network.remove_conn = remove_and_forget  # type: ignore[method-assign]


# ---------------------------------------------------------------- the DHT (finding 7)

_FRESH = contextvars.ContextVar("moeswarm_fresh_lookup", default=False)
_ACKS: contextvars.ContextVar[list[ID] | None] = contextvars.ContextVar("moeswarm_put_acks",
                                                                        default=None)


class _ValueStore(ValueStore):
    """Skips the local shortcut of ``get_value`` during our lookups; counts remote stores."""

    def get(self, key: bytes) -> Record | None:
        return None if _FRESH.get() else super().get(key)

    async def _store_at_peer(self, peer_id: ID, key: bytes, value: bytes,
                             record: Record | None = None) -> bool:
        ok = await super()._store_at_peer(peer_id, key, value, record)
        acks = _ACKS.get()
        if ok and acks is not None and peer_id not in acks:
            acks.append(peer_id)
        return ok


class _ProviderStore(ProviderStore):
    """Skips the local shortcut of ``find_providers`` during our lookups."""

    def get_providers(self, key: bytes) -> list[PeerInfo]:
        return [] if _FRESH.get() else super().get_providers(key)


class RecordValidator(Validator):
    """libp2p's view of ``moeswarm.protocol.validate_record`` / ``select_record``.

    The record a key already holds here is the ``stored`` record, so a replayed older seq is
    refused; re-putting the very same bytes is not a replay and passes.
    """

    def __init__(self, value_store: ValueStore) -> None:
        self._values = value_store

    def validate(self, key: str, value: bytes) -> None:
        entry = self._values.store.get(key.encode())  # raw: no expiry side effects
        stored = entry[0].value if entry is not None else None
        validate_any(key, value, None if stored == value else stored)

    def select(self, key: str, values: list[bytes]) -> int:
        return select_any(key, values)


class MoeswarmDHT(KadDHT):
    """Kademlia DHT accepting only ``/moeswarm/`` records that pass our validator."""

    def __init__(self, host: IHost, *, client_mode: bool) -> None:
        super().__init__(host, DHTMode.CLIENT if client_mode else DHTMode.SERVER,
                         validator=NamespacedValidator({}, strict_validation=True),
                         validator_changed=True, strict_validation=True)
        self.value_store = _ValueStore(host=host, local_peer_id=self.local_peer_id)
        self.provider_store = _ProviderStore(host=host, peer_routing=self.peer_routing)
        self.register_validator(DHT_NAMESPACE, RecordValidator(self.value_store))
        self.admit_only_servers = False

    def install_hygiene(self) -> None:
        """Apply the finding-3 workaround: admit only servers, forget departed peers."""
        self.admit_only_servers = True
        install_routing_table_hygiene(self)

    async def add_peer(self, peer_id: ID, *, skip_server_mode_check: bool = False) -> bool:
        """Called for every peer that opens a KAD stream to us, with the check skipped."""
        if skip_server_mode_check and self.admit_only_servers:
            if not await self._serves_kad(peer_id):
                return False
            skip_server_mode_check = False
        return await super().add_peer(peer_id, skip_server_mode_check=skip_server_mode_check)

    async def _serves_kad(self, peer_id: ID) -> bool:
        """Whether identify says the peer accepts KAD streams (runs identify if not yet done)."""
        peerstore = self.host.get_peerstore()
        if not peerstore.supports_protocols(peer_id, [str(IDENTIFY_PROTOCOL_ID)]):
            with trio.move_on_after(IDENTIFY_WAIT_S):
                try:
                    await self.host._identify_peer(peer_id, reason="moeswarm-kad-inbound")
                except Exception as exc:  # noqa: BLE001 -- then we do not know: not a server
                    logging.getLogger(__name__).debug("identify %s: %r", peer_id, exc)
        return bool(peerstore.supports_protocols(peer_id, [str(KAD_PROTOCOL_ID)]))

    async def provide_key(self, key: str) -> bool:
        """``provide`` for a UTF-8 key (libp2p's ``provide`` would try to parse it as a CID)."""
        return await self.provider_store.provide(key.encode())

    async def put_counted(self, key: str, value: bytes) -> int:
        """``put_value``, returning how many remote peers acknowledged the store."""
        acks: list[ID] = []
        token = _ACKS.set(acks)
        try:
            await self.put_value(key, value)
        finally:
            _ACKS.reset(token)
        return len(acks)

    async def get_fresh(self, key: str) -> bytes | None:
        """The best valid value among the network's and our own, expired ones ignored."""
        key_bytes = key.encode()
        entry = self.value_store.store.get(key_bytes)
        local = entry[0] if entry is not None else None
        token = _FRESH.set(True)
        try:
            remote = await self.get_value(key)  # stores the best remote record locally
        finally:
            _FRESH.reset(token)
        candidates = [v for v in (remote, local.value if local else None) if v is not None]
        if not candidates:
            return None
        try:
            best = candidates[select_any(key, candidates)]
        except ProtocolError:  # nothing valid, e.g. our own copy has expired
            self.value_store.remove(key_bytes)
            return None
        if local is not None and best == local.value:
            self.value_store.put_record(key_bytes, local)  # undo a worse remote overwrite
        return best

    async def find_providers_fresh(self, key: str, count: int) -> list[str]:
        """Provider peer IDs from the network plus our own store, deduplicated, in order."""
        token = _FRESH.set(True)
        try:
            remote = await self.provider_store.find_providers(key.encode(), count)
        finally:
            _FRESH.reset(token)
        local = self.provider_store.get_providers(key.encode())
        return list(dict.fromkeys(str(p.peer_id) for p in [*remote, *local]))[:count]


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
    # One attempt per dial: py-libp2p retries 3 times with backoff (0.7 s per refused dial),
    # which every lookup that meets a departed peer pays; callers retry at their own pace.
    host.get_network().retry_config = RetryConfig(max_retries=0)
    install_find_node_fix()
    if release_slots:
        install_inbound_slot_fix(host.get_network())
    return host


async def close_host(host: IHost) -> None:
    """Close every connection at once (py-libp2p closes them one by one, 0.2 s each), then
    the host: leaving ``host.run()`` alone would leave them open (finding 2)."""

    async def close(conn: INetConn) -> None:
        try:
            await conn.close()
        except Exception as exc:  # noqa: BLE001 -- best effort, the socket goes anyway
            logging.getLogger(__name__).debug("closing %s: %r", conn, exc)

    async with trio.open_nursery() as nursery:
        for conns in list(host.get_network().connections.values()):
            for conn in list(conns):
                nursery.start_soon(close, conn)
    await host.close()


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
                    error = f"{type(exc).__name__}: {exc}"
                    await trio.sleep(pause)
                    pause *= 2
                    continue
                answered.append(info)
                return
        failures.append(f"{info.peer_id}: {error}"[:200])

    async with trio.open_nursery() as nursery:
        for info in peers:
            nursery.start_soon(dial, info)
    if peers and not answered:
        raise Unreachable("no bootstrap peer answered: " + "; ".join(failures)[:500])
    for info in answered:
        await dht.routing_table.add_peer(info)
    with trio.move_on_after(config.op_timeout_s):
        await dht.refresh_routing_table()


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
