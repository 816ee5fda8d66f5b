"""Qwen3-Next (``qwen3_next``) against transformers 5.24: both on-disk layouts, an 80-token prefill
(longer than one 64-token DeltaNet chunk; whole, and in calls of 27 tokens carrying the conv and
delta-rule state), 8 decode steps on the cache, greedy tokens; negative controls: each mechanism
of the family switched off in the engine moves the logits by far more than the tolerance, so the
match is no accident of a mechanism that does nothing on these weights; the published
Qwen3-Next-80B-A3B config at real scale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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

from moeswarm.errors import CheckpointError, ConfigError
from moeswarm.model import (
    ModelConfig,
    SamplingParams,
    Weights,
    load_model,
)
from moeswarm.model._config_qwen3_next import ARCHITECTURES as ARCHITECTURES_QWEN3_NEXT
from moeswarm.model.speculative import generate_speculative

LAYOUTS = ("per_expert", "packed")
TOL = 1e-4
MATTERS = 1e-2  # a mechanism switched off must move some logit by at least 100x the tolerance
SHIPPED = Path(__file__).resolve().parents[2] / "moeswarm" / "model" / "configs" / "qwen3-next-80b-a3b.json"


def test_the_family_is_registered() -> None:
    assert ARCHITECTURES_QWEN3_NEXT == ("qwen3_next",)


@pytest.mark.parametrize("chunk", [None, 27], ids=["one-prefill", "prefill-in-calls-of-27"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_tokens_match_transformers(qwen3_next_checkpoints, layout: str, chunk: int | None) -> None:
    folder, ref = qwen3_next_checkpoints.get(layout)
    assert len(ref.prompt_ids) > 64  # the DeltaNet prefill runs more than one chunk
    model = load_model(folder, backend="eager")
    assert model.config.arch == "qwen3_next"
    assert_matches_transformers(model, ref, chunk, TOL)


def test_the_carried_linear_attention_state_matters(qwen3_next_checkpoints) -> None:
    """The last 26 prompt tokens from an empty cache give other logits than after the first 54."""
    folder, ref = qwen3_next_checkpoints.get("packed")
    model = load_model(folder)
    fresh = model.forward(np.asarray([ref.prompt_ids[54:]]), model.new_cache())[0]
    assert np.abs(fresh - ref.prefill_logits[54:]).max() > 0.1


def _ungrouped_projections(w: Weights) -> None:
    """Read ``in_proj_qkvz`` / ``in_proj_ba`` as Qwen3.5's q | k | v, z and b, a (no per-key-head groups)."""
    dn = w.config.deltanet
    assert dn is not None
    for L in (L for L in range(w.config.num_layers) if dn.layers[L]):
        qkvz, ba = w.tensors.pop(f"{L}.attn.qkvz"), w.tensors.pop(f"{L}.attn.ba")
        w.tensors[f"{L}.attn.qkv"], w.tensors[f"{L}.attn.z"] = qkvz[: dn.conv_dim], qkvz[dn.conv_dim :]
        w.tensors[f"{L}.attn.b"], w.tensors[f"{L}.attn.a"] = ba[: dn.num_v_heads], ba[dn.num_v_heads :]


def _plain_norms(w: Weights) -> None:
    """Scale by ``weight``, not ``1 + weight`` (the zero-centred RMSNorms read as ordinary ones)."""
    for name in [n for n in w.tensors if n.endswith(("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm"))]:
        w.tensors[name] = w.tensors[name] - np.float32(1.0)


OFF: dict[str, tuple[Callable[[ModelConfig], dict[str, Any]], Callable[[Weights], None] | None]] = {
    "qkvz_ba_grouped_per_key_head": (lambda c: {}, _ungrouped_projections),
    "zero_centred_norms": (lambda c: {}, _plain_norms),
    "partial_rotary_factor": (lambda c: dict(rope=replace(c.rope, dim=c.head_dim)), None),
    "shared_expert": (lambda c: dict(shared_intermediate_size=0, shared_expert_gate=False), None),
    "shared_expert_gate": (lambda c: dict(shared_expert_gate=False), None),
    "norm_topk_prob_false": (lambda c: dict(norm_topk_prob=True), None),
}


@pytest.mark.parametrize("mechanism", OFF)
def test_each_mechanism_changes_the_logits(qwen3_next_checkpoints, mechanism: str) -> None:
    folder, ref = qwen3_next_checkpoints.get("packed")
    cfg = load_model(folder).config
    # the configuration really has each mechanism on
    assert cfg.deltanet is not None and cfg.deltanet.layers == (True, False, True)
    assert (cfg.deltanet.num_k_heads, cfg.deltanet.num_v_heads) == (2, 4)  # two value heads per key head
    assert cfg.rope.dim == 8 and cfg.head_dim == 32 and cfg.moe_layers == (True, False, True)
    assert cfg.shared_intermediate_size == 48 and cfg.shared_expert_gate and not cfg.norm_topk_prob
    changes, edit = OFF[mechanism]
    assert moved(_variant(folder, edit, **changes(cfg)), ref) > MATTERS


