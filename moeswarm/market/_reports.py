"""Signed demand reports from backbones, their codec, and the robust merge of many of them.

A report is a canonical msgpack map (see ``report_body``) signed with the backbone's Ed25519
identity under the domain ``moeswarm/v1/market-demand-report\\0``. ``decode_report`` validates
every field and raises ``ProtocolError`` for anything else; ``merge_reports`` keeps only
signed, fresh, well-shaped reports and discards outliers, so no single backbone sets demand.

Against stuffing (many fresh keys reporting one expert): a report's time is clamped to now, so
dating it ahead wins nothing; each reporter has one live report; and given ``standing`` (what
each reporter paid the ledger for calls it made: verified work, ``moeswarm.ledger``'s
``POST /v1/standing``) reporters are weighted by it, those without standing count for nothing,
and shares are combined by a weighted median and weighted trimmed mean, so keys with no standing
move no share however many they are. Without ``standing`` every signed reporter weighs the same:
only for swarms whose backbones trust one another.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Final

import numpy as np

from moeswarm.errors import ProtocolError
from moeswarm.protocol import Identity, canonical, is_peer_id, peer_id_from_public_key, verify
from moeswarm.protocol._codec import MODEL_ID_RE  # the one model-id syntax of the protocol
from moeswarm.protocol._wire import Fields, bad, check_uint, unpack  # the protocol's defensive decoder

from ._demand import Demand, DemandCounter
from ._grid import ModelShape

REPORT_KIND: Final = "market-demand-report"
"""Signature domain of demand reports (after the protocol's ``moeswarm/v1/`` prefix)."""
MAX_REPORT_LAYERS: Final = 4096
MAX_REPORT_EXPERTS: Final = 65536
MAX_REPORT_CELLS: Final = 1 << 20
MAX_REPORT_BYTES: Final = 4 * MAX_REPORT_CELLS + 16384
MAX_HALF_LIFE_MS: Final = 30 * 24 * 3600 * 1000
MAX_COUNT: Final = 1e15  # no decayed count is this large in any real swarm


@dataclass(frozen=True, eq=False)
class DemandReport:
    """One backbone's decayed routing counts for one model, signed by the backbone."""

    TYPE: ClassVar[str] = "demand_report"
    model_id: str
    layers: tuple[int, ...]  # model layer numbers of the rows of ``counts``, strictly ascending
    num_experts: int  # columns of ``counts``
    counts: np.ndarray  # (L, E) float32, decayed routed-pair counts, finite, >= 0
    half_life_ms: int  # decay half-life the counts were taken with, milliseconds
    time_ms: int  # unix milliseconds at which the counts were taken
    seq: int  # increases with every report from this backbone
    reporter: bytes  # backbone's peer ID (38 bytes)
    public_key: bytes  # backbone's Ed25519 public key (32 bytes)
    sig: bytes = b""  # signature over ``report_body`` (64 bytes); empty = unsigned

    @property
    def rate(self) -> float:
        """Routed pairs per second these counts stand for (steady-state estimate)."""
        return float(self.counts.sum(dtype=np.float64)) * math.log(2) * 1000.0 / self.half_life_ms


def report_body(r: DemandReport) -> dict[str, Any]:
    """The fields the signature covers: everything but ``sig``, counts as little-endian f32."""
    return {
        "counts": np.ascontiguousarray(r.counts, dtype="<f4").tobytes(),
        "half_life_ms": int(r.half_life_ms), "layers": [int(x) for x in r.layers],
        "model_id": r.model_id, "num_experts": int(r.num_experts), "public_key": r.public_key,
        "reporter": r.reporter, "seq": int(r.seq), "time_ms": int(r.time_ms), "type": DemandReport.TYPE,
    }


def encode_report(r: DemandReport) -> bytes:
    """The canonical msgpack bytes of a (signed) report."""
    return canonical({**report_body(r), "sig": r.sig})


def sign_report(identity: Identity, *, model_id: str, layers: tuple[int, ...], counts: np.ndarray,
                half_life_ms: int, time_ms: int, seq: int) -> DemandReport:
    """A report of ``counts`` (``(len(layers), E)``) signed by ``identity``."""
    c = np.ascontiguousarray(counts, dtype="<f4")
    unsigned = DemandReport(model_id, tuple(int(x) for x in layers), int(c.shape[1]), c, half_life_ms,
                            time_ms, seq, identity.peer_id, identity.public_key)
    return replace(unsigned, sig=identity.sign(REPORT_KIND, canonical(report_body(unsigned))))


def report_from_counter(identity: Identity, counter: DemandCounter, *, model_id: str, seq: int,
                        time_ms: int | None = None) -> DemandReport:
    """Snapshot ``counter`` and sign it: what a backbone publishes every few minutes."""
    return sign_report(identity, model_id=model_id, layers=counter.moe_layers, counts=counter.snapshot(),
                       half_life_ms=max(1, round(counter.config.half_life_s * 1000)),
                       time_ms=int(time.time() * 1000) if time_ms is None else time_ms, seq=seq)


def verify_report(r: DemandReport) -> bool:
    """Whether the report is signed by the key its ``reporter`` peer ID names."""
    if len(r.public_key) != 32 or not is_peer_id(r.reporter):
        return False
    if peer_id_from_public_key(r.public_key) != r.reporter:
        return False
    return verify(r.public_key, REPORT_KIND, canonical(report_body(r)), r.sig)


def decode_report(data: bytes) -> DemandReport:
    """Parse and validate a report; ``ProtocolError`` for anything malformed (not for a bad
    signature: that is ``verify_report``'s call, so callers can count it)."""
    if len(data) > MAX_REPORT_BYTES:
        raise ProtocolError(f"demand report of {len(data)} bytes exceeds {MAX_REPORT_BYTES}", code=3)
    f = Fields(unpack(data), "demand_report")
    if f.raw("type") != DemandReport.TYPE:
        bad("not a demand report")
    model_id = f.text("model_id", max_bytes=128, pattern=MODEL_ID_RE)
    layers = tuple(check_uint(x, "layers[]", hi=2**32 - 1) for x in f.array("layers", lo=1, hi=MAX_REPORT_LAYERS))
    if any(a >= b for a, b in zip(layers, layers[1:])):
        bad("layers must be strictly ascending")
    num_experts = f.uint("num_experts", lo=1, hi=MAX_REPORT_EXPERTS)
    cells = len(layers) * num_experts
    if cells > MAX_REPORT_CELLS:
        bad(f"{cells} counts exceed {MAX_REPORT_CELLS}")
    raw = f.bin("counts", size=4 * cells)
    counts = np.frombuffer(raw, dtype="<f4").reshape(len(layers), num_experts)
    if not np.all(np.isfinite(counts)) or np.any(counts < 0) or np.any(counts > MAX_COUNT):
        bad("counts must be finite, non-negative and plausible", code=6)
    return DemandReport(
        model_id, layers, num_experts, counts, f.uint("half_life_ms", lo=1, hi=MAX_HALF_LIFE_MS),
        f.uint("time_ms"), f.uint("seq"), _peer(f), f.bin("public_key", size=32), f.bin("sig", max_size=64),
    )


def _peer(f: Fields) -> bytes:
    value = f.bin("reporter")
    if not is_peer_id(value):
        bad("reporter is not an Ed25519 peer ID")
    return value


# ---------------------------------------------------------------- merge


@dataclass(frozen=True)
class MergeConfig:
    """How reports from many backbones become one demand."""

    max_age_s: float = 1800.0  # reports whose counts are older than this, seconds, are stale
    max_future_s: float = 300.0  # tolerated clock skew: reports dated further ahead are dropped, seconds
    min_reporters: int = 3  # fewer trusted reports than this: fall back to uniform demand
    outlier_factor: float = 3.0  # drop a report whose distance to the median exceeds this x the median distance
    outlier_floor: float = 0.1  # ... but never drop one closer than this (total-variation distance, 0..1)
    trim: float = 0.2  # per expert, drop this fraction of the lowest and of the highest shares, then average
    max_volume_ratio: float = 4.0  # one report's rate counts at most this x the median rate
    max_reporters: int = 256  # only this many backbones are merged: the most standing, then the most recent
    max_weight_ratio: float = 4.0  # with standing: one reporter weighs at most this x the median weight (by weight)
    standing_window_s: float = 24 * 3600.0  # standing counts the calls a reporter paid for in this window, s


@dataclass(frozen=True, eq=False)
class MergeResult:
    demand: Demand  # the merged demand (uniform when fewer than ``min_reporters`` were trusted)
    accepted: tuple[bytes, ...]  # peer IDs of the backbones whose reports were used
    rejected: dict[str, int]  # reason -> number of reports dropped for it


def merge_reports(reports: Iterable[DemandReport | bytes], shape: ModelShape, *, now_ms: int | None = None,
                  config: MergeConfig = MergeConfig(),
                  standing: Mapping[bytes, float] | None = None) -> MergeResult:
    """Robustly merge demand reports of ``shape``'s model.

    Drops, by reason: ``malformed`` bytes, ``unsigned`` or badly signed reports, reports for
    another ``model`` or ``shape``, ``stale`` (older than ``max_age_s``) or ``future`` ones,
    ``empty`` ones (no calls), superseded reports of the same backbone (``duplicate``), and
    ``outlier`` reports whose share vector lies far from the per-expert median. The survivors'
    shares are combined per expert by a trimmed mean, so one backbone moves no price alone.
    A report's time counts as at most ``now_ms`` (dating it ahead makes it no newer).

    With ``standing`` (reporter peer ID -> verified work, e.g. credits it paid the ledger), a
    reporter without standing is dropped (``no_standing``), weights are capped at
    ``max_weight_ratio`` x their median by weight (``_mass_median``), and the center, the
    outlier distance and the trimmed mean are weighted.
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    rejected: dict[str, int] = {}

    def drop(reason: str) -> None:
        rejected[reason] = rejected.get(reason, 0) + 1

    latest: dict[bytes, DemandReport] = {}
    for item in reports:
        try:
            r = decode_report(item) if isinstance(item, (bytes, bytearray, memoryview)) else item
        except ProtocolError:
            drop("malformed")
            continue
        reason = _reject_reason(r, shape, now, config)
        if reason is None and standing is not None and not standing.get(r.reporter, 0) > 0:
            reason = "no_standing"
        if reason is not None:
            drop(reason)
            continue
        r = replace(r, time_ms=min(r.time_ms, now))  # clamped: a report dated ahead is no newer than now
        old = latest.get(r.reporter)
        if old is not None:
            drop("duplicate")
            if (r.seq, r.time_ms) <= (old.seq, old.time_ms):
                continue
        latest[r.reporter] = r
    def rank(r: DemandReport) -> tuple[float, int, bytes]:
        return (-(standing or {}).get(r.reporter, 0.0), -r.time_ms, r.reporter)

    kept = sorted(latest.values(), key=rank)[: config.max_reporters]
    if len(latest) > len(kept):
        rejected["excess"] = len(latest) - len(kept)
    if not kept:
        return MergeResult(Demand.uniform(shape), (), rejected)
    shares = np.stack([r.counts.reshape(-1).astype(np.float64) / r.counts.sum(dtype=np.float64) for r in kept])
    weights = None
    if standing is not None:
        w = np.array([float(standing[r.reporter]) for r in kept])
        weights = np.minimum(w, config.max_weight_ratio * _mass_median(w, w))
    center = np.median(shares, axis=0) if weights is None else _weighted_quantile(shares, weights, 0.5)
    center /= max(center.sum(), 1e-300)
    distance = 0.5 * np.abs(shares - center).sum(axis=1)  # total variation, 0..1
    typical = float(np.median(distance)) if weights is None else _mass_median(distance, weights)
    limit = max(config.outlier_floor, config.outlier_factor * typical)
    inlier = distance <= limit
    if (~inlier).any():
        rejected["outlier"] = int((~inlier).sum())
    kept = [r for r, ok in zip(kept, inlier) if ok]
    if len(kept) < config.min_reporters:
        return MergeResult(Demand.uniform(shape), tuple(r.reporter for r in kept), rejected)
    share = (_trimmed_mean(shares[inlier], config.trim) if weights is None
             else _weighted_trimmed_mean(shares[inlier], weights[inlier], config.trim))
    rates = np.array([r.rate for r in kept])
    rate = float(np.minimum(rates, config.max_volume_ratio * np.median(rates)).sum())
    demand = Demand(share.reshape(shape.grid) / share.sum(), rate, len(kept))
    return MergeResult(demand, tuple(r.reporter for r in kept), rejected)


def _reject_reason(r: DemandReport, shape: ModelShape, now: int, config: MergeConfig) -> str | None:
    if not r.sig or not verify_report(r):
        return "unsigned"
    if r.model_id != shape.model_id:
        return "model"
    if r.layers != shape.moe_layers or r.num_experts != shape.num_experts or r.counts.shape != shape.grid:
        return "shape"
    if r.time_ms > now + config.max_future_s * 1000:
        return "future"
    if now - r.time_ms > config.max_age_s * 1000:
        return "stale"
    if not float(r.counts.sum(dtype=np.float64)) > 0:
        return "empty"
    return None


def _mass_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value at which half the total weight is reached (values sorted ascending).

    Weights are capped at ``max_weight_ratio`` x the mass median of the standings, not their plain
    median: 200 reporters of 1 credit each next to 40 of 10^6 pull a plain median down to 1 and
    the 40 down to 4 credits each; the mass median stays at 10^6, so many small reporters weigh
    what they paid, not more."""
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    return float(values[order][int(np.searchsorted(cum, 0.5 * cum[-1]))])


def _weighted_quantile(rows: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """Per column: the smallest value at which the cumulative weight reaches ``q`` of the total."""
    order = np.argsort(rows, axis=0, kind="stable")
    values = np.take_along_axis(rows, order, axis=0)
    cum = np.cumsum(weights[order], axis=0)  # (n, cells)
    index = np.minimum((cum < q * cum[-1]).sum(axis=0), rows.shape[0] - 1)
    out: np.ndarray = np.take_along_axis(values, index[None, :], axis=0)[0]
    return out


def _weighted_trimmed_mean(rows: np.ndarray, weights: np.ndarray, trim: float) -> np.ndarray:
    """Per column: drop ``trim`` of the total weight from the lowest and from the highest values
    (splitting a reporter's weight at the cut), average the rest by weight."""
    order = np.argsort(rows, axis=0, kind="stable")
    values = np.take_along_axis(rows, order, axis=0)
    w = weights[order]  # (n, cells)
    hi = np.cumsum(w, axis=0)
    lo = hi - w
    total = hi[-1]
    a, b = trim * total, (1 - trim) * total
    kept = np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0, None)
    out: np.ndarray = (values * kept).sum(axis=0) / np.maximum(kept.sum(axis=0), 1e-300)
    return out


def _trimmed_mean(rows: np.ndarray, trim: float) -> np.ndarray:
    """Per column: sort, drop ``floor(trim * n)`` values at each end, average the rest."""
    n = rows.shape[0]
    cut = min(int(trim * n), (n - 1) // 2)
    ordered = np.sort(rows, axis=0)
    out: np.ndarray = ordered[cut: n - cut].mean(axis=0)
    return out
