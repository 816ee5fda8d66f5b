"""The rule every peer-signed, replaceable DHT record follows (catalogue entries, gateway records):
the key names the signer, the signature verifies, it has not expired nor expires too far ahead,
and it replaces a still-valid stored record only with a higher ``seq``."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from ..errors import ProtocolError, SwarmError
from ..protocol import ErrorCode, peer_id_from_str
from ..protocol._limits import CLOCK_SKEW_MS, MAX_RECORD_TTL_MS
from ..protocol._wire import bad


class PeerRecord(Protocol):
    peer_id: bytes
    seq: int
    expires_at_ms: int

    def verifies(self) -> bool: ...


R = TypeVar("R", bound=PeerRecord)


def validate_peer_record(what: str, key_rx: re.Pattern[str], decode: Callable[[bytes], R], key: str, value: bytes,
                         stored: bytes | None = None, *, now_ms: int | None = None) -> R:
    """Accept ``value`` (a ``what``) for ``key`` or raise ``ProtocolError``: size and decoding
    (``decode``'s codes), the key names the signer (9), signature (9), expiry (15), too-distant
    expiry (4), and a ``seq`` above a still-valid ``stored`` record's (14)."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    m = key_rx.fullmatch(key)
    if m is None:
        bad(f"not a {what} key: {key!r:.100}")
    record = decode(value)
    try:
        named = peer_id_from_str(m.group(1))
    except SwarmError:
        bad("the key does not name a peer ID")
    if record.peer_id != named:
        raise ProtocolError(f"key names another peer than the {what}", code=ErrorCode.AUTH_FAILED)
    if not record.verifies():
        raise ProtocolError(f"{what} signature does not verify", code=ErrorCode.AUTH_FAILED)
    if record.expires_at_ms <= now:
        raise ProtocolError(f"{what} has expired", code=ErrorCode.EXPIRED)
    if record.expires_at_ms > now + MAX_RECORD_TTL_MS + CLOCK_SKEW_MS:
        bad(f"{what} expires too far in the future")
    if stored is not None:
        try:
            old = validate_peer_record(what, key_rx, decode, key, stored, now_ms=now)
        except ProtocolError:
            return record
        if record.seq <= old.seq:
            raise ProtocolError(f"{what} seq {record.seq} is not above stored {old.seq}", code=ErrorCode.STALE)
    return record


def select_newest(what: str, validate: Callable[[str, bytes], PeerRecord], key: str, values: Sequence[bytes]) -> int:
    """Index of the valid record with the highest seq (the first on a tie)."""
    best, best_seq, error = -1, -1, None
    for i, value in enumerate(values):
        try:
            seq = validate(key, value).seq
        except ProtocolError as e:
            error = e
            continue
        if seq > best_seq:
            best, best_seq = i, seq
    if best < 0:
        raise error or ProtocolError(f"no valid {what}", code=ErrorCode.BAD_FIELD)
    return best
