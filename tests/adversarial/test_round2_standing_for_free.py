"""Issue 32, point 1: standing for free owns the market, run as an attacker would.

The operator runs ``moeswarm-ledger serve`` (a real process, real HTTP, 2 s epochs) and funds 40
honest backbones, which pay an honest server for their calls. The attacker, its own process,
holds a key the operator granted 200 calls' worth of credit (it bought them), and 200 fresh
keys. The funded key pays each fresh key for one made-up call; once the epoch has settled, each
pays it back for a call of the same price (zero net cost: the funded key ends where it began),
and signs a demand report putting all its demand on one expert. The market reads standing from
the ledger the way ``moeswarm market --ledger URL`` does (``GET /v1/standing``, the top 256) and
merges the honest reports with and without the 200 Sybil reports.

On main 52de96c a reporter's standing was what it *paid*, so each Sybil had ``paid > 0``; the
weight cap (4 x the median weight) took the Sybils' weight as the median, and this test printed
``AssertionError: the Sybils moved the target's share from 0.0015 to 1.0000; merged 200
reporters, rejected {'outlier': 40}``: every honest reporter dropped as an outlier. Now standing
is credit paid out and not got back (paid - earned, bounded by the lifetime figure): each Sybil
paid 1 call and earned 1 call, the funded key paid 200 and earned 200, so none of the 201 keys
has standing, the share moves by exactly 0 and the 40 honest reporters are all merged.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
from ledger_attack_support import attacker, ledger_cli, start_ledger

from moeswarm.demo import CHECKPOINT
from moeswarm.ledger import Ledger, StoreConfig
from moeswarm.market import decode_report, merge_reports, sign_report
from moeswarm.market._grid import ModelShape
from moeswarm.market._standing import fetch_top_standing
from moeswarm.model import load_config
from moeswarm.model.model_id import model_id_for
from moeswarm.protocol import ExpertRequest, ExpertRows, Identity, countersign, encode, make_receipt, peer_id_from_str

pytestmark = [pytest.mark.timeout(300)]

HONEST, SYBILS = 40, 200
EPOCH_S = 2
TARGET = (1, 6)  # (row of the MoE layers, expert) the attacker wants


def _honest_receipts(clients: list[Identity], server: Identity, model_id: str, hidden: int, ffn: int) -> list[bytes]:
    out = []
    for i, client in enumerate(clients):
        tokens = 1 + i % 8
        x = np.random.default_rng(i).standard_normal((tokens, hidden)).astype(np.float32)  # (N, H)
        rows = np.arange(tokens, dtype=np.uint32)
        request = ExpertRequest(os.urandom(16), model_id, 0, i + 1, x, (ExpertRows(0, rows), ExpertRows(1, rows)))
        outputs = np.zeros((request.pairs, hidden), dtype=np.float32)  # (P, H)
        receipt = make_receipt(server, request, outputs, client=client.peer_id,
                               expert_flops=6 * hidden * ffn * request.pairs, time_ms=int(time.time() * 1000))
        out.append(encode(countersign(client, receipt)))
    return out


def _post(url: str, items: list[bytes]) -> list[str]:
    req = urllib.request.Request(f"{url}/v1/receipts", data=msgpack.packb({"receipts": items}, use_bin_type=True),
                                 method="POST", headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return [r["status"] for r in json.loads(resp.read())["results"]]


def _settle_ended_epochs(db: Path, key: Path, first: int) -> None:
    """Wait for the current epoch to end, then settle every epoch from ``first`` (the operator's job)."""
    now = time.time()
    last = int(now) // EPOCH_S
    time.sleep(max(0.0, (last + 1) * EPOCH_S - now) + 0.2)
    for epoch in range(first, last + 1):
        out = ledger_cli("settle", "--db", str(db), "--key", str(key), "--epoch", str(epoch))
        assert out.returncode == 0 or "no receipts" in out.stderr.lower(), out.stderr


def test_credit_passed_round_and_paid_back_buys_no_standing(tmp_path: Path) -> None:
    cfg = load_config(str(CHECKPOINT))
    model_id = model_id_for(str(CHECKPOINT), cfg)
    moe = tuple(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
    shape = ModelShape(model_id, moe, cfg.num_experts, 1)
    hidden, ffn = cfg.hidden_size, cfg.moe_intermediate_size
    price = 6 * hidden * ffn  # one call of one token to one expert, at the FLOPs bound
    db, key, state = tmp_path / "ledger.db", tmp_path / "ledger.key", tmp_path / "attacker.json"
    operator = Identity.generate()
    key.write_bytes(operator.seed())
    started = int(time.time()) // EPOCH_S
    ledger = start_ledger(["--db", str(db), "--key", str(key), "--listen", "127.0.0.1:0", "--epoch-seconds",
                           str(EPOCH_S), "--model", f"{model_id}={hidden}:{ffn}"], tmp_path / "ledger.log")
    clients, server = [Identity.generate() for _ in range(HONEST)], Identity.generate()
    try:
        keys = attacker("circular_standing.py", "keys", str(state), str(SYBILS))
        with Ledger(StoreConfig(str(db)), operator) as books:  # the operator's grants (the attacker bought its)
            for c in clients:
                books.grant(c.peer_id, 10**9)
            books.grant(peer_id_from_str(keys["funded"]), SYBILS * price)
        honest = _post(ledger.url, _honest_receipts(clients, server, model_id, hidden, ffn))
        args = [str(state), ledger.url, model_id, str(hidden), str(ffn)]
        paid = attacker("circular_standing.py", "pay", *args)["paid"]
        _settle_ended_epochs(db, key, started)  # the Sybils now hold what the funded key paid them
        back = attacker("circular_standing.py", "back", *args, ",".join(map(str, moe)), str(cfg.num_experts),
                        str(moe[TARGET[0]]), str(TARGET[1]))
        standing = asyncio.run(fetch_top_standing(ledger.url, (started - 1) * EPOCH_S * 1000, 256))
    finally:
        ledger.stop()
    assert honest == ["accepted"] * HONEST
    assert paid == ["accepted"] * SYBILS and back["paid_back"] == ["accepted"] * SYBILS  # the circle closed
    sybil = json.loads(ledger_cli("balance", "--db", str(db), keys["sybils"][0], "--format", "json").stdout)
    assert sybil["spent"] == price and sybil["balance"] == 0  # each Sybil paid for a call, at zero net cost

    now_ms = int(time.time() * 1000)
    rng = np.random.default_rng(4)
    truth = rng.uniform(1, 10, size=(len(moe), cfg.num_experts))
    truth[TARGET] = 0.3
    truth /= truth.sum()
    reports = [sign_report(c, model_id=model_id, layers=moe, counts=np.random.default_rng(i).poisson(truth * 20_000)
                           .astype(np.float32), half_life_ms=600_000, time_ms=now_ms - 60_000, seq=1)
               for i, c in enumerate(clients)]
    sybil_reports = [decode_report(bytes.fromhex(r)) for r in back["reports"]]
    before = merge_reports(reports, shape, now_ms=now_ms, standing=standing)
    after = merge_reports([*reports, *sybil_reports], shape, now_ms=now_ms, standing=standing)
    was, now = before.demand.share[TARGET], after.demand.share[TARGET]
    print(f"\ntarget share {was:.4f} -> {now:.4f}; merged {len(after.accepted)}, rejected {after.rejected}")
    assert float(np.abs(after.demand.share - before.demand.share).max()) == 0.0, (
        f"the Sybils moved the target's share from {was:.4f} to {now:.4f}; merged {len(after.accepted)} "
        f"reporters, rejected {after.rejected}")
    assert sorted(after.accepted) == sorted(c.peer_id for c in clients)  # no honest reporter dropped
    assert after.rejected.get("no_standing") == SYBILS
