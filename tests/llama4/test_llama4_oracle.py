"""Llama 4 (``llama4_text``, and ``llama4``'s text model) against transformers 5.24: both checkpoint
forms, a 16-token prefill (whole, and in chunks of 5 over the cache), 8 decode steps on the cache,
greedy tokens; and negative controls: each mechanism switched off in the engine moves the logits by
far more than the tolerance, so the match is no accident of a mechanism that does nothing on these
weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from engine_support import (
    assert_matches_transformers,
    copy_with_config,
    moved,
    run_engine,
)
from engine_support import variant as _variant
from transformers import AutoConfig, Llama4ForCausalLM

from moeswarm.errors import CheckpointError
from moeswarm.model import ModelConfig, load_model
from moeswarm.model._config_llama4 import ARCHITECTURES
from moeswarm.model.plan import model_size

LAYOUTS = ("text", "vision")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance
CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"


def test_the_family_is_registered() -> None:
    assert set(ARCHITECTURES) == {"llama4", "llama4_text"}


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_tokens_match_transformers(llama4_checkpoints, layout: str, chunk: int | None) -> None:
    folder, ref = llama4_checkpoints.get(layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == {"text": "llama4_text", "vision": "llama4"}[layout]
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_configuration_has_every_mechanism_on(llama4_checkpoints) -> None:
    text = load_model(llama4_checkpoints.get("text")[0]).config
    s = text.family
    assert s.rope_layers == (True, False, True, False) and s.chunked == (True, False, True, False)
    assert s.chunk_size == 5 and s.qk_norm and s.temperature_tuning and (s.floor_scale, s.attn_scale) == (4, 0.5)
    assert text.rope.kind == "llama3" and text.rope.interleaved and text.moe_layers == (False, True, False, True)
    assert (text.num_experts, text.top_k, text.moe_intermediate_size) == (8, 2, 32)
    assert (text.shared_intermediate_size, text.dense_intermediate_size) == (32, 128)
    assert text.router == "topk_sigmoid" and text.expert_input_scaled
    vision = load_model(llama4_checkpoints.get("vision")[0]).config
    assert replace(vision, arch="", raw={}, model_id="") == replace(text, arch="", raw={}, model_id="")


def _family(**changes: Any) -> Callable[[ModelConfig], dict[str, Any]]:
    return lambda c: dict(family=replace(c.family, **changes))


OFF: dict[str, Callable[[ModelConfig], dict[str, Any]]] = {
    "llama3_rope_scaling": lambda c: dict(rope=replace(c.rope, kind="default")),
    "interleaved_rope": lambda c: dict(rope=replace(c.rope, interleaved=False)),
    "chunked_attention": _family(chunked=(False,) * 4),
    "no_rope_layers": _family(rope_layers=(True,) * 4),
    "qk_l2_norm": _family(qk_norm=False),
    "temperature_tuning": _family(temperature_tuning=False),
    "expert_input_scaled": lambda c: dict(expert_input_scaled=False),  # the weight on the output instead
    "sigmoid_weights": lambda c: dict(router="topk_softmax"),
    "shared_expert": lambda c: dict(shared_intermediate_size=0),
}


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(llama4_checkpoints, mechanism: str) -> None:
    folder, ref = llama4_checkpoints.get("text")
    assert moved(_variant(folder, **OFF[mechanism](load_model(folder).config)), ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    # the MoE layers are where the config says: one more or one fewer and the tensors do not fit
    (lambda raw: raw.update(moe_layers=[1]), "missing tensor '3.mlp.gate'"),
    (lambda raw: raw.update(moe_layers=[0, 1, 3]), "missing tensor '0.router'"),
    (lambda raw: raw.update(moe_layers=[1, 4]), "moe_layers [1, 4] names a layer outside 0..3"),
    (lambda raw: raw.update(no_rope_layers=[1, 0]), "no_rope_layers must give each of 4 layers"),
    (lambda raw: raw["rope_parameters"].update(rope_type="yarn"), "rope type 'yarn' is not supported"),
    (lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(llama4_checkpoints, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    folder, _ = llama4_checkpoints.get("text")
    bad = copy_with_config(folder, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(bad)


def test_derived_layers_and_hub_rope_spelling_give_the_same_logits(llama4_checkpoints, tmp_path: Path) -> None:
    """A config.json without ``no_rope_layers``, ``layer_types`` and ``moe_layers`` (derived from
    ``no_rope_layer_interval``, ``attention_chunk_size`` and ``interleave_moe_layer_step``, as in the
    published Maverick config), with the older ``rope_theta`` + ``rope_scaling`` spelling, reads the same."""
    folder, ref = llama4_checkpoints.get("text")

    def hub(raw: dict[str, Any]) -> None:
        for name in ("no_rope_layers", "layer_types", "moe_layers"):
            raw.pop(name)
        rope = raw.pop("rope_parameters")
        raw.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)

    model = load_model(copy_with_config(folder, tmp_path / "hub", hub), backend="eager")
    assert replace(model.config, raw={}, model_id="") == replace(load_model(folder).config, raw={}, model_id="")
    prefill, decode = run_engine(model, ref, chunk=5)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL


def _transformers_count(text: dict[str, Any]) -> tuple[int, int]:
    """(parameters, MoE layers) of the Llama4ForCausalLM transformers builds from ``text`` (meta device)."""
    config = AutoConfig.for_model(**text)
    with torch.device("meta"):
        model = Llama4ForCausalLM(config)
    return sum(p.numel() for p in model.parameters()), sum(layer.is_moe_layer for layer in model.model.layers)


@pytest.mark.parametrize("name", ["tiny", "llama-4-scout", "llama-4-maverick"])
def test_plan_counts_the_parameters_transformers_builds(llama4_checkpoints, name: str) -> None:
    """``moeswarm plan``'s count (``model_size``) against transformers' Llama4ForCausalLM from the same
    text config: the oracle's tiny one and the two shipped published ones."""
    if name == "tiny":
        raw = json.loads((llama4_checkpoints.get("vision")[0] / "config.json").read_text())
    else:
        raw = json.loads((CONFIGS / f"{name}.json").read_text())
    total, moe = _transformers_count(raw["text_config"])
    size = model_size(raw)
    assert (size.total, size.moe_layers) == (total, moe)


def test_published_configs_parse_at_real_scale() -> None:
    scout = ModelConfig.from_hf(json.loads((CONFIGS / "llama-4-scout.json").read_text()))
    assert (scout.num_layers, sum(scout.moe_layers), scout.num_experts, scout.top_k) == (48, 48, 16, 1)
    assert scout.family.rope_layers == tuple((i + 1) % 4 != 0 for i in range(48)) == scout.family.chunked
    assert scout.family.qk_norm and scout.rope.kind == "llama3" and scout.rope.factor == 16.0
    maverick = ModelConfig.from_hf(json.loads((CONFIGS / "llama-4-maverick.json").read_text()))
    assert (sum(maverick.moe_layers), maverick.num_experts, maverick.moe_layers[:4]) == (24, 128, (False, True) * 2)
    assert not maverick.family.qk_norm and maverick.rope.kind == "default" and maverick.rope.theta == 500_000.0
    assert maverick.eos_token_ids == (200001, 200007, 200008)
