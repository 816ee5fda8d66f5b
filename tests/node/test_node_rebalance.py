"""Issue 6, point 5: an ``--experts auto`` node re-evaluates its block, moves to the experts the
swarm lacks once the swarm changes, keeps every expert listed in discovery while it moves, serves
old and new during the grace period, and stays put while nothing changes.

The pieces first, over an in-memory DHT: a move's records (``Announcer.move``) and how discovery
reads them, the last-moment check that keeps the old block, requests accepted before a move.
Then a swarm on loopback: three nodes in this process (``run_node``), on the 4-layer x 8-expert
demo checkpoint:

- P holds expert 3 of every layer (the bootstrap peer);
- C joins with ``--experts auto`` and room for 16 experts: the market gives it the 16 experts
  nobody holds, layers 0-3 x experts 4-7;
- Q then joins with layers 0-1, all experts: experts 3 and 4-7 of layers 0-1 now have two
  holders, experts 0-2 of layers 2-3 none. C's best block becomes layers 2-3 x all experts
  (14 uncovered experts instead of 8: a gain of 0.75, above the 0.5 hysteresis); it drops
  layers 0-1 (Q holds them) and keeps layers 2-3 x experts 4-7, which only it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from moeswarm.daemon import SwarmConfig, p2p_node
from moeswarm.demo import CHECKPOINT
from moeswarm.errors import ProtocolError
from moeswarm.market import Block, ModelShape, RebalanceConfig, Volunteer
from moeswarm.model import expert_ffn, load_config
from moeswarm.net.announce import AnnounceConfig, Announcer
from moeswarm.net.client import ExpertClient
from moeswarm.net.discovery import Discovery
from moeswarm.net.routing_table import SwarmTable
from moeswarm.node.config import NodeConfig
from moeswarm.node.expert_server import ExpertServer, ExpertServerConfig
from moeswarm.node.rebalancer import (
    Decision,
    Holding,
    Rebalancer,
    held_bytes,
    load_block,
    load_blocks,
)
from moeswarm.node.volunteer import run_node
from moeswarm.protocol import (
    ErrorCode,
    ExpertRequest,
    ExpertRows,
    Identity,
    announcement_key,
    decode,
    peer_id_from_str,
    validate_record,
)

pytestmark = pytest.mark.timeout(120)

CFG = load_config(CHECKPOINT)
MOE = [L for L in range(CFG.num_layers) if CFG.moe_layers[L]]
ALL = {(L, e) for L in MOE for e in range(CFG.num_experts)}
MODEL = "demo-m"


class MemoryDHT:
    """The DHT operations over dicts, validating announcements like the real one (newest seq wins)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.providers: dict[str, list[str]] = {}
        self.me = ""  # the peer that calls provide

    async def put(self, key: str, value: bytes) -> int:
        validate_record(key, value, self.values.get(key))
        self.values[key] = value
        return 1

    async def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    async def provide(self, key: str) -> None:
        self.providers.setdefault(key, [])
        if self.me not in self.providers[key]:
            self.providers[key].append(self.me)

    async def find_providers(self, key: str) -> list[str]:
        return list(self.providers.get(key, []))


def a_node(dht: MemoryDHT, layers: tuple[int, int], experts: tuple[int, int]) -> tuple[Identity, Holding]:
    """A node's server and announcer (not started) holding one block, announcing through ``dht``."""
    identity = Identity.generate()
    weights = load_block(str(CHECKPOINT), CFG, layers, experts)
    server = ExpertServer(weights, identity, ExpertServerConfig(MODEL, layers, experts))
    moe = tuple(L for L in MOE if layers[0] <= L <= layers[1])
    announcer = Announcer(dht, identity, AnnounceConfig(MODEL, layers, moe, experts, ("tcp+tls://127.0.0.1:1",),
                                                        held_bytes(weights)))
    dht.me = identity.peer_id_str
    return identity, Holding(CFG, server, announcer, weights, (Block(layers, experts),))


