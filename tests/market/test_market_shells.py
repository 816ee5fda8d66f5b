"""The I/O shells: ``fetch_state`` over an in-memory DHT, and ``moeswarm market`` on a state file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeswarm.errors import ProtocolError, Unreachable
from moeswarm.market import (
    ModelShape,
    decode_report,
    demand_key,
    encode_report,
    fetch_state,
    publish_demand,
    sign_report,
    validate_demand_record,
)
from moeswarm.market_cli import market
from moeswarm.model.memory import parse_size
from moeswarm.protocol import (
    Identity,
    announcement_key,
    encode,
    provider_key,
    sign_announcement,
)

SHAPE = ModelShape("org/m", (1, 2, 3), 4, 1_000_000)
NOW = 1_700_000_000_000
IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(8)]


class MemoryDHT:
    """The DHT protocol over dicts; ``broken`` provider keys raise like an unreachable network."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.providers: dict[str, list[str]] = {}
        self.broken: set[str] = set()
        self.me = "12D3KooWQYV9dGMFoRzNStwpXztXaBUjtPqi6aU76ZgUriHhKust"  # overwritten per put by tests

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    async def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    async def provide(self, key: str) -> None:
        self.providers.setdefault(key, []).append(self.me)

    async def find_providers(self, key: str) -> list[str]:
        if key in self.broken:
            raise Unreachable("no route")
        return list(self.providers.get(key, []))


async def _announce(dht: MemoryDHT, ident: Identity, layers: tuple[int, int], experts: tuple[int, int],
                    expires_at_ms: int = NOW + 60_000) -> None:
    rec = sign_announcement(ident, model_id="org/m", layers=layers, experts=experts,
                            endpoints=["tcp+tls://127.0.0.1:1"], capacity_bytes=1, throughput=400,
                            load_permille=0, software="t", seq=1, expires_at_ms=expires_at_ms)
    dht.me = ident.peer_id_str
    for layer in SHAPE.moe_layers:
        if layers[0] <= layer <= layers[1]:
            await dht.put(announcement_key("org/m", layer, ident.peer_id), encode(rec))
            await dht.provide(provider_key("org/m", layer))


def _report(ident: Identity, counts: np.ndarray, time_ms: int = NOW):  # type: ignore[no-untyped-def]
    return sign_report(ident, model_id="org/m", layers=SHAPE.moe_layers, counts=counts, half_life_ms=600_000,
                       time_ms=time_ms, seq=1)


def test_fetch_state_reads_valid_announcements_and_merges_reports() -> None:
    async def main():  # type: ignore[no-untyped-def]
        dht = MemoryDHT()
        await _announce(dht, IDS[0], (1, 2), (0, 3))
        await _announce(dht, IDS[1], (2, 3), (0, 1))
        await _announce(dht, IDS[2], (1, 3), (0, 3), expires_at_ms=NOW - 1)  # expired: skipped
        dht.providers[provider_key("org/m", 3)].append(IDS[3].peer_id_str)  # provider without a record
        dht.values[announcement_key("org/m", 1, IDS[4].peer_id)] = b"garbage"
        dht.providers[provider_key("org/m", 1)].append(IDS[4].peer_id_str)
        counts = np.arange(1, 13, dtype=float).reshape(3, 4)
        for ident in IDS[5:8]:
            dht.me = ident.peer_id_str
            await publish_demand(dht, _report(ident, counts))
        liar = np.zeros((3, 4))
        liar[0, 0] = 1e9
        dht.me = IDS[4].peer_id_str
        await publish_demand(dht, _report(IDS[4], liar))
        state = await fetch_state(dht, SHAPE, now_ms=NOW)
        dht.broken.add(provider_key("org/m", 2))
        partial = await fetch_state(dht, SHAPE, now_ms=NOW)
        return state, partial

    state, partial = asyncio.run(main())
    assert state.supply.holders == 2
    assert state.supply.replicas.tolist() == [[1, 1, 1, 1], [2, 2, 1, 1], [1, 1, 0, 0]]
    assert state.demand.reporters == 3  # the liar is an outlier
    np.testing.assert_allclose(state.demand.share, np.arange(1, 13).reshape(3, 4) / 78, rtol=1e-6)
    assert state.epoch == NOW // 3_600_000
    assert partial.supply.holders == 2  # layer 2's providers unreachable: others still found via layers 1, 3
    prices = state.prices()
    assert prices.price("org/m", 3, 3, state.epoch) == 4.0  # nobody holds it


def test_validate_demand_record_checks_key_signature_and_age() -> None:
    r = _report(IDS[0], np.ones((3, 4)))
    key = demand_key("org/m", IDS[0].peer_id)
    assert key == "/moeswarm/v1/org/m/demand/" + IDS[0].peer_id_str
    assert decode_report(encode_report(validate_demand_record(key, encode_report(r), now_ms=NOW))).seq == 1
    for bad_key, value, now in ((demand_key("org/m", IDS[1].peer_id), encode_report(r), NOW),
                                (key, encode_report(r), NOW + 10**8),
                                (key, encode_report(r), NOW - 10**7),
                                (key, encode_report(_report(IDS[1], np.ones((3, 4)))), NOW)):
        with pytest.raises(ProtocolError):
            validate_demand_record(bad_key, value, now_ms=now)


def _state_file(tmp_path: Path) -> Path:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({
        "model": {"model_id": "org/m", "moe_layers": {"first": 1, "last": 3}, "num_experts": 4,
                  "expert_bytes": 1_000_000},
        "now_ms": NOW,
        "holders": [{"layers": [1, 2], "experts": [0, 3], "throughput": 400},
                    {"layers": [3, 3], "experts": [0, 1], "throughput": 100, "load_permille": 900},
                    {"layers": [3, 3], "experts": [2, 3], "expires_at_ms": NOW - 1}],
        "demand": {"counts": [[1, 2, 3, 4], [4, 3, 2, 1], [9, 9, 9, 9]], "rate": 1000.0},
    }))
    return path


def test_market_cli_shows_coverage_prices_and_a_suggestion(tmp_path: Path) -> None:
    path = _state_file(tmp_path)
    runner = CliRunner()
    out = runner.invoke(market, ["--state", str(path), "--json", "--suggest", "2MB", "--device-class", "hub"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["coverage"] == pytest.approx(10 / 12) and data["uncovered"] == [[3, 2], [3, 3]]
    assert data["holders"] == 2 and data["layers"][2]["covered"] == 2
    assert data["prices"]["multipliers"][2][3] == 4.0
    assert data["suggestion"]["node_args"] == ["--layers", "3-3", "--experts", "2-3"]
    table = runner.invoke(market, ["--state", str(path)])
    assert table.exit_code == 0 and "coverage" in table.output and "L3/e2" in table.output
    assert "--help" not in table.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"model_id": "m"}}))
    err = runner.invoke(market, ["--state", str(bad)])
    assert err.exit_code == 2 and "error:" in err.output
    missing = runner.invoke(market, ["--state", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2


def test_parse_size() -> None:
    assert parse_size("8GB") == 8 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("1.5e9") == 1_500_000_000
    # a bare unit letter is binary, as --memory-budget 8g always read it (the market alone read 3 g as 3e9)
    assert parse_size("3 g") == 3 * 2**30
    with pytest.raises(Exception):
        parse_size("lots")
