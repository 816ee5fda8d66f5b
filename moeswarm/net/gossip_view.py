"""What a node keeps of a model's announcement topic, and what it lets strangers cost (no libp2p
import: plain data structures, used from the libp2p thread under a lock).

Announcements travel on one GossipSub topic per model (``announce_topic``); every message is one
announcement exactly as the DHT stores it, validated exactly as ``validate_record`` does (ranges
inside the model, signature, seq, expiry). Before that work, ``Limits`` bounds each message's
cost: token buckets per forwarding peer, per forwarding address (IPv4 address or IPv6 /64), per
signer, and for keys the view has not seen yet, per forwarding address again. ``RecordView``
holds at most ``max_records`` records per model and never evicts a live record to admit another:
once full, a new key waits until a record expires, is withdrawn, or fails its calls (``drop``).
So a flood of fresh keys fills only the free room, and an honest holder already in the view
keeps its place through its refreshes (``protocol_spec/discovery.md``).
"""

from __future__ import annotations

import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from ..errors import ProtocolError, SwarmError
from ..protocol import (
    Announcement,
    ErrorCode,
    announcement_key,
    decode,
    peer_id_to_str,
    validate_record,
)

ANNOUNCE_TOPIC_PREFIX: Final = "/moeswarm/v1/"
SYNC_MAX_MODEL_ID_BYTES: Final = 128  # a first-view request names a model in at most this many UTF-8 bytes
# A withdrawal is a record that expires a second after it is signed; one that arrives expired (the
# gossip hops took longer: a loaded machine, a long path) still replaces its signer's older record
# if it expired at most this long ago, so the holder leaves every view instead of staying live
# until its last refresh expires (10 minutes)
WITHDRAWAL_GRACE_MS: Final = 60_000
# Refusals that depend on who forwarded a message, not on the message: another peer's copy of it
# may be taken. Every other refusal holds for every copy of the message (its bytes are signed), so
# the message is remembered as seen and not fetched again (``_libp2p_gossip.remember_refused``)
FORWARDER_REFUSALS: Final = frozenset({"peer rate", "address rate", "new-key rate"})


def announce_topic(model_id: str) -> str:
    """The GossipSub topic carrying ``model_id``'s announcements."""
    return f"{ANNOUNCE_TOPIC_PREFIX}{model_id}/announce"


