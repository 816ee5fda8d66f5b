"""Discovery: keeps a ``SwarmTable`` of who holds which experts, refreshed in the background.

On a libp2p node with gossip (``moeswarm.net.gossip``) the table follows the model's
announcement topic, and a refresh is a first view from a few peers of the topic: one round trip
each, whatever the number of holders. The DHT pass (one get per holder) remains for nodes
without gossip and for a swarm where no peer answers a first view (the first nodes of a swarm).
Nothing here is on the per-token path; the table is what the backbone's dispatch reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from .._tasks import cancel_and_wait
from ..errors import SwarmError
from ..protocol import DHT, Announcement, peer_id_to_str, read_announcements
from .announce import refresh_period
from .gossip import FIRST_VIEW_PEERS, ModelGossip, has_gossip
from .gossip_view import GossipLimits, fits_model
from .routing_table import SwarmTable

__all__ = ["Discovery", "fits_model"]
log = logging.getLogger(__name__)
GOSSIP_RESYNC_S = 120.0  # with gossip, a first view again this often at most (missed messages), and
# from one peer, no more often than holders refresh on a big topic (refresh_period): a first view of
# 1,000 records from 3 peers every 120 s was 8.7 KB/s per backbone, more than the topic's gossip
# A joiner whose first view from the topic holds fewer records than this also reads the DHT once:
# in a young swarm the peers it asked may not know every holder yet (their mesh is still forming),
# and a few dozen DHT gets cost less than a missed replica (the trust checks need every one)
SMALL_VIEW = 32


class Discovery:
    def __init__(self, dht: DHT, table: SwarmTable, moe_layers: Sequence[int], interval_s: float = 10.0, *,
                 num_layers: int | None = None, num_experts: int | None = None,
                 gossip_limits: GossipLimits | None = None) -> None:
        self.dht, self.table = dht, table
        self.num_layers, self.num_experts = num_layers, num_experts
        self._rejected = 0  # records refused because their ranges exceed the model (DHT pass)
        self.moe_layers = list(moe_layers)
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.refreshes = 0
        self.dht_passes = 0  # refreshes that read every holder from the DHT
        self.gossip: ModelGossip | None = None
        if has_gossip(dht):
            self.gossip = ModelGossip(dht, table.model_id, self.moe_layers, limits=gossip_limits,
                                      num_layers=num_layers, num_experts=num_experts, on_record=self._apply)
        self._joined = False
        self._joined_view = False  # a first view was taken (from FIRST_VIEW_PEERS peers; resyncs from one)

    def _apply(self, record: Announcement) -> None:
        """A record the topic's gate accepted: into the table, which stays as bounded as the view."""
        self.table.update(record)
        view = self.gossip.view if self.gossip is not None else None
        if view is not None and len(self.table.holders) > view.max_records:
            for peer in [p for p in self.table.holders if p not in view]:
                del self.table.holders[peer]

    @property
    def rejected(self) -> int:
        """Records refused because their ranges exceed the model."""
        gossiped = self.gossip.gate.refused.get("outside the model", 0) if self.gossip is not None else 0
        return self._rejected + gossiped

    async def refresh(self, *, peers: int = FIRST_VIEW_PEERS) -> None:
        """With gossip: join the topic (once) and take a first view from ``peers`` of its peers;
        when none answers, when the view still leaves an expert without a holder, when a joiner's
        first view is small (``SMALL_VIEW``), or without gossip, one DHT pass (``read_announcements``)."""
        if self.gossip is not None:
            if not self._joined:
                await self.gossip.start()
                self._joined = True
            answered = await self.gossip.first_view(peers if self._joined_view else FIRST_VIEW_PEERS)
            self._joined_view = True
            joining_small = self.refreshes == 0 and len(self.gossip.view) < SMALL_VIEW
            if (answered or len(self.gossip.view)) and not self._uncovered() and not joining_small:
                self.refreshes += 1
                return
        await self._dht_pass()
        self.refreshes += 1

    def _uncovered(self) -> bool:
        """Whether some (layer, expert) has no live holder in the table: then the topic's peers did
        not know every holder yet (a young swarm whose mesh is still forming, a joiner that asked
        peers which joined late) and the DHT, where every holder also writes, fills the view."""
        return self.num_experts is not None and bool(self.table.coverage(self.moe_layers, self.num_experts))

    async def _dht_pass(self) -> None:
        """One pass over every MoE layer's providers (each peer's newest record, including peers
        that moved their block)."""
        self.dht_passes += 1
        for record in await read_announcements(self.dht, self.table.model_id, self.moe_layers):
            if not fits_model(record, self.num_layers, self.num_experts):
                self._rejected += 1
                log.info("ignoring %s: it claims layers %s, experts %s of a model with %s layers, %s experts",
                         peer_id_to_str(record.peer_id), list(record.layers), list(record.experts),
                         self.num_layers, self.num_experts)
                continue
            self.table.update(record)

    async def wait_for_coverage(self, num_experts: int, timeout_s: float) -> set[tuple[int, int]]:
        """Refresh until every (layer, expert) has a live holder or ``timeout_s`` passes; returns what is missing."""
        deadline = time.monotonic() + timeout_s
        delay = 0.2
        while True:
            await self.refresh()
            missing = self.table.coverage(self.moe_layers, num_experts)
            if not missing or time.monotonic() + delay > deadline:
                return missing
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 1.5)

    def resync_s(self) -> float:
        """Seconds until the next background refresh: ``interval_s`` without gossip; with it, a
        first view (from one peer) every ``GOSSIP_RESYNC_S`` at most, and no more often than the
        holders of the topic refresh (``refresh_period`` of the records the view keeps)."""
        if self.gossip is None:
            return self.interval_s
        return max(self.interval_s, refresh_period(len(self.gossip.view), GOSSIP_RESYNC_S))

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_s())
            try:
                await self.refresh(peers=1)
            except SwarmError as e:
                log.warning("discovery refresh failed: %s", e)

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self.gossip is not None and self._joined:
            await self.gossip.aclose()
            self._joined = False
