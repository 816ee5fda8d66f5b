"""Seed 000's comparison on emulated links: one node serving from its disk (mmap under a memory
budget) vs the swarm (hidden states to the expert holders) vs weight fetching (expert weights
pulled from the holders' RAM on a miss), for decode and prefill, next to the tier planner's
prediction and the crossovers it predicts.

    sudo python benchmarks/tiers.py [--tokens 12] [--prompt 32] [--png tiers.png] [--keep DIR]

Links (benchmarks/_links.py: two network namespaces, a veth pair shaped by tbf each direction,
the round trip added by a userspace proxy because this kernel has no netem):
  (a) RTT 3.4 ms, 89 Mbit/s to the holders, 49 Mbit/s back (the seed's office link);
  (b) 1 Gbit/s each way, no added delay;
  (c) no shaping, no added delay (veth + TLS as fast as this machine goes).
The backbone runs in namespace a, two expert nodes (experts 0-3 and 4-7) in namespace b.  The
single node reads its own copy of the checkpoint (so the nodes' page cache does not serve it),
with the same memory for experts as the fetching backbone's cache.  Needs root (namespaces).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from moeswarm.model import Model, ModelConfig, load_config, load_weights
from moeswarm.model.memory import MemoryBudget, MemoryStats
from moeswarm.model.synthetic import random_mixtral

HERE = Path(__file__).resolve().parent
SCENARIOS = {  # name: (rtt ms, Mbit/s backbone -> holders, Mbit/s holders -> backbone)
    "a: 3.4 ms, 89/49 Mbit/s": (3.4, 89.0, 49.0),
    "b: 1 Gbit/s": (0.0, 1000.0, 1000.0),
    "c: no shaping": (0.0, None, None),
}
SHAPE = dict(hidden=512, inter=1024, layers=4, experts=8, vocab=4096, heads=8, kv_heads=2)  # 6.3 MB experts


def prompt_ids(n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(1).integers(3, vocab, n)]


def timed_run(model: Model, prompt: list[int], tokens: int, after_prefill: Any = None) -> dict[str, float]:
    """Prefill the prompt (one forward), then ``tokens`` greedy decode steps; seconds for each."""
    cache = model.new_cache()
    t0 = time.perf_counter()
    logits = model.forward(np.asarray([prompt]), cache)
    prefill = time.perf_counter() - t0
    if after_prefill is not None:
        after_prefill()
    token = int(np.argmax(logits[0, -1]))
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = int(np.argmax(model.forward(np.asarray([[token]]), cache)[0, -1]))
    return {"prefill_s": prefill, "decode_tok_s": tokens / (time.perf_counter() - t0)}


# ---------------------------------------------------------------- the three ways


def resident_run(folder: Path, prompt: list[int], tokens: int) -> dict[str, float]:
    """The same model with every weight in RAM: the compute floor.  Its maps are gone on return."""
    weights = load_weights(str(folder))
    timed_run(Model(weights), prompt, tokens)  # pages everything in
    result = timed_run(Model(weights), prompt, tokens)
    del weights
    gc.collect()
    return result


def run_mmap(folder: Path, budget: int, prompt: list[int], tokens: int) -> dict[str, Any]:
    """One node, its checkpoint memory-mapped under a budget: misses read from disk."""
    resident = resident_run(folder, prompt, tokens)
    for f in folder.glob("*.safetensors"):  # then cold: the page cache forgets this copy (no map pins it)
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    weights = load_weights(str(folder))
    cfg = weights.config
    expert_bytes = sum(w.nbytes for layer in weights.experts.values() for w in layer.values())
    backbone = sum(a.nbytes for a in weights.tensors.values())
    base = MemoryStats.now().vm_rss  # the interpreter and its libraries, before any weight is touched
    memory = MemoryBudget(weights, base + backbone + budget)
    model = Model(weights)
    memory.attach(model)
    stats = memory.stats
    marks: dict[str, int] = {}
    result = timed_run(model, prompt, tokens, lambda: marks.update(hits=stats.hits, misses=stats.misses))
    decode_hits, decode_misses = stats.hits - marks["hits"], stats.misses - marks["misses"]
    from moeswarm.node.measure import measure_compute_bps, measure_disk_bps

    result.update(resident_decode_s=1 / resident["decode_tok_s"], resident_prefill_s=resident["prefill_s"],
                  hit_rate=decode_hits / max(1, decode_hits + decode_misses), disk_bps=measure_disk_bps(weights),
                  disk_seq_bps=measure_disk_bps(weights, consecutive=True),
                  compute_bps=measure_compute_bps(cfg, weights.experts[1][0]), expert_bytes=expert_bytes,
                  backbone_bytes=backbone)
    memory.close()
    return result


def backbone_main(spec: dict[str, Any]) -> None:
    """Inside namespace a: a backbone (--tiers remote or fetch) timed like ``run_mmap``; prints JSON."""
    from moeswarm.daemon import SwarmConfig
    from moeswarm.node.backbone import SwarmBackbone
    from moeswarm.node.config import BackboneConfig

    async def main() -> dict[str, Any]:
        config = BackboneConfig(SwarmConfig(spec["folder"], bootstrap=(spec["bootstrap"],), client_mode=True),
                                coverage_timeout_s=60, tiers=spec["tiers"], fetch_cache_bytes=spec["budget"],
                                probe_interval_s=3600)
        async with SwarmBackbone(config) as bb:
            assert bb.tiers is not None and bb.model is not None
            deadline = time.monotonic() + 60
            while len(bb.tiers.links.links) < 2 and time.monotonic() < deadline:  # both holders measured
                await asyncio.sleep(0.2)
            fetched = bb.tiers.fetched
            marks: dict[str, int] = {}
            result = await asyncio.to_thread(timed_run, bb.model, spec["prompt"], spec["tokens"],
                                             lambda: marks.update(bytes=fetched.fetched_bytes))
            result["fetch_hit_rate"] = None
            assert bb.tiers.fetch_rejected == 0 and (spec["tiers"] != "fetch" or bb.tiers.fetch_verified > 0)
            if len(fetched):  # --tiers fetch: the share of decode's expert uses its cache already held
                one = fetched.bytes / len(fetched)  # every expert has the same size here
                uses = spec["tokens"] * sum(bb.cfg.moe_layers) * bb.cfg.top_k
                result["fetch_hit_rate"] = 1 - (fetched.fetched_bytes - marks.get("bytes", 0)) / one / uses
            links = list(bb.tiers.links.links.values())
            result["link"] = {"rtt_s": float(np.mean([x.rtt_s for x in links])),
                              "up_bps": float(np.mean([x.up_bps for x in links])),
                              "down_bps": float(np.mean([x.down_bps for x in links]))}
            result["fetched_bytes"] = bb.tiers.fetched.fetched_bytes
            calls = [h.rtt_s for h in bb.table.live() if h.rtt_s is not None]  # observed call latency
            result["call_s"] = float(np.mean(calls)) if calls else None
            return result

    print("RESULT " + json.dumps(asyncio.run(main())), flush=True)


def run_link(link: Any, folder: Path, budget: int, prompt: list[int], tokens: int) -> dict[str, dict[str, Any]]:
    """Two nodes in namespace b behind the link; a backbone in namespace a per way."""
    nodes = []
    boot = None
    for experts in ("0-3", "4-7"):
        data_port = 20000 + len(nodes)
        proxy_port = link.delayed_port(data_port)
        argv = [sys.executable, "-m", "moeswarm.cli", "node", "--model", str(folder), "--experts", experts,
                "--host", "0.0.0.0", "--announce-host", link.addr_b, "--port", str(data_port),
                "--announce-port", str(proxy_port), "--status", "off"]
        if boot:
            argv += ["--bootstrap", boot]
        process = link.run(link.ns_b, argv, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        info = _ready(process)
        boot = boot or info["multiaddrs"][0]
        nodes.append(process)
    out = {}
    for way in ("remote", "fetch"):
        spec = {"folder": str(folder), "bootstrap": boot, "tiers": way, "budget": budget, "prompt": prompt,
                "tokens": tokens}
        process = link.run(link.ns_a, [sys.executable, str(Path(__file__).resolve()), "--backbone", json.dumps(spec)],
                           stdout=subprocess.PIPE, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        out[way] = _result(process)
    return out


def _ready(process: subprocess.Popen[str], timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"a node exited (code {process.wait()}) before READY")
        if line.startswith("READY "):
            return json.loads(line[6:])  # type: ignore[no-any-return]
    raise RuntimeError("no READY line in time")


def _result(process: subprocess.Popen[str], timeout_s: float = 900) -> dict[str, Any]:
    out, _ = process.communicate(timeout=timeout_s)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])  # type: ignore[no-any-return]
    raise RuntimeError(f"the backbone printed no result (exit {process.returncode})")


# ---------------------------------------------------------------- the planner's side


def predict(cfg: ModelConfig, mm: dict[str, Any], link: dict[str, float], prompt: int,
            call_s: float | None, fetch_hit_rate: float) -> dict[str, float]:
    """The planner's cost model (moeswarm.node.planner) with measured figures: seconds per decode
    token and per prefill, for each way.  The compute floor is the same model run with every
    weight in RAM; each way adds what it moves: disk reads of misses, weight fetches of misses, or
    one call per MoE layer (at the call latency the backbone observed, which includes dispatch,
    not just the ping) plus the hidden states each direction."""
    from moeswarm.node import planner

    L, E, k = sum(cfg.moe_layers), cfg.num_experts, cfg.top_k
    B = mm["expert_bytes"] / (L * E)
    h = mm["hit_rate"]  # decode's hit rate in the single node's expert cache, as measured
    hf = fetch_hit_rate  # ... and in the fetching backbone's cache (same memory)
    disk = planner.LocalTier(mm["disk_bps"], float("inf"), hit_rate=h)
    net = planner.Link(max(link["rtt_s"], call_s or 0.0), link["up_bps"], link["down_bps"], float("inf"))
    spec = planner.ExpertSpec(0, 0, int(B))
    hidden = cfg.hidden_size * 4
    fetch_miss = (1 - hf) * (net.rtt_s + B / net.down_bps)
    cold = planner.LocalTier(mm["disk_seq_bps"], float("inf"))  # prefill: every expert read (in order) or fetched once
    dec, pre = mm["resident_decode_s"], mm["resident_prefill_s"]
    return {
        "mmap_decode": dec + L * k * planner.local_seconds(spec, disk),
        "swarm_decode": dec + L * planner.remote_seconds(spec, net, 1, hidden * k),
        "fetch_decode": dec + L * k * fetch_miss,
        "mmap_prefill": pre + L * E * planner.local_seconds(spec, cold),
        "swarm_prefill": pre + L * (net.rtt_s + prompt * hidden / net.up_bps + prompt * k * hidden / net.down_bps),
        "fetch_prefill": pre + L * E * (net.rtt_s + B / net.down_bps),
    }


def crossovers(cfg: ModelConfig, mm: dict[str, Any]) -> tuple[float, float]:
    """(down Mbit/s above which fetching a miss beats reading it from this disk, RTT ms below which
    the swarm's one call per MoE layer beats the disk reads of that layer's misses), from the same
    cost model (both caches missing alike)."""
    L, k = sum(cfg.moe_layers), cfg.top_k
    B = mm["expert_bytes"] / (L * cfg.num_experts)
    disk_s = B / mm["disk_bps"]
    return B / disk_s * 8e-6, k * (1 - mm["hit_rate"]) * disk_s * 1e3


def measured_crossovers(cfg: ModelConfig, mm: dict[str, Any], rows: list[Any]) -> tuple[float | None, float | None]:
    """Where the measured ways would cross the single node's decode, by lines through the
    measured points: fetching's seconds per token against 1 / download bandwidth (links b and
    c, no added delay), the swarm's against the observed expert-call latency (links a and b)."""
    t_disk = 1 / mm["decode_tok_s"]
    by = {name[0]: (net, m) for name, net, m, _ in rows}
    down = rtt = None
    (nb, mb), (nc, mc) = by["b"], by["c"]
    x1, x2 = 1 / nb["down_bps"], 1 / nc["down_bps"]
    y1, y2 = 1 / mb["fetch"]["decode_tok_s"], 1 / mc["fetch"]["decode_tok_s"]
    if x1 != x2 and y1 != y2:
        slope = (y1 - y2) / (x1 - x2)  # seconds per token per (second per byte)
        x = (t_disk - (y2 - slope * x2)) / slope
        down = 8e-6 / x if x > 0 else None
    (_, ma), (_, mb) = by["a"], by["b"]
    c1, c2 = ma["remote"]["call_s"], mb["remote"]["call_s"]
    s1, s2 = 1 / ma["remote"]["decode_tok_s"], 1 / mb["remote"]["decode_tok_s"]
    if c1 and c2 and c1 != c2:
        slope = (s1 - s2) / (c1 - c2)
        call = c2 + (t_disk - s2) / slope
        rtt = call * 1e3 if call > 0 else None
    return down, rtt


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--png", default="tiers.png")
    ap.add_argument("--keep", default=None, help="build the checkpoint here and keep it")
    ap.add_argument("--backbone", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backbone:
        return backbone_main(json.loads(args.backbone))
    if os.geteuid() != 0:
        sys.exit("benchmarks/tiers.py needs root: it creates network namespaces")
    sys.path.insert(0, str(HERE))
    from _links import emulated_link

    root = Path(args.keep or tempfile.mkdtemp(prefix="moeswarm-tiers-"))
    folder = random_mixtral(root / "model", **SHAPE)
    own = root / "single-node-copy"
    if not own.exists():
        shutil.copytree(folder, own)
    cfg = load_config(str(folder))
    weights = load_weights(str(folder))
    from moeswarm.node.fetch import DIGESTS_FILE, write_expert_digests

    write_expert_digests(weights, folder / DIGESTS_FILE, model_id="tiers benchmark")  # fetches are checked, as a user's are
    total = sum(w.nbytes for layer in weights.experts.values() for w in layer.values())
    budget = total // 4  # memory for experts: a quarter of them
    prompt = prompt_ids(args.prompt, cfg.vocab_size)
    print(f"model: {SHAPE}, {total / 1e6:.0f} MB of experts ({total / 1e6 / (cfg.num_layers * cfg.num_experts):.1f} "
          f"MB each); memory for experts {budget / 1e6:.0f} MB; prompt {args.prompt} tokens, {args.tokens} decoded\n")

    mm = run_mmap(own, budget, prompt, args.tokens)
    print(f"single node (mmap): disk {mm['disk_bps'] / 1e6:.0f} MB/s for scattered experts, "
          f"{mm['disk_seq_bps'] / 1e6:.0f} MB/s for a layer's in order; decode's expert cache hit rate "
          f"{mm['hit_rate']:.0%}; all in RAM: {1 / mm['resident_decode_s']:.1f} tokens/s, prefill "
          f"{mm['resident_prefill_s']:.2f} s")
    rows = []
    for name, (rtt, a_to_b, b_to_a) in SCENARIOS.items():
        with emulated_link(rtt, a_to_b, b_to_a) as link:
            measured = run_link(link, folder, budget, prompt, args.tokens)
        net = measured["remote"]["link"]
        rows.append((name, net, measured, predict(cfg, mm, net, args.prompt, measured["remote"]["call_s"],
                                                  measured["fetch"]["fetch_hit_rate"])))
        print(f"  {name}: measured rtt {net['rtt_s'] * 1e3:.2f} ms, up {net['up_bps'] * 8e-6:.0f} Mbit/s, "
              f"down {net['down_bps'] * 8e-6:.0f} Mbit/s; expert call latency observed "
              f"{(measured['remote']['call_s'] or 0) * 1e3:.2f} ms; fetch cache hit rate "
              f"{measured['fetch']['fetch_hit_rate']:.0%}", flush=True)

    print("\ndecode tokens/s (measured | planner)        prefill seconds (measured | planner)")
    print(f"{'link':<26}{'mmap':>14}{'swarm':>14}{'fetch':>14}   {'mmap':>13}{'swarm':>13}{'fetch':>13}")
    for name, net, m, p in rows:
        dec = [(mm["decode_tok_s"], 1 / p["mmap_decode"]), (m["remote"]["decode_tok_s"], 1 / p["swarm_decode"]),
               (m["fetch"]["decode_tok_s"], 1 / p["fetch_decode"])]
        pre = [(mm["prefill_s"], p["mmap_prefill"]), (m["remote"]["prefill_s"], p["swarm_prefill"]),
               (m["fetch"]["prefill_s"], p["fetch_prefill"])]
        print(f"{name:<26}" + "".join(f"{a:>7.1f} |{b:>5.1f}" for a, b in dec) + "   "
              + "".join(f"{a:>6.2f} |{b:>5.2f}" for a, b in pre))
    down, rtt = crossovers(cfg, mm)
    print("\nwho wins, measured:")
    for name, net, m, p in rows:
        dec = {"mmap": mm["decode_tok_s"], "swarm": m["remote"]["decode_tok_s"], "fetch": m["fetch"]["decode_tok_s"]}
        pre = {"mmap": mm["prefill_s"], "swarm": m["remote"]["prefill_s"], "fetch": m["fetch"]["prefill_s"]}
        print(f"  {name}: decode {max(dec, key=dec.__getitem__)}, prefill {min(pre, key=pre.__getitem__)}; "
              f"fetching vs disk: {m['fetch']['decode_tok_s'] / mm['decode_tok_s']:.2f}x")
    print(f"planner's crossovers (same figures): fetching beats this disk above {down:,.0f} Mbit/s down "
          f"(with no added delay); the swarm's decode beats it below {rtt:.1f} ms per expert call")
    m_down, m_rtt = measured_crossovers(cfg, mm, rows)
    print("measured crossovers (lines through the measured points): fetching would beat this disk above "
          + (f"{m_down:,.0f} Mbit/s down" if m_down else "no bandwidth") + "; the swarm's decode beats it below "
          + (f"{m_rtt:.1f} ms per expert call" if m_rtt else "(no slope between the links)"))
    plot(rows, mm, args.png)
    print(f"\nplot: {args.png}")


def plot(rows: list[Any], mm: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r[0] for r in rows]
    x = np.arange(len(rows))
    for i, (way, key) in enumerate((("mmap", None), ("swarm", "remote"), ("fetch", "fetch"))):
        dec = [mm["decode_tok_s"] if key is None else r[2][key]["decode_tok_s"] for r in rows]
        pre = [mm["prefill_s"] if key is None else r[2][key]["prefill_s"] for r in rows]
        pdec = [1 / r[3][f"{way}_decode"] for r in rows]
        ppre = [r[3][f"{way}_prefill"] for r in rows]
        ax1.bar(x + (i - 1) * 0.27, dec, 0.27, label=f"{way} measured")
        ax1.scatter(x + (i - 1) * 0.27, pdec, marker="_", s=300, color="black", zorder=3,
                    label="planner" if i == 0 else None)
        ax2.bar(x + (i - 1) * 0.27, pre, 0.27, label=f"{way} measured")
        ax2.scatter(x + (i - 1) * 0.27, ppre, marker="_", s=300, color="black", zorder=3,
                    label="planner" if i == 0 else None)
    for ax, title in ((ax1, "decode tokens/s (higher is better)"), (ax2, "prefill seconds (lower is better)")):
        ax.set_xticks(x, names, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
