"""Choosing a gateway (issue 30, point 1), the pure parts: the ranking by load and latency, ``--model``
as a folder, its config.json or a catalogue id, and the gateway record under the DHT's validator."""

from __future__ import annotations

import time

import pytest

from moeswarm.demo import CHECKPOINT
from moeswarm.errors import ConfigError, ProtocolError
from moeswarm.model import load_config
from moeswarm.model.model_id import model_id_for
from moeswarm.net.gateways import gateway_key, sign_gateway
from moeswarm.net.records import select_any, validate_any
from moeswarm.protocol import Identity
from moeswarm.sdk.gateway import Candidate, model_id_of, rank


def _record(free: int, rtt_us: int, identity: Identity | None = None, seq: int = 1):  # type: ignore[no-untyped-def]
    return sign_gateway(identity or Identity.generate(), "http://127.0.0.1:8000", ["mixtral-e4bde7c04b4d"],
                        free_slots=free, max_batch=16, price_per_token=0, rtt_us=rtt_us, seq=seq,
                        expires_at_ms=int(time.time() * 1000) + 60_000)


def test_rank_prefers_a_free_place_then_the_least_expected_latency_then_more_free_places() -> None:
    full_near = Candidate(_record(0, 1000), 0.001)  # nearest, but its batch is full
    far = Candidate(_record(8, 1000), 0.040)
    near = Candidate(_record(2, 1000), 0.005)
    near_far_holders = Candidate(_record(9, 60_000), 0.005)  # near the person, far from its holders
    tie_fewer = Candidate(_record(1, 1000), 0.005)
    order = rank([full_near, far, near_far_holders, tie_fewer, near])
    assert order == [near, tie_fewer, far, near_far_holders, full_near]


def test_model_is_a_folder_its_config_or_a_catalogue_id() -> None:
    expected = model_id_for(CHECKPOINT, load_config(CHECKPOINT))
    assert model_id_of(str(CHECKPOINT)) == model_id_of(str(CHECKPOINT / "config.json")) == expected
    assert model_id_of("mixtral-e4bde7c04b4d") == "mixtral-e4bde7c04b4d"
    with pytest.raises(ConfigError, match="neither a checkpoint folder"):
        model_id_of("no such/model id!")


def test_the_dht_stores_a_gateway_record_under_its_own_key_and_prefers_the_newer() -> None:
    me = Identity.generate()
    old, new = _record(4, 1500, me, seq=1), _record(3, 1500, me, seq=2)
    key = gateway_key(me.peer_id)
    validate_any(key, old.encode())
    validate_any(key, new.encode(), old.encode())
    with pytest.raises(ProtocolError) as info:
        validate_any(key, old.encode(), new.encode())
    assert info.value.code == 14
    with pytest.raises(ProtocolError) as info:
        validate_any(gateway_key(Identity.generate().peer_id), new.encode())
    assert info.value.code == 9
    assert select_any(key, [old.encode(), new.encode()]) == 1


def test_generate_identity_needs_swarm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from moeswarm.cli import main

    done = CliRunner().invoke(main, ["generate", "--identity", str(tmp_path / "me.key"), "--max-new-tokens", "1"])
    assert done.exit_code != 0
    assert "--identity countersigns the swarm's receipts: it needs --swarm" in done.output
    assert not (tmp_path / "me.key").exists()
