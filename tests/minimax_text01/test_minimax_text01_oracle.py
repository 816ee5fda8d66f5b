"""MiniMax-Text-01 (``minimax``) against transformers 5.24: both on-disk layouts, a 16-token prefill
(whole, and in chunks of 5 over the caches and lightning states), 8 decode steps, greedy tokens, the
batched path; negative controls (each mechanism
switched off moves the logits by far more than the tolerance); config errors; plan's count against
transformers'."""

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
from transformers import MiniMaxConfig, MiniMaxForCausalLM

from moeswarm.errors import CheckpointError
from moeswarm.model import Weights, load_model
from moeswarm.model import _config_minimax_text01 as text01
from moeswarm.model._config_minimax_text01 import ARCHITECTURES, MiniMaxSettings
from moeswarm.model.batch import CachePool, Step, forward_batch, layer_specs
from moeswarm.model.plan import model_size

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance
CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"


def test_the_family_is_registered() -> None:
    assert ARCHITECTURES == ("minimax",)


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_tokens_match_transformers(minimax_checkpoints, layout: str, chunk: int | None) -> None:
    folder, ref = minimax_checkpoints.get(layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == "minimax"
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_batched_path_keeps_each_sequence_its_own_state(minimax_checkpoints) -> None:
    folder, ref = minimax_checkpoints.get()
    model = load_model(folder, backend="eager")
    pool = CachePool(layer_specs(model.config), 4 << 20)  # a model that is not paged books 1 MiB a sequence
    steps = [Step(pool.admit(len(ref.prompt_ids)), list(ref.prompt_ids), all_logits=True),  # type: ignore[arg-type]
             Step(pool.admit(8), list(ref.prompt_ids[:8]), all_logits=True)]  # type: ignore[arg-type]
    forward_batch(model, steps)
    assert np.abs(steps[0].logits - ref.prefill_logits).max() <= TOL
    assert np.abs(steps[1].logits - ref.prefill_logits[:8]).max() <= TOL


def _drop(*suffixes: str) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        for name in [n for n in w.tensors if n.endswith(suffixes)]:
            del w.tensors[name]

    return edit


def test_the_configuration_has_every_mechanism_on(minimax_checkpoints) -> None:
    c = load_model(minimax_checkpoints.get()[0]).config
    assert c.family == MiniMaxSettings(linear=(False, True, False, True), full_attn=(1.7, 0.8),
                                       linear_attn=(1.3, 0.9), mlp=(1.5, 0.7))
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_experts, c.top_k) == (4, 2, 16, 8, 2)


def _settings(**changes: Any) -> Callable[[Any], dict[str, Any]]:
    return lambda c: dict(family=replace(c.family, **changes))


def _scaled(suffix: str, factor: float) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        for name in [n for n in w.tensors if n.endswith(suffix)]:
            w.tensors[name] = np.asarray(w.tensors[name], np.float32) * np.float32(factor)

    return edit


OFF: dict[str, tuple[Callable[[Any], dict[str, Any]], Callable[[Weights], None] | None]] = {
    "lightning_output_gate": (lambda c: {}, _scaled("attn.gate", 0.0)),  # sigmoid(0) = 0.5 everywhere
    "full_attn_factors": (_settings(full_attn=(1.0, 1.0)), None),
    "linear_attn_factors": (_settings(linear_attn=(1.0, 1.0)), None),
    "mlp_factors": (_settings(mlp=(1.0, 1.0)), None),
}


def test_the_lightning_decay_matters(minimax_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, ref = minimax_checkpoints.get()
    computed = text01._decay
    monkeypatch.setattr(text01, "_decay", lambda cfg, layer: computed(cfg, layer) ** 4)  # four times the rate
    assert moved(load_model(folder, backend="eager"), ref) > MATTERS


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(minimax_checkpoints, mechanism: str) -> None:
    folder, ref = minimax_checkpoints.get()
    changes, edit = OFF[mechanism]
    assert moved(_variant(folder, edit, **changes(load_model(folder).config)), ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda raw: raw.update(layer_types=["full_attention"] * 4), "missing tensor '1.attn.q' required by config.json"),
    (lambda raw: raw.update(num_local_experts=4),
     r"shape \[8, 64\] does not match config.json, which implies \[4, 64\] .*block_sparse_moe\.gate\.weight"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(minimax_checkpoints, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    bad = copy_with_config(minimax_checkpoints.get()[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


@pytest.mark.parametrize("name", ["tiny", "minimax-text-01"])
def test_plan_counts_the_parameters_transformers_builds(minimax_checkpoints, name: str) -> None:
    path = minimax_checkpoints.get()[0] / "config.json" if name == "tiny" else CONFIGS / f"{name}.json"
    raw = json.loads(path.read_text())
    with torch.device("meta"):
        model = MiniMaxForCausalLM(MiniMaxConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
    size = model_size(raw)
    assert size.total == sum(p.numel() for p in model.parameters())
    assert size.moe_layers == len(model.model.layers)


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """MiniMaxAI/MiniMax-Text-01's card: 456B total, 45.9B active."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "minimax-text-01"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "minimax: 80 layers (0 dense, 80 MoE), 32 experts per MoE layer, top-2" in text
    assert "456.1B total, 48.4B active per token (45.9B without embeddings and LM head)" in text
    assert "model card      456B total, 45.9B active (MiniMaxAI/MiniMax-Text-01)" in text
