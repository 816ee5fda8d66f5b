"""``moeswarm backbone --gateway``: announce this backbone's API to the swarm as a gateway.

Every ``interval_s`` (and at once when started) the backbone signs a ``GatewayRecord``
(``moeswarm.net.gateways``): its API URL, the model it serves, the free places in its batch, its
price per token and the median round trip it measured to the holders it calls; it stores it under
its own key and provides the gateway key. On exit the record is replaced by one that expires at
once, so clients stop choosing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._tasks import cancel_and_wait
from ..errors import SwarmError
from ..net.gateways import GATEWAY_PROVIDER_KEY, GatewayRecord, gateway_key, sign_gateway

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    url: str  # the API URL announced (what people dial), e.g. http://203.0.113.5:8000
    price_per_token: int = 0  # credits per generated token a person pays this gateway (0: free)
    interval_s: float = 10.0  # re-announce (free slots, round trip) this often
    ttl_s: float = 60.0  # records expire this long after each announcement


class GatewayAnnouncer:
    """Owns the refresh task; ``start`` publishes once before returning."""

    def __init__(self, dht: Any, identity: Any, model_id: str, config: GatewayConfig, max_batch: int,
                 running: Callable[[], int], rtt_s: Callable[[], list[float]]) -> None:
        self.dht, self.identity, self.model_id, self.config = dht, identity, model_id, config
        self.max_batch, self.running, self.rtt_s = max_batch, running, rtt_s
        self._seq = int(time.time() * 1000)
        self._task: asyncio.Task[None] | None = None
        self.last: GatewayRecord | None = None

    def record(self, ttl_s: float) -> GatewayRecord:
        self._seq += 1
        rtts = self.rtt_s()
        return sign_gateway(self.identity, self.config.url, [self.model_id],
                            free_slots=max(0, self.max_batch - self.running()), max_batch=self.max_batch,
                            price_per_token=self.config.price_per_token,
                            rtt_us=int(statistics.median(rtts) * 1e6) if rtts else 0, seq=self._seq,
                            expires_at_ms=int((time.time() + ttl_s) * 1000))

    async def publish(self, ttl_s: float | None = None, *, provide: bool = True) -> None:
        record = self.record(self.config.ttl_s if ttl_s is None else ttl_s)
        await self.dht.put(gateway_key(self.identity.peer_id), record.encode())
        if provide:
            await self.dht.provide(GATEWAY_PROVIDER_KEY)
        self.last = record

    async def start(self) -> None:
        await self.publish()
        self._task = asyncio.create_task(self._refresh())

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.publish()
            except SwarmError as e:
                log.warning("gateway announcement failed: %s", e)

    async def aclose(self) -> None:
        """Stop refreshing and replace the record with one that expires at once."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        with contextlib.suppress(SwarmError, TimeoutError):
            async with asyncio.timeout(5):
                await self.publish(ttl_s=1.0, provide=False)


def holder_rtts(backbone: Any) -> Callable[[], list[float]]:
    """Round trips (seconds) the backbone's link monitor measured to the holders it calls."""

    def rtts() -> list[float]:
        tiers = backbone.tiers
        links = getattr(getattr(tiers, "links", None), "links", {}) if tiers is not None else {}
        return [est.rtt_s for est in links.values()]

    return rtts
