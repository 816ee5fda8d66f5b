"""Test-side oracle for dots.llm1 (``dots1``), ERNIE 4.5 MoE (``ernie4_5_moe``) and Hunyuan-A13B
(``hunyuan_v1_moe``): tiny hot-initialised
checkpoints built by transformers 5.24 from their configs, and reference logits from transformers (fp32,
eager attention, eager experts).  Test-only (imports torch + transformers); reuses ``oracle.py``'s prompt,
hot init (``reinit_hot``), loader and reference run.

Configs (see ``CONFIGS``), vocab 512, hidden 64, 4 heads (2 kv heads), fp32, chosen so that every
mechanism moves the logits (``tests/families/test_families_oracle.py`` switches each one off and
sees them move):

* ``dots1``: 3 layers, ``first_k_dense_replace=1`` (layer 0 dense, 128 wide), ``head_dim=32``
  (!= hidden / heads), per-head q/k norm, ``attention_bias`` (q/k/v and o), ``sliding_window=6`` on the
  layers from ``max_window_layers=1`` on (the 16-token prompt and 8 decode steps go well past it),
  16 experts top-4 in ``n_group=4`` groups of which ``topk_group=2`` compete, sigmoid router with a hot
  ``e_score_correction_bias``, ``norm_topk_prob`` (off by default, on here), ``routed_scaling_factor=2.5``,
  one shared expert (32 wide).
* ``ernie4_5_moe``: 6 layers, MoE where ``(i + 1) % 2 == 0`` from ``moe_layer_start_index=1`` to
  ``moe_layer_end_index=3`` (layers 1 and 3; layer 5 is dense because of the end index), interleaved
  RoPE, 16 experts top-4 chosen on softmax + a hot ``e_score_correction_bias``, one shared expert,
  tied embeddings (the family's default).
* ``hunyuan_v1_moe``: 2 layers, both MoE, ``head_dim=32``, q/k/v/o biases, per-head q/k norm after RoPE,
  RoPE base stretched by a fixed NTK ``alpha=1000`` (``type: dynamic``, ``factor: 1`` as published), 8 experts (32 wide) top-2 with
  renormalised softmax weights, a shared MLP as wide.

Layouts: ``per_expert`` is ``save_pretrained`` (the hub names), ``packed`` is
``save_original_format=False`` (transformers' runtime ``gate_up_proj [E, 2I, H]``; ERNIE's score bias
under ``mlp.gate.moe_statics``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
from oracle import PROMPT, Reference, _quiet, reference_run  # noqa: F401  (re-exported)
from transformers import Dots1Config, Ernie4_5_MoeConfig, HunYuanMoEV1Config

ARCHS = ("dots1", "ernie4_5_moe", "hunyuan_v1_moe")
LAYOUTS = ("per_expert", "packed")

_TEXT: dict[str, Any] = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
             rope_parameters=dict(rope_type="default", rope_theta=10_000.0))

CONFIGS: dict[str, Any] = {
    "dots1": lambda: Dots1Config(
        **_TEXT,
        num_hidden_layers=3,
        intermediate_size=128,
        moe_intermediate_size=32,
        head_dim=32,
        tie_word_embeddings=False,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        attention_bias=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    "ernie4_5_moe": lambda: Ernie4_5_MoeConfig(
        **_TEXT,
        num_hidden_layers=6,
        intermediate_size=128,
        moe_intermediate_size=32,
        tie_word_embeddings=True,
        moe_num_experts=16,
        moe_k=4,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_end_index=3,
        moe_layer_interval=2,
    ),
    "hunyuan_v1_moe": lambda: HunYuanMoEV1Config(
        **{**_TEXT, "rope_parameters": dict(rope_type="dynamic", alpha=1000.0, factor=1.0, rope_theta=10_000.0)},
        num_hidden_layers=2,
        intermediate_size=32,
        head_dim=32,
        tie_word_embeddings=False,
        attention_bias=True,
        num_experts=8,
        moe_topk=2,
    ),
}


def build_model(arch: str, seed: int = 0) -> Any:
    return oracle.build_from_config(CONFIGS[arch], seed)


def build_checkpoint(arch: str, layout: str, out_dir: Path, seed: int = 0) -> Path:
    return oracle.save_in_layout(lambda: build_model(arch, seed), layout, out_dir)
