"""Test-side oracle for MiMo-V2-Flash (``mimo_v2_flash``): a tiny hot-initialised checkpoint built by
transformers 5.24 and reference logits from transformers (fp32, eager attention and experts).
Test-only; reuses ``oracle.py``'s prompt, hot init, loader and reference run.

The config (``CONFIG``): vocab 512, hidden 64, 4 heads of 24 (values 16 wide), 1 kv head on full
layers and 2 on sliding ones, 4 layers (``layer_types`` full, sliding, sliding, full; layer 0 dense
48 wide, the rest MoE: 8 experts 32 wide, top-2, sigmoid scores with the correction bias, 2 groups
of which 1 competes, ``routed_scaling_factor`` 1.5), ``sliding_window`` 5 (shorter than the 16-token
prompt), ``attention_value_scale`` 0.6, partial rotary 0.334 (8 of 24 channels) with theta 1e6 on full
layers and 1e4 on sliding ones.  Sinks get ``oracle.reinit_hot``'s N(0, 1).

Layouts: ``per_expert`` is ``save_pretrained`` (``mlp.experts.E.{gate,up,down}_proj``), ``packed`` is
``save_original_format=False`` (``mlp.experts.gate_up_proj`` / ``down_proj``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oracle
from oracle import PROMPT, Reference, _quiet, load_model, reference_run  # noqa: F401  (re-exported)
from transformers import MiMoV2FlashConfig

LAYOUTS = ("per_expert", "packed")


def CONFIG() -> MiMoV2FlashConfig:  # noqa: N802 - a config factory, as oracle_families.CONFIGS
    return MiMoV2FlashConfig(
        vocab_size=512, hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5, max_position_embeddings=256,
        rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        head_dim=24, v_head_dim=16, sliding_window=5, attention_value_scale=0.6,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
        },
    )


def build_model(seed: int = 0) -> Any:
    return oracle.build_from_config(CONFIG, seed)


def build_checkpoint(layout: str, out_dir: Path, seed: int = 0) -> Path:
    return oracle.save_in_layout(lambda: build_model(seed), layout, out_dir)
