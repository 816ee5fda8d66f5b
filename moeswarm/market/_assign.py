"""Assignment: which experts a joining volunteer should hold, as a pure function of the swarm.

Every expert (grid cell) gets five values for this volunteer, compared lexicographically
(a block's score is the tuple of its sums, most important first):

1. cover: 1 for an expert nobody holds;
2. tier: a hub's first fast copy: ``1 + p_e / mean(p)`` where no fast holder serves the expert
   yet (``fast_held``) and it ranks among the ``F`` most demanded, ``F`` the experts fast holders
   serve now (what the hubs' copies can reach), ``OFF_TIER * p_e / mean(p)`` below them (the tail
   edge devices hold): the hubs carry nearly all the serving rate, so calls served reach the
   demand on experts some hub holds, and the hubs' memory goes to one fast copy of as many
   experts as it can, hottest first (what the served bound's optimum does), before any second
   copy; but only as far as its rate carries (``within_rate``): beyond the most demanded of
   those experts whose demand fits its share of the swarm's serving rate, a first copy is 0
   (their calls would exceed what it serves); 0 for an edge device, and everywhere when every
   holder serves at about the same rate;
3. redundancy: replicas the expert lacks below ``min(t_e, min_replicas)``, where ``t_e`` is its
   target (``replica_targets``: ``target_replicas`` of demand over the swarm's expert slots,
   what every holder holds plus this volunteer, at least 1 each, raised to ``min_replicas`` when
   the slots allow it); for an edge device, whose memory holds the count replicas while the
   hubs' is spent (some experts have no fast holder), every replica the expert lacks below
   ``t_e`` until the slots allow ``min_replicas`` everywhere (so the most lacking, the hottest
   experts', come first: a second copy of an expert whose target is 2 does not come before a
   third of one whose target is 5), then the replicas below ``min_replicas``;
4. demand: the further replicas it lacks below ``t_e``: replicas follow demand. Once the hubs'
   copies reach every expert, the hot experts' count replicas are the hubs' to add (fast copies
   serve them): an edge device weighs the hot set at ``OFF_TIER`` in levels 3 and 4 (a phone at
   0 in level 4);
5. serve: where this volunteer helps most --
   a hub: ``p_e * log(1 + t / W_e)``, the gain in ``sum_e p_e log W_e`` (whose optimum is
   serving throughput ``W`` proportional to demand ``p``) from adding its per-expert
   throughput ``t`` (``Volunteer.serving_rate``: its compute, or its link if that is slower):
   hot experts short of throughput first, normalised to at most 1;
   an edge device: the same outside the hot set, 0 inside (the warmest of the long tail first),
   left in its own units, tiny next to a hub's as its throughput is: its blocks do not stretch
   over experts only to serve them.

Capacity decides the tier too (``effective_class``): a volunteer that declares itself a hub but
serves each of its experts at under ``edge_rate_share`` of the swarm's mean rate per held expert
(a home box on a 49 Mbit/s uplink in a swarm of 200G hubs) is placed like an edge device: its
copy of a hot expert adds almost no throughput. So the replica counts that follow demand come
from the edge tier's memory: the hubs' memory goes to serving rate (level 2), and an edge device
covers the tail (level 1 weighs the hot experts and, under the tier rule, every expert inside the
hubs' reach at ``OFF_TIER``: a hub will hold those) and gives the rest to count replicas, the most
lacking first (level 3, unweighted, while the hubs' memory is spent). A hub's levels 1, 3 and 4 weigh the hot set fully and
the rest at ``OFF_TIER``. Nobody leaves an expert uncovered to stay in its tier: while any expert is
uncovered, every volunteer that can hold one expert covers at least one.

Blocks are one layer range x one expert range (a node announces up to 64). With one block per
volunteer it is chosen among the largest shapes that fit (``pareto_shapes``) with 2-D prefix
sums: O(shapes x L x E). With ``max_blocks > 1`` (a node process announcing several blocks)
the levels are folded into one number per cell and each cell is charged the volunteer's
opportunity cost, the value of the ``k``-th best cell for a volunteer that can hold ``k``: blocks
then gather the cells worth most instead of filling memory with one large rectangle, and stop
when no rectangle is worth its cells (``best_signed_rect``, every shape); the memory left then
goes where it covers or adds missing replicas (never only to pile up replicas of cold experts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

import numpy as np

from moeswarm.errors import ConfigError

from ._demand import Demand
from ._grid import Block, ModelShape, Rect, Score, SignedSearch, best_rect
from ._layers import whole_layers
from ._supply import Supply
from ._target import target_replicas

DeviceClass = Literal["hub", "edge"]
OFF_TIER: Final = 0.1
"""Weight of covering / replicating an expert of the other tier (hot for edges, tail for hubs)."""
EDGE_SERVE: Final = 1e-3
"""Most an edge device's serving value (level 5) reaches: its throughput is a rounding error next to a hub's."""
_TAKEN: Final = 1e30  # penalty that keeps a volunteer's blocks disjoint


@dataclass(frozen=True)
class Volunteer:
    """What a joining machine offers."""

    memory_bytes: int  # memory it gives to expert weights, bytes
    throughput: float  # (expert, token) pairs per second it can compute (measured or estimated)
    device_class: DeviceClass = "hub"  # "hub": datacenter/workstation on a fat link; "edge": phone, NAT'd box
    bandwidth_bytes_s: float = 100e6  # its link's bandwidth, bytes per second
    rtt_s: float = 0.01  # its round trip to the swarm's backbones, seconds
    upload_bytes_s: float | None = None  # its upload, bytes per second, if slower than bandwidth_bytes_s

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.throughput < 0 or self.bandwidth_bytes_s <= 0 or self.rtt_s < 0:
            raise ConfigError("a volunteer needs memory >= 0, throughput >= 0, bandwidth > 0, rtt >= 0")
        if self.upload_bytes_s is not None and self.upload_bytes_s <= 0:
            raise ConfigError("a volunteer's upload must be > 0 bytes/s")
        if self.device_class not in ("hub", "edge"):
            raise ConfigError(f"device_class must be 'hub' or 'edge', not {self.device_class!r}")

    def serving_rate(self, call_bytes: int) -> float:
        """(expert, token) pairs per second it can serve: its compute, or what its link carries if
        slower (each call brings ``call_bytes`` in and sends as many back; 0: the link is no limit)."""
        if call_bytes <= 0:
            return self.throughput
        up = self.bandwidth_bytes_s if self.upload_bytes_s is None else min(self.upload_bytes_s, self.bandwidth_bytes_s)
        return min(self.throughput, up / call_bytes)


@dataclass(frozen=True)
class AssignConfig:
    """Policy of the assignment."""

    min_replicas: int = 2  # replicas every expert should have before any expert gets more (when capacity allows)
    max_blocks: int = 1  # blocks per volunteer (one `moeswarm node` process announces up to --max-blocks, 64)
    hot_share: float = 0.5  # the most-demanded experts that carry this share of calls are "hot": for hubs
    hub_max_rtt_s: float = 0.05  # a hub whose round trip exceeds this, seconds, is placed like an edge device
    edge_rate_share: float = 0.1  # a hub serving each expert at under this share of the swarm's mean rate
    # per held expert (Supply.throughput summed over held_cells) is placed like an edge device; 0: never
    max_load_s: float = 3600.0  # never assign more weights than its link downloads in this long, seconds
    width_bonus: float = 0.1  # extra score of a block spanning all experts of its layers (fewer requests)
    call_bytes: int = 0  # bytes one (token, expert) call moves each way (hidden size x bytes per value);
    # a volunteer serves at most its link / call_bytes calls per second; 0: only its compute counts
    block_cells: int = 64  # with max_blocks > 1: most experts in each block but the last (bounds the search)
    whole_layers: bool = True  # a hub that can hold a whole layer holds whole layers, balanced by
    # each layer's rate per call (``_layers.py``), unless a rectangle covers or replicates more

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_blocks < 1 or not 0 <= self.hot_share <= 1:
            raise ConfigError("need min_replicas >= 0, max_blocks >= 1, 0 <= hot_share <= 1")
        if self.hub_max_rtt_s < 0 or self.max_load_s <= 0 or self.width_bonus < 0 or self.call_bytes < 0:
            raise ConfigError("need hub_max_rtt_s >= 0, max_load_s > 0, width_bonus >= 0, call_bytes >= 0")
        if not 0 <= self.edge_rate_share < 1:
            raise ConfigError("need 0 <= edge_rate_share < 1")
        if self.block_cells < 1:
            raise ConfigError("block_cells must be >= 1")


@dataclass(frozen=True)
class Assignment:
    """The experts a volunteer should hold."""

    blocks: tuple[Block, ...]  # best first; empty if it cannot hold even one expert
    cells: int  # experts held in all
    bytes: int  # cells * expert_bytes; never above the volunteer's memory
    score: Score  # (cover, tier, redundancy, demand, serve) sums under the state it was computed for

    def node_args(self) -> list[str]:
        """``--layers A-B --experts X-Y`` of the best block, for ``moeswarm node`` with fixed
        ranges (a node given ``--experts auto`` asks the market itself and holds every block).
        """
        if not self.blocks:
            raise ConfigError("this volunteer cannot hold a single expert")
        return self.blocks[0].cli_args()


def effective_class(volunteer: Volunteer, config: AssignConfig, *, rate_per_expert: float | None = None,
                    swarm_rate_per_expert: float = 0.0) -> DeviceClass:
    """``edge`` for edge devices, for hubs too far away to serve hot experts quickly, and for hubs
    that serve each expert (``rate_per_expert``, pairs/s) at under ``edge_rate_share`` of the
    swarm's mean rate per held expert (``swarm_rate_per_expert``; 0: unknown, no such rule)."""
    if volunteer.device_class == "edge" or volunteer.rtt_s > config.hub_max_rtt_s:
        return "edge"
    if rate_per_expert is not None and rate_per_expert < config.edge_rate_share * swarm_rate_per_expert:
        return "edge"
    return "hub"


