"""Who holds which experts, and the pure choice of replicas for one MoE layer's dispatch."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..protocol import Announcement, BlockRanges

DEFAULT_RTT_S = 0.005  # assumed round trip for a holder not measured yet
NEARLY_AS_GOOD = 1.5  # reuse an already chosen holder if its score is within this factor of the best


@dataclass
class Holder:
    """A peer that serves experts, as announced and as measured by us."""

    peer_id: bytes
    endpoints: tuple[str, ...]
    model_id: str
    layers: tuple[int, int]  # inclusive
    experts: tuple[int, int]  # inclusive
    expires_at_ms: int
    seq: int
    load_permille: int = 0
    throughput: int = 0
    rtt_s: float | None = None  # smoothed measured round trip minus server compute, seconds
    failures: int = 0  # consecutive failed calls
    banned_until: float = 0.0  # monotonic seconds; skipped until then
    software: str = ""  # as announced, e.g. "moeswarm/0.1.0"
    more_blocks: BlockRanges = ()  # as announced: blocks beside the first
    in_flight: int = 0  # our calls to it not answered yet
    service_s: float | None = None  # smoothed compute time of one of our calls there, seconds (as it reports)

    def blocks(self) -> BlockRanges:
        """Every (layers, experts) block it announced, the first one first."""
        return ((self.layers, self.experts), *self.more_blocks)

    def holds(self, layer: int, expert: int) -> bool:
        return any(L[0] <= layer <= L[1] and E[0] <= expert <= E[1] for L, E in self.blocks())

    def score(self) -> float:
        """Lower is better: the expected latency of one more call, seconds: the measured round trip
        (link probes, then calls; a call's includes its wait in the holder's queue), inflated by the
        load it reports, plus the calls we already have in flight there, each its compute time."""
        rtt = self.rtt_s if self.rtt_s is not None else DEFAULT_RTT_S
        return rtt * (1 + self.load_permille / 1000) + self.in_flight * (self.service_s or 0.0)

    def observe(self, seconds: float, load_permille: int, compute_s: float | None = None) -> None:
        """A call answered: ``seconds`` from sending to the answer minus its compute time."""
        self.rtt_s = seconds if self.rtt_s is None else 0.7 * self.rtt_s + 0.3 * seconds
        if compute_s is not None:
            self.service_s = compute_s if self.service_s is None else 0.7 * self.service_s + 0.3 * compute_s
        self.load_permille = load_permille
        self.failures = 0

    def probed(self, rtt_s: float) -> None:
        """A link probe's round trip (pings: no queue): where no call measured the holder yet it is
        the estimate; else it pulls the calls' estimate back toward the network's round trip (the
        queue a call waited in once, e.g. while the holder was loaded, does not stay forever)."""
        self.rtt_s = rtt_s if self.rtt_s is None else min(self.rtt_s, 0.5 * self.rtt_s + 0.5 * rtt_s)

    def fail(self, now: float) -> None:
        self.failures += 1
        self.banned_until = now + min(60.0, 0.5 * 2 ** min(self.failures, 7))


class SwarmTable:
    """Holders of one model, updated from validated announcements."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.holders: dict[bytes, Holder] = {}
        self.excluded: dict[bytes, str] = {}  # peer -> why: caught returning wrong outputs; never live again

    def update(self, ann: Announcement) -> None:
        if ann.model_id != self.model_id:
            return
        old = self.holders.get(ann.peer_id)
        if old is not None and old.seq >= ann.seq:
            return
        h = Holder(ann.peer_id, ann.endpoints, ann.model_id, ann.layers, ann.experts, ann.expires_at_ms, ann.seq,
                   ann.load_permille, ann.throughput, software=ann.software, more_blocks=ann.more_blocks)
        if old is not None and old.endpoints == ann.endpoints:  # keep what we measured
            h.rtt_s, h.failures, h.banned_until = old.rtt_s, old.failures, old.banned_until
            h.in_flight, h.service_s = old.in_flight, old.service_s
        self.holders[ann.peer_id] = h

    def live(self, now_ms: int | None = None, now: float | None = None) -> list[Holder]:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        now = time.monotonic() if now is None else now
        return [h for h in self.holders.values()
                if h.expires_at_ms > now_ms and h.banned_until <= now and h.peer_id not in self.excluded]

    def coverage(self, layers: Iterable[int], num_experts: int) -> set[tuple[int, int]]:
        """The (layer, expert) pairs that no live holder serves."""
        live = self.live()
        return {(L, e) for L in layers for e in range(num_experts) if not any(h.holds(L, e) for h in live)}


def plan_dispatch(
    layer: int, experts: Iterable[int], holders: list[Holder], exclude: set[bytes] = frozenset()  # type: ignore[assignment]
) -> tuple[dict[bytes, list[int]], list[int]]:
    """Choose one holder per expert: the best score, preferring holders already chosen when
    nearly as good (fewer requests).  Returns ({peer: experts}, experts nobody holds)."""
    plan: dict[bytes, list[int]] = {}
    missing: list[int] = []
    for e in sorted(set(int(x) for x in experts)):
        options = [h for h in holders if h.holds(layer, e) and h.peer_id not in exclude]
        if not options:
            missing.append(e)
            continue
        best = min(options, key=lambda h: (h.score(), h.peer_id))
        reuse = [h for h in options if h.peer_id in plan and h.score() <= NEARLY_AS_GOOD * best.score()]
        chosen = min(reuse, key=lambda h: (h.score(), h.peer_id)) if reuse else best
        plan.setdefault(chosen.peer_id, []).append(e)
    return plan, missing
