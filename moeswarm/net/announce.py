"""Announcements in the DHT: a node's signed record, refreshed on a period, withdrawn at exit.

One record covers the node's blocks (a layer range x an expert range each, ``more_blocks``
beside the first); it is stored under the node's own key for every MoE layer it holds and the node registers as a provider of each layer's key, which is how
backbones find it (``protocol_spec/``: DHT keys). On a libp2p node with gossip the same record
is published first on the model's announcement topic (``moeswarm.net.gossip``), where backbones
see it within a gossip hop or two, and the node keeps a view of the topic to answer joiners'
first views. With ``catalogue`` set it also keeps its entry in the swarm's catalogue
(``moeswarm.net.catalogue``): which models it serves, by config digest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .._tasks import cancel_and_wait
from ..errors import SwarmError
from ..protocol import (
    DHT,
    Announcement,
    BlockRanges,
    Identity,
    announcement_key,
    encode,
    provider_key,
    sign_announcement,
)
from ..protocol._limits import MAX_RECORD_TTL_MS
from .catalogue import (
    CATALOGUE_PROVIDER_KEY,
    CatalogueModel,
    catalogue_key,
    sign_catalogue_entry,
)
from .gossip import ModelGossip, has_gossip

log = logging.getLogger(__name__)
SOFTWARE = "moeswarm/0.1.0"
# A model's topic carries every holder's refresh to every subscriber: with a fixed period, traffic per
# node grows with the swarm (1,000 holders every 240 s: 4.2 announcements/s, 14.6 KB/s per node at the
# measured 3.5 KB per announcement). So a holder on a topic refreshes no more often than its share of
# this rate, given how many holders it observes (``refresh_period``), and its records live as much
# longer (``AnnounceConfig.ttl_s`` per ``interval_s``); moves and withdrawals still go at once
TOPIC_REFRESH_RATE = 2.0  # refreshes per second a model's topic carries, all holders together
MAX_REFRESH_S = 8 * 3600.0  # the period's ceiling: a record then lives 20 h, inside the 24 h a reader accepts
MAX_TTL_S = MAX_RECORD_TTL_MS / 1000 - 3600.0  # records never claim more than 23 h (clock skew, hops)


def refresh_period(holders: float, interval_s: float, rate: float = TOPIC_REFRESH_RATE) -> float:
    """Seconds between refreshes for a holder observing ``holders`` holders on its model's topic:
    ``interval_s`` while they refresh below ``rate`` per second together, longer above, at most
    ``MAX_REFRESH_S`` (``protocol_spec/discovery.md``, "Refresh period")."""
    return max(interval_s, min(holders / rate, MAX_REFRESH_S))


@dataclass(frozen=True)
class AnnounceConfig:
    model_id: str
    layers: tuple[int, int]  # inclusive range held
    moe_layers: tuple[int, ...]  # which of those are MoE layers (the keys written)
    experts: tuple[int, int]  # inclusive range held per layer
    endpoints: tuple[str, ...]  # data-plane URLs
    capacity_bytes: int  # memory given to expert weights, bytes
    interval_s: float = 240.0  # refresh period (protocol_spec: every 4 minutes; longer on a big topic, refresh_period)
    ttl_s: float = 600.0  # records expire this long after each refresh (scaled with the period)
    more_blocks: BlockRanges = ()  # (layers, experts) beside the first
    catalogue: tuple[CatalogueModel, ...] = ()  # what the swarm catalogue says this node serves (none: no entry)
    dht: bool = True  # also store the record under each layer's DHT key and provide the layers (DHT readers,
    # rendezvous); False: the announcement topic only (a node with gossip)

    def blocks(self) -> BlockRanges:
        return ((self.layers, self.experts), *self.more_blocks)


class Announcer:
    """Owns the refresh task; ``start`` publishes once before returning."""

    def __init__(self, dht: DHT, identity: Identity, config: AnnounceConfig,
                 stats: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        self.dht, self.identity, self.config = dht, identity, config
        self.stats = stats  # () -> (throughput pairs/s, load permille)
        self._seq = int(time.time() * 1000)  # monotonic across restarts of this peer
        self._task: asyncio.Task[None] | None = None
        self.last: Announcement | None = None
        self.gossip = ModelGossip(dht, config.model_id, config.moe_layers) if has_gossip(dht) else None
        self.period_s = config.interval_s  # the current refresh period (refresh_period)
        self._counted = (0, time.monotonic())  # topic records counted (observed_holders), and when

    def observed_holders(self) -> float:
        """How many holders this node counts on its model's topic (``refresh_period`` divides it by
        the topic's rate): the records it keeps, or more if the topic brought more records since the
        last call (accepted, or refused for want of room in the bounded view) than one current
        period at ``TOPIC_REFRESH_RATE`` allows. With every holder doing so the topic's rate
        settles at ``TOPIC_REFRESH_RATE``: a rate twice that doubles every period."""
        if self.gossip is None:
            return 0.0
        count, now = self._topic_records(), time.monotonic()
        (before, since), self._counted = self._counted, (count, now)
        rate = (count - before) / max(now - since, 1.0)
        return max(float(len(self.gossip.gate.view)), rate * self.period_s)

    def _topic_records(self) -> int:
        gate = self.gossip.gate if self.gossip is not None else None
        return 0 if gate is None else gate.accepted + gate.refused.get("view full", 0)

    def ttl_s(self) -> float:
        """Records live ``config.ttl_s`` per ``config.interval_s`` of the current period."""
        c = self.config
        return min(c.ttl_s * self.period_s / c.interval_s, max(c.ttl_s, MAX_TTL_S))

    def record(self, ttl_s: float, config: AnnounceConfig | None = None, seq: int | None = None) -> Announcement:
        """A signed record of ``config`` (default: the current one) with the next ``seq`` (or ``seq``)."""
        if seq is None:
            self._seq += 1
            seq = self._seq
        throughput, load = self.stats()
        c = config or self.config
        return sign_announcement(
            self.identity, model_id=c.model_id, layers=c.layers, experts=c.experts, endpoints=c.endpoints,
            capacity_bytes=c.capacity_bytes, throughput=throughput, load_permille=load, software=SOFTWARE,
            seq=seq, expires_at_ms=int((time.time() + ttl_s) * 1000), more_blocks=c.more_blocks,
        )

    async def publish(self, ttl_s: float | None = None, *, provide: bool = True) -> None:
        record = self.record(self.ttl_s() if ttl_s is None else ttl_s)
        value = encode(record)
        if self.gossip is not None:
            try:
                await self.gossip.publish(value)
            except SwarmError as e:  # the DHT still has it
                log.warning("publishing the announcement on %s failed: %s", self.gossip.topic, e)
        for layer in self.config.moe_layers if self.config.dht or self.gossip is None else ():
            await self.dht.put(announcement_key(self.config.model_id, layer, self.identity.peer_id), value)
            if provide:
                await self.dht.provide(provider_key(self.config.model_id, layer))
        if self.config.catalogue:  # the swarm's catalogue: same seq and lifetime as the announcement
            entry = sign_catalogue_entry(self.identity, self.config.catalogue, self.config.endpoints,
                                         seq=record.seq, expires_at_ms=record.expires_at_ms)
            await self.dht.put(catalogue_key(self.identity.peer_id), entry.encode())
            if provide:
                await self.dht.provide(CATALOGUE_PROVIDER_KEY)
        self.last = record

    async def move(self, blocks: Sequence[tuple[tuple[int, int], tuple[int, int]]], moe_layers: Sequence[int],
                   capacity_bytes: int, *, retire_ttl_s: float = 2.0) -> None:
        """Announce other ``blocks`` (layers, experts) instead of the current ones (one record per
        node, new ``seq``); ``moe_layers``: the MoE layers they hold.

        The new record goes under the keys of the new layers. A record stored under a layer's key
        must cover that layer, so the key of each layer no longer held gets a record of that layer
        alone (the old blocks' experts there), expiring in ``retire_ttl_s``, with a ``seq`` below
        the new record's: readers that keep a peer's newest record and re-read it under layers that
        record does not cover (``Discovery``) see the new blocks at once. The caller serves the old
        blocks longer.
        """
        old = self.config
        stale = [L for L in old.moe_layers if L not in moe_layers]
        retire_seqs = range(self._seq + 1, self._seq + 1 + len(stale))
        self._seq += len(stale)
        (layers, experts), *more = blocks
        self.config = replace(old, layers=layers, moe_layers=tuple(moe_layers), experts=experts,
                              capacity_bytes=capacity_bytes, more_blocks=tuple(more))
        await self.publish()
        for layer, seq in zip(stale if self.config.dht or self.gossip is None else (), retire_seqs):
            (first, *rest) = [((layer, layer), E) for L, E in old.blocks() if L[0] <= layer <= L[1]]
            left = replace(old, layers=first[0], experts=first[1], more_blocks=tuple(rest), moe_layers=(layer,))
            record = self.record(retire_ttl_s, left, seq)
            try:
                await self.dht.put(announcement_key(old.model_id, layer, self.identity.peer_id), encode(record))
            except SwarmError as e:  # readers then believe the old record (which we serve) until it expires
                log.warning("retiring the record of layer %d failed: %s", layer, e)

    async def start(self) -> None:
        if self.gossip is not None:
            await self.gossip.start()
            await self.gossip.first_view()  # the mesh forms; our view answers joiners in full
            self.period_s = refresh_period(len(self.gossip.view), self.config.interval_s)
            self._counted = (self._topic_records(), time.monotonic())  # gossip from here on, not the first view
        await self.publish()
        self._task = asyncio.create_task(self._refresh())

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            if self.gossip is not None:  # the period for the next record, and this one's lifetime
                self.period_s = refresh_period(self.observed_holders(), self.config.interval_s)
            try:
                await self.publish()
            except SwarmError as e:  # the DHT may be briefly unreachable: keep trying
                log.warning("announcement refresh failed: %s", e)

    async def withdraw(self) -> None:
        """Stop refreshing and replace the record with one that expires at once."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        with contextlib.suppress(SwarmError, TimeoutError):
            async with asyncio.timeout(10):
                await self.publish(ttl_s=1.0, provide=False)
        if self.gossip is not None:
            await self.gossip.aclose()
