"""Paying a gateway: a person's spending authorization and their acknowledgements of tokens received.

authorization sig = Ed25519(person, "moeswarm/v1/spending-authorization\\0" + canonical(body))
    body = {type: "spending_authorization", person, gateway, model_id, max_credits, price_per_token,
            expires_ms, nonce (16 bytes)}
authorization id  = SHA-256("moeswarm/v1/spending-authorization-id\\0" + canonical(body))
usage sig         = Ed25519(person, "moeswarm/v1/gateway-usage\\0" + canonical(body))
    body = {type: "gateway_usage", authorization: <id>, tokens: every token received under it so far}

The person lets ``gateway`` charge their account ``tokens x price_per_token`` credits for the
tokens they acknowledge, never more than ``max_credits`` in all and never after ``expires_ms``
(the ledger's clock). ``price_per_token`` is the gateway's announced price, as the person saw it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from typing import Any, Final

from moeswarm.errors import ProtocolError, SwarmError

from ._codec import MODEL_ID_RE
from ._identity import Identity, is_peer_id, public_key_from_peer_id, verify
from ._limits import MAX_MODEL_ID_BYTES, SIGNATURE_SIZE, ErrorCode
from ._wire import Fields, bad, canonical, unpack

AUTHORIZATION_KIND: Final = "spending-authorization"
USAGE_KIND: Final = "gateway-usage"
_ID_PREFIX: Final = b"moeswarm/v1/spending-authorization-id\x00"
MAX_CREDITS: Final = 2**63 - 1
MAX_SPENDING_BYTES: Final = 1024
"""An encoded authorization or usage acknowledgement is at most this long."""


@dataclass(frozen=True)
class SpendingAuthorization:
    person: bytes  # peer ID of the account that pays
    gateway: bytes  # peer ID of the gateway allowed to charge it
    model_id: str
    max_credits: int  # the most it may charge in all
    price_per_token: int  # credits per acknowledged token (the gateway's announced price)
    expires_ms: int  # unix ms after which nothing more may be charged
    nonce: bytes  # 16 random bytes: two authorizations never share an id
    sig: bytes = b""

    def body(self) -> dict[str, Any]:
        return {"expires_ms": self.expires_ms, "gateway": self.gateway, "max_credits": self.max_credits,
                "model_id": self.model_id, "nonce": self.nonce, "person": self.person,
                "price_per_token": self.price_per_token, "type": "spending_authorization"}

    @property
    def id(self) -> bytes:
        return hashlib.sha256(_ID_PREFIX + canonical(self.body())).digest()

    def verifies(self) -> bool:
        try:
            return verify(public_key_from_peer_id(self.person), AUTHORIZATION_KIND, canonical(self.body()), self.sig)
        except SwarmError:
            return False

    def encode(self) -> bytes:
        return canonical({**self.body(), "sig": self.sig})

    @classmethod
    def decode(cls, data: bytes) -> SpendingAuthorization:
        """``ProtocolError`` (4) for anything that is not a well-formed authorization; the signature is not checked."""
        f = _fields(data, "spending_authorization")
        person, gateway = f.bin("person"), f.bin("gateway")
        if not (is_peer_id(person) and is_peer_id(gateway)):
            bad("spending_authorization.person and .gateway must be Ed25519 peer IDs")
        if person == gateway:
            bad("a gateway cannot be authorized to charge itself")
        return cls(person, gateway, f.text("model_id", max_bytes=MAX_MODEL_ID_BYTES, pattern=MODEL_ID_RE),
                   f.uint("max_credits", lo=1, hi=MAX_CREDITS), f.uint("price_per_token", hi=MAX_CREDITS),
                   f.uint("expires_ms", hi=MAX_CREDITS), f.bin("nonce", size=16), f.bin("sig", size=SIGNATURE_SIZE))


@dataclass(frozen=True)
class UsageAck:
    authorization: bytes  # the authorization's id
    tokens: int  # every token the person received under it so far
    sig: bytes = b""

    def body(self) -> dict[str, Any]:
        return {"authorization": self.authorization, "tokens": self.tokens, "type": "gateway_usage"}

    def verifies(self, person: bytes) -> bool:
        try:
            return verify(public_key_from_peer_id(person), USAGE_KIND, canonical(self.body()), self.sig)
        except SwarmError:
            return False

    def encode(self) -> bytes:
        return canonical({**self.body(), "sig": self.sig})

    @classmethod
    def decode(cls, data: bytes) -> UsageAck:
        f = _fields(data, "gateway_usage")
        return cls(f.bin("authorization", size=32), f.uint("tokens", hi=MAX_CREDITS), f.bin("sig", size=SIGNATURE_SIZE))


def _fields(data: bytes, kind: str) -> Fields:
    if len(data) > MAX_SPENDING_BYTES:
        bad(f"{kind} of {len(data)} bytes exceeds {MAX_SPENDING_BYTES}", code=ErrorCode.FRAME_TOO_LARGE)
    f = Fields(unpack(data), kind)
    if f.raw("type") != kind:
        bad(f"not a {kind}")
    return f


def authorize_spending(person: Identity, gateway: bytes, model_id: str, *, max_credits: int, price_per_token: int,
                       expires_ms: int, nonce: bytes | None = None) -> SpendingAuthorization:
    unsigned = SpendingAuthorization(person.peer_id, gateway, model_id, max_credits, price_per_token, expires_ms,
                                     nonce if nonce is not None else os.urandom(16))
    return replace(unsigned, sig=person.sign(AUTHORIZATION_KIND, canonical(unsigned.body())))


def acknowledge_usage(person: Identity, authorization: SpendingAuthorization, tokens: int) -> UsageAck:
    unsigned = UsageAck(authorization.id, tokens)
    return replace(unsigned, sig=person.sign(USAGE_KIND, canonical(unsigned.body())))


def check_spending(authorization: SpendingAuthorization, usage: UsageAck | None = None) -> None:
    """Both signatures by the person, and the acknowledgement of this authorization; ``ProtocolError`` 9/4."""
    if not authorization.verifies():
        raise ProtocolError("the spending authorization's signature does not verify", code=ErrorCode.AUTH_FAILED)
    if usage is not None:
        if usage.authorization != authorization.id:
            raise ProtocolError("the usage acknowledgement is of another authorization", code=ErrorCode.BAD_FIELD)
        if not usage.verifies(authorization.person):
            raise ProtocolError("the usage acknowledgement is not signed by the authorization's person",
                                code=ErrorCode.AUTH_FAILED)
