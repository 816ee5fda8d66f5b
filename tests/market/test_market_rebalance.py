"""Rebalancing: moves keep every expert covered at every step, clear the hysteresis, and do not flap."""

from __future__ import annotations

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from moeswarm.market import (
    AssignConfig,
    Block,
    Demand,
    ModelShape,
    MovePlan,
    PlanStep,
    RebalanceConfig,
    Rect,
    Supply,
    Volunteer,
    check_plan,
    drop_is_safe,
    plan_move,
    rebalance,
)

SHAPE = ModelShape("org/m", (0, 1, 2, 3), 6, 10)


@st.composite
def rects(draw: st.DrawFn, shape: ModelShape = SHAPE) -> Rect:
    L, E = shape.grid
    r0, e0 = draw(st.integers(0, L - 1)), draw(st.integers(0, E - 1))
    return Rect(r0, draw(st.integers(r0, L - 1)), e0, draw(st.integers(e0, E - 1)))


@st.composite
def swarms(draw: st.DrawFn) -> tuple[Supply, Demand, Volunteer, Rect, AssignConfig]:
    """A swarm of random holders, one of which (``mine``, held by ``me``) re-evaluates."""
    supply = Supply.empty(SHAPE)
    for r in draw(st.lists(rects(), max_size=8)):
        supply = supply.changed([r], draw(st.floats(1, 1e4)), +1)
    mine = draw(rects())
    me = Volunteer(draw(st.integers(mine.cells, SHAPE.cells)) * SHAPE.expert_bytes, draw(st.floats(1, 1e4)),
                   draw(st.sampled_from(["hub", "edge"])))
    supply = supply.changed([mine], me.throughput, +1)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    demand = Demand.from_counts(rng.zipf(1.3, size=SHAPE.grid).astype(float))
    cfg = AssignConfig(min_replicas=draw(st.integers(0, 3)))
    return supply, demand, me, mine, cfg


