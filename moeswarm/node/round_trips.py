"""A volunteer's own round trips to the swarm's holders, for the market's regions.

The market places a hub's first fast copy and the layers it balances by the supply *near* the
volunteer (``market/_near.py``: holders within ``NEAR_RTT_S``). A volunteer has no link probes of
its own (a backbone's ``LinkMonitor`` measures the holders it calls), so before it asks the market
what to hold, and at each re-evaluation, it pings the holders' data planes: the least of a few
pings each, over one short-lived connection, a bounded sample of holders, a few at a time. A holder
that does not answer in time is left out: it is not counted near.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Final, Protocol

from ..errors import ConfigError, NetworkError, ProtocolError
from ..net.client import Connections
from ..protocol import Identity


class Reachable(Protocol):
    """A holder as an announcement (or the routing table's ``Holder``) names it."""

    @property
    def peer_id(self) -> bytes: ...

    @property
    def endpoints(self) -> Sequence[str]: ...

MAX_PEERS: Final = 64  # holders pinged per measurement (a random sample beyond that)
PINGS: Final = 2
TIMEOUT_S: Final = 2.0  # connect + handshake + pings, per holder
CONCURRENCY: Final = 8


async def measure_round_trips(identity: Identity, holders: Sequence[Reachable], *, max_peers: int = MAX_PEERS,
                              pings: int = PINGS, timeout_s: float = TIMEOUT_S,
                              concurrency: int = CONCURRENCY) -> dict[bytes, float]:
    """peer -> this volunteer's round trip to it, seconds (the least of ``pings``), for at most
    ``max_peers`` distinct holders other than itself; holders that did not answer are absent."""
    peers = {h.peer_id: h for h in holders if h.peer_id != identity.peer_id and h.endpoints}
    chosen = list(peers.values())
    if len(chosen) > max_peers:
        chosen = random.sample(chosen, max_peers)
    gate = asyncio.Semaphore(concurrency)
    connections = Connections(identity)  # each endpoint tried in turn; dropped once pinged

    async def one(holder: Reachable) -> tuple[bytes, float | None]:
        async with gate:
            try:
                client = await connections.get(holder, timeout_s)  # type: ignore[arg-type]
                return holder.peer_id, min([await client.ping(timeout_s) for _ in range(pings)])
            except (NetworkError, ProtocolError, ConfigError, OSError):
                return holder.peer_id, None
            finally:
                await connections.drop(holder.peer_id)

    try:
        results = await asyncio.gather(*(one(h) for h in chosen))
    finally:
        await connections.aclose()
    return {peer: rtt for peer, rtt in results if rtt is not None}
