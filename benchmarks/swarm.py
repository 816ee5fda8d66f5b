"""The data plane's cost, measured side by side in one run on loopback.

1. raw asyncio TCP round trip of a 4 KB message (the floor);
2. one MoE layer dispatched through the swarm (TLS, framing, msgpack, receipts: v1.3 batched
   beside v1.2 signed per answer), also from a worker thread as the forward pass does, minus the same experts
   computed locally with the same parallelism (one thread per holder called): the per-layer
   dispatch overhead, the CPU each side spends on it, and (``--profile``) where it goes;
3. decode tokens/s of a backbone + 4 expert-node processes vs the single-process engine;
4. (``overlap``) what computing the shared expert while the routed experts are in flight saves:
   decode tokens/s with and without that overlap, with every data-plane connection through a
   delay proxy (3.4 ms round trip, benchmarks/_links.py ``delayed_swarm``);
5. (``verify``) what checking holders' outputs costs: decode tokens/s of a backbone with the
   default verification (node/verify.py: a 5% sample of trusted holders' calls recomputed from its
   checkpoint) and with it off, alternating, after probation is over.

    python benchmarks/swarm.py [--tokens 32] [--keep DIR] [--only dispatch|overlap|verify] [--rtt-ms 3.4]
                               [--models demo,mixtral] [--profile]

The last line of output is one JSON object: ``{"dispatch_over_rtt_demo", "dispatch_over_rtt_1g",
"swarm_over_single_demo", "swarm_over_single_1g"}`` (dispatch overhead over a raw TCP round trip,
a multiple; swarm decode over single-process decode, a fraction; null for a model not measured).

Models: the shipped demo checkpoint (tiny: dispatch overhead dominates), a random 1.1 GB
Mixtral-style checkpoint written with numpy (expert math dominates, as in real models), and for
4. a random Qwen2-MoE-style checkpoint (0.6 GB) whose gated shared expert is as wide as its
top-4 routed experts together, as in Qwen1.5-MoE-A2.7B.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _links import delayed_swarm  # benchmarks/_links.py

from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import Daemon, local_swarm
from moeswarm.model import SamplingParams, generate, load_config, load_model
from moeswarm.model.experts import dense_ffn, expert_ffn
from moeswarm.model.routing import route
from moeswarm.model.synthetic import random_mixtral, random_qwen2_moe
from moeswarm.net.client import Connections, ExpertClient
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.node.onloop import run_on_loop
from moeswarm.protocol import Identity

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


def first_moe_layer_inputs(bb: SwarmBackbone) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """One token's hidden state at the first MoE layer and its router's choice there."""
    assert bb.model is not None
    cfg, w = bb.cfg, bb.model.weights
    layer = next(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
    x = np.random.default_rng(0).standard_normal((1, cfg.hidden_size)).astype(np.float32)
    ids, weights = route(cfg, x, w[f"{layer}.router"], w.get(f"{layer}.router_bias"), w.get(f"{layer}.router_score_bias"))
    return layer, x, ids, weights


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Dispatch:
    on_loop_s: float  # one MoE layer via the swarm (v1.3, output checks off), awaited on the event loop
    token_path_s: float  # ... submitted from a worker thread, as the forward pass does (thread hops included)
    v12_token_path_s: float  # ... the same over protocol v1.2 connections (a signed receipt in every answer)
    checked_token_path_s: float  # ... v1.3 with the default output checks (node/verify.py) on
    greenlet_s: float  # ... v1.3, checks off, submitted by a forward pass run on the loop (node/onloop.py): no hop
    local_s: float  # the same experts computed here, one thread per holder called, in parallel
    holders: int  # holders one dispatch calls (= threads of the local computation)
    ping_s: float  # data-plane ping (TLS, framing) to the first holder
    backbone_cpu_s: float  # CPU of the backbone's loop thread per dispatch
    holders_cpu_s: float  # CPU of all holder processes per dispatch
    profile: str  # cProfile of the loop thread, top lines by own time


def local_same_parallelism(model, plan: dict[bytes, list[int]], layer: int, x: np.ndarray, ids: np.ndarray,  # type: ignore[no-untyped-def]
                           pool: ThreadPoolExecutor) -> None:
    """Each holder's share of the experts computed in its own thread (numpy releases the GIL)."""
    store = model.experts.cache.layer(layer, model.experts.experts[layer], None)  # float32 copies, kept

    def share(experts: list[int]) -> None:
        for e in experts:
            rows = np.nonzero((ids == e).any(axis=1))[0]
            expert_ffn(store[e], x[rows], model.config)

    for f in [pool.submit(share, experts) for experts in plan.values()]:
        f.result()


