"""Attack 1 of issue 12, credit from nothing, run as an attacker would.

The operator runs ``moeswarm-ledger serve`` (a real process, real HTTP) knowing the real Mixtral
shape. The attacker, its own process, makes two fresh keys that sign and countersign receipts
for work never done (one claiming 2**32 - 1 tokens, three within any per-call limit, all at the
FLOPs bound), POSTs them, and tries to register the model's shape over HTTP as 1 x 1.

Before the fix (commit 7895ee0, the base of branch ``trustledger``) this test fails at its first
check of the results: all four forged receipts were accepted, registering a new model over HTTP
answered 200 (the real one 409 only because the operator had registered it first), the forged
server's ``balance`` failed ("integer overflow", SQLite's SUM) and settling its epoch paid it
9,223,441,306,087,325,695 credits. Now credit enters only through the operator's signed grants:
the forged client holds none, so its receipts are refused (the first one also for exceeding one
call of the model), the forged server's balance is 0, the epochs settle, and there is no HTTP
route to register a model. An honest client the operator funded pays its server, and ``verify``
finds every account holding exactly what its grants, receipts and settlements make it."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
from ledger_attack_support import attacker, ledger_cli, start_ledger

from moeswarm.protocol import (
    ExpertRequest,
    ExpertRows,
    Identity,
    countersign,
    encode,
    make_receipt,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MIXTRAL = "mistralai/Mixtral-8x7B-v0.1"
H, F = 4096, 14336
EPOCH_S = 5
GRANT = 10**12


def _balance(db: Path, peer: str) -> dict:
    out = ledger_cli("balance", "--db", str(db), peer, "--format", "json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def _honest_receipt(client: Identity, server: Identity) -> bytes:
    hidden = np.random.default_rng(0).standard_normal((4, H)).astype(np.float32)  # (N, H)
    rows = np.arange(4, dtype=np.uint32)
    request = ExpertRequest(b"\x01" * 16, MIXTRAL, 0, 1, hidden, (ExpertRows(0, rows), ExpertRows(1, rows)))
    outputs = np.zeros((request.pairs, H), dtype=np.float32)  # (P, H)
    receipt = make_receipt(server, request, outputs, client=client.peer_id, expert_flops=6 * H * F * request.pairs,
                           time_ms=int(time.time() * 1000))
    return encode(countersign(client, receipt))


def _post(url: str, items: list[bytes]) -> list[dict]:
    req = urllib.request.Request(f"{url}/v1/receipts", data=msgpack.packb({"receipts": items}, use_bin_type=True),
                                 method="POST", headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return list(json.loads(resp.read())["results"])


def test_forged_receipts_earn_nothing(tmp_path: Path) -> None:
    db, key = tmp_path / "ledger.db", tmp_path / "ledger.key"
    key.write_bytes(Identity.generate().seed())
    started = int(time.time())
    ledger = start_ledger(["--db", str(db), "--key", str(key), "--listen", "127.0.0.1:0", "--epoch-seconds",
                           str(EPOCH_S), "--model", f"{MIXTRAL}={H}:{F}"], tmp_path / "ledger.log")
    try:
        attack = attacker("forge_credit.py", ledger.url, MIXTRAL, str(H), str(F))
        # the honest side: the operator funds a client, which pays for a real call
        client, server = Identity.generate(), Identity.generate()
        granted = ledger_cli("grant", "--db", str(db), "--key", str(key), client.peer_id_str, str(GRANT))
        honest = _post(ledger.url, [_honest_receipt(client, server)])
        ended = int(time.time())
    finally:
        ledger.stop()

    # the attack: nothing accepted, nothing earned, nobody can register a shape over HTTP
    assert attack["status"] == 200
    assert [r["status"] for r in attack["results"]] == ["rejected"] * 4, attack["results"]
    assert attack["results"][0]["reason"] in ("exceeds_model_limits", "insufficient_funds")
    assert {r["reason"] for r in attack["results"][1:]} == {"insufficient_funds"}
    forged = _balance(db, attack["server"])
    print(f"\nforged receipts' server balance: {forged}")
    assert all(forged.get(k, 0) == 0 for k in ("balance", "settled", "pending", "granted"))
    assert forged["receipts"] == 0
    assert attack["register_existing"] in (404, 405) and attack["register_new"] in (404, 405)

    # every epoch since the start settles (a forged sum above 2**64 once made settle fail for ever)
    time.sleep(max(0.0, (ended // EPOCH_S + 1) * EPOCH_S - time.time()) + 0.2)
    statements = []
    for epoch in range(started // EPOCH_S, ended // EPOCH_S + 1):
        out = ledger_cli("settle", "--db", str(db), "--key", str(key), "--epoch", str(epoch))
        assert out.returncode == 0, out.stderr
        statements.append(json.loads(out.stdout))
    assert all(b["server"] != attack["server"] for s in statements for b in s["balances"])

    # the honest call was paid for: its server earned exactly what the client paid
    assert granted.returncode == 0, granted.stderr
    assert [r["status"] for r in honest] == ["accepted"]
    price = 6 * H * F * 8  # one credit per expert-FLOP, 8 pairs
    paid, spent = _balance(db, server.peer_id_str), _balance(db, client.peer_id_str)
    assert paid["balance"] == paid["settled"] == price
    assert spent["balance"] == GRANT - price and spent["spent"] == price
    assert sum(b["credits"] for s in statements for b in s["balances"]) == price
    checked = ledger_cli("verify", "--db", str(db))  # every grant signed, every account what its moves make it
    assert checked.returncode == 0, checked.stderr
