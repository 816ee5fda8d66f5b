"""The GossipSub half of the libp2p glue (``_libp2p_patches`` has the host, ``_libp2p_dht`` the
DHT): a pubsub router for the announcement topics, the first-view stream protocol, and the
workarounds for py-libp2p 0.8.1's GossipSub. Importing it imports libp2p.

* GossipSub's spam guard (``spam_protection_enabled``, on by default) counts every message a
  peer forwards on a topic, our own publications included, and silently stops forwarding past
  10 per second: a model's topic with 1,000 holders refreshing carries more than that through
  every mesh peer. It is off; ``moeswarm.net.gossip_view.TopicGate`` budgets per peer, address
  and signer instead.
* Its "adaptive gossip" (``adaptive_gossip_enabled``, on by default) rescores the network's
  health every 30 s and, below 0.7, sets the heartbeat interval to at least 30 s (60 s below
  0.7, 30 s below 0.4; written for its default heartbeat of 120 s): our 1 s heartbeat became a
  minute within half a minute of start in every router of a 20-peer harness, so meshes were
  repaired and IHAVE gossip (what recovers a missed announcement) sent once a minute. It is
  off: the heartbeat, the mesh degrees and the gossip factor stay what ``make_router`` says.
* ``install_opportunistic_graft_fix``: "opportunistic grafting" runs on every heartbeat and
  grafts up to 2 peers whose score is at least half the mesh's median: with the scorer's
  default weights (all 0) every peer of the topic qualifies, so each router grafted 2 peers a
  heartbeat until its mesh passed D_high and the heartbeat pruned it back to D: mesh churn
  measured at 0.55 GRAFT and 0.50 PRUNE received per node per second in an idle 50-peer
  harness, each a control RPC (Noise, Yamux, protobuf, the signed peer record checked again).
  It now grafts only peers scoring above the mesh's median, as the GossipSub v1.1 spec says
  (none when scores are equal).
* ``install_idontwant_threshold``: GossipSub v1.2 sends IDONTWANT for every message it
  forwards, to every mesh peer: for a 349-byte announcement that is one more RPC per mesh peer
  and message (each carrying the sender's signed peer record, checked on arrival), more than the
  duplicates it saves. go-libp2p sends it only for messages of 1 KiB or more; so do we.
* ``install_signed_record_cache``: every pubsub RPC carries the sender's signed peer record,
  and each arriving RPC had it decoded and its Ed25519 signature checked twice (by pubsub,
  then by the router). A record already accepted from that peer by this host (same bytes,
  within ``SIGNED_RECORD_RECHECK_S``) is taken as accepted. And for every RPC it sent, the
  host listed its listen addresses again (a ``getsockname`` per listener) to see whether its
  own record was still current: now once per ``OWN_RECORD_RECHECK_S``. (Together 30% of the
  busy samples of a 100-peer harness, 20% of them Ed25519 checks.)
* ``install_signed_record_once``: that record (about 200 bytes) rode in every RPC, a copy of an
  announcement included; now once per pubsub stream, again after ``SIGNED_RECORD_RESEND_S``.
  A receiver takes an RPC without one as it always did. (20 peers, every holder publishing once:
  6.9 -> 4.6 KB read per node per announcement.)
* ``install_equivocation_bound``: GossipSub keeps every message it ever forwarded in
  ``equivocation_detection`` (to spot a (from, seqno) reused with other data) and never forgets
  one: memory grew by one message per message, forever. It now keeps the newest
  ``EQUIVOCATION_MEMORY`` of them.
* ``install_pending_queue_bound``: GossipSub queued every message it published or forwarded for
  every connected peer not (yet) subscribed to the topic, up to 100 per peer, in case that
  peer's subscription was still on its way: a peer connected for a while that does not subscribe
  (a bootstrap node, another model's node, a DHT-only peer) had each message queued, the queue
  filtered again on every message, and a warning logged per message once it held 100 (4,534
  warnings in the first minutes of a 300-peer harness, from holders connected to its seed node).
  A peer whose pubsub stream has been up for ``PENDING_GRACE_S`` has said what it subscribes to:
  nothing is queued for it any more (a later subscription still gets the recent messages pubsub
  replays to a new subscriber).
* ``install_gossip_to_backed_off_peers``: IHAVE gossip went only to peers of the topic that were
  not in GRAFT backoff; a peer pruned from a full mesh (and the one pruning it) backs off for a
  minute, and then neither gossiped to the other: a few holders whose mesh links to busier peers
  were all pruned formed an island no announcement left (a block move of a holder in a
  10-holder worker of a 200-peer harness reached no backbone in 25 s). Backoff is for GRAFT
  only (GossipSub v1.1; go-libp2p's emitGossip skips only mesh and fanout peers): IHAVE now goes
  to backed-off peers too.
* ``remember_refused``: pubsub marks a message seen only once a validator accepts it, so a
  message our gate refused was requested again (IWANT) on every IHAVE that named it, fetched and
  its signature checked again: a joiner that took a record from a first view refused the gossiped
  copy as stale, and asked for it again each heartbeat of each peer gossiping it. A message refused
  for what it is (not for a forwarder's budget) is now marked seen; its signature was checked first
  (strict signing), so nobody can have a stranger's message id refused in advance.
* ``SYNC_PROTOCOL``: a joiner asks a peer of the topic for every record it keeps of a model,
  in one round trip; each record is then checked like a gossiped one.
"""

