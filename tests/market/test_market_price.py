"""Supply from announcements, and prices: bounded, smooth, rising with demand, falling with supply."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from moeswarm.errors import ConfigError, ProtocolError
from moeswarm.market import (
    Block,
    Demand,
    ModelShape,
    PriceConfig,
    Supply,
    compute_prices,
    price_table_from_json,
    price_table_to_json,
    smooth,
    supply_from_holders,
    target_multipliers,
)
from moeswarm.net.routing_table import SwarmTable, plan_dispatch
from moeswarm.protocol import Identity, sign_announcement
from moeswarm.protocol import decode as p_decode
from moeswarm.protocol import encode as p_encode

SHAPE = ModelShape("org/m", (0, 1, 2), 4, 1000)
NOW = 1_700_000_000_000
IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(4)]


def _ann(ident: Identity, layers: tuple[int, int], experts: tuple[int, int], throughput: int = 1200, **kw):  # type: ignore[no-untyped-def]
    fields = dict(model_id="org/m", layers=layers, experts=experts, endpoints=["tcp+tls://10.0.0.1:1"],
                  capacity_bytes=1, throughput=throughput, load_permille=500, software="t", seq=1,
                  expires_at_ms=NOW + 60_000)
    fields.update(kw)
    return sign_announcement(ident, **fields)  # type: ignore[arg-type]


def test_supply_counts_live_holders_and_splits_their_throughput() -> None:
    anns = [
        _ann(IDS[0], (0, 2), (0, 3), throughput=1200),  # 12 experts: 100 pairs/s each
        _ann(IDS[1], (1, 1), (2, 3), throughput=0),  # unmeasured: default throughput
        _ann(IDS[2], (0, 0), (0, 0), expires_at_ms=NOW - 1),  # expired
        _ann(IDS[3], (0, 0), (0, 0), model_id="org/other"),  # another model
        _ann(IDS[1], (2, 2), (0, 0), seq=0),  # older record of a peer already seen
    ]
    s = supply_from_holders(SHAPE, anns, now_ms=NOW, default_throughput=50)
    assert s.holders == 2 and s.held_cells == 14
    assert s.replicas.tolist() == [[1, 1, 1, 1], [1, 1, 2, 2], [1, 1, 1, 1]]
    assert s.throughput[1, 3] == pytest.approx(125) and s.throughput[0, 0] == pytest.approx(100)
    assert s.load[1, 2] == pytest.approx(0.5) and s.coverage() == 1.0
    rect = SHAPE.rect(Block((1, 1), (2, 3)))
    assert rect is not None
    back = s.changed([rect], 50, -1)
    assert back.replicas[1].tolist() == [1, 1, 1, 1] and back.throughput[1, 3] == pytest.approx(100)


def test_a_holder_of_several_blocks_counts_once_per_expert_and_splits_its_throughput_over_all() -> None:
    """One node process announcing three blocks (``more_blocks``), as the market and a backbone's
    routing table read it: every expert of every block held once, its rate over all 5 experts."""
    ann = _ann(IDS[0], (0, 0), (0, 1), throughput=1000, more_blocks=[((1, 1), (3, 3)), ((2, 2), (1, 2))])
    s = supply_from_holders(SHAPE, [p_decode(p_encode(ann))], now_ms=NOW)
    assert s.holders == 1 and s.held_cells == 5
    assert s.replicas.tolist() == [[1, 1, 0, 0], [0, 0, 0, 1], [0, 1, 1, 0]]
    assert s.throughput[2, 2] == pytest.approx(200) and s.throughput.sum() == pytest.approx(1000)
    table = SwarmTable("org/m")
    table.update(ann)
    h = table.holders[IDS[0].peer_id]
    assert [(L, e) for L in range(3) for e in range(4) if h.holds(L, e)] == [(0, 0), (0, 1), (1, 3), (2, 1), (2, 2)]
    assert plan_dispatch(2, [1, 2, 3], [h]) == ({IDS[0].peer_id: [1, 2]}, [3])


grids = arrays(np.float64, (3, 4), elements=st.floats(0, 1e6, allow_nan=False))


def _supply(tput: np.ndarray, replicas: np.ndarray | None = None) -> Supply:
    reps = (tput > 0).astype(np.int64) if replicas is None else replicas
    return Supply(reps, tput, np.zeros_like(tput), 1, int(reps.sum()))


configs = st.builds(PriceConfig, min_multiplier=st.floats(0.05, 1.0), max_multiplier=st.floats(1.0, 20.0),
                    elasticity=st.floats(0.1, 2.0), smoothing=st.floats(0.001, 1.0), ema=st.floats(0.05, 1.0),
                    max_step=st.floats(1.0, 3.0))


@settings(max_examples=150, deadline=None)
@given(grids, grids, configs, st.tuples(st.integers(0, 2), st.integers(0, 3)), st.floats(1.0, 1e3))
def test_prices_are_bounded_and_monotone(demand: np.ndarray, tput: np.ndarray, cfg: PriceConfig,
                                         cell: tuple[int, int], factor: float) -> None:
    assume(demand.sum() > 0)
    d = Demand.from_counts(demand)
    m = target_multipliers(d, _supply(tput), cfg)
    assert np.all(m >= cfg.min_multiplier - 1e-12) and np.all(m <= cfg.max_multiplier + 1e-12)
    more_demand = demand.copy()
    more_demand[cell] = more_demand[cell] * factor + 1.0
    assert target_multipliers(Demand.from_counts(more_demand), _supply(tput), cfg)[cell] >= m[cell] - 1e-9
    more_supply = tput.copy()
    more_supply[cell] = more_supply[cell] * factor + 1.0
    reps = (tput > 0).astype(np.int64)
    reps[cell] += 1
    assert target_multipliers(d, _supply(more_supply, reps), cfg)[cell] <= m[cell] + 1e-9
    # smoothing: inside the bounds, never more than max_step per epoch, monotone in the target
    prev = np.full(m.shape, cfg.min_multiplier)
    nxt = smooth(prev, m, cfg)
    assert np.all(nxt >= cfg.min_multiplier - 1e-12) and np.all(nxt <= cfg.max_multiplier + 1e-12)
    assert np.all(nxt <= prev * cfg.max_step * (1 + 1e-12)) and np.all(nxt >= prev / cfg.max_step * (1 - 1e-12))
    assert np.all(smooth(prev, np.maximum(m, m * factor), cfg) >= nxt - 1e-12)


def test_unheld_experts_cost_the_most_and_balanced_ones_about_one() -> None:
    d = Demand.uniform(SHAPE)
    tput = np.full(SHAPE.grid, 10.0)
    tput[0, 0] = 0.0
    m = target_multipliers(d, _supply(tput))
    assert m[0, 0] == PriceConfig().max_multiplier
    assert np.allclose(m[1:], (11 / 12) ** 0.5, atol=0.01)  # 11 held experts share the supply: s = 11/12


def test_smoothing_converges_to_the_target_within_bounded_steps() -> None:
    cfg = PriceConfig()
    target = np.array([[4.0, 0.25]])
    m = np.ones((1, 2))
    for _ in range(30):
        new = smooth(m, target, cfg)
        assert np.all(new / m <= cfg.max_step + 1e-9) and np.all(m / new <= cfg.max_step + 1e-9)
        m = new
    np.testing.assert_allclose(m, target, rtol=1e-3)


def test_price_table_reads_signs_and_round_trips_json() -> None:
    d = Demand.from_counts(np.arange(1, 13, dtype=float).reshape(3, 4))
    s = _supply(np.full(SHAPE.grid, 5.0))
    t0 = compute_prices(SHAPE, d, s, epoch=7)
    t1 = compute_prices(SHAPE, d, _supply(np.full(SHAPE.grid, 1.0) + np.eye(3, 4) * 100), epoch=8, previous=t0)
    assert np.all(t1.multipliers / t0.multipliers <= 1.25 + 1e-6)
    signed = t1.signed(IDS[0])
    assert signed.verify() and not t1.verify()
    back = price_table_from_json(json.loads(json.dumps(price_table_to_json(signed))))
    assert back.verify() and np.array_equal(back.multipliers, signed.multipliers)
    assert back.price("org/m", 2, 3, 8) == pytest.approx(float(signed.multipliers[2, 3]))
    assert not replace(back, epoch=9).verify()
    for bad in (("org/m", 2, 3, 7), ("org/x", 2, 3, 8), ("org/m", 5, 0, 8), ("org/m", 0, 4, 8)):
        with pytest.raises(ConfigError):
            back.price(*bad)
    obj = price_table_to_json(signed)
    broken: object
    for broken in ({**obj, "multipliers": [[1.0]]}, {**obj, "multipliers": [[99.0] * 4] * 3}, {**obj, "type": "x"},
                   {k: v for k, v in obj.items() if k != "epoch"}, {**obj, "layers": [2, 1, 0]}, [], {**obj, "sig": "zz"}):
        with pytest.raises(ProtocolError):
            price_table_from_json(broken)


def test_price_config_rejects_nonsense() -> None:
    for bad in (dict(min_multiplier=2.0), dict(max_multiplier=0.5), dict(ema=0), dict(max_step=0.9), dict(epoch_s=0)):
        with pytest.raises(ConfigError):
            PriceConfig(**bad)  # type: ignore[arg-type]
    assert PriceConfig(epoch_s=60).epoch_of(120_500) == 2
