"""GLM-4.5 / 4.6 (``glm4_moe``) and GLM-4.7-Flash (``glm4_moe_lite``) against transformers 5.24:
both on-disk layouts, a 16-token prefill (whole, and in chunks of 5 over the cache), 8 decode steps
on the cache, greedy tokens; and negative controls: each mechanism of the family switched off in
the engine moves the logits by far more than the tolerance, so the match is no accident of a
mechanism that does nothing on these weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from engine_support import (
    assert_matches_transformers,
    copy_with_config,
    moved,
    run_engine,
)
from engine_support import variant as _variant

from moeswarm.errors import CheckpointError
from moeswarm.model import (
    BACKENDS,
    ModelConfig,
    Weights,
    get_backend,
    load_model,
)
from moeswarm.model._config_glm4 import ARCHITECTURES as ARCHITECTURES_GLM4
from moeswarm.model.routing import route

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance


def test_both_families_are_registered() -> None:
    assert set(ARCHITECTURES_GLM4) == {"glm4_moe", "glm4_moe_lite"}


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHITECTURES_GLM4)
def test_logits_and_greedy_tokens_match_transformers(glm4_checkpoints, arch: str, layout: str,
                                                     chunk: int | None) -> None:
    folder, ref = glm4_checkpoints.get(arch, layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == arch
    assert_matches_transformers(model, ref, chunk, TOL)


@pytest.mark.parametrize("arch", ARCHITECTURES_GLM4)
def test_backends_agree(glm4_checkpoints, arch: str) -> None:
    folder, _ = glm4_checkpoints.get(arch, "packed")
    model = load_model(folder)
    cfg, w = model.config, model.weights
    layer = next(L for L in range(cfg.num_layers) if cfg.moe_layers[L])
    rng = np.random.default_rng(1)
    for tokens in (1, 3, 8, 33):
        x = rng.standard_normal((tokens, cfg.hidden_size)).astype(np.float32)
        ids, weights = route(cfg, x, w[f"{layer}.router"], None, w.get(f"{layer}.router_score_bias"))
        outs = {name: get_backend(name)(w.experts[layer], x, ids, weights, cfg) for name in BACKENDS}
        for name, out in outs.items():
            assert np.abs(out - outs["eager"]).max() <= 1e-5, (tokens, name)
        assert np.abs(outs["eager"]).max() > 1e-2


def _drop_attention_biases(w: Weights) -> None:
    for name in [n for n in w.tensors if n.endswith(("attn.q_bias", "attn.k_bias", "attn.v_bias"))]:
        del w.tensors[name]


def _zero_score_bias(w: Weights) -> None:
    for name in [n for n in w.tensors if n.endswith("router_score_bias")]:
        w.tensors[name] = np.zeros_like(w.tensors[name])


GLM4_MOE_OFF: dict[str, tuple[Callable[[ModelConfig], dict[str, Any]], Callable[[Weights], None] | None]] = {
    "partial_rotary_factor": (lambda c: dict(rope=replace(c.rope, dim=c.head_dim)), None),
    "use_qk_norm": (lambda c: dict(qk_norm=None), None),
    "attention_bias": (lambda c: {}, _drop_attention_biases),
    "shared_experts": (lambda c: dict(shared_intermediate_size=0), None),
    "sigmoid_router": (lambda c: dict(router="softmax_topk"), None),
    "e_score_correction_bias": (lambda c: {}, _zero_score_bias),
    "n_group_topk_group": (lambda c: dict(n_group=1, topk_group=1), None),
    "norm_topk_prob": (lambda c: dict(norm_topk_prob=False), None),
    "routed_scaling_factor": (lambda c: dict(routed_scaling_factor=1.0), None),
}


@pytest.mark.parametrize("mechanism", GLM4_MOE_OFF)
def test_glm4_moe_each_mechanism_changes_the_logits(glm4_checkpoints, mechanism: str) -> None:
    folder, ref = glm4_checkpoints.get("glm4_moe")
    cfg = load_model(folder).config
    # the configuration really has each mechanism on
    assert cfg.rope.dim == 8 and cfg.head_dim == 32 and cfg.qk_norm == "head" and cfg.qkv_bias and not cfg.o_bias
    assert (cfg.n_group, cfg.topk_group, cfg.top_k, cfg.num_experts) == (4, 2, 4, 16)
    assert cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.5 and cfg.shared_intermediate_size == 32
    changes, edit = GLM4_MOE_OFF[mechanism]
    assert moved(_variant(folder, edit, **changes(cfg)), ref) > MATTERS


def test_glm4_moe_lite_routed_scaling_and_group_limit_change_the_logits(glm4_checkpoints) -> None:
    folder, ref = glm4_checkpoints.get("glm4_moe_lite")
    cfg = load_model(folder).config
    assert cfg.attention == "mla" and cfg.moe_layers == (True, False, True)
    assert cfg.routed_scaling_factor == 1.8 and cfg.shared_intermediate_size == 32
    assert moved(_variant(folder, routed_scaling_factor=1.0), ref) > MATTERS
    assert moved(_variant(folder, n_group=1, topk_group=1), ref) > MATTERS


@pytest.mark.parametrize(("arch", "edit", "message"), [
    # the dense layers are where the config says: one more or one fewer and the tensors do not fit
    ("glm4_moe", lambda raw: raw.update(first_k_dense_replace=2), "missing tensor '1.mlp.gate'"),
    ("glm4_moe", lambda raw: raw.update(first_k_dense_replace=0), "missing tensor '0.router'"),
    ("glm4_moe_lite", lambda raw: raw.pop("mlp_layer_types"), "missing tensor '0.mlp.gate'"),
    ("glm4_moe", lambda raw: raw.update(n_group=3), "n_group=3 must divide n_routed_experts=16"),
    ("glm4_moe", lambda raw: raw["rope_parameters"].update(partial_rotary_factor=0.3),
     "rotary width 9 must be even"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(glm4_checkpoints, tmp_path: Path, arch: str,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    folder, _ = glm4_checkpoints.get(arch)
    bad = copy_with_config(folder, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(bad)


def test_hub_config_spelling_gives_the_same_logits(glm4_checkpoints, tmp_path: Path) -> None:
    """GLM-4.5's config.json as published: top-level ``rope_theta`` and ``partial_rotary_factor``,
    ``rope_scaling: null``, ``num_nextn_predict_layers`` (the MTP layer, not read)."""
    folder, ref = glm4_checkpoints.get("glm4_moe")

    def hub(raw: dict[str, Any]) -> None:
        rope = raw.pop("rope_parameters")
        raw.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                   rope_scaling=None, num_nextn_predict_layers=1)

    model = load_model(copy_with_config(folder, tmp_path / "hub", hub), backend="eager")
    assert replace(model.config, raw={}, model_id="") == replace(load_model(folder).config, raw={}, model_id="")
    prefill, decode = run_engine(model, ref, chunk=5)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL


def test_without_partial_rotary_factor_half_of_each_head_turns(glm4_checkpoints, tmp_path: Path) -> None:
    """Glm4MoeConfig defaults ``partial_rotary_factor`` to 0.5 when a config.json does not say it;
    transformers is run again on the edited checkpoint, and the engine follows it."""
    folder, ref = glm4_checkpoints.get("glm4_moe")
    edited = copy_with_config(folder, tmp_path / "half",
                               lambda raw: raw["rope_parameters"].pop("partial_rotary_factor"))
    new_ref = glm4_checkpoints.oracle.reference_run(edited, ref.prompt_ids)
    assert np.abs(new_ref.prefill_logits - ref.prefill_logits).max() > MATTERS  # the factor matters
    model = load_model(edited, backend="eager")
    assert model.config.rope.dim == 16
    prefill, decode = run_engine(model, new_ref)
    assert np.abs(prefill - new_ref.prefill_logits).max() <= TOL
    assert np.abs(decode - new_ref.decode_logits).max() <= TOL


GLM_4_5_AIR = {  # zai-org/GLM-4.5-Air config.json (106B total, 12B active): no QK norm, 1 dense layer
    "model_type": "glm4_moe", "attention_bias": True, "head_dim": 128, "hidden_size": 4096,
    "partial_rotary_factor": 0.5, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
    "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "use_qk_norm": False, "vocab_size": 151552,
    "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329,
}


def test_published_configs_parse_at_real_scale() -> None:
    shipped = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs" / "glm-4.5.json"
    glm = ModelConfig.from_hf(json.loads(shipped.read_text()))
    assert (glm.num_layers, sum(glm.moe_layers), glm.num_experts, glm.top_k) == (92, 89, 160, 8)
    assert (glm.hidden_size, glm.num_heads, glm.num_kv_heads, glm.head_dim, glm.rope.dim) == (5120, 96, 8, 128, 64)
    assert glm.qk_norm == "head" and glm.qkv_bias and glm.rope.theta == 1e6 and glm.rms_norm_eps == 1e-5
    assert (glm.routed_scaling_factor, glm.shared_intermediate_size, glm.dense_intermediate_size) == (2.5, 1536, 12288)
    air = ModelConfig.from_hf(GLM_4_5_AIR)
    assert air.qk_norm is None and sum(air.moe_layers) == 45 and air.num_experts == 128 and air.rope.dim == 64
    assert air.eos_token_ids == (151329, 151336, 151338)


def test_mla_latent_norms_use_eps_1e6_whatever_rms_norm_eps_says(glm4_checkpoints, monkeypatch) -> None:
    """transformers builds ``q_a_layernorm`` / ``kv_a_layernorm`` with RMSNorm's default eps (1e-6);
    with this config's ``rms_norm_eps`` (1e-5) there instead, the logits were 5e-5 off: inside the
    1e-4 tolerance, so this test holds them to 1e-5 and shows the wrong eps exceeds that."""
    import moeswarm.model.attention as attention

    folder, ref = glm4_checkpoints.get("glm4_moe_lite")
    model = load_model(folder, backend="eager")
    assert model.config.rms_norm_eps == 1e-5
    prefill, _ = run_engine(model, ref)
    assert np.abs(prefill - ref.prefill_logits).max() <= 1e-5
    monkeypatch.setattr(attention, "MLA_LATENT_EPS", model.config.rms_norm_eps)
    prefill, _ = run_engine(model, ref)
    assert np.abs(prefill - ref.prefill_logits).max() > 1e-5
