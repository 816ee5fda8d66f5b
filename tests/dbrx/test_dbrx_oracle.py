"""DBRX (``dbrx``) against transformers 5.24: a 16-token prefill (whole, and in chunks of 5 over the
cache), 8 decode steps, greedy tokens, the batched path; negative controls; config errors; plan's count
against transformers' for the tiny config and the shipped published one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from engine_support import assert_matches_transformers, copy_with_config, moved
from engine_support import variant as _variant
from transformers import DbrxConfig, DbrxForCausalLM

from moeswarm.errors import CheckpointError
from moeswarm.model import ModelConfig, load_model
from moeswarm.model.batch import CachePool, Step, forward_batch, layer_specs
from moeswarm.model.plan import model_size

TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance
CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
def test_logits_and_greedy_tokens_match_transformers(dbrx_checkpoint, chunk: int | None) -> None:
    folder, ref = dbrx_checkpoint.get()
    model = load_model(folder, backend="eager")
    c = model.config
    assert c.arch == "dbrx" and c.norm == "layer" and c.clip_qkv == 0.5 and (c.num_experts, c.top_k) == (8, 2)
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_batched_path_uses_layernorm_too(dbrx_checkpoint) -> None:
    folder, ref = dbrx_checkpoint.get()
    model = load_model(folder, backend="eager")
    pool = CachePool(layer_specs(model.config), 1 << 20)
    steps = [Step(pool.admit(len(ref.prompt_ids)), list(ref.prompt_ids), all_logits=True),  # type: ignore[arg-type]
             Step(pool.admit(6), list(ref.prompt_ids[:6]), all_logits=True)]  # type: ignore[arg-type]
    forward_batch(model, steps)
    assert np.abs(steps[0].logits - ref.prefill_logits).max() <= TOL
    assert np.abs(steps[1].logits - ref.prefill_logits[:6]).max() <= TOL


OFF: dict[str, Callable[[ModelConfig], dict[str, Any]]] = {
    "layernorm": lambda c: dict(norm="rms"),  # RMSNorm instead: the mean is not removed
    "clip_qkv": lambda c: dict(clip_qkv=None),
    "renormalised_top_k": lambda c: dict(norm_topk_prob=False),
}


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(dbrx_checkpoint, mechanism: str) -> None:
    folder, ref = dbrx_checkpoint.get()
    assert moved(_variant(folder, **OFF[mechanism](load_model(folder).config)), ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw["ffn_config"].update(moe_normalize_expert_weights=2.0),
     r"moe_normalize_expert_weights=2.0 is not supported \(1\)"),
    (lambda raw: raw["ffn_config"].update(ffn_act_fn={"name": "gelu"}), "ffn_act_fn 'gelu' is not supported"),
    (lambda raw: raw["attn_config"].update(kv_n_heads=1),
     r"shape \[32, 64\] does not match config.json, which implies \[16, 64\]"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(dbrx_checkpoint, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    bad = copy_with_config(dbrx_checkpoint.get()[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


@pytest.mark.parametrize("name", ["tiny", "dbrx"])
def test_plan_counts_the_parameters_transformers_builds(dbrx_checkpoint, name: str) -> None:
    path = dbrx_checkpoint.get()[0] / "config.json" if name == "tiny" else CONFIGS / "dbrx.json"
    raw = json.loads(path.read_text())
    with torch.device("meta"):
        model = DbrxForCausalLM(DbrxConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
    size = model_size(raw)
    assert size.total == sum(p.numel() for p in model.parameters())
    assert size.moe_layers == len(model.transformer.blocks)


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """databricks/dbrx-instruct's card: 132B total, 36B active."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "dbrx"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "dbrx: 40 layers (0 dense, 40 MoE), 16 experts per MoE layer, top-4" in text
    assert "131.6B total, 36.5B active per token" in text
    assert "model card      132B total, 36B active (databricks/dbrx-instruct)" in text
