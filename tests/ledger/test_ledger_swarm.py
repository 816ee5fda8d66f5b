"""End to end: a generation through a local swarm of expert processes, the backbone's receipt sink
feeding two ledger services (SQLite and PostgreSQL) through ReceiptSubmitters.

Each ledger must then hold exactly one countersigned receipt per expert call served, with FLOPs
by the formula, and verify."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from sqlalchemy import select

from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT, DEFAULT_PROMPT
from moeswarm.demo.swarm import local_swarm
from moeswarm.ledger import (
    Ledger,
    LedgerService,
    ModelShape,
    ReceiptSubmitter,
    StoreConfig,
    SubmitterConfig,
    list_receipts,
    verify_chain,
)
from moeswarm.ledger._models import Entry
from moeswarm.model import SamplingParams, generate
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.protocol import CountersignedReceipt, Identity, peer_id_from_str

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_generation_through_a_swarm_lands_in_the_ledger(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    urls = [str(tmp_path / "swarm.db"), str(request.getfixturevalue("pg_url"))]  # SQLite and PostgreSQL
    key = Identity.generate()

    with local_swarm(str(CHECKPOINT), 2, experts_per_layer=8) as daemons:
        boot = daemons[0].info["multiaddrs"][0]
        holders = {peer_id_from_str(d.info["peer_id"]) for d in daemons}

        async def main() -> tuple[int, int, SwarmBackbone]:
            ledgers = [Ledger(StoreConfig(url, create=True), key) for url in urls]
            backbone = SwarmBackbone(BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(boot,), client_mode=True),
                                                    coverage_timeout_s=60))
            shape = ModelShape(backbone.cfg.hidden_size, backbone.cfg.moe_intermediate_size, backbone.cfg.top_k)
            for led in ledgers:  # the operator registers the model and funds the backbone
                led.register_model(backbone.model_id, shape)
                led.grant(backbone.identity.peer_id, 10**15)
            config = SubmitterConfig()
            async with contextlib.AsyncExitStack() as stack:
                for led in ledgers:
                    stack.callback(led.close)
                services = [await stack.enter_async_context(LedgerService(led)) for led in ledgers]
                submitters = [await stack.enter_async_context(ReceiptSubmitter(s.url, tmp_path / f"queue{i}", config))
                              for i, s in enumerate(services)]
                bb = await stack.enter_async_context(backbone)  # closes before the submitters
                assert bb.model is not None and bb.executor is not None

                def fan_out(cr: CountersignedReceipt) -> None:
                    for submit in submitters:
                        submit(cr)

                bb.executor.receipts = fan_out
                ids = bb.tokenizer().encode(DEFAULT_PROMPT)
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, ids,  # type: ignore[arg-type]
                                                                       SamplingParams(max_new_tokens=8))))
                assert len(tokens) == 8
                await bb.executor.flush_receipts()  # v1.3: unbatched receipts too
                for submit in submitters:
                    assert await submit.flush(30)
                return bb.executor.calls, bb.executor.bad_receipts, bb

        calls, bad, bb = asyncio.run(main())

    assert calls > 0 and bad == 0
    H, F = bb.cfg.hidden_size, bb.cfg.moe_intermediate_size
    for url in urls:
        with Ledger(StoreConfig(url)) as led:
            rows = list_receipts(led)
            assert len(rows) == calls, url
            with led.read() as conn:
                request_ids = set(conn.execute(select(Entry.request_id)).scalars())
            assert len(request_ids) == calls
            assert all(r.expert_flops == 6 * H * F * r.pairs for r in rows)
            assert {r.server for r in rows} <= holders and {r.client for r in rows} == {bb.identity.peer_id}
            assert {r.model_id for r in rows} == {bb.model_id}
            report = verify_chain(led)
            assert report.ok and report.entries == calls
