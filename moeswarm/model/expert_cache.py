"""Which experts to keep in fast memory: replacement policies and router-predicted prefetch.

Every token touches k experts in each of L MoE layers, in layer order, so a cache smaller than
one token's expert set sees a cyclic access pattern: plain LRU evicts exactly the expert that
is needed next and its hit rate collapses (MoE-Infinity, mixtral-offloading).  ``RecencyFrequency``
keeps a combined recency-frequency score per expert (LRFU: each access adds 1, the score halves
every ``half_life`` accesses), so experts that are used often stay, while the score still
forgets experts that stopped being routed to.

``predict_next_experts`` applies the *next* layer's router to the current hidden state: a cheap,
usually right guess of which experts the next layer will pick, used to start reading them early.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .attention import rms_norm
from .config import ModelConfig
from .routing import route
from .weights import Weights


class Policy(Protocol):
    """A cache of at most ``capacity`` entries; ``access`` says whether the key was held."""

    capacity: int

    def access(self, key: Hashable) -> bool: ...

    def evict_one(self, protect: Hashable | None = None) -> Hashable | None: ...

    def __contains__(self, key: Hashable) -> bool: ...


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def access(self, key: Hashable) -> bool:
        hit = key in self._keys
        if hit:
            self._keys.move_to_end(key)
        else:
            while len(self._keys) >= self.capacity and self._keys:
                self._keys.popitem(last=False)
            if self.capacity > 0:
                self._keys[key] = None
        return hit

    def evict_one(self, protect: Hashable | None = None) -> Hashable | None:
        for key in self._keys:
            if key != protect:
                del self._keys[key]
                return key
        return None


class RecencyFrequency:
    """LRFU: score(key) = sum over its accesses of 2^(-age / half_life), age counted in accesses."""

    def __init__(self, capacity: int, half_life: float = 64.0, bypass: bool = True) -> None:
        self.capacity = capacity
        self.bypass = bypass  # refuse a slot to a key weaker than every held one (admission control)
        self.decay = 0.5 ** (1.0 / half_life)
        self.clock = 0
        self._score: dict[Hashable, tuple[float, int]] = {}  # key -> (score at its last access, that time)
        self._held: set[Hashable] = set()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held

    def score(self, key: Hashable) -> float:
        value, at = self._score.get(key, (0.0, self.clock))
        return value * self.decay ** (self.clock - at)

    def access(self, key: Hashable) -> bool:
        self.clock += 1
        before = self.score(key)  # its standing from earlier accesses (0 if never seen)
        self._score[key] = (before + 1.0, self.clock)
        if key in self._held:
            return True
        if self.capacity <= 0:
            return False
        if len(self._held) >= self.capacity:
            weakest = min(self._held, key=self.score)
            if self.bypass and before <= self.score(weakest):
                return False  # not worth a slot (yet): serve it without caching; a loop stays put
            self._held.discard(weakest)
        self._held.add(key)
        return False

    def evict_one(self, protect: Hashable | None = None) -> Hashable | None:
        candidates = [k for k in self._held if k != protect]
        if not candidates:
            return None
        weakest = min(candidates, key=self.score)
        self._held.discard(weakest)
        return weakest


def predict_next_experts(cfg: ModelConfig, weights: Weights, layer: int, x: np.ndarray) -> np.ndarray | None:
    """Experts the next MoE layer after ``layer`` would pick for the residual stream ``x (T, H)``,
    were attention to leave it unchanged; ``None`` when there is no later MoE layer."""
    nxt = next((L for L in range(layer + 1, cfg.num_layers) if cfg.moe_layers[L]), None)
    if nxt is None:
        return None
    h = rms_norm(x, weights[f"{nxt}.mlp_norm"], cfg.rms_norm_eps)
    ids, _ = route(cfg, h, weights[f"{nxt}.router"], weights.get(f"{nxt}.router_bias"),
                   weights.get(f"{nxt}.router_score_bias"))
    return ids


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    predicted: int = 0  # expert picks that a prediction named in advance
    picks: int = 0  # expert picks that had a prediction to compare with

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)

    @property
    def prefetch_accuracy(self) -> float:
        return self.predicted / max(1, self.picks)


def simulate(policy: Policy, trace: Iterable[Hashable]) -> float:
    """Hit rate of ``policy`` on an access trace."""
    hits = total = 0
    for key in trace:
        hits += policy.access(key)
        total += 1
    return hits / max(1, total)
