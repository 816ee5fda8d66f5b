"""Simulate the scarcity market on the seed's model shape, next to Petals' block selection.

Model: 57 MoE layers x 128 experts (MiniMax M3), one expert = ``--expert-mb`` MB (28 MB:
4-bit weights of a 6144 x 3072 SwiGLU expert). Demand: Zipf(``--zipf``) over the 128 experts
of each layer, a fresh random ranking per layer, every layer equally busy (each token visits
every layer). Volunteers: 1,000 heterogeneous machines (datacenter GPUs and workstations are
hubs; laptops and phones are edge devices); each epoch 10% leave and as many new ones join.

All policies see the same volunteers, the same departures and the same joiners. An epoch is
``--epoch-s`` seconds (3600: demand reports are an hour apart, 10% of volunteers leave per hour).

* ``market``: ``moeswarm.market.assign`` for joiners, ``rebalance`` (hysteresis, cooldown,
  safe move plans) for a random half of the nodes each epoch, demand merged from signed
  reports of 5 honest backbones plus 1 lying one.
* ``petals``: Petals' own ``block_selection`` (``_petals_blocks.py``, ported from
  bigscience-workshop/petals@22afba6 with its parameters): a joiner takes the span of
  consecutive blocks whose weakest block (then next weakest...) has the least throughput; every
  server checks every ``random() * 240`` s (mean 120 s, about 30 checks per epoch) whether to move,
  simulating every server's moves and moving only if the weakest block's throughput would rise
  past 1/0.75 of today's (``balance_quality`` 0.75); a mover shuts down and rejoins. Petals knows
  no experts and no demand: a block is a whole MoE layer, all 128 experts together, a server holds
  as many whole layers as fit in its memory, and a volunteer that cannot hold one layer is refused
  (Petals asserts ``num_blocks >= 1``). Its announced throughput is the volunteer's calls/s.
* ``petals/32`` (an extension, not something Petals ships): the same code on a finer line, each
  layer cut into blocks of 32 adjacent experts (layer-major, so a span may end inside a layer),
  so that volunteers smaller than a layer can take part; run only up to ``--fine-up-to``
  capacity (its per-check simulation is slow with hundreds of servers).

Metrics (``--utilization`` u: the swarm's calls are u x its total throughput):

* coverage: share of experts held by someone (after departures, and after repair);
* calls finding a replica: demand-weighted coverage;
* served: share of calls served when each expert's calls go to its holders with headroom, as the
  backbone's load-aware routing does with ``load_permille`` (the best routing of the placement, a
  maximum flow: ``_swarm_model.routed``), next to min(1, 1/u) (all the volunteers' throughput) and to an upper
  bound no placement can beat (a linear program, ``_swarm_model.served_bound``);
* replicas vs demand: Spearman correlation, hottest-decile / coldest-decile mean replicas, and
  the same ratio for replicas proportional to demand (at least one each; a reference shape, not a
  bound: the LP above is the bound);
* moves: share of nodes that moved in the epoch; holding: share of volunteers holding experts.

    .venv/bin/python benchmarks/market_sim.py            # ~15 minutes on 2 loaded cores
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from moeswarm import market as mk
from moeswarm.protocol import Identity

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _petals_blocks as pb
from _swarm_model import routed, served_bound

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
    version: int = 0  # bumped by every join, departure and move
    # Petals only: spans on its line of blocks, pending checks (time s, node), last "stay" verdicts
    line: PetalsLine | None = None
    spans: dict[int, pb.Span] = field(default_factory=dict)
    checks: list[tuple[float, int]] = field(default_factory=list)
    verdicts: dict[int, tuple[int, bool]] = field(default_factory=dict)  # (version, simulation ran)
    stats: dict[str, int] = field(default_factory=lambda: {"checks": 0, "simulated": 0, "reused": 0,
                                                           "reused_simulated": 0})
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(7))


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


@dataclass(frozen=True)
class PetalsLine:
    """Petals' line of blocks laid on the grid. Petals serves a model as a chain of blocks and a server
    holds a contiguous span of them; for a MoE model a block is a whole layer, all its experts together
    (``width`` = experts per layer: Petals as shipped). With ``width`` < experts per layer the same
    rule runs on a finer line, layer-major, each layer cut into ``experts / width`` blocks of
    ``width`` adjacent experts (not something Petals ships: a span may then end inside a layer)."""

    layers: int
    experts: int
    width: int  # experts per Petals block

    @property
    def per_layer(self) -> int:
        return self.experts // self.width

    @property
    def total(self) -> int:
        return self.layers * self.per_layer

    def num_blocks(self, cells: int) -> int:
        """``_choose_num_blocks``: what fits in memory, at most the model (0: Petals refuses it)."""
        return min(cells // self.width, self.total)

    def rects(self, span: pb.Span) -> list[mk.Rect]:
        out = []
        for layer in range(span.start // self.per_layer, (span.end - 1) // self.per_layer + 1):
            lo = max(span.start, layer * self.per_layer) - layer * self.per_layer
            hi = min(span.end, (layer + 1) * self.per_layer) - layer * self.per_layer
            out.append(mk.Rect(layer, layer, lo * self.width, hi * self.width - 1))
        merged: list[mk.Rect] = []  # consecutive whole layers as one rectangle
        for r in out:
            if merged and r.e0 == 0 and r.e1 == self.experts - 1 and merged[-1][2:] == r[2:] \
                    and merged[-1].r1 == r.r0 - 1:
                merged[-1] = mk.Rect(merged[-1].r0, r.r1, r.e0, r.e1)
            else:
                merged.append(r)
        return merged


def petals_join(policy: Policy, line: PetalsLine, shape: mk.ModelShape, nid: int, v: mk.Volunteer,
                cfg: mk.AssignConfig, now_s: float, epoch: int = -99) -> None:
    """A (re)joining server: ``choose_best_blocks`` on the swarm as announced, then its first check
    after ``random() * 2 * mean_balance_check_period`` (server.py 366-370)."""
    n = line.num_blocks(mk.capacity_cells(shape, v, cfg))
    rects: list[mk.Rect] = []
    if n >= 1:
        # Petals' announced throughput is its compute per block over the average blocks a request
        # uses, (n + 1) / 2 (throughput.py lines 98-103), as a request runs through consecutive blocks; an expert
        # call here uses one block, so the announced throughput is the volunteer's calls/s.
        span = pb.Span(pb.choose_best_blocks(n, policy.spans, line.total), n, v.throughput)
        policy.spans[nid] = span
        rects = line.rects(span)
        heapq.heappush(policy.checks, (now_s + policy.rng.random() * 2 * pb.MEAN_BALANCE_CHECK_PERIOD_S, nid))
    add_node(policy, nid, v, rects, epoch)


def petals_checks(policy: Policy, line: PetalsLine, shape: mk.ModelShape, epoch: int, until_s: float,
                  cfg: mk.AssignConfig) -> int:
    """Every check due before ``until_s``, in time order; returns how many servers moved. A check
    against a swarm unchanged since this server's last "stay" reuses that verdict: exact for the two
    early exits (deterministic), an approximation when the simulated rebalancing ran (its shuffle is
    random; ``policy.stats`` counts both)."""
    moved = 0
    while policy.checks and policy.checks[0][0] < until_s:
        now, nid = heapq.heappop(policy.checks)
        if nid not in policy.spans:
            continue  # it left
        version, simulated = policy.verdicts.get(nid, (-1, False))
        if version == policy.version:
            policy.stats["reused"] += 1
            policy.stats["reused_simulated"] += simulated
        else:
            move, simulated = pb.should_choose_other_blocks(nid, policy.spans, line.total, policy.rng)
            policy.stats["checks"] += 1
            policy.stats["simulated"] += simulated
            if not move:
                policy.verdicts[nid] = (policy.version, simulated)
            else:
                old = policy.spans[nid].start
                node = policy.nodes[nid]
                remove_node(policy, nid)  # shuts down, announced offline
                now += policy.rng.random() * 2 * pb.MEAN_BLOCK_SELECTION_DELAY_S
                petals_join(policy, line, shape, nid, node.volunteer, cfg, now, epoch)
                moved += policy.spans[nid].start != old
                continue  # petals_join scheduled its next check
        heapq.heappush(policy.checks, (now + policy.rng.random() * 2 * pb.MEAN_BALANCE_CHECK_PERIOD_S, nid))
    return moved


# ---------------------------------------------------------------- the market's decisions


def place(policy: Policy, shape: mk.ModelShape, demand: mk.Demand, v: mk.Volunteer,
          cfg: mk.AssignConfig) -> list[mk.Rect]:
    a = mk.assign(shape, policy.supply, demand, v, cfg)
    return [r for r in (shape.rect(b) for b in a.blocks) if r is not None]


def reconsider(policy: Policy, shape: mk.ModelShape, demand: mk.Demand, node: Node, epoch: int,
               cfg: mk.AssignConfig, rcfg: mk.RebalanceConfig) -> list[mk.Rect] | None:
    """The node's new rects if it moves (its plan was checked safe), else ``None``."""
    v, blocks = node.volunteer, [shape.block(r) for r in node.rects]
    plan = mk.rebalance(shape, policy.supply, demand, v, blocks, assign_config=cfg, config=rcfg,
                        epochs_since_move=epoch - node.moved_at)
    if plan is None:
        return None
    problems = mk.check_plan(shape, policy.supply.changed(node.rects, v.throughput, -1).replicas, plan,
                             mk.capacity_cells(shape, v, cfg))
    if problems:
        raise RuntimeError(f"unsafe move plan: {problems}")
    return [r for r in (shape.rect(b) for b in plan.target) if r is not None]


