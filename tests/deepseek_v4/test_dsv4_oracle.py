"""DeepSeek-V4 (``deepseek_v4``) against transformers 5.24: both checkpoint layouts (DeepSeek's own
names, transformers' runtime names), a 16-token prefill (whole, in chunks of 5 and token by token over
the cache), 8 decode steps on the cache, greedy tokens; and negative controls: each mechanism
switched off in the engine moves the logits by far more than the tolerance, so the match is no
accident of a mechanism that does nothing on these weights (``tests/oracle_dsv4.py`` says how its
config switches every one on)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_support import assert_matches_transformers, copy_with_config, moved
from engine_support import variant as _variant
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from moeswarm.errors import CheckpointError, ConfigError
from moeswarm.model import ModelConfig, Weights, load_model
from moeswarm.model._config_dsv4 import ARCHITECTURES
from moeswarm.model.plan import model_size

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance


def test_the_family_is_registered() -> None:
    assert ARCHITECTURES == ("deepseek_v4",)


@pytest.mark.parametrize("chunk", [None, 5, 1], ids=["one-prefill", "prefill-in-chunks-of-5", "token-by-token"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_tokens_match_transformers(dsv4_checkpoints, layout: str, chunk: int | None) -> None:
    folder, ref = dsv4_checkpoints.get(layout)
    model = load_model(folder, backend="eager")
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_configuration_has_every_mechanism_on(dsv4_checkpoints) -> None:
    cfg = load_model(dsv4_checkpoints.get("packed")[0]).config
    s = cfg.family
    assert s.layer_kinds == ("sliding", "csa", "hca", "csa", "hca") and s.sliding_window == 6
    assert s.hash_layers == (True, True, False, False, False) and (s.csa_rate, s.hca_rate) == (4, 8)
    assert (s.index_topk, s.index_heads, s.index_head_dim, s.rope_dim) == (3, 4, 16, 8)
    assert (s.hc_mult, s.hc_sinkhorn_iters, s.o_groups, s.o_lora_rank) == (3, 6, 2, 16)
    assert s.compress_rope.kind == "yarn" and s.main_rope.kind == "default" and s.compress_rope.theta == 160_000.0
    assert cfg.router == "sqrtsoftplus" and cfg.residual_form == "hyper" and cfg.swiglu_limit == 0.5
    assert (cfg.num_experts, cfg.top_k, cfg.shared_intermediate_size, cfg.routed_scaling_factor) == (8, 2, 32, 1.5)
    per_expert = load_model(dsv4_checkpoints.get("per_expert")[0]).config
    assert replace(per_expert, raw={}, model_id="") == replace(cfg, raw={}, model_id="")


def _family(**changes: Any) -> Callable[[ModelConfig], dict[str, Any]]:
    return lambda c: dict(family=replace(c.family, **changes))


def _without_hash_tables(w: Weights) -> None:
    """Hash-routed layers routed like the others (learned top-k on the same scores, no correction bias)."""
    for L, hashed in enumerate(w.config.family.hash_layers):
        if hashed:
            del w.tensors[f"{L}.router_table"]


OFF: dict[str, Callable[[ModelConfig], dict[str, Any]]] = {
    "sliding_window": _family(sliding_window=10**6),
    "compressed_entries": _family(compressed=False),
    "csa_indexer_top_k": _family(indexer=False),
    "csa_overlapping_windows": _family(overlap=False),
    "compress_rope_yarn": lambda c: dict(family=replace(c.family, compress_rope=replace(c.family.compress_rope,
                                                                                         kind="default"))),
    "attention_sinks": _family(sinks=False),
    "grouped_output_lora": _family(grouped_output=False),
    "hyper_connections": lambda c: dict(residual_form="add"),
    "sinkhorn_iterations": _family(hc_sinkhorn_iters=1),
    "sqrtsoftplus_scores": lambda c: dict(router="sigmoid_group"),
    "swiglu_limit": lambda c: dict(expert_activation="swiglu", dense_activation="swiglu"),
    "routed_scaling_factor": lambda c: dict(routed_scaling_factor=1.0),
    "shared_expert": lambda c: dict(shared_intermediate_size=0),
}


@pytest.mark.parametrize("mechanism", [*OFF, "hash_routing"])
def test_each_mechanism_changes_the_logits(dsv4_checkpoints, mechanism: str) -> None:
    folder, ref = dsv4_checkpoints.get("packed")
    if mechanism == "hash_routing":
        model = _variant(folder, _without_hash_tables)
    else:
        model = _variant(folder, **OFF[mechanism](load_model(folder).config))
    assert moved(model, ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    # a layer said to be sliding where the checkpoint has a compressor, and the reverse: tensors do not fit
    (lambda raw: raw["layer_types"].__setitem__(1, "heavily_compressed_attention"),
     "shape [64, 64] does not match config.json, which implies [32, 64]"),
    (lambda raw: raw["layer_types"].__setitem__(0, "compressed_sparse_attention"), "missing tensor '0.attn.c_kv'"),
    (lambda raw: raw["mlp_layer_types"].__setitem__(2, "hash_moe"), "missing tensor '2.router_table'"),
    (lambda raw: raw.update(layer_types=["full_attention"] * 5), "layer_types must name one of"),
    (lambda raw: raw.update(num_key_value_heads=2), "num_key_value_heads must be 1"),
    (lambda raw: raw.update(scoring_func="softmax"), "scoring_func 'softmax' is not supported"),
    (lambda raw: raw.update(o_groups=3), "o_groups=3 must divide num_attention_heads=4"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(dsv4_checkpoints, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    folder, _ = dsv4_checkpoints.get("packed")
    bad = copy_with_config(folder, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(bad)


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.__setitem__((7, 1), 8), r"the token -> experts table names experts outside 0\.\.7"),
    (lambda t: t.__setitem__((7, 1), t[7, 0]), "the token -> experts table repeats an expert for one token"),
])
def test_a_hash_table_that_does_not_fit_says_what_is_wrong(dsv4_checkpoints, tmp_path: Path,
                                                             change: Callable[[np.ndarray], None], message: str) -> None:
    folder, _ = dsv4_checkpoints.get("packed")
    bad = Path(shutil.copytree(folder, tmp_path / "bad"))
    tensors = load_file(bad / "model.safetensors")
    change(tensors["model.layers.1.mlp.gate.tid2eid"])
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


def test_plan_counts_the_parameters_transformers_builds(dsv4_checkpoints) -> None:
    raw = json.loads((dsv4_checkpoints.get("packed")[0] / "config.json").read_text())
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"}))
    assert model_size(raw).total == sum(p.numel() for p in model.parameters())
