"""Early dispatch of DeepSeek-V4's hash-routed layers over the 30 ms testbed (issue 34).

A hash-routed layer's experts follow from the token ids, so the backbone knows them before the
layer's attention finishes (``Model._announce_hashed``); their input, though, is the layer's
post-attention hidden state, so the expert call itself cannot leave earlier and every MoE layer
still costs one round trip.  What can start early is the holder's side: with
``DispatchConfig.early_hash`` each hash layer after the pass's first MoE layer (here layer 1)
has its holders sent a warm-up call (zeros, outputs discarded) for exactly its experts, right
behind the previous layer's requests, and the layer's call then goes to the same holders.  That saves time only where a holder has work to do before it can compute: reading
(paging in) experts it does not keep resident.  Measured in two swarms of the same checkpoint:

- ``resident``: the nodes keep every expert in memory (the default);
- ``paging``: the nodes run with ``--memory-budget`` below what they hold, so experts are read
  from disk on use and evicted (``moeswarm/model/memory.py``).

The checkpoint: ``tests/oracle_dsv4.py``'s config (five layers: hash_moe, hash_moe, moe, moe, moe;
sliding / CSA / HCA attention, hyper-connections) at hidden 1024, experts 2048 wide (25 MB each
in float32), 8 experts top-2; built once with transformers into ``--dir``.  Two expert nodes
(experts 0-3, 4-7), each behind a delay proxy process (``--rtt-ms``, 30 by default: every
data-plane call pays it), the backbone in this process.  Each round prefills 8 tokens and then
decodes ``--tokens`` forced random tokens (the same in every case), with early dispatch on and off
alternated; per forward pass the median wall time, and per layer the median time from the
layer's submit to its result, and the compute time the holder reports for each layer's own call
(the profile: paging vs matmuls).  The logits must be the same on and off (printed).  A receipt
naming no call of ours is printed as a DIAG line.  The last line is one JSON object.

    python benchmarks/hash_dispatch.py [--tokens 24] [--rounds 5] [--rtt-ms 30] [--memory-budget 420MiB] [--warm-after-ms 2]

Every process runs with OPENBLAS_NUM_THREADS=1.  Figures measured while other work shares the
machine are noisy: the load average is printed.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import asyncio
import dataclasses
import json
import socket
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _delay import spawn_delay_proxy  # benchmarks/_delay.py

SIZE = {"hidden_size": 1024, "moe_intermediate_size": 2048, "n_routed_experts": 8}


def build(folder: Path) -> Path:
    """The benchmark's checkpoint (transformers, test-side oracle config at ``SIZE``), once."""
    if (folder / "config.json").exists():
        return folder
    import oracle_dsv4  # tests/oracle_dsv4.py: imports torch + transformers

    oracle_dsv4.CONFIG_FIELDS.update(SIZE)
    folder.parent.mkdir(parents=True, exist_ok=True)
    return oracle_dsv4.build_checkpoint("per_expert", folder)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_case(folder: str, rtt_ms: float, budget: str | None, tokens: int, rounds: int, warm_after_s: float) -> dict:  # type: ignore[type-arg]
    from moeswarm.daemon import SwarmConfig
    from moeswarm.demo.swarm import expert_nodes
    from moeswarm.node.backbone import SwarmBackbone
    from moeswarm.node.config import BackboneConfig

    proxies = []

    def behind_a_proxy(i: int) -> list[str]:
        port = _free_port()
        proxies.append(spawn_delay_proxy("127.0.0.1:0", f"127.0.0.1:{port}", rtt_ms / 2e3))
        return ["--port", str(port), "--announce-port", str(proxies[-1].port)] + (
            ["--memory-budget", budget] if budget else [])

    rng = np.random.default_rng(7)
    prompt = rng.integers(3, 512, 8).tolist()
    forced = rng.integers(3, 512, tokens).tolist()
    try:
        with expert_nodes(folder, ["0-3", "4-7"], extra_args=behind_a_proxy) as daemons:
            swarm = SwarmConfig(folder, bootstrap=(daemons[0].info["multiaddrs"][0],), client_mode=True)

            async def main() -> dict:  # type: ignore[type-arg]
                async with SwarmBackbone(BackboneConfig(swarm, coverage_timeout_s=120)) as bb:
                    ex, model = bb.executor, bb.model
                    assert ex is not None and model is not None
                    spans: dict[int, float] = {}
                    per_layer: list[tuple[int, float]] = []
                    dispatch = ex.dispatch

                    async def timed_dispatch(layer, x, ids, weights):  # type: ignore[no-untyped-def]
                        try:
                            return await dispatch(layer, x, ids, weights)
                        finally:
                            per_layer.append((layer, time.perf_counter() - spans[layer]))

                    submit = ex.submit

                    def timed_submit(layer, x, ids, weights):  # type: ignore[no-untyped-def]
                        spans[layer] = time.perf_counter()
                        return submit(layer, x, ids, weights)

                    ex.dispatch, ex.submit = timed_dispatch, timed_submit  # type: ignore[method-assign]
                    computed: list[tuple[int, float]] = []  # (layer, the holder's compute ms) of each real call
                    call_once = ex._call_once_or_reconnect

                    sent: dict[bytes, list] = {}  # type: ignore[type-arg]  # diagnostics of refused receipts

                    async def timed_call(holder, request):  # type: ignore[no-untyped-def]
                        sent[request.request_id] = ["call" if request.hidden.any() else "warm-up", request.layer,
                                                    time.perf_counter(), None]
                        response = await call_once(holder, request)
                        sent[request.request_id][3] = time.perf_counter()
                        if request.hidden.any():  # not a warm-up (zeros)
                            computed.append((request.layer, response.compute_us / 1e3))
                        return response

                    ex._call_once_or_reconnect = timed_call  # type: ignore[method-assign]
                    settle_batch = ex._settle_batch

                    def checked_settle(peer, batch):  # type: ignore[no-untyped-def]
                        for r in batch.receipts:
                            if (peer, r.request_id) not in ex._awaiting:
                                print(f"DIAG receipt for {sent.get(r.request_id)} now={time.perf_counter()} "
                                      f"unchecked={len(ex._unchecked)}", flush=True)
                        return settle_batch(peer, batch)

                    ex._settle_batch = checked_settle  # type: ignore[method-assign]

                    def one_round(early: bool) -> tuple[list[float], list[tuple[int, float]], np.ndarray, int]:
                        ex.config = dataclasses.replace(ex.config, early_hash=early, warm_after_s=warm_after_s)
                        warm0 = ex.warmups
                        cache = model.new_cache()
                        model.forward(np.asarray([prompt]), cache, last_only=True)
                        per_layer.clear()
                        computed.clear()
                        steps, logits = [], []
                        for t in forced:
                            t0 = time.perf_counter()
                            logits.append(model.forward(np.asarray([[t]]), cache)[0, -1])
                            steps.append(time.perf_counter() - t0)
                        return steps, list(per_layer), np.stack(logits), ex.warmups - warm0, list(computed)

                    await asyncio.to_thread(one_round, False)  # warm-up, untimed
                    out: dict[bool, list] = {True: [], False: []}  # type: ignore[type-arg]
                    for r in range(rounds):
                        for early in ((True, False) if r % 2 == 0 else (False, True)):
                            out[early].append(await asyncio.to_thread(one_round, early))
                    pings = []
                    for client in ex.connections.open_clients():
                        pings += [await client.ping(5.0) for _ in range(5)]
                    return {"out": out, "ping_s": statistics.median(pings) if pings else float("nan")}

            return asyncio.run(main())
    finally:
        for proxy in proxies:
            proxy.close()