def add_node(policy: Policy, nid: int, v: mk.Volunteer, rects: list[mk.Rect], epoch: int = -99) -> None:
    policy.nodes[nid] = Node(v, rects, epoch)
    policy.version += 1
    if rects:
        policy.supply = policy.supply.changed(rects, v.throughput, +1)


def remove_node(policy: Policy, nid: int) -> None:
    node = policy.nodes.pop(nid)
    policy.spans.pop(nid, None)
    policy.version += 1
    if node.rects:
        policy.supply = policy.supply.changed(node.rects, node.volunteer.throughput, -1)


# ---------------------------------------------------------------- metrics


def served_share(policy: Policy, shape: mk.ModelShape, truth: np.ndarray, utilization: float) -> float:
    """Share of calls served with the best routing of this placement (see the module docstring)."""
    nodes = [n for n in policy.nodes.values() if n.rects]
    if not nodes:
        return 0.0
    rects = np.array([r for n in nodes for r in n.rects], dtype=np.int64)
    owner = np.array([i for i, n in enumerate(nodes) for _ in n.rects])
    cap = np.array([max(n.volunteer.throughput, 1e-9) for n in nodes])
    return routed_share(shape, truth, utilization, rects, owner, cap)


def routed_share(shape: mk.ModelShape, truth: np.ndarray, utilization: float, rects: np.ndarray,
                 owner: np.ndarray, cap: np.ndarray) -> float:
    """Served calls / all calls when the volunteers get ``utilization`` of what they could serve,
    spread over the experts as ``truth`` (``_swarm_model.routed``: the best routing of the placement)."""
    return routed(shape, truth * utilization * cap.sum(), rects, owner, cap)[0]