def test_a_move_retires_the_layers_left_and_discovery_reads_the_new_block() -> None:
    async def main() -> None:
        dht = MemoryDHT()
        me, holding = a_node(dht, (0, 3), (4, 7))
        await holding.announcer.publish()
        await holding.announce([Block((2, 3), (0, 7))], load_block(str(CHECKPOINT), CFG, (2, 3), (0, 7)))
        new = decode(dht.values[announcement_key(MODEL, 2, me.peer_id)])
        assert (new.layers, new.experts) == ((2, 3), (0, 7))
        for layer in (0, 1):  # left: a record of that layer alone, older than the new one, expiring soon
            left = decode(dht.values[announcement_key(MODEL, layer, me.peer_id)])
            assert (left.layers, left.experts) == ((layer, layer), (4, 7)) and left.seq < new.seq
            assert left.expires_at_ms < time.time() * 1000 + 5_000
        table = SwarmTable(MODEL)
        await Discovery(dht, table, MOE).refresh()  # reads layer 0 first, yet ends on the newest record
        assert (table.holders[me.peer_id].layers, table.holders[me.peer_id].experts) == ((2, 3), (0, 7))
        assert table.coverage(MOE, CFG.num_experts) == {(L, e) for L in (0, 1) for e in range(8)}

    asyncio.run(main())


def test_a_move_that_would_uncover_an_expert_keeps_the_old_block() -> None:
    """The plan was safe when made; by the last check the other holder of the experts to drop is gone."""
    async def main() -> None:
        dht = MemoryDHT()
        me, holding = a_node(dht, (0, 3), (4, 7))
        await holding.announcer.publish()
        before = dict(dht.values)
        one_expert = held_bytes(load_block(str(CHECKPOINT), CFG, (0, 0), (0, 0)))
        shape = ModelShape(MODEL, tuple(MOE), CFG.num_experts, one_expert)
        decisions: list[Decision] = []
        rebalancer = Rebalancer(dht, me.peer_id, shape, Volunteer(16 * shape.expert_bytes, 1e4), holding,
                                NodeConfig(SwarmConfig(str(CHECKPOINT))), decisions.append)
        old_weights = holding.weights
        d = await rebalancer._move([Block((0, 3), (4, 7))], [Block((2, 3), (0, 7))], 0.75, epoch=1)
        assert d.action == "kept" and (d.layers, d.experts) == ((0, 3), (4, 7)), d
        assert holding.weights is old_weights and holding.server.weights is old_weights
        assert dht.values == before  # nothing announced
        assert rebalancer.moved_epoch is None

    asyncio.run(main())


def test_a_node_of_two_blocks_moves_them_in_one_record_and_keeps_any_block_only_it_holds() -> None:
    """One process, two blocks: the record claims both (``more_blocks``) under every layer of
    each; a move to two other blocks retires the layers it leaves (each cut to its old experts
    there); a move that would drop the second block while it is the only holder keeps both."""
    async def main() -> None:
        dht = MemoryDHT()
        me, holding = a_node(dht, (0, 0), (0, 1))
        shape = ModelShape(MODEL, tuple(MOE), CFG.num_experts, held_bytes(load_block(str(CHECKPOINT), CFG, (0, 0),
                                                                                     (0, 0))))
        two = [Block((0, 0), (0, 1)), Block((2, 3), (6, 7))]
        await holding.announce(two, load_blocks(str(CHECKPOINT), CFG, two))
        for layer in (0, 2, 3):
            record = decode(dht.values[announcement_key(MODEL, layer, me.peer_id)])
            assert record.blocks() == (((0, 0), (0, 1)), ((2, 3), (6, 7)))
        assert announcement_key(MODEL, 1, me.peer_id) not in dht.values
        other, other_holding = a_node(dht, (0, 0), (0, 1))  # a second holder of the first block only
        await other_holding.announcer.publish()
        dht.me = me.peer_id_str
        rebalancer = Rebalancer(dht, me.peer_id, shape, Volunteer(16 * shape.expert_bytes, 1e4), holding,
                                NodeConfig(SwarmConfig(str(CHECKPOINT))))
        keeps = await rebalancer._move(two, [Block((1, 1), (0, 3))], 1.0, epoch=1)  # drops both: the second is sole
        assert keeps.action == "kept" and "layers 2-3 x experts 6-7" in keeps.reason, keeps
        assert (keeps.layers, keeps.experts, keeps.more_blocks) == ((0, 0), (0, 1), (((2, 3), (6, 7)),))
        moves = await rebalancer._move(two, [Block((2, 3), (6, 7)), Block((1, 1), (4, 5))], 1.0, epoch=1)
        assert moves.action == "moved", moves  # drops only the first block, which the other node holds
        assert (moves.layers, moves.experts, moves.more_blocks) == ((2, 3), (6, 7), (((1, 1), (4, 5)),))
        new = decode(dht.values[announcement_key(MODEL, 1, me.peer_id)])
        assert new.blocks() == (((2, 3), (6, 7)), ((1, 1), (4, 5)))
        left = decode(dht.values[announcement_key(MODEL, 0, me.peer_id)])  # layer 0 alone, older, short-lived
        assert left.blocks() == (((0, 0), (0, 1)),) and left.seq < new.seq
        table = SwarmTable(MODEL)
        await Discovery(dht, table, MOE).refresh()
        assert table.holders[me.peer_id].blocks() == new.blocks()
        assert {e for e in range(8) if table.holders[me.peer_id].holds(1, e)} == {4, 5}

    asyncio.run(main())


