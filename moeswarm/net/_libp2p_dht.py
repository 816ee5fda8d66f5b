"""The DHT half of the libp2p workarounds (``_libp2p_patches`` has the host half): a KadDHT that
stores only validated ``/moeswarm/`` records (finding 7), asks the network instead of its cache,
keeps client-mode and departed peers out of routing tables (finding 3), and answers FIND_NODE for
keys over 50 bytes.  Importing it imports libp2p.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import trio
from libp2p.abc import IHost, INetConn
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL_ID
from libp2p.kad_dht import kad_dht as _kad_module
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL_ID
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.kad_dht.provider_store import ProviderStore
from libp2p.kad_dht.value_store import ValueStore
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import PeerStoreError
from libp2p.records.validator import NamespacedValidator, Validator

from moeswarm.errors import ProtocolError
from moeswarm.net.addresses import address_key
from moeswarm.net.records import select_any, validate_any
from moeswarm.net.value_quota import DEFAULT_MAX_VALUES, DEFAULT_MAX_VALUES_PER_PEER, QuotaStore
from moeswarm.protocol import DHT_NAMESPACE

__all__ = ["MoeswarmDHT", "install_find_node_fix", "install_routing_table_hygiene"]

IDENTIFY_WAIT_S = 2.0
"""How long an inbound KAD stream waits for identify to tell whether its peer is a server."""


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
_WRITER: contextvars.ContextVar[str | None] = contextvars.ContextVar("moeswarm_dht_writer", default=None)
"""The address (IPv4, IPv6 /64) of the peer whose inbound KAD stream is being handled: the
writer group a PUT_VALUE is charged to (``QuotaStore``)."""


class _ValueStore(ValueStore):
    """Skips the local shortcut of ``get_value`` during our lookups; counts remote stores; keeps
    its values in a ``QuotaStore`` (per-peer quotas, O(1) eviction) instead of a dict that
    py-libp2p empties one linear scan at a time."""

    def use_quotas(self, capacity: int, per_peer: int) -> None:
        store = QuotaStore(capacity, per_peer, source=_WRITER.get)
        store.update(self.store)
        self.store = store

    def _evict_if_full(self) -> None:
        """Nothing to do: the QuotaStore evicts as it admits."""

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

    def __init__(self, host: IHost, *, client_mode: bool, max_values: int = DEFAULT_MAX_VALUES,
                 max_values_per_peer: int = DEFAULT_MAX_VALUES_PER_PEER) -> None:
        super().__init__(host, DHTMode.CLIENT if client_mode else DHTMode.SERVER,
                         validator=NamespacedValidator({}, strict_validation=True),
                         validator_changed=True, strict_validation=True)
        self.value_store = _ValueStore(host=host, local_peer_id=self.local_peer_id)
        self.value_store.use_quotas(max_values, max_values_per_peer)
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

    async def _do_handle_stream(self, stream: Any) -> None:
        """Every value stored while handling an inbound stream is charged to the sender's address."""
        try:
            remote = stream.get_remote_address()
        except Exception:  # noqa: BLE001 -- a transport without addresses: charged per key
            remote = None
        token = _WRITER.set(address_key(remote) if remote else None)
        try:
            await super()._do_handle_stream(stream)
        finally:
            _WRITER.reset(token)

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
