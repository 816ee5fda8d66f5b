"""Market-driven nodes: which block of experts to hold (``--experts auto``) and when to move.

A ``Rebalancer`` re-reads the market on a jittered period and moves only when the gain clears
the hysteresis: it loads the new block beside the old, checks that dropping the old block leaves
every expert covered, announces the new block, and unloads the old one after a grace period.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, cast

import psutil

from .._tasks import cancel_and_wait
from ..errors import ConfigError, SwarmError
from ..model import ModelConfig, Weights, load_weights
from ..net.announce import Announcer
from ..protocol import peer_id_to_str
from .expert_server import ExpertServer

if TYPE_CHECKING:
    from ..market import Block, DeviceClass, MarketState, ModelShape, Volunteer
    from .config import NodeConfig

log = logging.getLogger(__name__)


def load_block(model_dir: str, cfg: ModelConfig, layers: tuple[int, int], experts: tuple[int, int]) -> Weights:
    """The weights of one block (memory-mapped: cheap until experts are called)."""
    return load_weights(model_dir, config=cfg,
                        keep_expert=lambda L, e: layers[0] <= L <= layers[1] and experts[0] <= e <= experts[1])


def moe_layers_in(cfg: ModelConfig, layers: tuple[int, int]) -> tuple[int, ...]:
    moe = tuple(L for L in range(layers[0], layers[1] + 1) if cfg.moe_layers[L])
    if not moe:
        raise ConfigError(f"layers {layers[0]}-{layers[1]} hold no MoE layer")
    return moe


def held_bytes(weights: Weights) -> int:
    return sum(w.nbytes for layer in weights.experts.values() for w in layer.values())


def market_view(cfg: ModelConfig, model_id: str, config: NodeConfig) -> tuple[ModelShape, Volunteer]:
    """The model's expert grid and what this machine offers, as the market sees them."""
    from ..market import Volunteer, model_shape

    shape = model_shape(config.swarm.model_dir, cfg, model_id)
    memory = config.capacity_bytes or config.memory_budget or int(psutil.virtual_memory().available // 2)
    return shape, Volunteer(memory_bytes=memory, throughput=config.throughput,
                            device_class=cast("DeviceClass", config.device_class))  # Volunteer checks it


def watch_memory(server: ExpertServer, weights: Weights, budget: int | None) -> None:
    """--memory-budget: page the served experts in and out so resident memory stays under ``budget``."""
    if budget is None:
        return
    from ..model.memory import MemoryBudget

    previous = getattr(server.on_access, "__self__", None)
    server.on_access = MemoryBudget(weights, budget).before_expert
    if isinstance(previous, MemoryBudget):
        previous.close()


@dataclass
class Holding:
    """What a node serves (``weights``) and announces (one block); ``Rebalancer`` moves it."""

    cfg: ModelConfig
    server: ExpertServer
    announcer: Announcer
    weights: Weights
    layers: tuple[int, int]
    experts: tuple[int, int]
    memory_budget: int | None = None

    def serve(self, weights: Weights) -> None:
        self.server.serve(weights, self.layers, self.experts)
        watch_memory(self.server, weights, self.memory_budget)
        self.weights = weights

    async def announce(self, block: Block, weights: Weights) -> None:
        self.layers, self.experts = block.layers, block.experts
        await self.announcer.move(block.layers, moe_layers_in(self.cfg, block.layers), block.experts,
                                  held_bytes(weights), retire_ttl_s=2.0)


@dataclass(frozen=True)
class Decision:
    """One re-evaluation by an ``--experts auto`` node (printed as ``REBALANCE {json}``)."""

    action: Literal["stay", "moved", "kept", "failed"]  # moved: the new block is announced; kept: moving
    # would have left an expert without a holder; failed: the market could not be read (or the block loaded)
    reason: str
    layers: tuple[int, int]  # the block announced after this decision
    experts: tuple[int, int]
    gain: float | None = None  # the market's relative gain of the move considered (inf: from nothing)
    time_ms: int = field(default_factory=lambda: int(time.time() * 1000))


def report_decision(decision: Decision) -> None:
    info = asdict(decision)
    if info["gain"] is not None and not math.isfinite(info["gain"]):
        info["gain"] = "inf"
    sys.stdout.write("REBALANCE " + json.dumps(info, sort_keys=True) + "\n")
    sys.stdout.flush()


def _fmt(block: Block) -> str:
    return f"layers {block.layers[0]}-{block.layers[1]} x experts {block.experts[0]}-{block.experts[1]}"


class Rebalancer:
    """``--experts auto``: about every ``rebalance_interval_s`` asks the market (``rebalance``, with
    the live state) whether another block is worth more than the hysteresis margin, and moves.

    A node announces one record, so a move is: load the new block (memory-mapped) and serve old
    and new; check with a fresh state that other live holders hold every expert of the old block
    the new one lacks (``drop_is_safe``; if not, unload the new block and stay); announce the new
    block (new ``seq``); ``rebalance_grace_s`` later (calls in flight, backbones still routing by
    the old record) serve only the new block. No expert the DHT listed a holder for loses it.

    Nodes announcing the same block see the same market and would make the same move at the same
    time, each before the other's new record is visible, and together leave the experts of that
    block only they held (seen live: two nodes of one layer both moved to the hot experts): of such
    twins only the one with the smallest peer ID evaluates; the others stay until it has moved.
    Holders of different blocks that both drop the same experts in one round are not ruled out.
    """

    def __init__(self, p2p: Any, peer_id: bytes, shape: ModelShape, volunteer: Volunteer, holding: Holding,
                 config: NodeConfig, on_decision: Callable[[Decision], None] = report_decision) -> None:
        from ..market import RebalanceConfig

        self.p2p, self.peer_id, self.shape, self.volunteer = p2p, peer_id, shape, volunteer
        self.holding, self.config, self.on_decision = holding, config, on_decision
        self.policy = config.rebalance or RebalanceConfig()
        self.last: Decision | None = None  # the latest decision, for status
        self.moved_epoch: int | None = None  # pricing epoch of the last move
        self._drop_after_grace: Weights | None = None  # the new block alone, served once the grace is over

    async def run_until(self, stop: asyncio.Event) -> None:
        """Re-evaluate until ``stop`` is set; an unexpected error ends the node rather than rebalancing."""
        task = asyncio.create_task(self._loop())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(stopping)
            await cancel_and_wait(task)  # raises the loop's error, if it ended with one

    async def _loop(self) -> None:
        while True:  # jittered, so nodes that joined together do not all re-evaluate together
            await asyncio.sleep(self.config.rebalance_interval_s * random.uniform(0.8, 1.2))
            try:
                decision = await self.evaluate()
            except (SwarmError, OSError) as e:
                decision = self._decision("failed", f"{type(e).__name__}: {e}")
            self.last = decision
            log.info("rebalance: %s, holding %s: %s", decision.action, _fmt(self._block()), decision.reason)
            self.on_decision(decision)
            if self._drop_after_grace is not None:
                await asyncio.sleep(self.config.rebalance_grace_s)
                self.holding.serve(self._drop_after_grace)
                self._drop_after_grace = None
                log.info("rebalance: stopped serving the old block")

    def _block(self) -> Block:
        from ..market import Block

        return Block(self.holding.layers, self.holding.experts)

    def _decision(self, action: Literal["stay", "moved", "kept", "failed"], reason: str,
                  gain: float | None = None) -> Decision:
        return Decision(action, reason, self.holding.layers, self.holding.experts, gain)

    async def _others(self) -> tuple[MarketState, list[bytes]]:
        """The market's state without this node's own record (it knows its block better than the DHT),
        and the peer IDs of the other live holders announcing exactly its block (its twins)."""
        from ..market import fetch_announcements, fetch_state

        found = await fetch_announcements(self.p2p, self.shape)
        state = await fetch_state(self.p2p, self.shape, exclude_peers=(self.peer_id,),
                                  ledger_url=self.config.market_ledger, announcements=found)
        block = (self.holding.layers, self.holding.experts)
        twins = [a.peer_id for a in found if a.peer_id != self.peer_id and (a.layers, a.experts) == block]
        return state, twins

    async def evaluate(self) -> Decision:
        """One re-evaluation; moves (and returns ``moved``) when the market says so."""
        from ..market import rebalance

        current = self._block()
        state, twins = await self._others()
        first = min([self.peer_id, *twins])
        if first != self.peer_id:
            return self._decision("stay", f"{len(twins)} other node(s) announce this block: {peer_id_to_str(first)} "
                                          "(the smallest peer ID) decides first")
        rect = self.shape.rect(current)
        # the rate it measured serving (what it announces, as the others do), once it has served:
        # the market compares it with theirs (AssignConfig.edge_rate_share)
        measured = self.holding.server.throughput
        me = replace(self.volunteer, throughput=float(measured)) if measured > 0 else self.volunteer
        supply = state.supply.changed([rect] if rect is not None else [], me.throughput, +1)
        since = None if self.moved_epoch is None else state.epoch - self.moved_epoch
        plan = rebalance(self.shape, supply, state.demand, me, [current], config=self.policy,
                         epochs_since_move=since)
        if plan is None:
            if since is not None and since < self.policy.cooldown_epochs:
                return self._decision("stay", f"moved {since} epochs ago, cooling down")
            return self._decision("stay", "no block is worth the move (hysteresis), or none is reachable "
                                          "without uncovering an expert")
        (target,) = plan.target  # one block per node: AssignConfig.max_blocks = 1
        return await self._move(current, target, plan.gain, state.epoch)

    async def _move(self, old: Block, new: Block, gain: float, epoch: int) -> Decision:
        from ..market import drop_is_safe

        h = self.holding
        old_weights = h.weights
        new_weights = await asyncio.to_thread(load_block, self.config.swarm.model_dir, h.cfg, new.layers, new.experts)
        both = {L: {**old_weights.experts.get(L, {}), **new_weights.experts.get(L, {})}
                for L in old_weights.experts.keys() | new_weights.experts.keys()}
        try:
            h.serve(replace(new_weights, experts=both))
            others = (await self._others())[0].supply.replicas
        except BaseException:
            h.serve(old_weights)
            raise
        if not drop_is_safe(self.shape, others, [old, new], old):
            h.serve(old_weights)
            return self._decision("kept", f"{_fmt(new)} would leave experts of {_fmt(old)} without a holder", gain)
        try:
            await h.announce(new, new_weights)
            note = ""
        except SwarmError as e:  # the record is switched: the announcer's refresh retries the DHT
            note = f"; announcing failed for now ({e})"
        self.moved_epoch = epoch
        self._drop_after_grace = new_weights
        return self._decision("moved", f"from {_fmt(old)}, gain {gain:.2f}{note}", gain)
