"""dots.llm1 (``dots1``), ERNIE 4.5 MoE (``ernie4_5_moe``) and Hunyuan-A13B (``hunyuan_v1_moe``) against
transformers 5.24: both on-disk
layouts, a 16-token prefill (whole, and in chunks of 5 over the cache), 8 decode steps on the cache,
greedy tokens; and negative controls: each mechanism of the family switched off in the engine moves the
logits by far more than the tolerance, so the match is no accident of a mechanism that does nothing on
these weights."""

from __future__ import annotations

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
    ModelConfig,
    Weights,
    load_model,
)
from moeswarm.model._config_dots1_ernie import ARCHITECTURES as DOTS1_ERNIE
from moeswarm.model._config_hunyuan import ARCHITECTURES as HUNYUAN

ARCHITECTURES = DOTS1_ERNIE + HUNYUAN

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance


def test_the_families_are_registered() -> None:
    assert set(ARCHITECTURES) == {"dots1", "ernie4_5_moe", "hunyuan_v1_moe"}


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_and_greedy_tokens_match_transformers(family_checkpoints, arch: str, layout: str,
                                                     chunk: int | None) -> None:
    folder, ref = family_checkpoints.get(arch, layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == arch
    assert_matches_transformers(model, ref, chunk, TOL)


def _drop(*suffixes: str) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        for name in [n for n in w.tensors if n.endswith(suffixes)]:
            del w.tensors[name]

    return edit


def _zero_score_bias(w: Weights) -> None:
    for name in [n for n in w.tensors if n.endswith("router_score_bias")]:
        w.tensors[name] = np.zeros_like(w.tensors[name])


Off = dict[str, tuple[Callable[[ModelConfig], dict[str, Any]], Callable[[Weights], None] | None]]
OFF: dict[str, Off] = {
    "dots1": {
        "qk_norm": (lambda c: dict(qk_norm=None), None),
        "qkv_bias": (lambda c: {}, _drop("attn.q_bias", "attn.k_bias", "attn.v_bias")),
        "o_bias": (lambda c: {}, _drop("attn.o_bias")),
        "sliding_window": (lambda c: dict(sliding_windows=(None,) * c.num_layers), None),
        "shared_experts": (lambda c: dict(shared_intermediate_size=0), None),
        "sigmoid_router": (lambda c: dict(router="softmax_topk"), None),
        "e_score_correction_bias": (lambda c: {}, _zero_score_bias),
        "n_group_topk_group": (lambda c: dict(n_group=1, topk_group=1), None),
        "norm_topk_prob": (lambda c: dict(norm_topk_prob=False), None),
        "routed_scaling_factor": (lambda c: dict(routed_scaling_factor=1.0), None),
    },
    "ernie4_5_moe": {
        "interleaved_rope": (lambda c: dict(rope=replace(c.rope, interleaved=False)), None),
        "choice_bias": (lambda c: dict(choice_bias=False), None),
        "norm_topk_prob": (lambda c: dict(norm_topk_prob=False), None),
        "shared_experts": (lambda c: dict(shared_intermediate_size=0), None),
    },
    "hunyuan_v1_moe": {
        "qk_norm_after_rope": (lambda c: dict(qk_norm="head"), None),  # the norm before RoPE instead
        "qk_norm": (lambda c: dict(qk_norm=None), None),
        "ntk_alpha": (lambda c: dict(rope=replace(c.rope, theta=10_000.0)), None),
        "qkv_bias": (lambda c: {}, _drop("attn.q_bias", "attn.k_bias", "attn.v_bias")),
        "o_bias": (lambda c: {}, _drop("attn.o_bias")),
        "norm_topk_prob": (lambda c: dict(norm_topk_prob=False), None),
        "shared_mlp": (lambda c: dict(shared_intermediate_size=0), None),
    },
}


def test_the_configurations_have_every_mechanism_on(family_checkpoints) -> None:
    dots = load_model(family_checkpoints.get("dots1")[0]).config
    assert dots.head_dim == 32 and dots.rope.dim == 32 and dots.qk_norm == "head" and dots.qkv_bias and dots.o_bias
    assert dots.sliding_windows == (None, 6, 6) and dots.moe_layers == (False, True, True)
    assert (dots.n_group, dots.topk_group, dots.top_k, dots.num_experts) == (4, 2, 4, 16)
    assert dots.norm_topk_prob and dots.routed_scaling_factor == 2.5 and dots.shared_intermediate_size == 32
    ernie = load_model(family_checkpoints.get("ernie4_5_moe")[0]).config
    assert ernie.moe_layers == (False, True, False, True, False, False) and ernie.tie_word_embeddings
    assert ernie.rope.interleaved and ernie.router == "softmax_topk" and ernie.choice_bias and ernie.norm_topk_prob
    assert (ernie.top_k, ernie.num_experts, ernie.shared_intermediate_size) == (4, 16, 32)
    hy = load_model(family_checkpoints.get("hunyuan_v1_moe")[0]).config
    assert hy.qk_norm == "head_after_rope" and hy.qkv_bias and hy.o_bias and hy.head_dim == 32
    assert hy.rope.theta == pytest.approx(10_000.0 * 1000.0 ** (32 / 30)) and hy.moe_layers == (True, True)
    assert (hy.top_k, hy.num_experts, hy.moe_intermediate_size, hy.shared_intermediate_size) == (2, 8, 32, 32)


@pytest.mark.parametrize(("arch", "mechanism"), [(a, m) for a, off in OFF.items() for m in off])
def test_each_mechanism_changes_the_logits(family_checkpoints, arch: str, mechanism: str) -> None:
    folder, ref = family_checkpoints.get(arch)
    changes, edit = OFF[arch][mechanism]
    assert moved(_variant(folder, edit, **changes(load_model(folder).config)), ref) > MATTERS


@pytest.mark.parametrize(("arch", "edit", "message"), [
    # the dense layers are where the config says: one more or one fewer and the tensors do not fit
    ("dots1", lambda raw: raw.update(first_k_dense_replace=2), "missing tensor '1.mlp.gate'"),
    ("dots1", lambda raw: raw.update(first_k_dense_replace=0), "missing tensor '0.router'"),
    ("dots1", lambda raw: raw.update(n_group=3), "n_group=3 must divide n_routed_experts=16"),
    ("dots1", lambda raw: raw.pop("n_shared_experts"), "n_shared_experts is required"),
    ("ernie4_5_moe", lambda raw: raw.update(moe_layer_end_index=-1), "missing tensor '5.router'"),
    ("ernie4_5_moe", lambda raw: raw.update(moe_layer_start_index=2), "missing tensor '1.mlp.gate'"),
    ("ernie4_5_moe", lambda raw: raw.update(use_bias=True), "use_bias=true .* is not supported"),
    ("hunyuan_v1_moe", lambda raw: raw.update(moe_topk=[2, 3]), "moe_topk must give every one of 2 layers"),
    ("hunyuan_v1_moe", lambda raw: raw["rope_parameters"].update(rope_type="yarn"), "rope type 'yarn' is not"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(family_checkpoints, tmp_path: Path, arch: str,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    folder, _ = family_checkpoints.get(arch)
    bad = copy_with_config(folder, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(bad)


def test_dots1_without_layer_types_derives_the_sliding_layers(family_checkpoints, tmp_path: Path) -> None:
    """A config.json without ``layer_types`` (as published: Dots1Config derives it from
    ``max_window_layers`` and ``sliding_window``) gives the same layers and logits."""
    folder, ref = family_checkpoints.get("dots1")
    model = load_model(copy_with_config(folder, tmp_path / "derived", lambda raw: raw.pop("layer_types")),
                       backend="eager")
    assert model.config.sliding_windows == (None, 6, 6)
    prefill, decode = run_engine(model, ref, chunk=5)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL


def test_hunyuan_published_config_spelling_gives_the_same_logits(family_checkpoints, tmp_path: Path) -> None:
    """Hunyuan-A13B's config.json as published: ``rope_scaling: {"type": "dynamic", "alpha": ...}`` beside a
    top-level ``rope_theta``, per-layer ``moe_topk`` and ``num_experts`` lists (equal on every layer)."""
    folder, ref = family_checkpoints.get("hunyuan_v1_moe")

    def hub(raw: dict[str, Any]) -> None:
        rope = raw.pop("rope_parameters")
        raw.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "dynamic", "alpha": rope["alpha"]},
                   moe_topk=[raw["moe_topk"]] * 2, num_experts=[raw["num_experts"]] * 2)

    model = load_model(copy_with_config(folder, tmp_path / "hub", hub), backend="eager")
    assert replace(model.config, raw={}, model_id="") == replace(load_model(folder).config, raw={}, model_id="")
    prefill, decode = run_engine(model, ref, chunk=5)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_plan_counts_the_parameters_transformers_builds(family_checkpoints, arch: str) -> None:
    """``moeswarm plan``'s count from config.json (``model_size``) against the parameters of the model
    transformers builds from the same config (ERNIE's tied embeddings and moe_statics bias, Hunyuan's
    shared MLP and q/k norms, dots1's dense first layer and o_proj bias all count)."""
    from moeswarm.model.plan import model_size

    oracle = family_checkpoints.oracle
    model = oracle.build_model(arch)
    size = model_size(oracle.CONFIGS[arch]().to_dict())
    assert size.total == sum(p.numel() for p in model.parameters())
    experts = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert (size.moe_layers, size.num_experts) == (len(experts), experts[0].gate_up_proj.shape[0])
    assert size.top_k == load_model(family_checkpoints.get(arch)[0]).config.top_k


@pytest.mark.parametrize(("arch", "aliases"), [
    ("ernie4_5_moe", {"moe_num_experts": "num_experts", "moe_k": "num_experts_per_tok"}),
    ("hunyuan_v1_moe", {"num_experts": "num_local_experts", "moe_topk": "num_experts_per_tok"}),
])
def test_attribute_map_spellings_read_the_same(family_checkpoints, tmp_path: Path, arch: str,
                                               aliases: dict[str, str]) -> None:
    """transformers' ``attribute_map`` lets a config.json say ``num_experts`` for ERNIE's ``moe_num_experts``
    (and so on); the engine reads either spelling to the same configuration."""
    folder, _ = family_checkpoints.get(arch)

    def respell(raw: dict[str, Any]) -> None:
        for name, alias in aliases.items():
            raw[alias] = raw.pop(name)

    edited = load_model(copy_with_config(folder, tmp_path / "alias", respell)).config
    assert replace(edited, raw={}, model_id="") == replace(load_model(folder).config, raw={}, model_id="")
