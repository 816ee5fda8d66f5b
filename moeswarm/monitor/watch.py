"""What the monitor knows about the swarm, kept current in the background.

A snapshot (``SwarmWatch.snapshot()``, the body of ``GET /api/v1/swarm``) holds, per watched model,
the coverage grid (live replicas of every expert of every MoE layer), the demand share and the
market's price of each expert, and a verdict; per holder, what it announced and what the monitor
measured (state, round trip, calls served); and the ledger's top contributors.

A holder is *joining* until the monitor first reaches it, *online* while its pings are answered and
*unreachable* once a ping fails; an unreachable holder's experts do not count as covered, and a
holder whose announcement expired is dropped, as a backbone drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._tasks import cancel_and_wait
from ..errors import CheckpointError, ConfigError, NetworkError, ProtocolError, SwarmError
from ..market import ModelShape, fetch_state
from ..model import ModelConfig, load_config
from ..model.model_id import model_id_for, model_name
from ..net.client import ExpertClient
from ..net.discovery import Discovery
from ..net.routing_table import Holder, SwarmTable
from ..protocol import Identity, peer_id_to_str

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class WatchConfig:
    interval_s: float = 5.0  # re-read the DHT, ping every holder, re-read /status this often
    ping_timeout_s: float = 5.0
    ledger_url: str | None = None
    top_contributors: int = 20
    catalogue_interval_s: float = 30.0  # without --model: re-read the catalogue (new models) at most this often


@dataclass
class WatchedModel:
    """One model the monitor draws: its shape comes from the config.json the swarm uses."""

    model_id: str
    cfg: ModelConfig
    table: SwarmTable
    discovery: Discovery
    name: str | None = None  # what a person calls it (model_name), beside the hash id
    demand: np.ndarray | None = None  # (L, E) share of routed pairs, from signed demand reports
    prices: np.ndarray | None = None  # (L, E) price multipliers
    rate: float = 0.0  # routed (token, expert) pairs per second, as the demand reports estimate
    reporters: int = 0

    @property
    def moe_layers(self) -> list[int]:
        return [L for L in range(self.cfg.num_layers) if self.cfg.moe_layers[L]]

    def shape(self) -> ModelShape:
        c = self.cfg
        expert_bytes = 3 * c.hidden_size * c.moe_intermediate_size * 2  # as published (16-bit): prices only
        return ModelShape(self.model_id, tuple(self.moe_layers), c.num_experts, expert_bytes)


@dataclass
class Measured:
    """What the monitor measured of one holder."""

    state: str = "joining"  # joining | online | unreachable
    rtt_ms: float | None = None
    calls_served: int | None = None
    status_url: str | None = None
    software: str = ""
    checked_at: float = 0.0
    error: str = ""


def catalogue_fetch(identity: Identity, timeout: float) -> Any:
    """How the monitor asks a catalogue holder for a config: ``config_request`` over the data plane."""
    from ..net.client import fetch_config

    return lambda entry, model_id: fetch_config(identity, entry.peer_id, entry.endpoints, model_id, timeout)


def config_from_bytes(model_id: str, config: bytes) -> ModelConfig:
    """The config of a model the catalogue names, from the bytes a holder handed out (digest checked):
    ``CheckpointError`` if they are not a config.json of a supported family."""
    try:
        raw = json.loads(config)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"the config of {model_id} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"the config of {model_id} is not a JSON object")
    return ModelConfig.from_hf(raw, model_id=model_id)


def model_from(path: str) -> tuple[str, ModelConfig]:
    """(model id, config) of a checkpoint folder, a GGUF file or a config.json, reading only metadata."""
    p = Path(path)
    folder = p.parent if p.name == "config.json" else p
    cfg = load_config(folder)
    return model_id_for(str(folder), cfg), cfg


class SwarmWatch:
    def __init__(self, p2p: Any, models: list[tuple[str, ModelConfig]], config: WatchConfig = WatchConfig(),
                 names: dict[str, str | None] | None = None, *, catalogue: bool = False) -> None:
        """``catalogue``: also watch every model the swarm's catalogue names (``moeswarm.net.catalogue``),
        re-read each round, configs fetched from holders and checked against the published digest."""
        self.p2p = p2p
        self.config = config
        self.identity = Identity.generate()  # the monitor's own key, for data-plane pings
        self.models: dict[str, WatchedModel] = {}
        for model_id, cfg in models:
            self.add_model(model_id, cfg, (names or {}).get(model_id))
        self.catalogue = catalogue
        self.catalogue_rejected: dict[str, int] = {}  # what the last catalogue pass dropped, by reason
        self._catalogue_read_at: float | None = None  # monotonic time of the last catalogue pass
        self.measured: dict[bytes, Measured] = {}
        self.contributors: list[dict[str, Any]] | None = None
        self.ledger_error = ""
        self.rounds = 0
        self._clients: dict[bytes, ExpertClient] = {}
        self._task: asyncio.Task[None] | None = None

    def add_model(self, model_id: str, cfg: ModelConfig, name: str | None = None) -> None:
        table = SwarmTable(model_id)
        moe = [L for L in range(cfg.num_layers) if cfg.moe_layers[L]]
        self.models[model_id] = WatchedModel(model_id, cfg, table, Discovery(
            self.p2p, table, moe, num_layers=cfg.num_layers, num_experts=cfg.num_experts), name)

    async def read_catalogue(self) -> None:
        """Add the models of the catalogue not watched yet (at most ``MAX_CATALOGUE_MODELS`` in all)."""
        from ..net.catalogue import MAX_CATALOGUE_MODELS, read_catalogue, resolve_models

        catalogue = await read_catalogue(self.p2p)
        new = [m for m in catalogue.offers if m not in self.models][:max(0, MAX_CATALOGUE_MODELS - len(self.models))]
        for served in await resolve_models(catalogue, catalogue_fetch(self.identity, self.config.ping_timeout_s),
                                           wanted=new):
            try:
                cfg = config_from_bytes(served.model_id, served.config)
            except CheckpointError as e:
                log.warning("catalogue: %s", e)
                catalogue.reject("config_unsupported")
                continue
            self.add_model(served.model_id, cfg, served.name or None)
        self.catalogue_rejected = catalogue.rejected

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        for client in self._clients.values():
            client.abort()
        self._clients.clear()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - one bad round must not end the monitor
                log.exception("monitor refresh failed")

    async def refresh(self) -> None:
        now = time.monotonic()
        if self.catalogue and (self._catalogue_read_at is None
                               or now - self._catalogue_read_at >= self.config.catalogue_interval_s):
            self._catalogue_read_at = now
            with contextlib.suppress(SwarmError):
                await self.read_catalogue()
        for m in list(self.models.values()):
            with contextlib.suppress(SwarmError):
                await m.discovery.refresh()
            with contextlib.suppress(SwarmError, ProtocolError, ConfigError, ValueError):
                state = await fetch_state(self.p2p, m.shape())
                m.demand = np.asarray(state.demand.share, dtype=np.float64)
                m.rate, m.reporters = float(state.demand.rate), int(state.demand.reporters)
                m.prices = np.asarray(state.prices().multipliers, dtype=np.float64)
        holders = self.holders()
        await asyncio.gather(*(self._ping(h) for h in holders))
        await asyncio.to_thread(self._read_local_status, {h.peer_id for h in holders})
        if self.config.ledger_url:
            await asyncio.to_thread(self._read_ledger)
        live = {h.peer_id for h in holders}
        for peer in [p for p in self._clients if p not in live]:  # expired: forget it
            self._clients.pop(peer).abort()
        self.rounds += 1

    def holders(self) -> list[Holder]:
        return [h for m in self.models.values() for h in m.table.live()]

    async def _ping(self, holder: Holder) -> None:
        m = self.measured.setdefault(holder.peer_id, Measured())
        client = self._clients.get(holder.peer_id)
        try:
            if client is None or client.closed:
                client = None
                error: Exception | None = None
                for endpoint in holder.endpoints:
                    try:
                        client = await ExpertClient.connect(endpoint, self.identity, expected_peer=holder.peer_id,
                                                            timeout=self.config.ping_timeout_s)
                        break
                    except (NetworkError, ProtocolError, ConfigError) as e:
                        error = e
                if client is None:
                    raise error or NetworkError("no endpoint announced")
                self._clients[holder.peer_id] = client
            async with asyncio.timeout(self.config.ping_timeout_s):
                seconds = await client.ping()
            m.state, m.rtt_ms, m.error = "online", round(seconds * 1000, 3), ""
        except (NetworkError, ProtocolError, ConfigError, TimeoutError, OSError) as e:
            m.state, m.rtt_ms, m.error = "unreachable", None, str(e)[:500]  # room for the cause at the end
            stale = self._clients.pop(holder.peer_id, None)
            if stale is not None:
                stale.abort()
        m.checked_at = time.time()

    def _read_local_status(self, peers: set[bytes]) -> None:
        """Daemons on this machine leave run files (as ``moeswarm node status`` finds them): their
        /status gives the calls they served and a link for the node table."""
        from ..daemon import fetch_reports, running

        urls = {info["peer_id"]: info["status"] for info in running() if "peer_id" in info and "status" in info}
        wanted = {peer_id_to_str(p): p for p in peers}
        for report in fetch_reports([u for pid, u in urls.items() if pid in wanted], timeout=2.0):
            peer = wanted.get(str(report.get("peer_id", "")))
            if peer is None or "error" in report:
                continue
            m = self.measured.setdefault(peer, Measured())
            m.status_url = report.get("url")
            serving = report.get("serving", {})
            m.calls_served = serving.get("requests")

    def _read_ledger(self) -> None:
        url = str(self.config.ledger_url).rstrip("/") + f"/v1/contributors?top={self.config.top_contributors}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                self.contributors = json.loads(response.read())["contributors"]
            self.ledger_error = ""
        except (OSError, ValueError, KeyError) as e:
            self.ledger_error = str(e)[:200]

    # ------------------------------------------------------------------ the snapshot
    def snapshot(self) -> dict[str, Any]:
        now_ms = int(time.time() * 1000)
        models, nodes = [], []
        for m in self.models.values():
            live = m.table.live()
            moe = m.moe_layers
            E = m.cfg.num_experts
            announced = np.zeros((len(moe), E), np.int32)
            reachable = np.zeros((len(moe), E), np.int32)
            for h in live:
                measured = self.measured.get(h.peer_id, Measured())
                for layers, experts in h.blocks():
                    rows = [i for i, L in enumerate(moe) if layers[0] <= L <= layers[1]]
                    cols = slice(experts[0], min(experts[1], E - 1) + 1)
                    for i in rows:
                        announced[i, cols] += 1
                        if measured.state != "unreachable":
                            reachable[i, cols] += 1
                nodes.append(self._node(h, m, measured))
            uncovered = int((reachable == 0).sum())
            per_token = max(1, m.cfg.top_k * len(moe))
            models.append({
                "model_id": m.model_id, "name": m.name, "arch": m.cfg.arch, "num_layers": m.cfg.num_layers, "moe_layers": moe,
                "num_experts": E, "top_k": m.cfg.top_k,
                "verdict": "healthy" if uncovered == 0 else "broken", "uncovered_experts": uncovered,
                "holders": len(live), "holders_live": sum(self.measured.get(h.peer_id, Measured()).state != "unreachable"
                                                         for h in live),
                "replicas_total": int(announced.sum()), "replicas_live": int(reachable.sum()),
                "min_replicas_per_layer": [int(r.min()) for r in reachable],
                "tokens_per_s": round(m.rate / per_token, 2), "demand_reporters": m.reporters,
                "coverage": reachable.tolist(),
                "demand": None if m.demand is None else np.round(m.demand, 6).tolist(),
                "prices": None if m.prices is None else np.round(m.prices, 4).tolist(),
            })
        return {"version": SNAPSHOT_VERSION, "generated_at_ms": now_ms, "rounds": self.rounds,
                "models": models, "nodes": nodes, "ledger": self.config.ledger_url,
                "contributors": self.contributors, "ledger_error": self.ledger_error or None,
                "catalogue": {"rejected": self.catalogue_rejected} if self.catalogue else None}

    @staticmethod
    def _node(h: Holder, m: WatchedModel, measured: Measured) -> dict[str, Any]:
        relay = any(e.startswith(("relay+wss://", "relay+ws://")) for e in h.endpoints)
        return {
            "peer_id": peer_id_to_str(h.peer_id), "model_id": m.model_id, "layers": list(h.layers),
            "experts": list(h.experts), "blocks": [[*L, *E] for L, E in h.blocks()], "endpoints": list(h.endpoints), "via": "relay" if relay else "direct",
            "state": measured.state, "rtt_ms": measured.rtt_ms, "error": measured.error or None,
            "load_permille": h.load_permille, "throughput": h.throughput, "software": h.software,
            "calls_served": measured.calls_served, "status_url": measured.status_url,
            "expires_at_ms": h.expires_at_ms,
        }


__all__ = ["SwarmWatch", "WatchConfig", "WatchedModel", "model_from", "model_name"]
