"""The figures of issue 12's attacks 2 and 7, measured the way the attacks were run: a
``moeswarm node`` process, and the attacker of ``tests/adversarial`` in another process.

    PYTHONPATH=. python benchmarks/trust_attacks.py        # this tree
    PYTHONPATH=/path/to/other/checkout python benchmarks/trust_attacks.py   # compare a commit

Prints: the node's peak RSS growth while an 8 MiB nested Hello is sent as a first frame, and the
honest client's connect + ping time before and after; the descriptors the node holds while one
address keeps 300 half-open connections (TCP connected, no TLS). Medians of 3 connects.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "adversarial"))

from adversarial_support import attack, descriptors, finish, first_line, reset_peak_rss, rss_kib, start_attacker  # noqa: E402

from moeswarm.demo import CHECKPOINT  # noqa: E402
from moeswarm.demo.swarm import start_daemon, stop_daemon  # noqa: E402
from moeswarm.net.client import ExpertClient  # noqa: E402
from moeswarm.protocol import Identity, peer_id_from_str  # noqa: E402


def connect_s(endpoint: str, peer: str) -> float:
    async def one() -> float:
        t0 = time.perf_counter()
        client = await ExpertClient.connect(endpoint, Identity.generate(), expected_peer=peer_id_from_str(peer),
                                            timeout=60)
        await client.ping(timeout=30)
        await client.aclose()
        return time.perf_counter() - t0

    return statistics.median(asyncio.run(one()) for _ in range(3))


def main() -> None:
    node = start_daemon("victim", ["node", "--model", str(CHECKPOINT), "--layers", "0-0", "--experts", "0-7"])
    endpoint, peer, pid = node.info["endpoint"], node.info["peer_id"], node.process.pid
    try:
        before_connect = connect_s(endpoint, peer)
        reset_peak_rss(pid)
        rss0 = rss_kib(pid, "VmRSS")
        t0 = time.perf_counter()
        result = attack("hello-bomb", endpoint, "--size", str(8 << 20), "--phase", "before")
        bomb_s = time.perf_counter() - t0
        growth = (rss_kib(pid) - rss0) / 1024
        after_connect = connect_s(endpoint, peer)
        print("attack 2: 8 MiB nested Hello as the first frame")
        print(f"  answer: {result['before_auth']}; attacker done in {bomb_s:.1f} s")
        print(f"  node peak RSS: {rss0 / 1024:.0f} MiB before, +{growth:.1f} MiB during the attack")
        print(f"  honest connect+ping: {before_connect * 1e3:.0f} ms before, {after_connect * 1e3:.0f} ms after")

        time.sleep(0.5)
        fds0 = descriptors(pid)
        holder = start_attacker("hold", endpoint, "--source", "127.0.0.2", "--count", "300")
        opened = first_line(holder)["opened"]
        time.sleep(2.0)
        held = descriptors(pid) - fds0
        during_connect = connect_s(endpoint, peer)
        report = finish(holder)
        print("attack 7: 300 half-open connections from 127.0.0.2")
        print(f"  opened {opened}; node holds {held} more descriptors (baseline {fds0}); "
              f"{report['closed_by_victim']} closed by the node")
        print(f"  honest connect+ping from 127.0.0.1 during the attack: {during_connect * 1e3:.0f} ms")
    finally:
        stop_daemon(node)


if __name__ == "__main__":
    try:
        main()
    except subprocess.TimeoutExpired as e:
        sys.exit(f"timed out: {e}")
