"""The long-running processes: an expert node and a backbone.  Each prints one
``READY {json}`` line on stdout once it serves, and shuts down cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._keys import load_key_file
from .._tasks import cancel_and_wait
from ..errors import CheckpointError, ConfigError, SwarmError, Unreachable
from ..model import Model, ModelConfig, Tokenizer, Weights, load_config, load_weights
from ..model.model_id import model_id_for
from ..protocol import Identity
from .announce import AnnounceConfig, Announcer
from .backbone import DispatchConfig, RemoteExperts
from .dataplane import DataPlaneServer, ServerConfig
from .discovery import Discovery
from .expert_server import ExpertServer, ExpertServerConfig
from .fetch import serve_weights
from .links import ProbeConfig
from .rebalancer import (
    Decision,
    Holding,
    Rebalancer,
    held_bytes,
    load_block,
    market_assignment,
    market_view,
    moe_layers_in,
    report_decision,
    watch_memory,
)
from .routing_table import SwarmTable

if TYPE_CHECKING:
    from ..market import RebalanceConfig

log = logging.getLogger(__name__)


def parse_range(text: str | None, upper: int, what: str) -> tuple[int, int]:
    """``"A-B"`` (inclusive, as a person writes it) or ``"A"``; ``None`` means all of ``0..upper-1``."""
    if text is None or text == "all":
        return 0, upper - 1
    try:
        a, _, b = text.partition("-")
        first, last = int(a), int(b) if b else int(a)
    except ValueError:
        raise ConfigError(f"--{what} takes an inclusive range like 0-31, not {text!r}") from None
    if not 0 <= first <= last < upper:
        raise ConfigError(f"--{what} {text} is outside 0-{upper - 1}")
    return first, last


def load_identity(path: str | None) -> Identity:
    """The node's Ed25519 key from ``path`` (created, mode 0600, if missing), or a fresh one."""
    return Identity.generate() if path is None else load_key_file(path, create=True, what="identity file")


def public_multiaddrs(multiaddrs: list[str], cfg: "SwarmConfig") -> list[str]:
    """Listen addresses as others should dial them (``--announce-host`` replaces the bound host)."""
    if not cfg.announce_host:
        return list(multiaddrs)
    return [m.replace(f"/ip4/{cfg.host}/", f"/ip4/{cfg.announce_host}/", 1) for m in multiaddrs]


