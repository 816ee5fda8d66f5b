"""The tier planner, live: measured figures in, a decision per expert out, re-planned as they change.

``planner.plan`` is the arithmetic; this module feeds it what this machine and its links really
do and keeps the result current:

* the **local tier**: disk bandwidth (a timed cold read of the checkpoint), the rate the expert
  math streams weights (a timed expert), and per expert whether its pages are in RAM now
  (``mincore``);
* the **links**: round trip and bandwidth to each holder, each direction (``LinkMonitor``);
* the **holders**: who serves what, and how fast they compute (their announcements);
* **demand**: how often the routers pick each expert (``DemandCounter``), which says how many
  calls a fetched copy would serve.

Every ``replan_s`` the plan is recomputed; with ``act=True`` a backbone follows it (the
executor asks ``tier_of`` per expert) and experts planned ``fetch`` are pulled, in the
background, into a bounded cache (``FetchedExperts``); until one arrives it is called remotely.
A node that only serves runs the same planner for ``moeswarm node status``: what it would do if
it ran the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._tasks import cancel_and_wait
from ..errors import BadResponse, NetworkError, ProtocolError, SwarmError
from ..model import ExpertWeights, ModelConfig, Weights
from ..model.memory import resident_fraction
from ..model.weights import stored_expert_bytes
from ..net.routing_table import Holder, SwarmTable
from ..protocol import ErrorCode, peer_id_to_str
from . import planner
from .fetch import FetchedExperts, expert_digest, fetch_expert
from .links import LinkMonitor, ProbeConfig
from .measure import (
    ASSUMED_DISK_BPS,
    measure_backbone_seconds,
    measure_compute_bps,
    measure_disk_bps,
)

if TYPE_CHECKING:
    from ..market import DemandCounter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierConfig:
    act: bool = False  # follow the plan (a backbone with --tiers auto) or only show it
    force: str | None = None  # "fetch": every expert fetched on a miss and computed here (the remote-RAM
    # cold tier of seed 000, for benchmarks and for links faster than the local disk); None: plan
    replan_s: float = 10.0
    horizon_tokens: float = 256.0  # tokens a fetched expert is expected to stay cached for
    fetch_cache_bytes: int = 1 << 30
    wire_bytes_per_value: int = 4  # hidden states travel as float32


class TierPlanner:
    def __init__(self, cfg: ModelConfig, table: SwarmTable, links: LinkMonitor, *, self_peer: bytes,
                 local: Weights | None = None, demand: "DemandCounter | None" = None,
                 backbone: Weights | None = None, config: TierConfig = TierConfig(),
                 digests: dict[tuple[int, int], str] | None = None) -> None:
        self.cfg = cfg
        self.table = table
        self.links = links
        self.self_peer = self_peer
        self.local = local
        self.demand = demand
        self.config = config
        self.moe = [L for L in range(cfg.num_layers) if cfg.moe_layers[L]]
        self.fetched = FetchedExperts(config.fetch_cache_bytes)
        self.plan: planner.Plan | None = None
        self.planned_at = 0.0
        self.backbone = backbone  # the non-expert weights, to time a step without its experts
        self.backbone_s = 0.0
        self.local_tier = planner.LocalTier(disk_bps=ASSUMED_DISK_BPS, compute_bps=10e9)
        self._inflight: dict[tuple[int, int], asyncio.Task[ExpertWeights]] = {}
        self.fetch_errors = 0
        self.digests = digests  # expert_digests.json: fetched experts are checked against it, if given
        self.fetch_verified = 0
        self.fetch_rejected = 0  # fetched experts that differed from their digest
        self.no_fetch_from: set[bytes] = set()  # holders that sent such weights: never fetched from again
        self.fetch_bps: dict[bytes, float] = {}  # per holder: weight bytes/s its fetches delivered (smoothed)
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ figures

    def calibrate(self) -> None:
        """Measure the local tier (blocking: run it in a thread)."""
        sample = next((e for L in self.moe for e in (self.local.experts.get(L) or {}).values()), None) \
            if self.local is not None else None
        disk = measure_disk_bps(self.local) if self.local is not None else ASSUMED_DISK_BPS
        self.local_tier = planner.LocalTier(disk_bps=disk, compute_bps=measure_compute_bps(self.cfg, sample))
        if self.backbone is not None:
            self.backbone_s = measure_backbone_seconds(self.backbone)

    def expert_bytes(self, layer: int, expert: int) -> int:
        if self._in_local_map(layer, expert):
            return self.local.experts[layer][expert].nbytes  # type: ignore[union-attr]
        return stored_expert_bytes(self.cfg)  # as quantization_config says they are stored, else 16-bit

    def _uses_per_token(self) -> np.ndarray:
        """(L, E): expected uses of each expert per token, from the routers' counts if any."""
        k, E = self.cfg.top_k, self.cfg.num_experts
        even = np.full((len(self.moe), E), k / E)
        if self.demand is None:
            return even
        counts = self.demand.snapshot()
        totals = counts.sum(axis=1, keepdims=True)
        return np.where(totals > 0, counts * k / np.maximum(totals, 1e-12), even)

    def specs(self, live: list[Holder] | None = None,
              fetched: frozenset[tuple[int, int]] | None = None) -> list[planner.ExpertSpec]:
        live = [h for h in (self.table.live() if live is None else live) if h.peer_id != self.self_peer]
        fetched = frozenset(self.fetched.keys()) if fetched is None else fetched
        uses = self._uses_per_token()
        out = []
        for row, L in enumerate(self.moe):
            held_here = self.local.experts.get(L, {}) if self.local is not None else {}
            for e in range(self.cfg.num_experts):
                key = (L, e)
                cached = key in fetched
                local = e in held_here or cached
                resident = 1.0 if cached else (resident_fraction(held_here[e]) if e in held_here else None)
                out.append(planner.ExpertSpec(
                    L, e, self.expert_bytes(L, e),
                    holders=tuple(h.peer_id.hex() for h in live if h.holds(L, e)),
                    local=local, reuse=max(1.0, float(uses[row, e]) * self.config.horizon_tokens),
                    resident=resident))
        return out

    def link_table(self) -> dict[str, planner.Link]:
        """A link per live holder: as measured; for holders the monitor does not probe (a big
        swarm), the median measured link, with the round trip of their calls if we made any."""
        out = {}
        live = self.table.live()
        estimates = {h.peer_id: self.links.link(h.peer_id) for h in live}
        measured = [e for e in estimates.values() if e is not None]
        typical = planner.Link(float(np.median([e.rtt_s for e in measured])),
                               float(np.median([e.up_bps for e in measured])),
                               float(np.median([e.down_bps for e in measured]))) if measured else None
        for h in live:
            est = estimates[h.peer_id]
            expert = self.expert_bytes(*(h.layers[0], h.experts[0]))
            compute = expert * h.throughput if h.throughput else planner.Link.compute_bps
            if est is not None:
                link = est.link(compute)
            elif typical is not None:
                link = dataclasses.replace(typical, rtt_s=h.rtt_s or typical.rtt_s, compute_bps=compute)
            else:
                continue
            if h.rtt_s is not None and h.rtt_s > link.rtt_s:  # calls observed slower than pings: dispatch costs too
                link = dataclasses.replace(link, rtt_s=h.rtt_s)
            if h.peer_id in self.fetch_bps:  # fetches observed: four chunks in flight, not one probe
                link = dataclasses.replace(link, fetch_bps=self.fetch_bps[h.peer_id])
            if h.peer_id in self.no_fetch_from:
                link = dataclasses.replace(link, fetchable=False)
            out[h.peer_id.hex()] = link
        return out

    def _in_local_map(self, layer: int, expert: int) -> bool:
        return self.local is not None and expert in self.local.experts.get(layer, {})

    @property
    def _hidden_bytes(self) -> int:
        """One token's hidden state on the wire."""
        return self.cfg.hidden_size * self.config.wire_bytes_per_value

    def replan(self, live: list[Holder] | None = None, links: dict[str, planner.Link] | None = None,
               fetched: frozenset[tuple[int, int]] | None = None) -> planner.Plan:
        """Recompute the plan.  A caller off the event loop passes what it read on the loop: the
        live holders, the link table and the fetched experts (``replan_soon`` does)."""
        fetched = frozenset(self.fetched.keys()) if fetched is None else fetched
        links = self.link_table() if links is None else links
        specs = self.specs(live, fetched)
        plan = planner.plan(specs, self.local_tier, links, tokens=1, hidden_bytes=self._hidden_bytes,
                            top_k=self.cfg.top_k, backbone_seconds=self.backbone_s)
        self._cap_fetches(plan, specs, links)
        for key in fetched:  # fetched copies compute here, but say where they came from
            d = plan.decisions.get(key)
            if d is not None and d.tier == planner.LOCAL and not self._in_local_map(*key):
                plan.decisions[key] = planner.Decision(planner.FETCH, d.seconds, d.peer)
        self.plan, self.planned_at = plan, time.monotonic()
        return plan

    def _cap_fetches(self, plan: planner.Plan, specs: list[planner.ExpertSpec],
                     links: dict[str, planner.Link]) -> None:
        """Keep ``fetch`` only for what fits the cache, the most used first; the rest go remote."""
        by_key = {(s.layer, s.expert): s for s in specs}
        want = sorted((k for k, d in plan.decisions.items() if d.tier == planner.FETCH),
                      key=lambda k: -by_key[k].reuse)
        room = self.config.fetch_cache_bytes
        for key in want:
            size = by_key[key].bytes
            if size <= room:
                room -= size
                continue
            d = plan.decisions[key]
            link = links.get(d.peer or "")
            seconds = planner.remote_seconds(by_key[key], link, 1, self._hidden_bytes) if link else d.seconds
            plan.decisions[key] = planner.Decision(planner.REMOTE, seconds, d.peer)

    async def replan_soon(self) -> planner.Plan:
        """``replan`` in a worker thread (residency checks cost ~10 us per expert), from a snapshot
        of what the event loop owns."""
        snapshot = self.table.live(), self.link_table(), frozenset(self.fetched.keys())
        return await asyncio.to_thread(self.replan, *snapshot)

    # ------------------------------------------------------------ acting on it

    def tier_of(self, layer: int, expert: int) -> str:
        """Where to compute this expert now: LOCAL (from the map or a fetched copy) or REMOTE."""
        if self.config.force == planner.FETCH:
            return planner.FETCH  # fetched now if not cached: see ensure()
        if self.plan is None:
            return planner.REMOTE
        d = self.plan.decisions.get((layer, expert))
        if d is None or d.tier == planner.REMOTE:
            return planner.REMOTE
        if d.tier == planner.FETCH:
            return planner.LOCAL if (layer, expert) in self.fetched else planner.REMOTE
        return planner.LOCAL

    def weights(self, layer: int, expert: int) -> ExpertWeights | None:
        """The weights to compute locally: a fetched copy, else the local map."""
        w = self.fetched.get((layer, expert))
        if w is not None:
            return w
        if self.local is not None:
            return self.local.experts.get(layer, {}).get(expert)
        return None

    async def ensure(self, layer: int, expert: int, peer: bytes | None = None) -> ExpertWeights:
        """The expert's weights here, fetched now on a miss: from ``peer`` if given, else from the
        best-measured holder.  Concurrent asks for one expert share one fetch."""
        key = (layer, expert)
        w = self.fetched.get(key)
        if w is not None:
            return w
        task = self._inflight.get(key)
        if task is None:
            if self.digests is not None and key not in self.digests:
                raise SwarmError(f"expert {expert} of layer {layer} is not in the digest file: "
                                 "it is called, not fetched")
            holders = [h for h in self.table.live() if h.holds(layer, expert) and h.peer_id != self.self_peer
                       and h.peer_id not in self.no_fetch_from]
            if peer is not None:
                holders = [h for h in holders if h.peer_id == peer] or holders
            if not holders:
                raise SwarmError(f"no holder of expert {expert} of layer {layer} to fetch it from")
            best = min(holders, key=lambda h: (self.links.link(h.peer_id) is None, h.score(), h.peer_id))
            # the fetch is the planner's task, not the first asker's: an asker that is cancelled
            # (its request was) leaves the others waiting on a fetch that goes on
            task = asyncio.create_task(self._fetch(key, best), name=f"fetch expert {expert} of layer {layer}")
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._fetch_done(key, t))
        return await asyncio.shield(task)

    async def _fetch(self, key: tuple[int, int], holder: Holder) -> ExpertWeights:
        client = await self.links.client(holder)
        t0 = time.perf_counter()
        w = await fetch_expert(client, self.cfg, self.table.model_id, *key)
        rate = w.nbytes / max(time.perf_counter() - t0, 1e-6)
        old = self.fetch_bps.get(holder.peer_id)
        self.fetch_bps[holder.peer_id] = rate if old is None else 0.5 * old + 0.5 * rate
        if self.digests is not None:  # the publisher's word on what each expert is (see moeswarm.node.fetch)
            got = await asyncio.to_thread(expert_digest, w, self.cfg)  # hashing megabytes: off the loop
            if got != self.digests.get(key):
                # not banned from calls: a stale digest file must not take every holder away;
                # its outputs are what the audits check
                self.fetch_rejected += 1
                self.no_fetch_from.add(holder.peer_id)
                raise BadResponse(f"expert {key[1]} of layer {key[0]} from {peer_id_to_str(holder.peer_id)} "
                                  "does not match its digest", code=ErrorCode.BAD_TENSOR)
            self.fetch_verified += 1
        self.fetched.put(key, w)
        return w

    def _fetch_done(self, key: tuple[int, int], task: asyncio.Task[ExpertWeights]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: the askers re-raise it; with none left it is not logged as lost

    async def fetch_planned(self) -> int:
        """Pull the experts planned ``fetch`` that are not cached yet, one at a time; returns how many."""
        if self.plan is None:
            return 0
        done = 0
        for key, d in list(self.plan.decisions.items()):
            if d.tier != planner.FETCH or key in self.fetched or key in self._inflight or d.peer is None:
                continue
            peer = bytes.fromhex(d.peer)
            if peer not in self.table.holders:
                continue
            try:
                await self.ensure(*key, peer=peer)
                done += 1
            except (NetworkError, ProtocolError, SwarmError) as e:
                self.fetch_errors += 1
                log.info("fetching expert %s from %s failed: %s", key, d.peer[-12:], e)
        return done

    async def start(self) -> None:
        await asyncio.to_thread(self.calibrate)

        async def loop() -> None:
            min_gap = min(1.0, self.config.replan_s)  # a big swarm's first probes do not replan 32 times over
            while True:
                self.links.changed.clear()  # links measured from here on wake the next round early
                started = time.monotonic()
                try:
                    await self.replan_soon()
                    if self.config.act:
                        await self.fetch_planned()
                except Exception:  # noqa: BLE001 - a planning bug must not stop serving; it is logged
                    log.exception("tier planning failed")
                with contextlib.suppress(TimeoutError):  # every replan_s, or as soon as links are (re)measured
                    async with asyncio.timeout(self.config.replan_s):
                        await self.links.changed.wait()
                await asyncio.sleep(max(0.0, started + min_gap - time.monotonic()))

        self._task = asyncio.create_task(loop())

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)
        for task in list(self._inflight.values()):
            await cancel_and_wait(task)

    # ------------------------------------------------------------ status

    def status(self, per_layer: bool = True) -> dict[str, Any]:
        plan = self.plan
        out: dict[str, Any] = {
            "acting": self.config.act,
            "local_tier": {"disk_mb_s": round(self.local_tier.disk_bps / 1e6, 1),
                           "compute_gb_s": round(self.local_tier.compute_bps / 1e9, 2),
                           "step_without_experts_ms": round(self.backbone_s * 1e3, 3)},
            "links": {peer_id_to_str(p): est.as_dict() for p, est in self.links.links.items()},
            "link_errors": {peer_id_to_str(p): msg for p, msg in self.links.errors.items()},
            "fetched": {"experts": len(self.fetched), "bytes": self.fetched.bytes,
                        "bytes_fetched": self.fetched.fetched_bytes, "errors": self.fetch_errors,
                        "checked": self.digests is not None, "verified": self.fetch_verified,
                        "rejected": self.fetch_rejected,
                        "not_fetched_from": sorted(peer_id_to_str(p) for p in self.no_fetch_from),
                        "rate_mbit": {peer_id_to_str(p): round(r * 8e-6, 1) for p, r in self.fetch_bps.items()}},
        }
        if plan is None:
            return out
        predicted = round(plan.tokens_per_s, 2) if plan.tokens_per_s > 0 else None  # None: no holder measured yet
        out["plan"] = {"age_s": round(time.monotonic() - self.planned_at, 1), "counts": plan.counts(),
                       "predicted_tokens_per_s": predicted}
        if per_layer:
            layers: dict[str, dict[str, list[int]]] = {}
            for (L, e), d in sorted(plan.decisions.items()):
                layers.setdefault(str(L), {}).setdefault(d.tier, []).append(e)
            out["plan"]["layers"] = layers
        return out


