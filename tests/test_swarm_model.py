"""The simulation's calls-served model (``benchmarks/_swarm_model.routed``) against a linear
program solved by scipy: the most calls any routing of this placement serves."""

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
