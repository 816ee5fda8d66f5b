"""Simulate the scarcity market on the seed's model shape, next to Petals' placement rule.

Model: 57 MoE layers x 128 experts (MiniMax M3), one expert = ``--expert-mb`` MB (28 MB:
4-bit weights of a 6144 x 3072 SwiGLU expert). Demand: Zipf(``--zipf``) over the 128 experts
of each layer, a fresh random ranking per layer, every layer equally busy (each token visits
every layer). Volunteers: 1,000 heterogeneous machines (datacenter GPUs and workstations are
hubs; laptops and phones are edge devices); each epoch 10% leave and as many new ones join.

Both policies see the same volunteers, the same departures and the same joiners:

* ``market``: ``moeswarm.market.assign`` for joiners, ``rebalance`` (hysteresis, cooldown,
  safe move plans) for a random half of the nodes each epoch, demand merged from signed
  reports of 5 honest backbones plus 1 lying one.
* ``petals``: Petals' rule: a joiner takes whole layers (or one layer's expert range when it
  cannot hold a layer) where the swarm is least covered; nodes move when that raises the
  coverage of the least-covered span by the same 30% (Petals' ``balance_quality``).

Metrics (``--utilization`` u: the swarm's calls are u x its total throughput):

* coverage: share of experts held by someone (after departures, and after repair);
* calls finding a replica: demand-weighted coverage;
* served: share of calls served under load-aware routing (calls spread over an expert's
  holders by weight, weights shifted away from overloaded holders, as the backbone does with
  ``load_permille``), next to min(1, 1/u) (all the volunteers' throughput) and to an upper
  bound no placement can beat (a linear program, ``_swarm_model.served_bound``);
* replicas vs demand: Spearman correlation, hottest-decile / coldest-decile mean replicas, and
  the same ratio for the ideal (replicas proportional to demand, at least one each);
* moves: share of nodes that moved in the epoch.

    .venv/bin/python benchmarks/market_sim.py            # ~1-2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from moeswarm import market as mk  # noqa: E402
from moeswarm.market._grid import paint, prefix_sum, rect_sums  # noqa: E402
from moeswarm.protocol import Identity  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _swarm_model import served_bound  # noqa: E402

GB = 1e9
# name, share, device class, memory GB, throughput pairs/s, bandwidth B/s, rtt s   (uniform ranges)
CLASSES = [
    ("gpu", 0.05, "hub", (24, 80), (1e5, 4e5), 1.25e9, (0.002, 0.010)),
    ("workstation", 0.20, "hub", (8, 32), (1e4, 5e4), 1.25e8, (0.005, 0.030)),
    ("laptop", 0.35, "edge", (2, 8), (1e3, 8e3), 2.5e7, (0.020, 0.080)),
    ("phone", 0.40, "edge", (0.5, 2), (1e2, 8e2), 5e6, (0.050, 0.200)),
]


@dataclass
class Node:
    volunteer: mk.Volunteer
    rects: list[mk.Rect]
    moved_at: int = -99


@dataclass
class Policy:
    name: str
    supply: mk.Supply
    nodes: dict[int, Node] = field(default_factory=dict)
    rows: list[dict[str, float]] = field(default_factory=list)


def make_volunteers(rng: np.random.Generator, n: int, scale: float) -> list[mk.Volunteer]:
    shares = np.array([c[1] for c in CLASSES])
    out = []
    for c in rng.choice(len(CLASSES), size=n, p=shares / shares.sum()):
        _, _, cls, mem, tput, bw, rtt = CLASSES[c]
        out.append(mk.Volunteer(int(rng.uniform(*mem) * GB * scale), float(rng.uniform(*tput)),
                                "hub" if cls == "hub" else "edge", bw, float(rng.uniform(*rtt))))
    return out


def zipf_demand(rng: np.random.Generator, shape: mk.ModelShape, s: float) -> np.ndarray:
    base = 1.0 / np.arange(1, shape.num_experts + 1) ** s
    grid = np.stack([rng.permutation(base) for _ in range(shape.num_layers)])
    out: np.ndarray = grid / grid.sum()
    return out


def merged_demand(rng: np.random.Generator, shape: mk.ModelShape, truth: np.ndarray, ids: list[Identity],
                  now_ms: int) -> mk.MergeResult:
    """Reports of 5 honest backbones (sampled traffic) and 1 liar (all demand on one block)."""
    reports = []
    for i, ident in enumerate(ids):
        if i == len(ids) - 1:
            counts = np.full(shape.grid, 1.0)
            counts[:4, :16] = 5e4
        else:
            counts = rng.multinomial(2_000_000, truth.reshape(-1)).reshape(shape.grid).astype(np.float64)
        reports.append(mk.sign_report(ident, model_id=shape.model_id, layers=shape.moe_layers, counts=counts,
                                      half_life_ms=600_000, time_ms=now_ms, seq=now_ms))
    return mk.merge_reports(reports, shape, now_ms=now_ms)


# ---------------------------------------------------------------- Petals' rule (the baseline)


def petals_values(supply: mk.Supply) -> list[np.ndarray]:
    """Levels of Petals' rule: uncovered experts, then the least replicated."""
    r = supply.replicas
    return [(r <= 0).astype(np.float64), 1.0 / (1.0 + np.maximum(r, 0))]


