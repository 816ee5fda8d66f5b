"""The data plane's cost, measured side by side in one run on loopback.

1. raw asyncio TCP round trip of a 4 KB message (the floor);
2. one MoE layer dispatched through the swarm (TLS, framing, msgpack, receipts signed and
   countersigned) minus the same experts computed locally: the per-layer dispatch overhead;
3. decode tokens/s of a backbone + 4 expert-node processes vs the single-process engine.

    python benchmarks/swarm.py [--tokens 32] [--keep DIR]

Two models: the shipped demo checkpoint (tiny: dispatch overhead dominates) and a random
1.1 GB Mixtral-style checkpoint written with numpy (expert math dominates, as in real models).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import sys
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import local_swarm
from moeswarm.model import SamplingParams, generate, load_model
from moeswarm.model.synthetic import random_mixtral
from moeswarm.model.routing import route
from moeswarm.node.daemon import BackboneConfig, SwarmBackbone, SwarmConfig


ECHO = """
import asyncio, sys
async def echo(r, w):
    try:
        while True:
            w.write(await r.readexactly(4096)); await w.drain()
    except asyncio.IncompleteReadError:
        w.close()
async def main():
    s = await asyncio.start_server(echo, "127.0.0.1", 0)
    print(s.sockets[0].getsockname()[1], flush=True)
    await s.serve_forever()
asyncio.run(main())
"""


async def raw_tcp_rtt(n: int = 400) -> float:
    """A 4 KB round trip to an asyncio echo server in another process (as expert nodes are)."""
    server = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload, samples = os.urandom(4096), []
    for _ in range(n):
        t0 = time.perf_counter()
        writer.write(payload)
        await writer.drain()
        await reader.readexactly(4096)
        samples.append(time.perf_counter() - t0)
    writer.close()
    server.kill()
    server.wait()
    server.stdout.close()
    return statistics.median(samples)


def decode_rate(model, ids: list[int], tokens: int) -> float:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_new_tokens=tokens)
    first = None
    n = 0
    for _ in generate(model, ids, params):
        n += 1
        if first is None:
            first = time.perf_counter()  # exclude the prefill
    assert first is not None
    return (n - 1) / (time.perf_counter() - first)


async def swarm_side(model_dir: str, bootstrap: str, ids: list[int], tokens: int, reps: int) -> tuple[float, float, float]:
    config = BackboneConfig(SwarmConfig(model_dir, bootstrap=(bootstrap,), client_mode=True))
    async with SwarmBackbone(config) as bb:
        assert bb.model is not None and bb.executor is not None
        cfg, w = bb.cfg, bb.model.weights
        layer = next(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
        x = np.random.default_rng(0).standard_normal((1, cfg.hidden_size)).astype(np.float32)
        ids1, weights = route(cfg, x, w[f"{layer}.router"], w.get(f"{layer}.router_bias"),
                              w.get(f"{layer}.router_score_bias"))
        local = load_model(model_dir).experts
        remote, computed = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            await bb.executor.dispatch(layer, x, ids1, weights)
            remote.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            local.submit(layer, x, ids1, weights).result()
            computed.append(time.perf_counter() - t0)
        rate = await asyncio.to_thread(decode_rate, bb.model, ids, tokens)
        return statistics.median(remote), statistics.median(computed), rate


def measure(model_dir: str, tokens: int, reps: int) -> tuple[float, float, float, float, int]:
    model = load_model(model_dir)
    ids = list(range(3, 19))
    single = decode_rate(model, ids, tokens)
    with local_swarm(model_dir, 4, experts_per_layer=model.config.num_experts) as daemons:
        dispatch, compute, swarm = asyncio.run(
            swarm_side(model_dir, daemons[0].info["multiaddrs"][0], ids, tokens, reps))
    return dispatch, compute, single, swarm, model.config.top_k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--reps", type=int, default=100, help="single-layer dispatches timed")
    ap.add_argument("--keep", type=Path, default=None, help="build/reuse the 1.1 GB model here, not in a temp dir")
    args = ap.parse_args()
    rtt = asyncio.run(raw_tcp_rtt())
    big = random_mixtral((args.keep or Path(tempfile.mkdtemp(prefix="moeswarm-bench-"))) / "mixtral-1.1GB")
    rows = [("demo (4.4M params, fp16)", measure(str(CHECKPOINT), args.tokens, args.reps)),
            ("random Mixtral 1.1 GB (H 1024, I 2816)", measure(str(big), args.tokens // 2, args.reps // 3))]
    print(f"\nloopback, medians; raw asyncio TCP 4 KB round trip to another process: {rtt * 1e3:.3f} ms")
    print("| model | one MoE layer via swarm | same experts locally | dispatch overhead | overhead / raw RTT "
          "| decode single process | decode backbone + 4 nodes | swarm / single |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (dispatch, compute, single, swarm, k) in rows:
        overhead = dispatch - compute
        print(f"| {name} | {dispatch * 1e3:.2f} ms | {compute * 1e3:.2f} ms | {overhead * 1e3:.2f} ms | "
              f"{overhead / rtt:.1f}x | {single:.1f} tok/s | {swarm:.1f} tok/s | {swarm / single:.0%} |")


if __name__ == "__main__":
    main()
