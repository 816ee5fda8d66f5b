"""The volunteer's daemon: an expert node serving blocks of a model's experts over the data plane
(one block, or with ``--experts auto`` up to ``--max-blocks``), announcing them in the DHT,
reporting its status, and (``--experts auto``) following the market."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from ..daemon import (
    joining,
    load_identity,
    p2p_node,
    parse_range,
    public_multiaddrs,
    ready,
    say,
    span,
    stop_event,
)
from ..market import NEAR_RTT_S, AssignConfig, Block, fetch_announcements, market_assignment
from ..model import ModelConfig, load_config
from ..model.model_id import config_bytes, model_id_for, model_name
from ..net.announce import AnnounceConfig, Announcer
from ..net.catalogue import catalogue_model
from ..net.dataplane import BatchedHandler, DataPlaneServer, ServerConfig
from ..protocol import ExpertRequest, ExpertResponse, Identity
from .config import NodeConfig
from .expert_server import ExpertServer, ExpertServerConfig
from .fetch import serve_weights
from .links import ProbeConfig
from .round_trips import measure_round_trips
from .rebalancer import (
    Decision,
    Holding,
    Rebalancer,
    held_bytes,
    load_block,
    load_blocks,
    market_view,
    moe_layers_of,
    report_decision,
    watch_memory,
)


def _layers(text: str | None, cfg: ModelConfig) -> tuple[int, int]:
    """--layers: all (the default) is the decoder's layers; a range may reach into the
    multi-token-prediction layers after them (``num_layers`` ...), served like any layer's."""
    if text is None or text == "all":
        return 0, cfg.num_layers - 1
    return parse_range(text, cfg.all_layers, "layers")


async def run_node(config: NodeConfig, on_ready: Callable[[dict[str, Any]], None] = ready,
                   stop: asyncio.Event | None = None,
                   on_decision: Callable[[Decision], None] = report_decision) -> None:
    sc = config.swarm
    cfg = load_config(sc.model_dir)
    model_id = sc.model_id or model_id_for(sc.model_dir, cfg)
    identity = load_identity(sc.identity_file)
    stop = stop or stop_event()
    chosen = None if config.experts == "auto" else (Block(_layers(config.layers, cfg),
                                                          parse_range(config.experts, cfg.num_experts, "experts")),)
    say(joining(sc))
    async with p2p_node(identity, sc) as p2p:
        market = None
        if chosen is None:
            say("asking the swarm's market which experts it lacks...")
            market = market_view(cfg, model_id, config)
            round_trips = await measure_round_trips(identity, await fetch_announcements(p2p, market[0]))
            say(f"measured round trips to {len(round_trips)} holder(s): "
                f"{sum(r <= NEAR_RTT_S for r in round_trips.values())} within {NEAR_RTT_S * 1e3:.0f} ms "
                "(the market's region)")
            blocks = await market_assignment(p2p, *market, ledger_url=config.market_ledger,
                                             config=AssignConfig(max_blocks=config.max_blocks),
                                             round_trips=round_trips)
        else:
            blocks = chosen
        (layers, experts), more = (blocks[0].layers, blocks[0].experts), blocks[1:]
        moe = moe_layers_of(cfg, blocks)
        say(f"loading {_blocks_text(blocks)} from {sc.model_dir}...")
        weights = load_blocks(sc.model_dir, cfg, blocks)
        say(f"mapped {held_bytes(weights) / 2**20:,.1f} MiB of expert weights (read from disk when first called)")
        server = ExpertServer(weights, identity, ExpertServerConfig(
            model_id, layers, experts, f32_cache_bytes=(config.memory_budget or 4 << 30) // 8))
        watch_memory(server, weights, config.memory_budget)
        handler, batched_handler, gate = server.handle, server.handle_batched, None
        if config.require_funded:  # ask the ledger for each client's standing before serving it
            from ..ledger import FundedGate

            gate = FundedGate(config.require_funded)
            handler, batched_handler = gate.wrap(server.handle), _gated_batched(gate, server.handle_batched)
        dataplane = DataPlaneServer(identity, handler, ServerConfig(
                                        host=sc.host, port=config.data_port, max_connections=config.max_connections,
                                        max_conns_per_ip=config.max_conns_per_ip,
                                        max_conns_per_peer=config.max_conns_per_peer,
                                        frame_timeout_s=config.frame_timeout_s,
                                        idle_timeout_s=config.idle_timeout_s,
                                        versions=config.protocol_versions),
                                    weights_handler=(lambda client, request: asyncio.to_thread(
                                        serve_weights, server.weights, model_id, request))
                                    if config.serve_weights else None,
                                    configs={model_id: config_bytes(sc.model_dir)},
                                    batched_handler=batched_handler, receipts=server,
                                    fast_handler=server.answer_now if gate is None else None)  # the gate asks first
        await server.start()
        await dataplane.start()
        try:
            host = sc.announce_host or sc.host
            endpoint = f"tcp+tls://{host}:{config.announce_port or dataplane.port}"
            announcer = Announcer(p2p, identity, AnnounceConfig(
                model_id, layers, moe, experts, (endpoint,), held_bytes(weights), config.announce_interval_s,
                config.record_ttl_s, more_blocks=tuple((b.layers, b.experts) for b in more),
                catalogue=(catalogue_model(model_id, config_bytes(sc.model_dir), model_name(sc.model_dir)),)),
                stats=lambda: (server.throughput, server.load_permille))
            await announcer.start()
            async with contextlib.AsyncExitStack() as stack:
                status_url = await _node_status(stack, config, identity, p2p, cfg, model_id, server, endpoint,
                                                announcer)
                on_ready({"peer_id": identity.peer_id_str, "multiaddrs": public_multiaddrs(p2p.multiaddrs, sc),
                          "endpoint": endpoint, "model_id": model_id, "layers": list(layers),
                          "experts": list(experts), "blocks": [[*b.layers, *b.experts] for b in blocks],
                          "status": status_url})
                say(f"serving {_blocks_text(blocks)} at {endpoint}"
                    + (f", status at {status_url}" if status_url else "") + " (Ctrl-C to stop)")
                if market is not None and config.rebalance_interval_s > 0:
                    holding = Holding(cfg, server, announcer, weights, tuple(blocks), config.memory_budget)
                    await Rebalancer(p2p, identity.peer_id, *market, holding, config, on_decision,
                                     round_trips=lambda found: measure_round_trips(identity, found)).run_until(stop)
                else:
                    await stop.wait()
            say("withdrawing the announcement...")
            await announcer.withdraw()
        finally:
            await dataplane.aclose()
            await server.aclose()
            if gate is not None:
                await gate.aclose()


def _blocks_text(blocks: tuple[Block, ...] | list[Block]) -> str:
    """``layers 0-3 x experts 0-3`` (and ``+ layers 4-7 x experts 0-1`` for more blocks)."""
    return " + ".join(f"layers {span(b.layers)} x experts {span(b.experts)}" for b in blocks)


async def _node_status(stack: contextlib.AsyncExitStack, config: NodeConfig, identity: Identity, p2p: Any,
                       cfg: ModelConfig, model_id: str, server: ExpertServer, endpoint: str,
                       announcer: Announcer) -> str | None:
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
            "blocks": [[*L, *E] for L, E in announcer.config.blocks()],
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


def _gated_batched(gate: Any, handle: BatchedHandler) -> BatchedHandler:
    """A v1.3 handler (client, request, channel) behind a ``FundedGate``."""

    async def gated(client: bytes, request: ExpertRequest, channel: object) -> ExpertResponse:
        return await gate.wrap(lambda c, r: handle(c, r, channel))(client, request)

    return gated