@settings(max_examples=200, deadline=None)
@given(swarms(), st.floats(0, 1))
def test_rebalancing_never_uncovers_an_expert_and_does_not_flap(swarm, hysteresis: float) -> None:  # type: ignore[no-untyped-def]
    supply, demand, me, mine, cfg = swarm
    rcfg = RebalanceConfig(hysteresis=hysteresis, cooldown_epochs=0)
    plan = rebalance(SHAPE, supply, demand, me, [SHAPE.block(mine)], assign_config=cfg, config=rcfg)
    event("moves" if plan is not None else "stays")
    if plan is None:
        return
    event(f"plan of {len(plan.steps)} steps")
    others = supply.changed([mine], me.throughput, -1)
    assert check_plan(SHAPE, others.replicas, plan, me.memory_bytes // SHAPE.expert_bytes) == []
    assert plan.gain > hysteresis and plan.target != plan.source
    moved = others
    for b in plan.target:
        r = SHAPE.rect(b)
        assert r is not None
        moved = moved.changed([r], me.throughput, +1)
    assert (moved.replicas > 0).sum() >= (supply.replicas > 0).sum()
    again = rebalance(SHAPE, moved, demand, me, list(plan.target), assign_config=cfg, config=rcfg)
    assert again is None, "moved, then wants to move again under the same state"


@settings(max_examples=200, deadline=None)
@given(st.lists(rects(), max_size=5), st.lists(rects(), min_size=1, max_size=2),
       st.lists(rects(), min_size=1, max_size=2), st.integers(1, 24))
def test_every_plan_keeps_coverage_and_memory_at_each_step(others_rects: list[Rect], src: list[Rect],
                                                           dst: list[Rect], capacity: int) -> None:
    others = np.zeros(SHAPE.grid, dtype=np.int64)
    for r in others_rects:
        others[r.slices] += 1
    plan = plan_move(SHAPE, others, [SHAPE.block(r) for r in src], [SHAPE.block(r) for r in dst], capacity)
    event("planned" if plan is not None else "refused")
    if plan is not None:
        assert check_plan(SHAPE, others, plan, capacity) == []
    sole = np.zeros(SHAPE.grid, dtype=bool)
    for r in src:
        sole[r.slices] = True
    sole &= others == 0
    kept = np.zeros(SHAPE.grid, dtype=bool)
    for r in dst:
        kept[r.slices] = True
    if (sole & ~kept).any():
        assert plan is None  # a move that would drop the last copy of an expert is refused


def test_a_node_holding_the_last_copy_adds_before_it_drops() -> None:
    others = np.zeros(SHAPE.grid, dtype=np.int64)
    a, b = Block((0, 0), (0, 2)), Block((0, 1), (0, 1))  # b keeps experts 0-1 of layer 0, not expert 2
    assert plan_move(SHAPE, others, [a], [b], max_cells=9) is None  # expert (0, 2) would be lost
    others[0, 2] = 1  # someone else holds it
    plan = plan_move(SHAPE, others, [a], [b], max_cells=5)  # room for old and new at once
    assert plan is not None and plan.steps == (PlanStep("add", b), PlanStep("drop", a))
    plan = plan_move(SHAPE, others, [a], [b], max_cells=4)  # no room: shrink to the overlap, then grow
    assert plan is not None and check_plan(SHAPE, others, plan, 4) == []
    assert [s.action for s in plan.steps] == ["add", "drop", "add", "drop"]
    assert plan.steps[0].block == Block((0, 0), (0, 1))
    assert plan_move(SHAPE, others, [a], [b], max_cells=3) is None  # b alone does not fit
    bad = MovePlan((a,), (b,), (PlanStep("drop", a), PlanStep("add", b)), 1.0)
    assert any("uncovered" in p for p in check_plan(SHAPE, np.zeros(SHAPE.grid, dtype=np.int64), bad, 9))
    assert not drop_is_safe(SHAPE, np.zeros(SHAPE.grid, dtype=np.int64), [a], a)
    assert drop_is_safe(SHAPE, np.zeros(SHAPE.grid, dtype=np.int64), [a, Block((0, 0), (0, 5))], a)


def test_hysteresis_and_cooldown_hold_a_node_in_place() -> None:
    demand = Demand.uniform(SHAPE)
    me = Volunteer(6 * SHAPE.expert_bytes, 100.0, "hub")
    full = np.full(SHAPE.grid, 2, dtype=np.int64)
    supply = Supply(full, full * 10.0, np.zeros(SHAPE.grid), 8, int(full.sum()))
    mine = Rect(0, 0, 0, 5)
    supply = supply.changed([mine], me.throughput, +1)
    # everything covered twice by others and demand uniform: nothing is worth moving for
    assert rebalance(SHAPE, supply, demand, me, [SHAPE.block(mine)]) is None
    hole = Supply(supply.replicas.copy(), supply.throughput, supply.load_sum, supply.holders, supply.held_cells)
    hole.replicas[3, 0:6] = 0  # a whole layer nobody else holds
    plan = rebalance(SHAPE, hole, demand, me, [SHAPE.block(mine)])
    assert plan is not None and plan.target == (Block((3, 3), (0, 5)),) and plan.gain == float("inf")
    assert rebalance(SHAPE, hole, demand, me, [SHAPE.block(mine)], epochs_since_move=1) is None  # cooldown


def test_a_gain_is_weighed_against_the_experts_the_move_loads() -> None:
    """The live check's grid (4 x 8, top-2 demo): six 8-expert nodes placed by coverage, then
    experts 0-1 of every layer wanted 2.5x as much: a second holder of layer 0 moves to them."""
    shape = ModelShape("org/demo", (0, 1, 2, 3), 8, 10)
    counts = np.ones(shape.grid)
    counts[:, :2] = 2.5
    me = Volunteer(8 * shape.expert_bytes, 1e4)
    supply = Supply.empty(shape)
    for layer in (0, 1, 2, 3, 0, 1):
        supply = supply.changed([Rect(layer, layer, 0, 7)], me.throughput, +1)
    plan = rebalance(shape, supply, Demand.from_counts(counts), me, [Block((0, 0), (0, 7))])
    # 6 hot experts below 2 replicas instead of 2, by loading the 6 it lacks: 4 / 6 > 0.5 (by its
    # size, 4 / 8, it would stay)
    assert plan is not None and plan.target == (Block((0, 3), (0, 1)),)
    assert abs(plan.gain - 4 / 6) < 1e-9
    assert rebalance(shape, supply, Demand.from_counts(counts), me, [Block((0, 0), (0, 7))],
                     config=RebalanceConfig(hysteresis=0.7)) is None


def _many_block_hub() -> tuple[ModelShape, Supply, Demand, Volunteer, AssignConfig, list[Rect]]:
    """A fast node of 4 blocks holding the only copies of experts 0, 8 and 15 beside duplicates of
    cold ones, while hot experts 3-5 (wanted 20x) have no fast holder."""
    shape = ModelShape("org/m", (0,), 16, 10)
    counts = np.ones(shape.grid)
    counts[0, 3:6] = 20.0
    me = Volunteer(6 * shape.expert_bytes, 1e6, "hub")
    mine = [Rect(0, 0, 0, 1), Rect(0, 0, 7, 8), Rect(0, 0, 14, 15)]
    supply = Supply.empty(shape)
    for e in (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14):  # slow holders of everything but 0, 8 and 15
        supply = supply.changed([Rect(0, 0, e, e)], 1.0, +1)
    for e in (2, 6, 9, 10, 11, 12, 13):  # cold experts a fast node serves
        supply = supply.changed([Rect(0, 0, e, e)], 1e6, +1)
    supply = supply.changed(mine, me.throughput, +1)
    return shape, supply, Demand.from_counts(counts), me, AssignConfig(max_blocks=4, edge_rate_share=0.1), mine


def test_a_node_of_many_blocks_keeps_its_only_copies_and_moves_the_rest() -> None:
    """The many-block hub (``_many_block_hub``) keeps the three only copies (as blocks of their
    own) and moves the duplicates' memory to 3-5, never uncovering an expert."""
    shape, supply, demand, me, cfg, mine = _many_block_hub()
    plan = rebalance(shape, supply, demand, me, [shape.block(r) for r in mine], assign_config=cfg)
    assert plan is not None
    held = {e for b in plan.target for e in range(b.experts[0], b.experts[1] + 1)}
    assert {0, 8, 15} <= held and {3, 4, 5} <= held and len(held) <= 6
    others = supply.changed(mine, me.throughput, -1)
    assert not check_plan(shape, others.replicas, plan, 6)


def test_an_edge_device_moves_to_cover_and_a_move_must_be_worth_its_cost() -> None:
    """A slow machine moves to cover an expert nobody holds, not for count replicas (the edge
    tier's joiners place those; ``edge_levels`` can allow it), and a move for replicas must add
    more than ``move_cost`` times the model's experts."""
    demand = Demand.from_counts(np.array([[9.0, 1, 1, 1, 1, 1]] * 4))
    me = Volunteer(SHAPE.expert_bytes, 1.0, "edge")
    supply = Supply.empty(SHAPE)
    for layer in range(4):  # layer 3's holder is slow: its experts have no fast holder, so the hubs'
        supply = supply.changed([Rect(layer, layer, 0, 5)], 1.0 if layer < 3 else 1e-3, +1)  # memory is spent
    mine = Rect(3, 3, 5, 5)  # a second copy of a cold expert
    supply = supply.changed([mine], me.throughput, +1)
    assert rebalance(SHAPE, supply, demand, me, [SHAPE.block(mine)]) is None  # hot experts lack replicas
    # 25 slots in all, one per expert and the last to a hot one: an expert 0 lacks its second copy
    counts = RebalanceConfig(edge_levels=4)
    plan = rebalance(SHAPE, supply, demand, me, [SHAPE.block(mine)], config=counts)
    assert plan is not None and plan.target[0].experts == (0, 0) and plan.gain == 1.0
    assert rebalance(SHAPE, supply, demand, me, [SHAPE.block(mine)],  # a move must add more than 1
                     config=RebalanceConfig(edge_levels=4, move_cost=1.0 / SHAPE.cells)) is None
    hole = supply.changed([Rect(2, 2, 0, 5)], 1.0, -1)  # layer 2's holder left
    plan = rebalance(SHAPE, hole, demand, me, [SHAPE.block(mine)])
    assert plan is not None and plan.gain == float("inf")


def test_an_edge_device_releases_idle_blocks_for_missing_replicas() -> None:
    """A slow machine of 4 experts in blocks of its own holds the only copy of expert 14 and
    copies of 8 and 9 that a hub also holds (nothing lacks a replica there: idle). The hot experts
    0-3 (wanted 20x) have one holder, and the swarm's 19 slots give 0, 1 and 2 (ties to the lower
    index) a second replica: it keeps 14 and swaps 8-9 for 0-2, though it moves only to cover
    (``edge_levels=1``); idle memory below ``release_share`` of its own stays put."""
    shape = ModelShape("org/m", (0,), 16, 10)
    counts = np.ones(shape.grid)
    counts[0, 0:4] = 20.0
    demand = Demand.from_counts(counts)
    me = Volunteer(4 * shape.expert_bytes, 1.0, "edge")
    cfg = AssignConfig(max_blocks=4)
    supply = Supply.empty(shape).changed([Rect(0, 0, 0, 3), Rect(0, 0, 8, 11)], 1e6, +1)  # a hub
    for e in (4, 5, 6, 7, 12, 13, 15):  # slow holders of the rest but 14
        supply = supply.changed([Rect(0, 0, e, e)], 1.0, +1)
    mine = [Rect(0, 0, 8, 9), Rect(0, 0, 14, 14)]
    supply = supply.changed(mine, me.throughput, +1)
    blocks = [shape.block(r) for r in mine]
    plan = rebalance(shape, supply, demand, me, blocks, assign_config=cfg)
    assert plan is not None and plan.target == (Block((0, 0), (14, 14)), Block((0, 0), (0, 2)))
    assert plan.gain == 1.0  # three missing replicas for the three experts it loads
    others = supply.changed(mine, me.throughput, -1)
    assert check_plan(shape, others.replicas, plan, 4) == []
    assert plan.steps == (PlanStep("drop", blocks[0]), PlanStep("add", Block((0, 0), (0, 2))))  # 8-9: the hub's
    # 2 idle experts of 4: released at a share up to a half, not above it, nor with the rule off
    assert rebalance(shape, supply, demand, me, blocks, assign_config=cfg,
                     config=RebalanceConfig(release_share=0.5)) == plan
    for off in (RebalanceConfig(release_share=0.6), RebalanceConfig(release_share=0.0)):
        assert rebalance(shape, supply, demand, me, blocks, assign_config=cfg, config=off) is None


def test_a_hub_gathers_its_swaps_for_first_copies_past_the_move_cost() -> None:
    """The many-block hub above gains one first fast copy by its move (expert 3, wanted 20x of 73
    calls among 16 experts: 1 + 16 * 20 / 73 = 5.38 at level 2; its rate's share carries no
    second): it moves while that is more than ``move_cost`` times the model's 16 experts, not
    once it is less (the hubs' moves were not weighed against it before: only an edge device's)."""
    shape, supply, demand, me, cfg, mine = _many_block_hub()
    blocks = [shape.block(r) for r in mine]
    plan = rebalance(shape, supply, demand, me, blocks, assign_config=cfg, config=RebalanceConfig(move_cost=5 / 16))
    assert plan is not None and Block((0, 0), (3, 5)) in plan.target
    assert rebalance(shape, supply, demand, me, blocks, assign_config=cfg,
                     config=RebalanceConfig(move_cost=6 / 16)) is None
