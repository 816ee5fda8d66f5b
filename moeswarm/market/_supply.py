"""Supply: who holds each expert, with how much serving throughput, from the DHT's announcements."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moeswarm.protocol import BlockRanges

from ._grid import Block, ModelShape, Rect


class HolderLike(Protocol):
    """What supply reads from a holder: an ``Announcement`` or a ``net.routing_table.Holder``."""

    @property
    def peer_id(self) -> bytes: ...
    @property
    def model_id(self) -> str: ...
    @property
    def layers(self) -> tuple[int, int]: ...
    @property
    def experts(self) -> tuple[int, int]: ...
    @property
    def throughput(self) -> int: ...
    @property
    def load_permille(self) -> int: ...
    @property
    def expires_at_ms(self) -> int: ...
    @property
    def seq(self) -> int: ...
    def blocks(self) -> BlockRanges: ...


@dataclass(frozen=True, eq=False)
class Supply:
    """Replicas and serving throughput of every expert of one model. Arrays are ``(L, E)``."""

    replicas: np.ndarray  # int64: live holders of each expert
    throughput: np.ndarray  # float64, (expert, token) pairs/s: each holder's throughput split evenly over its experts
    load_sum: np.ndarray  # float64: sum over the expert's holders of their load (0..1)
    holders: int  # distinct live holders counted
    held_cells: int  # sum over holders of the experts each holds (bytes = held_cells * expert_bytes)

    @classmethod
    def empty(cls, shape: ModelShape) -> Supply:
        z = np.zeros(shape.grid)
        return cls(np.zeros(shape.grid, dtype=np.int64), z, z.copy(), 0, 0)

    @property
    def load(self) -> np.ndarray:
        """Mean load (0 idle .. 1 saturated) of each expert's holders; 0 where nobody holds it."""
        out: np.ndarray = self.load_sum / np.maximum(self.replicas, 1)
        return out

    @property
    def rate_per_held_expert(self) -> float:
        """The swarm's mean serving throughput per expert held (pairs/s; 0 while nothing is held):
        the yardstick a holder's rate per expert is compared with (``AssignConfig.edge_rate_share``)."""
        return float(self.throughput.sum()) / self.held_cells if self.held_cells > 0 else 0.0

    def coverage(self) -> float:
        """Share of experts with at least one live holder."""
        return float(np.count_nonzero(self.replicas)) / self.replicas.size

    def changed(self, rects: Sequence[Rect], throughput: float, sign: int, load: float = 0.0) -> Supply:
        """A copy with one holder of ``rects`` (``throughput`` pairs/s in all) added (+1) or removed (-1)."""
        replicas, tput, load_sum = self.replicas.copy(), self.throughput.copy(), self.load_sum.copy()
        cells = sum(r.cells for r in rects)
        for r in rects:
            replicas[r.slices] += sign
            tput[r.slices] += sign * throughput / max(cells, 1)
            load_sum[r.slices] += sign * load
        np.maximum(tput, 0.0, out=tput)  # float round-off must not make supply negative
        return Supply(replicas, tput, load_sum, self.holders + sign, self.held_cells + sign * cells)


def supply_from_holders(
    shape: ModelShape,
    holders: Iterable[HolderLike],
    *,
    now_ms: int | None = None,
    default_throughput: float = 1.0,
) -> Supply:
    """Aggregate live holders of ``shape.model_id`` into a ``Supply``.

    Records of other models, expired records (``expires_at_ms <= now_ms``, default the system
    clock) and older records of a peer already seen (lower ``seq``) are skipped. A holder whose
    announced throughput is 0 (not measured yet) counts with ``default_throughput`` pairs/s.
    Its throughput is split evenly over the experts it holds: a holder of 1,000 experts adds a
    thousandth of its speed to each (conservative: serving time really goes where calls go).
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    latest: dict[bytes, HolderLike] = {}
    for h in holders:
        if h.model_id != shape.model_id or h.expires_at_ms <= now:
            continue
        old = latest.get(h.peer_id)
        if old is None or h.seq > old.seq:
            latest[h.peer_id] = h
    replicas = np.zeros(shape.grid, dtype=np.int64)
    tput = np.zeros(shape.grid)
    load_sum = np.zeros(shape.grid)
    count = cells = 0
    for h in latest.values():
        rects = [shape.rect(Block(L, E)) for L, E in h.blocks() if 0 <= L[0] <= L[1] and 0 <= E[0] <= E[1]]
        rects = [r for r in rects if r is not None]  # blocks are disjoint (the codec checks announcements')
        held = sum(r.cells for r in rects)
        if not held:
            continue
        speed = float(h.throughput) if h.throughput > 0 else default_throughput
        for rect in rects:
            replicas[rect.slices] += 1
            tput[rect.slices] += speed / held
            load_sum[rect.slices] += min(max(h.load_permille, 0), 1000) / 1000.0
        count += 1
        cells += held
    return Supply(replicas, tput, load_sum, count, cells)
