"""The figures of issue 12's attacks 2 and 7, measured the way the attacks were run: a
``moeswarm node`` process, and the attacker of ``tests/adversarial`` in another process.

    PYTHONPATH=. python benchmarks/trust_attacks.py        # this tree
    PYTHONPATH=/path/to/other/checkout python benchmarks/trust_attacks.py   # compare a commit

    PYTHONPATH=. python benchmarks/trust_attacks.py --liars    # only issue 32's patient liars

Prints: the node's peak RSS growth while an 8 MiB nested Hello is sent as a first frame, and the
honest client's connect + ping time before and after; the descriptors the node holds while one
address keeps 300 half-open connections (TCP connected, no TLS). Medians of 3 connects.

Then issue 32's patient liars, one at a time (``tests/adversarial/attackers/patient_liar.py``,
holding experts 0-7) beside an honest node holding 0-3, so the liar is the only remote holder of
4-7: a backbone with default verification (and ``--local-fallback`` once the liar is excluded)
generates greedy tokens for 8 prompts x 16 tokens; per liar, the calls it answered, the lies it told, whether
and after how many calls it was excluded, and how many tokens differ from the single-process
engine's (every token a lie changed before the liar was excluded).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
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


LIAR_PROMPTS = ["And it came to pass", "The king said unto them", "In the beginning", "And the LORD spake",
                "Blessed are", "And God said", "Now the serpent", "Thus saith the LORD"]
LIAR_TOKENS = 16


def patient_liars() -> None:
    from test_round2_patient_liar import start_liar, lies_told  # noqa: PLC0415 -- the test's attacker, as run there

    from moeswarm.daemon import SwarmConfig
    from moeswarm.model import SamplingParams, Tokenizer, generate, load_model
    from moeswarm.node.backbone import SwarmBackbone
    from moeswarm.node.config import BackboneConfig

    def greedy(model: object, tokenizer: Tokenizer, prompt: str) -> list[int]:
        return list(generate(model, tokenizer.encode(prompt), SamplingParams(max_new_tokens=LIAR_TOKENS)))  # type: ignore[arg-type]

    reference = load_model(str(CHECKPOINT))
    tokenizer = Tokenizer.from_folder(str(CHECKPOINT), reference.config.bos_token_id)
    expected = {p: greedy(reference, tokenizer, p) for p in LIAR_PROMPTS}

    async def backbone(boot: str) -> tuple[dict[str, list[int]], dict]:  # type: ignore[type-arg]
        cfg = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(boot,), client_mode=True), coverage_timeout_s=60,
                             local_fallback=True)
        async with SwarmBackbone(cfg) as bb:
            assert bb.model is not None
            out = {p: await asyncio.to_thread(greedy, bb.model, bb.tokenizer(), p) for p in LIAR_PROMPTS}
            return out, bb.status()["verification"]

    print(f"issue 32 point 10: patient liars ({len(LIAR_PROMPTS)} prompts x {LIAR_TOKENS} greedy tokens, "
          "a liar holding experts 0-7 beside an honest node holding 0-3)")
    print(f"  {'liar':<22} {'calls':>6} {'lies':>5} {'excluded':>9} {'tokens changed':>15}")
    logging.getLogger("moeswarm").setLevel(logging.ERROR)  # the exclusions are in the table
    for policy, n in (("wait", 8), ("rate", 50), ("unchecked", 8)):
        honest = start_daemon("honest", ["node", "--model", str(CHECKPOINT), "--experts", "0-3"])
        liar = None
        try:
            liar = start_liar(policy, n, honest.info["multiaddrs"][0])
            tokens, v = asyncio.run(backbone(honest.info["multiaddrs"][0]))
            told = lies_told(liar)
        finally:
            if liar is not None:
                stop_daemon(liar)
            stop_daemon(honest)
        peer = liar.info["peer_id"]
        changed = sum(a != b for p in LIAR_PROMPTS for a, b in zip(tokens[p], expected[p]))
        calls = v["holders"].get(peer, {}).get("calls", 0)
        name = {"wait": f"honest first {n}", "rate": f"lies 1 call in {n}", "unchecked": "lies when unchecked"}[policy]
        print(f"  {name:<22} {calls:>6} {told:>5} {'yes' if peer in v['excluded'] else 'no':>9} "
              f"{changed:>10} of {len(LIAR_PROMPTS) * LIAR_TOKENS}")


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
    parser = argparse.ArgumentParser()
    parser.add_argument("--liars", action="store_true", help="only the patient liars of issue 32")
    try:
        if not parser.parse_args().liars:
            main()
        patient_liars()
    except subprocess.TimeoutExpired as e:
        sys.exit(f"timed out: {e}")
