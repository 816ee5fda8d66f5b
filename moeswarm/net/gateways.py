"""Gateways: backbones that serve other people's OpenAI-API requests, and their signed DHT records.

A backbone started with ``--gateway`` writes::

    /moeswarm/v1/gateway/<peer id, base58btc>

    {type: "gateway", peer_id, public_key, url, models: [model id, ...], free_slots, max_batch,
     price_per_token, rtt_us, seq, expires_at_ms,
     sig: the peer's Ed25519 signature (kind ``gateway``) over canonical(the map without sig)}

and registers as a provider of ``/moeswarm/v1/gateway``. ``url`` is its API (``http(s)://host:port``,
``/v1/...`` below it); ``free_slots`` of ``max_batch`` places in its batch are free; a person pays
``price_per_token`` credits per generated token (the figure a spending authorization signs);
``rtt_us`` is the median round trip it measured to the expert holders it calls (0: none measured
yet). A reader (``read_gateways``) keeps the valid records of at most ``MAX_GATEWAY_PEERS``
providers; ``protocol_spec/gateway.md`` has the format with vectors.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from ..errors import SwarmError
from ..protocol import (
    ErrorCode,
    Identity,
    canonical,
    is_peer_id,
    peer_id_from_public_key,
    peer_id_from_str,
    peer_id_to_str,
    verify,
)
from ..protocol._codec import MODEL_ID_RE
from ..protocol._limits import (
    MAX_MODEL_ID_BYTES,
    MAX_RECORD_BYTES,
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
)
from ..protocol._wire import Fields, bad, check_text, unpack
from ._signed import select_newest, validate_peer_record

log = logging.getLogger(__name__)

GATEWAY_KIND: Final = "gateway"
"""Signature domain of gateway records (after the protocol's ``moeswarm/v1/`` prefix)."""
GATEWAY_PROVIDER_KEY: Final = "/moeswarm/v1/gateway"
"""Every gateway provides this key."""
MAX_GATEWAY_MODELS: Final = 8
MAX_URL_BYTES: Final = 256
MAX_GATEWAY_PEERS: Final = 32
"""Providers of the gateway key a reader asks for and reads in one pass."""
URL_RE: Final = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(:[0-9]{1,5})?(/[A-Za-z0-9._~\-/]*)?")
_KEY = re.compile(r"/moeswarm/v1/gateway/([1-9A-HJ-NP-Za-km-z]+)")


@dataclass(frozen=True)
class GatewayRecord:
    """A gateway's signed statement: where its API is, what it serves, how loaded, at what price."""

    peer_id: bytes
    public_key: bytes
    url: str  # the OpenAI-compatible API, e.g. http://203.0.113.5:8000
    models: tuple[str, ...]  # model ids it serves
    free_slots: int  # places free in its batch now
    max_batch: int  # places in its batch
    price_per_token: int  # credits per generated token a person pays it
    rtt_us: int  # median measured round trip to the holders it calls, microseconds (0: not measured)
    seq: int
    expires_at_ms: int
    sig: bytes = b""

    def body(self) -> dict[str, Any]:
        return {"expires_at_ms": self.expires_at_ms, "free_slots": self.free_slots, "max_batch": self.max_batch,
                "models": list(self.models), "peer_id": self.peer_id, "price_per_token": self.price_per_token,
                "public_key": self.public_key, "rtt_us": self.rtt_us, "seq": self.seq, "type": "gateway",
                "url": self.url}

    def signed(self, identity: Identity) -> GatewayRecord:
        return replace(self, sig=identity.sign(GATEWAY_KIND, canonical(self.body())))

    def verifies(self) -> bool:
        try:
            return (peer_id_from_public_key(self.public_key) == self.peer_id
                    and verify(self.public_key, GATEWAY_KIND, canonical(self.body()), self.sig))
        except SwarmError:
            return False

    def encode(self) -> bytes:
        return canonical({**self.body(), "sig": self.sig})

    @property
    def peer(self) -> str:
        return peer_id_to_str(self.peer_id)

    @classmethod
    def decode(cls, data: bytes) -> GatewayRecord:
        """``ProtocolError`` for anything that is not a well-formed record (the signature is not checked)."""
        if len(data) > MAX_RECORD_BYTES:
            bad(f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}", code=ErrorCode.FRAME_TOO_LARGE)
        f = Fields(unpack(data), "gateway")
        if f.raw("type") != "gateway":
            bad("not a gateway record")
        peer = f.bin("peer_id")
        if not is_peer_id(peer):
            bad("gateway.peer_id is not an Ed25519 peer ID")
        models = tuple(check_text(m, "models[]", max_bytes=MAX_MODEL_ID_BYTES, pattern=MODEL_ID_RE)
                       for m in f.array("models", lo=1, hi=MAX_GATEWAY_MODELS))
        max_batch = f.uint("max_batch", lo=1, hi=1 << 20)
        return cls(peer, f.bin("public_key", size=PUBLIC_KEY_SIZE), f.text("url", max_bytes=MAX_URL_BYTES, pattern=URL_RE),
                   models, f.uint("free_slots", hi=max_batch), max_batch, f.uint("price_per_token", hi=1 << 40),
                   f.uint("rtt_us", hi=1 << 40), f.uint("seq"), f.uint("expires_at_ms"), f.bin("sig", size=SIGNATURE_SIZE))


def sign_gateway(identity: Identity, url: str, models: Sequence[str], *, free_slots: int, max_batch: int,
                 price_per_token: int, rtt_us: int, seq: int, expires_at_ms: int) -> GatewayRecord:
    return GatewayRecord(identity.peer_id, identity.public_key, url, tuple(models), free_slots, max_batch,
                         price_per_token, rtt_us, seq, expires_at_ms).signed(identity)


def gateway_key(peer_id: bytes) -> str:
    return f"{GATEWAY_PROVIDER_KEY}/{peer_id_to_str(peer_id)}"


def is_gateway_key(key: str) -> bool:
    return _KEY.fullmatch(key) is not None


def validate_gateway(key: str, value: bytes, stored: bytes | None = None, *, now_ms: int | None = None) -> GatewayRecord:
    """Accept a gateway record for ``key`` or raise ``ProtocolError``: size (3), decoding (4), the key
    names the signer (9), signature (9), expiry (15), too-distant expiry (4), and a ``seq`` above a
    still-valid ``stored`` record's (14)."""
    return validate_peer_record("gateway record", _KEY, GatewayRecord.decode, key, value, stored, now_ms=now_ms)


def select_gateway(key: str, values: Sequence[bytes]) -> int:
    """Index of the valid gateway record with the highest seq (the first on a tie)."""
    return select_newest("gateway record", validate_gateway, key, values)


async def read_gateways(dht: Any, model_id: str | None = None, *, max_peers: int = MAX_GATEWAY_PEERS) -> list[GatewayRecord]:
    """The valid records of at most ``max_peers`` gateways (serving ``model_id``, if given), in provider order."""
    try:
        providers = await dht.find_providers(GATEWAY_PROVIDER_KEY, max_peers)
    except SwarmError as e:
        log.info("find_providers for gateways failed: %s", e)
        return []

    async def get(peer: str) -> GatewayRecord | None:
        try:
            key = gateway_key(peer_id_from_str(peer))
            value = await dht.get(key)
            return None if value is None else validate_gateway(key, value)
        except SwarmError as e:  # ProtocolError is one
            log.info("gateway record of %s rejected: %s", peer, e)
            return None

    found = await asyncio.gather(*(get(p) for p in list(dict.fromkeys(providers))[:max_peers]))
    return [r for r in found if r is not None and (model_id is None or model_id in r.models)]


__all__ = [
    "GATEWAY_PROVIDER_KEY",
    "GatewayRecord",
    "gateway_key",
    "is_gateway_key",
    "read_gateways",
    "select_gateway",
    "sign_gateway",
    "validate_gateway",
]