async def swarm_side(model_dir: str, daemons: list[Daemon], ids: list[int], tokens: int, reps: int,
                     profile: bool) -> tuple[Dispatch, float, float]:
    from moeswarm.net.routing_table import plan_dispatch

    config = BackboneConfig(SwarmConfig(model_dir, bootstrap=(daemons[0].info["multiaddrs"][0],), client_mode=True))
    async with SwarmBackbone(config) as bb:
        assert bb.model is not None and bb.executor is not None
        ex = bb.executor
        layer, x, ids1, weights = first_moe_layer_inputs(bb)
        plan, _ = plan_dispatch(layer, ids1.ravel().tolist(), bb.table.live())
        local = load_model(model_dir)
        probe = await ExpertClient.connect(daemons[0].info["endpoint"], Identity.generate())
        pings = [await probe.ping() for _ in range(reps)]
        await probe.aclose()
        verifier = ex.verifier
        for _ in range(10):
            await ex.dispatch(layer, x, ids1, weights)  # warm: connections, f32 copies, probation
        ex.verifier = None  # the data plane alone: the checks' cost is the --only verify table's
        v13 = ex.connections
        v12 = Connections(ex.identity, versions=(1,), on_batch=ex._batch_arrived)  # a v1.2 backbone's
        ex.connections = v12
        for _ in range(10):
            await ex.dispatch(layer, x, ids1, weights)  # warm the v1.2 connections
        ex.connections = v13
        with ThreadPoolExecutor(len(plan)) as pool:
            local_same_parallelism(local, plan, layer, x, ids1, pool)
            on_loop, computed, thread_cpu = [], [], []
            pids = [d.process.pid for d in daemons]
            cpu0 = sum(proc_cpu_s(p) for p in pids)
            for _ in range(reps):  # alternate, so drift hits both alike
                t0, c0 = time.perf_counter(), time.thread_time()
                await ex.dispatch(layer, x, ids1, weights)
                on_loop.append(time.perf_counter() - t0)
                thread_cpu.append(time.thread_time() - c0)
                t0 = time.perf_counter()
                local_same_parallelism(local, plan, layer, x, ids1, pool)
                computed.append(time.perf_counter() - t0)
            holders_cpu = (sum(proc_cpu_s(p) for p in pids) - cpu0) / reps

        threaded: dict[str, list[float]] = {"v1.3": [], "v1.2": [], "checked": []}

        def token_path() -> None:
            for case, out in threaded.items():
                ex.connections = v12 if case == "v1.2" else v13
                ex.verifier = verifier if case == "checked" else None
                t0 = time.perf_counter()
                ex.submit(layer, x, ids1, weights).result()
                out.append(time.perf_counter() - t0)
                ex.end_step()  # receipts settle between steps, as in decoding
            ex.connections, ex.verifier = v13, None

        def from_loop() -> float:
            t0 = time.perf_counter()
            ex.submit(layer, x, ids1, weights).result()
            ex.end_step()
            return time.perf_counter() - t0

        greenlet = []
        for _ in range(reps):  # alternate, so drift hits all four alike
            await asyncio.to_thread(token_path)
            greenlet.append(await run_on_loop(from_loop))
        text = ""
        if profile:
            prof = cProfile.Profile(time.thread_time)  # CPU time: robust to a loaded machine
            prof.enable()
            for _ in range(reps):
                await ex.dispatch(layer, x, ids1, weights)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            text = out.getvalue()
        ex.verifier = verifier  # decoding as shipped: v1.3, default checks
        rates: dict[str, list[float]] = {"thread": [], "loop": []}
        for _ in range(3):  # alternate: the forward pass in a worker thread, or on the loop (as the engine decodes)
            rates["thread"].append(await asyncio.to_thread(decode_rate, bb.model, ids, tokens))
            rates["loop"].append(await run_on_loop(decode_rate, bb.model, ids, tokens))
        await v12.aclose()
        d = Dispatch(statistics.median(on_loop), statistics.median(threaded["v1.3"]),
                     statistics.median(threaded["v1.2"]), statistics.median(threaded["checked"]),
                     statistics.median(greenlet), statistics.median(computed), len(plan), statistics.median(pings),
                     statistics.median(thread_cpu), holders_cpu, text)
        return d, statistics.median(rates["thread"]), statistics.median(rates["loop"])


