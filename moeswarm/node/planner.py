"""The tier planner: where each expert should be computed, from measured link and disk figures.

Seed 000's thesis as arithmetic.  For one decode step an expert can be

* computed **locally** from the memory-mapped checkpoint: a cache miss reads its bytes from
  disk (``bytes / disk_bps``), then the math streams them from RAM (``bytes / compute_bps``);
* **called** on a remote holder: one round trip plus the hidden states up and the outputs down,
  each direction at its own measured bandwidth (links are asymmetric), plus its compute;
* **fetched**: its weights pulled from a holder into the local cache once (``bytes / down_bps``),
  amortised over the calls it will serve while cached, then computed locally.

The plan picks the cheapest per expert; experts of one MoE layer called on different holders
run in parallel, so a layer costs its slowest path.  Everything here is a pure function of the
figures passed in: the node measures, this decides, ``moeswarm node status`` shows it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

LOCAL, REMOTE, FETCH = "local", "remote", "fetch"


@dataclass(frozen=True)
class Link:
    """Measured path to one peer; bandwidths in bytes per second, each direction separately."""

    rtt_s: float  # round trip, seconds
    up_bps: float  # us -> peer
    down_bps: float  # peer -> us
    compute_bps: float = 10e9  # the peer's weight-streaming rate (memory bandwidth), bytes/s
    fetch_bps: float | None = None  # weights per second its past fetches delivered, if any (else down_bps)
    fetchable: bool = True  # False once it sent weights that differed from the published digests


@dataclass(frozen=True)
class LocalTier:
    disk_bps: float  # bytes/s read from the checkpoint's disk on a cache miss
    compute_bps: float  # bytes/s of expert weights the local matmuls stream (RAM bandwidth bound)
    hit_rate: float = 0.0  # fraction of expert uses already resident (from the expert cache)


@dataclass(frozen=True)
class ExpertSpec:
    layer: int
    expert: int
    bytes: int  # weight bytes
    holders: tuple[str, ...] = ()  # peers that serve it
    local: bool = True  # present in the local checkpoint
    reuse: float = 1.0  # expected calls served while cached, if fetched
    resident: float | None = None  # share of its bytes in RAM now (None: the tier's hit rate)


@dataclass
class Decision:
    tier: str  # LOCAL, REMOTE or FETCH
    seconds: float  # predicted cost per use
    peer: str | None = None


@dataclass
class Plan:
    decisions: dict[tuple[int, int], Decision] = field(default_factory=dict)
    seconds_per_token: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.seconds_per_token if self.seconds_per_token > 0 else float("inf")

    def counts(self) -> dict[str, int]:
        out = {LOCAL: 0, REMOTE: 0, FETCH: 0}
        for d in self.decisions.values():
            out[d.tier] += 1
        return out


def local_seconds(spec: ExpertSpec, local: LocalTier) -> float:
    hit = local.hit_rate if spec.resident is None else spec.resident
    return (1 - hit) * spec.bytes / local.disk_bps + spec.bytes / local.compute_bps


def remote_seconds(spec: ExpertSpec, link: Link, tokens: int, hidden_bytes: int) -> float:
    payload = tokens * hidden_bytes
    return link.rtt_s + payload / link.up_bps + payload / link.down_bps + spec.bytes / link.compute_bps


def fetch_seconds(spec: ExpertSpec, link: Link, local: LocalTier) -> float:
    rate = link.fetch_bps or link.down_bps  # what fetching did deliver beats what a probe suggests
    return (link.rtt_s + spec.bytes / rate) / max(spec.reuse, 1.0) + spec.bytes / local.compute_bps


def decide(spec: ExpertSpec, local: LocalTier, links: Mapping[str, Link], tokens: int, hidden_bytes: int) -> Decision:
    options = [Decision(LOCAL, local_seconds(spec, local))] if spec.local else []
    for peer in spec.holders:
        link = links.get(peer)
        if link is None:
            continue
        options.append(Decision(REMOTE, remote_seconds(spec, link, tokens, hidden_bytes), peer))
        if link.fetchable:
            options.append(Decision(FETCH, fetch_seconds(spec, link, local), peer))
    if not options:
        return Decision(REMOTE, float("inf"))
    return min(options, key=lambda d: (d.seconds, d.tier))


def plan(experts: Sequence[ExpertSpec], local: LocalTier, links: Mapping[str, Link], *, tokens: int = 1,
         hidden_bytes: int = 4096, top_k: int = 1, backbone_seconds: float = 0.0) -> Plan:
    """Decide every expert, and predict one step's time.

    Each MoE layer uses ``top_k`` of its experts, taken to be a typical sample of the layer:
    with a share ``r`` of its experts called remotely, the step computes ``top_k * (1 - r)``
    experts here one after another, and makes remote calls (in parallel) with probability
    ``1 - (1 - r) ** top_k``.
    """
    result = Plan()
    per_layer: dict[int, list[Decision]] = {}
    for spec in experts:
        d = decide(spec, local, links, tokens, hidden_bytes)
        result.decisions[(spec.layer, spec.expert)] = d
        per_layer.setdefault(spec.layer, []).append(d)
    total = backbone_seconds
    for decisions in per_layer.values():
        here = [d.seconds for d in decisions if d.tier != REMOTE]
        away = [d.seconds for d in decisions if d.tier == REMOTE]
        r = len(away) / len(decisions)
        if here:
            total += top_k * (1 - r) * sum(here) / len(here)
        if away:
            total += (1 - (1 - r) ** top_k) * sum(away) / len(away)
    result.seconds_per_token = total
    return result
