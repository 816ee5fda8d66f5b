"""Replicas near the backbones that call them (issue 30 point 3): regions are the clusters short
round trips connect; a hub's first fast copy counts in its region, so a region whose hot experts
are held only across an ocean gets them from its own hubs; coverage still comes first."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from test_market_shells import IDS, MemoryDHT, _announce, _report

from moeswarm.market import (
    AssignConfig,
    Demand,
    ModelShape,
    Rect,
    Supply,
    Volunteer,
    assign,
    check_plan,
    fetch_state,
    market_assignment,
    publish_demand,
    rebalance,
    round_trip_regions,
)

GRID = ModelShape("org/m", (0, 1, 2, 3), 16, 1_000_000)  # 4 layers x 16 experts


def test_regions_are_the_clusters_short_round_trips_connect() -> None:
    inf = float("inf")
    ms = 1e-3
    rtt = np.array([[0, 1 * ms, 120 * ms, inf, 90 * ms],
                    [1 * ms, 0, 130 * ms, 2 * ms, inf],
                    [120 * ms, 130 * ms, 0, inf, 1 * ms],
                    [inf, inf, inf, 0, inf],  # measured only by peer 1 (one direction counts)
                    [90 * ms, inf, 1 * ms, inf, 0]])
    assert round_trip_regions(rtt).tolist() == [0, 0, 1, 0, 1]
    assert round_trip_regions(rtt, max_rtt_s=0.1).tolist() == [0, 0, 0, 0, 0]  # 90 ms links them


def _demand() -> Demand:
    counts = np.ones(GRID.grid)
    counts[2, 5] = 400.0  # the hottest expert
    counts[1, 9] = 200.0
    return Demand.from_counts(counts)


def _far_hubs() -> Supply:
    """Region A: two hubs holding every expert (fast copies of all); nothing in region B."""
    whole = [Rect(0, 3, 0, 15)]
    return Supply.empty(GRID).changed(whole, 1e5, +1).changed(whole, 1e5, +1)


HUB = Volunteer(8 * 1_000_000, 1e5, "hub")  # 8 experts


def test_a_hub_takes_the_first_fast_copy_of_hot_experts_in_its_own_region() -> None:
    supply, demand = _far_hubs(), _demand()
    alone = assign(GRID, supply, demand, HUB)  # the world's copies seen as its own: every expert fast-held
    near = assign(GRID, supply, demand, HUB, near=Supply.empty(GRID))  # its region holds nothing
    cells = {(L, e) for b in near.blocks for L in range(b.layers[0], b.layers[1] + 1)
             for e in range(b.experts[0], b.experts[1] + 1)}
    assert (2, 5) in cells  # the hottest expert's first copy in region B
    assert near.score[1] > 0 and alone.score[1] == 0  # level 2 (first fast copy) counts only near
    # once region B's hubs hold it, a second region-B hub does not take it for the same reason
    mine = [r for r in (GRID.rect(b) for b in near.blocks) if r is not None]
    region_b = Supply.empty(GRID).changed(mine, 1e5, +1)
    again = assign(GRID, supply.changed(mine, 1e5, +1), demand, HUB, near=region_b)
    assert again.score[1] < near.score[1]


def test_coverage_comes_before_a_copy_near() -> None:
    supply, demand = _far_hubs(), _demand()
    supply = supply.changed([Rect(0, 3, 0, 15)], 1e5, -1).changed([Rect(0, 3, 0, 15)], 1e5, -1)
    supply = supply.changed([Rect(0, 3, 0, 14)], 1e5, +1)  # expert 15 of every layer: nobody holds it
    got = assign(GRID, supply, demand, HUB, near=Supply.empty(GRID))
    held = [GRID.rect(b) for b in got.blocks]
    assert all(r is not None and r.e0 <= 15 <= r.e1 for r in held)  # its block covers the uncovered column
    assert got.score[0] > 0


def test_rebalance_moves_a_hub_to_its_regions_hot_experts_by_a_safe_plan() -> None:
    supply, demand = _far_hubs(), _demand()
    cold = [Rect(3, 3, 8, 15)]  # a region-B hub holding cold experts the region-A hubs also hold
    supply = supply.changed(cold, 1e5, +1)
    near = Supply.empty(GRID).changed(cold, 1e5, +1)  # region B: only this hub
    plan = rebalance(GRID, supply, demand, HUB, [GRID.block(cold[0])], near=near)
    assert plan is not None
    cells = {(L, e) for b in plan.target for L in range(b.layers[0], b.layers[1] + 1)
             for e in range(b.experts[0], b.experts[1] + 1)}
    assert (2, 5) in cells
    others = supply.changed(cold, 1e5, -1)
    assert check_plan(GRID, others.replicas, plan, 8) == []  # never uncovers an expert, within memory


def test_the_market_path_reads_round_trips_into_the_near_supply() -> None:
    """``market_assignment`` over a DHT (the shell a node's ``--experts auto`` runs): two holders
    of everything, measured 120 ms away, and demand reports; the volunteer's round trips make
    the region empty, so its block takes the hottest expert's first copy there."""
    shape = ModelShape("org/m", (1, 2, 3), 4, 1_000_000)
    counts = np.ones((3, 4))
    counts[1, 2] = 500.0

    now = int(time.time() * 1000)  # market_assignment reads the DHT at the clock's time

    async def main():  # type: ignore[no-untyped-def]
        dht = MemoryDHT()
        for ident in IDS[:2]:
            await _announce(dht, ident, (1, 3), (0, 3), expires_at_ms=now + 600_000)
        for ident in IDS[5:8]:
            dht.me = ident.peer_id_str
            await publish_demand(dht, _report(ident, counts, time_ms=now))
        far = {IDS[0].peer_id: 0.12, IDS[1].peer_id: 0.12}
        state = await fetch_state(dht, shape, now_ms=now, round_trips=far)
        near_state = await fetch_state(dht, shape, now_ms=now, round_trips={IDS[0].peer_id: 0.001})
        volunteer = Volunteer(2 * 1_000_000, 1e4, "hub")
        blocks = await market_assignment(dht, shape, volunteer, round_trips=far, config=AssignConfig())
        return state, near_state, blocks

    state, near_state, blocks = asyncio.run(main())
    assert state.supply.holders == 2 and state.near is not None and state.near.holders == 0
    assert near_state.near is not None and near_state.near.holders == 1
    assert any(b.layers[0] <= 2 <= b.layers[1] and b.experts[0] <= 2 <= b.experts[1] for b in blocks)


def test_a_hub_on_whole_layers_its_region_holds_twice_moves_to_the_layers_it_lacks() -> None:
    """Region B's two hubs both hold layers 2-3, none holds 0-1 (region A's hubs hold everything
    twice): a backbone in B pays an ocean's round trip on layers 0-1 every token. Re-evaluating,
    one of them moves to 0-1 by a safe plan, and then stays; a hub whose layers no other hub of
    its region serves does not swap them for others, nor does a hub blind to regions. Before the
    rule a hub on whole layers always stayed: this printed ``assert None is not None``."""
    demand = _demand()
    hub = Volunteer(32 * 1_000_000, 1e5, "hub")  # two whole layers
    back = [Rect(2, 3, 0, 15)]
    supply = _far_hubs().changed(back, 1e5, +1).changed(back, 1e5, +1)  # region A x2, region B's two hubs
    near = Supply.empty(GRID).changed(back, 1e5, +1).changed(back, 1e5, +1)
    plan = rebalance(GRID, supply, demand, hub, [GRID.block(back[0])], near=near)
    assert plan is not None
    assert [GRID.rect(b) for b in plan.target] == [Rect(0, 1, 0, 15)]
    others = supply.changed(back, 1e5, -1)
    assert check_plan(GRID, others.replicas, plan, 32) == []
    front = [Rect(0, 1, 0, 15)]  # after the move: it stays
    assert rebalance(GRID, others.changed(front, 1e5, +1), demand, hub, [GRID.block(front[0])],
                     near=near.changed(back, 1e5, -1).changed(front, 1e5, +1)) is None
    alone = Supply.empty(GRID).changed(back, 1e5, +1)  # its layers bare without it: no sideways swap
    assert rebalance(GRID, _far_hubs().changed(back, 1e5, +1), demand, hub, [GRID.block(back[0])], near=alone) is None
    assert rebalance(GRID, supply, demand, hub, [GRID.block(back[0])]) is None  # blind: the world serves 0-1