async def start_planner(stack: contextlib.AsyncExitStack, identity: Any, p2p: Any, cfg: ModelConfig, model_id: str,
                        *, local: Weights | None, table: SwarmTable | None = None, demand: "DemandCounter | None" = None,
                        probe: ProbeConfig | None = None, config: TierConfig = TierConfig(),
                        backbone: Weights | None = None,
                        digests: dict[tuple[int, int], str] | None = None) -> TierPlanner:
    """Links measured, holders discovered (unless ``table`` is kept current by someone else) and the
    plan kept current, all closed with ``stack``."""
    from ..net.discovery import Discovery

    moe = [L for L in range(cfg.num_layers) if cfg.moe_layers[L]]
    if table is None:
        table = SwarmTable(model_id)
        discovery = Discovery(p2p, table, moe, num_layers=cfg.num_layers, num_experts=cfg.num_experts)
        with contextlib.suppress(SwarmError):
            await discovery.refresh()
        await discovery.start()
        stack.push_async_callback(discovery.aclose)
    probe = probe or ProbeConfig()
    links = LinkMonitor(identity, table, probe)
    if probe.interval_s > 0:
        await links.start()
    stack.push_async_callback(links.aclose)
    tiers = TierPlanner(cfg, table, links, self_peer=identity.peer_id, local=local, demand=demand,
                        backbone=backbone, config=config, digests=digests)
    await tiers.start()
    stack.push_async_callback(tiers.aclose)
    return tiers
