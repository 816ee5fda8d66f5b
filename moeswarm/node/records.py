"""Every kind of record the swarm keeps in the DHT, behind one validator.

``/moeswarm/v1/<model>/L<layer>/<peer>``: expert announcements (``moeswarm.protocol``);
``/moeswarm/v1/<model>/demand/<peer>``: backbones' signed demand reports (``moeswarm.market``).
Each is accepted only when signed by the peer its key names; a stored record is replaced only
by a newer one from the same peer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..errors import ProtocolError
from ..market import decode_report, validate_demand_record
from ..protocol import ErrorCode, select_record, validate_record

_DEMAND = re.compile(r"/moeswarm/v1/.+/demand/[1-9A-HJ-NP-Za-km-z]+")


def is_demand_key(key: str) -> bool:
    return _DEMAND.fullmatch(key) is not None


def validate_any(key: str, value: bytes, stored: bytes | None = None) -> None:
    """Raise ``ProtocolError`` unless ``value`` may be stored under ``key`` (replacing ``stored``)."""
    if not is_demand_key(key):
        validate_record(key, value, stored)
        return
    report = validate_demand_record(key, value)
    if stored is not None:
        try:
            old = decode_report(stored)
        except ProtocolError:
            return
        if old.seq >= report.seq:
            raise ProtocolError(f"demand report seq {report.seq} is not above stored {old.seq}", code=ErrorCode.STALE)


def select_any(key: str, values: Sequence[bytes]) -> int:
    """Index of the best valid value (highest seq)."""
    if not is_demand_key(key):
        return select_record(key, values)
    best, best_seq, error = -1, -1, None
    for i, value in enumerate(values):
        try:
            seq = validate_demand_record(key, value).seq
        except ProtocolError as e:
            error = e
            continue
        if seq > best_seq:
            best, best_seq = i, seq
    if best < 0:
        raise error or ProtocolError("no valid demand report", code=ErrorCode.BAD_FIELD)
    return best
