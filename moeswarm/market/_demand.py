"""Demand: how often each (layer, expert) is routed to, counted cheaply where the router runs.

A backbone feeds a ``DemandCounter`` from the model's router observer hook::

    counter = DemandCounter(shape.moe_layers, shape.num_experts, DemandConfig(half_life_s=600))
    model.observers.append(counter.observe)

``observe`` only adds a ``bincount`` into a pending row (microseconds); decay is applied when
counts are read (``snapshot``), so the forward pass never pays for it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moeswarm.errors import ConfigError

from ._grid import ModelShape


@dataclass(frozen=True)
class DemandConfig:
    """How a backbone counts demand."""

    half_life_s: float = 600.0  # seconds after which an observed call counts half: the demand window


@dataclass(frozen=True, eq=False)
class Demand:
    """Merged demand of one model: the share of routed (token, expert) pairs each expert gets."""

    share: np.ndarray  # (L, E) float64, non-negative, sums to 1
    rate: float  # estimated routed pairs per second over the whole swarm; 0 when unknown
    reporters: int  # reports merged into it; 0 means the uniform prior (no trusted reports)

    @classmethod
    def uniform(cls, shape: ModelShape, rate: float = 0.0) -> Demand:
        """Every expert equally wanted: what the market assumes before it has trusted reports."""
        return cls(np.full(shape.grid, 1.0 / shape.cells), rate, 0)

    @classmethod
    def from_counts(cls, counts: np.ndarray, rate: float = 0.0, reporters: int = 1) -> Demand:
        """Demand proportional to ``counts`` (``(L, E)``, non-negative, not all zero)."""
        c = np.asarray(counts, dtype=np.float64)
        total = float(c.sum())
        if c.ndim != 2 or not np.all(np.isfinite(c)) or np.any(c < 0) or total <= 0:
            raise ConfigError("demand counts must be a finite non-negative (L, E) grid, not all zero")
        return cls(c / total, rate, reporters)


class DemandCounter:
    """Exponentially decayed routing counts per (MoE layer, expert); thread-safe.

    A call observed ``t`` seconds ago counts ``0.5 ** (t / half_life_s)``. Calls observed since
    the last ``snapshot`` are folded in undecayed at the next one, so read it at least once per
    half-life (the backbone does, every time it publishes a report).
    """

    def __init__(self, moe_layers: Sequence[int], num_experts: int, config: DemandConfig = DemandConfig(),
                 clock: Callable[[], float] = time.time) -> None:
        if num_experts < 1 or not moe_layers or config.half_life_s <= 0:
            raise ConfigError("DemandCounter needs MoE layers, experts and a positive half-life")
        self.moe_layers = tuple(int(x) for x in moe_layers)
        self.num_experts = num_experts
        self.config = config
        self._rows = {layer: i for i, layer in enumerate(self.moe_layers)}
        self._clock = clock
        self._lock = threading.Lock()
        self._pending = np.zeros((len(self.moe_layers), num_experts), dtype=np.int64)
        self._counts = np.zeros((len(self.moe_layers), num_experts))
        self._t = clock()
        self.observed = 0  # routed pairs seen in total, undecayed (for logs and tests)

    def observe(self, layer: int, ids: np.ndarray) -> None:
        """Router hook: ``ids`` ``(T, k)`` holds the experts routed to for ``T`` tokens at ``layer``."""
        row = self._rows.get(layer)
        if row is None:
            return  # a layer this counter does not track
        flat = np.asarray(ids).reshape(-1)
        counts = np.bincount(flat, minlength=self.num_experts)[: self.num_experts]  # ids >= E ignored
        with self._lock:
            self._pending[row] += counts
            self.observed += flat.size

    def snapshot(self) -> np.ndarray:
        """The decayed counts now, ``(L, E)`` float64 (a copy)."""
        with self._lock:
            now = self._clock()
            elapsed = max(0.0, now - self._t)
            if elapsed:
                self._counts *= 0.5 ** (elapsed / self.config.half_life_s)
            self._counts += self._pending
            self._pending[:] = 0
            self._t = now
            return self._counts.copy()

    def rate(self, counts: np.ndarray | None = None) -> float:
        """Routed pairs per second that ``counts`` (default: a fresh snapshot) stand for.

        In steady state decayed counts sum to ``rate * half_life / ln 2``.
        """
        c = self.snapshot() if counts is None else counts
        return float(c.sum()) * math.log(2) / self.config.half_life_s
