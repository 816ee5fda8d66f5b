"""Test-side oracle for GLM-4.5 / 4.6 (``glm4_moe``) and GLM-4.7-Flash (``glm4_moe_lite``): tiny
hot-initialised checkpoints built by transformers 5.24 from their configs, and reference logits from
transformers (fp32, eager attention, eager experts).  Test-only (imports torch + transformers);
reuses ``oracle.py``'s prompt, hot init (``reinit_hot``), loader and reference run.

Configs (see ``CONFIGS``), all vocab 512, hidden 64, 4 heads, fp32, chosen so that every mechanism
moves the logits (``tests/glm4/test_glm4_oracle.py`` switches each one off and sees them move):

* ``glm4_moe``: 3 layers, ``first_k_dense_replace=1`` (layer 0 dense, 128 wide), 2 kv heads,
  ``head_dim=32`` (!= hidden / heads), ``partial_rotary_factor=0.25`` (8 of 32 channels turn),
  ``use_qk_norm``, ``attention_bias`` (q/k/v biases; o_proj has none), 16 experts top-4 in
  ``n_group=4`` groups of which ``topk_group=2`` compete, sigmoid router with a hot
  ``e_score_correction_bias``, ``norm_topk_prob``, ``routed_scaling_factor=2.5``, one shared
  expert (32 wide, as the routed ones).
* ``glm4_moe_lite``: 3 layers, ``mlp_layer_types`` sparse, dense, sparse (not the default), MLA
  (q_lora_rank 32, kv_lora_rank 16, qk_nope 16 + qk_rope 8, v_head_dim 16, interleaved rope),
  the same router and shared expert, ``routed_scaling_factor=1.8``.

Layouts: ``per_expert`` is ``save_pretrained`` (the hub names: ``mlp.experts.E.{gate,up,down}_proj``),
``packed`` is ``save_original_format=False`` (transformers' runtime ``gate_up_proj [E, 2I, H]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
from oracle import PROMPT, Reference, _quiet, reference_run  # noqa: F401  (re-exported)
from transformers import Glm4MoeConfig, Glm4MoeLiteConfig

ARCHS = ("glm4_moe", "glm4_moe_lite")
LAYOUTS = ("per_expert", "packed")

_TEXT = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
             num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
             num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True)

CONFIGS: dict[str, Any] = {
    "glm4_moe": lambda: Glm4MoeConfig(
        **_TEXT,
        num_key_value_heads=2,
        head_dim=32,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        attention_bias=True,
        num_mtp_layers=0,
        rope_parameters=dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.25),
    ),
    "glm4_moe_lite": lambda: Glm4MoeLiteConfig(
        **_TEXT,
        num_key_value_heads=4,
        routed_scaling_factor=1.8,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mlp_layer_types=["sparse", "dense", "sparse"],
        rope_parameters=dict(rope_type="default", rope_theta=10_000.0),
    ),
}


def build_model(arch: str, seed: int = 0) -> Any:
    return oracle.build_from_config(CONFIGS[arch], seed)


def build_checkpoint(arch: str, layout: str, out_dir: Path, seed: int = 0) -> Path:
    return oracle.save_in_layout(lambda: build_model(arch, seed), layout, out_dir)
