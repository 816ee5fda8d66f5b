"""``moeswarm bridge --experts auto``: a bridge asks the swarm's market what it lacks, exports that
block of the demo checkpoint and serves it through a relay. A node holds experts 0-3 of every
layer; the bridge's capacity fits the other half, so the market must hand it experts 4-7, and a
backbone must then generate the single-process engine's tokens through node + bridge."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo import CHECKPOINT, DEFAULT_PROMPT
from moeswarm.mobile_bridge import Manifest
from moeswarm.model import SamplingParams, Tokenizer, generate, load_config, load_model
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.protocol import peer_id_from_str
from moeswarm.relay import set_relay_ca

pytestmark = pytest.mark.slow


def test_bridge_with_experts_auto_takes_the_uncovered_experts_and_generates_the_engine_tokens(
        certs: Any, spawn: Any, tmp_path: Path) -> None:
    cfg = load_config(CHECKPOINT)
    assert (cfg.num_layers, cfg.num_experts) == (4, 8) and all(cfg.moe_layers)
    expert_fp32 = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    capacity = 16 * expert_fp32 + expert_fp32 // 2  # 4 layers x 4 experts exported as fp32, not 17

    node = spawn("node", "moeswarm.cli", "node", "--model", str(CHECKPOINT), "--experts", "0-3")
    boot = node.wait_ready()["multiaddrs"][0]
    relay = spawn("relay", "moeswarm.relay.cli", "--listen", "127.0.0.1:0", "--cert", str(certs.cert),
                  "--key", str(certs.key), "--bootstrap", boot)
    url = relay.wait_ready()["url"]
    cache = tmp_path / "shards-cache"
    bridge = spawn("bridge", "moeswarm.mobile_bridge.cli", "bridge", "--relay", url, "--ca", str(certs.ca),
                   "--model", str(CHECKPOINT), "--experts", "auto", "--bootstrap", boot,
                   "--capacity", str(capacity), "--shards-cache", str(cache), "-v")
    info = bridge.wait_ready()
    assert (info["layers"], info["experts"]) == ([0, 3], [4, 7]), bridge.stderr()[-1500:]
    assert info["endpoint"].startswith("relay+wss://")
    exported = Manifest.read(cache / info["model_id"] / "layers0-3_experts4-7_fp32")
    assert (exported.layers, exported.experts, exported.dtype) == ((0, 3), (4, 7), "fp32")

    tok = Tokenizer.from_folder(CHECKPOINT, cfg.bos_token_id)
    prompt = tok.encode(DEFAULT_PROMPT)
    params = SamplingParams(max_new_tokens=8)
    expected = list(generate(load_model(CHECKPOINT), prompt, params))
    set_relay_ca(str(certs.ca))

    async def through_the_swarm() -> tuple[list[int], dict[bytes, set[tuple[int, int]]]]:
        config = BackboneConfig(SwarmConfig(str(CHECKPOINT), bootstrap=(boot,), client_mode=True),
                                coverage_timeout_s=20, discovery_interval_s=1.0)
        async with SwarmBackbone(config) as bb:
            assert bb.model is not None and bb.executor is not None
            tokens = await asyncio.to_thread(lambda: list(generate(bb.model, prompt, params)))  # type: ignore[arg-type]
            return tokens, dict(bb.executor.served_by)

    tokens, served_by = asyncio.run(through_the_swarm())
    assert tokens == expected
    assert set(served_by) == {peer_id_from_str(node.info["peer_id"]), peer_id_from_str(info["peer_id"])}
    assert all(e >= 4 for _, e in served_by[peer_id_from_str(info["peer_id"])])  # the bridge's block only