from __future__ import annotations

import logging
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any, Final

import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub import gossipsub as _gossipsub_module
from libp2p.pubsub.gossipsub import (
    PROTOCOL_ID,
    PROTOCOL_ID_V11,
    PROTOCOL_ID_V12,
    GossipSub,
)
from libp2p.pubsub.pubsub import Pubsub

from moeswarm.errors import ProtocolError
from moeswarm.net.addresses import address_key
from moeswarm.net.gossip_view import SYNC_MAX_MODEL_ID_BYTES, sync_answer, sync_request
from moeswarm.protocol._limits import MAX_RECORD_BYTES

__all__ = ["SYNC_PROTOCOL", "fetch_records", "install_equivocation_bound",
           "install_gossip_to_backed_off_peers", "install_idontwant_threshold", "install_opportunistic_graft_fix",
           "install_pending_queue_bound",
           "install_signed_record_cache", "install_signed_record_once",
           "make_pubsub", "make_router", "remember_refused",
           "serve_records"]

log = logging.getLogger(__name__)

SYNC_PROTOCOL: Final = TProtocol("/moeswarm/announce-sync/1.0.0")
EQUIVOCATION_MEMORY: Final = 4096
"""Messages GossipSub remembers to detect equivocation (about a minute of a busy topic)."""


# ---------------------------------------------------------------- equivocation memory


def install_equivocation_bound() -> None:
    """Keep GossipSub's equivocation memory to the newest ``EQUIVOCATION_MEMORY`` messages
    (idempotent; on the class, so every router of this process)."""
    cls = _gossipsub_module.GossipSub
    if getattr(cls, "_moeswarm_equivocation_bound", False):
        return
    original = cls._check_equivocation

    def bounded(self: Any, msg: Any) -> bool:
        ok = original(self, msg)
        memory: dict[bytes, Any] = self.equivocation_detection
        while len(memory) > EQUIVOCATION_MEMORY:
            del memory[next(iter(memory))]  # insertion order: the oldest first
        return bool(ok)

    cls._check_equivocation = bounded
    cls._moeswarm_equivocation_bound = True
    cls._moeswarm_unbounded_check_equivocation = original  # for the test that shows why


# ---------------------------------------------------------------- opportunistic grafting


def install_opportunistic_graft_fix() -> None:
    """Opportunistic grafting takes only peers scoring above the median of the mesh (idempotent;
    on the class, so every router of this process)."""
    cls = _gossipsub_module.GossipSub
    if getattr(cls, "_moeswarm_graft_fix", False):
        return
    original = cls._get_grafting_candidates

    def above_median(self: Any, topic: str, current_mesh: set[ID], threshold: float) -> list[tuple[ID, float]]:
        candidates = original(self, topic, current_mesh, threshold)
        if not candidates or self.scorer is None:
            return candidates
        median = statistics.median([self.scorer.score(p, [topic]) for p in current_mesh] or [0.0])
        return [(peer, score) for peer, score in candidates if score > median]

    cls._get_grafting_candidates = above_median
    cls._moeswarm_graft_fix = True
    cls._moeswarm_unfixed_get_grafting_candidates = original  # for the test that shows why


