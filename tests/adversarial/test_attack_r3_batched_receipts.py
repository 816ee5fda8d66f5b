"""v1.3 batched receipts at a real ledger (issue 29): what an honest batch earns, and what its
server cannot make it earn, run as an attacker would.

The operator runs ``moeswarm-ledger serve`` (a real process, SQLite, real HTTP) knowing the real
Mixtral shape and funds a client. An honest server answers four of that client's calls; it signs
their receipts in one batch, the client checks and countersigns the batch once and POSTs the four
``batched_receipt`` records. The attacker is the server, its own process (``attackers/
batch_inflator.py``) holding its key and the four honest records: it inflates them, adds calls
never made under the honest statement, re-signs a bigger statement over the client's
countersignature, raises the statement's count, and replays the batch.

What it printed on the code before the defence (this branch with the Merkle-path check of
``ledger._chain.signature_problem`` removed: a ledger that trusts a batched receipt because its
statement's two signatures verify): ``"forged": {"status": 200, "results": {"accepted/": 4}}``
-- four calls never made, paid by the client -- and ``"inflated": {"results":
{"rejected/replay": 4}}`` (caught only because the honest records with the same request ids came
first); the test failed at its check of ``inflated``. (On main, v1.2, there are no batched
receipts: this file does not import.) Now inflated and forged receipts are
``rejected/bad_batch_proof``, the re-signed statement ``rejected/bad_client_signature``, the
recounted one ``rejected/malformed`` (its paths no longer fit the count; were they to fit, the
server's signature covers the count), the replays ``duplicate``; the client paid exactly the four
calls, the server earned exactly that, and ``verify``
finds the chain and every account in order."""

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
    check_receipt,
    countersign_batch,
    encode,
    make_receipt,
    sign_batch,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MIXTRAL = "mistralai/Mixtral-8x7B-v0.1"
H, F = 4096, 14336
GRANT = 10**13


def _post(url: str, items: list[bytes]) -> list[dict]:
    req = urllib.request.Request(f"{url}/v1/receipts", data=msgpack.packb({"receipts": items}, use_bin_type=True),
                                 method="POST", headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return list(json.loads(resp.read())["results"])


def _honest_batch(client: Identity, server: Identity) -> list[bytes]:
    """Four calls of 2 tokens x 2 experts; the server batches their receipts, the client checks
    each against its call and countersigns the batch once."""
    rng = np.random.default_rng(0)
    calls = []
    for i in range(4):
        hidden = rng.standard_normal((2, H)).astype(np.float32)  # (N, H)
        rows = np.arange(2, dtype=np.uint32)
        request = ExpertRequest(bytes([i + 1]) * 16, MIXTRAL, i, 10 + i, hidden, (ExpertRows(0, rows), ExpertRows(3, rows)))
        outputs = rng.standard_normal((request.pairs, H)).astype(np.float32)  # (P, H)
        calls.append((request, outputs))
    receipts = [make_receipt(server, req, out, client=client.peer_id, expert_flops=6 * H * F * req.pairs,
                             time_ms=int(time.time() * 1000), sign=False) for req, out in calls]
    batch = sign_batch(server, client.peer_id, receipts)
    for (req, out), r in zip(calls, batch.receipts):
        check_receipt(req, out, r, client=client.peer_id, server=server.peer_id)
    return [encode(b) for b in countersign_batch(client, batch)]


def _balance(db: Path, peer: str) -> dict:
    out = ledger_cli("balance", "--db", str(db), peer, "--format", "json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_a_server_cannot_make_its_batch_earn_more(tmp_path: Path) -> None:
    db, key = tmp_path / "ledger.db", tmp_path / "ledger.key"
    key.write_bytes(Identity.generate().seed())
    client, server = Identity.generate(), Identity.generate()
    ledger = start_ledger(["--db", str(db), "--key", str(key), "--listen", "127.0.0.1:0",
                           "--model", f"{MIXTRAL}={H}:{F}"], tmp_path / "ledger.log")
    try:
        granted = ledger_cli("grant", "--db", str(db), "--key", str(key), client.peer_id_str, str(GRANT))
        assert granted.returncode == 0, granted.stderr
        records = _honest_batch(client, server)
        honest = _post(ledger.url, records)
        (tmp_path / "records").write_bytes(msgpack.packb(records, use_bin_type=True))
        (tmp_path / "server.key").write_bytes(server.seed())
        attack = attacker("batch_inflator.py", ledger.url, str(tmp_path / "records"), str(tmp_path / "server.key"))
    finally:
        ledger.stop()
    print(f"\nattacker printed: {json.dumps(attack)}")

    assert [r["status"] for r in honest] == ["accepted"] * 4, honest
    assert attack["inflated"] == {"status": 200, "results": {"rejected/bad_batch_proof": 4}}
    assert attack["forged"] == {"status": 200, "results": {"rejected/bad_batch_proof": 4}}
    assert attack["resigned"] == {"status": 200, "results": {"rejected/bad_client_signature": 4}}
    recounted = attack["recounted"]["results"]
    assert sum(recounted.values()) == 4 and all(k.startswith("rejected/") for k in recounted), recounted
    assert set(recounted) <= {"rejected/malformed", "rejected/bad_server_signature"}
    assert attack["replayed"] == {"status": 200, "results": {"duplicate/duplicate": 8}}

    price = 4 * 6 * H * F * 4  # one credit per expert-FLOP: 4 calls of 4 pairs
    spent = _balance(db, client.peer_id_str)
    earned = _balance(db, server.peer_id_str)
    print(f"client: {spent}\nserver: {earned}")
    assert spent["spent"] == price and spent["balance"] == GRANT - price
    assert earned["receipts"] == 4 and earned["pending"] == price
    checked = ledger_cli("verify", "--db", str(db))  # the chain, both record kinds, every account
    assert checked.returncode == 0, checked.stderr
