"""Attack 7 of issue 12: held connections.

From one address (127.0.0.2; honest clients come from 127.0.0.1), an attacker process opens 300
TCP connections to a ``moeswarm node``'s data plane and never starts TLS; it also opens 8
authenticated connections under one key, and announces a 2 MiB frame and stops after 100 bytes.
On the base commit 7895ee0 the node held a descriptor for every half-open connection (TLS was
negotiated before anything was counted), accepted any number of connections per key, and waited
for a frame body for ever. Now the node holds at most ``--max-conns-per-ip`` (32) of them, refuses
the fifth connection of one key with code 8 (``--max-conns-per-peer`` 4), gives up on a frame
body after ``--frame-timeout`` plus 1 s per MB, and serves an honest client throughout.

The count waits (bounded) for the attacker to see all but 32 of its connections closed, and
checks exactly 32 are still open then. Negative control, run by hand: the same test against a node
started with ``--max-conns-per-ip 1000`` printed "the node closed 300 of 300 together: a timeout,
not the cap" (counting after sleep(2), as before, could not tell the two apart once the 10 s
handshake timeout had fired).
"""

from __future__ import annotations

import asyncio
import subprocess
import time

from adversarial_support import attack, descriptors, finish, first_line, start_attacker

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.net.client import ExpertClient
from moeswarm.protocol import Identity, peer_id_from_str

CAP = 32


def _honest_ping(endpoint: str, peer: str) -> float:
    async def main() -> float:
        client = await ExpertClient.connect(endpoint, Identity.generate(), expected_peer=peer_id_from_str(peer),
                                            timeout=20)
        try:
            return await client.ping(timeout=10)
        finally:
            await client.aclose()

    return asyncio.run(main())


def ask(holder: subprocess.Popen[str]) -> int:
    """How many of its connections the holding attacker has seen the victim close so far."""
    assert holder.stdin is not None
    holder.stdin.write("count\n")
    holder.stdin.flush()
    return int(first_line(holder)["closed_by_victim"])


def test_one_address_holds_at_most_its_cap_and_slow_or_greedy_peers_are_cut_off() -> None:
    node = start_daemon("victim", ["node", "--model", str(CHECKPOINT), "--layers", "0-0", "--experts", "0-7",
                                   "--max-conns-per-ip", str(CAP), "--max-conns-per-peer", "4",
                                   "--frame-timeout", "1"])
    endpoint, peer, pid = node.info["endpoint"], node.info["peer_id"], node.process.pid
    try:
        assert _honest_ping(endpoint, peer) > 0
        time.sleep(0.5)
        before = descriptors(pid)
        holder = start_attacker("hold", endpoint, "--source", "127.0.0.2", "--count", "300")
        try:
            assert first_line(holder)["opened"] == 300  # the kernel accepts them all; the node keeps few
            deadline = time.monotonic() + 60  # bound: wait until the node has closed all but CAP of them
            while (closed := ask(holder)) < 300 - CAP:
                assert time.monotonic() < deadline, f"the node closed only {closed} of 300"
                time.sleep(0.05)
            held = descriptors(pid) - before  # (while it accepts, asyncio briefly holds up to ~240)
            # exactly CAP still open: refused at once, not timed out (the 10 s TLS handshake timeout
            # closes them all together; a node without the cap passes "closed >= 268" that way)
            assert closed == 300 - CAP, f"the node closed {closed} of 300 together: a timeout, not the cap"
            assert held <= CAP + 2, f"the node holds {held} descriptors for one address"
            assert _honest_ping(endpoint, peer) > 0  # another address is served during the attack
        finally:
            report = finish(holder)
        assert report["closed_by_victim"] >= 300 - CAP, report

        answers = attack("per-peer", endpoint, "--count", "8")["answers"]
        assert answers[:4] == ["open"] * 4 and answers[4:] == [8] * 4, answers

        slow = attack("slow-frame", endpoint, "--size", str(2 << 20), "--wait", "20")
        assert slow["closed"], slow  # 1 s + 2.1 s for 2 MiB, then the node lets go
    finally:
        stop_daemon(node)
