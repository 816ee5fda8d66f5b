"""The expert grid: block <-> rectangle conversion, maximal shapes, and the block search against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeswarm.errors import ConfigError
from moeswarm.market import Block, ModelShape, Rect, best_rect, better, pareto_shapes
from moeswarm.market._grid import paint, prefix_sum, rect_sums

SHAPE = ModelShape("org/m", (1, 3, 5, 7), 8, 1000)  # MoE layers interleaved with dense ones


def test_blocks_map_to_rows_of_moe_layers_and_back() -> None:
    assert SHAPE.grid == (4, 8) and SHAPE.cells == 32 and SHAPE.total_bytes == 32_000
    assert SHAPE.rect(Block((3, 5), (2, 4))) == Rect(1, 2, 2, 4)
    assert SHAPE.rect(Block((2, 6), (0, 99))) == Rect(1, 2, 0, 7)  # dense ends and experts past E are clipped
    assert SHAPE.rect(Block((8, 9), (0, 1))) is None
    assert SHAPE.block(Rect(0, 3, 0, 7)) == Block((1, 7), (0, 7))
    assert Block((3, 5), (0, 31)).cli_args() == ["--layers", "3-5", "--experts", "0-31"]
    assert SHAPE.row(5) == 2
    with pytest.raises(ConfigError):
        SHAPE.row(4)
    for bad in (dict(moe_layers=()), dict(moe_layers=(2, 1)), dict(num_experts=0), dict(expert_bytes=0)):
        with pytest.raises(ConfigError):
            ModelShape(**{**dict(model_id="m", moe_layers=(0,), num_experts=1, expert_bytes=1), **bad})  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Block((2, 1), (0, 0))


@given(st.integers(1, 80), st.integers(1, 9), st.integers(1, 12))
def test_pareto_shapes_are_maximal_and_contain_every_fitting_shape(cap: int, L: int, E: int) -> None:
    shapes = pareto_shapes(cap, (L, E))
    assert all(1 <= h <= L and 1 <= w <= E and h * w <= cap for h, w in shapes)
    for h in range(1, L + 1):
        for w in range(1, E + 1):
            if h * w <= cap:
                assert any(h <= a and w <= b for a, b in shapes)


def _brute(levels: list[np.ndarray], cap: int) -> tuple[float, ...]:
    L, E = levels[0].shape
    best: tuple[float, ...] | None = None
    for r0 in range(L):
        for r1 in range(r0, L):
            for e0 in range(E):
                for e1 in range(e0, E):
                    if (r1 - r0 + 1) * (e1 - e0 + 1) <= cap:
                        s = tuple(float(v[r0:r1 + 1, e0:e1 + 1].sum()) for v in levels)
                        if best is None or better(s, best):
                            best = s
    assert best is not None
    return best


grids = st.tuples(st.integers(1, 5), st.integers(1, 6)).flatmap(
    lambda d: st.lists(st.lists(st.integers(0, 3), min_size=d[0] * d[1], max_size=d[0] * d[1]), min_size=2,
                       max_size=2).map(lambda ls: [np.array(x, dtype=float).reshape(d) for x in ls]))


@settings(max_examples=60, deadline=None)
@given(grids, st.integers(1, 30))
def test_best_rect_equals_brute_force_lexicographic_optimum(levels: list[np.ndarray], cap: int) -> None:
    found = best_rect(levels, cap)
    assert found is not None
    rect, score = found
    assert rect.cells <= cap
    assert score == tuple(float(v[rect.slices].sum()) for v in levels)
    assert score == _brute(levels, cap)


def test_paint_and_rect_sums_agree_with_slicing() -> None:
    rng = np.random.default_rng(1)
    rects = np.array([[0, 1, 2, 5], [1, 3, 0, 7], [2, 2, 4, 4]])
    weights = np.array([1.0, 2.0, 4.0])
    painted = paint((4, 8), rects, weights)
    expect = np.zeros((4, 8))
    for (r0, r1, e0, e1), w in zip(rects, weights):
        expect[r0:r1 + 1, e0:e1 + 1] += w
    np.testing.assert_allclose(painted, expect)
    grid = rng.random((4, 8))
    sums = rect_sums(prefix_sum(grid), rects)
    np.testing.assert_allclose(sums, [grid[r0:r1 + 1, e0:e1 + 1].sum() for r0, r1, e0, e1 in rects])


def test_better_uses_the_first_differing_level_and_the_margin() -> None:
    assert better((1.0, 0.0), (0.0, 99.0))
    assert not better((1.0, 5.0), (1.0, 5.0))
    assert better((1.0, 6.0), (1.0, 5.0)) and not better((1.0, 6.0), (1.0, 5.0), margin=0.5)
    assert better((1.0, 8.0), (1.0, 5.0), margin=0.5)
    assert not better((1.2, 99.0), (1.0, 0.0), margin=0.5)  # the first differing level decides
    assert better((2.0, 0.0), (0.0, 0.0), margin=10.0)  # anything beats nothing
