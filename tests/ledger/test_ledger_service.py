"""The ingestion service and the backbone's ReceiptSubmitter, in one process, on both backends."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from pathlib import Path

import aiohttp
import msgpack

from moeswarm.ledger import (
    IngestResult,
    Reason,
    Ledger,
    LedgerService,
    ModelShape,
    ReceiptSubmitter,
    SubmitterConfig,
    verify_chain,
)
from moeswarm.protocol import encode

from ledger_support import EPOCH_MS, T0, Clock, Peers, fund

FAST = SubmitterConfig(batch_size=10, max_delay_s=0.01, retry_initial_s=0.02, retry_max_s=0.1, close_timeout_s=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_post_receipts_answers_per_item_after_commit(ledger: Ledger) -> None:
    good, other = Peers().funded(ledger).receipts(2)
    items = [encode(good), encode(good), b"junk", 42, encode(other)]

    async def main() -> tuple[dict, dict, int]:
        async with LedgerService(ledger) as service, aiohttp.ClientSession() as http:
            async with http.post(f"{service.url}/v1/receipts", data=msgpack.packb({"receipts": items})) as r:
                answer = await r.json()
            async with http.get(f"{service.url}/healthz") as r:
                health = await r.json()
            async with http.post(f"{service.url}/v1/receipts", data=b"\xc1") as r:
                status = r.status
        return answer, health, status

    answer, health, bad_status = asyncio.run(main())
    results = [IngestResult.from_json(r) for r in answer["results"]]
    assert [r.status for r in results] == ["accepted", "duplicate", "rejected", "rejected", "accepted"]
    assert results[2].reason == results[3].reason == "malformed"
    assert answer["head"] == 2 and health["entries"] == 2
    assert health["peer_id"] == ledger.identity.peer_id_str  # type: ignore[union-attr]
    assert bad_status == 400


def test_submitter_batches_in_the_background(ledger: Ledger, tmp_path: Path) -> None:
    receipts = Peers().funded(ledger).receipts(35)
    acked: list[IngestResult] = []

    async def main() -> dict[str, int]:
        async with LedgerService(ledger) as service:
            submitter = ReceiptSubmitter(service.url, tmp_path / "queue", FAST, on_result=acked.append)
            await submitter.start()
            for cr in receipts[:20]:
                submitter(cr)  # on the loop, like RemoteExperts.settle_receipts

            def from_a_thread() -> None:
                for cr in receipts[20:]:
                    submitter(cr)

            await asyncio.to_thread(from_a_thread)
            assert await submitter.flush(10)
            await submitter.aclose()
            return submitter.stats

    stats = asyncio.run(main())
    assert ledger.head().position == 35 and len(acked) == 35
    assert stats["accepted"] == 35 and stats["posts"] >= 4
    assert verify_chain(ledger).ok


def test_submitter_spools_while_the_ledger_is_down_and_resubmits(ledger: Ledger, tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    receipts = Peers().funded(ledger).receipts(25)
    queue = tmp_path / "queue"

    async def while_down() -> int:
        async with ReceiptSubmitter(url, queue, replace(FAST, close_timeout_s=0.1)) as submitter:
            for cr in receipts:
                submitter(cr)
            assert not await submitter.flush(0.3)  # nobody listens
            return submitter.pending

    assert asyncio.run(while_down()) == 25  # all spooled when it closed
    assert len(list(queue.glob("*.spool"))) >= 3

    async def back_up() -> dict[str, int]:
        from moeswarm.ledger import ServiceConfig

        async with LedgerService(ledger, ServiceConfig(port=port)), ReceiptSubmitter(url, queue, FAST) as submitter:
            assert submitter.pending == 25
            submitter(receipts[0])  # a duplicate of a spooled one
            assert await submitter.flush(10)
            return submitter.stats

    stats = asyncio.run(back_up())
    assert ledger.head().position == 25
    assert stats["accepted"] == 25 and stats["duplicate"] == 1
    assert not list(queue.glob("*.spool"))


def test_only_the_operator_registers_models_and_undecided_receipts_wait(ledger: Ledger, tmp_path: Path) -> None:
    peers = Peers().funded(ledger)
    unknown = peers.receipts(3, model="new/model")
    config = SubmitterConfig(batch_size=10, max_delay_s=0.01, retry_initial_s=0.02, retry_max_s=0.05)

    async def main() -> tuple[int, int]:
        async with LedgerService(ledger) as service, aiohttp.ClientSession() as http:
            async with http.put(f"{service.url}/v1/models/new/model", json={"hidden": 1, "ffn": 1}) as r:
                put = r.status  # no such route: a backbone cannot register (or squat) a model's shape
            async with ReceiptSubmitter(service.url, tmp_path / "a", config) as submitter:
                for cr in unknown:
                    submitter(cr)
                assert not await submitter.flush(0.5)  # "retry": kept, resent
                waiting = submitter.pending
                await asyncio.to_thread(ledger.register_model, "new/model", ModelShape(8, 16))  # the operator
                assert await submitter.flush(10)
        return put, waiting

    put, waiting = asyncio.run(main())
    assert put in (404, 405) and waiting == 3
    assert ledger.models()["new/model"] == ModelShape(8, 16)
    assert ledger.head().position == 3


def test_service_serves_proofs_and_statements(ledger: Ledger, clock: Clock) -> None:
    from moeswarm.ledger import Proof, check_proof, settle_epoch

    clock.ms = T0 + 1
    [result] = ledger.ingest(Peers().funded(ledger).receipts(1))
    clock.ms = T0 + EPOCH_MS
    settle_epoch(ledger, T0 // EPOCH_MS)

    async def main() -> tuple[dict, dict, int]:
        async with LedgerService(ledger) as service, aiohttp.ClientSession() as http:
            async with http.get(f"{service.url}/v1/proofs/{(result.receipt_id or b'').hex()}") as r:
                proof = await r.json()
            async with http.get(f"{service.url}/v1/settlements/{T0 // EPOCH_MS}") as r:
                statement = await r.json()
            async with http.get(f"{service.url}/v1/settlements/1") as r:
                missing = r.status
        return proof, statement, missing

    proof, statement, missing = asyncio.run(main())
    assert check_proof(Proof.from_json(proof), ledger_key=ledger.ledger_peer_id) is None
    assert statement["receipts"] == 1 and missing == 404


def test_receipts_after_close_go_to_disk(ledger: Ledger, tmp_path: Path) -> None:
    late = Peers().funded(ledger).receipts(2)

    async def main() -> None:
        submitter = ReceiptSubmitter("http://127.0.0.1:9", tmp_path / "q", replace(FAST, close_timeout_s=0.05))
        await submitter.start()
        await submitter.aclose()
        for cr in late:
            submitter(cr)  # e.g. a backbone's final settle_receipts after the sink closed

    asyncio.run(main())
    assert len(list((tmp_path / "q").glob("*.spool"))) == 2

    async def deliver() -> None:
        async with LedgerService(ledger) as service, ReceiptSubmitter(service.url, tmp_path / "q", FAST) as s:
            assert s.pending == 2 and await s.flush(10)

    asyncio.run(deliver())
    assert ledger.head().position == 2


def test_accounts_and_standing_over_http(ledger: Ledger, clock: Clock) -> None:
    peers = Peers()
    rich, poor = peers.clients
    fund(ledger, rich, amount=5000)
    clock.ms = T0 + 1
    results = ledger.ingest(peers.receipts(4))  # clients alternate: rich pays, poor is refused
    assert [r.status for r in results] == ["accepted", "rejected"] * 2
    assert results[1].reason == Reason.INSUFFICIENT_FUNDS and "holds 0 credits" in results[1].message
    paid = 2 * 6 * 8 * 16 * 2

    async def main() -> tuple[dict, dict, dict, int, int]:
        async with LedgerService(ledger) as service, aiohttp.ClientSession() as http:
            async with http.get(f"{service.url}/v1/accounts/{rich.peer_id_str}") as r:
                a = await r.json()
            async with http.get(f"{service.url}/v1/accounts/{poor.peer_id_str}") as r:
                b = await r.json()
            async with http.post(f"{service.url}/v1/standing",
                                 json={"peers": [rich.peer_id_str, poor.peer_id_str], "since_ms": T0 + 2}) as r:
                later = await r.json()
            async with http.get(f"{service.url}/v1/accounts/not-a-peer") as r:
                bad = r.status
            async with http.post(f"{service.url}/v1/standing", json={"peers": ["x"] * 2000}) as r:
                too_many = r.status
        return a, b, later, bad, too_many

    a, b, later, bad, too_many = asyncio.run(main())
    assert (a["balance"], a["paid"], a["receipts"], a["funded"]) == (5000 - paid, paid, 2, True)
    assert (b["balance"], b["paid"], b["receipts"], b["funded"]) == (0, 0, 0, False)
    assert [s["paid"] for s in later["standing"]] == [0, 0]  # nothing paid since then
    assert bad == 400 and too_many == 400


def test_contributors_are_the_servers_ranked_by_settled_credit(ledger: Ledger, clock: Clock) -> None:
    """GET /v1/contributors (what `moeswarm monitor --ledger` shows): the signed settlements' paid
    balances summed per server, highest first; the same figures as `balance` gives each of them."""
    from moeswarm.ledger import peer_balance, settle_epoch
    from moeswarm.protocol import peer_id_to_str

    peers = Peers().funded(ledger)
    clock.ms = T0 + 1
    assert all(r.reason == "" for r in ledger.ingest(peers.receipts(7)))
    clock.ms = T0 + EPOCH_MS
    settle_epoch(ledger, T0 // EPOCH_MS)

    async def main() -> tuple[dict, int]:
        async with LedgerService(ledger) as service, aiohttp.ClientSession() as http:
            async with http.get(f"{service.url}/v1/contributors?top=2") as r:
                top = await r.json()
            async with http.get(f"{service.url}/v1/contributors?top=x") as r:
                bad = r.status
        return top, bad

    top, bad = asyncio.run(main())
    ranked = sorted(((peer_balance(ledger, s.peer_id).settled, s.peer_id) for s in peers.servers),
                    key=lambda cp: (-cp[0], cp[1]))  # most credit first; ties by peer ID bytes
    got = [(c["credit"], c["peer_id"]) for c in top["contributors"]]
    assert got == [(credit, peer_id_to_str(peer)) for credit, peer in ranked[:2]] and got[0][0] > 0
    assert bad == 400
