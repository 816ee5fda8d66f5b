"""Market-driven nodes: which blocks of experts to hold (``--experts auto``) and when to move.

A ``Rebalancer`` re-reads the market on a jittered period and moves only when the gain clears
the hysteresis: it loads the new blocks beside the old, checks that dropping each old block
leaves every expert covered, announces the new blocks, and unloads the old ones after a grace
period. One node process holds up to ``--max-blocks`` blocks (one record announces them all).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, cast

import psutil

from .._tasks import cancel_and_wait
from ..errors import ConfigError, SwarmError
from ..model import ModelConfig, Weights, load_weights
from ..net.announce import Announcer
from ..protocol import BlockRanges, peer_id_to_str
from .expert_server import ExpertServer

if TYPE_CHECKING:
    from ..market import Block, DeviceClass, MarketState, ModelShape, Volunteer
    from .config import NodeConfig

log = logging.getLogger(__name__)


def load_block(model_dir: str, cfg: ModelConfig, layers: tuple[int, int], experts: tuple[int, int]) -> Weights:
    """The weights of one block (memory-mapped: cheap until experts are called)."""
    from ..market import Block

    return load_blocks(model_dir, cfg, [Block(layers, experts)])


def load_blocks(model_dir: str, cfg: ModelConfig, blocks: Sequence[Block]) -> Weights:
    """The weights of every expert in ``blocks`` (memory-mapped: cheap until experts are called)."""
    spans = [(b.layers, b.experts) for b in blocks]
    return load_weights(model_dir, config=cfg,
                        keep_expert=lambda L, e: any(l0 <= L <= l1 and e0 <= e <= e1 for (l0, l1), (e0, e1) in spans))


def moe_layers_in(cfg: ModelConfig, layers: tuple[int, int]) -> tuple[int, ...]:
    moe = tuple(L for L in range(layers[0], layers[1] + 1) if cfg.moe_layers[L])
    if not moe:
        raise ConfigError(f"layers {layers[0]}-{layers[1]} hold no MoE layer")
    return moe


def moe_layers_of(cfg: ModelConfig, blocks: Sequence[Block]) -> tuple[int, ...]:
    """The MoE layers of all ``blocks`` (each must hold one), ascending: the keys a record goes under."""
    return tuple(sorted({L for b in blocks for L in moe_layers_in(cfg, b.layers)}))


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
    """What a node serves (``weights``) and announces (its blocks, best first); ``Rebalancer`` moves it."""

    cfg: ModelConfig
    server: ExpertServer
    announcer: Announcer
    weights: Weights
    blocks: tuple[Block, ...]
    memory_budget: int | None = None

    def serve(self, weights: Weights) -> None:
        self.server.serve(weights, self.blocks[0].layers, self.blocks[0].experts)
        watch_memory(self.server, weights, self.memory_budget)
        self.weights = weights

    async def announce(self, blocks: Sequence[Block], weights: Weights) -> None:
        self.blocks = tuple(blocks)
        await self.announcer.move([(b.layers, b.experts) for b in blocks], moe_layers_of(self.cfg, blocks),
                                  held_bytes(weights), retire_ttl_s=2.0)


@dataclass(frozen=True)
class Decision:
    """One re-evaluation by an ``--experts auto`` node (printed as ``REBALANCE {json}``)."""

    action: Literal["stay", "moved", "kept", "failed"]  # moved: the new block is announced; kept: moving
    # would have left an expert without a holder; failed: the market could not be read (or the block loaded)
    reason: str
    layers: tuple[int, int]  # the (first) block announced after this decision
    experts: tuple[int, int]
    gain: float | None = None  # the market's relative gain of the move considered (inf: from nothing)
    time_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    more_blocks: BlockRanges = ()  # (layers, experts) announced beside it


def report_decision(decision: Decision) -> None:
    info = asdict(decision)
    if info["gain"] is not None and not math.isfinite(info["gain"]):
        info["gain"] = "inf"
    sys.stdout.write("REBALANCE " + json.dumps(info, sort_keys=True) + "\n")
    sys.stdout.flush()


def _fmt(block: Block) -> str:
    return f"layers {block.layers[0]}-{block.layers[1]} x experts {block.experts[0]}-{block.experts[1]}"


def _fmts(blocks: Sequence[Block]) -> str:
    return _fmt(blocks[0]) if len(blocks) == 1 else f"{len(blocks)} blocks ({', '.join(map(_fmt, blocks))})"


class Rebalancer:
    """``--experts auto``: about every ``rebalance_interval_s`` asks the market (``rebalance``, with
    the live state) whether other blocks are worth more than the hysteresis margin, and moves.

    A node announces one record (all its blocks), so a move is: load the new blocks (memory-mapped)
    and serve old and new; check with a fresh state that, dropping the old blocks the new set lacks
    one by one, other live holders or the blocks kept hold every expert (``drop_is_safe``; if not,
    unload the new blocks and stay); announce the new blocks (new ``seq``); ``rebalance_grace_s``
    later (calls in flight, backbones still routing by the old record) serve only the new ones. No
    expert the DHT listed a holder for loses it.

    Nodes announcing the same blocks see the same market and would make the same move at the same
    time, each before the other's new record is visible, and together leave the experts of those
    blocks only they held (seen live: two nodes of one layer both moved to the hot experts): of such
    twins only the one with the smallest peer ID evaluates; the others stay until it has moved.
    Holders of different blocks that both drop the same experts in one round are not ruled out.
    """

    def __init__(self, p2p: Any, peer_id: bytes, shape: ModelShape, volunteer: Volunteer, holding: Holding,
                 config: NodeConfig, on_decision: Callable[[Decision], None] = report_decision,
                 round_trips: Callable[[Sequence[Any]], Awaitable[dict[bytes, float]]] | None = None) -> None:
        from ..market import RebalanceConfig

        self.p2p, self.peer_id, self.shape, self.volunteer = p2p, peer_id, shape, volunteer
        # holders' announcements -> this node's round trips to them (``round_trips.measure_round_trips``):
        # the market's supply near it (its region); None: the market is blind to regions
        self.round_trips = round_trips
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
            log.info("rebalance: %s, holding %s: %s", decision.action, _fmts(self.holding.blocks), decision.reason)
            self.on_decision(decision)
            if self._drop_after_grace is not None:
                await asyncio.sleep(self.config.rebalance_grace_s)
                self.holding.serve(self._drop_after_grace)
                self._drop_after_grace = None
                log.info("rebalance: stopped serving the old blocks")

    def _decision(self, action: Literal["stay", "moved", "kept", "failed"], reason: str,
                  gain: float | None = None) -> Decision:
        first, *more = self.holding.blocks
        return Decision(action, reason, first.layers, first.experts, gain,
                        more_blocks=tuple((b.layers, b.experts) for b in more))

    async def _others(self) -> tuple[MarketState, list[bytes]]:
        """The market's state without this node's own record (it knows its blocks better than the DHT),
        and the peer IDs of the other live holders announcing exactly its blocks (its twins)."""
        from ..market import fetch_announcements, fetch_state

        found = await fetch_announcements(self.p2p, self.shape)
        rtts = await self.round_trips(found) if self.round_trips is not None else None
        state = await fetch_state(self.p2p, self.shape, exclude_peers=(self.peer_id,),
                                  ledger_url=self.config.market_ledger, announcements=found, round_trips=rtts)
        mine = {(b.layers, b.experts) for b in self.holding.blocks}
        twins = [a.peer_id for a in found if a.peer_id != self.peer_id and set(a.blocks()) == mine]
        return state, twins

    async def evaluate(self) -> Decision:
        """One re-evaluation; moves (and returns ``moved``) when the market says so."""
        from ..market import AssignConfig, rebalance

        current = self.holding.blocks
        state, twins = await self._others()
        first = min([self.peer_id, *twins])
        if first != self.peer_id:
            return self._decision("stay", f"{len(twins)} other node(s) announce these blocks: {peer_id_to_str(first)} "
                                          "(the smallest peer ID) decides first")
        rects = [r for r in (self.shape.rect(b) for b in current) if r is not None]
        # the rate it measured serving (what it announces, as the others do), once it has served:
        # the market compares it with theirs (AssignConfig.edge_rate_share)
        measured = self.holding.server.throughput
        me = replace(self.volunteer, throughput=float(measured)) if measured > 0 else self.volunteer
        supply = state.supply.changed(rects, me.throughput, +1)
        near = state.near.changed(rects, me.throughput, +1) if state.near is not None else None  # the node included
        since = None if self.moved_epoch is None else state.epoch - self.moved_epoch
        plan = rebalance(self.shape, supply, state.demand, me, list(current), config=self.policy,
                         assign_config=AssignConfig(max_blocks=self.config.max_blocks), epochs_since_move=since,
                         near=near)
        if plan is None:
            if since is not None and since < self.policy.cooldown_epochs:
                return self._decision("stay", f"moved {since} epochs ago, cooling down")
            return self._decision("stay", "no blocks are worth the move (hysteresis), or none are reachable "
                                          "without uncovering an expert")
        return await self._move(current, plan.target, plan.gain, state.epoch)

    async def _move(self, old: Sequence[Block], new: Sequence[Block], gain: float, epoch: int) -> Decision:
        from ..market import drop_is_safe

        h = self.holding
        old_weights = h.weights
        new_weights = await asyncio.to_thread(load_blocks, self.config.swarm.model_dir, h.cfg, new)
        both = {L: {**old_weights.experts.get(L, {}), **new_weights.experts.get(L, {})}
                for L in old_weights.experts.keys() | new_weights.experts.keys()}
        try:
            h.serve(replace(new_weights, experts=both))
            others = (await self._others())[0].supply.replicas
        except BaseException:
            h.serve(old_weights)
            raise
        held = [*old, *(b for b in new if b not in old)]
        for block in [b for b in old if b not in new]:  # dropped one by one, as the plan's steps do
            if not drop_is_safe(self.shape, others, held, block):
                h.serve(old_weights)
                return self._decision("kept", f"{_fmts(new)} would leave experts of {_fmt(block)} without a holder",
                                      gain)
            held.remove(block)
        try:
            await h.announce(new, new_weights)
            note = ""
        except SwarmError as e:  # the record is switched: the announcer's refresh retries the DHT
            note = f"; announcing failed for now ({e})"
        self.moved_epoch = epoch
        self._drop_after_grace = new_weights
        return self._decision("moved", f"from {_fmts(old)}, gain {gain:.2f}{note}", gain)
