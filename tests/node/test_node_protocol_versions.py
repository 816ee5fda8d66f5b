"""A mixed swarm (issue 29): a v1.2 node (``--protocol-versions 1``, its own process: every answer
carries its signed receipt) beside a v1.3 node (receipts in batches), used by a v1.3 backbone
and by a v1.2 one. Both backbones get the single-process engine's greedy tokens, every call's
receipt verifies and is of the kind its connection's version says; a client that speaks only
version 2 is refused by the v1.2 node with an error naming both sides' versions."""

from __future__ import annotations

import asyncio

import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT, DEFAULT_PROMPT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.errors import ProtocolError
from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.net.client import ExpertClient
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.node.dispatch import DispatchConfig
from moeswarm.protocol import BatchedReceipt, CountersignedReceipt, ErrorCode, Identity, peer_id_from_str, verify_record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
TOKENS = 6


async def _generate(boot: str, versions: tuple[int, ...]) -> dict[str, object]:
    config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(boot,), client_mode=True), coverage_timeout_s=60,
                            dispatch=DispatchConfig(versions=versions))
    async with SwarmBackbone(config) as bb:
        assert bb.model is not None and bb.executor is not None
        receipts: list[CountersignedReceipt | BatchedReceipt] = []
        bb.executor.receipts = receipts.append
        ids = bb.tokenizer().encode(DEFAULT_PROMPT)
        model = bb.model
        tokens = await asyncio.to_thread(lambda: list(generate(model, ids, SamplingParams(max_new_tokens=TOKENS))))
        await bb.executor.flush_receipts()
        versions_by_peer = {c.server_peer: c.version for c in bb.executor.connections.open_clients()}
        return {"tokens": tokens, "receipts": receipts, "calls": bb.executor.calls, "bad": bb.executor.bad_receipts,
                "versions": versions_by_peer, "served_by": set(bb.executor.served_by), "ids": ids}


def test_v1_2_and_v1_3_peers_interoperate_or_refuse_naming_versions() -> None:
    old = start_daemon("v1.2 node", ["node", "--model", str(CHECKPOINT), "--experts", "0-3",
                                     "--protocol-versions", "1"])
    try:
        boot = old.info["multiaddrs"][0]
        new = start_daemon("v1.3 node", ["node", "--model", str(CHECKPOINT), "--experts", "4-7", "--bootstrap", boot])
        try:
            v13 = asyncio.run(_generate(boot, (1, 2)))
            v12 = asyncio.run(_generate(boot, (1,)))

            async def only_v2() -> str:
                try:
                    client = await ExpertClient.connect(old.info["endpoint"], Identity.generate(), versions=(2,),
                                                        expected_peer=peer_id_from_str(old.info["peer_id"]))
                except ProtocolError as e:
                    assert e.code == ErrorCode.UNSUPPORTED_VERSION
                    return str(e)
                await client.aclose()
                return "connected"

            refused = asyncio.run(only_v2())
        finally:
            stop_daemon(new)
        old_peer, new_peer = peer_id_from_str(old.info["peer_id"]), peer_id_from_str(new.info["peer_id"])
    finally:
        stop_daemon(old)

    model = load_model(str(CHECKPOINT))
    expected = list(generate(model, v13["ids"], SamplingParams(max_new_tokens=TOKENS)))  # type: ignore[arg-type]
    assert v13["tokens"] == v12["tokens"] == expected
    assert v13["versions"] == {old_peer: 1, new_peer: 2} and v12["versions"] == {old_peer: 1, new_peer: 1}
    for run in (v13, v12):
        assert run["served_by"] == {old_peer, new_peer} and run["bad"] == 0
        receipts = run["receipts"]
        assert len(receipts) == run["calls"]  # type: ignore[arg-type]
        for r in receipts:  # type: ignore[attr-defined]
            verify_record(r)
    kinds = {(r.receipt.server, type(r).__name__) for r in v13["receipts"]}  # type: ignore[attr-defined]
    assert kinds == {(old_peer, "CountersignedReceipt"), (new_peer, "BatchedReceipt")}
    assert {type(r).__name__ for r in v12["receipts"]} == {"CountersignedReceipt"}  # type: ignore[attr-defined]
    assert "no common version: client [2], server [1]" in refused, refused