def bound_share(policy: Policy, shape: mk.ModelShape, truth: np.ndarray, utilization: float) -> float:
    """An upper bound on the calls any placement and routing of these volunteers could serve: the
    linear program of ``swarm_sim.served_bound`` (relaxed holdings, nodes and experts bucketed)."""
    nodes = list(policy.nodes.values())
    cap = np.array([max(n.volunteer.throughput, 1e-9) for n in nodes])
    slots = np.array([mk.capacity_cells(shape, n.volunteer, mk.AssignConfig()) for n in nodes])
    return served_bound(truth * utilization * cap.sum(), cap, slots)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    if a.min() == a.max():
        return 0.0
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
            "nodes": len(policy.nodes), "holding": sum(bool(n.rects) for n in policy.nodes.values()) / len(policy.nodes)}


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
    policies = [Policy("market", mk.Supply.empty(shape))]
    for width in args.petals_widths:
        if width != shape.num_experts and (ratio is None or ratio > args.fine_up_to):
            continue  # the finer line's checks cost minutes per epoch with hundreds of servers holding blocks
        line = PetalsLine(shape.num_layers, shape.num_experts, width)
        name = "petals" if width == shape.num_experts else f"petals/{width}"
        policies.append(Policy(name, mk.Supply.empty(shape), line=line, rng=np.random.default_rng(args.seed + 7)))
    now_ms = 1_700_000_000_000
    merged = merged_demand(rng, shape, truth, backbones, now_ms)
    prices: mk.PriceTable | None = None
    print(f"\n## {label}: {args.volunteers} volunteers, capacity {capacity:.2f}x the model "
          f"({shape.total_bytes / 1e9:.0f} GB), Zipf {args.zipf}, utilization {args.utilization}")
    print(f"demand merge: {len(merged.accepted)} reports used, dropped {merged.rejected}")
    next_id = 0
    for v in population:  # all join at time 0, one after the other
        for pol in policies:
            if pol.line is None:
                add_node(pol, next_id, v, place(pol, shape, merged.demand, v, cfg))
            else:
                petals_join(pol, pol.line, shape, next_id, v, cfg, 0.0)
        next_id += 1
    for pol in policies[1:]:
        refused = sum(not n.rects for n in pol.nodes.values())
        print(f"{pol.name}: blocks of {pol.line.width} experts, {pol.line.total} blocks; {refused} of "
              f"{len(pol.nodes)} volunteers cannot hold one block (Petals refuses them)")
    header = (f"{'epoch':>5} {'policy':>9} {'cov-left':>8} {'coverage':>8} {'calls':>7} {'served':>7} {'bound':>7} "
              f"{'spearman':>8} {'hot/cold':>8} {'prop.':>6} {'moves':>6} {'holding':>8} {'price hot/cold':>14} "
              f"{'decide':>7}")
    print(header)
    for epoch in range(args.epochs + 1):
        now_ms += int(args.epoch_s * 1000)
        epoch_start, epoch_end = epoch * args.epoch_s, (epoch + 1) * args.epoch_s
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
                if pol.line is None:
                    add_node(pol, next_id + i, v, place(pol, shape, merged.demand, v, cfg))
                else:
                    petals_join(pol, pol.line, shape, next_id + i, v, cfg, epoch_start, epoch)
        next_id += len(joining)
        evaluate = [nid for nid in sorted(policies[0].nodes) if rng.random() < args.eval_share] if epoch else []
        optimal = bound_share(policies[0], shape, truth, args.utilization)
        for pol, cov in zip(policies, left_cov):
            moved = 0
            t0 = time.perf_counter()
            for nid in evaluate if pol.line is None else ():
                node = pol.nodes[nid]
                new = reconsider(pol, shape, merged.demand, node, epoch, cfg, rcfg)
                if new is not None:
                    remove_node(pol, nid)
                    add_node(pol, nid, node.volunteer, new, epoch)
                    moved += 1
            if pol.line is not None:
                moved = petals_checks(pol, pol.line, shape, epoch, epoch_end, cfg)
            decide_s = time.perf_counter() - t0
            row = measure(pol, shape, truth, args.utilization, moved, cov)
            row["optimal"] = optimal
            if pol.name == "market":
                prices = mk.compute_prices(shape, merged.demand, pol.supply, epoch=epoch, previous=prices)
                m = prices.multipliers.astype(np.float64).reshape(-1)[np.argsort(-truth.reshape(-1))]
                tenth = m.size // 10
                row["price_hot"], row["price_cold"] = float(m[:tenth].mean()), float(m[-tenth:].mean())
            pol.rows.append(row)
            price = f"{row['price_hot']:.2f}/{row['price_cold']:.2f}" if "price_hot" in row else ""
            print(f"{epoch:>5} {pol.name:>9} {row['coverage_after_leave']:>8.2%} {row['coverage']:>8.2%} "
                  f"{row['calls_with_replica']:>7.2%} {row['served']:>7.2%} {row['optimal']:>7.2%} {row['spearman']:>8.3f} "
                  f"{row['decile_ratio']:>8.2f} {row['ideal_decile_ratio']:>6.1f} {row['moves']:>6.2%} "
                  f"{row['holding']:>8.1%} {price:>14} {decide_s:>6.1f}s", flush=True)
    steady = slice(args.warmup, None)
    out = {}
    for pol in policies:
        rows = pol.rows[steady]
        out[pol.name] = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        out[pol.name]["coverage_min"] = min(r["coverage"] for r in rows)
        out[pol.name]["moves_max"] = max(r["moves"] for r in rows)
    for pol in policies[1:]:
        out[pol.name]["width"] = pol.line.width
        print(f"{pol.name}: {pol.stats['checks']} checks run ({pol.stats['simulated']} simulated the whole swarm's "
              f"moves), {pol.stats['reused']} reused a verdict on an unchanged swarm ({pol.stats['reused_simulated']} "
              f"of them a simulated one)")
    out["capacity"] = {"ratio": capacity}
    return out


