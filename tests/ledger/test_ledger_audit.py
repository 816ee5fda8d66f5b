"""Audits against a deliberately lying expert server, in-process: evidence, marking, withholding.

The liar is a real ``ExpertServer`` whose expert weights are perturbed: it returns wrong outputs
and signs receipts for exactly those outputs, so every signature checks and only re-execution
can catch it."""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import replace

import numpy as np
import pytest
from sqlalchemy import select

from moeswarm.demo import CHECKPOINT
from moeswarm.errors import BadResponse
from moeswarm.ledger import (
    AuditConfig,
    AuditRunner,
    AuditSample,
    Ledger,
    LedgerService,
    LocalJudge,
    ModelShape,
    RemoteJudge,
    evidence_for,
    peer_balance,
    reexecute,
    settle_epoch,
    verify_chain,
)
from moeswarm.ledger._models import Evidence
from moeswarm.model import Weights, load_weights
from moeswarm.node.expert_server import ExpertServer, ExpertServerConfig
from moeswarm.protocol import (
    CountersignedReceipt,
    ExpertRequest,
    ExpertRows,
    Identity,
    check_response,
    countersign,
)

from ledger_support import EPOCH_MS, GRANT, T0, Clock, LyingServer, fund

MODEL_ID = "demo-kjv"


@pytest.fixture(scope="module")
def weights() -> Weights:
    return load_weights(CHECKPOINT)


Call = tuple[ExpertRequest, np.ndarray, CountersignedReceipt]


async def _serve(server: ExpertServer, client: Identity, n: int, *, seed: int, dtype: str = "float32") -> list[Call]:
    """n calls the way a backbone makes them: random rows routed to two experts of layer 1."""
    rng = np.random.default_rng(seed)
    H = server.cfg.hidden_size
    calls = []
    await server.start()
    try:
        for i in range(n):
            hidden = rng.standard_normal((3, H)).astype(dtype)  # (N, H)
            e1, e2 = (int(e) for e in rng.choice(8, 2, replace=False))
            request = ExpertRequest(os.urandom(16), MODEL_ID, 1, 1000 + i, hidden,
                                    (ExpertRows(e1, np.array([0, 1, 2], np.uint32)),
                                     ExpertRows(e2, np.array([1], np.uint32))))
            response = await server.handle(client.peer_id, request)
            receipt = check_response(request, response, client=client.peer_id, server=server.identity.peer_id)
            calls.append((request, response.outputs, countersign(client, receipt)))
    finally:
        await server.aclose()
    return calls


def _servers(weights: Weights) -> tuple[ExpertServer, ExpertServer]:
    config = ExpertServerConfig(MODEL_ID, (0, 3), (0, 7))
    return ExpertServer(weights, Identity.generate(), config), LyingServer(weights, Identity.generate(), config)


def _register(ledger: Ledger, weights: Weights) -> None:
    ledger.register_model(MODEL_ID, ModelShape(weights.config.hidden_size, weights.config.moe_intermediate_size))


def test_reexecute_passes_honest_calls_and_catches_the_liar(weights: Weights) -> None:
    honest, liar = _servers(weights)
    client = Identity.generate()
    half, _ = _servers(weights)  # one server object per event loop
    good = asyncio.run(_serve(honest, client, 2, seed=1)) + asyncio.run(_serve(half, client, 2, seed=2,
                                                                              dtype="float16"))
    bad = asyncio.run(_serve(liar, client, 2, seed=3))
    for request, outputs, cr in good:
        verdict = reexecute(AuditSample(request, outputs, cr), weights, 1e-2)
        assert verdict.ok and verdict.max_error < 1e-3
    for request, outputs, cr in bad:
        verdict = reexecute(AuditSample(request, outputs, cr), weights, 1e-2)
        assert not verdict.ok and verdict.max_error > 1e-2 and verdict.server == liar.identity.peer_id
    # a backbone cannot frame an honest server: the sample must be the receipted call
    request, outputs, cr = good[0]
    with pytest.raises(BadResponse, match="output_hash"):
        reexecute(AuditSample(request, outputs * 2, cr), weights, 1e-2)
    with pytest.raises(BadResponse, match="input_hash"):
        reexecute(AuditSample(replace(request, hidden=request.hidden * 2), outputs, cr), weights, 1e-2)


