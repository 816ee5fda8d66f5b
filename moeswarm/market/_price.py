"""Scarcity and price: from demand and supply to a bounded, smooth price multiplier per expert.

The formula (one epoch, one expert ``e`` of a model with ``N`` experts)::

    p_e = demand share of e                 (merged reports; sums to 1 over the model)
    q_e = supply share of e                 (holders' throughput attributed to e / all of it)
    s_e = (p_e + eps/N) / (q_e + eps/N)     scarcity: 1 when supply matches demand
    m*_e = clip(s_e ** gamma, m_min, m_max) target multiplier; m_max if nobody holds e
    m_e(t) = m_e(t-1) * clip((m*_e / m_e(t-1)) ** alpha, 1/step, step)

``m_e(t)`` multiplies the ledger's base price for the expert-FLOPs served by ``e`` in epoch
``t``. It rises with demand and falls with supply (``p_e`` up or ``q_e`` down raise ``s_e``),
stays in ``[m_min, m_max]`` and moves at most a factor ``step`` per epoch. Multipliers are
relative: a swarm short of everything keeps them near 1; the base price carries the level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np

from moeswarm.errors import ConfigError, ProtocolError
from moeswarm.protocol import (
    Identity,
    canonical,
    is_peer_id,
    peer_id_from_public_key,
    peer_id_from_str,
    peer_id_to_str,
    verify,
)

from ._demand import Demand
from ._grid import ModelShape
from ._supply import Supply

PRICE_KIND: Final = "market-price-table"
"""Signature domain of price tables (after the protocol's ``moeswarm/v1/`` prefix)."""


@dataclass(frozen=True)
class PriceConfig:
    """The knobs of the price formula above."""

    min_multiplier: float = 0.25  # m_min: lowest multiplier of the base price (dimensionless)
    max_multiplier: float = 4.0  # m_max: highest multiplier, also the price of an unheld expert
    elasticity: float = 0.5  # gamma: target = scarcity ** gamma (0.5: 4x scarcer pays 2x)
    smoothing: float = 0.05  # eps: added to both shares, in units of the uniform share 1/N
    ema: float = 0.5  # alpha: share of the way (in log space) toward the target per epoch
    max_step: float = 1.25  # step: largest factor by which a multiplier changes in one epoch
    epoch_s: float = 3600.0  # length of a pricing epoch, seconds

    def __post_init__(self) -> None:
        if not 0 < self.min_multiplier <= 1 <= self.max_multiplier:
            raise ConfigError("need 0 < min_multiplier <= 1 <= max_multiplier")
        if self.elasticity <= 0 or self.smoothing <= 0 or not 0 < self.ema <= 1 or self.max_step < 1:
            raise ConfigError("need elasticity > 0, smoothing > 0, 0 < ema <= 1, max_step >= 1")
        if self.epoch_s <= 0:
            raise ConfigError("epoch_s must be positive")

    def epoch_of(self, time_ms: int) -> int:
        """The epoch a unix-millisecond time falls in."""
        return int(time_ms // round(self.epoch_s * 1000))


def scarcity(demand: Demand, supply: Supply, config: PriceConfig = PriceConfig()) -> np.ndarray:
    """``s_e`` of the formula, ``(L, E)``; supply shares use replicas when no throughput is known."""
    n = demand.share.size
    weight = supply.throughput if supply.throughput.sum() > 0 else supply.replicas.astype(np.float64)
    total = float(weight.sum())
    q = weight / total if total > 0 else np.zeros_like(weight)
    eps = config.smoothing / n
    out: np.ndarray = (demand.share + eps) / (q + eps)
    return out


def target_multipliers(demand: Demand, supply: Supply, config: PriceConfig = PriceConfig()) -> np.ndarray:
    """``m*`` of the formula: ``clip(s ** gamma, m_min, m_max)``, ``m_max`` for unheld experts."""
    m = np.clip(scarcity(demand, supply, config) ** config.elasticity, config.min_multiplier, config.max_multiplier)
    m[supply.replicas <= 0] = config.max_multiplier
    return m


def smooth(previous: np.ndarray | None, target: np.ndarray, config: PriceConfig = PriceConfig()) -> np.ndarray:
    """One epoch of the EMA with a bounded step, in log space; ``target`` itself when no history."""
    lo, hi = config.min_multiplier, config.max_multiplier
    if previous is None:
        return np.clip(target, lo, hi)
    prev = np.clip(previous.astype(np.float64), lo, hi)
    limit = math.log(config.max_step)
    step = np.clip(config.ema * (np.log(np.clip(target, lo, hi)) - np.log(prev)), -limit, limit)
    out: np.ndarray = np.clip(prev * np.exp(step), lo, hi)
    return out


@dataclass(frozen=True, eq=False)
class PriceTable:
    """The multipliers of one model for one epoch, as published to the ledger."""

    model_id: str
    epoch: int  # pricing epoch (``PriceConfig.epoch_of``)
    layers: tuple[int, ...]  # model layer numbers of the rows, ascending
    multipliers: np.ndarray  # (L, E) float32 multipliers of the base price
    min_multiplier: float  # bounds the multipliers were computed under
    max_multiplier: float
    publisher: bytes = b""  # peer ID of the market that signed it (empty: unsigned)
    public_key: bytes = b""  # its Ed25519 public key
    sig: bytes = b""  # signature over ``body()`` under ``PRICE_KIND``

    @property
    def num_experts(self) -> int:
        return int(self.multipliers.shape[1])

    def price(self, model_id: str, layer: int, expert: int, epoch: int) -> float:
        """The multiplier for ``expert`` of model ``layer`` in ``epoch``; ``ConfigError`` if this
        table does not price it (another model or epoch, a dense layer, an expert out of range)."""
        if model_id != self.model_id or epoch != self.epoch:
            raise ConfigError(f"this table prices {self.model_id} epoch {self.epoch}, not {model_id} epoch {epoch}")
        try:
            row = self.layers.index(layer)
        except ValueError:
            raise ConfigError(f"layer {layer} is not priced (not a MoE layer)") from None
        if not 0 <= expert < self.num_experts:
            raise ConfigError(f"expert {expert} is out of range 0..{self.num_experts - 1}")
        return float(self.multipliers[row, expert])

    def body(self) -> dict[str, Any]:
        """The signed fields (canonical msgpack map; multipliers as little-endian f32 bytes)."""
        return {"epoch": int(self.epoch), "layers": list(self.layers), "max_multiplier": float(self.max_multiplier),
                "min_multiplier": float(self.min_multiplier), "model_id": self.model_id,
                "multipliers": np.ascontiguousarray(self.multipliers, dtype="<f4").tobytes(),
                "num_experts": self.num_experts, "public_key": self.public_key, "publisher": self.publisher,
                "type": "price_table"}

    def signed(self, identity: Identity) -> PriceTable:
        """A copy signed by ``identity``."""
        unsigned = replace(self, publisher=identity.peer_id, public_key=identity.public_key, sig=b"")
        return replace(unsigned, sig=identity.sign(PRICE_KIND, canonical(unsigned.body())))

    def verify(self) -> bool:
        """Whether the table is signed by the key its ``publisher`` names."""
        if len(self.public_key) != 32 or not is_peer_id(self.publisher):
            return False
        if peer_id_from_public_key(self.public_key) != self.publisher:
            return False
        return verify(self.public_key, PRICE_KIND, canonical(self.body()), self.sig)


def compute_prices(shape: ModelShape, demand: Demand, supply: Supply, *, epoch: int,
                   previous: PriceTable | None = None, config: PriceConfig = PriceConfig()) -> PriceTable:
    """This epoch's table: the formula's target, smoothed from ``previous`` when it prices the
    same model and grid (a table of an older epoch is the usual ``previous``)."""
    prev = None
    if previous is not None and previous.model_id == shape.model_id and previous.layers == shape.moe_layers \
            and previous.multipliers.shape == shape.grid:
        prev = previous.multipliers
    m = smooth(prev, target_multipliers(demand, supply, config), config)
    return PriceTable(shape.model_id, epoch, shape.moe_layers, _to_f32(m, config.min_multiplier, config.max_multiplier),
                      config.min_multiplier, config.max_multiplier)


def _to_f32(m: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """``m`` as float32, still inside ``[lo, hi]`` after rounding."""
    lo32, hi32 = np.float32(lo), np.float32(hi)
    if float(lo32) < lo:
        lo32 = np.nextafter(lo32, np.float32(np.inf))
    if float(hi32) > hi:
        hi32 = np.nextafter(hi32, np.float32(-np.inf))
    out: np.ndarray = np.clip(m.astype(np.float32), lo32, hi32)
    return out


# ---------------------------------------------------------------- JSON


def price_table_to_json(t: PriceTable) -> dict[str, Any]:
    """A JSON-ready dict; ``price_table_from_json`` reads it back bit for bit (signature included)."""
    return {"type": "price_table", "model_id": t.model_id, "epoch": t.epoch, "layers": list(t.layers),
            "num_experts": t.num_experts, "min_multiplier": t.min_multiplier, "max_multiplier": t.max_multiplier,
            "multipliers": [[float(x) for x in row] for row in t.multipliers],
            "publisher": peer_id_to_str(t.publisher) if t.publisher else None,
            "public_key": t.public_key.hex(), "sig": t.sig.hex()}


def price_table_from_json(obj: Any) -> PriceTable:
    """Parse ``price_table_to_json`` output; ``ProtocolError`` if anything is off."""
    def fail(why: str) -> ProtocolError:
        return ProtocolError(f"bad price table: {why}", code=4)

    if not isinstance(obj, dict) or obj.get("type") != "price_table":
        raise fail("not a price_table object")
    try:
        layers = tuple(int(x) for x in obj["layers"] if type(x) is int)
        if len(layers) != len(obj["layers"]) or any(a >= b for a, b in zip(layers, layers[1:])):
            raise fail("layers must be ascending integers")
        grid = np.asarray(obj["multipliers"], dtype=np.float64)
        lo, hi = float(obj["min_multiplier"]), float(obj["max_multiplier"])
        table = PriceTable(str(obj["model_id"]), int(obj["epoch"]), layers, grid.astype(np.float32), lo, hi,
                           peer_id_from_str(obj["publisher"]) if obj.get("publisher") else b"",
                           bytes.fromhex(obj.get("public_key") or ""), bytes.fromhex(obj.get("sig") or ""))
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise fail(str(exc)) from None
    if grid.ndim != 2 or grid.shape[0] != len(layers) or grid.shape[1] != obj.get("num_experts") or grid.size == 0:
        raise fail("multipliers must be len(layers) x num_experts")
    if not (np.all(np.isfinite(grid)) and 0 < lo <= hi and np.all(grid >= np.float32(lo) * (1 - 1e-6))
            and np.all(grid <= np.float32(hi) * (1 + 1e-6))):
        raise fail("multipliers must be finite and within [min_multiplier, max_multiplier]")
    if table.epoch < 0 or not table.model_id:
        raise fail("epoch must be >= 0 and model_id non-empty")
    return table
