"""``moeswarm plan`` against an independent count: transformers 5.24 builds each model on the meta
device (no memory) from the same config.json, and its parameters are counted tensor by tensor."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from transformers import AutoConfig, AutoModelForCausalLM

from moeswarm.model.plan import GGML_BLOCKS, model_size

CONFIGS = Path(__file__).resolve().parents[1] / "moeswarm" / "model" / "configs"
SHIPPED = ("minimax-m3", "deepseek-v3.2", "kimi-k2.5", "glm-4.5", "qwen3-next-80b-a3b")


def plan_json(path: Path, *args: str) -> dict:  # type: ignore[type-arg]
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", str(path), "--json", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def transformers_count(raw: dict) -> dict[str, int]:  # type: ignore[type-arg]
    """Total parameters of the text model transformers builds from ``raw``, one routed expert's
    parameters and matrices, and how many MoE layers hold how many experts."""
    config = AutoConfig.for_model(**raw).get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    moe = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    e = moe[0]
    experts = e.gate_up_proj.shape[0]
    per_expert = sum(p.numel() for p in e.parameters()) // experts
    I2, H = e.gate_up_proj.shape[1:]
    return {"total": total, "moe_layers": len(moe), "experts": experts, "per_expert": per_expert,
            "gate_up": (I2, H), "down": tuple(e.down_proj.shape[1:])}


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_of_a_shipped_config_matches_transformers_count(name: str) -> None:
    path = CONFIGS / f"{name}.json"
    raw = json.loads(path.read_text())
    want = transformers_count(raw)
    got = plan_json(path)
    top_k = AutoConfig.for_model(**raw).get_text_config().num_experts_per_tok
    assert got["total_params"] == want["total"]
    assert got["moe_layers"] == want["moe_layers"] and got["experts_per_layer"] == want["experts"]
    assert got["routed_experts"] == want["moe_layers"] * want["experts"]
    assert got["active_experts_per_token"] == want["moe_layers"] * top_k
    assert got["expert_params"] == want["per_expert"]
    assert got["active_params"] == want["total"] - want["moe_layers"] * (want["experts"] - top_k) * want["per_expert"]
    # bytes per expert by each format's layout: FP8 one float32 scale per 128x128 block, MXFP4 one
    # byte per 32, INT4 a bf16 per 32, GGML types by gguf's own block table
    I, H = want["gate_up"][0] // 2, want["gate_up"][1]
    mats = [(I, H), (I, H), want["down"]]
    assert got["expert_bytes_by_format"]["BF16"] == 2 * want["per_expert"]
    assert got["expert_bytes_by_format"]["FP8"] == sum(r * c + math.ceil(r / 128) * math.ceil(c / 128) * 4 for r, c in mats)
    assert got["expert_bytes_by_format"]["MXFP4"] == sum(r * c // 2 + r * c // 32 for r, c in mats)
    assert got["expert_bytes_by_format"]["INT4"] == sum(r * c // 2 + r * c // 32 * 2 for r, c in mats)
    for t in GGML_BLOCKS:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t]]
        assert got["expert_bytes_by_format"][t] == sum(r * c // block * size for r, c in mats), t
    # the working set: the backbone plus every MoE layer's top-k experts, in the stored format
    fmt = got["format"]
    assert got["working_set_bytes"] == got["backbone_bytes"] + got["active_experts_per_token"] * got["expert_bytes_by_format"][fmt]


def test_minimax_m3_has_the_seed_figures() -> None:
    """The seed's table: 60 layers (3 dense, 57 MoE), 128 experts top-4; 7,296 experts of which 228
    per token; ~428B total (ours: 426.0B: the vision tower and any MTP layer are not counted) and
    ~23B active (ours: 23.3B without the embedding lookup and LM head)."""
    got = plan_json(CONFIGS / "minimax-m3.json")
    assert (got["layers"], got["moe_layers"], got["experts_per_layer"], got["top_k"]) == (60, 57, 128, 4)
    assert (got["routed_experts"], got["active_experts_per_token"]) == (7296, 228)
    assert got["stored_format"] == "FP8"


def test_plan_reads_config_json_of_model_types_the_engine_does_not_run(tmp_path: Path) -> None:
    """transformers' own default configs of families the engine has no parser for."""
    for model_type in ("glm_moe_dsa", "qwen3_5_moe", "minimax_m2"):
        raw = AutoConfig.for_model(model_type).to_dict()
        path = tmp_path / model_type
        path.mkdir()
        (path / "config.json").write_text(json.dumps(raw))
        want = transformers_count(raw)
        got = plan_json(path)  # a folder: only its config.json is read
        assert got["total_params"] == want["total"], model_type
        assert got["expert_params"] == want["per_expert"], model_type
        assert got["routed_experts"] == want["moe_layers"] * want["experts"], model_type


