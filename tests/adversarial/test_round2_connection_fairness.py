"""Issue 32, point 9: filling the node's global connection cap from many addresses.

A ``moeswarm node`` holds at most ``--max-connections`` connections, ``--max-conns-per-ip`` per
address. Scaled down from the issue's 40 addresses x 32 connections against 1,024 (so the test
takes seconds), an attacker process opens 4 connections from each of 40 addresses (127.0.0.2 to
127.0.0.41) against a cap of 128, and never starts TLS: 160 connections, every address within
its own cap. Then an honest client from 127.0.0.1 pings the node. On main 52de96c a full node
closed every newcomer at accept; there this test printed ``AssertionError: the honest client was
refused while the node was full: Unreachable: cannot connect to tcp+tls://127.0.0.1:41501:
[Errno 104] Connection reset by peer``. Now a newcomer whose address holds
fewer connections than the heaviest address (by 2 or more) takes that address's oldest
connection (the relay's fair share for devices): the honest client is served during the attack.
"""

from __future__ import annotations

import asyncio
import time

from adversarial_support import descriptors, finish, first_line, start_attacker

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.net.client import ExpertClient
from moeswarm.protocol import Identity, peer_id_from_str

CAP, PER_ADDRESS, ADDRESSES = 128, 4, 40


def _honest_ping(endpoint: str, peer: str) -> str:
    """"ok", or why the honest client was turned away."""
    async def main() -> str:
        try:
            client = await ExpertClient.connect(endpoint, Identity.generate(), expected_peer=peer_id_from_str(peer),
                                                timeout=8)
        except Exception as e:  # noqa: BLE001 -- the test reports what the honest client met
            return f"{type(e).__name__}: {e}"
        try:
            await client.ping(timeout=8)
            return "ok"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_many_addresses_at_their_caps_cannot_lock_a_newcomer_out() -> None:
    node = start_daemon("victim", ["node", "--model", str(CHECKPOINT), "--layers", "0-0", "--experts", "0-7",
                                   "--max-connections", str(CAP), "--max-conns-per-ip", str(PER_ADDRESS)])
    endpoint, peer, pid = node.info["endpoint"], node.info["peer_id"], node.process.pid
    try:
        assert _honest_ping(endpoint, peer) == "ok"
        time.sleep(0.5)  # the honest client's connection is closed on both sides
        before = descriptors(pid)
        sources = ",".join(f"127.0.0.{i}" for i in range(2, 2 + ADDRESSES))
        holder = start_attacker("hold", endpoint, "--sources", sources, "--count", str(PER_ADDRESS))
        try:
            assert first_line(holder)["opened"] == ADDRESSES * PER_ADDRESS  # more than the node's cap
            deadline = time.monotonic() + 8  # within the node's 10 s handshake timeout
            while descriptors(pid) - before != CAP and time.monotonic() < deadline:
                time.sleep(0.05)  # accepted all 160, closed the 32 over its cap: the node is full
            assert descriptors(pid) - before == CAP
            answer = _honest_ping(endpoint, peer)
            assert answer == "ok", f"the honest client was refused while the node was full: {answer}"
        finally:
            report = finish(holder)
        assert report["closed_by_victim"] >= ADDRESSES * PER_ADDRESS - CAP, report
    finally:
        stop_daemon(node)
