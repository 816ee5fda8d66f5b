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


# Cases worked by hand from Petals' own code, bigscience-workshop/petals at 22afba6
# (src/petals/server/block_selection.py), not from the port: each docstring gives the lines and
# the arithmetic. Spans are keyed by an integer standing for the PeerID.


def test_throughputs_add_in_peer_id_order_as_petals_does() -> None:
    """block_selection.py lines 17-19: ``for span in sorted(spans.values(), key=peer_id)``: three
    servers on block 0 with 0.1, 0.2, 0.3 are added 0.1, then 0.2, then 0.3, whatever order they
    were announced in: (0.1 + 0.2) + 0.3 = 0.6000000000000001 in floating point, not the 0.6 that
    (0.3 + 0.2) + 0.1 gives. Block 1 is held by nobody: 0."""
    spans = {3: pb.Span(0, 1, 0.3), 2: pb.Span(0, 1, 0.2), 1: pb.Span(0, 1, 0.1)}
    t = pb.compute_throughputs(spans, 2)
    assert t[0] == (0.1 + 0.2) + 0.3 and t[0] != (0.3 + 0.2) + 0.1 and t[1] == 0.0


@pytest.mark.parametrize("num_blocks, start", [(1, 3), (2, 3), (3, 2), (5, 0)])
def test_a_joiner_starts_where_petals_puts_it(num_blocks: int, start: int) -> None:
    """block_selection.py lines 23-25 and 28-33: ``min`` over ``(sorted(window), i)``. Servers
    1: blocks 0-2 at 1.0, 2: block 1 at 1.0, 3: blocks 3-4 at 0.5 give throughputs
    [1, 2, 1, 0.5, 0.5]. One block: the windows are [1], [2], [1], [0.5], [0.5]: the smallest
    is [0.5], first at 3. Two: [1, 2], [1, 2], [0.5, 1], [0.5, 0.5]: 3. Three: [1, 1, 2],
    [0.5, 1, 2], [0.5, 0.5, 1]: 2. Five: the only window, 0."""
    spans = {1: pb.Span(0, 3, 1.0), 2: pb.Span(1, 1, 1.0), 3: pb.Span(3, 2, 0.5)}
    assert pb.choose_best_blocks(num_blocks, spans, 5) == start


def test_petals_breaks_ties_on_the_next_weakest_block_then_the_lowest_start() -> None:
    """Lines 24-25: tuples compare element by element, then by start. Throughputs [0, 1, 0, 2]
    (server 1 on block 1 at 1.0, server 2 on block 3 at 2.0). Two blocks: windows sorted [0, 1],
    [0, 1], [0, 2]: [0, 1] < [0, 2] on the second block, and of the two [0, 1] the lower start,
    0. The same line with the first block made 0.5: [0.5, 1], [0, 1], [0, 2]: 1."""
    spans = {1: pb.Span(1, 1, 1.0), 2: pb.Span(3, 1, 2.0)}
    assert pb.choose_best_blocks(2, spans, 4) == 0
    spans[3] = pb.Span(0, 1, 0.5)
    assert pb.choose_best_blocks(2, spans, 4) == 1


def test_a_server_beside_a_gap_moves_to_cover_it_as_petals_does() -> None:
    """block_selection.py lines 46-95 with balance_quality 0.75 (server.py line 84). Servers 1
    (the caller) and 2 on blocks 0-1 at 1.0 each; blocks 2-3 uncovered: throughputs [2, 2, 0, 0],
    initial 0. Line 53: [0.999, 0.999, 0, 0]. Line 59: initial 0 is not above eps, no split check.
    Line 62: windows [0.999, 0.999], [0, 0.999], [0, 0]: start 2, not 0. Lines 66-68: [1, 1, 1, 1].
    Lines 71-86: server 2 minus 1.001 sees [-0.001, -0.001, 1, 1], best start 0 where it is;
    server 1 likewise stays at 2: nobody moves. Line 88: new 1, not below initial 0 nor eps;
    quality 0 / 1 = 0 < 0.75 - 0.001: True (the simulation ran)."""
    spans = {1: pb.Span(0, 2, 1.0), 2: pb.Span(0, 2, 1.0)}
    assert pb.should_choose_other_blocks(1, spans, 4, np.random.default_rng(0)) == (True, True)


