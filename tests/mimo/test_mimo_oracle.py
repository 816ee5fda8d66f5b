"""MiMo-V2-Flash (``mimo_v2_flash``) against transformers 5.24: both on-disk layouts, a 16-token prefill
(whole, and in chunks of 5 over the cache), 8 decode steps on the cache, greedy tokens, the batched
path; negative controls (each mechanism switched off moves the logits by far more than the
tolerance); config errors; plan's count against transformers'."""

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
from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

from moeswarm.errors import CheckpointError
from moeswarm.model import ModelConfig, Weights, load_model
from moeswarm.model._config_mimo import ARCHITECTURES, MimoSettings
from moeswarm.model.batch import CachePool, Step, forward_batch, layer_specs
from moeswarm.model.plan import model_size

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance
CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"


def test_the_family_is_registered() -> None:
    assert ARCHITECTURES == ("mimo_v2_flash",)


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_tokens_match_transformers(mimo_checkpoints, layout: str, chunk: int | None) -> None:
    folder, ref = mimo_checkpoints.get(layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == "mimo_v2_flash"
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_batched_path_steps_each_sequence_through_its_layers(mimo_checkpoints) -> None:
    folder, ref = mimo_checkpoints.get()
    model = load_model(folder, backend="eager")
    pool = CachePool(layer_specs(model.config), 4 << 20)  # a model that is not paged books 1 MiB a sequence
    steps = [Step(pool.admit(len(ref.prompt_ids)), list(ref.prompt_ids), all_logits=True),  # type: ignore[arg-type]
             Step(pool.admit(8), list(ref.prompt_ids[:8]), all_logits=True)]  # type: ignore[arg-type]
    forward_batch(model, steps)
    assert np.abs(steps[0].logits - ref.prefill_logits).max() <= TOL
    assert np.abs(steps[1].logits - ref.prefill_logits[:8]).max() <= TOL


def test_the_configuration_has_every_mechanism_on(mimo_checkpoints) -> None:
    c = load_model(mimo_checkpoints.get()[0]).config
    s: MimoSettings = c.family
    assert s.sliding == (False, True, True, False) and c.sliding_windows == (None, 5, 5, None)
    assert (c.num_kv_heads, s.sliding_kv_heads, c.head_dim, s.v_head_dim, s.value_scale) == (1, 2, 24, 16, 0.6)
    assert (c.rope.theta, c.rope.dim, s.sliding_rope.theta, s.sliding_rope.dim) == (1e6, 8, 1e4, 8)
    assert c.moe_layers == (False, True, True, True) and c.dense_intermediate_size == 48
    assert (c.router, c.n_group, c.topk_group, c.routed_scaling_factor) == ("sigmoid_group", 2, 1, 1.5)


def _drop(*suffixes: str) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        for name in [n for n in w.tensors if n.endswith(suffixes)]:
            del w.tensors[name]

    return edit


def _settings(**changes: Any) -> Callable[[ModelConfig], dict[str, Any]]:
    return lambda c: dict(family=replace(c.family, **changes))


OFF: dict[str, tuple[Callable[[ModelConfig], dict[str, Any]], Callable[[Weights], None] | None]] = {
    "sinks": (lambda c: {}, _drop("attn.sinks")),
    "sliding_window": (lambda c: dict(sliding_windows=(None,) * c.num_layers), None),
    "sliding_layers_rope_theta": (lambda c: dict(family=replace(c.family, sliding_rope=c.rope)), None),
    "partial_rotary_factor": (lambda c: dict(rope=replace(c.rope, dim=c.head_dim),
                                             family=replace(c.family, sliding_rope=replace(c.family.sliding_rope,
                                                                                           dim=c.head_dim))), None),
    "attention_value_scale": (_settings(value_scale=1.0), None),
    "group_limited_routing": (lambda c: dict(n_group=1, topk_group=1), None),
    "routed_scaling_factor": (lambda c: dict(routed_scaling_factor=1.0), None),
}


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(mimo_checkpoints, mechanism: str) -> None:
    folder, ref = mimo_checkpoints.get()
    changes, edit = OFF[mechanism]
    assert moved(_variant(folder, edit, **changes(load_model(folder).config)), ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw.update(attention_bias=True), "attention_bias is not supported"),
    (lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda raw: raw["rope_parameters"]["sliding_attention"].update(rope_type="yarn"),
     r"rope type 'yarn' is not supported \(default\)"),
    (lambda raw: raw.update(num_key_value_heads=2),
     r"shape \[24, 64\] does not match config.json, which implies \[48, 64\] .*layers\.0\.self_attn\.k_proj"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(mimo_checkpoints, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    bad = copy_with_config(mimo_checkpoints.get()[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


@pytest.mark.parametrize("name", ["tiny", "mimo-v2-flash"])
def test_plan_counts_the_parameters_transformers_builds(mimo_checkpoints, name: str) -> None:
    path = mimo_checkpoints.get()[0] / "config.json" if name == "tiny" else CONFIGS / f"{name}.json"
    raw = json.loads(path.read_text())
    with torch.device("meta"):
        model = MiMoV2FlashForCausalLM(MiMoV2FlashConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
    size = model_size(raw)
    assert size.total == sum(p.numel() for p in model.parameters())
    assert size.moe_layers == len(model.model.layers) - 1


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """XiaomiMiMo/MiMo-V2-Flash's card: 309B total, 15B active."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "mimo-v2-flash"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "mimo_v2_flash: 48 layers (1 dense, 47 MoE), 256 experts per MoE layer, top-8" in text
    assert "308.8B total, 15.4B active per token (14.2B without embeddings and LM head)" in text
    assert "model card      309B total, 15B active (XiaomiMiMo/MiMo-V2-Flash)" in text