def measure(model_dir: str, tokens: int, reps: int, profile: bool) -> tuple[Dispatch, float, float, float]:
    model = load_model(model_dir)
    ids = list(range(3, 19))
    with local_swarm(model_dir, 4, experts_per_layer=model.config.num_experts) as daemons:
        dispatch, threaded, on_loop = asyncio.run(swarm_side(model_dir, daemons, ids, tokens, reps, profile))
    single = statistics.median(decode_rate(model, ids, tokens) for _ in range(3))  # the nodes are gone: same load
    return dispatch, single, threaded, on_loop


# ---------------------------------------------------------------- 4. shared-expert overlap


@dataclass
class Overlap:
    ping_s: float  # data-plane ping through the delay proxy
    dispatch_s: float  # one MoE layer's routed experts through the swarm
    shared_s: float  # one layer's shared expert, computed in the backbone
    moe_layers: int
    rates: dict[bool, list[float]]  # decode tok/s of each run, by overlap on / off


async def overlap_side(model_dir: str, daemons: list[Daemon], ids: list[int], tokens: int, rounds: int) -> Overlap:
    config = BackboneConfig(SwarmConfig(model_dir, bootstrap=(daemons[0].info["multiaddrs"][0],), client_mode=True))
    probe = await ExpertClient.connect(daemons[0].info["endpoint"], Identity.generate())
    pings = [await probe.ping() for _ in range(30)]
    await probe.aclose()
    async with SwarmBackbone(config) as bb:
        assert bb.model is not None and bb.executor is not None
        layer, x, ids1, weights = first_moe_layer_inputs(bb)
        cfg, w = bb.cfg, bb.model.weights
        dispatch, shared = [], []
        for _ in range(30):
            t0 = time.perf_counter()
            await bb.executor.dispatch(layer, x, ids1, weights)
            dispatch.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dense_ffn(w[f"{layer}.shared.gate"], w[f"{layer}.shared.up"], w[f"{layer}.shared.down"], x)
            shared.append(time.perf_counter() - t0)
        await asyncio.to_thread(decode_rate, bb.model, ids, 4)  # warm-up: connections, page cache
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):  # alternate, so drift hits both alike
            for overlap in (True, False):
                bb.model.overlap_shared = overlap
                rates[overlap].append(await asyncio.to_thread(decode_rate, bb.model, ids, tokens))
        return Overlap(statistics.median(pings), statistics.median(dispatch), statistics.median(shared),
                       sum(cfg.moe_layers), rates)


def overlap_section(folder: Path, tokens: int, rounds: int, rtt_ms: float) -> None:
    model_dir = str(random_qwen2_moe(folder / "qwen2-moe-0.6GB"))
    E = load_config(model_dir).num_experts
    with delayed_swarm(model_dir, [f"0-{E // 2 - 1}", f"{E // 2}-{E - 1}"], rtt_ms) as daemons:
        r = asyncio.run(overlap_side(model_dir, daemons, list(range(3, 19)), tokens, rounds))
    on, off = (statistics.median(r.rates[k]) for k in (True, False))
    saved = (1 / off - 1 / on) * 1e3
    bound = r.moe_layers * min(r.shared_s, r.dispatch_s) * 1e3
    print(f"\nshared-expert overlap: random Qwen2-MoE (H 1024, 16 experts of 512 top-4, shared 2048 gated, "
          f"4 layers, fp32), backbone + 2 expert nodes, data plane through delay proxies asked for {rtt_ms} ms RTT; "
          f"measured data-plane ping {r.ping_s * 1e3:.2f} ms; medians of {rounds} alternating runs of {tokens} tokens")
    print("| shared expert, one layer | one MoE layer via swarm | decode, overlap on | decode, overlap off | "
          "saved per token | upper bound (MoE layers x min of the two) |")
    print("|---|---|---|---|---|---|")
    print(f"| {r.shared_s * 1e3:.2f} ms | {r.dispatch_s * 1e3:.2f} ms | {on:.2f} tok/s ({1e3 / on:.1f} ms) | "
          f"{off:.2f} tok/s ({1e3 / off:.1f} ms) | {saved:.1f} ms ({on / off - 1:+.0%} tok/s) | {bound:.1f} ms |")
    print(f"runs, tok/s: on {[round(v, 2) for v in r.rates[True]]}, off {[round(v, 2) for v in r.rates[False]]}")