def petals_rect(values: list[np.ndarray], k: int) -> tuple[mk.Rect, mk.Score] | None:
    """Whole layers where least covered; one layer's expert span if a layer does not fit."""
    L, E = values[0].shape
    if k < 1:
        return None
    h, w = (min(L, k // E), E) if k >= E else (1, k)
    sums = [p[h:, w:] - p[:-h, w:] - p[h:, :-w] + p[:-h, :-w] for p in map(prefix_sum, values)]
    key = sums[0] * 1e6 + sums[1]  # cover first (at most 1e4 cells), then least replicated
    i, j = divmod(int(np.argmax(key)), key.shape[1])
    return mk.Rect(i, i + h - 1, j, j + w - 1), (float(sums[0][i, j]), float(sums[1][i, j]))


# ---------------------------------------------------------------- the two policies' decisions


def place(policy: Policy, shape: mk.ModelShape, demand: mk.Demand, v: mk.Volunteer,
          cfg: mk.AssignConfig) -> list[mk.Rect]:
    if policy.name == "market":
        a = mk.assign(shape, policy.supply, demand, v, cfg)
        return [r for r in (shape.rect(b) for b in a.blocks) if r is not None]
    found = petals_rect(petals_values(policy.supply), mk.capacity_cells(shape, v, cfg))
    return [found[0]] if found is not None else []


def reconsider(policy: Policy, shape: mk.ModelShape, demand: mk.Demand, node: Node, epoch: int,
               cfg: mk.AssignConfig, rcfg: mk.RebalanceConfig) -> list[mk.Rect] | None:
    """The node's new rects if it moves (its plan was checked safe), else ``None``."""
    v, blocks = node.volunteer, [shape.block(r) for r in node.rects]
    if policy.name == "market":
        plan = mk.rebalance(shape, policy.supply, demand, v, blocks, assign_config=cfg, config=rcfg,
                            epochs_since_move=epoch - node.moved_at)
    else:
        if epoch - node.moved_at < rcfg.cooldown_epochs:
            return None
        others = policy.supply.changed(node.rects, v.throughput, -1)
        values = petals_values(others)
        found = petals_rect(values, mk.capacity_cells(shape, v, cfg))
        if found is None or [found[0]] == node.rects:
            return None
        now = tuple(float(sum(lv[r.slices].sum() for r in node.rects)) for lv in values)
        if not mk.better(found[1], now, rcfg.hysteresis):
            return None
        plan = mk.plan_move(shape, others.replicas, blocks, [shape.block(found[0])], mk.capacity_cells(shape, v, cfg))
    if plan is None:
        return None
    problems = mk.check_plan(shape, policy.supply.changed(node.rects, v.throughput, -1).replicas, plan,
                             mk.capacity_cells(shape, v, cfg))
    if problems:
        raise RuntimeError(f"unsafe move plan: {problems}")
    return [r for r in (shape.rect(b) for b in plan.target) if r is not None]


def add_node(policy: Policy, nid: int, v: mk.Volunteer, rects: list[mk.Rect], epoch: int = -99) -> None:
    policy.nodes[nid] = Node(v, rects, epoch)
    if rects:
        policy.supply = policy.supply.changed(rects, v.throughput, +1)


def remove_node(policy: Policy, nid: int) -> None:
    node = policy.nodes.pop(nid)
    if node.rects:
        policy.supply = policy.supply.changed(node.rects, node.volunteer.throughput, -1)


# ---------------------------------------------------------------- metrics


def served_share(policy: Policy, shape: mk.ModelShape, truth: np.ndarray, utilization: float) -> float:
    """Share of calls served under load-aware routing (see the module docstring)."""
    nodes = [n for n in policy.nodes.values() if n.rects]
    rects = np.array([r for n in nodes for r in n.rects], dtype=np.int64)
    owner = np.array([i for i, n in enumerate(nodes) for _ in n.rects])
    cap = np.array([max(n.volunteer.throughput, 1e-9) for n in nodes])
    return routed_share(shape, truth, utilization, rects, owner, cap)


def routed_share(shape: mk.ModelShape, truth: np.ndarray, utilization: float, rects: np.ndarray,
                 owner: np.ndarray, cap: np.ndarray, iters: int = 40) -> float:
    """Calls for each expert go to its holders in proportion to routing weights; a holder serves
    at most its throughput; weights move away from overloaded holders (as the backbone does with
    ``load_permille``). Returns served calls / all calls."""
    demand = truth * utilization * cap.sum()
    held = paint(shape.grid, rects, np.ones(len(rects))) > 0.5  # calls to experts nobody holds are lost
    w = cap / cap.max()
    load = np.zeros_like(cap)
    for _ in range(iters):
        weight = paint(shape.grid, rects, w[owner])
        pressure = np.divide(demand, weight, out=np.zeros_like(demand), where=held)
        load = w * np.bincount(owner, rect_sums(prefix_sum(pressure), rects), minlength=len(cap))
        w = w * np.clip(cap / np.maximum(load, 1e-12), 0.25, 4.0) ** 0.5
        w = np.clip(w / w.max(), 1e-9, 1.0)
    return float(np.minimum(load, cap).sum() / demand.sum())


def bound_share(policy: Policy, shape: mk.ModelShape, truth: np.ndarray, utilization: float) -> float:
    """An upper bound on the calls any placement and routing of these volunteers could serve: the
    linear program of ``swarm_sim.served_bound`` (relaxed holdings, nodes and experts bucketed)."""
    nodes = list(policy.nodes.values())
    cap = np.array([max(n.volunteer.throughput, 1e-9) for n in nodes])
    slots = np.array([mk.capacity_cells(shape, n.volunteer, mk.AssignConfig()) for n in nodes])
    return served_bound(truth * utilization * cap.sum(), cap, slots)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def decile_ratio(replicas: np.ndarray, truth: np.ndarray) -> float:
    order = np.argsort(-truth.reshape(-1), kind="stable")
    r = replicas.reshape(-1)[order].astype(np.float64)
    tenth = max(1, r.size // 10)
    return float(r[:tenth].mean() / max(r[-tenth:].mean(), 1e-9))


def ideal_replicas(truth: np.ndarray, slots: int, cap: int) -> np.ndarray:
    """Replicas proportional to demand, at least 1 and at most ``cap`` each, ``slots`` in all."""
    p = truth.reshape(-1)
    lo, hi = 0.0, float(slots) / p.min()
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.clip(np.floor(mid * p), 1, cap).sum() > slots:
            hi = mid
        else:
            lo = mid
    out: np.ndarray = np.clip(np.floor(lo * p), 1, cap).reshape(truth.shape)
    return out


def measure(policy: Policy, shape: mk.ModelShape, truth: np.ndarray, u: float, moved: int,
            coverage_after_leave: float) -> dict[str, float]:
    r = policy.supply.replicas
    ideal = ideal_replicas(truth, int(r.sum()), len(policy.nodes))
    return {"coverage": policy.supply.coverage(), "coverage_after_leave": coverage_after_leave,
            "calls_with_replica": float(truth[r > 0].sum()), "served": served_share(policy, shape, truth, u),
            "spearman": spearman(r.reshape(-1), truth.reshape(-1)), "decile_ratio": decile_ratio(r, truth),
            "ideal_decile_ratio": decile_ratio(ideal, truth), "moves": moved / max(1, len(policy.nodes)),
            "nodes": len(policy.nodes)}


# ---------------------------------------------------------------- the run


def run_scenario(label: str, ratio: float | None, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(args.seed)
    shape = mk.ModelShape("minimax/m3", tuple(range(3, 60)), 128, int(args.expert_mb * 1e6))
    truth = zipf_demand(rng, shape, args.zipf)
    natural = make_volunteers(np.random.default_rng(args.seed + 1), args.volunteers, 1.0)
    scale = 1.0 if ratio is None else ratio * shape.total_bytes / sum(v.memory_bytes for v in natural)
    population = make_volunteers(np.random.default_rng(args.seed + 1), args.volunteers, scale)
    capacity = sum(v.memory_bytes for v in population) / shape.total_bytes
    cfg = mk.AssignConfig(max_blocks=args.max_blocks)
    rcfg = mk.RebalanceConfig(hysteresis=args.hysteresis, cooldown_epochs=args.cooldown)
    backbones = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(6)]
    policies = [Policy("market", mk.Supply.empty(shape)), Policy("petals", mk.Supply.empty(shape))]
    now_ms = 1_700_000_000_000
    merged = merged_demand(rng, shape, truth, backbones, now_ms)
    prices: mk.PriceTable | None = None
    print(f"\n## {label}: {args.volunteers} volunteers, capacity {capacity:.2f}x the model "
          f"({shape.total_bytes / 1e9:.0f} GB), Zipf {args.zipf}, utilization {args.utilization}")
    print(f"demand merge: {len(merged.accepted)} reports used, dropped {merged.rejected}")
    next_id = 0
    for v in population:
        for pol in policies:
            add_node(pol, next_id, v, place(pol, shape, merged.demand, v, cfg))
        next_id += 1
    header = (f"{'epoch':>5} {'policy':>7} {'cov-left':>8} {'coverage':>8} {'calls':>7} {'served':>7} {'bound':>7} "
              f"{'spearman':>8} {'hot/cold':>8} {'ideal':>6} {'moves':>6} {'price hot/cold':>14}")
    print(header)
    for epoch in range(args.epochs + 1):
        now_ms += 3_600_000
        merged = merged_demand(rng, shape, truth, backbones, now_ms)
        leaving: list[int] = []
        joining: list[mk.Volunteer] = []
        if epoch > 0:
            ids = sorted(policies[0].nodes)
            leaving = list(rng.choice(ids, size=int(args.churn * len(ids)), replace=False))
            joining = make_volunteers(rng, len(leaving), scale)
        for pol in policies:
            for nid in leaving:
                remove_node(pol, nid)
        left_cov = [pol.supply.coverage() for pol in policies]
        for i, v in enumerate(joining):
            for pol in policies:
                add_node(pol, next_id + i, v, place(pol, shape, merged.demand, v, cfg))
        next_id += len(joining)
        evaluate = [nid for nid in sorted(policies[0].nodes) if rng.random() < args.eval_share] if epoch else []
        optimal = bound_share(policies[0], shape, truth, args.utilization)
        for pol, cov in zip(policies, left_cov):
            moved = 0
            for nid in evaluate:
                node = pol.nodes[nid]
                new = reconsider(pol, shape, merged.demand, node, epoch, cfg, rcfg)
                if new is not None:
                    remove_node(pol, nid)
                    add_node(pol, nid, node.volunteer, new, epoch)
                    moved += 1
            row = measure(pol, shape, truth, args.utilization, moved, cov)
            row["optimal"] = optimal
            if pol.name == "market":
                prices = mk.compute_prices(shape, merged.demand, pol.supply, epoch=epoch, previous=prices)
                m = prices.multipliers.astype(np.float64).reshape(-1)[np.argsort(-truth.reshape(-1))]
                tenth = m.size // 10
                row["price_hot"], row["price_cold"] = float(m[:tenth].mean()), float(m[-tenth:].mean())
            pol.rows.append(row)
            price = f"{row['price_hot']:.2f}/{row['price_cold']:.2f}" if "price_hot" in row else ""
            print(f"{epoch:>5} {pol.name:>7} {row['coverage_after_leave']:>8.2%} {row['coverage']:>8.2%} "
                  f"{row['calls_with_replica']:>7.2%} {row['served']:>7.2%} {row['optimal']:>7.2%} {row['spearman']:>8.3f} "
                  f"{row['decile_ratio']:>8.2f} {row['ideal_decile_ratio']:>6.1f} {row['moves']:>6.2%} {price:>14}")
    steady = slice(args.warmup, None)
    out = {}
    for pol in policies:
        rows = pol.rows[steady]
        out[pol.name] = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        out[pol.name]["coverage_min"] = min(r["coverage"] for r in rows)
        out[pol.name]["moves_max"] = max(r["moves"] for r in rows)
    out["capacity"] = {"ratio": capacity}
    return out


def table(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> str:
    bound = min(1.0, 1.0 / args.utilization)
    lines = [f"| capacity | policy | coverage: mean (min) | coverage right after 10% leave | calls finding a replica "
             f"| calls served, u={args.utilization} | served / capacity ({bound:.0%}) | served / LP upper bound "
             f"(bound) | replicas hottest/coldest decile (ideal) | nodes moving per epoch: mean (max) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results.values():
        for name in ("market", "petals"):
            r = res[name]
            lines.append(
                f"| {res['capacity']['ratio']:.1f}x | {name} | {r['coverage']:.2%} ({r['coverage_min']:.2%}) "
                f"| {r['coverage_after_leave']:.2%} | {r['calls_with_replica']:.2%} | {r['served']:.1%} "
                f"| {r['served'] / bound:.0%} | {r['served'] / r['optimal']:.0%} ({r['optimal']:.1%}) "
                f"| {r['decile_ratio']:.2f} ({r['ideal_decile_ratio']:.1f}) | {r['moves']:.2%} ({r['moves_max']:.2%}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--volunteers", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="epochs left out of the steady-state averages")
    ap.add_argument("--churn", type=float, default=0.10, help="share of nodes leaving (and joining) per epoch")
    ap.add_argument("--eval-share", type=float, default=0.5, help="share of nodes re-evaluating per epoch")
    ap.add_argument("--expert-mb", type=float, default=28.0)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--utilization", type=float, default=0.7)
    ap.add_argument("--ratios", default="1.5,3,10", help="total capacity / model size, comma-separated; "
                    "'natural' keeps the volunteers' own memory (about 40x at 28 MB per expert)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-blocks", type=int, default=1, help="blocks per market node (1: one node process)")
    ap.add_argument("--hysteresis", type=float, default=mk.RebalanceConfig().hysteresis)
    ap.add_argument("--cooldown", type=int, default=mk.RebalanceConfig().cooldown_epochs)
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = {}
    for item in args.ratios.split(","):
        ratio = None if item == "natural" else float(item)
        label = "natural mix" if ratio is None else f"{ratio:g}x"
        results[label] = run_scenario(label, ratio, args)
    print(f"\nsteady state: epochs {args.warmup}..{args.epochs}, {args.volunteers} volunteers, "
          f"{args.churn:.0%} churn per epoch, Zipf {args.zipf}, {args.expert_mb:g} MB experts "
          f"({time.perf_counter() - t0:.0f} s)\n")
    print(table(results, args))


if __name__ == "__main__":
    main()
