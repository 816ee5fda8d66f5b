"""Announcements in the DHT: a node's signed record, refreshed on a period, withdrawn at exit.

One record covers the node's layer range; it is stored under the node's own key for every MoE
layer it holds and the node registers as a provider of each layer's key, which is how
backbones find it (``protocol_spec/``: DHT keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import SwarmError
from ..protocol import Announcement, Identity, announcement_key, encode, provider_key, sign_announcement

log = logging.getLogger(__name__)
SOFTWARE = "moeswarm/0.1.0"


class DHT(Protocol):
    async def put(self, key: str, value: bytes) -> int: ...  # how many peers stored it
    async def get(self, key: str) -> bytes | None: ...
    async def provide(self, key: str) -> None: ...
    async def find_providers(self, key: str) -> list[str]: ...


@dataclass(frozen=True)
class AnnounceConfig:
    model_id: str
    layers: tuple[int, int]  # inclusive range held
    moe_layers: tuple[int, ...]  # which of those are MoE layers (the keys written)
    experts: tuple[int, int]  # inclusive range held per layer
    endpoints: tuple[str, ...]  # data-plane URLs
    capacity_bytes: int  # memory given to expert weights, bytes
    interval_s: float = 240.0  # refresh period (protocol_spec: every 4 minutes)
    ttl_s: float = 600.0  # records expire this long after each refresh


class Announcer:
    """Owns the refresh task; ``start`` publishes once before returning."""

    def __init__(self, dht: DHT, identity: Identity, config: AnnounceConfig,
                 stats: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        self.dht, self.identity, self.config = dht, identity, config
        self.stats = stats  # () -> (throughput pairs/s, load permille)
        self._seq = int(time.time() * 1000)  # monotonic across restarts of this peer
        self._task: asyncio.Task[None] | None = None
        self.last: Announcement | None = None

    def record(self, ttl_s: float) -> Announcement:
        self._seq += 1
        throughput, load = self.stats()
        c = self.config
        return sign_announcement(
            self.identity, model_id=c.model_id, layers=c.layers, experts=c.experts, endpoints=c.endpoints,
            capacity_bytes=c.capacity_bytes, throughput=throughput, load_permille=load, software=SOFTWARE,
            seq=self._seq, expires_at_ms=int((time.time() + ttl_s) * 1000),
        )

    async def publish(self, ttl_s: float | None = None, *, provide: bool = True) -> None:
        record = self.record(self.config.ttl_s if ttl_s is None else ttl_s)
        value = encode(record)
        for layer in self.config.moe_layers:
            await self.dht.put(announcement_key(self.config.model_id, layer, self.identity.peer_id), value)
            if provide:
                await self.dht.provide(provider_key(self.config.model_id, layer))
        self.last = record

    async def start(self) -> None:
        await self.publish()
        self._task = asyncio.create_task(self._refresh())

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.publish()
            except SwarmError as e:  # the DHT may be briefly unreachable: keep trying
                log.warning("announcement refresh failed: %s", e)

    async def withdraw(self) -> None:
        """Stop refreshing and replace the record with one that expires at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(SwarmError):
            await asyncio.wait_for(self.publish(ttl_s=1.0, provide=False), timeout=10)
