"""PhiMoE (``phimoe``, Phi-3.5-MoE) against transformers 5.24: both on-disk layouts, a 16-token prefill
(whole, and in chunks of 5 over the cache), 8 decode steps on the cache, greedy tokens, the batched
path; the long cos/sin scale of a pass that reaches past ``original_max_position_embeddings``
(against transformers run in the same chunks); negative controls (each mechanism switched off moves
the logits by far more than the tolerance); config errors; plan's count against transformers'."""

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
from transformers import PhimoeConfig, PhimoeForCausalLM

from moeswarm.errors import CheckpointError
from moeswarm.model import Model, ModelConfig, Weights, load_model, load_weights
from moeswarm.model._config_phimoe import ARCHITECTURES, PhimoeSettings
from moeswarm.model.batch import CachePool, Step, forward_batch, layer_specs
from moeswarm.model.plan import model_size

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance
CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"


def test_the_family_is_registered() -> None:
    assert ARCHITECTURES == ("phimoe",)


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_tokens_match_transformers(phimoe_checkpoints, layout: str, chunk: int | None) -> None:
    folder, ref = phimoe_checkpoints.get(layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == "phimoe"
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_batched_path_has_the_norm_and_head_biases_too(phimoe_checkpoints) -> None:
    """``forward_batch`` (paged GQA, several sequences in one pass) has its own layer loop."""
    folder, ref = phimoe_checkpoints.get()
    model = load_model(folder, backend="eager")
    pool = CachePool(layer_specs(model.config), 1 << 20)
    steps = [Step(pool.admit(len(ref.prompt_ids)), list(ref.prompt_ids), all_logits=True),  # type: ignore[arg-type]
             Step(pool.admit(8), list(ref.prompt_ids[:8]), all_logits=True)]  # type: ignore[arg-type]
    forward_batch(model, steps)
    assert np.abs(steps[0].logits - ref.prefill_logits).max() <= TOL
    assert np.abs(steps[1].logits - ref.prefill_logits[:8]).max() <= TOL


def test_the_configuration_has_every_mechanism_on(phimoe_checkpoints) -> None:
    c = load_model(phimoe_checkpoints.get()[0]).config
    assert (c.router, c.top_k, c.family) == ("sparsemixer", 2, PhimoeSettings(router_jitter=0.4))
    assert (c.norm, c.norm_bias, c.lm_head_bias, c.qkv_bias, c.o_bias) == ("layer", True, True, True, True)
    assert c.sliding_windows == (6, 6)
    assert (c.rope.kind, c.rope.attention_factor, c.rope.long_mscale, c.rope.original_max_position) == (
        "longrope", 1.3, 1.7, 32)
    assert len(set(c.rope.factors)) == 8
    spread = phimoe_checkpoints.oracle.sparsemixer_spread(phimoe_checkpoints.get()[0])
    assert spread > 2.0  # experts per first-choice softmax, transformers' own logits: the window matters


def _drop(*suffixes: str) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        for name in [n for n in w.tensors if n.endswith(suffixes)]:
            del w.tensors[name]

    return edit


OFF: dict[str, tuple[Callable[[ModelConfig], dict[str, Any]], Callable[[Weights], None] | None]] = {
    "sparsemixer": (lambda c: dict(router="softmax_topk", norm_topk_prob=True), None),  # Mixtral's router instead
    "router_jitter_noise": (lambda c: dict(family=PhimoeSettings(router_jitter=0.01)), None),  # the published one
    "layer_norm": (lambda c: dict(norm="rms"), None),
    "layer_norm_bias": (lambda c: {}, _drop("norm_bias")),
    "lm_head_bias": (lambda c: {}, _drop("lm_head_bias")),
    "qkv_bias": (lambda c: {}, _drop("attn.q_bias", "attn.k_bias", "attn.v_bias")),
    "sliding_window": (lambda c: dict(sliding_windows=(None,) * c.num_layers), None),
    "longrope_short_factor": (lambda c: dict(rope=replace(c.rope, factors=(1.0,) * len(c.rope.factors))), None),
    "longrope_short_mscale": (lambda c: dict(rope=replace(c.rope, attention_factor=1.0)), None),
}


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(phimoe_checkpoints, mechanism: str) -> None:
    folder, ref = phimoe_checkpoints.get()
    changes, edit = OFF[mechanism]
    assert moved(_variant(folder, edit, **changes(load_model(folder).config)), ref) > MATTERS


def _original_length(length: int) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["original_max_position_embeddings"] = raw["rope_parameters"]["original_max_position_embeddings"] = length

    return edit


def _chunked(model: Model, ids: list[int], chunk: int) -> np.ndarray:
    cache = model.new_cache()
    return np.concatenate([model.forward(np.asarray([ids[i : i + chunk]]), cache)[0] for i in range(0, len(ids), chunk)])


def test_a_pass_past_the_original_length_takes_the_long_scale(phimoe_checkpoints, tmp_path: Path) -> None:
    """With ``original_max_position_embeddings`` 10, passes of 5 tokens over the cache: the first two
    (positions up to 10) rotate with ``short_mscale``, the later ones with ``long_mscale``, and the
    cached keys keep the scale they had; transformers run in the same chunks is the reference."""
    folder, ref = phimoe_checkpoints.get()
    short = copy_with_config(folder, tmp_path / "short", _original_length(10))
    ids = ref.sequence_ids
    want = phimoe_checkpoints.oracle.chunked_run(short, ids, 5)
    model = load_model(short, backend="eager")
    assert np.abs(_chunked(model, ids, 5) - want).max() <= TOL
    w = load_weights(short)
    w.config = replace(w.config, rope=replace(w.config.rope, long_mscale=0.0))  # always the short scale
    assert np.abs(_chunked(Model(w, backend="eager"), ids, 5) - want).max() > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw.update(num_experts_per_tok=4), r"num_experts_per_tok=4 is not supported \(PhiMoE's router picks 2\)"),
    (lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda raw: raw["rope_parameters"].update(short_factor=[1.0] * 3), "short_factor has 3 values; head_dim 16 needs 8"),
    (lambda raw: raw["rope_parameters"].update(rope_type="dynamic"), r"rope type 'dynamic' is not supported"),
    (lambda raw: raw.update(num_local_experts=4),
     r"shape \[8, 64\] does not match config.json, which implies \[4, 64\] .*block_sparse_moe\.gate\.weight"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(phimoe_checkpoints, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    bad = copy_with_config(phimoe_checkpoints.get()[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


@pytest.mark.parametrize("name", ["tiny", "phi-3.5-moe"])
def test_plan_counts_the_parameters_transformers_builds(phimoe_checkpoints, name: str) -> None:
    path = phimoe_checkpoints.get()[0] / "config.json" if name == "tiny" else CONFIGS / f"{name}.json"
    raw = json.loads(path.read_text())
    with torch.device("meta"):
        model = PhimoeForCausalLM(PhimoeConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
    size = model_size(raw)
    assert size.total == sum(p.numel() for p in model.parameters())
    assert size.moe_layers == len(model.model.layers)


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """microsoft/Phi-3.5-MoE-instruct's card: 41.9B total, 6.6B active."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "phi-3.5-moe"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "phimoe: 32 layers (0 dense, 32 MoE), 16 experts per MoE layer, top-2" in text
    assert "41.9B total, 6.6B active per token" in text
    assert "model card      41.9B total, 6.6B active (microsoft/Phi-3.5-MoE-instruct)" in text
