"""The model's expert grid: MoE layers x experts, the blocks volunteers hold, rectangle sums.

Every array in the market is an ``(L, E)`` grid: row ``i`` is the ``i``-th MoE layer of the
model (``shape.moe_layers[i]`` in the model's own layer numbering), column ``e`` is expert ``e``.
A ``Block`` is what one node announces: one inclusive layer range times one inclusive expert
range, in the model's numbering, exactly like ``Announcement.layers`` / ``Announcement.experts``.
Internally blocks become ``Rect``: inclusive row and column ranges of the grid.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from moeswarm.errors import ConfigError

MAX_GRID_CELLS = 1 << 22
"""Largest ``L x E`` grid the market handles (4M experts)."""


@dataclass(frozen=True)
class ModelShape:
    """What the market needs to know about a model."""

    model_id: str  # the model's name in the swarm, as in announcements
    moe_layers: tuple[int, ...]  # model layer numbers of the MoE layers, strictly ascending
    num_experts: int  # routed experts per MoE layer
    expert_bytes: int  # bytes one expert's weights take on a volunteer, as it loads them

    def __post_init__(self) -> None:
        layers = tuple(int(x) for x in self.moe_layers)
        object.__setattr__(self, "moe_layers", layers)
        if not self.model_id:
            raise ConfigError("model_id must not be empty")
        if not layers or any(x < 0 for x in layers) or any(a >= b for a, b in zip(layers, layers[1:])):
            raise ConfigError("moe_layers must be non-negative and strictly ascending, at least one")
        if self.num_experts < 1 or self.expert_bytes < 1:
            raise ConfigError("num_experts and expert_bytes must be positive")
        if len(layers) * self.num_experts > MAX_GRID_CELLS:
            raise ConfigError(f"{len(layers)} x {self.num_experts} experts exceed {MAX_GRID_CELLS}")

    @property
    def num_layers(self) -> int:
        """L, the number of MoE layers (grid rows)."""
        return len(self.moe_layers)

    @property
    def grid(self) -> tuple[int, int]:
        """``(L, E)``, the shape of every market array."""
        return self.num_layers, self.num_experts

    @property
    def cells(self) -> int:
        """Experts in the whole model (``L * E``)."""
        return self.num_layers * self.num_experts

    @property
    def total_bytes(self) -> int:
        """Bytes of all routed experts: what one full replica of the model needs."""
        return self.cells * self.expert_bytes

    def row(self, layer: int) -> int:
        """Grid row of a model layer number; ``ConfigError`` if it is not a MoE layer."""
        i = bisect_left(self.moe_layers, layer)
        if i == len(self.moe_layers) or self.moe_layers[i] != layer:
            raise ConfigError(f"layer {layer} is not a MoE layer of {self.model_id}")
        return i

    def rect(self, block: Block) -> Rect | None:
        """The grid rectangle a block covers (``None`` if it holds no MoE layer or expert)."""
        r0 = bisect_left(self.moe_layers, block.layers[0])
        r1 = bisect_right(self.moe_layers, block.layers[1]) - 1
        e0, e1 = block.experts[0], min(block.experts[1], self.num_experts - 1)
        if r0 > r1 or e0 > e1:
            return None
        return Rect(r0, r1, e0, e1)

    def block(self, rect: Rect) -> Block:
        """The block (model layer numbers) of a grid rectangle."""
        return Block((self.moe_layers[rect.r0], self.moe_layers[rect.r1]), (rect.e0, rect.e1))


@dataclass(frozen=True, order=True)
class Block:
    """One contiguous share of a model: what a node's ``--layers A-B --experts X-Y`` hold."""

    layers: tuple[int, int]  # first, last model layer, inclusive (only MoE layers count)
    experts: tuple[int, int]  # first, last expert in each of those layers, inclusive

    def __post_init__(self) -> None:
        if not (0 <= self.layers[0] <= self.layers[1] and 0 <= self.experts[0] <= self.experts[1]):
            raise ConfigError(f"empty or negative block {self.layers} x {self.experts}")

    def cli_args(self) -> list[str]:
        """The node CLI's flags for this block: ``["--layers", "A-B", "--experts", "X-Y"]``."""
        return ["--layers", f"{self.layers[0]}-{self.layers[1]}",
                "--experts", f"{self.experts[0]}-{self.experts[1]}"]


