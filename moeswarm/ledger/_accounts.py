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

from sqlalchemy import Connection, and_, bindparam, exists, func, insert, literal_column, select, union_all, update

from moeswarm.errors import ConfigError, ProtocolError
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
    """What the ledger knows of one peer: its balance, the calls it paid for and what it earned.

    ``standing`` is what demand reports are weighted by: credit this peer paid out and did not
    get back, ``paid - earned`` since ``since_ms``, at most its lifetime ``paid - earned``, never
    below 0 (receipts whose server was withheld by audit evidence, i.e. refunded, count on
    neither side). Credit paid to a colluder and paid back nets to 0, so keys passing one credit
    around have no standing however often it goes round; and since ``paid - earned`` over a
    key's lifetime is at most the grants it received, a set of keys holds at most as much
    standing, all together, as the grants it was given: standing costs what it buys
    (``protocol_spec/security.md``, "Standing")."""

    peer: bytes
    balance: int  # spendable credits
    paid: int  # credits it paid for calls appended at or after ``since_ms``
    receipts: int  # those calls
    earned: int = 0  # credits paid to it as a server for calls appended at or after ``since_ms``
    standing: int = 0  # max(0, min(paid - earned, lifetime paid - lifetime earned))

    @property
    def funded(self) -> bool:
        return self.balance > 0

    def to_json(self) -> dict[str, Any]:
        return {"peer": peer_id_to_str(self.peer), "balance": self.balance, "paid": self.paid,
                "receipts": self.receipts, "earned": self.earned, "standing": self.standing,
                "funded": self.funded}


def _withheld(conn: Connection) -> set[tuple[int, bytes]]:
    from ._models import Evidence

    return {(int(e), bytes(s)) for e, s in conn.execute(select(Evidence.epoch, Evidence.server)).all()}


def standing_of(conn: Connection, peers: Iterable[bytes], since_ms: int) -> dict[bytes, Standing]:
    wanted = list(dict.fromkeys(peers))
    held = balances_of(conn, wanted)
    withheld = _withheld(conn)
    # per peer: [paid, receipts, earned] since since_ms, then [paid, earned] over its lifetime
    sums: dict[bytes, list[int]] = {}
    for i in range(0, len(wanted), 500):
        chunk = wanted[i : i + 500]
        for side, column in ((0, Entry.client), (1, Entry.server)):
            rows = conn.execute(select(column, Entry.server, Entry.epoch, Entry.amount, Entry.received_ms)
                                .where(column.in_(chunk)).where(Entry.amount > 0))
            for peer, server, epoch, amount, received in rows:
                if (int(epoch), bytes(server)) in withheld:
                    continue  # refunded to the client: paid by nobody, earned by nobody
                s = sums.setdefault(bytes(peer), [0, 0, 0, 0, 0])
                if received >= since_ms:
                    s[2 * side] += int(amount)
                    s[1] += 1 - side
                s[3 + side] += int(amount)
    out = {}
    for p in wanted:
        paid, receipts, earned, life_paid, life_earned = sums.get(p, (0, 0, 0, 0, 0))
        out[p] = Standing(p, held.get(p, 0), paid, receipts, earned,
                          max(0, min(paid - earned, life_paid - life_earned)))
    return out


def top_payers(conn: Connection, since_ms: int, limit: int) -> list[bytes]:
    """The peers that paid out the most credit they did not get back (``paid - earned``) for calls
    appended at or after ``since_ms``, most first; refunded receipts count on neither side.

    Only an order: SQLite sums as a float here (``total``), PostgreSQL as NUMERIC; the exact
    figures (also bounded by the lifetime figure) come from ``standing_of``."""
    from ._models import Evidence

    refunded = exists().where(and_(Evidence.epoch == Entry.epoch, Evidence.server == Entry.server))
    counted = and_(Entry.received_ms >= since_ms, Entry.amount > 0, ~refunded)
    flows = union_all(
        select(Entry.client.label("peer"), Entry.amount.label("x")).where(counted),
        select(Entry.server.label("peer"), (literal_column("0") - Entry.amount).label("x")).where(counted),
    ).subquery()
    total = func.sum(flows.c.x) if conn.dialect.name == "postgresql" else func.total(flows.c.x)
    rows = conn.execute(select(flows.c.peer, total.label("net")).group_by(flows.c.peer).having(total > 0)
                        .order_by(total.desc(), flows.c.peer).limit(limit))
    return [bytes(r.peer) for r in rows]


def count_grants(conn: Connection) -> int:
    return int(conn.execute(select(func.count()).select_from(Grant)).scalar_one())


def accounts_problem(conn: Connection, ledger: bytes) -> str | None:
    """What is wrong with the grants and accounts, or None: every grant signed by ``ledger`` over
    its row, and every balance equal to what the grants, the entries and the settlements make it
    (granted - paid as client + earned as a paid server + refunds of withheld servers' receipts
    - charged by gateways + charged as a gateway)."""
    expected: dict[bytes, int] = {}
    for g in conn.execute(select(Grant).order_by(Grant.id)).all():  # .all(): no cursor left open on return
        if not grant_verifies(ledger, g.record, g.sig) or g.record != grant_body(
                ledger, bytes(g.peer), int(g.amount), int(g.id), int(g.created_ms)):
            return f"grant {g.id}: its signature or fields do not verify"
        expected[bytes(g.peer)] = expected.get(bytes(g.peer), 0) + int(g.amount)
    settled = set(conn.execute(select(Settlement.epoch)).scalars().all())
    withheld = _withheld(conn)
    for client, server, epoch, amount in conn.execute(select(Entry.client, Entry.server, Entry.epoch, Entry.amount)
                                                      .where(Entry.amount > 0)):  # read to the end
        client, server, amount = bytes(client), bytes(server), int(amount)
        expected[client] = expected.get(client, 0) - amount
        if epoch in settled:
            payee = client if (int(epoch), server) in withheld else server
            expected[payee] = expected.get(payee, 0) + amount
    from ._charges import charge_deltas  # gateway charges: moves between two accounts

    try:
        charges = charge_deltas(conn)
    except ProtocolError as e:
        return str(e)
    for peer, delta in charges.items():
        expected[peer] = expected.get(peer, 0) + delta
    held = {bytes(p): int(b) for p, b in conn.execute(select(Account.peer, Account.balance)).all()}
    for peer in sorted(set(expected) | set(held)):
        if held.get(peer, 0) != expected.get(peer, 0):
            return (f"account {peer_id_to_str(peer)} holds {held.get(peer, 0)} credits; its grants, receipts and "
                    f"settlements make it {expected.get(peer, 0)}")
    return None