def _frame(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def sync_request(model_id: str) -> bytes:
    """A first-view request (``/moeswarm/announce-sync/1.0.0``): one frame naming the model."""
    return _frame(model_id.encode()[:SYNC_MAX_MODEL_ID_BYTES])


def sync_answer(records: list[bytes]) -> bytes:
    """A first-view answer: one frame per record, then an empty frame."""
    return b"".join(map(_frame, records)) + _frame(b"")


@dataclass(frozen=True)
class GossipLimits:
    """What one node accepts from the announcement topic of one model. Rates are messages per
    second, bursts are messages; ``max_records`` bounds memory whatever strangers publish."""

    per_peer_rate: float = 50.0  # messages forwarded to us by one peer (a whole topic's traffic passes a mesh peer)
    per_peer_burst: float = 500.0
    per_address_rate: float = 100.0  # ... by every peer behind one address (IPv4, IPv6 /64)
    per_address_burst: float = 1000.0
    new_keys_per_address_rate: float = 2.0  # records of signers not in the view yet, per forwarding address
    new_keys_per_address_burst: float = 200.0
    per_signer_rate: float = 0.2  # records one signer may publish (a refresh every 4 min; moves, withdrawals)
    per_signer_burst: float = 8.0
    max_records: int = 4096  # records kept per model (one per signer)
    max_sync_records: int = 4096  # records one first-view answer may carry
    max_buckets: int = 8192  # rate-limit entries kept per kind; the least recently used goes first


class TokenBuckets:
    """One token bucket per name, at most ``max_names`` of them (least recently used dropped)."""

    def __init__(self, rate: float, burst: float, max_names: int) -> None:
        self.rate, self.burst, self.max_names = rate, burst, max_names
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # name -> (tokens, at)

    def take(self, name: str, now: float) -> bool:
        tokens, at = self._buckets.pop(name, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[name] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > self.max_names:
            self._buckets.popitem(last=False)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)


class RecordView:
    """The newest valid announcement of each signer of one model, at most ``max_records``.

    Thread-safe: the libp2p thread offers records, the event loop reads them. A record replaces
    its signer's older one (higher ``seq``); a new signer is admitted only into free room, made
    by expired records (and those ``drop`` removed), never by pushing out a live one.
    """

    def __init__(self, max_records: int) -> None:
        self.max_records = max_records
        self._records: dict[bytes, tuple[Announcement, bytes]] = {}  # signer -> (record, its bytes)
        self._lock = threading.Lock()
        self.refused_full = 0  # new signers turned away because the view was full

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._records

    def seq_of(self, peer_id: bytes) -> int | None:
        entry = self._records.get(peer_id)
        return None if entry is None else entry[0].seq

    def offer(self, record: Announcement, value: bytes, now_ms: int | None = None) -> bool:
        """Keep ``record`` (already validated) if it is its signer's newest and there is room."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        with self._lock:
            old = self._records.get(record.peer_id)
            if old is not None:
                if old[0].seq >= record.seq:
                    return False
            elif len(self._records) >= self.max_records:
                self._expire(now_ms)
                if len(self._records) >= self.max_records:
                    self.refused_full += 1
                    return False
            self._records[record.peer_id] = (record, value)
            return True

    def drop(self, peer_id: bytes) -> None:
        """Forget a signer (its calls failed, or it was caught lying): room for another."""
        with self._lock:
            self._records.pop(peer_id, None)

    def values(self, limit: int | None = None, now_ms: int | None = None) -> list[bytes]:
        """The encoded live records, for a joiner's first view."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        with self._lock:
            live = [v for r, v in self._records.values() if r.expires_at_ms > now_ms]
        return live if limit is None else live[:limit]

    def _expire(self, now_ms: int) -> None:
        for peer in [p for p, (r, _) in self._records.items() if r.expires_at_ms <= now_ms]:
            del self._records[peer]


def fits_model(record: Announcement, num_layers: int | None, num_experts: int | None) -> bool:
    """Whether a record's ranges lie inside the model (layers below ``num_layers``, experts below
    ``num_experts``; ``None``: not known). A record claiming more than the model has is a lie
    (it would win every holder choice), not a holder of what it does have."""
    return all((num_layers is None or layers[1] < num_layers) and (num_experts is None or experts[1] < num_experts)
               for layers, experts in record.blocks())


class TopicGate:
    """Decides, in the libp2p thread, whether one message of a model's topic is accepted
    (delivered here and forwarded) and keeps the accepted ones in ``view``.

    In order, cheapest first: the forwarding peer's and address's budgets, the decoding (a record
    whose signer the view keeps at this seq or above is refused as stale before its signature is
    checked: refusing cannot admit anything), the validation of the record exactly as a DHT value (``validate_record`` under the key of its
    first layer: size, signature, expiry, ranges inside the model; a withdrawal of a signer in
    the view that expired on its way, ``WITHDRAWAL_GRACE_MS`` ago at most, is taken), the
    signer's budget, a new signer's budget per forwarding address, then the view (seq above the
    one kept, room).
    Counters say why messages were refused.
    """

    def __init__(self, model_id: str, limits: GossipLimits, *, num_layers: int | None = None,
                 num_experts: int | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.model_id, self.limits = model_id, limits
        self.num_layers, self.num_experts = num_layers, num_experts
        self.view = RecordView(limits.max_records)
        self._clock, self._wall_ms = clock, wall_ms  # rate budgets; record expiry (unix ms)
        n = limits.max_buckets
        self._peers = TokenBuckets(limits.per_peer_rate, limits.per_peer_burst, n)
        self._addresses = TokenBuckets(limits.per_address_rate, limits.per_address_burst, n)
        self._new_keys = TokenBuckets(limits.new_keys_per_address_rate, limits.new_keys_per_address_burst, n)
        self._signers = TokenBuckets(limits.per_signer_rate, limits.per_signer_burst, n)
        self._lock = threading.Lock()
        self.refused: dict[str, int] = {}  # reason -> messages
        self.accepted = 0

    def check(self, forwarder: str, address: str | None, value: bytes, *, budget: bool = True) -> Announcement | None:
        """The record if accepted, else ``None`` (the reason is counted in ``refused``).
        ``budget=False``: a first-view answer we asked for (bounded by its size, not by rates)."""
        verdict = self.decide(forwarder, address, value, budget=budget)
        return verdict if isinstance(verdict, Announcement) else None

    def decide(self, forwarder: str, address: str | None, value: bytes, *, budget: bool = True) -> Announcement | str:
        """``check``, returning the reason (a key of ``refused``) instead of ``None``."""
        now = self._clock()
        with self._lock:
            if budget and not self._peers.take(forwarder, now):
                return self._refuse("peer rate")
            if budget and address is not None and not self._addresses.take(address, now):
                return self._refuse("address rate")
        try:
            record = decode(value)
            if not isinstance(record, Announcement) or record.model_id != self.model_id:
                return self._refuse("not an announcement of this model")
            known = self.view.seq_of(record.peer_id)
            if known is not None and known >= record.seq:  # before the signature: copies of what we keep are
                return self._refuse("stale")  # most of a first view's answers (several peers) and of gossip
            now_ms = self._wall_ms()
            key = announcement_key(record.model_id, record.layers[0], record.peer_id)
            try:
                validate_record(key, value, now_ms=now_ms)
            except ProtocolError as e:
                known = self.view.seq_of(record.peer_id)
                if (e.code != ErrorCode.EXPIRED or known is None or known >= record.seq
                        or now_ms - record.expires_at_ms > WITHDRAWAL_GRACE_MS):
                    raise
                validate_record(key, value, now_ms=record.expires_at_ms - 1)  # all but the expiry, checked
        except SwarmError:
            return self._refuse("invalid")
        if not fits_model(record, self.num_layers, self.num_experts):
            return self._refuse("outside the model")
        with self._lock:
            seq = self.view.seq_of(record.peer_id)
            if seq is not None and seq >= record.seq:
                return self._refuse("stale")
            if budget and not self._signers.take(peer_id_to_str(record.peer_id), now):
                return self._refuse("signer rate")
            if budget and seq is None and address is not None and not self._new_keys.take(address, now):
                return self._refuse("new-key rate")
            if not self.view.offer(record, value, now_ms):
                return self._refuse("view full")
            self.accepted += 1
        return record

    def _refuse(self, why: str) -> str:
        self.refused[why] = self.refused.get(why, 0) + 1
        return why
