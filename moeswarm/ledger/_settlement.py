"""Settling epochs, inclusion proofs, and balances: the store side of ``_settle`` and ``_merkle``.

An epoch is the set of entries the ledger received in ``[N * epoch_ms, (N + 1) * epoch_ms)``.
It can be settled once it has ended; settling verifies its entries, computes balances (servers
with audit evidence in that epoch are withheld), builds the Merkle tree, signs the statement,
stores it and seals the epoch: later appends always land after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, update

from moeswarm.errors import ConfigError
from moeswarm.protocol import (
    BatchedReceipt,
    CountersignedReceipt,
    decode,
    peer_id_from_str,
    peer_id_to_str,
)

from ._accounts import apply_deltas, balances_of
from ._chain import GENESIS_HASH, receipt_id
from ._errors import LedgerCorrupt
from ._merkle import inclusion_proof, leaf_hash, merkle_root, verify_inclusion
from ._models import Entry, Evidence, Grant, Settlement
from ._settle import Balance, Statement
from ._store import ENTRIES, HEAD, Ledger
from ._verify import check_entry


def epoch_balances(rows: list[Any], withheld: frozenset[bytes]) -> tuple[list[Balance], list[Balance]]:
    """(paid, withheld) per server from stored entries: the amounts their clients paid (Python ints)."""
    sums: dict[bytes, list[int]] = {}
    for r in rows:
        s = sums.setdefault(bytes(r.server), [0, 0, 0])
        s[0] += int(r.amount)
        s[1] += int(r.expert_flops)
        s[2] += 1
    out = sorted(Balance(server, *v) for server, v in sums.items())
    return [b for b in out if b.server not in withheld], [b for b in out if b.server in withheld]


def withheld_servers(conn: Any, epoch: int) -> frozenset[bytes]:
    return frozenset(conn.execute(select(Evidence.server).where(Evidence.epoch == epoch)).scalars())


def stored_statement(ledger: Ledger, epoch: int) -> Statement | None:
    with ledger.read() as conn:
        data = conn.execute(select(Settlement.statement).where(Settlement.epoch == epoch)).scalar()
    return Statement.decode(data) if data is not None else None


def settle_epoch(ledger: Ledger, epoch: int) -> Statement:
    """Settle ``epoch`` (once: a settled epoch returns its stored statement).

    Each receipt's client paid its ``amount`` into escrow when it was appended; settling pays the
    escrow to the servers' accounts, except for servers with audit evidence in the epoch, whose
    receipts' amounts go back to the clients that paid them."""
    if ledger.identity is None:
        raise ConfigError("settling signs a statement: it needs the ledger's key (--key)")
    if epoch < 0:
        raise ConfigError("epochs are numbered from 0")
    end = (epoch + 1) * ledger.epoch_ms
    now = ledger.clock()
    with ledger.write() as conn:
        head = ledger.head_in(conn, lock=True)  # first: settlers and appenders queue here
        held = conn.execute(select(Settlement.statement).where(Settlement.epoch == epoch)).scalar()
        if held is not None:
            return Statement.decode(held)
        if now < end:
            raise ConfigError(f"epoch {epoch} is still open for {(end - now + 999) // 1000} s "
                              f"(epochs last {ledger.epoch_ms // 1000} s)")
        rows = ledger.epoch_rows(conn, epoch)
        shapes = ledger.models()
        if rows:
            prev = conn.execute(select(ENTRIES.c.entry_hash, ENTRIES.c.received_ms)
                                .where(ENTRIES.c.position == rows[0].position - 1)).first()
            prev_hash, prev_received = (prev.entry_hash, prev.received_ms) if prev else (GENESIS_HASH, 0)
            for i, row in enumerate(rows):
                message = check_entry(row, position=rows[0].position + i, prev_hash=prev_hash,
                                      prev_received=prev_received, epoch_ms=ledger.epoch_ms, shapes=shapes)
                if message is not None:
                    raise LedgerCorrupt(f"entry {row.position}: {message}; run `moeswarm-ledger verify`",
                                        position=row.position)
                prev_hash, prev_received = row.entry_hash, row.received_ms
        withheld = withheld_servers(conn, epoch)
        paid, held_back = epoch_balances(rows, withheld)
        moves: dict[bytes, int] = {}
        for b in paid:
            moves[b.server] = moves.get(b.server, 0) + b.credits
        for r in rows:
            if r.server in withheld:
                moves[r.client] = moves.get(r.client, 0) + r.amount  # refunded: the work failed its audit
        apply_deltas(conn, moves, now)
        statement = Statement(
            ledger=ledger.ledger_peer_id, epoch=epoch, epoch_ms=ledger.epoch_ms, pricing=ledger.pricing.name,
            receipts=len(rows), first_position=rows[0].position if rows else 0,
            last_position=rows[-1].position if rows else 0, chain_hash=rows[-1].entry_hash if rows else bytes(32),
            merkle_root=merkle_root([leaf_hash(r.record) for r in rows]), balances=tuple(paid),
            withheld=tuple(held_back), settled_ms=now,
        ).signed(ledger.identity)
        conn.execute(insert(Settlement).values(epoch=epoch, merkle_root=statement.merkle_root,
                                               statement=statement.encode(), settled_ms=now))
        conn.execute(update(HEAD).where(HEAD.c.id == 1).values(sealed_ms=max(head.sealed_ms, end)))
    return statement