def table(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> str:
    bound = min(1.0, 1.0 / args.utilization)
    lines = [(f"| capacity | policy | coverage: mean (min) | coverage right after 10% leave | calls finding a replica "
             f"| calls served, u={args.utilization} | served / capacity ({bound:.0%}) | served / LP upper bound "
             f"(bound) | replicas hottest/coldest decile (proportional to demand) | nodes moving per epoch: mean (max) "
             f"| volunteers holding experts |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results.values():
        for name in [k for k in res if k != "capacity"]:
            r = res[name]
            lines.append(
                f"| {res['capacity']['ratio']:.1f}x | {name} | {r['coverage']:.2%} ({r['coverage_min']:.2%}) "
                f"| {r['coverage_after_leave']:.2%} | {r['calls_with_replica']:.2%} | {r['served']:.1%} "
                f"| {r['served'] / bound:.0%} | {r['served'] / r['optimal']:.0%} ({r['optimal']:.1%}) "
                f"| {r['decile_ratio']:.2f} ({r['ideal_decile_ratio']:.1f}) | {r['moves']:.2%} ({r['moves_max']:.2%}) "
                f"| {r['holding']:.0%} |")
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
    ap.add_argument("--epoch-s", type=float, default=3600.0, help="seconds per epoch (demand time, churn, "
                    "and the window of Petals' balance checks)")
    ap.add_argument("--petals-widths", default="128,32", help="experts per Petals block, comma-separated: 128 = "
                    "a whole layer (Petals as shipped), less = Petals' rule on a finer line (an extension)")
    ap.add_argument("--fine-up-to", type=float, default=3.0, help="run the finer Petals lines only at capacities "
                    "up to this (at 10x the simulated rebalancing of each check, over ~500 servers, takes "
                    "minutes per epoch on 2 cores)")
    ap.add_argument("--hysteresis", type=float, default=mk.RebalanceConfig().hysteresis)
    ap.add_argument("--cooldown", type=int, default=mk.RebalanceConfig().cooldown_epochs)
    args = ap.parse_args()
    args.petals_widths = [int(w) for w in args.petals_widths.split(",") if w]
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
