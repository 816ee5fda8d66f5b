"""Mistral Small 4 (``mistral4``) against transformers 5.24: a 16-token prefill (whole, and in chunks of 5
over the cache), 8 decode steps on the cache, greedy tokens; negative controls (each mechanism switched
off moves the logits by far more than the tolerance); config errors; ``moeswarm plan`` on the shipped
published config beside the model card."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from engine_support import assert_matches_transformers, copy_with_config, moved
from engine_support import variant as _variant
from transformers import Mistral4Config, Mistral4ForCausalLM

from moeswarm.errors import CheckpointError
from moeswarm.model import ModelConfig, load_model
from moeswarm.model._config_mistral4 import ARCHITECTURES
from moeswarm.model.plan import model_size

TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance
CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"


def test_the_family_is_registered() -> None:
    assert ARCHITECTURES == ("mistral4",)


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
def test_logits_and_greedy_tokens_match_transformers(mistral4_checkpoint, chunk: int | None) -> None:
    folder, ref = mistral4_checkpoint.get()
    model = load_model(folder, backend="eager")
    assert model.config.arch == "mistral4"
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_configuration_has_every_mechanism_on(mistral4_checkpoint) -> None:
    c = load_model(mistral4_checkpoint.get()[0]).config
    assert c.attention == "mla" and c.q_lora_rank == 32 and c.kv_lora_rank == 16 and c.rope.interleaved
    assert c.rope.kind == "yarn" and c.rope.dim == 8 and c.q_position_scale == (0.5, 4)
    assert c.scale == pytest.approx((1 + 0.1 * np.log(4)) ** 2 / 16**0.5)
    assert c.moe_layers == (False, True, True) and c.router == "softmax_group"
    assert (c.num_experts, c.top_k, c.n_group, c.topk_group) == (16, 4, 4, 2)
    assert c.norm_topk_prob and c.routed_scaling_factor == 2.5 and c.shared_intermediate_size == 32


OFF: dict[str, Callable[[ModelConfig], dict[str, Any]]] = {
    "softmax_scores": lambda c: dict(router="sigmoid_group"),
    "llama_4_query_scale": lambda c: dict(q_position_scale=None),
    "yarn_mscale": lambda c: dict(attention_scale=c.scale / (1 + 0.1 * np.log(4)) ** 2),
    "interleaved_rope": lambda c: dict(rope=replace(c.rope, interleaved=False)),
    "n_group_topk_group": lambda c: dict(n_group=1, topk_group=1),
    "norm_topk_prob": lambda c: dict(norm_topk_prob=False),
    "routed_scaling_factor": lambda c: dict(routed_scaling_factor=1.0),
    "shared_experts": lambda c: dict(shared_intermediate_size=0),
}


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(mistral4_checkpoint, mechanism: str) -> None:
    folder, ref = mistral4_checkpoint.get()
    assert moved(_variant(folder, **OFF[mechanism](load_model(folder).config)), ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw.update(first_k_dense_replace=2), "missing tensor '1.mlp.gate'"),
    (lambda raw: raw.update(first_k_dense_replace=0), "missing tensor '0.router'"),
    (lambda raw: raw.update(n_group=3), "n_group=3 must divide n_routed_experts=16"),
    (lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(mistral4_checkpoint, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    bad = copy_with_config(mistral4_checkpoint.get()[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(bad)


def test_a_config_without_rope_parameters_takes_transformers_default() -> None:
    """Mistral4Config fills in YaRN (factor 128 from 8192, mscale 1) and llama_4_scaling_beta 0.1."""
    c = ModelConfig.from_hf({"model_type": "mistral4"})
    assert (c.rope.kind, c.rope.factor, c.rope.original_max_position, c.q_position_scale) == ("yarn", 128.0, 8192,
                                                                                              (0.1, 8192))
    assert c.scale == pytest.approx((1 + 0.1 * np.log(128)) ** 2 / 128**0.5)


@pytest.mark.parametrize("name", ["tiny", "mistral-small-4"])
def test_plan_counts_the_parameters_transformers_builds(mistral4_checkpoint, name: str) -> None:
    """``model_size`` against the Mistral4ForCausalLM transformers builds (meta device) from the same config."""
    path = mistral4_checkpoint.get()[0] / "config.json" if name == "tiny" else CONFIGS / f"{name}.json"
    raw = json.loads(path.read_text())
    with torch.device("meta"):
        model = Mistral4ForCausalLM(Mistral4Config(**{k: v for k, v in raw.items() if k != "model_type"}))
    moe = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    size = model_size(raw)
    assert size.total == sum(p.numel() for p in model.parameters())
    assert (size.moe_layers, size.num_experts) == (len(moe), moe[0].gate_up_proj.shape[0])


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """Mistral's announcement of mistralai/Mistral-Small-4-119B-2603: 119B total, 6B active per token (8B
    with the embedding and output layers, by its count).  plan counts 119.0B, 5.6B active without the
    embedding lookup and LM head, 6.6B with them."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "mistral-small-4"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "36 layers (0 dense, 36 MoE), 128 experts per MoE layer, top-4" in text
    assert "119.0B total, 6.6B active per token (5.6B without embeddings and LM head)" in text
    assert "model card      119B total, 6B active (mistralai/Mistral-Small-4-119B-2603)" in text
