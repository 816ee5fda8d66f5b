"""Revision 0002 (double-entry) moves an existing ledger without losing a receipt or a chain link.

The old ledger is built at revision 0001 by Alembic itself and filled the way the 0001 code
appended (entry hashes chained, the head signed, a settled epoch), then opened by today's
``Ledger``, which upgrades it."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from ledger_support import EPOCH_MS, MODEL, SHAPE, T0, Clock, Peers, fund
from sqlalchemy import select, text

from moeswarm.ledger import Ledger, StoreConfig, settle_epoch, verify_chain
from moeswarm.ledger._chain import GENESIS_HASH, entry_hash, prepare
from moeswarm.ledger._db import MIGRATIONS, database_url, open_engine, write_tx
from moeswarm.ledger._models import VERSION_TABLE, Entry
from moeswarm.ledger._store import HEAD_KIND, head_payload
from moeswarm.protocol import Identity


def _old_ledger(url: str, key: Identity, receipts: list) -> list[tuple[int, bytes, bytes]]:
    """A ledger at revision 0001 holding ``receipts`` (two epochs); returns (position, receipt id, entry hash)."""
    engine = open_engine(database_url(url), create=True)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with write_tx(engine) as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
    out, prev, received = [], GENESIS_HASH, T0 + 10
    with write_tx(engine) as conn:
        for k, v in {"ledger_peer_id": key.peer_id.hex(), "epoch_ms": str(EPOCH_MS), "created_ms": str(T0),
                     "format": "1"}.items():
            conn.execute(text("INSERT INTO ledger_meta (key, value) VALUES (:k, :v)"), {"k": k, "v": v})
        conn.execute(text("INSERT INTO ledger_models (model_id, hidden, ffn, source, registered_ms) "
                          "VALUES (:m, :h, :f, 'client', :t)"), {"m": MODEL, "h": SHAPE.hidden, "f": SHAPE.ffn, "t": T0})
        for position, cr in enumerate(receipts, 1):
            if position == len(receipts) // 2 + 1:
                received = T0 + EPOCH_MS + 10  # the second half lands in the next epoch
            p = prepare(cr, {MODEL: SHAPE})
            h = entry_hash(prev, position, received, p.record)  # type: ignore[union-attr]
            r = cr.receipt
            conn.execute(text(
                "INSERT INTO ledger_entries (position, entry_hash, prev_hash, received_ms, epoch, record, receipt_id, "
                "client, server, request_id, model_id, layer, tokens, pairs, expert_flops, time_ms, seq) VALUES "
                "(:position, :h, :prev, :received, :epoch, :record, :rid, :client, :server, :request_id, :model, "
                ":layer, :tokens, :pairs, :flops, :time_ms, :seq)"),
                {"position": position, "h": h, "prev": prev, "received": received, "epoch": received // EPOCH_MS,
                 "record": p.record, "rid": p.receipt_id, "client": r.client, "server": r.server,  # type: ignore[union-attr]
                 "request_id": r.request_id, "model": r.model_id, "layer": r.layer, "tokens": r.tokens,
                 "pairs": r.pairs, "flops": r.expert_flops, "time_ms": r.time_ms, "seq": r.seq})
            out.append((position, p.receipt_id, h))  # type: ignore[union-attr]
            prev = h
        conn.execute(text("INSERT INTO ledger_head (id, position, entry_hash, received_ms, sealed_ms, sig) "
                          "VALUES (1, :p, :h, :r, 0, :s)"),
                     {"p": len(receipts), "h": prev, "r": received,
                      "s": key.sign(HEAD_KIND, head_payload(key.peer_id, len(receipts), prev))})
        version = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
    engine.dispose()
    assert version == "0001"
    return out


def test_upgrade_keeps_every_receipt_and_link(db_url: str, ledger_key: Identity) -> None:
    peers = Peers()
    receipts = peers.receipts(10)
    before = _old_ledger(db_url, ledger_key, receipts)
    clock = Clock(T0 + 2 * EPOCH_MS + 5)
    with Ledger(StoreConfig(db_url), ledger_key, clock=clock) as led:  # opening upgrades through 0002 to 0003 (gateway charges)
        with led.read() as conn:
            version = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
            rows = conn.execute(select(Entry.position, Entry.receipt_id, Entry.entry_hash, Entry.amount)
                                .order_by(Entry.position)).all()
        assert version == "0003"
        assert [(r.position, r.receipt_id, r.entry_hash) for r in rows] == before  # every receipt, every link
        assert {r.amount for r in rows} == {0}  # the old ledger minted their credit; none moves now
        report = verify_chain(led)
        assert report.ok and report.entries == 10, report.problem
        assert led.models()[MODEL] == SHAPE  # a shape without per-call limits: token_limit by frame size
        statement = settle_epoch(led, T0 // EPOCH_MS)  # an old epoch still settles, paying nobody credit
        assert statement.receipts == 5 and all(b.credits == 0 for b in statement.balances)
        # the chain goes on under the new rules
        [refused] = led.ingest(peers.receipts(1))
        assert refused.reason == "insufficient_funds"
        fund(led, *peers.clients)
        [accepted] = led.ingest(peers.receipts(1))
        assert accepted.status == "accepted" and accepted.position == 11
        assert verify_chain(led).ok