def test_swarm_and_budget_figures_and_a_clear_error(tmp_path: Path) -> None:
    path = CONFIGS / "deepseek-v3.2.json"
    size = model_size(json.loads(path.read_text()))
    got = plan_json(path, "--swarm", "64", "--memory-budget", "256GiB", "--format", "Q4_K")
    one = got["expert_bytes_by_format"]["Q4_K"]
    assert got["experts_per_node"] == math.ceil(size.routed_experts / 64) and got["bytes_per_node"] == \
        got["experts_per_node"] * one
    assert got["resident_experts_one_machine"] == (256 * 2**30 - got["backbone_bytes"]) // one
    assert got["machines_for_all_experts"] == math.ceil(size.routed_experts * one / (256 * 2**30))
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "deepseek-v3.2", "--swarm", "64"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "14,848 in the model, 464 active per token" in text and "swarm of 64" in text
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "hidden_size": 8}))
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "lacks 'num_hidden_layers'" in done.stderr
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "no-such-model"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and all(n in done.stderr for n in ("deepseek-v3.2", "glm-4.5", "kimi-k2.5", "minimax-m3"))


def test_glm_4_5_prints_its_model_card_beside_the_count(tmp_path: Path) -> None:
    """zai-org/GLM-4.5's card: 355B total, 32B active.  plan counts 352.8B (without the ~4B
    multi-token-prediction layer) and 32.1B active without the embedding lookup and LM head."""
    got = plan_json(CONFIGS / "glm-4.5.json")
    assert (got["layers"], got["moe_layers"], got["experts_per_layer"], got["top_k"]) == (92, 89, 160, 8)
    assert "model_card" not in got  # a file path is not a shipped name: no card
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "glm-4.5"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "352.8B total, 33.6B active per token (32.1B without embeddings and LM head)" in text
    assert "model card      355B total, 32B active (zai-org/GLM-4.5)" in text
    # GLM-4.5-Air's shape (no QK norm, one dense layer) and GLM-4.7-Flash's (MLA, mlp_layer_types),
    # as transformers' config classes default them, against transformers' own count
    for model_type in ("glm4_moe", "glm4_moe_lite"):
        raw = AutoConfig.for_model(model_type).to_dict()
        path = tmp_path / model_type
        path.mkdir()
        (path / "config.json").write_text(json.dumps(raw))
        want, got = transformers_count(raw), plan_json(path)
        assert got["total_params"] == want["total"], model_type
        assert got["routed_experts"] == want["moe_layers"] * want["experts"], model_type


def test_qwen3_next_prints_its_model_card_beside_the_count() -> None:
    """Qwen/Qwen3-Next-80B-A3B-Instruct's card: 80B total, 3B active.  plan counts 79.7B (without
    the multi-token-prediction layer) and 3.3B active without the embedding lookup and LM head;
    36 of the 48 layers are gated DeltaNet (``full_attention_interval`` 4)."""
    got = plan_json(CONFIGS / "qwen3-next-80b-a3b.json")
    assert (got["layers"], got["moe_layers"], got["experts_per_layer"], got["top_k"]) == (48, 48, 512, 10)
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "qwen3-next-80b-a3b"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "79.7B total, 3.9B active per token (3.3B without embeddings and LM head)" in text
    assert "model card      80B total, 3B active (Qwen/Qwen3-Next-80B-A3B-Instruct)" in text
