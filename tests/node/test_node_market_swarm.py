"""Issue 6 end to end: three nodes started with --experts auto on an uncovered model cover every
expert; the ledger settles their receipts with the market's per-expert prices."""

from __future__ import annotations

import asyncio
import time
from fractions import Fraction
from math import floor
from pathlib import Path

import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.ledger import Ledger, PerExpertPrice, StoreConfig, settle_epoch
from moeswarm.ledger import ModelShape as LedgerShape
from moeswarm.market import (
    Demand,
    DemandCounter,
    ModelShape,
    compute_prices,
    supply_from_holders,
)
from moeswarm.model import SamplingParams, Tokenizer, generate, load_config
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.protocol import Identity, peer_id_from_str

pytestmark = pytest.mark.slow


def test_auto_assignment_covers_the_model_and_settles_at_market_prices(tmp_path: Path) -> None:
    cfg = load_config(CHECKPOINT)
    moe = tuple(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
    daemons = []
    try:
        for i in range(3):  # each offers ~40% of the experts' bytes: together they can cover it
            args = ["node", "--model", str(CHECKPOINT), "--experts", "auto", "--capacity", "3MB"]
            if daemons:
                args += ["--bootstrap", daemons[0].info["multiaddrs"][0]]
            daemons.append(start_daemon(f"auto{i}", args))
        mine = [{(L, e) for l0, l1, e0, e1 in d.info["blocks"] for L in range(l0, l1 + 1)
                 for e in range(e0, e1 + 1) if L in moe} for d in daemons]
        assert set().union(*mine) == {(L, e) for L in moe for e in range(cfg.num_experts)}
        assert all(len(m) < len(moe) * cfg.num_experts for m in mine), \
            [d.info["blocks"] for d in daemons]  # nobody took it all

        receipts: list = []

        async def run() -> tuple[object, list]:
            config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(daemons[0].info["multiaddrs"][0],),
                                                client_mode=True))
            async with SwarmBackbone(config) as bb:
                assert bb.model is not None and bb.executor is not None
                bb.executor.receipts = receipts.append
                counter = DemandCounter(moe, cfg.num_experts)
                bb.model.observers.append(counter.observe)
                tok = Tokenizer.from_folder(CHECKPOINT, cfg.bos_token_id)
                for prompt in ("And it came to pass", "The LORD is my shepherd"):
                    ids = tok.encode(prompt)
                    await asyncio.to_thread(lambda: list(generate(bb.model, ids, SamplingParams(max_new_tokens=12))))  # type: ignore[arg-type]
                await bb.executor.flush_receipts()  # v1.3: unbatched receipts too
                expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
                shape = ModelShape(bb.model_id, moe, cfg.num_experts, expert_bytes)
                supply = supply_from_holders(shape, list(bb.table.holders.values()), now_ms=int(time.time() * 1000))
                counts = counter.snapshot()
                demand = Demand(counts / counts.sum(), counter.rate(counts), reporters=1)
                return compute_prices(shape, demand, supply, epoch=0), bb.model_id

        table, model_id = asyncio.run(run())
    finally:
        for d in daemons:
            stop_daemon(d)

    now = [int(time.time() * 1000)]
    price = PerExpertPrice(lambda m, layer, e, t: table.price(m, layer, e, table.epoch))  # type: ignore[attr-defined]
    ledger = Ledger(StoreConfig(str(tmp_path / "ledger.db"), create=True, epoch_s=3600), Identity.generate(),
                    clock=lambda: now[0], pricing=price)  # each receipt's price is fixed when it is appended
    ledger.register_model(model_id, LedgerShape(cfg.hidden_size, cfg.moe_intermediate_size))
    for client in {cr.receipt.client for cr in receipts}:  # the backbone pays with credit the operator granted
        ledger.grant(client, 10**15)
    results = ledger.ingest(receipts)
    assert all(r.status == "accepted" for r in results) and len(results) == len(receipts) > 0, results[:3]
    epoch = now[0] // 3_600_000  # the epoch the receipts were received in
    now[0] += 3_600_000  # ... has ended an hour later
    statement = settle_epoch(ledger, epoch)
    paid = {b.server: b.credits for b in statement.balances}
    assert set(paid) == {peer_id_from_str(d.info["peer_id"]) for d in daemons}
    expected: dict[bytes, int] = {}
    for cr in receipts:
        r = cr.receipt
        m = sum(Fraction(table.price(r.model_id, r.layer, e, table.epoch)) for e in r.experts) / len(r.experts)
        expected[r.server] = expected.get(r.server, 0) + floor(r.expert_flops * m)
    assert paid == expected
    multipliers = {table.price(model_id, L, e, table.epoch) for L in moe for e in range(cfg.num_experts)}
    assert len(multipliers) > 1  # market prices, not a flat 1.0


