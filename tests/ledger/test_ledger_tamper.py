"""Tampering: each attack is caught by ingestion or by ``verify``, which names the entry and the fault.

The stored-data attacks write to the database directly, as someone with database access but
without the ledger's key (or the peers' keys) could."""

from __future__ import annotations

from dataclasses import replace

import pytest
from click.testing import CliRunner
from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from moeswarm.ledger import Ledger, Reason, entry_hash, receipt_id, verify_chain
from moeswarm.ledger._store import ENTRIES, HEAD
from moeswarm.ledger.cli import main
from moeswarm.protocol import CountersignedReceipt, Identity, SignatureKind, canonical, countersign, encode, receipt_body

from ledger_support import Peers, fund, receipt


@pytest.fixture
def filled(ledger: Ledger) -> Ledger:
    ledger.ingest(Peers().funded(ledger).receipts(6))
    assert verify_chain(ledger).ok
    return ledger


def _rows(ledger: Ledger) -> list:
    with ledger.read() as conn:
        return list(conn.execute(select(ENTRIES).order_by(ENTRIES.c.position)))


def _rechain(ledger: Ledger, start: int) -> None:
    """Recompute entry hashes from ``start`` on, as a forger covering their tracks would."""
    rows = _rows(ledger)
    prev = rows[start - 2].entry_hash if start > 1 else bytes(32)
    with ledger.engine.begin() as conn:
        for row in rows[start - 1:]:
            h = entry_hash(prev, row.position, row.received_ms, row.record)
            conn.execute(update(ENTRIES).where(ENTRIES.c.position == row.position).values(prev_hash=prev, entry_hash=h))
            prev = h


def _overwrite(ledger: Ledger, position: int, cr: CountersignedReceipt) -> None:
    """Replace an entry's receipt, every column consistent with it, and recompute the chain."""
    r = cr.receipt
    with ledger.engine.begin() as conn:
        conn.execute(update(ENTRIES).where(ENTRIES.c.position == position).values(
            record=encode(cr), receipt_id=receipt_id(r), client=r.client, server=r.server, request_id=r.request_id,
            model_id=r.model_id, layer=r.layer, tokens=r.tokens, pairs=r.pairs, expert_flops=r.expert_flops,
            time_ms=r.time_ms, seq=r.seq))
    _rechain(ledger, position)


def _problem(ledger: Ledger) -> str:
    report = verify_chain(ledger)
    assert report.problem is not None
    return str(report.problem)


