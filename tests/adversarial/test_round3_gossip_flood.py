"""Issue 31, point 2: a flood of fresh keys on a model's announcement topic.

A backbone follows a model (2 layers x 8 experts) served by 4 honest holders, each announcing
itself on the model's GossipSub topic; its view of the topic keeps at most 256 records. Then an
attacker process (``attackers/gossip_sybils.py``), one libp2p peer from another address
(127.0.0.2), publishes 1,000 valid announcements signed by 1,000 fresh keys, each claiming every
expert of the model. The backbone must still list every honest holder as live, keep no more than
256 records, and still see an honest holder's departure.

Run against the new path before its defence (the gossip view evicting its oldest record when full,
no budgets per address or signer: the natural bound on memory), this test printed
``AssertionError: the flood evicted 4 of the 4 honest holders (view 256, table 256, refused {'stale': 12})``.
With the defence (``TopicGate``: new keys per forwarding address, per signer; ``RecordView``
never evicts a live record) it passes: the honest records keep their place and the flood is
refused once its address's budget of new keys or the view's room is spent.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from moeswarm.net.announce import AnnounceConfig, Announcer
from moeswarm.net.discovery import Discovery
from moeswarm.net.gossip_view import GossipLimits
from moeswarm.net.p2p import P2PConfig, P2PNode
from moeswarm.net.routing_table import SwarmTable
from moeswarm.protocol import Identity

SYBILS = Path(__file__).with_name("attackers") / "gossip_sybils.py"
MODEL = "honest/gossip"
LAYERS, EXPERTS, HONEST, VIEW = 2, 8, 4, 256


def test_a_thousand_fresh_keys_on_the_topic_do_not_push_out_honest_holders() -> None:
    asyncio.run(_scenario())


async def _scenario() -> None:
    async with P2PNode(Identity.generate(), P2PConfig()) as backbone:
        table = SwarmTable(MODEL)
        discovery = Discovery(backbone, table, range(LAYERS), num_layers=LAYERS, num_experts=EXPERTS,
                              gossip_limits=GossipLimits(max_records=VIEW))
        holders: list[tuple[P2PNode, Announcer]] = []
        try:
            for i in range(HONEST):
                node = await P2PNode(Identity.generate(), P2PConfig(bootstrap=(backbone.multiaddrs[0],))).__aenter__()
                announcer = Announcer(node, node._identity, AnnounceConfig(
                    MODEL, (0, LAYERS - 1), tuple(range(LAYERS)), (2 * i, 2 * i + 1), ("tcp+tls://127.0.0.1:9",), 1))
                holders.append((node, announcer))
                await announcer.start()
            assert not await discovery.wait_for_coverage(EXPERTS, 60)
            honest = {a.identity.peer_id for _, a in holders}
            assert honest <= {h.peer_id for h in table.live()}

            flood = await asyncio.to_thread(
                subprocess.run, [sys.executable, str(SYBILS), backbone.multiaddrs[0], "--model", MODEL, "--layers",
                                 str(LAYERS), "--experts", str(EXPERTS), "--keys", "1000"],
                capture_output=True, text=True, timeout=300, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
            lines = [line for line in flood.stdout.splitlines() if line.startswith("{")]
            assert flood.returncode == 0 and lines, flood.stderr[-2000:]
            assert json.loads(lines[-1])["published"] == 1000
            gate = discovery.gossip.gate  # type: ignore[union-attr]
            seen = gate.accepted + sum(gate.refused.values())  # what reached its check (GossipSub's own score
            # gate drops the rest of an invalid-heavy sender's messages before they get there)
            assert seen > VIEW + HONEST, f"the flood did not reach the backbone: {seen} messages, {gate.refused}"

            left = honest - {h.peer_id for h in table.live()}
            assert not left, (f"the flood evicted {len(left)} of the {HONEST} honest holders (view "
                              f"{len(gate.view)}, table {len(table.holders)}, refused {gate.refused})")
            assert len(gate.view) <= VIEW and len(table.holders) <= VIEW

            gone = holders[0][1]
            await gone.withdraw()  # a departure still reaches the backbone through the flooded topic
            async with asyncio.timeout(30):
                while gone.identity.peer_id in {h.peer_id for h in table.live()}:
                    await asyncio.sleep(0.05)
        finally:
            await discovery.aclose()
            for node, announcer in holders:
                await announcer.withdraw()
                await node.stop()
