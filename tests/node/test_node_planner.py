"""The tier planner on the seed's measured figures, and its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeswarm.node.planner import (
    FETCH,
    LOCAL,
    REMOTE,
    ExpertSpec,
    Link,
    LocalTier,
    decide,
    plan,
)

MB = 1e6
# seed 000: MI250 box <-> GB10, RTT 3.4 ms, 49 Mbit/s (6.1 MB/s) one way, 11.2 MB/s the other; NVMe 2.5 GB/s
SEED_LINK = Link(rtt_s=0.0034, up_bps=6.1 * MB, down_bps=11.2 * MB, compute_bps=200e9)
NVME = LocalTier(disk_bps=2500 * MB, compute_bps=200e9)
EXPERT = ExpertSpec(layer=0, expert=0, bytes=int(16.5 * MB), holders=("peer",))
HIDDEN = 6144 * 2  # one token's fp16 hidden state (M3: n_embd 6144)


def test_on_the_seed_link_the_local_disk_wins_prefill() -> None:
    assert decide(EXPERT, NVME, {"peer": SEED_LINK}, tokens=512, hidden_bytes=HIDDEN).tier == LOCAL


def test_decode_over_the_seed_link_is_round_trip_bound() -> None:
    d = decide(EXPERT, NVME, {"peer": SEED_LINK}, tokens=1, hidden_bytes=HIDDEN)
    assert d.seconds >= 0.0034 or d.tier == LOCAL


def test_at_200_gbe_remote_ram_beats_local_nvme() -> None:
    fast = Link(rtt_s=0.0002, up_bps=25e9, down_bps=25e9, compute_bps=200e9)
    assert decide(EXPERT, NVME, {"peer": fast}, tokens=1, hidden_bytes=HIDDEN).tier in (REMOTE, FETCH)


def test_hot_experts_are_fetched_when_reused_enough() -> None:
    lan = Link(rtt_s=0.0005, up_bps=117 * MB, down_bps=117 * MB, compute_bps=20e9)  # 1 Gbit/s
    slow_disk = LocalTier(disk_bps=100 * MB, compute_bps=20e9)
    hot = ExpertSpec(0, 0, int(16.5 * MB), ("peer",), local=True, reuse=1000)
    assert decide(hot, slow_disk, {"peer": lan}, tokens=64, hidden_bytes=HIDDEN).tier == FETCH


def test_prediction_adds_up() -> None:
    specs = [ExpertSpec(0, e, int(16.5 * MB), ("peer",)) for e in range(8)]
    p = plan(specs, NVME, {"peer": SEED_LINK}, tokens=1, hidden_bytes=HIDDEN, top_k=2, backbone_seconds=0.01)
    assert p.counts()[LOCAL] + p.counts()[REMOTE] + p.counts()[FETCH] == 8
    assert p.seconds_per_token > 0.01 and 0 < p.tokens_per_s < 100


@given(st.floats(1e-4, 0.1), st.floats(1e-4, 0.1), st.floats(1e5, 1e10), st.floats(1e5, 1e10), st.integers(1, 512))
def test_choice_is_cheapest_and_slower_links_never_attract(rtt: float, more: float, up: float, down: float,
                                                           tokens: int) -> None:
    fast = Link(rtt, up, down)
    slow = Link(rtt + more, up, down)
    a = decide(EXPERT, NVME, {"peer": fast}, tokens=tokens, hidden_bytes=HIDDEN)
    b = decide(EXPERT, NVME, {"peer": slow}, tokens=tokens, hidden_bytes=HIDDEN)
    assert b.seconds >= a.seconds - 1e-12
    if a.tier == LOCAL:
        assert b.tier == LOCAL


def _holder(i: int, layers: tuple[int, int], experts: tuple[int, int], rtt: float | None = None):  # type: ignore[no-untyped-def]
    from moeswarm.net.routing_table import Holder

    h = Holder(bytes([i]) * 34, (f"tcp://10.0.0.{i}:1",), "m", layers, experts, 2**62, 1)
    h.rtt_s = rtt
    return h


def test_a_big_swarm_probes_a_cover_of_every_expert_first() -> None:
    """600 holders of 2 experts each, plus 8 that each hold a whole layer: 8 probes cover the
    model; measured holders win ties; a small swarm is probed whole."""
    from moeswarm.node.links import choose_probed

    small = [_holder(i, (L, L), (2 * (i % 32), 2 * (i % 32) + 1)) for i, L in enumerate([0] * 32)]
    assert len(choose_probed(small, 32)) == 32
    pairs = [_holder(i % 250, (L, L), (2 * e, 2 * e + 1)) for i, (L, e) in
             enumerate((L, e) for L in range(8) for e in range(64))][:600]
    layers = [_holder(300 + L - 256, (L, L), (0, 127)) for L in range(8)]
    live = pairs + layers
    chosen = choose_probed(live, 10, measured={layers[3].peer_id})
    assert chosen[0] is layers[3]  # the measured one first among equally good covers
    assert set(map(id, chosen[:8])) == set(map(id, layers))  # 8 probes cover 8 x 128 experts
    assert len(chosen) == 10
    covered = {(L, e) for h in chosen for L in range(h.layers[0], h.layers[1] + 1)
               for e in range(h.experts[0], h.experts[1] + 1)}
    assert covered >= {(L, e) for L in range(8) for e in range(128)}
    # no holder holds everything: the cover still takes the biggest gain each time
    halves = [_holder(i, (0, 7), (64 * (i % 2), 64 * (i % 2) + 63)) for i in range(40)]
    assert {h.experts for h in choose_probed(halves, 2)} == {(0, 63), (64, 127)}


def test_unprobed_holders_are_planned_with_the_typical_link() -> None:
    """The planner predicts a finite speed for experts whose holders went unprobed: their link is
    the median measured one, with the round trip their calls showed."""
    import asyncio
    import time
    from dataclasses import replace

    from moeswarm.model.config import ModelConfig
    from moeswarm.net.routing_table import SwarmTable
    from moeswarm.node.links import LinkEstimate, LinkMonitor
    from moeswarm.node.tiers import TierPlanner
    from moeswarm.protocol import Identity

    cfg = ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "vocab_size": 100, "rms_norm_eps": 1e-5, "max_position_embeddings": 64})
    table = SwarmTable("m")
    a, b, c = _holder(1, (0, 1), (0, 1)), _holder(2, (0, 1), (2, 3)), _holder(3, (0, 1), (2, 3), rtt=0.02)
    for h in (a, b, c):
        table.holders[h.peer_id] = h
    links = LinkMonitor(Identity.generate(), table)
    links.links[a.peer_id] = LinkEstimate(0.004, 10e6, 5e6, time.monotonic())
    tiers = TierPlanner(cfg, table, links, self_peer=b"me")
    table_ = tiers.link_table()
    assert table_[b.peer_id.hex()].rtt_s == 0.004 and table_[b.peer_id.hex()].down_bps == 5e6
    assert table_[c.peer_id.hex()].rtt_s == 0.02  # its calls said so
    plan_ = tiers.replan()
    assert 0 < plan_.tokens_per_s < float("inf")
    assert tiers.status()["plan"]["predicted_tokens_per_s"] > 0
    del links.links[a.peer_id]  # nothing measured: no prediction rather than "0 tokens/s"
    tiers.replan()
    assert tiers.status()["plan"]["predicted_tokens_per_s"] is None

    async def replans_on_new_links() -> float:
        """The plan is remade as soon as a probe brings a link, not only every replan_s."""
        tiers.config = replace(tiers.config, replan_s=3600)
        await tiers.start()
        try:
            first = tiers.planned_at
            links.links[a.peer_id] = LinkEstimate(0.004, 10e6, 5e6, time.monotonic())
            links.changed.set()
            for _ in range(200):
                if tiers.planned_at > first:
                    break
                await asyncio.sleep(0.01)
            return tiers.planned_at - first
        finally:
            await tiers.aclose()

    assert asyncio.run(replans_on_new_links()) > 0
    assert tiers.status()["plan"]["predicted_tokens_per_s"] > 0
    assert all(d.peer is not None and d.seconds < float("inf") for d in plan_.decisions.values()), plan_.decisions


def test_a_fetch_rate_seen_beats_the_probes_estimate() -> None:
    """Fetches pull four chunks at once; once some have run, their rate is what fetching costs."""
    from moeswarm.node.planner import fetch_seconds

    probed = Link(rtt_s=0.001, up_bps=10 * MB, down_bps=10 * MB)
    seen = Link(rtt_s=0.001, up_bps=10 * MB, down_bps=10 * MB, fetch_bps=40 * MB)
    spec = ExpertSpec(0, 0, bytes=int(20 * MB), holders=("peer",), local=False, reuse=200.0)
    assert fetch_seconds(spec, probed, NVME) == pytest.approx((0.001 + 2.0) / 200 + spec.bytes / NVME.compute_bps)
    assert fetch_seconds(spec, seen, NVME) == pytest.approx((0.001 + 0.5) / 200 + spec.bytes / NVME.compute_bps)
    assert decide(spec, NVME, {"peer": probed}, 1, HIDDEN).tier == REMOTE
    assert decide(spec, NVME, {"peer": seen}, 1, HIDDEN).tier == FETCH
    untrusted = Link(rtt_s=0.001, up_bps=10 * MB, down_bps=10 * MB, fetch_bps=40 * MB, fetchable=False)
    assert decide(spec, NVME, {"peer": untrusted}, 1, HIDDEN).tier == REMOTE
