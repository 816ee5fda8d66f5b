"""Demand: the router hook's counts and decay, signed reports and their codec, and the robust merge."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeswarm.errors import ConfigError, ProtocolError
from moeswarm.market import (
    Demand,
    DemandConfig,
    DemandCounter,
    MergeConfig,
    ModelShape,
    decode_report,
    encode_report,
    merge_reports,
    report_from_counter,
    sign_report,
    verify_report,
)
from moeswarm.protocol import Identity

SHAPE = ModelShape("org/m", (2, 3, 5), 8, 1000)
NOW = 1_700_000_000_000
IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(8)]
TRUTH = np.array([[8, 4, 2, 1, 1, 1, 1, 1], [1, 1, 1, 1, 2, 4, 8, 16], [3, 3, 3, 3, 3, 3, 3, 3]], dtype=float)


def _report(ident: Identity, counts: np.ndarray, *, time_ms: int = NOW, seq: int = 1, **kw):  # type: ignore[no-untyped-def]
    fields = dict(model_id=SHAPE.model_id, layers=SHAPE.moe_layers, counts=counts, half_life_ms=600_000,
                  time_ms=time_ms, seq=seq)
    fields.update(kw)
    return sign_report(ident, **fields)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_counter_counts_routed_experts_and_halves_per_half_life() -> None:
    clock = Clock()
    c = DemandCounter(SHAPE.moe_layers, 8, DemandConfig(half_life_s=10), clock=clock)
    c.observe(2, np.array([[0, 1], [0, 3]]))  # (T=2, k=2)
    c.observe(5, np.array([[7, 6]]))
    c.observe(4, np.array([[1, 2]]))  # not a MoE layer this counter tracks: ignored
    c.observe(3, np.array([[8, 9]]))  # ids past the expert count are ignored, not crashed on
    snap = c.snapshot()
    assert snap[0].tolist() == [2, 1, 0, 1, 0, 0, 0, 0] and snap[2, 6:].tolist() == [1, 1] and snap[1].sum() == 0
    clock.t += 10
    assert c.snapshot()[0, 0] == pytest.approx(1.0)
    clock.t += 20
    assert c.snapshot()[0, 0] == pytest.approx(0.25)
    assert c.observed == 8  # pairs seen at tracked layers (ids past E included)
    assert c.rate(np.full((3, 8), 10.0)) == pytest.approx(240 * np.log(2) / 10)
    with pytest.raises(ConfigError):
        DemandCounter((), 8)


def test_counter_hooks_into_a_router_observer_list_and_reports() -> None:
    observers = []
    c = DemandCounter(SHAPE.moe_layers, 8, clock=Clock())
    observers.append(c.observe)
    for layer in SHAPE.moe_layers:
        for observe in observers:
            observe(layer, np.arange(8).reshape(4, 2))
    r = report_from_counter(IDS[0], c, model_id=SHAPE.model_id, seq=7, time_ms=NOW)
    assert verify_report(r) and r.counts.shape == (3, 8) and float(r.counts.sum()) == 24


def test_report_round_trips_and_signature_binds_every_field() -> None:
    r = _report(IDS[0], TRUTH)
    back = decode_report(encode_report(r))
    assert verify_report(back) and np.array_equal(back.counts, r.counts) and back.layers == r.layers
    assert back.rate == pytest.approx(TRUTH.sum() * np.log(2) / 600)
    for change in (dict(seq=2), dict(time_ms=NOW + 1), dict(counts=(TRUTH + 1).astype("<f4")),
                   dict(reporter=IDS[1].peer_id), dict(model_id="org/other")):
        assert not verify_report(replace(r, **change))  # type: ignore[arg-type]
    assert not verify_report(replace(r, sig=b""))


def _mutations(body: dict) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for key in body:
        out.append({k: v for k, v in body.items() if k != key})  # missing field
        out.append({**body, key: "x" if not isinstance(body[key], str) else 7})  # wrong type
    out += [{**body, "counts": body["counts"][:-4]}, {**body, "layers": [5, 3, 2]},
            {**body, "counts": np.full(24, np.nan, dtype="<f4").tobytes()},
            {**body, "counts": np.full(24, -1, dtype="<f4").tobytes()}, {**body, "num_experts": 0},
            {**body, "type": "announcement"}, {**body, "reporter": b"\x00" * 38}, {**body, "half_life_ms": 0}]
    return out


def test_decode_rejects_malformed_reports_with_protocol_error() -> None:
    body = msgpack.unpackb(encode_report(_report(IDS[0], TRUTH)))
    for bad in _mutations(body):
        with pytest.raises(ProtocolError):
            decode_report(msgpack.packb(bad, use_bin_type=True))
    for junk in (b"", b"\xc1", msgpack.packb([1, 2]), b"\x00" * (5 << 20)):
        with pytest.raises(ProtocolError):
            decode_report(junk)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_decode_raises_only_protocol_error_on_arbitrary_bytes(data: bytes) -> None:
    try:
        decode_report(data)
    except ProtocolError:
        pass


def _honest(rng: np.random.Generator, n: int) -> np.ndarray:
    p = (TRUTH / TRUTH.sum()).reshape(-1)
    return rng.multinomial(n, p).reshape(TRUTH.shape).astype(float)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), honest=st.integers(3, 6), volume=st.floats(1e3, 1e9),
       target=st.tuples(st.integers(0, 2), st.integers(0, 7)), stale_age_s=st.floats(1801, 1e6))
def test_merge_ignores_unsigned_stale_and_outlying_reports(seed: int, honest: int, volume: float,
                                                           target: tuple[int, int], stale_age_s: float) -> None:
    rng = np.random.default_rng(seed)
    good = [_report(IDS[i], _honest(rng, 20_000)) for i in range(honest)]
    liar = np.zeros_like(TRUTH)
    liar[target] = volume  # one backbone claims everything goes to one expert, at any volume
    forged = replace(_report(IDS[honest], liar), reporter=IDS[0].peer_id)  # signed by another key
    evil = [_report(IDS[honest + 1], liar), replace(_report(IDS[6], liar), sig=b""), forged,
            _report(IDS[7], liar, time_ms=NOW - int(stale_age_s * 1000)),
            _report(IDS[7], liar, time_ms=NOW + 3_600_000, seq=2)]
    clean = merge_reports(good, SHAPE, now_ms=NOW)
    merged = merge_reports(good + evil, SHAPE, now_ms=NOW)
    assert merged.rejected.get("unsigned") == 2 and merged.rejected.get("outlier") == 1
    assert merged.rejected.get("stale", 0) + merged.rejected.get("future", 0) == 2
    assert set(merged.accepted) == {r.reporter for r in good}
    np.testing.assert_allclose(merged.demand.share, clean.demand.share)
    assert abs(merged.demand.share.sum() - 1) < 1e-9
    assert 0.5 * np.abs(merged.demand.share - TRUTH / TRUTH.sum()).sum() < 0.05


def test_merge_needs_min_reporters_and_caps_any_one_volume() -> None:
    rng = np.random.default_rng(3)
    two = [_report(IDS[i], _honest(rng, 10_000)) for i in range(2)]
    assert merge_reports(two, SHAPE, now_ms=NOW).demand.reporters == 0  # uniform: too few to trust
    assert merge_reports(two, SHAPE, now_ms=NOW, config=MergeConfig(min_reporters=2)).demand.reporters == 2
    loud = [_report(IDS[i], _honest(rng, 10_000) * (1000 if i == 0 else 1)) for i in range(4)]
    m = merge_reports(loud, SHAPE, now_ms=NOW)
    assert m.demand.rate <= 7.01 * loud[1].rate  # 3 normal + one capped at 4x the median
    newer = _report(IDS[1], _honest(rng, 10_000), seq=5)
    m2 = merge_reports([*loud, newer, b"junk"], SHAPE, now_ms=NOW)
    assert m2.rejected == {"duplicate": 1, "malformed": 1} and len(m2.accepted) == 4
    other = ModelShape("org/m", (2, 3, 6), 8, 1000)
    assert merge_reports(loud, other, now_ms=NOW).rejected == {"shape": 4}


def test_demand_constructors() -> None:
    u = Demand.uniform(SHAPE)
    assert u.share.shape == (3, 8) and u.share.sum() == pytest.approx(1) and u.reporters == 0
    assert Demand.from_counts(TRUTH).share[0, 0] == pytest.approx(8 / TRUTH.sum())
    with pytest.raises(ConfigError):
        Demand.from_counts(np.zeros((3, 8)))


def test_reporters_without_standing_move_no_share_however_many() -> None:
    """40 backbones with standing (credits paid at the ledger), then 256 fresh keys that report all
    demand on one expert, dated as far ahead as the validator allows: the merge does not move."""
    rng = np.random.default_rng(11)
    honest_ids = [Identity.generate() for _ in range(40)]
    honest = [_report(i, _honest(rng, 20_000), time_ms=NOW - int(rng.integers(0, 600_000))) for i in honest_ids]
    standing = {i.peer_id: float(rng.integers(1_000, 100_000)) for i in honest_ids}
    spike = np.zeros_like(TRUTH)
    spike[1, 3] = 1e6
    fakes = [_report(Identity.generate(), spike, time_ms=NOW + 299_000) for _ in range(256)]
    clean = merge_reports(honest, SHAPE, now_ms=NOW, standing=standing)
    stuffed = merge_reports([*fakes, *honest], SHAPE, now_ms=NOW, standing=standing)
    assert stuffed.rejected == {"no_standing": 256}
    assert np.array_equal(stuffed.demand.share, clean.demand.share)  # moved by exactly 0
    assert set(stuffed.accepted) == {i.peer_id for i in honest_ids}
    # without standing (a swarm that trusts every backbone) the same crowd takes the expert over,
    # which is why an open swarm weighs reports by the ledger (moeswarm market --ledger URL)
    trusting = merge_reports([*fakes, *honest], SHAPE, now_ms=NOW)
    assert trusting.demand.share[1, 3] > 0.9 > 10 * clean.demand.share[1, 3]


def test_dating_a_report_ahead_wins_no_place_among_the_merged() -> None:
    rng = np.random.default_rng(12)
    ids = [Identity.generate() for _ in range(4)]
    reports = [_report(i, _honest(rng, 10_000), time_ms=NOW - 60_000) for i in ids[:3]]
    ahead = _report(ids[3], _honest(rng, 10_000), time_ms=NOW + 299_000)
    config = MergeConfig(max_reporters=3, min_reporters=1)
    standing = {i.peer_id: 10.0 for i in ids}
    standing[ids[3].peer_id] = 1.0  # least standing
    merged = merge_reports([ahead, *reports], SHAPE, now_ms=NOW, config=config, standing=standing)
    assert ids[3].peer_id not in merged.accepted and merged.rejected["excess"] == 1


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 12))
def test_weighted_trimmed_mean_is_the_trimmed_mean_of_replicated_rows(data: st.DataObject, n: int) -> None:
    """Oracle: integer weights mean repeating a row that many times; with total weight a multiple
    of 5, trimming 0.2 of the weight is trimming whole rows of the replicated set."""
    from moeswarm.market._reports import (
        _trimmed_mean,
        _weighted_quantile,
        _weighted_trimmed_mean,
    )

    weights = data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    weights[-1] += (-sum(weights)) % 5
    rows = np.array(data.draw(st.lists(st.lists(st.floats(0, 1), min_size=3, max_size=3), min_size=n, max_size=n)))
    replicated = np.repeat(rows, weights, axis=0)
    w = np.array(weights, dtype=float)
    np.testing.assert_allclose(_weighted_trimmed_mean(rows, w, 0.2), _trimmed_mean(replicated, 0.2), atol=1e-12)
    ordered = np.sort(replicated, axis=0)
    lower_median = ordered[(replicated.shape[0] - 1) // 2]
    np.testing.assert_array_equal(_weighted_quantile(rows, w, 0.5), lower_median)
