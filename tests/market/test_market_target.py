"""Replicas that follow demand: target counts, the signed block search, several blocks per volunteer,
what a volunteer's link lets it serve."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moeswarm.errors import ConfigError
from moeswarm.market import (
    AssignConfig,
    Demand,
    ModelShape,
    Rect,
    Supply,
    Volunteer,
    assign,
    best_signed_rect,
    target_replicas,
)
from moeswarm.market._grid import SignedSearch


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1e3), min_size=1, max_size=40), st.integers(0, 400), st.integers(0, 2),
       st.one_of(st.none(), st.integers(2, 30)))
@example([999.9999999999999, 1000.0], 1, 0, None)  # equal logs: the last slot went to the lighter one
def test_targets_are_proportional_within_floor_and_cap(weights: list[float], slots: int, floor: int,
                                                       cap: int | None) -> None:
    w = np.array(weights)
    if w.sum() <= 0:
        with pytest.raises(ConfigError):
            target_replicas(w, slots, floor=floor, cap=cap)
        return
    t = target_replicas(w, slots, floor=floor, cap=cap)
    hi = cap if cap is not None else max(slots, floor)
    assert t.shape == w.shape and t.min() >= floor and t.max() <= hi
    n, pos = w.size, int((w > 0).sum())
    if floor * n <= slots <= floor * (n - pos) + hi * pos:
        assert t.sum() == slots
    for i in range(n):
        for j in range(n):
            if w[i] > w[j]:
                assert t[i] >= t[j]  # more weight, never fewer replicas
    if floor == 0 and cap is None and slots > 0:  # no clipping: Hamilton's apportionment of the slots
        q = slots * w / w.sum()
        assert np.all(t >= np.floor(q) - 1e-9) and np.all(t <= np.ceil(q) + 1e-9)


def test_targets_follow_demand_times_cost() -> None:
    t = target_replicas(np.array([8.0, 4.0, 2.0, 1.0, 1.0]), 20)
    assert t.tolist() == [8, 4, 2, 1, 1] or t.sum() == 20 and t[0] > t[1] > t[2] >= t[3]
    flat = target_replicas(np.array([1.0, 1.0]), 10, cost=np.array([4.0, 1.0]))
    assert flat.tolist() == [8, 2]
    assert target_replicas(np.array([5.0, 0.0, 1.0]), 2).tolist() == [1, 1, 1]  # fewer slots than experts: floor


def _brute(values: np.ndarray, cap: int) -> float:
    L, E = values.shape
    return max(float(values[r0:r1 + 1, e0:e1 + 1].sum()) for r0 in range(L) for r1 in range(r0, L)
               for e0 in range(E) for e1 in range(e0, E) if (r1 - r0 + 1) * (e1 - e0 + 1) <= cap)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5), st.integers(1, 7), st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_signed_search_finds_the_best_rectangle_of_any_shape(L: int, E: int, cap: int, seed: int) -> None:
    values = np.random.default_rng(seed).normal(size=(L, E))
    found = best_signed_rect(values, cap)
    assert found is not None
    rect, s = found
    assert rect.cells <= cap and s == pytest.approx(float(values[rect.slices].sum()))
    assert s == pytest.approx(_brute(values, cap))
    assert best_signed_rect(values, 0) is None


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 2**32 - 1), st.booleans())
def test_repeated_searches_over_a_lowered_grid_answer_as_a_fresh_search(L: int, E: int, seed: int,
                                                                         ties: bool) -> None:
    """``SignedSearch`` (``_choose_signed``'s up to 64 searches, each after the block found is set
    below every value) skips shapes whose earlier best cannot win: every answer, rectangle and sum,
    is the fresh ``best_signed_rect``'s on the grid as it is then (ties too: small integers)."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-2, 3, size=(L, E)).astype(float) if ties else rng.normal(size=(L, E))
    search = SignedSearch(values.copy())
    floor = -2.0 * (float(np.abs(values).sum()) + 1.0)
    for _ in range(L * E):
        cap = int(rng.integers(1, L * E + 1))
        fresh = best_signed_rect(search.values.copy(), cap)
        found = search.best(cap)
        assert found == fresh
        assert found is not None and found[1] == pytest.approx(_brute(search.values, cap))
        search.lower(found[0], floor)


def test_a_volunteer_with_several_blocks_gathers_the_scattered_hot_experts() -> None:
    shape = ModelShape("org/m", tuple(range(4)), 16, 1000)
    rng = np.random.default_rng(1)
    counts = np.stack([rng.permutation(1.0 / np.arange(1, 17) ** 1.5) for _ in range(4)])
    demand = Demand.from_counts(counts)
    reps = np.ones(shape.grid, dtype=np.int64)  # covered once: only extra replicas are left to place
    supply = Supply(reps, reps * 1.0, np.zeros(shape.grid), 4, int(reps.sum()))
    me = Volunteer(4 * 1000, 100.0, "hub")
    one = assign(shape, supply, demand, me, AssignConfig(max_blocks=1))
    four = assign(shape, supply, demand, me, AssignConfig(max_blocks=4))
    hottest = {tuple(x) for x in np.argwhere(counts == counts.max(axis=1, keepdims=True))}  # each layer's top expert

    def cells(a) -> set[tuple[int, int]]:  # type: ignore[no-untyped-def]
        out = set()
        for b in a.blocks:
            r: Rect = shape.rect(b)
            out |= {(i, j) for i in range(r.r0, r.r1 + 1) for j in range(r.e0, r.e1 + 1)}
        return out

    assert len(four.blocks) == 4 and cells(four) == hottest  # one block per layer's top expert
    assert len(cells(one) & hottest) <= 1 < len(hottest)  # one 4-expert block reaches at most one of them


def test_a_volunteer_serves_what_its_link_carries() -> None:
    v = Volunteer(10**9, 5000.0, "hub", bandwidth_bytes_s=11.2e6, upload_bytes_s=6.1e6)
    assert v.serving_rate(0) == 5000.0
    assert v.serving_rate(12288) == pytest.approx(6.1e6 / 12288)  # upload-bound: the office link of seed 000
    assert Volunteer(10**9, 100.0).serving_rate(12288) == 100.0  # compute-bound
    with pytest.raises(ConfigError):
        Volunteer(1, 1.0, upload_bytes_s=0.0)
    with pytest.raises(ConfigError):
        AssignConfig(block_cells=0)