def test_an_auto_node_fills_an_l_shaped_gap_with_two_blocks_in_one_record_that_backbones_route_to() -> None:
    """Two fixed nodes leave an L-shaped gap (layers 0-1 x experts 6-7 and layers 2-3 x experts
    4-7): no rectangle of 12 experts covers it. A third node, ``--experts auto`` with room for 12,
    takes it as two blocks of one process, announced in one signed record (``more_blocks``); a
    backbone reads that record from the DHT, routes to both blocks, and its greedy tokens equal
    the single-process engine's."""
    from moeswarm.market import fetch_announcements, model_shape
    from moeswarm.model import load_model

    cfg = load_config(CHECKPOINT)
    expert_bytes = model_shape(str(CHECKPOINT), cfg, "probe").expert_bytes
    gap = {(L, e) for L in (0, 1) for e in (6, 7)} | {(L, e) for L in (2, 3) for e in range(4, 8)}
    tok = Tokenizer.from_folder(CHECKPOINT, cfg.bos_token_id)
    ids = tok.encode("In the beginning")
    expected = list(generate(load_model(str(CHECKPOINT)), ids, SamplingParams(max_new_tokens=10)))
    daemons = [start_daemon("l-top", ["node", "--model", str(CHECKPOINT), "--layers", "0-1", "--experts", "0-5"])]
    try:
        boot = daemons[0].info["multiaddrs"][0]
        daemons.append(start_daemon("l-bottom", ["node", "--model", str(CHECKPOINT), "--layers", "2-3", "--experts",
                                                 "0-3", "--bootstrap", boot]))
        daemons.append(start_daemon("gap", ["node", "--model", str(CHECKPOINT), "--experts", "auto", "--capacity",
                                            f"{12 * expert_bytes + expert_bytes // 2}B", "--rebalance-interval", "0",
                                            "--bootstrap", boot]))
        blocks = daemons[2].info["blocks"]
        held = [{(L, e) for L in range(l0, l1 + 1) for e in range(e0, e1 + 1)} for l0, l1, e0, e1 in blocks]
        assert len(blocks) == 2 and set().union(*held) == gap and sum(map(len, held)) == 12, blocks

        async def run() -> tuple[list[int], object, list]:
            config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(boot,), client_mode=True))
            async with SwarmBackbone(config) as bb:
                assert bb.model is not None and bb.executor is not None
                served: list = []
                bb.executor.receipts = served.append
                got = await asyncio.to_thread(lambda: list(generate(bb.model, ids,  # type: ignore[arg-type]
                                                                     SamplingParams(max_new_tokens=10))))
                await bb.executor.flush_receipts()  # v1.3: unbatched receipts too
                shape = ModelShape(bb.model_id, tuple(range(cfg.num_layers)), cfg.num_experts, expert_bytes)
                records = await fetch_announcements(bb.p2p, shape)
                return got, records, served

        got, records, served = asyncio.run(run())
    finally:
        for d in daemons:
            stop_daemon(d)
    gap_peer = peer_id_from_str(daemons[2].info["peer_id"])
    (record,) = [r for r in records if r.peer_id == gap_peer]  # type: ignore[attr-defined]
    assert sorted([*L, *E] for L, E in record.blocks()) == sorted(blocks)
    used = {(cr.receipt.layer, e) for cr in served if cr.receipt.server == gap_peer for e in cr.receipt.experts}
    assert used and used <= gap and {L for L, _ in used} & {0, 1} and {L for L, _ in used} & {2, 3}, used
    assert got == expected


def test_backbones_publish_signed_demand_that_the_market_reads_from_the_dht() -> None:
    from dataclasses import replace

    from moeswarm.market import decode_report, fetch_reports, verify_report

    daemons = [start_daemon("n0", ["node", "--model", str(CHECKPOINT)])]
    try:
        async def run() -> list:
            config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(daemons[0].info["multiaddrs"][0],),
                                                client_mode=True))
            config = replace(config, demand_interval_s=0.2)
            async with SwarmBackbone(config) as bb:
                tok = Tokenizer.from_folder(CHECKPOINT, bb.cfg.bos_token_id)
                ids = tok.encode("And it came to pass")
                await asyncio.to_thread(lambda: list(generate(bb.model, ids, SamplingParams(max_new_tokens=6))))  # type: ignore[arg-type]
                deadline = time.monotonic() + 20
                reports: list = []
                while not reports and time.monotonic() < deadline:
                    reports = [decode_report(v) for v in await fetch_reports(bb.p2p, bb.model_id)]
                    await asyncio.sleep(0.1)  # bounded poll for the periodic publisher
                return [(r, bb.identity.peer_id, bb.demand.snapshot().sum()) for r in reports]

        found = asyncio.run(run())
    finally:
        stop_daemon(daemons[0])
    assert found, "no demand report reached the DHT"
    report, me, total = found[0]
    assert report.reporter == me and verify_report(report) and report.counts.sum() > 0 and total > 0


def test_market_cli_reads_coverage_live_from_the_dht() -> None:
    import json
    import subprocess
    import sys

    daemons = [start_daemon("half", ["node", "--model", str(CHECKPOINT), "--experts", "0-3"])]
    try:
        r = subprocess.run([sys.executable, "-m", "moeswarm.cli", "market", "--model", str(CHECKPOINT), "--bootstrap",
                            daemons[0].info["multiaddrs"][0], "--json"], capture_output=True, text=True, timeout=120)
    finally:
        stop_daemon(daemons[0])
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert view["coverage"] == 0.5 and len(view["uncovered"]) == view["experts"] // 2
