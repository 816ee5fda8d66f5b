"""Q8_0 experts on the data plane: two ``moeswarm node`` processes serve a Q8_0 GGUF (each expert
dequantised from the map when it is called), are found through the libp2p DHT and called over TLS by
a backbone in this process.  The oracle is the engine run in one process on the same GGUF."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moeswarm.daemon import SwarmConfig
from moeswarm.demo.swarm import Daemon, local_swarm
from moeswarm.errors import ProtocolError, Unreachable
from moeswarm.model import (
    Model,
    SamplingParams,
    expert_ffn,
    generate,
    load_config,
    load_model,
    load_weights,
)
from moeswarm.model.gguf import QuantizedTensor, convert_to_gguf
from moeswarm.model.model_id import model_id_for
from moeswarm.net.client import ExpertClient
from moeswarm.node.backbone import SwarmBackbone
from moeswarm.node.config import BackboneConfig
from moeswarm.protocol import (
    ErrorCode,
    ExpertRequest,
    ExpertRows,
    Identity,
    peer_id_from_str,
)

from gguf_reference import LOGIT_TOL

ARCH = "mixtral"  # 2 MoE layers of 8 experts: the nodes hold 0-3 and 4-7
N_RANDOM_PROMPTS = 15  # plus the oracle prompt: the prompt set of test_gguf_numerics
N_NEW = 8


def test_the_model_id_names_how_the_experts_are_encoded(oracle_checkpoints, gguf_checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from test_gguf_mmap import write_sparse_gguf

    folder, _ = oracle_checkpoints.get(ARCH, "per_expert")
    cfg = load_config(folder)
    base = model_id_for(str(folder), cfg)  # safetensors: arch + hash of config.json, as before
    q8 = model_id_for(str(gguf_checkpoints.get(ARCH, "F16", "Q8_0")), cfg)
    assert q8 == f"{base}-q8_0"
    assert model_id_for(str(gguf_checkpoints.get(ARCH, "F16")), cfg) == f"{base}-f16"
    # experts encoded alike compute alike, whatever the backbone tensors are
    assert model_id_for(str(gguf_checkpoints.get(ARCH, "Q8_0")), cfg) == q8
    # the converter's sidecar config.json does not make the GGUF folder pass for the safetensors one
    convert_to_gguf(folder, tmp_path / "sidecar" / "m.gguf", weight_type="F16", experts_type="Q8_0")
    assert (tmp_path / "sidecar" / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    assert model_id_for(str(tmp_path / "sidecar"), load_config(tmp_path / "sidecar")) == q8
    # a type per layer (llama.cpp's K-quant mixes): named by a hash of which tensor has which type
    write_sparse_gguf(tmp_path / "mixed.gguf", hidden=64, inter=128, layers=2, experts=4)
    mixed = load_config(tmp_path / "mixed.gguf")
    assert re.fullmatch(r"mixtral-[0-9a-f]{12}-mixed-[0-9a-f]{8}", model_id_for(str(tmp_path / "mixed.gguf"), mixed))


@pytest.fixture(scope="module")
def q8_swarm(gguf_checkpoints) -> Iterator[tuple[Path, list[Daemon]]]:  # type: ignore[no-untyped-def]
    path = gguf_checkpoints.get(ARCH, "F16", "Q8_0")  # F16 backbone tensors, Q8_0 experts
    experts = load_config(path).num_experts
    with local_swarm(str(path), 2, experts_per_layer=experts) as daemons:  # READY-gated, stopped on exit
        yield path, daemons


def backbone(model: Path, boot: str, model_id: str | None = None, timeout_s: float = 60) -> SwarmBackbone:
    return SwarmBackbone(BackboneConfig(SwarmConfig(str(model), bootstrap=(boot,), client_mode=True,
                                                    model_id=model_id), coverage_timeout_s=timeout_s))


def run_logits(model: Model, prompt: list[int], decode: list[int]) -> np.ndarray:
    """Prefill, then one forward per decode token -> (T + len(decode), V)."""
    cache = model.new_cache()
    out = [model.forward(np.asarray([prompt]), cache)[0]]
    out += [model.forward(np.asarray([[t]]), cache)[0] for t in decode]
    return np.concatenate(out)


def greedy(model: Model, prompts: list[list[int]]) -> list[list[int]]:
    return [list(generate(model, p, SamplingParams(max_new_tokens=N_NEW))) for p in prompts]


def prompt_set(prompt: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [list(prompt)] + [rng.integers(3, 512, len(prompt)).tolist() for _ in range(N_RANDOM_PROMPTS)]


def teacher_forced_argmax(model: Model, prompts: list[list[int]], continuations: list[list[int]]) -> np.ndarray:
    """Argmax at each of the N_NEW positions when reading ``prompt + continuation[:-1]`` -> (prompts, N_NEW)."""
    return np.stack([model.forward(np.asarray([p + c[:-1]]), model.new_cache())[0, len(p) - 1 :].argmax(-1)
                     for p, c in zip(prompts, continuations)])


@pytest.mark.slow
def test_q8_0_nodes_compute_what_the_engine_computes_on_the_gguf(oracle_checkpoints, q8_swarm) -> None:  # type: ignore[no-untyped-def]
    folder, ref = oracle_checkpoints.get(ARCH, "per_expert")
    path, daemons = q8_swarm
    # The engine on the same GGUF in one process, one kernel call per expert as the nodes compute them; its
    # default, a layer's experts in one QMoE call, rounds activations to int8 in its own order (checked below).
    local = load_model(path, backend="grouped")
    assert isinstance(local.weights.experts[0][0].gate, QuantizedTensor)
    model_id = model_id_for(str(path), local.config)
    assert model_id.endswith("-q8_0") and model_id != model_id_for(str(folder), load_config(folder))
    assert {d.info["model_id"] for d in daemons} == {model_id}  # derived by the nodes, not forced
    prompts = prompt_set(ref.prompt_ids)
    fp32 = load_model(folder)  # the safetensors checkpoint: only reported against
    fp32_tokens = greedy(fp32, prompts)

    async def main() -> tuple[np.ndarray, list[list[int]], np.ndarray, set[bytes]]:
        async with backbone(path, daemons[0].info["multiaddrs"][0]) as bb:  # the same GGUF: the same id
            assert bb.model is not None and bb.executor is not None and bb.model_id == model_id
            logits = await asyncio.to_thread(run_logits, bb.model, ref.prompt_ids, ref.decode_tokens)
            tokens = await asyncio.to_thread(greedy, bb.model, prompts)
            forced = await asyncio.to_thread(teacher_forced_argmax, bb.model, prompts, fp32_tokens)
            return logits, tokens, forced, set(bb.executor.served_by)

    logits, tokens, forced, used = asyncio.run(main())
    assert np.abs(logits - run_logits(local, ref.prompt_ids, ref.decode_tokens)).max() <= 1e-4
    layer_calls = run_logits(load_model(path), ref.prompt_ids, ref.decode_tokens)
    assert np.abs(logits - layer_calls).max() <= LOGIT_TOL * np.abs(logits).max()  # int8 activations' bound
    assert tokens == greedy(local, prompts)
    assert used == {peer_id_from_str(d.info["peer_id"]) for d in daemons}

    # Reported, not asserted (test_gguf_numerics bounds Q8_0 against fp32 in one process).
    fp32_forced = teacher_forced_argmax(fp32, prompts, fp32_tokens)
    wrong = int((forced != fp32_forced).sum())
    identical = sum(a == b for a, b in zip(tokens, fp32_tokens))
    print(f"{ARCH} Q8_0 swarm vs safetensors fp32: teacher-forced greedy mismatches {wrong}/{forced.size}; "
          f"identical free-running sequences {identical}/{len(prompts)}")


@pytest.mark.slow
def test_a_safetensors_backbone_uses_q8_0_nodes_only_when_told(oracle_checkpoints, q8_swarm) -> None:  # type: ignore[no-untyped-def]
    folder, ref = oracle_checkpoints.get(ARCH, "per_expert")
    path, daemons = q8_swarm
    boot = daemons[0].info["multiaddrs"][0]
    q8_id = daemons[0].info["model_id"]

    async def without_override() -> None:
        async with backbone(folder, boot, timeout_s=2):  # its own id: no holder announced under it
            pass

    with pytest.raises(Unreachable, match="have no holder"):
        asyncio.run(without_override())

    async def forced() -> np.ndarray:
        async with backbone(folder, boot, model_id=q8_id) as bb:
            assert bb.model is not None
            return await asyncio.to_thread(run_logits, bb.model, ref.prompt_ids, ref.decode_tokens)

    mixed = load_weights(folder)  # fp32 backbone tensors, experts from the Q8_0 GGUF
    expected = run_logits(Model(replace(mixed, experts=load_weights(path).experts)), ref.prompt_ids, ref.decode_tokens)
    assert np.abs(asyncio.run(forced()) - expected).max() <= 1e-4


@pytest.mark.slow
def test_nan_hidden_gets_non_finite_and_the_q8_0_node_keeps_serving(q8_swarm) -> None:  # type: ignore[no-untyped-def]
    path, daemons = q8_swarm
    node = daemons[1]  # experts 4-7
    weights = load_weights(path, keep_expert=lambda L, e: (L, e) == (1, 5))
    hidden = np.random.default_rng(1).standard_normal((3, weights.config.hidden_size)).astype(np.float32)

    def request(x: np.ndarray) -> ExpertRequest:
        return ExpertRequest(request_id=np.random.bytes(16), model_id=node.info["model_id"], layer=1, seq=1,
                             hidden=x, experts=(ExpertRows(5, np.arange(3, dtype=np.uint32)),))

    async def main() -> np.ndarray:
        client = await ExpertClient.connect(node.info["endpoint"], Identity.generate(),
                                            expected_peer=peer_id_from_str(node.info["peer_id"]))
        try:
            poisoned = hidden.copy()
            poisoned[1, 7] = np.nan
            with pytest.raises(ProtocolError) as info:
                await client.call(request(poisoned), timeout=10)
            assert info.value.code == ErrorCode.NON_FINITE and "server error" in str(info.value)  # the node's answer
            response = await client.call(request(hidden), timeout=10)  # the same connection still serves
            return response.outputs
        finally:
            await client.aclose()

    outputs = asyncio.run(main())
    expert = weights.experts[1][5]
    assert isinstance(expert.gate, QuantizedTensor)
    dequantised = replace(expert, **{k: getattr(expert, k).astype(np.float32) for k in ("gate", "up", "down")})
    expected = expert_ffn(dequantised, hidden, weights.config)
    # The node computes on the repacked Q8_0 kernel, whose activations are int8 (as llama.cpp's): within the
    # 2 % that tests/gguf/test_qkernels.py bounds for one fused expert, far below a wrong answer's error.
    assert np.abs(outputs - expected).max() <= 2e-2 * np.abs(expected).max()
