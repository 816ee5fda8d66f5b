"""Double-entry credit: accounts, operator-signed grants, and the moves between them.

Credit is conserved like money. It enters only through a grant the ledger operator signs with
the ledger's key (``Ledger.grant``); a receipt moves ``amount`` from its client's account into
escrow when it is appended (refused if the client cannot pay); settling its epoch releases the
escrow to the server's account, or back to the clients when audit evidence withholds the server.
So at every commit::

    sum(account balances) + sum(amounts of receipts in unsettled epochs) == sum(grants)

and two colluding keys can only move credit they already hold. Every quantity is at most the
sum of grants, which ``grant`` keeps at or below 2**63 - 1, so BIGINT columns never overflow;
sums are taken in Python ints, never by SQL.

A grant's signed body (kind ``ledger-grant``) is canonical msgpack of
``{amount, ledger, peer, seq, time_ms, type: "ledger_grant"}`` (``seq`` = 1, 2, ... per ledger).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Connection, bindparam, func, insert, select, update

from moeswarm.errors import ConfigError
from moeswarm.protocol import canonical, peer_id_to_str, public_key_from_peer_id, verify

from ._chain import MAX_STORED_INT
from ._errors import LedgerCorrupt
from ._models import Account, Entry, Grant, Settlement

GRANT_KIND: Final = "ledger-grant"


def grant_body(ledger: bytes, peer: bytes, amount: int, seq: int, time_ms: int) -> bytes:
    """The canonical bytes the ledger key signs for a grant."""
    return canonical({"amount": amount, "ledger": ledger, "peer": peer, "seq": seq, "time_ms": time_ms,
                      "type": "ledger_grant"})


def grant_verifies(ledger: bytes, record: bytes, sig: bytes) -> bool:
    return verify(public_key_from_peer_id(ledger), GRANT_KIND, record, sig)


@dataclass(frozen=True)
class GrantRecord:
    """One grant as stored: who got how much, signed by the ledger."""

    seq: int
    peer: bytes
    amount: int
    time_ms: int
    record: bytes  # grant_body(...)
    sig: bytes

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "peer": peer_id_to_str(self.peer), "amount": self.amount,
                "time_ms": self.time_ms, "record": self.record.hex(), "sig": self.sig.hex()}


def check_grant_amount(amount: int, granted: int) -> None:
    if amount < 1:
        raise ConfigError(f"a grant is a positive number of credits, not {amount}")
    if granted + amount > MAX_STORED_INT:
        raise ConfigError(f"granting {amount} would bring all grants to {granted + amount}, above the "
                          f"ledger's limit of {MAX_STORED_INT} credits")


def total_granted(conn: Connection) -> int:
    return sum(int(a) for a in conn.execute(select(Grant.amount)).scalars())


def balances_of(conn: Connection, peers: Iterable[bytes]) -> dict[bytes, int]:
    """Spendable balances of ``peers`` (peers without an account are absent)."""
    wanted = list(dict.fromkeys(peers))
    out: dict[bytes, int] = {}
    for i in range(0, len(wanted), 500):
        chunk = wanted[i : i + 500]
        out.update((bytes(p), int(b)) for p, b in conn.execute(
            select(Account.peer, Account.balance).where(Account.peer.in_(chunk))))
    return out


def apply_deltas(conn: Connection, deltas: Mapping[bytes, int], now_ms: int) -> None:
    """Add ``deltas`` (peer -> signed credits) to the accounts, creating missing ones.

    The caller holds the chain head's lock and has checked that no balance goes negative."""
    changed = {p: d for p, d in deltas.items() if d}
    if not changed:
        return
    held = balances_of(conn, changed)
    for peer, delta in changed.items():
        new = held.get(peer, 0) + delta
        if not 0 <= new <= MAX_STORED_INT:  # conservation makes this unreachable; never store a wrong sum
            raise LedgerCorrupt(f"account {peer_id_to_str(peer)} would hold {new} credits: the stored balances "
                                "no longer add up (run `moeswarm-ledger verify`)")
    updates = [{"p": p, "b": held[p] + d, "t": now_ms} for p, d in changed.items() if p in held]
    if updates:
        conn.execute(update(Account).where(Account.peer == bindparam("p"))
                     .values(balance=bindparam("b"), updated_ms=bindparam("t")), updates)
    fresh = [{"peer": p, "balance": d, "updated_ms": now_ms} for p, d in changed.items() if p not in held]
    if fresh:
        conn.execute(insert(Account), fresh)