def summarise(name: str, res: dict, moe_hash: list[int]) -> dict:  # type: ignore[type-arg]
    out = res["out"]
    ref = out[False][0][2]
    worst = max(float(np.abs(o[2] - ref).max()) for case in out.values() for o in case)
    row: dict = {"case": name, "max_logit_diff": worst, "ping_ms": res["ping_s"] * 1e3}  # type: ignore[type-arg]
    for early in (False, True):
        steps = [s for o in out[early] for s in o[0]]
        layers: dict[int, list[float]] = defaultdict(list)
        for o in out[early]:
            for L, s in o[1]:
                layers[L].append(s)
        key = "on" if early else "off"
        row[f"step_ms_{key}"] = statistics.median(steps) * 1e3
        row[f"layer_ms_{key}"] = {L: statistics.median(v) * 1e3 for L, v in sorted(layers.items())}
        row[f"warmups_{key}"] = sum(o[3] for o in out[early])
        holder: dict[int, list[float]] = defaultdict(list)
        for o in out[early]:
            for L, ms in o[4]:
                holder[L].append(ms)
        row[f"compute_ms_{key}"] = {L: statistics.median(v) for L, v in sorted(holder.items())}
    row["hash_layers"] = moe_hash
    return row


def _kind(L: int, hashed: list[int], warmed: list[int]) -> str:
    return " (hash, warmed)" if L in warmed else " (hash)" if L in hashed else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/moeswarm-bench/hash-dispatch-v4", help="checkpoint folder (built once)")
    ap.add_argument("--tokens", type=int, default=24, help="forced decode tokens per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of each case (medians reported)")
    ap.add_argument("--rtt-ms", type=float, default=30.0, help="round trip added to every data-plane connection")
    ap.add_argument("--memory-budget", default="420MiB",
                    help="the paging nodes' --memory-budget (below the 400 MB of experts each holds plus its baseline)")
    ap.add_argument("--warm-after-ms", type=float, default=2.0,
                    help="DispatchConfig.warm_after_s: a warm-up leaves at least this long after the previous layer's "
                         "requests (more on a holder that computes longer: dispatch.py _warm_delay)")
    args = ap.parse_args()
    folder = str(build(Path(args.dir)))
    from moeswarm.model import load_config

    cfg = load_config(folder)
    hashed = [L for L, h in enumerate(cfg.family.hash_layers) if h]
    first_moe = cfg.moe_layers.index(True)
    warmed = [L for L in hashed if L > first_moe]  # the first MoE layer is not warmed (dispatch.py)
    rows = []
    load = [os.getloadavg()[0]]
    for name, budget in (("resident", None), ("paging", args.memory_budget)):
        rows.append(summarise(name, run_case(folder, args.rtt_ms, budget, args.tokens, args.rounds, args.warm_after_ms / 1e3), hashed))
        load.append(os.getloadavg()[0])
    print(f"\nDeepSeek-V4 ({cfg.num_layers} layers, hash-routed {hashed}; hidden {cfg.hidden_size}, "
          f"{cfg.num_experts} experts of {cfg.moe_intermediate_size} wide, top-{cfg.top_k}) through 2 expert nodes, "
          f"data plane {args.rtt_ms} ms RTT (delay proxies); {args.tokens} forced decode tokens x {args.rounds} "
          f"alternating rounds per case; warm-ups >= {args.warm_after_ms} ms behind the previous layer's requests; load average {min(load):.1f}-{max(load):.1f}")
    print("| holders | data-plane ping ms | decode ms/token, early off | on | saved | "
          + " | ".join(f"layer {L}{_kind(L, hashed, warmed)} ms off / on" for L in range(cfg.num_layers))
          + " | warm-up calls on | max logit diff on vs off |")
    print("|---|---|---|---|---|" + "---|" * cfg.num_layers + "---|---|")
    for r in rows:
        cells = " | ".join(f"{r['layer_ms_off'].get(L, float('nan')):.1f} / {r['layer_ms_on'].get(L, float('nan')):.1f}"
                           for L in range(cfg.num_layers))
        print(f"| {r['case']} | {r['ping_ms']:.1f} | {r['step_ms_off']:.1f} | {r['step_ms_on']:.1f} | "
              f"{r['step_ms_off'] - r['step_ms_on']:+.1f} | {cells} | {r['warmups_on']} | {r['max_logit_diff']:.1e} |")
    print("\nthe holder's side of each layer's own call (compute_us in its answer: reading the experts when not "
          "resident, and the matmuls), ms, median per call, early dispatch off / on")
    print("| holders | " + " | ".join(f"layer {L}{_kind(L, hashed, warmed)}" for L in range(cfg.num_layers)) + " |")
    print("|---|" + "---|" * cfg.num_layers)
    for r in rows:
        print(f"| {r['case']} | " + " | ".join(
            f"{r['compute_ms_off'].get(L, float('nan')):.1f} / {r['compute_ms_on'].get(L, float('nan')):.1f}"
            for L in range(cfg.num_layers)) + " |")
    result = {"rtt_ms": args.rtt_ms, "warm_after_ms": args.warm_after_ms, "load_avg": round(max(load), 1)}
    for r in rows:
        c = r["case"]
        result[f"{c}_ms_per_token_off"] = round(r["step_ms_off"], 2)
        result[f"{c}_ms_per_token_on"] = round(r["step_ms_on"], 2)
        result[f"{c}_saved_ms_per_token"] = round(r["step_ms_off"] - r["step_ms_on"], 2)
        result[f"{c}_warmed_layers_saved_ms"] = round(statistics.mean(
            r["layer_ms_off"][L] - r["layer_ms_on"][L] for L in warmed), 2)
        for key in ("off", "on"):
            result[f"{c}_warmed_layers_holder_compute_ms_{key}"] = round(statistics.mean(
                r[f"compute_ms_{key}"][L] for L in warmed), 2)
        result[f"{c}_max_logit_diff"] = r["max_logit_diff"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