def capacity_cells(shape: ModelShape, volunteer: Volunteer, config: AssignConfig) -> int:
    """Experts the volunteer can hold: its memory, what its link loads in ``max_load_s``, the model."""
    by_memory = volunteer.memory_bytes // shape.expert_bytes
    by_link = int(volunteer.bandwidth_bytes_s * config.max_load_s) // shape.expert_bytes
    return int(max(0, min(by_memory, by_link, shape.cells)))


def hot_mask(share: np.ndarray, hot_share: float) -> np.ndarray:
    """The most-demanded cells that together carry ``hot_share`` of demand, all above average."""
    flat = share.reshape(-1)
    order = np.argsort(-flat, kind="stable")
    cum = np.cumsum(flat[order])
    count = int(np.searchsorted(cum, hot_share * cum[-1], side="left")) + 1 if hot_share > 0 else 0
    mask = np.zeros(flat.size, dtype=bool)
    mask[order[:count]] = True
    mask &= flat > (1.0 + 1e-9) / flat.size
    return mask.reshape(share.shape)


class CellValues(NamedTuple):
    """The value levels of every expert for one volunteer, each ``(L, E)``, most important first."""

    cover: np.ndarray
    tier: np.ndarray
    redundancy: np.ndarray
    demand: np.ndarray
    serve: np.ndarray


