"""DeepSeek-V4 (``deepseek_v4``) in ``moeswarm plan``: plan counts it against transformers 5.24 building ``DeepseekV4ForCausalLM`` on the meta device from the same
config: the shipped V4-Flash config (transformers' ``DeepseekV4Config`` defaults, whose docstring
names deepseek-ai/DeepSeek-V4-Flash-Base), the legacy spelling older checkpoints ship
(``compress_ratios``, ``num_hash_layers``), and a small config with sliding-only layers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from moeswarm.model import ModelConfig
from moeswarm.model.plan import model_size

CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"
FLASH = CONFIGS / "deepseek-v4-flash.json"
PRO = CONFIGS / "deepseek-v4-pro.json"


def _transformers(raw: dict[str, Any]) -> tuple[int, int, int]:
    """(parameters, MoE layers, parameters of one routed expert) of the model transformers builds."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"}))
    experts = model.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // experts.num_experts
    return sum(p.numel() for p in model.parameters()), len(model.model.layers), per_expert


def _small(**changes: Any) -> dict[str, Any]:
    raw = dict(model_type="deepseek_v4", vocab_size=512, hidden_size=64, moe_intermediate_size=32,
               num_hidden_layers=5, num_attention_heads=4, head_dim=32, q_lora_rank=16, n_routed_experts=8,
               num_experts_per_tok=2, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16, hc_mult=3,
               layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                            "sliding_attention", "compressed_sparse_attention"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
    return {**raw, **changes}


@pytest.mark.parametrize("name", ["flash", "pro", "legacy-spelling", "small-with-sliding-layers"])
def test_plan_counts_the_parameters_transformers_builds(name: str) -> None:
    if name in ("flash", "pro"):
        raw = json.loads({"flash": FLASH, "pro": PRO}[name].read_text())
    elif name == "legacy-spelling":
        raw = _small(layer_types=None, compress_rates=None, compress_ratios=[0, 128, 4, 4, 128], num_hash_layers=2)
    else:
        raw = _small()
    total, layers, per_expert = _transformers(raw)
    size = model_size(raw)
    assert (size.total, size.moe_layers, size.expert_params) == (total, layers, per_expert)


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """deepseek-ai/DeepSeek-V4-Flash's card: 284B total, 13B active.  plan counts 284.3B (without the
    multi-token-prediction layer) and 12.7B active without the embedding lookup and LM head."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "deepseek-v4-flash"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "deepseek_v4: 43 layers (0 dense, 43 MoE), 256 experts per MoE layer, top-6" in text
    assert "284.3B total, 13.8B active per token (12.7B without embeddings and LM head)" in text
    assert "model card      284B total, 13B active (deepseek-ai/DeepSeek-V4-Flash)" in text


def test_plan_prints_v4_pro_beside_its_card() -> None:
    """deepseek-ai/DeepSeek-V4-Pro's card: 1.6T total, 49B active.  plan counts 1,573.0B without the
    multi-token-prediction layer, 49.8B active (47.9B without the embedding lookup and LM head)."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "deepseek-v4-pro"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "deepseek_v4: 61 layers (0 dense, 61 MoE), 384 experts per MoE layer, top-6" in text
    assert "1,573.0B total, 49.8B active per token (47.9B without embeddings and LM head)" in text
    assert "model card      1.6T total, 49B active (deepseek-ai/DeepSeek-V4-Pro)" in text


def test_the_shipped_config_parses_at_full_scale() -> None:
    """V4-Flash as the engine reads it: 43 layers (2 HCA, then CSA / HCA alternating), the first 3
    hash-routed, 256 experts top-6, 4 residual streams, 64-dim RoPE tail of 512-dim heads."""
    cfg = ModelConfig.from_hf(json.loads(FLASH.read_text()))
    s = cfg.family
    assert (cfg.arch, cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.num_kv_heads) == ("deepseek_v4", 43, 256, 6, 1)
    assert s.layer_kinds[:4] == ("hca", "hca", "hca", "csa") and set(s.layer_kinds) == {"hca", "csa"}
    assert s.hash_layers == (True,) * 3 + (False,) * 40 and (s.csa_rate, s.hca_rate) == (4, 128)
    assert (s.hc_mult, s.hc_sinkhorn_iters, s.rope_dim, s.o_groups, s.index_topk) == (4, 20, 64, 8, 512)
    assert (s.main_rope.kind, s.main_rope.theta, s.compress_rope.kind, s.compress_rope.theta) == (
        "default", 10000.0, "default", 160000.0)
    assert cfg.router == "sqrtsoftplus" and cfg.residual_form == "hyper" and cfg.expert_activation == "limited_swiglu"
    pro = ModelConfig.from_hf(json.loads(PRO.read_text()))
    p = pro.family
    assert (pro.num_layers, pro.num_heads, pro.num_experts, pro.hidden_size, pro.q_lora_rank) == (61, 128, 384, 7168, 1536)
    assert (p.o_groups, p.index_topk, pro.routed_scaling_factor, p.layer_kinds[:3]) == (16, 1024, 2.5, ("hca",) * 3)
    assert (p.compress_rope.kind, p.compress_rope.factor, p.compress_rope.original_max_position) == ("yarn", 16.0, 65536)
    assert p.compress_rope.attention_factor == 1.0 and p.main_rope.kind == "default"
