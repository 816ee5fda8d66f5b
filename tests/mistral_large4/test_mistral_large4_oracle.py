"""Mistral Large 4 (``mistral_large4``) against transformers 5.24, in both checkpoint layouts: a 16-token
prefill (whole, and in chunks of 5 over the cache), 8 decode steps on the cache, greedy tokens; negative
controls (each mechanism switched off in the engine moves the logits by far more than the tolerance);
config errors; the vision tower's tensors left unread.  The checkpoint: ``tests/oracle_mistral_large4.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_support import assert_matches_transformers, copy_with_config, moved
from engine_support import variant as _variant

from moeswarm.errors import CheckpointError
from moeswarm.model import (
    ModelConfig,
    Weights,
    _attn_ml4,
    load_model,
    load_weights,
)
from moeswarm.model._config_mistral_large4 import ARCHITECTURES
from moeswarm.model._safetensors import open_folder
from moeswarm.model.convert import convert
from moeswarm.model.transformer import ATTENTION_KINDS

TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance


def test_the_family_is_registered() -> None:
    assert ARCHITECTURES == ("mistral_large4", "mistral_large4_text")


@pytest.mark.parametrize("layout", ["packed", "native"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["one-prefill", "prefill-in-chunks-of-5"])
def test_logits_and_greedy_tokens_match_transformers(ml4_checkpoints, layout: str, chunk: int | None) -> None:
    folder, ref = ml4_checkpoints.get(layout)
    model = load_model(folder, backend="eager")
    assert model.config.arch == "mistral_large4"
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_configuration_has_every_mechanism_on(ml4_checkpoints) -> None:
    folder, ref = ml4_checkpoints.get("packed")
    w = load_weights(folder)
    c = w.config
    assert c.attention == "mistral_large4" and c.q_lora_rank is None and c.rope.interleaved
    assert c.family.rope_layers == (True, True, False, False) and c.family.kv_source == (0, 0, 2, 2)
    assert c.dsa is not None and c.dsa.shared == (False, True, False, False)
    assert c.dsa.topk == 6 < len(ref.prompt_ids) and c.dsa.n_heads == 16
    assert "1.attn.kv_a" not in w.tensors and "3.attn.kv_a" not in w.tensors and "1.attn.idx_q_b" not in w.tensors
    assert w["2.attn.kv_a"].shape == (16, 64) and w["0.attn.kv_a"].shape == (24, 64)  # NoPE: no rotary part
    assert np.abs(w["rope_alpha"]).min() > 0 and c.rope.kind == "yarn" and c.rope.attention_factor == 1.0
    assert np.abs(w["0.attn.ssmax_s"]).min() > 0 and np.abs(w["0.attn.idx_ssmax_s"]).min() > 0
    assert c.final_logit_softcapping == 3.0 and np.abs(ref.prefill_logits).max() > 1.5  # tanh bends there
    assert c.moe_layers == (False, True, True, True) and c.router == "softmax_group" and c.norm_topk_prob
    assert (c.num_experts, c.top_k, c.n_group, c.topk_group, c.routed_scaling_factor) == (16, 4, 4, 2, 2.5)


def _copy_from(pairs: dict[str, str]) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        for dst, src in pairs.items():
            w.tensors[dst] = w.tensors[src]
    return edit


def _ssmax_off(prefix: str) -> Callable[[Weights], None]:
    def edit(w: Weights) -> None:
        for L in range(w.config.num_layers):
            if f"{L}.attn.{prefix}ssmax_s" in w.tensors:
                w.tensors[f"{L}.attn.{prefix}ssmax_s"] = np.zeros_like(w.tensors[f"{L}.attn.{prefix}ssmax_s"])
                w.tensors[f"{L}.attn.{prefix}ssmax_b"] = np.ones_like(w.tensors[f"{L}.attn.{prefix}ssmax_b"])
    return edit


# each: (config changes, weight edit) that switch one mechanism off in the engine
OFF: dict[str, Callable[[ModelConfig], tuple[dict[str, Any], Callable[[Weights], None] | None]]] = {
    # a layer that reads another's latent KV computes its own from the source's kv_a on its own input
    "kv_source_layers": lambda c: (dict(family=replace(c.family, kv_source=(0, 1, 2, 3))), _copy_from({
        "1.attn.kv_a": "0.attn.kv_a", "1.attn.kv_a_norm": "0.attn.kv_a_norm",
        "3.attn.kv_a": "2.attn.kv_a", "3.attn.kv_a_norm": "2.attn.kv_a_norm"})),
    # the shared indexer layer runs layer 0's indexer on its own input
    "shared_indexer": lambda c: (dict(dsa=replace(c.dsa, shared=(False,) * 4)), _copy_from({
        f"1.attn.{n}": f"0.attn.{n}" for n in ("idx_q_norm", "idx_q_norm_bias", "idx_q_b", "idx_k", "idx_k_norm",
                                               "idx_k_norm_bias", "idx_w", "idx_ssmax_s", "idx_ssmax_b")})),
    "index_topk": lambda c: (dict(dsa=replace(c.dsa, topk=1000)), None),
    "lerope_alpha": lambda c: ({}, lambda w: w.tensors.pop("rope_alpha")),
    "yarn": lambda c: (dict(rope=replace(c.rope, kind="default")), None),
    "interleaved_rope": lambda c: (dict(rope=replace(c.rope, interleaved=False)), None),
    "ssmax_attention": lambda c: ({}, _ssmax_off("")),
    "ssmax_indexer": lambda c: ({}, _ssmax_off("idx_")),
    "final_logit_softcapping": lambda c: (dict(final_logit_softcapping=0.0), None),
    "softmax_scores": lambda c: (dict(router="sigmoid_group"), None),
    "n_group_topk_group": lambda c: (dict(n_group=1, topk_group=1), None),
    "routed_scaling_factor": lambda c: (dict(routed_scaling_factor=1.0), None),
    "shared_experts": lambda c: (dict(shared_intermediate_size=0), None),
}


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(ml4_checkpoints, mechanism: str) -> None:
    folder, ref = ml4_checkpoints.get("packed")
    changes, edit = OFF[mechanism](load_weights(folder).config)
    assert moved(_variant(folder, edit, **changes), ref) > MATTERS


def test_nope_layers_change_the_logits(ml4_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """NoPE switched off: layers 2 and 3 rotate the last qk_rope_head_dim dims of their attention queries
    and keys, and the first of their indexer's, as a RoPE layer does (a RoPE layer's kv_a and kv_b have
    other shapes, so no config change does this on these weights:
    ``test_a_config_that_does_not_fit_says_what_is_wrong``).  Each half alone moves the logits."""
    folder, ref = ml4_checkpoints.get("packed")
    model = load_model(folder, backend="eager")
    assert moved(model, ref) <= TOL
    rd, nope_layers, now = model.config.qk_rope_head_dim, (2, 3), {}
    attention, attend, indexer = _attn_ml4.ml4_attention, _attn_ml4._attend, _attn_ml4._indexer_keep

    def layer_noted(w, x, cfg, rope, cache, positions, layer, step):  # type: ignore[no-untyped-def]
        now["layer"] = layer
        return attention(w, x, cfg, rope, cache, positions, layer, step)

    def attend_rotated(q, k, v, past, *rest):  # type: ignore[no-untyped-def]
        if now["layer"] in nope_layers:
            T, S = q.shape[2], k.shape[2]
            qc, qs = model.rope.tables(np.arange(past, past + T))
            kc, ks = model.rope.tables(np.arange(S))
            q = np.concatenate([q[..., :-rd], model.rope.apply(q[..., -rd:], qc, qs)], axis=-1)
            k = np.concatenate([k[..., :-rd], model.rope.apply(k[..., -rd:], kc, ks)], axis=-1)
        return attend(q, k, v, past, *rest)

    def indexer_rotated(w, x, cfg, cos, sin, cache, positions):  # type: ignore[no-untyped-def]
        return indexer(w, x, cfg, *model.rope.tables(positions), cache, positions)

    monkeypatch.setitem(ATTENTION_KINDS, "mistral_large4", layer_noted)
    monkeypatch.setattr(_attn_ml4, "_attend", attend_rotated)
    assert moved(model, ref) > MATTERS
    monkeypatch.setattr(_attn_ml4, "_attend", attend)
    monkeypatch.setattr(_attn_ml4, "_indexer_keep", indexer_rotated)
    assert moved(model, ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw["text_config"].update(no_rope_layers=[1, 1, 1, 1]),
     "shape [128, 16] does not match config.json, which implies [96, 16]"),  # layer 2's kv_b
    (lambda raw: raw["text_config"].update(kv_source_layers=[0, 1, 2, 3]), "missing tensor '1.attn.kv_a'"),
    (lambda raw: raw["text_config"].update(kv_source_layers=[0, 0, 0, 2]),
     "layer 2 reads layer 0's KV, but transformers hands it the latest NoPE sharing layer's"),
    (lambda raw: raw["text_config"].update(kv_source_layers=[0, 0, 1, 2]),
     "layer 2 must share KV with an earlier layer that owns its cache, got 1"),
    (lambda raw: raw["text_config"].update(indexer_types=["full", "full", "full", "full"]),
     "missing tensor '1.attn.idx_q_norm'"),
    (lambda raw: raw["text_config"].update(n_group=3), "n_group=3 must divide n_routed_experts=16"),
    (lambda raw: raw["text_config"].update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(ml4_checkpoints, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    bad = copy_with_config(ml4_checkpoints.get("packed")[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(bad)


def test_the_vision_tower_is_not_read(ml4_checkpoints) -> None:
    """The native checkpoint carries the Pixtral tower and projector (``vision_encoder.*``, ...): no rule
    claims them, so their bytes are never mapped into the model; everything else is claimed."""
    folder, _ = ml4_checkpoints.get("native")
    cfg = load_weights(folder).config
    conv = convert(cfg.arch, open_folder(folder), num_layers=cfg.num_layers, num_experts=cfg.num_experts)
    assert conv.unmatched and all(k.startswith(("vision_encoder.", "patch_merger.", "pre_mm_projector_norm.",
                                                "vision_language_adapter.")) for k in conv.unmatched)


def test_the_text_config_alone_is_read_too(ml4_checkpoints) -> None:
    raw = load_weights(ml4_checkpoints.get("packed")[0]).config.raw
    assert ModelConfig.from_hf({**raw, "model_type": "mistral_large4_text"}).family.kv_source == (0, 0, 2, 2)
