"""Issue 31, acceptance: discovery with 200 real libp2p peers (``tests/peer_swarm.py``: real TCP,
Noise, Yamux, GossipSub, the project's Announcer and Discovery; holders several to a worker process).

Holder ``i`` serves expert ``i`` of the model, so full coverage means every holder's record was
seen. Two backbones join after the holders; each must see full coverage through the model's
announcement topic (a first view from peers of the topic, then gossip) without a DHT pass (the
holders do not write the DHT here: a DHT pass could not cover anything); then a departure (a holder
withdraws) and a block move (a holder takes two experts) must reach both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest
from peer_swarm import PeerSwarm

HOLDERS = 200
GONE, MOVED = 7, 109  # in the first worker process and in a later one
log = logging.getLogger(__name__)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_hundred_peers_coverage_departure_and_move_seen_by_two_backbones() -> None:
    asyncio.run(_scenario())


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s") from None


async def _scenario() -> None:
    t0 = time.monotonic()
    async with PeerSwarm(HOLDERS, per_process=100) as swarm:
        log.info("200 holders started in %.1f s", swarm.startup_s)
        backbones = [await swarm.backbone(), await swarm.backbone()]
        for d in backbones:
            missing = await d.wait_for_coverage(HOLDERS, 60)
            assert not missing, f"{len(missing)} experts without a holder, e.g. {sorted(missing)[:5]}"
            assert d.dht_passes == 0  # the view came from the topic, not one DHT get per holder
            assert len(d.table.live()) == HOLDERS
        log.info("both backbones covered at %.1f s", time.monotonic() - t0)

        def holders_of(d, expert: int):  # type: ignore[no-untyped-def]
            return [h for h in d.table.live() if h.holds(0, expert)]

        await swarm.withdraw(GONE)
        await _until(lambda: all(not holders_of(d, GONE) for d in backbones), "the departure reaching both")
        assert all(d.table.coverage([0], HOLDERS) == {(0, GONE)} for d in backbones)

        await swarm.move(MOVED, (MOVED, MOVED + 1))
        await _until(lambda: all(any(h.experts == (MOVED, MOVED + 1) for h in holders_of(d, MOVED + 1))
                                 for d in backbones), "the block move reaching both")
        assert all(len(holders_of(d, MOVED + 1)) == 2 and len(d.table.live()) == HOLDERS - 1 for d in backbones)
        log.info("departure and move seen by both at %.1f s", time.monotonic() - t0)