def ready(info: dict[str, Any]) -> None:
    sys.stdout.write("READY " + json.dumps(info, sort_keys=True) + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class SwarmConfig:
    """What every swarm process shares: where the model is and how to reach the DHT."""

    model_dir: str
    bootstrap: tuple[str, ...] = ()  # multiaddrs with /p2p/<peer id>; none = this is a bootstrap peer
    host: str = "127.0.0.1"  # address to listen on (libp2p and data plane)
    announce_host: str | None = None  # address others should dial, if not ``host``
    p2p_port: int = 0  # 0 picks a free port
    client_mode: bool = False  # behind NAT: DHT client mode
    model_id: str | None = None  # default: derived from the checkpoint (model_id_for)
    identity_file: str | None = None


@dataclass(frozen=True)
class NodeConfig:
    swarm: SwarmConfig
    layers: str | None = None  # inclusive range, default all
    experts: str | None = None  # inclusive range, default all
    data_port: int = 0
    announce_port: int | None = None  # data-plane port others dial, if not data_port (NAT, proxy)
    announce_interval_s: float = 240.0  # protocol_spec: refresh every 4 minutes
    record_ttl_s: float = 600.0  # ... with records that expire 10 minutes ahead
    memory_budget: int | None = None  # bytes of resident memory to stay under (None: no limit)
    capacity_bytes: int | None = None  # --experts auto: memory offered for expert weights (default: budget or half of free RAM)
    throughput: float = 10_000.0  # --experts auto: (expert, token) pairs per second this machine can compute
    device_class: str = "hub"  # --experts auto: "hub" (fat link) or "edge" (phone, NAT'd box)
    rebalance_interval_s: float = 600.0  # --experts auto: re-evaluate the block about this often, seconds (0: never)
    rebalance_grace_s: float = 30.0  # after a move, serve the old block this long too (calls in flight, stale tables)
    rebalance: RebalanceConfig | None = None  # --experts auto: hysteresis and cooldown of moves (None: the market's)
    status: tuple[str, int] | None = ("127.0.0.1", 0)  # serve /status and /metrics here (None: not at all)
    probe_interval_s: float = 30.0  # re-measure the links to peers this often (0: never)


@dataclass(frozen=True)
class BackboneConfig:
    swarm: SwarmConfig
    http: tuple[str, int] | None = None  # serve the OpenAI API here
    local_fallback: bool = False  # compute unreachable experts from the local checkpoint
    coverage_timeout_s: float = 60.0  # wait this long for every expert to be announced
    discovery_interval_s: float = 10.0
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    demand_interval_s: float = 120.0  # publish the routers' decayed expert counts (signed) this often
    ledger_url: str | None = None  # submit countersigned receipts to this ledger service
    ledger_queue_dir: str | None = None  # receipts spooled here until the ledger acknowledges them
    audit_fraction: float = 0.0  # share of expert calls the ledger re-executes (needs ledger_url), 0..1
    audit_drain_s: float = 30.0  # on shutdown, wait at most this long for the audits still queued
    tiers: str = "remote"  # "remote": every routed expert is called in the swarm; "auto": the tier planner
    # decides; "fetch": every expert is fetched from a holder on a miss and computed here
    fetch_cache_bytes: int = 1 << 30  # --tiers auto: memory for expert weights fetched from holders
    probe_interval_s: float = 30.0  # re-measure the links to holders this often (0: never)
    replan_s: float = 10.0  # recompute the tier plan this often

    def __post_init__(self) -> None:
        if not 0.0 <= self.audit_fraction <= 1.0:
            raise ConfigError(f"the audit fraction must be within 0..1, not {self.audit_fraction}")
        if self.audit_fraction > 0 and self.ledger_url is None:
            raise ConfigError("audits are judged by the ledger: --audit-fraction needs --ledger")
        if self.tiers not in ("remote", "auto", "fetch"):
            raise ConfigError(f"--tiers is 'remote', 'auto' or 'fetch', not {self.tiers!r}")


@contextlib.asynccontextmanager
async def p2p_node(identity: Identity, cfg: SwarmConfig) -> AsyncIterator[Any]:
    from .p2p import P2PConfig, P2PNode  # imports libp2p (1-2 s): only when a daemon starts

    node = P2PNode(identity, P2PConfig(listen=f"/ip4/{cfg.host}/tcp/{cfg.p2p_port}", bootstrap=cfg.bootstrap,
                                       client_mode=cfg.client_mode))
    await node.start()
    try:
        yield node
    finally:
        await node.stop()


def stop_event() -> asyncio.Event:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, event.set)
    return event


