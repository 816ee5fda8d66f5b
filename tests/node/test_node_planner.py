"""The tier planner on the seed's measured figures, and its invariants."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from moeswarm.node.planner import FETCH, LOCAL, REMOTE, ExpertSpec, Link, LocalTier, decide, plan

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
