"""LongCat-Flash (``longcat_flash``) against transformers 5.24: both on-disk layouts, a 16-token prefill
(whole, and in chunks of 5 over the cache), 8 decode steps on the cache, greedy tokens, the batched
path; the zero-computation experts never reach the expert executor; negative controls (each mechanism
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
from engine_support import (
    assert_matches_transformers,
    copy_with_config,
    moved,
    run_engine,
)
from engine_support import variant as _variant
from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

from moeswarm.errors import CheckpointError
from moeswarm.model import LocalExperts, Model, Weights, load_model, load_weights
from moeswarm.model._config_longcat import ARCHITECTURES, LongcatLayer, SublayerCaches
from moeswarm.model.attention import mla, rms_norm
from moeswarm.model.batch import CachePool, Step, forward_batch, layer_specs
from moeswarm.model.experts import dense_ffn
from moeswarm.model.plan import model_size
from moeswarm.model.transformer import DECODER_LAYERS

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance
CONFIGS = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs"


def test_the_family_is_registered() -> None:
    assert ARCHITECTURES == ("longcat_flash",)


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_tokens_match_transformers(longcat_checkpoints, layout: str, chunk: int | None) -> None:
    folder, ref = longcat_checkpoints.get(layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == "longcat_flash"
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_batched_path_steps_each_sequence_through_both_sublayers(longcat_checkpoints) -> None:
    """``forward_batch`` on a model that is not paged: each sequence keeps its layers' own
    (two-sublayer) caches; two sequences, the reference prompt and a shorter one."""
    folder, ref = longcat_checkpoints.get()
    model = load_model(folder, backend="eager")
    pool = CachePool(layer_specs(model.config), 4 << 20)  # a model that is not paged books 1 MiB a sequence
    steps = [Step(pool.admit(len(ref.prompt_ids)), list(ref.prompt_ids), all_logits=True),  # type: ignore[arg-type]
             Step(pool.admit(8), list(ref.prompt_ids[:8]), all_logits=True)]  # type: ignore[arg-type]
    forward_batch(model, steps)
    assert np.abs(steps[0].logits - ref.prefill_logits).max() <= TOL
    assert np.abs(steps[1].logits - ref.prefill_logits[:8]).max() <= TOL


class _Recording(LocalExperts):
    """Local experts that remember every expert id they were asked for."""

    asked: list[np.ndarray]

    def submit(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> Any:
        self.asked.append(np.asarray(ids).copy())
        return super().submit(layer, x, ids, weights)


def test_zero_computation_experts_are_chosen_and_never_sent(longcat_checkpoints) -> None:
    """transformers itself routes a share of the choices to zero-computation experts; the engine
    computes those where it routes, so the executor (a swarm's nodes) only ever sees routed ones."""
    folder, ref = longcat_checkpoints.get()
    share = longcat_checkpoints.oracle.zero_share(folder)
    assert 0.05 < share < 0.5
    w = load_weights(folder)
    experts = _Recording(w.experts, w.config, "eager")
    experts.asked = []
    prefill, decode = run_engine(Model(w, experts), ref)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    asked = np.concatenate([a.reshape(-1) for a in experts.asked])
    assert asked.max() < w.config.num_experts == 8 and w.config.zero_experts == 4
    assert len(asked) < (len(ref.prompt_ids) + len(ref.decode_tokens)) * 3 * 2  # fewer than every choice


def test_the_configuration_has_every_mechanism_on(longcat_checkpoints) -> None:
    c = load_model(longcat_checkpoints.get()[0]).config
    assert (c.num_experts, c.zero_experts, c.top_k, c.routed_scaling_factor) == (8, 4, 3, 2.5)
    assert (c.router, c.choice_bias, c.norm_topk_prob) == ("softmax_topk", True, False)
    assert c.mla_lora_scale == pytest.approx((2**0.5, 2.0))  # sqrt(64 / 32), sqrt(64 / 16)
    assert (c.q_lora_rank, c.kv_lora_rank, c.rope.interleaved) == (32, 16, True)


class _ShortcutAfterTheFirstSublayer(LongcatLayer):
    """The MoE output added right after the first sublayer's MLP (so the second attention sees it)."""

    def __call__(self, model: Model, L: int, x: np.ndarray, cache: object, positions: np.ndarray,
                 observe: bool) -> np.ndarray:
        cfg, w = model.config, model.weights
        assert isinstance(cache, SublayerCaches)
        B, T, H = x.shape
        for i in (0, 1):
            attn = {k[2:]: a for k, a in model._attn[L].items() if k.startswith(f"{i}.")}
            h = rms_norm(x, w[f"{L}.attn_norm{i}"], cfg.rms_norm_eps)
            x = x + mla(attn, h, cfg, model.rope, cache.parts[i], positions)  # type: ignore[arg-type]
            h = rms_norm(x, w[f"{L}.mlp_norm{i}"], cfg.rms_norm_eps).reshape(B * T, H)
            out = dense_ffn(w[f"{L}.mlp{i}.gate"], w[f"{L}.mlp{i}.up"], w[f"{L}.mlp{i}.down"], h)
            if i == 0:
                out = out + model._mlp(L, h, observe=observe)
            x = x + out.reshape(B, T, H)
        return x


def _without_zero_experts(w: Weights) -> None:
    """Router rows and correction biases of the routed experts only (no zero-computation ones)."""
    E = w.config.num_experts
    for L in range(w.config.num_layers):
        w.tensors[f"{L}.router"] = w.tensors[f"{L}.router"][:E]
        w.tensors[f"{L}.router_score_bias"] = w.tensors[f"{L}.router_score_bias"][:E]
    w.config = replace(w.config, zero_experts=0)


def _identity_returns_nothing(model: Model) -> Model:
    chosen = model._submit_with_zero_experts
    E = model.config.num_experts
    model._submit_with_zero_experts = lambda L, h, ids, weights, observe: chosen(  # type: ignore[method-assign]
        L, h, ids, np.where(ids < E, weights, np.float32(0)), observe)
    return model


OFF: dict[str, Callable[[Path], Model]] = {
    "zero_experts": lambda f: _variant(f, _without_zero_experts),
    "zero_experts_return_their_input": lambda f: _identity_returns_nothing(_variant(f)),
    "mla_lora_scale": lambda f: _variant(f, mla_lora_scale=None),
    "routed_scaling_factor": lambda f: _variant(f, routed_scaling_factor=1.0),
    "e_score_correction_bias": lambda f: _variant(f, choice_bias=False),
    "interleaved_rope": lambda f: _variant(f, rope=replace(load_model(f).config.rope, interleaved=False)),
}


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(longcat_checkpoints, mechanism: str) -> None:
    folder, ref = longcat_checkpoints.get()
    assert moved(OFF[mechanism](folder), ref) > MATTERS


def test_the_shortcut_joins_after_the_second_sublayer(longcat_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, ref = longcat_checkpoints.get()
    monkeypatch.setitem(DECODER_LAYERS, "longcat_flash", _ShortcutAfterTheFirstSublayer())
    assert moved(load_model(folder, backend="eager"), ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw.update(attention_bias=True), "attention_bias is not supported"),
    (lambda raw: raw.update(head_dim=16), "head_dim 16 must equal qk_rope_head_dim 8"),
    (lambda raw: raw.update(zero_expert_num=2),
     r"shape \[12, 64\] does not match config.json, which implies \[10, 64\] .*router\.classifier\.weight"),
    (lambda raw: raw["rope_parameters"].update(rope_type="yarn"), r"rope type 'yarn' is not supported"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(longcat_checkpoints, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    bad = copy_with_config(longcat_checkpoints.get()[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


@pytest.mark.parametrize("name", ["tiny", "longcat-flash-chat"])
def test_plan_counts_the_parameters_transformers_builds(longcat_checkpoints, name: str) -> None:
    """transformers allocates gate/up rows for the zero-computation experts in its packed
    ``gate_up_proj`` (never read, not in the hub's checkpoint): plan counts without them."""
    path = longcat_checkpoints.get()[0] / "config.json" if name == "tiny" else CONFIGS / f"{name}.json"
    raw = json.loads(path.read_text())
    with torch.device("meta"):
        model = LongcatFlashForCausalLM(LongcatFlashConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
    c = model.config
    unread = c.num_layers * c.zero_expert_num * 2 * c.expert_ffn_hidden_size * c.hidden_size
    size = model_size(raw)
    assert size.total == sum(p.numel() for p in model.parameters()) - unread
    assert (size.moe_layers, size.num_experts) == (len(model.model.layers), c.n_routed_experts)


def test_plan_prints_the_model_card_beside_the_count() -> None:
    """meituan-longcat/LongCat-Flash-Chat's card: 560B total, 18.6B-31.3B active (zero-computation
    experts make it vary); plan's active count takes every choice as a routed expert (its upper end)."""
    text = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--model", "longcat-flash-chat"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "longcat_flash: 28 layers (0 dense, 28 MoE), 512 experts per MoE layer, top-12" in text
    assert "560.7B total, 32.2B active per token (30.6B without embeddings and LM head)" in text
    assert "model card      560B total, 18.6B-31.3B active (meituan-longcat/LongCat-Flash-Chat)" in text
