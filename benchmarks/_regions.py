"""Regions for ``swarm_sim.py``: three clusters of volunteers, ~1 ms apart inside, 80-150 ms
between, people in every region; one person's decode through a gateway in their region.

A volunteer belongs to one region: each tier's volunteers split over them by
``swarm_sim.REGIONS``' shares (``split_by_region``). A call from a backbone in
region ``a`` to a holder in region ``b`` pays the backbone's access round trip, the holder's, and
``REGION_RTT_S[a][b]`` (0 inside a region: two hubs there are their access links apart, ~1 ms).
The market sees regions as the swarm does, from round trips: with ``near`` a volunteer's
assignment and re-evaluation get the supply of its own region (``moeswarm.market.near_supply``:
holders within ``NEAR_RTT_S``; the clusters ``round_trip_regions`` finds in ``REGION_RTT_S``).

Decode: for a backbone of a tier in region ``a``, every expert's fastest holder anywhere
(``_swarm_model.path_seconds`` over the regional round trip), each MoE layer waiting for its
slowest call (``_swarm_model.decode_rates``). A gateway is a hub-tier backbone in the person's
region: the person streams from it, one round trip to start (not per token); a home backbone
is the person's own box on seed 000's office link, as today.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import _swarm_model as sm
from moeswarm import market as mk

REGION_RTT_S = np.array([[0.0, 0.080, 0.150],  # between the three regions, seconds
                         [0.080, 0.0, 0.110],
                         [0.150, 0.110, 0.0]])


@dataclass
class RegionalSwarm:
    """Volunteers placed by the market, each in a region; ``near``: the market sees its region."""

    shape: sm.Shape
    grid: mk.ModelShape
    configs: list[mk.AssignConfig]  # per tier
    near: bool
    supply: mk.Supply
    regional: list[mk.Supply]  # per region
    nodes: dict[int, tuple[mk.Volunteer, int, int, list[mk.Rect]]] = field(default_factory=dict)  # v, tier, region, rects
    next_id: int = 0

    def join(self, v: mk.Volunteer, tier: int, region: int, demand: mk.Demand) -> None:
        a = mk.assign(self.grid, self.supply, demand, v, self.configs[tier],
                      near=self.regional[region] if self.near else None)
        rects = [r for r in (self.grid.rect(b) for b in a.blocks) if r is not None]
        self.nodes[self.next_id] = (v, tier, region, rects)
        self.next_id += 1
        self._count(v, region, rects, +1)

    def leave(self, nid: int) -> None:
        v, _, region, rects = self.nodes.pop(nid)
        self._count(v, region, rects, -1)

    def reconsider(self, nid: int, demand: mk.Demand) -> bool:
        v, tier, region, rects = self.nodes[nid]
        plan = mk.rebalance(self.grid, self.supply, demand, v, [self.grid.block(r) for r in rects],
                            assign_config=self.configs[tier], near=self.regional[region] if self.near else None)
        if plan is None:
            return False
        self._count(v, region, rects, -1)
        new = [r for r in (self.grid.rect(b) for b in plan.target) if r is not None]
        self.nodes[nid] = (v, tier, region, new)
        self._count(v, region, new, +1)
        return True

    def _count(self, v: mk.Volunteer, region: int, rects: list[mk.Rect], sign: int) -> None:
        if rects:
            self.supply = self.supply.changed(rects, v.throughput, sign)
            self.regional[region] = self.regional[region].changed(rects, v.throughput, sign)

    def held(self) -> np.ndarray:
        """``(tiers, regions, L, C)``: copies of every cell each tier holds in each region."""
        out = np.zeros((len(sm.TIERS), len(REGION_RTT_S), *self.grid.grid))
        for v, tier, region, rects in self.nodes.values():
            for r in rects:
                out[tier, region][r.slices] += 1
        return out


def split_by_region(rng: np.random.Generator, tiers: np.ndarray, shares: tuple[float, ...]) -> np.ndarray:
    """``(n,)`` the region of each volunteer: every tier's volunteers split over the regions in
    proportion to ``shares`` (largest remainders), in random order within the tier. (Drawn one
    volunteer at a time, seed 3's 333 volunteers put 1 of their 9 hubs, 70 GB, in region 0: its
    hubs held 19 of M3's 57 layers and its person's gateway paid 80-150 ms on the other 38, a draw
    the shares do not describe.)"""
    p = np.array(shares, dtype=np.float64) / sum(shares)
    out = np.empty(len(tiers), dtype=np.int64)
    for t in np.unique(tiers):
        members = np.flatnonzero(tiers == t)
        exact = p * len(members)
        counts = np.floor(exact).astype(np.int64)
        counts[np.argsort(-(exact - counts), kind="stable")[: len(members) - int(counts.sum())]] += 1
        out[rng.permutation(members)] = np.repeat(np.arange(len(p)), counts)
    return out


def build(shape_key: str, volunteers: int, ratio: float | None, *, near: bool, seed: int, epochs: int,
          shares: tuple[float, ...], zipf_s: float) -> tuple[RegionalSwarm, np.ndarray, np.random.Generator]:
    """Volunteers join in random order (every tier split over the regions by ``shares``:
    ``split_by_region``), every node re-evaluates once (the first joiners saw an empty swarm: a hub
    that joined while memory held under two copies of the model took rectangles, not whole
    layers, and with only the epochs' half re-evaluating, a quarter of the nodes never looked
    again in two epochs), then ``epochs`` of 10% churn (each leaver replaced by a joiner of its
    tier and region) and half the nodes re-evaluating; returns the swarm, the true demand and the
    generator."""
    rng = np.random.default_rng(seed)
    shape = sm.SHAPES[shape_key]
    grid = shape.market()
    truth = sm.grouped(sm.zipf_grid(rng, shape.layers, shape.experts * 1, zipf_s), shape.group)
    tiers = sm.draw_tiers(np.random.default_rng(seed + 1), volunteers)
    natural = sm.volunteers(np.random.default_rng(seed + 1), tiers, shape, 1.0)
    scale = 1.0 if ratio is None else ratio * grid.total_bytes / sum(v.memory_bytes for v in natural)
    configs = [mk.AssignConfig(max_blocks=64 if t.device_class == "hub" else 1, call_bytes=shape.call_bytes)
               for t in sm.TIERS]
    swarm = RegionalSwarm(shape, grid, configs, near, mk.Supply.empty(grid),
                          [mk.Supply.empty(grid) for _ in REGION_RTT_S])
    regions = split_by_region(rng, tiers, shares)

    def demand_now() -> mk.Demand:
        return mk.Demand.from_counts(rng.multinomial(2_000_000, truth.reshape(-1)).reshape(grid.grid).astype(float))

    def arrive(tier_ids: np.ndarray, region_ids: np.ndarray, demand: mk.Demand) -> None:
        people = sm.volunteers(rng, tier_ids, shape, scale)
        for k in rng.permutation(len(people)):
            swarm.join(people[k], int(tier_ids[k]), int(region_ids[k]), demand)

    arrive(tiers, regions, demand_now())
    demand = demand_now()
    for nid in rng.permutation(list(swarm.nodes)):  # the swarm settles: every node re-evaluates once
        swarm.reconsider(int(nid), demand)
    for _ in range(epochs):
        demand = demand_now()
        ids = list(swarm.nodes)
        leaving = rng.choice(ids, size=len(ids) // 10, replace=False)
        left = [swarm.nodes[int(i)][1:3] for i in leaving]  # (tier, region): a joiner of each takes its place
        for nid in leaving:
            swarm.leave(int(nid))
        arrive(np.array([t for t, _ in left], dtype=np.int64), np.array([g for _, g in left], dtype=np.int64), demand)
        for nid in [i for i in list(swarm.nodes) if rng.random() < 0.5]:
            swarm.reconsider(nid, demand)
    return swarm, truth, rng


def decode_tok_s(swarm: RegionalSwarm, truth: np.ndarray, rng: np.random.Generator, backbone_tier: int,
                 region: int, batch: int = 1) -> float:
    """Tokens/s of one stream (``batch`` 1) for a backbone of ``backbone_tier`` in ``region``."""
    held = swarm.held() > 0.5
    bt = sm.TIERS[backbone_tier]
    tokens = max(1, batch * swarm.shape.top_k // swarm.shape.experts)
    cell = np.full(swarm.grid.grid, np.inf)
    for t, ht in enumerate(sm.TIERS):
        for g in range(len(REGION_RTT_S)):
            secs = sm.path_seconds(bt, ht, float(np.mean(ht.rtt_s)) + float(REGION_RTT_S[region, g]), tokens,
                                   swarm.shape)
            cell = np.where(held[t, g], np.minimum(cell, secs), cell)
    best = np.where(np.isfinite(cell), cell, 0.0)  # nobody holds it: left out (coverage is reported apart)
    return sm.decode_rates(rng, swarm.shape, truth, [best], (batch,))[0]


def in_region_calls(swarm: RegionalSwarm, truth: np.ndarray) -> list[float]:
    """Per region: the share of calls whose expert a hub of that region holds."""
    hubs = swarm.held()[0] > 0.5  # (regions, L, C)
    return [float(truth[hubs[g]].sum()) for g in range(len(REGION_RTT_S))]
