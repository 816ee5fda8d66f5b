"""Ed25519 identities, libp2p-compatible peer IDs, and domain-separated signatures.

A peer ID is the libp2p peer ID of the node's Ed25519 key: the identity multihash
(code 0x00) of the protobuf ``PublicKey{Type=Ed25519(1), Data=<32 bytes>}``. On the wire it
travels as those 38 raw bytes; in text (DHT keys, logs) as base58btc (``12D3KooW...``).
"""

from __future__ import annotations

import os
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from moeswarm.errors import ConfigError, ProtocolError

from ._limits import DOMAIN_PREFIX, PEER_ID_SIZE, PUBLIC_KEY_SIZE, SIGNATURE_SIZE, ErrorCode
from ._wire import canonical

# identity multihash (code 0x00, length 36) of protobuf {1: varint 1 (Ed25519), 2: bytes[32]}
PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}


def b58encode(data: bytes) -> str:
    """Bitcoin-alphabet base58 (base58btc, without the multibase ``z`` prefix)."""
    zeros = len(data) - len(data.lstrip(b"\0"))
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    return "1" * zeros + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    """Inverse of ``b58encode``; ``ValueError`` on characters outside the alphabet."""
    n = 0
    for c in text:
        if c not in _B58_INDEX:
            raise ValueError(f"{c!r} is not a base58btc character")
        n = n * 58 + _B58_INDEX[c]
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * zeros + body


def peer_id_from_public_key(public_key: bytes) -> bytes:
    """The 38-byte peer ID of a 32-byte Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_SIZE:
        raise ConfigError(f"an Ed25519 public key has {PUBLIC_KEY_SIZE} bytes, not {len(public_key)}")
    return PEER_ID_PREFIX + bytes(public_key)


def is_peer_id(value: bytes) -> bool:
    """Whether ``value`` is an Ed25519 identity-multihash peer ID (the only kind v1 accepts)."""
    return len(value) == PEER_ID_SIZE and value.startswith(PEER_ID_PREFIX)


def public_key_from_peer_id(peer_id: bytes) -> bytes:
    """The Ed25519 public key embedded in a peer ID; ``ProtocolError`` (4) if it has none."""
    if not is_peer_id(peer_id):
        raise ProtocolError("not an Ed25519 identity peer ID", code=ErrorCode.BAD_FIELD)
    return peer_id[len(PEER_ID_PREFIX) :]


def peer_id_to_str(peer_id: bytes) -> str:
    """The base58btc text form of a peer ID, as libp2p prints it."""
    return b58encode(peer_id)


def peer_id_from_str(text: str) -> bytes:
    """Parse the base58btc form; ``ProtocolError`` (4) unless it is an Ed25519 peer ID."""
    try:
        raw = b58decode(text)
    except ValueError:
        raise ProtocolError(f"peer ID {text!r} is not base58btc", code=ErrorCode.BAD_FIELD) from None
    if not is_peer_id(raw) or b58encode(raw) != text:
        raise ProtocolError(f"{text!r} is not an Ed25519 peer ID", code=ErrorCode.BAD_FIELD)
    return raw


def signing_payload(kind: str, payload: bytes) -> bytes:
    """The exact bytes an Ed25519 signature of ``kind`` covers: prefix, kind, NUL, payload."""
    return DOMAIN_PREFIX + kind.encode("ascii") + b"\0" + payload


class Identity:
    """An Ed25519 private key with its public key and peer ID. Keep it secret."""

    __slots__ = ("_key", "public_key", "peer_id")

    def __init__(self, key: ed25519.Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key: bytes = key.public_key().public_bytes_raw()
        self.peer_id: bytes = peer_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls.from_seed(os.urandom(32))

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a 32-byte Ed25519 seed (RFC 8032 private key)."""
        if len(seed) != 32:
            raise ConfigError(f"an Ed25519 seed has 32 bytes, not {len(seed)}")
        return cls(ed25519.Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    def seed(self) -> bytes:
        """The 32-byte seed, for storing the key; handle with care."""
        return self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @property
    def peer_id_str(self) -> str:
        """The base58btc peer ID."""
        return peer_id_to_str(self.peer_id)

    def sign(self, kind: str, payload: bytes) -> bytes:
        """Sign ``payload`` (canonical bytes) under the domain of ``kind``."""
        return self._key.sign(signing_payload(kind, payload))

    def sign_body(self, kind: str, body: Any) -> bytes:
        """Sign the canonical msgpack encoding of ``body`` under the domain of ``kind``."""
        return self.sign(kind, canonical(body))

    def __repr__(self) -> str:
        return f"Identity({self.peer_id_str})"


def verify(public_key: bytes, kind: str, payload: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the key's Ed25519 signature of ``payload`` under ``kind``."""
    if len(public_key) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
        return False
    try:
        key = ed25519.Ed25519PublicKey.from_public_bytes(bytes(public_key))
        key.verify(bytes(signature), signing_payload(kind, payload))
    except (InvalidSignature, ValueError):
        return False
    return True


def verify_body(public_key: bytes, kind: str, body: Any, signature: bytes) -> bool:
    """``verify`` over the canonical encoding of ``body``."""
    return verify(public_key, kind, canonical(body), signature)
