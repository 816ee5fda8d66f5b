"""Regions: holders within a short round trip of each other, from measured round trips.

Decode is round-trip bound: a backbone pays one round trip per MoE layer, so a replica of a hot
expert across an ocean (80-150 ms) costs a person more than any queue. The market therefore
counts, for a hub's first fast copy and for the layers it balances (``cell_values``,
``whole_layers``), the supply *near* the volunteer: the holders its link probes (or pings)
measured within ``NEAR_RTT_S``. Regions are not declared anywhere: they are the clusters of
peers that short round trips connect (``round_trip_regions``); each volunteer only needs its own
round trips (``near_supply``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import numpy as np

from ._grid import ModelShape
from ._supply import HolderLike, Supply, supply_from_holders

NEAR_RTT_S: Final = 0.02
"""Round trip under which two peers are in one region, seconds: a continent's backbone links are
within it, an ocean (80-150 ms) is not."""


def round_trip_regions(rtt_s: np.ndarray, max_rtt_s: float = NEAR_RTT_S) -> np.ndarray:
    """``(n,)`` region labels (0, 1, ... in order of first member) for ``n`` peers whose round
    trips ``rtt_s`` ``(n, n)`` were measured (inf: not measured): the clusters that round trips
    of at most ``max_rtt_s`` connect, each direction's measurement counted (single linkage)."""
    n = rtt_s.shape[0]
    close = (rtt_s <= max_rtt_s) | (rtt_s.T <= max_rtt_s)
    labels = np.full(n, -1, dtype=np.int64)
    region = 0
    for start in range(n):
        if labels[start] >= 0:
            continue
        labels[start] = region
        stack = [start]
        while stack:  # a breadth of at most n peers: bounded
            i = stack.pop()
            for j in np.flatnonzero(close[i] & (labels < 0)):
                labels[j] = region
                stack.append(int(j))
        region += 1
    return labels


def near_supply(shape: ModelShape, holders: Iterable[HolderLike], round_trips: Mapping[bytes, float], *,
                max_rtt_s: float = NEAR_RTT_S, now_ms: int | None = None) -> Supply:
    """The supply of the holders measured within ``max_rtt_s`` of this peer (``round_trips``:
    peer -> measured round trip, seconds; a holder not measured is not counted near)."""
    close = [h for h in holders if round_trips.get(h.peer_id, float("inf")) <= max_rtt_s]
    return supply_from_holders(shape, close, now_ms=now_ms)