@pytest.mark.parametrize(("edit", "message"), [
    # the dense layer is where mlp_only_layers says: elsewhere, and the tensors do not fit
    (lambda raw: raw.update(mlp_only_layers=[]), "missing tensor '1.router'"),
    (lambda raw: raw.update(mlp_only_layers=[0, 1]), "missing tensor '0.mlp.gate'"),
    (lambda raw: raw.update(layer_types=["full_attention"] * 3), "missing tensor '0.attn.q'"),
    (lambda raw: raw.update(linear_num_key_heads=3), "linear_num_value_heads must be a multiple"),
    (lambda raw: raw.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
])
def test_a_config_that_does_not_fit_says_what_is_wrong(qwen3_next_checkpoints, tmp_path: Path,
                                                         edit: Callable[[dict[str, Any]], None], message: str) -> None:
    folder, _ = qwen3_next_checkpoints.get("packed")
    bad = copy_with_config(folder, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


def test_hub_config_spelling_gives_the_same_logits(qwen3_next_checkpoints, tmp_path: Path) -> None:
    """The config.json as Qwen publishes it: top-level ``rope_theta`` and ``partial_rotary_factor``,
    ``rope_scaling: null``, ``full_attention_interval`` instead of ``layer_types``."""
    folder, ref = qwen3_next_checkpoints.get("per_expert")

    def hub(raw: dict[str, Any]) -> None:
        rope = raw.pop("rope_parameters")
        del raw["layer_types"]
        raw.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                   rope_scaling=None, full_attention_interval=2)

    model = load_model(copy_with_config(folder, tmp_path / "hub", hub), backend="eager")
    assert replace(model.config, raw={}, model_id="") == replace(load_model(folder).config, raw={}, model_id="")
    prefill, decode = run_engine(model, ref, chunk=27)
    assert np.abs(prefill - ref.prefill_logits).max() <= TOL
    assert np.abs(decode - ref.decode_logits).max() <= TOL


def test_published_config_parses_at_real_scale() -> None:
    """Qwen3-Next-80B-A3B: 48 layers, every 4th full attention, 512 experts top-10 + a shared one."""
    cfg = ModelConfig.from_hf(json.loads(SHIPPED.read_text()))
    assert cfg.arch == "qwen3_next" and cfg.deltanet is not None
    assert (cfg.num_layers, sum(cfg.moe_layers), cfg.num_experts, cfg.top_k) == (48, 48, 512, 10)
    assert sum(cfg.deltanet.layers) == 36 and not cfg.deltanet.layers[3] and cfg.deltanet.layers[4]
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope.dim) == (2048, 16, 2, 256, 64)
    assert (cfg.deltanet.num_k_heads, cfg.deltanet.num_v_heads, cfg.deltanet.k_head_dim) == (16, 32, 128)
    assert cfg.rope.theta == 1e7 and cfg.norm_topk_prob and cfg.shared_intermediate_size == 512
    assert cfg.shared_expert_gate and cfg.eos_token_ids == (151645,)
    # a config.json that says only the model type takes Qwen3NextConfig's defaults: the same model
    assert replace(ModelConfig.from_hf({"model_type": "qwen3_next"}), raw={}, rope=cfg.rope,
                   eos_token_ids=(), bos_token_id=None, max_position_embeddings=0, dense_intermediate_size=0) == \
        replace(cfg, raw={}, eos_token_ids=(), bos_token_id=None, max_position_embeddings=0, dense_intermediate_size=0)


def test_batch_rows_equal_single_rows(qwen3_next_checkpoints) -> None:
    """Three rows at once (the grouped projections re-ordered per row) give each row's own logits."""
    model = load_model(qwen3_next_checkpoints.get("packed")[0])
    batch = np.random.default_rng(3).integers(3, model.config.vocab_size, size=(3, 20))

    def run(rows: np.ndarray) -> np.ndarray:  # a prefill of 17 tokens, then 3 more (the states carried)
        cache = model.new_cache()
        return np.concatenate([model.forward(rows[:, :17], cache), model.forward(rows[:, 17:], cache)], axis=1)

    together = run(batch)
    for b in range(3):
        assert np.abs(together[b] - run(batch[b : b + 1])[0]).max() <= TOL
    assert np.abs(together[0] - together[1]).max() > MATTERS  # the rows differ


def test_speculative_decoding_is_refused(qwen3_next_checkpoints) -> None:
    folder, ref = qwen3_next_checkpoints.get("packed")
    with pytest.raises(ConfigError, match="speculative decoding is not supported"):
        list(generate_speculative(load_model(folder), ref.prompt_ids, SamplingParams(max_new_tokens=8), k=4))


def test_generate_cli_gives_transformers_greedy_tokens(qwen3_next_checkpoints) -> None:
    folder, ref = qwen3_next_checkpoints.get("per_expert")
    expected = list(ref.greedy_tokens)
    if 2 in expected:  # eos (id 2) ends generation
        expected = expected[: expected.index(2) + 1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "moeswarm.cli", "generate", "--model", str(folder), "--prompt-ids",
         json.dumps(ref.prompt_ids), "--max-new-tokens", str(len(ref.greedy_tokens)), "--print-token-ids"],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected
