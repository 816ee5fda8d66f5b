"""Settlement per epoch, the signed statement, Merkle trees and inclusion proofs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from dataclasses import replace
from fractions import Fraction

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from moeswarm.errors import ConfigError
from moeswarm.ledger import (
    FlatPrice,
    Ledger,
    PerExpertPrice,
    Proof,
    check_proof,
    credits,
    inclusion_proof,
    leaf_hash,
    merkle_root,
    node_hash,
    peer_balance,
    prove,
    settle_epoch,
    verify_chain,
    verify_inclusion,
)
from moeswarm.ledger.cli import main
from moeswarm.protocol import CountersignedReceipt, Identity, decode

from ledger_support import EPOCH_MS, GRANT, T0, Clock, Peers, fund, receipt


def _rfc9162_root(leaves: list[bytes]) -> bytes:
    """MTH from RFC 9162 section 2.1.1, written recursively as the RFC states it (the oracle)."""
    if len(leaves) == 1:
        return leaves[0]
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return node_hash(_rfc9162_root(leaves[:k]), _rfc9162_root(leaves[k:]))


@given(st.integers(1, 70), st.data())
@settings(max_examples=60, deadline=None)
def test_merkle_tree_is_rfc9162_and_every_proof_verifies(n: int, data: st.DataObject) -> None:
    leaves = [leaf_hash(i.to_bytes(4, "big")) for i in range(n)]
    root = merkle_root(leaves)
    assert root == _rfc9162_root(leaves)
    i = data.draw(st.integers(0, n - 1))
    path = inclusion_proof(leaves, i)
    assert verify_inclusion(leaves[i], i, n, path, root)
    assert not verify_inclusion(leaf_hash(b"other"), i, n, path, root)
    if n > 1:
        assert not verify_inclusion(leaves[i], (i + 1) % n, n, path, root)


def test_domain_separation_of_leaves_and_nodes() -> None:
    a, b = leaf_hash(b"a"), leaf_hash(b"b")
    assert node_hash(a, b) != leaf_hash(a + b)  # a node can never pass for a leaf
    assert leaf_hash(b"a") != hashlib.sha256(b"\x00a").digest()


def _fill(ledger: Ledger, clock: Clock) -> tuple[Peers, list[int]]:
    """Receipts in epochs 0 (of T0's hour) and the next one."""
    peers = Peers().funded(ledger)
    clock.ms = T0 + 10
    first = ledger.ingest(peers.receipts(5))
    clock.ms = T0 + EPOCH_MS + 10
    second = ledger.ingest(peers.receipts(3))
    return peers, [r.position or 0 for r in first + second]


def test_settle_an_epoch(ledger: Ledger, clock: Clock) -> None:
    peers, _ = _fill(ledger, clock)
    epoch = T0 // EPOCH_MS
    with pytest.raises(ConfigError, match="still open"):
        settle_epoch(ledger, epoch + 1)
    statement = settle_epoch(ledger, epoch)
    assert statement.verifies() and statement.ledger == ledger.ledger_peer_id
    assert (statement.receipts, statement.first_position, statement.last_position) == (5, 1, 5)
    flops = 6 * 8 * 16 * 2
    expected: dict[bytes, int] = {}
    for i in range(5):
        expected[peers.servers[i % 3].peer_id] = expected.get(peers.servers[i % 3].peer_id, 0) + flops
    assert {b.server: b.credits for b in statement.balances} == expected
    assert sum(b.expert_flops for b in statement.balances) == 5 * flops
    assert settle_epoch(ledger, epoch) == statement  # settled once
    assert not replace(statement, balances=statement.balances[1:]).verifies()
    assert verify_chain(ledger).ok


def test_settled_epochs_are_sealed(ledger: Ledger, clock: Clock) -> None:
    _fill(ledger, clock)
    clock.ms = T0 + 7 * EPOCH_MS
    later_epoch = T0 // EPOCH_MS + 5
    settle_epoch(ledger, later_epoch)  # an empty epoch, ended
    clock.ms = T0 + 2 * EPOCH_MS  # the clock goes back (another process, skew)
    [r] = ledger.ingest(Peers().funded(ledger).receipts(1))
    row = ledger.find(r.receipt_id or b"")
    assert row.epoch > later_epoch  # never lands in a settled epoch
    assert verify_chain(ledger).ok


def test_open_epoch_and_empty_epoch(ledger: Ledger, clock: Clock) -> None:
    clock.ms = T0 + 10
    with pytest.raises(ConfigError, match="still open"):
        settle_epoch(ledger, T0 // EPOCH_MS)
    clock.ms = T0 + EPOCH_MS
    empty = settle_epoch(ledger, T0 // EPOCH_MS)
    assert empty.receipts == 0 and empty.balances == () and empty.verifies()


def test_inclusion_proofs(ledger: Ledger, clock: Clock) -> None:
    _, positions = _fill(ledger, clock)
    row = ledger.find(_receipt_at(ledger, 3))
    unsettled = prove(ledger, row.receipt_id.hex()[:12])
    assert unsettled.statement is None and check_proof(unsettled) is None
    settle_epoch(ledger, T0 // EPOCH_MS)
    proof = prove(ledger, row.receipt_id)
    assert proof.statement is not None and proof.leaf_index == 2 and proof.tree_size == 5
    assert check_proof(proof, ledger_key=ledger.ledger_peer_id) is None
    assert check_proof(Proof.from_json(json.loads(json.dumps(proof.to_json())))) is None
    assert "not the expected ledger" in (check_proof(proof, ledger_key=Identity.generate().peer_id) or "")
    wrong_path = replace(proof, path=(bytes(32),) + proof.path[1:])
    assert "does not lead" in (check_proof(wrong_path) or "")
    other = prove(ledger, _receipt_at(ledger, 1))
    assert "not the receipt" in (check_proof(replace(proof, record=other.record)) or "")


def _receipt_at(ledger: Ledger, position: int) -> bytes:
    from sqlalchemy import select

    from moeswarm.ledger._models import Entry

    with ledger.read() as conn:
        return conn.execute(select(Entry.receipt_id).where(Entry.position == position)).scalar_one()


def test_prices(ledger: Ledger, clock: Clock) -> None:
    client, server = Identity.generate(), Identity.generate()
    fund(ledger, client)
    clock.ms = T0 + 5
    # the price is fixed when the receipt is appended: the client pays it then
    ledger.pricing = PerExpertPrice(lambda model, layer, expert, t: Fraction(expert + 1, 3))  # experts 0, 3: 1/3, 4/3
    ledger.ingest([receipt(client, server, seq=1, experts=(0, 3))])
    flops = 6 * 8 * 16 * 4
    assert ledger.balance(client.peer_id) == GRANT - flops * 5 // 6
    clock.ms = T0 + EPOCH_MS
    statement = settle_epoch(ledger, T0 // EPOCH_MS)
    assert statement.balances[0].credits == flops * 5 // 6 and statement.pricing == "per-expert"
    assert ledger.balance(server.peer_id) == flops * 5 // 6
    stored = decode(ledger.find(_receipt_at(ledger, 1)).record)
    assert isinstance(stored, CountersignedReceipt)
    with pytest.raises(ConfigError, match="negative"):
        credits(stored.receipt, FlatPrice(-1.0))


def test_balance_and_cli_settle_and_prove(ledger: Ledger, clock: Clock, ledger_key: Identity,
                                          tmp_path: Path) -> None:
    peers, _ = _fill(ledger, clock)
    server = peers.servers[0].peer_id
    b = peer_balance(ledger, server)
    assert (b.settled, b.pending, b.receipts) == (0, 3 * 6 * 8 * 16 * 2, 3)
    settle_epoch(ledger, T0 // EPOCH_MS)
    b = peer_balance(ledger, server)
    assert (b.settled, b.pending) == (2 * 6 * 8 * 16 * 2, 1 * 6 * 8 * 16 * 2)
    db = ledger.url.render_as_string(hide_password=False)
    runner = CliRunner()
    out = runner.invoke(main, ["balance", "--db", db, peers.servers[0].peer_id_str, "--format", "json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["settled"] == 2 * 6 * 8 * 16 * 2
    proof = runner.invoke(main, ["prove", "--db", db, _receipt_at(ledger, 2).hex()])
    assert proof.exit_code == 0, proof.output
    path = tmp_path / "proof.json"
    path.write_text(proof.output)
    checked = runner.invoke(main, ["check-proof", str(path), "--ledger-key", ledger_key.peer_id_str])
    assert checked.exit_code == 0 and "in the signed statement of epoch" in checked.output
    # tamper one named field of the decoded proof at a time: each is caught for its own reason
    honest = json.loads(proof.output)
    assert honest["path"], "a receipt of a 3-leaf tree has siblings"

    def flipped(hex_text: str) -> str:  # the same length, one nibble different
        return ("1" if hex_text[0] != "1" else "2") + hex_text[1:]

    tampered = {
        "path": ({**honest, "path": [flipped(honest["path"][0]), *honest["path"][1:]]},
                 "the path does not lead from the receipt to the Merkle root"),
        "merkle_root": ({**honest, "merkle_root": flipped(honest["merkle_root"])},
                        "the path does not lead from the receipt to the Merkle root"),
        "epoch": ({**honest, "epoch": honest["epoch"] + 1},
                  "the proof's root, size or epoch differ from the signed statement"),
        "statement.merkle_root": ({**honest, "statement": {**honest["statement"],
                                                           "merkle_root": flipped(honest["statement"]["merkle_root"])}},
                                  "the settlement statement's signature does not verify"),
    }
    for field_name, (bad, message) in tampered.items():
        path.write_text(json.dumps(bad))
        out = runner.invoke(main, ["check-proof", str(path)])
        assert (out.exit_code, message in out.output) == (1, True), (field_name, out.output)
