"""Speculative decoding through a swarm at a 3.4 ms round trip, repetitive vs non-repetitive text.

Two expert nodes and a backbone on the demo checkpoint; every data-plane connection goes through
a proxy process that delays each direction by 1.7 ms (a 3.4 ms round trip, the seed's measured
RTT; this kernel has no netem, so the link is emulated in userspace: benchmarks/_delay.py,
benchmarks/_links.py ``delayed_swarm``).  Prints the measured round trips, then decode tokens/s
with and without prompt-lookup speculation (k=4) and with the demo's own multi-token-prediction
layer as the draft (``--draft mtp``, k=``--mtp-k``; its experts are served by the nodes too) in one
table, and the same greedy vs MTP comparison in a single process (no network).

    python benchmarks/speculative.py [--tokens 48] [--rtt-ms 3.4] [--mtp-k K]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import json
import statistics
import time

from _delay import measure_rtts  # benchmarks/_delay.py
from _links import delayed_swarm, mtp_layers  # benchmarks/_links.py

from moeswarm._cli_util import DEFAULT_MTP_DRAFT

PROMPTS = {
    "repetitive": "And the LORD said unto Moses, Speak unto the children of Israel. And the LORD said unto Moses, "
                  "Speak unto the children of Israel. And the LORD said unto Moses,",
    "non-repetitive": "Now the serpent was more subtil than any beast",  # drafts from it never match (0/58)
    "short, its continuation loops": "In the beginning",  # the demo model's greedy text repeats itself
}


def timed(cases: dict, rounds: int) -> dict:  # type: ignore[type-arg]
    """name -> (tokens, stats) run ``rounds`` times each, alternating the order; -> name -> (median s,
    tokens, stats).  Every case must give the first case's tokens (greedy)."""
    times: dict = {name: [] for name in cases}  # type: ignore[type-arg]
    out: dict = {}  # type: ignore[type-arg]
    names = list(cases)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            out[name] = cases[name]()
            times[name].append(time.perf_counter() - t0)
    first = out[names[0]][0]
    assert all(tokens == first for tokens, _ in out.values()), "speculative decoding changed the output"
    return {name: (statistics.median(times[name]), *out[name]) for name in names}


def single_process(CHECKPOINT: str, tokens: int, k: int, rounds: int) -> list[tuple]:  # type: ignore[type-arg]
    from moeswarm.model import SamplingParams, Tokenizer, generate, load_model
    from moeswarm.model.speculative import MtpDraft, SpeculativeStats, generate_drafted

    model = load_model(CHECKPOINT)
    tok = Tokenizer.from_folder(CHECKPOINT, model.config.bos_token_id)
    params = SamplingParams(max_new_tokens=tokens)
    rows = []
    for name, text in PROMPTS.items():
        ids = tok.encode(text)
        list(generate(model, ids, params))  # warm-up, untimed

        def mtp() -> tuple:  # type: ignore[type-arg]
            st = SpeculativeStats()
            return list(generate_drafted(model, ids, params, MtpDraft(model), k=k, stats=st)), st

        r = timed({"plain": lambda: (list(generate(model, ids, params)), None), "mtp": mtp}, rounds)
        rows.append((name, r))
    return rows