def test_flipped_byte_in_a_stored_receipt(filled: Ledger) -> None:
    row = _rows(filled)[3]
    record = bytearray(row.record)
    record[len(record) // 2] ^= 0x01
    with filled.engine.begin() as conn:
        conn.execute(update(ENTRIES).where(ENTRIES.c.position == 4).values(record=bytes(record)))
    problem = _problem(filled)
    assert problem.startswith(f"entry 4 (receipt {row.receipt_id.hex()[:16]})")
    assert "entry hash mismatch" in problem
    _rechain(filled, 4)  # the forger recomputes the chain: the signatures still give it away
    assert _problem(filled).startswith("entry 4")


def test_reordered_entries(filled: Ledger) -> None:
    with filled.engine.begin() as conn:
        for old, new in ((2, -2), (3, 2), (-2, 3)):
            conn.execute(update(ENTRIES).where(ENTRIES.c.position == old).values(position=new))
    problem = _problem(filled)
    assert problem.startswith("entry 2") and "does not link" in problem


def test_dropped_entry_in_the_middle(filled: Ledger) -> None:
    with filled.engine.begin() as conn:
        conn.execute(delete(ENTRIES).where(ENTRIES.c.position == 3))
    assert _problem(filled).startswith("entry 4") and "entries were removed" in _problem(filled)


def test_dropped_last_entry_is_caught_by_the_signed_head(filled: Ledger) -> None:
    with filled.engine.begin() as conn:
        conn.execute(delete(ENTRIES).where(ENTRIES.c.position == 6))
    problem = _problem(filled)
    assert problem.startswith("head 6") and "chain ends at entry 5" in problem
    # moving the head back without the ledger's key does not help
    row = _rows(filled)[-1]
    with filled.engine.begin() as conn:
        conn.execute(update(HEAD).values(position=5, entry_hash=row.entry_hash))
    assert "signature does not verify" in _problem(filled)


def test_replayed_old_receipt(filled: Ledger) -> None:
    old = _rows(filled)[0]
    [again] = filled.ingest([old.record])
    assert (again.status, again.position) == ("duplicate", 1)
    assert filled.head().position == 6
    with pytest.raises(IntegrityError), filled.engine.begin() as conn:  # a copy written straight to the table
        conn.execute(insert(ENTRIES).values({**old._asdict(), "position": 7}))
    assert verify_chain(filled).ok


def test_forged_server_signature(ledger: Ledger) -> None:
    client, server, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    good = receipt(client, server, seq=5)
    forged = countersign(client, replace(good.receipt, sig=mallory.sign(
        SignatureKind.RECEIPT, canonical(receipt_body(good.receipt)))))
    [result] = ledger.ingest([forged])
    assert (result.status, result.reason) == ("rejected", Reason.BAD_SERVER_SIGNATURE)
    ledger.ingest(Peers().funded(ledger).receipts(3))
    # written into the table directly, chain hashes recomputed: verify names it
    _overwrite(ledger, 2, forged)
    problem = _problem(ledger)
    assert problem.startswith("entry 2") and problem.endswith("bad server signature")


def test_inflated_flops(ledger: Ledger) -> None:
    client, server = Identity.generate(), Identity.generate()
    fund(ledger, client)
    honest = receipt(client, server, seq=1)
    # a colluding client and server both sign a receipt that claims ten times the work
    inflated = receipt(client, server, seq=2, flops=honest.receipt.expert_flops * 10)
    results = ledger.ingest([honest, inflated])
    assert [r.reason for r in results] == ["", Reason.FLOPS_EXCEED_FORMULA]
    # the column edited in the table
    with ledger.engine.begin() as conn:
        conn.execute(update(ENTRIES).where(ENTRIES.c.position == 1).values(expert_flops=10**12))
    assert "column expert_flops" in _problem(ledger)
    # the record edited too (and the chain recomputed): the signatures no longer verify
    bigger = replace(honest, receipt=replace(honest.receipt, expert_flops=10**12))
    _overwrite(ledger, 1, bigger)
    problem = _problem(ledger)
    assert problem.startswith("entry 1") and problem.endswith("bad server signature")


def test_cli_verify_names_the_first_bad_entry(filled: Ledger) -> None:
    runner = CliRunner()
    ok = runner.invoke(main, ["verify", "--db", filled.url.render_as_string(hide_password=False)])
    assert ok.exit_code == 0, ok.output
    assert "ok: 6 entries" in ok.output
    with filled.engine.begin() as conn:
        conn.execute(update(ENTRIES).where(ENTRIES.c.position == 5).values(received_ms=1))
    bad = runner.invoke(main, ["verify", "--db", filled.url.render_as_string(hide_password=False)])
    assert bad.exit_code == 1
    assert "BAD entry 5 (receipt" in bad.output


def test_edited_balance_or_grant_is_caught(ledger: Ledger, clock) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import update as sql_update

    from moeswarm.ledger._models import Account, Grant

    peers = Peers().funded(ledger)
    ledger.ingest(peers.receipts(4))
    assert verify_chain(ledger).ok
    rich = peers.clients[0].peer_id
    with ledger.engine.begin() as conn:
        conn.execute(sql_update(Account).where(Account.peer == rich).values(balance=Account.balance + 1))
    problem = _problem(ledger)
    assert problem.startswith("accounts") and "holds" in problem
    with ledger.engine.begin() as conn:
        conn.execute(sql_update(Account).where(Account.peer == rich).values(balance=Account.balance - 1))
        conn.execute(sql_update(Grant).where(Grant.id == 1).values(amount=Grant.amount * 2))
    assert _problem(ledger).startswith("accounts") and "grant 1" in _problem(ledger)
