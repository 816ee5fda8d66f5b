"""Signed expert announcements in the Kademlia DHT, their keys and their validation.

py-libp2p 0.8.1 keeps one value per key, so each peer writes its own key per layer::

    /moeswarm/v1/<model_id>/L<layer>/<peer_id base58btc>     value: the Announcement

and advertises itself as a provider of ``/moeswarm/v1/<model_id>/L<layer>`` (the UTF-8 bytes of
that text are the provider key); readers ``find_providers`` on that key, then ``get_value``
each provider's own key.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Final, Protocol

from moeswarm.errors import ConfigError, ProtocolError, SwarmError

from ._codec import MODEL_ID_RE, announcement_body, decode
from ._identity import (
    Identity,
    peer_id_from_public_key,
    peer_id_from_str,
    peer_id_to_str,
    verify,
)
from ._limits import (
    CLOCK_SKEW_MS,
    MAX_RECORD_BYTES,
    MAX_RECORD_TTL_MS,
    U32_MAX,
    ErrorCode,
    SignatureKind,
)
from ._messages import Announcement
from ._wire import canonical

DHT_NAMESPACE: Final = "moeswarm"
"""The namespace libp2p routes to our validator (first segment of every key)."""
KEY_PREFIX: Final = "/moeswarm/v1/"
_KEY_RE: Final = re.compile(r"/moeswarm/v1/(.+)/L(0|[1-9][0-9]{0,9})/([1-9A-HJ-NP-Za-km-z]+)")


def provider_key(model_id: str, layer: int) -> str:
    """The key whose providers are the peers holding experts of ``layer``.

    At most 80 UTF-8 bytes fit a provider key in go-libp2p, i.e. a ``model_id`` of 55 bytes
    for any ``u32`` layer; longer keys are the DHT adapter's to refuse.
    """
    if MODEL_ID_RE.fullmatch(model_id) is None or not 0 <= layer <= U32_MAX:
        raise ConfigError(f"bad model_id {model_id!r} or layer {layer}")
    return f"{KEY_PREFIX}{model_id}/L{layer}"


def announcement_key(model_id: str, layer: int, peer_id: bytes) -> str:
    """The key under which ``peer_id`` stores its announcement for ``layer``."""
    return f"{provider_key(model_id, layer)}/{peer_id_to_str(peer_id)}"


def parse_announcement_key(key: str) -> tuple[str, int, bytes]:
    """``(model_id, layer, peer_id)`` of an announcement key; ``ProtocolError`` 4 otherwise."""
    m = _KEY_RE.fullmatch(key)
    if m is None or MODEL_ID_RE.fullmatch(m.group(1)) is None or int(m.group(2)) > U32_MAX:
        raise ProtocolError(f"{key[:200]!r} is not an announcement key", code=ErrorCode.BAD_FIELD)
    return m.group(1), int(m.group(2)), peer_id_from_str(m.group(3))


def sign_announcement(
    identity: Identity,
    *,
    model_id: str,
    layers: tuple[int, int],
    experts: tuple[int, int],
    endpoints: Sequence[str],
    capacity_bytes: int,
    throughput: int,
    load_permille: int,
    software: str,
    seq: int,
    expires_at_ms: int,
    more_blocks: Sequence[tuple[tuple[int, int], tuple[int, int]]] = (),
) -> Announcement:
    """A new announcement signed by ``identity`` (``more_blocks``: blocks held beside the first)."""
    unsigned = Announcement(
        model_id=model_id, layers=layers, experts=experts, endpoints=tuple(endpoints),
        capacity_bytes=capacity_bytes, throughput=throughput, load_permille=load_permille,
        software=software, seq=seq, expires_at_ms=expires_at_ms, peer_id=identity.peer_id,
        public_key=identity.public_key, more_blocks=tuple(more_blocks),
    )
    sig = identity.sign(SignatureKind.ANNOUNCEMENT, canonical(announcement_body(unsigned)))
    return replace(unsigned, sig=sig)


def verify_announcement(record: Announcement) -> None:
    """Check that the key matches the peer ID and signed the record; ``ProtocolError`` 9."""
    if peer_id_from_public_key(record.public_key) != record.peer_id:
        raise ProtocolError("public_key does not match peer_id", code=ErrorCode.AUTH_FAILED)
    payload = canonical(announcement_body(record))
    if not verify(record.public_key, SignatureKind.ANNOUNCEMENT, payload, record.sig):
        raise ProtocolError("announcement signature does not verify", code=ErrorCode.AUTH_FAILED)


def _now_ms(now_ms: int | None) -> int:
    return int(time.time() * 1000) if now_ms is None else now_ms


def _stored_seq(key: str, stored: bytes | Announcement | None, now_ms: int) -> int | None:
    """The seq of the stored record if it is still valid, else ``None``."""
    if stored is None:
        return None
    if isinstance(stored, Announcement):
        return stored.seq if stored.expires_at_ms > now_ms else None
    try:
        return validate_record(key, stored, now_ms=now_ms).seq
    except ProtocolError:
        return None


def validate_record(
    key: str,
    value: bytes,
    stored: bytes | Announcement | None = None,
    *,
    now_ms: int | None = None,
) -> Announcement:
    """Accept a DHT value for ``key`` or raise ``ProtocolError`` with the reason's code.

    In order: size (3), decoding (1/4/5...), key syntax and agreement with the record (4),
    peer ID in the key (9), key/peer ID/signature (9), expiry (15), too-distant expiry (4),
    and seq strictly above the ``stored`` record's when that one is still valid (14).
    ``now_ms`` is unix milliseconds (default: the system clock).
    """
    now = _now_ms(now_ms)
    if len(value) > MAX_RECORD_BYTES:
        raise ProtocolError(f"record of {len(value)} bytes exceeds {MAX_RECORD_BYTES}",
                            code=ErrorCode.FRAME_TOO_LARGE)
    record = decode(value)
    if not isinstance(record, Announcement):
        raise ProtocolError("DHT value is not an announcement", code=ErrorCode.BAD_FIELD)
    model_id, layer, peer_id = parse_announcement_key(key)
    if model_id != record.model_id or not record.covers_layer(layer):
        raise ProtocolError("key's model or layer is not covered by the record",
                            code=ErrorCode.BAD_FIELD)
    if peer_id != record.peer_id:
        raise ProtocolError("key names another peer than the record", code=ErrorCode.AUTH_FAILED)
    verify_announcement(record)
    if record.expires_at_ms <= now:
        raise ProtocolError("record has expired", code=ErrorCode.EXPIRED)
    if record.expires_at_ms > now + MAX_RECORD_TTL_MS + CLOCK_SKEW_MS:
        raise ProtocolError("record expires too far in the future", code=ErrorCode.BAD_FIELD)
    old_seq = _stored_seq(key, stored, now)
    if old_seq is not None and record.seq <= old_seq:
        raise ProtocolError(f"record seq {record.seq} is not above stored {old_seq}",
                            code=ErrorCode.STALE)
    return record


def select_record(key: str, values: Sequence[bytes], *, now_ms: int | None = None) -> int:
    """Index of the valid value with the highest seq (first on ties), for DHT ``select``.

    Raises the last ``ProtocolError`` when no value is valid (``ConfigError`` if none given).
    """
    if not values:
        raise ConfigError("select_record needs at least one value")
    now = _now_ms(now_ms)
    best, best_seq = -1, -1
    error: ProtocolError | None = None
    for i, value in enumerate(values):
        try:
            seq = validate_record(key, value, now_ms=now).seq
        except ProtocolError as exc:
            error = exc
            continue
        if seq > best_seq:
            best, best_seq = i, seq
    if best < 0 and error is not None:
        raise error
    return best


class DHT(Protocol):
    """The DHT operations the swarm uses (``moeswarm.net.p2p.P2PNode`` provides them)."""

    async def put(self, key: str, value: bytes) -> int: ...  # how many peers stored it
    async def get(self, key: str) -> bytes | None: ...
    async def provide(self, key: str) -> None: ...
    async def find_providers(self, key: str) -> list[str]: ...


async def read_announcements(dht: DHT, model_id: str, layers: Iterable[int], *,
                             now_ms: int | None = None) -> list[Announcement]:
    """Every valid announcement for ``layers`` of ``model_id``, each peer's newest.

    The reading rule of the spec (section 13, moves): a provider is read again under any layer
    its newest record so far does not cover, since a peer that moved its block leaves records
    under the layers it left.  Failed lookups and rejected records are logged and skipped.
    """
    log = logging.getLogger(__name__)
    newest: dict[str, Announcement] = {}
    for layer in layers:
        try:
            providers = await dht.find_providers(provider_key(model_id, layer))
        except SwarmError as e:
            log.info("find_providers for layer %d failed: %s", layer, e)
            continue
        for peer in providers:
            seen = newest.get(peer)
            if seen is not None and seen.covers_layer(layer):
                continue  # the record read under an earlier layer covers this one
            try:
                key = announcement_key(model_id, layer, peer_id_from_str(peer))
                value = await dht.get(key)
                if value is None:
                    continue
                record = validate_record(key, value, now_ms=now_ms)
            except SwarmError as e:  # ProtocolError is one
                log.info("record of %s for layer %d rejected: %s", peer, layer, e)
                continue
            if seen is None or record.seq > seen.seq:
                newest[peer] = record
    return list(newest.values())