def main(tokens: int, rtt_ms: float, rounds: int = 5, mtp_k: int = DEFAULT_MTP_DRAFT, CHECKPOINT: str | None = None) -> None:
    from moeswarm.daemon import SwarmConfig
    from moeswarm.demo import CHECKPOINT as DEMO
    from moeswarm.model import SamplingParams, generate
    from moeswarm.model.speculative import MtpDraft, SpeculativeStats, generate_drafted, generate_speculative
    from moeswarm.node.scheduler import EngineConfig
    from moeswarm.net.client import ExpertClient
    from moeswarm.node.backbone import SwarmBackbone
    from moeswarm.node.config import BackboneConfig
    from moeswarm.protocol import Identity

    CHECKPOINT = CHECKPOINT or str(DEMO)
    rows = []
    pings: list[float] = []
    direct, proxied = measure_rtts(rtt_ms / 2e3, 200)  # raw TCP through the same kind of proxy
    # the nodes serve the MTP layer's experts too
    with delayed_swarm(str(CHECKPOINT), ["0-3", "4-7"], rtt_ms, layers=mtp_layers(CHECKPOINT)) as daemons:

        async def run() -> None:
            config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(daemons[0].info["multiaddrs"][0],),
                                                client_mode=True), draft="mtp", engine=EngineConfig(speculative=mtp_k))
            probe = await ExpertClient.connect(daemons[0].info["endpoint"], Identity.generate())
            pings.extend([await probe.ping() for _ in range(30)])
            await probe.aclose()
            async with SwarmBackbone(config) as bb:
                tok = bb.tokenizer()
                params = SamplingParams(max_new_tokens=tokens)
                model = bb.model
                for name, text in PROMPTS.items():
                    ids = tok.encode(text)
                    await asyncio.to_thread(lambda: list(generate(model, ids, params)))  # type: ignore[arg-type]  # warm-up

                    def lookup() -> tuple:  # type: ignore[type-arg]
                        st = SpeculativeStats()
                        return list(generate_speculative(model, ids, params, k=4, stats=st)), st  # type: ignore[arg-type]

                    def mtp() -> tuple:  # type: ignore[type-arg]
                        st = SpeculativeStats()
                        return list(generate_drafted(model, ids, params, MtpDraft(model), k=mtp_k, stats=st)), st  # type: ignore[arg-type]

                    cases = {"plain": lambda: (list(generate(model, ids, params)), None), "lookup": lookup, "mtp": mtp}  # type: ignore[arg-type]
                    rows.append((name, await asyncio.to_thread(timed, cases, rounds)))

        asyncio.run(run())
    med = statistics.median
    print(f"\ndecode through a swarm (2 expert nodes + backbone, demo model); data plane through delay-proxy "
          f"processes asked for {rtt_ms} ms RTT ({rtt_ms / 2} ms each way). Measured medians: raw 64 B TCP ping "
          f"{med(proxied) * 1e3:.2f} ms through a proxy ({med(direct) * 1e3:.3f} ms without), data-plane ping "
          f"(TLS, to node0) {med(pings) * 1e3:.2f} ms")
    print(f"medians of {rounds} alternating runs of each case")
    from moeswarm.model import load_config

    moe = sum(load_config(CHECKPOINT).moe_layers[: load_config(CHECKPOINT).num_layers])
    print("expert round trips: one per MoE layer per forward pass, one per MTP-layer pass (= drafted tokens); "
          "they do not depend on the machine's load")
    print("| prompt | greedy tok/s | prompt lookup k=4 tok/s | speedup | MTP k=%d tok/s | speedup | "
          "MTP drafts accepted | forward passes (greedy / lookup / MTP) | expert round trips (greedy / MTP) |" % mtp_k)
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        (tp, plain, _), (tl, _, sl), (tm, _, sm) = r["plain"], r["lookup"], r["mtp"]
        n = len(plain)
        print(f"| {name} | {n / tp:.1f} | {n / tl:.1f} | {tp / tl:.2f}x | {n / tm:.1f} | {tp / tm:.2f}x | "
              f"{sm.accepted}/{sm.drafted} ({sm.accepted / max(sm.drafted, 1):.0%}) | {n} / {sl.steps + 1} / "
              f"{sm.steps + 1} | {n * moe} / {(sm.steps + 1) * moe + sm.drafted} |")
    print(f"\nsingle process, demo model, no network: greedy vs MTP drafts (k={mtp_k}); medians of {rounds} alternating runs")
    print("| prompt | greedy tok/s | MTP tok/s | speedup | MTP drafts accepted | forward passes (greedy / MTP) |")
    print("|---|---|---|---|---|---|")
    accepted = drafted = 0
    for name, r in single_process(CHECKPOINT, tokens, mtp_k, rounds):
        (tp, plain, _), (tm, _, sm) = r["plain"], r["mtp"]
        n = len(plain)
        accepted, drafted = accepted + sm.accepted, drafted + sm.drafted
        print(f"| {name} | {n / tp:.1f} | {n / tm:.1f} | {tp / tm:.2f}x | {sm.accepted}/{sm.drafted} "
              f"({sm.accepted / max(sm.drafted, 1):.0%}) | {n} / {sm.steps + 1} |")
    print(json.dumps({"mtp_acceptance": round(accepted / max(drafted, 1), 4), "mtp_k": mtp_k}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    ap.add_argument("--rtt-ms", type=float, default=3.4, help="round trip added to every data-plane connection")
    ap.add_argument("--rounds", type=int, default=5, help="alternating runs of each case (medians reported)")
    ap.add_argument("--mtp-k", type=int, default=DEFAULT_MTP_DRAFT,
                    help="tokens the MTP layer drafts per step (default: the shipped default of --draft mtp)")
    ap.add_argument("--model", default=None, help="checkpoint folder with an MTP layer (default: the demo)")
    args = ap.parse_args()
    main(args.tokens, args.rtt_ms, args.rounds, args.mtp_k, args.model)
