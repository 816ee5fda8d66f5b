"""The backbone: a model's non-expert weights here, the router authoritative, every routed expert
sent to its holders in the swarm (``dispatch.RemoteExperts``); ``run_backbone`` serves it over the
OpenAI-compatible HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._tasks import cancel_and_wait
from ..daemon import joining, load_identity, p2p_node, public_multiaddrs, ready, say, stop_event
from ..errors import CheckpointError, ConfigError, SwarmError, Unreachable
from ..model import Model, Tokenizer, Weights, load_config, load_weights
from ..model.model_id import model_id_for
from ..net.discovery import Discovery
from ..net.routing_table import SwarmTable
from .config import BackboneConfig
from .dispatch import RemoteExperts
from .verify import Verifier
from .links import ProbeConfig

log = logging.getLogger(__name__)


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
        self.verifier: Verifier | None = None  # checks holders' outputs (on unless verify.fraction == 0)
        self.service: Any = None  # the GenerationService run_backbone serves (its engine's draft counts)

    async def __aenter__(self) -> "SwarmBackbone":
        sc, cfg = self.config.swarm, self.cfg
        try:
            say(joining(sc))
            self.p2p = await self._stack.enter_async_context(p2p_node(self.identity, sc))
            say(f"waiting up to {self.config.coverage_timeout_s:.0f} s for the swarm to announce every expert...")
            moe = [L for L in range(cfg.num_layers) if cfg.moe_layers[L]]
            found = list(moe)  # the layers whose holders are discovered
            if self.config.draft == "mtp":  # the MTP layers' experts are called in the swarm too (their
                if not cfg.mtp_layers:     # routes are not counted in the demand reports)
                    raise ConfigError(f"--draft mtp: {sc.model_dir} holds no multi-token-prediction layer")
                found += list(range(cfg.num_layers, cfg.all_layers))
            self.discovery = Discovery(self.p2p, self.table, found, self.config.discovery_interval_s,
                                       num_layers=cfg.all_layers, num_experts=cfg.num_experts)
            missing = await self.discovery.wait_for_coverage(cfg.num_experts, self.config.coverage_timeout_s)
            if missing and not self.config.local_fallback:
                sample = sorted(missing)[:8]
                raise Unreachable(f"{len(missing)} (layer, expert) pairs have no holder in the swarm, e.g. {sample}")
            await self.discovery.start()
            self._stack.push_async_callback(self.discovery.aclose)
            say(f"loading the backbone's weights (attention, routers, LM head) from {sc.model_dir}...")
            # the whole map: experts the planner places here, or nobody serves, are computed from it
            local = self._local_experts()
            receipts = await self._ledger_sink() if self.config.ledger_url else None
            self.audits = await self._audit_runner() if self.config.audit_fraction > 0 else None
            self.executor = RemoteExperts(cfg, self.identity, self.table, asyncio.get_running_loop(),
                                          config=self.config.dispatch, local=local, receipts=receipts,
                                          audit=self.audits.offer if self.audits is not None else None)
            self._stack.push_async_callback(self.executor.aclose)
            checkpoint = await self._start_verifier(local)
            # the backbone's own tensors; with --local-fallback the full map holds them; the map loaded for
            # checks by recomputation lends its non-expert tensors (the model itself holds no experts)
            weights = local or (dataclasses.replace(checkpoint, experts={}) if checkpoint is not None else
                                load_weights(sc.model_dir, config=cfg, keep_expert=lambda L, e: False))
            self.model = Model(weights, experts=self.executor)
            await self._start_demand_reports(moe)
            await self._start_planner(local, weights)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _start_verifier(self, local: Weights | None) -> Weights | None:
        """Check holders' outputs (verify.py); returns the checkpoint's full map if it was loaded
        to recompute from (None: checks ask other holders, or checks are off)."""
        c = self.config.verify
        if not c.enabled:
            return None
        # recomputation decides only for this checkpoint's own id: a --model-id naming another encoding
        # (Q8_0 nodes for a float backbone) accepts their numbers, so their outputs are compared with each other's
        own = model_id_for(self.config.swarm.model_dir, self.cfg) == self.model_id
        weights = local if own else None
        if weights is None and own and c.method != "holders":
            try:
                weights = load_weights(self.config.swarm.model_dir, config=self.cfg)
            except CheckpointError as e:
                log.info("the checkpoint holds no experts to recompute from (%s): other holders check", e)
        elif not own:
            log.info("--model-id %s is not this checkpoint's own id: other holders check", self.model_id)
        assert self.executor is not None
        verifier = Verifier(self.cfg, self.identity, self.table, c, weights=weights, call=self.executor.call_holder,
                            dht=self.p2p, wire_dtype=self.config.dispatch.wire_dtype)
        await verifier.start()  # evidence in the DHT against holders found so far: excluded before any call
        self._stack.push_async_callback(verifier.aclose)
        self.executor.verifier = self.verifier = verifier
        return weights if local is None and own else None

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
        if self.verifier is not None:
            out["verification"] = self.verifier.status()
        if self.tiers is not None:
            out["tiers"] = self.tiers.status()
        engine = self.service.engine if self.service is not None else None
        if engine is not None and engine.config.speculative:
            out["speculative"] = {"draft": getattr(engine.drafter, "kind", "lookup"), "tokens": engine.config.speculative,
                                  "steps": engine.steps, "drafted": engine.drafted, "accepted": engine.accepted}
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
        from ..ledger import ReceiptSubmitter

        assert self.config.ledger_url is not None
        queue = self.config.ledger_queue_dir or str(
            Path.home() / ".moeswarm" / "receipts" / self.identity.peer_id_str)
        Path(queue).mkdir(parents=True, exist_ok=True)
        submitter = ReceiptSubmitter(self.config.ledger_url, queue)  # the ledger's operator registers the model
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
    from .http_api import ApiConfig, serve_http
    from .service import GenerationService

    stop = stop or stop_event()
    async with SwarmBackbone(config) as backbone:
        assert backbone.model is not None
        service = GenerationService(backbone.model, backbone.tokenizer(), backbone.model_id, engine=config.engine,
                                    drafter=_drafter(config, backbone.cfg, backbone.model))
        backbone.service = service
        info: dict[str, Any] = {"peer_id": backbone.identity.peer_id_str,
                                "multiaddrs": public_multiaddrs(backbone.p2p.multiaddrs, config.swarm),
                                "model_id": backbone.model_id}
        runner, gate = None, None
        if config.gateway and config.gateway_price > 0:
            from .gateway import SpendingGate

            assert config.ledger_url is not None
            gate = SpendingGate(backbone.identity, backbone.model_id, config.gateway_price, config.ledger_url,
                                max_tokens_default=min(4096, config.max_tokens_cap))
        if config.http is not None:
            api = ApiConfig(max_tokens_cap=config.max_tokens_cap, chat_max_tokens=min(4096, config.max_tokens_cap),
                            api_key=config.api_key, limits=config.http_limits,
                            middlewares=(gate.middleware(),) if gate is not None else (), public=config.gateway,
                            allowed_hosts=_url_hosts(config.gateway_url))
            runner, port = await serve_http(service, config.http[0], config.http[1], api, status=backbone.status)
            info["http"] = info["status"] = f"http://{config.http[0]}:{port}"
        gateway = None
        try:
            if config.gateway:
                gateway = await _start_gateway(config, backbone, service, port)
                info["gateway"] = gateway.config.url
            with contextlib.ExitStack() as files:
                if runner is not None:
                    from .status import run_file

                    files.enter_context(run_file("backbone", backbone.identity.peer_id_str, info["status"]))
                on_ready(info)
                say(f"serving the OpenAI-compatible API at {info['http']}/v1 (Ctrl-C to stop)" if runner is not None
                    else "serving (Ctrl-C to stop)")
                await stop.wait()
        finally:
            if gateway is not None:
                await gateway.aclose()
            if runner is not None:
                await runner.cleanup()
            if gate is not None:
                await gate.aclose()


def _url_hosts(url: str | None) -> tuple[str, ...]:
    """The host name of a gateway's announced URL: clients send it in Host."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname if url else None
    return (host,) if host else ()


