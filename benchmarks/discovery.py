"""Discovery with many real libp2p peers on this machine (issue 31, point 5).

    python benchmarks/discovery.py [--peers 100 300 1000] [--per-process 50] [--backbones 3] [--window 60]

For each size, ``tests/peer_swarm.py`` starts that many holders (real TCP, Noise, Yamux,
GossipSub, the project's Announcer; holder ``i`` serves expert ``i``, so full coverage means every
record was seen), then measures:

- ``coverage_s``: a new backbone (P2PNode start + Discovery) until every holder's record is live,
  median over ``--backbones`` backbones joining one after another;
- ``departure_s``: a holder withdraws; until every backbone holds its withdrawal record;
- ``move_s``: a holder announces another block; until every backbone holds the new record;
- over ``--window`` seconds of steady state (holders refreshing every 240 s as shipped):
  bytes every holder read from its libp2p connections (DHT and gossip together), announcement
  messages it checked, CPU, per holder; resident memory per holder; GossipSub GRAFT, PRUNE and
  IHAVE messages handled per holder per second (mesh churn: none when nothing changes);
- then, per announcement: ``--announcements`` holders publish their record once more (spread
  over ``--spread`` seconds); the bytes and CPU each node spends above its idle rate, divided
  by the announcements (``bytes_per_message``, ``cpu_ms_per_message``: every node receives
  each). Last, so that its backlog (50 holders share a process and its GIL) does not delay the
  departure and the move;
- ``uncovered_each``: experts each backbone still had no holder for when ``--timeout`` ended
  (0: full coverage), and the machine's load average at the start and end of the size.

The last line is one JSON object for the largest size that ran. A size that does not start
within ``--start-timeout`` is reported as such and stops the sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from peer_swarm import PeerSwarm  # noqa: E402

BASELINE_KIB = 95_000  # one worker's resident memory before its first peer (python + libp2p imported)


async def _until(condition: Any, timeout_s: float) -> float:
    """Seconds until ``condition()`` holds; NaN if it did not within ``timeout_s`` (reported as measured)."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        return float("nan")
    return time.monotonic() - t0


async def run(peers: int, args: argparse.Namespace) -> dict[str, Any]:
    async with PeerSwarm(peers, per_process=args.per_process, start_timeout_s=args.start_timeout) as swarm:
        load_started = os.getloadavg()[0]
        coverage: list[float] = []
        uncovered: list[int] = []
        backbones = []
        for _ in range(args.backbones):
            t0 = time.monotonic()
            d = await swarm.backbone()
            missing = await d.wait_for_coverage(peers, args.timeout)
            coverage.append(time.monotonic() - t0 if not missing else float("nan"))
            uncovered.append(len(missing))
            backbones.append(d)
        s0, t0 = await swarm.stats(), time.monotonic()
        await asyncio.sleep(args.window)
        s1, window = await swarm.stats(), time.monotonic() - t0

        def total(stats: list[dict[str, Any]], key: str) -> float:
            return float(sum(s[key] for s in stats))

        gone, moved = 1, 3
        t_ms = int(time.time() * 1000)
        t0 = time.monotonic()
        await swarm.withdraw(gone)

        def departed() -> bool:
            return all(any(h.experts == (gone, gone) and h.expires_at_ms <= t_ms + 5_000 for h in d.table.holders.values())
                       for d in backbones)

        # from before the command to the holder; NaN if some backbone did not see it within --timeout
        waited = await _until(departed, args.timeout)
        departure_s = waited if math.isnan(waited) else time.monotonic() - t0
        t0 = time.monotonic()
        await swarm.move(moved, (moved, moved + 1))
        waited = await _until(lambda: all(any(h.experts == (moved, moved + 1) for h in d.table.holders.values())
                                          for d in backbones), args.timeout)
        move_s = waited if math.isnan(waited) else time.monotonic() - t0

        # per announcement: --announcements holders publish once more, spread over --spread seconds; what each
        # node reads and spends above the idle window's rate, divided by the announcements
        r0, t0 = await swarm.stats(), time.monotonic()
        published = await swarm.refresh(args.spread, args.announcements)
        await asyncio.sleep(15)  # the last ones propagate, the processes work off their backlog
        r1, burst = await swarm.stats(), time.monotonic() - t0
        idle_bps = (total(s1, "bytes_in") - total(s0, "bytes_in")) / peers / window
        idle_cpu = (total(s1, "cpu_s") - total(s0, "cpu_s")) / peers / window
        bytes_per_message = ((total(r1, "bytes_in") - total(r0, "bytes_in")) / peers - idle_bps * burst) / published
        cpu_per_message = ((total(r1, "cpu_s") - total(r0, "cpu_s")) / peers - idle_cpu * burst) / published

        def control(kind: str) -> float:  # GossipSub control messages handled per node per second
            return round(sum(b["control"].get(kind, 0) - a["control"].get(kind, 0) for a, b in zip(s0, s1))
                         / peers / window, 3)

        refused: dict[str, int] = {}  # topic messages the holders' gates refused, by reason (whole run)
        for worker in r1:
            for why, n in worker["refused"].items():
                refused[why] = refused.get(why, 0) + n
        return {
            "peers": peers, "processes": len(swarm.workers), "startup_s": round(swarm.startup_s, 1),
            "refused": refused,
            "uncovered_each": uncovered, "graft_per_node_s": control("handle_graft"),
            "prune_per_node_s": control("handle_prune"), "ihave_per_node_s": control("handle_ihave"),
            "load_at_start": round(load_started, 1), "load_at_end": round(os.getloadavg()[0], 1),
            "coverage_s": round(statistics.median(coverage), 3), "coverage_each_s": [round(c, 3) for c in coverage],
            "departure_s": round(departure_s, 3), "move_s": round(move_s, 3),
            "bytes_per_node_s": round((total(s1, "bytes_in") - total(s0, "bytes_in")) / peers / window, 1),
            "messages_per_node_min": round((total(s1, "messages") - total(s0, "messages")) / peers / window * 60, 2),
            "cpu_per_node": round((total(s1, "cpu_s") - total(s0, "cpu_s")) / peers / window, 5),
            "rss_mib_per_node": round((total(s1, "rss_kib") - BASELINE_KIB * len(swarm.workers)) / peers / 1024, 2),
            "dht_passes": sum(d.dht_passes for d in backbones),
            "bytes_per_message": round(bytes_per_message, 1), "cpu_ms_per_message": round(cpu_per_message * 1e3, 3),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--per-process", type=int, default=50)
    parser.add_argument("--backbones", type=int, default=3)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds each worker process may take to start its holders")
    parser.add_argument("--spread", type=float, default=30.0, help="seconds over which holders publish once more")
    parser.add_argument("--announcements", type=int, default=60, help="how many holders publish once more")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for peers in args.peers:
        try:
            rows.append(asyncio.run(run(peers, args)))
        except (TimeoutError, RuntimeError) as e:
            print(f"{peers} peers: did not run to the end on this machine: {e!r}", flush=True)
            break
        print(json.dumps(rows[-1]), flush=True)
    keys = ["peers", "processes", "startup_s", "coverage_s", "departure_s", "move_s", "bytes_per_node_s",
            "messages_per_node_min", "cpu_per_node", "rss_mib_per_node", "dht_passes", "graft_per_node_s",
            "bytes_per_message", "cpu_ms_per_message",
            "load_at_start", "load_at_end"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    if rows:
        last = rows[-1]
        print(json.dumps({k: last[k] for k in ("peers", "coverage_s", "departure_s", "move_s", "bytes_per_node_s",
                                                "cpu_per_node")}))


if __name__ == "__main__":
    main()
