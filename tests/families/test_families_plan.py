"""``moeswarm plan`` on the published configs of dots.llm1 (``dots1``), ERNIE 4.5 21B-A3B
(``ernie4_5_moe``), Hunyuan-A13B (``hunyuan_v1_moe``) and GLM-4.7-Flash (``glm4_moe_lite``), shipped in
moeswarm/model/configs/ (docs/families.md says where each came from): plan's total equals the
parameters transformers 5.24 builds from the same file on the meta device (and its active count,
those less the routed experts a token does not use), the engine reads the file,
and ``moeswarm plan --model NAME`` prints the model card's figures beside its own count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from moeswarm.cli import main
from moeswarm.model import ModelConfig
from moeswarm.model.plan import model_size

CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"

# shipped name -> (the engine's arch, MoE layers, the header, the count and the card's line plan prints)
PUBLISHED = {
    "dots-llm1": ("dots1", 61, "dots1: 62 layers (1 dense, 61 MoE), 128 experts per MoE layer, top-6",
                  "142.8B total, 14.0B active per token (12.8B without embeddings and LM head)",
                  "model card      142B total, 14B active (rednote-hilab/dots.llm1.inst)"),
    "ernie-4.5-21b-a3b": ("ernie4_5_moe", 27, "ernie4_5_moe: 28 layers (1 dense, 27 MoE), 64 experts per MoE layer, top-6",
                          "21.8B total, 3.4B active per token (3.1B without embeddings and LM head)",
                          "model card      21B total, 3B active (baidu/ERNIE-4.5-21B-A3B-PT)"),
    "hunyuan-a13b": ("hunyuan_v1_moe", 32, "hunyuan_v1_moe: 32 layers (0 dense, 32 MoE), 64 experts per MoE layer, top-8",
                     "80.4B total, 12.7B active per token (12.2B without embeddings and LM head)",
                     "model card      80B total, 13B active (tencent/Hunyuan-A13B-Instruct)"),
    "glm-4.7-flash": ("glm4_moe_lite", 46, "glm4_moe_lite: 47 layers (1 dense, 46 MoE), 64 experts per MoE layer, top-4",
                      "29.9B total, 3.9B active per token (3.3B without embeddings and LM head)",
                      "model card      30B total, 3B active (zai-org/GLM-4.7-Flash)"),
}


def _transformers_parameters(raw: dict) -> tuple[int, int]:  # type: ignore[type-arg]
    """(total, active per token) of the model transformers builds from ``raw``: active is the total
    less the routed experts a token does not use (each MoE layer's experts but its top-k)."""
    config = CONFIG_MAPPING[raw["model_type"]](**{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied LM head once
    top_k = config.num_experts_per_tok
    top_k = top_k[0] if isinstance(top_k, list) else top_k  # Hunyuan's per-layer list
    idle = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            count = experts.gate_up_proj.shape[0]
            idle += (count - top_k) * sum(p.numel() for p in experts.parameters()) // count
    return total, total - idle


@pytest.mark.parametrize("name", PUBLISHED)
def test_plan_counts_what_transformers_builds_and_prints_the_card(name: str) -> None:
    arch, moe_layers, header, count, card = PUBLISHED[name]
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    size = model_size(raw)
    assert (size.total, size.active) == _transformers_parameters(raw)
    assert size.moe_layers == moe_layers
    engine = ModelConfig.from_hf(raw)
    assert engine.arch == arch and sum(engine.moe_layers) == moe_layers
    result = CliRunner().invoke(main, ["plan", "--model", name])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == header and count in lines[1] and lines[2] == f"  {card}"