# ---------------------------------------------------------------- per-message work

IDONTWANT_MIN_BYTES: Final = 1024  # go-libp2p's IDontWantMessageThreshold
SIGNED_RECORD_RECHECK_S: Final = 600.0  # a sender's peer record accepted this long ago is checked again
SIGNED_RECORD_MEMORY: Final = 4096  # (peer, record) pairs remembered per host
SIGNED_RECORD_RESEND_S: Final = 600.0  # our signed peer record goes again on a stream after this long
OWN_RECORD_RECHECK_S: Final = 5.0  # how long a host's own signed peer record is sent unchanged


def install_idontwant_threshold() -> None:
    """IDONTWANT only for messages of ``IDONTWANT_MIN_BYTES`` or more (idempotent; on the class)."""
    cls = _gossipsub_module.GossipSub
    if getattr(cls, "_moeswarm_idontwant_threshold", False):
        return
    publish, emit = cls.publish, cls._emit_idontwant_for_message

    async def publish_noting_size(self: Any, msg_forwarder: ID, pubsub_msg: Any) -> None:
        # read by the emitter below, which publish awaits before any other await: no other
        # publication of this router runs in between
        self._moeswarm_small_message = len(pubsub_msg.data) < IDONTWANT_MIN_BYTES
        await publish(self, msg_forwarder, pubsub_msg)

    async def emit_for_large(self: Any, msg_id: bytes, topic_ids: Any) -> None:
        if getattr(self, "_moeswarm_small_message", False):
            return
        await emit(self, msg_id, topic_ids)

    cls.publish = publish_noting_size
    cls._emit_idontwant_for_message = emit_for_large
    cls._moeswarm_idontwant_threshold = True
    cls._moeswarm_unbounded_emit_idontwant = emit  # for the test that shows why


def install_signed_record_cache() -> None:
    """Check a sender's signed peer record once per host, peer and record (idempotent; replaces
    ``maybe_consume_signed_record`` where pubsub and GossipSub call it)."""
    from libp2p.pubsub import pubsub as pubsub_module
    from libp2p.pubsub import utils

    if getattr(utils, "_moeswarm_record_cache", False):
        return
    original = utils.maybe_consume_signed_record

    def cached(msg: Any, host: IHost, peer_id: ID) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        store = host.get_peerstore()
        seen: dict[tuple[ID, bytes], float] | None = getattr(store, "_moeswarm_records_seen", None)
        if seen is None:
            seen = store._moeswarm_records_seen = {}  # type: ignore[attr-defined]
        key, now = (peer_id, bytes(msg.senderRecord)), time.monotonic()
        if seen.get(key, -SIGNED_RECORD_RECHECK_S) > now - SIGNED_RECORD_RECHECK_S:
            return True
        ok = original(msg, host, peer_id)
        if ok:
            seen.pop(key, None)
            seen[key] = now
            while len(seen) > SIGNED_RECORD_MEMORY:
                del seen[next(iter(seen))]  # insertion order: the oldest first
        return bool(ok)

    own = pubsub_module.env_to_send_in_RPC

    def own_record(host: IHost) -> tuple[bytes, bool]:
        store = host.get_peerstore()
        kept: tuple[float, tuple[bytes, bool]] | None = getattr(store, "_moeswarm_own_record", None)
        now = time.monotonic()
        if kept is not None and kept[0] > now - OWN_RECORD_RECHECK_S:
            return kept[1][0], False
        envelope = own(host)
        store._moeswarm_own_record = (now, envelope)  # type: ignore[attr-defined]
        return envelope

    pubsub_module.maybe_consume_signed_record = cached
    _gossipsub_module.maybe_consume_signed_record = cached
    pubsub_module.env_to_send_in_RPC = own_record
    _gossipsub_module.env_to_send_in_RPC = own_record
    utils._moeswarm_record_cache = True
    utils._moeswarm_unchecked_original = original  # for the test that shows why
    utils._moeswarm_unkept_own_record = own


