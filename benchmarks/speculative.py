"""Speculative decoding through a swarm at a 3.4 ms round trip, repetitive vs non-repetitive text.

Two expert nodes and a backbone on the demo checkpoint; every data-plane connection goes through
a proxy that delays each direction by 1.7 ms (a 3.4 ms round trip, the seed's measured RTT; this
kernel has no netem, so the link is emulated in userspace, benchmarks/_delay.py).  Prints decode
tokens/s with and without prompt-lookup speculation (k=4) in one table.

    python benchmarks/speculative.py [--tokens 48]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import socket
import threading
import time

from _delay import start_delay_proxy  # benchmarks/_delay.py
PROMPTS = {
    "repetitive": "And the LORD said unto Moses, Speak unto the children of Israel. And the LORD said unto Moses, "
                  "Speak unto the children of Israel. And the LORD said unto Moses,",
    "non-repetitive": "In the beginning",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proxies:
    """Delay proxies on their own event loop thread, so the backbone's loop does not carry them."""

    def __init__(self, pairs: list[tuple[int, int]], delay_s: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers = [asyncio.run_coroutine_threadsafe(start_delay_proxy(a, b, delay_s), self.loop).result()
                        for a, b in pairs]

    def close(self) -> None:
        for server in self.servers:
            self.loop.call_soon_threadsafe(server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def main(tokens: int) -> None:
    from moeswarm.demo import CHECKPOINT
    from moeswarm.demo.swarm import start_daemon, stop_daemon
    from moeswarm.model import SamplingParams, generate
    from moeswarm.model.speculative import SpeculativeStats, generate_speculative
    from moeswarm.node.daemon import BackboneConfig, SwarmBackbone, SwarmConfig
    from moeswarm.node.dataplane import ExpertClient
    from moeswarm.protocol import Identity

    ports = [(free_port(), free_port()) for _ in range(2)]  # (proxy, node)
    proxies = Proxies(ports, 0.0017)
    daemons = []
    rows = []
    rtts: list[float] = []
    try:
        for i, ((proxy, node), experts) in enumerate(zip(ports, ["0-3", "4-7"])):
            args = ["node", "--model", str(CHECKPOINT), "--experts", experts, "--port", str(node),
                    "--announce-port", str(proxy)]
            if daemons:
                args += ["--bootstrap", daemons[0].info["multiaddrs"][0]]
            daemons.append(start_daemon(f"node{i}", args))

        async def run() -> None:
            config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(daemons[0].info["multiaddrs"][0],),
                                                client_mode=True))
            probe = await ExpertClient.connect(f"tcp+tls://127.0.0.1:{ports[0][0]}", Identity.generate())
            rtts.extend([await probe.ping() for _ in range(20)])
            await probe.aclose()
            async with SwarmBackbone(config) as bb:
                tok = bb.tokenizer()
                params = SamplingParams(max_new_tokens=tokens)
                for name, text in PROMPTS.items():
                    ids = tok.encode(text)
                    t0 = time.perf_counter()
                    plain = await asyncio.to_thread(lambda: list(generate(bb.model, ids, params)))  # type: ignore[arg-type]
                    t_plain = time.perf_counter() - t0
                    stats = SpeculativeStats()
                    t0 = time.perf_counter()
                    fast = await asyncio.to_thread(
                        lambda: list(generate_speculative(bb.model, ids, params, k=4, stats=stats)))  # type: ignore[arg-type]
                    t_fast = time.perf_counter() - t0
                    assert fast == plain, "speculative decoding changed the output"
                    rows.append((name, len(plain) / t_plain, len(fast) / t_fast, stats, len(plain)))

        asyncio.run(run())
    finally:
        for d in daemons:
            stop_daemon(d)
        proxies.close()
    rtt = sorted(rtts)[len(rtts) // 2] * 1e3
    print(f"\ndecode through a swarm (2 expert nodes + backbone, demo model); data plane through 1.7 ms-each-way "
          f"proxies, measured ping RTT {rtt:.2f} ms (asyncio timers round sleeps up to whole ms)")
    print("| prompt | greedy tok/s | speculative k=4 tok/s | speedup | forward passes | drafts accepted |")
    print("|---|---|---|---|---|---|")
    for name, plain, fast, st, n in rows:
        print(f"| {name} | {plain:.1f} | {fast:.1f} | {fast / plain:.2f}x | {st.steps + 1} for {n} tokens | "
              f"{st.accepted}/{st.drafted} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    main(ap.parse_args().tokens)
