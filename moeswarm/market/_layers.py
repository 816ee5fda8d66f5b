"""Whole layers for a hub that can hold one: where its serving rate reaches the hot experts.

Every layer's most demanded experts are different ones (a fresh ranking per layer), so a block
of a few experts over many layers holds about as much demand per expert as any other: a hub's
rectangle of 500 experts cut from the grid catches the hot experts of its layers only by chance,
and a hot expert whose layers' hubs hold other columns keeps calls no holder has time for. A
hub holding whole layers serves whichever expert of its layers is called (the routing sends a
call to any holder with headroom), so once memory allows whole layers the constraint is per
layer, and a layer's serving rate should follow the layer's share of calls. That is Petals'
rule, on demand: a hub of ``n`` layers' memory takes the ``n`` consecutive layers whose serving
rate per call is lowest (compared weakest first, as Petals' ``choose_best_blocks`` compares
spans). With memory to spare the market's rectangles served 86.4% of calls where Petals' rule
served 99.6% (``benchmarks/market_sim.py``, 10x capacity); hubs on whole layers fix that.
"""

from __future__ import annotations

import numpy as np

from ._demand import Demand
from ._grid import ModelShape, Rect
from ._supply import Supply


def layer_rates(supply: Supply, demand: Demand) -> np.ndarray:
    """``(L,)``: each layer's serving rate (its holders' throughput, spread over what each holds)
    per share of calls; infinite for a layer nobody calls."""
    calls = demand.share.sum(axis=1)
    rate = supply.throughput.sum(axis=1)
    out: np.ndarray = np.where(calls > 0, rate / np.where(calls > 0, calls, 1.0), np.inf)
    return out


def whole_layers(shape: ModelShape, supply: Supply, demand: Demand, capacity: int) -> Rect | None:
    """The consecutive whole layers a hub of ``capacity`` experts should hold: as many as fit, the
    span whose layers' rates per call (``layer_rates``), sorted weakest first, are lowest; ``None``
    when it cannot hold one whole layer."""
    layers, experts = shape.grid
    n = min(capacity // experts, layers)
    if n < 1:
        return None
    rates = layer_rates(supply, demand)
    start = min(range(layers - n + 1), key=lambda s: (tuple(np.sort(rates[s : s + n])), s))
    return Rect(start, start + n - 1, 0, experts - 1)


def is_whole_layers(shape: ModelShape, rects: list[Rect], capacity: int) -> bool:
    """Whether ``rects`` are whole layers, as many as ``capacity`` holds."""
    layers, experts = shape.grid
    n = min(capacity // experts, layers)
    return n >= 1 and all(r.e0 == 0 and r.e1 == experts - 1 for r in rects) \
        and sum(r.r1 - r.r0 + 1 for r in rects) == n


def bare_layers(supply: Supply, layer_rate: float, share: float) -> np.ndarray:
    """``(L,)``: the layers whose holders in ``supply`` serve at under ``share`` of ``layer_rate``
    pairs/s in all (a hub's rate per layer it holds): no fast holder there. Over a region's supply
    (``_near.py``), the layers whose calls a backbone of the region sends across an ocean."""
    out: np.ndarray = supply.throughput.sum(axis=1) < share * layer_rate
    return out