def replica_targets(shape: ModelShape, supply: Supply, demand: Demand, capacity: int,
                    config: AssignConfig = AssignConfig()) -> np.ndarray:
    """``(L, E)`` replicas each expert should have once a volunteer of ``capacity`` experts joins:
    ``target_replicas`` of demand over the swarm's slots, at least ``min_replicas`` when they allow."""
    slots = supply.held_cells + capacity
    target = target_replicas(demand.share, slots, floor=1)
    if slots >= config.min_replicas * shape.cells:
        target = np.maximum(target, config.min_replicas)
    return target


def fast_held(supply: Supply, config: AssignConfig = AssignConfig()) -> np.ndarray:
    """``(L, E)``: experts whose holders serve them at hub rate, at least ``edge_rate_share`` of the
    swarm's mean throughput per held expert (``Supply.rate_per_held_expert``); with
    ``edge_rate_share`` 0 (the tier rule off) every held expert."""
    held: np.ndarray = supply.replicas > 0
    if config.edge_rate_share <= 0 or supply.held_cells <= 0:
        return held
    out: np.ndarray = held & (supply.throughput >= config.edge_rate_share * supply.rate_per_held_expert)
    return out


def within_rate(share: np.ndarray, fast: np.ndarray, rate: float, swarm_rate: float) -> np.ndarray:
    """``(L, E)``: the experts without a fast holder (``~fast``) whose first fast copy a hub of
    ``rate`` pairs/s can serve: the most demanded of them, in order, while the demand before each
    (``share``, summing to 1) is under the hub's share of the swarm's rate, ``rate / (swarm_rate +
    rate)`` (``swarm_rate``: the others' announced rate). As the only fast holder of those experts
    it takes their calls; with the swarm at full load, calls beyond that share are more than it
    serves, so a first copy there adds no call served (a hub that took every expert it could
    hold, hottest first, ran saturated while others idled: ``benchmarks/swarm_sim.py``)."""
    fit = rate / (swarm_rate + rate) if swarm_rate + rate > 0 else 1.0
    flat = np.where(fast, 0.0, share).reshape(-1)
    order = np.argsort(-flat, kind="stable")
    before = np.cumsum(flat[order]) - flat[order]  # demand of the hotter experts without a fast copy
    out = np.zeros(flat.size, dtype=bool)
    out[order[before < fit]] = True
    out &= ~fast.reshape(-1)
    return out.reshape(share.shape)


