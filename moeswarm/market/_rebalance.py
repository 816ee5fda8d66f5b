"""Rebalancing: a node re-evaluates its blocks and moves only for a clear gain, never uncovering
an expert on the way.

A move is an ordered ``MovePlan`` of ``add`` / ``drop`` steps over the node's held blocks
(``add``: load the weights, then announce them; ``drop``: announce without them, then unload).
A plan is only produced if, after every step, every expert that was held anywhere before the
move is still held (by another node or by a block this node still holds) and the node holds no
more than its memory allows (plus ``transition_slack``). New copies are therefore announced
before old ones are dropped whenever the old one was the last copy.

The executor must re-check each ``drop`` with ``drop_is_safe`` right before doing it (other
nodes may have left since the plan was made) and wait instead of dropping if it is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from moeswarm.errors import ConfigError

from ._assign import (
    AssignConfig,
    CellValues,
    Volunteer,
    capacity_cells,
    cell_values,
    choose_rects,
    layer_choice,
    layers_apply,
    placed_as,
    score_rects,
)
from ._demand import Demand
from ._grid import Block, ModelShape, Rect, better, cell_mask, union_cells
from ._layers import bare_layers, is_whole_layers
from ._supply import Supply


@dataclass(frozen=True)
class RebalanceConfig:
    """When a node moves."""

    hysteresis: float = 0.5  # move only if the best blocks score this fraction above the current ones
    cooldown_epochs: int = 2  # after a move, stay put for at least this many epochs
    move_cost: float = 0.004  # a move for anything but coverage and serving (levels 2-4: first fast
    # copies, replicas) must add more than this times the model's experts at the level it gains
    # (29 for MiniMax M3's 7,296): whatever it loads, a move costs announcements and a re-plan, for
    # an edge device a download over a slow link and a relay's announcements, and in a large model
    # one copy is a small part of the swarm, so nodes gather their swaps into fewer, larger moves
    # (swarm_sim's M3 before the rule: the hubs moved at half their re-evaluations, a dozen first
    # copies each time, 1.2% of all nodes every epoch); a release (below) is gathered by its share
    edge_levels: int = 1  # score levels a volunteer placed like an edge device moves for (1: only to
    # cover an expert nobody holds): its move is a download over a slow link, the edge tier turns
    # over within hours, so its joiners place the rest, and when demand shifts every edge device
    # would chase the same new count replicas at once (with 4, swarm_sim's shifting M3 moved 13% of
    # all nodes in one epoch)
    release_share: float = 0.3  # a volunteer placed like an edge device (of more than one block)
    # whose idle blocks (every expert in them another holder keeps and none lacks a replica: 0 at
    # levels 1, 3 and 4) are at least this share of its memory swaps those blocks, and only those,
    # for missing replicas, whatever edge_levels says, in one move of at least that share: a hub
    # that takes a first fast copy of a tail expert a home box covered leaves the home box's copy
    # idle (swarm_sim's M3: a quarter of the home boxes' memory), memory the count replicas the
    # hot experts lack want; 0: never
    transition_slack: float = 0.0  # extra memory (fraction of the volunteer's) usable while old and new overlap

    def __post_init__(self) -> None:
        if min(self.hysteresis, self.cooldown_epochs, self.transition_slack, self.edge_levels, self.move_cost,
               self.release_share) < 0 or self.release_share > 1:
            raise ConfigError("hysteresis, cooldown_epochs, transition_slack, edge_levels and move_cost must be >= 0, "
                              "release_share in [0, 1]")


@dataclass(frozen=True)
class PlanStep:
    action: Literal["add", "drop"]  # add: load, then announce; drop: announce without, then unload
    block: Block


@dataclass(frozen=True)
class MovePlan:
    """How a node goes from ``source`` blocks to ``target`` blocks, step by step."""

    source: tuple[Block, ...]
    target: tuple[Block, ...]
    steps: tuple[PlanStep, ...]
    gain: float  # gain at the first score level that improved (see ``rebalance``; inf from 0)


def _covered(others: np.ndarray, shape: ModelShape, held: Sequence[Block]) -> np.ndarray:
    rects = [r for r in (shape.rect(b) for b in held) if r is not None]
    out: np.ndarray = (others > 0) | cell_mask(shape.grid, rects)
    return out


def _cells(shape: ModelShape, held: Sequence[Block]) -> int:
    return union_cells([r for r in (shape.rect(b) for b in held) if r is not None])


def drop_is_safe(shape: ModelShape, others: np.ndarray, held: Sequence[Block], block: Block) -> bool:
    """Whether dropping ``block`` (one of ``held``) keeps every cell it covers held somewhere.

    ``others`` is the ``(L, E)`` replica count of every other node.
    """
    rect = shape.rect(block)
    if rect is None:
        return True
    rest = list(held)
    rest.remove(block)
    return bool(_covered(others, shape, rest)[rect.slices].all())


def check_plan(shape: ModelShape, others: np.ndarray, plan: MovePlan, max_cells: int) -> list[str]:
    """Every way ``plan`` breaks the invariants (empty list: it is safe).

    ``others`` is the ``(L, E)`` replica count of every other node; ``max_cells`` the experts
    the node may hold at once.
    """
    problems: list[str] = []
    held = list(plan.source)
    before = _covered(others, shape, held)
    for i, step in enumerate(plan.steps):
        if step.action == "add":
            held.append(step.block)
        elif step.block in held:
            held.remove(step.block)
        else:
            problems.append(f"step {i} drops {step.block}, which is not held")
        lost = before & ~_covered(others, shape, held)
        if lost.any():
            problems.append(f"step {i} leaves {int(lost.sum())} experts uncovered")
        if _cells(shape, held) > max_cells:
            problems.append(f"step {i} holds {_cells(shape, held)} experts, above {max_cells}")
    if sorted(held) != sorted(plan.target):
        problems.append("the plan does not end on its target")
    return problems


def plan_move(shape: ModelShape, others: np.ndarray, source: Sequence[Block], target: Sequence[Block],
              max_cells: int, gain: float = 0.0) -> MovePlan | None:
    """A safe ordered plan from ``source`` to ``target`` blocks, or ``None`` if there is none.

    Tries, in order: (1) add every new block, then drop every old one (needs memory for both);
    (2) add the overlaps of old and new blocks, drop the old, add the new, drop the overlaps
    (needs every expert held only by the old blocks to be kept by the new ones, and memory for
    the larger of old and new). ``max_cells`` bounds the experts held at every step.
    """
    src, dst = tuple(source), tuple(target)
    adds = [b for b in dst if b not in src]
    drops = [b for b in src if b not in dst]
    candidates = [[PlanStep("add", b) for b in adds] + [PlanStep("drop", b) for b in drops]]
    overlaps: list[Block] = []
    for a in drops:
        for b in adds:
            ra, rb = shape.rect(a), shape.rect(b)
            inter = ra.intersect(rb) if ra is not None and rb is not None else None
            if inter is not None and shape.block(inter) not in overlaps + list(src):
                overlaps.append(shape.block(inter))
    candidates.append([PlanStep("add", b) for b in overlaps] + [PlanStep("drop", b) for b in drops]
                      + [PlanStep("add", b) for b in adds] + [PlanStep("drop", b) for b in overlaps])
    for steps in candidates:
        plan = MovePlan(src, dst, tuple(steps), gain)
        if not check_plan(shape, others, plan, max_cells):
            return plan
    return None


def _bounds(mask: np.ndarray, rect: Rect) -> Rect:
    """The smallest rectangle inside ``rect`` around its cells where ``mask`` is set (some are)."""
    rows, cols = np.nonzero(mask[rect.slices])
    return Rect(rect.r0 + int(rows.min()), rect.r0 + int(rows.max()),
                rect.e0 + int(cols.min()), rect.e0 + int(cols.max()))


def _released(values: CellValues, rects: Sequence[Rect], capacity: int, assign_config: AssignConfig,
              share: float) -> list[Rect] | None:
    """The blocks an edge device keeps (those with an expert it is the only holder of, or one
    that lacks a replica) and, in the memory its idle blocks held, blocks chosen afresh; ``None``
    unless the idle blocks are at least ``share`` of ``capacity`` (``RebalanceConfig.release_share``)."""
    if share <= 0 or assign_config.max_blocks < 2 or not rects:
        return None
    idle = (values.cover <= 0) & (values.redundancy <= 0) & (values.demand <= 0)
    kept = [r for r in rects if not idle[r.slices].all()]
    if sum(r.cells for r in rects) - sum(r.cells for r in kept) < max(1.0, share * capacity):
        return None
    return _keep_and_choose(values, kept, capacity, assign_config)  # kept < max_blocks: a block is idle


def _keep_and_choose(values: CellValues, keep: list[Rect], capacity: int, assign_config: AssignConfig) -> list[Rect]:
    """``keep`` (fewer than ``max_blocks`` blocks) and, in the memory and blocks they leave, the
    blocks ``choose_rects`` picks by ``values`` without overlapping them."""
    more, _ = choose_rects(values, capacity - sum(r.cells for r in keep),
                           replace(assign_config, max_blocks=assign_config.max_blocks - len(keep)),
                           taken=cell_mask(values.cover.shape, keep))
    return keep + more


def _bares_more(shape: ModelShape, supply: Supply, volunteer: Volunteer, config: AssignConfig, capacity: int,
                rects: Sequence[Rect], span: Sequence[Rect]) -> bool:
    """Whether a hub on whole layers ``rects`` should move to ``span``: more of the span's layers
    than of its own have no fast holder in ``supply`` but it (``bare_layers``, its rate per layer,
    ``edge_rate_share``). Over its region's supply: a backbone there pays an ocean's round trip on
    every bare layer, every token (swarm_sim's regions at 8x memory: a region's three hubs on
    layers 17-39, 25-40 and 41-56, layers 0-16 held by none of them, stayed: 70% of calls on the
    region's hubs, its gateway 0.73 tok/s). Each such move lowers the region's bare layers: moves
    end. ``edge_rate_share`` 0: never."""
    layers = shape.grid[1]
    rate = volunteer.serving_rate(config.call_bytes) / max(capacity // layers, 1)
    bare = bare_layers(supply, rate, config.edge_rate_share)
    mine, there = cell_mask(shape.grid, rects)[:, 0], cell_mask(shape.grid, span)[:, 0]
    return int(bare[there].sum()) > int(bare[mine].sum())


def rebalance(shape: ModelShape, supply: Supply, demand: Demand, volunteer: Volunteer, current: Sequence[Block],
              *, assign_config: AssignConfig = AssignConfig(), config: RebalanceConfig = RebalanceConfig(),
              epochs_since_move: int | None = None, near: Supply | None = None) -> MovePlan | None:
    """Re-evaluate a node that holds ``current`` (included in ``supply``): a plan, or ``None`` to stay.

    The node's own contribution is taken out of ``supply`` and the assignment is recomputed for
    the rest of the swarm; a node of several blocks counts the experts it holds ``1 + hysteresis``
    times their value (it swaps only experts a new one beats by the hysteresis) and also weighs
    keeping the blocks around the only copies it holds and choosing the rest afresh. It
    moves only if the new blocks beat its current ones at the first level where they differ by
    more than ``hysteresis``: relatively for coverage (``best / now - 1``, infinite from nothing),
    and for the other levels per expert the move loads (``(best - now) / max(m, 1)`` for a move
    that loads ``m`` experts the node does not hold yet: each expert loaded must add more than
    ``hysteresis`` of a missing replica or of a mean expert's first fast copy, so a node of 100
    experts does not reload them to add one, while it does swap 20 of them for 20 worth more).
    A move for first fast copies or replicas (levels 2-4) must add more than ``move_cost`` times
    the model's experts in all. A volunteer placed like an edge device moves only for the first
    ``edge_levels`` levels (coverage), or to release idle blocks (``release_share``: it keeps its
    other blocks and chooses the idle ones' memory afresh, past ``edge_levels`` and ``move_cost``).
    It must not have moved in the last ``cooldown_epochs`` epochs, and a safe
    ``plan_move`` must exist. ``near``: the part of ``supply`` held near the node, the node
    included (its region, ``_near.py``): first fast copies and whole layers count there. With the state unchanged, a node that just moved stays: its new
    blocks are the best for the same values.
    """
    if epochs_since_move is not None and epochs_since_move < config.cooldown_epochs:
        return None
    rects: list[Rect] = [r for r in (shape.rect(b) for b in current) if r is not None]
    others = supply.changed(rects, volunteer.throughput, -1) if rects else supply
    near = near.changed(rects, volunteer.throughput, -1) if near is not None and rects else near
    k = capacity_cells(shape, volunteer, assign_config)
    values = cell_values(shape, others, demand, volunteer, assign_config, capacity=k, near=near)
    limit = int(k * (1.0 + config.transition_slack))
    span = None
    if layers_apply(shape, others, volunteer, assign_config, k):  # else no rectangle search for nothing
        rival = choose_rects(values, k, assign_config)[0] if values.cover.any() or values.redundancy.any() else []
        span = layer_choice(shape, others, demand, volunteer, assign_config, values, k, rival, near)
    if span is not None:  # a hub that can hold a whole layer: whole layers (_layers.py)
        if is_whole_layers(shape, rects, k) and not _bares_more(shape, others if near is None else near, volunteer,
                                                                 assign_config, k, rects, span):
            return None  # joiners fill the layers short of rate; a hub on whole layers stays (but see _bares_more)
        return plan_move(shape, others.replicas, [shape.block(r) for r in rects], [shape.block(r) for r in span],
                         limit, float("inf"))  # no score level measures it: whole layers are the rule
    held = cell_mask(shape.grid, rects)
    sticky = values
    if assign_config.max_blocks > 1:
        # the experts held count (1 + hysteresis) times their value in the choice: a node of many
        # blocks swaps only the experts a new one beats by the hysteresis and keeps the rest (one
        # block moves whole: the gain below weighs it)
        sticky = CellValues(*(np.where(held, level * (1.0 + config.hysteresis), level) for level in values))
    candidates = [choose_rects(sticky, k, assign_config)[0]]
    keep = [_bounds(values.cover, r) for r in rects if values.cover[r.slices].any()]  # around the only copies it holds
    if assign_config.max_blocks > len(keep) > 0:
        # a node of many blocks also weighs keeping those and choosing the rest afresh: the fresh
        # choice alone may not fit every only copy it holds into its blocks, and then never moves
        candidates.append(_keep_and_choose(sticky, keep, k, assign_config))
    now = score_rects(values, rects, assign_config)
    edge = placed_as(others, volunteer, assign_config, k) == "edge"
    released = _released(values, rects, k, assign_config, config.release_share) if edge else None
    if released is not None:
        candidates.append(released)
    best, gain = rects, 0.0
    for option in candidates:
        score = score_rects(values, option, assign_config)
        if sorted(option) == sorted(rects) or not better(score, now):
            continue
        level = next(i for i, (a, b) in enumerate(zip(score, now)) if a > b)
        if level >= config.edge_levels and edge and option is not released:
            continue
        loads = int((cell_mask(shape.grid, option) & ~held).sum())  # experts to load
        base = now[level] if level == 0 else max(float(loads), 1.0)
        gained = score[level] - now[level]
        if option is not released and 0 < level < len(score) - 1 and gained <= config.move_cost * shape.cells:
            continue
        g = gained / base if base > 0 else float("inf")
        if g > gain:
            best, gain = option, g
    if gain <= config.hysteresis:
        return None
    return plan_move(shape, others.replicas, [shape.block(r) for r in rects], [shape.block(r) for r in best],
                     limit, gain)
