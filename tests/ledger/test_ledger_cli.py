"""The ``moeswarm-ledger`` command line: listings, filters, formats, settle, and one-line errors."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeswarm.ledger import Ledger, StoreConfig
from moeswarm.ledger.cli import main
from moeswarm.protocol import Identity

from ledger_support import MODEL, SHAPE, Clock, Peers

PAST = 1_700_000_000_000  # epochs here have ended by the real clock the CLI uses


@pytest.fixture
def filled(db_url: str, tmp_path: Path) -> tuple[str, Path, Peers]:
    key = Identity.generate()
    key_path = tmp_path / "ledger.key"
    key_path.write_bytes(key.seed())
    peers = Peers()
    with Ledger(StoreConfig(db_url, create=True), key, clock=Clock(PAST + 5)) as led:
        led.register_model(MODEL, SHAPE)
        led.register_model("other/model", SHAPE)
        peers.funded(led)
        led.ingest(peers.receipts(4, time_ms=PAST) + peers.receipts(2, layer=3, time_ms=PAST + 60_000)
                   + peers.receipts(1, model="other/model", time_ms=PAST))
    return db_url, key_path, peers


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_receipts_with_filters_and_formats(filled: tuple[str, Path, Peers]) -> None:
    db, _, peers = filled
    code, out = run("receipts", "--db", db, "--format", "json")
    assert code == 0 and len(json.loads(out)) == 7
    code, out = run("receipts", "--db", db, "--format", "json", "--layer", "3")
    assert [r["layer"] for r in json.loads(out)] == [3, 3]
    code, out = run("receipts", "--db", db, "--format", "json", "--model", "other/model")
    assert [r["model_id"] for r in json.loads(out)] == ["other/model"]
    server = peers.servers[0].peer_id_str
    code, out = run("receipts", "--db", db, "--format", "csv", "--peer", server)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rows and all(server in (r["server"], r["client"]) for r in rows)
    code, out = run("receipts", "--db", db, "--format", "json", "--since", str((PAST + 30_000) / 1000))
    assert len(json.loads(out)) == 2
    code, out = run("receipts", "--db", db, "--format", "json", "--until", "2023-11-14T22:13:21")
    assert len(json.loads(out)) == 5  # PAST is 2023-11-14T22:13:20Z
    code, out = run("receipts", "--db", db)
    assert code == 0 and "7 receipts" in out and "expert FLOPs" in out


def test_settle_balance_epochs(filled: tuple[str, Path, Peers]) -> None:
    db, key, peers = filled
    code, out = run("epochs", "--db", db)
    assert code == 0 and str(PAST // 3_600_000) in out and "no" in out
    code, out = run("settle", "--db", db, "--key", str(key), "--epoch", str(PAST // 3_600_000))
    assert code == 0, out
    statement = json.loads(out)
    assert statement["receipts"] == 7 and sum(b["credits"] for b in statement["balances"]) == 7 * 6 * 8 * 16 * 2
    code, out = run("balance", "--db", db, peers.servers[1].peer_id_str)
    assert code == 0 and "settled" in out
    code, out = run("balance", "--db", db, peers.servers[1].peer_id_str, "--format", "json")
    assert json.loads(out)["settled"] > 0 and json.loads(out)["pending"] == 0
    code, out = run("verify", "--db", db)
    assert code == 0 and "1 settlements" in out


def test_friendly_errors(tmp_path: Path, filled: tuple[str, Path, Peers]) -> None:
    db, key, _ = filled
    cases = [
        (["receipts", "--db", str(tmp_path / "missing.db")], "no ledger database at"),
        (["verify", "--db", "postgresql://u@h:port/x"], "neither a file path nor a database URL"),
        (["balance", "--db", "nosuch://x/y", "12D3KooW"], "no SQLAlchemy driver"),
        (["balance", "--db", db, "not-a-peer"], "not base58btc"),
        (["settle", "--db", db, "--epoch", "1", "--key", str(tmp_path / "nokey")], "no ledger key"),
        (["settle", "--db", db, "--epoch", "99999999", "--key", str(key)], "still open"),
        (["prove", "--db", db, "abcd"], "not a receipt id"),
        (["prove", "--db", db, "00" * 32], "no receipt"),
        (["receipts", "--db", db, "--since", "yesterday"], "ISO 8601"),
        (["serve", "--db", db, "--key", str(key), "--listen", "nowhere"], "HOST:PORT"),
    ]
    for args, message in cases:
        code, out = run(*args)
        assert code == 2, (args, out)
        lines = out.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, out)


def test_grant_models_add_and_the_balance(tmp_path: Path) -> None:
    from moeswarm.demo import CHECKPOINT
    from moeswarm.model import load_config

    db, key = str(tmp_path / "ops.db"), tmp_path / "ops.key"
    code, out = run("models", "add", "--db", db, "--key", str(key), "--model", f"{CHECKPOINT}=demo/model")
    cfg = load_config(str(CHECKPOINT))
    added = json.loads(out)
    assert code == 0 and (added["model_id"], added["hidden"], added["ffn"], added["top_k"]) == (
        "demo/model", cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k)
    peer = Identity.generate().peer_id_str
    code, out = run("grant", "--db", db, "--key", str(key), peer, "600")
    assert code == 0 and out.strip() == f"granted 600 credits to {peer}: balance now 600"  # a person reads it
    code, out = run("grant", "--db", db, "--key", str(key), peer, "400", "--json")
    assert code == 0 and json.loads(out)["balance"] == 1000 and json.loads(out)["amount"] == 400
    code, out = run("grant", "--db", db, "--key", str(key), peer, str(2**63 - 1000))
    assert code == 2 and "above the ledger's limit" in out
    code, out = run("grant", "--db", db, "--key", str(tmp_path / "someone-else.key"), peer, "5")
    assert code == 2 and "no ledger key" in out
    code, out = run("balance", "--db", db, peer, "--format", "json")
    assert json.loads(out)["balance"] == json.loads(out)["granted"] == 1000
    code, out = run("models", "list", "--db", db)
    assert code == 0 and json.loads(out)["model_id"] == "demo/model"
