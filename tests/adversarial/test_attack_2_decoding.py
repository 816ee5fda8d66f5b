"""Attack 2 of issue 12: decoding before authentication.

One 8 MiB Hello of nested empty arrays, sent as the first frame to a ``moeswarm node`` over real
TLS by a separate attacker process, raised the node's peak memory by ~600 MB on the base commit
7895ee0 (the whole body was read and msgpack built 8 million lists), and the same bomb inside an
authenticated frame did too. Now a peer that has not authenticated may send 8 KiB at most (the
length is refused before a body byte is read: code 3), and every decode is bounded (the
authenticated bomb is refused by the pre-scan: code 1). On 7895ee0 this test fails: the first
answer is code 4 (after the full decode) and the node's peak grows by hundreds of MB.
"""

from __future__ import annotations

import asyncio

from adversarial_support import attack, reset_peak_rss, rss_kib

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.net.client import ExpertClient
from moeswarm.protocol import Identity, peer_id_from_str


def test_nested_hello_bomb_is_refused_unread_and_honest_clients_still_connect() -> None:
    node = start_daemon("victim", ["node", "--model", str(CHECKPOINT), "--experts", "0-7"])
    try:
        pid = node.process.pid
        reset_peak_rss(pid)
        base_kib = rss_kib(pid, "VmRSS")
        result = attack("hello-bomb", node.info["endpoint"], "--size", str(8 << 20), "--phase", "before")
        growth_mib = (rss_kib(pid) - base_kib) / 1024
        assert result["before_auth"]["code"] == 3, result  # frame_too_large, decided on the header
        assert growth_mib < 16, f"peak memory grew by {growth_mib:.0f} MiB before authentication"

        # an authenticated peer may send frames up to 64 MiB: the 8 MiB body is read (and copied
        # once by the stream), but decoding it builds nothing
        reset_peak_rss(pid)
        base_kib = rss_kib(pid, "VmRSS")
        result = attack("hello-bomb", node.info["endpoint"], "--size", str(8 << 20), "--phase", "after")
        growth_mib = (rss_kib(pid) - base_kib) / 1024
        assert result["after_auth"]["code"] == 1, result  # malformed: 8M-item array refused by the scan
        assert growth_mib < 4 * 8 + 16, f"peak memory grew by {growth_mib:.0f} MiB for an 8 MiB frame"
        assert node.process.poll() is None

        async def honest() -> float:
            client = await ExpertClient.connect(node.info["endpoint"], Identity.generate(),
                                                expected_peer=peer_id_from_str(node.info["peer_id"]), timeout=20)
            try:
                return await client.ping(timeout=10)
            finally:
                await client.aclose()

        assert asyncio.run(honest()) > 0
    finally:
        stop_daemon(node)