def test_a_server_moves_to_the_weak_block_when_the_gain_is_large() -> None:
    """Two blocks. Servers 1 (caller) and 2 on block 0 at 1.0, server 3 on block 1 at 0.2:
    [2, 0.2], initial 0.2. Line 53: [0.999, 0.2], min above 0. Line 62: start 1. Lines 66-68:
    [1, 1.2]. Lines 71-86: server 2 sees [-0.001, 1.2] (stays at 0), server 3 [1, 0.9998] (stays
    at 1), server 1 [1, 0.1998] (stays at 1). Line 88: new 1; 0.2 / 1 = 0.2 < 0.749: True."""
    spans = {1: pb.Span(0, 1, 1.0), 2: pb.Span(0, 1, 1.0), 3: pb.Span(1, 1, 0.2)}
    for seed in range(4):  # nobody moves in the loop, so the shuffle's order cannot matter
        assert pb.should_choose_other_blocks(1, spans, 2, np.random.default_rng(seed)) == (True, True)


def test_a_server_stays_when_petals_finds_the_gain_too_small() -> None:
    """Three blocks. Server 1 (caller, 0.2) and 2 (1.5) on block 0, 3 (1.0) on block 1, 4 (1.05)
    on block 2: [1.7, 1.0, 1.05], initial 1.0. Line 53: block 0 1.4998; line 62: start 1, not 0.
    Lines 66-68: [1.5, 1.2, 1.05]. Lines 71-86: server 2 sees [-0.0015, 1.2, 1.05] (stays),
    3 sees [1.5, 0.199, 1.05] (stays), 4 sees [1.5, 1.2, -0.00105] (stays), 1 sees
    [1.5, 0.9998, 1.05] (stays). Line 88: new 1.05; quality 1 / 1.05 = 0.952, not below 0.749:
    False (after simulating). And with server 1 (at 1.0) alone on block 1, servers 2 and 4 as
    before: [1.5, 1.0, 1.05]; line 53: [1.5, -0.001, 1.05]; line 59: initial 1.0 > eps and the
    min <= 0: False without simulating (the swarm would split)."""
    spans = {1: pb.Span(0, 1, 0.2), 2: pb.Span(0, 1, 1.5), 3: pb.Span(1, 1, 1.0), 4: pb.Span(2, 1, 1.05)}
    assert pb.should_choose_other_blocks(1, spans, 3, np.random.default_rng(0)) == (False, True)
    alone = {1: pb.Span(1, 1, 1.0), 2: pb.Span(0, 1, 1.5), 4: pb.Span(2, 1, 1.05)}
    assert pb.should_choose_other_blocks(1, alone, 3, np.random.default_rng(0)) == (False, False)


def test_balance_quality_above_one_always_moves() -> None:
    """Lines 43-44: ``balance_quality > 1.0`` returns True before looking at the swarm."""
    even = {1: pb.Span(0, 2, 1.0), 2: pb.Span(2, 2, 1.0)}
    assert pb.should_choose_other_blocks(1, even, 4, np.random.default_rng(0), balance_quality=1.01) == (True, False)


def test_the_eps_on_the_callers_own_span_keeps_it_where_it_is_on_a_tie() -> None:
    """Line 53 subtracts the caller's throughput times 1 + eps ("makes _choose_best_start()
    prefer the previous server position", lines 54-57). Server 2 (1.0) on block 0, servers 1
    (the caller) and 3 (1.0 each) on block 1: [1, 2]. Line 53: [1, 0.999]; line 62: start 1,
    where it is: False without simulating. (Subtracting exactly 1.0 would tie [1, 1] and pick
    start 0.)"""
    spans = {1: pb.Span(1, 1, 1.0), 2: pb.Span(0, 1, 1.0), 3: pb.Span(1, 1, 1.0)}
    assert pb.should_choose_other_blocks(1, spans, 2, np.random.default_rng(0)) == (False, False)


@pytest.mark.parametrize("weak, moves", [(0.7495, False), (0.7485, True)])
def test_petals_moves_below_balance_quality_minus_eps(weak: float, moves: bool) -> None:
    """Line 95: ``actual_quality < balance_quality - eps``, 0.75 - 0.001 = 0.749. Servers 1 (the
    caller, 0.5) and 2 (1.0) on block 0, server 3 (``weak``) on block 1: [1.5, weak], initial
    ``weak``. Line 53: [0.9995, weak]: start 1; lines 66-68: [1.0, weak + 0.5]; lines 71-86:
    server 2 sees [-0.001, ...] and stays, server 3 sees [1.0, 0.5 - 0.001 weak] and stays, the
    caller sees [1.0, weak - 0.0005] and stays. Line 88: new 1.0; quality ``weak``: 0.7495 is not
    below 0.749 (stays), 0.7485 is (moves); both after simulating."""
    spans = {1: pb.Span(0, 1, 0.5), 2: pb.Span(0, 1, 1.0), 3: pb.Span(1, 1, weak)}
    assert pb.should_choose_other_blocks(1, spans, 2, np.random.default_rng(0)) == (moves, True)
