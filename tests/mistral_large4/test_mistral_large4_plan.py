"""Mistral Large 4 (``mistral_large4``, text model ``mistral_large4_text``): ``moeswarm plan`` counts it
and the engine reads its published config (it runs it: ``test_mistral_large4_oracle.py``).  plan's count of the text model equals the
parameters transformers 5.24 builds for it (the vision tower and projector left out), on the shipped
config (transformers' defaults, named after mistralai/Mistral-Large-4-1T-A52B) and on a small one
with every per-layer variant: NoPE layers, layers reading an earlier layer's latent cache, indexer
layers that reuse the previous top-k, a dense first layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import MistralLarge4Config, MistralLarge4ForConditionalGeneration

from moeswarm.model import ModelConfig
from moeswarm.model.plan import model_size

CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"
SMALL: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16,
    no_rope_layers=[1, 1, 0, 1, 0, 1], kv_source_layers=[0, 1, 1, 3, 4, 4],
    indexer_types=["full", "shared", "full", "full", "shared", "full"],
)


def _text_parameters(raw: dict[str, Any]) -> int:
    with torch.device("meta"):
        model = MistralLarge4ForConditionalGeneration(MistralLarge4Config(**{k: v for k, v in raw.items()
                                                                              if k != "model_type"}))
    return sum(p.numel() for name, p in model.named_parameters()
               if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")))


@pytest.mark.parametrize("name", ["small", "mistral-large-4"])
def test_plan_counts_the_text_model_transformers_builds(name: str) -> None:
    if name == "small":
        raw = {"model_type": "mistral_large4", "text_config": {"model_type": "mistral_large4_text", **SMALL}}
    else:
        raw = json.loads((CONFIGS / f"{name}.json").read_text())
    size = model_size(raw)
    assert size.total == _text_parameters(raw)
    assert size.moe_layers == int(raw["text_config"]["num_hidden_layers"]) - 1


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """mistralai/Mistral-Large-4-1T-A52B: 1T total, 52B active (the name says so)."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "mistral-large-4"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "mistral_large4 (text model: mistral_large4_text): 72 layers (1 dense, 71 MoE), 128 experts" in text
    assert "1,050.1B total, 53.1B active per token (50.6B without embeddings and LM head)" in text
    assert "model card      1T total, 52B active (mistralai/Mistral-Large-4-1T-A52B)" in text


def test_the_engine_reads_the_published_config() -> None:
    """The shipped config.json (the multimodal one) read through its text_config, with transformers'
    defaults for what it leaves out."""
    raw = json.loads((CONFIGS / "mistral-large-4.json").read_text())
    c = ModelConfig.from_hf(raw)
    text = raw["text_config"]
    assert (c.arch, c.attention, c.num_layers, c.q_lora_rank, c.kv_lora_rank) == ("mistral_large4", "mistral_large4",
                                                                                  72, None, 512)
    assert c.family.rope_layers == tuple(bool(f) for f in text["no_rope_layers"]) and not c.family.rope_layers[3]
    assert c.family.kv_source == tuple(range(72)) and c.dsa is not None and not any(c.dsa.shared)
    assert (c.dsa.topk, c.dsa.n_heads, c.dsa.head_dim) == (2048, 32, 128)
    assert (c.router, c.norm_topk_prob, c.num_experts, c.top_k) == ("softmax_group", True, 128, 4)
    assert c.moe_layers == (False,) + (True,) * 71 and c.final_logit_softcapping == 30.0
    assert (c.rope.kind, c.rope.factor, c.rope.attention_factor, c.scale) == ("yarn", 2048.0, 1.0, 128**-0.5)
