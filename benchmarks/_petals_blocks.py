"""Petals' block selection, ported for ``market_sim.py``'s baseline (the rule itself, on a line of blocks).

Followed: bigscience-workshop/petals at commit 22afba627a7eb4fcfe9418c49472c6a51334b8ac (2024-08-25;
the file's last change is 5ce4f1a, 2023-09-15):

* ``src/petals/server/block_selection.py``
  - lines 12-20 ``compute_throughputs``: a block's throughput is the sum of the throughputs of the
    servers whose span holds it, added in peer-id order;
  - lines 23-25 ``_choose_best_start``: the start whose window, sorted ascending, is smallest
    lexicographically (the weakest block first, then the next weakest...), ties to the lowest start;
  - lines 28-33 ``choose_best_blocks``: a joining server takes ``num_blocks`` blocks from that start;
  - lines 36-37 ``_move_span`` and 40-95 ``should_choose_other_blocks``: take this server out (its
    throughput times ``1 + eps`` so it prefers to stay when things are equal); stay if leaving would
    leave a block with no throughput (the swarm would split) or if its best start is where it is;
    otherwise move it there and let every server, in a random order, move to its own best start,
    round after round until nobody moves; move for real only if ``initial / new`` minimum block
    throughput is below ``balance_quality - eps`` (the swarm's weakest block gains more than 1/0.75).
* ``src/petals/server/server.py`` (same commit)
  - lines 84-86: ``balance_quality = 0.75``, ``mean_balance_check_period = 120`` s,
    ``mean_block_selection_delay = 5`` s;
  - lines 318-321 (``_choose_num_blocks``): ``num_blocks`` = what fits in memory, at most the model's
    blocks; a server that cannot hold one block is refused (``assert num_blocks >= 1``);
  - lines 366-380 (``run``): after each ``random() * 2 * mean_balance_check_period`` seconds the server
    calls ``should_choose_other_blocks``; if it says yes the server shuts down its blocks and, lines
    403-411 (``_choose_blocks``), after ``random() * 2 * mean_block_selection_delay`` s calls
    ``choose_best_blocks`` on the swarm as announced then (itself no longer in it).
* ``src/petals/utils/dht.py`` lines 134-153 (``compute_spans``): joining servers count too
  (``min_state=JOINING``); ``src/petals/server/throughput.py`` lines 98-103: the announced
  throughput is the compute per block over the ``(num_blocks + 1) / 2`` blocks a request uses on
  average, at most the network's (``market_sim.py`` says what it announces instead, and why).

Spans here are keyed by an integer node id (Petals: the ``PeerID``, whose order sets the addition
order). Petals draws the shuffle from the global ``np.random``; here a seeded ``Generator``.
``choose_best_start`` is vectorised (sort every window, then narrow the candidates column by
column); ``choose_best_start_reference`` is the plain loop it is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

EPS = 1e-3  # block_selection.py line 49
BALANCE_QUALITY = 0.75  # server.py line 84
MEAN_BALANCE_CHECK_PERIOD_S = 120.0  # server.py line 85
MEAN_BLOCK_SELECTION_DELAY_S = 5.0  # server.py line 86


@dataclass
class Span:
    """A server's contiguous blocks ``start .. start + length - 1`` and its announced throughput."""

    start: int
    length: int
    throughput: float

    @property
    def end(self) -> int:
        return self.start + self.length


def compute_throughputs(spans: dict[int, Span], total_blocks: int) -> np.ndarray:
    """Per-block sum of the holders' throughputs, added in a fixed (id) order (lines 12-20)."""
    out = np.zeros(total_blocks)
    for key in sorted(spans):
        s = spans[key]
        out[s.start:s.end] += s.throughput
    return out


def choose_best_start(throughputs: np.ndarray, num_blocks: int) -> int:
    """Lines 23-25: the start whose sorted window is lexicographically smallest, lowest start on ties."""
    if num_blocks == 1:
        return int(np.argmin(throughputs))  # first minimum: the lowest start among equals
    windows = np.sort(sliding_window_view(throughputs, num_blocks), axis=1)  # (starts, num_blocks)
    cand = np.arange(len(windows))
    for col in range(num_blocks):
        v = windows[cand, col]
        cand = cand[v == v.min()]
        if len(cand) == 1:
            break
    return int(cand[0])


def choose_best_start_reference(throughputs: np.ndarray, num_blocks: int) -> int:
    """The same choice as a plain loop over starts (what the vectorised one is checked against)."""
    best: tuple[list[float], int] | None = None
    for i in range(len(throughputs) - num_blocks + 1):
        option = (sorted(throughputs[i:i + num_blocks].tolist()), i)
        if best is None or option < best:
            best = option
    assert best is not None
    return best[1]


def choose_best_blocks(num_blocks: int, spans: dict[int, Span], total_blocks: int) -> int:
    """Lines 28-33: where a (re)joining server of ``num_blocks`` blocks starts."""
    return choose_best_start(compute_throughputs(spans, total_blocks), num_blocks)


def should_choose_other_blocks(local: int, spans: dict[int, Span], total_blocks: int, rng: np.random.Generator,
                               balance_quality: float = BALANCE_QUALITY) -> tuple[bool, bool]:
    """Lines 40-95. Returns (move?, whether the simulated rebalancing of every server was run)."""
    if balance_quality > 1.0:
        return True, False
    spans = {k: Span(s.start, s.length, s.throughput) for k, s in spans.items()}  # simulated moves are private
    t = compute_throughputs(spans, total_blocks)
    initial = t.min()
    me = spans[local]
    t[me.start:me.end] -= me.throughput * (1 + EPS)
    if initial > EPS and t.min() <= 0:
        return False, False  # leaving would split the swarm
    new_start = choose_best_start(t, me.length)
    if new_start == me.start:
        return False, False  # already at its best place
    t[me.start:me.end] += me.throughput * EPS
    me.start = new_start
    t[me.start:me.end] += me.throughput
    moved = True
    while moved:
        order = list(spans)
        rng.shuffle(order)
        moved = False
        for key in order:
            s = spans[key]
            t[s.start:s.end] -= s.throughput * (1 + EPS)
            best = choose_best_start(t, s.length)
            t[s.start:s.end] += s.throughput * EPS
            if best != s.start:
                s.start = best
                moved = True
            t[s.start:s.end] += s.throughput
    new = t.min()
    if new < initial or new < EPS:
        return False, True
    return bool(initial / new < balance_quality - EPS), True
