"""Many users at once through the OpenAI API: continuous batching and speculative decoding.

A swarm of 3 expert-node processes on the demo checkpoint and, in front of it, backbone
processes that differ only in their flags: ``--max-batch 1`` (one user at a time), the default
(``--max-batch 16``) and the default with ``--speculative 4`` (prompt lookup).  N concurrent
streaming completions (aiohttp, server-sent events, ``return_token_ids`` to count tokens) at
N = 1, 4, 16, 64; each yields ``--tokens`` tokens (greedy, ``ignore_eos``).  Printed per case:
aggregate tokens/s (all tokens / wall time from the first request to the last token), p50 and
p95 of the time between a stream's consecutive tokens.  Then speculative decoding on and off,
one stream, on a repetitive and a non-repetitive prompt.  Both over loopback and over links
with a ``--rtt-ms`` round trip (default 30 ms) on every data-plane connection (delay proxy
processes: benchmarks/_delay.py, benchmarks/_links.py ``delayed_swarm``; DHT traffic undelayed).

    python benchmarks/serving.py [--tokens 12] [--streams 1,4,16,64] [--rtt-ms 30] [--links loopback,delayed]
                                 [--rounds 3]

Every process runs with OPENBLAS_NUM_THREADS=1.  The benchmark client is one asyncio loop in
this process.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
from _links import delayed_swarm  # benchmarks/_links.py

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import Daemon, expert_nodes, start_daemon, stop_daemon

RANGES = ["0-2", "3-5", "6-7"]
BACKBONES = {"max-batch 1": ["--max-batch", "1", "--max-waiting", "256"],
             "default (max-batch 16)": ["--max-waiting", "256"],
             "default + speculative 4": ["--max-waiting", "256", "--speculative", "4"]}
PROMPTS = ["And it came to pass", "In the beginning", "The LORD is my shepherd", "And God said",
           "Blessed are the meek", "Then Moses", "And the king said unto", "For unto us"]
SPEC_PROMPTS = {
    "repetitive": "And the LORD said unto Moses, Speak unto the children of Israel. And the LORD said unto Moses, "
                  "Speak unto the children of Israel. And the LORD said unto Moses,",
    "non-repetitive": "Now the serpent was more subtil than any beast",
}


@dataclass
class Run:
    tokens: int  # generated, all streams
    wall_s: float  # first request sent -> last token received
    gaps_s: list[float]  # time between consecutive tokens of a stream, all streams

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s

    def gap(self, q: float) -> float:
        gaps = sorted(self.gaps_s)
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else float("nan")


async def stream(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> list[float]:
    """One streaming completion -> the arrival time of each token."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event["choices"]:
                times.extend([time.perf_counter()] * len(choice.get("token_ids") or ()))
    return times


async def measure(url: str, streams: int, tokens: int, prompts: list[str]) -> Run:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await stream(session, url, "warm up", 2)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream(session, url, prompts[i % len(prompts)] + f" {i}", tokens)
                                         for i in range(streams)))
    end = max(t[-1] for t in results)
    gaps = [b - a for t in results for a, b in zip(t, t[1:])]
    return Run(sum(len(t) for t in results), end - t0, gaps)


@contextlib.contextmanager
def backbones(nodes: list[Daemon]) -> Iterator[dict[str, str]]:
    started: dict[str, Daemon] = {}
    try:
        for name, flags in BACKBONES.items():
            started[name] = start_daemon(f"backbone {name}", [
                "backbone", "--model", str(CHECKPOINT), "--bootstrap", nodes[0].info["multiaddrs"][0],
                "--http", "127.0.0.1:0", *flags], timeout_s=600)  # a loaded machine starts slowly
        yield {name: d.info["http"] for name, d in started.items()}
    finally:
        for d in started.values():
            stop_daemon(d)


def median_run(runs: list[Run]) -> Run:
    """The run with the median rate, with the gaps of every run."""
    mid = sorted(runs, key=lambda r: r.rate)[len(runs) // 2]
    return Run(mid.tokens, mid.wall_s, [g for r in runs for g in r.gaps_s])


def section(link: str, urls: dict[str, str], streams: list[int], tokens: int, rounds: int) -> None:
    rows: dict[int, dict[str, Run]] = {}
    for n in streams:
        runs: dict[str, list[Run]] = {"max-batch 1": [], "default (max-batch 16)": []}
        for _ in range(rounds if n <= 4 else 1):  # alternate, so the machine's drift hits both alike
            for name in runs:
                runs[name].append(asyncio.run(measure(urls[name], n, tokens, PROMPTS)))
                print(f"  [{link}] {name}, {n} streams: {runs[name][-1].rate:.1f} tok/s", flush=True)
        rows[n] = {name: median_run(r) for name, r in runs.items()}
    print(f"\n{link}: {tokens} tokens per stream, greedy; aggregate tok/s (median of {rounds} alternating runs at "
          f"<= 4 streams, one run above) and time between tokens (p50 / p95)")
    print("| streams | max-batch 1: tok/s | p50 | p95 | default: tok/s | p50 | p95 | default / max-batch 1 "
          "| default vs its 1 stream |")
    print("|---|---|---|---|---|---|---|---|---|")
    one = rows[streams[0]]["default (max-batch 16)"].rate
    for n in streams:
        a, b = rows[n]["max-batch 1"], rows[n]["default (max-batch 16)"]
        print(f"| {n} | {a.rate:.1f} | {a.gap(0.5) * 1e3:.0f} ms | {a.gap(0.95) * 1e3:.0f} ms | {b.rate:.1f} | "
              f"{b.gap(0.5) * 1e3:.0f} ms | {b.gap(0.95) * 1e3:.0f} ms | {b.rate / a.rate:.1f}x | {b.rate / one:.1f}x |")
    print(f"\n{link}: speculative decoding (prompt lookup, k=4), one stream, {tokens * 3} tokens")
    print("| prompt | off: tok/s | on: tok/s | on / off |")
    print("|---|---|---|---|")
    for kind, prompt in SPEC_PROMPTS.items():
        offs, ons = [], []
        for _ in range(rounds):
            offs.append(asyncio.run(measure(urls["default (max-batch 16)"], 1, tokens * 3, [prompt])).rate)
            ons.append(asyncio.run(measure(urls["default + speculative 4"], 1, tokens * 3, [prompt])).rate)
        off, on = statistics.median(offs), statistics.median(ons)
        print(f"| {kind} | {off:.1f} | {on:.1f} | {on / off:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=12, help="tokens per stream")
    ap.add_argument("--streams", default="1,4,16,64", help="concurrent streams, comma-separated")
    ap.add_argument("--rtt-ms", type=float, default=30.0, help="round trip of the delayed links")
    ap.add_argument("--links", default="loopback,delayed", help="loopback, delayed or both")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs at <= 4 streams and for speculative")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    links = args.links.split(",")
    print(f"demo checkpoint (4 MoE layers, 8 experts top-2), 3 expert-node processes {RANGES}, backbone processes "
          f"with {', '.join(BACKBONES)}; OPENBLAS_NUM_THREADS=1 everywhere; {os.cpu_count()} CPUs", flush=True)
    if "loopback" in links:
        with expert_nodes(str(CHECKPOINT), RANGES) as nodes, backbones(nodes) as urls:
            section("loopback", urls, streams, args.tokens, args.rounds)
    if "delayed" in links:
        with delayed_swarm(str(CHECKPOINT), RANGES, args.rtt_ms) as nodes, backbones(nodes) as urls:
            section(f"{args.rtt_ms:g} ms round trip on every data-plane link", urls, streams, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