def install_signed_record_once() -> None:
    """Send our signed peer record once per pubsub stream (again after ``SIGNED_RECORD_RESEND_S``)
    instead of in every RPC (idempotent; on the class)."""
    if getattr(Pubsub, "_moeswarm_record_once", False):
        return
    write_msg = Pubsub.write_msg

    async def write_once(self: Any, stream: Any, rpc_msg: Any) -> bool:
        if rpc_msg.HasField("senderRecord"):
            record, now = bytes(rpc_msg.senderRecord), time.monotonic()
            sent: tuple[bytes, float] | None = getattr(stream, "_moeswarm_record_sent", None)
            if sent is not None and sent[0] == record and sent[1] > now - SIGNED_RECORD_RESEND_S:
                lean = type(rpc_msg)()
                lean.CopyFrom(rpc_msg)
                lean.ClearField("senderRecord")
                rpc_msg = lean
            else:
                stream._moeswarm_record_sent = (record, now)
        return bool(await write_msg(self, stream, rpc_msg))

    Pubsub.write_msg = write_once
    Pubsub._moeswarm_record_once = True
    Pubsub._moeswarm_unlean_write_msg = write_msg  # for the test that shows why


# ---------------------------------------------------------------- pending messages

PENDING_GRACE_S = 5.0  # a peer whose pubsub stream is this old has told us its subscriptions


def install_pending_queue_bound() -> None:
    """Queue nothing for peers past ``PENDING_GRACE_S`` (idempotent; on the class)."""
    cls = _gossipsub_module.GossipSub
    if getattr(cls, "_moeswarm_pending_bound", False):
        return
    add_peer, remove_peer, prune = cls.add_peer, cls.remove_peer, cls._prune_pending_messages

    def noting_add(self: Any, peer_id: ID, protocol_id: Any) -> None:
        add_peer(self, peer_id, protocol_id)
        self.__dict__.setdefault("_moeswarm_added", {})[peer_id] = time.monotonic()

    def forgetting_remove(self: Any, peer_id: ID) -> None:
        remove_peer(self, peer_id)
        self.__dict__.get("_moeswarm_added", {}).pop(peer_id, None)

    def settled_prune(self: Any, peer_id: ID) -> None:
        added = self.__dict__.get("_moeswarm_added", {}).get(peer_id)
        if added is not None and time.monotonic() - added > PENDING_GRACE_S:
            self._pending_messages.pop(peer_id, None)  # the caller then queues one message at most
            return
        prune(self, peer_id)

    cls.add_peer, cls.remove_peer, cls._prune_pending_messages = noting_add, forgetting_remove, settled_prune
    cls._moeswarm_pending_bound = True
    cls._moeswarm_unbounded_prune_pending = prune  # for the test that shows why


# ---------------------------------------------------------------- gossip targets


def install_gossip_to_backed_off_peers() -> None:
    """IHAVE gossip chooses among every non-mesh peer of the topic, backoff or not (idempotent)."""
    cls = _gossipsub_module.GossipSub
    if getattr(cls, "_moeswarm_gossip_backoff", False):
        return
    original = cls.gossip_heartbeat

    def gossip_heartbeat(self: Any) -> Any:
        from collections import defaultdict

        peers_to_gossip: Any = defaultdict(dict)
        if self.pubsub is None:
            return peers_to_gossip
        topics = [*self.mesh.items(), *((t, p) for t, p in self.fanout.items() if t not in self.mesh)]
        for topic, current in topics:
            if topic not in self.pubsub.peer_topics:
                continue
            msg_ids = self.mcache.window(topic)
            if not msg_ids:
                continue
            count = self._get_adaptive_gossip_peers_count(
                topic, len(self.pubsub.peer_topics.get(topic, set())) - len(current))
            for peer in self._get_in_topic_gossipsub_peers_from_minus(topic, count, current, False):
                peers_to_gossip[peer][topic] = list(msg_ids)
        return peers_to_gossip

    cls.gossip_heartbeat = gossip_heartbeat
    cls._moeswarm_gossip_backoff = True
    cls._moeswarm_backoff_gossip_heartbeat = original  # for the test that shows why


