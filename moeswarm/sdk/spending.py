"""Paying gateways from the client: one spending authorization per gateway, acknowledgements as tokens arrive.

``Authorizer.headers(record)`` is what a request to a gateway carries: the person's authorization
for that gateway (signed once, at the price the gateway announced, for at most ``max_credits``,
expiring ``ttl_s`` after signing) as ``X-Moeswarm-Authorization``, and an acknowledgement of every
token received under it so far as ``X-Moeswarm-Usage`` (a gateway serves the next request only once
the tokens it streamed before are acknowledged). ``received(n)`` counts tokens as they arrive;
``close()`` sends the last acknowledgement (``POST /v1/gateway/usage``). Header values are
unpadded base64url of the records' canonical msgpack (``protocol_spec/gateway.md``).
"""

from __future__ import annotations

import base64
import http.client
import time
from typing import Any

from ..net.gateways import GatewayRecord
from ..protocol import Identity
from ..protocol._spending import (
    SpendingAuthorization,
    acknowledge_usage,
    authorize_spending,
)

AUTHORIZATION_HEADER = "X-Moeswarm-Authorization"
USAGE_HEADER = "X-Moeswarm-Usage"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Authorizer:
    def __init__(self, identity: Identity, model_id: str, *, max_credits: int | None = None, ttl_s: float = 3600.0,
                 default_tokens: int = 256) -> None:
        self.identity, self.model_id, self.ttl_s = identity, model_id, ttl_s
        self.max_credits, self.default_tokens = max_credits, default_tokens
        self.authorizations: dict[bytes, SpendingAuthorization] = {}  # by gateway peer id
        self.tokens: dict[bytes, int] = {}  # tokens received, by authorization id
        self.current: tuple[GatewayRecord, SpendingAuthorization] | None = None

    @classmethod
    def from_file(cls, path: str, model_id: str, **kw: Any) -> Authorizer:
        from .._keys import load_key_file

        return cls(load_key_file(path, create=False, what="identity file",
                                 missing_hint=" (give the key file your account is granted to)"), model_id, **kw)

    def authorization(self, record: GatewayRecord) -> SpendingAuthorization:
        auth = self.authorizations.get(record.peer_id)
        if auth is None or auth.price_per_token != record.price_per_token or auth.expires_ms <= time.time() * 1000:
            limit = self.max_credits or max(1, self.default_tokens * record.price_per_token)
            auth = self.authorizations[record.peer_id] = authorize_spending(
                self.identity, record.peer_id, self.model_id, max_credits=limit,
                price_per_token=record.price_per_token, expires_ms=int((time.time() + self.ttl_s) * 1000))
        return auth

    def headers(self, record: GatewayRecord) -> dict[str, str]:
        if record.price_per_token == 0:
            self.current = None
            return {}
        auth = self.authorization(record)
        self.current = (record, auth)
        out = {AUTHORIZATION_HEADER: b64(auth.encode())}
        if (done := self.tokens.get(auth.id, 0)) > 0:
            out[USAGE_HEADER] = b64(acknowledge_usage(self.identity, auth, done).encode())
        return out

    def received(self, n: int) -> None:
        if self.current is not None:
            auth = self.current[1]
            self.tokens[auth.id] = self.tokens.get(auth.id, 0) + n

    def close(self, timeout: float = 10.0) -> None:
        """Acknowledge what the current gateway streamed (best effort: a gateway that is gone is not paid)."""
        if self.current is None:
            return
        record, _ = self.current
        headers = self.headers(record)
        if USAGE_HEADER not in headers:
            return
        from urllib.parse import urlsplit

        parts = urlsplit(record.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname or "", parts.port, timeout=timeout)
        try:
            conn.request("POST", parts.path.rstrip("/") + "/v1/gateway/usage", body=b"", headers=headers)
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