@dataclass(frozen=True)
class Proof:
    """That one receipt is a leaf of its epoch's Merkle tree (and, once settled, of the statement)."""

    receipt_id: bytes
    position: int
    epoch: int
    record: bytes  # the countersigned receipt: its leaf is leaf_hash(record)
    leaf_index: int
    tree_size: int
    path: tuple[bytes, ...]  # sibling hashes, bottom up (RFC 9162 audit path)
    merkle_root: bytes
    statement: Statement | None  # the signed settlement, or None while the epoch is unsettled

    def to_json(self) -> dict[str, Any]:
        return {"receipt_id": self.receipt_id.hex(), "position": self.position, "epoch": self.epoch,
                "record": self.record.hex(), "leaf_index": self.leaf_index, "tree_size": self.tree_size,
                "path": [p.hex() for p in self.path], "merkle_root": self.merkle_root.hex(),
                "statement": self.statement.to_json() if self.statement else None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Proof:
        try:
            st = d.get("statement")
            return cls(bytes.fromhex(d["receipt_id"]), int(d["position"]), int(d["epoch"]),
                       bytes.fromhex(d["record"]), int(d["leaf_index"]), int(d["tree_size"]),
                       tuple(bytes.fromhex(p) for p in d["path"]), bytes.fromhex(d["merkle_root"]),
                       Statement.from_json(st) if st else None)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not an inclusion proof: {e}") from None


def check_proof(proof: Proof, *, ledger_key: bytes | None = None) -> str | None:
    """What is wrong with a proof, or None when it proves inclusion (in the signed statement, if any)."""
    try:
        cr = decode(proof.record)
    except Exception as e:  # noqa: BLE001 - any decoding failure is a bad proof
        return f"record does not decode: {e}"
    if not isinstance(cr, (CountersignedReceipt, BatchedReceipt)) or receipt_id(cr.receipt) != proof.receipt_id:
        return "record is not the receipt the proof names"
    if not verify_inclusion(leaf_hash(proof.record), proof.leaf_index, proof.tree_size, proof.path,
                            proof.merkle_root):
        return "the path does not lead from the receipt to the Merkle root"
    st = proof.statement
    if st is None:
        return None
    if ledger_key is not None and st.ledger != ledger_key:
        return f"the statement is signed by {peer_id_to_str(st.ledger)}, not the expected ledger"
    if not st.verifies():
        return "the settlement statement's signature does not verify"
    if (st.merkle_root, st.receipts, st.epoch) != (proof.merkle_root, proof.tree_size, proof.epoch):
        return "the proof's root, size or epoch differ from the signed statement"
    return None


def prove(ledger: Ledger, receipt: str | bytes) -> Proof:
    """The inclusion proof of one receipt (id or unambiguous hex prefix) in its epoch's tree."""
    row = ledger.find(receipt)
    with ledger.read() as conn:
        records = conn.execute(select(Entry.position, Entry.record).where(Entry.epoch == row.epoch)
                               .order_by(Entry.position)).all()
        data = conn.execute(select(Settlement.statement).where(Settlement.epoch == row.epoch)).scalar()
    leaves = [leaf_hash(r.record) for r in records]
    index = [r.position for r in records].index(row.position)
    root = merkle_root(leaves)
    statement = Statement.decode(data) if data is not None else None
    if statement is not None and statement.merkle_root != root:
        raise LedgerCorrupt(f"epoch {row.epoch}'s stored receipts no longer match its signed statement",
                            position=row.position)
    return Proof(row.receipt_id, row.position, row.epoch, row.record, index, len(leaves),
                 tuple(inclusion_proof(leaves, index)), root, statement)


@dataclass(frozen=True)
class PeerBalance:
    """A peer's credit: spendable balance, earnings settled, pending (escrowed) and withheld."""

    peer: bytes
    settled: int  # credits earned in signed statements
    pending: int  # credits its clients paid into escrow in epochs not settled yet
    withheld: int  # credits withheld by statements because of audit evidence (refunded to clients)
    expert_flops: int  # all expert-FLOPs served, settled or not
    receipts: int
    evidence: int  # failed audits on record
    balance: int = 0  # spendable credits now: grants + settled earnings + refunds - what it paid
    granted: int = 0  # credits granted to it by the operator
    spent: int = 0  # credits it paid for calls as a client

    def to_json(self) -> dict[str, Any]:
        return {"peer": peer_id_to_str(self.peer), "balance": self.balance, "settled": self.settled,
                "pending": self.pending, "withheld": self.withheld, "granted": self.granted, "spent": self.spent,
                "expert_flops": self.expert_flops, "receipts": self.receipts, "evidence": self.evidence,
                "flagged": self.evidence > 0}


def top_contributors(ledger: Ledger, n: int = 20) -> list[tuple[bytes, int]]:
    """The ``n`` servers with the most settled credit, over every signed settlement: (peer, credits)."""
    totals: dict[bytes, int] = {}
    with ledger.read() as conn:
        for data in conn.execute(select(Settlement.statement)).scalars():
            for b in Statement.decode(data).balances:
                totals[b.server] = totals.get(b.server, 0) + b.credits
    return sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def peer_balance(ledger: Ledger, peer: str | bytes) -> PeerBalance:
    """The balance of a peer (base58 peer ID or raw bytes): as a server and as a client."""
    pid = peer_id_from_str(peer) if isinstance(peer, str) else peer
    settled = withheld = 0
    with ledger.read() as conn:
        settled_epochs = set()
        for data in conn.execute(select(Settlement.statement)).scalars():
            st = Statement.decode(data)
            settled_epochs.add(st.epoch)
            settled += sum(b.credits for b in st.balances if b.server == pid)
            withheld += sum(b.credits for b in st.withheld if b.server == pid)
        pending = flops = receipts = 0
        for epoch, amount, f in conn.execute(select(Entry.epoch, Entry.amount, Entry.expert_flops)
                                             .where(Entry.server == pid)):
            flops += int(f)
            receipts += 1
            if epoch not in settled_epochs:
                pending += int(amount)
        spent = sum(int(a) for a in conn.execute(select(Entry.amount).where(Entry.client == pid)).scalars())
        granted = sum(int(a) for a in conn.execute(select(Grant.amount).where(Grant.peer == pid)).scalars())
        balance = balances_of(conn, [pid]).get(pid, 0)
        evidence = conn.execute(select(func.count()).select_from(Evidence).where(Evidence.server == pid)).scalar_one()
    return PeerBalance(pid, settled, pending, withheld, flops, receipts, int(evidence), balance, granted, spent)


__all__ = ["Balance", "PeerBalance", "Proof", "check_proof", "epoch_balances", "peer_balance", "prove",
           "settle_epoch", "stored_statement", "withheld_servers"]
