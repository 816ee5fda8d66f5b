"""Verification of a stored ledger: the whole chain, every signature, every settlement.

``verify_chain`` streams the entries in position order and stops at the first problem, which
it names (position, receipt id, what is wrong). ``check_entry`` is the per-entry check that
settlement also runs over the epoch it settles.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, select

from moeswarm.errors import ProtocolError
from moeswarm.protocol import BatchedReceipt, CountersignedReceipt, decode

from ._accounts import accounts_problem
from ._chain import (
    GENESIS_HASH,
    ModelShape,
    content_problem,
    encode_record,
    entry_hash,
    receipt_id_of_body,
    signature_problem,
)
from ._evidence import EvidenceRecord
from ._merkle import leaf_hash, merkle_root
from ._models import Evidence, Settlement
from ._settle import Statement
from ._store import ENTRIES, Ledger

_COLUMNS = ("client", "server", "request_id", "model_id", "layer", "tokens", "pairs", "expert_flops",
            "time_ms", "seq")


@dataclass(frozen=True)
class Problem:
    """The first thing found wrong."""

    what: str  # "entry", "head", "settlement", "evidence" or "accounts"
    position: int | None  # chain position of the entry (or the epoch, for a settlement)
    receipt_id: bytes | None
    message: str

    def __str__(self) -> str:
        rid = f" (receipt {self.receipt_id.hex()[:16]})" if self.receipt_id else ""
        where = f"{self.what} {self.position}" if self.position is not None else self.what
        return f"{where}{rid}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    entries: int  # entries checked
    settlements: int
    evidence: int
    problem: Problem | None

    @property
    def ok(self) -> bool:
        return self.problem is None


def check_entry(row: Row[Any], *, position: int, prev_hash: bytes, prev_received: int, epoch_ms: int,
                shapes: Mapping[str, ModelShape]) -> str | None:
    """What is wrong with one stored entry, given the entry before it, or None."""
    if row.position != position:
        return (f"expected entry {position} here, found {row.position}: entries were removed"
                if row.position > position else "entries out of order")
    if row.prev_hash != prev_hash:
        return "does not link to the entry before it (entries reordered, removed or inserted)"
    if entry_hash(row.prev_hash, row.position, row.received_ms, row.record) != row.entry_hash:
        return "its record or received time changed after it was appended (entry hash mismatch)"
    if row.received_ms < prev_received:
        return "received before the entry preceding it"
    if row.epoch != row.received_ms // epoch_ms:
        return "epoch column does not match its received time"
    try:
        cr = decode(row.record)
    except ProtocolError as e:
        return f"record is not a valid countersigned receipt: {e}"
    if not isinstance(cr, (CountersignedReceipt, BatchedReceipt)):
        return "record is not a countersigned or batched receipt"
    body, record = encode_record(cr)
    if record != row.record:
        return "record is not a canonical countersigned receipt"
    if receipt_id_of_body(body) != row.receipt_id:
        return "receipt id does not match its record"
    bad_sig = signature_problem(cr, body)
    if bad_sig is not None:
        return bad_sig.replace("_", " ")
    for name in _COLUMNS:
        if getattr(row, name) != getattr(cr.receipt, name):
            return f"column {name} = {getattr(row, name)!r} differs from its signed record"
    problem = content_problem(cr.receipt, shapes, limits=False)
    if problem is not None and problem[0] == "rejected":
        return f"{problem[1].replace('_', ' ')}: {problem[2]}"
    return None


def verify_chain(ledger: Ledger, *, ledger_key: bytes | None = None, batch: int = 2000) -> VerifyReport:
    """Check every entry, the signed head, every settlement statement and evidence record, every
    grant's signature, and that every account holds what its grants, receipts and settlements make.

    ``ledger_key`` (the ledger's peer ID) pins whose signatures the head and statements must
    carry; by default the key recorded in the database is trusted."""
    key = ledger_key or ledger.ledger_peer_id
    if key != ledger.ledger_peer_id:
        return VerifyReport(0, 0, 0, Problem("head", None, None, "the database names another ledger key"))
    shapes = ledger.models()
    position, prev, prev_received = 0, GENESIS_HASH, 0
    leaves: dict[int, list[bytes]] = {}
    ends: dict[int, tuple[int, int, bytes]] = {}  # epoch -> (first, last position, last entry hash)
    with ledger.read() as conn:
        head = ledger.head_in(conn)
        result = conn.execution_options(yield_per=batch).execute(select(ENTRIES).order_by(ENTRIES.c.position))
        try:
            for row in result:
                position += 1
                message = check_entry(row, position=position, prev_hash=prev, prev_received=prev_received,
                                      epoch_ms=ledger.epoch_ms, shapes=shapes)
                if message is not None:
                    return VerifyReport(position - 1, 0, 0, Problem("entry", row.position, row.receipt_id, message))
                prev, prev_received = row.entry_hash, row.received_ms
                leaves.setdefault(row.epoch, []).append(leaf_hash(row.record))
                first = ends.get(row.epoch, (row.position, 0, b""))[0]
                ends[row.epoch] = (first, row.position, row.entry_hash)
        finally:
            result.close()  # a server-side cursor on PostgreSQL
        if head.position != position or head.entry_hash != prev:
            return VerifyReport(position, 0, 0, Problem(
                "head", head.position, None, f"the signed head names entry {head.position} but the chain ends at "
                f"entry {position} (entries removed from the end, or the head was altered)"))
        if not ledger.head_verifies(head, key):
            return VerifyReport(position, 0, 0, Problem("head", head.position, None,
                                                        "the head's signature does not verify"))
        statements = conn.execute(select(Settlement).order_by(Settlement.epoch)).all()
        evidence = conn.execute(select(Evidence).order_by(Evidence.id)).all()
        books = accounts_problem(conn, key)
    for s in statements:
        problem = _check_statement(s, key, leaves.get(s.epoch, []), ends.get(s.epoch))
        if problem is not None:
            return VerifyReport(position, 0, 0, Problem("settlement", s.epoch, None, problem))
    for ev in evidence:
        record = EvidenceRecord.decode(ev.record)
        if record.ledger != key or not record.verifies() or record.receipt_id != ev.receipt_id:
            return VerifyReport(position, len(statements), 0, Problem(
                "evidence", ev.id, ev.receipt_id, "evidence record's signature or fields do not verify"))
    if books is not None:
        return VerifyReport(position, len(statements), len(evidence), Problem("accounts", None, None, books))
    return VerifyReport(position, len(statements), len(evidence), None)


def _check_statement(s: Row[Any], key: bytes, leaves: list[bytes],
                     span: tuple[int, int, bytes] | None) -> str | None:
    try:
        st = Statement.decode(s.statement)
    except Exception as e:  # noqa: BLE001 - stored bytes that do not parse
        return f"statement does not parse: {e}"
    if st.ledger != key or not st.verifies():
        return "statement signature does not verify"
    if st.epoch != s.epoch or st.merkle_root != s.merkle_root:
        return "statement differs from its row"
    if st.receipts != len(leaves) or st.merkle_root != merkle_root(leaves):
        return f"its Merkle root does not match the epoch's {len(leaves)} stored receipts"
    first, last, h = span if span else (0, 0, bytes(32))
    if (st.first_position, st.last_position, st.chain_hash) != (first, last, h):
        return "its chain span does not match the stored entries"
    return None