def placed_as(supply: Supply, volunteer: Volunteer, config: AssignConfig, capacity: int) -> DeviceClass:
    """The tier the volunteer is placed in (``effective_class``) when it holds ``capacity``
    experts among the holders of ``supply``."""
    rate = volunteer.serving_rate(config.call_bytes) / max(capacity, 1)
    return effective_class(volunteer, config, rate_per_expert=rate, swarm_rate_per_expert=supply.rate_per_held_expert)


def cell_values(shape: ModelShape, supply: Supply, demand: Demand, volunteer: Volunteer,
                config: AssignConfig = AssignConfig(), *, capacity: int | None = None,
                near: Supply | None = None) -> CellValues:
    """The value of this volunteer holding each expert, given the others' ``supply``; ``near``:
    the part of it held by holders within a short round trip of this volunteer (its region, see
    ``_near.py``), for a hub's first fast copy (level 2): the first fast copy in its region, so the
    backbones there call a holder one round trip across the region away, not across the world."""
    k = capacity_cells(shape, volunteer, config) if capacity is None else capacity
    r = supply.replicas
    p = demand.share
    target = replica_targets(shape, supply, demand, k, config)
    short = np.where(r > 0, np.clip(np.minimum(target, config.min_replicas) - r, 0, None), 0).astype(np.float64)
    extra = np.where(r > 0, np.clip(target - np.maximum(r, config.min_replicas), 0, None), 0).astype(np.float64)
    hot = hot_mask(p, config.hot_share)
    t = max(volunteer.serving_rate(config.call_bytes) / max(k, 1), 1e-12)
    w = supply.throughput
    floor = max(float(w.mean()), t) * 1e-3
    serve = p * np.log1p(t / (w + floor))
    fast = fast_held(supply, config)
    tail = np.zeros(p.shape, dtype=bool)
    if config.edge_rate_share > 0:  # the experts beyond what the hubs' copies can reach
        rank = np.empty(p.size, dtype=np.int64)
        rank[np.argsort(-p.reshape(-1), kind="stable")] = np.arange(p.size)
        tail = rank.reshape(p.shape) >= int(fast.sum())
    if placed_as(supply, volunteer, config, k) == "hub":
        tier = np.where(hot, 1.0, OFF_TIER)
        here, fast_here = (supply, fast) if near is None else (near, fast_held(near, config))
        first = np.where(fast_here, 0.0, np.where(tail, OFF_TIER * p * p.size, 1.0 + p * p.size))
        rate = volunteer.serving_rate(config.call_bytes)
        first = np.where(within_rate(p, fast_here, rate, float(here.throughput.sum())), first, 0.0)
        short, extra = tier * short, tier * extra
        serve = serve / max(float(serve.max()), 1e-300)
    else:  # the tail first (what the hubs reach, they will hold), then count replicas
        serve = np.where(hot, 0.0, serve)
        serve = EDGE_SERVE * serve / max(float(serve.max()), 1e-300)
        reach = ~tail if config.edge_rate_share > 0 else np.zeros(p.shape, dtype=bool)
        tier = np.where(hot | reach, OFF_TIER, 1.0)
        first = np.zeros(p.shape)
        if config.edge_rate_share > 0 and not tail.any():
            # the hubs' copies reach every expert: the hot experts' count replicas are theirs to add
            # (fast copies serve; a phone's would only take their place in the counts)
            phone = effective_class(volunteer, config) == "edge"
            short = np.where(hot, OFF_TIER, 1.0) * short
            extra = np.where(hot, 0.0 if phone else OFF_TIER, 1.0) * extra
        elif supply.held_cells + k < config.min_replicas * shape.cells:
            # every replica it lacks (t_e - r_e), the most lacking first, in level 3 (which memory
            # left over fills); once the slots allow min_replicas everywhere (t_e >= min_replicas),
            # short and extra are already those below it and the rest
            short, extra = short + extra, np.zeros(p.shape)
    return CellValues(tier * (r <= 0), first, short, extra, serve)