# ---------------------------------------------------------------- refused messages

REMEMBER_REFUSED = True  # False: py-libp2p 0.8.1's behaviour (for the test that shows why)


def remember_refused(pubsub: Pubsub, msg: Any) -> None:
    """Mark a message the topic's check refused for good as seen: pubsub then drops its copies
    and does not ask for it in answer to IHAVE (called by the validator, after the signature check)."""
    if REMEMBER_REFUSED:
        pubsub._mark_msg_seen(msg)


# ---------------------------------------------------------------- the router


def make_router(degree: int, heartbeat_s: int) -> GossipSub:
    """A GossipSub router: mesh ``degree`` (D_low 2D/3, D_high 2D), heartbeat every ``heartbeat_s``."""
    install_equivocation_bound()
    install_opportunistic_graft_fix()
    install_idontwant_threshold()
    install_signed_record_cache()
    install_signed_record_once()
    install_pending_queue_bound()
    install_gossip_to_backed_off_peers()
    return GossipSub(
        protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=degree, degree_low=max(2, degree * 2 // 3), degree_high=degree * 2,
        heartbeat_initial_delay=0.5, heartbeat_interval=heartbeat_s,
        spam_protection_enabled=False,  # see the module docstring: TopicGate budgets instead
        eclipse_protection_enabled=False,  # needs the peer scorer, which we do not run
        adaptive_gossip_enabled=False,  # see the module docstring: it stretched the heartbeat to a minute
    )


def make_pubsub(host: IHost, degree: int, heartbeat_s: int) -> tuple[Pubsub, GossipSub]:
    """A GossipSub router (``make_router``) and its pubsub."""
    router = make_router(degree, heartbeat_s)
    return Pubsub(host, router, strict_signing=True), router


def forwarder_address(host: IHost, peer: ID) -> str | None:
    """The counting key (``address_key``) of the address ``peer`` is connected from."""
    for conn in host.get_network().get_connections(peer):
        try:
            remote = conn.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 -- a transport without addresses
            remote = None
        if remote:
            return address_key(remote)
    return None


# ---------------------------------------------------------------- first view


async def _read_exactly(stream: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await stream.read(n - len(data))
        if not chunk:
            raise ProtocolError(f"the stream ended {n - len(data)} bytes short")
        data += chunk
    return data


async def _read_frame(stream: Any, limit: int) -> bytes:
    (length,) = struct.unpack(">I", await _read_exactly(stream, 4))
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds {limit}")
    return await _read_exactly(stream, length) if length else b""


def serve_records(host: IHost, sources: dict[str, Callable[[], list[bytes]]]) -> None:
    """Answer first-view requests: one frame naming a model, then one frame per record kept of
    it (``sources[model]()``) and an empty frame."""

    async def handle(stream: Any) -> None:
        try:
            with trio.move_on_after(10):
                model = (await _read_frame(stream, SYNC_MAX_MODEL_ID_BYTES)).decode("utf-8", "replace")
                source = sources.get(model)
                records = source() if source is not None else []
                await stream.write(sync_answer(records))
        except Exception as exc:  # noqa: BLE001 -- a stranger's broken request: drop it
            log.debug("first-view request: %r", exc)
        finally:
            await stream.close()

    host.set_stream_handler(SYNC_PROTOCOL, handle)


async def fetch_records(host: IHost, peer: str, model_id: str, max_records: int) -> list[bytes]:
    """Every record ``peer`` keeps of ``model_id``, at most ``max_records`` (unchecked bytes)."""
    stream = await host.new_stream(ID.from_base58(peer), [SYNC_PROTOCOL])
    try:
        await stream.write(sync_request(model_id))
        records: list[bytes] = []
        while record := await _read_frame(stream, MAX_RECORD_BYTES):
            if len(records) >= max_records:
                raise ProtocolError(f"peer {peer} sent more than {max_records} records")
            records.append(record)
        return records
    finally:
        await stream.close()