def test_of_two_nodes_announcing_one_block_only_the_smallest_peer_id_moves() -> None:
    """Twins see the same market: both would leave the block at once and uncover it (seen live)."""
    async def main() -> None:
        dht = MemoryDHT()
        twins = []
        for _ in range(2):  # nobody holds experts 0-3: each twin, seeing the other, would move there
            identity, holding = a_node(dht, (0, 3), (4, 7))
            await holding.announcer.publish()
            twins.append((identity, holding))
        twins.sort(key=lambda t: t[0].peer_id)
        one_expert = held_bytes(load_block(str(CHECKPOINT), CFG, (0, 0), (0, 0)))
        shape = ModelShape(MODEL, tuple(MOE), CFG.num_experts, one_expert)
        first, second = (Rebalancer(dht, i.peer_id, shape, Volunteer(16 * one_expert, 1e4), h,
                                    NodeConfig(SwarmConfig(str(CHECKPOINT)))) for i, h in twins)
        waits = await second.evaluate()
        assert waits.action == "stay" and "smallest peer ID" in waits.reason, waits
        assert (waits.layers, waits.experts) == ((0, 3), (4, 7))
        moves = await first.evaluate()
        assert moves.action == "moved" and (moves.layers, moves.experts) == ((0, 3), (0, 3)), moves
        again = await second.evaluate()  # no twin any more; it is the only holder of experts 4-7
        assert again.action == "stay" and "smallest peer ID" not in again.reason, again
        table = SwarmTable(MODEL)
        await Discovery(dht, table, MOE).refresh()
        assert table.coverage(MOE, CFG.num_experts) == set()  # what no holder lists: nothing

    asyncio.run(main())


