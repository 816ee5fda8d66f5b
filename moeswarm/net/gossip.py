"""A node on a model's announcement topic: freshness by GossipSub, a joiner's first view in one
round trip (``protocol_spec/discovery.md``).

Holders publish each signed announcement on ``announce_topic(model)`` as well as in the DHT;
every subscriber checks each message (``TopicGate``: budgets, then ``validate_record`` exactly as
for a DHT value, then the bounded ``RecordView``) before it is delivered or forwarded. A node that
joins asks a few peers of the topic for every record they keep (``first_view``): one stream per
peer instead of one DHT get per holder; each record is checked as a gossiped one. Answers are
interleaved, so one lying peer cannot fill the view before the honest answers land.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import SwarmError
from ..protocol import Announcement, provider_key
from .gossip_view import FORWARDER_REFUSALS, GossipLimits, TopicGate, announce_topic

log = logging.getLogger(__name__)

FIRST_VIEW_PEERS = 3  # peers asked for a first view
RENDEZVOUS_PEERS = 8  # holders found in the DHT and connected to, so that the topic's mesh forms
# how long a node that just subscribed waits for its connected peers to say they subscribe too
# (their pubsub hello, one round trip) before it looks for holders in the DHT: a DHT lookup costs
# every peer it asks a stream, and it is what made a joining holder slow (below)
TOPIC_PEERS_WAIT_S = 2.0


def has_gossip(node: object) -> bool:
    """Whether ``node`` (a ``DHT``) can carry announcement topics (a ``P2PNode`` with gossip on)."""
    config = getattr(node, "config", None)
    return bool(getattr(config, "gossip", False)) and hasattr(node, "subscribe")


class ModelGossip:
    """Joins ``node`` to ``model_id``'s topic; ``on_record`` (on the event loop) gets each record
    accepted, whoever sent it. ``rendezvous_layers``: MoE layers whose DHT providers are holders
    to connect to when the node knows no peer of the topic."""

    def __init__(self, node: Any, model_id: str, rendezvous_layers: Sequence[int], *,
                 limits: GossipLimits | None = None, num_layers: int | None = None,
                 num_experts: int | None = None, on_record: Callable[[Announcement], None] | None = None) -> None:
        self.node, self.model_id = node, model_id
        self.topic = announce_topic(model_id)
        self.limits = limits or GossipLimits()
        self.gate = TopicGate(model_id, self.limits, num_layers=num_layers, num_experts=num_experts)
        self.rendezvous_layers = list(rendezvous_layers)
        self.on_record = on_record
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def view(self) -> Any:
        return self.gate.view

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.node.subscribe(self.topic, self._check)
        await self.node.serve_records(self.model_id, lambda: self.gate.view.values(self.limits.max_sync_records))

    async def aclose(self) -> None:
        try:
            await self.node.serve_records(self.model_id, None)
            await self.node.unsubscribe(self.topic)
        except SwarmError as e:  # the node is stopping too
            log.debug("leaving %s: %s", self.topic, e)

    async def publish(self, value: bytes) -> None:
        await self.node.publish(self.topic, value)

    def _check(self, forwarder: str, address: str | None, value: bytes, *, budget: bool = True) -> bool | None:
        """True: accepted; False: refused, as every copy of this message would be; None: refused
        for what the forwarder did (its budget: another peer's copy may be taken)."""
        record = self.gate.decide(forwarder, address, value, budget=budget)
        if not isinstance(record, Announcement):
            return None if record in FORWARDER_REFUSALS else False
        if self.on_record is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.on_record, record)
            except RuntimeError:  # the event loop has closed
                pass
        return True

    async def rendezvous(self) -> list[str]:
        """Peers of the topic: those connected that said so, else holders found in the DHT
        (connected to, so that GossipSub grafts them into the mesh).  None for a node connected to
        nobody (a swarm's first node): there is no one to wait for or to ask."""
        if not await self.node.connected_peers():
            return []
        peers = await self._topic_peers()
        if peers:
            return peers
        found: list[str] = []
        for layer in self.rendezvous_layers[:2]:
            try:
                found += await self.node.find_providers(provider_key(self.model_id, layer))
            except SwarmError as e:
                log.info("finding holders of layer %d failed: %s", layer, e)
        found = [p for p in dict.fromkeys(found) if p != self.node.peer_id and p not in peers]

        async def connect(peer: str) -> str | None:
            try:
                await self.node.connect(peer)
                return peer
            except SwarmError as e:
                log.debug("connecting to %s: %s", peer, e)
                return None

        connected = await asyncio.gather(*(connect(p) for p in found[:RENDEZVOUS_PEERS]))
        return peers + [p for p in connected if p is not None]

    async def _topic_peers(self) -> list[str]:
        """Connected peers of the topic, waiting up to ``TOPIC_PEERS_WAIT_S`` for the first."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + TOPIC_PEERS_WAIT_S, 0.05
        while True:
            peers = [p for p in await self.node.topic_peers(self.topic) if p != self.node.peer_id]
            if peers or loop.time() + delay > deadline:
                return peers
            await asyncio.sleep(delay)
            delay = min(0.4, delay * 2)

    async def first_view(self, peers: int = FIRST_VIEW_PEERS) -> int:
        """Ask up to ``peers`` peers of the topic for their records; returns how many records
        were accepted (0: nobody answered, or nobody knew more than we do)."""
        found = await self.rendezvous()
        candidates = random.sample(found, min(peers, len(found)))  # not always the same few

        async def fetch(peer: str) -> list[bytes]:
            try:
                return await self.node.fetch_records(peer, self.model_id, self.limits.max_sync_records)
            except SwarmError as e:
                log.info("first view from %s failed: %s", peer, e)
                return []

        answers = await asyncio.gather(*(fetch(p) for p in candidates))
        accepted = 0
        for value in itertools.chain.from_iterable(itertools.zip_longest(*answers)):  # interleaved
            if value is not None and self._check("sync", None, value, budget=False) is True:
                accepted += 1
        await asyncio.sleep(0)  # the accepted records reach on_record
        return accepted
