"""Crash test: SIGKILL the ledger service while a client streams receipts into it.

Afterwards every receipt the client saw acknowledged is in the database, the chain verifies,
and after a restart the client's resubmission completes without a duplicate entry."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from sqlalchemy import func, select

from moeswarm.ledger import (
    IngestResult,
    Ledger,
    ReceiptSubmitter,
    StoreConfig,
    SubmitterConfig,
    receipt_id,
    verify_chain,
)
from moeswarm.ledger._models import Entry
from moeswarm.protocol import Identity

from ledger_process import start_ledger
from ledger_support import MODEL, Peers, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
N = 1200


def _held(db: str) -> tuple[set[bytes], int]:
    with Ledger(StoreConfig(db)) as led:
        assert verify_chain(led).ok, verify_chain(led).problem
        with led.read() as conn:
            ids = set(conn.execute(select(Entry.receipt_id)).scalars())
            count = conn.execute(select(func.count()).select_from(Entry)).scalar_one()
    return ids, count


def test_sigkill_while_streaming(db_url: str, tmp_path: Path) -> None:
    port = free_port()
    key = tmp_path / "ledger.key"
    key.write_bytes(Identity.generate().seed())
    args = ["--db", db_url, "--key", str(key), "--listen", f"127.0.0.1:{port}", "--model", f"{MODEL}=8:16"]
    peers = Peers()
    receipts = peers.receipts(N)
    acked: dict[bytes, IngestResult] = {}
    config = SubmitterConfig(batch_size=40, max_delay_s=0.005, retry_initial_s=0.05, retry_max_s=0.2)
    first = start_ledger(args, tmp_path / "ledger.log")
    with Ledger(StoreConfig(db_url), Identity.from_seed(key.read_bytes())) as operator:
        peers.funded(operator)  # the operator's grants, beside the running service
    second = None
    try:
        async def stream() -> dict[str, int]:
            nonlocal second

            def on_result(r: IngestResult) -> None:
                acked[r.receipt_id or b""] = r

            async with ReceiptSubmitter(first.info["url"], tmp_path / "queue", config,
                                        on_result=on_result) as submitter:
                killed_at = None
                for i, cr in enumerate(receipts):
                    submitter(cr)
                    if i % 20 == 0:
                        await asyncio.sleep(0.002)  # yield to the sender: the client keeps streaming
                    if killed_at is None and (len(acked) >= N // 8 or i == N // 2):
                        deadline = asyncio.get_running_loop().time() + 30
                        while len(acked) < N // 8 and asyncio.get_running_loop().time() < deadline:
                            await asyncio.sleep(0.01)  # a slow ledger: wait for some acks, bounded
                        os.kill(first.process.pid, signal.SIGKILL)
                        first.process.wait(10)
                        killed_at = dict(acked)
                assert killed_at is not None and len(killed_at) >= N // 8
                # the service is dead: everything it acknowledged is durable and verifies
                held, _ = await asyncio.to_thread(_held, db_url)
                assert set(killed_at) <= held
                assert submitter.pending > 0
                second = await asyncio.to_thread(start_ledger, args, tmp_path / "ledger.log")
                assert await submitter.flush(60), "resubmission did not complete"
                return submitter.stats

        stats = asyncio.run(stream())
    finally:
        first.stop()
        if second is not None:
            second.stop()
    held, count = _held(db_url)
    assert count == N == len(held)  # every receipt exactly once
    assert held == {receipt_id(cr.receipt) for cr in receipts}
    assert len(acked) == N and all(r.status in ("accepted", "duplicate") for r in acked.values())
    assert stats["accepted"] + stats["duplicate"] >= N and stats["failures"] > 0