def escrowed(conn: Connection) -> int:
    """Credits paid by receipts whose epoch is not settled yet."""
    settled = set(conn.execute(select(Settlement.epoch)).scalars())
    total = 0
    for epoch, amount in conn.execute(select(Entry.epoch, Entry.amount).where(Entry.amount > 0)):
        if epoch not in settled:
            total += int(amount)
    return total


@dataclass(frozen=True)
class Standing:
    """What the ledger knows of one peer: its balance and the calls it paid for (verified work)."""

    peer: bytes
    balance: int  # spendable credits
    paid: int  # credits it paid for calls appended at or after ``since_ms``
    receipts: int  # those calls

    @property
    def funded(self) -> bool:
        return self.balance > 0

    def to_json(self) -> dict[str, Any]:
        return {"peer": peer_id_to_str(self.peer), "balance": self.balance, "paid": self.paid,
                "receipts": self.receipts, "funded": self.funded}


def standing_of(conn: Connection, peers: Iterable[bytes], since_ms: int) -> dict[bytes, Standing]:
    wanted = list(dict.fromkeys(peers))
    held = balances_of(conn, wanted)
    paid: dict[bytes, list[int]] = {}
    for i in range(0, len(wanted), 500):
        chunk = wanted[i : i + 500]
        rows = conn.execute(select(Entry.client, Entry.amount).where(Entry.client.in_(chunk))
                            .where(Entry.received_ms >= since_ms))
        for client, amount in rows:
            s = paid.setdefault(bytes(client), [0, 0])
            s[0] += int(amount)
            s[1] += 1
    return {p: Standing(p, held.get(p, 0), *paid.get(p, (0, 0))) for p in wanted}


def top_payers(conn: Connection, since_ms: int, limit: int) -> list[bytes]:
    """The clients that paid the most for calls appended at or after ``since_ms``, most first.

    Only an order: SQLite sums as a float here (``total``), PostgreSQL as NUMERIC; the exact
    figures come from ``standing_of``."""
    total = func.sum(Entry.amount) if conn.dialect.name == "postgresql" else func.total(Entry.amount)
    rows = conn.execute(select(Entry.client, total.label("paid")).where(Entry.received_ms >= since_ms)
                        .where(Entry.amount > 0).group_by(Entry.client)
                        .order_by(total.desc(), Entry.client).limit(limit))
    return [bytes(r.client) for r in rows]


def count_grants(conn: Connection) -> int:
    return int(conn.execute(select(func.count()).select_from(Grant)).scalar_one())


def accounts_problem(conn: Connection, ledger: bytes) -> str | None:
    """What is wrong with the grants and accounts, or None: every grant signed by ``ledger`` over
    its row, and every balance equal to what the grants, the entries and the settlements make it
    (granted - paid as client + earned as a paid server + refunds of withheld servers' receipts)."""
    from ._models import Evidence

    expected: dict[bytes, int] = {}
    for g in conn.execute(select(Grant).order_by(Grant.id)).all():  # .all(): no cursor left open on return
        if not grant_verifies(ledger, g.record, g.sig) or g.record != grant_body(
                ledger, bytes(g.peer), int(g.amount), int(g.id), int(g.created_ms)):
            return f"grant {g.id}: its signature or fields do not verify"
        expected[bytes(g.peer)] = expected.get(bytes(g.peer), 0) + int(g.amount)
    settled = set(conn.execute(select(Settlement.epoch)).scalars().all())
    withheld = {(int(e), bytes(s)) for e, s in conn.execute(select(Evidence.epoch, Evidence.server)).all()}
    for client, server, epoch, amount in conn.execute(select(Entry.client, Entry.server, Entry.epoch, Entry.amount)
                                                      .where(Entry.amount > 0)):  # read to the end
        client, server, amount = bytes(client), bytes(server), int(amount)
        expected[client] = expected.get(client, 0) - amount
        if epoch in settled:
            payee = client if (int(epoch), server) in withheld else server
            expected[payee] = expected.get(payee, 0) + amount
    held = {bytes(p): int(b) for p, b in conn.execute(select(Account.peer, Account.balance)).all()}
    for peer in sorted(set(expected) | set(held)):
        if held.get(peer, 0) != expected.get(peer, 0):
            return (f"account {peer_id_to_str(peer)} holds {held.get(peer, 0)} credits; its grants, receipts and "
                    f"settlements make it {expected.get(peer, 0)}")
    return None
