"""The relay's pure parts: envelopes, control messages, endpoints, rate limits and quotas."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeswarm.errors import ConfigError, ProtocolError
from moeswarm.protocol import Error, ErrorCode, Identity, canonical, encode
from moeswarm.relay import (
    GoAway, Kind, PeerBudget, Publish, Published, Quota, RelayLimits, TokenBucket, UnknownControl, Welcome,
    check_frame, decode_control, encode_control, pack, parse_relay_endpoint, relay_endpoint, unpack,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@given(st.sampled_from([Kind.OPEN, Kind.DATA, Kind.CLOSE]), st.integers(1, 2**32 - 1), st.binary(max_size=64))
def test_envelopes_round_trip(kind: Kind, stream: int, payload: bytes) -> None:
    assert unpack(pack(kind, stream, payload)) == (kind, stream, payload)


@pytest.mark.parametrize("data", [b"", b"\x02\x00\x00", b"\x07\x00\x00\x00\x01", pack(Kind.DATA, 0, b"x"),
                                  pack(Kind.CONTROL, 5, b"x")],
                         ids=["empty", "short", "unknown-kind", "data-on-stream-0", "control-on-stream-5"])
def test_bad_envelopes_are_malformed(data: bytes) -> None:
    with pytest.raises(ProtocolError) as e:
        unpack(data)
    assert e.value.code == ErrorCode.MALFORMED_FRAME


@given(st.binary(min_size=1, max_size=100))
def test_check_frame_accepts_exactly_one_frame(body: bytes) -> None:
    check_frame(len(body).to_bytes(4, "big") + body, 1 << 20)
    for bad in (len(body).to_bytes(4, "big") + body + b"x", (len(body) + 1).to_bytes(4, "big") + body, body[:3]):
        with pytest.raises(ProtocolError):
            check_frame(bad, 1 << 20)


def test_frame_limits_are_checked_before_the_body() -> None:
    with pytest.raises(ProtocolError) as e:
        check_frame((2 << 20).to_bytes(4, "big") + b"x", 1 << 20)
    assert e.value.code == ErrorCode.FRAME_TOO_LARGE
    with pytest.raises(ProtocolError) as e:
        check_frame(b"\x00\x00\x00\x00", 1 << 20)
    assert e.value.code == ErrorCode.MALFORMED_FRAME


def test_control_messages_round_trip_and_unknown_types_are_ignored() -> None:
    peer = Identity.generate().peer_id
    for msg in (Welcome("relay+wss://h:1/x", peer, 1 << 20, 8, 20), Publish(b"rec", (0, 3)), Published(7, 2),
                GoAway("bye", 1500), Error(ErrorCode.OVERLOADED, "busy")):
        again = decode_control(encode_control(msg))
        assert encode_control(again) == encode_control(msg)
    assert decode_control(canonical({"type": "relay_future_thing", "x": 1})) == UnknownControl("relay_future_thing")
    for bad, code in [(canonical({"type": "relay_publish", "record": b"x", "layers": []}), ErrorCode.BAD_FIELD),
                      (canonical({"type": "relay_publish", "record": bytes(9000), "layers": [0]}),
                       ErrorCode.FRAME_TOO_LARGE),
                      (canonical({"type": "relay_welcome", "endpoint": "x"}), ErrorCode.BAD_FIELD),
                      (b"\xc1", ErrorCode.MALFORMED_FRAME), (canonical([1]), ErrorCode.MALFORMED_FRAME)]:
        with pytest.raises(ProtocolError) as e:
            decode_control(bad)
        assert e.value.code == code
    assert encode(Error(1, "x")) == encode_control(Error(1, "x"))


def test_relay_endpoints() -> None:
    peer = Identity.generate()
    endpoint = relay_endpoint("wss://relay.example.org:443/moe/", peer.peer_id)
    assert endpoint == f"relay+wss://relay.example.org:443/moe/{peer.peer_id_str}"
    assert parse_relay_endpoint(endpoint) == (f"wss://relay.example.org:443/moe/{peer.peer_id_str}", peer.peer_id)
    for bad in ("wss://h/x", f"relay+wss://h/{peer.peer_id_str}?a=1", "relay+wss://h/notapeer", "relay+wss:///x"):
        with pytest.raises(ConfigError):
            parse_relay_endpoint(bad)
    with pytest.raises(ConfigError):
        relay_endpoint("https://h", peer.peer_id)


def test_token_bucket_shapes_and_a_flood_is_refused() -> None:
    clock = Clock()
    bucket = TokenBucket(10, 10, clock)
    assert [bucket.take(1) for _ in range(10)] == [0.0] * 10
    assert bucket.take(1) == pytest.approx(0.1)
    clock.now += 1.0
    assert bucket.take(1) == 0.0
    limits = RelayLimits(max_flood_s=1.0)
    budget = PeerBudget(10, 1e9, 0, limits, clock)
    waits = []
    for _ in range(200):  # a sender that always waits exactly as told: held at the limit
        wait = budget.charge(100)
        if wait is None:
            break
        waits.append(wait)
        clock.now += wait
    assert wait is None and 10 < len(waits) < 40  # refused after ~1 s at the limit
    polite = PeerBudget(10, 1e9, 0, limits, clock)
    for _ in range(100):  # a sender below its rate is never refused
        clock.now += 0.2
        assert polite.charge(100) == 0.0


def test_quotas_per_window() -> None:
    clock = Clock()
    quota = Quota(1000, 60, clock)
    assert quota.spend(600) and quota.spend(400) and not quota.spend(1)
    clock.now += 61
    assert quota.spend(1000)
    assert Quota(0, 60, clock).spend(10**12)  # 0: unlimited
    with pytest.raises(ConfigError):
        RelayLimits(max_frame=1000)
