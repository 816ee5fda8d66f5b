"""The checks of a gateway charge that need no database, and the books' replay of stored charges
(``_authorizations.py`` applies charges; ``_accounts.accounts_problem`` replays them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Connection, select

from moeswarm.errors import ProtocolError
from moeswarm.protocol._spending import SpendingAuthorization, UsageAck, check_spending

from ._models import GatewayCharge

CHARGED: Final = "charged"
OUTCOMES: Final = (CHARGED, "duplicate", "malformed", "bad_signature", "authorization_expired",
                   "exceeds_authorization", "insufficient_funds")


@dataclass(frozen=True)
class ChargeResult:
    status: str  # one of OUTCOMES
    charged: int = 0  # credits this authorization has moved in all, after this charge
    moved: int = 0  # credits this charge moved
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "charged": self.charged, "moved": self.moved, "message": self.message}


def decode_charge(authorization: bytes, usage: bytes) -> tuple[SpendingAuthorization, UsageAck] | ChargeResult:
    """The checked pair, or why it is refused (no database, no lock)."""
    try:
        auth, ack = SpendingAuthorization.decode(authorization), UsageAck.decode(usage)
    except ProtocolError as e:
        return ChargeResult("malformed", message=str(e))
    try:
        check_spending(auth, ack)
    except ProtocolError as e:
        return ChargeResult("bad_signature", message=str(e))
    return auth, ack


def charge_deltas(conn: Connection) -> dict[bytes, int]:
    """What every charge moved, per account (for ``accounts_problem``); each row is checked against
    the signed acknowledgement and authorization it stores."""
    out: dict[bytes, int] = {}
    for row in conn.execute(select(GatewayCharge)).all():
        checked = decode_charge(bytes(row.authorization), bytes(row.usage))
        if isinstance(checked, ChargeResult):
            raise ProtocolError(f"gateway charge {bytes(row.authorization_id).hex()}: {checked.status}")
        auth, ack = checked
        if auth.id != bytes(row.authorization_id) or ack.tokens * auth.price_per_token != int(row.charged):
            raise ProtocolError(f"gateway charge {bytes(row.authorization_id).hex()} does not match its records")
        out[auth.person] = out.get(auth.person, 0) - int(row.charged)
        out[auth.gateway] = out.get(auth.gateway, 0) + int(row.charged)
    return out
