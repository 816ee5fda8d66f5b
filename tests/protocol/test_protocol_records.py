"""DHT announcement keys and validation: forgery, replay, expiry and key mismatches."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from moeswarm import protocol as p
from moeswarm.errors import ConfigError, ProtocolError

SERVER = p.Identity.from_seed(bytes(range(32, 64)))
OTHER = p.Identity.from_seed(bytes(range(64, 96)))
NOW = 1_700_000_000_000
E = p.ErrorCode


def _record(ident: p.Identity = SERVER, **changes: Any) -> p.Announcement:
    fields: dict[str, Any] = dict(
        model_id="org/model", layers=(10, 20), experts=(0, 63), endpoints=["tcp+tls://10.0.0.1:4443"],
        capacity_bytes=2**34, throughput=5000, load_permille=0, software="moeswarm/0.1.0", seq=5,
        expires_at_ms=NOW + 3_600_000)
    fields.update(changes)
    return p.sign_announcement(ident, **fields)


def _key(layer: int = 12, peer: bytes = SERVER.peer_id, model: str = "org/model") -> str:
    return p.announcement_key(model, layer, peer)


def _code(key: str, value: bytes, stored: Any = None, now: int = NOW) -> int:
    with pytest.raises(ProtocolError) as info:
        p.validate_record(key, value, stored, now_ms=now)
    return info.value.code


def test_keys() -> None:
    assert p.provider_key("org/model", 12) == "/moeswarm/v1/org/model/L12"
    key = _key()
    assert key == "/moeswarm/v1/org/model/L12/" + SERVER.peer_id_str
    assert p.parse_announcement_key(key) == ("org/model", 12, SERVER.peer_id)
    assert key.split("/")[1] == p.DHT_NAMESPACE  # the namespace libp2p dispatches on
    for bad in ("/moeswarm/v1/org/model/L012/" + SERVER.peer_id_str, "/moeswarm/v1/L1/x",
                "/moeswarm/v2/m/L1/" + SERVER.peer_id_str, "/moeswarm/v1/a b/L1/" + SERVER.peer_id_str,
                "/moeswarm/v1/m/L1/" + SERVER.peer_id_str + "x"):
        with pytest.raises(ProtocolError):
            p.parse_announcement_key(bad)
    with pytest.raises(ConfigError):
        p.provider_key("bad id", 1)
    assert len(p.provider_key("m" * 55, 2**32 - 1).encode()) == 80  # go-libp2p's provider key cap


def test_valid_record_accepted_for_every_layer_it_covers() -> None:
    value = p.encode(_record())
    for layer in (10, 15, 20):
        assert p.validate_record(_key(layer), value, now_ms=NOW).seq == 5
    assert _code(_key(9), value) == E.BAD_FIELD
    assert _code(_key(21), value) == E.BAD_FIELD


def test_wrong_key_rejected() -> None:
    # a record signed by OTHER for OTHER's peer ID, offered under SERVER's key
    assert _code(_key(), p.encode(_record(OTHER))) == E.AUTH_FAILED
    # SERVER's record claimed to be signed by OTHER's key
    forged = replace(_record(), public_key=OTHER.public_key)
    assert _code(_key(), p.encode(forged)) == E.AUTH_FAILED
    # OTHER's peer ID and key, SERVER's signature
    unsigned = replace(_record(), peer_id=OTHER.peer_id, public_key=OTHER.public_key)
    assert _code(_key(peer=OTHER.peer_id), p.encode(unsigned)) == E.AUTH_FAILED


def test_inflated_record_rejected() -> None:
    inflated = replace(_record(), throughput=10**9)  # edited after signing
    assert _code(_key(), p.encode(inflated)) == E.AUTH_FAILED


def test_replayed_older_seq_rejected() -> None:
    old, new = p.encode(_record(seq=5)), p.encode(_record(seq=6))
    assert p.validate_record(_key(), new, old, now_ms=NOW).seq == 6
    assert _code(_key(), old, new) == E.STALE
    assert _code(_key(), new, new) == E.STALE
    assert _code(_key(), old, p.decode(new)) == E.STALE  # stored given decoded
    garbage = b"not a record"
    assert p.validate_record(_key(), old, garbage, now_ms=NOW).seq == 5  # invalid stored ignored


def test_expired_record_rejected_and_expired_stored_ignored() -> None:
    value = p.encode(_record(expires_at_ms=NOW + 1000))
    assert p.validate_record(_key(), value, now_ms=NOW + 999).seq == 5
    assert _code(_key(), value, now=NOW + 1000) == E.EXPIRED
    newer_but_expired = p.encode(_record(seq=9, expires_at_ms=NOW + 10))
    assert p.validate_record(_key(), value, newer_but_expired, now_ms=NOW + 10).seq == 5


def test_expiry_too_far_ahead_rejected() -> None:
    day = 24 * 3600 * 1000
    ok = p.encode(_record(expires_at_ms=NOW + day + 5 * 60 * 1000))
    assert p.validate_record(_key(), ok, now_ms=NOW).seq == 5
    assert _code(_key(), p.encode(_record(expires_at_ms=NOW + 2 * day))) == E.BAD_FIELD


def test_record_size_and_type() -> None:
    many = ["tcp+tls://" + "h" * 230 + ".example:1"] * 8
    assert len(p.encode(_record(endpoints=many))) < 8192
    assert _code(_key(), p.encode(_record()) + bytes(8192)) == E.FRAME_TOO_LARGE
    assert _code(_key(), p.encode(p.Ping(1))) == E.BAD_FIELD
    assert _code(_key(), b"\xc1") == E.MALFORMED_FRAME


def test_select_record_picks_highest_valid_seq() -> None:
    values = [p.encode(_record(seq=s)) for s in (3, 8, 5)]
    forged_high = p.encode(replace(_record(seq=99), sig=bytes(64)))
    assert p.select_record(_key(), values + [forged_high], now_ms=NOW) == 1
    assert p.select_record(_key(), [b"junk", values[0]], now_ms=NOW) == 1
    with pytest.raises(ProtocolError):
        p.select_record(_key(), [b"junk", forged_high], now_ms=NOW)
    with pytest.raises(ConfigError):
        p.select_record(_key(), [], now_ms=NOW)


def test_a_record_of_several_blocks_is_valid_under_every_layer_of_each() -> None:
    """One node process announces several blocks (``more_blocks``): the record covers every layer
    of each (and is refused under a layer none holds); its signature covers them all."""
    record = _record(layers=(10, 11), experts=(0, 3), more_blocks=[((14, 14), (5, 5)), ((20, 21), (8, 9))])
    value = p.encode(record)
    for layer in (10, 11, 14, 20, 21):
        assert p.validate_record(_key(layer), value, now_ms=NOW).more_blocks == ((((14, 14), (5, 5))), ((20, 21), (8, 9)))
    for layer in (9, 12, 13, 15, 22):
        assert _code(_key(layer), value) == E.BAD_FIELD
    widened = replace(record, more_blocks=(((14, 14), (5, 6)), ((20, 21), (8, 9))))  # edited after signing
    assert _code(_key(14), p.encode(widened)) == E.AUTH_FAILED
    dropped = replace(record, more_blocks=())  # a reader that ignored the field could not verify it either
    assert _code(_key(10), p.encode(dropped)) == E.AUTH_FAILED
    assert p.encode(_record()) == p.encode(_record(more_blocks=()))  # one block: the wire map has no such key
    assert b"more_blocks" not in p.encode(_record())


def test_blocks_that_overlap_or_are_too_many_or_empty_are_refused() -> None:
    """A holder counted twice for one expert (overlapping blocks) would inflate its replicas; a
    record is bounded (``MAX_BLOCKS`` blocks in all); an empty range claims nothing."""
    overlap = p.encode(_record(layers=(10, 11), experts=(0, 3), more_blocks=[((11, 12), (3, 4))]))
    assert _code(_key(10), overlap) == E.BAD_FIELD
    twice = p.encode(_record(layers=(10, 10), experts=(0, 0), more_blocks=[((12, 12), (0, 0)), ((12, 12), (0, 0))]))
    assert _code(_key(10), twice) == E.BAD_FIELD
    most = [((L, L), (0, 0)) for L in range(1, p.MAX_BLOCKS)]  # the first block + 63 more
    assert p.validate_record(_key(0), p.encode(_record(layers=(0, 0), experts=(1, 1), more_blocks=most)), now_ms=NOW)
    more = [((L, L), (0, 0)) for L in range(1, p.MAX_BLOCKS + 1)]
    assert _code(_key(0), p.encode(_record(layers=(0, 0), experts=(1, 1), more_blocks=more))) == E.BAD_FIELD
    empty = p.encode(_record(layers=(10, 10), experts=(0, 0), more_blocks=[((12, 12), (5, 4))]))
    assert _code(_key(10), empty) == E.BAD_FIELD
    beyond = p.encode(_record(layers=(10, 10), experts=(0, 0), more_blocks=[((12, p.MAX_LAYER + 1), (0, 0))]))
    assert _code(_key(10), beyond) == E.BAD_FIELD
