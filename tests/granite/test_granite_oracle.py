"""Granite MoE (``granitemoe``) and Granite MoE shared (``granitemoeshared``) against transformers 5.24:
both on-disk layouts, a 16-token prefill (whole, and in chunks of 5 over the cache), 8 decode steps on
the cache, greedy tokens, the batched path; negative controls (each mechanism switched off moves the
logits by far more than the tolerance); config errors; plan's count against transformers'."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from engine_support import assert_matches_transformers, copy_with_config, moved
from engine_support import variant as _variant

from moeswarm.errors import CheckpointError
from moeswarm.model import ModelConfig, Weights, load_model
from moeswarm.model._config_granite import ARCHITECTURES
from moeswarm.model.batch import CachePool, Step, forward_batch, layer_specs
from moeswarm.model.plan import model_size

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance


def test_the_families_are_registered() -> None:
    assert ARCHITECTURES == ("granitemoe", "granitemoeshared")


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_and_greedy_tokens_match_transformers(granite_checkpoints, arch: str, layout: str,
                                                     chunk: int | None) -> None:
    folder, ref = granite_checkpoints.get(arch, layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == arch
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_batched_path_applies_the_multipliers_too(granite_checkpoints) -> None:
    """``forward_batch`` (paged GQA, several sequences in one pass) has its own layer loop: two
    sequences, the reference prompt and a shorter one, each get transformers' logits."""
    folder, ref = granite_checkpoints.get("granitemoeshared")
    model = load_model(folder, backend="eager")
    pool = CachePool(layer_specs(model.config), 1 << 20)
    steps = [Step(pool.admit(len(ref.prompt_ids)), list(ref.prompt_ids), all_logits=True),  # type: ignore[arg-type]
             Step(pool.admit(8), list(ref.prompt_ids[:8]), all_logits=True)]  # type: ignore[arg-type]
    forward_batch(model, steps)
    assert np.abs(steps[0].logits - ref.prefill_logits).max() <= TOL
    assert np.abs(steps[1].logits - ref.prefill_logits[:8]).max() <= TOL


def test_the_configurations_have_every_mechanism_on(granite_checkpoints) -> None:
    for arch in ARCHITECTURES:
        c = load_model(granite_checkpoints.get(arch)[0]).config
        assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling, c.scale) == (6.0, 0.4, 3.0,
                                                                                               pytest.approx(0.1))
        assert c.router == "topk_softmax" and c.qkv_bias and c.o_bias and c.tie_word_embeddings
        assert (c.num_experts, c.top_k, c.moe_intermediate_size) == (8, 2, 32)
        assert c.shared_intermediate_size == (48 if arch == "granitemoeshared" else 0)


def _drop(*suffixes: str) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        for name in [n for n in w.tensors if n.endswith(suffixes)]:
            del w.tensors[name]

    return edit


Off = dict[str, tuple[Callable[[ModelConfig], dict[str, Any]], Callable[[Weights], None] | None]]
_COMMON: Off = {
    "embedding_multiplier": (lambda c: dict(embedding_multiplier=1.0), None),
    "attention_multiplier": (lambda c: dict(attention_scale=0.0), None),  # head_dim ** -0.5 instead
    "residual_multiplier": (lambda c: dict(residual_multiplier=1.0), None),
    "logits_scaling": (lambda c: dict(logits_scaling=1.0), None),
    "softmax_over_the_top_k": (lambda c: dict(router="softmax_topk"), None),  # over all experts instead
    "qkv_bias": (lambda c: {}, _drop("attn.q_bias", "attn.k_bias", "attn.v_bias")),
}
OFF: dict[str, Off] = {
    "granitemoe": _COMMON,
    "granitemoeshared": {**_COMMON, "shared_mlp": (lambda c: dict(shared_intermediate_size=0), None)},
}


@pytest.mark.parametrize(("arch", "mechanism"), [(a, m) for a, off in OFF.items() for m in off])
def test_each_mechanism_changes_the_logits(granite_checkpoints, arch: str, mechanism: str) -> None:
    folder, ref = granite_checkpoints.get(arch)
    changes, edit = OFF[arch][mechanism]
    assert moved(_variant(folder, edit, **changes(load_model(folder).config)), ref) > MATTERS


@pytest.mark.parametrize(("arch", "edit", "message"), [
    ("granitemoe", lambda raw: raw.update(logits_scaling=0), "logits_scaling must not be 0"),
    ("granitemoe", lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    ("granitemoe", lambda raw: raw.update(num_local_experts=4),
     r"shape \[8, 64\] does not match config.json, which implies \[4, 64\] .*router\.layer\.weight"),
    ("granitemoeshared", lambda raw: raw.update(shared_intermediate_size=32),
     r"shape \[48, 64\] does not match config.json, which implies \[32, 64\] .*shared_mlp\.input_linear"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(granite_checkpoints, tmp_path: Path, arch: str,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    bad = copy_with_config(granite_checkpoints.get(arch)[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_plan_counts_the_parameters_transformers_builds(granite_checkpoints, arch: str) -> None:
    oracle = granite_checkpoints.oracle
    model = oracle.build_model(arch)
    size = model_size(oracle.CONFIGS[arch]().to_dict())
    assert size.total == sum(p.numel() for p in model.parameters())
    assert (size.moe_layers, size.num_experts, size.top_k) == (2, 8, 2)


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """ibm-granite/granite-3.0-3b-a800m-instruct: 3.3B total, 800M active; plan counts 807.4M active
    without the (tied) embedding lookup and LM head."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "granite-3.0-3b-a800m"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "granitemoe: 32 layers (0 dense, 32 MoE), 40 experts per MoE layer, top-8" in text
    assert "3.3B total, 882.9M active per token (807.4M without embeddings and LM head)" in text
    assert "model card      3.3B total, 800M active (ibm-granite/granite-3.0-3b-a800m-instruct)" in text