class Rect(NamedTuple):
    """Inclusive grid rows ``r0..r1`` and columns ``e0..e1``."""

    r0: int
    r1: int
    e0: int
    e1: int

    @property
    def cells(self) -> int:
        return (self.r1 - self.r0 + 1) * (self.e1 - self.e0 + 1)

    @property
    def slices(self) -> tuple[slice, slice]:
        """Numpy index of the rectangle in an ``(L, E)`` grid."""
        return slice(self.r0, self.r1 + 1), slice(self.e0, self.e1 + 1)

    def intersect(self, other: Rect) -> Rect | None:
        r0, r1 = max(self.r0, other.r0), min(self.r1, other.r1)
        e0, e1 = max(self.e0, other.e0), min(self.e1, other.e1)
        return Rect(r0, r1, e0, e1) if r0 <= r1 and e0 <= e1 else None


def cell_mask(grid: tuple[int, int], rects: Iterable[Rect]) -> np.ndarray:
    """``(L, E)`` bool: the cells any of ``rects`` covers."""
    mask = np.zeros(grid, dtype=bool)
    for r in rects:
        mask[r.slices] = True
    return mask


def union_cells(rects: Sequence[Rect]) -> int:
    """Number of distinct cells the rectangles cover (overlaps counted once)."""
    if len(rects) == 1:
        return rects[0].cells
    if not rects:
        return 0
    rows = max(r.r1 for r in rects) + 1
    cols = max(r.e1 for r in rects) + 1
    return int(cell_mask((rows, cols), rects).sum())


