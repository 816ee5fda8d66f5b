"""The simulation's calls-served models against independent answers: ``routed`` (the best
routing of a placement, a maximum flow) against a linear program solved by scipy; ``dispatched``
(the backbone's routing rule) against cases worked by hand from ``plan_dispatch``; and the
upper bound ``served_bound`` against both on random placements."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from scipy.optimize import linprog

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _swarm_model as sm

from moeswarm.market import ModelShape


def best_routing(demand: np.ndarray, rects: np.ndarray, owner: np.ndarray, cap: np.ndarray) -> float:
    """max sum x_(cell, node) over held pairs, each cell at most its demand, each node at most its rate."""
    E = demand.shape[1]
    pairs = sorted({(r * E + e, int(n)) for (r0, r1, e0, e1), n in zip(rects.tolist(), owner)
                    for r in range(r0, r1 + 1) for e in range(e0, e1 + 1)})
    a = np.zeros((demand.size + len(cap), len(pairs)))
    for j, (c, n) in enumerate(pairs):
        a[c, j] = a[demand.size + n, j] = 1.0
    res = linprog(-np.ones(len(pairs)), A_ub=a, b_ub=np.concatenate([demand.reshape(-1), cap]), method="highs")
    assert res.status == 0
    return float(-res.fun / demand.sum())


def test_calls_served_is_the_best_routing_of_the_placement() -> None:
    rng = np.random.default_rng(7)
    shape = ModelShape("org/m", (0, 1, 2, 3), 6, 10)
    for _ in range(20):
        n = int(rng.integers(2, 9))
        rects, owner = [], []
        for node in range(n):
            for _ in range(int(rng.integers(1, 3))):
                r0, e0 = int(rng.integers(0, 4)), int(rng.integers(0, 6))
                rects.append((r0, int(rng.integers(r0, 4)), e0, int(rng.integers(e0, 6))))
                owner.append(node)
        cap = rng.uniform(0.5, 50.0, n)
        demand = rng.uniform(0.0, 10.0, shape.grid)
        served, per_node = sm.routed(shape, demand, np.array(rects), np.array(owner), cap)
        assert abs(served - best_routing(demand, np.array(rects), np.array(owner), cap)) < 1e-6
        assert np.all(per_node <= cap + 1e-6) and abs(per_node.sum() / demand.sum() - served) < 1e-6


def random_placement(rng: np.random.Generator, shape: ModelShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rects, owner, slots): 2-8 nodes of 1-2 random rectangles each; a node's slots are the cells it holds."""
    n = int(rng.integers(2, 9))
    rects, owner = [], []
    for node in range(n):
        for _ in range(int(rng.integers(1, 3))):
            r0, e0 = int(rng.integers(0, shape.grid[0])), int(rng.integers(0, shape.grid[1]))
            rects.append((r0, int(rng.integers(r0, shape.grid[0])), e0, int(rng.integers(e0, shape.grid[1]))))
            owner.append(node)
    held = np.zeros((n, *shape.grid), dtype=bool)
    for (r0, r1, e0, e1), node in zip(rects, owner):
        held[node, r0:r1 + 1, e0:e1 + 1] = True
    return np.array(rects), np.array(owner), held.reshape(n, -1).sum(axis=1)


def test_no_placement_or_routing_serves_more_than_the_bound() -> None:
    """``served_bound`` (an LP over every placement within the nodes' slots) is at least what the
    backbone's rule and the best routing serve on random placements that respect those slots;
    the rule never beats the best routing, and no holder serves past its rate."""
    rng = np.random.default_rng(11)
    shape = ModelShape("org/m", (0, 1, 2, 3), 6, 10)
    for _ in range(40):
        rects, owner, slots = random_placement(rng, shape)
        cap = rng.uniform(0.5, 50.0, len(slots))
        rtt = rng.choice([0.0005, 0.001, 0.0034, 0.05], size=len(slots))
        demand = rng.uniform(0.0, 10.0, shape.grid) * rng.uniform(0.2, 3.0)
        rule, by_node = sm.dispatched(shape, demand, rects, owner, cap, rtt)
        best, _ = sm.routed(shape, demand, rects, owner, cap)
        bound = sm.served_bound(demand, cap, slots)
        assert rule <= best + 1e-6 <= bound + 2e-6, (rule, best, bound)
        assert np.all(by_node <= cap * (1 + 1e-6)) and abs(by_node.sum() / demand.sum() - rule) < 1e-9


def test_the_rule_serves_what_plan_dispatch_and_overloaded_retries_give_by_hand() -> None:
    """Two holders, two experts of one layer, 10 calls/s each, each holder computes 10 calls/s.

    1. Hub A (0.3 ms) holds experts 0 and 1, home box B (3.4 ms) holds expert 0. ``plan_dispatch``
       sends both experts to A (lower ``Holder.score``); A gets 20 calls/s, computes 10, and
       refuses the rest at random (``OVERLOADED``): 5 of each expert. Its load doubles its score to
       0.6 ms, still below B's 3.4 ms, so the order stays; expert 0's refused 5 go to B, expert 1's
       5 have nowhere to go. Served 15 of 20: 75%, A 10 and B 5. The best routing (A takes expert
       1, B expert 0) serves all 20.
    2. The same with B a hub at 0.5 ms: once A is saturated its score (0.6 ms) is above B's, so
       expert 0 goes to B first, A keeps expert 1: all 20 served, 10 each.
    """
    shape = ModelShape("org/m", (0,), 2, 10)
    demand = np.array([[10.0, 10.0]])
    rects, owner, cap = np.array([(0, 0, 0, 1), (0, 0, 0, 0)]), np.array([0, 1]), np.array([10.0, 10.0])
    served, by_node = sm.dispatched(shape, demand, rects, owner, cap, np.array([0.0003, 0.0034]))
    assert abs(served - 0.75) < 1e-9 and np.allclose(by_node, [10.0, 5.0])
    assert abs(sm.routed(shape, demand, rects, owner, cap)[0] - 1.0) < 1e-9
    served, by_node = sm.dispatched(shape, demand, rects, owner, cap, np.array([0.0003, 0.0005]))
    assert abs(served - 1.0) < 1e-9 and np.allclose(by_node, [10.0, 10.0])
