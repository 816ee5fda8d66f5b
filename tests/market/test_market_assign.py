"""Assignment: within memory, covers everything given enough volunteers, replicas follow demand, hubs hot /
edges the tail and count replicas."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeswarm.errors import ConfigError
from moeswarm.market import (
    AssignConfig,
    Block,
    Demand,
    ModelShape,
    Supply,
    Volunteer,
    assign,
    capacity_cells,
    cell_values,
    effective_class,
    hot_mask,
    replica_targets,
)


@st.composite
def swarms(draw: st.DrawFn) -> tuple[ModelShape, Demand, Supply]:
    L, E = draw(st.integers(1, 6)), draw(st.integers(1, 10))
    shape = ModelShape("org/m", tuple(range(0, 2 * L, 2)), E, draw(st.integers(1, 10**8)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    demand = Demand.from_counts(rng.zipf(1.5, size=(L, E)).astype(float))
    reps = rng.integers(0, 4, size=(L, E)) * (rng.random((L, E)) < 0.7)
    supply = Supply(reps.astype(np.int64), reps * rng.random((L, E)) * 100, np.zeros((L, E)), 5, int(reps.sum()))
    return shape, demand, supply


volunteers = st.builds(Volunteer, memory_bytes=st.integers(0, 10**10), throughput=st.floats(0, 1e6),
                       device_class=st.sampled_from(["hub", "edge"]), bandwidth_bytes_s=st.floats(1e3, 1e10),
                       rtt_s=st.floats(0, 0.5))
configs = st.builds(AssignConfig, min_replicas=st.integers(0, 3), max_blocks=st.integers(1, 4),
                    hot_share=st.floats(0, 1), width_bonus=st.floats(0, 1))


@settings(max_examples=200, deadline=None)
@given(swarms(), volunteers, configs)
def test_assignment_never_exceeds_the_volunteers_memory(swarm: tuple[ModelShape, Demand, Supply],
                                                        v: Volunteer, cfg: AssignConfig) -> None:
    shape, demand, supply = swarm
    a = assign(shape, supply, demand, v, cfg)
    rects = [shape.rect(b) for b in a.blocks]
    assert all(r is not None for r in rects)
    mask = np.zeros(shape.grid, dtype=int)
    for r in rects:
        mask[r.slices] += 1  # type: ignore[union-attr]
    assert mask.max(initial=0) <= 1, "blocks overlap"
    assert a.cells == int(mask.sum()) and a.bytes == a.cells * shape.expert_bytes
    assert a.bytes <= v.memory_bytes and len(a.blocks) <= cfg.max_blocks
    assert a.cells <= v.bandwidth_bytes_s * cfg.max_load_s / shape.expert_bytes
    assert a == assign(shape, supply, demand, v, cfg)  # pure and deterministic
    if capacity_cells(shape, v, cfg) >= 1:
        assert a.blocks and a.node_args()[0] == "--layers"
    else:
        assert not a.blocks


@settings(max_examples=60, deadline=None)
@given(swarms(), st.lists(volunteers, min_size=1, max_size=8), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_enough_volunteers_cover_every_expert_with_min_replicas(swarm: tuple[ModelShape, Demand, Supply],
                                                                pool: list[Volunteer], min_replicas: int,
                                                                seed: int) -> None:  # noqa: ARG001
    shape, demand, _ = swarm
    cfg = AssignConfig(min_replicas=min_replicas)
    supply = Supply.empty(shape)
    # joiners hold >= 1 expert each: after cells * min_replicas of them the slots allow min_replicas
    # everywhere, and from then on each one fixes an expert below it or adds the copy its tier owes
    # (a fast volunteer: the first fast copy of an expert), of which there are at most cells, so
    # three times that many suffice
    joiners = 0
    while supply.replicas.min() < min_replicas:
        assert joiners < 3 * shape.cells * min_replicas, "min_replicas not reached"
        v = pool[joiners % len(pool)]
        v = Volunteer(max(v.memory_bytes, shape.expert_bytes), v.throughput, v.device_class, 1e12, v.rtt_s)
        before = supply.replicas.copy()
        target = replica_targets(shape, supply, demand, capacity_cells(shape, v, cfg), cfg)
        a = assign(shape, supply, demand, v, cfg)
        rect = shape.rect(a.blocks[0])
        assert rect is not None
        if (before == 0).any():  # every joiner covers at least one uncovered expert while there is one
            assert (before[rect.slices] == 0).any()
        elif supply.held_cells + capacity_cells(shape, v, cfg) >= shape.cells * min_replicas and (before < min_replicas).any():
            # then, once the slots allow it, one short of min_replicas (the target is at least that)
            owed = cell_values(shape, supply, demand, v, cfg).tier > 0  # or its tier's copy, which comes first
            assert (target >= min_replicas).all()
            assert (before[rect.slices] < min_replicas).any() or owed[rect.slices].any()
        supply = supply.changed([rect], v.throughput, +1)
        joiners += 1
    assert supply.coverage() == 1.0


def test_replicas_follow_demand_and_edge_devices_cover_the_tail() -> None:
    shape = ModelShape("org/m", tuple(range(8)), 32, 1_000_000)
    rng = np.random.default_rng(0)
    counts = np.stack([rng.permutation(1.0 / np.arange(1, 33)) for _ in range(8)])
    demand = Demand.from_counts(counts)
    reps = np.full(shape.grid, 2, dtype=np.int64)  # covered twice: count replicas and serving are left
    supply = Supply(reps, reps * 10.0, np.zeros(shape.grid), 64, int(reps.sum()))
    hub = assign(shape, supply, demand, Volunteer(8_000_000, 50_000, "hub"), AssignConfig())
    edge = assign(shape, supply, demand, Volunteer(8_000_000, 500, "edge", rtt_s=0.1), AssignConfig())
    far = assign(shape, supply, demand, Volunteer(8_000_000, 50_000, "hub", rtt_s=0.2), AssignConfig())

    # replicas follow demand: the hub's block gathers the most replicas that demand asks for beyond
    # the two every expert has (replicas proportional to demand, computed here by sorting, not by
    # the market); the edge device's does too once some experts have no fast holder (the hubs'
    # memory is spent: the count replicas come from the edge tier's), not before (the hot experts'
    # are the hubs')
    slots = int(reps.sum()) + 8
    order = np.argsort(-demand.share.reshape(-1))
    c = slots / demand.share.sum()
    while np.maximum(np.floor(c * demand.share), 1).sum() > slots:
        c *= 0.999
    deficit = np.clip(np.maximum(np.floor(c * demand.share), 2) - 2, 0, None)
    assert deficit.reshape(-1)[order[0]] > 0
    best = max(deficit[r0:r1 + 1, e0:e1 + 1].sum() for r0 in range(8) for r1 in range(r0, 8) for e0 in range(32)
               for e1 in range(e0, 32) if (r1 - r0 + 1) * (e1 - e0 + 1) <= 8)

    def gathered(a) -> tuple[float, float]:  # type: ignore[no-untyped-def]  # (replicas lacking, demand) in its block
        rect = shape.rect(a.blocks[0])
        assert rect is not None
        return float(deficit[rect.slices].sum()), float(demand.share[rect.slices].sum())

    assert gathered(hub)[0] >= 0.9 * best
    rect = shape.rect(edge.blocks[0])  # no count replica of a hot expert: those are the hubs'
    assert rect is not None and (deficit * hot_mask(demand.share, AssignConfig().hot_share))[rect.slices].sum() == 0
    assert far.blocks == edge.blocks  # a hub too far away is placed like an edge device
    slow = supply.throughput.copy()
    slow.reshape(-1)[order[-32:]] = 0.001  # the coldest 32 held by slow machines only: the tail
    tail = Supply(reps, slow, np.zeros(shape.grid), 64, int(reps.sum()))
    edge = assign(shape, tail, demand, Volunteer(8_000_000, 500, "edge", rtt_s=0.1), AssignConfig())
    assert gathered(edge)[0] >= 0.9 * best

    # an expert nobody holds: a hub covers the hottest, an edge device the coldest (the tail, beyond
    # what the hubs' copies reach; a hub will take the hot one)
    hottest, coldest = np.unravel_index(order[0], shape.grid), np.unravel_index(order[-1], shape.grid)
    holes = reps.copy()
    holes[hottest] = holes[coldest] = 0
    supply = Supply(holes, holes * 10.0, np.zeros(shape.grid), 64, int(holes.sum()))
    one = 1_000_000  # one expert
    hub = assign(shape, supply, demand, Volunteer(one, 50_000, "hub"), AssignConfig())
    edge = assign(shape, supply, demand, Volunteer(one, 500, "edge", rtt_s=0.1), AssignConfig())
    assert hub.blocks == (Block((int(hottest[0]),) * 2, (int(hottest[1]),) * 2),)
    assert edge.blocks == (Block((int(coldest[0]),) * 2, (int(coldest[1]),) * 2),)


def test_a_hub_whose_link_serves_little_is_placed_like_an_edge_device() -> None:
    """Capacity, not only the declared class, decides the tier: a home box on a slow uplink among
    fast hubs (its rate per expert under edge_rate_share of the swarm's mean) covers the tail."""
    shape = ModelShape("org/m", (0, 1), 8, 1_000_000)
    share = np.array([[8.0, 4, 2, 1, 1, 1, 1, 1], [8, 4, 2, 1, 1, 1, 1, 1]])
    demand = Demand.from_counts(share)
    hot = hot_mask(demand.share, AssignConfig().hot_share)
    reps = np.full(shape.grid, 2, dtype=np.int64)
    reps[0, 0] = reps[1, 7] = 0  # nobody holds the hottest expert of layer 0, nor a tail expert of layer 1
    assert hot[0, 0] and not hot[1, 7]
    supply = Supply(reps, reps * 5_000.0, np.zeros(shape.grid), 7, int(reps.sum()))  # 5,000 pairs/s per held expert
    cfg, off = AssignConfig(call_bytes=10_000), AssignConfig(call_bytes=10_000, edge_rate_share=0.0)

    def placed(v: Volunteer, c: AssignConfig = cfg) -> tuple[Block, ...]:
        return assign(shape, supply, demand, v, c).blocks

    slow = Volunteer(1_000_000, 1e6, "hub", upload_bytes_s=1e6)  # one expert; its link: 100 pairs/s
    fast = Volunteer(1_000_000, 1e6, "hub", upload_bytes_s=1e10)  # 1e6 pairs/s
    near = Volunteer(1_000_000, 1e6, "hub", upload_bytes_s=1e7)  # 1,000 pairs/s: a fifth of the mean
    edge = Volunteer(1_000_000, 1e6, "edge", upload_bytes_s=1e10)
    assert effective_class(slow, cfg, rate_per_expert=100.0, swarm_rate_per_expert=5_000.0) == "edge"
    assert effective_class(slow, cfg) == "hub"  # no swarm rate known: the declared class
    tail, top = (Block((1, 1), (7, 7)),), (Block((0, 0), (0, 0)),)
    assert placed(fast) == placed(near) == placed(slow, off) == top  # hubs cover the hot expert first
    assert placed(slow) == placed(edge) == tail  # too slow to serve it: covers the tail like an edge device
    with pytest.raises(ConfigError):
        AssignConfig(edge_rate_share=1.0)


def test_uncovered_experts_come_before_the_tier_and_capacity_rules() -> None:
    shape = ModelShape("org/m", (0, 1), 4, 100)
    reps = np.ones(shape.grid, dtype=np.int64) * 3
    reps[1, 2] = 0  # nobody holds layer 1, expert 2
    supply = Supply(reps, reps * 1.0, np.zeros(shape.grid), 3, int(reps.sum()))
    demand = Demand.uniform(shape)
    for cls in ("hub", "edge"):
        a = assign(shape, supply, demand, Volunteer(100, 1.0, cls), AssignConfig())  # type: ignore[arg-type]
        assert a.blocks == (Block((1, 1), (2, 2)),) and a.node_args() == ["--layers", "1-1", "--experts", "2-2"]
    by_link = Volunteer(10**9, 1.0, "hub", bandwidth_bytes_s=1.0)
    assert capacity_cells(shape, by_link, AssignConfig(max_load_s=250)) == 2
    empty = assign(shape, supply, demand, Volunteer(99, 1.0), AssignConfig())
    assert empty.blocks == () and empty.bytes == 0
    with pytest.raises(ConfigError):
        empty.node_args()
    with pytest.raises(ConfigError):
        Volunteer(1, 1.0, "phone")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        AssignConfig(max_blocks=0)


def test_a_hub_adds_the_first_fast_copy_and_an_edge_device_a_count_replica() -> None:
    """Hubs carry nearly all the serving rate, so a hub's memory goes first to the hottest expert
    no fast holder serves (not to a second copy of one a hub already serves), and a slow machine's
    to the replica demand asks for most (here a second copy of the hottest expert)."""
    shape = ModelShape("org/m", (0,), 8, 1_000_000)
    demand = Demand.from_counts(np.array([[8.0, 7, 6, 5, 4, 3, 2, 1]]))
    reps = np.ones(shape.grid, dtype=np.int64)  # every expert held once
    tput = np.array([[1e6, 1e6, 1.0, 1.0, 1.0, 1.0, 1.0, 1e6]])  # 0, 1 and the coldest (7) by fast holders
    supply = Supply(reps, tput, np.zeros(shape.grid), 8, 8)
    cfg = AssignConfig(edge_rate_share=0.1)
    hub = assign(shape, supply, demand, Volunteer(shape.expert_bytes, 1e6, "hub"), cfg)
    edge = assign(shape, supply, demand, Volunteer(shape.expert_bytes, 1.0, "edge"), cfg)
    # expert 2: the hottest without a fast holder (experts 0 and 1, hotter, have one; by count alone
    # the hub would add a second copy of expert 0)
    assert hub.blocks == (Block((0, 0), (2, 2)),)
    # 9 slots in all, proportional to demand 8:7:...:1 (sum 36): expert 0 deserves 2, every other one 1
    assert edge.blocks == (Block((0, 0), (0, 0)),)
    off = AssignConfig(edge_rate_share=0.0)  # the tier rule off: no tier copies, count and serving decide
    assert assign(shape, supply, demand, Volunteer(shape.expert_bytes, 1e6, "hub"), off).blocks == (Block((0, 0), (0, 0)),)


def test_a_hub_values_first_fast_copies_only_as_far_as_its_rate_carries() -> None:
    """A first fast copy sends the hub that expert's calls; past its share of the swarm's rate they
    are more than it serves. So it values them for the most demanded experts without a fast holder
    while the demand before each is under ``rate / (others' rate + rate)``, and no further."""
    shape = ModelShape("org/m", (0,), 10, 1_000_000)
    demand = Demand.from_counts(np.array([[30.0, 20, 15, 10, 8, 6, 4, 3, 2, 2]]))  # shares 0.30, 0.20, ...
    reps = np.ones(shape.grid, dtype=np.int64)
    tput = np.array([[1000.0] + [1.0] * 9])  # expert 0 by a fast holder, 1-9 by slow ones: 1,009 pairs/s
    supply = Supply(reps, tput, np.zeros(shape.grid), 10, 10)
    cfg = AssignConfig(edge_rate_share=0.1)

    def valued(rate: float) -> list[int]:
        hub = Volunteer(5 * shape.expert_bytes, rate, "hub")
        return np.flatnonzero(cell_values(shape, supply, demand, hub, cfg).tier[0] > 0).tolist()

    # a quarter of the swarm's rate (1009 / 3 of 1009 + 1009 / 3): experts 1 (0.20; nothing before)
    # and 2 (0.15; 0.20 before), not 3 (0.35 before)
    assert valued(1009 / 3) == [1, 2]
    # half of it: 1-4 (0.45 before expert 4), not 5 (0.53 before)
    assert valued(1009.0) == [1, 2, 3, 4]
    # its blocks hold those two first copies
    hub = assign(shape, supply, demand, Volunteer(5 * shape.expert_bytes, 1009 / 3, "hub"), cfg)
    assert {e for b in hub.blocks for e in range(b.experts[0], b.experts[1] + 1)} >= {1, 2}