def pareto_shapes(capacity: int, grid: tuple[int, int]) -> list[tuple[int, int]]:
    """The maximal ``(rows, cols)`` rectangles with ``rows * cols <= capacity`` in the grid.

    Every smaller rectangle fits inside one of these, so with non-negative cell values the
    best block is always one of them.
    """
    L, E = grid
    shapes: list[tuple[int, int]] = []
    top = min(L, capacity)
    for h in range(1, top + 1):
        w = min(E, capacity // h)
        nxt = min(E, capacity // (h + 1)) if h < top else -1
        if w >= 1 and nxt < w:
            shapes.append((h, w))
    return shapes


Score = tuple[float, ...]
"""A block's value per level, most important first (compared lexicographically)."""


def better(a: Score, b: Score, margin: float = 0.0) -> bool:
    """Whether ``a`` beats ``b``: at the first level where they differ (beyond round-off),
    ``a`` is higher, and by more than ``margin`` (relative) if ``margin > 0``."""
    for x, y in zip(a, b):
        tol = 1e-9 * max(1.0, abs(x), abs(y))
        if x > y * (1.0 + margin) + tol:
            return True
        if x < y - tol or (margin > 0 and x > y + tol):
            return False
    return False


def best_rect(levels: Sequence[np.ndarray], capacity: int, *, width_bonus: float = 0.0) -> tuple[Rect, Score] | None:
    """The rectangle of at most ``capacity`` cells with the best score, and its score.

    ``levels`` are ``(L, E)`` grids of non-negative cell values, most important first; a
    rectangle's score is the tuple of its sums, compared lexicographically, the last level
    multiplied by ``1 + width_bonus * (cols - 1) / (E - 1)`` (wide blocks mean fewer requests
    per layer). Ties go to the first shape in ``pareto_shapes`` order, then the lowest row and
    column: the choice is deterministic. ``None`` if ``capacity < 1``.
    """
    L, E = levels[0].shape
    if capacity < 1:
        return None
    prefixes = [prefix_sum(v) for v in levels]
    best: tuple[Score, Rect] | None = None
    for h, w in pareto_shapes(capacity, (L, E)):
        sums = [p[h:, w:] - p[:-h, w:] - p[h:, :-w] + p[:-h, :-w] for p in prefixes]
        sums[-1] = sums[-1] * (1.0 + width_bonus * ((w - 1) / (E - 1) if E > 1 else 0.0))
        mask = np.ones(sums[0].shape, dtype=bool)
        for level in sums:
            top = float(level[mask].max())
            mask &= level >= top - 1e-9 * max(1.0, abs(top))
        i, j = divmod(int(np.argmax(mask)), mask.shape[1])
        score = tuple(float(level[i, j]) for level in sums)
        if best is None or better(score, best[0]):
            best = (score, Rect(i, i + h - 1, j, j + w - 1))
    assert best is not None
    return best[1], best[0]


def rect_sums(prefix: np.ndarray, rects: np.ndarray) -> np.ndarray:
    """Sums of many rectangles at once: ``rects`` is ``(N, 4)`` of inclusive ``r0, r1, e0, e1``;
    ``prefix`` is the ``(L+1, E+1)`` 2-D prefix sum of a grid."""
    r0, r1, e0, e1 = rects[:, 0], rects[:, 1] + 1, rects[:, 2], rects[:, 3] + 1
    out: np.ndarray = prefix[r1, e1] - prefix[r0, e1] - prefix[r1, e0] + prefix[r0, e0]
    return out


def prefix_sum(grid: np.ndarray) -> np.ndarray:
    """The ``(L+1, E+1)`` 2-D prefix sum of an ``(L, E)`` grid (zero first row and column)."""
    L, E = grid.shape
    out = np.zeros((L + 1, E + 1))
    np.cumsum(np.cumsum(grid, axis=0), axis=1, out=out[1:, 1:])
    return out


def paint(grid: tuple[int, int], rects: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``(L, E)`` grid where each cell holds the sum of ``weights`` of the rectangles covering it.

    ``rects`` is ``(N, 4)`` inclusive ``r0, r1, e0, e1``; O(N + L*E) with a 2-D difference array.
    """
    L, E = grid
    diff = np.zeros((L + 1, E + 1))
    r0, r1, e0, e1 = rects[:, 0], rects[:, 1] + 1, rects[:, 2], rects[:, 3] + 1
    np.add.at(diff, (r0, e0), weights)
    np.add.at(diff, (r0, e1), -weights)
    np.add.at(diff, (r1, e0), -weights)
    np.add.at(diff, (r1, e1), weights)
    out: np.ndarray = np.cumsum(np.cumsum(diff, axis=0), axis=1)[:L, :E]
    return out


class SignedSearch:
    """Repeated ``best_signed_rect`` searches over one grid whose values only go down between them
    (``lower``: a block taken is set below every value): the best sum each rectangle shape reached
    in an earlier search bounds it from above, so a shape whose bound cannot beat the best found
    so far (by the search's own rule, round-off allowed for) is not summed again. The answers are
    those of ``best_signed_rect`` on the grid as it is (a skipped shape could not have changed
    them); a node's choice of up to 64 blocks searches 64 times (``_assign._choose_signed``), and
    most shapes' best rectangles lie away from the block just taken."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values  # owned: ``lower`` writes into it
        self.upper: dict[tuple[int, int], float] = {}  # (rows, cols) -> the best sum it reached
        self.slack = 0.0  # round-off allowance of those sums

    def lower(self, rect: Rect, value: float) -> None:
        """Set the cells of ``rect`` to ``value`` (a value above any of them forgets the bounds)."""
        cells = self.values[rect.slices]
        if (cells < value).any():
            self.upper.clear()
        cells[...] = value

    def best(self, capacity: int) -> tuple[Rect, float] | None:
        """``best_signed_rect(self.values, capacity)``."""
        return best_signed_rect(self.values, capacity, _search=self)


def _unreachable(bound: float, best: float) -> bool:
    """Whether a sum of at most ``bound`` cannot replace a best of ``best`` (``best_signed_rect``'s
    rule: it must exceed ``best - tol``, ``tol = 1e-9 * max(1, |sum|)``, which grows with the sum)."""
    return bound + 1e-9 * max(1.0, abs(bound)) <= best


def best_signed_rect(values: np.ndarray, capacity: int, *, _search: SignedSearch | None = None
                     ) -> tuple[Rect, float] | None:
    """The rectangle of at most ``capacity`` cells with the largest sum of ``values`` (which may
    be negative: a cell below the volunteer's opportunity cost), over every shape, and its sum.

    Ties go to fewer cells (the same gain in less memory leaves room for another block: a gap of
    8 + 4 experts in an L is two blocks, not one 12-cell rectangle that spends 2 on held experts
    and misses 2), then the lowest row and column. O(capacity log capacity x L x E)
    (every ``h x w`` with ``h * w <= capacity``). ``None`` if ``capacity < 1``.
    """
    L, E = values.shape
    if capacity < 1:
        return None
    p = prefix_sum(values)
    upper = {} if _search is None else _search.upper
    slack = 0.0
    if _search is not None:  # sums of (L+E)-term prefix differences: error well under 1e-10 of the magnitudes
        _search.slack = max(_search.slack, 1e-10 * float(np.abs(values).sum()))
        slack = 2.0 * _search.slack  # the bound's round-off and this search's
    best: tuple[float, int, Rect] | None = None
    for h in range(1, min(L, capacity) + 1):
        rows: np.ndarray | None = None
        for w in range(1, min(E, capacity // h) + 1):
            bound = upper.get((h, w))
            if bound is not None and best is not None and _unreachable(bound + slack, best[0]):
                continue
            if rows is None:
                rows = p[h:, :] - p[:-h, :]  # (L-h+1, E+1): column prefix sums of every h-row band
            sums = rows[:, w:] - rows[:, :-w]
            k = int(sums.argmax())
            s = float(sums.flat[k])
            if _search is not None:
                upper[(h, w)] = s
            tol = 1e-9 * max(1.0, abs(s))
            if best is None or s > best[0] + tol or (s > best[0] - tol and h * w < best[1]):
                i, j = divmod(k, sums.shape[1])
                best = (s, h * w, Rect(i, i + h - 1, j, j + w - 1))
    assert best is not None
    return best[2], best[0]
