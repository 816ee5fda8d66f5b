"""Discovery: keeps a ``SwarmTable`` of who holds which experts, refreshed in the background.

Lookups go to the DHT on a period and never on the per-token path; the table is what the
backbone's dispatch reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from .._tasks import cancel_and_wait
from ..errors import SwarmError
from ..protocol import DHT, Announcement, peer_id_to_str, read_announcements
from .routing_table import SwarmTable

log = logging.getLogger(__name__)


def fits_model(record: Announcement, num_layers: int | None, num_experts: int | None) -> bool:
    """Whether a record's ranges lie inside the model (layers below ``num_layers``, experts below
    ``num_experts``; ``None``: not known). A record claiming more than the model has is a lie
    (it would win every holder choice), not a holder of what it does have."""
    return all((num_layers is None or layers[1] < num_layers) and (num_experts is None or experts[1] < num_experts)
               for layers, experts in record.blocks())


class Discovery:
    def __init__(self, dht: DHT, table: SwarmTable, moe_layers: Sequence[int], interval_s: float = 10.0, *,
                 num_layers: int | None = None, num_experts: int | None = None) -> None:
        self.dht, self.table = dht, table
        self.num_layers, self.num_experts = num_layers, num_experts
        self.rejected = 0  # records refused because their ranges exceed the model
        self.moe_layers = list(moe_layers)
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.refreshes = 0

    async def refresh(self) -> None:
        """One pass over every MoE layer's providers (``read_announcements``: each peer's newest
        record, including peers that moved their block)."""
        for record in await read_announcements(self.dht, self.table.model_id, self.moe_layers):
            if not fits_model(record, self.num_layers, self.num_experts):
                self.rejected += 1
                log.info("ignoring %s: it claims layers %s, experts %s of a model with %s layers, %s experts",
                         peer_id_to_str(record.peer_id), list(record.layers), list(record.experts),
                         self.num_layers, self.num_experts)
                continue
            self.table.update(record)
        self.refreshes += 1

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

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except SwarmError as e:
                log.warning("discovery refresh failed: %s", e)

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
