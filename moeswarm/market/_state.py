"""The market's view of one model, its JSON state file, and the summary ``moeswarm market`` shows.

State file schema (JSON; unknown keys are ignored)::

    {
      "model": {"model_id": "org/name", "moe_layers": [3, 4, ..., 59],   # or {"first": 3, "last": 59}
                "num_experts": 128, "expert_bytes": 28000000},
      "now_ms": 1700000000000,          # optional, default: now; holders expired by then are skipped
      "epoch": 472222,                  # optional, default: the pricing epoch of now_ms
      "holders": [                      # optional: the live announcements
        {"peer_id": "12D3KooW...",      # optional (default: one per entry)
         "layers": [3, 20], "experts": [0, 127],   # inclusive, model layer numbers
         "throughput": 50000,           # optional, (expert, token) pairs/s (0 = unknown)
         "load_permille": 120,          # optional, 0..1000
         "expires_at_ms": 1700000600000 # optional, default: never
        }],
      "demand": {"counts": [[...E numbers...], ...L rows...],   # optional, default uniform;
                 "rate": 12345.0},                              #   or "share" instead of "counts"
      "previous_prices": {...}          # optional: last epoch's price table (its JSON), for smoothing
    }
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeswarm.errors import ConfigError, ProtocolError
from moeswarm.protocol import BlockRanges

from ._demand import Demand
from ._grid import ModelShape
from ._price import PriceConfig, PriceTable, compute_prices, price_table_from_json, price_table_to_json
from ._supply import Supply, supply_from_holders

NEVER_MS = 2**63 - 1


@dataclass(frozen=True)
class HolderRecord:
    """A holder as written in a state file (satisfies ``HolderLike``)."""

    peer_id: bytes
    model_id: str
    layers: tuple[int, int]  # inclusive model layer numbers
    experts: tuple[int, int]  # inclusive
    throughput: int = 0  # (expert, token) pairs per second; 0 = unknown
    load_permille: int = 0
    expires_at_ms: int = NEVER_MS
    seq: int = 0

    def blocks(self) -> BlockRanges:
        return ((self.layers, self.experts),)


@dataclass(frozen=True, eq=False)
class MarketState:
    """Everything the market decides from, for one model at one time."""

    shape: ModelShape
    supply: Supply
    demand: Demand
    epoch: int  # pricing epoch
    previous_prices: PriceTable | None = None  # last epoch's table, if known (smooths this one)
    near: Supply | None = None  # the supply held within a short round trip of the asking peer (_near.py)

    def prices(self, config: PriceConfig = PriceConfig()) -> PriceTable:
        """This epoch's price table."""
        return compute_prices(self.shape, self.demand, self.supply, epoch=self.epoch,
                              previous=self.previous_prices, config=config)


def _int_pair(value: Any, name: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(type(x) is int and x >= 0 for x in value)):
        raise ConfigError(f"{name} must be [first, last], non-negative integers")
    if value[0] > value[1]:
        raise ConfigError(f"{name} = {value} is empty")
    return value[0], value[1]


