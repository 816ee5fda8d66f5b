"""Link measurement: round-trip time and bandwidth to each peer, each direction separately.

Links are asymmetric (seed 000: 49 Mbit/s up, 89 Mbit/s down between the same two machines),
and the narrow direction is often the one an expert's outputs come back on, so one number per
peer is not enough.  A probe uses the data plane's ``ping``: plain pings give the round trip;
a ping carrying ``pad`` filler bytes times the way up, one asking for ``want`` bytes back times
the way down.  Each transfer is sized to take about ``target_s`` (doubling from what the last
estimate says), so probes stay short on slow links and still measure fast ones.

``LinkMonitor`` keeps a probe connection to every live holder (apart from the connections
that carry expert calls, so a probe never queues ahead of a call) and re-measures each every
``interval_s``; estimates are smoothed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container
from dataclasses import dataclass

import numpy as np

from .._tasks import cancel_and_wait
from ..errors import ConfigError, NetworkError, ProtocolError
from ..net.client import Connections, ExpertClient
from ..net.routing_table import Holder, SwarmTable
from ..protocol import MAX_PROBE_BYTES, Identity
from .planner import Link

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeConfig:
    interval_s: float = 30.0  # re-measure each peer this often
    pings: int = 3  # plain pings per probe; the fastest is the round trip
    target_s: float = 0.05  # size each bandwidth transfer to take about this long
    min_bytes: int = 64 << 10
    max_bytes: int = MAX_PROBE_BYTES
    rounds: int = 4  # at most this many growing transfers per direction and probe
    timeout_s: float = 10.0
    smoothing: float = 0.5  # weight of the newest measurement
    max_peers: int = 32  # peers kept measured (a swarm of 1,000 is not probed n^2): see choose_probed

    def __post_init__(self) -> None:
        if not 0 < self.min_bytes <= self.max_bytes <= MAX_PROBE_BYTES:
            raise ConfigError(f"probe sizes must satisfy 0 < min <= max <= {MAX_PROBE_BYTES}")


@dataclass
class LinkEstimate:
    rtt_s: float
    up_bps: float  # bytes/s, us -> peer
    down_bps: float  # bytes/s, peer -> us
    measured_at: float  # time.monotonic()
    probes: int = 1

    def link(self, compute_bps: float = Link.compute_bps) -> Link:
        return Link(self.rtt_s, self.up_bps, self.down_bps, compute_bps)

    def as_dict(self) -> dict[str, float]:
        return {"rtt_ms": round(self.rtt_s * 1e3, 3), "up_mbit": round(self.up_bps * 8e-6, 2),
                "down_mbit": round(self.down_bps * 8e-6, 2), "age_s": round(time.monotonic() - self.measured_at, 1),
                "probes": self.probes}


async def _rate(client: ExpertClient, rtt_s: float, start_bytes: int, config: ProbeConfig, *, up: bool) -> float:
    """Bytes/s in one direction: grow the transfer until it takes at least half of ``target_s``."""
    size = max(config.min_bytes, min(config.max_bytes, start_bytes))
    rate = 0.0
    for _ in range(config.rounds):
        seconds = await client.ping(config.timeout_s, pad=size if up else 0, want=0 if up else size)
        transfer = max(seconds - rtt_s, 1e-6)
        rate = size / transfer
        if transfer >= config.target_s / 2 or size >= config.max_bytes:
            break
        size = min(config.max_bytes, max(2 * size, int(rate * config.target_s)))
    return rate


async def measure(client: ExpertClient, config: ProbeConfig = ProbeConfig(),
                  previous: LinkEstimate | None = None) -> tuple[float, float, float]:
    """(rtt_s, up_bps, down_bps) over ``client``'s connection."""
    rtt = min([await client.ping(config.timeout_s) for _ in range(config.pings)])
    guess_up = int(previous.up_bps * config.target_s) if previous else config.min_bytes
    guess_down = int(previous.down_bps * config.target_s) if previous else config.min_bytes
    up = await _rate(client, rtt, guess_up, config, up=True)
    down = await _rate(client, rtt, guess_down, config, up=False)
    return rtt, up, down


