"""FP8 experts in a swarm: node processes serve a block-scaled FP8 checkpoint (as DeepSeek-V3 and
MiniMax M2 publish them) keeping its stored bytes (their resident sets show it), and a backbone
that fetches experts receives exactly those bytes (every fetched expert passes the publisher's
digest, which is over the stored codes and scales).  The oracle is the engine run in one process
on the same checkpoint (tests/test_quantized_formats.py checks that one against transformers)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeswarm.model import SamplingParams, generate, load_model, load_weights
from moeswarm.model._stored import StoredTensor
from moeswarm.model.synthetic import random_mixtral
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.fetch import DIGESTS_FILE

import quantized_checkpoints as qc
from moeswarm.demo.swarm import expert_nodes
from test_node_swarm import backbone_config, run_logits

pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def backbone_only_copy(folder: Path, dest: Path) -> Path:
    """The checkpoint without any routed expert (nor their scales): what a backbone of a real swarm holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for f in folder.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v for k, v in load_file(str(f)).items() if ".experts." not in k}, str(dest / f.name))
        elif f.is_file() and not f.name.endswith(".index.json"):
            shutil.copy(f, dest / f.name)
    return dest


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("fp8swarm")
    src = random_mixtral(root / "f32", hidden=512, inter=2048, layers=2, experts=16, vocab=1024, heads=8, kv_heads=2)
    return qc.write_fp8(src, root / "fp8", block=(128, 128))


def test_fp8_nodes_keep_the_stored_bytes_and_a_fetching_backbone_gets_them(fp8_model: Path, tmp_path: Path,
                                                                          monkeypatch) -> None:  # type: ignore[no-untyped-def]
    weights = load_weights(fp8_model)
    cfg = weights.config
    one = weights.experts[0][0]
    assert isinstance(one.gate, StoredTensor) and one.gate.fmt.method == "fp8_block"
    stored_total = sum(w.nbytes for layer in weights.experts.values() for w in layer.values())
    float_total = 4 * cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    model = load_model(fp8_model)
    params = SamplingParams(max_new_tokens=12)
    expected_tokens = list(generate(model, PROMPT, params))
    expected = run_logits(model, PROMPT, expected_tokens[:-1])
    own = backbone_only_copy(fp8_model, tmp_path / "backbone")
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "expert-digests", "--model", str(fp8_model),
                           "--out", str(own / DIGESTS_FILE), "-q"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # glibc raises its mmap threshold after the first large free, and then keeps freed arrays in
    # its heap: a fixed threshold makes the nodes' RSS track the memory they really hold
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    budget = 384 << 20  # f32 conversions kept between calls: budget / 8 = 48 MiB per node

    with expert_nodes(str(fp8_model), ["0-7", "8-15"], extra_args=lambda i: ["--memory-budget", "384MiB"]) as daemons:
        ready = [_status(d.process.pid) for d in daemons]

        async def called() -> tuple[np.ndarray, list[int]]:
            async with SwarmBackbone(backbone_config(fp8_model, daemons[0].info["multiaddrs"][0])) as bb:
                logits = await asyncio.to_thread(run_logits, bb.model, PROMPT, expected_tokens[:-1])
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, PROMPT, params)))  # type: ignore[arg-type]
                return logits, tokens

        logits, tokens = asyncio.run(called())
        served = [_status(d.process.pid) for d in daemons]

        async def fetched() -> tuple[list[int], dict, list]:  # type: ignore[type-arg]
            config = backbone_config(own, daemons[0].info["multiaddrs"][0], tiers="fetch",
                                     fetch_cache_bytes=4 * one.nbytes)
            async with SwarmBackbone(config) as bb:
                tokens = await asyncio.to_thread(lambda: list(generate(bb.model, PROMPT, params)))  # type: ignore[arg-type]
                assert bb.tiers is not None and bb.executor is not None
                kept = [bb.tiers.fetched.get(k) for k in bb.tiers.fetched.keys()]
                return tokens, {"fetched_bytes": bb.tiers.fetched.fetched_bytes, "verified": bb.tiers.fetch_verified,
                                "rejected": bb.tiers.fetch_rejected, "calls": bb.executor.calls}, kept

        fetched_tokens, stats, kept = asyncio.run(fetched())

    # the swarm computes what one process computes on the FP8 checkpoint
    assert np.abs(logits - expected).max() <= 1e-5
    assert tokens == expected_tokens
    # each node touched all its experts; its memory grew by about their stored bytes (file pages)
    # plus the bounded float32 conversions, far below a float32 copy of its experts
    per_node_stored, per_node_float = stored_total / 2, float_total / 2
    for before, after in zip(ready, served):
        grown = after["VmRSS"] - before["VmRSS"]
        print(f"node RSS grew {grown / 2**20:.0f} MiB (file {after['RssFile'] / 2**20:.0f} MiB); its experts: "
              f"{per_node_stored / 2**20:.0f} MiB stored, {per_node_float / 2**20:.0f} MiB as float32; anon +{(after['RssAnon'] - before['RssAnon']) / 2**20:.1f} MiB")
        one_float = 4 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        assert after["RssFile"] - before["RssFile"] <= per_node_stored + (4 << 20)  # its experts' pages, as stored
        # anonymous memory: the float32 cache (budget / 8), one conversion in flight, buffers
        assert after["RssAnon"] - before["RssAnon"] <= budget // 8 + one_float + (16 << 20)
        assert grown < 0.75 * per_node_float
    # the fetching backbone computed every expert from fetched stored bytes, each checked
    assert fetched_tokens == expected_tokens and stats["calls"] == 0
    assert stats["verified"] >= 4 and stats["rejected"] == 0, stats
    assert stats["fetched_bytes"] == stats["verified"] * one.nbytes  # stored size, not a float copy
    assert kept and all(isinstance(w.gate, StoredTensor) and w.nbytes == one.nbytes for w in kept)