def shape_from_json(obj: Any) -> ModelShape:
    if not isinstance(obj, dict):
        raise ConfigError("state file: 'model' must be an object")
    layers = obj.get("moe_layers")
    if isinstance(layers, dict):
        first, last = _int_pair([layers.get("first"), layers.get("last")], "moe_layers")
        layers = list(range(first, last + 1))
    if not (isinstance(layers, list) and all(type(x) is int for x in layers)):
        raise ConfigError("state file: model.moe_layers must be a list of integers or {first, last}")
    try:
        return ModelShape(str(obj["model_id"]), tuple(layers), int(obj["num_experts"]), int(obj["expert_bytes"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"state file: model needs model_id, num_experts, expert_bytes ({exc})") from None


def _holders(shape: ModelShape, items: Any) -> list[HolderRecord]:
    if not isinstance(items, list):
        raise ConfigError("state file: 'holders' must be a list")
    out = []
    for i, h in enumerate(items):
        if not isinstance(h, dict):
            raise ConfigError(f"state file: holders[{i}] must be an object")
        peer = h.get("peer_id")
        try:
            numbers = int(h.get("throughput", 0)), int(h.get("load_permille", 0)), int(h.get("expires_at_ms", NEVER_MS))
        except (TypeError, ValueError):
            raise ConfigError(f"state file: holders[{i}] throughput, load_permille, expires_at_ms are numbers") from None
        out.append(HolderRecord(
            peer.encode() if isinstance(peer, str) else i.to_bytes(8, "big"), shape.model_id,
            _int_pair(h.get("layers"), f"holders[{i}].layers"), _int_pair(h.get("experts"), f"holders[{i}].experts"),
            *numbers))
    return out


def _demand(shape: ModelShape, obj: Any) -> Demand:
    if obj is None:
        return Demand.uniform(shape)
    if not isinstance(obj, dict):
        raise ConfigError("state file: 'demand' must be an object")
    grid = obj.get("counts", obj.get("share"))
    try:
        arr = np.asarray(grid, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError("state file: demand.counts must be numbers") from None
    if arr.shape != shape.grid:
        raise ConfigError(f"state file: demand grid is {arr.shape}, the model is {shape.grid}")
    return Demand.from_counts(arr, float(obj.get("rate", 0.0)))


def state_from_json(obj: Any, *, price_config: PriceConfig = PriceConfig()) -> MarketState:
    """Read a state file's parsed JSON (schema in this module's docstring); ``ConfigError`` if invalid."""
    if not isinstance(obj, dict):
        raise ConfigError("a market state file holds one JSON object")
    shape = shape_from_json(obj.get("model"))
    now = int(obj.get("now_ms", time.time() * 1000))
    supply = supply_from_holders(shape, _holders(shape, obj.get("holders", [])), now_ms=now)
    epoch = int(obj.get("epoch", price_config.epoch_of(now)))
    previous = None
    if obj.get("previous_prices") is not None:
        try:
            previous = price_table_from_json(obj["previous_prices"])
        except ProtocolError as exc:
            raise ConfigError(f"state file: previous_prices: {exc}") from None
    return MarketState(shape, supply, _demand(shape, obj.get("demand")), epoch, previous)


def summarize(state: MarketState, prices: PriceTable) -> dict[str, Any]:
    """The JSON ``moeswarm market --json`` prints: totals, per-layer rows, uncovered experts, prices."""
    shape, s, d = state.shape, state.supply, state.demand
    m = prices.multipliers.astype(np.float64)
    layers = []
    for i, layer in enumerate(shape.moe_layers):
        reps = s.replicas[i]
        hot = int(np.argmax(d.share[i]))
        layers.append({
            "layer": layer, "covered": int(np.count_nonzero(reps)), "experts": shape.num_experts,
            "replicas_min": int(reps.min()), "replicas_median": float(np.median(reps)), "replicas_max": int(reps.max()),
            "throughput": float(s.throughput[i].sum()), "demand_share": float(d.share[i].sum()),
            "hottest_expert": hot, "hottest_share": float(d.share[i, hot]),
            "price_min": float(m[i].min()), "price_median": float(np.median(m[i])), "price_max": float(m[i].max()),
        })
    rows, cols = np.nonzero(s.replicas <= 0)
    return {
        "model_id": shape.model_id, "epoch": state.epoch, "coverage": s.coverage(),
        "experts": shape.cells, "holders": s.holders, "held_bytes": s.held_cells * shape.expert_bytes,
        "model_bytes": shape.total_bytes, "capacity_ratio": s.held_cells / shape.cells,
        "demand_reporters": d.reporters, "demand_rate": d.rate,
        "uncovered": [[shape.moe_layers[r], int(c)] for r, c in zip(rows, cols)],
        "layers": layers, "prices": price_table_to_json(prices),
    }
