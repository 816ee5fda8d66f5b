"""ONNX expert shards: numerics against the engine's expert_ffn, the manifest, external data,
and the bridge's expert server against the node's."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from moeswarm.errors import ConfigError, ProtocolError
from moeswarm.mobile_bridge import Manifest, OnnxExpertServer, OnnxShards, RuntimeConfig, export_onnx, session_options
from moeswarm.mobile_bridge.cli import export_onnx as export_cli
from moeswarm.model import expert_ffn, load_config, load_weights
from moeswarm.model.model_id import model_id_for
from moeswarm.node.expert_server import ExpertServer, ExpertServerConfig
from moeswarm.protocol import ErrorCode, ExpertRequest, ExpertRows, Identity, check_response


def max_error(folder: Path, shard_dir: Path, experts: range) -> float:
    weights = load_weights(folder)
    shards = OnnxShards(shard_dir)
    rng = np.random.default_rng(1)
    worst = 0.0
    for layer in shards.moe_layers:
        sizes = [1, 5, 0, 9, 2, 3, 1, 4][: len(experts)]  # 0 rows: an empty branch
        xs = {e: 2 * rng.standard_normal((n, weights.config.hidden_size)).astype(np.float32) for e, n in zip(experts, sizes)}
        ys = shards.run(layer, xs)
        for e, x in xs.items():
            assert ys[e].shape == x.shape and ys[e].dtype == np.float32
            if len(x):
                ref = expert_ffn(weights.experts[layer][e], x, weights.config)
                worst = max(worst, float(np.abs(ys[e] - ref).max() / max(1.0, np.abs(ref).max())))
    return worst


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])  # SwiGLU; gpt-oss clamped SwiGLU with biases
def test_fp32_shards_equal_the_engine_and_fp16_are_close(oracle_checkpoints: Any, tmp_path: Path, arch: str) -> None:
    folder, _ = oracle_checkpoints.get(arch, "packed")
    cfg = load_config(folder)
    assert cfg.expert_activation == ("clamped_swiglu" if arch == "gpt_oss" else "swiglu")
    export_onnx(folder, tmp_path / "fp32", experts=(2, 5))
    export_onnx(folder, tmp_path / "fp16", experts=(2, 5), dtype="fp16")
    assert max_error(folder, tmp_path / "fp32", range(2, 6)) <= 1e-5
    assert max_error(folder, tmp_path / "fp16", range(2, 6)) <= 5e-3
    assert (tmp_path / "fp16" / "layer_0000.onnx.data").stat().st_size < (tmp_path / "fp32" / "layer_0000.onnx.data").stat().st_size


def test_manifest_external_data_and_hashes(oracle_checkpoints: Any, tmp_path: Path) -> None:
    folder, _ = oracle_checkpoints.get("qwen2_moe", "packed")  # layer 1 is dense: it gets no shard
    cfg = load_config(folder)
    result = CliRunner().invoke(export_cli, ["--model", str(folder), "--layers", "0-2", "--experts", "4-9",
                                             "--out", str(tmp_path / "s"), "--dtype", "fp16"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["moe_layers"] == [0, 2]  # the progress bar goes to stderr
    manifest = Manifest.read(tmp_path / "s")
    assert manifest.model_id == model_id_for(str(folder), cfg)  # what the nodes of this model announce
    assert (manifest.layers, manifest.experts, manifest.dtype) == ((0, 2), (4, 9), "fp16")
    assert (manifest.hidden_size, manifest.intermediate_size) == (cfg.hidden_size, cfg.moe_intermediate_size)
    assert (tmp_path / "s" / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    manifest.verify(tmp_path / "s")
    model = onnx.load(str(tmp_path / "s" / "layer_0002.onnx"), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) == 2 * 6  # w_gu and w_down of each of the 6 experts
    offsets = [int({e.key: e.value for e in t.external_data}["offset"]) for t in external]
    assert all(o % 65536 == 0 for o in offsets)  # page-aligned, so onnxruntime can map them
    assert [i.name for i in model.graph.input] == [f"x_{e}" for e in range(4, 10)]
    so = session_options(RuntimeConfig(threads=1, mmap=True))
    assert so.get_session_config_entry("session.disable_prepacking") == "1"
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert OnnxShards(tmp_path / "s", RuntimeConfig(mmap=True)).held(2) == tuple(range(4, 10))
    data = tmp_path / "s" / "layer_0002.onnx.data"
    data.write_bytes(data.read_bytes()[:-1] + b"\x01")
    with pytest.raises(ConfigError, match="layer_0002.onnx.data"):
        Manifest.read(tmp_path / "s").verify(tmp_path / "s")
    with pytest.raises(ConfigError, match="outside"):
        export_onnx(folder, tmp_path / "t", experts=(0, cfg.num_experts))
    with pytest.raises(ConfigError, match="no MoE layer"):
        export_onnx(folder, tmp_path / "t", layers=(1, 1))


def test_the_bridge_server_answers_like_the_node_server(mixtral: tuple[Path, Any], tmp_path: Path) -> None:
    folder, _ = mixtral
    manifest = export_onnx(folder, tmp_path / "s", experts=(0, 3))
    config = ExpertServerConfig(manifest.model_id, (0, 1), (0, 3))
    client = Identity.generate()
    rng = np.random.default_rng(2)

    def request(layer: int, experts: dict[int, list[int]], rows: int = 4, hidden: int = 64,
                dtype: Any = np.float32, model: str | None = None) -> ExpertRequest:
        x = rng.standard_normal((rows, hidden)).astype(dtype)
        return ExpertRequest(os.urandom(16), model or manifest.model_id, layer, int(rng.integers(1 << 40)), x,
                             tuple(ExpertRows(e, np.array(r, np.uint32)) for e, r in experts.items()))

    async def main() -> None:
        keep = lambda L, e: e <= 3  # noqa: E731
        node = ExpertServer(load_weights(folder, keep_expert=keep), Identity.generate(), config)
        bridge = OnnxExpertServer(OnnxShards(tmp_path / "s"), Identity.generate(), config)
        await node.start()
        await bridge.start()
        try:
            requests = [request(0, {1: [0, 2], 3: [1, 2, 3]}), request(1, {0: [0, 1, 2, 3]}),
                        request(1, {2: [0]}, rows=1, dtype=np.float16)]
            answers = await asyncio.gather(*(s.handle(client.peer_id, r) for r in requests for s in (node, bridge)))
            for i, r in enumerate(requests):
                want, got = answers[2 * i], answers[2 * i + 1]
                check_response(r, got, client=client.peer_id, server=bridge.identity.peer_id)
                assert got.outputs.dtype == r.hidden.dtype and got.outputs.shape == want.outputs.shape
                tol = 1e-5 if r.hidden.dtype == np.float32 else 1e-2
                assert np.abs(got.outputs.astype(np.float32) - want.outputs.astype(np.float32)).max() <= tol
                assert got.receipt.expert_flops == want.receipt.expert_flops
            for bad, code in [(request(0, {5: [0, 1, 2, 3]}), ErrorCode.UNKNOWN_EXPERT),
                              (request(0, {1: [0, 1, 2, 3]}, model="other-model"), ErrorCode.UNKNOWN_EXPERT),
                              (request(0, {1: [0, 1, 2, 3]}, hidden=32), ErrorCode.BAD_TENSOR)]:
                for server in (node, bridge):
                    with pytest.raises(ProtocolError) as e:
                        await server.handle(client.peer_id, bad)
                    assert e.value.code == code
        finally:
            await bridge.aclose()
            await node.aclose()

    asyncio.run(main())
