"""The Petals baseline of ``benchmarks/market_sim.py``: the port of Petals' block selection
(``benchmarks/_petals_blocks.py``) and how its line of blocks is laid on the experts' grid."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _petals_blocks as pb
import market_sim

from moeswarm.market import Rect


@pytest.mark.parametrize("ties", [False, True])
def test_vectorised_best_start_is_the_plain_loop(ties: bool) -> None:
    rng = np.random.default_rng(1 + ties)
    for _ in range(500):
        blocks = int(rng.integers(1, 30))
        n = int(rng.integers(1, blocks + 1))
        t = rng.integers(0, 3, blocks).astype(float) if ties else rng.random(blocks)
        assert pb.choose_best_start(t, n) == pb.choose_best_start_reference(t, n)


def test_joiner_takes_the_weakest_span() -> None:
    assert pb.choose_best_blocks(2, {}, 4) == 0  # empty swarm: the first start
    spans = {1: pb.Span(0, 2, 5.0)}
    assert pb.choose_best_blocks(2, spans, 4) == 2
    spans[2] = pb.Span(2, 2, 1.0)
    assert pb.choose_best_blocks(1, spans, 4) == 2  # the lowest start among the weakest


def test_moves_only_for_a_large_enough_gain() -> None:
    rng = np.random.default_rng(0)
    # blocks 0-1 carry 3, blocks 2-3 carry 1: moving a server over doubles the weakest block
    lopsided = {1: pb.Span(0, 2, 1.0), 2: pb.Span(2, 2, 1.0), 3: pb.Span(0, 2, 1.0), 4: pb.Span(0, 2, 1.0)}
    assert pb.should_choose_other_blocks(3, lopsided, 4, rng) == (True, True)
    # blocks 0-1 carry 1.7, blocks 2-3 carry 1.0: moving server 3 over lifts the weakest to 1.2, a gain
    # below 1 / 0.75: it stays, after simulating everyone's moves
    mild = {1: pb.Span(0, 2, 1.0), 2: pb.Span(2, 2, 1.0), 3: pb.Span(0, 2, 0.5), 4: pb.Span(0, 2, 0.2)}
    assert pb.should_choose_other_blocks(3, mild, 4, rng) == (False, True)
    # leaving would uncover blocks 0-1: it stays without simulating
    split = {1: pb.Span(0, 2, 1.0), 2: pb.Span(2, 2, 1.0)}
    assert pb.should_choose_other_blocks(1, split, 4, rng) == (False, False)
    # already where it is best: it stays without simulating
    even = {1: pb.Span(0, 2, 1.0), 2: pb.Span(2, 2, 1.0), 3: pb.Span(0, 2, 1.0), 4: pb.Span(2, 2, 1.0)}
    assert pb.should_choose_other_blocks(1, even, 4, rng) == (False, False)
    assert lopsided[3].start == 0  # the simulated moves left the caller's spans alone


def test_line_on_the_grid() -> None:
    layers = market_sim.PetalsLine(57, 128, 128)  # Petals as shipped: a block is a whole layer
    assert layers.total == 57 and layers.num_blocks(127) == 0 and layers.num_blocks(10_000) == 57
    assert layers.rects(pb.Span(2, 3, 1.0)) == [Rect(2, 4, 0, 127)]
    fine = market_sim.PetalsLine(57, 128, 32)
    assert fine.rects(pb.Span(3, 3, 1.0)) == [Rect(0, 0, 96, 127), Rect(1, 1, 0, 63)]
    assert fine.rects(pb.Span(3, 6, 1.0)) == [Rect(0, 0, 96, 127), Rect(1, 1, 0, 127), Rect(2, 2, 0, 31)]
