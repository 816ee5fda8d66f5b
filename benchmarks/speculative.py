"""Speculative decoding through a swarm at a 3.4 ms round trip, repetitive vs non-repetitive text.

Two expert nodes and a backbone on the demo checkpoint; every data-plane connection goes through
a proxy process that delays each direction by 1.7 ms (a 3.4 ms round trip, the seed's measured
RTT; this kernel has no netem, so the link is emulated in userspace: benchmarks/_delay.py,
benchmarks/_links.py ``delayed_swarm``).  Prints the measured round trips, then decode tokens/s
with and without prompt-lookup speculation (k=4) in one table.

    python benchmarks/speculative.py [--tokens 48] [--rtt-ms 3.4]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import statistics
import time

from _delay import measure_rtts  # benchmarks/_delay.py
from _links import delayed_swarm  # benchmarks/_links.py

PROMPTS = {
    "repetitive": "And the LORD said unto Moses, Speak unto the children of Israel. And the LORD said unto Moses, "
                  "Speak unto the children of Israel. And the LORD said unto Moses,",
    "non-repetitive": "Now the serpent was more subtil than any beast",  # drafts from it never match (0/58)
    "short, its continuation loops": "In the beginning",  # the demo model's greedy text repeats itself
}


def main(tokens: int, rtt_ms: float, rounds: int = 5) -> None:
    from moeswarm.daemon import SwarmConfig
    from moeswarm.demo import CHECKPOINT
    from moeswarm.model import SamplingParams, generate
    from moeswarm.model.speculative import SpeculativeStats, generate_speculative
    from moeswarm.net.client import ExpertClient
    from moeswarm.node.backbone import SwarmBackbone
    from moeswarm.node.config import BackboneConfig
    from moeswarm.protocol import Identity

    rows = []
    pings: list[float] = []
    direct, proxied = measure_rtts(rtt_ms / 2e3, 200)  # raw TCP through the same kind of proxy
    with delayed_swarm(str(CHECKPOINT), ["0-3", "4-7"], rtt_ms) as daemons:

        async def run() -> None:
            config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(daemons[0].info["multiaddrs"][0],),
                                                client_mode=True))
            probe = await ExpertClient.connect(daemons[0].info["endpoint"], Identity.generate())
            pings.extend([await probe.ping() for _ in range(30)])
            await probe.aclose()
            async with SwarmBackbone(config) as bb:
                tok = bb.tokenizer()
                params = SamplingParams(max_new_tokens=tokens)
                for name, text in PROMPTS.items():
                    ids = tok.encode(text)
                    t_plains, t_fasts = [], []
                    plain = await asyncio.to_thread(lambda: list(generate(bb.model, ids, params)))  # type: ignore[arg-type]  # warm-up, untimed
                    for r in range(rounds):  # alternate, swapping which goes first, so drift hits both alike
                        for case in (("plain", "fast") if r % 2 == 0 else ("fast", "plain")):
                            t0 = time.perf_counter()
                            if case == "plain":
                                plain = await asyncio.to_thread(lambda: list(generate(bb.model, ids, params)))  # type: ignore[arg-type]
                                t_plains.append(time.perf_counter() - t0)
                            else:
                                stats = SpeculativeStats()
                                fast = await asyncio.to_thread(
                                    lambda: list(generate_speculative(bb.model, ids, params, k=4, stats=stats)))  # type: ignore[arg-type]
                                t_fasts.append(time.perf_counter() - t0)
                        assert fast == plain, "speculative decoding changed the output"
                    rows.append((name, len(plain) / statistics.median(t_plains), len(fast) / statistics.median(t_fasts),
                                 stats, len(plain)))

        asyncio.run(run())
    med = statistics.median
    print(f"\ndecode through a swarm (2 expert nodes + backbone, demo model); data plane through delay-proxy "
          f"processes asked for {rtt_ms} ms RTT ({rtt_ms / 2} ms each way). Measured medians: raw 64 B TCP ping "
          f"{med(proxied) * 1e3:.2f} ms through a proxy ({med(direct) * 1e3:.3f} ms without), data-plane ping "
          f"(TLS, to node0) {med(pings) * 1e3:.2f} ms")
    print(f"medians of {rounds} alternating runs of each case")
    print("| prompt | greedy tok/s | speculative k=4 tok/s | speedup | forward passes | drafts accepted |")
    print("|---|---|---|---|---|---|")
    for name, plain, fast, st, n in rows:
        print(f"| {name} | {plain:.1f} | {fast:.1f} | {fast / plain:.2f}x | {st.steps + 1} for {n} tokens | "
              f"{st.accepted}/{st.drafted} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    ap.add_argument("--rtt-ms", type=float, default=3.4, help="round trip added to every data-plane connection")
    ap.add_argument("--rounds", type=int, default=5, help="alternating runs of each case (medians reported)")
    args = ap.parse_args()
    main(args.tokens, args.rtt_ms, args.rounds)
