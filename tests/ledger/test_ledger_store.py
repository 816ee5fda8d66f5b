"""Ingestion into the store, on SQLite and PostgreSQL: what is appended, what is refused and why."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import select

from moeswarm.errors import ConfigError
from moeswarm.ledger import DatabaseMissing, Ledger, Reason, StoreConfig, receipt_id, verify_chain
from moeswarm.ledger._models import VERSION_TABLE, Base, Entry
from moeswarm.protocol import Identity, SignatureKind, canonical, countersign, encode, receipt_body

from ledger_support import MODEL, SHAPE, Clock, Peers, call, fund, receipt


def test_accepts_a_batch_in_one_commit_and_chains_it(ledger: Ledger) -> None:
    peers = Peers().funded(ledger)
    batch = peers.receipts(6)
    results = ledger.ingest(batch)
    assert [r.status for r in results] == ["accepted"] * 6
    assert sorted(r.position or 0 for r in results) == [1, 2, 3, 4, 5, 6]
    assert [r.receipt_id for r in results] == [receipt_id(cr.receipt) for cr in batch]
    head = ledger.head()
    assert head.position == 6 and ledger.head_verifies(head)
    assert verify_chain(ledger).ok


def test_same_receipt_again_is_a_duplicate_and_a_no_op(ledger: Ledger) -> None:
    batch = Peers().funded(ledger).receipts(3)
    first = ledger.ingest(batch)
    again = ledger.ingest([encode(cr) for cr in batch])  # as bytes this time
    assert [r.status for r in again] == ["duplicate"] * 3
    assert [r.position for r in again] == [r.position for r in first]
    within = ledger.ingest([batch[0], batch[0]])
    assert [r.status for r in within] == ["duplicate", "duplicate"]
    assert ledger.head().position == 3


def test_duplicate_inside_one_new_batch(ledger: Ledger) -> None:
    cr = Peers().funded(ledger).receipts(1)[0]
    results = ledger.ingest([cr, cr])
    assert sorted(r.status for r in results) == ["accepted", "duplicate"]
    assert results[0].position == results[1].position == 1


def test_replay_same_request_id_other_content_is_rejected(ledger: Ledger) -> None:
    client, server = Identity.generate(), Identity.generate()
    fund(ledger, client)
    original = receipt(client, server, seq=10)
    ledger.ingest([original])
    # both keys re-sign the same request id with other content (a later seq, other outputs)
    replay = receipt(client, server, seq=11, request_id=original.receipt.request_id, seed=99)
    [result] = ledger.ingest([replay])
    assert (result.status, result.reason) == ("rejected", Reason.REPLAY)
    assert "entry 1" in result.message


def test_seq_reuse_and_regression_are_rejected(ledger: Ledger) -> None:
    client, server, newcomer = Identity.generate(), Identity.generate(), Identity.generate()
    fund(ledger, client, newcomer)
    ledger.ingest([receipt(client, server, seq=100_000)])
    [reused] = ledger.ingest([receipt(client, server, seq=100_000)])
    assert (reused.status, reused.reason) == ("rejected", Reason.SEQ_REUSED)
    window = ledger.config.seq_window
    [late] = ledger.ingest([receipt(client, server, seq=100_000 - window)])  # within the window: fine
    assert late.status == "accepted"
    [old] = ledger.ingest([receipt(client, server, seq=100_000 - window - 1)])
    assert (old.status, old.reason) == ("rejected", Reason.SEQ_REGRESSION)
    [other_pair] = ledger.ingest([receipt(newcomer, server, seq=1)])  # seqs are per pair
    assert other_pair.status == "accepted"


def test_bad_signatures_are_rejected(ledger: Ledger) -> None:
    client, server, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    good = receipt(client, server, seq=1)
    forged_server = replace(good, receipt=replace(good.receipt, sig=mallory.sign(
        SignatureKind.RECEIPT, canonical(receipt_body(good.receipt)))))
    forged_server = countersign(client, forged_server.receipt)  # the client countersigns the forgery
    bad_client = replace(good, client_sig=bytes(64))
    flipped = bytearray(encode(good))
    flipped[-70] ^= 1  # inside the server signature
    results = ledger.ingest([forged_server, bad_client, bytes(flipped), b"\x80junk"])
    assert [r.reason for r in results] == [Reason.BAD_SERVER_SIGNATURE, Reason.BAD_CLIENT_SIGNATURE,
                                           Reason.BAD_SERVER_SIGNATURE, Reason.MALFORMED]
    assert all(r.status == "rejected" for r in results)
    assert ledger.head().position == 0


def test_flops_above_the_formula_are_rejected_exact_is_accepted(ledger: Ledger) -> None:
    client, server = Identity.generate(), Identity.generate()
    fund(ledger, client)
    _, _, exact = call(client, server, seq=1, experts=(1, 4), tokens=3)
    assert exact.receipt.expert_flops == 6 * 8 * 16 * 6
    _, _, inflated = call(client, server, seq=2, experts=(1, 4), tokens=3, flops=6 * 8 * 16 * 6 + 1)
    results = ledger.ingest([exact, inflated])
    assert [r.status for r in results] == ["accepted", "rejected"]
    assert results[1].reason == Reason.FLOPS_EXCEED_FORMULA


def test_self_dealing_out_of_range_and_unknown_model(ledger: Ledger) -> None:
    me, other = Identity.generate(), Identity.generate()
    fund(ledger, me)
    results = ledger.ingest([receipt(me, me, seq=1), receipt(me, other, seq=2**63),
                             receipt(me, other, seq=3, model="nobody/knows")])
    assert [(r.status, r.reason) for r in results] == [
        ("rejected", Reason.SELF_DEALING), ("rejected", Reason.OUT_OF_RANGE), ("retry", Reason.UNKNOWN_MODEL)]
    assert not results[2].acknowledged
    ledger.register_model("nobody/knows", ledger.models()[MODEL])
    [later] = ledger.ingest([receipt(me, other, seq=3, model="nobody/knows")])
    assert later.status == "accepted"


def test_batch_order_changes_neither_chain_nor_results(db_url: str, ledger_key: Identity, tmp_path: Path) -> None:
    peers = Peers()
    batch = peers.receipts(8)
    batch.append(batch[2])  # a duplicate inside the batch
    heads = []
    for i, order in enumerate((batch, batch[::-1])):
        url = db_url if i == 0 else str(tmp_path / "other.db")
        with Ledger(StoreConfig(url, create=True), ledger_key, clock=Clock()) as led:
            led.register_model(MODEL, SHAPE)
            peers.funded(led)
            results = led.ingest(order)
            heads.append((led.head().entry_hash, sorted((r.receipt_id, r.position, r.status) for r in results)))
    assert heads[0] == heads[1]


def test_model_shape_conflict_is_refused(ledger: Ledger) -> None:
    shape = ledger.models()[MODEL]
    assert ledger.register_model(MODEL, shape) is False
    with pytest.raises(ConfigError, match="registered as hidden"):
        ledger.register_model(MODEL, replace(shape, ffn=shape.ffn * 2))


def test_reopen_keeps_everything_and_checks_the_key(db_url: str, ledger_key: Identity) -> None:
    with Ledger(StoreConfig(db_url, create=True), ledger_key) as led:
        led.register_model(MODEL, SHAPE)
        led.ingest(Peers().funded(led).receipts(4))
    with Ledger(StoreConfig(db_url)) as led:  # read-only: no key needed, no create
        assert led.head().position == 4 and verify_chain(led).ok
        assert led.ledger_peer_id == ledger_key.peer_id
    with pytest.raises(ConfigError, match="belongs to key"):
        Ledger(StoreConfig(db_url), Identity.generate())


def test_migrations_create_exactly_the_models(ledger: Ledger) -> None:
    with ledger.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}),
                                Base.metadata)
        version = conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalar()
    assert diff == []
    assert version == "0003"  # 0003: gateway charges (issue 30)


def test_missing_database_and_bad_urls(tmp_path: Path) -> None:
    with pytest.raises(DatabaseMissing, match="no ledger database"):
        Ledger(StoreConfig(str(tmp_path / "absent.db")))
    with pytest.raises(ConfigError, match="folder"):
        Ledger(StoreConfig(str(tmp_path / "no" / "such" / "dir.db"), create=True), Identity.generate())
    with pytest.raises(ConfigError, match="neither a file path nor a database URL"):
        Ledger(StoreConfig("postgresql://user@host:notaport/db"))
    with pytest.raises(ConfigError, match="no SQLAlchemy driver"):
        Ledger(StoreConfig("nosuchdb://x/y"))
    with pytest.raises(ConfigError, match="needs its key"):
        Ledger(StoreConfig(str(tmp_path / "new.db"), create=True))
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(DatabaseMissing, match="holds no ledger"):
        Ledger(StoreConfig(str(empty)))


def test_missing_postgres_database(pg_url: str) -> None:
    base, _, query = pg_url.partition("?")
    with pytest.raises(DatabaseMissing, match="does not exist"):
        Ledger(StoreConfig(base.rsplit("/", 1)[0] + "/no_such_db_" + os.urandom(4).hex() + "?" + query))


def test_stored_columns_mirror_the_record(ledger: Ledger) -> None:
    [cr] = Peers().funded(ledger).receipts(1, experts=(2, 5), tokens=3)
    ledger.ingest([cr])
    with ledger.read() as conn:
        row = conn.execute(select(Entry.__table__)).one()
    assert row.record == encode(cr)
    assert (row.pairs, row.tokens, row.expert_flops) == (6, 3, 6 * 8 * 16 * 6)


def test_records_are_the_canonical_encoding() -> None:
    from moeswarm.ledger._chain import encode_record

    for cr in Peers().receipts(5, experts=(0, 70_000, 2**31), tokens=3) + [receipt(
            Identity.generate(), Identity.generate(), seq=2**62, time_ms=2**40, layer=65_536)]:
        assert encode_record(cr) == (canonical(receipt_body(cr.receipt)), encode(cr))


def test_parallel_signature_checks_decide_the_same(db_url: str, ledger_key: Identity, tmp_path: Path) -> None:
    peers = Peers()
    batch = peers.receipts(300)
    batch[7] = replace(batch[7], client_sig=bytes(64))
    batch[250] = batch[3]
    outcomes = []
    for url, threads in ((db_url, 2), (str(tmp_path / "one.db"), 1)):
        with Ledger(StoreConfig(url, create=True, verify_threads=threads), ledger_key, clock=Clock()) as led:
            led.register_model(MODEL, SHAPE)
            peers.funded(led)
            outcomes.append(([(r.status, r.reason, r.position) for r in led.ingest(batch)], led.head().entry_hash))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0][7][1] == Reason.BAD_CLIENT_SIGNATURE and outcomes[0][0][250][0] == "duplicate"


def test_concurrent_appenders_keep_one_chain(db_url: str, ledger_key: Identity) -> None:
    """Two Ledger objects (as two processes would) append at once: the chain stays one."""
    with Ledger(StoreConfig(db_url, create=True), ledger_key) as first:
        first.register_model(MODEL, SHAPE)
        batches = [Peers().funded(first).receipts(10) for _ in range(16)]
    errors: list[BaseException] = []

    def append(mine: list) -> None:  # type: ignore[type-arg]
        try:
            with Ledger(StoreConfig(db_url), ledger_key) as led:
                for batch in mine:
                    assert all(r.status == "accepted" for r in led.ingest(batch))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=append, args=(batches[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    with Ledger(StoreConfig(db_url)) as led:
        report = verify_chain(led)
        assert report.ok and report.entries == 160


def test_tokens_and_pairs_are_capped_by_the_model(ledger: Ledger) -> None:
    """A receipt may claim no more than one call of the model: tokens up to its limit, pairs up to
    tokens x top-k. Signed by both sides and within the FLOPs formula, it is still refused."""
    import os as _os

    from moeswarm.ledger import ModelShape
    from moeswarm.protocol import Receipt, SignatureKind, canonical, countersign, receipt_body

    ledger.register_model("capped/model", ModelShape(8, 16, top_k=2, max_tokens=64))
    client, server = Identity.generate(), Identity.generate()
    fund(ledger, client)

    def claim(tokens: int, experts: int, pairs: int, seq: int):  # type: ignore[no-untyped-def]
        r = Receipt(request_id=_os.urandom(16), client=client.peer_id, server=server.peer_id, model_id="capped/model",
                    layer=0, experts=tuple(range(experts)), tokens=tokens, pairs=pairs,
                    expert_flops=6 * 8 * 16 * pairs, input_hash=bytes(32), output_hash=bytes(32), time_ms=1, seq=seq)
        return countersign(client, replace(r, sig=server.sign(SignatureKind.RECEIPT, canonical(receipt_body(r)))))

    results = ledger.ingest([claim(64, 2, 128, 1), claim(65, 1, 65, 2), claim(10, 4, 21, 3), claim(10, 4, 20, 4)])
    assert [(r.status, r.reason) for r in results] == [
        ("accepted", ""), ("rejected", Reason.EXCEEDS_MODEL_LIMITS), ("rejected", Reason.EXCEEDS_MODEL_LIMITS),
        ("accepted", "")]
    assert "at most 64 tokens and 2 experts per token" in results[1].message
    assert ModelShape(4096, 14336).token_limit == 64 * 2**20 // (2 * 4096)  # default: 16-bit rows in a largest frame
