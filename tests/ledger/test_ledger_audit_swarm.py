"""Audits in a running backbone: a local swarm in which one node lies, a backbone generating with
``audit_fraction=1.0`` (and checks before use turned off, so the liar's outputs are used and only
the ledger's re-execution catches it) and a ledger service (``moeswarm-ledger serve --model-dir``) judging.

The honest node is a ``moeswarm node`` subprocess. The liar is the real node code (``run_node``)
in this process with its ``ExpertServer`` swapped for ``LyingServer``, so no test hook exists in
the product. Afterwards the ledger holds signed evidence naming the liar and only the liar, and
settlement withholds the liar's receipts while paying the honest node."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from ledger_process import start_ledger
from ledger_support import LyingServer

from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT, DEFAULT_PROMPT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.errors import ConfigError
from moeswarm.ledger import (
    Ledger,
    StoreConfig,
    evidence_for,
    list_receipts,
    load_key,
    peer_balance,
    settle_epoch,
    verify_chain,
)
from moeswarm.ledger._queries import default_key_path
from moeswarm.ledger.cli import main as ledger_cli
from moeswarm.model import SamplingParams, generate
from moeswarm.node import volunteer
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig, NodeConfig
from moeswarm.node.verify import VerifyConfig
from moeswarm.node.volunteer import run_node
from moeswarm.protocol import Identity, peer_id_from_str

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def generate_beside_a_liar(boot: str, ledger_url: str, queue: Path, key_file: Path) -> dict[str, Any]:
    """Start the lying node (experts 4-7) in this process, generate through the swarm with every
    call audited, wait for the audits and the receipts to reach the ledger."""
    stop, ready, liar = asyncio.Event(), asyncio.Event(), {}
    node = asyncio.create_task(run_node(
        NodeConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(boot,)), experts="4-7"),
        on_ready=lambda info: (liar.update(info), ready.set()), stop=stop))
    try:
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({node, waiter}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if node.done():
            node.result()  # its error
        assert ready.is_set(), "the lying node did not get ready"
        config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(boot,), client_mode=True,
                                            identity_file=str(key_file)),
                                coverage_timeout_s=60, ledger_url=ledger_url, ledger_queue_dir=str(queue),
                                audit_fraction=1.0, verify=VerifyConfig(fraction=0))  # after-the-fact audits only
        async with SwarmBackbone(config) as bb:
            assert bb.model is not None and bb.executor is not None and bb.audits is not None
            ids = bb.tokenizer().encode(DEFAULT_PROMPT)
            model = bb.model
            tokens = await asyncio.to_thread(lambda: list(generate(model, ids, SamplingParams(max_new_tokens=4))))
            assert len(tokens) == 4
            await bb.executor.flush_receipts()  # v1.3: unbatched receipts too
            await asyncio.wait_for(bb.audits.drain(), 60)
            assert await bb.executor.receipts.flush(30)  # the backbone's ReceiptSubmitter
            audits = bb.audits
            return {"liar": peer_id_from_str(liar["peer_id"]), "calls": bb.executor.calls,
                    "bad": bb.executor.bad_receipts, "served_by": set(bb.executor.served_by),
                    "offered": audits.offered, "skipped": audits.skipped, "errors": list(audits.errors),
                    "verdicts": list(audits.verdicts)}
    finally:
        stop.set()
        await asyncio.wait_for(node, 30)


def test_audits_in_the_backbone_catch_a_lying_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "audits.db"
    ledger = start_ledger(["--db", str(db), "--listen", "127.0.0.1:0", "--model-dir", str(CHECKPOINT)],
                          tmp_path / "ledger.log")
    backbone_key = tmp_path / "backbone.key"
    backbone_key.write_bytes(Identity.generate().seed())
    granted = CliRunner().invoke(ledger_cli, ["grant", "--db", str(db), Identity.from_seed(
        backbone_key.read_bytes()).peer_id_str, str(10**15)])  # the operator funds the backbone's calls
    assert granted.exit_code == 0, granted.output
    try:
        honest_node = start_daemon("honest node", ["node", "--model", str(CHECKPOINT), "--experts", "0-3"])
        try:
            monkeypatch.setattr(volunteer, "ExpertServer", LyingServer)  # only run_node in this process
            run = asyncio.run(generate_beside_a_liar(honest_node.info["multiaddrs"][0], ledger.info["url"],
                                                     tmp_path / "queue", backbone_key))
        finally:
            stop_daemon(honest_node)
    finally:
        ledger.stop()
    liar, honest = run["liar"], peer_id_from_str(honest_node.info["peer_id"])
    ledger_peer = peer_id_from_str(ledger.info["peer_id"])

    # the backbone: every call checked out (signatures and hashes are fine: only re-execution tells)
    assert run["bad"] == 0 and run["served_by"] == {liar, honest}
    assert run["errors"] == [] and run["offered"] == run["calls"]
    assert len(run["verdicts"]) + run["skipped"] == run["calls"] and run["skipped"] == 0
    assert {v.server for v in run["verdicts"] if not v.ok} == {liar}
    assert {v.server for v in run["verdicts"] if v.ok} == {honest}

    with Ledger(StoreConfig(str(db)), load_key(default_key_path(str(db)), create=False),
                clock=lambda: int(time.time() * 1000) + 3_600_000) as led:  # every epoch so far has ended
        evidence = evidence_for(led, liar)
        assert evidence and evidence_for(led, honest) == []
        assert all(e.verifies() and e.withheld and e.ledger == ledger_peer and e.server == liar for e in evidence)
        rows = list_receipts(led)
        assert len(rows) == run["calls"]
        for epoch in sorted({r.epoch for r in rows}):
            statement = settle_epoch(led, epoch)
            assert liar not in {b.server for b in statement.balances}
            servers = {r.server for r in rows if r.epoch == epoch}
            assert {b.server for b in statement.withheld} == servers & {liar}
            withheld = sum(b.receipts for b in statement.withheld)
            assert withheld == sum(1 for r in rows if r.epoch == epoch and r.server == liar)
        paid, cheat = peer_balance(led, honest), peer_balance(led, liar)
        assert paid.settled > 0 and paid.withheld == 0 and paid.evidence == 0
        assert cheat.settled == 0 and cheat.withheld > 0 and cheat.evidence == len(evidence)
        assert verify_chain(led).ok


def test_audit_flags() -> None:
    swarm = SwarmConfig(str(CHECKPOINT))
    with pytest.raises(ConfigError, match="needs --ledger"):
        BackboneConfig(swarm, audit_fraction=0.1)
    with pytest.raises(ConfigError, match="0..1"):
        BackboneConfig(swarm, ledger_url="http://127.0.0.1:1", audit_fraction=1.5)
    from moeswarm.node.cli import backbone

    result = CliRunner().invoke(backbone, ["--model", str(CHECKPOINT), "--audit-fraction", "0.5"])
    assert result.exit_code == 2 and "needs --ledger" in result.output