def dispatch_section(folder: Path, tokens: int, reps: int, models: list[str], profile: bool) -> dict[str, float]:
    rtt = asyncio.run(raw_tcp_rtt())
    rows = []
    keys = []
    if "demo" in models:
        rows.append(("demo (4.4M params, fp16)", measure(str(CHECKPOINT), tokens, reps, profile)))
        keys.append("demo")
    if "mixtral" in models:
        big = random_mixtral(folder / "mixtral-1.1GB")
        rows.append(("random Mixtral 1.1 GB (H 1024, I 2816)", measure(str(big), tokens // 2, reps // 3, profile)))
        keys.append("1g")
    print(f"\nloopback, medians of alternating runs; raw asyncio TCP 4 KB round trip to another process: "
          f"{rtt * 1e3:.3f} ms.  Threads: every process OPENBLAS_NUM_THREADS=1; the swarm computes a layer's experts "
          f"in the holder processes it calls, in parallel; 'locally' computes each holder's share in its own thread "
          f"of this process, in parallel (the same parallelism); 'token path' submits from a worker thread, as the "
          f"forward pass does (two thread hops per layer).  Dispatch columns: protocol v1.3 (receipts in batches) "
          f"with output checks off, beside v1.2 (a signed receipt per answer) and v1.3 with the default checks "
          f"(their cost in decoding: --only verify); decode: v1.3, default checks, medians of 3 alternating runs, "
          f"swarm / single with the forward on the loop (as the batch engine decodes).  {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at the end (the machine is shared).")
    print("| model | holders called (= local threads) | data-plane ping | one MoE layer via swarm, awaited on the loop "
          "| ... from a forward pass on the loop (no hop) | ... from a worker thread (2 hops) | ... thread, v1.2 "
          "| ... thread, v1.3 + checks | same experts locally | dispatch overhead (forward on the loop - local) "
          "| overhead / raw RTT | CPU per layer: backbone loop / holders | decode single process "
          "| decode backbone + 4 nodes: forward in a thread / on the loop | swarm / single |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, float] = {}
    for key, (name, (d, single, threaded, looped)) in zip(keys, rows):
        overhead = d.greenlet_s - d.local_s
        swarm = looped  # as the batch engine decodes (node/scheduler.py: small steps on the loop)
        print(f"| {name} | {d.holders} | {d.ping_s * 1e3:.3f} ms | {d.on_loop_s * 1e3:.2f} ms | "
              f"{d.greenlet_s * 1e3:.2f} ms | {d.token_path_s * 1e3:.2f} ms | {d.v12_token_path_s * 1e3:.2f} ms | "
              f"{d.checked_token_path_s * 1e3:.2f} ms | {d.local_s * 1e3:.2f} ms | {overhead * 1e3:.2f} ms | "
              f"{overhead / rtt:.1f}x | {d.backbone_cpu_s * 1e3:.2f} / {d.holders_cpu_s * 1e3:.2f} ms | "
              f"{single:.1f} tok/s | {threaded:.1f} / {looped:.1f} tok/s | {swarm / single:.1%} |")
        ratios[f"dispatch_over_rtt_{key}"] = round(overhead / rtt, 2)
        ratios[f"swarm_over_single_{key}"] = round(swarm / single, 3)
    for name, (d, *_) in rows:
        if d.profile:
            print(f"\ncProfile of the backbone's loop thread, {name}, {reps} dispatches:\n" + d.profile)
    return ratios


# ---------------------------------------------------------------- 5. the cost of checking outputs


async def verify_side(model_dir: str, bootstrap: str, tokens: int, rounds: int) -> tuple[dict[bool, list[float]], float]:
    config = BackboneConfig(SwarmConfig(model_dir, bootstrap=(bootstrap,), client_mode=True))  # default checks
    async with SwarmBackbone(config) as bb:
        assert bb.model is not None and bb.executor is not None and bb.verifier is not None
        verifier, ids = bb.verifier, list(range(3, 19))
        await asyncio.to_thread(decode_rate, bb.model, ids, 8)  # warm-up: connections, probation of every holder
        rates: dict[bool, list[float]] = {True: [], False: []}
        spent = verifier.check_s
        for _ in range(rounds):  # alternate, so drift hits both alike
            for on in (True, False):
                bb.executor.verifier = verifier if on else None
                rates[on].append(await asyncio.to_thread(decode_rate, bb.model, ids, tokens))
        bb.executor.verifier = verifier
        print(f"  ({verifier.status()['method']} checks: {verifier.checked} calls checked, "
              f"{verifier.verification_calls} extra calls)")
        return rates, (verifier.check_s - spent) / (rounds * tokens)


def verify_section(folder: Path, tokens: int, rounds: int) -> None:
    rows = []
    for name, model_dir in (("demo (4.4M params, fp16)", str(CHECKPOINT)),
                            ("random Mixtral 1.1 GB (H 1024, I 2816)", str(random_mixtral(folder / "mixtral-1.1GB")))):
        with local_swarm(model_dir, 2, experts_per_layer=load_config(model_dir).num_experts) as daemons:
            rates, per_token = asyncio.run(verify_side(model_dir, daemons[0].info["multiaddrs"][0], tokens, rounds))
        rows.append((name, *(statistics.median(rates[k]) for k in (True, False)), per_token, rates))
    print(f"\nchecking outputs: backbone + 2 expert nodes on loopback; medians of {rounds} alternating runs of "
          f"{tokens} tokens, after probation")
    print("| model | decode, default checks (5% recomputed) | decode, --verify-fraction 0 | tok/s lost "
          "| time in checks per token (measured inside) |")
    print("|---|---|---|---|---|")
    for name, on, off, per_token, rates in rows:
        print(f"| {name} | {on:.1f} tok/s | {off:.1f} tok/s | {1 - on / off:+.1%} | {per_token * 1e3:.2f} ms "
              f"({per_token * off:.1%} of an unchecked token) |")
        print(f"runs, tok/s: on {[round(v, 1) for v in rates[True]]}, off {[round(v, 1) for v in rates[False]]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--reps", type=int, default=100, help="single-layer dispatches timed")
    ap.add_argument("--keep", type=Path, default=None, help="build/reuse the random models here, not in a temp dir")
    ap.add_argument("--only", choices=["dispatch", "overlap", "verify"], default=None, help="run one section (default both)")
    ap.add_argument("--rtt-ms", type=float, default=3.4, help="overlap section: round trip added to the data plane")
    ap.add_argument("--rounds", type=int, default=5, help="overlap section: alternating on/off runs")
    ap.add_argument("--models", default="demo,mixtral", help="dispatch section: demo, mixtral or both")
    ap.add_argument("--profile", action="store_true", help="dispatch section: print a cProfile of the dispatches")
    args = ap.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="moeswarm-bench-"))
    ratios: dict[str, float] = {}
    if args.only in (None, "dispatch"):
        ratios = dispatch_section(folder, args.tokens, args.reps, args.models.split(","), args.profile)
    if args.only in (None, "overlap"):
        overlap_section(folder, args.tokens, args.rounds, args.rtt_ms)
    if args.only in (None, "verify"):
        verify_section(folder, args.tokens, args.rounds)
    # the last line: the four ratios (null where a model was not measured in this run)
    print(json.dumps({k: ratios.get(k) for k in ("dispatch_over_rtt_demo", "dispatch_over_rtt_1g",
                                                 "swarm_over_single_demo", "swarm_over_single_1g")}))


if __name__ == "__main__":
    main()