def choose_rects(values: CellValues, capacity: int, config: AssignConfig = AssignConfig(), *,
                 taken: np.ndarray | None = None) -> tuple[list[Rect], Score]:
    """Up to ``max_blocks`` disjoint rectangles, greedily best first, within ``capacity`` cells;
    with a ``taken`` mask (the blocks a node keeps), none over its cells (``_choose_signed``)."""
    if config.max_blocks > 1 or taken is not None:
        return _choose_signed(values, capacity, config, taken)
    levels = [v.copy() for v in values]
    rects: list[Rect] = []
    score: Score = tuple(0.0 for _ in levels)
    while len(rects) < config.max_blocks and capacity > 0:
        found = best_rect(levels, capacity, width_bonus=config.width_bonus)
        if found is None or found[1][0] < 0:
            break
        rect, s = found
        rects.append(rect)
        score = tuple(a + b for a, b in zip(score, s))
        capacity -= rect.cells
        levels[0][rect.slices] = -_TAKEN  # later blocks must not overlap this one
    return rects, score


def folded(values: Sequence[np.ndarray], capacity: int) -> np.ndarray:
    """The levels as one number per cell: a unit of a level outweighs everything the levels below
    it add up to over ``capacity`` cells, so sums over blocks compare lexicographically."""
    out = np.zeros_like(values[0])
    weight, below = 1.0, 0.0  # below: the most the lower levels add up to in one cell, weighted
    for level in reversed(values):
        out += weight * level
        below += weight * float(level.max(initial=0.0))
        weight = capacity * below + 1.0
    return out


def _choose_signed(values: CellValues, capacity: int, config: AssignConfig,
                   mask: np.ndarray | None = None) -> tuple[list[Rect], Score]:
    """Up to ``max_blocks`` disjoint rectangles: first (all but one) each the best under the
    opportunity cost (the ``capacity``-th best cell's value; the first always taken, later ones
    only if worth it, each at most ``block_cells``), then the memory left goes to the rectangles
    that cover, add the tier's copy or replicate most (uncovered experts first) without
    overlapping each other or the cells of ``mask``, which are not counted for the opportunity cost."""
    v = folded(values, capacity)
    mask = np.zeros(v.shape, dtype=bool) if mask is None else mask
    flat = v[~mask]
    k = min(capacity, flat.size)
    kth = float(np.partition(flat, flat.size - k)[flat.size - k]) if k > 0 else 0.0
    below = flat[flat < kth]
    cost = (kth + float(below.max())) / 2 if below.size else kth - 1.0  # the k best cells (and ties) gain
    signed = v - cost
    taken = -2.0 * (float(np.abs(signed).sum()) + 1.0)  # below any sum of untaken cells, yet exact in float64
    signed[mask] = taken
    rects: list[Rect] = []
    left = capacity
    search = SignedSearch(signed)  # the searches below only lower it: each reuses the last one's sums
    while len(rects) < config.max_blocks - 1 and left > 0:
        found = search.best(min(left, config.block_cells))
        if found is None or (rects and found[1] <= 0):
            break
        rect = found[0]
        rects.append(rect)
        left -= rect.cells
        search.lower(rect, taken)
    # the rest of memory goes where it covers, adds its tier's copy or replicates (levels 1-3), in
    # the largest rectangles that hold most of it without overlapping the blocks taken
    need = folded((values.cover, values.tier, values.redundancy), capacity)
    gone = -2.0 * (float(need.sum()) + 1.0) * max(capacity, 1)
    search = SignedSearch(np.where(signed == taken, gone, need))
    while len(rects) < config.max_blocks and left > 0:
        found = search.best(left)
        if found is None or found[1] <= 0:
            break
        rects.append(found[0])
        left -= found[0].cells
        search.lower(found[0], gone)
    return rects, score_rects(values, rects, config)