def choose_probed(live: list[Holder], max_peers: int, measured: Container[bytes] = ()) -> list[Holder]:
    """The holders to keep measured, at most ``max_peers``: first a cover, so that every expert
    has a measured holder (greedily, the holder adding the most experts not yet covered; ties go
    to holders measured already, then to better scores), then the rest, measured ones and better
    scores first.  Without a cover the planner would have nothing to say about experts whose
    holders all went unprobed."""
    order = sorted(live, key=lambda h: (h.peer_id not in measured, h.score(), h.peer_id))
    if len(order) <= max_peers:
        return order
    owner = np.array([i for i, h in enumerate(order) for _ in h.blocks()])  # a holder may announce several blocks
    lo = np.array([[L[0], E[0]] for h in order for L, E in h.blocks()])
    hi = np.array([[L[1], E[1]] for h in order for L, E in h.blocks()]) + 1
    uncovered = np.ones((int(hi[:, 0].max()), int(hi[:, 1].max())), np.int64)
    chosen: list[int] = []
    while len(chosen) < max_peers:
        s = np.zeros((uncovered.shape[0] + 1, uncovered.shape[1] + 1), np.int64)  # 2-D prefix sums
        s[1:, 1:] = uncovered.cumsum(0).cumsum(1)
        per_block = s[hi[:, 0], hi[:, 1]] - s[lo[:, 0], hi[:, 1]] - s[hi[:, 0], lo[:, 1]] + s[lo[:, 0], lo[:, 1]]
        gain = np.bincount(owner, per_block, minlength=len(order))
        gain[chosen] = 0
        best = int(np.argmax(gain))  # the first of the best: the sort order breaks ties
        if gain[best] <= 0:
            break
        chosen.append(best)
        for b in np.flatnonzero(owner == best):
            uncovered[lo[b, 0]:hi[b, 0], lo[b, 1]:hi[b, 1]] = 0
    taken = set(chosen)
    rest = [i for i in range(len(order)) if i not in taken]
    return [order[i] for i in chosen + rest[: max_peers - len(chosen)]]


class LinkMonitor:
    """Current link estimates to every live holder of a ``SwarmTable`` (see the module docstring)."""

    def __init__(self, identity: Identity, table: SwarmTable, config: ProbeConfig = ProbeConfig()) -> None:
        self.identity = identity
        self.table = table
        self.config = config
        self.links: dict[bytes, LinkEstimate] = {}
        self.errors: dict[bytes, str] = {}
        self.connections = Connections(identity)  # its own: a probe never queues ahead of a call
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0  # probe rounds completed (a test can wait for one)
        self.changed = asyncio.Event()  # set when a peer is first measured, and after a round that measured
        # any (the tier planner replans then, not only on its period)

    def link(self, peer: bytes) -> LinkEstimate | None:
        return self.links.get(peer)

    async def client(self, holder: Holder) -> ExpertClient:
        """This monitor's own connection to ``holder`` (probes and weight fetches, never calls)."""
        return await self.connections.get(holder, self.config.timeout_s)

    async def probe(self, holder: Holder) -> LinkEstimate:
        client = await self.client(holder)
        try:
            rtt, up, down = await measure(client, self.config, self.links.get(holder.peer_id))
        except (NetworkError, ProtocolError):
            await self.connections.drop(holder.peer_id)
            raise
        old = self.links.get(holder.peer_id)
        now = time.monotonic()
        if old is None:
            new = LinkEstimate(rtt, up, down, now)
        else:
            a = self.config.smoothing
            new = LinkEstimate((1 - a) * old.rtt_s + a * rtt, (1 - a) * old.up_bps + a * up,
                               (1 - a) * old.down_bps + a * down, now, old.probes + 1)
        self.links[holder.peer_id] = new
        self.errors.pop(holder.peer_id, None)
        held = self.table.holders.get(holder.peer_id)
        if held is not None:  # the dispatch's expected latency (Holder.score) learns the round trip
            held.probed(rtt)
        if old is None:  # the plan had no figure for this peer at all
            self.changed.set()
        return new

    async def probe_all(self) -> None:
        """One round: every chosen holder whose estimate is missing or older than the interval."""
        now = time.monotonic()
        live = [h for h in self.table.live() if h.peer_id != self.identity.peer_id]
        measured = 0
        for holder in choose_probed(live, self.config.max_peers, self.links):
            old = self.links.get(holder.peer_id)
            if old is not None and now - old.measured_at < self.config.interval_s:
                continue
            try:
                await self.probe(holder)
                measured += 1
            except (NetworkError, ProtocolError, ConfigError) as e:
                self.errors[holder.peer_id] = f"{type(e).__name__}: {e}"
                log.info("probing %s failed: %s", holder.peer_id.hex()[-12:], e)
        self.rounds += 1
        if measured:
            self.changed.set()

    async def start(self) -> None:
        async def loop() -> None:
            while True:
                await self.probe_all()
                await asyncio.sleep(min(self.config.interval_s, 5.0))

        self._task = asyncio.create_task(loop())

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)
        await self.connections.aclose()
