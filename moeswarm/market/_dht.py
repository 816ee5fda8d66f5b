"""The market's I/O shell over the DHT: read announcements and demand reports into a ``MarketState``.

Announcements are read exactly as ``moeswarm.net.discovery.Discovery`` reads them (providers of
each MoE layer's key, then each provider's own record, validated). Demand reports live under::

    /moeswarm/v1/<model_id>/demand/<peer_id base58btc>   value: the signed DemandReport

with the backbone registered as a provider of ``/moeswarm/v1/<model_id>/demand``. The DHT's
record validator must accept those keys through ``validate_demand_record`` (today it accepts
announcements only, so ``publish_demand`` fails and ``fetch_state`` sees uniform demand).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence

from moeswarm.errors import ProtocolError, SwarmError
from moeswarm.protocol import (
    DHT,
    Announcement,
    peer_id_from_str,
    peer_id_to_str,
    provider_key,
    read_announcements,
)

from ._grid import ModelShape
from ._near import NEAR_RTT_S, near_supply
from ._price import PriceConfig, PriceTable
from ._reports import (
    DemandReport,
    MergeConfig,
    decode_report,
    encode_report,
    merge_reports,
    verify_report,
)
from ._state import MarketState
from ._supply import supply_from_holders

log = logging.getLogger(__name__)


def demand_provider_key(model_id: str) -> str:
    """The key whose providers are the backbones publishing demand for ``model_id``."""
    provider_key(model_id, 0)  # validates model_id (ConfigError), as for announcements
    return f"/moeswarm/v1/{model_id}/demand"


def demand_key(model_id: str, peer_id: bytes) -> str:
    """The key under which backbone ``peer_id`` stores its demand report."""
    return f"{demand_provider_key(model_id)}/{peer_id_to_str(peer_id)}"


def validate_demand_record(key: str, value: bytes, *, now_ms: int | None = None,
                           config: MergeConfig = MergeConfig()) -> DemandReport:
    """Accept a DHT value stored under a demand key, or raise ``ProtocolError``.

    Checks: decoding (``decode_report``), key = ``demand_key(report.model_id, report.reporter)``,
    the signature (code 9), and freshness: not older than ``config.max_age_s`` (code 15) nor
    dated further ahead than ``config.max_future_s`` (code 4).
    """
    report = decode_report(value)
    if key != demand_key(report.model_id, report.reporter):
        raise ProtocolError("demand report stored under another key", code=4)
    if not verify_report(report):
        raise ProtocolError("demand report signature does not verify", code=9)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if now - report.time_ms > config.max_age_s * 1000:
        raise ProtocolError("demand report is stale", code=15)
    if report.time_ms > now + config.max_future_s * 1000:
        raise ProtocolError("demand report is dated in the future", code=4)
    return report


async def publish_demand(dht: DHT, report: DemandReport) -> None:
    """Store a signed report under the backbone's demand key and register as its provider."""
    await dht.put(demand_key(report.model_id, report.reporter), encode_report(report))
    await dht.provide(demand_provider_key(report.model_id))


async def fetch_announcements(dht: DHT, shape: ModelShape, *, now_ms: int | None = None) -> list[Announcement]:
    """Every valid announcement of ``shape``'s model, each peer's newest."""
    return await read_announcements(dht, shape.model_id, shape.moe_layers, now_ms=now_ms)


async def fetch_reports(dht: DHT, model_id: str, reporters: Iterable[bytes] = ()) -> list[bytes]:
    """The raw demand reports published for ``model_id`` (validated later, by the merge): those
    of the demand key's providers, and those of ``reporters`` (peer IDs), read by key."""
    try:
        providers = await dht.find_providers(demand_provider_key(model_id))
    except SwarmError as e:
        log.info("find_providers for demand failed: %s", e)
        providers = []
    out: list[bytes] = []
    for peer in dict.fromkeys([*(peer_id_to_str(r) for r in reporters), *providers]):
        try:
            value = await dht.get(demand_key(model_id, peer_id_from_str(peer)))
        except SwarmError as e:
            log.info("demand report of %s unreadable: %s", peer, e)
            continue
        if value is not None:
            out.append(value)
    return out


async def fetch_state(dht: DHT, shape: ModelShape, *, now_ms: int | None = None,
                      extra_reports: Iterable[DemandReport | bytes] = (),
                      previous_prices: PriceTable | None = None,
                      merge_config: MergeConfig = MergeConfig(),
                      price_config: PriceConfig = PriceConfig(),
                      exclude_peers: Collection[bytes] = (),
                      standing: Mapping[bytes, float] | None = None,
                      ledger_url: str | None = None,
                      announcements: Sequence[Announcement] | None = None,
                      round_trips: Mapping[bytes, float] | None = None,
                      near_rtt_s: float = NEAR_RTT_S) -> MarketState:
    """The market's state of ``shape``'s model, read live from the DHT.

    Supply from the validated announcements of every MoE layer, except those of
    ``exclude_peers`` (a node re-evaluating its own block counts itself as it knows it is, not
    as the DHT last heard); demand merged from the reports under the demand key plus
    ``extra_reports`` (e.g. the local backbone's own), weighted by ``standing`` or, given
    ``ledger_url``, by what each reporter paid that ledger for calls in the last
    ``merge_config.standing_window_s``: the ledger names the ``max_reporters`` clients that paid
    the most, their reports are read by key (so a crowd of fresh providers cannot hide them), and
    reporters without standing count for nothing. ``announcements`` already read (by a caller that
    looks at the holders themselves, e.g. ``fetch_announcements``) are used instead of reading them again.
    With ``round_trips`` (peer -> this peer's measured round trip, seconds) the state's ``near``
    is the supply of the holders within ``near_rtt_s``: its region (``_near.py``).
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    read = await fetch_announcements(dht, shape, now_ms=now) if announcements is None else announcements
    holders = [a for a in read if a.peer_id not in exclude_peers]
    if standing is None and ledger_url is not None:
        from ._standing import fetch_top_standing

        standing = await fetch_top_standing(ledger_url, now - int(merge_config.standing_window_s * 1000),
                                            merge_config.max_reporters)
    reports: list[DemandReport | bytes] = [*await fetch_reports(dht, shape.model_id, standing or ()),
                                           *extra_reports]
    merged = merge_reports(reports, shape, now_ms=now, config=merge_config, standing=standing)
    if merged.rejected:
        log.info("demand reports dropped: %s", merged.rejected)
    supply = supply_from_holders(shape, holders, now_ms=now)
    near = None if round_trips is None else near_supply(shape, holders, round_trips, max_rtt_s=near_rtt_s, now_ms=now)
    return MarketState(shape, supply, merged.demand, price_config.epoch_of(now), previous_prices, near)