def test_failed_audit_signs_evidence_marks_the_server_and_withholds_its_epoch(
        ledger: Ledger, clock: Clock, weights: Weights) -> None:
    _register(ledger, weights)
    honest, liar = _servers(weights)
    client = Identity.generate()
    fund(ledger, client)
    clock.ms = T0 + 1
    calls = asyncio.run(_serve(honest, client, 3, seed=4)) + asyncio.run(_serve(liar, client, 3, seed=5))
    ledger.ingest([cr for _, _, cr in calls])
    paid = sum(cr.receipt.expert_flops for _, _, cr in calls)  # one credit per FLOP
    assert ledger.balance(client.peer_id) == GRANT - paid

    async def audit() -> AuditRunner:
        runner = AuditRunner(AuditConfig(fraction=1.0, seed=0), LocalJudge(ledger, {MODEL_ID: weights}))
        await runner.start()
        for request, outputs, cr in calls:
            assert runner.offer(request, outputs, cr)
        await runner.drain()
        await runner.aclose()
        return runner

    runner = asyncio.run(audit())
    assert not runner.errors
    assert [v.ok for v in runner.verdicts] == [True] * 3 + [False] * 3
    records = evidence_for(ledger, liar.identity.peer_id)
    assert len(records) == 3 and all(r.verifies() and r.withheld for r in records)
    assert evidence_for(ledger, honest.identity.peer_id) == []
    with ledger.read() as conn:
        sample = conn.execute(select(Evidence.sample)).scalars().first()
    assert sample is not None
    assert hashlib.sha256(sample).digest() in {r.sample_hash for r in records}
    assert reexecute(AuditSample.decode(sample), weights, 1e-2).ok is False  # anyone can re-check it

    clock.ms = T0 + EPOCH_MS
    statement = settle_epoch(ledger, T0 // EPOCH_MS)
    assert [b.server for b in statement.balances] == [honest.identity.peer_id]
    assert [b.server for b in statement.withheld] == [liar.identity.peer_id]
    lb = peer_balance(ledger, liar.identity.peer_id)
    assert (lb.settled, lb.evidence) == (0, 3) and lb.withheld == statement.withheld[0].credits > 0
    # the honest server is paid; what the client paid the liar comes back to it
    assert ledger.balance(honest.identity.peer_id) == statement.balances[0].credits > 0
    assert ledger.balance(liar.identity.peer_id) == 0
    assert ledger.balance(client.peer_id) == GRANT - statement.balances[0].credits
    assert verify_chain(ledger).ok


def test_sampling_fraction_and_the_remote_judge(ledger: Ledger, weights: Weights) -> None:
    _register(ledger, weights)
    honest, liar = _servers(weights)
    client = Identity.generate()
    fund(ledger, client)
    calls = asyncio.run(_serve(liar, client, 12, seed=6))

    async def main() -> AuditRunner:
        judge = LocalJudge(ledger, {MODEL_ID: weights})
        async with LedgerService(ledger, judge=judge) as service:
            runner = AuditRunner(AuditConfig(fraction=0.5, seed=7), RemoteJudge(service.url))
            await runner.start()
            sampled = [runner.offer(*call) for call in calls]
            await runner.drain()
            await runner.aclose()
            request, outputs, cr = calls[0]
            with pytest.raises(BadResponse, match="refused the audit sample"):
                await RemoteJudge(service.url)(AuditSample(request, outputs + 1, cr))
        assert 0 < sum(sampled) < len(calls) and len(runner.verdicts) == sum(sampled)
        return runner

    runner = asyncio.run(main())
    assert all(not v.ok for v in runner.verdicts)
    assert len(evidence_for(ledger, liar.identity.peer_id)) == len(runner.verdicts)