def score_rects(values: CellValues, rects: Sequence[Rect], config: AssignConfig = AssignConfig()) -> Score:
    """The score ``choose_rects`` gives these (disjoint) rectangles under ``values``."""
    E = values.serve.shape[1]
    total = [0.0 for _ in values]
    for r in rects:
        w = r.e1 - r.e0 + 1
        bonus = 1.0 + config.width_bonus * ((w - 1) / (E - 1) if E > 1 else 0.0)
        for i, level in enumerate(values):
            total[i] += float(level[r.slices].sum()) * (bonus if i == len(values) - 1 else 1.0)
    return tuple(total)


def layers_apply(shape: ModelShape, supply: Supply, volunteer: Volunteer, config: AssignConfig, capacity: int) -> bool:
    """Whether whole layers are an option: a hub that can hold one, in a swarm whose memory holds
    ``min_replicas`` copies of every expert (scarce memory: count replicas follow demand first)."""
    return (config.whole_layers and capacity >= shape.grid[1] and placed_as(supply, volunteer, config, capacity) == "hub"
            and supply.held_cells + capacity >= config.min_replicas * shape.cells)


def layer_choice(shape: ModelShape, supply: Supply, demand: Demand, volunteer: Volunteer, config: AssignConfig,
                 values: CellValues, capacity: int, rects: Sequence[Rect], near: Supply | None = None
                 ) -> list[Rect] | None:
    """Whole layers (``_layers.whole_layers``, balanced over ``near``'s holders when given: its
    region's) instead of ``rects`` for a volunteer placed as a hub that can hold one, in a swarm
    whose memory holds ``min_replicas`` copies of every expert, when they
    cover and replicate as much in all (levels 1 and 3: memory left idle must not leave an expert
    uncovered or short of replicas). ``None``: keep ``rects``."""
    if not layers_apply(shape, supply, volunteer, config, capacity):
        return None
    span = whole_layers(shape, supply if near is None else near, demand, capacity)
    if span is None:
        return None
    ours, theirs = score_rects(values, [span], config), score_rects(values, rects, config)
    if any(ours[i] < theirs[i] - 1e-12 for i in (0, 2)):
        return None
    return [span]


def assign(shape: ModelShape, supply: Supply, demand: Demand, volunteer: Volunteer,
           config: AssignConfig = AssignConfig(), *, near: Supply | None = None) -> Assignment:
    """The blocks a joining ``volunteer`` should hold, given the swarm's ``supply`` and ``demand``
    (and ``near``, the part of ``supply`` in its region: see ``cell_values``).

    Pure and deterministic. Never assigns more than ``volunteer.memory_bytes``.
    """
    if supply.replicas.shape != shape.grid or demand.share.shape != shape.grid:
        raise ConfigError("supply and demand must be grids of the model's shape")
    k = capacity_cells(shape, volunteer, config)
    if k < 1:
        return Assignment((), 0, 0, (0.0, 0.0, 0.0, 0.0, 0.0))
    if near is not None and near.replicas.shape != shape.grid:
        raise ConfigError("the near supply must be a grid of the model's shape")
    values = cell_values(shape, supply, demand, volunteer, config, capacity=k, near=near)
    if not values.cover.any() and not values.redundancy.any():  # no rectangle can beat whole layers
        layers = layer_choice(shape, supply, demand, volunteer, config, values, k, [], near)
        if layers is not None:
            cells = sum(r.cells for r in layers)
            return Assignment(tuple(shape.block(r) for r in layers), cells, cells * shape.expert_bytes,
                              score_rects(values, layers, config))
    rects, score = choose_rects(values, k, config)
    layers = layer_choice(shape, supply, demand, volunteer, config, values, k, rects, near)
    if layers is not None:
        rects, score = layers, score_rects(values, layers, config)
    cells = sum(r.cells for r in rects)
    return Assignment(tuple(shape.block(r) for r in rects), cells, cells * shape.expert_bytes, score)