async def run_node(config: NodeConfig, on_ready: Callable[[dict[str, Any]], None] = ready,
                   stop: asyncio.Event | None = None,
                   on_decision: Callable[[Decision], None] = report_decision) -> None:
    sc = config.swarm
    cfg = load_config(sc.model_dir)
    model_id = sc.model_id or model_id_for(sc.model_dir, cfg)
    identity = load_identity(sc.identity_file)
    stop = stop or stop_event()
    async with p2p_node(identity, sc) as p2p:
        market = None
        if config.experts == "auto":
            market = market_view(cfg, model_id, config)
            block = await market_assignment(p2p, *market)
            layers, experts = block.layers, block.experts
        else:
            layers = parse_range(config.layers, cfg.num_layers, "layers")
            experts = parse_range(config.experts, cfg.num_experts, "experts")
        moe = moe_layers_in(cfg, layers)
        weights = load_block(sc.model_dir, cfg, layers, experts)
        server = ExpertServer(weights, identity, ExpertServerConfig(
            model_id, layers, experts, f32_cache_bytes=(config.memory_budget or 4 << 30) // 8))
        watch_memory(server, weights, config.memory_budget)
        dataplane = DataPlaneServer(identity, server.handle, ServerConfig(host=sc.host, port=config.data_port),
                                    weights_handler=lambda client, request: asyncio.to_thread(
                                        serve_weights, server.weights, model_id, request))
        await server.start()
        await dataplane.start()
        try:
            host = sc.announce_host or sc.host
            endpoint = f"tcp+tls://{host}:{config.announce_port or dataplane.port}"
            announcer = Announcer(p2p, identity, AnnounceConfig(
                model_id, layers, moe, experts, (endpoint,), held_bytes(weights), config.announce_interval_s,
                config.record_ttl_s), stats=lambda: (server.throughput, server.load_permille))
            await announcer.start()
            async with contextlib.AsyncExitStack() as stack:
                status_url = await _node_status(stack, config, identity, p2p, cfg, model_id, server, endpoint)
                on_ready({"peer_id": identity.peer_id_str, "multiaddrs": public_multiaddrs(p2p.multiaddrs, sc),
                          "endpoint": endpoint, "model_id": model_id, "layers": list(layers),
                          "experts": list(experts), "status": status_url})
                if market is not None and config.rebalance_interval_s > 0:
                    holding = Holding(cfg, server, announcer, weights, layers, experts, config.memory_budget)
                    await Rebalancer(p2p, identity.peer_id, *market, holding, config, on_decision).run_until(stop)
                else:
                    await stop.wait()
            await announcer.withdraw()
        finally:
            await dataplane.aclose()
            await server.aclose()


async def _node_status(stack: contextlib.AsyncExitStack, config: NodeConfig, identity: Identity, p2p: Any,
                       cfg: ModelConfig, model_id: str, server: ExpertServer, endpoint: str) -> str | None:
    """``moeswarm node status``'s source: the tier planner over the whole local checkpoint (what
    this machine would compute itself, call, or fetch), link figures, memory, what it served."""
    from .status import cache_snapshot, memory_snapshot, run_file, serve_status
    from .tiers import TierConfig, start_planner

    if config.status is None:
        return None
    everything = load_block(config.swarm.model_dir, cfg, (0, cfg.num_layers - 1), (0, cfg.num_experts - 1))
    # timing a step without experts reads the attention, router and LM-head weights: only when that
    # is cheap and no memory budget forbids it (a node does not otherwise touch them)
    small = sum(int(getattr(a, "nbytes", 0)) for a in everything.tensors.values()) < 1 << 30
    tiers = await start_planner(stack, identity, p2p, cfg, model_id, local=everything,
                                probe=ProbeConfig(interval_s=config.probe_interval_s), config=TierConfig(act=False),
                                backbone=everything if small and config.memory_budget is None else None)
    started = time.time()

    def snapshot() -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": "node", "peer_id": identity.peer_id_str, "model_id": model_id, "endpoint": endpoint,
            "layers": list(server.config.layers), "experts": list(server.config.experts),
            "uptime_s": round(time.time() - started, 1), "memory": memory_snapshot(),
            "memory_budget": config.memory_budget,
            "serving": {"requests": server.requests_served, "pairs": server.pairs_served,
                        "throughput_pairs_per_s": server.throughput, "load_permille": server.load_permille},
            "tiers": tiers.status(),
        }
        budget = getattr(server.on_access, "__self__", None)
        if budget is not None and hasattr(budget, "stats"):
            out["expert_cache"] = cache_snapshot(budget.stats)
        return out

    runner, url = await serve_status(snapshot, *config.status)
    stack.push_async_callback(runner.cleanup)
    stack.enter_context(run_file("node", identity.peer_id_str, url))
    return url


class SwarmBackbone:
    """A backbone inside this process: non-expert weights local, routed experts from the swarm."""

    def __init__(self, config: BackboneConfig) -> None:
        self.config = config
        sc = config.swarm
        self.cfg = load_config(sc.model_dir)
        self.model_id = sc.model_id or model_id_for(sc.model_dir, self.cfg)
        self.identity = load_identity(sc.identity_file)
        self.table = SwarmTable(self.model_id)
        self._stack = contextlib.AsyncExitStack()
        self.p2p: Any = None
        self.model: Model | None = None
        self.executor: RemoteExperts | None = None
        self.audits: Any = None  # moeswarm.ledger.AuditRunner when audit_fraction > 0
        self.tiers: Any = None  # moeswarm.node.tiers.TierPlanner

    async def __aenter__(self) -> "SwarmBackbone":
        sc, cfg = self.config.swarm, self.cfg
        try:
            self.p2p = await self._stack.enter_async_context(p2p_node(self.identity, sc))
            moe = [L for L in range(cfg.num_layers) if cfg.moe_layers[L]]
            self.discovery = Discovery(self.p2p, self.table, moe, self.config.discovery_interval_s)
            missing = await self.discovery.wait_for_coverage(cfg.num_experts, self.config.coverage_timeout_s)
            if missing and not self.config.local_fallback:
                sample = sorted(missing)[:8]
                raise Unreachable(f"{len(missing)} (layer, expert) pairs have no holder in the swarm, e.g. {sample}")
            await self.discovery.start()
            self._stack.push_async_callback(self.discovery.aclose)
            # the whole map: experts the planner places here, or nobody serves, are computed from it
            local = self._local_experts()
            receipts = await self._ledger_sink() if self.config.ledger_url else None
            self.audits = await self._audit_runner() if self.config.audit_fraction > 0 else None
            self.executor = RemoteExperts(cfg, self.identity, self.table, asyncio.get_running_loop(),
                                          config=self.config.dispatch, local=local, receipts=receipts,
                                          audit=self.audits.offer if self.audits is not None else None)
            self._stack.push_async_callback(self.executor.aclose)
            # the backbone's own tensors; with --local-fallback the full map already holds them
            weights = local or load_weights(sc.model_dir, config=cfg, keep_expert=lambda L, e: False)
            self.model = Model(weights, experts=self.executor)
            await self._start_demand_reports(moe)
            await self._start_planner(local, weights)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def _local_experts(self) -> Weights | None:
        """The whole checkpoint mapped, for --local-fallback or --tiers auto; with --tiers auto a
        backbone whose checkpoint holds no experts plans with remote holders and fetching only."""
        c, sc = self.config, self.config.swarm
        if not (c.local_fallback or c.tiers == "auto"):
            return None
        try:
            return load_weights(sc.model_dir, config=self.cfg)
        except CheckpointError as e:
            if c.local_fallback:
                raise
            log.info("no local experts (%s): the planner chooses between calling and fetching", e)
            return None

    async def _start_planner(self, local: Weights | None, weights: Weights) -> None:
        """Measure the links to holders and keep a tier plan; with --tiers auto the executor follows it."""
        from .fetch import DIGESTS_FILE, load_expert_digests
        from .tiers import TierConfig, start_planner

        c = self.config
        act = c.tiers != "remote"
        digests_file = Path(weights.folder) / DIGESTS_FILE
        digests = load_expert_digests(digests_file, self.cfg) if act else None
        if act and digests is None:
            log.warning("fetched expert weights will not be checked: %s does not exist "
                        "(the model's publisher writes it with `moeswarm expert-digests`)", digests_file)
        self.tiers = await start_planner(
            self._stack, self.identity, self.p2p, self.cfg, self.model_id, local=local, table=self.table,
            demand=self.demand, probe=ProbeConfig(interval_s=c.probe_interval_s),
            config=TierConfig(act=act, force="fetch" if c.tiers == "fetch" else None, replan_s=c.replan_s,
                              fetch_cache_bytes=c.fetch_cache_bytes),
            backbone=weights, digests=digests)
        if act:
            assert self.executor is not None
            self.executor.tiers = self.tiers

    def status(self) -> dict[str, Any]:
        from .status import memory_snapshot

        ex = self.executor
        out: dict[str, Any] = {"role": "backbone", "peer_id": self.identity.peer_id_str, "model_id": self.model_id,
                               "memory": memory_snapshot(), "holders": len(self.table.live())}
        if ex is not None:
            out["dispatch"] = {"calls": ex.calls, "fallbacks": ex.fallbacks, "local_pairs": ex.local_pairs,
                               "bad_receipts": ex.bad_receipts,
                               "served_by": {p.hex(): len(s) for p, s in ex.served_by.items()}}
        if self.tiers is not None:
            out["tiers"] = self.tiers.status()
        return out

    async def _start_demand_reports(self, moe: list[int]) -> None:
        """Count what the routers pick and publish it, signed, for the market (issue: scarcity)."""
        from ..market import DemandCounter, publish_demand, report_from_counter

        assert self.model is not None
        self.demand = DemandCounter(tuple(moe), self.cfg.num_experts)
        self.model.observers.append(self.demand.observe)
        seq = itertools.count(int(time.time() * 1000))

        async def publish() -> None:
            while True:
                await asyncio.sleep(self.config.demand_interval_s)
                report = report_from_counter(self.identity, self.demand, model_id=self.model_id, seq=next(seq))
                try:
                    await publish_demand(self.p2p, report)
                except SwarmError as e:
                    log.info("publishing demand failed: %s", e)

        task = asyncio.create_task(publish())

        async def stop() -> None:
            await cancel_and_wait(task)

        self._stack.push_async_callback(stop)

    async def _ledger_sink(self) -> Any:
        """A ReceiptSubmitter to the ledger; closed after the executor so its last receipts arrive."""
        from ..ledger import ModelShape, ReceiptSubmitter, SubmitterConfig

        assert self.config.ledger_url is not None
        queue = self.config.ledger_queue_dir or str(
            Path.home() / ".moeswarm" / "receipts" / self.identity.peer_id_str)
        Path(queue).mkdir(parents=True, exist_ok=True)
        shape = ModelShape(self.cfg.hidden_size, self.cfg.moe_intermediate_size)
        submitter = ReceiptSubmitter(self.config.ledger_url, queue, SubmitterConfig(models=((self.model_id, shape),)))
        await submitter.start()
        self._stack.push_async_callback(submitter.aclose)
        return submitter

    async def _audit_runner(self) -> Any:
        """Samples calls for the ledger to re-execute (POST /v1/audits); closed after the executor,
        waiting (bounded) for the audits still queued."""
        from ..ledger import AuditConfig, AuditRunner, RemoteJudge

        assert self.config.ledger_url is not None
        runner = AuditRunner(AuditConfig(fraction=self.config.audit_fraction), RemoteJudge(self.config.ledger_url))
        await runner.start()

        async def close() -> None:
            try:
                async with asyncio.timeout(self.config.audit_drain_s):
                    await runner.drain()
            except TimeoutError:
                log.warning("stopping with audits still queued")
            await runner.aclose()

        self._stack.push_async_callback(close)
        return runner

    def tokenizer(self) -> Tokenizer:
        # the folder the weights came from: --model may name a .gguf file, whose folder holds the tokenizer
        folder = self.model.weights.folder if self.model is not None else self.config.swarm.model_dir
        return Tokenizer.from_folder(folder, self.cfg.bos_token_id)


async def run_backbone(config: BackboneConfig, on_ready: Callable[[dict[str, Any]], None] = ready,
                       stop: asyncio.Event | None = None) -> None:
    from .http_api import serve_http
    from .service import GenerationService

    stop = stop or stop_event()
    async with SwarmBackbone(config) as backbone:
        assert backbone.model is not None
        service = GenerationService(backbone.model, backbone.tokenizer(), backbone.model_id)
        info: dict[str, Any] = {"peer_id": backbone.identity.peer_id_str,
                                "multiaddrs": public_multiaddrs(backbone.p2p.multiaddrs, config.swarm),
                                "model_id": backbone.model_id}
        runner = None
        if config.http is not None:
            runner, port = await serve_http(service, config.http[0], config.http[1], status=backbone.status)
            info["http"] = info["status"] = f"http://{config.http[0]}:{port}"
        try:
            with contextlib.ExitStack() as files:
                if runner is not None:
                    from .status import run_file

                    files.enter_context(run_file("backbone", backbone.identity.peer_id_str, info["status"]))
                on_ready(info)
                await stop.wait()
        finally:
            if runner is not None:
                await runner.cleanup()
