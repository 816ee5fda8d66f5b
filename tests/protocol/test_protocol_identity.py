"""Peer IDs agree with py-libp2p 0.8.1; base58btc is right; signatures interoperate."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pPrivateKey
from libp2p.crypto.ed25519 import Ed25519PublicKey as Libp2pPublicKey
from libp2p.peer.id import ID

from moeswarm import protocol as p
from moeswarm.errors import ConfigError, ProtocolError

seeds = st.binary(min_size=32, max_size=32)


@settings(max_examples=50, deadline=None)
@given(seeds)
def test_peer_id_equals_libp2p(seed: bytes) -> None:
    ident = p.Identity.from_seed(seed)
    libp2p_key = Libp2pPrivateKey.from_bytes(seed).get_public_key()
    assert libp2p_key.to_bytes() == ident.public_key
    expected = ID.from_pubkey(libp2p_key)
    assert ident.peer_id == expected.to_bytes()
    assert ident.peer_id_str == expected.to_base58()
    assert p.peer_id_from_str(expected.to_base58()) == ident.peer_id
    assert p.public_key_from_peer_id(ident.peer_id) == ident.public_key


@settings(max_examples=20, deadline=None)
@given(seeds, st.binary(max_size=100))
def test_signatures_interoperate_with_libp2p_keys(seed: bytes, payload: bytes) -> None:
    ident = p.Identity.from_seed(seed)
    libp2p_sig = Libp2pPrivateKey.from_bytes(seed).sign(p.signing_payload("auth", payload))
    assert p.verify(ident.public_key, "auth", payload, libp2p_sig)
    libp2p_pub = Libp2pPublicKey.from_bytes(ident.public_key)
    assert libp2p_pub.verify(p.signing_payload("auth", payload), ident.sign("auth", payload))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=50))
def test_base58_round_trip_and_matches_libp2p(data: bytes) -> None:
    text = p.b58encode(data)
    assert p.b58decode(text) == data
    assert ID(data).to_base58() == text


def test_bad_peer_id_text_rejected() -> None:
    ident = p.Identity.from_seed(bytes(32))
    for bad in ("", "0OIl", "Qm" + "1" * 44, ident.peer_id_str[:-1], "1" + ident.peer_id_str):
        with pytest.raises(ProtocolError) as info:
            p.peer_id_from_str(bad)
        assert info.value.code == p.ErrorCode.BAD_FIELD
    with pytest.raises(ProtocolError):
        p.public_key_from_peer_id(b"\x12\x20" + bytes(36))


def test_identity_misuse() -> None:
    with pytest.raises(ConfigError):
        p.Identity.from_seed(bytes(31))
    with pytest.raises(ConfigError):
        p.peer_id_from_public_key(bytes(33))
    ident = p.Identity.generate()
    assert p.Identity.from_seed(ident.seed()).peer_id == ident.peer_id
    assert ident.peer_id_str in repr(ident)


def test_verify_never_raises() -> None:
    ident = p.Identity.from_seed(bytes(32))
    sig = ident.sign("auth", b"x")
    assert p.verify(ident.public_key, "auth", b"x", sig)
    assert not p.verify(bytes(32), "auth", b"x", sig)
    assert not p.verify(b"\xff" * 32, "auth", b"x", sig)  # not a curve point
    assert not p.verify(ident.public_key, "auth", b"x", sig[:-1])
    assert not p.verify(ident.public_key[:-1], "auth", b"x", sig)
    assert not p.verify(ident.public_key, "receipt", b"x", sig)  # domain separation