async def _start_gateway(config: BackboneConfig, backbone: SwarmBackbone, service: Any, port: int) -> Any:
    """Announce the API as a gateway (``--gateway``), refreshed until closed."""
    from .gateway import GatewayAnnouncer, GatewayConfig, holder_rtts

    assert config.http is not None
    host = config.swarm.announce_host or config.http[0]
    url = config.gateway_url or f"http://{f'[{host}]' if ':' in host else host}:{port}"
    announcer = GatewayAnnouncer(backbone.p2p, backbone.identity, backbone.model_id,
                                 GatewayConfig(url, price_per_token=config.gateway_price),
                                 config.engine.max_batch, lambda: service.stats().running, holder_rtts(backbone))
    await announcer.start()
    say(f"announced as a gateway: {url} at {config.gateway_price} credits per token")
    return announcer


def _drafter(config: BackboneConfig, cfg: Any, model: Model | None = None) -> Any:
    """The draft model of --draft-model (computed here, experts and all), ``model``'s own MTP layer
    (--draft mtp: its experts called in the swarm), or None (prompt lookup)."""
    from ..model.speculative import DraftModel, MtpDraft

    if config.draft == "mtp":
        if model is None:
            raise ConfigError("--draft mtp drafts with the loaded model's own MTP layer: give the model")
        return MtpDraft(model)
    if config.draft_model is None:
        return None
    from ..model import load_model

    draft = load_model(config.draft_model)
    if draft.config.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"the draft model's vocabulary has {draft.config.vocab_size} tokens, the model's "
                              f"{cfg.vocab_size}: a draft model must share the tokenizer", path=config.draft_model)
    return DraftModel(draft)
