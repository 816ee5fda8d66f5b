"""Target replica counts: how many holders each expert should have so replicas follow demand.

With ``S`` expert slots in the swarm (the experts all volunteers can hold, summed) and a weight
``w_e = demand share x cost per call`` for every expert, the target is

    t_e = clip(c * w_e, floor, cap)      with c chosen so that sum_e t_e = S

rounded to integers by largest remainder. Serving time is what a replica contributes, so an
expert wanted ``w_e`` needs replicas in proportion to ``w_e``; ``floor`` (1) keeps every expert
covered first. In one model every routed expert costs the same FLOPs per call, so ``cost`` only
matters when the grid mixes experts of different sizes; it is a parameter so the policy says
what it optimises.

This is also the yardstick ``benchmarks/swarm_sim.py`` measures placements against ("ideal").
"""

from __future__ import annotations

import math

import numpy as np

from moeswarm.errors import ConfigError


def target_replicas(weight: np.ndarray, slots: int, *, floor: int = 1, cap: int | None = None,
                    cost: np.ndarray | None = None) -> np.ndarray:
    """Integer replicas per cell, ``weight.shape``, proportional to ``weight * cost``, each in
    ``[floor, cap]``, summing to ``slots`` when that is reachable (``floor * n <= slots`` and
    cells of zero weight kept at ``floor``, the others at most ``cap``; with fewer slots every
    cell gets ``floor``). ``weight`` is non-negative, not all zero."""
    w = np.asarray(weight, dtype=np.float64)
    if cost is not None:
        w = w * np.asarray(cost, dtype=np.float64)
    if w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ConfigError("target_replicas needs finite non-negative weights, not all zero")
    if floor < 0 or (cap is not None and cap < floor):
        raise ConfigError("need 0 <= floor <= cap")
    n = w.size
    hi_cap = float(cap) if cap is not None else float(max(slots, floor))
    if slots <= floor * n:
        return np.full(w.shape, floor, dtype=np.int64)
    if slots >= hi_cap * n:
        return np.full(w.shape, int(hi_cap), dtype=np.int64)
    flat = w.reshape(-1)
    pos = flat > 0
    log_w = np.full(n, -np.inf)
    log_w[pos] = np.log(flat[pos]) - math.log(float(flat.max()))  # relative to the largest, in logs:
    # weights may span hundreds of decades, down to subnormal ones a division would flush to zero

    wide = float(log_w[pos].min()) < -500.0  # else c * w in plain floats (faster): e^(500 + log slots) is finite
    rel = np.exp(log_w)

    def scaled(log_c: float) -> np.ndarray:
        if wide:
            out: np.ndarray = np.clip(np.exp(np.minimum(log_c + log_w, 700.0)), floor, hi_cap)  # e^700 > any cap
        else:
            out = np.clip(math.exp(log_c) * rel, floor, hi_cap)
        return out

    # sum of clip(c * w) is monotone in c: bisect log(c)
    lo = math.log(max(slots, 1) / float(rel.sum())) - 1.0  # c * sum(w) < slots: below the answer
    hi = math.log(float(slots) + 1.0) - float(log_w[pos].min())  # every w > 0 at >= slots
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if scaled(mid).sum() > slots:
            hi = mid
        else:
            lo = mid
    real = scaled(lo)
    out = np.floor(real).astype(np.int64)
    short = int(slots - out.sum())
    if short > 0:  # largest remainders first; ties to the heavier cell (by the weights themselves:
        # two weights a rounding apart have the same log), then the lower index
        room = (out < hi_cap) & pos
        frac = np.where(room, real - out, -1.0)
        order = np.lexsort((-flat, -frac))[: min(short, int(room.sum()))]
        out[order] += 1
    return out.reshape(w.shape)
