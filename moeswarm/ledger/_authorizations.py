"""Charges of gateways to the people they serve, under spending authorizations (issue 30).

A gateway (or anyone on its behalf) posts ``POST /v1/gateway-charges`` with msgpack
``{authorization: bin, usage: bin}``: the person's signed ``SpendingAuthorization`` and their
latest signed ``UsageAck`` (``moeswarm.protocol._spending``). Under the chain head's lock the ledger
moves ``usage.tokens x price_per_token - already charged`` credits from the person's account to the
gateway's, and remembers the new total per authorization (``ledger_gateway_charges``). So:

- the gateway's fee is the price the person signed; it can charge only for tokens the person
  acknowledged (``bad_signature``), never more than ``max_credits`` in all (``exceeds_authorization``),
  never once the ledger's clock has passed ``expires_ms`` (``authorization_expired``);
- a replayed or older acknowledgement charges nothing (``duplicate``): totals only grow;
- a person cannot take back what they acknowledged: the signed acknowledgement is all the ledger
  needs, whatever the person says afterwards;
- credit is conserved: each charge is one move between two accounts, and ``accounts_problem``
  replays the charges with the grants and receipts (``charge_deltas``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, select, update

from moeswarm.protocol import peer_id_to_str

from ._accounts import apply_deltas, balances_of
from ._charges import CHARGED, ChargeResult, decode_charge
from ._models import GatewayCharge

__all__ = ["charge"]


def charge(ledger: Any, authorization: bytes, usage: bytes) -> ChargeResult:
    """Apply one gateway charge to ``ledger`` (a ``moeswarm.ledger.Ledger``); see the module docstring."""
    checked = decode_charge(authorization, usage)
    if isinstance(checked, ChargeResult):
        return checked
    auth, ack = checked
    credits = ack.tokens * auth.price_per_token
    if credits > auth.max_credits:
        return ChargeResult("exceeds_authorization", message=f"{ack.tokens} tokens at {auth.price_per_token} "
                            f"credits are {credits} credits, above the authorized {auth.max_credits}")
    with ledger.write() as conn:
        ledger.head_in(conn, lock=True)  # receipts, grants and settlements take it too: balances hold still
        now = ledger.clock()
        if now >= auth.expires_ms:
            return ChargeResult("authorization_expired", message=f"the authorization expired at {auth.expires_ms} "
                                f"(ledger time {now})")
        row = conn.execute(select(GatewayCharge).where(GatewayCharge.authorization_id == auth.id)).one_or_none()
        before = int(row.charged) if row is not None else 0
        if credits <= before:
            return ChargeResult("duplicate", charged=before)
        moved = credits - before
        if balances_of(conn, [auth.person]).get(auth.person, 0) < moved:
            return ChargeResult("insufficient_funds", charged=before,
                                message=f"{peer_id_to_str(auth.person)} cannot pay {moved} credits")
        apply_deltas(conn, {auth.person: -moved, auth.gateway: moved}, now)
        values = {"charged": credits, "tokens": ack.tokens, "usage": ack.encode(), "updated_ms": now}
        if row is None:
            conn.execute(insert(GatewayCharge).values(authorization_id=auth.id, person=auth.person,
                                                      gateway=auth.gateway, authorization=auth.encode(), **values))
        else:
            conn.execute(update(GatewayCharge).where(GatewayCharge.authorization_id == auth.id).values(**values))
    return ChargeResult(CHARGED, charged=credits, moved=moved)