def test_requests_accepted_before_a_move_are_computed_after_it() -> None:
    async def main() -> None:
        _, holding = a_node(MemoryDHT(), (0, 3), (4, 7))
        server = holding.server
        x = np.ones((2, CFG.hidden_size), np.float32)
        request = ExpertRequest(request_id=os.urandom(16), model_id=MODEL, layer=0, seq=1, hidden=x,
                                experts=(ExpertRows(4, np.arange(2, dtype=np.uint32)),))
        call = asyncio.create_task(server.handle(b"c" * 38, request))
        await asyncio.sleep(0)  # one step of the call: accepted and queued (the worker is not started)
        assert server._queue.qsize() == 1
        server.serve(load_block(str(CHECKPOINT), CFG, (2, 3), (0, 7)), (2, 3), (0, 7))
        with pytest.raises(ProtocolError) as refused:
            await server.handle(b"c" * 38, request)
        assert refused.value.code == ErrorCode.UNKNOWN_EXPERT
        await server.start()
        try:
            response = await asyncio.wait_for(call, 10)
        finally:
            await server.aclose()
        np.testing.assert_allclose(response.outputs, expert_ffn(holding.weights.experts[0][4], x, CFG), rtol=1e-5)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def node(config: NodeConfig, decisions: asyncio.Queue[Decision] | None = None) -> AsyncIterator[dict[str, Any]]:
    """``run_node`` in this process until the block exits; yields its READY info."""
    stop = asyncio.Event()
    ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_node(config, on_ready=ready.set_result, stop=stop,
                                        on_decision=decisions.put_nowait if decisions else lambda d: None))
    try:
        await asyncio.wait({task, ready}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # its error
        assert ready.done(), "the node did not get ready within 60 s"
        yield ready.result()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def next_decision(decisions: asyncio.Queue[Decision], *, skip: str | None = None) -> Decision:
    """The next decision (bounded wait), passing over ``skip`` decisions."""
    deadline = time.monotonic() + 30
    while True:
        d = await asyncio.wait_for(decisions.get(), max(0.1, deadline - time.monotonic()))
        if d.action != skip:
            return d


async def call(endpoint: str, peer: bytes, model_id: str, layer: int, expert: int, x: np.ndarray) -> np.ndarray:
    client = await ExpertClient.connect(endpoint, Identity.generate(), expected_peer=peer)
    try:
        request = ExpertRequest(request_id=os.urandom(16), model_id=model_id, layer=layer,
                                seq=time.time_ns() // 1000, hidden=x,
                                experts=(ExpertRows(expert, np.arange(len(x), dtype=np.uint32)),))
        return (await client.call(request, timeout=10)).outputs
    finally:
        await client.aclose()


@pytest.mark.slow
def test_auto_node_moves_to_what_the_swarm_lacks_without_uncovering_an_expert() -> None:
    one_expert = held_bytes(load_block(str(CHECKPOINT), CFG, (MOE[0], MOE[0]), (0, 0)))
    x = np.random.default_rng(0).standard_normal((3, CFG.hidden_size)).astype(np.float32)

    async def main() -> None:
        decisions: asyncio.Queue[Decision] = asyncio.Queue()
        async with node(NodeConfig(SwarmConfig(str(CHECKPOINT)), experts="3-3")) as p:
            swarm = SwarmConfig(str(CHECKPOINT), bootstrap=(p["multiaddrs"][0],))
            auto = NodeConfig(swarm, experts="auto", capacity_bytes=16 * one_expert + one_expert // 2,
                              rebalance_interval_s=0.5, rebalance_grace_s=3.0,
                              rebalance=RebalanceConfig(hysteresis=0.5, cooldown_epochs=0))
            async with node(auto, decisions) as c:
                model_id, c_peer = c["model_id"], peer_id_from_str(c["peer_id"])
                assert (c["layers"], c["experts"]) == ([0, 3], [4, 7])  # what nobody held
                first = await next_decision(decisions)
                assert first.action == "stay", first  # the swarm has not changed since it joined

                async with node(NodeConfig(swarm, layers="0-1")), \
                        p2p_node(Identity.generate(), SwarmConfig(str(CHECKPOINT), bootstrap=swarm.bootstrap,
                                                                  client_mode=True)) as observer:
                    samples: list[set[tuple[int, int]]] = []

                    async def sample_coverage() -> None:  # what a backbone joining now would find
                        while True:
                            table = SwarmTable(model_id)
                            await Discovery(observer, table, MOE, num_layers=CFG.num_layers,  # as a backbone does
                                            num_experts=CFG.num_experts).refresh()
                            samples.append(ALL - table.coverage(MOE, CFG.num_experts))
                            await asyncio.sleep(0.05)  # pacing only: the samples are what is checked

                    sampler = asyncio.create_task(sample_coverage())
                    try:
                        moved = await next_decision(decisions, skip="stay")
                        assert moved.action == "moved", moved
                        assert (moved.layers, moved.experts) == ((2, 3), (0, 7)) and moved.gain is not None
                        assert moved.gain > 0.5
                        # during the grace period it serves the old block and the new one
                        old = await call(c["endpoint"], c_peer, model_id, 0, 4, x)
                        new = await call(c["endpoint"], c_peer, model_id, 2, 0, x)
                        # with the state unchanged, the next evaluations (after the grace) stay
                        for _ in range(2):
                            again = await next_decision(decisions)
                            assert again.action == "stay", again
                            assert (again.layers, again.experts) == ((2, 3), (0, 7))
                        with pytest.raises(ProtocolError) as dropped:  # the grace is over
                            await call(c["endpoint"], c_peer, model_id, 0, 4, x)
                        assert dropped.value.code == ErrorCode.UNKNOWN_EXPERT
                        deadline = time.monotonic() + 60  # a slow machine samples less often: wait for enough
                        while len(samples) < 5 and time.monotonic() < deadline:
                            await asyncio.sleep(0.1)
                    finally:
                        sampler.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await sampler

        reference = load_block(str(CHECKPOINT), CFG, (0, 2), (0, 7)).experts
        np.testing.assert_allclose(old, expert_ffn(reference[0][4], x, CFG), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new, expert_ffn(reference[2][0], x, CFG), rtol=1e-5, atol=1e-5)

        assert len(samples) >= 5, f"only {len(samples)} discovery samples during the move"
        only_c = {(L, e) for L in (2, 3) for e in range(4, 8)}  # held by C alone before and after
        for i, covered in enumerate(samples):
            assert only_c <= covered, f"sample {i}: {sorted(only_c - covered)} lost their only holder"
            if i:
                assert samples[i - 1] <= covered, f"sample {i}: {sorted(samples[i - 1] - covered)} uncovered"
        assert samples[-1] == ALL, f"still uncovered after the move: {sorted(ALL - samples[-1])}"

    asyncio.run(main())
