"""Kimi Linear (``kimi_linear``) against transformers 5.24: both on-disk layouts, a 16-token prefill
(whole, and in chunks of 5 over the cache and the delta-attention state), 8 decode steps, greedy
tokens, the batched path, the hub's config spellings; negative controls (each mechanism switched off
moves the logits by far more than the tolerance); config errors; plan's count against transformers'."""

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
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from moeswarm.errors import CheckpointError
from moeswarm.model import Weights, load_model
from moeswarm.model import _config_kimi_linear as kimi
from moeswarm.model.attention import Rope
from moeswarm.model.batch import CachePool, Step, forward_batch, layer_specs
from moeswarm.model.plan import model_size

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance
CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"


def test_the_family_is_registered() -> None:
    assert kimi.ARCHITECTURES == ("kimi_linear",)


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_tokens_match_transformers(kimi_linear_checkpoints, layout: str, chunk: int | None) -> None:
    folder, ref = kimi_linear_checkpoints.get(layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == "kimi_linear"
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_batched_path_keeps_each_sequence_its_own_state(kimi_linear_checkpoints) -> None:
    folder, ref = kimi_linear_checkpoints.get()
    model = load_model(folder, backend="eager")
    pool = CachePool(layer_specs(model.config), 4 << 20)  # a model that is not paged books 1 MiB a sequence
    steps = [Step(pool.admit(len(ref.prompt_ids)), list(ref.prompt_ids), all_logits=True),  # type: ignore[arg-type]
             Step(pool.admit(8), list(ref.prompt_ids[:8]), all_logits=True)]  # type: ignore[arg-type]
    forward_batch(model, steps)
    assert np.abs(steps[0].logits - ref.prefill_logits).max() <= TOL
    assert np.abs(steps[1].logits - ref.prefill_logits[:8]).max() <= TOL


def _hub_layer_lists(raw: dict[str, Any]) -> None:
    """The hub's file: no layer_types / mlp_layer_types, 1-based kda_layers / full_attn_layers."""
    types = raw.pop("layer_types")
    raw.pop("mlp_layer_types")
    raw["first_k_dense_replace"] = 1
    raw["linear_attn_config"] = {"head_dim": raw.pop("linear_head_dim"), "num_heads": raw.pop("linear_num_heads"),
                                 "short_conv_kernel_size": raw.pop("linear_conv_kernel_dim"),
                                 "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
                                 "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"]}


def test_the_hub_spellings_read_the_same(kimi_linear_checkpoints, tmp_path: Path) -> None:
    """config.json as transformers writes it already uses the hub's names for experts and groups
    (``num_experts``, ``num_experts_per_token``, ``moe_renormalize``...); the hub's file also keeps the
    layer lists in ``linear_attn_config``."""
    folder, ref = kimi_linear_checkpoints.get()
    assert "num_experts_per_token" in json.loads((folder / "config.json").read_text())
    hub = copy_with_config(folder, tmp_path / "hub", _hub_layer_lists)
    model = load_model(hub, backend="eager")
    assert model.config.family == load_model(folder).config.family
    assert moved(model, ref) <= TOL


def test_the_configuration_has_every_mechanism_on(kimi_linear_checkpoints) -> None:
    c = load_model(kimi_linear_checkpoints.get()[0]).config
    assert c.family == kimi.KimiLinearSettings(linear=(True, False, True), heads=4, head_dim=16, conv_kernel=4)
    assert c.moe_layers == (False, True, True) and c.shared_intermediate_size == 32
    assert (c.router, c.n_group, c.topk_group, c.routed_scaling_factor) == ("sigmoid_group", 2, 1, 2.446)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim) == (None, 16, 8)


def _set(suffix: str, value: Callable[[np.ndarray], np.ndarray]) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        for name in [n for n in w.tensors if n.endswith(suffix)]:
            w.tensors[name] = value(np.asarray(w.tensors[name], np.float32))

    return edit


def _identity_conv(a: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a)
    out[:, -1] = 1.0  # the current input only
    return out


OFF: dict[str, tuple[Callable[[Weights], None] | None, dict[str, Any]]] = {
    "forget_gate_decay": (_set("attn.A", np.zeros_like), {}),  # exp(0 * ...) = 1: no forgetting
    "beta": (_set("attn.b", np.zeros_like), {}),  # sigmoid(0) = 0.5 everywhere
    "causal_convolution": (_set("attn.q_conv", _identity_conv), {}),
    "output_gate": (_set("attn.g_b", np.zeros_like), {}),  # sigmoid(0) = 0.5 everywhere
    "routed_scaling_factor": (None, {"routed_scaling_factor": 1.0}),
    "shared_expert": (None, {"shared_intermediate_size": 0}),
}


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(kimi_linear_checkpoints, mechanism: str) -> None:
    folder, ref = kimi_linear_checkpoints.get()
    edit, changes = OFF[mechanism]
    assert moved(_variant(folder, edit, **changes), ref) > MATTERS


def test_the_full_attention_layers_have_no_rope(kimi_linear_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, ref = kimi_linear_checkpoints.get()
    model = load_model(folder, backend="eager")
    monkeypatch.setattr(kimi, "_NOPE", Rope(model.config))  # rotate the shared key slice, theta 1e4
    assert moved(model, ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw.update(attention_bias=True), "attention_bias is not supported"),
    (lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda raw: raw.update(linear_num_heads=2),
     r"shape \[64, 64\] does not match config.json, which implies \[32, 64\] .*layers\.0\.self_attn\.q_proj"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(kimi_linear_checkpoints, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    bad = copy_with_config(kimi_linear_checkpoints.get()[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-48b-a3b"])
def test_plan_counts_the_parameters_transformers_builds(kimi_linear_checkpoints, name: str) -> None:
    path = kimi_linear_checkpoints.get()[0] / "config.json" if name == "tiny" else CONFIGS / f"{name}.json"
    raw = json.loads(path.read_text())
    with torch.device("meta"):
        model = KimiLinearForCausalLM(KimiLinearConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
    size = model_size(raw)
    assert size.total == sum(p.numel() for p in model.parameters())
    assert size.moe_layers == len(model.model.layers) - 1


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """moonshotai/Kimi-Linear-48B-A3B-Instruct: 48B total, 3B active (the name says so)."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "kimi-linear-48b-a3b"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "kimi_linear: 27 layers (1 dense, 26 MoE), 256 experts per MoE layer, top-8" in text
    assert "49.1B total, 3.5B active per token (2.7B without embeddings and LM head)" in text
    assert "model card      48B total, 3B active (moonshotai/Kimi-Linear-48B-A3B-Instruct)" in text
